"""ZeroConfig.delay_update: "tail", the leaves outside the stacks (here wte, wpe, ln_f), or "all",
every leaf, updated one step late by the host pipeline, with their own step's count and
clipping. Checked against a plain single-device reference that applies each step's grads of
those leaves one step later."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import zinfjax
from zinfjax.models import GPT, get_config, lm_loss

from helpers import text_batches, zero_training

FOUR = get_config("tiny", num_layers=4)
STEPS = 5
LR, DECAY = 3e-3, 0.1


def factory(r):
  return GPT(FOUR, rngs=r)


@pytest.fixture(scope="module")
def batches():
  return text_batches(STEPS, batch=16, seq=32, seed=7)


def reference_grads(loss_fn, clip):
  """The model's initial params (a pure dict), and a jitted `grads(params, batch) -> (loss,
  grads clipped to `clip` by their global norm, whether that norm is finite)` on one device."""
  graphdef, state = nnx.split(factory(nnx.Rngs(jax.random.key(0))))

  @jax.jit
  def grads(p, batch):
    def loss(p):
      s = jax.tree.map(lambda x: x, state)
      nnx.replace_by_pure_dict(s, p)
      return loss_fn(nnx.merge(graphdef, s), batch)
    value, g = jax.value_and_grad(loss)(p)
    norm = optax.tree.norm(g)
    if clip is not None:
      g = jax.tree.map(lambda x: jnp.where(norm < clip, x, x / norm * clip), g)
    return value, g, jnp.isfinite(norm)

  return nnx.to_pure_dict(state), grads


def check_params(state, want) -> None:
  """8 ranks against one device round differently, and AdamW turns a rounding-level grad
  difference into up to a step (lr) for a param whose grad is near zero: every param is held
  to 1% of a step but for 1 in 10,000 at most (such near-zero grads, whose count depends on
  the CPU's vector width), and those to the steps taken."""
  got = flat(state.full_params())
  for name, expected in flat(want).items():
    expected = np.asarray(expected)
    diff = np.abs(np.asarray(got[name]) - expected)
    loose = diff > 1e-2 * LR + 1e-4 * np.abs(expected)
    assert loose.mean() <= 1e-4, f"{name}: {loose.sum()} of {loose.size} off by over 1% of a step"
    assert diff.max() <= STEPS * LR, f"{name}: off by {diff.max():.3g}, over {STEPS} steps"


def delayed_reference(batches, clip):
  """Losses and final params of plain AdamW on one device where the grads of the leaves
  outside `blocks` reach their update one step late (each clipped by its own step's norm)."""
  params, grads = reference_grads(lm_loss, clip)
  adam = optax.adamw(LR, weight_decay=DECAY)
  split = lambda p: ({"blocks": p["blocks"]}, {k: v for k, v in p.items() if k != "blocks"})

  def update(p, g, opt):
    u, opt = adam.update(g, opt, p)
    return optax.apply_updates(p, u), opt

  stack, tail = split(params)
  opt_stack, opt_tail, held, losses = adam.init(stack), adam.init(tail), None, []
  for batch in batches:
    value, g, _ = grads({**stack, **tail}, batch)
    losses.append(float(value))
    stack, opt_stack = update(stack, split(g)[0], opt_stack)
    if held is not None:
      tail, opt_tail = update(tail, held, opt_tail)
    held = split(g)[1]
  return np.asarray(losses), {**stack, **tail}


def flat(tree) -> dict[str, np.ndarray]:
  return {jax.tree_util.keystr(k): np.asarray(v) for k, v in jax.tree_util.tree_leaves_with_path(tree)}


# (params, optimizer, extra config, clip): the host pipeline after the program (grads in
# arrays), under backward with the params in the store (their tail written after the program),
# NVMe under backward with all-or-nothing steps, clipping every step; RAM and the drive under
# backward, rewritten in place (the RAM shards, the tail's among them, updated where they lie)
CASES = [("device", "pinned_host", dict(host_optimizer="pipeline"), None),
         ("pinned_host", "pinned_host", dict(host_optimizer="pipeline", skip_nonfinite=False), None),
         ("nvme", "nvme", {}, 0.5),
         ("pinned_host:2,nvme", "pinned_host:2,nvme",
          dict(host_optimizer="pipeline", skip_nonfinite=False, nvme_atomic_steps=False), None)]


@pytest.mark.parametrize("param,optimizer,extra,clip", CASES)
def test_delayed_tail_update_equals_the_reference(param, optimizer, extra, clip, mesh, batches,
                                                  tmp_path):
  if any("nvme" in tier for tier in (param, optimizer)):
    extra = dict(extra, nvme_path=str(tmp_path / "swap"))
  zero = zinfjax.ZeroConfig(precision="fp32", offload_param=param, offload_optimizer=optimizer,
                            delay_update="tail", **extra)
  tx = zinfjax.optim.adamw(LR, weight_decay=DECAY, max_grad_norm=clip)
  losses, state = zero_training(factory, tx, zero, mesh, batches, lm_loss)
  pipeline = state.engine.pipeline
  tail = {state.engine.plan.leaves[p.leaf].name for u in pipeline.tail for p in u.parts}
  assert tail == {"wte/embedding", "wpe/embedding", "ln_f/bias", "ln_f/scale"}
  want_losses, want = delayed_reference(batches, clip)
  np.testing.assert_allclose(losses, want_losses, rtol=1e-5)
  check_params(state, want)
  # where the params are in the store, the tail's new ones were written there (once backward
  # was past them)
  in_store = any(pipeline.on_store("params", p) for u in pipeline.tail for p in u.parts)
  assert in_store == (param != "device")
  # one more step: under backward where the grads go to the store (redone or predicted where it
  # clipped), after the program where they are arrays
  state, metrics = zinfjax.train_step(state, batches[0], lm_loss)
  assert ("nvme_grad_waits" in metrics) == (param != "device")
  state.close()
  # without the delay the same run differs from the second step on
  plain, state = zero_training(factory, tx, zero.replace(delay_update="none"), mesh,
                               batches[:3], lm_loss)
  state.close()
  assert plain[0] == pytest.approx(losses[0], rel=1e-6)
  assert abs(plain[2] - losses[2]) > 1e-5


def test_delay_update_needs_the_host_pipeline(mesh):
  """A delay (or all-or-nothing RAM steps) with the optimizer in pinned host settles
  host_optimizer="auto" to the pipeline, the one that does it, on any platform; another
  optimizer named outright is refused."""
  from zinfjax.engine import build_engine
  tx = zinfjax.optim.adamw(LR)
  for delay in ("tail", "all"):
    with pytest.raises(ValueError, match=f"delay_update='{delay}'.*offload_optimizer='nvme'"):
      zinfjax.init(factory, tx, zinfjax.ZeroConfig(offload_optimizer="pinned_host",
                                                   host_optimizer="xla", delay_update=delay), mesh)
  # NVMe named, but the splits before it take all 4 layers: no state there to delay
  with pytest.raises(ValueError, match=r"names NVMe, but its splits take every layer"):
    build_engine(factory, tx, zinfjax.ZeroConfig(
        offload_optimizer="device:2,pinned_host:2,nvme", host_optimizer="xla",
        delay_update="tail", nvme_path="/nonexistent/unused"), mesh, open_store_=False)
  with pytest.raises(ValueError, match="host_atomic_steps=True .* host_optimizer='xla'"):
    zinfjax.ZeroConfig(host_optimizer="xla", host_atomic_steps=True)
  host = zinfjax.ZeroConfig(offload_optimizer="pinned_host")
  for asks in (dict(delay_update="all"), dict(host_atomic_steps=True), {}):
    engine = build_engine(factory, tx, host.replace(**asks), mesh, open_store_=False)
    assert engine.plan.optimizer_in_store == bool(asks), asks
    assert engine.config.host_optimizer == ("pipeline" if asks else "xla"), asks
  with pytest.raises(ValueError, match="delay_update must be 'none', 'tail' or 'all'"):
    zinfjax.ZeroConfig(delay_update=True)


def scaled_loss(model, batch):
  """The LM loss times the batch's `scale` (NaN: every gradient is NaN)."""
  return lm_loss(model, batch) * batch["scale"][0]


@pytest.mark.parametrize("param,optimizer,extra", [
    ("nvme", "nvme", {}), ("device", "pinned_host", dict(host_optimizer="pipeline"))])
def test_a_skipped_step_keeps_the_held_grads(param, optimizer, extra, mesh, batches, tmp_path):
  """A step with NaN grads is skipped whole: the held grads of the step before it are applied by
  the step after it instead, so the run goes on exactly as if the NaN step had not been taken
  (on NVMe the skipped step had applied them under backward and is rolled back)."""
  good = [dict(b, scale=np.ones((16,), np.float32)) for b in batches[:4]]
  bad = dict(good[0], scale=np.full((16,), np.nan, np.float32))
  tx = zinfjax.optim.adamw(LR, weight_decay=DECAY)
  runs = []
  for with_nan in (False, True):
    if "nvme" in (param, optimizer):
      extra = dict(extra, nvme_path=str(tmp_path / f"swap{with_nan}"))
    zero = zinfjax.ZeroConfig(precision="fp32", offload_param=param, offload_optimizer=optimizer,
                              delay_update="tail", **extra)
    feed = good[:2] + [bad] + good[2:] if with_nan else good
    losses, state = zero_training(factory, tx, zero, mesh, feed, scaled_loss)
    runs.append((np.delete(losses, 2) if with_nan else losses, flat(state.full_params())))
    state.close()
  (losses, params), (nan_losses, nan_params) = runs
  np.testing.assert_array_equal(nan_losses, losses)
  for name, value in params.items():
    np.testing.assert_array_equal(nan_params[name], value, err_msg=name)


@pytest.mark.parametrize("restore_as", ["nvme", "pipeline", "device"])
def test_checkpoints_keep_the_held_grads(restore_as, mesh, batches, tmp_path):
  """Saved on NVMe with grads held, restored under the delay (on NVMe, or under the host
  pipeline): the rest of the run equals the run that never stopped, bit for bit. Restored
  without the delay (optimizer on the device), the held grads are left out, with a warning."""
  from zinfjax.checkpoint import Checkpointer
  tx = zinfjax.optim.adamw(LR, weight_decay=DECAY)
  nvme = zinfjax.ZeroConfig(precision="fp32", offload_param="nvme", offload_optimizer="nvme",
                            delay_update="tail", nvme_path=str(tmp_path / "a"))
  straight, _ = zero_training(factory, tx, nvme, mesh, batches, lm_loss)
  half, state = zero_training(factory, tx, nvme.replace(nvme_path=str(tmp_path / "b")), mesh,
                              batches[:3], lm_loss)
  again = {"nvme": nvme.replace(nvme_path=str(tmp_path / "c")),
           "pipeline": zinfjax.ZeroConfig(precision="fp32", offload_param="pinned_host",
                                          offload_optimizer="pinned_host",
                                          host_optimizer="pipeline", delay_update="tail"),
           "device": zinfjax.ZeroConfig(precision="fp32")}[restore_as]
  with Checkpointer(tmp_path / "ckpt") as ckpt:
    ckpt.save(state)
    ckpt.wait()
    assert ckpt.metadata()["held"]["count"] == 2  # the third step's grads (count 2 before it)
    state.close()
    with warnings.catch_warnings(record=True) as caught:
      warnings.simplefilter("always")
      state, _ = ckpt.restore(factory, tx, again, mesh)
  dropped = [w for w in caught if "are dropped" in str(w.message)]
  assert len(dropped) == (restore_as == "device"), [str(w.message) for w in caught]
  pipeline = state.engine.pipeline
  assert (pipeline is not None and pipeline.held is not None) == (restore_as != "device")
  losses = []
  for batch in batches[3:]:
    state, metrics = zinfjax.train_step(state, batch, lm_loss)
    losses.append(float(metrics["loss"]))
  state.close()
  if restore_as == "device":  # the same params; then the tail trains on without the delay
    np.testing.assert_allclose(losses[0], straight[3], rtol=1e-5)
    assert np.isfinite(losses).all() and losses[-1] != straight[-1]
  else:
    np.testing.assert_array_equal(np.concatenate([half, losses]), straight)


def test_held_grads_restore_onto_another_device_count(mesh, batches, tmp_path):
  """Held grads saved from 8 devices come back, the same values, on 4 (resharded like every
  other leaf)."""
  from zinfjax.checkpoint import Checkpointer
  from zinfjax.shards import from_host_shards

  def joined(state) -> dict[str, np.ndarray]:
    engine = state.engine
    out = {}
    for leaf in {engine.plan.leaves[p.leaf] for u in engine.pipeline.tail for p in u.parts}:
      shards = {r: engine.pipeline.held.grads[(leaf.index, r, 0)] for r in engine.plan.ranks}
      whole = np.asarray(from_host_shards(shards, engine.plan.sharding(leaf, "device"),
                                          leaf.layout.storage_shape))
      out[leaf.name] = whole[tuple(slice(0, n) for n in leaf.layout.shape)]
    return out

  tx = zinfjax.optim.adamw(LR, weight_decay=DECAY)
  zero = zinfjax.ZeroConfig(precision="fp32", offload_param="pinned_host",
                            offload_optimizer="pinned_host", host_optimizer="pipeline",
                            delay_update="tail")
  _, state = zero_training(factory, tx, zero, mesh, batches[:2], lm_loss)
  saved = joined(state)
  with Checkpointer(tmp_path / "ckpt") as ckpt:
    ckpt.save(state)
    ckpt.wait()
    state.close()
    state, _ = ckpt.restore(factory, tx, zero, zinfjax.make_mesh(4))
  assert state.engine.dp == 4
  restored = joined(state)
  assert set(restored) == set(saved) == {"wte/embedding", "wpe/embedding", "ln_f/bias", "ln_f/scale"}
  for name, value in saved.items():
    np.testing.assert_array_equal(restored[name], value, err_msg=name)
  state, metrics = zinfjax.train_step(state, batches[2], lm_loss)
  assert np.isfinite(float(metrics["loss"]))
  state.close()
