"""Next-token cross entropy in chunks of tokens: no [tokens, vocab] array in fp32.

The output projection of a language model makes a [tokens, vocab] array of
logits: 16k tokens of a 50k vocabulary are 3.3 GB in fp32, plus the same
again for their gradient. `chunked_cross_entropy` runs the projection and the
loss on a chunk of tokens at a time in a `lax.scan` (by default 1024 tokens,
or more where a chunk's fp32 logits stay within 512 MiB: each chunk adds its
weight gradient into an fp32 [vocab, hidden] sum, so fewer chunks move fewer
bytes; 4096 for a 32k vocabulary): the logits stay in the
compute dtype (bf16 under mixed precision) and each chunk's log-sum-exp is
taken in fp32. Where it is differentiated, each chunk's gradients (to its
rows and to the projection's weight, summed over chunks in fp32) are taken in
the forward pass while its logits are at hand, and backward only scales them
by the loss's cotangent: the logits are made once, not again in backward (2
of the head's 6 FLOPs a token and vocabulary entry). A weight that is not
differentiated (a frozen head) gets no gradient computed.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from zinfjax.globalmean import mean_divisor

LOSS_CHUNK = 1024  # tokens per chunk at least: [1024, vocab] fp32 logits at a time
LOSS_CHUNK_BYTES = 512 << 20  # a larger chunk while its fp32 logits take no more


def default_chunk(vocab: int) -> int:
  """Tokens per chunk: `LOSS_CHUNK`, doubled while a chunk's fp32 logits fit `LOSS_CHUNK_BYTES`."""
  chunk = LOSS_CHUNK
  while 2 * chunk * vocab * 4 <= LOSS_CHUNK_BYTES:
    chunk *= 2
  return chunk


def _chunk_losses(logits, targets):
  """Per-token cross entropy of one chunk, as optax's `softmax_cross_entropy_with_integer_labels`
  computes it (max-shifted, in fp32). A target past the vocabulary scores NaN, and so does
  every gradient it reaches: a gather past the end would drop the target's term from the
  gradient alone, and the step would train, with finite grads, towards no target at all."""
  logits = logits.astype(jnp.float32)
  vocab = logits.shape[-1]
  shift = lax.stop_gradient(jnp.max(logits, axis=-1, keepdims=True))
  shifted = logits - shift
  picked = jnp.take_along_axis(shifted, jnp.minimum(targets, vocab - 1)[:, None], axis=-1)[:, 0]
  poison = jnp.where(targets < vocab, 1.0, jnp.nan)  # NaN times the loss: NaN grads too
  return (jnp.log(jnp.sum(jnp.exp(shifted), axis=-1)) - picked) * poison


def chunked_cross_entropy(x_NxD: jax.Array, weight: jax.Array,
                          project: Callable[[jax.Array, jax.Array], jax.Array],
                          targets_N: jax.Array, chunk: int | None = None) -> jax.Array:
  """Mean cross entropy of `project(x, weight)` (logits [n, vocab]) against `targets_N`.

  `weight` is the projection's matrix (its gradient is accumulated in fp32
  across chunks); `project` is applied to `chunk` rows of `x_NxD` at a time (None:
  `default_chunk` of the vocabulary), in `x`'s dtype.
  """
  n, d = x_NxD.shape
  if chunk is None:
    chunk = default_chunk(jax.eval_shape(project, x_NxD[:1], weight).shape[-1])
  c = max(1, min(chunk, n))
  k = -(-n // c)
  pad = k * c - n
  xs = jnp.pad(x_NxD, ((0, pad), (0, 0))).reshape(k, c, d)
  valid = jnp.pad(targets_N >= 0, (0, pad)).reshape(k, c)  # ignored targets and padding: False
  ts = jnp.pad(jnp.maximum(targets_N, 0), (0, pad)).reshape(k, c)
  return _loss_sum(project, xs, weight, ts, valid) / scored(targets_N)


def scored(targets: jax.Array) -> jax.Array:
  """What the summed loss is divided by: the number of targets >= 0, those of the whole batch
  in a zinfjax step (`zinfjax.globalmean`), at least 1 (ignored targets alone score 0)."""
  return mean_divisor(jnp.sum(targets >= 0))


def _chunk_sum(project, x, weight, t, v) -> jax.Array:
  """The summed losses of one chunk's valid rows."""
  return jnp.sum(jnp.where(v, _chunk_losses(project(x, weight), t), 0.0))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _loss_sum(project, xs, weight, ts, valid) -> jax.Array:
  """The summed losses of all chunks (`xs` [chunks, rows, D])."""
  body = lambda total, c: (total + _chunk_sum(project, c[0], weight, c[1], c[2]), None)
  return lax.scan(body, jnp.zeros((), jnp.float32), (xs, ts, valid))[0]


def _loss_sum_fwd(project, xs, weight, ts, valid):
  """The sum and, chunk by chunk, its gradients to the rows and (where it is differentiated)
  to the weight, summed in fp32."""
  train_weight = weight.perturbed
  xs, weight, ts, valid = xs.value, weight.value, ts.value, valid.value

  def body(carry, c):
    total, g_w = carry
    x, t, v = c
    loss, grads = jax.value_and_grad(lambda x, w: _chunk_sum(project, x, w, t, v),
                                     (0, 1) if train_weight else (0,))(x, weight)
    if train_weight:
      g_w = g_w + grads[1].astype(jnp.float32)
    return (total + loss, g_w), grads[0]

  g_w = jnp.zeros(weight.shape if train_weight else (), jnp.float32)
  (total, g_w), g_xs = lax.scan(body, (jnp.zeros((), jnp.float32), g_w), (xs, ts, valid))
  # an empty array carries the weight's dtype to backward
  return total, (g_xs, g_w if train_weight else None, jnp.zeros((0,), weight.dtype))


def _loss_sum_bwd(project, residuals, g):
  g_xs, g_w, like_w = residuals
  g_weight = None if g_w is None else (g_w * g).astype(like_w.dtype)
  return (g_xs * g).astype(g_xs.dtype), g_weight, None, None


_loss_sum.defvjp(_loss_sum_fwd, _loss_sum_bwd, symbolic_zeros=True)


def tied(x: jax.Array, table_VxD: jax.Array) -> jax.Array:
  """Logits of a tied embedding: `x @ table.T` (as `nnx.Embed.attend`)."""
  dtype = jnp.result_type(x, table_VxD)
  return jnp.dot(x.astype(dtype), table_VxD.astype(dtype).T)


def dense(x: jax.Array, kernel_DxV: jax.Array) -> jax.Array:
  """Logits of an untied head: `x @ kernel` (as a bias-free `nnx.Linear`)."""
  dtype = jnp.result_type(x, kernel_DxV)
  return jnp.dot(x.astype(dtype), kernel_DxV.astype(dtype))


@functools.cache
def softcapped(project: Callable[[jax.Array, jax.Array], jax.Array], cap: float
               ) -> Callable[[jax.Array, jax.Array], jax.Array]:
  """`project` with its logits soft-capped, cap * tanh(logits / cap), in their dtype (Gemma 2's
  final_logit_softcapping); one function per (project, cap), so a step traces it once."""
  def capped(x: jax.Array, weight: jax.Array) -> jax.Array:
    logits = project(x, weight)
    return (jnp.tanh(logits / cap) * cap).astype(logits.dtype)
  return capped


def lm_loss(model, batch: dict[str, jax.Array], chunk: int | None = None) -> jax.Array:
  """Mean next-token cross entropy of `batch["inputs"]` against `batch["targets"]`.

  A negative target (-100 in Hugging Face's labels: padding, a prompt's tokens)
  is ignored: the mean is over the targets >= 0 of the whole batch, in a
  zinfjax step as on one device (`zinfjax.globalmean`). A target past the
  vocabulary gives a NaN loss and NaN grads (a skipped step under
  `skip_nonfinite`), as does an input id outside it (`embedding.lookup`); in a
  zinfjax step, a host batch with such an id is refused before it runs
  (`check_ids`). Targets of another shape than the inputs are refused.

  A model with `features(tokens) -> [B, T, D]` and `head() -> (weight, project)`
  (GPT, Llama) is scored in chunks (`chunked_cross_entropy`); any other model
  through its full logits."""
  if not (hasattr(batch, "keys") and {"inputs", "targets"} <= set(batch.keys())):
    got = f"keys {sorted(batch.keys())}" if hasattr(batch, "keys") else type(batch).__name__
    raise ValueError(f"lm_loss takes a batch dict with 'inputs' (token ids [B, T]) and 'targets' "
                     f"(the next ids, -100 to ignore one), got {got}.")
  inputs, targets = batch["inputs"], batch["targets"]
  _check_axes(inputs.shape)
  for name, x in (("inputs", inputs), ("targets", targets)):
    if not jnp.issubdtype(x.dtype, jnp.integer):
      raise ValueError(f"lm_loss: batch[{name!r}] holds {x.dtype} values, not token ids: give "
                       f"integers (np.asarray(batch[{name!r}], np.int32)).")
  if targets.shape != inputs.shape:
    raise ValueError(f"lm_loss: targets of shape {targets.shape} for inputs of shape "
                     f"{inputs.shape}: each input token needs its next token as its target (-100 "
                     "to ignore it), so the two must have one shape.")
  if hasattr(model, "features") and hasattr(model, "head"):
    x_BxTxD = model.features(inputs)
    weight, project = model.head()
    return chunked_cross_entropy(x_BxTxD.reshape(-1, x_BxTxD.shape[-1]), weight, project,
                                 targets.reshape(-1), chunk)
  logits = model(inputs).astype(jnp.float32)
  targets = targets.reshape(-1)
  losses = _chunk_losses(logits.reshape(-1, logits.shape[-1]), jnp.maximum(targets, 0))
  return jnp.sum(jnp.where(targets >= 0, losses, 0.0)) / scored(targets)


def _check_axes(shape: tuple[int, ...]) -> None:
  if len(shape) != 2:
    raise ValueError(f"lm_loss takes inputs of token ids [B, T] (examples, positions), got "
                     f"{len(shape)} axes {tuple(shape)}; a single sequence is x[None].")


def check_ids(model, batch: Mapping) -> None:
  """Refuse a host batch whose ids fall outside `model.config.vocab_size` (an input past it or
  below 0, a target past it), naming the leaf, the id and where; zinfjax calls it on every
  batch before the step (`lm_loss.check_batch`). On the device such an id only gives a NaN loss
  and a skipped step. Leaves already on a device (`jax.Array`) are left to that NaN, as reading
  them back would wait for them."""
  vocab = getattr(getattr(model, "config", None), "vocab_size", None)
  if vocab is None or not isinstance(batch, Mapping):
    return
  for name, low in (("inputs", 0), ("targets", None)):  # a negative target is ignored
    x = batch.get(name)
    if x is None or isinstance(x, jax.Array):
      continue
    x = np.asarray(x)
    if name == "inputs":
      _check_axes(x.shape)
    if x.size == 0 or not np.issubdtype(x.dtype, np.integer):
      continue
    if int(x.max()) < vocab and (low is None or int(x.min()) >= low):
      continue
    bad = (x >= vocab) if low is None else (x >= vocab) | (x < low)
    where = tuple(int(i) for i in np.argwhere(bad)[0])
    raise ValueError(
        f"lm_loss: batch[{name!r}] holds id {int(x[where])} at {where}, outside the model's "
        f"vocabulary of {vocab} ids (0 to {vocab - 1}"
        f"{'; a target of -100 is ignored' if low is None else ''}): the data was tokenized "
        "for another vocabulary, or the model's vocab_size is too small for it.")


lm_loss.check_batch = check_ids
