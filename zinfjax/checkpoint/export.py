"""A checkpoint's params, read a leaf at a time without a model or a mesh (for export).

Every process of a run saves its own shards into one checkpoint folder; read back, each
leaf is whole. This is how a run of several processes exports its model (`hf.save` takes
a `CheckpointParams`): no process holds every rank's shards of a live `TrainState`.
"""

from __future__ import annotations

import os
from typing import Iterator

import numpy as np

from .handler import open_checked, read
from .leaves import Leaf
from .manager import read_metadata
from .zarr import Array, trim

PREFIXES = ("master/", "params/")  # a trained leaf's fp32 master; a frozen leaf's params
BLOCK_BYTES = 64 << 20  # a slab of `CheckpointParams.blocks`, where a chunk row fits


class CheckpointParams:
  """The params of checkpoint `step` (default: the latest) in `directory`, by leaf path."""

  def __init__(self, directory: str | os.PathLike, step: int | None = None):
    meta = _metadata(os.fspath(directory), step)
    self.step = meta["step"]
    self.folder = os.path.join(os.fspath(directory), str(self.step), "state")
    self.leaves = {name[len(p):]: (name, info) for name, info in meta["leaves"].items()
                   for p in PREFIXES if name.startswith(p)}

  def __iter__(self) -> Iterator[str]:
    return iter(self.leaves)

  def shape(self, path: str) -> tuple[int, ...]:
    """A leaf's logical shape, from the metadata (nothing is read)."""
    return tuple(self.leaves[path][1]["shape"])

  def full_leaf(self, path: str, dtype=np.float32, layer: int | None = None) -> np.ndarray:
    """One leaf (e.g. "layers/block/q/kernel") in its logical shape: its master where it
    trained, else its params; with `layer`, its entry along the first axis alone (a stacked
    leaf's layer: only that is read). KeyError for a path the checkpoint does not hold."""
    arr, leaf = self._open(path)
    if layer is not None and (not leaf.shape or not 0 <= layer < leaf.shape[0]):
      raise IndexError(f"checkpoint leaf {path!r} of shape {list(leaf.shape)} has no layer "
                       f"{layer}.")
    data = self._rows(arr, leaf, dtype, None if layer is None else (layer, layer + 1))
    return data if layer is None else data[0]

  def blocks(self, path: str, dtype=np.float32, max_bytes: int = BLOCK_BYTES
             ) -> Iterator[np.ndarray]:
    """A leaf in slabs along its first axis, in order, each whole stored chunk rows (a stacked
    leaf's layers), as many as fit `max_bytes` (at least one): a writer that writes each slab
    before the next is read holds one slab, not the leaf. A scalar comes whole."""
    arr, leaf = self._open(path)
    if not leaf.shape:
      yield self._rows(arr, leaf, dtype)
      return
    rows = arr.chunk[0]
    row_bytes = int(np.prod(leaf.shape[1:], dtype=np.int64)) * np.dtype(dtype).itemsize * rows
    step = rows * max(1, max_bytes // max(row_bytes, 1))
    try:  # one slab's staging buffers, reused by the next slab's read
      for start in range(0, leaf.shape[0], step):
        yield self._rows(arr, leaf, dtype, (start, min(start + step, leaf.shape[0])), keep=True)
    finally:
      trim()

  def _open(self, path: str) -> tuple[Array, Leaf]:
    if path not in self.leaves:
      raise KeyError(f"checkpoint step {self.step} holds no leaf {path!r}.")
    name, info = self.leaves[path]
    leaf = Leaf(name, tuple(info["shape"]), np.dtype(info["dtype"]), None, [])
    return open_checked(os.path.join(self.folder, name), leaf), leaf

  @staticmethod
  def _rows(arr: Array, leaf: Leaf, dtype, rows: tuple[int, int] | None = None,
            keep: bool = False) -> np.ndarray:
    """Rows `rows` of the leaf's first axis (default: the whole leaf), in `dtype`; the staging
    buffers of the read freed unless `keep`."""
    index = tuple(slice(0, n) for n in leaf.shape)
    if rows is not None:
      index = (slice(*rows), *index[1:])
    data = read(arr, index, leaf, np.dtype(dtype))
    if not keep:
      trim()
    return data


def _metadata(directory: str, step: int | None) -> dict:
  """The metadata of `step` (default: the latest), its committed steps listed by this process
  alone: no `Checkpointer`, whose manager syncs with a run's other processes."""
  names = os.listdir(directory) if os.path.isdir(directory) else []
  steps = sorted(int(n) for n in names
                 if n.isdigit() and os.path.exists(os.path.join(directory, n, "meta", "metadata")))
  return read_metadata(directory, step, steps)


def master_params(directory: str | os.PathLike, step: int | None = None
                  ) -> Iterator[tuple[str, np.ndarray]]:
  """`(leaf name, fp32 array)` of a checkpoint's master params (a frozen leaf: its stored
  params), one leaf at a time in full logical shape, without building a model or a mesh (for
  export, like `zero_to_fp32`)."""
  params = CheckpointParams(directory, step)
  for path in params:
    yield path, params.full_leaf(path)
