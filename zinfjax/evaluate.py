"""`eval_step`: the loss of a batch with the training layout, forward only.

The same per-rank model as the training step (`grads.local_model`): each
`Stack` gathers layer by layer with prefetch from its params' tier (device,
pinned host or NVMe) and releases each layer after use; no gradient is formed
or written, no state changes, and the state is not donated, so evaluation
can run between any two training steps.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec as P

from .fnkey import fn_key, warn_if_recompiled
from .globalmean import over_ranks
from .grads import LossFn, local_model, param_specs, with_anchors
from .layers import micro_batches
from .losscheck import batch_check
from .offload import swap
from .ordering import needs_order, ordered_collectives
from .state import TrainState
from .inputs import shard_batch
from .runner import checked

Eval = Callable[[TrainState, Any], dict]


def make_eval_step(state: TrainState, loss_fn: LossFn) -> Eval:
  """A jitted `(state, batch) -> {"loss": mean over the global batch}` (state kept)."""
  engine = state.engine
  key = ("eval", fn_key(loss_fn))
  if key in engine.steps:
    return engine.steps[key]
  warn_if_recompiled(engine.steps, key, "eval_step", loss_fn)
  plan, mesh, axis = engine.plan, engine.mesh, engine.plan.axis

  def local(params, batch):
    with micro_batches(engine.config.micro_batches), over_ranks(axis, plan.dp):
      return lax.psum(loss_fn(local_model(engine, params), batch), axis) / plan.dp

  if needs_order(mesh, engine.config.ordered_collectives):
    local = ordered_collectives(local)
  fn = jax.shard_map(local, mesh=mesh, in_specs=(param_specs(plan), P(axis)), out_specs=P(),
                     check_vma=False)

  def evaluate(params, batch):
    return {"loss": fn(with_anchors(plan, params), batch)}

  shardings = jax.tree.map(lambda x: x.sharding, state.params)
  jitted = jax.jit(evaluate, in_shardings=(shardings, NamedSharding(mesh, P(axis))),
                   out_shardings=NamedSharding(mesh, P()),
                   compiler_options=swap.compiler_options(mesh) if engine.store else None)

  check = batch_check(engine, loss_fn)

  def run(state: TrainState, batch: Any) -> dict:
    state.check_usable("eval_step")
    check(batch)
    return checked(engine, jitted(state.params, shard_batch(engine, batch)))

  run.jitted = jitted
  engine.steps[key] = run
  return run


def eval_step(state: TrainState, batch: Any, loss_fn: LossFn) -> dict:
  """The loss of `batch` under the current params (compiled once per loss_fn and shapes)."""
  return make_eval_step(state, loss_fn)(state, batch)
