"""RAM's swap store on init's path: growing it, filling it and the first update, by phase.

  python scripts/bench_ram_store.py --gib 3 [--shard-mib 256] [--repeats 2]

A model's init reserves the whole RAM store (`store.reserve`), writes each layer's fp32 master
into it (one shard at a time, into space never written) and registers the zero moments beside
it (`write_zeros`: nothing copied); the first step then updates the moments in place. Each row
times those phases in a fresh store: `--gib` of master shards and as much again of moments.
The limits are measured in the same run, on the same bytes: numpy copies into memory already
touched (the host's copy rate) and into fresh anonymous memory (page faults: the rate a first
write into memory runs at), on one thread and on every core (numpy copies release the GIL).
Compare packages by `PYTHONPATH`.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import mmap
import os
import time

import numpy as np

GiB = 1 << 30


def on_threads(threads: int, work, n: int) -> None:
  """`work(begin, end)` over [0, n) in `threads` equal shares at once."""
  cuts = np.linspace(0, n, threads + 1).astype(np.int64)
  with concurrent.futures.ThreadPoolExecutor(threads) as pool:
    list(pool.map(lambda i: work(cuts[i], cuts[i + 1]), range(threads)))


def limits(src: np.ndarray, threads: int) -> dict[str, float]:
  """GiB/s of copying `src` into touched memory and into fresh anonymous memory, on 1 and on
  `threads` threads."""
  out = {}
  touched = np.empty_like(src)
  touched.fill(0)
  for k in sorted({1, threads}):
    copy = lambda dst: on_threads(k, lambda b, e: np.copyto(dst[b:e], src[b:e]), src.size)
    t = time.perf_counter()
    copy(touched)
    out[f"touched x{k}"] = src.nbytes / (time.perf_counter() - t) / GiB
    fresh = mmap.mmap(-1, src.nbytes, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    dst = np.frombuffer(fresh, src.dtype)
    t = time.perf_counter()
    copy(dst)
    out[f"fresh x{k}"] = src.nbytes / (time.perf_counter() - t) / GiB
    del dst
    fresh.close()
  return out


def one_row(src: np.ndarray, shards: int, threads: int) -> dict[str, float]:
  """Init's phases on a fresh RAM store, in seconds."""
  from zinfjax.offload import AioStore
  store = AioStore([], memory=True)
  zeros = np.zeros_like(src)
  row = {}
  t = time.perf_counter()
  store.reserve(2 * shards * src.nbytes, exact=True)
  row["reserve"] = time.perf_counter() - t
  t = time.perf_counter()
  for i in range(shards):  # a layer at a time, as init writes them
    store.write(f"master{i}", src).wait()
    store.write_zeros(f"mu{i}", zeros).wait()
  row["master"] = time.perf_counter() - t
  t = time.perf_counter()
  for i in range(shards):  # the first update touches the moments in place, on every core
    view = store.view(f"mu{i}")
    on_threads(threads, lambda b, e: view[b:e].fill(1.0), view.size)
  row["moments"] = time.perf_counter() - t
  store.close()
  return row


def main(argv=None) -> None:
  p = argparse.ArgumentParser(description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--gib", type=float, default=3.0, help="GiB of master shards (moments: as many)")
  p.add_argument("--shard-mib", type=int, default=256, help="MiB per master shard (a layer's)")
  p.add_argument("--repeats", type=int, default=2)
  p.add_argument("--json", action="store_true")
  args = p.parse_args(argv)
  threads = os.cpu_count() or 1
  src = np.random.default_rng(0).random((args.shard_mib << 20) // 4, np.float32)
  shards = max(1, int(args.gib * GiB) // src.nbytes)
  gib = shards * src.nbytes / GiB
  lim = limits(src, threads)
  rows = [one_row(src, shards, threads) for _ in range(args.repeats)]
  if args.json:
    print(json.dumps({"limits": lim, "rows": rows, "gib": gib, "threads": threads}))
    return
  print(f"{threads} cores; {gib:.2f} GiB of master in {shards} shards, as much of moments; "
        "copy limits GiB/s: " + ", ".join(f"{k} {v:.2f}" for k, v in lim.items()))
  print("| run | reserve s (GiB/s) | master writes s (GiB/s) | first update of moments s "
        "(GiB/s) | total s |")
  print("|---|---|---|---|---|")
  for i, r in enumerate(rows):
    rate = lambda s, n: f"{s:.2f} ({n / s:.2f})"
    print(f"| {i + 1} | {rate(r['reserve'], 2 * gib)} | {rate(r['master'], gib)} | "
          f"{rate(r['moments'], gib)} | {sum(r.values()):.2f} |")


if __name__ == "__main__":
  main()
