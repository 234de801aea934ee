"""The grads `ZeroConfig.delay_update` holds between steps, in a checkpoint.

Under `delay_update="tail"` the grads of the leaves outside the stacks wait
one step for their update; under "all", those of every part the host pipeline
updates. A checkpoint saves them as leaves `held/{leaf}` (whole, in their
logical shape, like the master params; a stacked leaf's layers that are not
delayed as zeros) with the count and global norm of the step that made them,
and the layers held per leaf, in its metadata, so a run resumed from it (on
any split or device count) applies them at its first step, as the run that
saved it would have. A run without the delay, or which delays other layers,
drops them, with a warning (those params miss one step's update).
"""

from __future__ import annotations

import warnings
from typing import Any

import jax
import numpy as np

from ..optim.pipeline import Held
from ..placement import Tier
from ..shards import from_host_shards, host_shards
from .leaves import Leaf, Source

PREFIX = "held/"


def _delayed(engine) -> dict[int, list[int]]:
  """The layers of each plan leaf the pipeline updates one step late (none without a delay)."""
  pipeline = engine.pipeline
  if pipeline is None or not pipeline.tail:
    return {}
  out: dict[int, set[int]] = {}
  for p in (p for u in pipeline.tail for p in u.parts):
    out.setdefault(p.leaf, set()).add(p.layer)
  return {i: sorted(out[i]) for i in sorted(out)}


def _leaf(engine, leaf, make) -> Leaf:
  """The checkpoint leaf of `leaf`'s held grads, its one source `make(storage shape, dtype,
  sharding)` (the array, or its restore target)."""
  dtype = np.dtype(engine.plan.dtype("grads"))
  source = make(leaf.layout.storage_shape, dtype, engine.plan.sharding(leaf, Tier.PINNED_HOST))
  return Leaf(PREFIX + leaf.name, leaf.layout.shape, dtype, leaf.layout, [Source(0, 1, source)],
              leaf)


def _shard(held, leaf, rank: int, layers: list[int]) -> np.ndarray:
  """One rank's held grads of `leaf` (all its layers, those not held as zeros): a copy, as the
  pipeline reuses its arrays for later steps while the save may still be writing."""
  if not leaf.stacked:
    return np.array(held.grads[(leaf.index, rank, 0)])
  first = held.grads[(leaf.index, rank, layers[0])]
  out = np.zeros((leaf.num_layers,) + first.shape, first.dtype)
  for l in layers:
    out[l] = held.grads[(leaf.index, rank, l)]
  return out


def held_leaves(state) -> tuple[list[Leaf], dict | None]:
  """The leaves of the grads `state`'s pipeline holds, and their metadata (count, norm and the
  layers held per leaf); `([], None)` when it holds none."""
  engine = state.engine
  held = engine.pipeline.held if engine.pipeline is not None else None
  if held is None:
    return [], None
  ranks, leaves = engine.plan.ranks, engine.plan.leaves
  delayed = _delayed(engine)
  out = [_leaf(engine, leaves[i], lambda shape, _, sharding, leaf=leaves[i], layers=layers:
                 from_host_shards({r: _shard(held, leaf, r, layers) for r in ranks}, sharding,
                                  shape))
         for i, layers in delayed.items()]
  return out, {"count": held.count, "norm": held.norm,
               "layers": {leaves[i].name: layers for i, layers in delayed.items()}}


def held_targets(engine, meta: dict) -> list[Leaf]:
  """Restore targets for the held grads a checkpoint (`meta`) saved, where this run delays the
  same layers' updates (else none: they are not restored)."""
  delayed, leaves = _delayed(engine), engine.plan.leaves
  layers = {leaves[i].name: l for i, l in delayed.items()}
  saved = meta.get("held")
  stored = {k[len(PREFIX):] for k in meta["leaves"] if k.startswith(PREFIX)}
  if saved is None or not stored:
    return []
  # a checkpoint from before the layers were recorded held the tail's whole (unstacked) leaves
  if saved.get("layers", {n: [0] for n in stored}) != layers or stored != set(layers):
    warnings.warn(
        f"the checkpoint holds grads its run's delay_update had not applied yet (step "
        f"{saved['count'] + 1}, {len(stored)} leaves); this run "
        + ("delays other layers' updates" if delayed else "delays no update")
        + ", so they are dropped: those params miss that step's update. To apply them, resume "
        "with the same delay_update and a placement whose host pipeline updates the same layers "
        "(the optimizer of each in pinned host or on NVMe).", stacklevel=3)
    return []
  target = lambda shape, dtype, sharding: jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)
  return [_leaf(engine, leaves[i], target) for i in delayed]


def restore_held(engine, restored: dict[str, Any], targets: list[Leaf], meta: dict) -> None:
  """Hand the restored held grads to the engine's pipeline (for its first step)."""
  if not targets:
    return
  delayed, grads = _delayed(engine), {}
  for target in targets:
    leaf = target.plan
    for rank, shard in host_shards(restored[f"{target.name}#0"], engine.plan.mesh).items():
      for l in delayed[leaf.index]:
        part = shard[l] if leaf.stacked else shard
        grads[(leaf.index, rank, l)] = np.ascontiguousarray(part)
  engine.pipeline.held = Held(grads, int(meta["held"]["count"]), meta["held"]["norm"])
