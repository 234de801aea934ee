"""A Llama-family decoder in Flax NNX: RMSNorm, rotary positions, SwiGLU, grouped-query attention.

Covers Llama 2/3 (its rope scalings too: `models/rope.py`), Mistral (its
sliding window), Qwen2 (q/k/v biases), Qwen3 (each head's queries and keys
RMS-normed), Phi-3, OLMo 2 (norms after attention and the MLP, and on the whole
q and k projections), Gemma, Gemma 2 and Gemma 3 checkpoints (GeGLU, norms
scaling by 1 + weight, embeddings scaled by sqrt(hidden); Gemma 2's and 3's norms
before and after attention and the MLP, and their sliding-window and global
layers, Gemma 2's logits soft-capped, Gemma 3's layers each kind with a rope of
its own), with tied or untied embeddings. Blocks are a
`zinfjax.Stack`, so it trains on one device or layer by layer under ZeRO-3.
Names and layouts follow Hugging Face's `LlamaForCausalLM` (see `models/hf.py`
for the mapping); the math follows its forward: norms and softmax in fp32,
rotary embedding with `rotate_half` (`models/rope.py`).
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from zinfjax.layers import Stack, layer_index
from .attention import causal_attention
from .config import check_lora_rank, train_flops
from .embedding import lookup
from .linear import linears
from .loss import dense, softcapped, tied
from .rope import RopeScaling, rotary


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
  """Shape of a Llama-family model (field names follow our GPTConfig; `hf.py` maps HF's).

  Attributes:
    num_kv_heads: key/value heads (grouped-query attention); divides num_heads.
    head_dim: width of one head (default hidden // num_heads).
    rope_theta: base of the rotary frequencies.
    rope_scaling: a scaling of those frequencies (`rope.RopeScaling`: Llama 3.1's, YaRN's...).
    tie_embeddings: the output projection is the token embedding transposed.
    qkv_bias: q/k/v projections have biases (Qwen2).
    qk_norm: queries and keys are RMS-normed before the rotary embedding: each head's (a
      learned scale of head_dim, Qwen3) or, with qk_norm_span="all", all heads' at once (a
      scale per feature of the q and k projections, OLMo 2).
    post_norm: the norms follow attention and the MLP, on their outputs before the residual
      add (x + norm(attn(x)), OLMo 2), instead of preceding them on their inputs.
    seq_len: longest sequence (HF's max_position_embeddings).
    sliding_window: each position attends to this many latest positions, itself included
      (Mistral's sliding window); None attends to all before it.
    activation: the MLP's gate, one of `ACTIVATIONS`: "silu" (SwiGLU), "gelu" (erf's) or
      "gelu_tanh" (its tanh approximation: Gemma's GeGLU).
    norm_offset: every RMSNorm scales by 1 + its weight, the weight starting at 0 (Gemma's: the
      weight is stored as it is, so bf16 params keep its precision near a scale of 1).
    embed_scale: the embedding's rows are multiplied by sqrt(hidden), rounded to their dtype
      first (Gemma's); the tied output projection is not.
    sandwich_norm: norms both before and after attention and the MLP (x + norm(attn(norm(x))),
      Gemma 3's); exclusive with post_norm.
    layer_types: each layer's attention, "full" or "sliding" (Gemma 3's: `sliding_window`
      applies to the sliding layers alone); None: every layer takes `sliding_window`.
    local_rope_theta: the sliding layers' rotary base, unscaled (Gemma 3's local rope); None:
      theirs is `rope_theta` with `rope_scaling`, as every layer's.
    query_pre_attn_scalar: attention logits are scaled by this ** -0.5 (Gemma 2's and 3's)
      instead of head_dim ** -0.5.
    attn_softcap: attention logits are soft-capped, cap * tanh(logits / cap) (Gemma 2's); their
      attention is then the explicit form's, not cuDNN's.
    final_softcap: the output logits are soft-capped likewise (Gemma 2's), in their dtype.
    lora_rank: > 0 makes every projection an `nnx.LoRALinear` of this rank (adapters
      `nnx.LoRAParam`, train them with `ZeroConfig(trainable=nnx.LoRAParam)`).
  """

  vocab_size: int = 128
  hidden: int = 64
  intermediate: int = 172
  num_layers: int = 2
  num_heads: int = 4
  num_kv_heads: int = 2
  head_dim: int | None = None
  rope_theta: float = 10000.0
  rope_scaling: RopeScaling | None = None
  rms_eps: float = 1e-6
  tie_embeddings: bool = False
  qkv_bias: bool = False
  qk_norm: bool = False
  qk_norm_span: str = "head"
  post_norm: bool = False
  seq_len: int = 2048
  sliding_window: int | None = None
  activation: str = "silu"
  norm_offset: bool = False
  embed_scale: bool = False
  sandwich_norm: bool = False
  layer_types: tuple[str, ...] | None = None
  local_rope_theta: float | None = None
  query_pre_attn_scalar: int | None = None
  attn_softcap: float | None = None
  final_softcap: float | None = None
  remat: bool = True
  lora_rank: int = 0

  def __post_init__(self):
    for name in ("vocab_size", "hidden", "intermediate", "num_layers", "num_heads",
                 "num_kv_heads", "seq_len"):
      value = getattr(self, name)
      if not isinstance(value, int) or value < 1:
        raise ValueError(f"LlamaConfig.{name} must be a positive int, got {value!r}.")
    if self.num_heads % self.num_kv_heads:
      raise ValueError(f"LlamaConfig.num_kv_heads={self.num_kv_heads} must divide "
                       f"num_heads={self.num_heads}.")
    check_lora_rank("LlamaConfig", self.lora_rank)
    if self.qk_norm_span not in ("head", "all"):
      raise ValueError(f"LlamaConfig.qk_norm_span must be 'head' or 'all', got "
                       f"{self.qk_norm_span!r}.")
    if self.activation not in ACTIVATIONS:
      raise ValueError(f"LlamaConfig.activation must be one of {', '.join(ACTIVATIONS)}, got "
                       f"{self.activation!r}.")
    if self.sandwich_norm and self.post_norm:
      raise ValueError("LlamaConfig.sandwich_norm and post_norm exclude each other: sandwich "
                       "norms already follow attention and the MLP.")
    if self.layer_types is not None:
      if len(self.layer_types) != self.num_layers or set(self.layer_types) - {"full", "sliding"}:
        raise ValueError(f"LlamaConfig.layer_types must give 'full' or 'sliding' for each of the "
                         f"{self.num_layers} layers, got {self.layer_types!r}.")
      if "sliding" in self.layer_types and self.sliding_window is None:
        raise ValueError("LlamaConfig.layer_types names sliding layers: give their "
                         "sliding_window.")
    if self.sliding_window is not None and (not isinstance(self.sliding_window, int)
                                            or self.sliding_window < 1):
      raise ValueError(f"LlamaConfig.sliding_window must be a positive int or None, got "
                       f"{self.sliding_window!r}.")
    if self.head_dim is None and self.hidden % self.num_heads:
      raise ValueError(f"LlamaConfig.hidden={self.hidden} is not divisible by num_heads="
                       f"{self.num_heads}; give head_dim.")

  @property
  def dim(self) -> int:
    return self.head_dim or self.hidden // self.num_heads

  @property
  def num_params(self) -> int:
    """Exact parameter count (tied embedding counted once; LoRA adapters not counted)."""
    d, h, kv, f = self.hidden, self.num_heads * self.dim, self.num_kv_heads * self.dim, self.intermediate
    block = d * h + 2 * d * kv + h * d + 3 * d * f + 2 * d + (h + 2 * kv if self.qkv_bias else 0)
    block += (2 * self.dim if self.qk_norm_span == "head" else h + kv) if self.qk_norm else 0
    block += 2 * d if self.sandwich_norm else 0
    head = 0 if self.tie_embeddings else d * self.vocab_size
    return self.vocab_size * d + self.num_layers * block + d + head

  @property
  def windows(self) -> tuple[int | None, ...]:
    """Each layer's attention window (None: full attention): `layer_types`' sliding layers take
    `sliding_window`, its full ones none; without them every layer takes `sliding_window`."""
    kinds = self.layer_types or ("sliding",) * self.num_layers
    return tuple(self.sliding_window if kind == "sliding" else None for kind in kinds)

  def train_flops(self, tokens: int, seq_len: int | None = None, frozen: bool = False) -> int:
    """FLOPs of one training step over `tokens` tokens in sequences of `seq_len` (default the
    config's), the standard count (`config.train_flops`): 6·N·T, N the params that multiply
    each token (all but an untied embedding table, a lookup), plus causal attention over the
    queries' width, each sliding layer over its window (4·N·T with `frozen` params: LoRA's)."""
    table = 0 if self.tie_embeddings else self.vocab_size * self.hidden
    s = self.seq_len if seq_len is None else seq_len
    return train_flops(self.num_params - table, tokens, s, self.num_heads * self.dim,
                       self.windows, frozen)

  def replace(self, **changes) -> "LlamaConfig":
    return dataclasses.replace(self, **changes)


# the MLP's gates: x -> act(x), in the compute dtype
ACTIVATIONS: dict[str, Callable[[jax.Array], jax.Array]] = {
    "silu": jax.nn.silu, "gelu": lambda x: jax.nn.gelu(x, approximate=False),
    "gelu_tanh": lambda x: jax.nn.gelu(x, approximate=True)}


class OffsetRMSNorm(nnx.Module):
  """x / rms(x) * (1 + scale) in fp32, the scale starting at 0 (Gemma's RMSNorm)."""

  def __init__(self, features: int, epsilon: float):
    self.scale = nnx.Param(jnp.zeros((features,), jnp.float32))
    self.epsilon = epsilon

  def __call__(self, x: jax.Array) -> jax.Array:
    x = x.astype(jnp.float32)
    x = x * jax.lax.rsqrt(jnp.mean(jnp.square(x), axis=-1, keepdims=True) + self.epsilon)
    return x * (1.0 + self.scale[...].astype(jnp.float32))


def _rms_norm(features: int, config: LlamaConfig, rngs: nnx.Rngs) -> nnx.Module:
  """An RMSNorm in fp32 (its output too): nnx's, or Gemma's with `config.norm_offset`."""
  if config.norm_offset:
    return OffsetRMSNorm(features, config.rms_eps)
  return nnx.RMSNorm(features, epsilon=config.rms_eps, dtype=jnp.float32, rngs=rngs)


class Block(nnx.Module):
  """x + attn(norm1(x)); x + mlp(norm2(x)) (or, `post_norm`, x + norm1(attn(x)); x +
  norm2(mlp(x))), with a gated MLP (SwiGLU or GeGLU) and grouped-query attention."""

  def __init__(self, config: LlamaConfig, *, rngs: nnx.Rngs):
    d, k = config.hidden, config.dim
    init = nnx.initializers.normal(0.02)
    make = linears(config.lora_rank, rngs)
    linear = lambda i, o, bias=False: make(i, o, bias, init)
    self.ln1 = _rms_norm(d, config, rngs)
    self.q = linear(d, config.num_heads * k, config.qkv_bias)
    self.k = linear(d, config.num_kv_heads * k, config.qkv_bias)
    self.v = linear(d, config.num_kv_heads * k, config.qkv_bias)
    self.o = linear(config.num_heads * k, d)
    # None, or what the q and k norms span: "head" (each head) or "all" (the projection)
    self.qk_norm = config.qk_norm_span if config.qk_norm else None
    if config.qk_norm:
      whole = config.qk_norm_span == "all"
      self.q_norm = _rms_norm(k * (config.num_heads if whole else 1), config, rngs)
      self.k_norm = _rms_norm(k * (config.num_kv_heads if whole else 1), config, rngs)
    self.ln2 = _rms_norm(d, config, rngs)
    if config.sandwich_norm:  # Gemma 3's, after attention and after the MLP
      self.post_attn_norm = _rms_norm(d, config, rngs)
      self.post_mlp_norm = _rms_norm(d, config, rngs)
    self.gate = linear(d, config.intermediate)
    self.up = linear(d, config.intermediate)
    self.down = linear(config.intermediate, d)
    self.num_heads, self.num_kv_heads, self.dim = config.num_heads, config.num_kv_heads, k
    self.rope = (config.rope_theta, config.rope_scaling)
    self.local_rope = self.rope if config.local_rope_theta is None else (
        config.local_rope_theta, None)
    self.window = config.sliding_window
    # None: every layer takes `window`; else each layer's: windowed (True) or global
    self.sliding = None if config.layer_types is None else tuple(
        kind == "sliding" for kind in config.layer_types)
    self.scale_dim, self.softcap = config.query_pre_attn_scalar, config.attn_softcap
    self.post_norm, self.sandwich_norm = config.post_norm, config.sandwich_norm
    self.activation = config.activation

  def attention(self, x_BxTxD: jax.Array) -> jax.Array:
    b, t, _ = x_BxTxD.shape
    h, g, k = self.num_heads, self.num_kv_heads, self.dim
    q_BxTxF, k_BxTxF = self.q(x_BxTxD), self.k(x_BxTxD)
    if self.qk_norm == "all":  # the projections normed whole, as OLMo 2's
      q_BxTxF = self.q_norm(q_BxTxF).astype(x_BxTxD.dtype)
      k_BxTxF = self.k_norm(k_BxTxF).astype(x_BxTxD.dtype)
    q_BxTxHxK, k_BxTxGxK = q_BxTxF.reshape(b, t, h, k), k_BxTxF.reshape(b, t, g, k)
    if self.qk_norm == "head":  # normed in fp32, back in the compute dtype, as Qwen3's
      q_BxTxHxK = self.q_norm(q_BxTxHxK).astype(x_BxTxD.dtype)
      k_BxTxGxK = self.k_norm(k_BxTxGxK).astype(x_BxTxD.dtype)
    v_BxTxGxK = self.v(x_BxTxD).reshape(b, t, g, k)

    def attend(window: int | None, rope: tuple) -> jax.Array:  # head j: kv head j // (h // g)
      return causal_attention(rotary(q_BxTxHxK, *rope), rotary(k_BxTxGxK, *rope), v_BxTxGxK,
                              window, self.scale_dim, self.softcap)
    if self.sliding is None:
      y_BxTxHxK = attend(self.window, self.rope)
    elif len(set(self.sliding)) == 1:  # every layer the same
      y_BxTxHxK = (attend(self.window, self.local_rope) if self.sliding[0]
                   else attend(None, self.rope))
    else:  # this layer's, one compiled block for both kinds
      y_BxTxHxK = jax.lax.cond(jnp.asarray(self.sliding)[layer_index()],
                               lambda: attend(self.window, self.local_rope),
                               lambda: attend(None, self.rope))
    return self.o(y_BxTxHxK.reshape(b, t, h * k))

  def mlp(self, x_BxTxD: jax.Array) -> jax.Array:
    return self.down(ACTIVATIONS[self.activation](self.gate(x_BxTxD)) * self.up(x_BxTxD))

  def __call__(self, x_BxTxD: jax.Array) -> jax.Array:
    dtype = x_BxTxD.dtype
    if self.sandwich_norm:  # Gemma 3's: normed in, and out before the residual add
      x_BxTxD = x_BxTxD + self.post_attn_norm(
          self.attention(self.ln1(x_BxTxD).astype(dtype))).astype(dtype)
      return x_BxTxD + self.post_mlp_norm(self.mlp(self.ln2(x_BxTxD).astype(dtype))).astype(dtype)
    if self.post_norm:  # OLMo 2's: the outputs normed, then added
      x_BxTxD = x_BxTxD + self.ln1(self.attention(x_BxTxD)).astype(dtype)
      return x_BxTxD + self.ln2(self.mlp(x_BxTxD)).astype(dtype)
    x_BxTxD = x_BxTxD + self.attention(self.ln1(x_BxTxD).astype(dtype))
    return x_BxTxD + self.mlp(self.ln2(x_BxTxD).astype(dtype))


class Llama(nnx.Module):
  """Token ids `[B, T]` -> next-token logits `[B, T, vocab]` (fp32)."""

  def __init__(self, config: LlamaConfig, *, rngs: nnx.Rngs):
    self.config = config
    self.embed = nnx.Embed(config.vocab_size, config.hidden,
                           embedding_init=nnx.initializers.normal(0.02), rngs=rngs)
    self.layers = Stack(lambda r: Block(config, rngs=r), config.num_layers, rngs=rngs,
                        remat=config.remat)
    self.norm = _rms_norm(config.hidden, config, rngs)
    if not config.tie_embeddings:
      self.lm_head = nnx.Linear(config.hidden, config.vocab_size, use_bias=False,
                                kernel_init=nnx.initializers.normal(0.02), rngs=rngs)

  def features(self, tokens_BxT: jax.Array) -> jax.Array:
    """The final norm's output `[B, T, hidden]`, in the compute dtype."""
    if tokens_BxT.shape[1] > self.config.seq_len:
      raise ValueError(f"sequence of {tokens_BxT.shape[1]} tokens is longer than "
                       f"seq_len={self.config.seq_len}.")
    x_BxTxD = lookup(self.embed, tokens_BxT)
    if self.config.embed_scale:  # sqrt(hidden) rounded to the rows' dtype, as Gemma's
      x_BxTxD = x_BxTxD * jnp.asarray(self.config.hidden ** 0.5, x_BxTxD.dtype)
    x_BxTxD = self.layers(x_BxTxD)
    return self.norm(x_BxTxD).astype(x_BxTxD.dtype)

  def head(self) -> tuple[jax.Array, Callable]:
    """The output projection as (weight, project): the tied embedding or `lm_head` (its logits
    soft-capped with `final_softcap`)."""
    weight, project = ((self.embed.embedding[...], tied) if self.config.tie_embeddings
                       else (self.lm_head.kernel[...], dense))
    if self.config.final_softcap is not None:
      project = softcapped(project, self.config.final_softcap)
    return weight, project

  def __call__(self, tokens_BxT: jax.Array) -> jax.Array:
    weight, project = self.head()
    return project(self.features(tokens_BxT), weight).astype(jnp.float32)
