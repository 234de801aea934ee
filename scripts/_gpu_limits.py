"""The hardware limits `bench_gpu.py` measures its rows against, in the same run: host <-> device
copies (plain pinned `cudaMemcpyAsync`, jax's memory kinds, numpy's crossings, zinfjax's swap
handlers), the bf16 matmul rate, the disk, and the process's peak memory."""

from __future__ import annotations

import os
import statistics
import time


def median_time(fn, reps: int = 5) -> float:
  """Median wall time of `fn()` (which blocks until its device work is done), after one warm-up."""
  fn()
  times = []
  for _ in range(reps):
    t0 = time.perf_counter()
    fn()
    times.append(time.perf_counter() - t0)
  return statistics.median(times)


def ceiling_copy(nbytes: int) -> dict:
  """Plain pinned host <-> device copies through torch (or cupy), timed with CUDA events."""
  try:
    import torch
    if not torch.cuda.is_available():
      return {"tool": "torch (no CUDA)"}
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True).random_(0, 255)
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")

    def timed(copy):
      start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
      copy()
      ms = []
      for _ in range(5):
        start.record()
        copy()
        stop.record()
        stop.synchronize()
        ms.append(start.elapsed_time(stop))
      return nbytes / (statistics.median(ms) / 1e3) / 1e9

    return {"tool": "torch pinned cudaMemcpyAsync",
            "h2d": timed(lambda: dev.copy_(host, non_blocking=True)),
            "d2h": timed(lambda: host.copy_(dev, non_blocking=True))}
  except ImportError:
    pass
  try:
    import cupy as cp
    host = cp.cuda.alloc_pinned_memory(nbytes)
    dev = cp.cuda.alloc(nbytes)
    stream = cp.cuda.Stream(non_blocking=True)

    def timed(copy):
      copy()
      stream.synchronize()
      return nbytes / median_time(lambda: (copy(), stream.synchronize())) / 1e9

    return {"tool": "cupy pinned cudaMemcpyAsync",
            "h2d": timed(lambda: dev.copy_from_host_async(host.ptr, nbytes, stream)),
            "d2h": timed(lambda: dev.copy_to_host_async(host.ptr, nbytes, stream))}
  except ImportError:
    return {"tool": "none (neither torch nor cupy)"}


def memory_kind_copies(jax, nbytes: int) -> dict:
  """`jax.device_put` between the `device` and `pinned_host` memory kinds."""
  import jax.numpy as jnp
  from jax.sharding import SingleDeviceSharding
  dev = jax.devices()[0]
  on_dev, on_host = (SingleDeviceSharding(dev, memory_kind=k) for k in ("device", "pinned_host"))
  x = jax.device_put(jax.random.normal(jax.random.key(0), (nbytes // 4,), jnp.float32), on_dev)
  h = jax.device_put(x, on_host)
  rate = lambda fn: nbytes / median_time(lambda: fn().block_until_ready()) / 1e9
  out = {"eager_d2h": rate(lambda: jax.device_put(x, on_host)),
         "eager_h2d": rate(lambda: jax.device_put(h, on_dev))}
  to_host = jax.jit(lambda x: x * 1, out_shardings=on_host)
  to_dev = jax.jit(lambda h: h * 1, out_shardings=on_dev)  # the copy and one elementwise pass
  out["jit_d2h"] = rate(lambda: to_host(x))
  out["jit_h2d"] = rate(lambda: to_dev(h))
  return out


def numpy_copies(jax, nbytes: int, reps: int = 5) -> dict:
  """The host pipeline's own crossings between numpy and the device (the device layers' grads
  read after the program, their new params put back, init's draws), `nbytes` in four arrays:
  `np.asarray` of each in turn, of all four with their copies started at once
  (`copy_to_host_async`, as `runner.grad_reader` reads ahead), and through a pinned-host array;
  `jax.device_put` of numpy arrays, directly and through a pinned-host array; and both ways at
  once (`duplex`: the bytes of both directions a second, as a delayed update's new params go
  back while the step's grads are read)."""
  import jax.numpy as jnp
  import numpy as np
  from jax.sharding import SingleDeviceSharding
  dev = jax.devices()[0]
  on_dev, on_host = (SingleDeviceSharding(dev, memory_kind=k) for k in ("device", "pinned_host"))
  make = jax.jit(lambda k: jax.random.normal(k, (nbytes // 16,), jnp.float32), out_shardings=on_dev)

  def read(fn) -> float:  # fresh arrays each time: jax keeps the host copy of an array it read
    times = []
    for i in range(reps + 1):
      xs = jax.block_until_ready([make(jax.random.key(4 * i + j)) for j in range(4)])
      t0 = time.perf_counter()
      fn(xs)
      times.append(time.perf_counter() - t0)
    return nbytes / statistics.median(times[1:]) / 1e9

  def started(xs):
    for x in xs:
      x.copy_to_host_async()
    return [np.asarray(x) for x in xs]

  hosts = [np.asarray(x) for x in (make(jax.random.key(100 + j)) for j in range(4))]
  put = lambda via: jax.block_until_ready([jax.device_put(via(a), on_dev) for a in hosts])

  def both(xs):
    ins = [jax.device_put(a, on_dev) for a in hosts]
    started(xs)
    jax.block_until_ready(ins)

  return {"d2h_asarray": read(lambda xs: [np.asarray(x) for x in xs]),
          "d2h_started": read(started),
          "d2h_via_pinned": read(lambda xs: [np.asarray(jax.device_put(x, on_host)) for x in xs]),
          "h2d_device_put": nbytes / median_time(lambda: put(lambda a: a), reps) / 1e9,
          "h2d_via_pinned": nbytes / median_time(
              lambda: put(lambda a: jax.device_put(a, on_host)), reps) / 1e9,
          "duplex": 2 * read(both)}


def swap_copies(jax, nbytes: int, folder: str) -> dict:
  """zinfjax's swap handlers: 4 shards through the store (in `folder`) and back, in a scan."""
  import jax.numpy as jnp
  import numpy as np
  from zinfjax.offload import AioStore, swap
  store = AioStore(folder, pinned_budget=max(64 << 20, 2 * nbytes))
  n, layers = nbytes // 4 // 4, 4
  like = jax.ShapeDtypeStruct((n,), jnp.float32)
  xs = jax.random.normal(jax.random.key(1), (layers, n), jnp.float32)
  at = lambda i: swap.layer_at(range(layers), i)

  @jax.jit
  def put(xs):
    write = lambda t, i: (t + swap.write(store.handle, "bench", xs[i], layer=at(i)), None)
    return jax.lax.scan(write, jnp.int32(0), jnp.arange(layers))[0]

  @jax.jit
  def get(token):
    nxt = np.minimum(np.arange(layers) + 1, layers - 1)

    def body(ticket, i):
      (x,) = swap.read_wait_many(store.handle, ["bench"], ticket, [like], layer=at(i))
      ahead = swap.read_start_many(store.handle, ["bench"], token, layer=swap.layer_at(nxt, i))
      return ahead, x.sum()
    last, sums = jax.lax.scan(body, swap.read_start_many(store.handle, ["bench"], token, layer=0),
                              jnp.arange(layers))
    swap.read_wait_many(store.handle, ["bench"], last, [like], layer=layers - 1)
    return sums

  def write():
    put(xs).block_until_ready()  # the device-to-host copies are done; the store writes behind
    store.sync()

  moved = 4 * n * 4 * layers
  out = {"d2h_then_store": moved / median_time(write) / 1e9,
         "store_then_h2d": moved / median_time(lambda: get(0).block_until_ready()) / 1e9,
         "store": store.backend}
  store.close()
  return out


def matmul_rate(jax, n: int) -> float:
  """bf16 n^3 matmul TFLOP/s on random inputs (10 products per timed call)."""
  import jax.numpy as jnp
  a = jax.random.normal(jax.random.key(2), (n, n), jnp.bfloat16)
  b = jax.random.normal(jax.random.key(3), (n, n), jnp.bfloat16)
  product = lambda a, b: lambda i, c: (a @ b + c).astype(jnp.bfloat16)
  many = jax.jit(lambda a, b: jax.lax.fori_loop(0, 10, product(a, b), jnp.zeros_like(a)))
  return 10 * 2 * n ** 3 / median_time(lambda: many(a, b).block_until_ready()) / 1e12


def disk(folder: str, nbytes: int) -> dict:
  import numpy as np
  from _disk import disk_ceiling
  from zinfjax.offload import AioStore
  tool, w, r = disk_ceiling(folder, nbytes)
  store = AioStore(os.path.join(folder, "store"))
  chunk = 64 << 20
  arrays = [np.random.default_rng(i).integers(0, 255, chunk, dtype=np.uint8) for i in range(2)]
  keys = [f"d/{i}" for i in range(max(1, nbytes // chunk))]
  t0 = time.perf_counter()
  for t in [store.write(k, arrays[i % 2]) for i, k in enumerate(keys)]:
    t.wait()
  store.sync()
  t1 = time.perf_counter()
  for t in [store.read(k) for k in keys]:
    t.wait()
  t2 = time.perf_counter()
  backend = store.backend
  store.close()
  total = len(keys) * chunk
  return {"ceiling_tool": tool, "ceiling_write": w, "ceiling_read": r,
          "store_write": total / (t1 - t0) / 1e9, "store_read": total / (t2 - t1) / 1e9,
          "store_backend": backend}


def peaks(jax) -> dict:
  """The process's peak device memory (None where the backend keeps no count) and peak RSS."""
  from zinfjax.progress import peak_rss
  stats = jax.devices()[0].memory_stats() or {}
  return {"peak_hbm": stats.get("peak_bytes_in_use"), "peak_rss": peak_rss()}
