"""Where a training step's time goes: a `jax.profiler` trace of a few steps, and its top kernels.

  python scripts/profile_step.py --out OUT [--offload pinned_host] [--tokens 16384]

Builds the GPT of `scripts/bench_gpu.py` (8 x 2048 by default), runs one
warm-up step, traces `--steps` steps into OUT/trace (open it in TensorBoard
or Perfetto), and prints the kernels (GPU) or XLA ops (CPU) that took the
most time over the traced steps, grouped by name, with their share of the
step, plus the step time. It writes the table to OUT/profile_top.txt and
the rows to OUT/profile_top.json.
"""

from __future__ import annotations

import argparse
import collections
import glob
import json
import os
import sys
import time


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--out", required=True)
  p.add_argument("--layers", type=int, default=8)
  p.add_argument("--hidden", type=int, default=2048)
  p.add_argument("--heads", type=int, default=16)
  p.add_argument("--seq-len", type=int, default=1024)
  p.add_argument("--tokens", type=int, default=16384, help="tokens per step")
  p.add_argument("--offload", default="device", help="offload_param and offload_optimizer")
  p.add_argument("--layer-residuals", default="auto", choices=("recompute", "save", "dots", "auto"))
  p.add_argument("--host-optimizer", default="xla", choices=("xla", "pipeline", "stream"),
                 help="ZeroConfig.host_optimizer: pinned-host states updated in XLA's host code, "
                      "by the C++ pipeline under backward (skip_nonfinite off, as bench_gpu's "
                      "pipeline-under row), or on the device, streamed a layer at a time ('stream')")
  p.add_argument("--steps", type=int, default=3, help="traced steps (after one warm-up)")
  p.add_argument("--top", type=int, default=25)
  p.add_argument("--tiny", action="store_true", help="small sizes: a check of the script on CPU")
  return p.parse_args(argv)


def top_events(trace_dir: str, top: int) -> tuple[list[dict], str]:
  """Per event name, total time over the trace: GPU kernels (the device planes' stream lines)
  where there are any, else the host's XLA op events (XLA:CPU)."""
  from jax.profiler import ProfileData
  paths = sorted(glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True))
  if not paths:
    raise FileNotFoundError(f"no .xplane.pb under {trace_dir}: the trace was not written")
  data = ProfileData.from_file(paths[-1])
  totals: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0])
  source = "kernels on /device:GPU streams"
  for plane in data.planes:
    if not plane.name.startswith("/device:GPU"):
      continue
    for line in plane.lines:
      if not line.name.startswith("Stream"):
        continue
      for ev in line.events:
        totals[ev.name][0] += ev.duration_ns
        totals[ev.name][1] += 1
  if not totals:  # no GPU: the XLA:CPU threads' op events
    source = "XLA ops on host threads (no GPU planes)"
    for plane in data.planes:
      if not plane.name.startswith("/host:CPU"):
        continue
      for line in plane.lines:
        if line.name == "python":
          continue
        for ev in line.events:
          if ev.duration_ns > 0 and not ev.name.startswith(("Threadpool", "$")):
            totals[ev.name][0] += ev.duration_ns
            totals[ev.name][1] += 1
  rows = [{"name": k, "ms": v[0] / 1e6, "calls": v[1]} for k, v in totals.items()]
  rows.sort(key=lambda r: -r["ms"])
  return rows[:top], source


def main(argv=None) -> int:
  args = parse_args(argv)
  os.makedirs(args.out, exist_ok=True)
  import jax
  import numpy as np
  import zinfjax
  from zinfjax.models import GPT, get_config, lm_loss
  if args.tiny:
    args.layers, args.hidden, args.heads, args.seq_len, args.tokens = 2, 64, 2, 32, 128
  config = get_config("tiny", num_layers=args.layers, hidden=args.hidden, num_heads=args.heads,
                      seq_len=args.seq_len, vocab_size=32768 if not args.tiny else 65)
  batch_size = max(1, args.tokens // config.seq_len)
  rng = np.random.default_rng(0)
  batches = [{k: rng.integers(0, config.vocab_size, (batch_size, config.seq_len)).astype(np.int32)
              for k in ("inputs", "targets")} for _ in range(args.steps + 1)]
  pipeline = args.host_optimizer == "pipeline"
  zero = zinfjax.ZeroConfig(offload_param=args.offload, offload_optimizer=args.offload,
                            layer_residuals=args.layer_residuals,
                            host_optimizer=args.host_optimizer, skip_nonfinite=not pipeline,
                            nvme_path=os.path.join(args.out, "nvme"))
  state = zinfjax.init(lambda r: GPT(config, rngs=r), zinfjax.optim.adamw(1e-4), zero,
                       zinfjax.make_mesh(1), 0)
  step = zinfjax.make_train_step(state, lm_loss)
  state, _ = step(state, batches[0])  # compiles
  jax.block_until_ready(state)
  trace = os.path.join(args.out, "trace")
  t0 = time.perf_counter()
  with jax.profiler.trace(trace):
    for batch in batches[1:]:
      state, metrics = step(state, batch)
      jax.block_until_ready(metrics)
  per_step = (time.perf_counter() - t0) / args.steps
  rows, source = top_events(trace, args.top)
  tokens = batch_size * config.seq_len
  flops = config.train_flops(tokens)
  lines = [f"GPT {config.num_layers} x {config.hidden}, {tokens} tokens/step, offload "
           f"{args.offload}, layer_residuals {args.layer_residuals}, host_optimizer "
           f"{args.host_optimizer}, {jax.devices()[0].device_kind}",
           f"step {per_step:.3f} s (traced, so a little slower than untraced), "
           f"{flops / per_step / 1e12:.1f} TFLOP/s",
           "last step's phases: " + (", ".join(f"{k[:-2]} {float(v):.3f} s" for k, v in metrics.items()
                                               if k.endswith("_s")) or "none reported"),
           f"top {len(rows)} by total time over {args.steps} steps ({source}):",
           "| ms per step | share of step | calls per step | name |", "|---|---|---|---|"]
  for r in rows:
    ms = r["ms"] / args.steps
    lines.append(f"| {ms:.2f} | {ms / 1e3 / per_step:.1%} | {r['calls'] / args.steps:.0f} | "
                 f"{r['name'][:120]} |")
  text = "\n".join(lines)
  print(text)
  with open(os.path.join(args.out, "profile_top.txt"), "w") as f:
    f.write(text + "\n")
  with open(os.path.join(args.out, "profile_top.json"), "w") as f:
    json.dump({"step_s": per_step, "tokens": tokens, "source": source, "top": rows}, f, indent=1)
  state.close()
  return 0


if __name__ == "__main__":
  sys.exit(main())
