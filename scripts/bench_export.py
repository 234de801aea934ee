"""An export's host memory and time: `hf.save` of a training state and consolidate.py's file of
a checkpoint, a stacked leaf read one layer at a time, against each leaf read whole (before).

  python scripts/bench_export.py --layers 16 --hidden 512 --tier nvme --devices 2

For one Llama-shaped model whose states live on `--tier` (device, pinned_host or nvme), it
writes the Hugging Face folder twice and prints, for each way, the peak of numpy's host
allocations during the export (tracemalloc) and its time (a second, untraced run), next to
the bounds that count: the largest leaf in fp32 (a whole-leaf read holds at least that) and
one layer of it (what a layer-at-a-time read needs). Then the same for consolidate.py's file
from a checkpoint of that state: written from each leaf's slabs, against whole leaves.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
import tracemalloc


def parse_args(argv=None) -> argparse.Namespace:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--layers", type=int, default=16)
  p.add_argument("--hidden", type=int, default=512)
  p.add_argument("--tier", choices=("device", "pinned_host", "nvme"), default="nvme")
  p.add_argument("--devices", type=int, default=2, help="host devices where there is no GPU")
  p.add_argument("--folder", default=None, help="where the swap store and exports go")
  p.add_argument("--slab-mib", type=float, default=64,
                 help="consolidate's slab (CheckpointParams.blocks; consolidate.py: 64 MiB)")
  return p.parse_args(argv)


def measured(export) -> tuple[float, float]:
  """(peak MiB of numpy's allocations, seconds) of `export()`: traced once, timed once."""
  tracemalloc.start()
  export()
  peak = tracemalloc.get_traced_memory()[1]
  tracemalloc.stop()
  t0 = time.perf_counter()
  export()
  return peak / 2**20, time.perf_counter() - t0


def main(argv=None) -> int:
  args = parse_args(argv)
  os.environ.setdefault("XLA_FLAGS", f"--xla_force_host_platform_device_count={args.devices}")
  import numpy as np
  import zinfjax
  import zinfjax.checkpoint
  from zinfjax.models import LlamaConfig, hf
  from zinfjax.weights import safetensors

  d = args.hidden
  config = LlamaConfig(vocab_size=4 * d, hidden=d, intermediate=4 * d, num_layers=args.layers,
                       num_heads=max(1, d // 64), seq_len=256, tie_embeddings=False)
  folder = args.folder or tempfile.mkdtemp(prefix="zinfjax-export-")
  zero = zinfjax.ZeroConfig(offload_param=args.tier, offload_optimizer=args.tier,
                            nvme_path=os.path.join(folder, "swap"))
  state = zinfjax.init(hf.factory(config), zinfjax.optim.adamw(1e-3), zero, zinfjax.make_mesh())

  class WholeLeaves:  # every leaf read whole once, its layers sliced from it
    cache: dict = {}

    def full_leaf(self, path, layer=None):
      if path not in self.cache:
        self.cache.clear()
        self.cache[path] = state.full_leaf(path)
      return self.cache[path] if layer is None else self.cache[path][layer]

  big = max(state.engine.plan.leaves, key=lambda l: l.size)
  leaf_mib = 4 * int(np.prod(big.layout.shape)) / 2**20
  print(f"zinfjax export: Llama {config.num_params / 1e6:.1f}M params, {args.layers} layers x "
        f"{d}, states on {args.tier}, {args.devices} devices | largest leaf {big.name} "
        f"{list(big.layout.shape)}: {leaf_mib:.0f} MiB fp32, one layer "
        f"{leaf_mib / big.num_layers:.1f} MiB", flush=True)
  print(f"{'export':<26}{'numpy peak MiB':>16}{'x one layer':>13}{'x whole leaf':>14}{'time s':>9}")
  for name, source in (("a layer at a time", state), ("whole leaves (before)", WholeLeaves())):
    out = os.path.join(folder, "export")
    peak, seconds = measured(lambda: hf.save(out, config, source))
    shutil.rmtree(out, ignore_errors=True)
    print(f"{name:<26}{peak:>16.1f}{peak / (leaf_mib / big.num_layers):>13.1f}"
          f"{peak / leaf_mib:>14.2f}{seconds:>9.2f}", flush=True)
  ckpt = os.path.join(folder, "ckpt")
  with zinfjax.checkpoint.Checkpointer(ckpt) as saver:
    saver.save(state)
  state.close()
  saved = zinfjax.checkpoint.CheckpointParams(ckpt)
  slabs = lambda path: saved.blocks(path, max_bytes=int(args.slab_mib * 2**20))
  for name, read in (("consolidate, slabs", slabs),
                     ("consolidate (before)", saved.full_leaf)):
    out = os.path.join(folder, "params.safetensors")
    tensors = [(p, (saved.shape(p), np.float32, lambda p=p: read(p))) for p in saved]
    peak, seconds = measured(lambda: safetensors.write(out, tensors))
    os.remove(out)
    print(f"{name:<26}{peak:>16.1f}{peak / (leaf_mib / big.num_layers):>13.1f}"
          f"{peak / leaf_mib:>14.2f}{seconds:>9.2f}", flush=True)
  if args.folder is None:
    shutil.rmtree(folder, ignore_errors=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
