"""Adam's moments in bf16 (`adamw(moment_dtype="bfloat16")`): stochastic rounding that the jnp
and C++ updates share bit for bit, that tracks fp32 where rounding to nearest stalls, and
training on every tier and placement like fp32 moments, with a third less optimizer memory."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest

import zinfjax
from zinfjax.models import GPT, get_config, lm_loss
from zinfjax.optim.kernel import (AdamConstants, adamw_jnp, adamw_numpy, moment_seed,
                                  stochastic_bf16)

from helpers import text_batches, zero_training

BF16 = ml_dtypes.bfloat16
C = AdamConstants(0.9, 0.999, 1e-8)


def test_kernel_and_jnp_round_bf16_moments_the_same_way():
  """One update on random fp32 master, bf16 moments and bf16 grads: the C++ kernel's moments
  equal the jnp reference's (the same hash of each value's kept bits and the step: where XLA
  fuses a multiply-add and lands one float32 ulp away, a value rounds apart with probability
  2^-16), its master agrees to float32 rounding; another step rounds differently."""
  rng = np.random.default_rng(0)
  n = 70_001  # not a multiple of the vector width; several threads
  master = rng.normal(size=n).astype(np.float32)
  m = (rng.normal(size=n) * 1e-2).astype(BF16)
  v = (rng.random(n) * 1e-3).astype(BF16)
  grad = rng.normal(size=n).astype(BF16)
  want = jax.jit(adamw_jnp, static_argnums=(7, 8))(master, m, v, grad, 1e-3, 0.19, 0.0975, C,
                                                    0.01, 5)
  got = [x.copy() for x in (master, m, v)]
  out = np.empty(n, BF16)
  adamw_numpy(*got, grad, out, 1e-3, 0.19, 0.0975, C, 0.01, threads=3, step=5)
  assert got[1].dtype == BF16 and got[2].dtype == BF16
  for k in (1, 2):
    a, b = got[k].astype(np.float32), np.asarray(want[k]).astype(np.float32)
    apart = a != b
    assert np.count_nonzero(apart) <= 4, np.count_nonzero(apart)   # of 70001; 2^-16 each
    # and differ by a bf16 step of themselves, or (where the update cancels, so a fused
    # multiply-add moves the tiny value itself) by far less than the moment's scale
    gap = np.abs(a - b)[apart]
    assert np.all((gap <= 2 ** -7 * np.abs(b)[apart]) | (gap <= 1e-6 * np.abs(b).max()))
  np.testing.assert_allclose(got[0], np.asarray(want[0]), rtol=1e-6, atol=1e-8)  # lr 1e-3 steps
  np.testing.assert_array_equal(out, got[0].astype(BF16))
  other = [x.copy() for x in (master, m, v)]
  adamw_numpy(*other, grad, None, 1e-3, 0.19, 0.0975, C, 0.01, step=6)
  flipped = np.mean(other[2].view(np.uint16) != got[2].view(np.uint16))
  assert 0.05 < flipped < 0.95, flipped   # the step re-draws the rounding


def test_stochastic_rounding_tracks_fp32_where_nearest_stalls():
  """A second moment fed g^2 = 1 from 0.5 with b2 = 0.999: each step adds 0.05%, under half of
  bf16's spacing there, so rounding to nearest never moves; stochastic rounding follows fp32
  (1 - 0.5 * 0.999^t) within 1%, and is unbiased on random values."""
  steps = 3000
  f32, sr = np.float32(0.5), jnp.bfloat16(0.5)
  near = jnp.bfloat16(0.5)
  update = lambda v: np.float32(0.001) * np.float32(1.0) + np.float32(0.999) * v
  seeds = np.asarray(jax.vmap(lambda t: moment_seed(t, 1))(jnp.arange(1, steps + 1)))
  step_sr = jax.jit(lambda v, s: stochastic_bf16(update(v.astype(jnp.float32)), s))
  for t in range(steps):
    f32 = update(f32)
    sr = step_sr(sr, seeds[t])
    near = update(near.astype(jnp.float32)).astype(jnp.bfloat16)
  assert float(near) == 0.5
  assert abs(float(sr) - float(f32)) / float(f32) < 0.01, (float(sr), float(f32))
  x = jnp.asarray(np.random.default_rng(1).normal(size=2048).astype(np.float32))
  mean = np.mean([np.asarray(stochastic_bf16(x, s).astype(jnp.float32)) for s in seeds[:1000]], 0)
  spacing = np.abs(np.asarray(x)) * 2.0 ** -8
  assert np.mean(np.abs(mean - np.asarray(x)) / spacing) < 0.05  # rounding to nearest: ~0.25


def _problem(steps=40, seed=0):
  rng = np.random.default_rng(seed)
  params = {"w": jnp.asarray(rng.normal(size=(37, 65)), jnp.float32),
            "b": jnp.asarray(rng.normal(size=1001), jnp.float32)}
  noise = [jax.tree.map(lambda p: jnp.asarray(rng.normal(size=p.shape), jnp.float32), params)
           for _ in range(steps)]
  return params, noise


def _train(tx, params, noise):
  state = tx.init(params)

  @jax.jit
  def step(params, state, noise):
    grads = jax.tree.map(lambda p, e: e + 0.5 * p, params, noise)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  for n in noise:
    params, state = step(params, state, n)
  return params, state


@pytest.mark.parametrize("offload", ["pinned_host", "nvme"])
def test_adamw_bf16_moments_same_on_every_tier(offload, tmp_path):
  """adamw(moment_dtype=bf16) gives the device tier's params on pinned host (the C++ kernel in
  XLA's host code) and NVMe (the streaming driver) to float32 rounding over 40 steps, keeps
  bf16 moments there, and lands within 1e-3 of fp32 moments (the rounding noise)."""
  params, noise = _problem()
  make = lambda offload, dtype: zinfjax.optim.adamw(
      1e-2, weight_decay=0.1, offload=offload, moment_dtype=dtype,
      nvme_path=str(tmp_path / "nvme"), sub_group_size=1024)
  want, _ = _train(make("device", jnp.bfloat16), params, noise)
  fp32, _ = _train(optax.adamw(1e-2, weight_decay=0.1), params, noise)
  got, state = _train(make(offload, jnp.bfloat16), params, noise)
  for g, w, f, p in zip(*(jax.tree.leaves(t) for t in (got, want, fp32, params))):
    np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-6)
    assert 0 < float(jnp.max(jnp.abs(w - f))) < 1e-3 * float(jnp.max(jnp.abs(f - p))) * 40
  if offload == "pinned_host":
    assert {x.dtype for x in jax.tree.leaves((state.mu, state.nu))} == {jnp.dtype(jnp.bfloat16)}
  with pytest.raises(ValueError, match="moment_dtype must be float32 or bfloat16"):
    zinfjax.optim.adamw(1e-3, moment_dtype=jnp.float16)


@pytest.fixture(scope="module")
def batches():
  return text_batches(12, batch=16, seq=32, seed=4)


@pytest.fixture(scope="module")
def on_device(mesh, batches):
  """The all-device run with bf16 moments, and with fp32 moments."""
  runs = {}
  for dtype in (jnp.bfloat16, jnp.float32):
    tx = zinfjax.optim.adamw(3e-3, weight_decay=0.1, moment_dtype=dtype)
    losses, state = zero_training(lambda r: GPT(get_config("tiny"), rngs=r), tx,
                                  zinfjax.ZeroConfig(precision="fp32"), mesh, batches, lm_loss)
    runs[dtype] = (losses, state.full_params())
    state.close()
  return runs


def test_engine_bf16_moments_on_every_placement(placement, mesh, batches, on_device):
  """zinfjax's AdamW with bf16 moments on every placement: the losses of the all-device run
  (rtol 1e-5), moments in bf16 where they live (arrays or the swap store), 8 optimizer bytes
  per element in the plan; the loss curve stays within 1% of fp32 moments' and differs."""
  tx = zinfjax.optim.adamw(3e-3, weight_decay=0.1, moment_dtype=jnp.bfloat16)
  losses, state = zero_training(lambda r: GPT(get_config("tiny"), rngs=r), tx, placement.zero(),
                                mesh, batches, lm_loss)
  want, fp32 = on_device[jnp.bfloat16][0], on_device[jnp.float32][0]
  np.testing.assert_allclose(losses, want, rtol=1e-5)
  assert losses[-1] < losses[0] - 0.3
  assert np.max(np.abs(want - fp32) / fp32) < 0.01 and np.max(np.abs(want - fp32)) > 0
  plan = state.engine.plan
  assert plan.dtype("mu") == jnp.bfloat16 and plan.optimizer_bytes == 8
  arrays = jax.tree.leaves((state.opt_state.mu, state.opt_state.nu))
  assert all(x.dtype == jnp.bfloat16 for x in arrays)
  store = state.engine.store
  if store is not None:
    keys = [k for k in store.keys() if k.startswith(("o/m/", "o/v/"))]
    assert keys or arrays
    for k in keys:
      assert store.view(k).dtype == BF16 if store.memory else store.read(k).wait().dtype == BF16
  state.close()


def test_bf16_moments_cut_the_optimizer_bytes():
  """bytes_per_param and the estimate count 8 optimizer bytes per param with bf16 moments."""
  from zinfjax.memory import bytes_per_param
  assert bytes_per_param(offload_optimizer="nvme", atomic_nvme=False, bf16_moments=True)["nvme"] == 8
  assert bytes_per_param(offload_optimizer="nvme", atomic_nvme=False)["nvme"] == 12
  assert bytes_per_param(offload_optimizer="nvme", bf16_moments=True)["nvme"] == 16


def test_bf16_moments_checkpoint_moves_between_placements(mesh, batches, tmp_path):
  """A checkpoint of bf16 moments (on NVMe) restores onto pinned host with bf16 moments and
  continues with the same losses, and onto fp32 moments (cast exactly: every bf16 is a float32)."""
  from zinfjax.checkpoint import Checkpointer
  make = lambda r: GPT(get_config("tiny"), rngs=r)
  tx = lambda dtype: zinfjax.optim.adamw(3e-3, weight_decay=0.1, moment_dtype=dtype)
  zero = lambda where: zinfjax.ZeroConfig(precision="fp32", offload_param=where,
                                          offload_optimizer=where, nvme_path=str(tmp_path / "swap"))
  state = zinfjax.init(make, tx(jnp.bfloat16), zero("nvme"), mesh, 0)
  for b in batches[:3]:
    state, _ = zinfjax.train_step(state, b, lm_loss)
  ckpt = Checkpointer(str(tmp_path / "ckpt"))
  ckpt.save(state)
  ckpt.wait()
  expect = []
  for b in batches[3:6]:
    state, m = zinfjax.train_step(state, b, lm_loss)
    expect.append(float(m["loss"]))
  state.close()
  restored, _ = ckpt.restore(make, tx(jnp.bfloat16), zero("pinned_host"), mesh)
  assert {x.dtype for x in jax.tree.leaves(restored.opt_state.mu)} == {jnp.dtype(jnp.bfloat16)}
  saved_nu = [np.asarray(x).astype(np.float32) for x in jax.tree.leaves(restored.opt_state.nu)]
  got = []
  for b in batches[3:6]:
    restored, m = zinfjax.train_step(restored, b, lm_loss)
    got.append(float(m["loss"]))
  np.testing.assert_allclose(got, expect, rtol=1e-5)
  wider, _ = ckpt.restore(make, tx(jnp.float32), zero("pinned_host"), mesh)
  wide_nu = [np.asarray(x) for x in jax.tree.leaves(wider.opt_state.nu)]
  assert {x.dtype for x in wide_nu} == {np.dtype(np.float32)} and any(np.any(x) for x in wide_nu)
  for a, b in zip(wide_nu, saved_nu):
    np.testing.assert_array_equal(a, b)
  wider, m = zinfjax.train_step(wider, batches[3], lm_loss)
  assert np.isfinite(float(m["loss"]))
  ckpt.close()
