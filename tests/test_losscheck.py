"""The loss checked when a step is traced (`zinfjax.losscheck`): one that returns anything but a
float scalar, or reads no trainable param, is refused before the step compiles or takes the
state; one that skips some params gets a warning naming them."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import zinfjax
from zinfjax.models import GPT, get_config, lm_loss
from zinfjax.models.embedding import lookup
from zinfjax.losscheck import unread_params

from helpers import random_batches

TINY = get_config("tiny")
BATCH = random_batches(1, batch=8, seq=16, vocab=TINY.vocab_size, seed=5)[0]


def make(rngs):
  return GPT(TINY, rngs=rngs)


def without_final_norm(model, batch):
  """The GPT's loss with its last layer norm left out: ln_f's two params never reach it."""
  tokens = batch["inputs"]
  x = lookup(model.wte, tokens) + lookup(model.wpe, jnp.arange(tokens.shape[1]))
  logits = model.wte.attend(model.blocks(x)).astype(jnp.float32)
  picked = jnp.take_along_axis(jax.nn.log_softmax(logits), batch["targets"][..., None], -1)
  return -jnp.mean(picked)


def constant(model, batch):
  """A loss of the batch alone: it reads no param."""
  return jnp.mean(batch["inputs"].astype(jnp.float32))


def init(mesh, stage: int = 3, **kw):
  return zinfjax.init(make, optax.adam(1e-3), zinfjax.ZeroConfig(stage=stage, **kw), mesh)


@pytest.fixture(scope="module")
def gpt(mesh):
  """A ZeRO-3 state the refused steps leave untouched (each test checks it was not taken)."""
  return init(mesh)


@pytest.mark.parametrize("stage", [1, 3])
def test_a_loss_reading_no_param_is_refused_before_the_step_takes_the_state(stage, mesh, gpt):
  state = gpt if stage == 3 else init(mesh, stage)
  with pytest.raises(ValueError, match="reads none of the model's 16 trainable params"):
    zinfjax.train_step(state, BATCH, constant)
  assert not state.arrays_deleted()  # not donated: the run goes on with a fixed loss
  state.check_usable("train_step")


@pytest.mark.parametrize("loss, said", [
    (lambda m, b: lm_loss(m, b).astype(jnp.int32), r"returned int32\[\]: an integer"),
    (lambda m, b: lm_loss(m, b) * jnp.ones(b["inputs"].shape), r"returned float32\[1, 16\], not a"),
    (lambda m, b: (lm_loss(m, b), {"n": 1.0}), "the loss alone, one float scalar"),
], ids=["integer", "per-token", "with-aux"])
def test_a_loss_that_is_not_one_float_scalar_is_refused(loss, said, gpt):
  """An integer loss would train with zero grads and no error; the others would fail inside
  autodiff in jax's words."""
  with pytest.raises(ValueError, match=said):
    zinfjax.train_step(gpt, BATCH, loss)
  assert not gpt.arrays_deleted()


def test_a_model_from_outside_the_step_is_refused(mesh, gpt):
  """The common form of the mistake: the loss scores a model it closes over, not its argument."""
  class MLP(nnx.Module):
    def __init__(self, rngs):
      self.a = nnx.Linear(4, 8, rngs=rngs)
      self.b = nnx.Linear(8, 1, rngs=rngs)

    def __call__(self, x):
      return self.b(jnp.tanh(self.a(x)))

  outside = MLP(nnx.Rngs(0))
  state = zinfjax.init(MLP, optax.adam(1e-3), zinfjax.ZeroConfig(stage=1), mesh)
  x = np.random.default_rng(0).normal(size=(8, 4)).astype(np.float32)
  with pytest.raises(ValueError, match="not a model from outside the step"):
    zinfjax.train_step(state, {"x": x}, lambda model, batch: jnp.mean(outside(batch["x"]) ** 2))
  _, metrics = zinfjax.train_step(state, {"x": x},
                                  lambda model, batch: jnp.mean(model(batch["x"]) ** 2))
  assert np.isfinite(float(metrics["loss"]))

  # with a zinfjax.Stack (its layer scan a flax transform), flax's own error is named
  other = make(nnx.Rngs(1))
  with pytest.raises(ValueError, match="an nnx module made outside the step"):
    zinfjax.train_step(gpt, BATCH, lambda model, batch: lm_loss(other, batch))


def test_the_params_a_loss_skips_are_named(gpt):
  state = gpt
  assert unread_params(state.engine, lm_loss, BATCH) == []
  assert unread_params(state.engine, without_final_norm, BATCH) == ["ln_f/bias", "ln_f/scale"]
  step = zinfjax.make_train_step(state, without_final_norm)
  with pytest.warns(UserWarning, match=r"does not read 2 of the model's 16 trainable params "
                                       r"\(ln_f/bias, ln_f/scale\)"):
    step.jitted.lower(state, BATCH)  # traced: the check runs before anything compiles


def test_frozen_params_the_loss_skips_are_not_named(mesh):
  state = init(mesh, trainable=lambda path, _: "ln_f" not in path)
  assert unread_params(state.engine, without_final_norm, BATCH) == []
  step = zinfjax.make_train_step(state, without_final_norm)
  with warnings.catch_warnings():
    warnings.filterwarnings("error", message=".*does not read.*")
    step.jitted.lower(state, BATCH)
