"""ZeRO-1/2/3 on 8 host devices match plain single-device optax training."""

import jax
import numpy as np
import optax
import pytest

import zinfjax
from zinfjax.models import GPT, GPTConfig, get_config, lm_loss

from helpers import random_batches, reference_losses, text_batches, zero_training

TINY = get_config("tiny")
STEPS = 20


def make_tx():
  schedule = optax.warmup_cosine_decay_schedule(0.0, 3e-3, 5, STEPS)
  return optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule, weight_decay=0.1))


def train(config, zero, mesh, batches, tx=None, seed=0):
  return zero_training(lambda r: GPT(config, rngs=r), tx or make_tx(), zero, mesh, batches, lm_loss,
                       seed)


@pytest.fixture(scope="module")
def batches():
  return text_batches(STEPS, batch=16, seq=32, seed=1)


@pytest.fixture(scope="module")
def reference(batches):
  return reference_losses(lambda r: GPT(TINY, rngs=r), make_tx(), lm_loss, batches)


def rel(a, b):
  return np.abs(a - b) / np.abs(b)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_fp32_matches_single_device(stage, mesh, batches, reference):
  ref_losses, ref_params = reference
  losses, state = train(TINY, zinfjax.ZeroConfig(stage=stage, precision="fp32"), mesh, batches)
  assert losses[-1] < losses[0] - 0.3, "training must make progress for the comparison to mean much"
  assert np.all(rel(losses, ref_losses) < 1e-5), rel(losses, ref_losses)
  final = state.full_params()
  for got, want in zip(jax.tree.leaves(final), jax.tree.leaves(ref_params)):
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-4, atol=2e-5)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_bf16_mixed_precision_tracks_fp32(stage, mesh, batches, reference):
  """bf16 compute params and grads against fp32 masters: losses within 2% of fp32 training."""
  losses, state = train(TINY, zinfjax.ZeroConfig(stage=stage, precision="bf16"), mesh, batches)
  assert np.all(rel(losses, reference[0]) < 2e-2), rel(losses, reference[0])
  assert losses[-1] < losses[0] - 0.3
  dtypes = {x.dtype for x in jax.tree.leaves(state.params)}
  assert dtypes == {np.dtype("bfloat16")}
  assert {x.dtype for x in jax.tree.leaves(state.master)} == {np.dtype("float32")}


def test_stage3_state_is_partitioned(mesh):
  state = zinfjax.init(lambda r: GPT(TINY, rngs=r), make_tx(), zinfjax.ZeroConfig(stage=3), mesh)
  for tree in (state.params, state.master, state.opt_state):
    for x in jax.tree.leaves(tree):
      if x.ndim == 0:
        continue
      shard = x.addressable_shards[0].data
      assert shard.size * 8 == x.size, (x.shape, shard.shape)
      assert len({s.device for s in x.addressable_shards}) == 8


@pytest.mark.parametrize("depth,threshold", [(0, 0), (2, 0), (1, 200)])
def test_prefetch_depth_and_persistence_do_not_change_results(depth, threshold, mesh, batches,
                                                               reference):
  zero = zinfjax.ZeroConfig(stage=3, precision="fp32", prefetch_depth=depth,
                            persistence_threshold=threshold)
  losses, state = train(TINY, zero, mesh, batches[:6])
  assert np.all(rel(losses, reference[0][:6]) < 1e-5)
  replicated = [lay for lay in jax.tree.leaves(state.engine.layouts, is_leaf=lambda x: hasattr(x, "axis"))
                if lay.axis is None]
  assert bool(replicated) == (threshold > 0)  # the threshold really kept small leaves whole


def test_shapes_not_divisible_by_the_mesh(mesh):
  """Width 36, vocab 67, 3 layers on 8 devices: padded shards, same training as one device."""
  config = GPTConfig(vocab_size=67, seq_len=24, num_layers=3, num_heads=4, hidden=36)
  batches = random_batches(6, batch=8, seq=24, vocab=67, seed=2)
  tx = optax.adamw(3e-3, weight_decay=0.1)
  ref_losses, _ = reference_losses(lambda r: GPT(config, rngs=r), tx, lm_loss, batches)
  losses, state = train(config, zinfjax.ZeroConfig(stage=3, precision="fp32"), mesh, batches, tx)
  wte = state.engine.layouts["wte"]["embedding"]
  assert wte.shape == (67, 36) and wte.padded == 72
  (embedding,) = state.master["wte"]["embedding"]  # one array segment: the whole leaf on device
  assert embedding.shape == (72, 36)
  assert np.all(rel(losses, ref_losses) < 1e-5)


def test_tied_embedding_is_one_parameter(mesh):
  state = zinfjax.init(lambda r: GPT(TINY, rngs=r), make_tx(), zinfjax.ZeroConfig(stage=3), mesh)
  assert set(state.master) == {"wte", "wpe", "blocks", "ln_f"}  # no separate output head
  n = sum(x.size for x in jax.tree.leaves(state.full_params()))
  assert n == TINY.num_params
