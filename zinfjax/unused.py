"""Trainable params the loss never reads, found when a step is traced, before it compiles.

A loss that never reads a trainable param gives it a zero gradient, and training
answers wrongly without a word: Adam leaves the param where it is (weight decay
alone shrinks it) while its master copy and moments still take memory on their
tiers. Losing a whole model this way is a common mistake: a loss that scores a
model from outside the step (a closure) instead of its `model` argument, or one
that returns a constant. So the step traces `loss_fn` once on the plain model
(abstract params: nothing runs) and drops the work the loss does not need
(JAX's dead-code elimination, inside loops, calls and `shard_map` too): a
trainable param whose input is dropped cannot reach the loss.

- No trainable param reaches the loss: `ValueError`, before the step compiles or
  takes the state.
- Some do not: a warning names them (freeze them with `ZeroConfig.trainable`).

A param read only under `stop_gradient` counts as read. Where the loss cannot be
traced on the plain model (it raises there), or JAX's elimination is not at hand,
nothing is checked: the step's own trace reports the loss's errors. One error
is named here: a module from outside the step used inside a transform (the
layer scan of a `Stack`), which flax reports as a graph node of another trace.
"""

from __future__ import annotations

import warnings
from typing import Any, Callable

import jax
from flax import nnx
from jax.sharding import PartitionSpec as P

from .globalmean import over_ranks

SHOWN = 8
OUTSIDE = "Cannot extract graph node from different trace level"  # names listed in a warning; the rest counted


def unread_params(engine, loss_fn: Callable, batch: Any) -> list[str] | None:
  """Names of the trainable leaves `loss_fn(model, local batch)` does not read (None: could
  not tell). `batch` is the step's whole batch (arrays, tracers or shapes)."""
  try:
    from jax._src.interpreters import partial_eval as pe  # not public API
    dce = pe.dce_jaxpr
  except (ImportError, AttributeError):
    return None
  plan = engine.plan
  params = [jax.ShapeDtypeStruct(l.layout.shape, plan.dtype("params")) for l in plan.leaves]
  shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), batch)

  def local(ps, b):
    with over_ranks(plan.axis, plan.dp):
      return loss_fn(nnx.merge(engine.graphdef, plan.unflatten(ps)), b)

  fn = jax.shard_map(local, mesh=plan.mesh, in_specs=(P(), P(plan.axis)), out_specs=P(),
                     check_vma=False)
  try:
    closed = jax.make_jaxpr(fn)(params, shapes)
    _, used = dce(closed.jaxpr, [True] * len(closed.jaxpr.outvars), instantiate=False)
  except Exception as e:  # noqa: BLE001 - the step's own trace reports what the loss raises
    if OUTSIDE in str(e):  # flax's words for a module of another trace inside a transform
      raise ValueError(
          f"the loss uses an nnx module made outside the step (a closure or a global) inside a "
          f"transform (a zinfjax.Stack's layer scan): {str(e).splitlines()[0][:120]}. Score the "
          "model the step passes (`loss_fn(model, batch)`); a second model the loss needs (a "
          "frozen teacher) belongs inside the model, frozen with ZeroConfig(trainable=...)."
      ) from None
    return None
  return [l.name for l, u in zip(plan.leaves, used[:len(plan.leaves)]) if l.trainable and not u]


def check_reads_params(engine, loss_fn: Callable, batch: Any) -> None:
  """Refuse a loss that reads no trainable param; warn naming the trainable params it does
  not read."""
  unread = unread_params(engine, loss_fn, batch)
  if not unread:
    return
  trainable = [l.name for l in engine.plan.leaves if l.trainable]
  name = getattr(loss_fn, "__name__", repr(loss_fn))
  if len(unread) == len(trainable):
    raise ValueError(
        f"the loss {name} reads none of the model's {len(trainable)} trainable params: every "
        "gradient would be zero and training would change nothing. The loss must score the "
        "model it is given (`loss_fn(model, batch)`), not a model from outside the step, and "
        "its value must depend on that model's output.")
  more = f" and {len(unread) - SHOWN} more" if len(unread) > SHOWN else ""
  warnings.warn(
      f"the loss {name} does not read {len(unread)} of the model's {len(trainable)} trainable "
      f"params ({', '.join(unread[:SHOWN])}{more}): their gradients are zero, so they do not "
      "train, while their optimizer states take memory. Freeze them with "
      "ZeroConfig(trainable=...), or check that the loss uses them.", stacklevel=2)
