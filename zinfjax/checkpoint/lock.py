"""One run per checkpoint directory: an exclusive `flock` on `.zinfjax-lock`, holding the pid.

Two runs saving into one directory break each other's orbax steps (a half-made
step folder of one is deleted or read by the other). The lock is taken when a
writing `Checkpointer` is made, so an unwritable directory or one in use is
reported before any compute; the kernel drops it when the process ends, so a
killed run never leaves it stale. Checkpointers of one process share it.
"""

from __future__ import annotations

import errno
import fcntl
import os
import threading

from .errors import CheckpointError

NAME = ".zinfjax-lock"
_held: dict[str, list[int]] = {}  # directory -> [fd, users]
_mu = threading.Lock()


def _unwritable(directory: str, e: OSError) -> CheckpointError:
  return CheckpointError(f"cannot write to checkpoint directory {directory}: {e.strerror or e}. "
                         "Choose a writable directory (checked before training, so no step is lost).")


def make(directory: str) -> None:
  """Make `directory` if missing, or raise a CheckpointError saying why it cannot be."""
  try:
    os.makedirs(directory, exist_ok=True)
  except OSError as e:
    raise _unwritable(directory, e) from e


def acquire(directory: str) -> None:
  """Lock `directory` (made if missing) for this process, or raise a CheckpointError naming
  the pid that holds it, or why the directory cannot be written."""
  with _mu:
    if directory in _held:
      _held[directory][1] += 1
      return
    make(directory)
    try:
      fd = os.open(os.path.join(directory, NAME), os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:
      raise _unwritable(directory, e) from e
    try:
      fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
      owner = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
      os.close(fd)
      if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
        raise CheckpointError(f"cannot lock checkpoint directory {directory}: {e.strerror}.") from e
      raise CheckpointError(
          f"checkpoint directory {directory} is in use by another run (pid {owner}). Wait for it "
          "to finish, or give this run another directory.") from None
    try:
      os.ftruncate(fd, 0)
      os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    except OSError as e:
      os.close(fd)
      raise CheckpointError(f"cannot write to checkpoint directory {directory}: {e.strerror}. "
                            "Free space or choose another directory.") from e
    _held[directory] = [fd, 1]


def release(directory: str) -> None:
  """Give back one use of this process's lock on `directory` (the last one unlocks it)."""
  with _mu:
    held = _held.get(directory)
    if held is None:
      return
    held[1] -= 1
    if held[1] == 0:
      os.close(held[0])  # closing the descriptor drops the flock
      del _held[directory]
