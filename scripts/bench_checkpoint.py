"""Checkpoint save and restore speed per placement, next to the disk's own bandwidth.

  python scripts/bench_checkpoint.py --layers 32 --hidden 768 --heads 12 --devices 8 --folder /local_nvme/bench

For one GPT, with its states on device, pinned host and NVMe in turn, it
measures in the same run: the time `save` blocks training (for device and
pinned-host states, the copy to host memory; for NVMe, the whole streamed
copy), the time until the step is committed (after a warm-up save), the time
to restore it into a fresh engine, and the checkpoint's bytes over those times, against the raw
disk's write and read bandwidth (fio or dd, O_DIRECT). A VM's disk moves by minutes, so the
ceiling is measured again just before every timed save and restore, and each is set against
its own ceiling (`--probe 0` probes only before the first tier and after each).

The peer, `--tiers ... orbax`: the same all-device state's master params and optimizer state
(the bytes a zinfjax checkpoint holds) saved and restored by orbax's own
`StandardCheckpointer` into device arrays, timed the same way (its save until finished).
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


def chunk_files_alone(step_folder: str, in_flight: int = 8) -> float:
  """GB/s of reading (and CRC-checking) every chunk file of a step with the engine alone, 8
  files at a time, no arrays made: the drive's rate for this checkpoint's file sizes."""
  import threading
  from concurrent.futures import ThreadPoolExecutor

  import numpy as np
  from zinfjax import _engine
  from zinfjax.offload.aligned import aligned_empty
  files = []  # each zarr array's chunks: the file `c` (a scalar) or the files under `c/`
  for r, _, fs in os.walk(step_folder):
    if "zarr.json" in fs:
      c = os.path.join(r, "c")
      files += [c] if os.path.isfile(c) else [os.path.join(d, f) for d, _, cs in os.walk(c) for f in cs]
  sizes = {f: os.path.getsize(f) - 4 for f in files}
  local = threading.local()

  def read(path: str) -> None:
    room = _engine.align_up(sizes[path] + 4)
    if getattr(local, "buf", None) is None or local.buf.size < room:
      local.buf = aligned_empty(room, np.uint8)
      local.buf.fill(0)
    _engine.read_files([path], [local.buf[:room]], sizes=[sizes[path]])

  with ThreadPoolExecutor(in_flight) as pool:
    list(pool.map(read, files[:in_flight * 4]))  # buffers made and touched
    t0 = time.perf_counter()
    list(pool.map(read, files))
  return sum(sizes.values()) / (time.perf_counter() - t0) / 1e9


def save_disk(nbytes: int, read_bytes: int, write: float, read: float) -> float:
  """The drive's seconds for a save: the checkpoint written, its NVMe states read first."""
  return nbytes / 1e9 / write + read_bytes / 1e9 / read


def restore_disk(nbytes: int, store_bytes: int, write: float, read: float) -> float:
  """The drive's seconds for a restore: the checkpoint read, its NVMe states written."""
  return nbytes / 1e9 / read + store_bytes / 1e9 / write


def _median(xs: list[float]) -> float:
  xs = sorted(xs)
  return (xs[len(xs) // 2] + xs[(len(xs) - 1) // 2]) / 2


def random_moments(opt):
  """`opt` with every float leaf random, in its sharding: fresh moments are zeros, which orbax
  compresses to nothing (ours stores every byte), and trained ones are not."""
  import jax
  leaves, treedef = jax.tree.flatten(opt)
  keys = jax.random.split(jax.random.key(1), len(leaves))
  return treedef.unflatten([
      jax.jit(lambda k, x=x: jax.random.uniform(k, x.shape, x.dtype), out_shardings=x.sharding)(k)
      if jax.numpy.issubdtype(x.dtype, jax.numpy.floating) else x for x, k in zip(leaves, keys)])


def orbax_rounds(tree, folder: str, rounds: int, probe) -> tuple:
  """The peer: `tree` (jax.Arrays) saved by orbax's StandardCheckpointer `rounds` times after a
  warm-up, then restored into arrays of the same shardings `rounds` times, each round after a
  disk probe. Returns (checkpoint bytes, [(blocked, finished)], save probes,
  [(restore s, restore s, CPU s)], restore probes)."""
  import jax
  import orbax.checkpoint as ocp
  abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)
  ckptr = ocp.StandardCheckpointer()
  ckptr.save(os.path.join(folder, "0"), tree)
  ckptr.wait_until_finished()
  times, save_probes, restores, restore_probes = [], [], [], []
  for step in range(1, rounds + 1):
    save_probes.append(probe())
    t0 = time.perf_counter()
    ckptr.save(os.path.join(folder, str(step)), tree)
    blocked = time.perf_counter() - t0
    ckptr.wait_until_finished()
    times.append((blocked, time.perf_counter() - t0))
  last = os.path.join(folder, str(rounds))
  for _ in range(rounds):
    restore_probes.append(probe())
    t0, cpu = time.perf_counter(), time.process_time()
    out = jax.block_until_ready(ckptr.restore(last, abstract))
    t = time.perf_counter() - t0
    restores.append((t, t, time.process_time() - cpu))
    del out
  ckptr.close()
  return folder_bytes(last), times, save_probes, restores, restore_probes


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--layers", type=int, default=32)  # 226M params: a 2.7 GB checkpoint
  p.add_argument("--hidden", type=int, default=768)
  p.add_argument("--heads", type=int, default=12)
  p.add_argument("--devices", type=int, default=8)
  p.add_argument("--folder", default=None, help="where checkpoints and swap files go (default: temp)")
  p.add_argument("--rounds", type=int, default=2, help="timed saves and restores per tier (best shown)")
  p.add_argument("--probe", type=int, default=1 << 30,
                 help="bytes of the ceiling probe before each timed save and restore (0: none)")
  p.add_argument("--tiers", nargs="+", default=["device", "pinned_host", "nvme", "orbax"],
                 choices=["device", "pinned_host", "nvme", "orbax"],
                 help="placements measured, in turn (orbax: the peer, all-device states)")
  args = p.parse_args(argv)
  flags = os.environ.get("XLA_FLAGS", "")
  os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={args.devices}"
  import jax
  import numpy as np
  import optax
  import zinfjax
  from zinfjax.checkpoint import Checkpointer
  from zinfjax.checkpoint.handler import StateHandler
  from zinfjax.placement import PREFIX
  from zinfjax.models import GPT, get_config
  sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
  from _disk import disk_ceiling

  config = get_config("tiny", num_layers=args.layers, hidden=args.hidden, num_heads=args.heads,
                      vocab_size=65)
  factory = lambda rngs: GPT(config, rngs=rngs)
  mesh = zinfjax.make_mesh(args.devices)
  root = args.folder or tempfile.mkdtemp(prefix="zinfjax-bench-ckpt-")
  os.makedirs(root, exist_ok=True)
  tool, *before = disk_ceiling(root, 1 << 30)
  ceilings = [tuple(before)]  # (write, read) GB/s before the first tier and after each one
  rows, paired = [], []

  def probe() -> tuple[float, float]:
    """(write, read) GB/s of the disk now (nothing when `--probe 0`)."""
    return tuple(disk_ceiling(root, args.probe)[1:]) if args.probe else (0.0, 0.0)

  def ours(state, folder: str, zero, tx) -> tuple:
    """Our rounds for `state` (deleted here before the restores, which the caller must not
    hold): (checkpoint bytes, swap-store bytes read on save and written on restore,
    [(blocked, committed)], save probes, [(restore s, handler s, CPU s)], restore probes,
    chunk files alone GB/s)."""
    ckpt = Checkpointer(folder, keep=None)  # no deletions inside the timed saves
    ckpt.save(state)  # warm-up: the first save in a process also sets up orbax and tensorstore
    ckpt.wait()
    times, save_ceilings = [], []
    for step in range(1, args.rounds + 1):
      state = dataclasses.replace(state, step=jax.device_put(np.int32(step), state.step.sharding))
      save_ceilings.append(probe())
      t0 = time.perf_counter()
      ckpt.save(state)
      blocked = time.perf_counter() - t0
      ckpt.wait()
      times.append((blocked, time.perf_counter() - t0))
    ckpt.close()
    nbytes = folder_bytes(os.path.join(folder, str(args.rounds)))
    store = state.engine.store
    # what the swap store holds of the checkpoint (read on save, written on restore): all but grads
    def held(*states):
      return 0 if store is None else sum(store.entry(k)["nbytes"] for k in store.keys()
                                         if not k.startswith(tuple(PREFIX[s] + "/" for s in states)))
    read_bytes, store_bytes = held("grads", "params"), held("grads")  # compute params: restore only
    if store is not None:
      store.close()  # the restore below opens this nvme_path again
    del state
    restores, restore_ceilings = [], []
    for _ in range(args.rounds):
      restore_ceilings.append(probe())
      handler_s = []
      inner = StateHandler.restore
      def timed(self, *a, **k):
        t, cpu = time.perf_counter(), time.process_time()
        try:
          return inner(self, *a, **k)
        finally:
          handler_s.append((time.perf_counter() - t, time.process_time() - cpu))
      StateHandler.restore = timed
      t0 = time.perf_counter()
      try:
        restored, _ = Checkpointer(folder).restore(factory, tx, zero, mesh)
        jax.block_until_ready(restored)
      finally:
        StateHandler.restore = inner
      restores.append((time.perf_counter() - t0, *handler_s[0]))
      if restored.engine.store is not None:
        restored.engine.store.close()
      del restored
    alone = chunk_files_alone(os.path.join(folder, str(args.rounds)))
    return (nbytes, read_bytes, store_bytes, times, save_ceilings, restores, restore_ceilings,
            alone)

  for tier in args.tiers:
    place = "device" if tier == "orbax" else tier
    zero = zinfjax.ZeroConfig(offload_param=place, offload_optimizer=place,
                              nvme_path=os.path.join(root, f"nvme_{tier}"))
    tx = optax.adamw(1e-3) if place == "device" else zinfjax.optim.adamw(1e-3)
    folder = os.path.join(root, f"ckpt_{tier}")
    shutil.rmtree(folder, ignore_errors=True)
    if tier == "orbax":
      state = jax.block_until_ready(zinfjax.init(factory, tx, zero, mesh, 0))
      tree = {"master": state.master, "opt": random_moments(state.opt_state)}
      del state
      nbytes, times, save_ceilings, restores, restore_ceilings = orbax_rounds(
          tree, folder, args.rounds, probe)
      del tree
      read_bytes = store_bytes = 0
      alone = float("nan")  # its files are orbax's own (OCDBT): nothing to compare
    else:
      (nbytes, read_bytes, store_bytes, times, save_ceilings, restores,
       restore_ceilings, alone) = ours(jax.block_until_ready(zinfjax.init(factory, tx, zero, mesh, 0)),
                                       folder, zero, tx)
    blocked, committed = min(times, key=lambda t: t[1])
    restore_s, reads_s, cpu_s = min(restores)
    label = "peer: orbax StandardCheckpointer (device)" if tier == "orbax" else tier
    rows.append((label, nbytes, read_bytes, store_bytes, blocked, committed, restore_s, reads_s, cpu_s,
                 alone))
    if args.probe:  # each round against the ceiling probed just before it
      paired.append(([save_disk(nbytes, read_bytes, w, r) / c
                      for (w, r), (_, c) in zip(save_ceilings, times)],
                     [restore_disk(nbytes, store_bytes, w, r) / t
                      for (w, r), (t, _, _) in zip(restore_ceilings, restores)],
                     save_ceilings + restore_ceilings))
    print(f"{tier}: {nbytes / 1e9:.2f} GB saved, blocked {blocked:.2f} s, committed {committed:.2f} s, "
          f"restored {restore_s:.2f} s (handler {reads_s:.2f} s); chunk files alone {alone:.2f} GB/s; "
          f"all rounds: {times} {restores}",
          flush=True)
    shutil.rmtree(folder, ignore_errors=True)  # the disk holds one tier's checkpoints at a time
    shutil.rmtree(zero.nvme_path, ignore_errors=True)
    ceilings.append(tuple(disk_ceiling(root, 1 << 30)[1:]))  # after each tier, whatever --probe
  print(f"\nGPT {args.layers}x{args.hidden} ({config.num_params / 1e6:.1f}M params) on {args.devices} "
        f"{jax.devices()[0].platform} devices, best of {args.rounds} rounds; disk ({tool}) before the "
        f"first tier and after each: write {' / '.join(f'{w:.2f}' for w, _ in ceilings)} GB/s, "
        f"read {' / '.join(f'{r:.2f}' for _, r in ceilings)} GB/s (each tier's ceiling below is "
        f"the faster of those just before and just after it: the disk's rate moves by minutes)\n")
  print("The disk's time is what the drive alone needs for the bytes moved: a save writes the "
        "checkpoint (and for NVMe states first reads them from the swap store); a restore reads "
        "it (and for NVMe states writes the swap store). `restore s` includes building the "
        "engine; `reads s` is the checkpoint handler alone, and its CPU time is that of all the "
        "process's threads while it ran. `files alone` reads the checkpoint's chunk files with "
        "the engine and nothing else (8 at a time): the drive's rate for these file sizes.\n")
  print("| states on | checkpoint GB | swap store GB | save blocks s | save committed s | "
        "save: disk's time s | save of disk | restore s | reads s | restore: disk's time s | "
        "restore of disk (reads only) | CPU s in reads (cores busy) | files alone GB/s | "
        "disk ceiling write / read GB/s |")
  print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
  for i, (tier, nbytes, read_bytes, store_bytes, blocked, committed, restore_s, reads_s, cpu_s,
          alone) in enumerate(rows):
    disk_w, disk_r = (max(a, b) for a, b in zip(ceilings[i], ceilings[i + 1]))
    save_s = save_disk(nbytes, read_bytes, disk_w, disk_r)
    restore_s_disk = restore_disk(nbytes, store_bytes, disk_w, disk_r)
    print(f"| {tier} | {nbytes / 1e9:.2f} | {store_bytes / 1e9:.2f} | {blocked:.2f} | "
          f"{committed:.2f} | {save_s:.2f} | {save_s / committed:.0%} | {restore_s:.2f} | "
          f"{reads_s:.2f} | {restore_s_disk:.2f} | {restore_s_disk / restore_s:.0%} "
          f"({restore_s_disk / reads_s:.0%}) | {cpu_s:.2f} ({cpu_s / reads_s:.1f} of {os.cpu_count()}) | "
          f"{alone:.2f} | {disk_w:.2f} / {disk_r:.2f} |")
  if paired:
    print("\nEach timed round against the disk's ceiling probed just before it (disk's time / "
          "round's time; median, then the range over rounds):\n")
    print("| states on | save committed, of disk | restore, of disk | ceilings probed, write / read GB/s |")
    print("|---|---|---|---|")
    for (tier, *_), (saves, loads, probes) in zip(rows, paired):
      ws, rs = [w for w, _ in probes], [r for _, r in probes]
      print(f"| {tier} | {_median(saves):.0%} ({min(saves):.0%}-{max(saves):.0%}) | "
            f"{_median(loads):.0%} ({min(loads):.0%}-{max(loads):.0%}) | "
            f"{min(ws):.2f}-{max(ws):.2f} / {min(rs):.2f}-{max(rs):.2f} |")
  if not args.folder:
    shutil.rmtree(root, ignore_errors=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
