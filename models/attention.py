"""Causal self-attention for the models, in their `[B, T, heads, head_dim]` layout.

On a GPU with bf16/fp16 inputs whose shapes it takes, cuDNN's fused (flash)
attention through `jax.nn.dot_product_attention(..., is_causal=True)`: no
`[T, T]` logits in HBM. Elsewhere (the CPU, fp32 runs, Gemma 2's capped
logits) the explicit form: fp32 logits, a causal mask, softmax, taken a block
of queries at a time on sequences longer than `EXPLICIT_BLOCK` (each against
the keys it sees alone). It is kept rather than XLA's
`dot_product_attention` because its programs round the same whatever the
placement around them, which the exact-resume tests rely on (XLA's fused
form differed by an ulp between two placements' programs). Grouped-query
attention (fewer key/value heads than query heads) is the same call, and
so is a sliding window (Mistral's: each query sees its `window` latest
positions, itself included).

Whether cuDNN takes a shape is asked once per shape by compiling its forward
and backward alone: a cuDNN that refuses at compile time (an engine it lacks
for a shape, a version older than the fused kernel needs) then costs a
warning and the explicit form, not the whole training step.
`ZINFJAX_ATTENTION=explicit` keeps the explicit form on a GPU too (a
baseline to time against); `ZINFJAX_ATTENTION=cudnn` takes cuDNN's form
wherever the dtype and head dim allow, unasked (a program compiled ahead of
time for a GPU target on a machine without one: scripts/compile_gpu.py).
"""

from __future__ import annotations

import functools
import math
import os
import warnings

import jax
import jax.numpy as jnp

# head dims cuDNN's fused attention takes (the ones these models use; 256, Gemma's, from Hopper
# on: an older GPU's refusal is caught by `cudnn_compiles`)
CUDNN_HEAD_DIMS = (64, 128, 256)
# queries per block of the explicit form on a longer sequence (`explicit_attention`);
# ZINFJAX_EXPLICIT_BLOCK=N sets it (0: the whole sequence at once)
EXPLICIT_BLOCK = 1024


def use_cudnn(q_BxTxNxH: jax.Array, k_BxTxKxH: jax.Array, window: int | None = None) -> bool:
  """Whether cuDNN's fused attention runs these queries: a 16-bit dtype, a head dim it takes
  (fp32 runs, the exact tests, stay on the explicit form), and a GPU backend where it compiles
  (or `ZINFJAX_ATTENTION=cudnn`)."""
  mode = os.environ.get("ZINFJAX_ATTENTION", "auto")
  if (mode == "explicit" or q_BxTxNxH.dtype not in (jnp.bfloat16, jnp.float16)
      or q_BxTxNxH.shape[-1] not in CUDNN_HEAD_DIMS):
    return False
  return mode == "cudnn" or (jax.default_backend() == "gpu" and cudnn_compiles(
      q_BxTxNxH.shape, k_BxTxKxH.shape, q_BxTxNxH.dtype, window))


def cudnn_attention(q_BxTxNxH: jax.Array, k_BxTxKxH: jax.Array, v_BxTxKxH: jax.Array,
                    window: int | None = None, scale_dim: float | None = None) -> jax.Array:
  return jax.nn.dot_product_attention(q_BxTxNxH, k_BxTxKxH, v_BxTxKxH, is_causal=True,
                                      scale=None if scale_dim is None else scale_dim ** -0.5,
                                      local_window_size=None if window is None else (window - 1, 0),
                                      implementation="cudnn")


@functools.cache
def cudnn_compiles(q_shape: tuple[int, ...], kv_shape: tuple[int, ...], dtype,
                   window: int | None = None) -> bool:
  """Whether cuDNN's fused attention and its gradient compile for these shapes (asked once per
  shape; a refusal warns and the explicit form is used)."""
  q, kv = jax.ShapeDtypeStruct(q_shape, dtype), jax.ShapeDtypeStruct(kv_shape, dtype)
  loss = lambda q, k, v: cudnn_attention(q, k, v, window).astype(jnp.float32).sum()
  try:
    jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, kv, kv).compile()
    return True
  except Exception as e:  # noqa: BLE001  (whatever cuDNN or XLA refuse with)
    warnings.warn(f"cuDNN's fused attention does not compile for queries {q_shape} and keys "
                  f"{kv_shape} in {jnp.dtype(dtype).name} ({type(e).__name__}: "
                  f"{str(e).splitlines()[0][:200] if str(e) else ''}); using the explicit form "
                  "([T, T] logits in HBM, slower)", stacklevel=2)
    return False


def causal_attention(q_BxTxNxH: jax.Array, k_BxTxKxH: jax.Array, v_BxTxKxH: jax.Array,
                     window: int | None = None, scale_dim: float | None = None,
                     softcap: float | None = None) -> jax.Array:
  """softmax(q k^T / sqrt(H) + causal mask) v, per head (N query heads over K <= N kv heads;
  query head j uses kv head j // (N // K)); with `window`, query i sees keys i - window + 1
  to i alone (a window as long as the sequence or longer changes nothing, and is left out);
  with `scale_dim`, the logits are divided by sqrt(scale_dim) instead (Gemma 2's and 3's);
  with `softcap`, they are soft-capped, softcap * tanh(logits / softcap) (Gemma 2's: the
  explicit form alone, cuDNN's fused attention has no cap)."""
  if window is not None and window >= q_BxTxNxH.shape[1]:
    window = None
  if softcap is None and use_cudnn(q_BxTxNxH, k_BxTxKxH, window):
    return cudnn_attention(q_BxTxNxH, k_BxTxKxH, v_BxTxKxH, window, scale_dim)
  return explicit_attention(q_BxTxNxH, k_BxTxKxH, v_BxTxKxH, window, scale_dim, softcap)


def explicit_attention(q_BxTxNxH: jax.Array, k_BxTxKxH: jax.Array, v_BxTxKxH: jax.Array,
                       window: int | None = None, scale_dim: float | None = None,
                       softcap: float | None = None, block: int | None = None) -> jax.Array:
  """The same attention written out: fp32 logits and softmax under a causal mask (banded to
  `window` positions when given).

  A sequence longer than `block` queries (default `EXPLICIT_BLOCK`, or ZINFJAX_EXPLICIT_BLOCK's;
  0 there: the whole sequence) is taken a block of queries at a time, each against the keys it
  can see alone (those before its last query, within the window): no [T, T] logits, about half
  the causal square's products and the band's alone under a window. Each block is a
  `jax.checkpoint` (backward may remake its logits rather than keep them) and the next starts
  after it: compiled for an H100, a step at 8k positions holds under 4 blocks' logits.
  """
  t = q_BxTxNxH.shape[1]
  if block is None:
    block = int(os.environ.get("ZINFJAX_EXPLICIT_BLOCK", EXPLICIT_BLOCK)) or t
  attend = functools.partial(_attend, window=window, scale_dim=scale_dim, softcap=softcap)
  if t <= block:
    return attend(q_BxTxNxH, k_BxTxKxH, v_BxTxKxH, 0, 0)
  outs = []
  for start in range(0, t, block):
    stop = min(start + block, t)
    lo = 0 if window is None else max(0, start - window + 1)  # the first key it sees
    run = jax.checkpoint(functools.partial(attend, first_query=start, first_key=lo))
    outs.append(run(q_BxTxNxH[:, start:stop], k_BxTxKxH[:, lo:stop], v_BxTxKxH[:, lo:stop]))
    # the next block reads the keys after this one is done: its logits are not made beside them
    outs[-1], k_BxTxKxH, v_BxTxKxH = jax.lax.optimization_barrier(
        (outs[-1], k_BxTxKxH, v_BxTxKxH))
  return jnp.concatenate(outs, axis=1)


def _attend(q_BxQxNxH: jax.Array, k_BxSxKxH: jax.Array, v_BxSxKxH: jax.Array, first_query: int,
            first_key: int, window: int | None, scale_dim: float | None,
            softcap: float | None) -> jax.Array:
  """Queries at positions first_query... against keys at first_key...: fp32 logits, the
  causal (and window's) mask by position, softmax, the values' weighted sum."""
  b, q, n, h = q_BxQxNxH.shape
  s, g = k_BxSxKxH.shape[1], k_BxSxKxH.shape[2]
  root = math.sqrt(h if scale_dim is None else scale_dim)
  cap = (lambda x: x) if softcap is None else (lambda x: jnp.tanh(x / softcap) * softcap)
  query_Qx1 = (first_query + jnp.arange(q))[:, None]
  key_1xS = (first_key + jnp.arange(s))[None, :]
  allowed_QxS = key_1xS <= query_Qx1
  if window is not None:
    allowed_QxS &= key_1xS > query_Qx1 - window
  if g == n:
    logits = cap(_logits("bqhk,bthk->bhqt", q_BxQxNxH, k_BxSxKxH) / root)
    probs = jax.nn.softmax(jnp.where(allowed_QxS, logits, -1e30), axis=-1).astype(v_BxSxKxH.dtype)
    return jnp.einsum("bhqt,bthk->bqhk", probs, v_BxSxKxH)
  q_BxQxGxRxH = q_BxQxNxH.reshape(b, q, g, n // g, h)
  logits = cap(_logits("bqgrk,btgk->bgrqt", q_BxQxGxRxH, k_BxSxKxH) / root)
  probs = jax.nn.softmax(jnp.where(allowed_QxS, logits, -1e30), axis=-1).astype(v_BxSxKxH.dtype)
  return jnp.einsum("bgrqt,btgk->bqgrk", probs, v_BxSxKxH).reshape(b, q, n, h)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _logits(spec: str, q: jax.Array, k: jax.Array) -> jax.Array:
  """q·k in fp32, whatever q's and k's dtype. Its backward multiplies the logits' grads in q's
  dtype, as flash attention does: bf16 runs then take dq and dk from bf16 products (fp32
  accumulation) rather than fp32 ones, where XLA would upcast q and k; in fp32 it is the plain
  product's backward."""
  return jnp.einsum(spec, q, k, preferred_element_type=jnp.float32)


def _logits_fwd(spec: str, q: jax.Array, k: jax.Array):
  return _logits(spec, q, k), (q, k)


def _logits_bwd(spec: str, saved, grad: jax.Array):
  q, k = saved
  _, vjp = jax.vjp(lambda a, b: jnp.einsum(spec, a, b, preferred_element_type=q.dtype), q, k)
  return vjp(grad.astype(q.dtype))


_logits.defvjp(_logits_fwd, _logits_bwd)
