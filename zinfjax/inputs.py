"""Host batches placed on the mesh, split over the data axis."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P


def shard_batch(engine, batch: Any) -> Any:
  """Place a host batch on the mesh, split on its leading axis; clear error if uneven."""
  axis, dp, n = engine.plan.axis, engine.dp, engine.config.micro_batches
  sharding = NamedSharding(engine.mesh, P(axis))

  def put(x):
    x = x if isinstance(x, jax.Array) else np.asarray(x)
    if x.ndim == 0 or x.shape[0] % dp:
      raise ValueError(
          f"batch leaf of shape {tuple(x.shape)} does not split over {dp} devices on "
          f"axis {axis!r}; use a batch size that is a multiple of {dp}.")
    if x.shape[0] // dp % n:
      raise ValueError(
          f"batch leaf of shape {tuple(x.shape)} gives {x.shape[0] // dp} examples per device, "
          f"which ZeroConfig.micro_batches={n} does not divide; use a batch size that is a "
          f"multiple of {dp * n} ({dp} devices x {n} micro-batches).")
    if jax.process_count() > 1:  # every process holds the global batch; each places its rows
      return jax.make_array_from_callback(x.shape, sharding, lambda index: np.asarray(x[index]))
    return jax.device_put(x, sharding)

  return jax.tree.map(put, batch)
