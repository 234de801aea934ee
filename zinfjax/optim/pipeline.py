"""The engine's optimizer over the plan's segments in the swap store (NVMe, or host RAM).

The plan's store-held optimizer segments are cut into parts (one rank's shard of one layer of
one leaf) and packed into sub-groups (consecutive parts of one rank's layer, none larger than
the largest part) for the one AdamW driver (`stream.StreamAdam`). Sub-groups go in the order
backward writes their grads (`Timeline.grad_order`), so with the grads in the store the update
of a layer runs while backward is still on the layers below it. Where a part's grads or
compute params live (the store, or an array on another tier) is the plan's to say, per layer.

With `delay="tail"`, the parts backward reaches last (the leaves outside the stacks: the
embedding, the final norm, an untied head) are updated one step late: their grads are held,
and the next step updates them with those while its forward runs, instead of the step waiting
for their update after backward. Their new params reach the store as soon as that step's
backward has written the part's grads (the program reads its params no more), and reach a tier
of arrays after the program. With `delay="all"` every part is: the whole update runs while the
next step's program does (ZeRO-Offload's delayed parameter update).

Under "all" in a RAM store outside transactions, the held grads and the new params stay in the
store, double-buffered: each such key has a twin (`TWIN` + key). Backward writes a step's
grads to the key while the held update reads the last step's from the twin and writes the new
params to the params key's twin while the program reads the key; once the program is done the
pairs trade places (`AioStore.exchange`), so nothing is copied.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from ..offload.store import AioStore
from ..placement import Plan
from ..putback import HostPool, PutBack, reuse, whole_buffers
from ..schedule import Phase, timeline
from .gate import GradGate
from .hyper import AdamHyper
from .stream import SLOTS, STATES, Part, PartKey, StreamAdam, Unit, pack_units


TWIN = "t/"  # + a store key: the key's twin (its other buffer), under "all" in a RAM store
# what one step's streams report (`StreamAdam.last_step`), summed over them
STATS = ("step_s", "compute_s", "read_wait_s", "write_wait_s", "bytes_read", "bytes_written")


@dataclasses.dataclass
class Held:
  """The delayed parts' grads of one step, for the update one step later."""

  grads: dict[PartKey, np.ndarray]
  count: int                # the optimizer count of the step that made them
  norm: float | None = None  # that step's global grad norm (for clipping)
  in_store: tuple[Part, ...] = ()  # parts whose grads stay in the store: in their twins


class NvmePipeline(StreamAdam):
  """AdamW over the plan's store-held optimizer segments, for the ranks this process owns.

  Args:
    store, plan: the process's swap store; the placement plan (segments, keys, shapes).
    hyper, decays: AdamW hyperparameters and per-leaf weight decay.
    budget: bytes the rotating buffers may take.
    delay: "tail" or "all": which parts are updated one step late (see above); "none".
  """

  def __init__(self, store: AioStore, plan: Plan, hyper: AdamHyper, decays: Sequence[float], *,
               budget: int, threads: int = 0, delay: str = "none"):
    super().__init__(store, hyper.constants, plan.dtype("params"), plan.dtype("grads"), threads,
                     hyper.moment_dtype)
    self.plan, self.hyper, self.decays, self.budget = plan, hyper, list(decays), budget
    self.ranks = plan.ranks
    self.delay = delay
    self.tail: list[Unit] = []  # the sub-groups updated one step late (first in `units`)
    self.held: Held | None = None  # the grads they wait with
    self._pending: Held | None = None  # this step's, held once the step stands
    self._new_in_twins = False  # the held update wrote new params to the params keys' twins
    # host arrays of held grads and written params a step is done with, for a later step's
    # (fresh pages cost a page fault each: two bytes a param, twice a step, under "all")
    self._spare: dict[tuple[str, PartKey], np.ndarray] = {}
    # likewise the whole-segment buffers of new params a step put back on the device
    self._put_back: Callable[[], Sequence[np.ndarray]] = list
    # and the arrays of single parts there, as soon as their copy is done (`PutBack`): a
    # layer of each leaf
    caps = collections.Counter((tuple(l.local_shape), self.params_dtype) for l in plan.leaves
                               for _ in self.ranks)
    self.pool = HostPool(dict(caps))
    # (leaf, layer) pairs this pipeline updates (master and moments in the store), whose grads
    # it reads from the store, and whose compute params it writes there: the timeline says
    moves = timeline(plan)
    layers = lambda ms: {(m.leaf, l) for m in ms if not m.dst.holds_arrays for l in range(m.start, m.stop)}
    self._on_nvme = {"master": layers(moves.select(Phase.OPTIMIZER)),
                     "params": layers(moves.select(Phase.AFTER)),
                     "grads": layers(moves.select(Phase.BACKWARD, "grads"))}
    self._nvme = self._on_nvme["master"]
    self._scalars = jax.jit(hyper.scalars)
    self._hyper: dict[int, tuple] = {}  # (lr, bc1, bc2, step) by count, made by `prepare`
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
    layers = [l.num_layers if l.stacked else None for l in self.plan.leaves]
    # "tail": what backward reaches after the last stacked layer; "all": everything
    last = max((k for k, (leaf, _) in enumerate(order) if leaf in stack_of), default=-1)
    late = {"none": set(), "tail": set(order[last + 1:]), "all": set(order)}[self.delay]
    self.tail = pack_units([p for p in parts if (p.leaf, p.layer) in late], layers)
    units = self.tail + pack_units([p for p in parts if (p.leaf, p.layer) not in late], layers)
    per_set = self.lay_out(units, self.budget, ("master", "mu", "nu", "grads", "params"))
    if SLOTS * per_set > self.budget and not self.store.memory:  # in RAM: updated in place
      largest = max(u.size for u in units)
      raise ValueError(
          f"the NVMe optimizer needs {SLOTS} buffer sets for its largest sub-group (one rank's "
          f"shard of one layer, {largest:,} elements): {SLOTS * per_set / 2**20:.1f} MiB, more than "
          f"the {self.budget / 2**20:.1f} MiB of ZeroConfig.pinned_budget left for it. Raise "
          "pinned_budget or split the model over more devices.")

  def on_store(self, state: str, part: Part) -> bool:
    return (part.leaf, part.layer) in self._on_nvme[state]

  def shape(self, part: Part) -> tuple[int, ...]:
    return self.plan.leaves[part.leaf].local_shape

  def key(self, state: str, part: Part) -> str:
    return self.plan.leaves[part.leaf].key(state, part.rank, part.layer)

  def write_layer(self, leaf: int, rank: int, layer: int, master: np.ndarray,
                  params: np.ndarray | None = None) -> list:
    """Store one rank's fp32 master shard of one layer with zero moments, and its compute
    params when they live in the store; returns the write tickets."""
    return self.write_part(Part(leaf, rank, layer, 0), master, params)

  def written_keys(self) -> list[str]:
    """The store keys this pipeline's update rewrites (what undoing it rolls back): its parts'
    master params and moments, and their compute params where the store keeps them. Not the
    compute params the step's program writes there (of layers whose optimizer it runs)."""
    return [self.key(s, p) for p in self.parts for s in STATES] + [
        self.key("params", p) for p in self.parts if self.on_store("params", p)]

  def grad_keys(self) -> list[str]:
    """The swap-store keys of the grads this pipeline reads from the store."""
    return [self.key("grads", p) for p in self.parts if self.on_store("grads", p)]

  def array_grad_order(self) -> list[tuple[int, int]]:
    """The (leaf, layer) pairs whose grads `step` asks its `grad_of` for (those not in the
    store), in the order it asks: this step's sub-groups, then the tail's."""
    n = len(self.tail)
    return list(dict.fromkeys((p.leaf, p.layer) for u in self.units[n:] + self.units[:n]
                              for p in u.parts if not self.on_store("grads", p)))

  grads_all_on_nvme = property(lambda self: all(self.on_store("grads", p) for p in self.parts))

  @property
  def grads_on_store(self) -> bool:
    """Whether backward writes any of the grads this pipeline reads into the store."""
    return any(self.on_store("grads", p) for p in self.parts)

  def step(self, count: int, grad_of: Callable[[Part], np.ndarray] | None = None,
           gate: GradGate | None = None,
           grad_norm: float | Callable[[], float] | None = None,
           putback: PutBack | None = None) -> dict[PartKey, np.ndarray]:
    """One AdamW step over every sub-group (see `StreamAdam.stream`); `grad_norm` (the global
    norm of all grads, or a callable asked for it at the first update) is needed when the
    AdamW clips. Returns the new compute params of the parts whose params are not in the
    store, but for those of this step's parts `putback` took as they were made."""
    lr, bc1, bc2, step = self._hyper_at(count)
    clip = self.hyper.max_grad_norm
    now = self.units[len(self.tail):]
    if clip is not None and grad_norm is None and now:
      raise ValueError("this AdamW clips grads (max_grad_norm): pass the step's grad_norm.")
    known: list[float] = []

    def norm() -> float:
      if not known:
        known.append(grad_norm() if callable(grad_norm) else grad_norm)
      return known[0]

    held = self.holding
    twins = self.twins
    # new params in host arrays: those the store does not keep, and the tail's (written to the
    # store once the program is past them, `_grads_of`; or to their twins)
    made = [p for u in now for p in u.parts if not self.on_store("params", p)]
    if held is not None:
      made += [p for u in self.tail for p in u.parts if not (twins and self.on_store("params", p))]
    # this step's parts `putback` may take as they are made: a host array each, made when
    # its update starts and let go once taken (not one buffer for a segment of them)
    own = ({p.id for u in now for p in u.parts if not self.on_store("params", p)
            and putback.wants(p.leaf, p.layer)} if putback is not None else set())
    outs = self._new_params([p for p in made if p.id not in own])

    def out_of(p: Part) -> np.ndarray:
      if p.id in own and p.id not in outs:
        outs[p.id] = self._array("params", p)
      return (outs[p.id] if p.id in outs
              else self.store.view(self._twin_key("params", p))).reshape(-1)

    def returned(p: Part) -> None:  # new params of a device array: to `putback`, if it takes them
      if p.id in outs and putback.wants(p.leaf, p.layer) and putback.take(*p.id, outs[p.id]):
        del outs[p.id]
    runs = []  # each stream's stats, summed for the step
    if held is not None:  # the delayed parts, with the grads held from the step before
      runs.append(self._held_update(held, out_of))
      self._new_in_twins = twins
    if now:
      self.stream(lr, bc1, bc2, self.decays, grad_of, out_of, gate, norm, clip, step, units=now,
                  made=returned if own else None)
      runs.append(self.last_step)
    if self.tail:
      kept = tuple(p for u in self.tail for p in u.parts if twins and self.on_store("grads", p))
      self._pending = Held(self._grads_of(self.tail, grad_of, gate, outs, kept,
                                          returned if putback is not None else None),
                           count, in_store=kept)
    self.last_step = {k: sum(r.get(k, 0.0) for r in runs) for k in STATS}
    return outs

  def _held_update(self, held: Held, out_of: Callable[[Part], np.ndarray]) -> dict:
    """The delayed parts' update with `held`'s grads (its step's count and norm); its stats."""
    lr, bc1, bc2, step = self._hyper_at(held.count)
    self.stream(lr, bc1, bc2, self.decays, lambda p: held.grads[p.id], out_of, None,
                lambda: held.norm, self.hyper.max_grad_norm, step, units=self.tail, held=True)
    return self.last_step

  def flush(self) -> dict[PartKey, np.ndarray]:
    """Apply the held grads now, with no step beside (before the model is taken out); nothing
    is held after. Returns the new compute params of the parts whose params are arrays."""
    if self.holding is None:
      return {}
    parts = [p for u in self.tail for p in u.parts]
    stored = [p for p in parts if self.on_store("params", p)]
    outs = self._new_params([p for p in parts if not (self.twins and p in stored)])
    twin = lambda p: self.store.view(self._twin_key("params", p))
    out_of = lambda p: (outs[p.id] if p.id in outs else twin(p)).reshape(-1)
    self.last_step = self._held_update(self.held, out_of)
    if self.twins:  # the new params are in the twins: they trade places
      self._exchange("params", stored)
    elif stored:
      self.store.write_many([(self.key("params", p), outs.pop(p.id)) for p in stored]).wait()
    self.held = None
    return outs

  def prepare(self, count: int) -> None:
    """Make the scalars of the step after `count` steps (and of the held update) now, before
    the step's program is dispatched. Made later, on the pipeline's thread, their computation
    would queue on the device behind the whole program (XLA:GPU runs a device's programs one
    after another), and the update meant to run under backward would start after it."""
    counts = {count} | ({self.held.count} if self.held is not None else set())
    self._hyper = {c: self._hyper.get(c) or self._compute_hyper(c) for c in counts}

  def _hyper_at(self, count: int) -> tuple:
    """(lr, bc1, bc2, step) of the update after `count` steps, as Python scalars: those
    `prepare` made, else made now."""
    return self._hyper.get(count) or self._compute_hyper(count)

  def _compute_hyper(self, count: int) -> tuple:
    """Jitted, like in the step: XLA's compiled pow/schedule can differ from eager by an ulp."""
    return tuple(x.item() for x in self._scalars(jnp.int32(count)))

  def _grads_of(self, units: Sequence[Unit], grad_of: Callable[[Part], np.ndarray] | None,
                gate: GradGate | None, outs: dict[PartKey, np.ndarray],
                kept: Sequence[Part] = (), returned: Callable[[Part], None] | None = None
                ) -> dict[PartKey, np.ndarray]:
    """Copies of the grads of `units`' parts: from the store (in the order backward writes
    them, each run of written ones read at once while backward goes on), then from `grad_of`
    (once the program is done). A part's grads written, the program reads its params no more:
    its new params in `outs` whose tier is the store (the held update's) are written there
    then, not after the program, and leave `outs`; those whose tier is a device array are
    `returned` (to the step's `PutBack`, taken once the step is known to stand) as each part's
    grads arrive from the device, so a layer's new params cross to the device while the next
    layer's grads cross from it, instead of all of them after all the reads. The grads of
    `kept` are not copied: they stay in the store (`advance` moves them to their twins)."""
    left = {p.id for p in kept}
    parts = [p for u in units for p in u.parts if p.id not in left]
    out = {p.id: self._array("grads", p) for p in parts}
    tickets: list = []
    sent: list[tuple[Part, np.ndarray]] = []  # new params written to the store

    def past(ps: list[Part]) -> None:  # the program is past them: read grads, write params
      reads = [(self.key("grads", p), out[p.id]) for p in ps if self.on_store("grads", p)]
      writes = [(p, outs.pop(p.id)) for p in ps if p.id in outs and self.on_store("params", p)]
      sent.extend(writes)
      if reads:
        tickets.append(self.store.read_many(reads))
      if writes:
        tickets.append(self.store.write_many([(self.key("params", p), a) for p, a in writes]))

    run: list[Part] = []
    for p in (p for p in parts if self.on_store("grads", p)):
      key = self.key("grads", p)
      if gate is not None and not gate.ready(key):
        past(run)
        run = []
        gate.wait(key)
      run.append(p)
    past(run)
    rest = [p for p in parts if not self.on_store("grads", p)]
    for p in rest:
      out[p.id][...] = grad_of(p)
      if returned is not None:
        returned(p)
    past(rest)
    for t in tickets:
      t.wait()
    self._spare.update((("params", p.id), a) for p, a in sent)  # in the store now
    return out

  def advance(self, norm: float, skipped: bool) -> None:
    """The step stands (after any redo): its delayed parts' grads (global norm `norm`) are
    held for the next step; a skipped step's are dropped. Under "tail" the grads held before a
    skipped step wait on (it applied none of them, or was rolled back); under "all" that step
    applied them, and they are spent."""
    pending, self._pending = self._pending, None
    before = self.held
    if self._new_in_twins:  # the held update applied, skipped or not: its params are current
      self._exchange("params",
                     [p for u in self.tail for p in u.parts if self.on_store("params", p)])
      self._new_in_twins = False
    if pending is not None and not skipped:
      if pending.in_store:  # this step's grads to the twins, where the next backward leaves them
        self._exchange("grads", pending.in_store)
        pending.grads.update((p.id, self.store.view(TWIN + self.key("grads", p)))
                             for p in pending.in_store)
      pending.norm = norm
      self.held = pending
    elif skipped and self.delay == "all":
      self.held = None
    for spent in (before, pending):  # their arrays serve a later step's grads
      if spent is not None and spent is not self.held:
        self._spare.update((("grads", k), a) for k, a in spent.grads.items()
                           if a.base is None and a.flags.writeable)

  @property
  def holding(self) -> Held | None:
    """The grads held for the delayed parts' update (by a next step or `flush`), if any."""
    return self.held if self.tail else None

  @property
  def twins(self) -> bool:
    """Whether this step's held grads and new params stay in the store, double-buffered:
    every update one step late, in a RAM store, outside a transaction (whose rollback would
    not undo an exchange)."""
    return self.delay == "all" and self.store.memory and not self.store.in_transaction

  def _twin_key(self, state: str, part: Part) -> str:
    """The store key of `part`'s `state` twin, its shard made on first use."""
    key = TWIN + self.key(state, part)
    if not self.store.has(key):
      dtype = self.grads_dtype if state == "grads" else self.params_dtype
      self.store.write_zeros(key, np.zeros(self.shape(part), dtype)).wait()
    return key

  def _exchange(self, state: str, parts: Sequence[Part]) -> None:
    """`parts`' `state` shards and their twins trade places (the program that used them done)."""
    self.store.exchange([(self.key(state, p), self._twin_key(state, p)) for p in parts])

  def recycle(self, put_back: Callable[[], Sequence[np.ndarray]]) -> None:
    """`put_back()` (`PutBack.spent`, asked at the next step's update) lists host arrays of new
    params the step put on the device: the whole-segment buffers among them serve again."""
    self._put_back = put_back

  def _new_params(self, made: Sequence[Part]) -> dict[PartKey, np.ndarray]:
    """Host arrays for the new compute params of `made`. Where a rank's parts cover a whole
    stacked segment of arrays, they are views into one [layers, ...] buffer, which the step
    puts back as it is (`PutBack.finish`) instead of stacking a second copy."""
    ids, outs, free = {p.id for p in made}, {}, whole_buffers(self._put_back())
    self._put_back = list
    for p in made:
      if p.id in outs:
        continue
      leaf = self.plan.leaves[p.leaf]
      seg = next((s for s in leaf.array_segments("params") if p.layer in s), None)
      if (leaf.stacked and seg is not None
          and all((p.leaf, p.rank, l) in ids for l in range(seg.start, seg.stop))):
        whole = reuse(free, (seg.layers, *self.shape(p)), self.params_dtype)
        outs.update(((p.leaf, p.rank, l), whole[l - seg.start]) for l in range(seg.start, seg.stop))
      else:
        outs[p.id] = self._array("params", p)
    return outs

  def _array(self, state: str, part: Part) -> np.ndarray:
    """A host array for `part`'s held "grads" or new "params": one a step is done with (new
    params: or one whose copy on the device is done), else a new one."""
    shape, dtype = self.shape(part), self.grads_dtype if state == "grads" else self.params_dtype
    spare = self._spare.pop((state, part.id), None)
    if spare is not None and spare.shape == shape and spare.dtype == dtype:
      return spare
    return self.pool.take(shape, dtype) if state == "params" else np.empty(shape, dtype)
