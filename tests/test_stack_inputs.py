"""`Stack` blocks with per-call inputs besides the carried activation; per-layer <-> stacked
weights; the warning for a model without a `Stack`."""

import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import zinfjax
from zinfjax.weights import stack_layers, unstack_layers


class Block(nnx.Module):
  def __init__(self, rngs):
    self.lin = nnx.Linear(16, 16, rngs=rngs)

  def __call__(self, x, scale, positions, mask):
    h = jnp.tanh(self.lin(x)) * scale[:, None, None] + 0.01 * positions[None, :, None]
    return x + jnp.where(mask[:, :, None], h, 0.0)


class Model(nnx.Module):
  def __init__(self, rngs):
    self.inp = nnx.Linear(4, 16, rngs=rngs)
    self.stack = zinfjax.Stack(lambda r: Block(r), 3, rngs=rngs)
    self.gain = nnx.Param(jnp.full((16,), 1.5))

  def __call__(self, x):
    h = self.inp(x)
    scale = jnp.mean(h, axis=(1, 2)) * self.gain[0]   # float input that depends on params
    positions = jnp.arange(x.shape[1])                # integer input
    mask = jnp.arange(x.shape[1])[None, :] < 4        # boolean input
    return self.stack(h, scale, positions, jnp.broadcast_to(mask, x.shape[:2]))


def loss_fn(model, batch):
  return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)


@pytest.mark.parametrize("extra", [dict(), dict(tiles=2), dict(offload_param="nvme")])
def test_stack_with_per_call_inputs_matches_flax(extra, mesh, tmp_path):
  """ZeRO-3 (tiled, NVMe) with float, int and bool per-call inputs trains like nnx.Optimizer
  (fp32, rtol 1e-6): the gradient through the float input reaches the params it came from."""
  rng = np.random.default_rng(0)
  batches = [{"x": rng.normal(size=(8, 5, 4)).astype(np.float32),
              "y": rng.normal(size=(8, 5, 16)).astype(np.float32)} for _ in range(3)]
  if "offload_param" in extra:
    extra = dict(extra, offload_optimizer="pinned_host", nvme_path=str(tmp_path))
  tx = zinfjax.optim.adam(1e-2) if extra.get("offload_param") else optax.adam(1e-2)
  state = zinfjax.init(Model, tx, zinfjax.ZeroConfig(precision="fp32", persistence_threshold=0,
                                                      **extra), mesh, rng=0)
  ref = Model(nnx.Rngs(0))
  opt = nnx.Optimizer(ref, optax.adam(1e-2), wrt=nnx.Param)
  for b in batches:
    state, metrics = zinfjax.train_step(state, b, loss_fn)
    loss, grads = nnx.value_and_grad(loss_fn)(ref, b)
    assert float(jnp.abs(grads["gain"][...]).max()) > 0
    opt.update(ref, grads)
    np.testing.assert_allclose(float(metrics["loss"]), float(loss), rtol=1e-6)
  got = state.full_params()
  np.testing.assert_allclose(got["gain"], ref.gain[...], rtol=1e-5)
  if state.engine.store is not None:
    state.engine.store.close()


def test_stack_layers_round_trip(mesh):
  """Per-layer weights stack into a `Stack` model's layout (lazily) and unstack back exactly."""
  rng = np.random.default_rng(1)
  per_layer = {"inp.kernel": rng.normal(size=(4, 16)).astype(np.float32),
               "inp.bias": rng.normal(size=(16,)).astype(np.float32),
               "gain": rng.normal(size=(16,)).astype(np.float32)}
  for i in range(3):
    per_layer[f"layers.{i}.lin.kernel"] = rng.normal(size=(16, 16)).astype(np.float32)
    per_layer[f"layers.{i}.lin.bias"] = rng.normal(size=(16,)).astype(np.float32)
  stacked = stack_layers(per_layer, pattern="layers.{i}.", into="stack/block/")
  assert stacked["stack/block/lin/kernel"].shape == (3, 16, 16)
  state = zinfjax.init(Model, optax.adam(1e-3), zinfjax.ZeroConfig(precision="fp32"), mesh,
                       params=stacked)
  back = unstack_layers(state.full_params(), stacked="stack/block/", pattern="layers.{i}.")
  assert set(back) == set(per_layer)
  for k, v in per_layer.items():
    np.testing.assert_array_equal(back[k], v, err_msg=k)
  del per_layer["layers.1.lin.bias"]
  with pytest.raises(ValueError, match="layers.1.lin.bias is missing"):
    stack_layers(per_layer, pattern="layers.{i}.", into="stack/block/")


def test_model_without_stack_warns(mesh):
  class Flat(nnx.Module):
    def __init__(self, rngs):
      self.a = nnx.Linear(8, 8, rngs=rngs)

    def __call__(self, x):
      return self.a(x)

  with pytest.warns(UserWarning, match="no zinfjax.Stack.*gathers all of its params at once"):
    zinfjax.abstract_init(Flat, optax.adam(1e-3), zinfjax.ZeroConfig(), mesh)
