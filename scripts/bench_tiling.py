"""Memory-centric tiling (the ZeRO-Infinity paper's Figure 6b experiment) on host devices.

  python scripts/bench_tiling.py [--hidden 2048 4096 ...] [--tiles 1 2 4 8 16] [--cap-gib 16] [--json]

For each hidden size and tile factor: the compiled per-device peak memory
(arguments + temporaries, from `memory_analysis()`, nothing allocated) of one
training step of a one-layer GPT under ZeRO-3 on `--devices` host devices,
and the largest hidden size that fits under `--cap-gib` with and without
tiling. Then the time cost of tiling: real steps at `--time-hidden`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--hidden", type=int, nargs="+", default=[2048, 4096, 8192, 16384, 32768, 65536])
  p.add_argument("--tiles", type=int, nargs="+", default=[1, 2, 4, 8, 16])
  p.add_argument("--devices", type=int, default=8)
  p.add_argument("--cap-gib", type=float, default=16.0, help="per-device memory cap")
  p.add_argument("--precision", default="fp32", choices=("fp32", "bf16"))
  p.add_argument("--time-hidden", type=int, default=1024)
  p.add_argument("--time-steps", type=int, default=5)
  p.add_argument("--time-tiles", type=int, nargs="+", default=[1, 4, 16],
                 help="tile factors to time for real")
  p.add_argument("--unordered-tiles", type=int, nargs="*", default=[1],
                 help="tile factors also timed with ordered_collectives=False (what ordering costs; "
                      "unordered runs can deadlock XLA's CPU collectives, 16 tiles did)")
  p.add_argument("--json", action="store_true")
  return p.parse_args(argv)


def main(argv=None) -> int:
  args = parse_args(argv)
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                             f" --xla_force_host_platform_device_count={args.devices}")
  import jax
  import jax.numpy as jnp
  import numpy as np
  import optax
  from jax.sharding import NamedSharding, PartitionSpec as P

  import zinfjax
  from zinfjax.models import GPT, GPTConfig, lm_loss

  mesh = zinfjax.make_mesh(args.devices)
  batch, seq = args.devices, 64

  def setup(hidden, tiles, abstract=True, ordered=None):
    config = GPTConfig(vocab_size=256, seq_len=seq, num_layers=1, num_heads=max(1, hidden // 128),
                       hidden=hidden)
    zero = zinfjax.ZeroConfig(stage=3, precision=args.precision, tiles=tiles,
                              ordered_collectives=ordered)
    make = zinfjax.abstract_init if abstract else zinfjax.init
    state = make(lambda r: GPT(config, rngs=r), optax.adam(1e-4), zero, mesh)
    return state, zinfjax.make_train_step(state, lm_loss)

  abstract_batch = {k: jax.ShapeDtypeStruct((batch, seq), jnp.int32,
                                            sharding=NamedSharding(mesh, P("data")))
                    for k in ("inputs", "targets")}
  peaks: dict[int, dict[int, float]] = {}
  for hidden in args.hidden:
    peaks[hidden] = {}
    for tiles in args.tiles:
      state, step = setup(hidden, tiles)
      ma = step.jitted.lower(state, abstract_batch).compile().memory_analysis()
      peaks[hidden][tiles] = (ma.argument_size_in_bytes + ma.temp_size_in_bytes) / 2**30
      if not args.json:
        print(f"hidden {hidden:>6} tiles {tiles:>2}: {peaks[hidden][tiles]:9.2f} GiB per device",
              flush=True)

  def largest(tiles):
    fits = [h for h in args.hidden if peaks[h].get(tiles, float("inf")) <= args.cap_gib]
    return max(fits) if fits else None

  timing = {}
  rng = np.random.default_rng(0)
  data = {k: rng.integers(0, 256, (batch, seq)).astype(np.int32) for k in ("inputs", "targets")}
  unordered = {}

  def timed(tiles, ordered=None):
    state, step = setup(args.time_hidden, tiles, abstract=False, ordered=ordered)
    state, m = step(state, data)
    jax.block_until_ready(m["loss"])
    t = time.perf_counter()
    for _ in range(args.time_steps):
      state, m = step(state, data)
    jax.block_until_ready(m["loss"])
    seconds = (time.perf_counter() - t) / args.time_steps
    print(f"timed hidden {args.time_hidden}, {tiles} tiles, collectives "
          f"{'unordered' if ordered is False else 'ordered'}: {1e3 * seconds:.0f} ms/step", flush=True)
    return seconds

  for tiles in args.time_tiles:
    timing[tiles] = timed(tiles)
  for tiles in args.unordered_tiles:
    unordered[tiles] = timed(tiles, ordered=False)

  report = {"devices": args.devices, "precision": args.precision, "cap_gib": args.cap_gib,
            "peak_gib": {str(h): {str(t): v for t, v in row.items()} for h, row in peaks.items()},
            "largest_hidden_under_cap": {str(t): largest(t) for t in args.tiles},
            "step_time_s": {str(t): v for t, v in timing.items()},
            "unordered_step_time_s": {str(t): v for t, v in unordered.items()},
            "time_hidden": args.time_hidden}
  if args.json:
    print(json.dumps(report, indent=2))
    return 0
  print(f"\nper-device peak GiB (arguments + temporaries), one-layer GPT, ZeRO-3 on "
        f"{args.devices} {jax.devices()[0].platform} devices, {args.precision}")
  print(f"{'hidden':>8} " + " ".join(f"{'tiles ' + str(t):>10}" for t in args.tiles))
  for h, row in peaks.items():
    print(f"{h:>8} " + " ".join(f"{row[t]:10.2f}" for t in args.tiles))
  print(f"largest hidden under {args.cap_gib:g} GiB: " +
        ", ".join(f"tiles {t}: {largest(t)}" for t in args.tiles))
  print(f"step time at hidden {args.time_hidden}: " +
        ", ".join(f"tiles {t}: {1e3 * v:.0f} ms ({v / timing[args.time_tiles[0]]:.2f}x)"
                  for t, v in timing.items()))
  if unordered:
    print("collectives in one order (default on CPU) vs unordered: " + ", ".join(
        f"tiles {t}: {1e3 * timing[t]:.0f} vs {1e3 * v:.0f} ms ({timing[t] / v:.2f}x)"
        for t, v in unordered.items() if t in timing))
  return 0


if __name__ == "__main__":
  sys.exit(main())
