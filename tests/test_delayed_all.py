"""ZeroConfig.delay_update="all" (ZeRO-Offload's delayed parameter update): every update the host
pipeline makes runs one step late, beside the next step's program. Checked against a plain
single-device AdamW that applies each step's grads one step later (clipped by their own step's
norm, a non-finite step's grads dropped), and through a checkpoint."""

import threading

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import zinfjax

from helpers import scalar_threads, text_batches, zero_training
from test_delayed import (DECAY, LR, STEPS, check_params, factory, reference_grads,
                          scaled_loss)


@pytest.fixture(scope="module")
def batches():
  return [dict(b, scale=np.ones((16,), np.float32))
          for b in text_batches(STEPS + 1, batch=16, seq=32, seed=11)]


def late_reference(batches, clip):
  """Losses and final params of plain AdamW on one device where each step's grads (of
  `scaled_loss`) are applied by the step after it; a step with a non-finite norm applies the
  grads held before it and holds none."""
  params, grads = reference_grads(scaled_loss, clip)
  adam = optax.adamw(LR, weight_decay=DECAY)

  @jax.jit
  def update(p, g, opt):
    u, opt = adam.update(g, opt, p)
    return optax.apply_updates(p, u), opt

  opt, held, losses = adam.init(params), None, []
  for batch in batches:
    value, g, finite = grads(params, batch)
    losses.append(float(value))
    if held is not None:
      params, opt = update(params, held, opt)
    held = g if bool(finite) else None
  return np.asarray(losses), params


# (params, optimizer, extra config, clip): grads in arrays, read after the program (with
# clipping, skip_nonfinite kept); every state in the RAM store, rewritten in place; NVMe, all
# or nothing, clipping every step
CASES = [("device", "pinned_host", dict(host_optimizer="pipeline"), 0.5),
         ("pinned_host", "pinned_host", dict(host_optimizer="pipeline"), None),
         ("nvme", "nvme", {}, 0.2)]


@pytest.mark.parametrize("param,optimizer,extra,clip", CASES)
def test_every_update_one_step_late_equals_the_reference(param, optimizer, extra, clip, mesh,
                                                         batches, tmp_path):
  if "nvme" in (param, optimizer):
    extra = dict(extra, nvme_path=str(tmp_path / "swap"))
  zero = zinfjax.ZeroConfig(precision="fp32", offload_param=param, offload_optimizer=optimizer,
                            delay_update="all", **extra)
  tx = zinfjax.optim.adamw(LR, weight_decay=DECAY, max_grad_norm=clip)
  feed = batches[:STEPS]
  losses, state = zero_training(factory, tx, zero, mesh, feed, scaled_loss)
  pipeline = state.engine.pipeline
  assert len(pipeline.tail) == len(pipeline.units)  # every sub-group waits a step
  want_losses, want = late_reference(feed, clip)
  np.testing.assert_allclose(losses, want_losses, rtol=1e-5)
  check_params(state, want)
  # nothing speculative: no step redone, whatever the norm
  before = dict(pipeline.held.grads)
  threads = scalar_threads(pipeline)
  state, metrics = zinfjax.train_step(state, batches[STEPS], scaled_loss)
  assert metrics.get("nvme_redone", 0) == 0
  # the held grads' memory serves again two steps later (no fresh pages each step): the same
  # host arrays, or in the RAM store the same half of each twin pair
  state, _ = zinfjax.train_step(state, batches[0], scaled_loss)
  assert all(a.ctypes.data == before[k].ctypes.data for k, a in pipeline.held.grads.items())
  # the held update's scalars and this step's are made before the program is dispatched
  assert threads == {threading.main_thread().name}
  # so does the memory of the new params put back on the device: the same buffers each step
  from zinfjax.putback import whole_buffers
  put_back = lambda: {a.ctypes.data: a for a in whole_buffers(pipeline._put_back())}
  before = put_back()
  assert bool(before) == (param == "device")
  state, _ = zinfjax.train_step(state, batches[1], scaled_loss)
  assert put_back().keys() == before.keys()
  # the host arrays kept between steps are what the memory count says (a RAM store keeps the
  # held grads and the new params in the twins of their keys instead: nothing copied out of
  # the store, nor into it)
  from zinfjax.autoplace import delayed_bytes
  from zinfjax.optim.pipeline import TWIN
  store = state.engine.store
  arrays = [a for a in [*pipeline.held.grads.values(), *pipeline._spare.values()] if a.base is None]
  arrays += list(before.values())
  twins = [store.entry(k)["nbytes"] for k in store.keys() if k.startswith(TWIN)]
  assert bool(twins) == (param == "pinned_host") and not (twins and arrays)
  kept = sum(a.nbytes for a in arrays) + sum(twins)
  count = delayed_bytes(state.engine.plan, zero.with_host_pipeline()) * len(pipeline.ranks)
  # but for the new params of the leaves outside the stack (embedding, final norm), made fresh:
  # the params array is made from them (on a CPU it may be their memory)
  plan = state.engine.plan
  fresh = (param == "device") * sum(l.local_size for l in plan.leaves if not l.stacked) * len(
      pipeline.ranks) * np.dtype(plan.dtype("params")).itemsize
  assert kept == count - fresh > 0
  state.close()


def masked_reference(batches, clip, late, loss_fn=scaled_loss, flush: bool = False):
  """Losses and final params of plain AdamW on one device whose entries `late(path, leaf)` marks
  take each step's grads one step late (each part with its own AdamW state, so its count is its
  own number of updates); with `flush`, the last step's held grads applied at the end."""
  params, grads = reference_grads(loss_fn, clip)
  adam = optax.adamw(LR, weight_decay=DECAY)
  mask = jax.tree_util.tree_map_with_path(late, params)
  where = lambda a, b: jax.tree.map(lambda m, x, y: jnp.where(m, x, y), mask, a, b)

  @jax.jit
  def update(p, g, opt):
    u, opt = adam.update(g, opt, p)
    return optax.apply_updates(p, u), opt

  now, later, held, losses = adam.init(params), adam.init(params), None, []
  for batch in batches:
    value, g, _ = grads(params, batch)
    losses.append(float(value))
    fresh, now = update(params, g, now)
    stale, later = update(params, held, later) if held is not None else (params, later)
    params = where(stale, fresh)
    held = g
  if flush:
    params = where(update(params, held, later)[0], params)
  return np.asarray(losses), params


def split_reference(batches, clip, first_late: int):
  """`late_reference` where only the stacked layers from `first_late` on are late: the other
  layers and the leaves outside the stack are updated by their own step."""
  def late(path, x):  # which entries of a leaf are late: the stack's layers >= first_late
    if "blocks" not in jax.tree_util.keystr(path):
      return np.zeros(x.shape, bool)
    return np.broadcast_to((np.arange(x.shape[0]) >= first_late).reshape(-1, *[1] * (x.ndim - 1)),
                           x.shape)

  return masked_reference(batches, clip, late)


def test_the_largest_runs_placement_one_step_late(mesh, batches, monkeypatch):
  """The largest run's placement with every host update one step late: every param on the
  device, the optimizer of the stack's first layers there too (updated by their own step, in
  the program) and of the rest in RAM's store (updated one step late by the host pipeline),
  with clipping: as a reference that delays only those layers. The held update's new params
  cross to the device between this step's grad reads, not all of them after the last."""
  from zinfjax import runner
  from zinfjax.putback import PutBack
  events: list[str] = []
  spy = lambda name, fn: lambda *a: (events.append(name), fn(*a))[1]
  monkeypatch.setattr(runner, "to_host", spy("read", runner.to_host))
  monkeypatch.setattr(PutBack, "_put", spy("put", PutBack._put))
  finish = PutBack.finish

  def finished(back, outs):  # logged once the puts on their way (on the put thread) are done
    back._wait()
    events.append("finish")
    return finish(back, outs)

  monkeypatch.setattr(PutBack, "finish", finished)
  zero = zinfjax.ZeroConfig(precision="fp32", offload_param="device",
                            offload_optimizer="device:1,pinned_host", host_optimizer="pipeline",
                            delay_update="all")
  tx = zinfjax.optim.adamw(LR, weight_decay=DECAY, max_grad_norm=0.5)
  feed = batches[:STEPS]
  losses, state = zero_training(factory, tx, zero, mesh, feed, scaled_loss)
  steps = " ".join(events).split("finish")[:-1]
  assert len(steps) == STEPS and "put" not in steps[0]  # the first step holds no update yet
  for step in (s.split() for s in steps[1:]):  # puts between the reads, none left for finish
    assert step[0] == "read" and step.index("put") < len(step) - 1 - step[::-1].index("read")
    assert step.count("put") == 3 * sum(l.stacked for l in state.engine.plan.leaves)
  assert {(p.layer, p.leaf) for u in state.engine.pipeline.units for p in u.parts} == {
      (layer, l.index) for l in state.engine.plan.leaves if l.stacked for layer in (1, 2, 3)}
  want_losses, want = split_reference(feed, 0.5, first_late=1)
  np.testing.assert_allclose(losses, want_losses, rtol=1e-5)
  check_params(state, want)
  # the reference tells the split apart from the whole stack late, or none of it
  for other in (0, 4):
    assert not np.allclose(split_reference(feed, 0.5, other)[0], want_losses, rtol=1e-5)
  state.close()


def test_a_skipped_step_drops_its_own_grads(mesh, batches):
  """A step with NaN grads applies the grads held before it (they stand) and holds none; the
  run goes on as the reference with that step's grads dropped."""
  feed = batches[:2] + [dict(batches[2], scale=np.full((16,), np.nan, np.float32))] + batches[3:5]
  zero = zinfjax.ZeroConfig(precision="fp32", offload_param="pinned_host",
                            offload_optimizer="pinned_host", host_optimizer="pipeline",
                            delay_update="all")
  tx = zinfjax.optim.adamw(LR, weight_decay=DECAY)
  losses, state = zero_training(factory, tx, zero, mesh, feed, scaled_loss)
  want_losses, want = late_reference(feed, None)
  assert np.isnan(losses[2]) and np.isnan(want_losses[2])
  np.testing.assert_allclose(np.delete(losses, 2), np.delete(want_losses, 2), rtol=1e-5)
  check_params(state, want)
  state.close()


def test_checkpoints_keep_every_held_grad(mesh, batches, tmp_path):
  """Saved with every layer's grads held (the stacked leaves' too), restored under the same delay
  on another placement: the rest of the run equals the run that never stopped, bit for bit."""
  from zinfjax.checkpoint import Checkpointer
  tx = zinfjax.optim.adamw(LR, weight_decay=DECAY)
  nvme = zinfjax.ZeroConfig(precision="fp32", offload_param="nvme", offload_optimizer="nvme",
                            delay_update="all", nvme_path=str(tmp_path / "a"))
  feed = batches[:STEPS]
  straight, _ = zero_training(factory, tx, nvme, mesh, feed, scaled_loss)
  half, state = zero_training(factory, tx, nvme.replace(nvme_path=str(tmp_path / "b")), mesh,
                              feed[:3], scaled_loss)
  again = zinfjax.ZeroConfig(precision="fp32", offload_param="pinned_host",
                             offload_optimizer="pinned_host", host_optimizer="pipeline",
                             delay_update="all")
  # what the checkpoint saves is a copy: the pipeline reuses its arrays while a save runs
  from zinfjax.checkpoint.held import held_leaves
  mine = list(state.engine.pipeline.held.grads.values())
  saved = [np.asarray(s.data) for leaf in held_leaves(state)[0]
           for s in leaf.sources[0].array.addressable_shards]
  assert not any(np.shares_memory(a, b) for a in saved for b in mine)
  with Checkpointer(tmp_path / "ckpt") as ckpt:
    ckpt.save(state)
    ckpt.wait()
    meta = ckpt.metadata()
    assert meta["held"]["count"] == 2
    assert meta["held"]["layers"]["blocks/block/fc/kernel"] == [0, 1, 2, 3]
    state.close()
    state, _ = ckpt.restore(factory, tx, again, mesh)
  assert state.engine.pipeline.held is not None
  losses = []
  for batch in feed[3:]:
    state, metrics = zinfjax.train_step(state, batch, scaled_loss)
    losses.append(float(metrics["loss"]))
  state.close()
  np.testing.assert_array_equal(np.concatenate([half, losses]), straight)


def test_which_held_grads_a_run_restores(mesh):
  """A run restores held grads saved for the layers it delays, and those of a checkpoint written
  before the layers were recorded (the tail's whole leaves); none saved for other layers."""
  from zinfjax.checkpoint.held import PREFIX, held_targets
  tail = ["ln_f/bias", "ln_f/scale", "wpe/embedding", "wte/embedding"]
  zero = zinfjax.ZeroConfig(precision="fp32", offload_param="pinned_host",
                            offload_optimizer="pinned_host", host_optimizer="pipeline")
  engine = zinfjax.init(factory, zinfjax.optim.adamw(LR), zero.replace(delay_update="tail"),
                        mesh).engine
  leaves = {PREFIX + n: {} for n in tail}
  older = {"held": {"count": 1, "norm": None}, "leaves": leaves}
  assert sorted(t.plan.name for t in held_targets(engine, older)) == tail
  now = {"held": {"count": 1, "norm": None, "layers": {n: [0] for n in tail}}, "leaves": leaves}
  assert len(held_targets(engine, now)) == 4
  every = zinfjax.init(factory, zinfjax.optim.adamw(LR), zero.replace(delay_update="all"),
                       mesh).engine
  assert held_targets(every, now) == [] and held_targets(every, older) == []
