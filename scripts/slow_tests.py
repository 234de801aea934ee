"""Write tests/slow.txt, the tests `pytest -m "not slow"` leaves out, from a timed run of the suite.

  pytest -q --durations=0 | tee durations.log
  python scripts/slow_tests.py durations.log [--over 5]

A test is slow when its setup, call and teardown took `--over` seconds or more together
(a module's shared fixture is counted with the first test that uses it). tests/conftest.py
marks the tests listed there with `slow`.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import sys


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("log", help="output of pytest --durations=0")
  p.add_argument("--over", type=float, default=5.0, help="seconds")
  args = p.parse_args(argv)
  seconds: dict[str, float] = collections.defaultdict(float)
  with open(args.log) as f:
    for line in f:
      m = re.match(r"([\d.]+)s (call|setup|teardown)\s+(\S+)", line)
      if m:
        seconds[m.group(3)] += float(m.group(1))
  if not seconds:
    print(f"error: no durations in {args.log}; run pytest with --durations=0.", file=sys.stderr)
    return 2
  slow = sorted(k for k, v in seconds.items() if v >= args.over)
  path = os.path.join(os.path.dirname(__file__), "..", "tests", "slow.txt")
  with open(path, "w") as f:
    f.write(f"# tests that took {args.over:g} s or more (scripts/slow_tests.py); "
            "`pytest -m \"not slow\"` leaves them out\n")
    f.write("".join(f"{k}\n" for k in slow))
  rest = sum(v for v in seconds.values() if v < args.over)
  print(f"{len(slow)} slow tests ({sum(seconds.values()) - rest:.0f} s); the others took {rest:.0f} s")
  return 0


if __name__ == "__main__":
  sys.exit(main())
