"""The orbax handler: each process saves and restores its own shards of every leaf's sources.

Array sources are copied to host memory in `save` and written in the
background; NVMe sources are streamed from the swap store into the checkpoint
a few shards at a time before `save` returns (the next step overwrites them in
place), and on restore streamed from the checkpoint into the store.
"""

from __future__ import annotations

import ctypes
import dataclasses
import os
from typing import Any, Callable

import jax
import numpy as np
import orbax.checkpoint as ocp
import tensorstore as ts
from orbax.checkpoint._src import asyncio_utils
from orbax.checkpoint._src.futures import future

from ..placement import Plan, shard_key
from ..partition import Region, clip, local, norm_region, overlap, shifted
from .leaves import Leaf, Source, chunks
from .zarr import Array, each, spec, write_chunks

IN_FLIGHT = 8  # NVMe shards on their way to the checkpoint at once (each one in host memory)


class CheckpointError(ValueError):
  """A checkpoint that cannot be restored here (missing, damaged, or from another run)."""


class CheckpointMismatch(CheckpointError):
  """A sound checkpoint of another model or optimizer: no other step of it restores here."""


@dataclasses.dataclass
class Run:
  """What the handler needs of the running engine."""

  leaves: list[Leaf]
  plan: Plan
  store: Any = None     # the process's swap store (NVMe sources)


def block_ranks(plan: Plan) -> int:
  """Ranks per chunk on the split axis: each process's ranks when every process owns one
  contiguous, equal block of the data axis (then a chunk is one process's part of one layer:
  fewer, larger files, each written whole by its process), else 1 (a chunk per rank)."""
  owners = [d.process_index for d in plan.mesh.devices.reshape(-1)]
  n = len(set(owners))
  k = len(owners) // n
  blocks = [owners[i:i + k] for i in range(0, len(owners), k)]
  ok = len(owners) == n * k and all(len(set(b)) == 1 for b in blocks) and len(
      {b[0] for b in blocks}) == n
  return k if ok else 1


def _bounding(regions: list[Region]) -> Region:
  return tuple(slice(min(r[i].start for r in regions), max(r[i].stop for r in regions))
               for i in range(len(regions[0])))


def _blocks(leaf: Leaf, src: Source) -> list[tuple[Region, np.ndarray]]:
  """This process's shards of an array source, copied to host memory (the state is donated
  next) as one block per run of adjacent shards: (region inside the logical shape, data)."""
  shards = [(shifted(norm_region(sh.index, src.array.shape), leaf.layout, src.start), sh)
            for sh in src.array.addressable_shards if not sh.replica_id]
  if not shards:  # another process holds the copy that is written
    return []
  box = _bounding([r for r, _ in shards])
  dense = sum(int(np.prod([x.stop - x.start for x in r])) for r, _ in shards) == int(
      np.prod([x.stop - x.start for x in box]))
  groups = [(box, shards)] if dense else [(r, [(r, sh)]) for r, sh in shards]
  out = []
  for region, members in groups:
    clipped = clip(region, leaf.shape)
    data = np.empty([x.stop - x.start for x in clipped], np.dtype(src.array.dtype))
    for r, sh in members:
      inside = clip(r, leaf.shape)
      data[local(inside, clipped)] = np.asarray(sh.data)[local(inside, r)]
    out.append((clipped, data))
  return out


def _layers(region: Region, stacked: bool) -> list[Region]:
  """`region` one layer at a time (a stacked leaf: host memory holds a layer), else whole."""
  if not stacked:
    return [region]
  return [(slice(l, l + 1),) + tuple(region[1:]) for l in range(region[0].start, region[0].stop)]


def _units(run: Run, leaf: Leaf, src: Source):
  """(rank, layer, region in storage coordinates) of this process's swap-store shards."""
  for rank in run.plan.ranks:
    for layer in range(src.start, src.stop):
      yield rank, layer, run.plan.region(leaf.plan, rank, layer)


class StateHandler(ocp.AsyncCheckpointHandler):
  """Saves and restores `Leaf`s as zarr3 arrays, each process its own shards."""

  def __init__(self):
    self._barriers = 0

  def _sync(self, what: str) -> None:
    self._barriers += 1
    ocp.multihost.sync_global_processes(f"zinfjax_{what}_{self._barriers}")

  async def async_save(self, directory, args: "StateSave") -> list:
    run = args.run
    if jax.process_index() == 0:
      group = block_ranks(run.plan)
      opened = [ts.open(spec(os.fspath(directory / leaf.name), leaf.shape, leaf.dtype,
                             chunks(leaf, run.plan.dp, group))) for leaf in run.leaves]
      for o in opened:
        o.result()
    self._sync("created")
    writes: list[tuple[str, Region, np.ndarray]] = []
    for leaf in run.leaves:
      path = os.fspath(directory / leaf.name)
      for src in leaf.sources:
        if src.derived:
          continue
        if src.array is None:  # NVMe: stream now, shard by shard, before the next step rewrites it
          _stream_nvme_to(path, leaf, src, run)
          continue
        writes += [(path, region, data) for region, data in _blocks(leaf, src)]

    async def commit():
      save_blocks(writes)
      _durable(os.fspath(directory))  # on the drive before orbax commits the step

    return [future.CommitFutureAwaitingContractedSignals(commit(), name="zinfjax_state")]

  def save(self, directory, args: "StateSave") -> None:
    async def run():
      for f in await self.async_save(directory, args):
        f.result()
    asyncio_utils.run_sync(run())

  def restore(self, directory, args: "StateRestore") -> dict[str, jax.Array]:
    run = args.run
    out = {}
    for leaf in run.leaves:
      arr = open_checked(os.fspath(directory / leaf.name), leaf)
      for k, src in enumerate(leaf.sources):
        if src.keys:
          _stream_to_nvme(arr, leaf, src, run)
        if src.array is not None:
          out[f"{leaf.name}#{k}"] = _read_array(arr, leaf, src)
    return out


@ocp.args.register_with_handler(StateHandler, for_save=True)
@dataclasses.dataclass
class StateSave(ocp.args.CheckpointArgs):
  run: Run


@ocp.args.register_with_handler(StateHandler, for_restore=True)
@dataclasses.dataclass
class StateRestore(ocp.args.CheckpointArgs):
  run: Run


def save_blocks(writes: list[tuple[str, Region, np.ndarray]]) -> None:
  """Write (array folder, region, data) blocks: whole chunks by the engine in few calls (the
  drive kept busy), anything else through tensorstore."""
  grids: dict[str, Array] = {}
  whole, others = [], []
  for path, region, data in writes:
    arr = grids.setdefault(path, Array(path))
    if arr.grid is not None and arr.grid.whole(region):
      whole.append((arr.grid, region, data))
    else:
      others.append(arr.write(region, data))
  write_chunks(whole)
  for wait in others:
    wait()


def read(arr, region: Region, leaf: Leaf, dtype) -> np.ndarray:
  """`region` (storage coordinates) of a stored leaf, zero where it is padding."""
  return read_async(arr, region, leaf, dtype)()


def read_async(arr, region: Region, leaf: Leaf, dtype) -> Callable[[], np.ndarray]:
  """Start reading `region`; the returned function waits for it (see `read`). Reads started
  together run in parallel: one small chunk at a time leaves the drive idle."""
  clipped = clip(region, leaf.shape)
  pending = arr.read(clipped)
  return lambda: _padded(pending, clipped, region, leaf, dtype)


def _padded(data: Callable[[], np.ndarray], clipped: Region, region: Region, leaf: Leaf,
            dtype) -> np.ndarray:
  """The data of `clipped` (from `data()`) as `region`, zero where it is padding."""
  try:
    x = data()
  except Exception as e:  # damaged chunks: the engine's CorruptShardError, tensorstore's errors
    raise CheckpointError(f"checkpoint array {leaf.name!r} is damaged or truncated ({e}).") from e
  if clipped == tuple(region):  # no padding in it: the data as read
    return x.astype(dtype, copy=False)
  out = np.zeros([s.stop - s.start for s in region], dtype)
  out[local(clipped, region)] = x
  return out


def _ahead(starts: list[Callable[[], Callable[[], Any]]], depth: int = IN_FLIGHT):
  """Yield the results of `starts` in order, with up to `depth` of them started ahead."""
  running = [start() for start in starts[:depth]]
  for i in range(len(starts)):
    if i + depth < len(starts):
      running.append(starts[i + depth]())
    yield running.pop(0)()


def _read_array(arr, leaf: Leaf, src: Source) -> jax.Array:
  """A jax.Array with the target's shape, dtype and sharding (memory kind included): the
  process's block of the stored leaf read one layer at a time (several at once), each
  layer's chunks read once and sliced into every device's shard by the thread that read it."""
  target = src.array
  sharding = target.sharding
  placed, regions = [], {}
  for device, index in sharding.addressable_devices_indices_map(target.shape).items():
    region = shifted(norm_region(index, target.shape), leaf.layout, src.start)
    key = tuple((x.start, x.stop) for x in region)
    regions.setdefault(key, region)  # replicated targets read each region once
    placed.append((device, key))
  # filled whole by the layers below (their box covers every region)
  outs = {k: np.empty([x.stop - x.start for x in r], target.dtype) for k, r in regions.items()}
  pieces = _layers(_bounding(list(regions.values())), leaf.layout is not None and leaf.layout.stacked)

  def load(piece: Region) -> None:  # on an I/O thread: the read, then its slices
    clipped = clip(piece, leaf.shape)
    data = _padded(lambda: arr.read_now(clipped), clipped, piece, leaf, target.dtype)
    for key, region in regions.items():
      inter = overlap(piece, region)
      if inter is not None:
        outs[key][local(inter, region)] = data[local(inter, piece)]

  each(load, pieces)
  arrays = [jax.device_put(outs[key], jax.sharding.SingleDeviceSharding(
      device, memory_kind=sharding.memory_kind)) for device, key in placed]
  return jax.make_array_from_single_device_arrays(target.shape, sharding, arrays)


def _by_layer(units: list) -> list[tuple[int, list]]:
  """(layer, [(rank, region)]) of `_units`, layer by layer."""
  layers: dict[int, list] = {}
  for rank, layer, region in units:
    layers.setdefault(layer, []).append((rank, region))
  return sorted(layers.items())


def _stream_to_nvme(arr, leaf: Leaf, src: Source, run: Run) -> None:
  """Write this process's swap-store shards of a source from the checkpoint: its block of each
  layer read once (`IN_FLIGHT` layers ahead), sliced per rank."""
  layers = _by_layer(list(_units(run, leaf, src)))
  boxes = [_bounding([r for _, r in ranks]) for _, ranks in layers]
  reads = _ahead([lambda b=b: read_async(arr, b, leaf, np.float32) for b in boxes])
  tickets = []
  for (layer, ranks), box, block in zip(layers, boxes, reads):
    for t in tickets:
      t.wait()
    tickets = [run.store.write(shard_key(base, rank, layer),
                               block[local(region, box)].reshape(leaf.plan.local_shape).astype(dtype))
               for rank, region in ranks for base, dtype in src.keys]
  for t in tickets:
    t.wait()


def _stream_nvme_to(path: str, leaf: Leaf, src: Source, run: Run) -> None:
  """Copy this process's swap-store shards of a source into the checkpoint array at `path`:
  each layer's shards (read `IN_FLIGHT` ahead) joined into the process's block, one write."""
  arr = Array(path)
  base = src.keys[0][0]
  replicated = leaf.layout.axis is None
  layers = _by_layer([u for u in _units(run, leaf, src) if not replicated or u[0] == 0])
  order = [(layer, rank) for layer, ranks in layers for rank, _ in ranks]
  reads = _ahead([lambda u=u: run.store.read(shard_key(base, u[1], u[0])).wait for u in order])
  writing: list = []  # at most 2 layers' blocks in host memory besides the reads
  for layer, ranks in layers:
    box = clip(_bounding([r for _, r in ranks]), leaf.shape)
    block = np.empty([x.stop - x.start for x in box], np.float32)
    for (rank, region), data in zip(ranks, reads):
      inside = clip(region, leaf.shape)
      data = data.reshape([x.stop - x.start for x in region])
      block[local(inside, box)] = data[local(inside, region)]
    if len(writing) >= 2:
      writing.pop(0)()
    writing.append(arr.write(box, block))
  for wait in writing:
    wait()


def _durable(directory: str) -> None:
  """Flush the file system holding `directory` (Linux `syncfs`; elsewhere `os.sync`): every
  chunk file written without its own fsync is on the drive when this returns."""
  fd = os.open(directory, os.O_RDONLY)
  try:
    syncfs = getattr(ctypes.CDLL(None, use_errno=True), "syncfs", None)
    if syncfs is None or syncfs(fd) != 0:
      os.sync()
  finally:
    os.close(fd)


def open_checked(path: str, leaf: Leaf) -> Array:
  """The stored array of `leaf`, after checking it is all there."""
  if not os.path.isdir(path):
    raise CheckpointError(f"checkpoint has no array {leaf.name!r} (no folder {path}).")
  try:
    arr = Array(path)
    arr.shape  # noqa: B018 - opens an array that is not plain zarr3 (tensorstore reads it)
  except Exception as e:
    raise CheckpointError(f"checkpoint array {leaf.name!r} at {path} cannot be opened ({e}).") from e
  if arr.shape:
    chunk = arr.chunk
    expected = int(np.prod([-(-n // c) for n, c in zip(arr.shape, chunk)], dtype=np.int64))
    found = sum(len(files) for _, _, files in os.walk(os.path.join(path, "c")))
  else:  # a scalar is one chunk file named "c"
    expected, found = 1, int(os.path.exists(os.path.join(path, "c")))
  if found < expected:
    raise CheckpointError(
        f"checkpoint array {leaf.name!r} at {path} is truncated: {found} of its {expected} "
        "chunks are there (a save that did not finish, or files lost).")
  return arr
