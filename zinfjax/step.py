"""The training step: one program for every stage and placement, and a short builder.

`train_program` is the step's compiled program as a plain function: the
loss and grads (`grads.py`), the update of every optimizer segment held in
arrays where it lives and the new params on their tiers (`update.py`), each
reading the step's moves from the plan's `Timeline` (`schedule.py`).
`make_train_step` jits it and wraps it in its runner (`runner.py`): the
program alone, or with the host pipeline that updates the NVMe segments
around it; then all-or-nothing on NVMe, and the donation check.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

from .fnkey import fn_key, warn_if_recompiled
from .grads import LossFn, local_loss_and_grads, param_specs, sum_squares, with_anchors
from .inputs import shard_batch
from .losscheck import batch_check, check_loss
from .offload import swap
from .ordering import needs_order, ordered_collectives
from .runner import PipelineRunner, all_or_nothing, run_program
from .schedule import Timeline, timeline
from .state import TrainState, gather_params
from .update import adamw_update, optax_update, place_params

Step = Callable[[TrainState, Any], tuple[TrainState, dict]]
__all__ = ["Step", "make_train_step", "shard_batch", "train_program", "train_step"]


def train_program(engine, loss_fn: LossFn, moves: Timeline, state: TrainState, batch: Any):
  """One step's program: the loss and grads, the update of the optimizer segments held in
  arrays, the new params on their tiers. Returns (new state, metrics, grads the host
  pipeline reads, or None)."""
  plan, axis = engine.plan, engine.plan.axis
  check_loss(engine, loss_fn, batch)  # at trace time: before the step compiles or runs

  def local(p, b):
    loss, grads = local_loss_and_grads(engine, loss_fn, p, b)
    return loss, grads, sum_squares(plan, grads)

  if needs_order(engine.mesh, engine.config.ordered_collectives):
    local = ordered_collectives(local)
  fn = jax.shard_map(local, mesh=engine.mesh, in_specs=(param_specs(plan), P(axis)),
                     out_specs=(P(), param_specs(plan, "grads"), P()), check_vma=False)
  loss, grads, squares = fn(with_anchors(plan, state.params), batch)
  norm = jnp.sqrt(squares)
  ok = jnp.isfinite(norm) if engine.config.skip_nonfinite else None
  if engine.hyper is None:
    master, opt_state, new = optax_update(engine, state, grads, norm, ok)
  else:
    master, opt_state, new = adamw_update(engine, moves, state, grads, norm, ok)
  if plan.stage == 3:
    params, token = place_params(engine, moves, state.params, new)
  else:
    params, token = gather_params(plan, master, engine.config.ordered_collectives), None
  metrics = {"loss": loss, "grad_norm": norm}
  if ok is not None:
    metrics["skipped"] = jnp.logical_not(ok).astype(jnp.int32)
  # zinfjax's AdamW: the schedule at the count before the step; optax's injected
  # hyperparameters: those the update just used
  lr = learning_rate(engine, state.opt_state if engine.hyper is not None else opt_state)
  if lr is not None:
    metrics["lr"] = lr
  if token is not None:
    metrics["nvme_token"] = token
  return TrainState(state.step + 1, params, master, opt_state, engine), metrics, host_grads(
      engine, grads)


def host_grads(engine, grads: Any) -> Any:
  """The grads held in arrays, for a host pipeline that reads them after the program (None
  when there is none, or when it reads every grad from NVMe)."""
  if not reads_grad_arrays(engine):
    return None
  plan = engine.plan
  return plan.unflatten([tuple(g for s, g in zip(l.params, parts) if s.tier.holds_arrays)
                         for l, parts in zip(plan.leaves, plan.flatten(grads))])


def reads_grad_arrays(engine) -> bool:
  return engine.pipeline is not None and not engine.pipeline.grads_all_on_nvme


def make_train_step(state: TrainState, loss_fn: LossFn) -> Step:
  """A jitted `(state, batch) -> (state, metrics)` for `loss_fn(model, local_batch) -> mean loss`.

  `batch` is any pytree of arrays whose leading axis (examples) divides evenly
  over the `data` axis; `loss_fn` sees each rank's slice. The input state is
  donated: use the returned one.
  """
  engine = state.engine
  key = ("train", fn_key(loss_fn))  # a lambda made anew each step runs the step compiled once
  if key in engine.steps:
    return engine.steps[key]
  warn_if_recompiled(engine.steps, key, "train_step", loss_fn)
  plan, mesh = engine.plan, engine.mesh
  moves = timeline(plan)
  shardings = jax.tree.map(lambda x: x.sharding, state)
  grad_shardings = None if not reads_grad_arrays(engine) else plan.unflatten([
      tuple(x.sharding for x in parts) if leaf.trainable else ()
      for leaf, parts in zip(plan.leaves, plan.flatten(state.params))])
  jitted = jax.jit(functools.partial(train_program, engine, loss_fn, moves), donate_argnums=(0,),
                   in_shardings=(shardings, NamedSharding(mesh, P(plan.axis))),
                   out_shardings=(shardings, NamedSharding(mesh, P()), grad_shardings),
                   compiler_options=swap.compiler_options(mesh) if engine.store else None)
  if engine.pipeline is None:
    run = functools.partial(run_program, engine, jitted)
  else:
    run = PipelineRunner(engine, jitted, loss_fn)
    engine.life.closers.append(run.close)  # its thread joined at close()
  if engine.store is not None and engine.config.nvme_atomic_steps:
    run = all_or_nothing(engine, run)
  guarded = consuming(run, batch_check(engine, loss_fn))
  guarded.jitted = jitted
  engine.steps[key] = guarded
  return guarded


def consuming(run: Step, check: Callable[[Any], None]) -> Step:
  """`run`, refusing a state that is no longer usable, or a batch `check` refuses (before the
  state is taken), and marking the state it consumes."""
  def step(state: TrainState, batch: Any) -> tuple[TrainState, dict]:
    state.check_usable("train_step")
    check(batch)
    try:
      new, metrics = run(state, batch)
    except BaseException:
      if state.arrays_deleted():
        state.mark_donated(None)  # the program ran (and took the arrays) before it failed
      raise
    state.mark_donated(new)
    return new, metrics

  return step


def learning_rate(engine, opt_state) -> jax.Array | None:
  """The learning rate this step uses: zinfjax's AdamW schedule at the step's count, or an
  optax `inject_hyperparams` state's `learning_rate` (None when the optimizer hides it)."""
  if engine.hyper is not None:
    return jnp.asarray(engine.hyper.schedule(opt_state.count), jnp.float32)
  found = [s.hyperparams["learning_rate"] for s in jax.tree.leaves(
      opt_state, is_leaf=lambda x: hasattr(x, "hyperparams"))
           if hasattr(s, "hyperparams") and "learning_rate" in s.hyperparams]
  return jnp.asarray(found[0], jnp.float32) if found else None


def train_step(state: TrainState, batch: Any, loss_fn: LossFn) -> tuple[TrainState, dict]:
  """One ZeRO training step; compiles once per (loss_fn, shapes) and reuses it."""
  return make_train_step(state, loss_fn)(state, batch)
