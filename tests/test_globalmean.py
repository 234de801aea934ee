"""Ignored targets spread unevenly over the ranks: the step's loss and update are those of one
device on the whole batch (the mean over every scored target, not a mean of ranks' means)."""

import jax
import numpy as np
import optax
import pytest
from flax import nnx

import zinfjax
from zinfjax.models import GPT, get_config, lm_loss

from helpers import reference_losses, text_batches, zero_training

TINY = get_config("tiny")
STEPS = 3


def make(rngs):
  return GPT(TINY, rngs=rngs)


def make_tx():
  """Plain SGD: the update is the grad, so the params' change compares the grads (Adam would
  blow a 1e-7 difference in a near-zero grad up to the step size)."""
  return optax.sgd(1.0)


def masked(batches, seed: int = 0):
  """`batches` with a prompt of -100 targets of a random length per example: one device's
  two examples keep every target, the others keep from a few down to none."""
  rng = np.random.default_rng(seed)
  out = []
  for b in batches:
    n, t = b["targets"].shape
    keep = rng.integers(0, t // 4, n)
    keep[:2] = t
    ignored = np.arange(t)[None, :] < (t - keep)[:, None]
    out.append({"inputs": b["inputs"], "targets": np.where(ignored, -100, b["targets"])})
  return out


@pytest.fixture(scope="module")
def batches():
  return masked(text_batches(STEPS, batch=16, seq=32, seed=3))


@pytest.fixture(scope="module")
def reference(batches):
  return reference_losses(make, make_tx(), lm_loss, batches)


@pytest.mark.parametrize("stage", [1, 3])
def test_unevenly_ignored_targets_train_as_on_one_device(stage, mesh, batches, reference):
  want_losses, want = reference
  losses, state = zero_training(make, make_tx(), zinfjax.ZeroConfig(stage=stage, precision="fp32"),
                                mesh, batches, lm_loss)
  # a mean of the ranks' means would be off by far more (the full device weighs 1/8, not ~3/4)
  np.testing.assert_allclose(losses, want_losses, rtol=1e-5)
  init = nnx.to_pure_dict(nnx.state(make(nnx.Rngs(jax.random.key(0))), nnx.Param))
  for g, w, i in zip(*map(jax.tree.leaves, (state.full_params(), want, init))):
    moved = np.asarray(w) - np.asarray(i)
    np.testing.assert_allclose(np.asarray(g) - np.asarray(i), moved, rtol=1e-3,
                               atol=1e-4 * np.abs(moved).max())


def test_eval_loss_is_the_whole_batch_mean(mesh, batches):
  state = zinfjax.init(make, make_tx(), zinfjax.ZeroConfig(precision="fp32"), mesh)
  model = make(nnx.Rngs(jax.random.key(0)))  # init's params (seed 0)
  for b in batches:
    want = float(lm_loss(model, b))
    rank_means = np.mean([float(lm_loss(model, {k: v[2 * r:2 * r + 2] for k, v in b.items()}))
                          for r in range(8)])
    assert abs(rank_means - want) > 1e-3 * want  # far past the tolerance below
    np.testing.assert_allclose(float(zinfjax.eval_step(state, b, lm_loss)["loss"]), want, rtol=1e-5)
  ignored = {"inputs": batches[0]["inputs"], "targets": np.full_like(batches[0]["targets"], -100)}
  assert float(zinfjax.eval_step(state, ignored, lm_loss)["loss"]) == 0.0
