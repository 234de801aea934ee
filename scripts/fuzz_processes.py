"""Random CLI configs trained by two processes against one (`scripts/train_gpt.py`).

  python scripts/fuzz_processes.py --trials 8 --seed 0
  python scripts/fuzz_processes.py --seeds 3 5             # trials to reproduce
  python scripts/fuzz_processes.py --resume --params --trials 8 --seed 500
  python scripts/fuzz_processes.py --pretrained llama --lora --params --seed 600

Each trial draws train_gpt.py flags (the stage, per-layer splits of params and optimizer
over the tiers, the host optimizer, a delayed update, tiles, micro-batches, prefetch,
all-or-nothing steps, clipping) and trains the tiny GPT (or fine-tunes a tests/data/hf
checkpoint, --pretrained, with LoRA adapters, --lora) in fp32 twice on 8 host devices:
one process of 8, and two processes of 4 through `scripts/launch.py` (each with its own
store folder and shards). Every step's loss must agree to 1e-5. With --resume the two
processes stop halfway, and a second launch resumes from their checkpoint. With --params
both layouts export the trained model (two processes from their last checkpoint), and the
exported tensors must agree too. A run that fails in either layout (other than a clear
"error: ..." refusal in both, counted as refused), a hang, or a mismatch fails the fuzz
(exit 1) and prints the flags.
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
PRETRAINED = ("gemma", "gemma2", "gemma3", "gemma3mm", "gpt2", "llama", "llama3", "mistral",
              "olmo2", "phi3", "qwen2", "qwen3", "yarn")
STEPS, LOSS_RTOL = 4, 1e-5  # fp32 sums of 8 shards in another grouping: rounding only
# --params: any one element to 1e-4 and a tensor's mean error to 1e-5. Adam's sign of a
# near-zero grad may flip in another summation order (see _fuzz_reference.FP32): Qwen2's key
# biases, whose grads are rounding noise (softmax ignores a shift), differ by 6e-6 per element
# and 6e-7 per tensor; other tensors by 1e-6 at most. A layer a step stale or the wrong
# checkpoint exported moves a tensor by the learning rate (1e-3 and more).
PARAM_ATOL, PARAM_MEAN = 1e-4, 1e-5


def parse_args(argv=None):
  p = trial_parser(__doc__, trials=8)
  p.add_argument("--resume", action="store_true",
                 help="the two processes save at step 2 and a second launch resumes")
  p.add_argument("--params", action="store_true",
                 help="both layouts --export the trained model; its tensors must agree too")
  p.add_argument("--pretrained", choices=sorted(PRETRAINED), default=None,
                 help="fine-tune the tiny Hugging Face checkpoint of tests/data/hf instead")
  p.add_argument("--lora", action="store_true", help="with --pretrained: --lora-rank 2")
  args = p.parse_args(argv)
  if args.lora and not args.pretrained:
    p.error("--lora adapts a pretrained model: give --pretrained too")
  return args


def model_flags(pretrained: str | None, lora: bool, folder: str) -> tuple[list[str], int]:
  """train_gpt.py's model and data flags, and the model's layer count: the tiny GPT on the
  bundled text, or a tests/data/hf checkpoint on that text's bytes within its vocabulary
  (written into `folder`)."""
  if pretrained is None:
    return ["--preset", "tiny", "--layers", "3"], 3
  import numpy as np
  from zinfjax.models import hf
  path = os.path.join(os.path.dirname(SCRIPTS), "tests", "data", "hf", pretrained)
  config = hf.config_from_hf(hf.read_config(path))  # GPT-2's and Llama's names alike
  with open(os.path.join(os.path.dirname(SCRIPTS), "data", "tinyshakespeare.txt"), "rb") as f:
    text = np.frombuffer(f.read()[:40000], np.uint8)
  data = os.path.join(folder, "tokens.bin")
  (text.astype(np.uint16) % config.vocab_size).tofile(data)
  flags = ["--init-from", path, "--data", data, *(["--lora-rank", "2"] if lora else [])]
  return flags, config.num_layers


def draw(rng, layers: int = 3, lora: bool = False) -> list[str]:
  """train_gpt.py flags of one trial (the model, data and steps aside; LoRA trains at stage 3)."""
  pick = lambda *xs: xs[int(rng.integers(len(xs)))]
  stage = 3 if lora else pick(3, 3, 3, 2, 1)
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
  cmd = [os.path.join(SCRIPTS, "train_gpt.py"), "--precision", "fp32", "--steps", str(STEPS),
         "--schedule-steps", str(STEPS), "--batch-size", "16", "--seq-len", "32",
         "--log-every", "1",
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


def exported(folder: str, name: str) -> dict:
  """The tensors `name`'s run exported (--params), read into memory."""
  import numpy as np
  from zinfjax.weights.safetensors import Checkpoint
  tensors = Checkpoint(os.path.join(folder, f"{name}_export"))
  return {k: np.array(tensors[k], np.float32) for k in tensors}


def compare_params(one: dict, two: dict) -> tuple[str | None, str]:
  """(what differs or None, the worst errors) of two exports of the same training."""
  import numpy as np
  if sorted(one) != sorted(two):
    return f"tensors exported: one process {sorted(one)}, two {sorted(two)}", ""
  worst = {"element": (0.0, ""), "mean": (0.0, "")}
  for k in sorted(one):
    err = np.abs(two[k] - one[k])
    for what, e in (("element", float(err.max(initial=0.0))), ("mean", float(err.mean()))):
      if e > worst[what][0]:
        worst[what] = (e, k)
  line = (f"worst param element {worst['element'][0]:.1e} ({worst['element'][1]}), "
          f"tensor mean {worst['mean'][0]:.1e} ({worst['mean'][1]})")
  bad = worst["element"][0] > PARAM_ATOL or worst["mean"][0] > PARAM_MEAN
  return (f"params differ: {line}" if bad else None), line


def trial(flags: list[str], folder: str, resume: bool, timeout: float, params: bool = False
          ) -> tuple[str, str]:
  """("ok" | "refused" | "failed", what happened)."""
  import numpy as np
  export = lambda name: ("--export", os.path.join(folder, f"{name}_export")) if params else ()
  ckpt = ("--checkpoint-dir", os.path.join(folder, "ckpt"), "--save-every", "2")
  one = run(flags, folder, "one", 1, timeout, export("one"))
  if resume:
    two = run(flags, folder, "two", 2, timeout, (*ckpt, "--steps", "2"))
    if two[0] == 0:
      two = run(flags, folder, "two", 2, timeout, (*ckpt, "--resume", *export("two")))
  else:  # several processes export from the checkpoint saved last
    two = run(flags, folder, "two", 2, timeout, (*ckpt, *export("two")) if params else ())
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
  what = f"worst loss {np.max(np.abs(got - want) / np.abs(want)):.1e}"
  if params:
    bad, line = compare_params(exported(folder, "one"), exported(folder, "two"))
    if bad:
      return "failed", bad
    what += f", {line}"
  return "ok", what


def main(argv=None) -> int:
  args = parse_args(argv)
  import numpy as np
  counts = {"ok": 0, "refused": 0, "failed": 0}
  seeds = args.seeds or range(args.seed, args.seed + args.trials)
  for i, seed in enumerate(seeds):
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="zinfjax-fuzz-") as folder:
      model, layers = model_flags(args.pretrained, args.lora, folder)
      drawn = draw(np.random.default_rng(seed), layers, args.lora)
      outcome, what = trial(model + drawn, folder, args.resume, args.timeout, args.params)
    counts[outcome] += 1
    print(f"{outcome.upper():8} trial {i} (seed {seed}): {' '.join(drawn)} "
          f"[{time.perf_counter() - t0:.1f} s]\n  {what}", flush=True)
  print(" ".join(f"{k}={v}" for k, v in counts.items()), flush=True)
  return 1 if counts["failed"] else 0


if __name__ == "__main__":
  sys.exit(main())
