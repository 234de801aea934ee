"""Next-token cross entropy in chunks of tokens: no [tokens, vocab] array in fp32.

The output projection of a language model makes a [tokens, vocab] array of
logits: 16k tokens of a 50k vocabulary are 3.3 GB in fp32, plus the same
again for their gradient. `chunked_cross_entropy` runs the projection and the
loss on `chunk` tokens at a time inside a rematerialized `lax.scan`: the
logits stay in the compute dtype (bf16 under mixed precision), each chunk's
log-sum-exp is taken in fp32, and backward recomputes one chunk's logits at a
time. The projection's weight gradient is summed over chunks in fp32.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
from jax import lax

LOSS_CHUNK = 1024  # tokens per chunk: [1024, vocab] fp32 logits at a time


def _chunk_losses(logits, targets):
  """Per-token cross entropy of one chunk, as optax's `softmax_cross_entropy_with_integer_labels`
  computes it (max-shifted, in fp32)."""
  logits = logits.astype(jnp.float32)
  shift = lax.stop_gradient(jnp.max(logits, axis=-1, keepdims=True))
  shifted = logits - shift
  picked = jnp.take_along_axis(shifted, targets[:, None], axis=-1)[:, 0]
  return jnp.log(jnp.sum(jnp.exp(shifted), axis=-1)) - picked


def chunked_cross_entropy(x_NxD: jax.Array, weight: jax.Array,
                          project: Callable[[jax.Array, jax.Array], jax.Array],
                          targets_N: jax.Array, chunk: int = LOSS_CHUNK) -> jax.Array:
  """Mean cross entropy of `project(x, weight)` (logits [n, vocab]) against `targets_N`.

  `weight` is the projection's matrix (its gradient is accumulated in fp32
  across chunks); `project` is applied to `chunk` rows of `x_NxD` at a time,
  in `x`'s dtype.
  """
  n, d = x_NxD.shape
  c = max(1, min(chunk, n))
  k = -(-n // c)
  pad = k * c - n
  xs = jnp.pad(x_NxD, ((0, pad), (0, 0))).reshape(k, c, d)
  ts = jnp.pad(targets_N, (0, pad)).reshape(k, c)
  valid = (jnp.arange(k * c) < n).reshape(k, c)
  w32 = weight.astype(jnp.float32)  # the grads of all chunks add up in fp32

  @jax.checkpoint
  def one(total, inputs):
    x, t, v = inputs
    losses = _chunk_losses(project(x, w32.astype(weight.dtype)), t)
    return total + jnp.sum(jnp.where(v, losses, 0.0)), None

  total, _ = lax.scan(one, jnp.zeros((), jnp.float32), (xs, ts, valid))
  return total / n


def tied(x: jax.Array, table_VxD: jax.Array) -> jax.Array:
  """Logits of a tied embedding: `x @ table.T` (as `nnx.Embed.attend`)."""
  dtype = jnp.result_type(x, table_VxD)
  return jnp.dot(x.astype(dtype), table_VxD.astype(dtype).T)


def dense(x: jax.Array, kernel_DxV: jax.Array) -> jax.Array:
  """Logits of an untied head: `x @ kernel` (as a bias-free `nnx.Linear`)."""
  dtype = jnp.result_type(x, kernel_DxV)
  return jnp.dot(x.astype(dtype), kernel_DxV.astype(dtype))


def lm_loss(model, batch: dict[str, jax.Array], chunk: int = LOSS_CHUNK) -> jax.Array:
  """Mean next-token cross entropy of `batch["inputs"]` against `batch["targets"]`.

  A model with `features(tokens) -> [B, T, D]` and `head() -> (weight, project)`
  (GPT, Llama) is scored in chunks (`chunked_cross_entropy`); any other model
  through its full logits."""
  inputs, targets = batch["inputs"], batch["targets"]
  if hasattr(model, "features") and hasattr(model, "head"):
    x_BxTxD = model.features(inputs)
    weight, project = model.head()
    return chunked_cross_entropy(x_BxTxD.reshape(-1, x_BxTxD.shape[-1]), weight, project,
                                 targets.reshape(-1), chunk)
  logits = model(inputs).astype(jnp.float32)
  return jnp.mean(_chunk_losses(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1)))
