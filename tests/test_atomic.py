"""A step on NVMe is all or nothing: a failure half way leaves every NVMe state of the previous step."""

import pytest

import zinfjax
from zinfjax.models import GPT, get_config, lm_loss

from helpers import text_batches

CONFIG = get_config("tiny", num_layers=4)


def snapshot(store) -> dict[str, bytes]:
  return {k: store.read(k).wait().tobytes() for k in store.keys()}


def make_tx(clip):
  return zinfjax.optim.adamw(1e-3, weight_decay=0.1, max_grad_norm=clip)


@pytest.mark.parametrize("clip,fault_after", [(None, 40), (None, 70), (1.0, 60)])
def test_failed_nvme_step_leaves_the_previous_states(clip, fault_after, mesh, tmp_path):
  """A write fault injected mid-step (with the optimizer under backward, or after it when
  clipping) fails the step with the engine's error; every shard in the swap store then holds
  its bytes from before the step, and a new run from there trains on."""
  zero = zinfjax.ZeroConfig(precision="fp32", offload_param="nvme", offload_optimizer="nvme",
                            nvme_path=str(tmp_path / "nvme"))
  state = zinfjax.init(lambda r: GPT(CONFIG, rngs=r), make_tx(clip), zero, mesh, 0)
  batches = text_batches(3, batch=16, seq=32, seed=2)
  state, _ = zinfjax.train_step(state, batches[0], lm_loss)
  store = state.engine.store
  before = snapshot(store)
  store.engine.set_fault_after_writes(fault_after)
  with pytest.raises(Exception, match="injected write fault") as failure:
    state, metrics = zinfjax.train_step(state, batches[1], lm_loss)
  store.engine.set_fault_after_writes(-1)
  assert any("rolled back" in n for n in getattr(failure.value, "__notes__", []))
  after = snapshot(store)
  changed = [k for k in before if k.startswith(("p/", "o/")) and after[k] != before[k]]
  assert not changed, changed[:5]
  assert not store.in_transaction


@pytest.mark.parametrize("optimizer", ["nvme", "device:2,nvme"])
def test_optimizer_under_backward_with_clipping_redoes_clipped_steps(optimizer, mesh, tmp_path):
  """With clipping on, the NVMe optimizer still updates each layer under backward, as if no
  clipping were needed; a step whose global norm needs it is rolled back and redone, unless the
  step before it clipped: then the update waits for the norm (its reads go ahead). The states
  equal, bit for bit, those of the optimizer run after backward with the norm known. With the
  first layers' optimizer on the device, the program writes their new params to NVMe in the
  step's transaction: undoing the pipeline's update must keep them."""
  batches = text_batches(6, batch=16, seq=32, seed=3)
  runs = {}
  for atomic in (False, True):
    zero = zinfjax.ZeroConfig(precision="fp32", offload_param="nvme", offload_optimizer=optimizer,
                              nvme_path=str(tmp_path / f"nvme{atomic}"), nvme_atomic_steps=atomic)
    state = zinfjax.init(lambda r: GPT(CONFIG, rngs=r), make_tx(CLIP), zero, mesh, 0)
    losses, redone, predicted, waits = [], [], [], 0
    for batch in batches:
      state, metrics = zinfjax.train_step(state, batch, lm_loss)
      losses.append(float(metrics["loss"]))
      redone.append(metrics.get("nvme_redone"))
      predicted.append(metrics.get("nvme_clip_predicted"))
      waits += metrics.get("nvme_grad_waits", 0)
    runs[atomic] = losses, (redone, predicted), waits, snapshot(state.engine.store)
    state.close()
  (ref_losses, ref_redone, _, ref_store), (losses, (redone, predicted), waits, store) = (
      runs[False], runs[True])
  assert ref_redone == ([None] * 6, [None] * 6)  # after backward: nothing to redo
  # a step after one that clipped waits for the norm instead of guessing (never redone); a
  # step after one that did not guesses "no clipping", redone when that was wrong
  assert 0 < sum(predicted) and 0 < sum(redone), (redone, predicted)
  assert not any(r and p for r, p in zip(redone, predicted)), (redone, predicted)
  assert waits > 0  # the update ran under backward
  assert losses == ref_losses
  keys = [k for k in ref_store if k.startswith(("p/", "o/"))]
  assert keys and all(store[k] == ref_store[k] for k in keys)


CLIP = 1.2
