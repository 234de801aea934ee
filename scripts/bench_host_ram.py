"""Host RAM of the host pipeline's new params for params on the device, by depth.

  python scripts/bench_host_ram.py --layers 4 8 16 --hidden 256 --devices 2

Params on the device, their optimizer in a swap store (RAM's, or the drive's with
`--optimizer nvme`), bf16, in the same run for each depth:

  after the update   every layer's new params kept on the host until the update
                     ends, then put back (`PutBack.wants` answering no)
  as made            each layer put back once this process's ranks have made it
                     (the default)

With `--delay-update all` (every update one step late, beside the next program), the rows
compare instead where the new params of a whole segment are made each step:

  fresh each step    new host buffers (their pages faulted in as the update writes them)
  reused             the buffers the step before put back on the device (the default)

Prints the host arrays at the step's peak (Python's `tracemalloc` over one step
after the first: numpy's arrays; the store's own mapping is not traced) against
the model's bf16 params and one layer of them, the median step time and the host's
update in it (`optimizer_s`), and the loss (equal in both rows: the same update).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
import tracemalloc


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--layers", type=int, nargs="+", default=[4, 8, 16])
  p.add_argument("--hidden", type=int, default=256)
  p.add_argument("--seq-len", type=int, default=64)
  p.add_argument("--batch-size", type=int, default=16)
  p.add_argument("--devices", type=int, default=2)
  p.add_argument("--steps", type=int, default=3, help="timed steps per row (after two)")
  p.add_argument("--optimizer", default="pinned_host", choices=("pinned_host", "nvme"))
  p.add_argument("--nvme-path", default=None)
  p.add_argument("--delay-update", default="none", choices=("none", "all"))
  args = p.parse_args(argv)
  flags = os.environ.get("XLA_FLAGS", "")
  os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={args.devices}"
  import jax
  import zinfjax
  import numpy as np
  from zinfjax import putback
  from zinfjax.optim import pipeline
  from zinfjax.models import GPT, TokenDataset, get_config, lm_loss, load_tokens

  tokens, vocab = load_tokens(os.path.join(os.path.dirname(__file__), "..", "data",
                                           "tinyshakespeare.txt"))
  mesh = zinfjax.make_mesh(args.devices)
  root = args.nvme_path or tempfile.mkdtemp(prefix="zinfjax-bench-host-ram-")
  print(f"params on the device, optimizer in {args.optimizer} (host pipeline), bf16, "
        f"{args.devices} {jax.devices()[0].platform} devices, batch {args.batch_size} x "
        f"{args.seq_len}, delay_update {args.delay_update}")
  print("| layers | params | new params | host arrays at the peak | x bf16 params "
        "| x one layer | step s | update s | loss |")
  print("|---|---|---|---|---|---|---|---|---|")
  wants, reuse = putback.PutBack.wants, pipeline.reuse
  fresh = lambda free, shape, dtype: np.empty(shape, dtype)
  # (kept until the update ends, the new params are made fresh each step: the row's peak)
  rows = ((("go back after the update", True, fresh), ("go back as made", False, reuse))
          if args.delay_update == "none" else
          (("fresh each step", False, fresh), ("reused", False, reuse)))
  for layers in args.layers:
    config = get_config("tiny", num_layers=layers, hidden=args.hidden, seq_len=args.seq_len,
                        vocab_size=vocab)
    data = TokenDataset(tokens, config.seq_len, args.batch_size, seed=0)
    batches = [next(data) for _ in range(args.steps + 2)]
    for name, late, made in rows:
      putback.PutBack.wants = (lambda self, leaf, layer: False) if late else wants
      pipeline.reuse = made
      zero = zinfjax.ZeroConfig(precision="bf16", offload_param="device",
                                offload_optimizer=args.optimizer, host_optimizer="pipeline",
                                nvme_path=os.path.join(root, f"{layers}-{name}"),
                                delay_update=args.delay_update)
      state = zinfjax.init(lambda r: GPT(config, rngs=r), zinfjax.optim.adamw(1e-3), zero, mesh, 0)
      state, _ = zinfjax.train_step(state, batches[0], lm_loss)  # compiled
      tracemalloc.start()
      state, _ = zinfjax.train_step(state, batches[1], lm_loss)
      jax.block_until_ready(state.params)
      peak = tracemalloc.get_traced_memory()[1]
      tracemalloc.stop()
      times, updates = [], []
      for batch in batches[2:]:
        t0 = time.perf_counter()
        state, metrics = zinfjax.train_step(state, batch, lm_loss)
        jax.block_until_ready(state.params)
        times.append(time.perf_counter() - t0)
        updates.append(metrics["optimizer_s"])
      plan = state.engine.plan
      params = sum(l.local_size * l.num_layers for l in plan.leaves) * len(plan.ranks) * 2
      layer = sum(l.local_size for l in plan.leaves if l.stacked) * len(plan.ranks) * 2
      print(f"| {layers} | {params / 2 / 1e6:.2f}M | {name} | {peak / 1e6:.2f} MB "
            f"| {peak / params:.2f} | {peak / layer:.1f} | {statistics.median(times):.3f} "
            f"| {statistics.median(updates):.3f} | {float(metrics['loss']):.6f} |", flush=True)
      state.close()
  putback.PutBack.wants, pipeline.reuse = wants, reuse
  return 0


if __name__ == "__main__":
  sys.exit(main())
