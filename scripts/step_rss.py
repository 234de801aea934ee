"""Where a training step's host memory goes, against the plan's count: the peak RSS of one
step (after a first, compiling one), numpy's arrays traced, the program's own temporaries.

  python scripts/step_rss.py --hidden 1024 --layers 42 --offload-param device:40,pinned_host \
      --offload-optimizer pinned_host:39,nvme --bf16-moments

The GPT of `train_gpt.py`'s tiny preset at `--hidden` x `--layers` with that placement (the host
pipeline; NVMe steps rewritten in place, as `largest_gpt.py` runs them) takes two steps on one
batch. Through the second, the kernel keeps this process's peak RSS (reset at its start,
`zinfjax.progress.reset_peak_rss`), and `tracemalloc` traces numpy's arrays: the host
pipeline's grads on their way and new params on their way back. The table puts them beside
the plan's host arrays (`autoplace.host_array_bytes`), its states per tier, and the compiled
program's temporaries (`memory_analysis()`): on a CPU the device is host memory, so the
program's temporaries show in RSS; on a GPU they are HBM.
"""

from __future__ import annotations

import argparse
import sys
import time
import tracemalloc

MIB = 1 << 20


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--hidden", type=int, default=1024)
  p.add_argument("--heads", type=int, default=8)
  p.add_argument("--layers", type=int, default=42)
  p.add_argument("--seq-len", type=int, default=256)
  p.add_argument("--batch-size", type=int, default=4)
  p.add_argument("--offload-param", default="device:40,pinned_host")
  p.add_argument("--offload-optimizer", default="pinned_host:39,nvme")
  p.add_argument("--bf16-moments", action="store_true")
  p.add_argument("--delay-update", default="none", choices=("none", "tail", "all"),
                 help="ZeroConfig.delay_update (the second step then holds the first's grads)")
  p.add_argument("--nvme-path", default="/tmp/zinfjax-step-rss")
  p.add_argument("--pinned-budget", type=int, default=192, help="MiB of pinned buffers for NVMe")
  args = p.parse_args(argv)

  import jax
  import numpy as np
  import zinfjax
  from zinfjax.autoplace import host_array_bytes, need
  from zinfjax.models import GPT, get_config, lm_loss
  from zinfjax.progress import peak_rss, reset_peak_rss, rss

  config = get_config("tiny", num_layers=args.layers, hidden=args.hidden, num_heads=args.heads,
                      vocab_size=65, seq_len=args.seq_len)
  zero = zinfjax.ZeroConfig(precision="bf16", offload_param=args.offload_param,
                            offload_optimizer=args.offload_optimizer, host_optimizer="pipeline",
                            nvme_path=args.nvme_path, nvme_atomic_steps=False,
                            pinned_budget=args.pinned_budget << 20,
                            delay_update=args.delay_update)
  tx = zinfjax.optim.adamw(1e-6, moment_dtype="bfloat16" if args.bf16_moments else "float32")
  state = zinfjax.init(lambda r: GPT(config, rngs=r), tx, zero, zinfjax.make_mesh(), 0)
  tokens = np.random.default_rng(0).integers(0, 65, (args.batch_size, args.seq_len + 1))
  batch = {"inputs": tokens[:, :-1].astype(np.int32), "targets": tokens[:, 1:].astype(np.int32)}
  step = zinfjax.make_train_step(state, lm_loss)
  program = step.jitted.lower(state, batch).compile().memory_analysis()
  state, first = step(state, batch)
  jax.block_until_ready(state.params)

  if not reset_peak_rss():  # the kernel's own peak, from the step's start on
    raise SystemExit("this kernel does not let /proc/self/clear_refs reset the peak RSS")
  start = rss()
  tracemalloc.start()
  t0 = time.perf_counter()
  state, second = step(state, batch)
  jax.block_until_ready(state.params)
  seconds = time.perf_counter() - t0
  numpy_peak = tracemalloc.get_traced_memory()[1]
  tracemalloc.stop()
  peak, after = peak_rss(), rss()

  engine = state.engine
  plan, run = engine.plan, engine.config
  states = {str(t): b for t, b in need(plan, run).items() if b}
  arrays = host_array_bytes(plan, run)
  print(f"GPT {args.layers} x {args.hidden} ({config.num_params / 1e9:.2f}B params), "
        f"{args.batch_size} x {args.seq_len} tokens, params {args.offload_param}, optimizer "
        f"{args.offload_optimizer}, delay_update {args.delay_update}, on "
        f"{jax.devices()[0].platform}; loss {float(first['loss']):.4f}"
        f" -> {float(second['loss']):.4f}; the second step {seconds:.1f} s\n")
  print("| | MiB |\n|---|---|")
  rows = [*(f"plan: {t} (per device)" for t in states), "plan: host arrays (of pinned host)",
          "program: temporaries", "RSS at the step's start", "RSS at its peak",
          "RSS after it", "numpy's arrays at their peak"]
  values = [*states.values(), arrays, program.temp_size_in_bytes, start,
            peak, after, numpy_peak]
  for name, value in zip(rows, values):
    print(f"| {name} | {value / MIB:.3f} |")
  state.close()
  return 0


if __name__ == "__main__":
  sys.exit(main())
