"""The placement plan: where every shard of every state lives, per layer, as data.

Computed once from `ZeroConfig`, the partition layouts and the mesh. For each
leaf of the model and each state of it

  params   compute params (bf16, or fp32 in exact mode)   store prefix "p"
  grads    their gradients (they follow the params' tiers) "g"
  master   fp32 master params                              "o/master"
  mu, nu   AdamW's moments (they follow the master)        "o/m", "o/v"

the plan holds its tier per layer (as `Segment`s: layers [start, stop) of a
stacked leaf on one tier), its sharding (memory kind included), its store key
and its local shard shape. Everything that moves or stores a shard (the
state's creation, the step, the NVMe optimizer, the checkpoint, the memory
report) asks the plan instead of the config. When a shard moves is the other
half of the answer: `schedule.py`.

A state held in arrays is a tuple per leaf: one array per segment of the leaf
on the `device` or `pinned_host` tier, in layer order (a stacked segment holds
its layers [start, stop)); segments on `nvme` live in the swap store only.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Sequence

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from . import _engine
from .partition import LeafLayout, is_layout, key_name
from .tier import TIERS, Tier, TierSplit, parse_split, split_tiers  # noqa: F401  (re-exported)

STATES = ("params", "grads", "master", "mu", "nu")
PREFIX = {"params": "p", "grads": "g", "master": "o/master", "mu": "o/m", "nu": "o/v"}


def shard_key(base: str, rank: int, layer: int = 0) -> str:
  """The swap-store key of one rank's shard of one layer (one definition, in the C++ engine)."""
  return _engine.shard_key(base, int(rank), int(layer))


@dataclasses.dataclass(frozen=True)
class Segment:
  """Layers [start, stop) of a leaf on `tier` (a leaf outside the stacks: [0, 1))."""

  tier: Tier
  start: int
  stop: int

  def __post_init__(self):
    object.__setattr__(self, "tier", Tier(self.tier))

  @property
  def layers(self) -> int:
    return self.stop - self.start

  def __contains__(self, layer: int) -> bool:
    return self.start <= layer < self.stop


def split_layers(split: TierSplit, num_layers: int | None) -> tuple[Segment, ...]:
  """A per-layer split applied to a stack of `num_layers` (None: a leaf outside the stacks)."""
  if num_layers is None:
    return (Segment(split[0][0], 0, 1),)
  out, start = [], 0
  for tier, amount in split:
    left = num_layers - start
    n = left if amount is None else min(left, amount if isinstance(amount, int)
                                        else int(round(amount * num_layers)))
    if n > 0:
      out.append(Segment(tier, start, start + n))
      start += n
  return tuple(out)


@dataclasses.dataclass(frozen=True)
class LeafPlan:
  """One leaf: its name, layout, local shard shape and per-state segments."""

  index: int
  name: str                        # its path, e.g. "blocks/block/mlp/fc1/kernel"
  layout: LeafLayout
  local_shape: tuple[int, ...]     # one rank's shard of one layer: the unit every tier moves
  params: tuple[Segment, ...]      # grads follow the params
  optimizer: tuple[Segment, ...]   # master, mu, nu (none for a frozen leaf)
  trainable: bool = True           # frozen: params only (no grads, master or moments)

  @property
  def stacked(self) -> bool:
    return self.layout.stacked

  @property
  def num_layers(self) -> int:
    return self.layout.shape[0] if self.stacked else 1

  @property
  def local_size(self) -> int:
    return math.prod(self.local_shape)

  @property
  def size(self) -> int:
    """The whole leaf's elements (logical shape, every layer, no padding)."""
    return math.prod(self.layout.shape)

  def segments(self, state: str) -> tuple[Segment, ...]:
    if state == "grads" and not self.trainable:
      return ()
    return self.params if state in ("params", "grads") else self.optimizer

  def params_with_master(self, layer: int) -> bool:
    """Whether the host pipeline's writes of the master make this layer's compute params in the
    store too (where they are there)."""
    return self.trainable and not self.tier("master", layer).holds_arrays

  def array_segments(self, state: str) -> tuple[Segment, ...]:
    return tuple(s for s in self.segments(state) if s.tier.holds_arrays)

  def tier(self, state: str, layer: int = 0) -> Tier:
    return next(s.tier for s in self.segments(state) if layer in s)

  def base_key(self, state: str) -> str:
    return f"{PREFIX[state]}/{self.name}"

  def key(self, state: str, rank: int, layer: int = 0) -> str:
    return shard_key(self.base_key(state), rank, layer)

  def segment_shape(self, seg: Segment) -> tuple[int, ...]:
    """Global storage shape of a segment's array (its layers, for a stacked leaf)."""
    shape = self.layout.storage_shape
    return (seg.layers,) + shape[1:] if self.stacked else shape

  def take(self, x: Any, seg: Segment) -> Any:
    """Layers of `seg` out of a whole leaf (array, or numpy shard) with a layer axis."""
    return x[seg.start:seg.stop] if self.stacked else x


@dataclasses.dataclass(frozen=True)
class StackPlan:
  """One `Stack` of the model: its path, depth, leaves, and the param tiers of its layers."""

  path: tuple[Any, ...]
  num_layers: int
  leaves: tuple[int, ...]          # indices of its block's leaves
  params: tuple[Segment, ...]


@dataclasses.dataclass(frozen=True, eq=False)
class Plan:
  """Where every shard of a run lives. `leaves` are in the order of the params' tree."""

  leaves: tuple[LeafPlan, ...]
  treedef: Any
  stacks: tuple[StackPlan, ...]
  mesh: Mesh
  axis: str
  stage: int
  compute_dtype: Any
  moment_dtype: Any = jnp.float32  # Adam's moments: fp32, or bf16 (`adamw(moment_dtype=)`)

  @property
  def dp(self) -> int:
    return self.mesh.shape[self.axis]

  @property
  def layouts(self) -> Any:
    return self.unflatten([leaf.layout for leaf in self.leaves])

  @property
  def ranks(self) -> list[int]:
    """Positions on the data axis of this process's devices."""
    return [r for r, d in enumerate(self.mesh.devices.reshape(-1))
            if d.process_index == jax.process_index()]

  def unflatten(self, xs: Sequence[Any]) -> Any:
    return jax.tree.unflatten(self.treedef, list(xs))

  def flatten(self, tree: Any) -> list[Any]:
    """Per leaf, in plan order (a state's tuples stay whole)."""
    return self.treedef.flatten_up_to(tree)

  # ------------------------------------------------------------ tiers
  def tiers(self, state: str) -> set[Tier]:
    return {s.tier for leaf in self.leaves for s in leaf.segments(state)}

  def uses(self, tier: str) -> bool:
    return any(tier in self.tiers(s) for s in ("params", "master"))

  @property
  def optimizer_on_device(self) -> bool:
    """Every optimizer state whole on the device: any optax transformation runs in the step."""
    return self.tiers("master") == {Tier.DEVICE}

  # ------------------------------------------------------------ shardings
  def spec(self, leaf: LeafPlan, compute: bool = False) -> P:
    if compute and self.stage != 3:
      return P()
    return leaf.layout.spec(self.axis)

  def sharding(self, leaf: LeafPlan, tier: str, compute: bool = False) -> NamedSharding:
    return NamedSharding(self.mesh, self.spec(leaf, compute), memory_kind=Tier(tier).memory_kind)

  def dtype(self, state: str) -> Any:
    low = dict(params=self.compute_dtype, grads=self.compute_dtype, mu=self.moment_dtype,
               nu=self.moment_dtype)
    return jnp.dtype(low.get(state, jnp.float32))

  @property
  def optimizer_bytes(self) -> int:
    """Bytes of optimizer state per element: the fp32 master and both moments."""
    return 4 + 2 * self.dtype("mu").itemsize

  def abstract(self, state: str) -> Any:
    """The state's arrays as sharded `ShapeDtypeStruct`s: a tuple per leaf, one per array segment."""
    compute = state == "params"

    def one(leaf):
      # stages 1 and 2 compute with whole (gathered, unpadded) params on every rank
      shape = lambda seg: (leaf.layout.shape if compute and self.stage != 3
                           else leaf.segment_shape(seg))
      return tuple(jax.ShapeDtypeStruct(shape(seg), self.dtype(state),
                                        sharding=self.sharding(leaf, seg.tier, compute))
                   for seg in leaf.array_segments(state))

    return self.unflatten([one(leaf) for leaf in self.leaves])

  # ------------------------------------------------------------ bytes
  def nvme_bytes(self, ranks: int | None = None, tier: Tier = Tier.NVME) -> dict[str, int]:
    """Bytes this process's ranks keep in the swap store of `tier` (the drive's, or host RAM's),
    by state group (each shard rounded up to the store's alignment, as it lies there)."""
    ranks = len(self.ranks) if ranks is None else ranks
    out = {"params": 0, "grads": 0, "optimizer": 0}
    item = jnp.dtype(self.compute_dtype).itemsize
    disk = lambda nbytes: -(-nbytes // _engine.ALIGNMENT) * _engine.ALIGNMENT
    for leaf in self.leaves:
      n = lambda state: sum(s.layers for s in leaf.segments(state) if s.tier == tier)
      out["params"] += n("params") * disk(leaf.local_size * item) * ranks
      out["grads"] += n("grads") * disk(leaf.local_size * item) * ranks
      moments = 2 * disk(leaf.local_size * self.dtype("mu").itemsize)
      out["optimizer"] += n("master") * (disk(leaf.local_size * 4) + moments) * ranks
    return out

  @property
  def stack_layer_size(self) -> int:
    """Elements of one rank's shard of a layer of the largest stack (all its block's leaves)."""
    return max((sum(self.leaves[i].local_size for i in s.leaves) for s in self.stacks), default=0)

  def lent_bytes(self, tier: Tier, in_flight: int = 3) -> int:
    """Bytes of the buffers the store of `tier` lends one step's transfers at once, where the
    swap calls do not copy straight from and into a RAM store's mapping (the copy stream, or a
    mapping that could not be page-locked): a layer's params (read in forward and backward) and
    grads (written in backward) of this process's ranks move through buffers of one stack
    layer, `in_flight` layers at a time, and each leaf outside the stacks through its own. Kept
    as the store's spares (its `pinned_budget`), they are made and page-locked once, not every
    step."""
    item = jnp.dtype(self.compute_dtype).itemsize * len(self.ranks)
    held = lambda i: (any(s.tier == tier for s in self.leaves[i].params)
                      * self.leaves[i].local_size * item * (1 + self.leaves[i].trainable))
    layer = max((sum(held(i) for i in s.leaves) for s in self.stacks), default=0)
    in_stacks = {i for s in self.stacks for i in s.leaves}
    return in_flight * layer + sum(held(i) for i in range(len(self.leaves)) if i not in in_stacks)

  def nvme_disk_bytes(self, atomic: bool, ranks: int | None = None,
                      tier: Tier = Tier.NVME) -> dict[str, int]:
    """`nvme_bytes` plus "copies": what all-or-nothing steps (`atomic`) write besides, a second
    copy of the params and optimizer states they rewrite."""
    need = self.nvme_bytes(ranks, tier)
    return {**need, "copies": need["params"] + need["optimizer"] if atomic else 0}

  @property
  def optimizer_in_store(self) -> bool:
    """Whether some optimizer state lives in a swap store: the host pipeline updates it."""
    return not all(t.holds_arrays for t in self.tiers("master"))

  @property
  def store_tiers(self) -> set[Tier]:
    """The swap stores the plan keeps shards in: the drive's (nvme), host RAM's (host_store)."""
    return {t for state in ("params", "master") for t in self.tiers(state) if not t.holds_arrays}

  @functools.cached_property
  def _bases(self) -> dict[str, tuple[LeafPlan, str]]:
    return {leaf.base_key(state): (leaf, state) for leaf in self.leaves for state in STATES}

  def key_tier(self, key: str) -> Tier:
    """The tier of the shard a swap-store key of this plan names (`LeafPlan.key`)."""
    base, _, layer = key.rsplit("/", 2)
    if base not in self._bases or not layer.startswith("l"):
      raise KeyError(f"{key!r} names no shard of this run's plan")
    leaf, state = self._bases[base]
    return leaf.tier(state, int(layer[1:]))

  def tier_bytes(self, by_medium: bool = True) -> dict[str, int]:
    """Bytes of model states one device holds in each memory (params, grads, master, moments),
    host RAM's swap store's in pinned_host; by tier (that store's apart) if not `by_medium`."""
    out = dict.fromkeys(TIERS if by_medium else tuple(Tier), 0)
    item = jnp.dtype(self.compute_dtype).itemsize
    where = (lambda t: t.medium) if by_medium else (lambda t: t)
    for leaf in self.leaves:
      for seg in leaf.params:
        out[where(seg.tier)] += seg.layers * leaf.local_size * (2 if leaf.trainable else 1) * item
      for seg in leaf.optimizer:
        out[where(seg.tier)] += seg.layers * leaf.local_size * self.optimizer_bytes
    return out

  # ------------------------------------------------------------ checkpoint regions
  def region(self, leaf: LeafPlan, rank: int, layer: int) -> tuple[slice, ...]:
    """Rank `rank`'s shard of layer `layer` in the leaf's storage coordinates (maybe padded)."""
    lay = leaf.layout
    region = [slice(0, n) for n in lay.storage_shape]
    if lay.stacked:
      region[0] = slice(layer, layer + 1)
    if lay.axis is not None:
      size = lay.padded // self.dp
      region[lay.axis] = slice(rank * size, (rank + 1) * size)
    return tuple(region)


def make_plan(config: Any, layouts: Any, stack_paths: Sequence[tuple[Any, ...]], mesh: Mesh,
              frozen: frozenset[str] = frozenset(), moment_dtype: Any = jnp.float32) -> Plan:
  """The plan of a model whose leaves have `layouts` and whose `Stack`s sit at `stack_paths`;
  the leaves named in `frozen` are not trained (params only); Adam's moments in `moment_dtype`."""
  dp = mesh.shape[config.axis]
  flat, treedef = jax.tree_util.tree_flatten_with_path(layouts, is_leaf=is_layout)
  leaves, stack_of = [], {}
  for i, (path, lay) in enumerate(flat):
    keys = tuple(key_name(k) for k in path)
    stack = next((j for j, p in enumerate(stack_paths)
                  if keys[:len(p) + 1] == tuple(map(str, p)) + ("block",)), None)
    layers = lay.shape[0] if lay.stacked else None
    name = "/".join(keys)
    trainable = name not in frozen
    leaves.append(LeafPlan(i, name, lay, lay.local_shape(dp),
                           split_layers(config.param_split, layers),
                           split_layers(config.optimizer_split, layers) if trainable else (),
                           trainable))
    if stack is not None:
      stack_of.setdefault(stack, []).append(i)
  depth = max((l.num_layers for l in leaves if l.stacked), default=None)
  _check_counts(config.param_split, "offload_param", depth)
  _check_counts(config.optimizer_split, "offload_optimizer", depth)
  stacks = []
  for j, path in enumerate(stack_paths):
    members = tuple(stack_of.get(j, ()))
    if not members:
      continue
    depth = leaves[members[0]].num_layers
    stacks.append(StackPlan(tuple(path), depth, members, split_layers(config.param_split, depth)))
  return Plan(tuple(leaves), treedef, tuple(stacks), mesh, config.axis, config.stage,
              config.compute_dtype, jnp.dtype(moment_dtype))


def _check_counts(split: TierSplit, field: str, depth: int | None) -> None:
  """Refuse a split whose layer counts add up to more layers than the deepest stack has: they
  would be cut silently, and the run would not be placed as asked."""
  asked = sum(a for _, a in split if isinstance(a, int))
  if depth is not None and asked > depth:
    # as the user wrote it: the host pipeline's store is pinned host to them
    text = ",".join(f"{t.medium}" + ("" if a is None else f":{a}") for t, a in split)
    raise ValueError(
        f"ZeroConfig.{field}={text!r} places {asked} layers by count, but the model's stacks "
        f"have {depth} layers: ask for at most {depth}, or give fractions (such as "
        "'device:0.5,pinned_host').")
