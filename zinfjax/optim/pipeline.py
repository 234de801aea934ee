"""AdamW over optimizer states in the swap store: the NVMe tier of the engine's optimizer.

The plan's NVMe optimizer segments are cut into parts (one rank's shard of
one layer of one leaf), packed into sub-groups (consecutive parts of one
rank's layer, none larger than the largest part) and streamed through 3 to 8
rotating pinned buffer sets (as many as `pinned_budget` holds): while
sub-group k is updated by the C++ kernel, the next ones are being read and
k-1 written, so NVMe reads, the CPU kernel and NVMe writes overlap. Sub-groups
go in the order backward writes their grads (`Timeline.grad_order`), so
with the grads on NVMe the update of a layer runs while backward is still on
the layers below it. Where a part's grads or compute params live (NVMe, or an
array on another tier) is the plan's to say, per layer.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from ..offload.store import AioStore, aligned_empty
from ..placement import Plan, Tier
from ..schedule import Phase, timeline
from .hyper import AdamHyper
from .kernel import adamw_numpy
from .nvme import SLOTS, run_pipeline

MAX_SLOTS = 8  # up to 6 sub-groups read ahead of the one being updated
PartKey = tuple[int, int, int]  # (leaf, rank, layer)


@dataclasses.dataclass(frozen=True)
class Part:
  """Rank `rank`'s shard of layer `layer` of leaf `leaf`, at `offset` in its sub-group's buffers."""

  leaf: int
  rank: int
  layer: int
  size: int
  offset: int = 0


@dataclasses.dataclass(frozen=True)
class Unit:
  """One sub-group: shards of one rank's layer, moved as one transfer and updated together."""

  parts: tuple[Part, ...]
  size: int  # elements of buffer it takes (parts aligned to ALIGN elements)


ALIGN = 1024  # elements: a part's fp32 buffers start on a 4 KiB boundary (zero-copy transfers)


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


class NvmePipeline:
  """AdamW over the plan's NVMe optimizer segments, for the ranks this process owns.

  Args:
    store: the process's swap store.
    plan: the placement plan (segments, keys, shapes).
    hyper, decays: AdamW hyperparameters and per-leaf weight decay.
    budget: bytes the rotating buffers may take.
  """

  def __init__(self, store: AioStore, plan: Plan, hyper: AdamHyper, decays: Sequence[float], *,
               budget: int, threads: int = 0):
    self.store, self.plan, self.hyper, self.decays = store, plan, hyper, list(decays)
    self.params_dtype = np.dtype(plan.dtype("params"))
    self.grads_dtype = np.dtype(plan.dtype("grads"))
    self.threads, self.budget = threads, budget
    self.ranks = plan.ranks
    # (leaf, layer) pairs this pipeline updates (master and moments on NVMe), whose grads it
    # reads from NVMe, and whose compute params it writes there: the step's timeline says
    moves = timeline(plan)
    layers = lambda ms: {(m.leaf, l) for m in ms if m.dst == Tier.NVME for l in range(m.start, m.stop)}
    self._on_nvme = {"master": layers(moves.select(Phase.OPTIMIZER)),
                     "params": layers(moves.select(Phase.AFTER)),
                     "grads": layers(moves.select(Phase.BACKWARD, "grads"))}
    self._nvme = self._on_nvme["master"]
    if store.memory and (self._on_nvme["grads"] or self._on_nvme["params"]):
      raise ValueError("the host-memory store holds optimizer states only: the grads come from "
                       "the program and the new params go back to it.")
    self._slots: list[dict[str, np.ndarray]] = []
    self._zero_buf: np.ndarray | None = None
    self._scalars = jax.jit(hyper.scalars)
    self.last_step: dict[str, float] = {}
    self.set_order(moves.grad_order)  # the plan's stack order, until the step finds the forward's

  def set_order(self, order: Sequence[tuple[int, int]]) -> None:
    """Update the sub-groups in this (leaf, layer) order: the order backward writes grads."""
    # within one layer of one stack (the leaves backward writes at once), each rank's leaves
    # stay together, so its small leaves pack into one sub-group
    stack_of = {leaf: j for j, s in enumerate(self.plan.stacks) for leaf in s.leaves}
    block = lambda o: (stack_of.get(o[0]), o[1])
    parts, i = [], 0
    while i < len(order):
      j = i
      while j < len(order) and block(order[j]) == block(order[i]):
        j += 1
      mine = [o for o in order[i:j] if o in self._nvme]
      parts += [Part(leaf, r, layer, self.plan.leaves[leaf].local_size)
                for r in self.ranks for leaf, layer in mine]
      i = j
    self.units = pack_units(parts, [l.num_layers if l.stacked else None for l in self.plan.leaves])
    largest = max((u.size for u in self.units), default=0)
    per_set = largest * (12 + self.params_dtype.itemsize + self.grads_dtype.itemsize)
    if SLOTS * per_set > self.budget and not self.store.memory:  # in RAM: updated in place
      raise ValueError(
          f"the NVMe optimizer needs {SLOTS} buffer sets for its largest sub-group (one rank's "
          f"shard of one layer, {largest:,} elements): {SLOTS * per_set / 2**20:.1f} MiB, more than "
          f"the {self.budget / 2**20:.1f} MiB of ZeroConfig.pinned_budget left for it. Raise "
          "pinned_budget or split the model over more devices.")
    # more sets where the budget allows: reads run further ahead of the kernel
    slots = int(min(MAX_SLOTS, self.budget // max(per_set, 1)))
    if self._slots and (slots != len(self._slots) or self._slots[0]["master"].size < largest):
      self._slots = []
    self.slots, self.pinned_bytes = slots, slots * per_set

  @property
  def parts(self) -> list[Part]:
    return [p for u in self.units for p in u.parts]

  def on_nvme(self, state: str, part: Part) -> bool:
    return (part.leaf, part.layer) in self._on_nvme[state]

  def key(self, state: str, part: Part) -> str:
    return self.plan.leaves[part.leaf].key(state, part.rank, part.layer)

  def _slot(self, k: int) -> dict[str, np.ndarray]:
    if not self._slots:
      n = max(u.size for u in self.units)
      self._slots = [{"master": aligned_empty(n, np.float32), "mu": aligned_empty(n, np.float32),
                      "nu": aligned_empty(n, np.float32), "grads": aligned_empty(n, self.grads_dtype),
                      "params": aligned_empty(n, self.params_dtype)} for _ in range(self.slots)]
    return self._slots[k % self.slots]

  def _views(self, k: int, part: Part) -> dict[str, np.ndarray]:
    """Part `part` of sub-group k's buffers, in its leaf's shape."""
    shape = self.plan.leaves[part.leaf].local_shape
    return {name: buf[part.offset:part.offset + part.size].reshape(shape)
            for name, buf in self._slot(k).items()}

  # ---------------------------------------------------------------- init
  def write_layer(self, leaf: int, rank: int, layer: int, master: np.ndarray,
                  params: np.ndarray | None = None) -> list:
    """Store one rank's fp32 master shard of one layer with zero moments, and its compute
    params when they live on NVMe (`params`: that cast, if the caller has it; else cast
    here); returns the write tickets."""
    part = Part(leaf, rank, layer, 0)
    data = np.ascontiguousarray(master, np.float32)
    zeros = self._zeros(data.shape)
    tickets = [self.store.write(self.key(s, part), x)
               for s, x in (("master", data), ("mu", zeros), ("nu", zeros))]
    if self.on_nvme("params", part):
      params = data.astype(self.params_dtype) if params is None else params
      tickets.append(self.store.write(self.key("params", part), params))
    return tickets

  def _zeros(self, shape: tuple[int, ...]) -> np.ndarray:
    """A read-only fp32 zero shard of `shape`, a view of one buffer (as large as the largest
    shard asked for) that every write of fresh moments shares: zero-filling a new buffer per
    write cost init as much as drawing the master. `release_zeros` frees it."""
    n = int(np.prod(shape, dtype=np.int64))
    if self._zero_buf is None or self._zero_buf.size < n:
      self._zero_buf = aligned_empty(n, np.float32)  # writes in flight keep the old one alive
      self._zero_buf.fill(0)
      self._zero_buf.flags.writeable = False
    return self._zero_buf[:n].reshape(shape)

  def release_zeros(self) -> None:
    """Drop the shared zero shard (after init or a weight load)."""
    self._zero_buf = None

  # ---------------------------------------------------------------- step
  def grad_keys(self) -> list[str]:
    """The swap-store keys of the grads this pipeline reads from NVMe."""
    return [self.key("grads", p) for p in self.parts if self.on_nvme("grads", p)]

  @property
  def grads_all_on_nvme(self) -> bool:
    return all(self.on_nvme("grads", p) for p in self.parts)

  def step(self, count: int, grad_of: Callable[[Part], np.ndarray] | None = None,
           gate: "GradGate | None" = None,
           grad_norm: float | Callable[[], float] | None = None) -> dict[PartKey, np.ndarray]:
    """One AdamW step over every sub-group.

    `grad_of(part)` gives a part's grad (host array) where it is not on NVMe.
    With `gate`, the grads on NVMe are still being written by a running
    backward pass: each is read once the gate says it is there. `grad_norm`
    (the global norm of all grads) is needed when the AdamW clips; a callable is
    asked for it at the first update (blocking until it is known) while the
    reads ahead of it go on.
    Returns the new compute params of the parts whose params are not on NVMe.
    """
    # jitted, like in the step: XLA's compiled pow/schedule can differ from eager by an ulp
    lr, bc1, bc2 = (float(x) for x in self._scalars(jnp.int32(count)))
    c = self.hyper.constants
    clip = self.hyper.max_grad_norm
    if clip is not None and grad_norm is None:
      raise ValueError("this AdamW clips grads (max_grad_norm): pass the step's grad_norm.")
    known: list[float] = []

    def norm() -> float:
      if not known:
        known.append(grad_norm() if callable(grad_norm) else grad_norm)
      return known[0]

    outs: dict[PartKey, np.ndarray] = {}
    for p in self.parts:
      if not self.on_nvme("params", p):
        outs[(p.leaf, p.rank, p.layer)] = np.empty(self.plan.leaves[p.leaf].local_shape,
                                                   self.params_dtype)
    if self.store.memory and not self.store.in_transaction:
      return self._step_in_place(lr, bc1, bc2, grad_of, norm if clip else None, outs)
    states = ("master", "mu", "nu")

    def views(k, reading: bool):
      out = []
      for p in self.units[k].parts:
        bufs = self._views(k, p)
        extra = ("grads",) if reading else ("params",)
        names = states + tuple(s for s in extra if self.on_nvme(s, p))
        out += [(self.key(s, p), bufs[s]) for s in names]
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
      return [self.store.read_many(now)] + [
          _Deferred(functools.partial(read_when_written, key, out)) for key, out in late]

    def compute(k):
      for p in self.units[k].parts:
        slot = {name: x.reshape(-1) for name, x in self._views(k, p).items()}
        grad = slot["grads"] if self.on_nvme("grads", p) else np.ascontiguousarray(
            grad_of(p)).reshape(-1)
        if clip:
          grad = clipped(grad, norm(), clip)
        param = slot["params"] if self.on_nvme("params", p) else outs[(p.leaf, p.rank, p.layer)]
        adamw_numpy(slot["master"], slot["mu"], slot["nu"], grad, param.reshape(-1), lr, bc1,
                    bc2, c, self.decays[p.leaf], self.threads)

    stats = run_pipeline(len(self.units), start_read, compute,
                         lambda k: [self.store.write_many(views(k, reading=False))], self.slots)
    item = {"grads": self.grads_dtype.itemsize, "params": self.params_dtype.itemsize}
    nvme_bytes = lambda s: sum(p.size * item[s] for p in self.parts if self.on_nvme(s, p))
    moved = sum(p.size for p in self.parts) * 12
    stats["bytes_read"] = moved + nvme_bytes("grads")
    stats["bytes_written"] = moved + nvme_bytes("params")
    self.last_step = stats
    return outs

  def _step_in_place(self, lr: float, bc1: float, bc2: float, grad_of: Callable[[Part], np.ndarray],
                     norm: Callable[[], float] | None, outs: dict) -> dict[PartKey, np.ndarray]:
    """The step on a store in host RAM: each part's master and moments updated where the store
    keeps them (no buffers, no copies); grads from `grad_of`, params into `outs`."""
    c, clip = self.hyper.constants, self.hyper.max_grad_norm
    t0 = time.perf_counter()
    for p in self.parts:
      master, mu, nu = (self.store.view(self.key(s, p)) for s in ("master", "mu", "nu"))
      grad = np.ascontiguousarray(grad_of(p))
      if norm is not None:
        grad = clipped(grad, norm(), clip)
      adamw_numpy(master, mu, nu, grad, outs[(p.leaf, p.rank, p.layer)], lr, bc1, bc2, c,
                  self.decays[p.leaf], self.threads)
    took = time.perf_counter() - t0
    self.last_step = {"step_s": took, "compute_s": took, "read_wait_s": 0.0, "write_wait_s": 0.0,
                      "bytes_read": 0, "bytes_written": 0}
    return outs


def clipped(grad: np.ndarray, norm: float, limit: float) -> np.ndarray:
  """`grad` scaled to a global norm of `limit` where `norm` reaches it, as
  optax.clip_by_global_norm does, in the grads' dtype."""
  if not norm >= limit:  # a NaN norm too: left to skip_nonfinite
    return grad
  return ((grad / grad.dtype.type(norm)) * grad.dtype.type(limit)).astype(grad.dtype)


class _Deferred:
  """A read that starts when it is first waited on (its data was not written yet)."""

  def __init__(self, start: Callable[[], Any]):
    self._start, self._ticket = start, None

  def wait(self):
    if self._ticket is None:
      self._ticket = self._start()
    return self._ticket.wait()


class GradGate:
  """Tells the NVMe optimizer which grads a running backward pass has written.

  Built just before the step's program is dispatched: each grad key must
  reach one more completed write than it had then. `program_done()` says
  whether the program has finished; a grad still missing after that means
  the program failed to write it, and `wait` raises the engine's recorded
  error instead of waiting forever.
  """

  def __init__(self, store: AioStore, keys: Sequence[str], program_done: Callable[[], bool]):
    self.store, self.program_done = store, program_done
    self.want = {k: store.generation(k) + 1 for k in keys}
    self.waited = 0  # grads the optimizer reached before backward had written them

  def ready(self, key: str) -> bool:
    return self.store.generation(key) >= self.want[key]

  def wait(self, key: str, poll_s: float = 0.5) -> None:
    self.waited += 1
    while not self.store.wait_generation(key, self.want[key], poll_s):
      if self.program_done() and not self.ready(key):
        self.store.raise_deferred()
        raise RuntimeError(f"the step's program finished without writing grad shard {key!r}.")
