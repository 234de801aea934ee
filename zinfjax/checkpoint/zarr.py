"""A checkpoint's zarr3 arrays, their chunk files moved by the engine at disk speed.

The format is plain zarr3 (tensorstore writes each array's metadata and reads
any of them): every chunk is its little-endian bytes followed by their CRC-32C.
Whole chunks of such arrays are written and read here by the engine's file
path (`_engine.write_files` / `read_files`: O_DIRECT, 8 MiB pieces over several
threads, every chunk's CRC-32C made and checked in C++), which runs at the
drive's speed where tensorstore's per-chunk codec path does not. The engine also
gathers each chunk from the parts that hold it (e.g. the shards of 8 devices)
and scatters it into the buffers that want it, on the thread that moves the
file, so no Python copy stands between the drive and the arrays. A region that
does not cover whole chunks, or an array in any other zarr layout, goes through
tensorstore.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import itertools
import json
import os
import threading
from typing import Any, Callable

import ml_dtypes
import numpy as np
import tensorstore as ts

from .. import _engine
from ..offload.aligned import aligned_empty
from ..partition import Region, clip, local, overlap, size

THREADS = 8             # engine threads per call: requests in flight on the drive
IN_FLIGHT = 8           # calls at once (a chunk of a few MB is one request: several calls keep
                        # the drive's queue full)
BATCH_BYTES = 256 << 20  # chunk payloads per engine call (copies of edge chunks included)
MIN_SCRATCH = 8 << 20   # smallest staging buffer for chunk reads
TRAILER = 4             # bytes of a chunk file's CRC-32C
PLAIN_CODECS = [{"name": "bytes", "configuration": {"endian": "little"}}, {"name": "crc32c"}]

_pool: concurrent.futures.ThreadPoolExecutor | None = None


def _io() -> concurrent.futures.ThreadPoolExecutor:
  """Threads that wait on the engine's calls (the GIL is released in them)."""
  global _pool
  if _pool is None:
    _pool = concurrent.futures.ThreadPoolExecutor(IN_FLIGHT, thread_name_prefix="zinfjax-ckpt-io")
  return _pool


def background(fn: Callable[..., Any], *args) -> Callable[[], Any]:
  """Start `fn(*args)` on the I/O threads; the returned function waits for its result."""
  return _io().submit(fn, *args).result


def spec(path: str, shape=None, dtype=None, chunk=None) -> dict:
  """tensorstore's spec of the array at `path`: to open it, or (given shape, dtype and chunk
  shape) to create it with the plain codecs."""
  # an open option, not stored: without it, all-zero chunks (fresh moments) would not be written
  # and the file count check in `open_checked` could not tell a truncated save
  out = {"driver": "zarr3", "kvstore": {"driver": "file", "path": path},
         "store_data_equal_to_fill_value": True,
         "context": {"file_io_concurrency": {"limit": 16}, "file_io_sync": False}}
  if shape is None:
    return {**out, "open": True}
  metadata = {"shape": list(shape), "data_type": np.dtype(dtype).name,
              "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": list(chunk)}},
              "codecs": PLAIN_CODECS}
  return {**out, "metadata": metadata, "create": True, "delete_existing": True}


@dataclasses.dataclass(frozen=True)
class Grid:
  """The chunking of a plain zarr3 array (see the module docstring)."""

  path: str
  shape: tuple[int, ...]
  chunk: tuple[int, ...]
  dtype: np.dtype
  separator: str

  @staticmethod
  def of(path: str) -> "Grid | None":
    """The array's grid, or None if its chunks are not plain (tensorstore moves those)."""
    try:
      with open(os.path.join(path, "zarr.json")) as f:
        meta = json.load(f)
      encoding = meta.get("chunk_key_encoding", {"name": "default"})
      grid = meta["chunk_grid"]
      plain = (meta.get("codecs") == PLAIN_CODECS and grid["name"] == "regular"
               and encoding["name"] == "default" and meta.get("fill_value", 0) in (0, 0.0)
               and not meta.get("dimension_names") and meta.get("storage_transformers", []) == [])
      if not plain:
        return None
      return Grid(path, tuple(meta["shape"]), tuple(grid["configuration"]["chunk_shape"]),
                  np.dtype(getattr(ml_dtypes, meta["data_type"], meta["data_type"])),
                  encoding.get("configuration", {}).get("separator", "/"))
    except (OSError, KeyError, TypeError, ValueError):
      return None

  def file(self, index: tuple[int, ...]) -> str:
    key = "c" + "".join(f"{self.separator}{i}" for i in index)
    return os.path.join(self.path, *key.split("/"))

  def box(self, index: tuple[int, ...]) -> Region:
    return tuple(slice(i * c, (i + 1) * c) for i, c in zip(index, self.chunk))

  def indices(self, region: Region) -> list[tuple[int, ...]]:
    """Chunks that `region` (inside the shape) touches, in C order."""
    return list(itertools.product(*[range(s.start // c, -(-s.stop // c))
                                     for s, c in zip(region, self.chunk)]))

  @property
  def chunk_bytes(self) -> int:
    """A chunk's payload bytes."""
    return int(np.prod(self.chunk, dtype=np.int64)) * self.dtype.itemsize

  @property
  def room(self) -> int:
    """A chunk's staging bytes: aligned, with room for its trailer and the O_DIRECT padding
    (so the drive reads and writes it in place)."""
    return _engine.align_up(self.chunk_bytes + TRAILER)

  def whole(self, region: Region) -> bool:
    """Whether `region` is a union of whole chunks (the edge chunks cut by the shape count)."""
    return all(s.start % c == 0 and (s.stop % c == 0 or s.stop == n)
               for s, c, n in zip(region, self.chunk, self.shape))


Part = tuple[Region, np.ndarray]  # a box of an array (it may reach past the shape) and its data


def join(region: Region, parts: list[Part], shape: tuple[int, ...]) -> np.ndarray:
  """`region` as one array, from the `parts` that cover it (inside `shape`)."""
  if len(parts) == 1 and tuple(parts[0][0]) == tuple(region):
    return parts[0][1]
  data = np.empty([s.stop - s.start for s in region], parts[0][1].dtype)
  for r, x in parts:
    inter = overlap(clip(r, shape), region)
    if inter is not None:
      data[local(inter, region)] = x[local(inter, r)]
  return data


def _at(a: np.ndarray, index: tuple) -> np.ndarray:
  """The view `a[index]`, also for a 0-d array (where `a[()]` is a scalar, not a view)."""
  return a[(*index, ...)]


def _gathers(grid: Grid, index: tuple[int, ...], parts: list[Part], payload: np.ndarray) -> list:
  """(payload view, part view) copies that make chunk `index`'s full C-order `payload` from
  `parts`; beyond the shape the payload is zeroed (the fill value)."""
  box = grid.box(index)
  inside = clip(box, grid.shape)
  copies, covered = [], 0
  for r, x in parts:
    inter = overlap(clip(r, grid.shape), inside)
    if inter is not None:
      copies.append((_at(payload, local(inter, box)), _at(x, local(inter, r))))
      covered += size(inter)
  if covered != size(inside):
    raise ValueError(f"chunk {index} of {grid.path} is not covered by the parts given "
                     f"({covered} of {size(inside)} elements)")
  if inside != box:
    payload.fill(0)
  return copies


class Array:
  """A checkpoint array: `write`/`read` start a transfer and return the function that waits."""

  def __init__(self, path: str):
    self.path = path
    self.grid = Grid.of(path)
    self._ts: Any = None
    self._opening = threading.Lock()  # one tensorstore handle, whichever writer thread opens it

  @property
  def ts(self) -> Any:
    with self._opening:
      if self._ts is None:
        self._ts = ts.open(spec(self.path)).result()
    return self._ts

  @property
  def shape(self) -> tuple[int, ...]:
    return self.grid.shape if self.grid is not None else tuple(self.ts.shape)

  @property
  def chunk(self) -> tuple[int, ...]:
    return self.grid.chunk if self.grid is not None else tuple(self.ts.chunk_layout.write_chunk.shape)

  def write(self, region: Region, parts: list[Part]) -> Callable[[], None]:
    """Write `region` (inside the shape) from the `parts` that cover it."""
    if self.grid is None or not self.grid.whole(region):
      return self.ts[region].write(join(region, parts, self.shape)).result
    return background(write_chunks, [(self.grid, region, parts)])

  def read(self, region: Region) -> Callable[[], np.ndarray]:
    """Start reading `region` (inside the shape); see `read_now`."""
    if self.grid is None:
      return self.ts[region].read().result
    return background(self.read_now, region)

  def read_now(self, region: Region) -> np.ndarray:
    """`region` (inside the shape), read before returning; the chunks it touches are read
    whole, once."""
    dtype = self.grid.dtype if self.grid is not None else self.ts.dtype.numpy_dtype
    out = np.empty([s.stop - s.start for s in region], dtype)
    self.scatter(region, [(region, out)])
    return out

  def scatter(self, region: Region, targets: list[Part]) -> None:
    """Read the chunks that `region` (inside the shape) touches, whole and once each, into the
    `targets` (box, buffer): each gets the part of `region` inside its box. The engine copies
    each chunk out as soon as it is read and checked (float32 into bfloat16 cast on the way);
    a target of any other dtype is cast here."""
    grid = self.grid
    if grid is None:
      _copy_into(region, self.ts[region].read().result(), targets)
      return
    indices = grid.indices(region)
    nbytes, room = grid.chunk_bytes, grid.room
    per_call = max(1, BATCH_BYTES // room)
    same = [t for t in targets if _engine_casts(grid.dtype, t[1].dtype)]
    cast = [t for t in targets if not _engine_casts(grid.dtype, t[1].dtype)]
    for start in range(0, len(indices), per_call):
      part = indices[start:start + per_call]
      with _scratch(room * len(part)) as buf:
        views = [buf[i * room:(i + 1) * room] for i in range(len(part))]
        chunks = []
        for ix, view in zip(part, views):
          box = grid.box(ix)
          inside = overlap(clip(box, grid.shape), region)
          data = view[:nbytes].view(grid.dtype).reshape([b.stop - b.start for b in box])
          chunks.append((inside, _at(data, local(inside, box))))
        copies = [[(_at(out, local(inter, r)), _at(data, local(inter, inside)))
                   for r, out in same if (inter := overlap(inside, r)) is not None]
                  for inside, data in chunks]
        _engine.read_files([grid.file(ix) for ix in part], views, THREADS,
                           sizes=[nbytes] * len(part), copies=copies)
        for inside, data in chunks:
          _copy_into(inside, data, cast)


def _engine_casts(src: np.dtype, dst: np.dtype) -> bool:
  """Whether the engine's copies move `src` items into `dst` ones (the same, or f32 to bf16)."""
  return src == dst or (src == np.float32 and dst == ml_dtypes.bfloat16)


def _copy_into(region: Region, data: np.ndarray, targets: list[Part]) -> None:
  """Copy `data` (holding `region`) into each target (box, buffer) where they meet."""
  for r, out in targets:
    inter = overlap(region, r)
    if inter is not None:
      out[local(inter, r)] = data[local(inter, region)]


class _scratch:
  """A staging buffer of at least `nbytes` from a shared free list: `with _scratch(n) as buf`.
  Buffers come in power-of-two sizes from 8 MiB and are touched once when made, so the drive
  reads into mapped (huge) pages: a fresh buffer per read halves the read rate. `trim()`
  frees the list."""

  _free: dict[int, list[np.ndarray]] = {}
  _lock = threading.Lock()

  def __init__(self, nbytes: int):
    self.nbytes = nbytes
    self.size = max(MIN_SCRATCH, 1 << (nbytes - 1).bit_length())

  def __enter__(self) -> np.ndarray:
    with self._lock:
      free = self._free.get(self.size)
      self.buf = free.pop() if free else None
    if self.buf is None:
      self.buf = aligned_empty(self.size, np.uint8)
      self.buf.fill(0)
    return self.buf[:self.nbytes]

  def __exit__(self, *exc) -> None:
    with self._lock:
      self._free.setdefault(self.size, []).append(self.buf)


def trim() -> None:
  """Free the staging buffers that chunk reads keep for reuse (after a restore or export)."""
  with _scratch._lock:
    _scratch._free.clear()


def each(fn: Callable[[Any], None], items: list) -> None:
  """`fn` on every item, `IN_FLIGHT` at a time on the I/O threads (e.g. read a chunk and
  scatter it, the copies of one overlapping the reads of the next); the first error raised."""
  for _ in _io().map(fn, items):
    pass


def write_chunks(items: list[tuple[Grid, Region, list[Part]]]) -> None:
  """Write whole chunks: each item is a region of whole chunks of a grid and the parts that
  cover it. The engine gathers each chunk from its parts into a staging buffer and writes it
  from there, about `BATCH_BYTES` a call."""
  files = []
  for grid, region, parts in items:
    parts = [(r, x.astype(grid.dtype, copy=False)) for r, x in parts]  # the stored dtype
    files += [(grid, index, parts) for index in grid.indices(region)]
  start, size_ = 0, 0
  for i, (grid, _, _) in enumerate(files):
    size_ += grid.room
    if size_ >= BATCH_BYTES or i == len(files) - 1:
      _write_batch(files[start:i + 1])
      start, size_ = i + 1, 0


def _write_batch(batch: list[tuple[Grid, tuple[int, ...], list[Part]]]) -> None:
  paths = [grid.file(index) for grid, index, _ in batch]
  for folder in {os.path.dirname(p) for p in paths}:
    os.makedirs(folder, exist_ok=True)
  offsets = np.cumsum([0] + [grid.room for grid, _, _ in batch])
  with _scratch(int(offsets[-1])) as buf:
    views, copies = [], []
    for (grid, index, parts), at in zip(batch, offsets):
      view = buf[at:at + grid.room]
      views.append(view)
      copies.append(_gathers(grid, index, parts, view[:grid.chunk_bytes].view(grid.dtype).reshape(grid.chunk)))
    sizes = [grid.chunk_bytes for grid, _, _ in batch]
    _engine.write_files(paths, views, THREADS, sizes=sizes, copies=copies)
