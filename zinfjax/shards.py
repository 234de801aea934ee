"""This process's shards of a sharded array as numpy, and back: how host-side code (the NVMe
optimizer, init, checkpoints) reads and writes the per-rank pieces the plan describes."""

from __future__ import annotations

import functools
from typing import Callable

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding


def host_shards(x: jax.Array, mesh: Mesh,
                layer: int | None = None) -> dict[int, np.ndarray]:
  """rank -> this process's local shard of `x` (of its `layer` along the first axis alone,
  sliced on each shard's own device), as numpy."""
  return to_host(start_host_shards(x, mesh, layer))


def start_host_shards(x: jax.Array, mesh: Mesh,
                      layer: int | None = None) -> dict[int, jax.Array]:
  """`host_shards`' shards as single-device arrays whose copies to the host have started (all
  at once, and while the caller does other work); `to_host` of them waits for the copies."""
  devices = list(mesh.devices.reshape(-1))
  out = {}
  for s in x.addressable_shards:
    shard = s.data if layer is None else s.data[layer]
    shard.copy_to_host_async()
    out[devices.index(s.device)] = shard
  return out


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
