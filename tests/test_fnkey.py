"""A loss function made anew each step (a lambda, a partial, a bound method) runs the step
compiled once; one that closes over other objects compiles again, with a warning."""

import functools
import warnings

import numpy as np
import pytest

import zinfjax
from zinfjax.fnkey import RecompileWarning, fn_key
from zinfjax.models import GPT, get_config, lm_loss

from helpers import random_batches

TINY = get_config("tiny", num_layers=2, hidden=32, num_heads=2, seq_len=16, vocab_size=64)
BATCHES = random_batches(2, batch=8, seq=16, vocab=64, seed=3)


def scaled(model, batch, scale=1.0):
  return lm_loss(model, batch) * scale


class Losses:
  def loss(self, model, batch):
    return lm_loss(model, batch)


def fresh():
  """A new function object for each call, as a lambda written in a training loop is."""
  return lambda m, b: lm_loss(m, b)


def made(scale):
  return lambda m, b: scaled(m, b, scale)


SCALE = 1.0


def reads_global():
  """A lambda reading a global, as one written in a script's loop reads the loop's variables."""
  return lambda m, b: lm_loss(m, b) * SCALE


def test_keys_compare_code_and_objects_by_identity():
  a, b = (lambda m, x: lm_loss(m, x)), (lambda m, x: lm_loss(m, x))
  assert fn_key(made(float("2"))) != fn_key(made(float("2")))  # two objects: identity, not value
  two = 2.0
  assert fn_key(made(two)) == fn_key(made(two))
  assert fn_key(a) != fn_key(b)                      # two lambdas: two code objects
  assert fn_key(lm_loss) == fn_key(lm_loss)
  assert fn_key(functools.partial(scaled, scale=two)) == fn_key(functools.partial(scaled, scale=two))
  assert fn_key(functools.partial(scaled, scale=two)) != fn_key(functools.partial(scaled, scale=3.0))
  owner = Losses()
  assert fn_key(owner.loss) == fn_key(owner.loss)    # a bound method is a new object each time
  assert fn_key(owner.loss) != fn_key(Losses().loss)
  held = [lambda m, x: lm_loss(m, x) for _ in range(2)]  # one code, no closure: one function
  assert fn_key(held[0]) == fn_key(held[1])
  global SCALE
  before = fn_key(reads_global())
  assert fn_key(reads_global()) == before
  SCALE = float("2")                                 # a global it reads now holds another object
  assert fn_key(reads_global()) != before


@pytest.fixture
def state():
  with zinfjax.init(lambda rngs: GPT(TINY, rngs=rngs), zinfjax.optim.adamw(1e-2),
                    zinfjax.ZeroConfig(precision="fp32"), zinfjax.make_mesh(), rng=0) as s:
    yield s


def test_a_lambda_made_each_step_compiles_once(state):
  engine = state.engine
  with warnings.catch_warnings():
    warnings.simplefilter("error", RecompileWarning)
    losses = []
    for batch in BATCHES:
      state, metrics = zinfjax.train_step(state, batch, fresh())
      losses.append(float(metrics["loss"]))
      assert np.isfinite(float(zinfjax.eval_step(state, batch, fresh())["loss"]))
  assert sorted(k[0] for k in engine.steps) == ["eval", "train"]
  (compiled,) = [v for k, v in engine.steps.items() if k[0] == "train"]
  assert zinfjax.make_train_step(state, fresh()) is compiled
  assert np.all(np.isfinite(losses)) and losses[1] != losses[0]


def test_a_closure_over_new_objects_warns_and_compiles_again(state):
  first = zinfjax.make_train_step(state, made(np.float32(1.0)))
  with pytest.warns(RecompileWarning, match=r"train_step compiles again .*'<lambda>'"):
    second = zinfjax.make_train_step(state, made(np.float32(1.0)))
  assert second is not first
  with pytest.warns(RecompileWarning, match="eval_step compiles again"):
    for _ in range(2):
      zinfjax.make_eval_step(state, functools.partial(scaled, scale=np.float32(2.0)))
