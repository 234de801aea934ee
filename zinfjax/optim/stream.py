"""AdamW streamed through a swap store: the one driver under every off-device AdamW.

The fp32 master params and both moments of each `Part` (a shard, or a slice
of one) live in a swap store. Parts are packed into sub-groups (`Unit`s),
which rotate through 3 to 8 pinned buffer sets: while sub-group k is updated
by the C++ kernel, the next ones are being read and k-1 written, so reads,
the CPU kernel and writes overlap (ZeRO-Infinity's pipeline). Shards in host
RAM need none of it: each is used where the store keeps it (`lends`: the
grads where backward wrote them, the states in place or, in an all-or-nothing
step, read from the committed copy and written to the step's new one), while
the drive's shards of the same step stream.

`StreamAdam` is that driver; what differs per user is only the layout (which
parts, their keys, which of grads and params the store holds), given by the
engine's `NvmePipeline` (from the placement plan) and by `NvmeAdam` (the
optax-compatible `adamw(offload="nvme")`, from the params' shapes).
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Any, Callable, Sequence

import numpy as np

from ..offload.store import AioStore, aligned_empty
from .kernel import AdamConstants, adamw_numpy

SLOTS = 3  # reading k+1, computing k, writing k-1
MAX_SLOTS = 8  # up to 6 sub-groups read ahead of the one being updated
ALIGN = 1024  # elements: a part's fp32 buffers start on a 4 KiB boundary (zero-copy transfers)
STATES = ("master", "mu", "nu")
PartKey = tuple[int, int, int]  # (leaf, rank, layer)


@dataclasses.dataclass(frozen=True)
class Part:
  """Rank `rank`'s shard of layer `layer` of leaf `leaf` (elements [start, start + size) of it),
  at `offset` in its sub-group's buffers."""

  leaf: int
  rank: int
  layer: int
  size: int
  offset: int = 0
  start: int = 0

  @property
  def id(self) -> PartKey:
    """(leaf, rank, layer): the part's name in the pipeline's outputs and held grads."""
    return (self.leaf, self.rank, self.layer)


@dataclasses.dataclass(frozen=True)
class Unit:
  """One sub-group: parts of one rank's layer, moved as one transfer and updated together."""

  parts: tuple[Part, ...]
  size: int  # elements of buffer it takes (parts aligned to ALIGN elements)


def pack_units(parts: Sequence[Part], layers: Sequence[int | None]) -> list[Unit]:
  """Consecutive parts of one rank's layer, packed into sub-groups no larger than the largest
  part: the small leaves (biases, norms) ride along instead of costing a transfer each, and
  the buffers stay as large as they were."""
  cap = max((p.size for p in parts), default=0)
  units: list[Unit] = []
  group: list[Part] = []
  used = 0

  def close():
    nonlocal group, used
    if group:
      units.append(Unit(tuple(group), used))
    group, used = [], 0

  for p in parts:
    same = group and (group[0].rank, group[0].layer, layers[group[0].leaf] is None) == (
        p.rank, p.layer, layers[p.leaf] is None)
    start = -(-used // ALIGN) * ALIGN
    if not same or start + p.size > cap:
      close()
      start = 0
    group.append(dataclasses.replace(p, offset=start))
    used = start + p.size
  close()
  return units


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


def clipped(grad: np.ndarray, norm: float, limit: float) -> np.ndarray:
  """`grad` scaled to a global norm of `limit` where `norm` reaches it, as
  optax.clip_by_global_norm does, in the grads' dtype."""
  if not norm >= limit:  # a NaN norm too: left to skip_nonfinite
    return grad
  return ((grad / grad.dtype.type(norm)) * grad.dtype.type(limit)).astype(grad.dtype)


class StreamAdam:
  """AdamW over parts whose master and moments live in `store`.

  Subclasses lay the parts out: they set `units` (through `lay_out`) and say
  each part's store key (`key`) and whether its grads or new params are in the
  store too (`on_store`); everything else (buffers, the pipeline, the in-place
  update in RAM, init writes, clipping, statistics) is here.
  """

  def __init__(self, store: AioStore | None, constants: AdamConstants, params_dtype: Any,
               grads_dtype: Any, threads: int = 0, moment_dtype: Any = np.float32):
    self.store, self.constants, self.threads = store, constants, threads
    self.params_dtype, self.grads_dtype = np.dtype(params_dtype), np.dtype(grads_dtype)
    self.moment_dtype = np.dtype(moment_dtype)
    self.units: list[Unit] = []
    self.slots, self.pinned_bytes = SLOTS, 0
    self.last_step: dict[str, float] = {}
    self._buffers: tuple[str, ...] = STATES
    self._slots: list[dict[str, np.ndarray]] = []
    self._slot_views: dict[tuple[int, PartKey], dict[str, np.ndarray]] = {}
    self._zero_buf: np.ndarray | None = None
    self._keys: dict[PartKey, dict[str, str]] = {}

  # ---------------------------------------------------------------- layout
  def key(self, state: str, part: Part) -> str:
    raise NotImplementedError

  def keys_of(self, part: Part) -> dict[str, str]:
    """Every state's store key of `part` ("master" ... "params"), made once: a step asks for
    them several times a part, and the key scheme (formatted in C++) cost more than a small
    part's update."""
    got = self._keys.get(part.id)
    if got is None:
      got = self._keys[part.id] = {s: self.key(s, part) for s in STATES + ("grads", "params")}
    return got

  def on_store(self, state: str, part: Part) -> bool:
    """Whether `part`'s "grads" or "params" are in the store (else the caller gives and takes
    them as host arrays); master and moments always are."""
    return False

  def shape(self, part: Part) -> tuple[int, ...]:
    """The shape `part`'s shards are stored in (the store checks it on every read)."""
    return (part.size,)

  @property
  def parts(self) -> list[Part]:
    return [p for u in self.units for p in u.parts]

  def lay_out(self, units: list[Unit], budget: int, buffers: Sequence[str]) -> int:
    """Take `units`, with per-set buffers `buffers` (the states plus "grads" / "params" where
    some part keeps them in the store), as many sets as `budget` bytes hold (3 to 8). Returns
    the bytes one set takes."""
    self.units, self._keys, self._slot_views = units, {}, {}
    dtypes = self._dtypes()
    largest = max((u.size for u in units), default=0)
    per_set = largest * sum(dtypes[b].itemsize for b in buffers)
    slots = int(min(MAX_SLOTS, max(SLOTS, budget // max(per_set, 1))))
    if self._slots and (slots != len(self._slots) or tuple(buffers) != self._buffers
                        or self._slots[0]["master"].size < largest):
      self._slots = []
    self._buffers = tuple(buffers)
    self.slots, self.pinned_bytes = slots, slots * per_set
    return per_set

  def _slot(self, k: int) -> dict[str, np.ndarray]:
    if not self._slots:
      n = max(u.size for u in self.units)
      dtypes = self._dtypes()
      self._slots = [{b: aligned_empty(n, dtypes[b]) for b in self._buffers}
                     for _ in range(self.slots)]
    return self._slots[k % self.slots]

  def _views(self, k: int, part: Part) -> dict[str, np.ndarray]:
    """Part `part` of sub-group k's buffers, in its stored shape (made once a slot and part:
    the buffers live as long as the layout)."""
    at = (k % self.slots, part.id)
    got = self._slot_views.get(at)
    if got is None:
      shape = self.shape(part)
      got = self._slot_views[at] = {name: buf[part.offset:part.offset + part.size].reshape(shape)
                                    for name, buf in self._slot(k).items()}
    return got

  # ------------------------------------------------------------------ init
  def write_part(self, part: Part, master: np.ndarray, params: np.ndarray | None = None) -> list:
    """Store `part`'s fp32 master with zero moments, and its compute params where the store
    keeps them (`params`: that cast, if the caller has it; else cast here); returns the write
    tickets."""
    data = np.ascontiguousarray(master, np.float32)
    zeros = self._zeros(data.shape, self.moment_dtype)
    tickets = [self.store.write(self.key("master", part), data)]
    tickets += [self.store.write_zeros(self.key(s, part), zeros) for s in ("mu", "nu")]
    if self.on_store("params", part):
      params = data.astype(self.params_dtype) if params is None else params
      tickets.append(self.store.write(self.key("params", part), params))
    return tickets

  def _zeros(self, shape: tuple[int, ...], dtype: Any = np.float32) -> np.ndarray:
    """A read-only zero shard of `shape` and `dtype` (fp32 or bf16), a view of one buffer (as
    large as the largest shard asked for) that every write of fresh moments shares:
    zero-filling a new buffer per write cost init as much as drawing the master.
    `release_zeros` frees it."""
    n = int(np.prod(shape, dtype=np.int64))
    if self._zero_buf is None or self._zero_buf.size < n:
      self._zero_buf = aligned_empty(n, np.float32)  # writes in flight keep the old one alive
      self._zero_buf.fill(0)
      self._zero_buf.flags.writeable = False
    return self._zero_buf.view(dtype)[:n].reshape(shape)

  def release_zeros(self) -> None:
    """Drop the shared zero shard (after init or a weight load)."""
    self._zero_buf = None

  # ------------------------------------------------------------------ step
  def stream(self, lr: float, bc1: float, bc2: float, decays: Sequence[float],
             grad_of: Callable[[Part], np.ndarray] | None, out_of: Callable[[Part], np.ndarray],
             gate: Any = None, norm: Callable[[], float] | None = None,
             clip: float | None = None, step: int = 0, units: Sequence[Unit] | None = None,
             held: bool = False, made: Callable[[Part], None] | None = None) -> None:
    """One AdamW step over every sub-group (or those of `units`).

    `grad_of(part)` gives a part's grad and `out_of(part)` the host array its
    new params go to, where the store does not keep them (with `held`, for
    every part: grads held from an earlier step, params written later). With
    `gate`, grads in the store are still being written by a running backward
    pass: each is read once the gate says it is there. With `clip`, grads are
    scaled to that global norm, `norm()` (asked at the first update, blocking
    until known). `step` (the count after this update) seeds the rounding of
    bf16 moments. `made(part)` is told of each part whose new params went to
    `out_of(part)`, once they are there.
    """
    units = self.units if units is None else list(units)
    stored = (lambda state, part: False) if held else self.on_store
    # updated where the store keeps it, no buffer, no copy (asked once a key: fixed for the step)
    lent = functools.cache(self.store.lends)
    c = self.constants
    waited = [0.0]

    item = {b: dt.itemsize for b, dt in self._dtypes().items()}
    moved_bytes = {True: 0, False: 0}

    def keys(p: Part, extra: str) -> list[tuple[str, str]]:
      every = self.keys_of(p)
      return [(s, every[s]) for s in STATES + ((extra,) if stored(extra, p) else ())]

    def views(k, reading: bool):
      """Sub-group k's transfers: its keys the store does not lend, and their buffers."""
      out = []
      for p in units[k].parts:
        moved = [(s, key) for s, key in keys(p, "grads" if reading else "params") if not lent(key)]
        bufs = self._views(k, p) if moved else {}
        out += [(key, bufs[s]) for s, key in moved]
        moved_bytes[reading] += sum(p.size * item[s] for s, _ in moved)
      return out

    def read_when_written(key, out):
      gate.wait(key)
      return self.store.read(key, out)

    def start_read(k):
      """One transfer for the sub-group's shards; a grad backward has not written yet is read
      on its own once it is there."""
      now, late = [], []
      for key, out in views(k, reading=True):
        waits = gate is not None and key.startswith("g/") and not gate.ready(key)
        (late if waits else now).append((key, out))
      return ([self.store.read_many(now)] if now else []) + [
          _Deferred(functools.partial(read_when_written, key, out)) for key, out in late]

    def at(k: int, state: str, p: Part, bufs: dict[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
      """Where the update reads `state` of `p` and where it writes it: sub-group k's buffers
      (`bufs`: their views for `p`, made on first need), or the store's shard (in an
      all-or-nothing step, the committed copy and the step's new one)."""
      key = self.keys_of(p)[state]
      if not lent(key):
        if not bufs:
          bufs.update(self._views(k, p))
        return bufs[state], bufs[state]
      if state == "grads":
        if gate is not None and not gate.ready(key):
          t0 = time.perf_counter()  # backward has not written it yet
          gate.wait(key)
          waited[0] += time.perf_counter() - t0
        grad = self.store.view(key)
        return grad, grad
      return self.store.stage(key)

    def compute(k):
      for p in units[k].parts:
        bufs: dict[str, np.ndarray] = {}
        grad = at(k, "grads", p, bufs)[0] if stored("grads", p) else _flat(grad_of(p))
        if clip:
          grad = clipped(grad, norm(), clip)
        param = at(k, "params", p, bufs)[1] if stored("params", p) else out_of(p)
        src, dst = zip(*(at(k, s, p, bufs) for s in STATES))
        moved = any(a is not b for a, b in zip(src, dst))  # a new copy, read from the old
        adamw_numpy(*dst, grad, param.reshape(-1), lr, bc1, bc2, c, decays[p.leaf],
                    self.threads, step, src if moved else None)
        if made is not None and not stored("params", p):
          made(p)

    def start_write(k):
      items = views(k, reading=False)
      return [self.store.write_many(items)] if items else []

    stats = run_pipeline(len(units), start_read, compute, start_write, self.slots)
    stats["compute_s"] -= waited[0]  # waits on backward inside the update: the reads' waits
    stats["read_wait_s"] += waited[0]
    stats["bytes_read"], stats["bytes_written"] = moved_bytes[True], moved_bytes[False]
    self.last_step = stats

  def _dtypes(self) -> dict[str, np.dtype]:
    """Each buffer's dtype: the master fp32, the moments, grads and params in theirs."""
    return {"master": np.dtype(np.float32), "mu": self.moment_dtype, "nu": self.moment_dtype,
            "grads": self.grads_dtype, "params": self.params_dtype}

  def close(self) -> None:
    if self.store is not None:
      self.store.close()
      self.store = None


def _flat(x: np.ndarray) -> np.ndarray:
  return np.ascontiguousarray(x).reshape(-1)


class _Deferred:
  """A read that starts when it is first waited on (its data was not written yet)."""

  def __init__(self, start: Callable[[], Any]):
    self._start, self._ticket = start, None

  def wait(self):
    if self._ticket is None:
      self._ticket = self._start()
    return self._ticket.wait()
