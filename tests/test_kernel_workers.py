"""The C++ AdamW's shared workers: every thread count, concurrent callers and a forked child
give the single-threaded update bit for bit, and a lower-priority caller gets workers of its
priority."""

import os
import pathlib
import subprocess
import sys
import textwrap
import threading

import ml_dtypes
import numpy as np
import pytest

from zinfjax.optim.kernel import AdamConstants, adamw_numpy

PIECE = 1 << 15  # the kernel's piece of work (ffi/core/adam.cc)
C = AdamConstants(0.9, 0.95, 1e-8)


def states(n: int, moments, seed: int):
  rng = np.random.default_rng(seed)
  return [rng.standard_normal(n).astype(np.float32),
          (rng.standard_normal(n) * 0.1).astype(moments), (rng.random(n) * 0.01).astype(moments),
          rng.standard_normal(n).astype(ml_dtypes.bfloat16)]


def update(master, m, v, grad, threads: int) -> list[np.ndarray]:
  """One step on copies; returns (master, m, v, bf16 params) as raw bits."""
  master, m, v = master.copy(), m.copy(), v.copy()
  out = np.empty(master.size, ml_dtypes.bfloat16)
  adamw_numpy(master, m, v, grad, out, 1e-3, 0.19, 0.0975, C, 0.01, threads=threads, step=7)
  return [x.view(np.uint16) if x.dtype.itemsize == 2 else x.view(np.uint32)
          for x in (master, m, v, out)]


@pytest.mark.parametrize("moments", [np.float32, ml_dtypes.bfloat16])
def test_every_thread_count_gives_the_one_thread_update(moments):
  """A ragged size over many pieces: no element skipped or done twice, whichever thread did it
  (bf16 moments round each element by its index: a misplaced piece shows)."""
  n = 9 * PIECE + 77
  base = states(n, moments, seed=11)
  want = update(*base, threads=1)
  assert not np.array_equal(want[0], base[0].view(np.uint32))
  for threads in (2, 3, 8, 0):
    for got, ref in zip(update(*base, threads=threads), want):
      np.testing.assert_array_equal(got, ref, err_msg=f"threads={threads}")


def test_callers_on_several_threads_share_the_workers():
  """Four Python threads update their own arrays at once, 5 times each (the kernel lets go of
  the GIL): each gets its single-threaded result, and none waits forever."""
  inputs = [states(6 * PIECE + 5 * i, np.float32, seed=20 + i) for i in range(4)]
  want = [update(*x, threads=1) for x in inputs]
  errors: list[str] = []

  def caller(i: int) -> None:
    for _ in range(5):
      for got, ref in zip(update(*inputs[i], threads=0), want[i]):
        if not np.array_equal(got, ref):
          errors.append(f"caller {i} differs")

  threads = [threading.Thread(target=caller, args=(i,)) for i in range(4)]
  for t in threads:
    t.start()
  for t in threads:
    t.join(timeout=120)
  assert not any(t.is_alive() for t in threads), "a caller never returned"
  assert errors == []


def test_a_forked_child_updates_without_the_parents_workers(tmp_path):
  """After the workers have started, a fork()ed child (which has none of them) still runs the
  update, with the parent's result, and exits."""
  code = textwrap.dedent(f"""
      import os, sys
      import numpy as np
      sys.path.insert(0, {str(pathlib.Path(__file__).parent)!r})
      from test_kernel_workers import states, update
      base = states(8 * {PIECE} + 3, np.float32, seed=31)
      want = update(*base, threads=4)  # starts the parent's workers
      pid = os.fork()
      if pid == 0:
        got = update(*base, threads=4)
        os._exit(0 if all(np.array_equal(a, b) for a, b in zip(got, want)) else 3)
      _, status = os.waitpid(pid, 0)
      sys.exit(os.waitstatus_to_exitcode(status))
      """)
  done = subprocess.run([sys.executable, "-P", "-W", "ignore", "-c", code], cwd=tmp_path,
                        capture_output=True, text=True, timeout=120)
  assert done.returncode == 0, done.stderr[-2000:]


def thread_nices() -> dict[int, int]:
  """Each thread of this process (Linux /proc) and its nice value."""
  found = {}
  for task in pathlib.Path("/proc/self/task").iterdir():
    try:
      fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
    except OSError:  # the thread ended meanwhile
      continue
    found[int(task.name)] = int(fields[16])  # stat's 19th field; the first two are cut
  return found


@pytest.mark.skipif(not pathlib.Path("/proc/self/task").is_dir(), reason="needs Linux /proc")
def test_a_lower_priority_caller_gets_workers_of_its_priority():
  """ZeroConfig.host_nice lowers the host pipeline's thread; the kernel it calls then runs on
  workers of that nice value, not on those a normal-priority caller started (whose priority
  would outrank the threads driving the step)."""
  base = states(8 * PIECE, np.float32, seed=41)
  want = update(*base, threads=1)
  update(*base, threads=4)  # this thread's priority: its workers
  mine = os.getpriority(os.PRIO_PROCESS, 0)
  lowered, got = min(19, mine + 3), []

  def caller() -> None:
    os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), lowered)
    got.append(update(*base, threads=4))

  before = {t for t, nice in thread_nices().items() if nice == lowered}
  t = threading.Thread(target=caller)
  t.start()
  t.join(timeout=120)
  assert got and all(np.array_equal(a, b) for a, b in zip(got[0], want))
  workers = {t for t, nice in thread_nices().items() if nice == lowered} - before
  assert len(workers) >= 1, f"no worker at nice {lowered}: {thread_nices()}"
