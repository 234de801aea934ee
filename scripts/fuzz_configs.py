"""Random ZeroConfigs trained against the plain single-device optax reference.

  python scripts/fuzz_configs.py --trials 40 --seed 0 [--restore] [--nan]
  python scripts/fuzz_configs.py --seeds 9 14 --restore --nan      # trials to reproduce

Each trial draws a config: the stage, a tier (or a per-layer split of tiers) for the params
and for the optimizer states, or offload="auto" with random tier budgets, the host
optimizer, all-or-nothing steps on NVMe and in RAM, prefetch depths, tiles, micro-batches,
the layer scan's residual policy, which params train (all; the blocks alone; all but the
layer norms), clipping (never, always) and the mesh size. It trains a
tiny GPT in fp32 on random tokens with that config and with optax's AdamW (clipping chained
in front) on one device, and compares every step's loss and the final fp32 params.

--nan gives one step a NaN loss: with skip_nonfinite (the default) that step must change
nothing, and the reference skips it. --restore saves a checkpoint halfway, closes the run
and goes on from the checkpoint restored onto a second random config (another placement,
another device count): the result must still equal the uninterrupted reference.

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

STEPS, BATCH, SEQ = 6, 16, 32
# fp32 in another summation order: losses to 2e-5; in each param leaf, the mean error to 1e-3
# of the mean change training made (plus 1e-6 of the leaf's mean size: zinfjax draws the
# initial params in a compiled program, a few units in the last place from nnx's eager ones,
# which a frozen leaf keeps), and no element off by more than 1e-4 (a fortieth of one step at
# the peak learning rate: an element whose grads stay near zero moves by Adam's sign of them,
# which that order can flip)
LOSS_RTOL, LEAF_RTOL, INIT_RTOL, PARAM_ATOL = 2e-5, 1e-3, 1e-6, 1e-4
TIERS = ("device", "pinned_host", "nvme")


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--trials", type=int, default=20)
  p.add_argument("--seed", type=int, default=0, help="trial i draws from seed + i")
  p.add_argument("--seeds", type=int, nargs="+", help="run the trials of these seeds instead")
  p.add_argument("--layers", type=int, default=3)
  p.add_argument("--restore", action="store_true", help="checkpoint halfway, resume elsewhere")
  p.add_argument("--nan", action="store_true", help="one step's loss is NaN")
  p.add_argument("--delay", action="store_true",
                 help="draw delay_update ('tail' or 'all'; not with --restore or --nan)")
  p.add_argument("--timeout", type=float, default=600.0, help="seconds per trial")
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


def draw(rng, layers: int, devices: int) -> dict:
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
  dp = pick(*[n for n in (1, 2, 4, 8) if n <= devices])
  return dict(zero=zero, clip=pick(None, 0.5, 1e3), dp=dp, optax=pick(True, False))


# `ZeroConfig.trainable` by name: which params train (the others stay frozen)
TRAINABLE = {
    "blocks": lambda path, _: "blocks" in map(str, path),  # embeddings and final norm frozen
    "no_norms": lambda path, _: not any(str(p).startswith("ln") for p in path),
}


def wrt(name: str | None):
  """The nnx filter of the params a trial trains (every `nnx.Param`, or those of `name`)."""
  from flax import nnx
  return nnx.Param if name is None else nnx.All(nnx.Param, TRAINABLE[name])


def schedule():
  import optax
  return optax.linear_schedule(1e-3, 4e-3, 4)  # the step count matters: a skip must not advance it


def reference_tx(clip):
  import optax
  adamw = optax.adamw(schedule(), weight_decay=0.1)
  return adamw if clip is None else optax.chain(optax.clip_by_global_norm(clip), adamw)


def trial_tx(trial, zero):
  """optax's chain where `zero` keeps the optimizer on the device and the trial says so; else
  zinfjax's AdamW (any optimizer tier), the same update."""
  import zinfjax
  on_device = not zero.offload and zero.optimizer_split == (("device", None),)
  if on_device and trial["optax"]:
    return reference_tx(trial["clip"])
  return zinfjax.optim.adamw(schedule(), weight_decay=0.1, max_grad_norm=trial["clip"])


def scaled_loss(model, batch):
  """The LM loss times the batch's `scale` (NaN in one step with --nan)."""
  from zinfjax.models import lm_loss
  return lm_loss(model, batch) * batch["scale"][0]


def batches(seed: int, vocab: int, nan_step: int | None) -> list[dict]:
  import numpy as np
  rng = np.random.default_rng(seed)
  out = []
  for i in range(STEPS):
    scale = np.full((BATCH,), np.nan if i == nan_step else 1.0, np.float32)
    out.append({"inputs": rng.integers(0, vocab, (BATCH, SEQ)).astype(np.int32),
                "targets": rng.integers(0, vocab, (BATCH, SEQ)).astype(np.int32), "scale": scale})
  return out


def reference(make_model, clip, data, nan_step, trainable=None):
  """Losses, initial and final params of optax on one device, training the params
  `trainable` names; the NaN step is skipped (its loss kept)."""
  import jax
  import numpy as np
  from flax import nnx
  with jax.default_device(jax.devices()[0]):
    model = make_model(nnx.Rngs(jax.random.key(0)))
    leaves = lambda: [np.asarray(x) for x in jax.tree.leaves(
        nnx.to_pure_dict(nnx.state(model, nnx.Param)))]
    initial = leaves()
    optimizer = nnx.Optimizer(model, reference_tx(clip), wrt=wrt(trainable))

    @nnx.jit(static_argnames="apply")
    def step(model, optimizer, batch, apply):
      diff = nnx.DiffState(0, wrt(trainable))
      loss, grads = nnx.value_and_grad(scaled_loss, argnums=diff)(model, batch)
      if apply:
        optimizer.update(model, grads)
      return loss

    losses = [float(step(model, optimizer, b, apply=i != nan_step)) for i, b in enumerate(data)]
    return np.asarray(losses), initial, leaves()


def delayed_reference(make_model, clip, data, trainable, delayed: dict[str, set[int]]):
  """`reference` where the parts `delayed` names see each step's grads one step late."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  from flax import nnx
  with jax.default_device(jax.devices()[0]):
    model = make_model(nnx.Rngs(jax.random.key(0)))
    leaves = lambda: [np.asarray(x) for x in jax.tree.leaves(
        nnx.to_pure_dict(nnx.state(model, nnx.Param)))]
    initial = leaves()
    graphdef, everything = nnx.split(model)
    params = nnx.to_pure_dict(nnx.state(model, wrt(trainable)))
    base = nnx.to_pure_dict(everything)

    def overlay(d, p):  # `d` with the trained params `p` in place of its own
      return {k: overlay(v, p[k]) if isinstance(v, dict) and k in p else p.get(k, v)
              for k, v in d.items()}

    def loss(p, base, batch):
      s = jax.tree.map(lambda x: x, everything)
      nnx.replace_by_pure_dict(s, overlay(base, p))
      return scaled_loss(nnx.merge(graphdef, s), batch)

    def late_mask(path, x):  # a stacked leaf's delayed layers, or the whole leaf
      layers = delayed.get("/".join(str(k.key) for k in path), set())
      if x.ndim and "blocks" in str(path[0].key):
        return jnp.asarray([i in layers for i in range(x.shape[0])]).reshape(
            (-1,) + (1,) * (x.ndim - 1))
      return jnp.asarray(bool(layers))

    mask = jax.tree_util.tree_map_with_path(late_mask, params)
    grad, tx = jax.jit(jax.value_and_grad(loss)), reference_tx(clip)
    now, late, held, losses = tx.init(params), tx.init(params), None, []
    for batch in data:
      value, g = grad(params, base, batch)
      losses.append(float(value))
      u_now, now = tx.update(g, now, params)
      u_late = jax.tree.map(jnp.zeros_like, g)
      if held is not None:
        u_late, late = tx.update(held, late, params)
      params = jax.tree.map(lambda p, m, a, b: p + jnp.where(m, b, a), params, mask, u_now, u_late)
      held = g
    nnx.replace_by_pure_dict(everything, overlay(base, params))
    nnx.update(model, everything)
    return np.asarray(losses), initial, leaves()


def config(trial, folder: str):
  import zinfjax
  kw = dict(trial["zero"])
  if kw.get("stage", 3) == 3:
    kw["nvme_path"] = folder
  if kw.get("trainable") is not None:
    kw["trainable"] = TRAINABLE[kw["trainable"]]
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
  import zinfjax.checkpoint
  state = start(trial, make_model, os.path.join(folder, "a"))
  delayed: dict[str, set[int]] = {}
  pipeline = state.engine.pipeline
  for part in [p for u in (pipeline.tail if pipeline else ()) for p in u.parts]:
    delayed.setdefault(state.engine.plan.leaves[part.leaf].name, set()).add(part.layer)
  losses = []
  for i, batch in enumerate(data):
    if second is not None and i == STEPS // 2:
      ckpt = zinfjax.checkpoint.Checkpointer(os.path.join(folder, "ckpt"))
      ckpt.save(state)
      ckpt.wait()
      state.close()
      zero = config(second, os.path.join(folder, "b"))
      state, _ = ckpt.restore(make_model, trial_tx(second, zero), zero,
                              zinfjax.make_mesh(second["dp"]))
      ckpt.close()
    state, metrics = zinfjax.train_step(state, batch, scaled_loss)
    losses.append(float(metrics["loss"]))
  params = [np.asarray(x) for x in jax.tree.leaves(state.full_params())]
  state.close()
  return losses, params, delayed


def compare(losses, params, want_losses, initial, want_params) -> str | None:
  """None when they agree to the tolerances; else what differs."""
  import numpy as np
  got = np.asarray(losses)
  if not np.allclose(got, want_losses, rtol=LOSS_RTOL, atol=0, equal_nan=True):
    return f"losses {got.tolist()} != {want_losses.tolist()}"
  for i, (a, b, b0) in enumerate(zip(params, want_params, initial)):
    change, size = np.mean(np.abs(b - b0)), np.mean(np.abs(b))
    leaf_err = np.mean(np.abs(a - b)) / max(change + INIT_RTOL / LEAF_RTOL * size, 1e-30)
    if leaf_err > LEAF_RTOL or np.max(np.abs(a - b)) > PARAM_ATOL:
      return (f"param leaf {i} {b.shape}: off by {leaf_err:.2e} of the change training made, "
              f"one element by {np.max(np.abs(a - b)):.2e}")
  return None


def main(argv=None) -> int:
  args = parse_args(argv)
  if args.delay and (args.restore or args.nan):
    raise SystemExit("--delay runs alone: its reference has no checkpoint or NaN step.")
  flags = os.environ.get("XLA_FLAGS", "")
  if "device_count" not in flags:
    os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={args.devices}"
  import numpy as np
  from zinfjax.models import GPT, get_config

  gpt = get_config("tiny", num_layers=args.layers)
  make_model = lambda r: GPT(gpt, rngs=r)
  counts = {"passed": 0, "refused": 0, "failed": 0}
  seeds = args.seeds or range(args.seed, args.seed + args.trials)
  for i, seed in enumerate(seeds):
    rng = np.random.default_rng(seed)
    trial = draw(rng, args.layers, args.devices)
    second = draw(rng, args.layers, args.devices) if args.restore else None
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
    data = batches(seed, gpt.vocab_size, nan_step)
    label = f"trial {i} (seed {seed}): {trial}" + (f" then {second}" if second else "")
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
    want = (delayed_reference(make_model, trial["clip"], data, trainable, delayed) if delayed
            else reference(make_model, trial["clip"], data, nan_step, trainable))
    problem = compare(losses, params, *want)
    counts["failed" if problem else "passed"] += 1
    print(f"{'MISMATCH' if problem else 'ok'}      {label} [{time.perf_counter() - t0:.1f} s]"
          + (f"\n  {problem}" if problem else ""), flush=True)
  print(" ".join(f"{k}={v}" for k, v in counts.items()), flush=True)
  return 1 if counts["failed"] else 0


if __name__ == "__main__":
  sys.exit(main())
