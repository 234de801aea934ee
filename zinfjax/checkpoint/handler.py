"""The orbax handler: each process saves and restores its own shards of every leaf's sources.

Array sources are copied to host memory in `save` and written in the
background; NVMe sources are streamed from the swap store into the checkpoint
a few shards at a time before `save` returns (the next step overwrites them in
place), and on restore streamed from the checkpoint into the store.
"""

from __future__ import annotations

import concurrent.futures
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

from ..offload.aligned import aligned_empty
from ..placement import Plan, shard_key
from ..partition import Region, bounding, clip, norm_region, shifted
from .arrays import LeafRead, fill, host_buffer, read_leaves
from .errors import CheckpointError
from .leaves import Leaf, Source, chunks
from .zarr import BATCH_BYTES, Array, Part, background, spec, trim, write_chunks

IN_FLIGHT = 8     # layers of NVMe shards read ahead between the store and the checkpoint
WRITES_AHEAD = 4  # layers being written behind them (each one in host memory)
FIRST_BATCH = 16 << 20  # bytes of the first batch a save writes (then twice as many, up to BATCH_BYTES)


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


@dataclasses.dataclass
class _Block:
  """A run of adjacent shards of one source in host memory (copies: the state is donated
  next, or NVMe shards just read), written as one region: `region` inside the logical shape,
  each chunk gathered from the parts by the engine."""

  region: Region
  parts: list[Part]     # each shard's region (maybe padded past the shape) and its copy

  @property
  def nbytes(self) -> int:
    return sum(x.nbytes for _, x in self.parts)


def _blocks(leaf: Leaf, src: Source) -> list[_Block]:
  """This process's shards of an array source, copied to host memory as they are (contiguous
  copies; the engine gathers the chunks from them when it writes) as one block per run of
  adjacent shards."""
  shards = [(shifted(norm_region(sh.index, src.array.shape), leaf.layout, src.start), sh)
            for sh in src.array.addressable_shards if not sh.replica_id]
  if not shards:  # another process holds the copy that is written
    return []
  box = bounding([r for r, _ in shards])
  dense = sum(int(np.prod([x.stop - x.start for x in r])) for r, _ in shards) == int(
      np.prod([x.stop - x.start for x in box]))
  groups = [(box, shards)] if dense else [(r, [(r, sh)]) for r, sh in shards]
  return [_Block(clip(region, leaf.shape), [(r, np.array(sh.data, copy=True)) for r, sh in members])
          for region, members in groups]


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
    writes = _Writes()  # array blocks written in the background while the next are copied
    nvme: list[tuple[str, Leaf, Source]] = []
    for leaf in run.leaves:
      path = os.fspath(directory / leaf.name)
      for src in leaf.sources:
        if src.derived:
          continue
        if src.array is None:  # NVMe: streamed below, before the next step rewrites it
          nvme.append((path, leaf, src))
          continue
        for block in _blocks(leaf, src):
          writes.add(path, block)
    writes.flush()
    _stream_nvme_to(nvme, run)

    async def commit():
      writes.wait()
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
    try:  # every array is checked before any is read
      arrs = [open_checked(os.fspath(directory / leaf.name), leaf) for leaf in run.leaves]
      _stream_to_nvme([(arr, leaf, src) for leaf, arr in zip(run.leaves, arrs)
                       for src in leaf.sources if src.keys], run)
      reads, names = [], []
      for leaf, arr in zip(run.leaves, arrs):
        arrays = [(k, src) for k, src in enumerate(leaf.sources) if src.array is not None]
        if arrays:
          reads.append(LeafRead(arr, leaf, [src for _, src in arrays]))
          names.append([f"{leaf.name}#{k}" for k, _ in arrays])
      for keys, xs in zip(names, read_leaves(reads)):
        out.update(zip(keys, xs))
    finally:
      trim()
    return out


@ocp.args.register_with_handler(StateHandler, for_save=True)
@dataclasses.dataclass
class StateSave(ocp.args.CheckpointArgs):
  run: Run


@ocp.args.register_with_handler(StateHandler, for_restore=True)
@dataclasses.dataclass
class StateRestore(ocp.args.CheckpointArgs):
  run: Run


class _Writes:
  """Blocks handed to `save_blocks` in batches, one batch at a time on a writer thread (each
  batch keeps the drive's queue full by itself). Batches grow from `FIRST_BATCH` to
  `BATCH_BYTES`, so the drive starts while the first shards are still being copied."""

  _thread: concurrent.futures.ThreadPoolExecutor | None = None

  def __init__(self):
    self.batch: list[tuple[str, _Block]] = []
    self.size = 0
    self.started: list[concurrent.futures.Future] = []

  def add(self, path: str, block: _Block) -> None:
    self.batch.append((path, block))
    self.size += block.nbytes
    if self.size >= min(BATCH_BYTES, FIRST_BATCH << len(self.started)):
      self.flush()

  def flush(self) -> None:
    if self.batch:
      if _Writes._thread is None:
        _Writes._thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="zinfjax-ckpt-save")
      batch = self.batch
      self.started.append(_Writes._thread.submit(
          lambda: save_blocks([(path, b.region, b.parts) for path, b in batch])))
    self.batch, self.size = [], 0

  def wait(self) -> None:
    """Wait for every batch; the first error is raised (after all have ended)."""
    concurrent.futures.wait(self.started)
    for f in self.started:
      f.result()


def save_blocks(writes: list[tuple[str, Region, list[Part]]]) -> None:
  """Write (array folder, region, parts) blocks: whole chunks by the engine in few calls (the
  drive kept busy), anything else through tensorstore."""
  grids: dict[str, Array] = {}
  whole, others = [], []
  for path, region, parts in writes:
    arr = grids.setdefault(path, Array(path))
    if arr.grid is not None and arr.grid.whole(region):
      whole.append((arr.grid, region, parts))
    else:
      others.append(arr.write(region, parts))
  write_chunks(whole)
  for wait in others:
    wait()


def read(arr: Array, region: Region, leaf: Leaf, dtype) -> np.ndarray:
  """`region` (storage coordinates) of a stored leaf in `dtype`, zero where it is padding."""
  out = host_buffer(region, dtype, leaf)
  fill(arr, leaf, region, [(region, out)])
  return out


def _ahead(starts: list[Callable[[], Callable[[], Any]]], depth: int = IN_FLIGHT):
  """Yield the results of `starts` in order, with up to `depth` of them started ahead."""
  running = [start() for start in starts[:depth]]
  for i in range(len(starts)):
    if i + depth < len(starts):
      running.append(starts[i + depth]())
    yield running.pop(0)()


def _by_layer(units: list) -> list[tuple[int, list]]:
  """(layer, [(rank, region)]) of `_units`, layer by layer."""
  layers: dict[int, list] = {}
  for rank, layer, region in units:
    layers.setdefault(layer, []).append((rank, region))
  return sorted(layers.items())


def _stream_to_nvme(items: list[tuple[Array, Leaf, Source]], run: Run) -> None:
  """Write this process's swap-store shards of NVMe sources (array, leaf, source) from the
  checkpoint, all in one stream: each layer's chunks read once (`IN_FLIGHT` layers ahead) and
  scattered by the engine into every rank's shard in every stored dtype, the layer's shards
  written as one transfer (`WRITES_AHEAD` layers in flight)."""
  units = [(arr, leaf, src, layer, ranks) for arr, leaf, src in items
           for layer, ranks in _by_layer(list(_units(run, leaf, src)))]

  def start(arr: Array, leaf: Leaf, src: Source, ranks: list) -> Callable[[], list]:
    shards = [(region, host_buffer(region, dtype, leaf)) for _, region in ranks for _, dtype in src.keys]
    wait = background(fill, arr, leaf, bounding([r for _, r in ranks]), shards)
    return lambda: (wait(), shards)[1]

  reads = _ahead([lambda u=u: start(u[0], u[1], u[2], u[4]) for u in units])
  writing: list = []
  for (_, leaf, src, layer, ranks), shards in zip(units, reads):
    keys = [shard_key(base, rank, layer) for rank, _ in ranks for base, _ in src.keys]
    writing.append(run.store.write_many([(key, buf.reshape(leaf.plan.local_shape))
                                         for key, (_, buf) in zip(keys, shards)]))
    if len(writing) > WRITES_AHEAD:
      writing.pop(0).wait()
  for t in writing:
    t.wait()


def _stream_nvme_to(items: list[tuple[str, Leaf, Source]], run: Run) -> None:
  """Copy this process's swap-store shards of NVMe sources (array folder, leaf, source) into
  the checkpoint, all in one stream: each layer's shards (`IN_FLIGHT` layers ahead) joined
  into the process's block, one write (`WRITES_AHEAD` in flight)."""
  units = []
  for path, leaf, src in items:
    arr = Array(path)
    replicated = leaf.layout.axis is None
    units += [(arr, leaf, src.keys[0], layer, ranks) for layer, ranks in
              _by_layer([u for u in _units(run, leaf, src) if not replicated or u[0] == 0])]
  reads = _ahead([lambda u=u: run.store.read_many([
      (shard_key(u[2][0], rank, u[3]), aligned_empty(u[1].plan.local_shape, u[2][1]))
      for rank, _ in u[4]]).wait for u in units])
  writing: list = []  # `WRITES_AHEAD` layers' blocks in host memory besides the reads
  for (arr, leaf, _, _, ranks), shards in zip(units, reads):
    parts = [(region, data.reshape([x.stop - x.start for x in region]))
             for (_, region), data in zip(ranks, shards)]
    if len(writing) >= WRITES_AHEAD:
      writing.pop(0)()
    writing.append(arr.write(clip(bounding([r for _, r in ranks]), leaf.shape), parts))
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
