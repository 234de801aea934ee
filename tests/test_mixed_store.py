"""host_optimizer="pipeline" with states on NVMe as well: the pinned-host shards in the swap store
in host RAM, the NVMe ones in the drive's, one host pipeline over both. It trains bit for bit
like the same placement under the XLA host update, each shard is in the store of its tier, a
skipped or failed step leaves both stores as they were, and checkpoints restore from it."""

import numpy as np
import pytest

import zinfjax
from zinfjax.checkpoint import Checkpointer
from zinfjax.models import lm_loss
from zinfjax.offload import AioStore
from zinfjax.offload.mixed import MixedStore, used_by_medium
from zinfjax.placement import Tier

from helpers import (assert_same_training, clipped_adamw, four_layer_gpt, skipped_step,
                     text_batches, zero_training)

STEPS = 5
factory, tx = four_layer_gpt, clipped_adamw


@pytest.fixture(scope="module")
def batches():
  return text_batches(STEPS, batch=16, seq=32, seed=5)


def assert_routed(state) -> None:
  """Every shard lies in the store of its tier, and both stores hold some."""
  store, plan = state.engine.store, state.engine.plan
  assert isinstance(store, MixedStore)
  for tier in (Tier.HOST_STORE, Tier.NVME):
    keys = store.stores[tier].keys()
    assert keys and {plan.key_tier(k) for k in keys} == {tier}
  assert store.stores[Tier.HOST_STORE].memory and not store.stores[Tier.NVME].memory
  used = used_by_medium(store)
  assert used[Tier.PINNED_HOST] > 0 and used[Tier.NVME] > 0


def streamed_bytes(plan) -> int:
  """Bytes the host pipeline reads in one step through its buffers: the master params,
  moments and grads its layers keep on the drive (the RAM store's are used where they lie)."""
  total = 0
  for leaf in plan.leaves:
    for layer in range(leaf.num_layers):
      if leaf.tier("master", layer).holds_arrays:
        continue  # updated on the device, not by the pipeline
      n = leaf.local_size * len(plan.ranks)
      total += n * (4 + 2 * plan.dtype("mu").itemsize) * (leaf.tier("master", layer) == Tier.NVME)
      total += n * plan.dtype("params").itemsize * (leaf.tier("grads", layer) == Tier.NVME)
  return total


# (params, optimizer, precision, clip, skip, atomic): params and grads in RAM with the optimizer
# on the drive; both stores holding params and optimizer states, per layer; the same rewritten
# in place, the RAM shards updated where they lie while the drive's stream
CASES = [("pinned_host", "nvme", "fp32", 0.5, True, True),
         ("pinned_host:2,nvme", "device:1,pinned_host:1,nvme", "bf16", None, False, True),
         ("pinned_host:2,nvme", "pinned_host:2,nvme", "fp32", None, False, False),
         # params of two layers on the device, their new params put back as they are made
         # once the step stands (the update under backward redone, or its norm predicted)
         ("device:2,pinned_host", "pinned_host:2,nvme", "fp32", 0.5, True, True)]


@pytest.mark.parametrize("param,optimizer,precision,clip,skip,atomic", CASES)
def test_mixed_store_trains_bit_for_bit_like_xla(param, optimizer, precision, clip, skip, atomic,
                                                 mesh, batches, tmp_path):
  zero = zinfjax.ZeroConfig(precision=precision, offload_param=param, offload_optimizer=optimizer,
                            skip_nonfinite=skip, nvme_path=str(tmp_path),
                            nvme_atomic_steps=atomic)
  xla_losses, xla = zero_training(factory, tx(clip), zero.replace(nvme_path=str(tmp_path / "x")),
                                  mesh, batches, lm_loss)
  state = zinfjax.init(factory, tx(clip), zero.replace(nvme_path=str(tmp_path / "p"),
                                                       host_optimizer="pipeline"), mesh, 0)
  assert_routed(state)
  losses = []
  for batch in batches:
    state, metrics = zinfjax.train_step(state, batch, lm_loss)
    losses.append(float(metrics["loss"]))
    # backward writes the grads into the stores and the pipeline updates beside the program
    assert "nvme_grad_waits" in metrics
  # only the drive's shards go through the pipeline's buffers: the RAM ones are updated where
  # they lie, or in an all-or-nothing step read from the committed copy into the new one
  read = state.engine.pipeline.last_step["bytes_read"]
  assert read == streamed_bytes(state.engine.plan) > 0
  assert losses[-1] < losses[0]
  # with clipping, to 1e-5: the global norm's sum runs in another order with the grads in a
  # store, not in arrays
  assert_same_training(losses, state, xla_losses, xla, rtol=0.0 if clip is None else 1e-5)
  assert not state.engine.store.in_transaction
  state.close()
  xla.close()


@pytest.mark.parametrize("param", ["pinned_host:2,nvme", "device:2,pinned_host"])
def test_a_skipped_step_leaves_both_stores_as_they_were(param, mesh, batches, tmp_path,
                                                        monkeypatch):
  """Clipping on every step (the update under backward redone) and a NaN step: the NaN step
  changes nothing in RAM, on the drive or on the device, and the run equals the one without
  it. With params on the device, the new params of a step that stands go back to it during
  the update; those of a guess that is redone or skipped never do."""
  from zinfjax import runner
  from zinfjax.putback import PutBack
  made = []  # per step: the layers put back during the update
  monkeypatch.setattr(runner, "PutBack", type("Counted", (PutBack,), {
      "finish": lambda self, outs: (made.append(self.returned), PutBack.finish(self, outs))[1]}))
  zero = zinfjax.ZeroConfig(offload_param=param, offload_optimizer="pinned_host:2,nvme",
                            host_optimizer="pipeline", nvme_path=str(tmp_path))
  scaled = lambda model, batch: lm_loss(model, batch) * batch["scale"][0]
  good = [dict(b, scale=np.ones((16,), np.float32)) for b in batches]
  bad = dict(good[1], scale=np.full((16,), np.nan, np.float32))
  want_losses, want = zero_training(factory, tx(0.5), zero.replace(nvme_path=str(tmp_path / "a")),
                                    mesh, good, scaled)
  state = zinfjax.init(factory, tx(0.5), zero.replace(nvme_path=str(tmp_path / "b")), mesh, 0)
  losses, redone = [], 0
  for i, batch in enumerate(good):
    if i == 2:
      state = skipped_step(state, bad, scaled)
    state, metrics = zinfjax.train_step(state, batch, scaled)
    losses.append(float(metrics["loss"]))
    redone += metrics["nvme_redone"]
  assert_same_training(losses, state, want_losses, want)
  # (leaf, layer) pairs on the device, each put back during every update that stood (the
  # reference's steps, then this run's), none in the NaN step; the first step's guess redone
  plan = state.engine.plan
  device = sum(leaf.tier("params", l) is Tier.DEVICE for leaf in plan.leaves
               for l in range(leaf.num_layers))
  assert redone > 0 and (device > 0) == param.startswith("device"), (redone, device)
  assert made == [device] * (STEPS + 2) + [0] + [device] * (STEPS - 2), (made, device)
  state.close()
  want.close()


@pytest.mark.parametrize("fault_after", [20, 100])
def test_a_failed_step_gives_back_the_staged_ram_copies(fault_after, mesh, batches, tmp_path):
  """A write fault on the drive after the RAM layers' update (under backward: RAM holds the
  last layers, which backward reaches first) fails the step with the engine's error, while
  backward still writes grads (20) or while the drive's layers update (100); the RAM states
  were already rewritten into the step's new copies (`stage`), and both stores then hold every
  param and optimizer state as before the step."""
  zero = zinfjax.ZeroConfig(precision="fp32", offload_param="nvme:2,pinned_host",
                            offload_optimizer="nvme:2,pinned_host", host_optimizer="pipeline",
                            nvme_path=str(tmp_path))
  state = zinfjax.init(factory, tx(None), zero, mesh, 0)
  state, _ = zinfjax.train_step(state, batches[0], lm_loss)
  store = state.engine.store
  ram, drive = store.stores[Tier.HOST_STORE], store.stores[Tier.NVME]
  staged, stage = [], ram.stage
  ram.stage = lambda key: (staged.append(key), stage(key))[1]
  snapshot = lambda: {k: store.read(k).wait().tobytes() for k in store.keys()
                      if k.startswith(("p/", "o/"))}
  before = snapshot()
  drive.engine.set_fault_after_writes(fault_after)
  with pytest.raises(Exception, match="injected write fault"):
    zinfjax.train_step(state, batches[1], lm_loss)
  drive.engine.set_fault_after_writes(-1)
  assert {k.split("/")[1] for k in staged} >= {"master", "m", "v"}  # RAM's new copies were made
  after = snapshot()
  assert before.keys() == after.keys()
  changed = [k for k in before if after[k] != before[k]]
  assert not changed, changed[:5]
  assert not store.in_transaction
  state.close()


@pytest.mark.parametrize("target", ["device", "mixed"])
def test_checkpoints_of_the_mixed_store_restore(target, mesh, batches, tmp_path):
  """Saved from both stores, restored with every state on the device or into another split of
  RAM and the drive: the rest of the run equals the mixed run that never stopped (the same
  update, to fp32 tolerance)."""
  zero = zinfjax.ZeroConfig(precision="fp32", offload_param="pinned_host:2,nvme",
                            offload_optimizer="pinned_host:1,nvme", host_optimizer="pipeline",
                            nvme_path=str(tmp_path / "swap"))
  straight, done = zero_training(factory, tx(0.5), zero, mesh, batches, lm_loss)
  done.close()
  half, state = zero_training(factory, tx(0.5), zero, mesh, batches[:2], lm_loss)
  with Checkpointer(tmp_path / "ckpt") as ckpt:
    ckpt.save(state)
    ckpt.wait()
    state.close()
    other = zero.replace(offload_param="pinned_host:1,nvme", offload_optimizer="nvme:1,pinned_host",
                         nvme_path=str(tmp_path / "other"))
    state, _ = ckpt.restore(factory, tx(0.5), zinfjax.ZeroConfig(precision="fp32")
                            if target == "device" else other, mesh)
    assert (target == "device") == (state.engine.store is None)
  losses = []
  for batch in batches[2:]:
    state, metrics = zinfjax.train_step(state, batch, lm_loss)
    losses.append(float(metrics["loss"]))
  np.testing.assert_allclose(np.concatenate([half, losses]), straight, rtol=1e-5)


def test_mixed_store_splits_calls_and_transactions(tmp_path):
  """Keys go to the store their tier names; a many-key call is split and rejoined in order; one
  transaction spans both stores (a rollback undoes RAM and drive alike)."""
  stores = {Tier.HOST_STORE: AioStore([], memory=True), Tier.NVME: AioStore(tmp_path, fresh=True)}
  store = MixedStore(stores, lambda key: Tier.HOST_STORE if key.startswith("p/") else Tier.NVME)
  rng = np.random.default_rng(0)
  xs = {k: rng.standard_normal((4, 3)).astype(np.float32) for k in ("p/a", "o/b", "p/c", "o/d")}
  store.write_many(list(xs.items())).wait()
  assert sorted(stores[Tier.HOST_STORE].keys()) == ["p/a", "p/c"]
  assert sorted(stores[Tier.NVME].keys()) == ["o/b", "o/d"]
  outs = store.read_many([(k, np.empty((4, 3), np.float32)) for k in xs]).wait()
  for out, want in zip(outs, xs.values()):
    np.testing.assert_array_equal(out, want)
  store.begin(["p/", "o/"])
  store.write_many([(k, np.zeros((4, 3), np.float32)) for k in xs]).wait()
  assert store.in_transaction
  store.rollback()
  assert not store.in_transaction
  for k, want in xs.items():
    np.testing.assert_array_equal(store.read(k).wait(), want)
  store.close()
