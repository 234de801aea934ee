"""Embedding lookups in the table's own dtype.

`nnx.Embed` fixes the dtype of its output when it is built (the fp32 of its
freshly initialized table) and promotes every lookup to it. Under mixed
precision zinfjax hands the model bf16 params, so that promotion would turn
the very first activation into fp32 and carry fp32 through every block: fp32
matrix products instead of bf16 ones, twice the activation memory, and no
fused attention (cuDNN takes 16-bit inputs only). `lookup` returns the rows
in the dtype the table has now: bf16 under mixed precision, fp32 in fp32 runs.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx


def lookup(embed: nnx.Embed, ids: jax.Array) -> jax.Array:
  """Rows `ids` of `embed`'s table, in the table's dtype (`ids` integer, any shape). An id
  outside the table, negative ones included (which `jnp.take` would count from the end), gives
  a row of NaN: a wrong id shows in the loss instead of training on another token's row."""
  if not jnp.issubdtype(ids.dtype, jnp.integer):
    raise ValueError(f"embedding lookups take integer ids, got {ids.dtype}.")
  table = embed.embedding[...]
  ids = jnp.where(ids < 0, table.shape[0], ids)  # past the end: filled
  return jnp.take(table, ids, axis=0, mode="fill", fill_value=jnp.nan)
