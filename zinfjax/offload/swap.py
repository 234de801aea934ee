"""Typed `jax.ffi` wrappers for the swap store's XLA custom calls.

Each call moves one layer's shards of several leaves (one store job) and names
them by base keys plus the device's rank and the layer. Every call carries
both as the program computes them (int32 operands) and as the host knows them
ahead from the static schedule (attributes): `ranks`, (device ordinal, rank)
pairs, and `layers`, the layer of each execution of the call in a run. The
GPU handlers use the host's copy alone, so they never read device memory on
the launch thread; the CPU handlers check the two agree. Reads take the token
of the write they depend on: XLA orders custom calls only through data.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from .. import _ffi  # noqa: F401  (registers the handlers)

_sites = itertools.count(1)


@dataclasses.dataclass(frozen=True)
class Layer:
  """A layer index as the program computes it and as the host knows it ahead."""

  value: Any                 # an int, or a traced int32 scalar
  order: tuple[int, ...]     # its value at the k-th execution of the call in a run (mod length)


def as_layer(layer: int | Layer) -> Layer:
  if isinstance(layer, Layer):
    return layer
  if isinstance(layer, (int, np.integer)):
    return Layer(int(layer), (int(layer),))
  raise TypeError(f"a swap call's layer must be an int or a swap.Layer with its schedule, got "
                  f"{type(layer).__name__}: use swap.layer_at(layers, i) inside a scan")


def layer_at(layers: Sequence[int], i, *, reverse: bool = False) -> Layer:
  """`layers[i]` at scan position `i` of a scan over all positions (`reverse`: last first)."""
  layers = np.asarray(layers, np.int32)
  order = layers[::-1] if reverse else layers
  return Layer(jnp.asarray(layers)[i], tuple(int(x) for x in order))


@functools.lru_cache(maxsize=64)
def rank_table(mesh: jax.sharding.Mesh, axis: str) -> tuple[int, ...]:
  """This process's devices' ranks on `axis`, as flat (device ordinal, rank) pairs.

  A handler learns its device's ordinal from XLA: the device's global id on CPU, its
  process-local hardware id on GPU; both are listed (they coincide or never clash).
  """
  devices = np.moveaxis(np.asarray(mesh.devices), mesh.axis_names.index(axis), 0)
  ranks: dict[int, int] = {}
  for r in range(devices.shape[0]):
    for d in np.ravel(devices[r]):
      if d.process_index != jax.process_index():
        continue
      for ordinal in {d.id, d.local_hardware_id}:
        if ranks.setdefault(ordinal, r) != r:
          raise ValueError(f"device ordinal {ordinal} names two ranks of mesh axis {axis!r}")
  return tuple(x for pair in sorted(ranks.items()) for x in pair)


def compiler_options(mesh: jax.sharding.Mesh) -> dict[str, Any]:
  """XLA options for a program with swap calls on `mesh`'s devices (for `jax.jit`).

  XLA:GPU's dynamic-slice fusion moves a custom call whose result feeds a
  dynamic-update-slice (a scan's stacked output, e.g. `lax.map` over reads)
  into a fusion that writes the slice in place, and keeps the original call
  because it has side effects: the read would run twice per iteration.
  """
  if mesh.devices.flat[0].platform == "gpu":
    return {"xla_gpu_enable_dynamic_slice_fusion": False}
  return {}


def _i32(x) -> jax.Array:
  return jnp.asarray(x, jnp.int32).reshape(())


def _site(store: int, keys: Sequence[str], ranks: Sequence[int] | None, layer: Layer) -> dict:
  ranks = (0, 0) if ranks is None else ranks  # outside shard_map: device 0, rank 0
  return dict(store=np.int64(store), keys="\n".join(keys), site=np.int64(next(_sites)),
              ranks=np.asarray(ranks, np.int32), layers=np.asarray(layer.order, np.int32))


def write_many(store: int, keys, xs, *, rank=0, ranks=None, layer: int | Layer = 0) -> jax.Array:
  """Write `xs[i]` as shard `keys[i]/r{rank}/l{layer}`, one store job; returns an int32 token."""
  layer = as_layer(layer)
  call = jax.ffi.ffi_call("zinfjax_swap_write_many", jax.ShapeDtypeStruct((), jnp.int32),
                          has_side_effect=True)
  return call(_i32(rank), _i32(layer.value), *xs, **_site(store, keys, ranks, layer))


def read_start_many(store: int, keys, token, *, rank=0, ranks=None, layer: int | Layer = 0) -> jax.Array:
  """Start reading shards `keys[i]/r{rank}/l{layer}` after the write that made `token`
  (into engine-owned buffers); returns a ticket for `read_wait_many`."""
  layer = as_layer(layer)
  call = jax.ffi.ffi_call("zinfjax_swap_read_start_many", jax.ShapeDtypeStruct((), jnp.int32),
                          has_side_effect=True)
  return call(_i32(token), _i32(rank), _i32(layer.value), **_site(store, keys, ranks, layer))


def read_wait_many(store: int, keys, ticket: jax.Array, likes, *, rank=0, ranks=None,
                   layer: int | Layer = 0) -> list[jax.Array]:
  """Finish the `read_start_many` of the same shards: them, in key order (checked against
  `likes[i]`)."""
  layer = as_layer(layer)
  call = jax.ffi.ffi_call("zinfjax_swap_read_wait_many",
                          [jax.ShapeDtypeStruct(l.shape, l.dtype) for l in likes],
                          has_side_effect=True)
  return list(call(_i32(ticket), _i32(rank), _i32(layer.value),
                   **_site(store, keys, ranks, layer)))


def write(store: int, key: str, x: jax.Array, *, rank=0, ranks=None, layer: int | Layer = 0) -> jax.Array:
  """`write_many` of one shard."""
  return write_many(store, [key], [x], rank=rank, ranks=ranks, layer=layer)


def read(store: int, key: str, like: jax.ShapeDtypeStruct, token, *, rank=0, ranks=None,
         layer: int | Layer = 0) -> jax.Array:
  """Read one shard (shaped like `like`) after the write that made `token`."""
  ticket = read_start_many(store, [key], token, rank=rank, ranks=ranks, layer=layer)
  return read_wait_many(store, [key], ticket, [like], rank=rank, ranks=ranks, layer=layer)[0]
