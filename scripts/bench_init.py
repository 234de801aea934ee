"""A random init straight into the NVMe store: time, write rate and peak host memory by depth.

  python scripts/bench_init.py --preset 2.5b --layers 16 32 --devices 2 --nvme-path /mnt/nvme/x

Each row creates the training state of a GPT preset at one depth in a fresh
process, params and optimizer on NVMe by default, or split by layer
(`--offload-param pinned_host:4,nvme`; stacked leaves are drawn one layer at
a time), and prints the seconds, the bytes the store holds and those written
(fresh zero moments are only registered), the write rate next to the disk's
O_DIRECT write ceiling measured in the same run, and the peak RSS: it should
stay flat as the model gets deeper. The largest model's kind of plan, params
on the device and the optimizer in RAM's store then the drive:

  python scripts/bench_init.py --layers 8 --offload-param device \
      --offload-optimizer pinned_host:7,nvme --host-optimizer pipeline --in-place
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time


def worker(args) -> None:
  """One row, in its own process: create the state, print a JSON line."""
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                             f" --xla_force_host_platform_device_count={args.devices}")
  import jax
  import zinfjax
  from zinfjax.models import GPT, get_config
  from zinfjax.placement import Tier
  from zinfjax.progress import peak_rss

  config = get_config(args.preset, num_layers=args.worker)
  zero = zinfjax.ZeroConfig(offload_param=args.offload_param,
                            offload_optimizer=args.offload_optimizer,
                            nvme_path=args.nvme_path, pinned_budget=args.pinned_budget_mib << 20,
                            host_optimizer=args.host_optimizer,
                            nvme_atomic_steps=not args.in_place)
  mesh = zinfjax.make_mesh(jax.devices()[:args.devices])
  start = time.perf_counter()
  state = zinfjax.init(lambda r: GPT(config, rngs=r), zinfjax.optim.adamw(1e-4), zero, mesh, 0)
  jax.block_until_ready(jax.tree.leaves(state.master))
  seconds = time.perf_counter() - start
  stats = state.engine.store.stats()
  used, written = stats["bytes_used"], stats["bytes_written"]  # the drive's, in a mixed store
  ram = stats.get(str(Tier.HOST_STORE), {"bytes_written": 0})["bytes_written"]
  rss = peak_rss()
  state.engine.store.close()
  draw = draw_alone(state.engine, lambda r: GPT(config, rngs=r))
  print(json.dumps({"layers": args.worker, "seconds": seconds, "peak_rss": rss, "draw_s": draw,
                    "store_bytes": used, "written_bytes": written, "ram_written_bytes": ram,
                    "params": config.num_params}), flush=True)


def draw_alone(engine, factory) -> float:
  """Seconds to draw every leaf's master as init does (stacked leaves one layer at a time),
  compiled beforehand, with nothing written: the compute bound of init."""
  import jax
  from zinfjax.draw import by_depth, layer_initializer, master_initializer
  key = jax.random.key(0)
  runs = []
  for leaf in engine.plan.leaves:
    if not leaf.stacked:
      f = master_initializer(engine, factory, [leaf.index])
      runs.append((f.lower(key).compile(), [(key,)]))
  # a layer of every stacked leaf of a depth in one program
  for depth, leaves in by_depth(l for l in engine.plan.leaves if l.stacked).items():
    f = layer_initializer(engine, factory, [leaf.index for leaf in leaves])
    runs.append((f.lower(key, 0).compile(), [(key, layer) for layer in range(depth)]))
  start = time.perf_counter()
  for compiled, calls in runs:
    for call in calls:
      jax.block_until_ready(compiled(*call))
  return time.perf_counter() - start


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--preset", default="2.5b")
  ap.add_argument("--layers", type=int, nargs="+", default=[16, 32])
  ap.add_argument("--devices", type=int, default=2)
  ap.add_argument("--pinned-budget-mib", type=int, default=4096)
  ap.add_argument("--nvme-path", default="/tmp/zinfjax-bench-init")
  ap.add_argument("--offload-param", default="nvme",
                  help="params' tiers, e.g. pinned_host:4,nvme (a fixed number of host layers "
                       "keeps the host's share equal at every depth)")
  ap.add_argument("--offload-optimizer", default="nvme")
  ap.add_argument("--host-optimizer", default="auto",
                  help="pipeline: pinned-host states in RAM's store (the largest model's plan: "
                       "--offload-param device --offload-optimizer pinned_host:N,nvme)")
  ap.add_argument("--in-place", action="store_true",
                  help="nvme_atomic_steps=False (largest_gpt.py's choice): no room kept for a "
                       "second copy of the states")
  ap.add_argument("--worker", type=int, default=None, help=argparse.SUPPRESS)
  args = ap.parse_args()
  if args.worker:
    return worker(args)
  sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
  from _disk import direct_io

  os.makedirs(args.nvme_path, exist_ok=True)
  probe = os.path.join(args.nvme_path, "ceiling.bin")
  write, read = direct_io(probe, 2 << 30)
  os.remove(probe)
  rows = []
  for layers in args.layers:
    run = os.path.join(args.nvme_path, "run")
    shutil.rmtree(run, ignore_errors=True)
    out = subprocess.run([sys.executable, __file__, "--worker", str(layers), "--preset", args.preset,
                          "--devices", str(args.devices), "--pinned-budget-mib",
                          str(args.pinned_budget_mib), "--nvme-path", run,
                          "--offload-param", args.offload_param,
                          "--offload-optimizer", args.offload_optimizer,
                          "--host-optimizer", args.host_optimizer]
                         + (["--in-place"] if args.in_place else []),
                         capture_output=True, text=True)
    if out.returncode:
      raise SystemExit(f"{layers} layers failed:\n{out.stderr[-3000:]}")
    rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    print(rows[-1], flush=True)
  shutil.rmtree(os.path.join(args.nvme_path, "run"), ignore_errors=True)
  gib = 2 ** 30
  print(f"\nrandom init of GPT {args.preset}, params {args.offload_param}, optimizer "
        f"{args.offload_optimizer}, host optimizer {args.host_optimizer} (swap {args.nvme_path}), "
        f"{args.devices} devices; disk O_DIRECT ceiling write {write:.2f} / read {read:.2f} GB/s")
  print("`draw s`: the random draws alone (compiled, nothing written); `written GB`: the bytes "
        "written to the drive (`RAM GB`: copied into RAM's store; fresh zero moments lie in space "
        "never written, which reads as zeros: only registered); `bound s`: the larger of the "
        "draws and the disk's time for the bytes written (what init would take if each "
        "overlapped the other fully)")
  print(f"{'layers':>6s} {'params':>8s} {'time s':>8s} {'draw s':>7s} {'bound s':>8s} {'x bound':>8s} "
        f"{'peak RSS GiB':>13s} {'store GB':>9s} {'written GB':>11s} {'RAM GB':>7s} "
        f"{'write GB/s':>11s} {'x ceiling':>10s}")
  for r in rows:
    rate = r["written_bytes"] / r["seconds"] / 1e9
    bound = max(r["draw_s"], r["written_bytes"] / 1e9 / write)
    print(f"{r['layers']:6d} {r['params'] / 1e9:7.2f}B {r['seconds']:8.1f} {r['draw_s']:7.1f} "
          f"{bound:8.1f} {r['seconds'] / bound:8.2f} {r['peak_rss'] / gib:13.2f} "
          f"{r['store_bytes'] / 1e9:9.1f} {r['written_bytes'] / 1e9:11.1f} "
          f"{r['ram_written_bytes'] / 1e9:7.1f} {rate:11.2f} {rate / write:10.2f}")
  if len(rows) > 1:
    print(f"peak RSS deepest / shallowest: {rows[-1]['peak_rss'] / rows[0]['peak_rss']:.2f}x")


if __name__ == "__main__":
  main()
