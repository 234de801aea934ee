"""The user's loss, checked when a step is traced: before it compiles or takes the state.

Two mistakes train without an error and answer wrongly, or fail deep inside
autodiff with jax's words rather than the loss's:

- **What the loss returns.** A step differentiates one float scalar. An integer
  loss has no gradient: every grad is zero, silently. A per-token array or a
  `(loss, aux)` tuple fails inside `value_and_grad`.
- **What the loss reads.** A trainable param the loss never reads gets a zero
  gradient: Adam leaves it where it is (weight decay alone shrinks it), while
  its master copy and moments still take memory on their tiers. Losing the
  whole model this way is common: a loss that scores a model from outside the
  step (a closure) instead of its `model` argument, or one that returns a
  constant. The loss's trace on the plain model, with the work it does not need
  dropped (JAX's dead-code elimination, inside loops, calls and `shard_map`
  too), shows which params can reach it.

A loss may also check each host batch itself, before the step takes the state
or spends compute: a `check_batch(model, batch)` attribute (`lm_loss` has one,
its ids against the model's vocabulary), called with the model's abstract
form (shapes and static attributes, no arrays) on every batch (`batch_check`).

The loss is traced once on the plain model (abstract params: nothing runs), in a
`shard_map` over the step's mesh, as each rank runs it. A loss that reads no
trainable param, or returns anything but one float scalar, is refused with a
`ValueError`; one that skips some params gets a warning naming them (freeze them
with `ZeroConfig.trainable`). A param read only under `stop_gradient` counts as
read. Where the loss cannot be traced on the plain model (it raises there) or
JAX's elimination is not at hand, nothing is checked: the step's own trace
reports the loss's errors. One such error is named here: a module from outside
the step used inside a transform (the layer scan of a `Stack`), which flax
reports as a graph node of another trace.
"""

from __future__ import annotations

import functools
import warnings
from typing import Any, Callable

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from .globalmean import over_ranks

SHOWN = 8  # names listed in a warning; the rest counted
OUTSIDE = "Cannot extract graph node from different trace level"  # flax's words


def _name(loss_fn: Callable) -> str:
  return getattr(loss_fn, "__name__", type(loss_fn).__name__)


def abstract_params(plan) -> list[jax.ShapeDtypeStruct]:
  """The model's params as shapes, one per plan leaf (whole, in the params' dtype)."""
  return [jax.ShapeDtypeStruct(l.layout.shape, plan.dtype("params")) for l in plan.leaves]


def traced(engine, loss_fn: Callable, batch: Any):
  """(closed jaxpr, output shapes) of `loss_fn(model, local batch)` on the plain model, or None
  where it cannot be traced there. `batch` is the step's whole batch (arrays, tracers or
  shapes)."""
  plan = engine.plan
  params = abstract_params(plan)
  shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), batch)

  def local(ps, b):
    with over_ranks(plan.axis, plan.dp):
      return loss_fn(nnx.merge(engine.graphdef, plan.unflatten(ps)), b)

  fn = jax.shard_map(local, mesh=plan.mesh, in_specs=(P(), P(plan.axis)), out_specs=P(),
                     check_vma=False)
  try:
    return jax.make_jaxpr(fn, return_shape=True)(params, shapes)
  except Exception as e:  # noqa: BLE001 - the step's own trace reports what the loss raises
    if OUTSIDE in str(e):
      raise ValueError(
          f"the loss {_name(loss_fn)} uses an nnx module made outside the step (a closure or a "
          f"global) inside a transform (a zinfjax.Stack's layer scan): "
          f"{str(e).splitlines()[0][:120]}. Score the model the step passes "
          "(`loss_fn(model, batch)`); a second model the loss needs (a frozen teacher) belongs "
          "inside the model, frozen with ZeroConfig(trainable=...).") from None
    return None


def _unread(engine, closed) -> list[str] | None:
  """Names of the trainable leaves whose params the traced loss does not need."""
  try:
    from jax._src.interpreters import partial_eval as pe  # not public API
    _, used = pe.dce_jaxpr(closed.jaxpr, [True] * len(closed.jaxpr.outvars), instantiate=False)
  except (ImportError, AttributeError, TypeError):
    return None
  leaves = engine.plan.leaves
  return [l.name for l, u in zip(leaves, used[:len(leaves)]) if l.trainable and not u]


def unread_params(engine, loss_fn: Callable, batch: Any) -> list[str] | None:
  """Names of the trainable leaves `loss_fn` does not read (None: could not tell)."""
  found = traced(engine, loss_fn, batch)
  return None if found is None else _unread(engine, found[0])


def check_output(name: str, out: Any) -> None:
  """Refuse a loss output that is not one float scalar, saying what to return instead."""
  leaves = jax.tree.leaves(out)
  if len(leaves) != 1 or not hasattr(leaves[0], "shape"):
    raise ValueError(
        f"the loss {name} returned {jax.tree.structure(out)}: a zinfjax step differentiates the "
        "loss alone, one float scalar (no auxiliary outputs). Return the mean loss; score other "
        "metrics with zinfjax.eval_step.")
  (x,) = leaves
  kind = f"{jnp.dtype(x.dtype).name}{list(x.shape)}"
  if x.shape != ():
    raise ValueError(f"the loss {name} returned {kind}, not a scalar: reduce it to the mean loss "
                     "over the batch (jnp.mean, or a sum over zinfjax.globalmean.mean_divisor).")
  if not jnp.issubdtype(x.dtype, jnp.floating):
    raise ValueError(f"the loss {name} returned {kind}: an integer or boolean loss has no "
                     "gradient (every grad would be zero). Return it in floating point.")


def check_loss(engine, loss_fn: Callable, batch: Any) -> None:
  """Refuse a loss that returns anything but one float scalar or reads no trainable param;
  warn naming the trainable params it does not read."""
  found = traced(engine, loss_fn, batch)
  if found is None:
    return
  name = _name(loss_fn)
  check_output(name, found[1])
  unread = _unread(engine, found[0])
  if not unread:
    return
  trainable = [l.name for l in engine.plan.leaves if l.trainable]
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


def batch_check(engine, loss_fn: Callable) -> Callable[[Any], None]:
  """`batch -> None`: the loss's own `check_batch(model, batch)` on the abstract model (through
  `functools.partial`s), raising before any compute; nothing where the loss has none."""
  fn = loss_fn
  while isinstance(fn, functools.partial):
    fn = fn.func
  check = getattr(fn, "check_batch", None)
  if check is None:
    return lambda batch: None
  model = nnx.merge(engine.graphdef, engine.plan.unflatten(abstract_params(engine.plan)))
  return lambda batch: check(model, batch)
