"""The portable swap store over tensorstore's `file` kvstore, and `open_store` (either kind).

`TensorstoreStore` keeps the `SwapStore` interface of `store.AioStore` (tickets,
a manifest of dtype, shape and checksum per shard, the engine's error types)
without the C++ engine's aio paths: what orbax itself writes through.
"""

from __future__ import annotations

import json
import os
import threading
from typing import Sequence

import numpy as np

from .. import _engine
from .store import (AioStore, CorruptShardError, EngineError, MissingShardError, NoSpaceError,
                    PathLike, ShardMismatchError, SwapStore, Ticket, _as_bytes, dtype_of)


class TensorstoreStore:
  """The same interface over tensorstore's `file` kvstore (portable, what orbax uses).

  One kvstore value per shard under `path/rank{rank}/tensorstore/`, and a JSON
  manifest with dtype, shape and checksum per shard.
  """

  def __init__(self, path: PathLike, rank: int = 0):
    import tensorstore as ts
    # absolute: tensorstore's file driver refuses a relative path such as "../x"
    self.folder = os.path.join(os.path.abspath(os.fspath(path)), f"rank{rank}", "tensorstore")
    try:
      os.makedirs(self.folder, exist_ok=True)
    except OSError as e:
      raise EngineError(f"cannot create nvme_path folder {self.folder} ({e.strerror}); choose a "
                        "writable nvme_path") from None
    if not os.access(self.folder, os.W_OK):
      raise EngineError(f"nvme_path folder {self.folder} is not writable; choose a writable nvme_path")
    self._kv = ts.KvStore.open({"driver": "file", "path": self.folder + "/"}).result()
    self._manifest_path = os.path.join(self.folder, "manifest.json")
    self._lock = threading.Lock()
    self._manifest: dict[str, dict] = {}
    if os.path.exists(self._manifest_path):
      with open(self._manifest_path) as f:
        self._manifest = json.load(f)

  def write(self, key: str, array: np.ndarray) -> Ticket:
    array = np.ascontiguousarray(array)
    data = _as_bytes(array).tobytes()
    entry = {"dtype": array.dtype.name, "shape": list(array.shape), "nbytes": len(data),
             "checksum": _engine.checksum(np.frombuffer(data, np.uint8))}
    future = self._kv.write(key, data)

    def finish():
      try:
        future.result()
      except Exception as e:  # tensorstore reports ENOSPC as a generic error
        if "space" in str(e).lower():
          raise NoSpaceError(f"no space left writing {key!r} under {self.folder}: {e}") from None
        raise
      with self._lock:
        self._manifest[key] = entry

    return Ticket(finish)

  def write_zeros(self, key: str, zeros: np.ndarray) -> Ticket:
    """`write`: a tensorstore file holds what is written to it, zeros too."""
    return self.write(key, zeros)

  def read(self, key: str, out: np.ndarray | None = None) -> Ticket:
    with self._lock:
      entry = self._manifest.get(key)
    if entry is None:
      raise MissingShardError(f"no shard {key!r} in the swap manifest of {self.folder}: it was "
                              "never written there (or the manifest belongs to another run)")
    if out is None:
      out = np.empty(entry["shape"], dtype_of(entry["dtype"]))
    if out.dtype.name != entry["dtype"] or list(out.shape) != entry["shape"]:
      raise ShardMismatchError(
          f"shard {key!r} was written as {entry['dtype']}{entry['shape']} but is read as "
          f"{out.dtype.name}{list(out.shape)}")
    future = self._kv.read(key)

    def finish():
      result = future.result()
      data = np.frombuffer(result.value, np.uint8)
      if result.state != "value" or data.size != entry["nbytes"]:
        raise CorruptShardError(f"shard {key!r} in {self.folder} holds {data.size} of "
                                f"{entry['nbytes']} bytes: the file was truncated or removed")
      if _engine.checksum(data) != entry["checksum"]:
        raise CorruptShardError(f"checksum mismatch for shard {key!r} in {self.folder}: the swap "
                                "file is corrupted; restore it from a checkpoint")
      _as_bytes(out)[:] = data
      return out

    return Ticket(finish)

  def sync(self) -> None:
    with self._lock:
      tmp = self._manifest_path + ".tmp"
      with open(tmp, "w") as f:
        json.dump(self._manifest, f)
        f.flush()
        os.fsync(f.fileno())
      os.replace(tmp, self._manifest_path)

  def keys(self) -> list[str]:
    with self._lock:
      return sorted(self._manifest)

  def close(self) -> None:
    self.sync()


def open_store(kind: str, paths: PathLike | Sequence[PathLike], rank: int = 0, **options) -> SwapStore:
  """`kind` "aio" (the C++ engine) or "tensorstore"."""
  if kind == "aio":
    return AioStore(paths, rank, **options)
  if kind == "tensorstore":
    if not isinstance(paths, (str, os.PathLike)):
      if len(paths) != 1:
        raise ValueError("the tensorstore backend takes one nvme_path; striping needs kind='aio'")
      paths = paths[0]
    return TensorstoreStore(paths, rank)
  raise ValueError(f"unknown swap store kind {kind!r}; use 'aio' or 'tensorstore'")
