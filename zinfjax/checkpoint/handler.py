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
from ..partition import Region, clip, local, norm_region, shifted
from .leaves import Leaf, Source, chunks

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


def spec(path: str, leaf: Leaf | None = None, dp: int = 1) -> dict:
  # an open option, not stored: without it, all-zero chunks (fresh moments) would not be written
  # many small chunks: keep the disk busy, and do not fsync each chunk file (one syncfs of the
  # whole checkpoint before it commits, `_durable`, costs what the data costs, not per file)
  out = {"driver": "zarr3", "kvstore": {"driver": "file", "path": path},
         "store_data_equal_to_fill_value": True,
         "context": {"file_io_concurrency": {"limit": 16}, "file_io_sync": False}}
  if leaf is None:
    return {**out, "open": True}
  metadata = {"shape": list(leaf.shape), "data_type": np.dtype(leaf.dtype).name,
              "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": chunks(leaf, dp)}},
              "codecs": [{"name": "bytes", "configuration": {"endian": "little"}},
                         {"name": "crc32c"}]}
  return {**out, "metadata": metadata, "create": True, "delete_existing": True}


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
      opened = [ts.open(spec(os.fspath(directory / leaf.name), leaf, run.plan.dp))
                for leaf in run.leaves]
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
        for shard in src.array.addressable_shards:
          if shard.replica_id:
            continue
          region = shifted(norm_region(shard.index, src.array.shape), leaf.layout, src.start)
          clipped = clip(region, leaf.shape)
          data = np.array(shard.data)[local(clipped, region)]  # a copy: the state is donated next
          writes.append((path, clipped, data))

    async def commit():
      arrays: dict[str, Any] = {}
      pending = []
      for path, region, data in writes:
        if path not in arrays:
          arrays[path] = ts.open(spec(path)).result()
        pending.append(arrays[path][region].write(data))
      for p in pending:
        p.result()
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


def read(arr, region: Region, leaf: Leaf, dtype) -> np.ndarray:
  """`region` (storage coordinates) of a stored leaf, zero where it is padding."""
  return read_async(arr, region, leaf, dtype)()


def read_async(arr, region: Region, leaf: Leaf, dtype) -> Callable[[], np.ndarray]:
  """Start reading `region`; the returned function waits for it (see `read`). Reads started
  together run in parallel: one small chunk at a time leaves the drive idle."""
  clipped = clip(region, leaf.shape)
  pending = arr[clipped].read()

  def finish() -> np.ndarray:
    out = np.zeros([s.stop - s.start for s in region], dtype)
    try:
      data = pending.result()
    except Exception as e:  # tensorstore reports damaged chunks as ValueError/IOError
      raise CheckpointError(f"checkpoint array {leaf.name!r} is damaged or truncated ({e}).") from e
    out[local(clipped, region)] = data.astype(dtype)
    return out

  return finish


def _ahead(starts: list[Callable[[], Callable[[], Any]]], depth: int = IN_FLIGHT):
  """Yield the results of `starts` in order, with up to `depth` of them started ahead."""
  running = [start() for start in starts[:depth]]
  for i in range(len(starts)):
    if i + depth < len(starts):
      running.append(starts[i + depth]())
    yield running.pop(0)()


def _read_array(arr, leaf: Leaf, src: Source) -> jax.Array:
  """A jax.Array with the target's shape, dtype and sharding (memory kind included)."""
  target = src.array
  sharding = target.sharding
  regions: dict[tuple, Region] = {}  # replicated targets read each region once
  placed = []
  for device, index in sharding.addressable_devices_indices_map(target.shape).items():
    region = shifted(norm_region(index, target.shape), leaf.layout, src.start)
    key = tuple((s.start, s.stop) for s in region)
    regions.setdefault(key, region)
    placed.append((device, key))
  keys = list(regions)
  got = dict(zip(keys, _ahead([lambda k=k: read_async(arr, regions[k], leaf, target.dtype)
                               for k in keys])))
  arrays = [jax.device_put(got[key], jax.sharding.SingleDeviceSharding(
      device, memory_kind=sharding.memory_kind)) for device, key in placed]
  return jax.make_array_from_single_device_arrays(target.shape, sharding, arrays)


def _stream_to_nvme(arr, leaf: Leaf, src: Source, run: Run) -> None:
  """Write this process's swap-store shards of a source from the checkpoint, `IN_FLIGHT`
  shards read ahead of the writes."""
  units = list(_units(run, leaf, src))
  reads = _ahead([lambda r=r: read_async(arr, r, leaf, np.float32) for _, _, r in units])
  tickets = []
  for (rank, layer, _), data in zip(units, reads):
    data = data.reshape(leaf.plan.local_shape)
    for t in tickets:
      t.wait()
    tickets = [run.store.write(shard_key(base, rank, layer), data.astype(dtype))
               for base, dtype in src.keys]
  for t in tickets:
    t.wait()


def _stream_nvme_to(path: str, leaf: Leaf, src: Source, run: Run) -> None:
  """Copy this process's swap-store shards of a source into the checkpoint array at `path`."""
  arr = ts.open(spec(path)).result()
  base = src.keys[0][0]
  replicated = leaf.layout.axis is None
  units = [u for u in _units(run, leaf, src) if not replicated or u[0] == 0]
  key = lambda u: shard_key(base, u[0], u[1])
  reads = _ahead([lambda u=u: run.store.read(key(u)).wait for u in units])
  writing: list = []  # at most 2 x IN_FLIGHT shards in host memory
  for (rank, layer, region), data in zip(units, reads):
    if len(writing) >= IN_FLIGHT:
      writing.pop(0).result()
    clipped = clip(region, leaf.shape)
    data = data.reshape([s.stop - s.start for s in region])
    writing.append(arr[clipped].write(np.ascontiguousarray(data[local(clipped, region)])))
  for w in writing:
    w.result()


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


def open_checked(path: str, leaf: Leaf):
  """The stored array of `leaf`, after checking it is all there."""
  if not os.path.isdir(path):
    raise CheckpointError(f"checkpoint has no array {leaf.name!r} (no folder {path}).")
  try:
    arr = ts.open(spec(path)).result()
  except Exception as e:
    raise CheckpointError(f"checkpoint array {leaf.name!r} at {path} cannot be opened ({e}).") from e
  if arr.shape:
    chunk = arr.chunk_layout.write_chunk.shape
    expected = int(np.prod([-(-n // c) for n, c in zip(arr.shape, chunk)], dtype=np.int64))
    found = sum(len(files) for _, _, files in os.walk(os.path.join(path, "c")))
  else:  # a scalar is one chunk file named "c"
    expected, found = 1, int(os.path.exists(os.path.join(path, "c")))
  if found < expected:
    raise CheckpointError(
        f"checkpoint array {leaf.name!r} at {path} is truncated: {found} of its {expected} "
        "chunks are there (a save that did not finish, or files lost).")
  return arr
