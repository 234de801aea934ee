"""Frozen params and LoRA on every tier (`ZeroConfig.trainable`): only the trained leaves carry
grads, an fp32 master and optimizer state; training matches nnx.Optimizer(wrt=...)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import zinfjax
from zinfjax.checkpoint import Checkpointer, master_params

from placements import placed


class Block(nnx.Module):
  def __init__(self, rngs):
    self.a = nnx.LoRALinear(16, 32, lora_rank=4, rngs=rngs)
    self.b = nnx.LoRALinear(32, 16, lora_rank=4, rngs=rngs)

  def __call__(self, x):
    return x + self.b(jnp.tanh(self.a(x)))


class Model(nnx.Module):
  def __init__(self, rngs):
    self.inp = nnx.Linear(4, 16, rngs=rngs)
    self.stack = zinfjax.Stack(lambda r: Block(r), 3, rngs=rngs)
    self.head = nnx.LoRALinear(16, 8, lora_rank=2, rngs=rngs)

  def __call__(self, x):
    return self.head(self.stack(self.inp(x)))


class PlainModel(Model):
  """`Model` without its LoRA adapters."""

  def __init__(self, rngs):
    super().__init__(rngs)
    self.head = nnx.Linear(16, 8, rngs=rngs)
    self.stack = zinfjax.Stack(lambda r: PlainBlock(r), 3, rngs=rngs)


class PlainBlock(Block):
  def __init__(self, rngs):
    self.a = nnx.Linear(16, 32, rngs=rngs)
    self.b = nnx.Linear(32, 16, rngs=rngs)


def loss_fn(model, batch):
  return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)


def batches(n=3, seed=0):
  rng = np.random.default_rng(seed)
  return [{"x": rng.normal(size=(8, 5, 4)).astype(np.float32),
           "y": rng.normal(size=(8, 5, 8)).astype(np.float32)} for _ in range(n)]


def _zero(placement):
  return placement.zero(trainable=nnx.LoRAParam)


def _tx(placement):
  return optax.adam(1e-2) if placement.states_on_device else zinfjax.optim.adam(1e-2)


def _diff(a, b) -> float:
  return max(float(jnp.max(jnp.abs(x - y))) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def test_lora_matches_flax_on_every_tier(placement, mesh):
  """LoRA adapters over a frozen base (every ZeRO-3 placement of tests/placements.py) train like
  nnx.Optimizer(wrt=nnx.LoRAParam): losses rtol 1e-6, params 1e-6; the base never moves."""
  state = zinfjax.init(Model, _tx(placement), _zero(placement), mesh, rng=0)
  ref = Model(nnx.Rngs(0))
  start = nnx.to_pure_dict(nnx.state(ref))
  opt = nnx.Optimizer(ref, optax.adam(1e-2), wrt=nnx.LoRAParam)
  for b in batches():
    state, metrics = zinfjax.train_step(state, b, loss_fn)
    loss, grads = nnx.value_and_grad(loss_fn, argnums=nnx.DiffState(0, nnx.LoRAParam))(ref, b)
    opt.update(ref, grads)
    np.testing.assert_allclose(float(metrics["loss"]), float(loss), rtol=1e-6)
  got = state.full_params()
  assert _diff(got, nnx.to_pure_dict(nnx.state(ref))) < 1e-6
  assert _diff(got["stack"]["block"]["a"]["kernel"], start["stack"]["block"]["a"]["kernel"]) == 0
  assert _diff(got["stack"]["block"]["a"]["lora"]["lora_b"],
               start["stack"]["block"]["a"]["lora"]["lora_b"]) > 1e-3
  state.close()


def test_frozen_leaves_hold_no_grads_master_or_moments(mesh, tmp_path):
  """Memory per tier: frozen leaves keep their params only (no grads, master, moments), and the
  swap store holds exactly the plan's bytes."""
  nvme = placed("nvme", tmp_path)
  state = zinfjax.init(Model, _tx(nvme), _zero(nvme), mesh, rng=0)
  plan = state.engine.plan
  frozen = [l for l in plan.leaves if not l.trainable]
  lora = [l for l in plan.leaves if l.trainable]
  assert {l.name.rsplit("/", 1)[-1] for l in lora} == {"lora_a", "lora_b"}
  assert {l.name.rsplit("/", 1)[-1] for l in frozen} == {"kernel", "bias"}
  for leaf in frozen:
    assert leaf.optimizer == () and leaf.segments("grads") == ()
  item = 4
  per_layer = lambda ls: sum(l.local_size * l.num_layers for l in ls)
  want = per_layer(frozen) * item + per_layer(lora) * (2 * item + 12)
  assert plan.tier_bytes()["nvme"] == want
  keys = state.engine.store.keys()
  for leaf in frozen:   # in the swap store: the frozen leaves' params, nothing else
    assert any(k.startswith(leaf.base_key("params")) for k in keys)
    assert not any(k.startswith(leaf.base_key(s)) for s in ("grads", "master", "mu", "nu")
                   for k in keys)
  for leaf in lora:
    assert all(any(k.startswith(leaf.base_key(s)) for k in keys) for s in ("master", "mu", "nu"))
  everything = zinfjax.abstract_init(Model, _tx(nvme), zinfjax.ZeroConfig(
      precision="fp32", offload_param="nvme", offload_optimizer="nvme",
      nvme_path=str(tmp_path / "unused")), mesh)
  assert everything.engine.plan.tier_bytes()["nvme"] == per_layer(plan.leaves) * (2 * item + 12)
  state.close()


def test_lora_checkpoint_restores_onto_another_placement(mesh, tmp_path):
  """A LoRA run's checkpoint (frozen base stored as its params) restores onto another placement
  and device count and continues with the same losses as the run that saved it."""
  data = batches(4, seed=2)
  split, pinned = placed("split", tmp_path), placed("pinned", tmp_path)
  state = zinfjax.init(Model, _tx(split), _zero(split), mesh, rng=1)
  for b in data[:2]:
    state, _ = zinfjax.train_step(state, b, loss_fn)
  ckpt = Checkpointer(str(tmp_path / "ckpt"))
  ckpt.save(state)
  ckpt.wait()
  saved = state.full_params()
  consolidated = dict(master_params(str(tmp_path / "ckpt")))   # frozen leaves included
  assert set(consolidated) == {l.name for l in state.engine.plan.leaves}
  np.testing.assert_array_equal(consolidated["stack/block/a/kernel"],
                                saved["stack"]["block"]["a"]["kernel"])
  expect = []
  for b in data[2:]:
    state, m = zinfjax.train_step(state, b, loss_fn)
    expect.append(float(m["loss"]))
  state.close()
  other = zinfjax.make_mesh(4)
  restored, _ = ckpt.restore(Model, _tx(pinned), _zero(pinned), other)
  assert _diff(restored.full_params(), saved) == 0
  got = []
  for b in data[2:]:
    restored, m = zinfjax.train_step(restored, b, loss_fn)
    got.append(float(m["loss"]))
  np.testing.assert_allclose(got, expect, rtol=1e-6)
  # restored with every param trained, or onto the model without its adapters: named refusals
  from zinfjax.checkpoint import CheckpointMismatch
  with pytest.raises(CheckpointMismatch, match=r"trains other params than this run: 8 frozen "
                                               r"there are trained here \(e.g. 'head/bias'"):
    ckpt.restore(Model, _tx(pinned), pinned.zero(), other)
  with pytest.raises(CheckpointMismatch, match=r"another model: 6 of its params are not in this "
                                               r"model \(e.g. 'head/lora/lora_a' \[16, 2\] .*"
                                               r"Its LoRA adapters differ"):
    ckpt.restore(PlainModel, _tx(pinned), pinned.zero(), other)
  ckpt.close()


def test_trainable_filter_errors(mesh):
  with pytest.raises(ValueError, match="selects none of the model's params"):
    zinfjax.abstract_init(Model, optax.adam(1e-3), zinfjax.ZeroConfig(trainable=nnx.BatchStat), mesh)
  with pytest.raises(ValueError, match="frozen params .* need stage=3"):
    zinfjax.abstract_init(Model, optax.adam(1e-3),
                          zinfjax.ZeroConfig(stage=2, trainable=nnx.LoRAParam), mesh)


@pytest.mark.parametrize("family, tier", [("llama", "nvme"), ("gpt2", "pinned_host")])
def test_lora_on_a_pretrained_model_exports_merged(family, tier, mesh, tmp_path):
  """LoRA on a pretrained tiny Llama or GPT-2 (base streamed onto NVMe or pinned host and
  frozen, adapters fresh from the initializers): starts at transformers' loss, trains like
  nnx.Optimizer(wrt=LoRAParam), and exports W + A @ B, whose plain-model logits equal the LoRA
  model's (fp32, 1e-5)."""
  import os
  from helpers import REPO
  from zinfjax.models import hf, lm_loss
  from zinfjax.weights import safetensors, source

  folder = os.path.join(REPO, "tests", "data", "hf", family)
  base, _, weights = hf.load(folder)
  config = base.replace(lora_rank=2)
  make = hf.factory(config)
  ref_data = np.load(os.path.join(folder, "reference.npz"))
  tokens = np.tile(ref_data["tokens"], (4, 1))
  batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
  zero = zinfjax.ZeroConfig(precision="fp32", trainable=nnx.LoRAParam, offload_param=tier,
                            offload_optimizer=tier, nvme_path=str(tmp_path / "swap"))
  state = zinfjax.init(make, zinfjax.optim.adam(1e-2), zero, mesh, rng=3, params=weights,
                       init_missing=nnx.LoRAParam)
  ref = make(nnx.Rngs(3))
  pretrained = jax.tree.map(lambda t: jnp.asarray(t.read(())), weights, is_leaf=source.is_tensor)
  nnx.update(ref, pretrained)
  assert _diff(state.full_params(), nnx.to_pure_dict(nnx.state(ref))) == 0
  logits = np.asarray(ref_data["logits"])
  start = float(optax.softmax_cross_entropy_with_integer_labels(
      jnp.asarray(logits[:, :-1]), ref_data["tokens"][:, 1:]).mean())
  np.testing.assert_allclose(float(zinfjax.eval_step(state, batch, lm_loss)["loss"]), start,
                             rtol=1e-5)
  opt = nnx.Optimizer(ref, optax.adam(1e-2), wrt=nnx.LoRAParam)
  for _ in range(3):
    state, metrics = zinfjax.train_step(state, batch, lm_loss)
    loss, grads = nnx.value_and_grad(lm_loss, argnums=nnx.DiffState(0, nnx.LoRAParam))(ref, batch)
    opt.update(ref, grads)
    np.testing.assert_allclose(float(metrics["loss"]), float(loss), rtol=1e-5)
  assert float(metrics["loss"]) < start - 0.01
  hf.save(str(tmp_path / "out"), config, state, base_config=hf.read_config(folder))
  hf.save(str(tmp_path / "out2"), base, state)   # the base model's config: adapters merged too
  out, out2 = (safetensors.Checkpoint(str(tmp_path / o)) for o in ("out", "out2"))
  assert all(np.array_equal(out[n], out2[n]) for n in out)
  base_config, base_make, merged = hf.load(str(tmp_path / "out"))
  assert base_config.lora_rank == 0
  plain = base_make(nnx.Rngs(0))
  nnx.update(plain, jax.tree.map(lambda t: jnp.asarray(t.read(())), merged,
                                 is_leaf=source.is_tensor))
  x = jnp.asarray(ref_data["tokens"])
  np.testing.assert_allclose(np.asarray(plain(x)), np.asarray(state.model()(x)), atol=1e-5)
  assert np.abs(np.asarray(plain(x)) - logits).max() > 1e-3   # the adapters changed the model
  state.close()
