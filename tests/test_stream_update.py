"""host_optimizer="stream": pinned-host optimizer states updated on the device, a layer at a time
(`optim.host.streamed_update`). It is the device's AdamW with the states carried over and back,
so it trains bit for bit like the states on the device, and it changes no state's tier."""

import jax
import numpy as np
import pytest

import zinfjax
from zinfjax.models import lm_loss
from zinfjax.optim.host import FORM_ENV

from helpers import (arrays, assert_same_training, clipped_adamw, four_layer_gpt, text_batches,
                     zero_training)

STEPS = 5
factory, tx = four_layer_gpt, clipped_adamw


@pytest.fixture(scope="module")
def batches():
  return text_batches(STEPS, batch=16, seq=32, seed=6)


# (params, optimizer, precision, clip, bf16 moments, form): per-layer splits, bf16 compute
# params and bf16 moments, clipping (0.5 clips every step of the tiny GPT: each layer's grads are
# clipped inside its update, fused as on the device), all bit for bit
CASES = [("pinned_host", "pinned_host", "fp32", None, False, "carry"),
         ("pinned_host", "pinned_host", "fp32", None, False, "stack"),
         ("pinned_host", "pinned_host", "fp32", 0.5, False, "carry"),
         ("device:2,pinned_host", "device:1,pinned_host", "bf16", None, True, "carry")]


@pytest.mark.parametrize("param,optimizer,precision,clip,bf16_moments,form", CASES)
def test_stream_update_trains_like_states_on_device(param, optimizer, precision, clip,
                                                     bf16_moments, form, mesh, batches,
                                                     monkeypatch):
  monkeypatch.setenv(FORM_ENV, form)
  opt = zinfjax.optim.adamw(3e-3, weight_decay=0.1, max_grad_norm=clip,
                            moment_dtype="bfloat16" if bf16_moments else "float32")
  zero = zinfjax.ZeroConfig(precision=precision, offload_param=param)
  want_losses, want = zero_training(factory, opt, zero, mesh, batches, lm_loss)
  placed = zero.replace(offload_optimizer=optimizer, host_optimizer="stream")
  losses, state = zero_training(factory, opt, placed, mesh, batches, lm_loss)
  assert state.engine.store is None and state.engine.pipeline is None
  kinds = {a.sharding.memory_kind for a in jax.tree.leaves(state.opt_state.mu)}
  assert kinds == {"pinned_host", "device"} if "device" in optimizer else {"pinned_host"}
  assert losses[-1] < losses[0]
  assert_same_training(losses, state, want_losses, want)
  flat = lambda tree: np.concatenate([a.astype(np.float32).ravel() for a in arrays(tree)])
  np.testing.assert_array_equal(flat(state.opt_state.nu), flat(want.opt_state.nu))
  state.close()
  want.close()


def test_stream_update_skips_a_nonfinite_step(mesh, batches):
  """A step whose grads are not finite changes no state, as on the device."""
  zero = zinfjax.ZeroConfig(precision="fp32", offload_param="pinned_host",
                            offload_optimizer="pinned_host", host_optimizer="stream")
  state = zinfjax.init(factory, tx(None), zero, mesh, 0)
  state, _ = zinfjax.train_step(state, batches[0], lm_loss)
  before = arrays(state.master) + arrays(state.opt_state.mu)
  nan_loss = lambda model, batch: lm_loss(model, batch) * np.float32(np.nan)
  state, metrics = zinfjax.train_step(state, batches[1], nan_loss)
  assert int(metrics["skipped"]) == 1
  for a, b in zip(before, arrays(state.master) + arrays(state.opt_state.mu)):
    np.testing.assert_array_equal(a, b)
  state.close()


def test_checkpoints_move_between_the_streamed_update_and_the_device(mesh, batches, tmp_path):
  """Saved from a streamed run (its states in pinned host), restored with every state on the
  device: the rest of the run equals one that never left the device, bit for bit."""
  from zinfjax.checkpoint import Checkpointer
  zero = zinfjax.ZeroConfig(precision="fp32")
  straight, _ = zero_training(factory, tx(None), zero, mesh, batches, lm_loss)
  streamed = zero.replace(offload_param="pinned_host", offload_optimizer="pinned_host",
                          host_optimizer="stream")
  half, state = zero_training(factory, tx(None), streamed, mesh, batches[:3], lm_loss)
  with Checkpointer(tmp_path / "ckpt") as ckpt:
    ckpt.save(state)
    ckpt.wait()
    state.close()
    state, _ = ckpt.restore(factory, tx(None), zero, mesh)
  losses = []
  for batch in batches[3:]:
    state, metrics = zinfjax.train_step(state, batch, lm_loss)
    losses.append(float(metrics["loss"]))
  np.testing.assert_array_equal(np.concatenate([half, losses]), straight)
  state.close()
