"""The NVMe optimizer with gradient clipping: under backward (speculative) vs after it.

  python scripts/bench_clip.py --layers 8 --hidden 512 --devices 8 --nvme-path /local_nvme/x

Params and optimizer on NVMe, one GPT, in the same run:

  no clipping           the optimizer runs under backward (the reference)
  clip, never triggers  speculative update under backward, nothing redone
  clip, always triggers the first step speculative, rolled back and redone; each later one
                        predicted from the step before (it clipped): its update waits
                        for the norm under backward, never redone
  clip, after backward  nvme_atomic_steps=False: the optimizer waits for the norm

Prints the median step time (after a warm-up step) and each row against the
first: a clipping run whose norm stays under the limit should cost what no
clipping costs; the always-triggering row is the price of clipping every step.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--layers", type=int, default=8)
  p.add_argument("--hidden", type=int, default=512)
  p.add_argument("--seq-len", type=int, default=64)
  p.add_argument("--batch-size", type=int, default=16)
  p.add_argument("--devices", type=int, default=8)
  p.add_argument("--steps", type=int, default=5, help="timed steps per row (after one warm-up)")
  p.add_argument("--nvme-path", default=None)
  args = p.parse_args(argv)
  flags = os.environ.get("XLA_FLAGS", "")
  os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={args.devices}"
  import jax
  import zinfjax
  from zinfjax.models import GPT, TokenDataset, get_config, lm_loss, load_tokens

  tokens, vocab = load_tokens(os.path.join(os.path.dirname(__file__), "..", "data", "tinyshakespeare.txt"))
  config = get_config("tiny", num_layers=args.layers, hidden=args.hidden, seq_len=args.seq_len,
                      vocab_size=vocab)
  mesh = zinfjax.make_mesh(args.devices)
  data = TokenDataset(tokens, config.seq_len, args.batch_size, seed=0)
  batches = [next(data) for _ in range(args.steps + 1)]
  root = args.nvme_path or tempfile.mkdtemp(prefix="zinfjax-bench-clip-")
  rows = [("no clipping", None, True), ("clip, never triggers", 1e9, True),
          ("clip, always triggers", 1e-6, True), ("clip, after backward", 1e9, False)]
  print(f"GPT {config.num_layers} x {config.hidden} ({config.num_params / 1e6:.1f}M params), batch "
        f"{args.batch_size} x {args.seq_len}, fp32, {args.devices} {jax.devices()[0].platform} "
        f"devices, params + optimizer on NVMe under {root}")
  results = []
  for name, clip, atomic in rows:
    zero = zinfjax.ZeroConfig(precision="fp32", offload_param="nvme", offload_optimizer="nvme",
                              nvme_path=os.path.join(root, "run"), nvme_atomic_steps=atomic)
    tx = zinfjax.optim.adamw(1e-4, weight_decay=0.1, max_grad_norm=clip)
    state = zinfjax.init(lambda r: GPT(config, rngs=r), tx, zero, mesh, 0)
    times, redone, predicted, losses = [], 0, 0, []
    for i, batch in enumerate(batches):
      t0 = time.perf_counter()
      state, metrics = zinfjax.train_step(state, batch, lm_loss)
      losses.append(float(metrics["loss"]))
      if i:
        times.append(time.perf_counter() - t0)
        redone += int(metrics.get("nvme_redone", 0))
        predicted += int(metrics.get("nvme_clip_predicted", 0))
    state.close()
    results.append((name, statistics.median(times), redone, predicted, losses[-1]))
  base = results[0][1]
  print("\n| run | step s (median) | vs no clipping | steps redone | clipping predicted | last loss |")
  print("|---|---|---|---|---|---|")
  for name, t, redone, predicted, loss in results:
    print(f"| {name} | {t:.3f} | {t / base:.2f}x | {redone} of {args.steps} | "
          f"{predicted} of {args.steps} | {loss:.4f} |")
  return 0


if __name__ == "__main__":
  sys.exit(main())
