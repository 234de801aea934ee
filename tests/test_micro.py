"""Layer-major micro-batches: the large batch's losses and params, reads once per layer, the
temporaries of one micro-batch."""

import jax
import numpy as np
import optax
import pytest

import zinfjax
from zinfjax.models import GPT, GPTConfig, get_config, lm_loss
from zinfjax.step import shard_batch

from helpers import random_batches, text_batches, zero_training

TINY = get_config("tiny")
STEPS = 4
# stage 3 runs micro-batches in zinfjax's layer scan (the last case with the activation
# checkpoints in pinned host memory); stages 1 and 2 in the model's own `Stack`
CASES = [(3, 2, False), (3, 4, False), (3, 4, True), (1, 4, False)]


def gpt(rngs):
  return GPT(TINY, rngs=rngs)


@pytest.fixture(scope="module")
def batches():
  return text_batches(STEPS, batch=32, seq=32, seed=3)


def rel_norm(a, b):
  return float(np.linalg.norm(np.asarray(a) - np.asarray(b)) / np.linalg.norm(np.asarray(b)))


@pytest.fixture(scope="module")
def sgd_runs(mesh, batches):
  """(stage, micro_batches) -> (losses, full params), trained with SGD: the params move by the
  grads themselves, so they show the accumulated grads' error (Adam's first steps turn a
  rounding-level grad into a whole lr step)."""
  runs = {}
  for stage, n, activations in CASES + [(1, 1, False), (3, 1, False)]:
    zero = zinfjax.ZeroConfig(stage=stage, precision="fp32", micro_batches=n,
                              offload_activations=activations)
    losses, state = zero_training(gpt, optax.sgd(0.2), zero, mesh, batches, lm_loss)
    runs[stage, n, activations] = losses, state.full_params()
  return runs


@pytest.mark.parametrize("stage,n,activations", CASES)
def test_micro_batches_give_the_large_batch(stage, n, activations, sgd_runs):
  (losses, params), (ref_losses, ref_params) = sgd_runs[stage, n, activations], sgd_runs[stage, 1, False]
  assert losses[-1] < losses[0] - 0.05
  rel = np.abs(losses - ref_losses) / ref_losses
  assert np.all(rel < 1e-6), rel
  for got, want in zip(jax.tree.leaves(params), jax.tree.leaves(ref_params)):
    assert rel_norm(got, want) < 1e-6


def test_nvme_reads_once_per_layer_whatever_the_micro_batches(mesh, batches, tmp_path):
  """Params and optimizer on NVMe: the same losses as the all-device large batch, and the bytes
  read from the swap store per step do not grow with the number of micro-batches."""
  tx = lambda: zinfjax.optim.adamw(3e-3, weight_decay=0.1)
  ref, _ = zero_training(gpt, optax.adamw(3e-3, weight_decay=0.1),
                         zinfjax.ZeroConfig(precision="fp32"), mesh, batches, lm_loss)
  reads = {}
  for n in (1, 4):
    zero = zinfjax.ZeroConfig(precision="fp32", offload_param="nvme", offload_optimizer="nvme",
                              nvme_path=str(tmp_path / f"n{n}"), micro_batches=n)
    state = zinfjax.init(gpt, tx(), zero, mesh)
    store, losses, per_step = state.engine.store, [], []
    for batch in batches:
      before = store.bytes_moved[0]
      state, metrics = zinfjax.train_step(state, batch, lm_loss)
      losses.append(float(metrics["loss"]))
      per_step.append(store.bytes_moved[0] - before)
    rel = np.abs(np.asarray(losses) - ref) / ref
    assert np.all(rel < 1e-6), (n, rel)
    assert len(set(per_step[1:])) == 1 and per_step[1] > 0, per_step
    reads[n] = per_step[1]
    store.close()
  assert reads[4] == reads[1], reads


def test_temporaries_are_those_of_one_micro_batch(mesh):
  """A batch of 64 (8 per device) as 4 micro-batches needs about the temporaries of a batch of
  16, plus what scales with the whole batch: the residual stream's checkpoints and the logits."""
  seq, hidden, layers, vocab = 128, 64, 4, 64
  config = GPTConfig(vocab_size=vocab, seq_len=seq, num_layers=layers, num_heads=4, hidden=hidden)

  def temp(n, batch):
    state = zinfjax.init(lambda r: GPT(config, rngs=r), optax.adam(1e-3),
                         zinfjax.ZeroConfig(precision="fp32", micro_batches=n), mesh)
    step = zinfjax.make_train_step(state, lm_loss)
    b = shard_batch(state.engine, random_batches(1, batch, seq, vocab)[0])
    return step.jitted.lower(state, b).compile().memory_analysis().temp_size_in_bytes

  whole, micro, small = temp(1, 64), temp(4, 64), temp(1, 16)
  stream = 8 * seq * hidden * 4     # one per-device activation of the whole batch, fp32
  logits = 8 * seq * vocab * 4
  assert micro < 0.5 * whole, (micro, whole)
  assert micro <= small + (layers + 4) * stream + 2 * logits, (micro, small)


def test_micro_batches_must_divide_the_batch(mesh):
  with pytest.raises(ValueError, match="micro_batches must be an int >= 1"):
    zinfjax.ZeroConfig(micro_batches=0)
  state = zinfjax.init(gpt, optax.adam(1e-3), zinfjax.ZeroConfig(micro_batches=3), mesh)
  batch = random_batches(1, 16, 8, 65)[0]   # 2 examples per device
  with pytest.raises(ValueError, match=r"micro_batches=3 does not divide.*multiple of 24"):
    zinfjax.train_step(state, batch, lm_loss)
