"""Layer-wise gather/release with prefetch: the heart of ZeRO-3.

All functions here run inside `shard_map` over the `data` axis, on each rank's
local shards. `fetch` turns a shard into the full tensor (all-gather) and its
transpose reduce-scatters the gradient back to the shard. `layer_scan` runs a
stack of blocks one layer at a time:

  forward   bring layer i+d from its tier (device, pinned host, NVMe) and
            gather it while layer i computes (d = prefetch depth), with NVMe
            reads running further ahead (see `schedule.py`); keep only each
            layer's input (one activation checkpoint per block, optionally in
            pinned host memory)
  backward  re-gather layer i (prefetching i-d), recompute the block from its
            checkpoint, reduce-scatter layer i's gradient to its shard and send
            it to the tier of its params

so no more than d+1 gathered layers are alive at once, and gathered params are
never saved as residuals.
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import lax

from . import micro
from . import residuals as R
from .offload import swap, tiers
from .offload.tiers import Source
from .layers import at_layer
from .partition import LeafLayout, is_layout
from .placement import Tier
from .schedule import LayerSchedule, layer_schedule
from .tiling import tile_matmuls


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


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3))
def fetch_from(x: jax.Array, layout: LeafLayout, axis_name: str, source: Source) -> jax.Array:
  """`fetch` of a leaf kept where `source` says (an array on a tier, or the swap store); its
  gradient goes back there.

  In the store, `x` is an anchor (float32[1, 2]): the shard is read from the
  store, the gradient shard written there, and the anchor's gradient is
  `[token, sum of squares]` of that write.
  """
  return _fetch_from_fwd(x, layout, axis_name, source)[0]


def _fetch_from_fwd(x, layout, axis_name, source):
  return gather(source.whole(x, tiers.rank(axis_name)), layout, axis_name), x


def _fetch_from_bwd(layout, axis_name, source, anchor, g):
  g = reduce_scatter(g, layout, axis_name)
  share = lambda: sum_squares_share(g, layout, axis_name)
  return (source.whole_grad(g, anchor, tiers.rank(axis_name), share),)


fetch_from.defvjp(_fetch_from_fwd, _fetch_from_bwd)


def _tree_gather(shards, layouts, axis_name):
  return jax.tree.map(lambda x, lay: gather(x, lay, axis_name), shards, layouts,
                      is_leaf=is_layout)


@dataclasses.dataclass(frozen=True, eq=False)
class ScanPlan:
  """Static description of one stack: the block's graph, per-layer layouts, tiers, depths."""

  graphdef: Any
  layouts: Any            # tree of per-layer LeafLayout
  num_layers: int
  prefetch_depth: int
  axis_name: str
  tiles: int = 1          # > 1: gather large weights tile by tile (memory-centric tiling)
  source: Source = tiers.InArrays(Tier.DEVICE)  # where the params come from, grads go
  offload_activations: bool = False
  first_layer: int = 0    # the stack's layer that is this scan's layer 0 (store keys)
  trainable: Any = None   # tree of bools: False for a frozen leaf (no grads); None: all trained
  micro_batches: int = 1  # > 1: each layer runs the batch as this many micro-batches in turn
  residuals: str = "recompute"  # "save"/"dots"/"auto": forward keeps what backward needs (residuals.py)
  residual_budget: int = 0      # "auto": bytes the stack's saved residuals may take

  @property
  def can_save_residuals(self) -> bool:
    """Saving needs one whole pullback per layer: not tiled, one micro-batch, activations
    on the device."""
    return (self.residuals != "recompute" and self.tiles == 1 and self.micro_batches == 1
            and not self.offload_activations)

  def apply(self, params: Any, x: jax.Array, args: tuple = ()) -> jax.Array:
    """One block on `x` (and the per-call `args`): `params` are gathered, or (tiles > 1) this
    layer's local shards."""
    if self.tiles == 1:
      return nnx.merge(self.graphdef, params)(x, *args)
    run = lambda shards, x, args: nnx.merge(self.graphdef, _tree_gather(
        shards, self.layouts, self.axis_name))(x, *args)
    return tile_matmuls(run, tiles=self.tiles)(params, x, args)

  def schedule(self, reverse: bool) -> LayerSchedule:
    return layer_schedule(self.num_layers, self.prefetch_depth, self.source.depth,
                          reverse=reverse)

  def gather_layer(self, local: Any) -> Any:
    if self.tiles > 1:  # gathered inside the tiled block, one tile at a time
      return local
    return _tree_gather(local, self.layouts, self.axis_name)

  def reduce_grad(self, g: jax.Array, layout: LeafLayout) -> jax.Array:
    """One leaf's per-layer grad -> this rank's shard (reduce-scatter; already done when tiled,
    where the block was differentiated through its all-gathers: only whole leaves need a sum)."""
    if self.tiles == 1:
      return reduce_scatter(g, layout, self.axis_name)
    return lax.psum(g, self.axis_name) if layout.axis is None else g

  def save_activation(self, h: jax.Array) -> jax.Array:
    return tiers.to_tier(h, Tier.PINNED_HOST) if self.offload_activations else h

  def load_activation(self, inputs: jax.Array, i) -> jax.Array:
    h = lax.dynamic_index_in_dim(inputs, i, 0, keepdims=False)
    return tiers.to_device(h, Tier.PINNED_HOST) if self.offload_activations else h


class _Fetcher:
  """Brings layers from where the params are kept to the device, gathered, `prefetch_depth`
  ahead.

  State (a pytree carried through the scan): the queue of gathered layers and
  the tickets of the store reads in flight (none for arrays).
  """

  def __init__(self, plan: ScanPlan, shards: Any, schedule: LayerSchedule):
    self.plan, self.shards, self.sched, self.src = plan, shards, schedule, plan.source
    self.rank = tiers.rank(plan.axis_name)

  def _layer(self, layers, i=None) -> swap.Layer | int:
    """A layer of this scan as the store knows it: the stack's index, with its schedule."""
    first = self.plan.first_layer
    if i is None:
      return int(layers) + first
    return swap.layer_at(np.asarray(layers) + first, i, reverse=self.sched.reverse)

  def _local(self, index, layer, pending) -> tuple[Any, tuple]:
    """This rank's shard of the layer at `index` (a traced position, or the store's `layer`)
    on the device."""
    return self.src.layer(self.shards, index, layer, pending, self.rank)

  def prologue(self) -> tuple:
    pending = ()
    if self.src.depth:
      pending = tuple(self.src.start(self._layer(layer), self.rank)
                      for layer in self.sched.prologue_read)
    queue = []
    for layer in self.sched.prologue_arrive:
      local, pending = self._local(layer, self._layer(layer), pending)
      queue.append(self.plan.gather_layer(local))
    return tuple(queue), pending

  def next(self, state: tuple, i) -> tuple[Any, tuple]:
    """The gathered layer at position `i`; starts the fetches the schedule puts at `i`."""
    queue, pending = state
    if self.src.depth:
      pending = pending + (self.src.start(self._layer(self.sched.read, i), self.rank),)
    arrive = self._layer(self.sched.arrive, i)
    local, pending = self._local(jnp.asarray(self.sched.arrive)[i], arrive, pending)
    full = self.plan.gather_layer(local)
    if not queue:  # no device prefetch: `arrive` is the layer we compute now
      return full, (queue, pending)
    return queue[0], (queue[1:] + (full,), pending)

  def drain(self, state: tuple) -> None:
    """Wait for the clamped reads still in flight past the last layer (frees their buffers)."""
    pending = state[1]
    if not pending:
      return
    step = -1 if self.sched.reverse else 1
    reads = list(self.sched.prologue_read) + list(self.sched.read[::step])
    for ticket, layer in zip(pending, reads[-len(pending):]):
      self.src.wait(ticket, self._layer(layer), self.rank)


def indexed(plan: ScanPlan, body: Callable) -> Callable:
  """A scan body over this plan's layers that traces each layer's block inside `at_layer`: the
  block's `layer_index()` is its index in the whole stack (`first_layer` on)."""
  def run(carry, i):
    with at_layer(plan.first_layer + i):
      return body(carry, i)
  return run


def _forward(plan: ScanPlan, shards, x, args, keep: bool = False):
  """The scan over the layers: (output, each layer's input, each layer's kept residuals or
  None). With `keep`, the residuals are kept where the plan's policy says."""
  sched = plan.schedule(reverse=False)
  fetcher = _Fetcher(plan, shards, sched)
  d = R.Layer.of(plan, args)

  def body(carry, i):
    h, state = carry
    full, state = fetcher.next(state, i)
    if keep and plan.can_save_residuals:
      leaves = jax.tree.leaves(full)
      y, pull = d.pull(plan, leaves, h, R.saving(plan.residuals))
      res = R.split(pull, d.known(leaves, h))
      # the policy, from the shapes of one layer's residuals (static: the body is traced once)
      if R.keep(plan.residuals, res.nbytes, plan.num_layers, plan.residual_budget):
        return (y, state), (plan.save_activation(h), res)
    y = micro.apply(lambda x, a: plan.apply(full, x, a), plan.micro_batches, h, args)
    return (y, state), (plan.save_activation(h), None)

  (y, state), (inputs, kept) = lax.scan(indexed(plan, body), (x, fetcher.prologue()),
                                        jnp.arange(plan.num_layers))
  fetcher.drain(state)
  return y, inputs, kept


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def layer_scan(plan: ScanPlan, shards: Any, x: jax.Array, args: tuple = ()) -> jax.Array:
  """Run all layers of a stack on `x` (with the same extra `args` for each layer); `shards` are
  the stacked local shards.

  With params on NVMe, `shards` is a tree of per-leaf anchors (float32[1, 2]):
  the data comes from the swap store, and each anchor's gradient is
  `[token, sum of squares]` of the gradients written back there.
  """
  return _forward(plan, shards, x, args)[0]


def _layer_scan_fwd(plan, shards, x, args):
  y, inputs, kept = _forward(plan, shards, x, args, keep=True)
  return y, (shards, inputs, args, kept)


def _layer_scan_bwd(plan, residuals, g_y):
  shards, inputs, args, kept = residuals
  # cotangents of the float per-call args add up over layers; integer ones have none; only the
  # trained leaves of a layer are differentiated, reduced and sent to their tier
  d = R.Layer.of(plan, args)
  layouts, treedef, trained, diff = d.layouts, d.treedef, d.trained, d.diff
  arg_leaves, arg_tree = d.arg_leaves, d.arg_tree

  sched = plan.schedule(reverse=True)
  fetcher = _Fetcher(plan, shards, sched)
  src, rank = plan.source, tiers.rank(plan.axis_name)

  def body(carry, i):
    g, state, sums, g_args = carry
    full, state = fetcher.next(state, i)
    full = jax.tree.leaves(full)
    h = plan.load_activation(inputs, i)
    if kept is not None:  # the forward's pullback, with this layer's params and input put back
      layer = jax.tree.map(lambda r: r[i], kept)
      g_trained, g_h, g_arg = R.pullback(layer, d.known(full, h))(g)
    else:  # the layer recomputed
      g_trained, g_h, g_arg = micro.vjp(d.block(plan, full), [full[k] for k in trained], h,
                                        arg_leaves, diff, g, plan.micro_batches)
    g_args = [a + b for a, b in zip(g_args, g_arg)]
    g_shard = [plan.reduce_grad(x, layouts[k]) for k, x in zip(trained, g_trained)]
    layer = swap.layer_at(np.arange(plan.num_layers) + plan.first_layer, i, reverse=True)
    shares = lambda: [sum_squares_share(x, layouts[k], plan.axis_name)
                      for x, k in zip(g_shard, trained)]
    kept_grads, sums = src.layer_grads(g_shard, trained, layer, rank, sums, shares)
    return (g_h, state, sums, g_args), kept_grads

  sums = [jnp.zeros((2,), jnp.float32) for _ in trained]
  zeros = [jnp.zeros_like(arg_leaves[k]) for k in diff]
  (g_x, state, sums, g_args), g_trained = lax.scan(
      indexed(plan, body), (g_y, fetcher.prologue(), sums, zeros), jnp.arange(plan.num_layers),
      reverse=True)
  fetcher.drain(state)
  anchors = jax.tree.leaves(shards)
  g_shards = [None] * len(layouts)
  for j, k in enumerate(trained):
    g_shards[k] = src.grads_of(None if g_trained is None else g_trained[j], sums[j], anchors[k])
  g_leaves = [None] * len(arg_leaves)
  for k, g in zip(diff, g_args):
    g_leaves[k] = g
  return jax.tree.unflatten(treedef, g_shards), g_x, jax.tree.unflatten(arg_tree, g_leaves)


def sum_squares_share(g: jax.Array, layout: LeafLayout, axis_name: str) -> jax.Array:
  """This rank's share of the squared gradient norm (whole leaves count 1/dp per rank)."""
  s = jnp.sum(jnp.square(g.astype(jnp.float32)))
  return s if layout.axis is not None else s / lax.axis_size(axis_name)


layer_scan.defvjp(_layer_scan_fwd, _layer_scan_bwd)


class ZeroStack:
  """Stands in for a `zinfjax.layers.Stack` inside a ZeRO-3 step.

  `segments` are (ScanPlan, shards) of consecutive layer ranges, one per tier
  the stack's params are split over (see `placement.py`); they run in order,
  each a `layer_scan` with its own prefetch. `on_call(index)` is told when the
  stack runs (at trace time), so the step learns the order of its stacks.
  """

  def __init__(self, segments: list[tuple[ScanPlan, Any]], index: int = 0,
               on_call: Callable[[int], None] | None = None):
    self.segments, self.index, self.on_call = segments, index, on_call

  def __call__(self, x: jax.Array, *args) -> jax.Array:
    if self.on_call is not None:
      self.on_call(self.index)
    check_input_dtype(x, [shards for _, shards in self.segments], self.index)
    for plan, shards in self.segments:
      x = layer_scan(plan, shards, x, tuple(args))
    return x


def check_input_dtype(x: jax.Array, shards: Any, index: int) -> None:
  """Warns (at trace time) when a stack of 16-bit params receives fp32 activations: its blocks'
  matrix products then run in fp32, with twice the activation memory and no fused attention."""
  dtypes = [getattr(a, "dtype", None) for a in jax.tree.leaves(shards)]  # arrays, or store keys
  floats = [d for d in dtypes if d is not None and jnp.issubdtype(d, jnp.floating)]
  if (jnp.issubdtype(x.dtype, jnp.floating) and jnp.dtype(x.dtype).itemsize > 2 and floats
      and all(jnp.dtype(d).itemsize == 2 for d in floats)):
    warnings.warn(
        f"the model's Stack #{index} receives {jnp.dtype(x.dtype).name} activations while its "
        f"params are {jnp.dtype(floats[0]).name}: every block's matrix products run in "
        f"{jnp.dtype(x.dtype).name}, slower and with twice the activation memory. A layer before "
        "the stack promotes them; nnx.Embed does (it returns the dtype it was built with): look "
        "rows up in the table's own dtype, `jnp.take(embed.embedding[...], ids, axis=0)` as "
        "zinfjax.models.embedding.lookup does, or cast the stack's input to the params' dtype. "
        "Ignore this if the activations are fp32 on purpose.", stacklevel=2)
