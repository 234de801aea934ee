"""`zinfjax.layer_index()`: blocks whose layers differ by more than their params.

Gemma 3's sliding-window and global layers are one compiled block that asks its
index in the stack; the model's own scan and every ZeRO-3 layer scan (its tier
segments, micro-batches, tiles, saved residuals, backward) must give each block
its own index, or a layer runs as another kind.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import zinfjax
from zinfjax.models import Llama, LlamaConfig, lm_loss

from helpers import random_batches, reference_losses, zero_training

VOCAB, LAYERS = 61, 4


class Graded(nnx.Module):
  """x + f(x) * (index + 1), its sign flipped on odd layers: any layer given another's index
  computes another function."""

  def __init__(self, *, rngs: nnx.Rngs):
    self.up = nnx.Linear(32, 48, rngs=rngs)
    self.down = nnx.Linear(48, 32, rngs=rngs)

  def __call__(self, x):
    i = zinfjax.layer_index()
    grade = (i + 1).astype(x.dtype) * jnp.where(i % 2 == 0, 1.0, -1.0).astype(x.dtype)
    return x + self.down(nnx.gelu(self.up(x))) * grade / LAYERS


class GradedModel(nnx.Module):
  def __init__(self, *, rngs: nnx.Rngs):
    self.embed = nnx.Embed(VOCAB, 32, rngs=rngs)
    self.stack = zinfjax.Stack(lambda r: Graded(rngs=r), LAYERS, rngs=rngs)
    self.head = nnx.Linear(32, VOCAB, rngs=rngs)

  def __call__(self, tokens):
    return self.head(self.stack(self.embed(tokens)))


GEMMA3 = LlamaConfig(vocab_size=VOCAB, hidden=32, intermediate=64, num_layers=LAYERS,
                     num_heads=4, num_kv_heads=2, head_dim=16, seq_len=16, tie_embeddings=True,
                     activation="gelu_tanh", norm_offset=True, embed_scale=True, qk_norm=True,
                     sandwich_norm=True, sliding_window=3, local_rope_theta=100.0,
                     layer_types=("sliding", "full", "sliding", "full"), query_pre_attn_scalar=24)
MODELS = {"graded": lambda r: GradedModel(rngs=r), "gemma3": lambda r: Llama(GEMMA3, rngs=r)}
ZEROS = {
    "split": dict(offload_param="pinned_host:1,nvme:2,device", offload_optimizer="device:2,nvme"),
    "micro+tiles": dict(micro_batches=2, tiles=2),
    "saved": dict(layer_residuals="save"),
    "stage2": dict(stage=2, micro_batches=2),
}


@pytest.fixture(scope="module")
def batches():
  return random_batches(3, 16, 16, VOCAB, seed=4)


@pytest.fixture(scope="module", params=sorted(MODELS))
def model(request, batches):
  make = MODELS[request.param]
  tx = lambda: optax.adamw(1e-2, weight_decay=0.1)
  return make, tx, reference_losses(make, tx(), lm_loss, batches)


@pytest.mark.parametrize("name", list(ZEROS))
def test_each_layer_trains_as_itself_on_every_path(name, model, batches, mesh, tmp_path):
  """Losses equal the model's own scan on one device (fp32, 1e-5), and each param leaf to 1e-5 on
  average (training moves them by 1e-2; Adam turns the rounding of a near-zero grad into a whole
  step of a few elements): the index of each layer reaches it in every segment of a split
  stack, in micro-batches and tiles, from saved residuals and in backward's recompute, and in
  the model's own scan under ZeRO-2."""
  make, tx, (want_losses, want) = model
  zero = zinfjax.ZeroConfig(precision="fp32", nvme_path=str(tmp_path / "nvme"), **ZEROS[name])
  if "offload_optimizer" in ZEROS[name]:
    optimizer = zinfjax.optim.adamw(1e-2, weight_decay=0.1)
  else:
    optimizer = tx()
  losses, state = zero_training(make, optimizer, zero, mesh, batches, lm_loss)
  np.testing.assert_allclose(losses, want_losses, rtol=1e-5)
  for got, expected in zip(jax.tree.leaves(state.full_params()), jax.tree.leaves(want)):
    assert np.abs(np.asarray(got) - np.asarray(expected)).mean() < 1e-5
  state.close()


def test_the_index_is_asked_within_a_stack_alone():
  block = Graded(rngs=nnx.Rngs(0))
  with pytest.raises(RuntimeError, match="layer_index\\(\\) was asked outside a Stack's layers"):
    block(jnp.ones((2, 32)))
  swapped = LlamaConfig(**{**GEMMA3.__dict__, "layer_types": ("full", "sliding") * 2})
  tokens = jnp.asarray(random_batches(1, 2, 16, VOCAB)[0]["inputs"])
  ours = Llama(GEMMA3, rngs=nnx.Rngs(0))(tokens)
  assert float(jnp.abs(ours - Llama(swapped, rngs=nnx.Rngs(0))(tokens)).max()) > 1e-3
