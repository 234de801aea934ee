"""Layer-major micro-batches with params and optimizer on NVMe: the I/O hides as N grows.

  python scripts/bench_micro.py --layers 8 --hidden 512 --micro-batch 8 --counts 1 2 4 8 \\
      --devices 8 --nvme-path /local_nvme/bench

For each number of micro-batches N (a fixed micro-batch, so the global batch
is N x micro-batch), in the same run:

* compute alone: the step with every state on the device, same N;
* the step with params and optimizer states on NVMe (`micro_batches=N`);
* the bytes the swap store read and wrote during one step (its counters):
  with layer-major micro-batches they do not grow with N;
* I/O alone: the swap store moving one step's bytes with nothing else running
  (once: the bytes do not depend on N).

The NVMe step's ratio to max(compute alone, I/O alone) is 1.0 when the
movement hides completely behind compute: the compute per step grows with N
while the bytes stay fixed, so the ratio to compute alone falls toward 1.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

from bench_step import io_alone, median_step, setup


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--layers", type=int, default=8)
  p.add_argument("--hidden", type=int, default=512)
  p.add_argument("--heads", type=int, default=8)
  p.add_argument("--seq-len", type=int, default=64)
  p.add_argument("--micro-batch", type=int, default=8, help="examples per micro-batch (global)")
  p.add_argument("--counts", type=int, nargs="+", default=[1, 2, 4, 8], help="micro-batches N")
  p.add_argument("--devices", type=int, default=8)
  p.add_argument("--precision", default="fp32", choices=("bf16", "fp32"))
  p.add_argument("--steps", type=int, default=2, help="timed steps per run (after one warm-up)")
  p.add_argument("--nvme-path", default=None, help="swap store folder (default: a temp folder)")
  p.add_argument("--pinned-budget", type=int, default=256, help="MiB")
  args = p.parse_args(argv)
  if args.micro_batch % args.devices:
    p.error(f"--micro-batch {args.micro_batch} must be a multiple of --devices {args.devices}.")
  return args


def main(argv=None) -> int:
  args = parse_args(argv)
  tokens, config, mesh = setup(args)
  import jax
  import zinfjax
  from zinfjax.models import GPT, TokenDataset, lm_loss

  root = args.nvme_path or tempfile.mkdtemp(prefix="zinfjax-bench-micro-")
  tx = zinfjax.optim.adamw(1e-4, weight_decay=0.1)
  print(f"GPT {config.num_layers} x {config.hidden} ({config.num_params / 1e6:.1f}M params), "
        f"micro-batch {args.micro_batch} x {args.seq_len}, {args.precision}, {args.devices} "
        f"{jax.devices()[0].platform} devices, swap store under {root}", flush=True)

  def run(n, offload):
    batch = args.micro_batch * n
    data = TokenDataset(tokens, config.seq_len, batch, seed=0)
    batches = [next(data) for _ in range(args.steps + 1)]
    zero = zinfjax.ZeroConfig(precision=args.precision, offload_param=offload,
                              offload_optimizer=offload, micro_batches=n,
                              pinned_budget=args.pinned_budget << 20,
                              nvme_path=os.path.join(root, f"n{n}"))
    state = zinfjax.init(lambda r: GPT(config, rngs=r), tx, zero, mesh, 0)
    store = state.engine.store
    before = store.bytes_moved if store is not None else (0, 0)
    seconds, state, _ = median_step(state, batches, lm_loss)
    moved = [(b - a) / len(batches) for a, b in zip(before, store.bytes_moved)] if store else None
    return seconds, state, moved

  rows, io = [], None
  for n in args.counts:
    compute, state, _ = run(n, "device")
    del state
    step, state, moved = run(n, "nvme")
    if io is None:
      io = io_alone(state.engine.store)
    state.engine.store.close()
    del state
    tokens_per_step = args.micro_batch * n * args.seq_len
    rows.append((n, args.micro_batch * n, tokens_per_step, compute, step, moved))
    print(f"N={n}: compute alone {compute:.3f} s, NVMe step {step:.3f} s, read "
          f"{moved[0] / 1e6:.1f} MB / written {moved[1] / 1e6:.1f} MB per step", flush=True)

  print(f"\nI/O alone: {io['seconds']:.3f} s ({io['read'] / 1e9:.2f} GB read at "
        f"{io['read_gbs']:.2f} GB/s, {io['written'] / 1e9:.2f} GB written at {io['write_gbs']:.2f} GB/s)\n")
  print("| N | batch | tokens/step | compute alone s | NVMe step s | tokens/s | vs compute alone "
        "| vs max(compute, I/O) | MB read / written per step |")
  print("|---|---|---|---|---|---|---|---|---|")
  for n, batch, tok, compute, step, moved in rows:
    bound = max(compute, io["seconds"])
    print(f"| {n} | {batch} | {tok} | {compute:.3f} | {step:.3f} | {tok / step:,.0f} | "
          f"{step / compute:.2f}x | {step / bound:.2f}x | {moved[0] / 1e6:.1f} / {moved[1] / 1e6:.1f} |")
  return 0


if __name__ == "__main__":
  sys.exit(main())
