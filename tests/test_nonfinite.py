"""A step with a NaN gradient changes nothing, on every tier; the run then trains on as if the
step had not been taken."""

import jax
import numpy as np
import optax
import pytest

import zinfjax
from zinfjax.models import GPT, get_config, lm_loss

from helpers import text_batches

CONFIG = get_config("tiny", num_layers=2)


def scaled_loss(model, batch):
  """The LM loss times the batch's `scale` (NaN: every gradient is NaN)."""
  return lm_loss(model, batch) * batch["scale"][0]


def snapshot(state) -> dict:
  """Every model state, copied to host bytes: arrays (before they are donated) and NVMe shards."""
  arrays = [np.asarray(x).tobytes() for x in jax.tree.leaves(
      (state.params, state.master, state.opt_state))]
  store = state.engine.store
  shards = {} if store is None else {k: store.read(k).wait().tobytes() for k in store.keys()
                                     if k.startswith(("p/", "o/"))}
  return {"arrays": arrays, "shards": shards}


@pytest.fixture(scope="module")
def batches():
  out = text_batches(4, batch=16, seq=32, seed=5)
  for b in out:
    b["scale"] = np.ones((16,), np.float32)
  bad = dict(out[1], scale=np.full((16,), np.nan, np.float32))
  return out, bad


@pytest.mark.parametrize("param,optimizer,clip", [
    ("device", "device", None), ("device", "device", 1.0), ("device", "pinned_host", 1.0),
    ("pinned_host", "nvme", 1.0),
    ("nvme", "nvme", None), ("nvme", "nvme", 1.0), ("nvme", "device:1,nvme", 1.0)])
def test_nan_gradient_leaves_every_state_as_it_was(param, optimizer, clip, batches, mesh,
                                                   tmp_path):
  good, bad = batches
  if optimizer == "device" and clip is None:  # any optax transformation
    make_tx = lambda: optax.adamw(1e-3, weight_decay=0.1)
  else:
    make_tx = lambda: zinfjax.optim.adamw(1e-3, weight_decay=0.1, max_grad_norm=clip)
  runs = {}
  for with_nan in (False, True):
    zero = zinfjax.ZeroConfig(precision="fp32", offload_param=param, offload_optimizer=optimizer,
                              nvme_path=str(tmp_path / f"nvme{with_nan}"))
    state = zinfjax.init(lambda r: GPT(CONFIG, rngs=r), make_tx(), zero, mesh, 0)
    losses = []
    for i, batch in enumerate(good):
      if with_nan and i == 2:
        before = snapshot(state)
        state, metrics = zinfjax.train_step(state, bad, scaled_loss)
        assert int(metrics["skipped"]) == 1 and not np.isfinite(float(metrics["grad_norm"]))
        assert snapshot(state) == before
      state, metrics = zinfjax.train_step(state, batch, scaled_loss)
      assert int(metrics["skipped"]) == 0
      losses.append(float(metrics["loss"]))
    runs[with_nan] = losses, snapshot(state)
    if state.engine.store is not None:
      state.engine.store.close()
  # the skipped step changed nothing: the steps after it are those of the run without it
  assert runs[True][0] == runs[False][0]
  assert runs[True][1] == runs[False][1]


def test_skipping_can_be_turned_off(batches, mesh):
  good, bad = batches
  zero = zinfjax.ZeroConfig(precision="fp32", offload_optimizer="device", skip_nonfinite=False)
  state = zinfjax.init(lambda r: GPT(CONFIG, rngs=r), optax.adamw(1e-3), zero, mesh, 0)
  state, metrics = zinfjax.train_step(state, bad, scaled_loss)
  assert "skipped" not in metrics
  assert not np.all(np.isfinite(np.asarray(jax.tree.leaves(state.master)[0])))
  with pytest.raises(ValueError, match="skip_nonfinite must be True or False"):
    zinfjax.ZeroConfig(skip_nonfinite=1)


def test_a_target_past_the_vocabulary_is_skipped_not_trained(batches, mesh):
  """`lm_loss` with one target past the vocabulary, in a batch already on the device (which
  `lm_loss.check_batch` leaves alone): NaN grads, so the step changes nothing (a gather past
  the end would otherwise drop that target's term from the grads alone)."""
  good, _ = batches
  zero = zinfjax.ZeroConfig(precision="fp32", offload_optimizer="device")
  state = zinfjax.init(lambda r: GPT(CONFIG, rngs=r), optax.adamw(1e-3), zero, mesh, 0)
  targets = good[0]["targets"].copy()
  targets[3, 5] = CONFIG.vocab_size
  before = snapshot(state)
  state, metrics = zinfjax.train_step(state, dict(good[0], targets=jax.numpy.asarray(targets)),
                                      lm_loss)
  assert int(metrics["skipped"]) == 1 and np.isnan(float(metrics["loss"]))
  assert snapshot(state) == before
  state, metrics = zinfjax.train_step(state, good[0], lm_loss)
  assert int(metrics["skipped"]) == 0 and np.isfinite(float(metrics["loss"]))
