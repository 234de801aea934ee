"""The standard FLOP count of a training step (`train_flops`, the MFU numerator) against what the
compiled step multiplies (scripts/_hlo.py), and its sliding windows against the keys the model's
attention lets each query see; the public checkpoints' shapes it is shown on (data/shapes)."""

import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from helpers import REPO, SCRIPTS
from zinfjax.models import GPTConfig, Llama, LlamaConfig, hf, lm_loss
from zinfjax.models.attention import explicit_attention
from zinfjax.models.config import attention_flops

sys.path.insert(0, SCRIPTS)
import _hlo  # noqa: E402

B, T = 2, 32


def _step_flops(config: LlamaConfig, wrt=nnx.Param) -> float:
  """The matrix-product FLOPs of one compiled value-and-grad of `lm_loss` over B x T tokens,
  taking the grads of the `wrt` params."""
  graph, state = nnx.split(Llama(config, rngs=nnx.Rngs(0)))
  rng = np.random.default_rng(0)
  batch = {k: jnp.asarray(rng.integers(0, config.vocab_size, (B, T)), jnp.int32)
           for k in ("inputs", "targets")}

  def step(state, batch):
    grad = nnx.value_and_grad(lm_loss, argnums=nnx.DiffState(0, wrt))
    return grad(nnx.merge(graph, state), batch)
  return _hlo.matmul_flops(jax.jit(step).lower(state, batch).compile().as_text()).total


def _not_products(config: LlamaConfig) -> int:
  """The params the count takes as products that multiply no matrix: norms' scales, biases."""
  h, kv = config.num_heads * config.dim, config.num_kv_heads * config.dim
  return config.num_layers * (2 * config.hidden + (h + 2 * kv) * config.qkv_bias) + config.hidden


CONFIG = LlamaConfig(vocab_size=96, hidden=64, intermediate=160, num_layers=3, num_heads=4,
                     num_kv_heads=2, seq_len=128, remat=False)


@pytest.mark.parametrize("changes", [{}, {"tie_embeddings": True, "qkv_bias": True},
                                     {"num_kv_heads": 1, "head_dim": 24}],
                         ids=["gqa", "tied+bias", "mqa+head_dim"])
def test_llama_count_is_what_the_step_multiplies(changes):
  """Without remat, the compiled step runs the count's products exactly, less what the count
  rounds in: its 6·N·T takes the norms' and biases' params as products, and its causal
  attention is the half the explicit form's masked square computes. An untied embedding table
  (a lookup) is left out of N, a tied one counted once (the head)."""
  config = CONFIG.replace(**changes)
  tokens = B * T
  masked = attention_flops(tokens, T, config.num_heads * config.dim, [None] * config.num_layers)
  expected = config.train_flops(tokens, T) + masked - 6 * tokens * _not_products(config)
  assert _step_flops(config) == expected


def test_lora_count_takes_no_grads_for_the_frozen_weights():
  """With LoRA adapters trained alone, the step runs 4·N·T for the frozen weights (forward, and
  backward to the activations) plus the adapters' 6 per param and token."""
  config = CONFIG.replace(lora_rank=2)
  tokens = B * T
  adapters = sum(x.size for x in jax.tree.leaves(
      nnx.state(Llama(config, rngs=nnx.Rngs(0)), nnx.LoRAParam)))
  masked = attention_flops(tokens, T, config.num_heads * config.dim, [None] * config.num_layers)
  expected = (config.train_flops(tokens, T, frozen=True) + masked
              - 4 * tokens * _not_products(config) + 6 * tokens * adapters)
  assert _step_flops(config, nnx.LoRAParam) == expected
  assert config.train_flops(tokens, T) - config.train_flops(tokens, T, frozen=True) == (
      2 * tokens * (config.num_params - config.vocab_size * config.hidden))


def _keys_seen(t: int, window: int | None) -> np.ndarray:
  """How many keys each query of the model's attention weighs: with queries of zeros every
  allowed key weighs alike, and values one-hot in the key's position show which."""
  q = jnp.zeros((1, t, 1, t), jnp.float32)
  v = jnp.eye(t, dtype=jnp.float32)[None, :, None, :]
  weights = explicit_attention(q, q, v, window)[0, :, 0, :]
  return np.asarray((weights > 0).sum(axis=-1))


@pytest.mark.parametrize("window", [None, 1, 5, 16, 31, 32, 64])
def test_windows_count_the_keys_the_attention_weighs(window):
  """Per sequence of s, a layer's attention FLOPs are 12 · width · the keys its queries weigh,
  less half a diagonal (the standard s²/2 for full attention, not s(s+1)/2)."""
  s, width = 32, 8
  seen = _keys_seen(s, window)
  diagonal = min(window or s, s) / 2
  assert attention_flops(s, s, width, [window]) == 12 * width * (seen.sum() - diagonal)
  if window is None or window >= s:
    assert attention_flops(s, s, width, [window]) == 12 * s * s * width // 2


def test_gemma3_layers_count_their_own_windows_and_gpt_its_standard_count():
  """Sliding and full layers each count their own keys; GPT's count is 6·N·T + 12·L·T·s·d/2,
  `seq_len` defaulting to the config's."""
  base = dict(vocab_size=96, hidden=64, intermediate=160, num_layers=4, num_heads=4,
              num_kv_heads=2, head_dim=32, seq_len=64, sliding_window=8, tie_embeddings=True)
  mixed = LlamaConfig(**base, layer_types=("sliding", "sliding", "sliding", "full"))
  full = LlamaConfig(**{**base, "sliding_window": None})
  width, tokens = 4 * 32, 256
  gap = full.train_flops(tokens) - mixed.train_flops(tokens)
  assert gap == 3 * (attention_flops(tokens, 64, width, [None])
                     - attention_flops(tokens, 64, width, [8]))
  assert LlamaConfig(**base).train_flops(tokens) < mixed.train_flops(tokens)  # all sliding
  assert mixed.train_flops(tokens, 8) == full.train_flops(tokens, 8)  # the window is the length
  gpt = GPTConfig(vocab_size=96, seq_len=64, num_layers=2, num_heads=4, hidden=64)
  assert gpt.train_flops(tokens) == 6 * gpt.num_params * tokens + 12 * 2 * tokens * 64 * 64 // 2
  assert gpt.train_flops(tokens, 16) == 6 * gpt.num_params * tokens + 12 * 2 * tokens * 16 * 64 // 2


@pytest.mark.parametrize("name, params, kinds", [
    ("gemma2-2b", 2_614_341_888, ("sliding", "full") * 13),
    ("gemma3-1b", 999_885_952, (("sliding",) * 5 + ("full",)) * 4 + ("sliding",) * 2),
    ("llama3-8b", 8_030_261_248, None)])
def test_the_shipped_shapes_are_their_checkpoints(name, params, kinds):
  """data/shapes' config.json files read as the public checkpoints: their exact parameter counts
  (as published) and their layers' kinds."""
  config = hf.config_from_hf(hf.read_config(os.path.join(REPO, "data", "shapes", name)))
  assert config.num_params == params and config.layer_types == kinds
