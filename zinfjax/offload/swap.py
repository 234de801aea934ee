"""Typed `jax.ffi` wrappers for the swap store's XLA custom calls (CPU).

Each call names its store by handle (a static attribute) and its shard by a
string key plus the device's `rank` and the `layer` as int32 operands, so one
compiled call serves every device of a `shard_map` and every step of a scan.
Reads take the token of the write they depend on: XLA orders custom calls
only through data, so the token is what keeps a read behind its write.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from .. import _ffi  # noqa: F401  (registers the handlers)


def _i32(x) -> jax.Array:
  return jnp.asarray(x, jnp.int32).reshape(())


def write(store: int, key: str, x: jax.Array, *, rank=0, layer=0) -> jax.Array:
  """Write `x` as shard `key/r{rank}/l{layer}`; returns an int32 token once it is on disk."""
  call = jax.ffi.ffi_call("zinfjax_swap_write", jax.ShapeDtypeStruct((), jnp.int32),
                          has_side_effect=True)
  return call(x, _i32(rank), _i32(layer), store=np.int64(store), key=key)


def read(store: int, key: str, like: jax.ShapeDtypeStruct, token, *, rank=0, layer=0) -> jax.Array:
  """Read shard `key/r{rank}/l{layer}` (shaped like `like`) after the write that made `token`."""
  call = jax.ffi.ffi_call("zinfjax_swap_read", jax.ShapeDtypeStruct(like.shape, like.dtype),
                          has_side_effect=True)
  return call(_i32(token), _i32(rank), _i32(layer), store=np.int64(store), key=key)


def read_start(store: int, key: str, token, *, rank=0, layer=0) -> jax.Array:
  """Start reading a shard into an engine-owned buffer; returns a ticket for `read_wait`."""
  return read_start_many(store, [key], token, rank=rank, layer=layer)


def read_wait(store: int, ticket: jax.Array, like: jax.ShapeDtypeStruct) -> jax.Array:
  """Finish a `read_start`: wait for it and return the shard (checked against `like`)."""
  return read_wait_many(store, ticket, [like])[0]


def _keys(keys) -> str:
  return "\n".join(keys)


def write_many(store: int, keys, xs, *, rank=0, layer=0) -> jax.Array:
  """`write` of several leaves' shards (`keys[i]` <- `xs[i]`) as one store job; one token."""
  call = jax.ffi.ffi_call("zinfjax_swap_write_many", jax.ShapeDtypeStruct((), jnp.int32),
                          has_side_effect=True)
  return call(_i32(rank), _i32(layer), *xs, store=np.int64(store), keys=_keys(keys))


def read_start_many(store: int, keys, token, *, rank=0, layer=0) -> jax.Array:
  """`read_start` of several leaves' shards as one store job; one ticket for `read_wait_many`."""
  call = jax.ffi.ffi_call("zinfjax_swap_read_start_many", jax.ShapeDtypeStruct((), jnp.int32),
                          has_side_effect=True)
  return call(_i32(token), _i32(rank), _i32(layer), store=np.int64(store), keys=_keys(keys))


def read_wait_many(store: int, ticket: jax.Array, likes) -> list[jax.Array]:
  """Finish a `read_start_many`: the shards, in its key order (each checked against `likes[i]`)."""
  call = jax.ffi.ffi_call("zinfjax_swap_read_wait_many",
                          [jax.ShapeDtypeStruct(l.shape, l.dtype) for l in likes],
                          has_side_effect=True)
  return list(call(_i32(ticket), store=np.int64(store)))
