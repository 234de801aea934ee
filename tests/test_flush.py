"""zinfjax.flush_updates: the updates ZeroConfig.delay_update holds, applied before the model is
taken out. Checked against a plain single-device AdamW that applies the delayed grads one step
late and then the last step's too, and by the loss of a step after the flush (which reads the
compute params, wherever the flush wrote them)."""

import warnings

import numpy as np
import pytest

import zinfjax
from zinfjax.models import lm_loss

from helpers import text_batches, zero_training
from test_delayed import DECAY, LR, check_params, factory, reference_grads
from test_delayed_all import masked_reference

STEPS = 3


@pytest.fixture(scope="module")
def batches():
  return text_batches(STEPS + 1, batch=16, seq=32, seed=5)


def flushed_reference(batches, clip, delay: str):
  """Losses and the params after the steps and a flush for plain AdamW on one device whose
  delayed entries (under "tail" the leaves outside the stack, under "all" every one) take each
  step's grads one step late; and the loss at those params of one more batch."""
  late = lambda path, x: np.full(x.shape, delay == "all" or "blocks" not in str(path))
  losses, params = masked_reference(batches[:-1], clip, late, lm_loss, flush=True)
  return losses, params, float(reference_grads(lm_loss, clip)[1](params, batches[-1])[0])


# (delay, params, optimizer, extra config, clip): the tail on NVMe, all or nothing, clipped; every
# update late with the params on the device (put back into their arrays), and with every state
# in the RAM store (the new params in the twins, which trade places)
CASES = [("tail", "nvme", "nvme", {}, 0.5),
         ("all", "device", "pinned_host", dict(host_optimizer="pipeline"), 0.5),
         ("all", "pinned_host", "pinned_host", dict(host_optimizer="pipeline"), None)]


@pytest.mark.parametrize("delay,param,optimizer,extra,clip", CASES)
def test_a_flush_applies_the_held_update(delay, param, optimizer, extra, clip, mesh, batches,
                                         tmp_path):
  if "nvme" in (param, optimizer):
    extra = dict(extra, nvme_path=str(tmp_path / "swap"))
  zero = zinfjax.ZeroConfig(precision="fp32", offload_param=param, offload_optimizer=optimizer,
                            delay_update=delay, **extra)
  tx = zinfjax.optim.adamw(LR, weight_decay=DECAY, max_grad_norm=clip)
  losses, state = zero_training(factory, tx, zero, mesh, batches[:STEPS], lm_loss)
  pipeline = state.engine.pipeline
  assert pipeline.held is not None
  with pytest.warns(zinfjax.HeldUpdateWarning, match="flush_updates"):  # taken out too soon
    state.full_leaf(state.engine.plan.leaves[0].name)
  before = state
  state = zinfjax.flush_updates(state)
  assert pipeline.held is None and state is not before
  with pytest.raises(zinfjax.UnusableStateError, match="flush_updates"):
    zinfjax.train_step(before, batches[0], lm_loss)
  assert zinfjax.flush_updates(state) is state  # nothing held: nothing to do
  want_losses, want, next_loss = flushed_reference(batches, clip, delay)
  np.testing.assert_allclose(losses, want_losses, rtol=1e-5)
  with warnings.catch_warnings():
    warnings.simplefilter("error", zinfjax.HeldUpdateWarning)
    check_params(state, want)
  # the next step reads the flushed compute params, applies nothing held, and holds its own
  state, metrics = zinfjax.train_step(state, batches[STEPS], lm_loss)
  np.testing.assert_allclose(float(metrics["loss"]), next_loss, rtol=1e-5)
  assert pipeline.held is not None
  if delay == "all":  # every update waits: the master params are the flushed ones still
    check_params(state, want)
  state.close()


def test_a_flush_without_a_delay_changes_nothing(mesh, batches):
  zero = zinfjax.ZeroConfig(precision="fp32", offload_optimizer="pinned_host")
  _, state = zero_training(factory, zinfjax.optim.adamw(LR), zero, mesh, batches[:1], lm_loss)
  assert zinfjax.flush_updates(state) is state
  state.close()
  with pytest.raises(zinfjax.UnusableStateError, match="flush_updates"):
    zinfjax.flush_updates(state)


def test_a_failed_flush_leaves_the_store_as_it_was(mesh, batches, tmp_path):
  """A write fault during a flush on NVMe (all or nothing): the flush fails with the engine's
  error and a note naming the flush, and every shard holds its bytes from before it."""
  zero = zinfjax.ZeroConfig(precision="fp32", offload_param="nvme", offload_optimizer="nvme",
                            delay_update="tail", nvme_path=str(tmp_path / "swap"))
  _, state = zero_training(factory, zinfjax.optim.adamw(LR), zero, mesh, batches[:1], lm_loss)
  store = state.engine.store
  before = {k: store.read(k).wait().tobytes() for k in store.keys()}
  store.engine.set_fault_after_writes(1)
  with pytest.raises(Exception, match="injected write fault") as failure:
    zinfjax.flush_updates(state)
  store.engine.set_fault_after_writes(-1)
  assert any("the flush failed" in n for n in getattr(failure.value, "__notes__", []))
  after = {k: store.read(k).wait().tobytes() for k in store.keys()}
  assert [k for k in before if after[k] != before[k]] == [] and not store.in_transaction
  state.close()
