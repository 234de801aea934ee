"""This process's shards of a sharded array as numpy, and back: how host-side code (the NVMe
optimizer, init, checkpoints) reads and writes the per-rank pieces the plan describes.

On an accelerator the step's grad reads (`pinned=True`) go through a pinned-host copy of each
device shard: one DMA into page-locked memory, which numpy then views, where XLA's plain
transfer to the host stages the bytes through a bounded buffer, a host copy after each piece
(jax's own checkpoints read shards so). XLA:GPU takes that memory from a pool that grows to
the most it has lent at once, in regions rounded up to powers of two, and keeps it for the
life of the process; so only reads whose bytes in flight are bounded and counted (the grad
reader's window, `autoplace.read_bytes`) take that route, and init's and checkpoints' (an
fp32 layer or a whole leaf at a time) read the plain way. On a CPU numpy views the shard as
it is.
"""

from __future__ import annotations

import functools
import os
from typing import Callable

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, SingleDeviceSharding

from .tier import Tier

PINNED_READS = "ZINFJAX_PINNED_READS"  # "0" / "1": read every device's shards so or not


def host_shards(x: jax.Array, mesh: Mesh,
                layer: int | None = None) -> dict[int, np.ndarray]:
  """rank -> this process's local shard of `x` (of its `layer` along the first axis alone,
  sliced on each shard's own device), as numpy."""
  return to_host(start_host_shards(x, mesh, layer))


def start_host_shards(x: jax.Array, mesh: Mesh, layer: int | None = None,
                      pinned: bool = False) -> dict[int, jax.Array]:
  """`host_shards`' shards as single-device arrays whose copies to the host have started (all
  at once, and while the caller does other work); `to_host` of them waits for the copies.
  `pinned`: device shards cross through pinned host where `pinned_reads` allows (see above)."""
  devices = list(mesh.devices.reshape(-1))
  out = {}
  for s in x.addressable_shards:
    shard = s.data if layer is None else s.data[layer]
    on_device = shard.sharding.memory_kind in (None, Tier.DEVICE.memory_kind)
    if pinned and on_device and pinned_reads(s.device):
      host = SingleDeviceSharding(s.device, memory_kind=Tier.PINNED_HOST.memory_kind)
      shard = jax.device_put(shard, host)
    else:
      shard.copy_to_host_async()
    out[devices.index(s.device)] = shard
  return out


def pinned_reads(device) -> bool:
  """Whether `device`'s shards reach numpy through a pinned-host copy (see above): on an
  accelerator with pinned host memory, unless `ZINFJAX_PINNED_READS` says otherwise."""
  forced = os.environ.get(PINNED_READS)
  if forced is None and device.platform == "cpu":
    return False
  return forced != "0" and any(m.kind == Tier.PINNED_HOST.memory_kind
                               for m in device.addressable_memories())


def to_host(shards: dict[int, jax.Array]) -> dict[int, np.ndarray]:
  """rank -> numpy, once each shard's copy to the host (`start_host_shards`) has ended."""
  return {r: np.asarray(a) for r, a in shards.items()}


def from_host_shards(shards: dict[int, np.ndarray], sharding: NamedSharding, shape) -> jax.Array:
  """The inverse of `host_shards`: a global array from per-rank numpy shards."""
  devices = list(sharding.mesh.devices.reshape(-1))
  arrays = [jax.device_put(shards[devices.index(d)],
                           jax.sharding.SingleDeviceSharding(d, memory_kind=sharding.memory_kind))
            for d in sharding.addressable_devices]
  return jax.make_array_from_single_device_arrays(shape, sharding, arrays)


@functools.cache
def set_layer(sharding: NamedSharding) -> Callable:
  """`(x, one, i) -> x` with `x[i] = one` (one layer, with or without its leading axis of 1,
  cast to x's dtype) in place, `x` donated: for stacked arrays of `sharding` (layer axis
  unsharded), so a stack never has a second copy in device memory."""
  def put(x, one, i):
    one = one.reshape((1, *x.shape[1:])).astype(x.dtype)
    return jax.lax.dynamic_update_slice_in_dim(x, one, i, 0)
  return jax.jit(put, donate_argnums=0, out_shardings=sharding)
