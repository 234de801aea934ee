"""The disk's bandwidth ceiling, measured by fio (or dd) for the benchmarks in this folder."""

from __future__ import annotations

import json
import os
import shutil
import subprocess


def direct_io(path: str, size: int, threads: int = 8, block: int = 8 << 20) -> tuple[float, float]:
  """(write, read) GB/s of `size` bytes in `block`s from `threads` threads with O_DIRECT.

  os.pwrite/os.preadv release the GIL, so the threads keep `threads` requests in flight, as
  fio's psync jobs do. The buffers are random (not zeros) and page-aligned (mmap).
  """
  import mmap
  import time
  from concurrent.futures import ThreadPoolExecutor

  import numpy as np
  blocks = max(threads, size // block)
  bufs = [mmap.mmap(-1, block) for _ in range(threads)]
  for i, b in enumerate(bufs):
    np.frombuffer(b, np.uint8)[:] = np.random.default_rng(i).integers(0, 255, block, np.uint8)
  fd = os.open(path, os.O_RDWR | os.O_CREAT | getattr(os, "O_DIRECT", 0), 0o644)
  try:
    def run(op) -> float:
      def worker(t: int) -> None:
        for k in range(t, blocks, threads):
          n = op(fd, bufs[t], k * block)
          if n != block:
            raise OSError(f"short O_DIRECT transfer on {path}: {n} of {block} bytes")

      t0 = time.perf_counter()
      with ThreadPoolExecutor(threads) as pool:
        list(pool.map(worker, range(threads)))
      if op is os.pwrite:
        os.fsync(fd)
      return blocks * block / (time.perf_counter() - t0) / 1e9

    w = run(os.pwrite)
    r = run(lambda fd, b, off: os.preadv(fd, [b], off))
    return w, r
  finally:
    os.close(fd)


def disk_ceiling(folder: str, size: int) -> tuple[str, float, float]:
  """(tool, write GB/s, read GB/s) of the raw disk under `folder`, with O_DIRECT."""
  path = os.path.join(folder, "ceiling.bin")
  size = max(64 << 20, size // (64 << 20) * (64 << 20))  # whole MiB blocks for every job
  try:
    if shutil.which("fio"):
      def fio(rw, engine, jobs, depth):
        out = subprocess.run(
            ["fio", "--name=ceiling", f"--filename={path}", f"--rw={rw}", "--bs=1M",
             f"--iodepth={depth}", f"--ioengine={engine}", "--direct=1", f"--numjobs={jobs}",
             f"--size={size // jobs}", f"--offset_increment={size // jobs}", "--group_reporting",
             "--output-format=json"], capture_output=True, text=True, check=True).stdout
        job = json.loads(out[out.index("{"):])["jobs"][0]
        return job["write" if rw == "write" else "read"]["bw_bytes"] / 1e9

      # The best of an async and a threaded configuration, each job on its own part of the file.
      configs = [("io_uring", 2, 32), ("psync", 16, 1)]
      w = max(fio("write", *c) for c in configs)
      r = max(fio("read", *c) for c in configs)
      return "fio (best of io_uring 2x QD32 and psync 16 jobs; 1 MiB, O_DIRECT)", w, r

    w, r = direct_io(path, size)
    return "O_DIRECT pwrite/pread, 8 threads x 8 MiB (no fio here)", w, r
  finally:
    if os.path.exists(path):
      os.remove(path)
