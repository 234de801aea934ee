"""Micro-batches inside a layer: layer-major gradient accumulation.

With `micro_batches=N` a stack runs each layer on N slices of the batch, one
after the other, before moving to the next layer. The layer's params are
fetched (from any tier) and gathered once per pass, however large N is, and
the block's own temporaries (attention scores, MLP activations, the
recomputation of backward) are those of one micro-batch. The layer's grads
add up over the micro-batches on the device (in fp32) and are reduced to
their shard once. The residual stream between layers (the blocks' input and
output, and its activation checkpoint) stays whole: every later layer needs it.

A block's extra call arguments are split with the batch when their leading
axis has the batch's size, and given whole to every micro-batch otherwise.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
from jax import lax


def check(batch: int, n: int) -> None:
  """Raise a clear error when a batch of `batch` examples does not split into `n`."""
  if n > 1 and batch % n:
    raise ValueError(
        f"micro_batches={n} does not divide the batch of {batch} examples; use a batch "
        f"whose size per device is a multiple of {n} (or fewer micro-batches).")


def split(x: jax.Array, n: int) -> jax.Array:
  """[B, ...] -> [n, B/n, ...]."""
  return x.reshape(n, x.shape[0] // n, *x.shape[1:])


def merge(x: jax.Array) -> jax.Array:
  """[n, B/n, ...] -> [B, ...]."""
  return x.reshape(-1, *x.shape[2:])


def _batched(leaves: Sequence[Any], batch: int) -> list[bool]:
  return [jnp.ndim(a) >= 1 and jnp.shape(a)[0] == batch for a in leaves]


def apply(fn: Callable[[jax.Array, Any], jax.Array], n: int, x: jax.Array,
          args: Any = ()) -> jax.Array:
  """`fn(x, args)` run on `n` micro-batches of `x` in turn (a scan), outputs concatenated."""
  if n == 1:
    return fn(x, args)
  check(x.shape[0], n)
  leaves, tree = jax.tree.flatten(args)
  flags = _batched(leaves, x.shape[0])

  def body(_, xs):
    xm, parts = xs
    parts = iter(parts)
    am = jax.tree.unflatten(tree, [next(parts) if f else a for a, f in zip(leaves, flags)])
    return None, fn(xm, am)

  _, ys = lax.scan(body, None, (split(x, n), [split(a, n) for a, f in zip(leaves, flags) if f]))
  return merge(ys)


def vjp(fn: Callable[[Any, jax.Array, list], jax.Array], params: Any, x: jax.Array,
        arg_leaves: list, diff: Sequence[int], g: jax.Array, n: int) -> tuple[Any, jax.Array, list]:
  """Cotangents of `fn(params, x, arg_leaves)` for output cotangent `g`, by micro-batch.

  Returns (grads of `params` summed over the micro-batches, cotangent of `x`,
  cotangents of the float args at positions `diff`). Each micro-batch is
  recomputed and pulled back on its own, so only one micro-batch's
  residuals live at a time; param grads accumulate in fp32.
  """
  def pull(xm, gm, leaves):
    def f(p, h, d):
      full = list(leaves)
      for k, a in zip(diff, d):
        full[k] = a
      return fn(p, h, full)
    _, back = jax.vjp(f, params, xm, [leaves[k] for k in diff])
    return back(gm)

  if n == 1:
    return pull(x, g, arg_leaves)
  check(x.shape[0], n)
  flags = _batched(arg_leaves, x.shape[0])
  split_args = [split(a, n) for a, f in zip(arg_leaves, flags) if f]
  whole = [k for k in diff if not flags[k]]   # cotangents added up over micro-batches
  f32 = lambda t: jax.tree.map(lambda a: jnp.zeros(jnp.shape(a), jnp.promote_types(
      jnp.result_type(a), jnp.float32)), t)

  def body(carry, xs):
    acc, acc_args = carry
    xm, gm, parts = xs
    parts = iter(parts)
    leaves = [next(parts) if f else a for a, f in zip(arg_leaves, flags)]
    g_p, g_h, g_d = pull(xm, gm, leaves)
    acc = jax.tree.map(lambda s, t: s + t.astype(s.dtype), acc, g_p)
    by_k = dict(zip(diff, g_d))
    acc_args = [s + by_k[k].astype(s.dtype) for s, k in zip(acc_args, whole)]
    return (acc, acc_args), (g_h, [by_k[k] for k in diff if flags[k]])

  init = (f32(params), f32([arg_leaves[k] for k in whole]))
  (acc, acc_args), (g_hs, g_split) = lax.scan(body, init, (split(x, n), split(g, n), split_args))
  g_params = jax.tree.map(lambda s, p: s.astype(jnp.result_type(p)), acc, params)
  sums = dict(zip(whole, [s.astype(jnp.result_type(arg_leaves[k])) for s, k in zip(acc_args, whole)]))
  pieces = dict(zip([k for k in diff if flags[k]], [merge(a) for a in g_split]))
  return g_params, merge(g_hs), [sums[k] if k in sums else pieces[k] for k in diff]
