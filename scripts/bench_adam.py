"""AdamW throughput on the CPU: zinfjax's fused kernel against its peers and memory bandwidth.

  python scripts/bench_adam.py --params 1e8 [--json]
  python scripts/bench_adam.py --params 1e8 --nvme-params 1e9 --nvme-path /mnt/nvme
  python scripts/bench_adam.py --params 1e8 --host-params 1e8

Table 1: parameters per second of one AdamW step over `--params` parameters
(fp32 master and moments) for the zinfjax C++ kernel (bf16 grads in, bf16
params out), optax.adamw jitted on the CPU backend (fp32), torch
AdamW(fused=True) and DeepSpeedCPUAdam when installed. The memory-bandwidth
bound is copy bandwidth measured in the same run divided by the bytes one
update moves per parameter (28: read master, m, v, grad; write master, m, v,
params; with bf16 moments 20). Table 2 (with --nvme-params): one NVMe-offloaded step over that many
parameters against (bytes read / read bandwidth + bytes written / write
bandwidth) of the disk, measured in the same run. Table 3 (with --host-params): one step of
the host pipeline over that many parameters in the RAM store (host_optimizer="pipeline"):
updated in place; all or nothing (the kernel reads the committed copy and writes the step's
new one); and all or nothing through the pipeline's buffers, as a store that lends nothing
is driven (read in, updated, written back: 48 more bytes per parameter), against the same
bound as table 1. Table 4 (with --call-sizes): one kernel call's time over tensors of those
sizes as the slices (threads) grow: what splitting one tensor over the cores costs. Table 5
(with --small-parts): the pipeline's own cost per part: a host-pipeline step over that many
small parts in the RAM store (in place; all or nothing) against the kernel alone called on
the same shards, in microseconds per part (a model's biases and norms are such parts, and
every layer adds its own).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import shutil
import sys
import tempfile
import time

import numpy as np

from _disk import disk_ceiling

BYTES_PER_PARAM = 28
BF16_MOMENT_BYTES = 20  # master 4 + m 2 + v 2 + grad 2 read; master 4 + m 2 + v 2 + params 2 written


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--params", type=float, default=1e8)
  p.add_argument("--repeats", type=int, default=5, help="timed steps per row (best kept)")
  p.add_argument("--nvme-params", type=float, default=0, help="also time an NVMe step this large")
  p.add_argument("--nvme-path", default=None)
  p.add_argument("--host-params", type=float, default=0, help="also time host-RAM steps this large")
  p.add_argument("--sub-group", type=float, default=5e7, help="NVMe sub-group size (elements)")
  p.add_argument("--call-sizes", default="", help="e.g. 1e6,1.6e7: also time one call per size")
  p.add_argument("--call-threads", default="1,2,16", help="slices per call in table 4")
  p.add_argument("--small-parts", type=int, default=0, help="table 5: this many parts")
  p.add_argument("--part-size", type=int, default=4096, help="elements per part in table 5")
  p.add_argument("--json", action="store_true")
  return p.parse_args(argv)


def best_time(fn, repeats: int) -> float:
  fn()  # warm up (compile, page faults)
  times = []
  for _ in range(repeats):
    t = time.perf_counter()
    fn()
    times.append(time.perf_counter() - t)
  return min(times)


def copy_bandwidth(n_bytes: int, repeats: int) -> float:
  """Bytes moved per second (read + write) by a large memcpy on every core at once."""
  from concurrent.futures import ThreadPoolExecutor
  a = np.ones(n_bytes // 4, np.float32)
  b = np.ones_like(a)
  workers = os.cpu_count() or 1
  parts = np.array_split(np.arange(a.size), workers)
  bounds = [(p[0], p[-1] + 1) for p in parts if len(p)]
  with ThreadPoolExecutor(workers) as pool:  # numpy releases the GIL while copying
    t = best_time(lambda: list(pool.map(lambda r: np.copyto(b[r[0]:r[1]], a[r[0]:r[1]]), bounds)),
                  repeats)
  return 2 * a.nbytes / t


def bench_zinfjax(n: int, repeats: int, moments=np.float32) -> float:
  import ml_dtypes
  from zinfjax.optim.kernel import AdamConstants, adamw_numpy
  rng = np.random.default_rng(0)
  master = rng.standard_normal(n, np.float32)
  m, v = np.zeros(n, moments), np.zeros(n, moments)
  grad = rng.standard_normal(n, np.float32).astype(ml_dtypes.bfloat16)
  out = np.empty(n, ml_dtypes.bfloat16)
  c = AdamConstants(0.9, 0.999, 1e-8)
  return best_time(lambda: adamw_numpy(master, m, v, grad, out, 1e-3, 0.1, 0.001, c, 0.01), repeats)


def bench_calls(sizes: list[int], threads: list[int], repeats: int) -> dict[int, dict[int, float]]:
  """Seconds of one kernel call (bf16 grads and params, fp32 moments) per size and slice count,
  the best of `repeats` averages over calls that move about 2 GB."""
  import ml_dtypes
  from zinfjax.optim.kernel import AdamConstants, adamw_numpy
  rng, c, out = np.random.default_rng(0), AdamConstants(0.9, 0.999, 1e-8), {}
  for n in sizes:
    master, m, v = rng.standard_normal(n, np.float32), np.zeros(n, np.float32), np.zeros(n, np.float32)
    grad = rng.standard_normal(n, np.float32).astype(ml_dtypes.bfloat16)
    params = np.empty(n, ml_dtypes.bfloat16)
    calls = max(3, int(2e9 // (n * BYTES_PER_PARAM)))

    def run(t):
      for _ in range(calls):
        adamw_numpy(master, m, v, grad, params, 1e-3, 0.1, 0.001, c, 0.01, threads=t)

    out[n] = {t: best_time(functools.partial(run, t), repeats) / calls for t in threads}
  return out


def bench_optax(n: int, repeats: int) -> float:
  import jax
  import jax.numpy as jnp
  import optax
  tx = optax.adamw(1e-3, weight_decay=0.01)
  params = jax.random.normal(jax.random.key(0), (n,), jnp.float32)
  grads = jax.random.normal(jax.random.key(1), (n,), jnp.float32)
  state = [params, tx.init(params)]

  @jax.jit
  def step(params, opt_state, grads):
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  step = jax.jit(step, donate_argnums=(0, 1))

  def run():
    state[0], state[1] = step(state[0], state[1], grads)
    jax.block_until_ready(state[0])

  return best_time(run, repeats)


def bench_torch(n: int, repeats: int) -> float | None:
  try:
    import torch
  except ImportError:
    return None
  p = torch.nn.Parameter(torch.randn(n))
  p.grad = torch.randn(n)
  opt = torch.optim.AdamW([p], lr=1e-3, weight_decay=0.01, fused=True)
  return best_time(opt.step, repeats)


def bench_deepspeed(n: int, repeats: int) -> float | None:
  try:
    import torch
    from deepspeed.ops.adam import DeepSpeedCPUAdam
  except Exception:  # noqa: BLE001 - not installed or its op does not build here
    return None
  p = torch.nn.Parameter(torch.randn(n))
  p.grad = torch.randn(n)
  opt = DeepSpeedCPUAdam([p], lr=1e-3, weight_decay=0.01)
  return best_time(opt.step, repeats)


def bench_nvme(n: int, path: str, sub_group: int) -> dict:
  import ml_dtypes
  import jax.numpy as jnp
  from zinfjax.optim.kernel import AdamConstants
  from zinfjax.optim.nvme import NvmeAdam
  folder = tempfile.mkdtemp(prefix="zinfjax-bench-adam-", dir=path)
  try:
    c = AdamConstants(0.9, 0.999, 1e-8)
    pipe = NvmeAdam(folder, sub_group_size=sub_group, constants=c)
    pipe.configure([(n,)])
    params = np.random.default_rng(0).standard_normal(n, np.float32)
    pipe.host_init(params)
    grad = params.astype(ml_dtypes.bfloat16)
    del params
    tool, write_bw, read_bw = disk_ceiling(folder, min(8 << 30, 12 * n // 4))
    pipe.host_step([0.01], [jnp.bfloat16], 1e-3, 0.1, 0.001, grad)
    stats = dict(pipe.last_step)
    pipe.close()
    io_bound = stats["bytes_read"] / (read_bw * 1e9) + stats["bytes_written"] / (write_bw * 1e9)
    return {"params": n, "step_s": stats["step_s"], "io_bound_s": io_bound,
            "ratio": stats["step_s"] / io_bound, "disk_tool": tool, "disk_read_gbps": read_bw,
            "disk_write_gbps": write_bw, "breakdown": stats, "pinned_bytes": pipe.pinned_bytes}
  finally:
    shutil.rmtree(folder, ignore_errors=True)


class _LendsNothing:
  """`store` with no shard used where it lies: each read into the pipeline's buffers and
  written back, as a drive's store is driven (the comparison row of table 3)."""

  def __init__(self, store):
    self._store = store

  def lends(self, key: str) -> bool:
    return False

  def __getattr__(self, name: str):
    return getattr(self._store, name)


def ram_pipeline(shapes: list[tuple[int, ...]], sub_group: int, moments=np.float32):
  """An `NvmeAdam` over leaves of `shapes` with its states in the RAM store."""
  from zinfjax.optim.kernel import AdamConstants
  from zinfjax.optim.nvme import NvmeAdam
  pipe = NvmeAdam("", sub_group_size=sub_group, constants=AdamConstants(0.9, 0.999, 1e-8),
                  moment_dtype=moments, memory=True)
  pipe.configure(shapes)
  return pipe


def ram_step(pipe, store, atomic: bool, decays: list[float], grad_of, out_of) -> None:
  """One host-pipeline step of `pipe`; with `atomic`, all or nothing in `store`."""
  from zinfjax.placement import PREFIX
  if atomic:
    store.begin([PREFIX[s] for s in ("master", "mu", "nu")])
  pipe.stream(1e-3, 0.1, 0.001, decays, grad_of, out_of, step=1)
  if atomic:
    store.commit()


def bench_host(n: int, sub_group: int, repeats: int, moments=np.float32,
               atomic: bool = True) -> dict[str, float]:
  """Seconds of one host-pipeline step over `n` params in the RAM store (bf16 grads in, bf16
  params out, `moments` the moments' dtype), best of `repeats`: in place, and with `atomic`,
  all or nothing, and all or nothing through buffers. The params go to one buffer kept over
  the steps, as the engine's go to the store's (a new one each step would add its first
  touch: a sixth of the step on a 2-core VM)."""
  import ml_dtypes
  from zinfjax.optim.nvme import _slice
  pipe = ram_pipeline([(n,)], sub_group, moments)
  params = np.random.default_rng(0).standard_normal(n, np.float32)
  pipe.host_init(params)
  grad = params.astype(ml_dtypes.bfloat16)
  out = np.zeros(n, ml_dtypes.bfloat16)
  del params
  store = pipe.store
  step = lambda atomic: ram_step(pipe, store, atomic, [0.01], lambda p: _slice(grad, p),
                                 lambda p: _slice(out, p))

  rows = {"in place": best_time(lambda: step(False), repeats)}
  if atomic:
    rows["all or nothing (committed copy read, new copy written)"] = best_time(
        lambda: step(True), repeats)
    pipe.store = _LendsNothing(store)
    rows["all or nothing through the buffers (read in, written back)"] = best_time(
        lambda: step(True), repeats)
    pipe.store = store
  pipe.close()
  return rows


def bench_parts(count: int, size: int, repeats: int) -> dict[str, float]:
  """Seconds per part: the kernel alone on `count` RAM-store shards of `size` elements (its
  calls, nothing else), then one host-pipeline step over them in place and all or nothing."""
  import ml_dtypes
  from zinfjax.optim.kernel import adamw_numpy
  pipe = ram_pipeline([(size,)] * count, size)
  rng = np.random.default_rng(0)
  params = [rng.standard_normal(size, np.float32) for _ in range(count)]
  pipe.host_init(*params)
  grads = [p.astype(ml_dtypes.bfloat16) for p in params]
  outs = [np.zeros(size, ml_dtypes.bfloat16) for _ in params]
  store = pipe.store
  shards = [[store.view(pipe.key(s, p)) for s in ("master", "mu", "nu")] for p in pipe.parts]

  def kernel() -> None:
    for (master, m, v), g, out in zip(shards, grads, outs):
      adamw_numpy(master, m, v, g, out, 1e-3, 0.1, 0.001, pipe.constants, 0.01)

  step = lambda atomic: ram_step(pipe, store, atomic, [0.01] * count, lambda p: grads[p.leaf],
                                 lambda p: outs[p.leaf])
  rows = {"the kernel alone on the store's shards": best_time(kernel, repeats),
          "pipeline step, in place": best_time(lambda: step(False), repeats),
          "pipeline step, all or nothing": best_time(lambda: step(True), repeats)}
  pipe.close()
  return {name: t / count for name, t in rows.items()}


def kernel_pass(pipeline, repeats: int = 2, sample: int = 1 << 26) -> dict:
  """The C++ AdamW over the parts a RAM-store pipeline updates, with nothing else running, in
  seconds (best of `repeats`): over all of them on the store's own shards (`views_s`, the
  memory the step's update uses; on a GPU the params and grads among it are lent to the
  device), and over the largest parts of the stacks' layers up to `sample` elements both there
  (`sample_views_s`) and on host copies of them made beforehand (`sample_copies_s`). Beside the
  step's `adam_s` it splits the update's time in the step into the kernel on that memory alone
  and what the step adds, and the store's memory from plain host memory. It updates the
  store's states: a bench row's last act."""
  from zinfjax.optim.kernel import adamw_numpy
  states = ("master", "mu", "nu", "grads", "params")
  parts = [p for p in pipeline.parts if all(pipeline.on_store(s, p) for s in ("grads", "params"))]
  views = [{s: pipeline.store.view(pipeline.key(s, p)) for s in states} for p in parts]
  largest, n = [], 0
  stacked = [i for i, p in enumerate(parts) if pipeline.plan.leaves[p.leaf].stacked]
  for i in sorted(stacked or range(len(parts)), key=lambda i: -parts[i].size):
    if n >= sample:
      break
    largest.append(views[i])
    n += parts[i].size
  copies = [{s: np.array(a) for s, a in v.items()} for v in largest]

  def run(shards) -> float:
    t0 = time.perf_counter()
    for v in shards:
      adamw_numpy(v["master"], v["mu"], v["nu"], v["grads"], v["params"], 1e-6, 0.1, 0.001,
                  pipeline.constants, 0.0)
    return time.perf_counter() - t0

  found: dict = {"views_s": [], "sample_views_s": [], "sample_copies_s": []}
  for _ in range(repeats):
    for name, shards in zip(found, (views, largest, copies)):
      found[name].append(run(shards))
  return {"parts": len(parts), "sample_params": n, **{k: min(v) for k, v in found.items()}}


def main(argv=None) -> int:
  args = parse_args(argv)
  import ml_dtypes
  from zinfjax.optim import isa
  n = int(args.params)
  bandwidth = copy_bandwidth(min(n * 4, 1 << 30), args.repeats)
  bound = bandwidth / BYTES_PER_PARAM
  bf16 = "zinfjax C++ AdamW, bf16 moments"
  rows = {"zinfjax C++ AdamW (" + isa() + ")": bench_zinfjax(n, args.repeats),
          bf16: bench_zinfjax(n, args.repeats, ml_dtypes.bfloat16),
          "optax.adamw (jit, CPU)": bench_optax(n, args.repeats),
          "torch AdamW(fused=True)": bench_torch(n, args.repeats),
          "DeepSpeedCPUAdam": bench_deepspeed(n, args.repeats)}
  # bf16 moments move 20 bytes per parameter: their bound is higher
  bound_of = {k: bandwidth / (BF16_MOMENT_BYTES if k == bf16 else BYTES_PER_PARAM) for k in rows}
  report = {"params": n, "copy_bandwidth_gbps": bandwidth / 1e9, "bound_params_per_s": bound,
            "rows": {k: None if t is None else {"seconds": t, "params_per_s": n / t,
                                                "vs_bound": n / t / bound_of[k]}
                     for k, t in rows.items()}}
  if args.nvme_params:
    report["nvme"] = bench_nvme(int(args.nvme_params), args.nvme_path or tempfile.gettempdir(),
                                int(args.sub_group))
  if args.host_params:
    report["host"] = bench_host(int(args.host_params), int(args.sub_group), args.repeats)
  sizes = [int(float(x)) for x in args.call_sizes.split(",") if x]
  threads = [int(x) for x in args.call_threads.split(",")]
  if sizes:
    report["calls"] = bench_calls(sizes, threads, args.repeats)
  if args.small_parts:
    report["parts"] = bench_parts(args.small_parts, args.part_size, args.repeats)
  if args.json:
    print(json.dumps(report, indent=2))
    return 0
  print(f"AdamW step over {n:.2e} params; copy bandwidth {bandwidth / 1e9:.1f} GB/s -> bound "
        f"{bound / 1e9:.3f} G params/s at {BYTES_PER_PARAM} B/param")
  print(f"{'':32} {'params/s':>12} {'vs bound':>9} {'vs optax':>9}   (bf16 moments: bound at "
        f"{BF16_MOMENT_BYTES} B/param)")
  optax_t = rows["optax.adamw (jit, CPU)"]
  for name, t in rows.items():
    if t is None:
      print(f"{name:32} {'not installed':>12}")
      continue
    print(f"{name:32} {n / t:12.3e} {n / t / bound_of[name]:9.0%} {optax_t / t:8.2f}x")
  if args.nvme_params:
    r = report["nvme"]
    b = r["breakdown"]
    print(f"\nNVMe-offloaded step over {r['params']:.2e} params (sub-groups of {int(args.sub_group):.1e}, "
          f"{r['pinned_bytes'] / 2**30:.2f} GiB pinned):")
    print(f"  step {r['step_s']:.2f} s | I/O bound {r['io_bound_s']:.2f} s "
          f"({b['bytes_read'] / 1e9:.1f} GB read at {r['disk_read_gbps']:.2f} GB/s + "
          f"{b['bytes_written'] / 1e9:.1f} GB written at {r['disk_write_gbps']:.2f} GB/s) | "
          f"ratio {r['ratio']:.2f}")
    print(f"  waits: read {b['read_wait_s']:.2f} s, write {b['write_wait_s']:.2f} s, "
          f"compute {b['compute_s']:.2f} s  (disk: {r['disk_tool']})")
  if args.host_params:
    h = int(args.host_params)
    print(f"\nHost-pipeline step over {h:.2e} params in the RAM store (bound {bound:.3e} params/s):")
    print(f"{'':60} {'seconds':>8} {'params/s':>10} {'vs bound':>9} {'vs in place':>12}")
    rows = report["host"]
    for name, t in rows.items():
      print(f"{name:60} {t:8.3f} {h / t:10.3e} {h / t / bound:9.0%} {t / rows['in place']:11.2f}x")
  if sizes:
    print(f"\nOne call's ms by slices ({os.cpu_count()} cores here):")
    print(f"{'elements':>12} " + " ".join(f"{f'{t} slices':>10}" for t in threads))
    for n, by in report["calls"].items():
      print(f"{n:12.3g} " + " ".join(f"{by[t] * 1e3:10.3f}" for t in threads))
  if args.small_parts:
    print(f"\nPer part, over {args.small_parts} parts of {args.part_size} elements in the RAM "
          "store:")
    floor = report["parts"]["the kernel alone on the store's shards"]
    for name, t in report["parts"].items():
      print(f"{name:40} {t * 1e6:8.1f} us {t / floor:6.2f}x  ({t * 1e6 - floor * 1e6:+.1f} us)")
  return 0


if __name__ == "__main__":
  sys.exit(main())
