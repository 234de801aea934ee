"""Start N local processes of a zinfjax script as one multi-process run.

  python scripts/launch.py --nproc 2 scripts/train_gpt.py --devices 4 --steps 100

Each process gets ZINFJAX_COORDINATOR / ZINFJAX_NUM_PROCESSES /
ZINFJAX_PROCESS_ID (read by `zinfjax.distributed.initialize`). If one process
fails, the others are stopped (SIGTERM, then SIGKILL after --grace-s) and the
launcher exits with an error naming it, instead of leaving them waiting in a
collective. On a cluster, use its launcher instead (see the README).
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import time


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def describe(code: int) -> str:
  if code < 0:
    return f"was killed by {signal.Signals(-code).name}"
  return f"exited with code {code}"


def stop(procs: list[subprocess.Popen], grace_s: float) -> list[int]:
  """SIGTERM the running processes, SIGKILL those still there after `grace_s`; returns the
  indices of the killed ones."""
  for p in procs:
    if p.poll() is None:
      p.terminate()
  deadline = time.monotonic() + grace_s
  killed = []
  for i, p in enumerate(procs):
    try:
      p.wait(timeout=max(0.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
      p.kill()
      p.wait()
      killed.append(i)
  return killed


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--nproc", type=int, required=True, help="processes to start on this machine")
  p.add_argument("--port", type=int, default=None, help="coordinator port (default: a free one)")
  p.add_argument("--grace-s", type=float, default=10.0,
                 help="seconds the other processes get to exit after one fails")
  p.add_argument("script", help="the Python script every process runs")
  p.add_argument("args", nargs=argparse.REMAINDER, help="its arguments")
  args = p.parse_args(argv)
  if args.nproc < 1:
    p.error("--nproc must be at least 1")
  coordinator = f"127.0.0.1:{args.port or free_port()}"
  procs = []
  for i in range(args.nproc):
    env = dict(os.environ, ZINFJAX_COORDINATOR=coordinator, ZINFJAX_NUM_PROCESSES=str(args.nproc),
               ZINFJAX_PROCESS_ID=str(i))
    procs.append(subprocess.Popen([sys.executable, args.script, *args.args], env=env))

  def forward(signum, _frame):
    for proc in procs:
      if proc.poll() is None:
        proc.send_signal(signum)
  signal.signal(signal.SIGTERM, forward)
  signal.signal(signal.SIGINT, forward)

  while True:
    codes = [proc.poll() for proc in procs]
    failed = [(i, c) for i, c in enumerate(codes) if c not in (None, 0)]
    if failed:
      i, code = failed[0]
      running = sum(c is None for c in codes)
      print(f"launch: process {i} of {args.nproc} {describe(code)}; stopping the {running} still "
            "running. Fix the cause and restart (with --resume to continue from the last "
            "checkpoint).", file=sys.stderr, flush=True)
      killed = stop(procs, args.grace_s)
      if killed:
        print(f"launch: processes {killed} ignored SIGTERM for {args.grace_s:g} s and were killed.",
              file=sys.stderr, flush=True)
      return 1
    if all(c == 0 for c in codes):
      return 0
    time.sleep(0.2)


if __name__ == "__main__":
  sys.exit(main())
