"""Checkpoint save and restore speed per placement, next to the disk's own bandwidth.

  python scripts/bench_checkpoint.py --layers 24 --hidden 512 --devices 8 --folder /local_nvme/bench

For one GPT, with its states on device, pinned host and NVMe in turn, it
measures in the same run: the time `save` blocks training (for device and
pinned-host states, the copy to host memory; for NVMe, the whole streamed
copy), the time until the step is committed (after a warm-up save), the time
to restore it into a fresh engine, and the checkpoint's bytes over those times, against the raw
disk's write and read bandwidth (fio or dd, O_DIRECT).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import sys
import tempfile
import time


def folder_bytes(path: str) -> int:
  return sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(path) for f in fs)


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--layers", type=int, default=24)
  p.add_argument("--hidden", type=int, default=512)
  p.add_argument("--heads", type=int, default=8)
  p.add_argument("--devices", type=int, default=8)
  p.add_argument("--folder", default=None, help="where checkpoints and swap files go (default: temp)")
  args = p.parse_args(argv)
  flags = os.environ.get("XLA_FLAGS", "")
  os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={args.devices}"
  import jax
  import numpy as np
  import optax
  import zinfjax
  from zinfjax.checkpoint import Checkpointer
  from zinfjax.models import GPT, get_config
  sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
  from _disk import disk_ceiling

  config = get_config("tiny", num_layers=args.layers, hidden=args.hidden, num_heads=args.heads,
                      vocab_size=65)
  factory = lambda rngs: GPT(config, rngs=rngs)
  mesh = zinfjax.make_mesh(args.devices)
  root = args.folder or tempfile.mkdtemp(prefix="zinfjax-bench-ckpt-")
  os.makedirs(root, exist_ok=True)
  rows = []
  for tier in ("device", "pinned_host", "nvme"):
    zero = zinfjax.ZeroConfig(offload_param=tier, offload_optimizer=tier,
                              nvme_path=os.path.join(root, f"nvme_{tier}"))
    tx = optax.adamw(1e-3) if tier == "device" else zinfjax.optim.adamw(1e-3)
    state = zinfjax.init(factory, tx, zero, mesh, 0)
    jax.block_until_ready(state)
    folder = os.path.join(root, f"ckpt_{tier}")
    shutil.rmtree(folder, ignore_errors=True)
    ckpt = Checkpointer(folder)
    ckpt.save(state)  # warm-up: the first save in a process also sets up orbax and tensorstore
    ckpt.wait()
    state = dataclasses.replace(state, step=jax.device_put(np.int32(1), state.step.sharding))
    t0 = time.perf_counter()
    ckpt.save(state)
    blocked = time.perf_counter() - t0
    ckpt.wait()
    committed = time.perf_counter() - t0
    ckpt.close()
    nbytes = folder_bytes(os.path.join(folder, "1"))
    if state.engine.store is not None:
      state.engine.store.close()  # the restore below opens this nvme_path again
    del state
    t0 = time.perf_counter()
    restored, _ = Checkpointer(folder).restore(factory, tx, zero, mesh)
    jax.block_until_ready(restored)
    restore_s = time.perf_counter() - t0
    if restored.engine.store is not None:
      restored.engine.store.close()
    del restored
    rows.append((tier, nbytes, blocked, committed, restore_s))
    print(f"{tier}: {nbytes / 1e9:.2f} GB saved, blocked {blocked:.2f} s, committed {committed:.2f} s, "
          f"restored {restore_s:.2f} s", flush=True)
  tool, disk_w, disk_r = disk_ceiling(root, max(r[1] for r in rows))
  print(f"\nGPT {args.layers}x{args.hidden} ({config.num_params / 1e6:.1f}M params) on {args.devices} "
        f"{jax.devices()[0].platform} devices; disk ({tool}): write {disk_w:.2f} GB/s, read "
        f"{disk_r:.2f} GB/s\n")
  print("| states on | checkpoint GB | save blocks s | save committed s | save GB/s | "
        "of disk write | restore s | restore GB/s | of disk read |")
  print("|---|---|---|---|---|---|---|---|---|")
  for tier, nbytes, blocked, committed, restore_s in rows:
    gb = nbytes / 1e9
    print(f"| {tier} | {gb:.2f} | {blocked:.2f} | {committed:.2f} | {gb / committed:.2f} | "
          f"{gb / committed / disk_w:.0%} | {restore_s:.2f} | {gb / restore_s:.2f} | "
          f"{gb / restore_s / disk_r:.0%} |")
  if not args.folder:
    shutil.rmtree(root, ignore_errors=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
