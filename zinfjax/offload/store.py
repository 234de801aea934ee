"""Swap stores for the NVMe tier: the C++ aio engine (fast path; tensorstore's in `kvstore`).

Both implement one interface, `SwapStore`: `write(key, array) -> Ticket`,
`read(key, out=None) -> Ticket`, `ticket.wait()`, `sync()`, `keys()`,
`close()`. Each rank keeps its own folder `path/rank{r}/`; reads are checked
against a manifest (dtype, shape, checksum), and every failure raises one of
the engine's error types with a message that says what to do.
"""

from __future__ import annotations

import functools
import os
from typing import Any, Callable, Protocol, Sequence

import ml_dtypes
import numpy as np

from .. import _engine
from .aligned import aligned_empty
from .probe import fastest_backend

EngineError = _engine.EngineError
NoSpaceError = _engine.NoSpaceError
CorruptShardError = _engine.CorruptShardError
MissingShardError = _engine.MissingShardError
ShardMismatchError = _engine.ShardMismatchError
StoreLockedError = _engine.StoreLockedError
PoolExhaustedError = _engine.PoolExhaustedError

PathLike = str | os.PathLike


@functools.lru_cache(maxsize=None)
def dtype_of(name: str) -> np.dtype:
  """numpy dtype for a manifest dtype name (ml_dtypes' names included); made once a name."""
  try:
    return np.dtype(name)
  except TypeError:
    return np.dtype(getattr(ml_dtypes, name))


@functools.lru_cache(maxsize=None)
def _name(dtype: np.dtype) -> str:
  """`dtype.name` (a Python property numpy builds each time), once a dtype."""
  return dtype.name


def _typed(raw: np.ndarray, dtype: str, shape: Sequence[int]) -> np.ndarray:
  """A store's uint8 bytes of a shard as the dtype and shape it was written as."""
  return raw.view(dtype_of(dtype)).reshape(shape)


def _as_bytes(array: np.ndarray) -> np.ndarray:
  return np.ascontiguousarray(array).reshape(-1).view(np.uint8)


class Ticket:
  """A transfer in flight; `wait()` returns the array read (None for a write).

  The ticket keeps the transfer's host buffers alive until it completes: a
  ticket dropped without `wait()` waits on its way out, so the engine never
  touches freed memory.
  """

  def __init__(self, wait: Callable[[], Any], *buffers: Any):
    self._wait, self._buffers = wait, buffers
    self._done, self._result = False, None

  def wait(self) -> Any:
    if not self._done:
      self._done = True
      try:
        self._result = self._wait()
      finally:
        self._buffers = ()
    return self._result

  def __del__(self):
    if not getattr(self, "_done", True):
      try:
        self.wait()
      except Exception:  # noqa: BLE001 - nobody is left to see it
        pass


class SwapStore(Protocol):
  folder: str

  def write(self, key: str, array: np.ndarray) -> Ticket: ...
  def write_zeros(self, key: str, zeros: np.ndarray) -> Ticket: ...
  def read(self, key: str, out: np.ndarray | None = None) -> Ticket: ...
  def sync(self) -> None: ...
  def keys(self) -> list[str]: ...
  def close(self) -> None: ...


class AioStore:
  """The C++ engine: io_uring (or the thread-pool fallback), O_DIRECT, pinned staging, striping.

  Args:
    paths: one folder or several (one swap file each, striped like RAID 0).
    rank: this process's rank; its files live in `path/rank{rank}/`.
    block_size: I/O block and stripe unit in bytes (multiple of 4 KiB).
    queue_depth: blocks kept in flight per transfer.
    backend: "auto" (the faster of the two on this drive, timed at the first open:
      `zinfjax.offload.probe`), "io_uring" or "threads".
    direct: O_DIRECT (buffered where the filesystem refuses it).
    io_threads: transfers that run concurrently.
    io_nice: added to the I/O threads' nice value, so they yield the CPU to
      the threads running the XLA program (0: same priority).
    pinned_budget: bytes of staging buffers the store may hold (never more); the
      copies of detached writes (the XLA grad writes) in flight stay within the
      same amount again.
    fresh: start empty: forget what the folders hold (another run's shards, of
      any shapes, block size or stripe count) and reuse their files' space.
    memory: keep the shards in host RAM (an anonymous memory file the store maps
      once, its pages made and mapped on threads as it grows) instead of files under
      `paths` (ignored): the host tier's store, whose shards `view` lends for updates
      in place. Nothing outlives it.
  """

  def __init__(self, paths: PathLike | Sequence[PathLike], rank: int = 0, *,
               block_size: int = 1 << 20, queue_depth: int = 32, backend: str = "auto",
               direct: bool = True, io_threads: int = 2, pinned_budget: int = 64 << 20,
               pool_timeout_s: float = 60.0, io_nice: int = 0, fresh: bool = False,
               memory: bool = False):
    paths = [paths] if isinstance(paths, (str, os.PathLike)) else list(paths)
    self.probe: dict | None = None
    if memory:
      paths, fresh, direct = [], True, False
    if backend == "auto" and not memory:
      make = lambda folder, b, fresh: AioStore(
          folder, block_size=block_size, queue_depth=queue_depth, backend=b, direct=direct,
          io_threads=io_threads, pinned_budget=pinned_budget, fresh=fresh)
      try:
        self.probe = fastest_backend(os.fspath(paths[0]), make, direct)
        backend = self.probe["backend"]
      except Exception:  # noqa: BLE001 - the store's own open below names what is wrong
        backend = "auto"  # the engine's: io_uring where it can be set up, else threads
    self._store = _engine.SwapStore([os.fspath(p) for p in paths], rank, block_size, queue_depth,
                                    backend, direct, io_threads, pinned_budget, pool_timeout_s,
                                    io_nice, fresh, memory)
    self._handle: int | None = None

  @property
  def folder(self) -> str:
    return self._store.folder

  @property
  def backend(self) -> str:
    return self._store.backend

  @property
  def engine(self) -> Any:
    """The underlying `_engine.SwapStore` (for the optimizer pipeline and benchmarks)."""
    return self._store

  @property
  def handle(self) -> int:
    """Handle of this store in the engine's table, for the FFI calls in `zinfjax.offload.swap`."""
    if self._handle is None:
      self._handle = self._store.register()
    return self._handle

  @property
  def memory(self) -> bool:
    """Whether the shards live in host RAM (see `view`), not in files."""
    return self._store.memory

  def lends(self, key: str) -> bool:
    """Whether `key`'s shard is updated where it lies (`view`, `stage`), with no transfer: in
    host RAM, always (an all-or-nothing step's update reads the committed copy and writes
    its new one)."""
    return self.memory

  def view(self, key: str) -> np.ndarray:
    """A memory store's shard `key` itself (its dtype and shape), for reading and updating in
    place; valid until the key is written again in a transaction (which moves it)."""
    raw, dtype, shape = self._store.view(key)
    return _typed(raw, dtype, shape)

  def stage(self, key: str) -> tuple[np.ndarray, np.ndarray]:
    """A memory store's shard `key` for an update that rewrites it whole: (the bytes to read,
    the bytes to write). In a transaction that versions the key, the first is the committed
    copy (kept for `rollback`) and the second the step's new one (its bytes undefined until
    written), so nothing is copied; otherwise both are the shard itself (the same array)."""
    src, dst, dtype, shape = self._store.stage(key)
    dst = _typed(dst, dtype, shape)
    return (dst if src is None else _typed(src, dtype, shape)), dst

  def write(self, key: str, array: np.ndarray) -> Ticket:
    array = np.ascontiguousarray(array)
    ticket = self._store.write_async(key, _as_bytes(array), _name(array.dtype), list(array.shape))
    return Ticket(lambda: self._store.wait(ticket), array)

  def write_zeros(self, key: str, zeros: np.ndarray) -> Ticket:
    """`write(key, zeros)` for an all-zero `zeros`, which an extent the store takes from space
    never written (a fresh store's tail) already holds: then nothing is copied or written,
    only registered (`bytes_left_zero` counts it)."""
    zeros = np.ascontiguousarray(zeros)
    ticket = self._store.write_zeros_async(key, _as_bytes(zeros), _name(zeros.dtype),
                                           list(zeros.shape))
    return Ticket(lambda: self._store.wait(ticket), zeros)

  def read(self, key: str, out: np.ndarray | None = None) -> Ticket:
    if out is None:
      entry = self._store.entry(key)
      out = aligned_empty(entry["shape"], dtype_of(entry["dtype"]))
    ticket = self._store.read_async(key, _as_bytes(out), _name(out.dtype), list(out.shape))

    def finish():
      self._store.wait(ticket)
      return out

    return Ticket(finish, out)

  def write_many(self, items: Sequence[tuple[str, np.ndarray]]) -> Ticket:
    """Write several shards as one transfer (one wait for all; far less overhead per shard
    than `write` for small shards)."""
    arrays = [np.ascontiguousarray(a) for _, a in items]
    ticket = self._store.write_many([k for k, _ in items], [_as_bytes(a) for a in arrays],
                                    [_name(a.dtype) for a in arrays],
                                    [list(a.shape) for a in arrays])
    return Ticket(lambda: self._store.wait(ticket), arrays)

  def read_many(self, items: Sequence[tuple[str, np.ndarray]]) -> Ticket:
    """Read several shards, each into its `out` array, as one transfer; `wait()` returns the
    arrays. Each is checked as `read` checks it."""
    outs = [out for _, out in items]
    for out in outs:
      if not (out.flags.c_contiguous and out.flags.writeable):
        raise ValueError("read_many needs writable C-contiguous output arrays")
    ticket = self._store.read_many([k for k, _ in items], [_as_bytes(o) for o in outs],
                                   [_name(o.dtype) for o in outs], [list(o.shape) for o in outs])

    def finish():
      self._store.wait(ticket)
      return outs

    return Ticket(finish, outs)

  def entry(self, key: str) -> dict:
    return self._store.entry(key)

  def has(self, key: str) -> bool:
    return self._store.has(key)

  def exchange(self, pairs: Sequence[tuple[str, str]]) -> None:
    """A memory store's shards trade places, pair by pair: each key then names the bytes the
    other named (a double buffer's halves swapped, nothing copied). Both keys hold shards of
    one dtype and shape, with no transfer of them in flight, outside a transaction."""
    self._store.exchange([(a, b) for a, b in pairs])

  def generation(self, key: str) -> int:
    """Completed writes of `key` so far (by any thread, XLA custom calls included)."""
    return self._store.generation(key)

  def wait_generation(self, key: str, generation: int, timeout_s: float) -> bool:
    """Wait until `generation(key) >= generation`; False after `timeout_s`."""
    return self._store.wait_generation(key, generation, timeout_s)

  def sync(self) -> None:
    self._store.sync()

  def begin(self, prefixes: Sequence[str]) -> None:
    """Start an all-or-nothing update of the keys under `prefixes` (see `commit`, `rollback`):
    their first rewrite goes to a fresh extent, the committed one is kept."""
    self._store.begin(list(prefixes))

  def commit(self) -> None:
    """Keep the update's writes (all waited for) and free the extents they replaced."""
    self._store.commit()

  def rollback(self, keys: Sequence[str] | None = None) -> None:
    """Undo the update: wait for its writes in flight, then bring back every committed entry.
    With `keys`, only theirs: the update goes on for the other keys (`commit` keeps them)."""
    if keys is None:
      self._store.rollback()
    else:
      self._store.rollback_keys(list(keys))

  @property
  def in_transaction(self) -> bool:
    return self._store.in_transaction

  def reserve(self, nbytes: int, exact: bool = False) -> None:
    """Allocate the files for `nbytes` more of shards now (`NoSpaceError` here, not later);
    `exact` also gives back the space the files hold beyond that."""
    self._store.reserve(nbytes, exact)

  @property
  def allocated_bytes(self) -> int:
    """Bytes the swap files hold on the drive (space the store reuses before growing)."""
    return self._store.allocated_bytes

  @property
  def bytes_moved(self) -> tuple[int, int]:
    """(bytes read, bytes written) of shard payloads since the store opened."""
    return self._store.bytes_read, self._store.bytes_written

  def keys(self) -> list[str]:
    return self._store.keys()

  def defer_errors(self, on: bool = True) -> None:
    """Record failures of the XLA custom calls instead of failing their program.

    Inside a collective program a failing rank would leave the others waiting
    in the next collective; with this on, the program finishes and
    `raise_deferred()` raises the first error (with its engine error type).
    """
    self._store.set_defer_errors(on)

  def raise_deferred(self) -> None:
    self._store.raise_deferred()

  def stats(self) -> dict:
    return {"backend": self.backend, "probe": self.probe, "direct": self._store.direct,
            "bytes_used": self._store.bytes_used, "bytes_read": self._store.bytes_read,
            "bytes_written": self._store.bytes_written,
            "bytes_left_zero": self._store.bytes_left_zero,
            "allocated_bytes": self._store.allocated_bytes,
            "pool": self._store.pool_stats(),
            "spare_bytes": self._store.spare_bytes, "buffers_made": self._store.buffers_made,
            "mapping_pinned_bytes": self._store.mapping_pinned_bytes}

  @property
  def closed(self) -> bool:
    return isinstance(self._store, _Closed)

  def close(self) -> None:
    """Flush and release the files and folder locks; a second close does nothing. A flush that
    fails (a full drive, a folder removed) is raised once the files are released."""
    if self._handle is not None:
      _engine.unregister_store(self._handle)
      self._handle = None
    if not isinstance(self._store, _Closed):
      store, self._store = self._store, _Closed(self._store.folder)
      try:
        store.sync()
      finally:
        del store  # the last reference: releases files and the folder lock


class _Closed:
  """In place of a closed store's engine: any later use is one clear error."""

  def __init__(self, folder: str):
    self._folder = folder

  def __getattr__(self, name: str):
    raise ValueError(f"the swap store in {self._folder} is closed (used after close()): open a "
                     "new AioStore on the folder to read what it holds.")
