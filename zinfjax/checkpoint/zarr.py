"""A checkpoint's zarr3 arrays, their chunk files moved by the engine at disk speed.

The format is plain zarr3 (tensorstore writes each array's metadata and reads
any of them): every chunk is its little-endian bytes followed by their CRC-32C.
Whole chunks of such arrays are written and read here by the engine's file
path (`_engine.write_files` / `read_files`: O_DIRECT, 8 MiB pieces over several
threads, every chunk's CRC-32C made and checked in C++), which runs at the
drive's speed where tensorstore's per-chunk codec path does not. A region that
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
from ..partition import Region, clip, local, overlap

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

  def whole(self, region: Region) -> bool:
    """Whether `region` is a union of whole chunks (the edge chunks cut by the shape count)."""
    return all(s.start % c == 0 and (s.stop % c == 0 or s.stop == n)
               for s, c, n in zip(region, self.chunk, self.shape))


def _payload(grid: Grid, index: tuple[int, ...], region: Region, data: np.ndarray) -> np.ndarray:
  """Chunk `index` of `data` (which holds `region`) as the chunk's full C-order array."""
  box = grid.box(index)
  inside = clip(box, grid.shape)
  piece = data[local(inside, region)]
  if inside == box:
    return np.ascontiguousarray(piece, grid.dtype)
  full = np.zeros([b.stop - b.start for b in box], grid.dtype)  # beyond the shape: fill value
  full[local(inside, box)] = piece
  return full


class Array:
  """A checkpoint array: `write`/`read` start a transfer and return the function that waits."""

  def __init__(self, path: str):
    self.path = path
    self.grid = Grid.of(path)
    self._ts: Any = None

  @property
  def ts(self) -> Any:
    if self._ts is None:
      self._ts = ts.open(spec(self.path)).result()
    return self._ts

  @property
  def shape(self) -> tuple[int, ...]:
    return self.grid.shape if self.grid is not None else tuple(self.ts.shape)

  @property
  def chunk(self) -> tuple[int, ...]:
    return self.grid.chunk if self.grid is not None else tuple(self.ts.chunk_layout.write_chunk.shape)

  def write(self, region: Region, data: np.ndarray) -> Callable[[], None]:
    """Write `data` to `region` (inside the shape)."""
    if self.grid is None or not self.grid.whole(region):
      return self.ts[region].write(data).result
    return _io().submit(write_chunks, [(self.grid, region, data)]).result

  def read(self, region: Region) -> Callable[[], np.ndarray]:
    """Start reading `region` (inside the shape); see `read_now`."""
    if self.grid is None:
      return self.ts[region].read().result
    return _io().submit(self.read_now, region).result

  def read_now(self, region: Region) -> np.ndarray:
    """`region` (inside the shape), read before returning; the chunks it touches are read
    whole, once."""
    dtype = self.grid.dtype if self.grid is not None else self.ts.dtype.numpy_dtype
    out = np.empty([s.stop - s.start for s in region], dtype)

    def put(box: Region, data: np.ndarray) -> None:
      inter = overlap(box, region)
      out[local(inter, region)] = data[local(inter, box)]

    self.scan(region, put)
    return out

  def scan(self, region: Region, fn: Callable[[Region, np.ndarray], None]) -> None:
    """Read the chunks that `region` (inside the shape) touches, whole and once each, and call
    `fn(box, data)` for each on this thread: `data` holds the chunk's `box` (clipped to the
    shape) and is valid only during the call (its buffer is reused)."""
    grid = self.grid
    if grid is None:
      fn(tuple(region), self.ts[region].read().result())
      return
    indices = grid.indices(region)
    nbytes = int(np.prod(grid.chunk, dtype=np.int64)) * grid.dtype.itemsize
    room = _engine.align_up(nbytes + TRAILER)  # aligned, with room for trailer and padding:
    per_call = max(1, BATCH_BYTES // room)     # the drive reads into it with no staging copy
    for start in range(0, len(indices), per_call):
      part = indices[start:start + per_call]
      with _scratch(room * len(part)) as buf:
        views = [buf[i * room:(i + 1) * room] for i in range(len(part))]
        _engine.read_files([grid.file(ix) for ix in part], views, THREADS, sizes=[nbytes] * len(part))
        for ix, view in zip(part, views):
          box = grid.box(ix)
          inside = clip(box, grid.shape)
          data = view[:nbytes].view(grid.dtype).reshape([b.stop - b.start for b in box])
          fn(inside, data[local(inside, box)])


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


def _bytes(a: np.ndarray) -> np.ndarray:
  """A C-contiguous array's bytes (the buffer protocol has no bfloat16)."""
  return a.reshape(-1).view(np.uint8)


def write_chunks(items: list[tuple[Grid, Region, np.ndarray]]) -> None:
  """Write whole chunks: each item is a region of whole chunks of a grid and its data."""
  files: list[tuple[str, np.ndarray]] = []
  size = 0
  for grid, region, data in items:
    for index in grid.indices(region):
      payload = _payload(grid, index, region, data)
      files.append((grid.file(index), payload))
      size += payload.nbytes
      if size >= BATCH_BYTES:
        _flush(files)
        size = 0
  _flush(files)


def _flush(files: list[tuple[str, np.ndarray]]) -> None:
  folders = {os.path.dirname(p) for p, _ in files}
  for folder in folders:
    os.makedirs(folder, exist_ok=True)
  if files:
    _engine.write_files([p for p, _ in files], [_bytes(a) for _, a in files], THREADS)
  files.clear()
