"""The swap store's XLA custom calls: in jit, in scan, in shard_map, ordered by tokens.

Every call also carries the host's copy of its schedule (`swap.layer_at`,
`swap.rank_table`), which the GPU handlers use instead of reading the device;
the CPU handlers check it against the program's own values on every call.
"""

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


def _prefetching_stream(store, keys, token, likes, n):
  """Read layers 0..n-1 with the read of layer i+1 started while layer i is taken."""
  nxt = np.minimum(np.arange(n) + 1, n - 1)

  def get(ticket, i):  # wait for layer i, start layer i+1 (prefetch)
    xs = swap.read_wait_many(store.handle, keys, ticket, likes, layer=swap.layer_at(range(n), i))
    following = swap.read_start_many(store.handle, keys, token, layer=swap.layer_at(nxt, i))
    return following, xs

  first = swap.read_start_many(store.handle, keys, token, layer=0)
  last, ys = jax.lax.scan(get, first, jnp.arange(n))
  swap.read_wait_many(store.handle, keys, last, likes, layer=n - 1)  # drain the extra prefetch
  return ys


def test_scan_with_layer_index_operand_and_prefetch(store):
  xs = jax.random.normal(jax.random.key(1), (6, 4, 1000))

  @jax.jit
  def offload_then_stream(xs):
    def put(token, i_x):
      i, x = i_x
      return swap.write(store.handle, "layers", x, layer=swap.layer_at(range(6), i)) + token, None

    token, _ = jax.lax.scan(put, jnp.int32(0), (jnp.arange(6), xs))
    like = jax.ShapeDtypeStruct(xs.shape[1:], xs.dtype)
    return _prefetching_stream(store, ["layers"], token, [like], 6)[0] * 2

  np.testing.assert_array_equal(np.asarray(offload_then_stream(xs)), 2 * np.asarray(xs))
  assert {f"layers/r0/l{i}" for i in range(6)} <= set(store.keys())


def test_shard_map_each_device_moves_its_own_shard(store, mesh):
  x = jax.device_put(jax.random.normal(jax.random.key(2), (8, 3000)),
                     jax.sharding.NamedSharding(mesh, P("data")))

  def per_device(x):
    rank, ranks = jax.lax.axis_index("data"), swap.rank_table(mesh, "data")
    token = swap.write(store.handle, "sharded", x, rank=rank, ranks=ranks)
    return swap.read(store.handle, "sharded", jax.ShapeDtypeStruct(x.shape, x.dtype), token,
                     rank=rank, ranks=ranks)

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
      return token + swap.write_many(store.handle, keys, xs, layer=swap.layer_at(range(4), i)), None

    token, _ = jax.lax.scan(put, jnp.int32(0), jnp.arange(4))
    return _prefetching_stream(store, keys, token, likes, 4)

  for got, want in zip(offload_then_stream(leaves), leaves):
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  assert store.entry("many/b/r0/l3")["dtype"] == "bfloat16"

  with pytest.raises(Exception, match="'many/a/r0/l0' was written as float32"):
    jax.jit(lambda t: swap.read_wait_many(
        store.handle, keys, swap.read_start_many(store.handle, keys, t), [likes[1]] + likes[1:]))(0)
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
    return swap.read_wait_many(store.handle, keys, swap.read_start_many(store.handle, keys, t),
                               likes)

  first = read_layer(0)
  spare = store.stats()["spare_bytes"]
  assert 0 < spare <= 1 << 20
  assert all(np.array_equal(np.asarray(x), np.arange(40_000)) for x in first)
  read_layer(1)[0].block_until_ready()
  assert store.stats()["spare_bytes"] == spare  # taken and given back, not a second one
  store.close()


def test_a_wrong_host_schedule_is_caught(store):
  """The CPU handlers compare the host's schedule with the program's values: a schedule that
  names the wrong layer (what a GPU handler would silently use) fails, naming both."""
  xs = jax.random.normal(jax.random.key(5), (3, 64))

  def put(xs, order):
    def one(token, i_x):
      i, x = i_x
      layer = swap.Layer(i, order)  # the program writes layer i; the host thinks `order`
      return token + swap.write(store.handle, "sched", x, layer=layer), None
    return jax.lax.scan(one, jnp.int32(0), (jnp.arange(3), xs))[0]

  jax.jit(lambda xs: put(xs, (0, 1, 2)))(xs).block_until_ready()
  with pytest.raises(Exception, match="host schedule gives rank 0, layer 2 but the program "
                                      "computed rank 0, layer 0"):
    jax.jit(lambda xs: put(xs, (2, 1, 0)))(xs).block_until_ready()
  with pytest.raises(Exception, match="device ordinal 0 is not in the mesh"):
    jax.jit(lambda x: swap.write(store.handle, "sched1", x, ranks=(1, 0)))(xs[0]).block_until_ready()


def test_a_run_that_fails_half_way_does_not_shift_the_next(store):
  """The host counts each call's executions per run: after a run stops at a missing shard, the
  same compiled program runs again from layer 0."""
  like = jax.ShapeDtypeStruct((128,), jnp.float32)
  rows = np.random.default_rng(0).normal(size=(4, 128)).astype(np.float32)
  for layer in (0, 1, 3):
    store.write(f"gap/r0/l{layer}", rows[layer]).wait()
  stream = jax.jit(lambda t: _prefetching_stream(store, ["gap"], t, [like], 4)[0])
  with pytest.raises(Exception, match="no shard 'gap/r0/l2'"):
    stream(0).block_until_ready()
  store.write("gap/r0/l2", rows[2]).wait()
  for _ in range(2):
    np.testing.assert_array_equal(np.asarray(stream(0)), rows)
