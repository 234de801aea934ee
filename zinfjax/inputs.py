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
    if x.ndim == 0:
      raise ValueError(
          "a batch leaf is a scalar: every leaf needs a leading example axis to split over the "
          f"{dp} devices. Repeat a per-step value for each example (np.full(batch_size, value)).")
    if x.shape[0] == 0:
      raise ValueError(f"batch leaf of shape {tuple(x.shape)} holds no examples: a step needs "
                       f"at least one per device ({dp}).")
    if x.shape[0] % dp:
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

  leaves, treedef = jax.tree_util.tree_flatten_with_path(batch)
  for path, x in leaves:  # a list of numbers flattens into one scalar leaf per number
    if path and isinstance(path[-1], jax.tree_util.SequenceKey) and isinstance(
        x, (int, float, bool)):
      while path and isinstance(path[-1], jax.tree_util.SequenceKey):  # the outermost list
        path = path[:-1]
      raise ValueError(
          f"batch leaf {jax.tree_util.keystr(path) or 'batch'} is a Python list of numbers: "
          "give an array (np.asarray(...)), whose leading axis counts the examples.")
  arrays = [x if isinstance(x, jax.Array) else np.asarray(x) for _, x in leaves]
  for (path, _), x in zip(leaves, arrays):  # bf16 and the other ml_dtypes are kind "V" too
    if x.dtype.kind in "OSUMm" or x.dtype.fields is not None:
      raise ValueError(
          f"batch leaf {jax.tree_util.keystr(path) or 'batch'} holds {x.dtype} values: a batch "
          "holds numeric arrays only. Tokenize text, and keep other per-example data out of it.")
  check_examples([path for path, _ in leaves], arrays)
  return jax.tree.unflatten(treedef, [put(x) for x in arrays])


def check_examples(paths: list, arrays: list) -> None:
  """Every batch leaf's leading axis counts the same examples: a clear error where not (the
  split would pair one device's inputs with another's targets, or fail in a reshape)."""
  if len({x.shape[0] for x in arrays if x.ndim}) > 1:
    listed = ", ".join(f"{jax.tree_util.keystr(p) or 'batch'} has {x.shape[0]}"
                       for p, x in zip(paths, arrays) if x.ndim)
    raise ValueError(f"the batch's leaves hold different numbers of examples on their leading "
                     f"axis ({listed}); every leaf's first axis must count the same examples.")
