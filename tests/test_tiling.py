"""Memory-centric tiling: tiled products equal jnp.dot, and hold one tile at a time."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

import zinfjax
from zinfjax import TiledLinear, tile_matmuls
from zinfjax.models import GPT, get_config, lm_loss

from helpers import text_batches


def rand(key, shape, dtype=jnp.float32):
  return jax.random.normal(jax.random.key(key), shape, dtype)


@pytest.mark.parametrize("tiles", [2, 3, 7, 16])
@pytest.mark.parametrize("shape", [(37, 101), (101, 37)])  # tile an output or a contracted axis
def test_values_and_grads_equal_jnp_dot(tiles, shape):
  x, w = rand(0, (5, shape[0])), rand(1, shape)
  f = lambda x, w: jnp.tanh(jnp.dot(x, w))
  tiled = tile_matmuls(f, tiles=tiles)
  np.testing.assert_allclose(tiled(x, w), f(x, w), rtol=1e-5, atol=1e-5)
  loss = lambda fn: lambda x, w: jnp.sum(fn(x, w) ** 2)
  got = jax.grad(loss(tiled), argnums=(0, 1))(x, w)
  want = jax.grad(loss(f), argnums=(0, 1))(x, w)
  for a, b in zip(got, want):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)
  # it really is tiled: a scan over the weight appears in the traced program
  assert "scan" in str(jax.make_jaxpr(tiled)(x, w))


def test_bf16_within_tolerance():
  x, w = rand(2, (8, 256), jnp.bfloat16), rand(3, (256, 512), jnp.bfloat16)
  got = tile_matmuls(lambda x, w: x @ w, tiles=8)(x, w).astype(jnp.float32)
  want = (x.astype(jnp.float32) @ w.astype(jnp.float32))
  # bf16 products: within 2% of the largest output (the untiled bf16 product is no closer)
  assert float(jnp.max(jnp.abs(got - want)) / jnp.max(jnp.abs(want))) < 2e-2


def test_under_jit_and_vmap():
  xs, w = rand(4, (3, 5, 64)), rand(5, (64, 96))
  f = jax.jit(jax.vmap(tile_matmuls(lambda x, w: x @ w, max_tile_bytes=64 * 96 * 4 // 4), (0, None)))
  np.testing.assert_allclose(f(xs, w), xs @ w, rtol=1e-5, atol=1e-5)


def test_small_products_are_left_alone():
  x, w = rand(6, (4, 8)), rand(7, (8, 8))
  assert "scan" not in str(jax.make_jaxpr(tile_matmuls(jnp.dot, max_tile_bytes=1 << 20))(x, w))
  with pytest.raises(ValueError, match="exactly one of"):
    tile_matmuls(jnp.dot)


def test_tiled_linear_layer():
  layer = TiledLinear(48, 80, in_splits=3, out_splits=4, rngs=nnx.Rngs(0))
  x = rand(8, (2, 7, 48))
  np.testing.assert_allclose(layer(x), x @ layer.kernel[...] + layer.bias[...], rtol=1e-5, atol=1e-5)
  grads = nnx.grad(lambda m: jnp.sum(m(x) ** 2))(layer)
  kernel = layer.kernel[...]
  want = jax.grad(lambda k: jnp.sum((x @ k + layer.bias[...]) ** 2))(kernel)
  np.testing.assert_allclose(grads.kernel[...], want, rtol=1e-4, atol=1e-4)
  with pytest.raises(ValueError, match="divide 80"):
    TiledLinear(48, 80, out_splits=3, rngs=nnx.Rngs(0))


def test_gpt_trains_the_same_with_tiling(mesh):
  config = get_config("tiny")
  batches = text_batches(10, batch=8, seq=32, seed=4)

  def losses(tiles):
    zero = zinfjax.ZeroConfig(stage=3, precision="fp32", tiles=tiles)
    state = zinfjax.init(lambda r: GPT(config, rngs=r), optax.adamw(3e-3), zero, mesh)
    out = []
    for b in batches:
      state, metrics = zinfjax.train_step(state, b, lm_loss)
      out.append(float(metrics["loss"]))
    return np.array(out), state

  (plain, _), (tiled, _) = losses(1), losses(4)
  np.testing.assert_allclose(tiled, plain, rtol=1e-5)
  assert tiled[-1] < tiled[0] - 0.3
  with pytest.raises(ValueError, match="needs stage=3"):
    zinfjax.ZeroConfig(stage=2, tiles=4)


def test_zero3_linear_16_tiles_uses_an_eighth_of_the_memory(mesh):
  """One 8192 -> 4x8192 linear under ZeRO-3 on 8 devices, compiled, not run."""
  hidden = 8192

  def step(tiles):
    def local(w_shard, x):
      def forward(w_shard, x):
        return jnp.dot(x, jax.lax.all_gather(w_shard, "data", axis=1, tiled=True))
      fwd = forward if tiles == 1 else tile_matmuls(forward, tiles=tiles)
      return jax.grad(lambda w: jnp.sum(fwd(w, x) ** 2))(w_shard)
    return jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(P(None, "data"), P("data")),
                                 out_specs=P(None, "data"), check_vma=False))

  w = jax.ShapeDtypeStruct((hidden, 4 * hidden), jnp.float32, sharding=NamedSharding(mesh, P(None, "data")))
  x = jax.ShapeDtypeStruct((8, hidden), jnp.float32, sharding=NamedSharding(mesh, P("data")))
  untiled = step(1).lower(w, x).compile().memory_analysis().temp_size_in_bytes
  tiled = step(16).lower(w, x).compile().memory_analysis().temp_size_in_bytes
  full_weight = hidden * 4 * hidden * 4
  assert untiled >= 2 * full_weight  # the gathered weight and its gradient
  assert tiled <= untiled / 8, (tiled, untiled)
