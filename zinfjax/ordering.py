"""One order of collectives on every device: a jaxpr transform.

XLA:CPU runs the independent operations of a program concurrently, in
whatever order their inputs become ready, on a thread pool the devices of a
process share. Two collectives with no data path between them (a layer's
prefetch all-gather and the previous layer's gradient reduce-scatter, the
all-gathers of two tiled projections) may then start in different orders on
different devices; each blocks a pool thread until every device joins it,
and with more devices than threads none ever completes (XLA aborts after its
collective timeout). GPUs issue collectives in one stream order and need none
of this.

`ordered_collectives(fn)` re-traces `fn` (inside `shard_map`, after autodiff)
and chains every collective, and every loop, branch or remat region holding
one, to the one before it in program order: an input of each is rewritten by
the custom call `zinfjax_after`, which reads an output of the one before
(XLA drops `optimization_barrier` before its CPU runtime, which orders work
only by the buffers it reads and writes). Each device then issues them one at
a time, in the jaxpr's order. Compute is not ordered, so it still overlaps
communication.
"""

from __future__ import annotations

import functools
import math
from typing import Callable

import jax
import jax.extend.core as jcore
from jax import lax

from . import _ffi  # noqa: F401  (registers zinfjax_after)
from .interpret import bind, evaluate, subjaxprs

COLLECTIVES = frozenset({
    "all_gather", "all_gather_invariant", "reduce_scatter", "psum", "psum_invariant", "pmax",
    "pmin", "ppermute", "all_to_all", "pbroadcast"})


def needs_order(mesh: jax.sharding.Mesh, setting: bool | None = None) -> bool:
  """Whether a step on `mesh` orders its collectives (`ZeroConfig.ordered_collectives`)."""
  if setting is not None:
    return setting
  return mesh.devices.flat[0].platform == "cpu" and mesh.devices.size > 1


def ordered_collectives(fn: Callable) -> Callable:
  """`fn` with its collectives issued one at a time in program order (same on every device)."""

  @functools.wraps(fn)
  def ordered(*args):
    closed, out_shape = jax.make_jaxpr(fn, return_shape=True)(*args)
    jaxpr, consts, args = _dce(closed, jax.tree.leaves(args))
    out, _ = _eval(jaxpr, consts, args, ())
    return jax.tree.unflatten(jax.tree.structure(out_shape), out)

  return ordered


def _dce(closed, args: list) -> tuple:
  """`closed` without its dead code, inside loops and branches too: a dead collective (the
  whole-weight all-gather a tiled product replaced) must not join the chain, which would keep it
  alive. Uses JAX's own DCE (not public API); without it, only this level's dead code goes."""
  try:
    from jax._src.interpreters import partial_eval as pe
    jaxpr, used_consts, used_args = pe.dce_jaxpr_consts(
        closed.jaxpr, [True] * len(closed.jaxpr.outvars), instantiate=True)
  except (ImportError, AttributeError, TypeError):
    return closed.jaxpr, closed.consts, args
  return (jaxpr, [c for c, u in zip(closed.consts, used_consts) if u],
          [a for a, u in zip(args, used_args) if u])


def _has_collective(jaxpr) -> bool:
  return any(eqn.primitive.name in COLLECTIVES or any(_has_collective(j) for j in subjaxprs(eqn))
             for eqn in jaxpr.eqns)


def _array(v) -> bool:
  return isinstance(v, jax.Array) or hasattr(v, "aval")


def _smallest(values: list, among: range | None = None) -> int | None:
  """Index of the smallest array in `values` (within `among`), None when there is none."""
  arrays = [i for i in (range(len(values)) if among is None else among) if _array(values[i])]
  return min(arrays, key=lambda k: values[k].size) if arrays else None


def _after(values: list, last: tuple, index: int | None = None) -> list:
  """`values` once `last` exist: the one at `index` (default: the smallest) rewritten by
  `zinfjax_after`, which reads the smallest of `last` (one operand suffices: an operation
  starts when all its inputs exist, and a collective's or loop's outputs all exist when it
  ends)."""
  i = _smallest(values) if index is None else index
  d = _smallest(list(last))
  if i is None or d is None or not _array(values[i]):
    return values
  x = values[i]
  call = jax.ffi.ffi_call("zinfjax_after", jax.ShapeDtypeStruct(x.shape, x.dtype),
                          input_output_aliases={0: 0})
  values = list(values)
  values[i] = call(x, last[d])
  return values


def _live(jaxpr) -> set[int]:
  """Ids of the equations whose results `jaxpr` uses (or that have effects). A dead collective
  (an all-gather a tiled product replaced) must not join the chain: that would keep it alive."""
  used = {v for v in jaxpr.outvars if not isinstance(v, jcore.Literal)}
  live = set()
  for eqn in reversed(jaxpr.eqns):
    if eqn.effects or any(v in used for v in eqn.outvars):
      live.add(id(eqn))
      used.update(v for v in eqn.invars if not isinstance(v, jcore.Literal))
  return live


def _eval(jaxpr, consts, args, last: tuple) -> tuple[list, tuple]:
  """Evaluates `jaxpr`, chaining its collective regions after `last`; returns (outs, last)."""
  chain = [last]
  live = _live(jaxpr)

  def rule(eqn, invals, read):
    if id(eqn) not in live:
      return [None] * len(eqn.outvars)
    if eqn.primitive.name in COLLECTIVES:
      outs = bind(eqn, _after(invals, chain[0]))
    elif any(_has_collective(j) for j in subjaxprs(eqn)):
      outs, token = _region(eqn, invals, chain[0])
      chain[0] = tuple(outs) if token is None else (outs[token],)
      return outs
    else:
      return None
    chain[0] = tuple(outs)
    return outs

  outs = evaluate(jaxpr, consts, args, rule)
  return outs, chain[0]


def _closed(j) -> jcore.ClosedJaxpr:
  """A region's jaxpr as a ClosedJaxpr (jax 0.11 keeps loop and call bodies as plain Jaxprs)."""
  return j if isinstance(j, jcore.ClosedJaxpr) else jcore.ClosedJaxpr(j, ())


def _inner(region, first: int | None = None, token: int | None = None) -> Callable:
  """A function running `region` (a Jaxpr or ClosedJaxpr) with its collectives ordered inside:
  after its argument `first` (the one the chain outside rewrote), and its output `token`
  after the last of them. The order then holds however XLA rewrites the region: a loop of one
  trip inlined, an all-gather of a loop invariant hoisted out of its loop, a loop unrolled
  (each trip's first collective waits on the one before it through the carry `token`)."""
  closed = _closed(region)

  def run(*a):
    start = () if first is None else (a[first],)
    outs, end = _eval(closed.jaxpr, closed.consts, list(a), start)
    return outs if token is None else _after(outs, end, token)

  return run


def _scan_counts(eqn) -> tuple[int, int]:
  """(consts, carry) operand counts of a scan equation.

  jax <= 0.10 names them in the params; jax 0.11 does not (its `ft_in` groups
  them only before differentiation). They follow from the shapes alone:
  carries are the leading outputs whose shape is the body's (stacked ys gain
  the `length` axis), and consts and carries are the leading operands whose
  shape is the body's (stacked xs gain it too).
  """
  p = eqn.params
  if "num_consts" in p:
    return p["num_consts"], p["num_carry"]
  body = p["jaxpr"].jaxpr if isinstance(p["jaxpr"], jcore.ClosedJaxpr) else p["jaxpr"]
  same = lambda outer, inner: [v.aval.shape == w.aval.shape for v, w in zip(outer, inner)]
  leading = lambda flags: next((k for k, f in enumerate(flags) if not f), len(flags))
  ncarry = leading(same(eqn.outvars, body.outvars))
  return leading(same(eqn.invars, body.invars)) - ncarry, ncarry


def _region(eqn, invals: list, last: tuple) -> tuple[list, int | None]:
  """A loop, branch, remat or call holding collectives, rebuilt with them ordered inside and
  chained after `last`: one array passes the chain through it (a loop's smallest carry, so
  every trip's collectives follow the trip before's), in at the region's first collective
  and out after its last. Returns the outputs and which of them carries the chain on."""
  p, name = eqn.params, eqn.primitive.name
  if name in ("pjit", "jit", "closed_call", "core_call", "checkpoint", "remat", "remat2"):
    i, token = _smallest(invals), _smallest_aval(eqn.outvars)
    body = _inner(p["jaxpr"], i, token)
    if name in ("checkpoint", "remat", "remat2"):
      body = jax.checkpoint(body, prevent_cse=p.get("prevent_cse", True), policy=p.get("policy"))
    return list(body(*_after(invals, last, i))), token
  if name == "scan":
    nc, ncarry = _scan_counts(eqn)
    c = _smallest(invals, range(nc, nc + ncarry))
    i = c if c is not None else _smallest(invals)
    invals = _after(invals, last, i)
    consts, carry, xs = invals[:nc], invals[nc:nc + ncarry], invals[nc + ncarry:]
    # carries lead the outputs; a loop with none passes the chain out through its smallest
    token = _smallest_aval(eqn.outvars) if c is None else c - nc
    run = _inner(p["jaxpr"], i, token)

    def body(c, x):
      out = run(*consts, *c, *x)
      return out[:ncarry], out[ncarry:]

    carry, ys = lax.scan(body, carry, xs, length=p["length"], reverse=p["reverse"],
                         unroll=p["unroll"])
    return list(carry) + list(ys), token
  if name == "while":
    cn, bn = p["cond_nconsts"], p["body_nconsts"]
    c = _smallest(invals, range(cn + bn, len(invals)))
    invals = _after(invals, last, c)
    cconsts, bconsts, init = invals[:cn], invals[cn:cn + bn], invals[cn + bn:]
    cond = _inner(p["cond_jaxpr"])
    k = None if c is None else c - cn - bn
    run = _inner(p["body_jaxpr"], None if k is None else bn + k, k)
    outs = lax.while_loop(lambda c: cond(*cconsts, *c)[0], lambda c: run(*bconsts, *c), init)
    return list(outs), k
  if name == "cond":
    i = _smallest(invals, range(1, len(invals)))
    invals = _after(invals, last, i)
    index, ops = invals[0], invals[1:]
    token = _smallest_aval(eqn.outvars)
    first = None if i is None else i - 1
    branches = [lambda *o, b=b: _inner(b, first, token)(*o) for b in p["branches"]]
    return list(lax.switch(index, branches, *ops)), token
  return bind(eqn, _after(invals, last)), None  # any other region: one unit in the order


def _smallest_aval(outvars) -> int | None:
  """Index of the smallest of a region's outputs (by their abstract values), which the next
  collective waits on; the region makes it wait on its own last collective."""
  sizes = [(math.prod(v.aval.shape), k) for k, v in enumerate(outvars) if hasattr(v.aval, "shape")]
  return min(sizes)[1] if sizes else None
