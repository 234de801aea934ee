"""Random ZeroConfigs trained against the plain single-device optax reference.

  python scripts/fuzz_configs.py --trials 40 --seed 0 [--restore] [--nan]
  python scripts/fuzz_configs.py --seeds 9 14 --restore --nan      # trials to reproduce

Each trial draws a config: the stage, a tier (or a per-layer split of tiers) for the params
and for the optimizer states, or offload="auto" with random tier budgets, the host
optimizer, all-or-nothing steps on NVMe and in RAM, prefetch depths, tiles, micro-batches,
the layer scan's residual policy, which params train (all; the blocks alone; all but the
layer norms), clipping (never, always) and the mesh size. It trains a
tiny GPT (or, with --model llama, a tiny Llama of drawn kv heads, tied or separate output
projection, q/k/v biases, sliding window, and the features of Qwen3, OLMo 2 and Gemma 1 to 3)
in fp32 on random tokens with that config and
with optax's AdamW (clipping chained in front) on one device, and compares every step's loss
and the final fp32 params, to fp32's tolerance, or where larger to twice the farthest the
reference is from itself started from params one unit in the last place away (a model that
amplifies fp32 rounding, like OLMo 2's norms after the MLP, differs from itself that much).
--lora gives every projection rank-2 adapters and trains only them.

--nan gives one step a NaN loss: with skip_nonfinite (the default) that step must change
nothing, and the reference skips it. --restore saves a checkpoint halfway (consolidate.py's
file of it must hold the state's full params, bit for bit), closes the run and goes on from
the checkpoint restored onto a second random config (another placement, another device
count): the result must still equal the uninterrupted reference.

A config refused at once with a ValueError counts as refused (its message is printed);
any other error, a mismatch, or a trial running past --timeout fails the run (exit 1),
printing the config to reproduce it.

--delay draws delay_update ("tail" or "all") for ZeRO-3 trials: the reference then runs
two AdamWs over the params, one fed each step's grads, one the step before's (from the
second step, with its own count), and each param element takes the update of the one its
part is in (the parts the run's host pipeline delays, read from the run).
"""

from __future__ import annotations

import argparse
import faulthandler
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _fuzz_reference import (BF16, EXACT, FP32, calibrated, compare,  # noqa: E402
                             delayed_reference, initial_params, measure, reference,
                             reference_tx, scaled_loss, schedule, trainable_filter)

STEPS, BATCH, SEQ = 6, 16, 32
TIERS = ("device", "pinned_host", "nvme")
# where states live and how they move there: what a bf16 trial's device twin leaves out
PLACEMENT = ("stage", "offload", "tier_budgets", "offload_param", "offload_optimizer",
             "host_optimizer", "host_atomic_steps", "nvme_atomic_steps", "nvme_prefetch_depth",
             "prefetch_depth", "offload_activations")


def trial_parser(doc: str, trials: int) -> argparse.ArgumentParser:
  """A fuzz script's parser with which trials it runs (--trials, --seed, --seeds) and how long
  one may take (--timeout)."""
  p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--trials", type=int, default=trials)
  p.add_argument("--seed", type=int, default=0, help="trial i draws from seed + i")
  p.add_argument("--seeds", type=int, nargs="+", help="run the trials of these seeds instead")
  p.add_argument("--timeout", type=float, default=600.0,
                 help="seconds a trial (or each run of one) may take")
  return p


def parse_args(argv=None):
  p = trial_parser(__doc__, trials=20)
  p.add_argument("--layers", type=int, default=3)
  p.add_argument("--model", choices=("gpt", "llama"), default="gpt",
                 help="llama draws its own shape: kv heads, tied embeddings, q/k/v biases")
  p.add_argument("--lora", action="store_true",
                 help="rank-2 LoRA adapters on every projection, and only they train (stage 3)")
  p.add_argument("--restore", action="store_true", help="checkpoint halfway, resume elsewhere")
  p.add_argument("--nan", action="store_true", help="one step's loss is NaN")
  p.add_argument("--delay", action="store_true",
                 help="draw delay_update ('tail' or 'all'; not with --restore or --nan)")
  p.add_argument("--precision", choices=("fp32", "bf16"), default="fp32",
                 help="bf16: each trial against its own config with every state on the device "
                      "(zinfjax, ZeRO-3, the same mesh; bit for bit where only the params move), "
                      "not optax (not with --restore, --delay)")
  p.add_argument("--devices", type=int, default=8, help="host devices (the mesh draws from them)")
  return p.parse_args(argv)


def draw_split(rng, layers: int) -> str:
  """One tier, or a per-layer split of two or three, by layer counts ("pinned_host:1,nvme")
  or by fractions ("device:0.5,nvme")."""
  if rng.random() < 0.5:
    return str(rng.choice(TIERS))
  tiers = [str(t) for t in rng.permutation(TIERS)[:rng.integers(2, 4)]]
  if rng.random() < 0.3:
    return f"{tiers[0]}:{rng.choice([0.25, 0.5, 0.75])},{tiers[1]}"
  left, counts = layers, []
  for _ in tiers[:-1]:  # each tier at least one layer, the last one what is left
    counts.append(int(rng.integers(1, max(2, left - (len(tiers) - 2 - len(counts))))))
    left -= counts[-1]
  return ",".join(f"{t}:{n}" for t, n in zip(tiers, counts)) + f",{tiers[-1]}"


def draw(rng, layers: int, devices: int, lora: bool = False) -> dict:
  """A random trial: `zero` (ZeroConfig keywords, nvme_path aside), `clip`, `dp`, `optax`
  (whether an all-device optimizer is optax's own chain rather than zinfjax's AdamW)."""
  pick = lambda *xs: xs[int(rng.integers(len(xs)))]
  zero = dict(stage=pick(3, 3, 3, 3, 2, 1), precision="fp32", prefetch_depth=pick(0, 1, 2),
              persistence_threshold=pick(0, 0, 300), micro_batches=pick(1, 2),
              layer_residuals=pick("auto", "recompute", "save", "dots"))
  if zero["stage"] == 3:
    zero.update(tiles=pick(1, 1, 2), nvme_atomic_steps=pick(True, False),
                nvme_prefetch_depth=pick(0, 1, 2), offload_activations=pick(False, False, True),
                host_optimizer=pick("auto", "xla", "stream", "pipeline"))
    if rng.random() < 0.2:
      zero.update(offload="auto", tier_budgets={str(t): int(rng.integers(0, 300_000))
                                                for t in TIERS[:2] if rng.random() < 0.8})
    else:
      zero.update(offload_param=draw_split(rng, layers), offload_optimizer=draw_split(rng, layers))
    if zero["host_optimizer"] in ("auto", "pipeline"):
      zero["host_atomic_steps"] = pick(False, True)
    zero["trainable"] = pick(None, None, None, "blocks", "no_norms")
    if lora:
      zero["trainable"] = "lora"
  dp = pick(*[n for n in (1, 2, 4, 8) if n <= devices])
  return dict(zero=zero, clip=pick(None, 0.5, 1e3), dp=dp, optax=pick(True, False))


def draw_model(rng, args) -> dict:
  """The model's shape: GPT's tiny one, or a Llama drawn with its kv heads, tied or separate
  output projection, q/k/v biases, a sliding window (Mistral's) or none, Qwen3's
  query/key norms (or OLMo 2's, over the whole projections) or none, norms before or (OLMo
  2's) after attention and the MLP, and Gemma's features or not (the MLP's gate, norms scaling
  by 1 + weight, the embedding scaled by sqrt(hidden)), and Gemma 2's and 3's (norms before and
  after, sliding and global layers in turn, a local rope, the logits' scale, soft caps)."""
  shape = dict(num_layers=args.layers, vocab_size=65, lora_rank=2 if args.lora else 0)
  if args.model == "llama":
    pick = lambda *xs: xs[int(rng.integers(len(xs)))]
    shape.update(hidden=64, intermediate=96, num_heads=4, num_kv_heads=pick(1, 2, 4),
                 tie_embeddings=pick(False, True), qkv_bias=pick(False, True), seq_len=SEQ)
    shape.update(sliding_window=pick(None, None, SEQ // 4))  # drawn later: older seeds keep theirs
    shape.update(qk_norm=pick(False, True))
    shape.update(qk_norm_span=pick("head", "all"), post_norm=pick(False, True))  # OLMo 2's
    shape.update(activation=pick("silu", "gelu", "gelu_tanh"), norm_offset=pick(False, True),
                 embed_scale=pick(False, True))  # Gemma's
    sandwich, alternate = pick(False, True), pick(False, True)   # Gemma 3's
    kinds = tuple("full" if i % 2 else "sliding" for i in range(args.layers))
    shape.update(sandwich_norm=sandwich and not shape["post_norm"],
                 layer_types=kinds if alternate and shape["sliding_window"] else None,
                 local_rope_theta=pick(None, 100.0), query_pre_attn_scalar=pick(None, 24))
    shape.update(attn_softcap=pick(None, 2.0), final_softcap=pick(None, 3.0))  # Gemma 2's
  return shape


def model_maker(model: str, shape: dict):
  """nnx.Rngs -> a fresh model of that shape."""
  from zinfjax.models import GPT, Llama, LlamaConfig, get_config
  if model == "llama":
    config = LlamaConfig(**shape)
    return lambda r: Llama(config, rngs=r)
  config = get_config("tiny", **shape)
  return lambda r: GPT(config, rngs=r)


def trial_tx(trial, zero):
  """optax's chain where `zero` keeps the optimizer on the device and the trial says so; else
  zinfjax's AdamW (any optimizer tier), the same update."""
  import zinfjax
  on_device = not zero.offload and zero.optimizer_split == (("device", None),)
  if on_device and trial["optax"]:
    return reference_tx(trial["clip"])
  return zinfjax.optim.adamw(schedule(), weight_decay=0.1, max_grad_norm=trial["clip"])


def device_twin(trial: dict) -> dict:
  """`trial` with every state on the device under ZeRO-3: the same mesh, micro-batches,
  tiles, residual policy, frozen params, precision and optimizer (optax's chain where the
  trial runs it, else zinfjax's AdamW, in the step)."""
  zero = {k: v for k, v in trial["zero"].items() if k not in PLACEMENT}
  zero.update(stage=3, offload_param="device", offload_optimizer="device")
  on_device = trial["zero"]["stage"] < 3 or trial["zero"].get("offload_optimizer") == "device"
  return dict(trial, zero=zero, optax=trial["optax"] and on_device)


def batches(seed: int, vocab: int, nan_step: int | None) -> list[dict]:
  import numpy as np
  rng = np.random.default_rng(seed)
  out = []
  for i in range(STEPS):
    scale = np.full((BATCH,), np.nan if i == nan_step else 1.0, np.float32)
    out.append({"inputs": rng.integers(0, vocab, (BATCH, SEQ)).astype(np.int32),
                "targets": rng.integers(0, vocab, (BATCH, SEQ)).astype(np.int32), "scale": scale})
  return out


def config(trial, folder: str):
  import zinfjax
  kw = dict(trial["zero"])
  if kw.get("stage", 3) == 3:
    kw["nvme_path"] = folder
  if kw.get("trainable") is not None:
    kw["trainable"] = trainable_filter(kw["trainable"])
  return zinfjax.ZeroConfig(**kw)


def start(trial, make_model, folder: str):
  """The trial's first state (a ValueError: refused)."""
  import zinfjax
  zero = config(trial, folder)
  mesh = zinfjax.make_mesh(trial["dp"])
  return zinfjax.init(make_model, trial_tx(trial, zero), zero, mesh, 0)


def run_trial(trial, second, make_model, data, folder: str) -> tuple[list[float], list, dict]:
  """Losses and final fp32 params of zinfjax under `trial` (from step STEPS // 2 under
  `second`, restored from a checkpoint, when given), and the parts it updates a step late
  (leaf name -> layers)."""
  import jax
  import numpy as np
  import zinfjax
  state = start(trial, make_model, os.path.join(folder, "a"))
  try:  # a trial that fails closes its run too: the next trial starts clean
    delayed: dict[str, set[int]] = {}
    pipeline = state.engine.pipeline
    for part in [p for u in (pipeline.tail if pipeline else ()) for p in u.parts]:
      delayed.setdefault(state.engine.plan.leaves[part.leaf].name, set()).add(part.layer)
    losses = []
    for i, batch in enumerate(data):
      if second is not None and i == STEPS // 2:
        state = resume(state, second, make_model, folder)
      state, metrics = zinfjax.train_step(state, batch, scaled_loss)
      losses.append(float(metrics["loss"]))
    return losses, [np.asarray(x) for x in jax.tree.leaves(state.full_params())], delayed
  finally:
    state.close()


def resume(state, second, make_model, folder: str):
  """`state` saved, closed and restored onto `second`'s config and mesh."""
  import zinfjax
  import zinfjax.checkpoint
  ckpt = zinfjax.checkpoint.Checkpointer(os.path.join(folder, "ckpt"))
  try:
    ckpt.save(state)
    ckpt.wait()
    check_consolidated(state, ckpt.directory, folder)
    state.close()
    zero = config(second, os.path.join(folder, "b"))
    return ckpt.restore(make_model, trial_tx(second, zero), zero,
                        zinfjax.make_mesh(second["dp"]))[0]
  finally:
    ckpt.close()


def check_consolidated(state, directory: str, folder: str) -> None:
  """consolidate.py's file of the checkpoint just saved holds the state's full params (the
  masters, and frozen params as they are), each under its name, bit for bit."""
  import contextlib
  import io

  import jax
  import numpy as np
  from zinfjax.weights.safetensors import Checkpoint
  import consolidate
  out = os.path.join(folder, "consolidated.safetensors")
  with contextlib.redirect_stdout(io.StringIO()):
    consolidate.main([directory, out])
  written = Checkpoint(out)
  want = {".".join(str(getattr(k, "key", k)) for k in path): np.asarray(x, np.float32)
          for path, x in jax.tree_util.tree_flatten_with_path(state.full_params())[0]}
  if sorted(written) != sorted(want):
    raise AssertionError(f"consolidate.py wrote {sorted(written)}, the state has {sorted(want)}")
  for name, x in want.items():
    if not np.array_equal(np.asarray(written[name]), x):
      raise AssertionError(f"consolidate.py's {name} differs from the state's")


def main(argv=None) -> int:
  args = parse_args(argv)
  if args.delay and (args.restore or args.nan):
    raise SystemExit("--delay runs alone: its reference has no checkpoint or NaN step.")
  if args.precision == "bf16" and (args.restore or args.delay):
    raise SystemExit("--precision bf16 compares each trial with its all-device twin; "
                     "it takes no --restore or --delay.")
  flags = os.environ.get("XLA_FLAGS", "")
  if "device_count" not in flags:
    os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={args.devices}"
  import numpy as np

  counts = {"passed": 0, "refused": 0, "failed": 0}
  seeds = args.seeds or range(args.seed, args.seed + args.trials)
  for i, seed in enumerate(seeds):
    rng = np.random.default_rng(seed)
    trial = draw(rng, args.layers, args.devices, args.lora)
    second = draw(rng, args.layers, args.devices, args.lora) if args.restore else None
    if second is not None:  # the same optimizer (its hyperparameters and state layout)
      second.update(clip=trial["clip"], optax=False)
      if second["zero"]["stage"] == 3:  # the same params train
        second["zero"]["trainable"] = trial["zero"].get("trainable")
      else:
        trial["zero"].pop("trainable", None)
      trial["optax"] = False
    nan_step = int(rng.integers(1, STEPS)) if args.nan else None
    if args.delay and trial["zero"]["stage"] == 3:
      trial["zero"]["delay_update"] = str(rng.choice(["tail", "all"]))
    if nan_step is not None:  # a NaN applied poisons every later step: nothing to compare
      trial["zero"]["skip_nonfinite"] = True
      if second is not None:
        second["zero"]["skip_nonfinite"] = True
    trial["zero"]["precision"] = args.precision
    shape = draw_model(rng, args)
    make_model = model_maker(args.model, shape)
    data = batches(seed, shape["vocab_size"], nan_step)
    label = (f"trial {i} (seed {seed}): {args.model} {shape} {trial}"
             + (f" then {second}" if second else ""))
    faulthandler.dump_traceback_later(args.timeout, exit=True)
    t0 = time.perf_counter()
    try:
      with tempfile.TemporaryDirectory(prefix="zinfjax-fuzz-") as folder:
        losses, params, delayed = run_trial(trial, second, make_model, data, folder)
    except ValueError as e:
      counts["refused"] += 1
      print(f"REFUSED {label}\n  {str(e).splitlines()[0][:300]}", flush=True)
      continue
    except Exception as e:  # noqa: BLE001 - every other error is a finding
      counts["failed"] += 1
      print(f"FAILED  {label}\n  {type(e).__name__}: {e}", flush=True)
      continue
    finally:
      faulthandler.cancel_dump_traceback_later()
    trainable = trial["zero"].get("trainable")
    if args.precision == "bf16":
      with tempfile.TemporaryDirectory(prefix="zinfjax-fuzz-") as folder:
        twin_losses, twin_params, _ = run_trial(device_twin(trial), None, make_model, data,
                                                folder)
      want = (twin_losses, initial_params(make_model), twin_params)
      zero = trial["zero"]
      only_params_move = zero["stage"] == 3 and zero.get("offload_optimizer") == "device"
      tol, floor = EXACT if only_params_move else BF16, None
    else:
      plain = reference(make_model, trial["clip"], data, nan_step, trainable)
      want = (delayed_reference(make_model, trial["clip"], data, trainable, delayed) if delayed
              else plain)
      tol, floor = calibrated(FP32, plain, make_model, trial["clip"], data, nan_step, trainable)
    problem = compare(losses, params, *want, tol)
    worst = measure(losses, params, *want, tol.init_rtol)
    counts["failed" if problem else "passed"] += 1
    print(f"{'MISMATCH' if problem else 'ok'}      {label} [{time.perf_counter() - t0:.1f} s; "
          f"worst: loss {worst['loss']:.1e}, leaf {worst['leaf']:.1e}, element "
          f"{worst['element']:.1e}" + (f"; the reference against itself one ulp away: element "
          f"{floor['element']:.1e}" if floor and tol != FP32 else "") + "]"
          + (f"\n  {problem}" if problem else ""), flush=True)
  print(" ".join(f"{k}={v}" for k, v in counts.items()), flush=True)
  return 1 if counts["failed"] else 0


if __name__ == "__main__":
  sys.exit(main())
