"""Re-evaluating a jaxpr with some equations replaced: the base of zinfjax's jaxpr transforms
(`tiling.tile_matmuls`, `ordering.ordered_collectives`)."""

from __future__ import annotations

from typing import Any, Callable

import jax.extend.core as jcore

# rule(eqn, invals, read) -> the eqn's outputs, or None to bind it unchanged
Rule = Callable[[Any, list, Callable], "list | None"]


def bind(eqn, invals: list) -> list:
  """`eqn`'s primitive applied to `invals` as the jaxpr would (its context and params)."""
  with eqn.ctx.manager:
    outs = eqn.primitive.bind(*invals, **eqn.primitive.get_bind_params(eqn.params))
  return list(outs) if eqn.primitive.multiple_results else [outs]


def evaluate(jaxpr, consts, args, rule: Rule) -> list:
  """The outputs of `jaxpr` on `args`, each equation evaluated by `rule` (or bound as is)."""
  env: dict = {}

  def read(v):
    return v.val if isinstance(v, jcore.Literal) else env[v]

  for v, x in zip(jaxpr.constvars, consts):
    env[v] = x
  for v, x in zip(jaxpr.invars, args):
    env[v] = x
  for eqn in jaxpr.eqns:
    invals = [read(v) for v in eqn.invars]
    outs = rule(eqn, invals, read)
    for v, x in zip(eqn.outvars, bind(eqn, invals) if outs is None else outs):
      env[v] = x
  return [read(v) for v in jaxpr.outvars]


def subjaxprs(eqn) -> list:
  """The jaxprs an equation holds (loop bodies, branches, calls, remat regions)."""
  found = []
  for value in eqn.params.values():
    for v in value if isinstance(value, (tuple, list)) else (value,):
      if isinstance(v, jcore.ClosedJaxpr):
        found.append(v.jaxpr)
      elif isinstance(v, jcore.Jaxpr):
        found.append(v)
  return found
