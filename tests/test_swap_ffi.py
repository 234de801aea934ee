"""The swap store's XLA custom calls: in jit, in scan, in shard_map, ordered by tokens."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from zinfjax.offload import AioStore, swap


@pytest.fixture(scope="module")
def store(tmp_path_factory):
  s = AioStore(tmp_path_factory.mktemp("nvme"), block_size=64 << 10)
  yield s
  s.close()


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16, jnp.int8])
def test_write_then_read_in_jit(store, dtype):
  x = (jax.random.normal(jax.random.key(0), (37, 129)) * 50).astype(dtype)

  @jax.jit
  def round_trip(x):
    token = swap.write(store.handle, "jit", x)
    return swap.read(store.handle, "jit", jax.ShapeDtypeStruct(x.shape, x.dtype), token)

  np.testing.assert_array_equal(np.asarray(round_trip(x)), np.asarray(x))
  assert store.entry("jit/r0/l0")["dtype"] == jnp.dtype(dtype).name


def test_scan_with_layer_index_operand_and_prefetch(store):
  xs = jax.random.normal(jax.random.key(1), (6, 4, 1000))

  @jax.jit
  def offload_then_stream(xs):
    def put(token, layer_x):
      layer, x = layer_x
      return swap.write(store.handle, "layers", x, layer=layer) + token, None

    token, _ = jax.lax.scan(put, jnp.int32(0), (jnp.arange(6), xs))
    like = jax.ShapeDtypeStruct(xs.shape[1:], xs.dtype)

    def get(ticket, layer):  # wait for layer i, start layer i+1 (prefetch)
      x = swap.read_wait(store.handle, ticket, like)
      following = swap.read_start(store.handle, "layers", token, layer=jnp.minimum(layer + 1, 5))
      return following, x * 2

    first = swap.read_start(store.handle, "layers", token, layer=0)
    last, ys = jax.lax.scan(get, first, jnp.arange(6))
    swap.read_wait(store.handle, last, like)  # drain the extra prefetch
    return ys

  np.testing.assert_array_equal(np.asarray(offload_then_stream(xs)), 2 * np.asarray(xs))
  assert {f"layers/r0/l{i}" for i in range(6)} <= set(store.keys())


def test_shard_map_each_device_moves_its_own_shard(store, mesh):
  x = jax.device_put(jax.random.normal(jax.random.key(2), (8, 3000)),
                     jax.sharding.NamedSharding(mesh, P("data")))

  def per_device(x):
    rank = jax.lax.axis_index("data")
    token = swap.write(store.handle, "sharded", x, rank=rank)
    return swap.read(store.handle, "sharded", jax.ShapeDtypeStruct(x.shape, x.dtype), token,
                     rank=rank)

  f = jax.jit(jax.shard_map(per_device, mesh=mesh, in_specs=P("data"), out_specs=P("data")))
  np.testing.assert_array_equal(np.asarray(f(x)), np.asarray(x))
  for r in range(8):  # every rank wrote exactly its own row
    row = store.read(f"sharded/r{r}/l0").wait()
    np.testing.assert_array_equal(row, np.asarray(x)[r:r + 1])


def test_read_is_ordered_after_its_write_by_the_token(store):
  """The read's only link to the write is the token: it must see the new value, every time."""

  @jax.jit
  def overwrite_and_read(x):
    token = swap.write(store.handle, "ordered", x)
    return swap.read(store.handle, "ordered", jax.ShapeDtypeStruct(x.shape, x.dtype), token)

  for i in range(5):
    x = jnp.full((2048,), float(i))
    np.testing.assert_array_equal(np.asarray(overwrite_and_read(x)), np.asarray(x))


def test_errors_surface_from_inside_jit(store):
  with pytest.raises(Exception, match="no shard 'never/r0/l0'"):
    jax.jit(lambda t: swap.read(store.handle, "never", jax.ShapeDtypeStruct((4,), jnp.float32), t))(0)
  with pytest.raises(Exception, match="no zinfjax swap store with handle 999999"):
    jax.jit(lambda x: swap.write(999999, "x", x))(jnp.ones(3))
  store.write("typed/r0/l0", np.ones(16, np.float32)).wait()
  with pytest.raises(Exception, match="written as float32"):
    jax.jit(lambda t: swap.read(store.handle, "typed", jax.ShapeDtypeStruct((16,), jnp.bfloat16), t,
                                layer=0))(0)


def test_a_layer_of_several_leaves_in_one_call(store):
  """write_many / read_start_many / read_wait_many: every leaf of a layer (mixed shapes and
  dtypes) in one custom call each, streamed over a scan with prefetch, bit-exact."""
  keys = ["many/a", "many/b", "many/c"]
  shapes_dtypes = [((5, 33), jnp.float32), ((1000,), jnp.bfloat16), ((7,), jnp.int8)]
  leaves = [(jax.random.normal(jax.random.key(10 + i), (4,) + shape) * 20).astype(dt)
            for i, (shape, dt) in enumerate(shapes_dtypes)]
  likes = [jax.ShapeDtypeStruct(shape, dt) for shape, dt in shapes_dtypes]

  @jax.jit
  def offload_then_stream(leaves):
    def put(token, i):
      xs = [x[i] for x in leaves]
      return token + swap.write_many(store.handle, keys, xs, layer=i), None

    token, _ = jax.lax.scan(put, jnp.int32(0), jnp.arange(4))

    def get(ticket, i):
      xs = swap.read_wait_many(store.handle, ticket, likes)
      following = swap.read_start_many(store.handle, keys, token, layer=jnp.minimum(i + 1, 3))
      return following, xs

    first = swap.read_start_many(store.handle, keys, token, layer=0)
    last, ys = jax.lax.scan(get, first, jnp.arange(4))
    swap.read_wait_many(store.handle, last, likes)
    return ys

  for got, want in zip(offload_then_stream(leaves), leaves):
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  assert store.entry("many/b/r0/l3")["dtype"] == "bfloat16"

  with pytest.raises(Exception, match="'many/a/r0/l0' was written as float32"):
    jax.jit(lambda t: swap.read_wait_many(
        store.handle, swap.read_start_many(store.handle, keys, t), [likes[1]] + likes[1:]))(0)
  with pytest.raises(Exception, match="no shard 'many/nope/r0/l0'"):
    jax.jit(lambda t: swap.read_start_many(store.handle, ["many/a", "many/nope"], t))(0)


def test_engine_owned_buffers_are_reused_within_the_budget(tmp_path):
  """The buffers of engine-owned reads go back to a cache of spare buffers, never holding
  more than the store's pinned budget, and the next read of the same size reuses one."""
  store = AioStore(tmp_path, pinned_budget=1 << 20)
  keys = [f"spare/{i}" for i in range(3)]
  likes = [jax.ShapeDtypeStruct((40_000,), jnp.float32)] * 3  # 3 x 160 KB per read
  for k in keys:
    store.write(f"{k}/r0/l0", np.arange(40_000, dtype=np.float32)).wait()

  @jax.jit
  def read_layer(t):
    return swap.read_wait_many(store.handle, swap.read_start_many(store.handle, keys, t), likes)

  first = read_layer(0)
  spare = store.stats()["spare_bytes"]
  assert 0 < spare <= 1 << 20
  assert all(np.array_equal(np.asarray(x), np.arange(40_000)) for x in first)
  read_layer(1)[0].block_until_ready()
  assert store.stats()["spare_bytes"] == spare  # taken and given back, not a second one
  store.close()
