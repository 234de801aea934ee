"""One rank's shards moving between tiers inside a `shard_map`ped step.

`device` and `pinned_host` are JAX memory kinds: a move is a `device_put`
across memory spaces, which XLA runs asynchronously next to compute. `nvme`
leaves live in the swap store: `NvmeLeaf` names one leaf's shards there
(`{key}/r{rank}/l{layer}`, one file extent per rank and layer) and reads or
writes them through the engine's XLA custom calls, so every rank moves only
its own shard and all ranks' links work at once. `start_layer`, `wait_layer`
and `write_layer` move one layer of many leaves in one call (one store job).
Every call names its layer as a `swap.Layer` (the traced index and the
schedule the host knows ahead) and carries the leaf's rank table.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ..placement import LeafPlan, Plan, Segment, Tier
from . import swap
from .mixed import store_handle

DEVICE, HOST = jax.memory.Space.Device, jax.memory.Space.Host


def to_device(x: jax.Array, tier: str) -> jax.Array:
  """A shard held on `tier` (device or pinned_host) as a device array."""
  return jax.device_put(x, DEVICE) if tier == Tier.PINNED_HOST else x


def to_tier(x: jax.Array, tier: str) -> jax.Array:
  """A device array sent to `tier` (device or pinned_host)."""
  return jax.device_put(x, HOST) if tier == Tier.PINNED_HOST else x


@dataclasses.dataclass(frozen=True)
class NvmeLeaf:
  """Where one leaf's per-rank shards live in the swap store, and their per-layer shape."""

  store: int                  # handle of the swap store that keeps the segment's tier
  key: str                    # base key; shards are `{key}/r{rank}/l{layer}`
  shape: tuple[int, ...]      # one layer's local shard
  dtype: Any
  layers: int | None = None   # stacked leaves: number of layers (of this segment)
  first: int = 0              # the leaf's layer that is this segment's layer 0
  ranks: tuple[int, ...] = (0, 0)  # (device ordinal, rank) pairs (`swap.rank_table`)

  @property
  def like(self) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(self.shape, self.dtype)

  def read(self, token, rank, layer: int | swap.Layer = 0) -> jax.Array:
    return swap.read(self.store, self.key, self.like, token, rank=rank, ranks=self.ranks,
                     layer=layer)

  def write(self, x: jax.Array, rank, layer: int | swap.Layer = 0) -> jax.Array:
    """Write one layer's shard; returns a token for the reads that need it."""
    return swap.write(self.store, self.key, x.astype(self.dtype), rank=rank, ranks=self.ranks,
                      layer=layer)

  def _layers(self) -> np.ndarray:
    return np.arange(self.layers) + self.first

  def read_all(self, token, rank) -> jax.Array:
    """The whole local shard of the segment (its layers, stacked, for a stacked leaf)."""
    if self.layers is None:
      return self.read(token, rank)
    return lax.map(lambda i: self.read(token, rank, swap.layer_at(self._layers(), i)),
                   jnp.arange(self.layers))

  def write_all(self, x: jax.Array, rank) -> jax.Array:
    """Write the segment's local shard, layer by layer; returns one token for all of it."""
    if self.layers is None:
      return self.write(x, rank)

    def one(token, i_x):
      i, layer = i_x
      return token + self.write(layer, rank, swap.layer_at(self._layers(), i)), None

    return lax.scan(one, jnp.int32(0), (jnp.arange(self.layers), x))[0]


def nvme_leaf(plan: Plan, store, leaf: LeafPlan, state: str, seg: Segment) -> NvmeLeaf:
  """The swap-store shards of layers `seg` of one leaf's `state`."""
  return NvmeLeaf(store_handle(store, seg.tier), leaf.base_key(state), leaf.local_shape,
                  plan.dtype(state),
                  seg.layers if leaf.stacked else None, seg.start,
                  swap.rank_table(plan.mesh, plan.axis))


@dataclasses.dataclass(frozen=True)
class ArrayOps:
  """A segment held in an array on the device or in pinned host memory."""

  tier: Tier
  seg: Segment
  stacked: bool

  def fetch(self, x: jax.Array, lo: int, hi: int, rank) -> jax.Array:
    """Layers [lo, hi) of the segment's local shard `x`, on the device."""
    x = to_device(x, self.tier)
    return x[lo - self.seg.start:hi - self.seg.start] if self.stacked else x

  def put(self, x: jax.Array, lo: int, hi: int, rank) -> jax.Array:
    """Layers [lo, hi) (`x`, on the device) sent to the tier; the array to keep."""
    return to_tier(x, self.tier)

  def sum_squares(self, g: jax.Array, share) -> jax.Array:
    return share(to_device(g, self.tier))


@dataclasses.dataclass(frozen=True)
class NvmeOps:
  """A segment in the swap store; its slot in the step's arrays is an anchor (float32[1, 2])
  whose first entry orders the reads after the writes they need."""

  plan: Plan
  store: Any
  leaf: LeafPlan
  state: str
  seg: Segment

  def shards(self, lo: int, hi: int) -> NvmeLeaf:
    return nvme_leaf(self.plan, self.store, self.leaf, self.state, Segment(self.seg.tier, lo, hi))

  def fetch(self, anchor: jax.Array, lo: int, hi: int, rank) -> jax.Array:
    return self.shards(lo, hi).read_all(anchor[0, 0].astype(jnp.int32), rank)

  def put(self, x: jax.Array, lo: int, hi: int, rank) -> jax.Array:
    """Written layer by layer; a token (int32) for all of it."""
    return self.shards(lo, hi).write_all(x, rank)

  def sum_squares(self, anchor: jax.Array, share) -> jax.Array:
    return jnp.sum(anchor[:, 1])  # the writes' own sum of squares, in the anchor's gradient


def ops(plan: Plan, store, leaf: LeafPlan, state: str, seg: Segment) -> ArrayOps | NvmeOps:
  """The operations on one segment of one leaf's `state`, chosen by its tier."""
  if seg.tier.holds_arrays:
    return ArrayOps(seg.tier, seg, leaf.stacked)
  return NvmeOps(plan, store, leaf, state, seg)


@dataclasses.dataclass(frozen=True)
class InArrays:
  """Where a scan's (or one leaf's) params come from and its grads go: arrays on `tier`
  (device or pinned host), carried through the step."""

  tier: Tier
  depth: int = 0  # no reads of their own ahead of the device prefetch

  def whole(self, x: jax.Array, rank) -> jax.Array:
    return to_device(x, self.tier)

  def whole_grad(self, g: jax.Array, anchor, rank, share: Callable[[], jax.Array]) -> jax.Array:
    return to_tier(g, self.tier)

  def layer(self, shards: Any, index, layer, pending: tuple, rank) -> tuple[Any, tuple]:
    """The layer at `index` of the stacked `shards`, on the device."""
    local = jax.tree.map(lambda a: lax.dynamic_index_in_dim(a, index, 0, keepdims=False), shards)
    return jax.tree.map(lambda x: to_device(x, self.tier), local), pending

  def start(self, layer, rank):
    raise AssertionError("arrays are not read ahead")  # depth 0: never asked

  def wait(self, ticket, layer, rank):
    raise AssertionError("arrays are not read ahead")

  def layer_grads(self, grads: list, trained: list[int], layer, rank, sums, shares):
    """One layer's grad shards sent to the tier: (what the scan stacks, the running sums);
    `shares()` (the layer's sums of squares) is not needed here."""
    return [to_tier(x, self.tier) for x in grads], sums

  def grads_of(self, stacked, sums, anchor) -> jax.Array:
    """A trained leaf's gradient in the step's arrays: the stacked layer grads."""
    return stacked


@dataclasses.dataclass(frozen=True)
class InStore:
  """Params in the swap store (`params`, a tree of `NvmeLeaf`), read through the engine's
  custom calls, with their grads written to `grads`. Their slot in the step's arrays is an
  anchor (float32[1, 2]) whose gradient is `[token, sum of squares]` of those writes; reads
  run `depth` layers ahead of the device prefetch."""

  params: Any
  grads: Any
  depth: int = 0

  def whole(self, anchor: jax.Array, rank) -> jax.Array:
    return self.params.read(0, rank)

  def whole_grad(self, g: jax.Array, anchor, rank, share: Callable[[], jax.Array]) -> jax.Array:
    token = self.grads.write(g, rank).astype(jnp.float32)
    return jnp.stack([token, share()]).reshape(jnp.shape(anchor))

  def layer(self, shards: Any, index, layer, pending: tuple, rank) -> tuple[Any, tuple]:
    """Layer `layer` from the store, consuming the oldest read in flight (or reading now)."""
    if not pending:
      return self.wait(self.start(layer, rank), layer, rank), pending
    return self.wait(pending[0], layer, rank), pending[1:]

  def start(self, layer, rank) -> jax.Array:
    """Start reading `layer` of every leaf (one store job); `wait` its ticket."""
    return start_layer(jax.tree.leaves(self.params), 0, rank, layer)

  def wait(self, ticket, layer, rank) -> Any:
    leaves, treedef = jax.tree.flatten(self.params)
    return jax.tree.unflatten(treedef, wait_layer(leaves, ticket, rank, layer))

  def layer_grads(self, grads: list, trained: list[int], layer, rank, sums, shares):
    """One layer's grads of every trained leaf written as one store job; each leaf's running
    `[token, sum of squares]` grows by this write's (`shares()`, per trained leaf)."""
    leaves = jax.tree.leaves(self.grads)
    token = write_layer([leaves[k] for k in trained], grads, rank, layer).astype(jnp.float32)
    return None, [s + jnp.stack([token, share]) for s, share in zip(sums, shares())]

  def grads_of(self, stacked, sums, anchor) -> jax.Array:
    return sums.reshape(anchor.shape)


Source = InArrays | InStore


def source(plan: Plan, store, leaves: Any, seg: Segment, depth: int = 0) -> InArrays | InStore:
  """Where segment `seg` of `leaves` (a `LeafPlan` or a tree of them, one stack's block) keeps
  its params and grads, chosen by its tier; `depth`: store reads ahead of the prefetch."""
  if seg.tier.holds_arrays:
    return InArrays(seg.tier)
  shards = lambda state: jax.tree.map(lambda l: nvme_leaf(plan, store, l, state, seg), leaves,
                                      is_leaf=lambda x: isinstance(x, LeafPlan))
  return InStore(shards("params"), shards("grads"), depth)


def _one_store(leaves: Sequence[NvmeLeaf]) -> int:
  stores = {leaf.store for leaf in leaves}
  if len(stores) != 1:
    raise ValueError(f"leaves of one swap call must share a store, got handles {sorted(stores)}")
  return stores.pop()


def start_layer(leaves: Sequence[NvmeLeaf], token, rank, layer: int | swap.Layer) -> jax.Array:
  """Start reading layer `layer` of every leaf (one store job); `wait_layer` the ticket."""
  return swap.read_start_many(_one_store(leaves), [l.key for l in leaves], token, rank=rank,
                              ranks=leaves[0].ranks, layer=layer)


def wait_layer(leaves: Sequence[NvmeLeaf], ticket: jax.Array, rank,
               layer: int | swap.Layer) -> list[jax.Array]:
  """The layer `start_layer` began reading with `ticket` (the same rank and layer)."""
  return swap.read_wait_many(_one_store(leaves), [l.key for l in leaves], ticket,
                             [l.like for l in leaves], rank=rank, ranks=leaves[0].ranks,
                             layer=layer)


def write_layer(leaves: Sequence[NvmeLeaf], xs: Sequence[jax.Array], rank,
                layer: int | swap.Layer) -> jax.Array:
  """Write layer `layer` of every leaf (one store job); one token for all of them."""
  return swap.write_many(_one_store(leaves), [l.key for l in leaves],
                         [x.astype(l.dtype) for x, l in zip(xs, leaves)], rank=rank,
                         ranks=leaves[0].ranks, layer=layer)


def rank(axis_name: str) -> jax.Array:
  """This device's position on the data axis: the rank in its shards' keys."""
  return lax.axis_index(axis_name)
