"""The disk's bandwidth ceiling, measured by fio (or dd) for the benchmarks in this folder."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess


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

    def dd(args):
      out = subprocess.run(["dd", *args], capture_output=True, text=True, check=True).stderr
      seconds = float(re.search(r"copied, ([0-9.]+) s", out).group(1))
      return size / seconds / 1e9

    count = max(1, size // (16 << 20))
    w = dd(["if=/dev/urandom", f"of={path}", "bs=16M", f"count={count}", "oflag=direct"])
    r = dd([f"if={path}", "of=/dev/null", "bs=16M", "iflag=direct"])
    return "dd (16 MiB, O_DIRECT)", w, r
  finally:
    if os.path.exists(path):
      os.remove(path)
