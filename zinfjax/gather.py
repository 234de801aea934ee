"""Layer-wise gather/release with prefetch: the heart of ZeRO-3.

All functions here run inside `shard_map` over the `data` axis, on each rank's
local shards. `fetch` turns a shard into the full tensor (all-gather) and its
transpose reduce-scatters the gradient back to the shard. `layer_scan` runs a
stack of blocks one layer at a time:

  forward   gather layer i+d while layer i computes (d = prefetch depth);
            keep only each layer's input (one activation checkpoint per block)
  backward  re-gather layer i (prefetching i-d), recompute the block from its
            checkpoint, reduce-scatter layer i's gradient to its shard

so no more than d+1 gathered layers are alive at once, and gathered params are
never saved as residuals.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax

from .partition import LeafLayout, is_layout


def gather(x: jax.Array, layout: LeafLayout, axis_name: str) -> jax.Array:
  """Local shard -> full logical tensor (all-gather, then drop padding)."""
  if layout.axis is None:
    return x
  return layout.unpad(lax.all_gather(x, axis_name, axis=layout.axis, tiled=True))


def reduce_scatter(g: jax.Array, layout: LeafLayout, axis_name: str) -> jax.Array:
  """Full local gradient -> this rank's shard of the sum over ranks."""
  if layout.axis is None:
    return lax.psum(g, axis_name)
  return lax.psum_scatter(layout.pad(g), axis_name, scatter_dimension=layout.axis, tiled=True)


def all_reduce_keep_shard(g: jax.Array, layout: LeafLayout, axis_name: str) -> jax.Array:
  """ZeRO-1: all-reduce the full gradient, then keep this rank's shard of it."""
  g = lax.psum(g, axis_name)
  if layout.axis is None:
    return g
  size = layout.padded // lax.axis_size(axis_name)
  start = lax.axis_index(axis_name) * size
  return lax.dynamic_slice_in_dim(layout.pad(g), start, size, axis=layout.axis)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def fetch(x: jax.Array, layout: LeafLayout, axis_name: str) -> jax.Array:
  """`gather` whose gradient is `reduce_scatter` (psum for replicated leaves)."""
  return gather(x, layout, axis_name)


def _fetch_fwd(x, layout, axis_name):
  return gather(x, layout, axis_name), None


def _fetch_bwd(layout, axis_name, _, g):
  return (reduce_scatter(g, layout, axis_name),)


fetch.defvjp(_fetch_fwd, _fetch_bwd)


def _tree_gather(shards, layouts, axis_name):
  return jax.tree.map(lambda x, lay: gather(x, lay, axis_name), shards, layouts,
                      is_leaf=is_layout)


def _tree_reduce_scatter(grads, layouts, axis_name):
  return jax.tree.map(lambda g, lay: reduce_scatter(g, lay, axis_name), grads, layouts,
                      is_leaf=is_layout)


@dataclasses.dataclass(frozen=True, eq=False)
class ScanPlan:
  """Static description of one stack: the block's graph, per-layer layouts, depth."""

  graphdef: Any
  layouts: Any            # tree of per-layer LeafLayout
  num_layers: int
  prefetch_depth: int
  axis_name: str
  tiles: int = 1          # > 1: gather large weights tile by tile (memory-centric tiling)

  def apply(self, params: Any, x: jax.Array) -> jax.Array:
    """One block on `x`: `params` are gathered, or (tiles > 1) this layer's local shards."""
    if self.tiles == 1:
      return nnx.merge(self.graphdef, params)(x)
    from .tiling import tile_matmuls
    run = lambda shards, x: nnx.merge(self.graphdef, _tree_gather(shards, self.layouts,
                                                                  self.axis_name))(x)
    return tile_matmuls(run, tiles=self.tiles)(params, x)

  def fetch_layer(self, shards: Any, i) -> Any:
    i = jnp.clip(i, 0, self.num_layers - 1)
    layer = jax.tree.map(lambda a: lax.dynamic_index_in_dim(a, i, 0, keepdims=False), shards)
    if self.tiles > 1:  # gathered inside the tiled block, one tile at a time
      return layer
    return _tree_gather(layer, self.layouts, self.axis_name)

  def reduce_grads(self, grads: Any) -> Any:
    """Per-layer grads -> this rank's shards (reduce-scatter; already done when tiled)."""
    if self.tiles == 1:
      return _tree_reduce_scatter(grads, self.layouts, self.axis_name)
    # the tiled block differentiated through its all-gathers: only whole leaves need a sum
    return jax.tree.map(lambda g, lay: lax.psum(g, self.axis_name) if lay.axis is None else g,
                        grads, self.layouts, is_leaf=is_layout)


def _forward(plan: ScanPlan, shards, x):
  depth = plan.prefetch_depth

  def body(carry, i):
    h, queue = carry
    if depth:
      full, queue = queue[0], queue[1:] + (plan.fetch_layer(shards, i + depth),)
    else:
      full = plan.fetch_layer(shards, i)
    return (plan.apply(full, h), queue), h

  queue = tuple(plan.fetch_layer(shards, k) for k in range(depth))
  (y, _), inputs = lax.scan(body, (x, queue), jnp.arange(plan.num_layers))
  return y, inputs


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def layer_scan(plan: ScanPlan, shards: Any, x: jax.Array) -> jax.Array:
  """Run all layers of a stack on `x`; `shards` are the stacked local shards."""
  return _forward(plan, shards, x)[0]


def _layer_scan_fwd(plan, shards, x):
  y, inputs = _forward(plan, shards, x)
  return y, (shards, inputs)


def _layer_scan_bwd(plan, residuals, g_y):
  shards, inputs = residuals
  depth, last = plan.prefetch_depth, plan.num_layers - 1

  def body(carry, i):
    g, queue = carry
    if depth:
      full, queue = queue[0], queue[1:] + (plan.fetch_layer(shards, i - depth),)
    else:
      full = plan.fetch_layer(shards, i)
    h = lax.dynamic_index_in_dim(inputs, i, 0, keepdims=False)
    _, vjp = jax.vjp(plan.apply, full, h)
    g_full, g_h = vjp(g)
    return (g_h, queue), plan.reduce_grads(g_full)

  queue = tuple(plan.fetch_layer(shards, last - k) for k in range(depth))
  (g_x, _), g_shards = lax.scan(body, (g_y, queue), jnp.arange(plan.num_layers), reverse=True)
  return g_shards, g_x


layer_scan.defvjp(_layer_scan_fwd, _layer_scan_bwd)


class ZeroStack:
  """Stands in for a `zinfjax.layers.Stack` inside a ZeRO-3 step: `x -> layer_scan(x)`."""

  def __init__(self, plan: ScanPlan, shards: Any):
    self.plan, self.shards = plan, shards

  def __call__(self, x: jax.Array) -> jax.Array:
    return layer_scan(self.plan, self.shards, x)
