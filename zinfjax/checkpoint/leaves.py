"""What a checkpoint stores of a `TrainState`: its leaves, each with the sources the plan says.

Leaf names: `step`, `master/{leaf}` (fp32 master params; `params/{leaf}`, the
compute params, for a frozen leaf) and the optimizer's
under `opt/` (zinfjax's AdamW: `opt/count`, `opt/mu/{leaf}`, `opt/nu/{leaf}`,
whatever tiers its segments were on; an optax state: its own paths). Each
leaf is stored whole in its logical shape; in the run it comes from (or goes
to) several sources, one per plan segment: an array holding layers
[start, stop), or the swap store's keys for those layers. Compute params are
not stored: they are sources derived from the master, cast on restore.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np
import optax

from ..optim.host import HostAdamState
from ..partition import LeafLayout, key_name
from ..placement import LeafPlan, Plan

@dataclasses.dataclass
class Source:
  """Layers [start, stop) of a leaf: a jax.Array (or target ShapeDtypeStruct), or NVMe keys."""

  start: int
  stop: int
  array: Any = None
  keys: tuple[tuple[str, Any], ...] = ()   # (base key, dtype) in the swap store; the first is read
  derived: bool = False                    # restored from the leaf but not saved (compute params)


@dataclasses.dataclass
class Leaf:
  """One stored array and where it lives in the run."""

  name: str
  shape: tuple[int, ...]            # logical shape
  dtype: np.dtype
  layout: LeafLayout | None         # None: stored and restored whole
  sources: list[Source]
  plan: LeafPlan | None = None


def _segment_sources(leaf: LeafPlan, state: str, parts: tuple, dtype, derived=False) -> list[Source]:
  arrays, out = iter(parts), []
  for seg in leaf.segments(state):
    if not seg.tier.holds_arrays:
      out.append(Source(seg.start, seg.stop, keys=((leaf.base_key(state), dtype),), derived=derived))
    else:
      out.append(Source(seg.start, seg.stop, next(arrays), derived=derived))
  return out


def _merge_nvme(sources: list[Source]) -> list[Source]:
  """A derived NVMe source over the same layers as a stored one rides along with it."""
  out = []
  for s in sources:
    twin = next((t for t in out if t.keys and not t.derived and (t.start, t.stop) == (s.start, s.stop)), None)
    if s.derived and s.keys and twin is not None:
      twin.keys += s.keys
    else:
      out.append(s)
  return out


def state_leaves(state) -> list[Leaf]:
  """The leaves of `state` (a TrainState, real or abstract) under their checkpoint names."""
  engine = state.engine
  plan: Plan = engine.plan
  f32, compute = np.dtype(np.float32), np.dtype(plan.compute_dtype)
  out = [Leaf("step", (), np.dtype(np.int32), None, [Source(0, 1, state.step)])]
  for leaf, m, p in zip(plan.leaves, plan.flatten(state.master), plan.flatten(state.params)):
    if not leaf.trainable:  # frozen: its compute params are what is stored
      out.append(Leaf(f"params/{leaf.name}", leaf.layout.shape, compute, leaf.layout,
                      _segment_sources(leaf, "params", p, compute), leaf))
      continue
    sources = _segment_sources(leaf, "master", m, f32)
    if plan.stage == 3:
      sources += _segment_sources(leaf, "params", p, compute, derived=True)
    else:  # whole compute params on every rank
      sources.append(Source(0, leaf.num_layers, p[0], derived=True))
    out.append(Leaf(f"master/{leaf.name}", leaf.layout.shape, f32, leaf.layout,
                    _merge_nvme(sources), leaf))

  opt = state.opt_state
  if isinstance(opt, HostAdamState):
    out.append(Leaf("opt/count", (), np.dtype(np.int32), None, [Source(0, 1, opt.count)]))
    for moment, state_name in (("mu", "mu"), ("nu", "nu")):
      for leaf, parts in zip(plan.leaves, plan.flatten(getattr(opt, moment))):
        if not leaf.trainable:
          continue
        dtype = np.dtype(plan.dtype(state_name))  # fp32, or bf16 moments
        out.append(Leaf(f"opt/{moment}/{leaf.name}", leaf.layout.shape, dtype, leaf.layout,
                        _segment_sources(leaf, state_name, parts, dtype), leaf))
    return out
  # any optax state: param-shaped leaves are split like the master, the rest are stored whole
  not_param = object()
  labels = optax.tree_map_params(engine.tx, lambda _, i: i, opt,
                                 plan.unflatten([l.index if l.trainable else None
                                                 for l in plan.leaves]),
                                 transform_non_params=lambda _: not_param)
  flat_labels = jax.tree.leaves(labels, is_leaf=lambda x: x is not_param or isinstance(x, int))
  for (path, x), lab in zip(jax.tree_util.tree_flatten_with_path(opt)[0], flat_labels):
    name = "opt/" + "/".join(key_name(k) for k in path)
    if lab is not_param:
      out.append(Leaf(name, tuple(x.shape), np.dtype(x.dtype), None, [Source(0, 1, x)]))
    else:
      leaf = plan.leaves[lab]
      out.append(Leaf(name, leaf.layout.shape, np.dtype(x.dtype), leaf.layout,
                      [Source(0, leaf.num_layers, x)], leaf))
  return out


def chunks(leaf: Leaf, dp: int, group: int = 1) -> list[int]:
  """The chunk shape, in logical coordinates: one layer of `group` ranks' shards (a process's
  block; 1: one rank's shard, the unit every tier moves)."""
  shape = list(leaf.shape)
  lay = leaf.layout
  if lay is not None:
    if lay.axis is not None:
      shape[lay.axis] = lay.padded // dp * group
    if lay.stacked:
      shape[0] = 1
  return [max(1, s) for s in shape]
