"""Memory-centric tiling: run huge matrix products as a scan over tiles of the weight.

`tile_matmuls(fn, tiles=N)` (or `max_tile_bytes=...`) re-traces `fn` and
replaces every `dot_general` whose weight operand is above the threshold with
a `lax.scan` over N slices of that weight, so only one tile (and its
gradient) is alive at a time, in forward and in backward (each tile's body is
rematerialized, never saved). When the weight comes straight from an
all-gather of a ZeRO-3 shard, the gather moves into the scan: each step
gathers only its tile's slice of the shard, uses it and drops it. No model
code changes; the result works under `jit`, `grad` and `vmap`.

The tiled axis is the weight's largest axis other than the gathered one. If
it is an output axis, tiles are computed exactly as untiled and concatenated;
if it is contracted, partial products are summed in float32. Axes that the
tile count does not divide get one smaller final tile.
"""

from __future__ import annotations

import functools
import math
from typing import Callable

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax
import jax.extend.core as jcore  # public: Literal, ClosedJaxpr

from .interpret import evaluate

_CALL_PRIMITIVES = ("pjit", "jit", "closed_call", "core_call")


def tile_matmuls(fn: Callable, *, tiles: int | None = None,
                 max_tile_bytes: int | None = None) -> Callable:
  """`fn` with its large matrix products tiled.

  Args:
    fn: any function of arrays (pytrees allowed).
    tiles: split each large weight into this many tiles (weights of at
      least `tiles` elements along the tiled axis are tiled).
    max_tile_bytes: or: tile every weight larger than this so each tile is
      at most this large.
  """
  if (tiles is None) == (max_tile_bytes is None):
    raise ValueError("tile_matmuls needs exactly one of tiles=N or max_tile_bytes=B.")
  if tiles is not None and tiles < 1:
    raise ValueError(f"tiles must be >= 1, got {tiles}.")
  if max_tile_bytes is not None and max_tile_bytes < 1:
    raise ValueError(f"max_tile_bytes must be >= 1, got {max_tile_bytes}.")

  @functools.wraps(fn)
  def tiled(*args):
    closed, out_shape = jax.make_jaxpr(fn, return_shape=True)(*args)
    out = _eval(closed.jaxpr, closed.consts, jax.tree.leaves(args), tiles, max_tile_bytes)
    return jax.tree.unflatten(jax.tree.structure(out_shape), out)

  return tiled


def _tile_count(weight_bytes: int, tiles: int | None, max_tile_bytes: int | None) -> int:
  if tiles is not None:
    return tiles
  return math.ceil(weight_bytes / max_tile_bytes)


def _eval(jaxpr, consts, args, tiles, max_tile_bytes):
  producers: dict = {}

  def rule(eqn, invals, read):
    name = eqn.primitive.name
    outs = None
    if name == "dot_general":
      outs = [_maybe_tiled_dot(eqn, invals, producers, read, tiles, max_tile_bytes)]
    elif name in _CALL_PRIMITIVES and "jaxpr" in eqn.params:
      inner = eqn.params["jaxpr"]
      inner = inner if hasattr(inner, "consts") else jcore.ClosedJaxpr(inner, ())
      outs = _eval(inner.jaxpr, inner.consts, invals, tiles, max_tile_bytes)
    for v in eqn.outvars:
      producers[v] = eqn
    return outs

  return evaluate(jaxpr, consts, args, rule)


def _maybe_tiled_dot(eqn, invals, producers, read, tiles, max_tile_bytes):
  lhs, rhs = invals
  (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
  plain = lambda: lax.dot_general(lhs, rhs, **eqn.params)
  if lb or rb:
    return plain()
  # The weight is the larger operand.
  w_index = 1 if rhs.size >= lhs.size else 0
  w = invals[w_index]
  weight_bytes = w.size * w.dtype.itemsize
  n = _tile_count(weight_bytes, tiles, max_tile_bytes)
  if n <= 1:  # fits in one tile
    return plain()
  gather = producers.get(eqn.invars[w_index])
  gathered = None
  if gather is not None and gather.primitive.name == "all_gather" and gather.params.get("tiled"):
    gathered = (read(gather.invars[0]), gather.params)
  gathered_axis = gathered[1]["all_gather_dimension"] if gathered else None
  candidates = [a for a in range(w.ndim) if a != gathered_axis]
  if not candidates:
    return plain()
  axis = max(candidates, key=lambda a: (w.shape[a], -a))
  if w.shape[axis] < n:
    return plain()
  return _tiled_dot(lhs, rhs, w_index, axis, n, eqn.params, gathered)


def _tiled_dot(lhs, rhs, w_index, axis, n, params, gathered):
  (lc, rc), _ = params["dimension_numbers"]
  w_contract, x_contract = (rc, lc) if w_index == 1 else (lc, rc)
  x = lhs if w_index == 1 else rhs
  size = (rhs if w_index == 1 else lhs).shape[axis]
  ts = -(-size // n)
  full, rest = size // ts, size % ts

  source = (rhs if w_index == 1 else lhs) if gathered is None else gathered[0]

  def finish(piece):  # a slice of the weight (or of its shard: gather it)
    if gathered is None:
      return piece
    g = gathered[1]
    return lax.all_gather(piece, g["axis_name"], axis=g["all_gather_dimension"], tiled=True,
                          axis_index_groups=g.get("axis_index_groups"))

  def weight_slice(start, length):
    return finish(lax.dynamic_slice_in_dim(source, start, length, axis))

  # Tiles along a leading axis are a free reshape: feed them to the scan as xs, so
  # their gradients come out stacked instead of accumulating in a weight-sized buffer.
  stacked = axis == 0 and full > 0
  pieces = (lax.slice_in_dim(source, 0, full * ts, axis=0).reshape((full, ts) + source.shape[1:])
            if stacked else jnp.arange(full))

  def tile(k_or_piece):
    return finish(k_or_piece) if stacked else weight_slice(k_or_piece * ts, ts)

  def dot(x_part, w_part):
    operands = (x_part, w_part) if w_index == 1 else (w_part, x_part)
    return lax.dot_general(*operands, **params)

  if axis in w_contract:  # split the contraction: sum partial products
    x_axis = x_contract[w_contract.index(axis)]
    out_dtype = params.get("preferred_element_type") or jnp.result_type(lhs, rhs)
    acc_dtype = jnp.float32 if jnp.issubdtype(out_dtype, jnp.floating) else out_dtype

    def partial(start, length, w_part):
      x_part = lax.dynamic_slice_in_dim(x, start, length, x_axis)
      return dot(x_part, w_part).astype(acc_dtype)

    @functools.partial(jax.checkpoint, prevent_cse=False)
    def body(carry, piece):
      acc, k = carry
      return (acc + partial(k * ts, ts, tile(piece)), k + 1), None

    out_shape = jax.eval_shape(lambda: dot(lax.slice_in_dim(x, 0, ts, axis=x_axis),
                                           weight_slice(0, ts))).shape
    (acc, _), _ = lax.scan(body, (jnp.zeros(out_shape, acc_dtype), jnp.int32(0)), pieces)
    if rest:
      acc = acc + partial(full * ts, rest, weight_slice(full * ts, rest))
    return acc.astype(out_dtype)

  # split an output axis: tiles are exact slices of the output
  w_free = [a for a in range((rhs if w_index == 1 else lhs).ndim) if a not in w_contract]
  x_free = x.ndim - len(x_contract)
  out_axis = (x_free + w_free.index(axis)) if w_index == 1 else w_free.index(axis)

  @functools.partial(jax.checkpoint, prevent_cse=False)
  def body(_, piece):
    return None, dot(x, tile(piece))

  _, ys = lax.scan(body, None, pieces)
  ys = jnp.moveaxis(ys, 0, out_axis)
  shape = list(ys.shape)
  merged = shape[:out_axis] + [shape[out_axis] * shape[out_axis + 1]] + shape[out_axis + 2:]
  y = ys.reshape(merged)
  if rest:
    y = jnp.concatenate([y, dot(x, weight_slice(full * ts, rest))], axis=out_axis)
  return y


class TiledLinear(nnx.Module):
  """A linear layer computed as `in_splits x out_splits` tiles of its weight, one at a time.

  Like DeepSpeed's TiledLinear, but the weight stays one `(in, out)` parameter
  (checkpoints do not change): only the computation is tiled. Each tile's
  product runs in a rematerialized scan body, so forward and backward hold one
  tile of the weight and of its gradient at a time.
  """

  def __init__(self, in_features: int, out_features: int, *, in_splits: int = 1,
               out_splits: int = 1, use_bias: bool = True,
               kernel_init=nnx.initializers.lecun_normal(), rngs: nnx.Rngs):
    for name, splits, size in (("in_splits", in_splits, in_features),
                               ("out_splits", out_splits, out_features)):
      if splits < 1 or size % splits:
        raise ValueError(f"TiledLinear.{name}={splits} must be >= 1 and divide {size}; "
                         f"choose a divisor of {size}.")
    self.in_splits, self.out_splits = in_splits, out_splits
    self.kernel = nnx.Param(kernel_init(rngs.params(), (in_features, out_features)))
    self.bias = nnx.Param(jnp.zeros((out_features,))) if use_bias else None

  def __call__(self, x: jax.Array) -> jax.Array:
    kernel = self.kernel[...]
    din, dout = kernel.shape
    ti, to = din // self.in_splits, dout // self.out_splits
    # (in_splits, ti, out_splits, to) -> tiles on two leading axes; free reshapes of the kernel
    tiles = kernel.reshape(self.in_splits, ti, self.out_splits, to).transpose(0, 2, 1, 3)
    xs = jnp.moveaxis(x.reshape(x.shape[:-1] + (self.in_splits, ti)), -2, 0)
    acc_dtype = jnp.float32 if jnp.issubdtype(x.dtype, jnp.floating) else x.dtype

    @functools.partial(jax.checkpoint, prevent_cse=False)
    def row(acc, x_and_tiles):
      x_i, row_tiles = x_and_tiles
      _, ys = lax.scan(lambda _, w: (None, x_i @ w), None, row_tiles)  # over out tiles
      y = jnp.moveaxis(ys, 0, -2).reshape(x_i.shape[:-1] + (dout,))
      return acc + y.astype(acc_dtype), None

    y, _ = lax.scan(row, jnp.zeros(x.shape[:-1] + (dout,), acc_dtype), (xs, tiles))
    y = y.astype(jnp.result_type(x, kernel))
    return y if self.bias is None else y + self.bias[...]
