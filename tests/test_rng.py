"""Threefry's straight-line lowering on CPU (`zinfjax.rng`): the same bits as JAX's rolled loop."""

import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from zinfjax.rng import jit_unrolled, unrolled_threefry

pytestmark = pytest.mark.skipif(jax.default_backend() != "cpu", reason="the swap is XLA:CPU's")


def draws(key):
  """Draws of several kinds and shapes, as model initializers make them."""
  k1, k2, k3, k4 = jax.random.split(key, 4)
  return (jax.random.normal(k1, (64, 96)) * 0.02,
          jax.random.truncated_normal(k2, -2.0, 2.0, (8, 24, 40), jnp.bfloat16),
          jax.random.uniform(k3, (1001,)),
          nnx.initializers.lecun_normal()(k4, (48, 32)))


def test_unrolled_draws_equal_jax_bit_for_bit(mesh):
  sh = NamedSharding(mesh, P("data"))
  outs = (sh, NamedSharding(mesh, P(None, "data")), NamedSharding(mesh, P()), sh)
  for seed in (0, 7, 123456):
    key = jax.random.key(seed)
    want = jax.jit(draws, out_shardings=outs)(key)
    got = jit_unrolled(draws, out_shardings=outs)(key)
    for g, w in zip(got, want):
      assert g.dtype == w.dtype and g.sharding == w.sharding
      assert float(jnp.std(g.astype(jnp.float32))) > 0  # random, not zeros
      np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


def rolled(jit=jax.jit) -> bool:
  """Whether a fresh program's threefry is lowered as JAX's rolled loop (a fresh function each
  time: JAX caches a function's lowering)."""
  return "while" in jit(lambda key: jax.random.bits(key, (4096,))).lower(jax.random.key(0)).as_text()


def test_swap_is_scoped_reentrant_and_restored():
  assert rolled()  # JAX's own CPU lowering
  assert not rolled(jit_unrolled)
  with unrolled_threefry() as swapped:
    assert swapped
    with unrolled_threefry():
      assert not rolled()
    assert not rolled()  # the outer block still holds the swap
  assert rolled()
  errors = []

  def worker():
    try:
      for _ in range(20):
        with unrolled_threefry():
          pass
    except Exception as e:  # pragma: no cover - reported below
      errors.append(e)

  threads = [threading.Thread(target=worker) for _ in range(4)]
  for t in threads:
    t.start()
  for t in threads:
    t.join()
  assert not errors
  assert rolled()  # concurrent blocks leave JAX's rule in place


def test_init_equals_the_eager_model_bit_for_bit(mesh):
  """`zinfjax.init` draws through the straight lowering; the whole model built by flax in one
  `jax.jit` (JAX's own lowering) has the same values. (Built eagerly, op by op, its values
  differ from any jitted build by an ulp: XLA fuses the scale into the draw.)"""
  import zinfjax
  from zinfjax.models import GPT, get_config
  config = get_config("tiny", num_layers=3)
  build = lambda: nnx.to_pure_dict(nnx.state(GPT(config, rngs=nnx.Rngs(jax.random.key(7)))))
  want = jax.tree.leaves(jax.jit(build)())
  state = zinfjax.init(lambda r: GPT(config, rngs=r), zinfjax.optim.adamw(1e-3),
                       zinfjax.ZeroConfig(), mesh, 7)
  got = jax.tree.leaves(state.full_params())
  assert len(got) == len(want)
  for g, w in zip(got, want):
    np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


def test_a_jax_without_the_rule_draws_the_same_rolled(monkeypatch):
  """Where this JAX keeps threefry's rules elsewhere (or its registry refuses the swap), the
  block is a no-op: JAX's own lowering, the same bits."""
  import zinfjax.rng as rng
  key = jax.random.key(3)
  want = jax.jit(lambda k: jax.random.normal(k, (257,)))(key)
  for broken in ("rule", "install"):
    with monkeypatch.context() as m:
      if broken == "rule":
        m.setattr(rng, "_rule", lambda: None)
      else:
        m.setattr(rng, "_install", lambda prim, rule: False)
      with unrolled_threefry() as swapped:
        assert not swapped
      assert rolled(jit_unrolled)
      got = jit_unrolled(lambda k: jax.random.normal(k, (257,)))(key)
      np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  assert not rolled(jit_unrolled)  # restored
