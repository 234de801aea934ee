"""A GPT in Flax NNX: pre-LN blocks, learned positions, GELU MLP 4x, tied embedding.

With `GPTConfig.lora_rank` every projection of the blocks carries LoRA adapters.

Blocks are built by `zinfjax.layers.Stack` (parameters stacked on a layer axis,
run with `nnx.scan`, each block remat-able), so the same model trains on one
device or layer by layer under ZeRO-3. Activations and matrix products are in the
parameters' dtype (bf16 under mixed precision: the lookups keep the table's dtype,
`embedding.lookup`); layer norms, softmax and the loss in fp32. Attention is
`attention.causal_attention` (cuDNN's fused attention on a GPU); `lm_loss` scores the output
projection in chunks of tokens (`loss.py`).
"""

from __future__ import annotations

import math

from typing import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from zinfjax.layers import Stack
from .attention import causal_attention
from .config import GPTConfig
from .embedding import lookup
from .linear import linears
from .loss import lm_loss, tied

__all__ = ["Block", "GPT", "lm_loss"]


def _layer_norm(features: int, rngs: nnx.Rngs) -> nnx.LayerNorm:
  return nnx.LayerNorm(features, epsilon=1e-5, dtype=jnp.float32, rngs=rngs)


class Block(nnx.Module):
  """One pre-LN transformer block: x + attn(ln1(x)); x + mlp(ln2(x))."""

  def __init__(self, config: GPTConfig, *, rngs: nnx.Rngs):
    d = config.hidden
    init = nnx.initializers.normal(0.02)
    # GPT-2: residual projections scaled by 1/sqrt(2 * layers).
    out_init = nnx.initializers.normal(0.02 / math.sqrt(2 * config.num_layers))
    linear = linears(config.lora_rank, rngs)
    self.ln1 = _layer_norm(d, rngs)
    self.qkv = linear(d, 3 * d, True, init)
    self.proj = linear(d, d, True, out_init)
    self.ln2 = _layer_norm(d, rngs)
    self.fc = linear(d, 4 * d, True, init)
    self.out = linear(4 * d, d, True, out_init)
    self.num_heads = config.num_heads

  def attention(self, x_BxTxD: jax.Array) -> jax.Array:
    b, t, d = x_BxTxD.shape
    h = self.num_heads
    qkv = self.qkv(x_BxTxD).reshape(b, t, 3, h, d // h)
    y_BxTxHxK = causal_attention(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2])
    return self.proj(y_BxTxHxK.reshape(b, t, d))

  def mlp(self, x_BxTxD: jax.Array) -> jax.Array:
    return self.out(jax.nn.gelu(self.fc(x_BxTxD), approximate=True))

  def __call__(self, x_BxTxD: jax.Array) -> jax.Array:
    dtype = x_BxTxD.dtype
    x_BxTxD = x_BxTxD + self.attention(self.ln1(x_BxTxD).astype(dtype))
    return x_BxTxD + self.mlp(self.ln2(x_BxTxD).astype(dtype))


class GPT(nnx.Module):
  """Token ids `[B, T]` -> next-token logits `[B, T, vocab]` (fp32)."""

  def __init__(self, config: GPTConfig, *, rngs: nnx.Rngs):
    init = nnx.initializers.normal(0.02)
    self.config = config
    self.wte = nnx.Embed(config.vocab_size, config.hidden, embedding_init=init, rngs=rngs)
    self.wpe = nnx.Embed(config.seq_len, config.hidden, embedding_init=init, rngs=rngs)
    self.blocks = Stack(lambda r: Block(config, rngs=r), config.num_layers,
                        rngs=rngs, remat=config.remat)
    self.ln_f = _layer_norm(config.hidden, rngs)

  def features(self, tokens_BxT: jax.Array) -> jax.Array:
    """The last layer norm's output `[B, T, hidden]`, in the compute dtype."""
    t = tokens_BxT.shape[1]
    if t > self.config.seq_len:
      raise ValueError(f"sequence of {t} tokens is longer than seq_len={self.config.seq_len}, "
                       "the positions the GPT learns: cut the batch's sequences to at most "
                       f"{self.config.seq_len} tokens, or build the model with a larger seq_len.")
    x_BxTxD = lookup(self.wte, tokens_BxT) + lookup(self.wpe, jnp.arange(t))
    x_BxTxD = self.blocks(x_BxTxD)
    return self.ln_f(x_BxTxD).astype(x_BxTxD.dtype)

  def head(self) -> tuple[jax.Array, Callable]:
    """The output projection as (weight, project): the tied token embedding."""
    return self.wte.embedding[...], tied

  def __call__(self, tokens_BxT: jax.Array) -> jax.Array:
    weight, project = self.head()
    return project(self.features(tokens_BxT), weight).astype(jnp.float32)
