"""Host RAM of the host pipeline's new params for params on the device, by depth.

  python scripts/bench_host_ram.py --layers 4 8 16 --hidden 256 --devices 2

Params on the device, their optimizer in a swap store (RAM's, or the drive's with
`--optimizer nvme`), bf16, in the same run for each depth:

  after the update   every layer's new params kept on the host until the update
                     ends, then put back (`PutBack.wants` answering no)
  as made, fresh     each layer put back once this process's ranks have made it, into
                     new host arrays each step (their pages faulted in as the update
                     writes them)
  as made            the same, into host arrays whose copy on the device is done
                     (`putback.HostPool`, the default)

With `--delay-update all` (every update one step late, beside the next program), the rows
compare instead where the new params of a whole segment are made each step:

  fresh each step    new host buffers (their pages faulted in as the update writes them)
  reused             the buffers the step before put back on the device (the default)

Prints the host arrays at the step's peak (Python's `tracemalloc` over one step
after the first: numpy's arrays; the store's own mapping is not traced) against
the model's bf16 params and one layer of them, the median step time and the host's
update in it (`optimizer_s`), and the loss (equal in every row: the same update).
On a CPU each layer goes to the device as a copy (a CPU device may alias the array
it is given), which costs what reuse saves; on a GPU there is no copy.

With `--part-elements N`, also what a new array costs the kernel itself: one AdamW
call over a part of N elements (bf16 grads and params) writing its new params into a
new array each call, against the same array again, by thread count:

  python scripts/bench_host_ram.py --part-elements 104857600
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
  p.add_argument("--layers", type=int, nargs="+", default=None,
                 help="model depths (default 4 8 16; none with --part-elements alone)")
  p.add_argument("--hidden", type=int, default=256)
  p.add_argument("--seq-len", type=int, default=64)
  p.add_argument("--batch-size", type=int, default=16)
  p.add_argument("--devices", type=int, default=2)
  p.add_argument("--steps", type=int, default=3, help="timed steps per row (after two)")
  p.add_argument("--optimizer", default="pinned_host", choices=("pinned_host", "nvme"))
  p.add_argument("--nvme-path", default=None)
  p.add_argument("--delay-update", default="none", choices=("none", "all"))
  p.add_argument("--part-elements", type=int, default=0,
                 help="also time the kernel over one part this large, new or reused params out")
  p.add_argument("--threads", default="1,2,16", help="kernel threads for --part-elements")
  args = p.parse_args(argv)
  args.layers = args.layers or ([] if args.part_elements else [4, 8, 16])
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
  if args.layers:
    print(f"params on the device, optimizer in {args.optimizer} (host pipeline), bf16, "
          f"{args.devices} {jax.devices()[0].platform} devices, batch {args.batch_size} x "
          f"{args.seq_len}, delay_update {args.delay_update}")
    print("| layers | params | new params | host arrays at the peak | x bf16 params "
          "| x one layer | step s | update s | loss |")
    print("|---|---|---|---|---|---|---|---|---|")
  wants, reuse, give = putback.PutBack.wants, pipeline.reuse, putback.HostPool.give
  # (kept until the update ends, the new params are made fresh each step: the row's peak)
  rows = ((("go back after the update", True, False), ("go back as made, fresh", False, False),
           ("go back as made", False, True))
          if args.delay_update == "none" else
          (("fresh each step", False, False), ("reused", False, True)))
  for layers in args.layers:
    config = get_config("tiny", num_layers=layers, hidden=args.hidden, seq_len=args.seq_len,
                        vocab_size=vocab)
    data = TokenDataset(tokens, config.seq_len, args.batch_size, seed=0)
    batches = [next(data) for _ in range(args.steps + 2)]
    for name, late, reused in rows:
      putback.PutBack.wants = (lambda self, leaf, layer: False) if late else wants
      pipeline.reuse = reuse if reused else (lambda free, shape, dtype: np.empty(shape, dtype))
      putback.HostPool.give = give if reused else (lambda self, arrays: None)
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
  putback.PutBack.wants, pipeline.reuse, putback.HostPool.give = wants, reuse, give
  if args.part_elements:
    print(f"\none kernel call over {args.part_elements:,} elements, the new params into:")
    print("| threads | a new array ms | the same array again ms | new / again |")
    print("|---|---|---|---|")
    for threads in (int(t) for t in args.threads.split(",")):
      new, again = part_call(args.part_elements, threads, max(3, args.steps))
      print(f"| {threads} | {new * 1e3:.3g} | {again * 1e3:.3g} | {new / again:.2f}x |",
            flush=True)
  return 0


def part_call(n: int, threads: int, repeats: int) -> tuple[float, float]:
  """Median seconds of one AdamW call over n elements, its bf16 params out to a new array each
  call (its pages faulted in and zeroed as the kernel writes them), and to one array reused."""
  import ml_dtypes
  import numpy as np
  from zinfjax.optim.kernel import AdamConstants, adamw_numpy
  rng, c, bf16 = np.random.default_rng(0), AdamConstants(0.9, 0.999, 1e-8), ml_dtypes.bfloat16
  master, m, v = rng.standard_normal(n, np.float32), np.ones(n, np.float32), np.ones(n, np.float32)
  grad, kept = (rng.standard_normal(n, np.float32) * 1e-3).astype(bf16), np.zeros(n, bf16)
  new, again = [], []
  for step in range(1, repeats + 2):
    t0 = time.perf_counter()
    adamw_numpy(master, m, v, grad, np.empty(n, bf16), 1e-4, 0.1, 0.001, c, 0.0, threads, step)
    t1 = time.perf_counter()
    adamw_numpy(master, m, v, grad, kept, 1e-4, 0.1, 0.001, c, 0.0, threads, step)
    new.append(t1 - t0)
    again.append(time.perf_counter() - t1)
  return statistics.median(new[1:]), statistics.median(again[1:])  # the first: warm-up


if __name__ == "__main__":
  sys.exit(main())
