"""The safetensors format, read memory-mapped and written one tensor at a time.

A file is an 8-byte little-endian header length, a JSON header
(`name -> {dtype, shape, data_offsets}` plus optional `__metadata__`) and the
raw little-endian tensor bytes. Reading maps the file and hands out numpy
views, so a reader slicing one rank's shard of one tensor touches only those
pages; writing takes the header up front and then one tensor at a time, so an
export never holds the whole model. Hugging Face's sharded checkpoints
(`model-0000x-of-0000y.safetensors` plus `model.safetensors.index.json`) are
one `Checkpoint` over all their files.
"""

from __future__ import annotations

import json
import os
import re
import struct
from typing import Any, Callable, Iterable, Iterator, Mapping

import ml_dtypes
import numpy as np

DTYPES: dict[str, np.dtype] = {
    "F64": np.dtype(np.float64), "F32": np.dtype(np.float32), "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16), "I64": np.dtype(np.int64), "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16), "I8": np.dtype(np.int8), "U8": np.dtype(np.uint8),
    "BOOL": np.dtype(np.bool_), "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
}
NAMES = {v: k for k, v in DTYPES.items()}
INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
# any file `write_sharded` writes: the single file, a shard, the index
WEIGHT_FILE = re.compile(r"model(-\d{5}-of-\d{5})?\.safetensors(\.index\.json)?")
MAX_HEADER = 100 << 20


class FormatError(ValueError):
  """A safetensors file or index that cannot be read as one."""


def read_header(path: str) -> tuple[dict[str, Any], int]:
  """(header, offset of the data section) of one safetensors file."""
  size = os.path.getsize(path)
  with open(path, "rb") as f:
    head = f.read(8)
    if len(head) < 8:
      raise FormatError(f"{path}: {size} bytes is too short for a safetensors file.")
    (n,) = struct.unpack("<Q", head)
    if n > min(MAX_HEADER, size - 8):
      raise FormatError(f"{path}: header length {n} does not fit the file ({size} bytes); "
                        "is it a safetensors file?")
    try:
      header = json.loads(f.read(n))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
      raise FormatError(f"{path}: the header is not JSON ({e}).") from None
  data = 8 + n
  for name, info in header.items():
    if name == "__metadata__":
      continue
    if info.get("dtype") not in DTYPES:
      raise FormatError(f"{path}: tensor {name!r} has dtype {info.get('dtype')!r}; "
                        f"supported: {', '.join(DTYPES)}.")
    begin, end = info["data_offsets"]
    want = int(np.prod(info["shape"], dtype=np.int64)) * DTYPES[info["dtype"]].itemsize
    if end - begin != want or data + end > size:
      raise FormatError(f"{path}: tensor {name!r} ({info['dtype']}{info['shape']}) has "
                        f"offsets {begin}..{end}, outside the file or of the wrong size: "
                        "the file is truncated or damaged.")
  return header, data


class File:
  """One safetensors file, memory-mapped: `file[name]` is a read-only numpy view."""

  def __init__(self, path: str):
    self.path = os.path.abspath(path)
    self.header, self._data = read_header(self.path)
    self._map: np.memmap | None = None

  @property
  def metadata(self) -> dict[str, str]:
    return dict(self.header.get("__metadata__", {}))

  def keys(self) -> list[str]:
    return [k for k in self.header if k != "__metadata__"]

  def __contains__(self, name: str) -> bool:
    return name != "__metadata__" and name in self.header

  def __getitem__(self, name: str) -> np.ndarray:
    if name not in self:
      raise KeyError(f"{self.path} has no tensor {name!r}.")
    if self._map is None:
      self._map = np.memmap(self.path, np.uint8, mode="r")
    info = self.header[name]
    begin, end = info["data_offsets"]
    raw = self._map[self._data + begin:self._data + end]
    return raw.view(DTYPES[info["dtype"]]).reshape(info["shape"])


class Mapped:
  """One tensor of a file as a `zinfjax.weights` Tensor: each `read` maps just that tensor,
  copies the box asked for and unmaps it, so pages read stay out of the process's memory."""

  def __init__(self, path: str, offset: int, shape: tuple[int, ...], dtype: np.dtype,
               name: str = ""):
    self.path, self.offset, self.shape, self.dtype = path, offset, tuple(shape), np.dtype(dtype)
    self.name = name  # the tensor's name in the file (for errors)

  def describe(self) -> str:
    return f"tensor {self.name!r} {list(self.shape)} of {self.path}"

  def read(self, index: tuple = ()) -> np.ndarray:
    if not all(self.shape):
      return np.zeros(self.shape, self.dtype)[index]
    view = np.memmap(self.path, self.dtype, mode="r", offset=self.offset, shape=self.shape)
    out = np.array(view[index], copy=True)
    del view
    return out


class Checkpoint(Mapping[str, np.ndarray]):
  """Every tensor of a safetensors checkpoint: one file, or a folder with a single file or
  Hugging Face's index over shards. Tensors are memory-mapped views, read on use."""

  def __init__(self, path: str):
    path = os.path.abspath(path)
    if os.path.isdir(path):
      index = os.path.join(path, INDEX)
      if os.path.exists(index):
        with open(index, encoding="utf-8") as f:
          weight_map = json.load(f).get("weight_map")
        if not isinstance(weight_map, dict):
          raise FormatError(f"{index} has no weight_map.")
        files = {name: os.path.join(path, rel) for name, rel in weight_map.items()}
      elif os.path.exists(os.path.join(path, SINGLE)):
        files = None
        path = os.path.join(path, SINGLE)
      else:
        raise FileNotFoundError(f"{path} has neither {SINGLE} nor {INDEX}: not a safetensors "
                                "checkpoint folder.")
    elif os.path.exists(path):
      files = None
    else:
      raise FileNotFoundError(f"no safetensors file or folder at {path}.")
    self._files: dict[str, File] = {}
    if files is None:
      self._files[path] = File(path)
      self._where = {name: path for name in self._files[path].keys()}
    else:
      for f in sorted(set(files.values())):
        if not os.path.exists(f):
          raise FileNotFoundError(f"{f}, named in {INDEX}, is missing.")
        self._files[f] = File(f)
      self._where = files
      for name, f in files.items():
        if name not in self._files[f]:
          raise FormatError(f"{INDEX} puts {name!r} in {f}, which does not hold it.")
    self.path = path

  def __getitem__(self, name: str) -> np.ndarray:
    if name not in self._where:
      raise KeyError(f"the checkpoint at {self.path} has no tensor {name!r}.")
    return self._files[self._where[name]][name]

  def __iter__(self) -> Iterator[str]:
    return iter(self._where)

  def __len__(self) -> int:
    return len(self._where)

  def tensor(self, name: str) -> Mapped:
    """A tensor to read by region, mapped only while it is read."""
    if name not in self._where:
      raise KeyError(f"the checkpoint at {self.path} has no tensor {name!r}.")
    f = self._files[self._where[name]]
    info = f.header[name]
    return Mapped(f.path, f._data + info["data_offsets"][0], info["shape"], DTYPES[info["dtype"]],
                  name)

  def info(self, name: str) -> tuple[tuple[int, ...], np.dtype]:
    """(shape, dtype) of a tensor, without mapping its data."""
    h = self._files[self._where[name]].header[name]
    return tuple(h["shape"]), DTYPES[h["dtype"]]


# shape, dtype, produce: `produce()` gives the tensor, or an iterator of its slabs along the
# first axis, in order
Tensor = tuple[tuple[int, ...], Any, Callable[[], "np.ndarray | Iterator[np.ndarray]"]]


def write(path: str, tensors: Iterable[tuple[str, Tensor]], metadata: dict[str, str] | None = None
          ) -> int:
  """Write a safetensors file from `(name, (shape, dtype, produce))`: the header first, then
  each tensor made by `produce()` and written before the next is made (a tensor given as slabs:
  each slab written before the next is made). Returns its bytes."""
  tensors = list(tensors)
  header: dict[str, Any] = {"__metadata__": dict(metadata)} if metadata else {}
  offset = 0
  for name, (shape, dtype, _) in tensors:
    dtype = np.dtype(dtype)
    if dtype not in NAMES:
      raise FormatError(f"tensor {name!r}: dtype {dtype} has no safetensors name.")
    n = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    header[name] = {"dtype": NAMES[dtype], "shape": [int(s) for s in shape],
                    "data_offsets": [offset, offset + n]}
    offset += n
  raw = json.dumps(header, separators=(",", ":")).encode()
  raw += b" " * (-len(raw) % 8)
  with open(path, "wb") as f:
    f.write(struct.pack("<Q", len(raw)))
    f.write(raw)
    for name, (shape, dtype, produce) in tensors:
      _write_tensor(f, name, tuple(shape), np.dtype(dtype), produce())
  return 8 + len(raw) + offset


def _write_tensor(f, name: str, shape: tuple[int, ...], dtype: np.dtype, made: Any) -> None:
  """One tensor's bytes from what `produce()` made: the array, or an iterator of its slabs along
  the first axis; checked against the announced shape (a wrong size would shift every later
  tensor)."""
  if isinstance(made, Iterator) and not shape:  # a scalar has no rows: its one slab is the value
    made = list(made)
    made = made[0] if len(made) == 1 else np.stack(made)  # more: the shape check refuses it
  if not isinstance(made, Iterator):
    x = np.asarray(made, dtype=dtype, order="C")  # a scalar stays 0-d
    if x.shape != shape:
      raise FormatError(f"tensor {name!r} was announced as {shape} but is {x.shape}.")
    f.write(x.reshape(-1).view(np.uint8).data)  # native little-endian bytes, no copy
    return
  rows = 0
  for slab in made:
    x = np.asarray(slab, dtype=dtype, order="C")
    if x.shape[1:] != shape[1:] or x.ndim != len(shape):
      raise FormatError(f"tensor {name!r} was announced as {shape} but has a slab of {x.shape}.")
    rows += x.shape[0]
    f.write(x.reshape(-1).view(np.uint8).data)
    del slab, x  # freed before the next slab is made
  if rows != shape[0]:
    raise FormatError(f"tensor {name!r} was announced with {shape[0]} rows but its slabs hold "
                      f"{rows}.")


def write_sharded(folder: str, tensors: Iterable[tuple[str, Tensor]], max_bytes: int = 5 << 30,
                  metadata: dict[str, str] | None = None) -> list[str]:
  """Hugging Face layout: one `model.safetensors`, or shards of at most `max_bytes` with an
  index when larger. Returns the files written."""
  tensors = list(tensors)
  groups: list[list] = [[]]
  size = 0
  for item in tensors:
    shape, dtype, _ = item[1]
    n = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
    if groups[-1] and size + n > max_bytes:
      groups.append([])
      size = 0
    groups[-1].append(item)
    size += n
  os.makedirs(folder, exist_ok=True)
  if len(groups) == 1:
    write(os.path.join(folder, SINGLE), groups[0], metadata)
    return [SINGLE]
  names, weight_map, total = [], {}, 0
  for k, group in enumerate(groups):
    name = f"model-{k + 1:05d}-of-{len(groups):05d}.safetensors"
    write(os.path.join(folder, name), group, metadata)
    total += sum(int(np.prod(sh, dtype=np.int64)) * np.dtype(dt).itemsize for _, (sh, dt, _) in group)
    names.append(name)
    weight_map.update({t: name for t, _ in group})
  with open(os.path.join(folder, INDEX), "w", encoding="utf-8") as f:
    json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
  return names + [INDEX]
