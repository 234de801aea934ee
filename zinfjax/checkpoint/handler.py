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
from ..placement import Plan, Tier, shard_key
from ..partition import Region, bounding, clip, norm_region, shifted, size
from ..progress import InitReport, Tally
from .arrays import LeafRead, fill, host_buffer, read_leaves
from .errors import CheckpointError
from .leaves import Leaf, Source, chunks
from .zarr import BATCH_BYTES, Array, Part, background, spec, trim, write_chunks

GROUP_BYTES = 32 << 20  # NVMe shards per swap-store transfer and chunk-file call (whole layers)
IN_FLIGHT = 2     # groups of NVMe shards read ahead between the store and the checkpoint
WRITES_AHEAD = 2  # groups being written behind them (each one in host memory)
FIRST_BATCH = 16 << 20  # bytes of the first batch a save writes (then twice as many, up to LAST_BATCH)
LAST_BATCH = BATCH_BYTES // 2  # a save's largest batch (WRITERS of them staged at once)
WRITERS = 2       # a save's batches written at once: one drains the drive's queue at its end


@dataclasses.dataclass
class Run:
  """What the handler needs of the running engine."""

  leaves: list[Leaf]
  plan: Plan
  store: Any = None     # the process's swap store (NVMe sources)
  # a restore's reports: (bytes placed, bytes in all, seconds so far), as `Tally` paces them
  progress: InitReport | None = None


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
  copies; the engine gathers the chunks from them when it writes: `_host_copy`) as one block
  per run of adjacent shards."""
  shards = [(shifted(norm_region(sh.index, src.array.shape), leaf.layout, src.start), sh)
            for sh in src.array.addressable_shards if not sh.replica_id]
  if not shards:  # another process holds the copy that is written
    return []
  box = bounding([r for r, _ in shards])
  dense = sum(size(r) for r, _ in shards) == size(box)
  groups = [(box, shards)] if dense else [(r, [(r, sh)]) for r, sh in shards]
  for _, sh in shards:  # an accelerator's device-to-host copies, all started before any is used
    if _accelerator(sh):
      sh.data.copy_to_host_async()
  return [_Block(clip(region, leaf.shape), [(r, _host_copy(sh)) for r, sh in members])
          for region, members in groups]


def _accelerator(shard) -> bool:
  """Whether a shard lives in an accelerator's own memory (HBM)."""
  return (shard.device.platform != "cpu"
          and shard.data.sharding.memory_kind == Tier.DEVICE.memory_kind)


def _host_copy(shard) -> np.ndarray:
  """A shard's data in host memory that nothing else writes (the state is donated next): from
  HBM, the device-to-host copy itself (numpy's view of a jax array there is already a private
  copy); anywhere else (a CPU device, host memory kinds, whose numpy view may be the buffer
  itself) a copy of that view."""
  if _accelerator(shard):
    return np.asarray(shard.data)
  return np.array(shard.data, copy=True)


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
    nvme: list[tuple[Array, Leaf, Source]] = []
    for leaf in run.leaves:
      arr = Array(os.fspath(directory / leaf.name))
      for src in leaf.sources:
        if src.derived:
          continue
        if src.array is None:  # NVMe: streamed below, before the next step rewrites it
          nvme.append((arr, leaf, src))
          continue
        for block in _blocks(leaf, src):
          writes.add(arr, block)
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
      groups = _groups(_units_of([(arr, leaf, src) for leaf, arr in zip(run.leaves, arrs)
                                  for src in leaf.sources if src.keys], run))
      reads, names = [], []
      for leaf, arr in zip(run.leaves, arrs):
        arrays = [(k, src) for k, src in enumerate(leaf.sources) if src.array is not None]
        if arrays:
          reads.append(LeafRead(arr, leaf, [src for _, src in arrays]))
          names.append([f"{leaf.name}#{k}" for k, _ in arrays])
      tally = Tally(sum(u.nbytes for g in groups for u in g) + sum(r.nbytes for r in reads),
                    run.progress)
      _stream_to_nvme(groups, run, tally)
      for keys, xs in zip(names, read_leaves(reads, tally)):
        out.update(zip(keys, xs))
      tally.close()
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
  """Blocks handed to `save_blocks` in batches, `WRITERS` batches at a time on writer threads,
  so the drive's queue stays full while one batch ends and the next begins. Batches grow from
  `FIRST_BATCH` to `LAST_BATCH`, so the drive starts while the first shards are still being
  copied."""

  _thread: concurrent.futures.ThreadPoolExecutor | None = None

  def __init__(self):
    self.batch: list[tuple[Array, _Block]] = []
    self.size = 0
    self.started: list[concurrent.futures.Future] = []

  def add(self, arr: Array, block: _Block) -> None:
    self.batch.append((arr, block))
    self.size += block.nbytes
    if self.size >= min(LAST_BATCH, FIRST_BATCH << len(self.started)):
      self.flush()

  def flush(self) -> None:
    if self.batch:
      if _Writes._thread is None:
        _Writes._thread = concurrent.futures.ThreadPoolExecutor(WRITERS, thread_name_prefix="zinfjax-ckpt-save")
      batch = self.batch
      self.started.append(_Writes._thread.submit(
          lambda: save_blocks([(arr, b.region, b.parts) for arr, b in batch])))
    self.batch, self.size = [], 0

  def wait(self) -> None:
    """Wait for every batch; the first error is raised (after all have ended)."""
    concurrent.futures.wait(self.started)
    for f in self.started:
      f.result()


def save_blocks(writes: list[tuple[Array, Region, list[Part]]]) -> None:
  """Write (array, region, parts) blocks: whole chunks by the engine in few calls (the drive
  kept busy), anything else through tensorstore."""
  whole, others = [], []
  for arr, region, parts in writes:
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


def _ahead(starts: list[Callable[[], Callable[[], Any]]], depth: int):
  """Yield the results of `starts` in order, with up to `depth` of them started ahead."""
  running = [start() for start in starts[:depth]]
  for i in range(len(starts)):
    if i + depth < len(starts):
      running.append(starts[i + depth]())
    yield running.pop(0)()


@dataclasses.dataclass
class _Unit:
  """One layer of one NVMe source: this process's ranks' swap-store shards of it."""

  arr: Array
  leaf: Leaf
  src: Source
  layer: int
  ranks: list[tuple[int, Region]]  # (rank, region in storage coordinates)

  @property
  def region(self) -> Region:
    return bounding([r for _, r in self.ranks])

  def keys(self, base: str) -> list[str]:
    return [shard_key(base, rank, self.layer) for rank, _ in self.ranks]

  @property
  def nbytes(self) -> int:
    return sum(size(r) for _, r in self.ranks) * sum(np.dtype(d).itemsize for _, d in self.src.keys)


def _units_of(items: list[tuple[Array, Leaf, Source]], run: Run, first_rank: bool = False) -> list[_Unit]:
  """Every layer of each NVMe source (array, leaf, source) as a `_Unit` (`first_rank`: of a
  replicated leaf, rank 0's shard alone)."""
  out = []
  for arr, leaf, src in items:
    ranks = [r for r in run.plan.ranks if not (first_rank and leaf.layout.axis is None and r)]
    if ranks:  # (another process holds rank 0)
      out += [_Unit(arr, leaf, src, layer, [(r, run.plan.region(leaf.plan, r, layer)) for r in ranks])
              for layer in range(src.start, src.stop)]
  return out


def _groups(units: list[_Unit]) -> list[list[_Unit]]:
  """`units` in order, packed into groups of about `GROUP_BYTES` (a larger unit alone): one
  swap-store transfer and one chunk-file call each, enough requests to keep the drive busy
  where one layer's shards are small."""
  groups, size_ = [], 0
  for u in units:
    if not groups or size_ + u.nbytes > GROUP_BYTES:
      groups.append([])
      size_ = 0
    groups[-1].append(u)
    size_ += u.nbytes
  return groups


def _stream_to_nvme(groups: list[list[_Unit]], run: Run, tally: Tally) -> None:
  """Write this process's swap-store shards of NVMe sources (`_groups` of their units) from
  the checkpoint, all in one stream: each layer's chunks read once (`IN_FLIGHT` groups ahead)
  and scattered by the engine into every rank's shard in every stored dtype, each group's
  shards written as one transfer (`WRITES_AHEAD` groups in flight); each group's bytes
  counted to `tally` once read."""

  def start(group: list[_Unit]) -> Callable[[], list]:
    shards, waits = [], []
    for u in group:
      bufs = [(region, host_buffer(region, dtype, u.leaf)) for _, region in u.ranks for _, dtype in u.src.keys]
      keys = [shard_key(base, rank, u.layer) for rank, _ in u.ranks for base, _ in u.src.keys]
      waits.append(background(fill, u.arr, u.leaf, u.region, bufs))
      shards += [(key, buf.reshape(u.leaf.plan.local_shape)) for key, (_, buf) in zip(keys, bufs)]
    return lambda: ([w() for w in waits], shards)[1]

  writing: list = []
  for group, shards in zip(groups, _ahead([lambda g=g: start(g) for g in groups], IN_FLIGHT)):
    tally.add(sum(u.nbytes for u in group))
    writing.append(run.store.write_many(shards))
    if len(writing) > WRITES_AHEAD:
      writing.pop(0).wait()
  for t in writing:
    t.wait()


def _stream_nvme_to(items: list[tuple[Array, Leaf, Source]], run: Run) -> None:
  """Copy this process's swap-store shards of NVMe sources (array, leaf, source) into the
  checkpoint, all in one stream: each group's shards read as one transfer (`IN_FLIGHT`
  groups ahead), its chunks gathered from them and written by one engine call
  (`WRITES_AHEAD` groups in flight)."""
  groups = _groups(_units_of(items, run, first_rank=True))

  def start(group: list[_Unit]) -> Callable[[], list]:
    reads = [(key, aligned_empty(u.leaf.plan.local_shape, u.src.keys[0][1]))
             for u in group for key in u.keys(u.src.keys[0][0])]
    return run.store.read_many(reads).wait

  writing: list = []  # `WRITES_AHEAD` groups in host memory besides the reads
  for group, shards in zip(groups, _ahead([lambda g=g: start(g) for g in groups], IN_FLIGHT)):
    blocks, shards = [], iter(shards)
    for u in group:
      parts = [(region, next(shards).reshape([x.stop - x.start for x in region])) for _, region in u.ranks]
      blocks.append((u.arr, clip(u.region, u.leaf.shape), parts))
    if len(writing) >= WRITES_AHEAD:
      writing.pop(0)()
    writing.append(background(save_blocks, blocks))
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
