"""AdamW over optimizer states that live on NVMe, streamed through pinned host buffers.

The fp32 master params and both moments are split into sub-groups (at most
`sub_group_size` elements, never spanning two leaves), each stored as three
shards in the swap store. One step runs the paper's pipeline: while sub-group
k is updated by the C++ kernel, k+1 is being read and k-1 written, so NVMe
reads, CPU compute and NVMe writes overlap. Host memory for the states is
three rotating buffer sets of one sub-group each: 3 x 12 bytes x sub_group_size,
whatever the model size.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable, Sequence

import numpy as np

from ..offload.store import AioStore, aligned_empty
from ..placement import PREFIX, shard_key
from .kernel import AdamConstants, adamw_numpy

SLOTS = 3  # reading k+1, computing k, writing k-1
STATE = {"master": "master", "m": "mu", "v": "nu"}  # buffer -> the plan's state name


@dataclasses.dataclass(frozen=True)
class SubGroup:
  leaf: int
  start: int
  stop: int

  @property
  def size(self) -> int:
    return self.stop - self.start


def run_pipeline(count: int, start_read: Callable[[int], list], compute: Callable[[int], None],
                 start_write: Callable[[int], list], slots: int = SLOTS) -> dict[str, float]:
  """Run `count` sub-groups through `slots` rotating buffer sets: while k is computed,
  k+1 .. k+slots-2 are being read and k-1 written.

  `start_read(k)` and `start_write(k)` return the tickets of sub-group k's
  transfers (into and out of slot k % slots); a slot is read into again only
  after its previous writes are done. Returns the seconds spent waiting on
  reads, on writes, computing, and in all.
  """
  if slots < SLOTS:
    raise ValueError(f"the pipeline needs at least {SLOTS} buffer sets, got {slots}.")
  ahead = slots - 2
  stats = {"read_wait_s": 0.0, "compute_s": 0.0, "write_wait_s": 0.0}
  start = time.perf_counter()
  reads: dict[int, list] = {k: start_read(k) for k in range(min(ahead, count))}
  writes: dict[int, list] = {}
  for k in range(count):
    t0 = time.perf_counter()
    for t in reads.pop(k):
      t.wait()
    t1 = time.perf_counter()
    nxt = k + ahead
    if nxt < count:  # the slot nxt uses was nxt-slots's: its writes must be done
      for t in writes.pop(nxt - slots, []):
        t.wait()
      reads[nxt] = start_read(nxt)
    t2 = time.perf_counter()
    compute(k)
    t3 = time.perf_counter()
    writes[k] = start_write(k)
    stats["read_wait_s"] += t1 - t0
    stats["write_wait_s"] += t2 - t1
    stats["compute_s"] += t3 - t2
  t4 = time.perf_counter()
  for tickets in writes.values():
    for t in tickets:
      t.wait()
  stats["write_wait_s"] += time.perf_counter() - t4
  stats["step_s"] = time.perf_counter() - start
  return stats


class NvmeAdam:
  """Host side of the NVMe-offloaded AdamW: owns the store and the staging buffers."""

  def __init__(self, nvme_path, *, rank: int = 0, sub_group_size: int = 1 << 22,
               constants: AdamConstants, threads: int = 0, **store_options):
    if sub_group_size < 1024:
      raise ValueError(f"sub_group_size must be >= 1024 elements, got {sub_group_size}.")
    self.path, self.rank, self.sub_group_size = nvme_path, rank, sub_group_size
    self.constants, self.threads, self.store_options = constants, threads, store_options
    self.store: AioStore | None = None
    self.groups: list[SubGroup] = []
    self.shapes: list[tuple[int, ...]] = []
    self._slots: list[dict[str, np.ndarray]] = []
    self.last_step: dict[str, float] = {}

  # ------------------------------------------------------------------ layout
  def configure(self, shapes: Sequence[tuple[int, ...]], names: Sequence[str] | None = None) -> None:
    """Sub-groups for leaves of `shapes`; `names` (their paths) name their store keys."""
    self.shapes = [tuple(s) for s in shapes]
    self.names = list(names) if names is not None else [f"leaf{i}" for i in range(len(shapes))]
    self.groups = [SubGroup(i, start, min(start + self.sub_group_size, n))
                   for i, shape in enumerate(self.shapes)
                   for n in [int(np.prod(shape, dtype=np.int64))]
                   for start in range(0, max(n, 1), self.sub_group_size)]
    if self.store is None:
      # init creates every state: start from an empty store
      self.store = AioStore(self.path, self.rank, **{"fresh": True, **self.store_options})

  @property
  def pinned_bytes(self) -> int:
    """Host bytes held for optimizer states: three sub-group buffer sets."""
    largest = max((g.size for g in self.groups), default=0)
    return SLOTS * 3 * 4 * largest

  def _slot(self, k: int) -> dict[str, np.ndarray]:
    if not self._slots:
      largest = max(g.size for g in self.groups)
      self._slots = [{name: aligned_empty(largest, np.float32) for name in ("master", "m", "v")}
                     for _ in range(SLOTS)]
    return self._slots[k % SLOTS]

  def key(self, k: int, state: str) -> str:
    """Sub-group k's shard of `state` ("master", "mu", "nu"): the engine's key scheme, with the
    sub-group's index within its leaf in place of the layer."""
    g = self.groups[k]
    return shard_key(f"{PREFIX[state]}/{self.names[g.leaf]}", self.rank, g.start // self.sub_group_size)

  # ----------------------------------------------------------------- steps
  def host_init(self, *params: np.ndarray) -> np.ndarray:
    """Write the fp32 master copy of `params` and zero moments to NVMe."""
    pending: dict[int, list] = {}
    for k, g in enumerate(self.groups):
      for t in pending.pop(k - SLOTS, []):
        t.wait()
      slot = {name: buf[:g.size] for name, buf in self._slot(k).items()}
      slot["master"][:] = np.asarray(params[g.leaf]).reshape(-1)[g.start:g.stop]
      slot["m"].fill(0)
      slot["v"].fill(0)
      pending[k] = [self.store.write(self.key(k, STATE[n]), slot[n]) for n in ("master", "m", "v")]
    for tickets in pending.values():
      for t in tickets:
        t.wait()
    self.store.sync()
    return np.int32(0)

  def host_step(self, weight_decays: Sequence[float], params_dtypes: Sequence[np.dtype],
                lr, bc1, bc2, *grads: np.ndarray) -> tuple[np.ndarray, ...]:
    """One AdamW step over every sub-group; returns the new params (in `params_dtypes`)."""
    outs = [np.empty(shape, dtype) for shape, dtype in zip(self.shapes, params_dtypes)]
    c = self.constants
    def views(k):
      g = self.groups[k]
      return {name: buf[:g.size] for name, buf in self._slot(k).items()}

    def compute(k):
      g, slot = self.groups[k], views(k)
      grad = np.asarray(grads[g.leaf]).reshape(-1)[g.start:g.stop]
      out = outs[g.leaf].reshape(-1)[g.start:g.stop]
      adamw_numpy(slot["master"], slot["m"], slot["v"], grad, out, lr, bc1, bc2, c,
                  weight_decays[g.leaf], self.threads)

    stats = run_pipeline(
        len(self.groups),
        lambda k: [self.store.read(self.key(k, STATE[n]), buf) for n, buf in views(k).items()],
        compute,
        lambda k: [self.store.write(self.key(k, STATE[n]), buf) for n, buf in views(k).items()])
    stats["bytes_read"] = stats["bytes_written"] = sum(12 * g.size for g in self.groups)
    self.last_step = stats
    return tuple(outs)

  def close(self) -> None:
    if self.store is not None:
      self.store.close()
      self.store = None
