"""The grads `delay_tail_update` holds between steps, in a checkpoint.

Under `ZeroConfig.delay_tail_update` the grads of the leaves outside the
stacks wait one step for their update. A checkpoint saves them as leaves
`held/{leaf}` (whole, in their logical shape, like the master params) with
the count and global norm of the step that made them in its metadata, so a
run resumed from it (on any split or device count) applies them at its first
step, as the run that saved it would have. A run without the delay, or whose
tail holds other leaves, ignores them.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from ..optim.pipeline import Held
from ..placement import Tier
from ..shards import from_host_shards, host_shards
from .leaves import Leaf, Source

PREFIX = "held/"


def _tail(engine) -> list:
  """The plan leaves of the pipeline's delayed sub-groups (none without the delay)."""
  pipeline = engine.pipeline
  if pipeline is None or not pipeline.tail:
    return []
  indices = sorted({p.leaf for u in pipeline.tail for p in u.parts})
  return [engine.plan.leaves[i] for i in indices]


def _leaf(engine, leaf, make) -> Leaf:
  """The checkpoint leaf of `leaf`'s held grads, its one source `make(storage shape, dtype,
  sharding)` (the array, or its restore target)."""
  dtype = np.dtype(engine.plan.dtype("grads"))
  source = make(leaf.layout.storage_shape, dtype, engine.plan.sharding(leaf, Tier.PINNED_HOST))
  return Leaf(PREFIX + leaf.name, leaf.layout.shape, dtype, leaf.layout, [Source(0, 1, source)],
              leaf)


def held_leaves(state) -> tuple[list[Leaf], dict | None]:
  """The leaves of the grads `state`'s pipeline holds, and their metadata (count and norm);
  `([], None)` when it holds none."""
  engine = state.engine
  held = engine.pipeline.held if engine.pipeline is not None else None
  if held is None:
    return [], None
  ranks = engine.plan.ranks
  out = [_leaf(engine, leaf, lambda shape, _, sharding, i=leaf.index: from_host_shards(
      {r: held.grads[(i, r, 0)] for r in ranks}, sharding, shape)) for leaf in _tail(engine)]
  return out, {"count": held.count, "norm": held.norm}


def held_targets(engine, meta: dict) -> list[Leaf]:
  """Restore targets for the held grads a checkpoint (`meta`) saved, where this run delays the
  same leaves' updates (else none: they are not restored)."""
  tail = _tail(engine)
  saved = {k for k in meta["leaves"] if k.startswith(PREFIX)}
  if not tail or meta.get("held") is None or saved != {PREFIX + l.name for l in tail}:
    return []
  target = lambda shape, dtype, sharding: jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)
  return [_leaf(engine, leaf, target) for leaf in tail]


def restore_held(engine, restored: dict[str, Any], targets: list[Leaf], meta: dict) -> None:
  """Hand the restored held grads to the engine's pipeline (for its first step)."""
  if not targets:
    return
  grads = {}
  for target in targets:
    leaf = target.plan
    for rank, shard in host_shards(restored[f"{target.name}#0"], engine.plan.mesh).items():
      grads[(leaf.index, rank, 0)] = np.ascontiguousarray(shard)
  engine.pipeline.held = Held(grads, int(meta["held"]["count"]), meta["held"]["norm"])
