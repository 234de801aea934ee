"""Restoring array sources: the stored leaves read chunk by chunk into every device's buffer.

Leaves are read in groups of about `GROUP_BYTES`, all their chunks in one
stream over the I/O threads (a leaf at a time drains the drive's queue at
every small leaf), each chunk scattered into the devices' buffers by the
engine thread that read it. The buffers are aligned, so on a CPU platform the
arrays take them over with no copy. Where `device_put` copies them (an
accelerator's memory), they are carved from two reusable `Staging` regions
instead: a group is read into one while the other's copies finish, so host
memory holds two groups and a restore touches fresh pages once, not once per
group (first touches of host memory can cost more than the drive's time).
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import numpy as np

from .. import _engine
from ..offload.aligned import aligned_empty
from ..partition import Region, bounding, clip, norm_region, shifted, size
from ..progress import Tally
from .errors import CheckpointError
from .leaves import Leaf, Source
from .zarr import Array, Part, each

GROUP_BYTES = 1 << 30  # host buffers filled before they become arrays
STAGE_ON_CPU = False   # stage through `Staging` on CPU devices too (tests of the accelerator path)

Alloc = Callable[[Any, Any], np.ndarray]  # (shape, dtype) -> an aligned host buffer


class Staging:
  """Aligned host buffers carved one after another from one region that is reused: `reset`
  starts over (after every array made from the last buffers has been copied)."""

  def __init__(self):
    self.region: np.ndarray | None = None
    self.used = 0

  def reset(self, nbytes: int) -> None:
    """Start over, with room for at least `nbytes` (the region grows if it must; touched once
    when made, so later reads fill mapped pages)."""
    if self.region is None or self.region.size < nbytes:
      self.region = None
      self.region = aligned_empty(max(nbytes, 1), np.uint8)
      self.region.fill(0)
    self.used = 0

  def take(self, shape, dtype) -> np.ndarray:
    """The next aligned buffer of `shape` and `dtype` (a fresh one once the region is full)."""
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if self.region is None or self.used + nbytes > self.region.size:
      return aligned_empty(shape, dtype)
    buf = self.region[self.used:self.used + nbytes].view(dtype).reshape(shape)
    self.used += _engine.align_up(nbytes)
    return buf


def checked(leaf: Leaf, read: Callable[[], Any]) -> Any:
  """`read()`, with damaged chunks (the engine's CorruptShardError, tensorstore's errors)
  raised as a CheckpointError naming the leaf."""
  try:
    return read()
  except Exception as e:
    raise CheckpointError(f"checkpoint array {leaf.name!r} is damaged or truncated ({e}).") from e


def fill(arr: Array, leaf: Leaf, region: Region, targets: list[Part]) -> None:
  """Read `region` (storage coordinates) of a stored leaf into the `targets` (box, buffer);
  the padding past the shape is not read (the buffers hold zeros there)."""
  clipped = clip(region, leaf.shape)
  if all(s.start < s.stop for s in clipped):  # else all padding
    checked(leaf, lambda: arr.scatter(clipped, targets))


def layers(region: Region, stacked: bool) -> list[Region]:
  """`region` one layer at a time (a stacked leaf: host memory holds a layer), else whole."""
  if not stacked:
    return [region]
  return [(slice(l, l + 1),) + tuple(region[1:]) for l in range(region[0].start, region[0].stop)]


class LeafRead:
  """The array sources of one leaf (e.g. the master and the compute params cast from it),
  read from its stored array once: `jobs` fill the host buffers (the engine scatters each
  chunk into every buffer, cast on the way), `arrays` makes them jax.Arrays with the
  targets' shapes, dtypes and shardings (memory kinds included)."""

  def __init__(self, arr: Array, leaf: Leaf, srcs: list[Source]):
    self.arr, self.leaf, self.srcs = arr, leaf, srcs
    self.placed, self.regions = [], {}
    for src in srcs:
      target = src.array
      dtype = np.dtype(target.dtype)
      devices = []
      for device, index in target.sharding.addressable_devices_indices_map(target.shape).items():
        region = shifted(norm_region(index, target.shape), leaf.layout, src.start)
        key = (tuple((x.start, x.stop) for x in region), dtype)
        self.regions.setdefault(key, region)  # targets that share a region read it once
        devices.append((device, key))
      self.placed.append(devices)
    self.outs: dict = {}
    self.nbytes = sum(size(r) * key[1].itemsize for key, r in self.regions.items())
    # host bytes if every buffer is staged (targets that share a region share its buffer)
    self.staged_bytes = sum(_engine.align_up(size(r) * key[1].itemsize) for key, r in self.regions.items())

  @property
  def copied(self) -> bool:
    """Whether `device_put` copies the buffers (an accelerator's memory), so they may be
    reused once the copies are done."""
    return STAGE_ON_CPU or any(d.platform != "cpu" for devices in self.placed for d, _ in devices)

  def jobs(self, alloc: Alloc = aligned_empty) -> list[Callable[[], None]]:
    """One read per layer of the leaf (each a layer's chunks, scattered as they come)."""
    self.outs = {k: host_buffer(r, k[1], self.leaf, alloc) for k, r in self.regions.items()}
    stacked = self.leaf.layout is not None and self.leaf.layout.stacked
    return [lambda p=p: self._load(p) for p in layers(bounding(list(self.regions.values())), stacked)]

  def _load(self, piece: Region) -> None:
    fill(self.arr, self.leaf, piece, [(region, self.outs[key]) for key, region in self.regions.items()])

  def arrays(self, copy: bool = False) -> list[jax.Array]:
    """One jax.Array per source, from the filled buffers: taken over, or with `copy` copied
    (the buffers are then reused once the arrays are ready, and shared by the targets)."""
    taken: set = set()
    out = []
    for src, devices in zip(self.srcs, self.placed):
      sharding = src.array.sharding
      if copy:  # a CPU device takes a numpy buffer over whatever `may_alias` says
        bufs = [np.array(self.outs[key]) if d.platform == "cpu" else self.outs[key] for d, key in devices]
      else:
        bufs = [_own(self.outs[key], key, taken) for _, key in devices]
      parts = jax.device_put(bufs, [jax.sharding.SingleDeviceSharding(
          device, memory_kind=sharding.memory_kind) for device, _ in devices],
          may_alias=False if copy else None)
      out.append(jax.make_array_from_single_device_arrays(src.array.shape, sharding, parts))
    self.outs = {}
    return out


def read_leaves(reads: list[LeafRead], tally: Tally) -> list[list[jax.Array]]:
  """`arrays()` of every read, the reads of a group of leaves (about `GROUP_BYTES`) in one
  stream over the I/O threads; each group's bytes counted to `tally` once placed. Where every
  array is a copy, the groups' host buffers come from two `Staging` regions in turn, each
  reused once the arrays made from it are ready."""
  out: list[list[jax.Array]] = []
  staged = bool(reads) and all(r.copied for r in reads)
  stages = [(Staging(), []), (Staging(), [])]  # (region, the arrays made from it last)
  start = 0
  while start < len(reads):
    stop, size = start, 0
    while stop < len(reads) and (stop == start or size + reads[stop].nbytes <= GROUP_BYTES):
      size += reads[stop].nbytes
      stop += 1
    group = reads[start:stop]
    alloc: Alloc = aligned_empty
    if staged:
      stage, made = stages[0]
      jax.block_until_ready(made)  # its copies are done: its region may be overwritten
      stage.reset(sum(r.staged_bytes for r in group))
      alloc = stage.take
    each(lambda job: job(), [job for r in group for job in r.jobs(alloc)])
    arrays = [r.arrays(copy=staged) for r in group]
    out += arrays
    tally.add(size)
    if staged:
      stages = [stages[1], (stages[0][0], arrays)]
    start = stop
  return out


def host_buffer(region: Region, dtype: np.dtype, leaf: Leaf, alloc: Alloc = aligned_empty) -> np.ndarray:
  """An aligned host buffer for `region` of a leaf (from `alloc`), zero where the region is
  padding."""
  buf = alloc([x.stop - x.start for x in region], dtype)
  if clip(region, leaf.shape) != tuple(region):
    buf.fill(0)
  return buf


def _own(buf: np.ndarray, key, taken: set) -> np.ndarray:
  """`buf` for one device array: itself the first time it is wanted, else an aligned copy (an
  array may take over its buffer, so none is shared)."""
  if key not in taken:
    taken.add(key)
    return buf
  out = aligned_empty(buf.shape, buf.dtype)
  np.copyto(out, buf)
  return out
