"""Random CLI configs trained by two processes against one (`scripts/train_gpt.py`).

  python scripts/fuzz_processes.py --trials 8 --seed 0
  python scripts/fuzz_processes.py --seeds 3 5             # trials to reproduce

Each trial draws train_gpt.py flags (the stage, per-layer splits of params and optimizer
over the tiers, the host optimizer, a delayed update, tiles, micro-batches, prefetch,
all-or-nothing steps, clipping) and trains the tiny GPT in fp32 twice on 8 host devices:
one process of 8, and two processes of 4 through `scripts/launch.py` (each with its own
store folder and shards). Every step's loss must agree to 1e-5; with --resume the two
processes stop halfway, and a second launch resumes from their checkpoint. A run that fails
in either layout (other than a clear "error: ..." refusal in both, counted as refused), a
hang, or a mismatch fails the fuzz (exit 1) and prints the flags.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from fuzz_configs import draw_split, trial_parser  # noqa: E402

SCRIPTS = os.path.dirname(os.path.abspath(__file__))
STEPS, LOSS_RTOL = 4, 1e-5  # fp32 sums of 8 shards in another grouping: rounding only


def parse_args(argv=None):
  p = trial_parser(__doc__, trials=8)
  p.add_argument("--resume", action="store_true",
                 help="the two processes save at step 2 and a second launch resumes")
  return p.parse_args(argv)


def draw(rng, layers: int = 3) -> list[str]:
  """train_gpt.py flags of one trial (the model, data and steps aside)."""
  pick = lambda *xs: xs[int(rng.integers(len(xs)))]
  stage = pick(3, 3, 3, 2, 1)
  flags = ["--zero-stage", str(stage), "--micro-batches", str(pick(1, 2)),
           "--prefetch-depth", str(pick(0, 1, 2))]
  if stage == 3:
    flags += ["--offload-param", draw_split(rng, layers),
              "--offload-optimizer", draw_split(rng, layers),
              "--host-optimizer", pick("auto", "xla", "stream", "pipeline"),
              "--tiles", str(pick(1, 1, 2)), "--nvme-prefetch-depth", str(pick(0, 1))]
    flags += pick([], [], ["--no-atomic-steps"], ["--host-atomic-steps"])
    flags += pick([], [], ["--delay-update", "tail"], ["--delay-update", "all"])
  flags += pick([], ["--clip", "0.5"], ["--clip", "1000"])
  return flags


def run(flags: list[str], folder: str, name: str, nproc: int, timeout: float,
        extra: tuple[str, ...] = ()) -> tuple[int, str]:
  """(exit code, the output's tail) of one train_gpt.py run writing `name`.jsonl."""
  cmd = [os.path.join(SCRIPTS, "train_gpt.py"), "--preset", "tiny", "--layers", "3",
         "--precision", "fp32", "--steps", str(STEPS), "--schedule-steps", str(STEPS),
         "--batch-size", "16", "--seq-len", "32", "--log-every", "1",
         "--devices", str(8 // nproc), "--nvme-path", os.path.join(folder, f"{name}_nvme"),
         "--metrics-jsonl", os.path.join(folder, f"{name}.jsonl"), *flags, *extra]
  if nproc > 1:
    cmd = [os.path.join(SCRIPTS, "launch.py"), "--nproc", str(nproc), *cmd]
  try:
    out = subprocess.run([sys.executable, *cmd], capture_output=True, text=True,
                         timeout=timeout, cwd=os.path.dirname(SCRIPTS))
  except subprocess.TimeoutExpired:
    return -1, f"no result after {timeout:.0f} s (a hang?)"
  return out.returncode, (out.stdout + out.stderr)[-1500:]


def losses(folder: str, name: str) -> dict[int, float]:
  path = os.path.join(folder, f"{name}.jsonl")
  if not os.path.exists(path):
    return {}
  with open(path) as f:
    return {r["step"]: r["loss"] for r in map(json.loads, f.read().splitlines()) if "loss" in r}


def trial(flags: list[str], folder: str, resume: bool, timeout: float) -> tuple[str, str]:
  """("ok" | "refused" | "failed", what happened)."""
  import numpy as np
  one = run(flags, folder, "one", 1, timeout)
  if resume:
    ckpt = ("--checkpoint-dir", os.path.join(folder, "ckpt"), "--save-every", "2")
    two = run(flags, folder, "two", 2, timeout, (*ckpt, "--steps", "2"))
    if two[0] == 0:
      two = run(flags, folder, "two", 2, timeout, (*ckpt, "--resume"))
  else:
    two = run(flags, folder, "two", 2, timeout)
  refused = lambda r: r[0] > 0 and "error: " in r[1] and "Traceback" not in r[1]
  if refused(one) and refused(two):  # the CLI's clear refusal (a hang or a crash is not one)
    return "refused", one[1].strip().splitlines()[-1][:300]
  if one[0] or two[0]:
    which, out = ("one process", one[1]) if one[0] else ("two processes", two[1])
    return "failed", f"{which} failed:\n{out}"
  a, b = losses(folder, "one"), losses(folder, "two")
  if sorted(a) != list(range(1, STEPS + 1)) or sorted(b) != sorted(a):
    return "failed", f"steps logged: one process {sorted(a)}, two {sorted(b)}"
  got, want = np.asarray([b[s] for s in sorted(a)]), np.asarray([a[s] for s in sorted(a)])
  if not np.allclose(got, want, rtol=LOSS_RTOL, atol=0):
    return "failed", f"losses of two processes {got.tolist()} != one {want.tolist()}"
  return "ok", f"worst loss {np.max(np.abs(got - want) / np.abs(want)):.1e}"


def main(argv=None) -> int:
  args = parse_args(argv)
  import numpy as np
  counts = {"ok": 0, "refused": 0, "failed": 0}
  seeds = args.seeds or range(args.seed, args.seed + args.trials)
  for i, seed in enumerate(seeds):
    flags = draw(np.random.default_rng(seed))
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="zinfjax-fuzz-") as folder:
      outcome, what = trial(flags, folder, args.resume, args.timeout)
    counts[outcome] += 1
    print(f"{outcome.upper():8} trial {i} (seed {seed}): {' '.join(flags)} "
          f"[{time.perf_counter() - t0:.1f} s]\n  {what}", flush=True)
  print(" ".join(f"{k}={v}" for k, v in counts.items()), flush=True)
  return 1 if counts["failed"] else 0


if __name__ == "__main__":
  sys.exit(main())
