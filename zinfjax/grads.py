"""Per-rank loss and gradients of a ZeRO step (inside `shard_map`), with params on any tier.

The params come in as the plan's parts: per leaf a tuple with one entry per
param segment, an array for `device`/`pinned_host` segments and an anchor
(float32[1, 2]) for `nvme` ones. Each `Stack` of the model is swapped for a
`ZeroStack` running one layer scan per segment; every other leaf is fetched
from its tier and all-gathered. The gradients come back in the same parts:
on the params' tiers, or written to NVMe with the anchor's gradient holding
`[token, sum of squares]` of the writes.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec as P

from . import gather as G
from . import residuals as R
from .globalmean import over_ranks
from .layers import micro_batches
from .offload import tiers
from .partition import is_layout
from .placement import LeafPlan, Plan
from .tier import Tier

LossFn = Callable[[nnx.Module, Any], jax.Array]
is_parts = lambda x: isinstance(x, tuple)


def _get(tree: Any, path) -> Any:
  for k in path:
    tree = tree[k] if isinstance(tree, dict) else getattr(tree, k)
  return tree


def _set_attr(model: nnx.Module, path, value: Any) -> None:
  parent = _get(model, path[:-1])
  if isinstance(parent, (list, dict)):
    parent[path[-1]] = value
  else:
    object.__setattr__(parent, path[-1], value)


def _fetch(plan: Plan, store, leaf: LeafPlan, x: jax.Array) -> jax.Array:
  """A leaf outside the stacks, from its tier to the device, gathered."""
  (seg,) = leaf.params
  return G.fetch_from(x, leaf.layout, plan.axis, tiers.source(plan, store, leaf, seg))


def zero_stack(engine, stack, index: int, flat: list, block_graph, on_call) -> G.ZeroStack:
  """The `ZeroStack` of one of the plan's stacks: a layer scan per param segment."""
  plan, config, store = engine.plan, engine.config, engine.store
  leaves = [plan.leaves[i] for i in stack.leaves]
  treedef = jax.tree.structure(_get(plan.layouts, stack.path + ("block",)), is_leaf=is_layout)
  block = lambda xs: jax.tree.unflatten(treedef, xs)
  budget = (R.device_budget(plan.tier_bytes()[Tier.DEVICE]) if config.residual_budget is None
            else config.residual_budget)
  layers = sum(seg.layers for seg in stack.params)
  segments = []
  for j, seg in enumerate(stack.params):
    scan = G.ScanPlan(
        block_graph, block([l.layout.layer() for l in leaves]), seg.layers, config.prefetch_depth,
        plan.axis, config.tiles,
        source=tiers.source(plan, store, block(leaves), seg, config.nvme_prefetch_depth),
        offload_activations=config.offload_activations,
        first_layer=seg.start, trainable=block([l.trainable for l in leaves]),
        micro_batches=config.micro_batches, residuals=config.layer_residuals,
        # the stack's budget shared by its scans as their layers are
        residual_budget=budget * seg.layers // layers)
    segments.append((scan, block([flat[l.index][j] for l in leaves])))
  return G.ZeroStack(segments, index, on_call)


def param_specs(plan: Plan, state: str = "params") -> Any:
  """PartitionSpecs of the params (or grads: none for a frozen leaf) in parts; an NVMe
  segment's anchor is split over `data`."""
  anchor = P(plan.axis)
  return plan.unflatten([tuple(plan.spec(l, True) if s.tier.holds_arrays else anchor
                               for s in l.segments(state)) for l in plan.leaves])


def with_anchors(plan: Plan, params: Any) -> Any:
  """The params' parts with an anchor (float32[dp, 2], split over `data`) in each NVMe slot."""
  sharding = NamedSharding(plan.mesh, P(plan.axis))
  anchor = lambda: jax.lax.with_sharding_constraint(jnp.zeros((plan.dp, 2), jnp.float32), sharding)
  out = []
  for leaf, parts in zip(plan.leaves, plan.flatten(params)):
    it = iter(parts)
    out.append(tuple(next(it) if s.tier.holds_arrays else anchor() for s in leaf.params))
  return plan.unflatten(out)


def local_model(engine, params: Any, on_call: Callable[[int], None] | None = None) -> nnx.Module:
  """The model one rank runs (inside `shard_map`): under ZeRO-3 its stacks gather layer by
  layer and its other leaves are fetched from their tiers; else the whole params."""
  plan = engine.plan
  flat = plan.flatten(params)
  if plan.stage != 3:
    return nnx.merge(engine.graphdef, plan.unflatten([parts[0] for parts in flat]))
  stacked = {i for s in plan.stacks for i in s.leaves}
  view = [parts[0] if i in stacked else _fetch(plan, engine.store, plan.leaves[i], parts[0])
          for i, parts in enumerate(flat)]
  model = nnx.merge(engine.graphdef, plan.unflatten(view))
  for index, stack in enumerate(plan.stacks):
    graph = nnx.graphdef(_get(model, stack.path).block)
    _set_attr(model, stack.path, zero_stack(engine, stack, index, flat, graph, on_call))
  return model


def local_loss_and_grads(engine, loss_fn: LossFn, params: Any, batch: Any):
  """Per-rank loss and gradients (already reduced to this rank's storage shards), in parts."""
  plan, axis, dp = engine.plan, engine.plan.axis, engine.plan.dp

  flat = plan.flatten(params)
  trained = [i for i, leaf in enumerate(plan.leaves) if leaf.trainable]

  def loss_of(parts):  # differentiated by the trained leaves only: frozen ones get no grads
    merged = list(flat)
    for i, p in zip(trained, parts):
      merged[i] = p
    # micro_batches: the stacks of stages 1 and 2; over_ranks: the whole batch's means
    with micro_batches(engine.config.micro_batches), over_ranks(axis, dp):
      return loss_fn(local_model(engine, plan.unflatten(merged)), batch) / dp

  loss, got = jax.value_and_grad(loss_of)([flat[i] for i in trained])
  grads = [()] * len(flat)
  for i, g in zip(trained, got):
    grads[i] = g
  grads = plan.unflatten(grads)
  if plan.stage != 3:
    reduce = G.all_reduce_keep_shard if plan.stage == 1 else G.reduce_scatter
    grads = plan.unflatten([(reduce(g[0], leaf.layout, axis),)
                            for g, leaf in zip(plan.flatten(grads), plan.leaves)])
  return lax.psum(loss, axis), grads


def sum_squares(plan: Plan, grads: Any) -> jax.Array:
  """The squared global norm of one rank's grads in parts (inside `shard_map`): its shards and
  NVMe anchors summed locally (a whole leaf counts 1/dp on each rank), then one psum."""
  total = jnp.float32(0)
  for leaf, parts in zip(plan.leaves, plan.flatten(grads)):
    share = lambda x, leaf=leaf: G.sum_squares_share(x, leaf.layout, plan.axis)
    for seg, g in zip(leaf.params, parts):
      total = total + tiers.ops(plan, None, leaf, "grads", seg).sum_squares(g, share)
  return lax.psum(total, plan.axis)


def forward_order(engine, loss_fn: LossFn, params: Any, batch: Any) -> list[int]:
  """The order the model's forward runs its stacks (indices into `plan.stacks`), found by
  tracing the forward alone (`jax.eval_shape`: nothing runs) before the step's first run."""
  plan, calls = engine.plan, []
  if plan.stage != 3 or len(plan.stacks) < 2:
    return list(range(len(plan.stacks)))

  def local(p, b):
    with over_ranks(plan.axis, plan.dp):
      return loss_fn(local_model(engine, p, lambda i: calls.append(i)), b)

  fn = jax.shard_map(local, mesh=plan.mesh, in_specs=(param_specs(plan), P(plan.axis)),
                     out_specs=P(), check_vma=False)
  jax.eval_shape(lambda p, b: fn(with_anchors(plan, p), b), params, batch)
  return list(dict.fromkeys(calls))
