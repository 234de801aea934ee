"""ZeRO partitioning rules: which axis of each leaf is split over `data`, and its padding.

Bandwidth-centric partitioning: each rank owns 1/dp of *every* tensor, so
every rank's links move data at once and an all-gather rebuilds the tensor.
A leaf's storage form is its logical shape with one axis (never the layer
axis of a stacked leaf) padded to a multiple of dp and split over `data`;
leaves under the persistence threshold stay whole on every rank.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

Path = tuple[str, ...]
Region = tuple[slice, ...]   # a box of a leaf, one slice per axis


@dataclasses.dataclass(frozen=True)
class LeafLayout:
  """Where one leaf lives: logical `shape`, split `axis` (None: replicated), padded size."""

  shape: tuple[int, ...]
  axis: int | None
  padded: int
  stacked: bool = False

  @property
  def storage_shape(self) -> tuple[int, ...]:
    if self.axis is None:
      return self.shape
    return self.shape[:self.axis] + (self.padded,) + self.shape[self.axis + 1:]

  @property
  def padding(self) -> int:
    return 0 if self.axis is None else self.padded - self.shape[self.axis]

  def spec(self, axis_name: str) -> P:
    """PartitionSpec of the storage form."""
    if self.axis is None:
      return P()
    return P(*([None] * self.axis + [axis_name]))

  def local_shape(self, dp: int) -> tuple[int, ...]:
    """One rank's shard of one layer, out of `dp` ranks."""
    shape = list(self.storage_shape)
    if self.axis is not None:
      shape[self.axis] //= dp
    return tuple(shape[1:] if self.stacked else shape)

  def layer(self) -> "LeafLayout":
    """Layout of one layer's slice of a stacked leaf."""
    if not self.stacked:
      raise ValueError("layer() is only defined for stacked leaves.")
    axis = None if self.axis is None else self.axis - 1
    return LeafLayout(self.shape[1:], axis, self.padded, stacked=False)

  def pad(self, x: jax.Array) -> jax.Array:
    """Logical -> storage shape (zeros appended on the split axis)."""
    if not self.padding:
      return x
    widths = [(0, 0)] * x.ndim
    widths[self.axis] = (0, self.padding)
    return jnp.pad(x, widths)

  def unpad(self, x: jax.Array) -> jax.Array:
    """Storage -> logical shape."""
    if not self.padding:
      return x
    return jax.lax.slice_in_dim(x, 0, self.shape[self.axis], axis=self.axis)


def leaf_layout(shape: tuple[int, ...], dp: int, *, stacked: bool = False,
                persistence_threshold: int = 0) -> LeafLayout:
  """Choose the split axis of one leaf.

  The largest axis divisible by `dp` wins (no padding); if none divides, the
  largest axis is padded up. The layer axis of a stacked leaf is never split,
  so a scan can slice one layer's shard locally.
  """
  shape = tuple(int(s) for s in shape)
  first = 1 if stacked else 0
  candidates = list(range(first, len(shape)))
  per_layer = math.prod(shape[first:])
  if dp == 1 or not candidates or per_layer < max(persistence_threshold, dp):
    return LeafLayout(shape, None, 0, stacked)
  divisible = [a for a in candidates if shape[a] % dp == 0]
  pool = divisible or candidates
  axis = max(pool, key=lambda a: (shape[a], -a))
  padded = -(-shape[axis] // dp) * dp
  return LeafLayout(shape, axis, padded, stacked)


def plan_layouts(abstract_params: Any, stacked_prefixes: set[Path], dp: int,
                 persistence_threshold: int = 0) -> Any:
  """A `LeafLayout` for every leaf of `abstract_params` (same tree structure)."""

  def one(path, leaf):
    keys = tuple(key_name(k) for k in path)
    stacked = any(keys[:len(p)] == p for p in stacked_prefixes)
    return leaf_layout(leaf.shape, dp, stacked=stacked,
                       persistence_threshold=persistence_threshold)

  return jax.tree_util.tree_map_with_path(one, abstract_params)


def key_name(key) -> str:
  """The name of one step of a pytree path (dict key, attribute or index)."""
  for attr in ("key", "name", "idx"):
    if hasattr(key, attr):
      return str(getattr(key, attr))
  return str(key)


def is_layout(x) -> bool:
  return isinstance(x, LeafLayout)


# ---------------------------------------------------------------- regions of the storage form
def norm_region(index: tuple, shape: tuple[int, ...]) -> Region:
  """A device's index (slices, maybe open) as concrete [start, stop) slices of `shape`."""
  return tuple(slice(*s.indices(n)[:2]) for s, n in zip(index, shape))


def shifted(region: Region, layout: LeafLayout | None, start: int) -> Region:
  """A region of layers [start, ...) of a stacked leaf moved to the whole leaf's coordinates."""
  if not start or layout is None or not layout.stacked:
    return region
  return (slice(region[0].start + start, region[0].stop + start),) + tuple(region[1:])


def clip(region: Region, shape: tuple[int, ...]) -> Region:
  """The part of `region` (storage coordinates, maybe padded) inside the logical `shape`."""
  return tuple(slice(min(s.start, n), min(s.stop, n)) for s, n in zip(region, shape))


def local(clipped: Region, region: Region) -> Region:
  """`clipped` in the coordinates of the box `region` (where it lands in a region-sized array)."""
  return tuple(slice(c.start - r.start, c.stop - r.start) for c, r in zip(clipped, region))


def overlap(a: Region, b: Region) -> Region | None:
  """The box two regions share, or None if they do not meet."""
  box = tuple(slice(max(x.start, y.start), min(x.stop, y.stop)) for x, y in zip(a, b))
  return None if any(s.start >= s.stop for s in box) else box


def size(region: Region) -> int:
  """Elements in a box."""
  return math.prod(s.stop - s.start for s in region)


def bounding(regions: list[Region]) -> Region:
  """The smallest box holding every region."""
  return tuple(slice(min(r[i].start for r in regions), max(r[i].stop for r in regions))
               for i in range(len(regions[0])))
