"""ZeroConfig.layer_residuals: saving each layer's backward residuals in the ZeRO-3 scan (all of
them, or only its matrix products' outputs) trains exactly like recomputing the layer, keeps
none of its params, and does run fewer matmuls."""

import math

import jax
import numpy as np
import pytest

import zinfjax
from zinfjax import residuals as R
from zinfjax.models import GPT, get_config, lm_loss

from helpers import text_batches, zero_training

TINY = get_config("tiny", num_layers=3)
LR = 3e-3
# the two programs round the same math apart (fused differently); AdamW moves a param by about
# lr a step whatever its grad's size, so params are held to 0.1% of that movement
PARAM_ATOL = 1e-3 * LR * 3


@pytest.fixture(scope="module")
def mesh():
  return zinfjax.make_mesh(jax.devices()[:4])


@pytest.fixture(scope="module")
def batches():
  return text_batches(3, 8, TINY.seq_len, seed=1)


def run(mesh, batches, tmp_path, residuals, param="device", **extra):
  zero = zinfjax.ZeroConfig(precision="fp32", offload_param=param, offload_optimizer=param,
                            nvme_path=str(tmp_path), layer_residuals=residuals, **extra)
  losses, state = zero_training(lambda r: GPT(TINY, rngs=r), zinfjax.optim.adamw(LR), zero,
                                mesh, batches, lm_loss)
  return losses, state


def dots(state, batch) -> int:
  """matmuls in the step's program (inside scans, custom vjps and shard_maps too)."""
  step = zinfjax.make_train_step(state, lm_loss)
  jaxpr = step.jitted.trace(state, zinfjax.step.shard_batch(state.engine, batch)).jaxpr

  def count(jx):
    n = 0
    for eqn in jx.eqns:
      n += eqn.primitive.name == "dot_general"
      for p in eqn.params.values():
        for inner in (p if isinstance(p, (tuple, list)) else [p]):
          inner = getattr(inner, "jaxpr", inner)
          if hasattr(inner, "eqns"):
            n += count(inner)
    return n

  return count(jaxpr.jaxpr)


def kept_residuals(state, batch) -> list[jax.ShapeDtypeStruct]:
  """What one layer of the step's scan keeps for backward (the step traced, not run; [] where
  it recomputes). Under an explicit mode each trace of the scan keeps the same."""
  seen = []

  def split(pull, known):
    seen.append(real(pull, known))
    return seen[-1]

  real, R.split = R.split, split
  try:
    step = zinfjax.make_train_step(state, lm_loss)
    step.jitted.trace(state, zinfjax.step.shard_batch(state.engine, batch))
  finally:
    R.split = real
  return [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (seen[-1].kept if seen else [])]


@pytest.mark.parametrize("param,mode", [("device", "save"), ("nvme", "save"), ("device", "dots")])
def test_saved_residuals_train_like_recompute(param, mode, mesh, batches, tmp_path):
  want, ref = run(mesh, batches, tmp_path / "a", "recompute", param)
  got, state = run(mesh, batches, tmp_path / "b", mode, param)
  np.testing.assert_allclose(got, want, rtol=1e-6)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=0, atol=PARAM_ATOL),
               state.full_params(), ref.full_params())
  # no recompute: backward runs each block's forward matmuls no more
  assert dots(state, batches[0]) < dots(ref, batches[0])
  ref.close()
  state.close()


def test_auto_saves_within_the_budget_only(mesh, batches, tmp_path):
  """"auto" keeps the matmuls' outputs ("dots") where all layers' fit the budget, else none;
  both train alike. "dots" keeps under half of what "save" does."""
  layer = lambda mode: sum(math.prod(x.shape) * x.dtype.itemsize for x in kept_residuals(
      run(mesh, [], tmp_path / mode, mode)[1], batches[0]))
  save, products = layer("save"), layer("dots")
  assert 0 < products < save / 2, (products, save)
  budgets = {"dots": TINY.num_layers * products, "recompute": TINY.num_layers * products - 1}
  losses, counts = {}, {}
  for mode, budget in budgets.items():
    losses[mode], state = run(mesh, batches[:1], tmp_path / f"auto-{mode}", "auto",
                              residual_budget=budget)
    counts[mode] = dots(state, batches[0])
    _, same = run(mesh, [], tmp_path / f"as-{mode}", mode)
    assert counts[mode] == dots(same, batches[0]), mode  # auto chose `mode`
    state.close()
    same.close()
  np.testing.assert_allclose(losses["dots"], losses["recompute"], rtol=1e-6)
  # dots: attention's batched products are recomputed, the dense layers' are not
  assert counts["dots"] < counts["recompute"], counts


def test_the_default_budget_is_half_of_what_the_states_leave():
  assert R.free_share(60 << 30, 8 << 30) == 26 << 30
  assert R.free_share(60 << 30, 70 << 30) == 0
  assert R.device_budget(0) == 0  # XLA:CPU reports no limit: recompute


def test_dots_keeps_only_the_dense_layers_outputs(mesh, tmp_path):
  """A GPT block's "dots" residuals are its qkv, attention-projection and MLP-input products'
  outputs, nothing elementwise (layer norms, GELU) and no params."""
  state = run(mesh, [], tmp_path, "dots")[1]
  batch = text_batches(1, 8, TINY.seq_len, seed=1)[0]
  b, t, d = 8 // 4, TINY.seq_len, TINY.hidden  # 8 examples over 4 devices
  kept = sorted(x.shape for x in kept_residuals(state, batch))
  assert kept == sorted([(b, t, 3 * d), (b, t, d), (b, t, 4 * d)]), kept
  state.close()


def test_kept_residuals_hold_no_params():
  """The pullback's residuals that are the layer's params (or its input) are named, not kept."""
  block = lambda p, h: jax.numpy.tanh(h @ p["w1"]) @ p["w2"] + h
  params = {"w1": jax.random.normal(jax.random.key(0), (8, 8)),
            "w2": jax.random.normal(jax.random.key(1), (8, 8))}
  h = jax.random.normal(jax.random.key(2), (4, 8))

  def check(p, h):
    _, pull = jax.vjp(block, p, h)
    known = [p["w1"], p["w2"], h]
    res = R.split(pull, known)
    assert all(x.shape != (8, 8) for x in res.kept)  # no weight among the kept
    assert set(res.sources) >= {0, 1}
    g = jax.numpy.ones((4, 8))
    return R.pullback(res, known)(g), pull(g)

  got, want = jax.jit(check)(params, h)
  jax.tree.map(lambda a, b: np.testing.assert_array_equal(a, b), got, want)


def test_bad_policy_is_refused():
  with pytest.raises(ValueError, match="layer_residuals"):
    zinfjax.ZeroConfig(layer_residuals="sometimes")
  with pytest.raises(ValueError, match="residual_budget"):
    zinfjax.ZeroConfig(residual_budget=-1)


def test_a_stack_split_over_tiers_shares_its_budget(mesh, batches, tmp_path):
  """A stack whose layers are split over tiers runs a scan per tier; they share the stack's
  budget as their layers are, so the stack keeps its residuals only where all of them fit."""
  products = sum(math.prod(x.shape) * x.dtype.itemsize for x in kept_residuals(
      run(mesh, [], tmp_path / "dots", "dots")[1], batches[0]))
  split = "device:2,pinned_host"  # scans of 2 and 1 layers
  counts = {}
  for name, budget in (("all", TINY.num_layers * products), ("two", 2 * products)):
    state = run(mesh, [], tmp_path / name, "auto", split, residual_budget=budget)[1]
    counts[name] = dots(state, batches[0])
    state.close()
  ref = run(mesh, [], tmp_path / "rec", "recompute", split)[1]
  assert counts["two"] == dots(ref, batches[0]) > counts["all"], counts
  ref.close()
