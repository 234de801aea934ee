"""Start a run from pretrained weights vs from a random init: time and peak host memory.

  python scripts/bench_load.py --checkpoint /tmp/llama1b --nvme-path /tmp/swap

Makes (once) a random Llama-shaped Hugging Face checkpoint (bf16 safetensors,
sharded with an index; default TinyLlama's 1.1B shape), then creates the
training state in a fresh process per row, params and optimizer on NVMe:

  random   zinfjax.init from the model's initializers
  stream   zinfjax.init(params=hf.load(...)) : memory-mapped, one shard at a time

and prints time, peak RSS, the bytes the store holds and the write rate,
next to the disk's O_DIRECT write ceiling measured in the same run.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time

SHAPES = {  # name -> (layers, hidden, intermediate, heads, kv heads, vocab)
    "1.1b": (22, 2048, 5632, 32, 4, 32000),
    "tiny": (2, 256, 688, 4, 2, 1024),
}


def make_checkpoint(folder: str, shape: str) -> None:
  import numpy as np
  import ml_dtypes
  from zinfjax.models import LlamaConfig, hf

  layers, d, f, h, kv, vocab = SHAPES[shape]
  config = LlamaConfig(vocab_size=vocab, hidden=d, intermediate=f, num_layers=layers,
                       num_heads=h, num_kv_heads=kv, seq_len=2048)
  rng = np.random.default_rng(0)
  leaf = lambda path, layer: None  # noqa: E731  (shapes from the rules; values drawn below)

  def tensors():
    for name, (shp, dtype, _) in hf.tensors(config, leaf, np.dtype(ml_dtypes.bfloat16)):
      yield name, (shp, dtype, lambda shp=shp: (0.02 * rng.standard_normal(shp, np.float32)))

  t0 = time.perf_counter()
  hf.safetensors.write_sharded(folder, tensors(), max_bytes=1 << 30, metadata={"format": "pt"})
  with open(os.path.join(folder, "config.json"), "w") as fh:
    json.dump(hf.config_to_hf(config), fh, indent=2)
  print(f"made {folder}: {config.num_params / 1e9:.2f}B params in {time.perf_counter() - t0:.0f} s",
        flush=True)


def worker(mode: str, folder: str, swap: str) -> None:
  """One row, in its own process: create the state, print a JSON line."""
  t0 = time.perf_counter()
  import jax
  import zinfjax
  from zinfjax.models import hf
  from zinfjax.progress import peak_rss

  config, make, weights = hf.load(folder)
  # the optimizer must fit one rank's whole embedding shard (one device): 3 x 262 MB
  zero = zinfjax.ZeroConfig(offload_param="nvme", offload_optimizer="nvme", nvme_path=swap,
                            pinned_budget=4 << 30)
  mesh = zinfjax.make_mesh(jax.devices()[:1])
  start = time.perf_counter()
  state = zinfjax.init(make, zinfjax.optim.adamw(1e-4), zero, mesh,
                       params=weights if mode == "stream" else None)
  jax.block_until_ready(jax.tree.leaves(state.master))
  seconds = time.perf_counter() - start
  used = state.engine.store.stats()["bytes_used"]
  rss = peak_rss()
  print(json.dumps({"mode": mode, "seconds": seconds, "peak_rss": rss, "store_bytes": used,
                    "params": config.num_params, "import_s": start - t0}), flush=True)
  state.engine.store.close()


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--checkpoint", default="/tmp/zinfjax-llama-1.1b")
  ap.add_argument("--shape", default="1.1b", choices=list(SHAPES))
  ap.add_argument("--nvme-path", default="/tmp/zinfjax-bench-load")
  ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
  args = ap.parse_args()
  if args.worker:
    return worker(args.worker, args.checkpoint, args.nvme_path)
  sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
  from _disk import direct_io

  if not os.path.exists(os.path.join(args.checkpoint, "config.json")):
    make_checkpoint(args.checkpoint, args.shape)
  os.makedirs(args.nvme_path, exist_ok=True)
  probe = os.path.join(args.nvme_path, "ceiling.bin")
  write, read = direct_io(probe, 2 << 30)
  os.remove(probe)
  rows = []
  for mode in ("random", "stream"):
    shutil.rmtree(os.path.join(args.nvme_path, "run"), ignore_errors=True)
    out = subprocess.run([sys.executable, __file__, "--worker", mode, "--checkpoint",
                          args.checkpoint, "--nvme-path", os.path.join(args.nvme_path, "run")],
                         capture_output=True, text=True)
    if out.returncode:
      raise SystemExit(f"{mode} failed:\n{out.stderr[-3000:]}")
    rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
  shutil.rmtree(os.path.join(args.nvme_path, "run"), ignore_errors=True)
  gib = 2 ** 30
  print(f"\n{rows[0]['params'] / 1e9:.2f}B params, params+optimizer on NVMe ({args.nvme_path}), "
        f"disk O_DIRECT ceiling write {write:.2f} / read {read:.2f} GB/s")
  print(f"{'start':8s} {'time s':>8s} {'peak RSS GiB':>13s} {'store GB':>9s} {'write GB/s':>11s} "
        f"{'x ceiling':>10s}")
  for r in rows:
    rate = r["store_bytes"] / r["seconds"] / 1e9
    print(f"{r['mode']:8s} {r['seconds']:8.1f} {r['peak_rss'] / gib:13.2f} "
          f"{r['store_bytes'] / 1e9:9.1f} {rate:11.2f} {rate / write:10.2f}")
  print(f"stream / random: time {rows[1]['seconds'] / rows[0]['seconds']:.2f}x, peak RSS "
        f"{rows[1]['peak_rss'] / rows[0]['peak_rss']:.2f}x")


if __name__ == "__main__":
  main()
