"""Step time with states on device, pinned host and NVMe, next to compute alone and I/O alone.

  python scripts/bench_step.py --layers 24 --hidden 512 --devices 8 --nvme-path /local_nvme

For one GPT it measures, in the same run:

* the ZeRO-3 step with every state on the device (its fwd/bwd part alone
  is "compute alone" together with the optimizer's kernel time),
* the step with params and optimizer states on pinned host, and on NVMe,
* "I/O alone": the swap store moving exactly the bytes the NVMe step moves
  (params read twice, grads written and read, optimizer states read and
  written), with nothing else running,

and prints each offloaded step against max(compute alone, I/O alone): the
ratio is 1.0 when movement hides completely behind compute (or compute
behind I/O). It also reports the CPU time of compute alone and of I/O alone:
where the accelerator is the CPU itself, the two share its cores, and their
sum over the core count is a floor no overlap can beat.

How well movement hides depends on the compute per byte moved: the bytes
per step are fixed by the model, the compute grows with the tokens each rank
processes (batch x seq / devices), as in the ZeRO-Infinity paper's bandwidth
analysis. Run it at a larger --batch-size / --seq-len to see the offload cost
shrink.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
import tempfile
import time


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--layers", type=int, default=24)
  p.add_argument("--hidden", type=int, default=512)
  p.add_argument("--heads", type=int, default=8)
  p.add_argument("--seq-len", type=int, default=64)
  p.add_argument("--batch-size", type=int, default=16)
  p.add_argument("--devices", type=int, default=8)
  p.add_argument("--precision", default="fp32", choices=("bf16", "fp32"))
  p.add_argument("--steps", type=int, default=4, help="timed steps per placement (after one warm-up)")
  p.add_argument("--nvme-path", default=None, help="swap store folder (default: a temp folder)")
  p.add_argument("--pinned-budget", type=int, default=256, help="MiB")
  return p.parse_args(argv)


def setup(args) -> tuple:
  """(tokens, GPT config, mesh) of a benchmark: `--devices` host devices (set before jax is
  imported), the shipped text and a GPT of `--layers/--hidden/--heads/--seq-len`."""
  flags = os.environ.get("XLA_FLAGS", "")
  os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={args.devices}"
  import zinfjax
  from zinfjax.models import get_config, load_tokens
  tokens, vocab = load_tokens(os.path.join(os.path.dirname(__file__), "..", "data", "tinyshakespeare.txt"))
  config = get_config("tiny", num_layers=args.layers, hidden=args.hidden, num_heads=args.heads,
                      seq_len=args.seq_len, vocab_size=vocab)
  return tokens, config, zinfjax.make_mesh(args.devices)


def main(argv=None) -> int:
  args = parse_args(argv)
  tokens, config, mesh = setup(args)
  import jax
  import numpy as np
  import zinfjax
  from zinfjax.models import GPT, TokenDataset, lm_loss
  from zinfjax.optim.kernel import AdamConstants, adamw_numpy
  from zinfjax.grads import local_loss_and_grads
  from zinfjax.step import shard_batch
  from jax.sharding import PartitionSpec as P

  data = TokenDataset(tokens, config.seq_len, args.batch_size, seed=0)
  batches = [next(data) for _ in range(args.steps + 1)]
  root = args.nvme_path or tempfile.mkdtemp(prefix="zinfjax-bench-step-")
  tx = zinfjax.optim.adamw(1e-4, weight_decay=0.1)
  print(f"GPT {config.num_layers} x {config.hidden} ({config.num_params / 1e6:.1f}M params), "
        f"batch {args.batch_size} x {args.seq_len}, {args.precision}, {args.devices} "
        f"{jax.devices()[0].platform} devices, swap store under {root}")

  def timed_steps(param, optimizer, tag, host_optimizer="xla", skip_nonfinite=True, atomic=False,
                  delay="none", nvme_atomic=True):
    zero = zinfjax.ZeroConfig(precision=args.precision, offload_param=param,
                              offload_optimizer=optimizer, pinned_budget=args.pinned_budget << 20,
                              host_optimizer=host_optimizer, skip_nonfinite=skip_nonfinite,
                              host_atomic_steps=atomic, delay_update=delay,
                              nvme_atomic_steps=nvme_atomic,
                              nvme_path=os.path.join(root, tag)
                              if any("nvme" in t for t in (param, optimizer)) else None)
    state = zinfjax.init(lambda r: GPT(config, rngs=r), tx, zero, mesh, 0)
    return median_step(state, batches, lm_loss)

  results = {}
  step_device, state, _ = timed_steps("device", "device", "device")
  results["all on device"] = step_device

  # compute alone: the all-device forward/backward, plus the C++ AdamW over every state element
  engine = state.engine
  plan = engine.plan
  specs = plan.unflatten([tuple(plan.spec(l, True) for _ in l.params) for l in plan.leaves])
  grad_fn = jax.jit(jax.shard_map(lambda p, b: local_loss_and_grads(engine, lm_loss, p, b),
                                  mesh=mesh, in_specs=(specs, P("data")),
                                  out_specs=(P(), specs), check_vma=False))
  params = state.params
  jax.block_until_ready(grad_fn(params, shard_batch(engine, batches[0])))
  fb, fb_cpu = [], []
  for batch in batches[1:]:
    t0, c0 = time.perf_counter(), cpu_seconds()
    jax.block_until_ready(grad_fn(params, shard_batch(engine, batch)))
    fb.append(time.perf_counter() - t0)
    fb_cpu.append(cpu_seconds() - c0)
  fwd_bwd = statistics.median(fb)
  n = sum(x.size for x in jax.tree.leaves(state.master))
  master, m, v = (np.random.default_rng(i).standard_normal(n).astype(np.float32) for i in range(3))
  v = np.abs(v)
  grad = np.random.default_rng(3).standard_normal(n).astype(np.float32)
  out = np.empty(n, np.float32)
  t0 = time.perf_counter()
  c0 = cpu_seconds()
  adamw_numpy(master, m, v, grad, out, 1e-4, 0.1, 0.001, AdamConstants(0.9, 0.999, 1e-8), 0.1)
  adam = time.perf_counter() - t0
  compute = fwd_bwd + adam
  compute_cpu = statistics.median(fb_cpu) + cpu_seconds() - c0
  del state, master, m, v, grad, out

  results["params + optimizer on pinned_host"], state, _ = timed_steps("pinned_host", "pinned_host", "pinned")
  del state
  results["params + optimizer on pinned_host, host pipeline"], state, _ = timed_steps(
      "pinned_host", "pinned_host", "pinned", "pipeline")
  state.close()
  del state
  # each layer updated while backward runs below it (no skipping of non-finite steps)
  results["params + optimizer on pinned_host, host pipeline under backward"], state, _ = timed_steps(
      "pinned_host", "pinned_host", "pinned", "pipeline", skip_nonfinite=False)
  state.close()
  del state
  # the leaves outside the stacks updated one step late, during the next step's forward
  results["params + optimizer on pinned_host, host pipeline under backward, delayed tail"], \
      state, _ = timed_steps("pinned_host", "pinned_host", "pinned", "pipeline",
                             skip_nonfinite=False, delay="tail")
  state.close()
  del state
  # all-or-nothing steps in RAM: under backward with skip_nonfinite kept (copies, not in place)
  results["params + optimizer on pinned_host, host pipeline under backward, all or nothing"], \
      state, _ = timed_steps("pinned_host", "pinned_host", "pinned", "pipeline", atomic=True)
  state.close()
  del state
  # params and grads in RAM, the optimizer on the drive: pinned-host arrays with the NVMe
  # pipeline after the program, or both in stores (RAM's and the drive's) under backward
  results["params on pinned_host, optimizer on nvme"], state, _ = timed_steps(
      "pinned_host", "nvme", "mixed-xla")
  state.close()
  del state
  results["params on pinned_host, optimizer on nvme, host pipeline (RAM + drive stores)"], \
      state, _ = timed_steps("pinned_host", "nvme", "mixed", "pipeline")
  state.close()
  del state
  # the same rewritten in place (nvme_atomic_steps=False): under the host pipeline the RAM
  # store's shards are updated where they lie while the drive's stream; then with half of the
  # layers' optimizer states in RAM too
  half = f"pinned_host:{config.num_layers // 2},nvme"
  for optimizer in ("nvme", half):
    name = f"params on pinned_host, optimizer on {optimizer}, rewritten in place"
    results[name], state, _ = timed_steps("pinned_host", optimizer, "mixed-xla", nvme_atomic=False)
    state.close()
    del state
    results[f"{name}, host pipeline under backward"], state, _ = timed_steps(
        "pinned_host", optimizer, "mixed", "pipeline", skip_nonfinite=False, nvme_atomic=False)
    state.close()
    del state
  results["params + optimizer on nvme"], state, metrics = timed_steps("nvme", "nvme", "nvme")
  io = io_alone(state.engine.store)
  print(f"\ncompute alone: {compute:.3f} s (fwd/bwd {fwd_bwd:.3f} s + AdamW {adam:.3f} s)")
  print(f"I/O alone:     {io['seconds']:.3f} s ({io['read'] / 1e9:.2f} GB read, "
        f"{io['written'] / 1e9:.2f} GB written: {io['read_gbs']:.2f} / {io['write_gbs']:.2f} GB/s)")
  print(f"NVMe step:     fwd/bwd {float(metrics['fwd_bwd_s']):.3f} s, optimizer "
        f"{float(metrics['optimizer_s']):.3f} s (read wait {float(metrics['nvme_read_wait_s']):.3f} s, "
        f"write wait {float(metrics['nvme_write_wait_s']):.3f} s)\n")
  bound = max(compute, io["seconds"])
  cores = len(os.sched_getaffinity(0))
  cpu_bound = (compute_cpu + io["cpu_s"]) / cores
  print(f"CPU time:      compute alone {compute_cpu:.2f} s, I/O alone {io['cpu_s']:.2f} s (checksums, "
        f"staging, syscalls) on {cores} cores: overlapping both needs at least {cpu_bound:.3f} s "
        f"({cpu_bound / bound:.2f}x max(compute, I/O))\n")
  print("| placement | step s | vs compute alone | vs max(compute, I/O) |")
  print("|---|---|---|---|")
  for name, t in results.items():
    print(f"| {name} | {t:.3f} | {t / compute:.2f}x | {t / bound:.2f}x |")
  print(f"| compute alone | {compute:.3f} | 1.00x | {compute / bound:.2f}x |")
  print(f"| I/O alone | {io['seconds']:.3f} | {io['seconds'] / compute:.2f}x | {io['seconds'] / bound:.2f}x |")
  state.engine.store.close()
  return 0


def median_step(state, batches, loss_fn, warmup: int = 1) -> tuple:
  """(median seconds of every step after the first `warmup`, final state, last metrics)."""
  import jax
  import zinfjax
  times, metrics = [], {}
  for i, batch in enumerate(batches):
    t0 = time.perf_counter()
    state, metrics = zinfjax.train_step(state, batch, loss_fn)
    jax.block_until_ready(metrics)
    if i >= warmup:
      times.append(time.perf_counter() - t0)
  return statistics.median(times), state, metrics


def io_alone(store) -> dict:
  """Move the bytes of one NVMe step through the store with nothing else running.

  Reads every param shard twice (forward, backward), every grad and optimizer
  shard once; writes every grad, optimizer and param shard once. Up to 16
  transfers in flight.
  """
  keys = store.keys()
  reads = ([k for k in keys if k.startswith("p/")] * 2
           + [k for k in keys if k.startswith(("g/", "o/"))])
  writes = [k for k in keys if k.startswith(("g/", "o/", "p/"))]
  buffers = {k: store.read(k).wait() for k in set(writes)}
  t0, c0 = time.perf_counter(), cpu_seconds()
  _stream([lambda k=k: store.read(k, buffers[k]) for k in reads])
  t1 = time.perf_counter()
  _stream([lambda k=k: store.write(k, buffers[k]) for k in writes])
  store.sync()
  t2, c2 = time.perf_counter(), cpu_seconds()
  read_bytes = sum(buffers[k].nbytes for k in reads)
  write_bytes = sum(buffers[k].nbytes for k in writes)
  return {"seconds": t2 - t0, "cpu_s": c2 - c0, "read": read_bytes, "written": write_bytes,
          "read_gbs": read_bytes / (t1 - t0) / 1e9, "write_gbs": write_bytes / (t2 - t1) / 1e9}


def cpu_seconds() -> float:
  """CPU time (user + system) this process has used, all threads."""
  usage = resource.getrusage(resource.RUSAGE_SELF)
  return usage.ru_utime + usage.ru_stime


def _stream(starts, depth: int = 16) -> None:
  in_flight = []
  for start in starts:
    in_flight.append(start())
    if len(in_flight) >= depth:
      in_flight.pop(0).wait()
  for t in in_flight:
    t.wait()


if __name__ == "__main__":
  sys.exit(main())
