"""Adam's moments in bf16 against fp32 on a real loss curve (tinyshakespeare, char GPT).

  python scripts/bench_moments.py                      # "small" GPT, 300 steps, on CPU or GPU
  python scripts/bench_moments.py --steps 50 --preset tiny

Trains the same model from the same init on the same batches with
`zinfjax.optim.adamw(moment_dtype=...)`: fp32 moments (12 optimizer bytes per parameter) and
bf16 moments with stochastic rounding (8 bytes). Prints the training loss (mean of each
stretch of steps) and a held-out loss for both, the gap, and the optimizer state bytes the
plan counts, with the time per step. The gap is the price of the bytes saved.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--preset", default="small", help="GPT preset (char vocabulary)")
  p.add_argument("--steps", type=int, default=300)
  p.add_argument("--batch-size", type=int, default=16)
  p.add_argument("--seq-len", type=int, default=128)
  p.add_argument("--lr", type=float, default=1e-3)
  p.add_argument("--offload", default="device", help="ZeroConfig.offload_optimizer")
  p.add_argument("--nvme-path", default=None)
  p.add_argument("--every", type=int, default=50, help="steps per row")
  return p.parse_args(argv)


def run(args, moment_dtype, train, held_out) -> dict:
  import jax.numpy as jnp
  import optax
  import zinfjax
  from zinfjax.models import GPT, get_config, lm_loss
  config = get_config(args.preset, seq_len=args.seq_len, vocab_size=65)
  schedule = optax.warmup_cosine_decay_schedule(0.0, args.lr, max(1, args.steps // 10), args.steps)
  tx = zinfjax.optim.adamw(schedule, weight_decay=0.1, moment_dtype=moment_dtype)
  zero = zinfjax.ZeroConfig(offload_param="device", offload_optimizer=args.offload,
                            nvme_path=args.nvme_path)
  losses, t0 = [], None
  with zinfjax.init(lambda r: GPT(config, rngs=r), tx, zero, zinfjax.make_mesh(), 0) as state:
    plan = state.engine.plan
    for i, batch in enumerate(train):
      if i == 1:
        t0 = time.perf_counter()
      state, metrics = zinfjax.train_step(state, batch, lm_loss)
      losses.append(float(metrics["loss"]))
    step_s = (time.perf_counter() - t0) / max(1, len(train) - 1)
    evals = [float(zinfjax.eval_step(state, b, lm_loss)["loss"]) for b in held_out]
    optimizer = plan.optimizer_bytes * sum(l.local_size * l.num_layers for l in plan.leaves
                                           if l.trainable)
  return {"dtype": jnp.dtype(moment_dtype).name, "losses": np.asarray(losses),
          "held_out": float(np.mean(evals)), "step_s": step_s, "optimizer_bytes": optimizer,
          "optimizer_bytes_per_element": plan.optimizer_bytes, "params": config.num_params}


def main(argv=None) -> int:
  args = parse_args(argv)
  import jax
  import jax.numpy as jnp
  from zinfjax.models import TokenDataset, load_tokens
  tokens, _ = load_tokens(os.path.join(REPO, "data", "tinyshakespeare.txt"))
  cut = int(len(tokens) * 0.9)
  devices = len(jax.devices())
  batch = max(devices, args.batch_size // devices * devices)
  train_data = TokenDataset(tokens[:cut], args.seq_len, batch, seed=0)
  test_data = TokenDataset(tokens[cut:], args.seq_len, batch, seed=1)
  train = [next(train_data) for _ in range(args.steps)]
  held_out = [next(test_data) for _ in range(8)]
  print(f"{jax.devices()[0].device_kind}: {args.preset} GPT, {args.steps} steps of {batch} x "
        f"{args.seq_len} tokens, optimizer on {args.offload}", flush=True)
  runs = [run(args, dtype, train, held_out) for dtype in (jnp.float32, jnp.bfloat16)]
  a, b = runs
  print(f"\n{a['params'] / 1e6:.1f}M params\n")
  print("| steps | train loss, fp32 moments | train loss, bf16 moments | bf16 - fp32 |")
  print("|---|---|---|---|")
  for s in range(0, args.steps, args.every):
    x, y = a["losses"][s:s + args.every].mean(), b["losses"][s:s + args.every].mean()
    print(f"| {s + 1}-{min(s + args.every, args.steps)} | {x:.4f} | {y:.4f} | {y - x:+.4f} |")
  print(f"| held out, after training | {a['held_out']:.4f} | {b['held_out']:.4f} "
        f"| {b['held_out'] - a['held_out']:+.4f} ({(b['held_out'] / a['held_out'] - 1):+.2%}) |")
  print(f"| optimizer state (plan) | {a['optimizer_bytes'] / 2**20:.1f} MiB, "
        f"{a['optimizer_bytes_per_element']} B/param | {b['optimizer_bytes'] / 2**20:.1f} MiB, "
        f"{b['optimizer_bytes_per_element']} B/param | {b['optimizer_bytes'] / a['optimizer_bytes'] - 1:+.0%} |")
  print(f"| step time | {a['step_s'] * 1e3:.0f} ms | {b['step_s'] * 1e3:.0f} ms | |")
  return 0


if __name__ == "__main__":
  sys.exit(main())
