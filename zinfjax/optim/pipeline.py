"""The engine's optimizer over the plan's segments in the swap store (NVMe, or host RAM).

The plan's store-held optimizer segments are cut into parts (one rank's
shard of one layer of one leaf) and packed into sub-groups (consecutive parts
of one rank's layer, none larger than the largest part) for the one AdamW
driver (`stream.StreamAdam`). Sub-groups go in the order backward writes
their grads (`Timeline.grad_order`), so with the grads in the store the
update of a layer runs while backward is still on the layers below it. Where
a part's grads or compute params live (the store, or an array on another
tier) is the plan's to say, per layer.
"""

from __future__ import annotations

from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from ..offload.store import AioStore
from ..placement import Plan, Tier
from ..schedule import Phase, timeline
from .hyper import AdamHyper
from .stream import SLOTS, Part, PartKey, StreamAdam, pack_units


class NvmePipeline(StreamAdam):
  """AdamW over the plan's store-held optimizer segments, for the ranks this process owns.

  Args:
    store: the process's swap store.
    plan: the placement plan (segments, keys, shapes).
    hyper, decays: AdamW hyperparameters and per-leaf weight decay.
    budget: bytes the rotating buffers may take.
  """

  def __init__(self, store: AioStore, plan: Plan, hyper: AdamHyper, decays: Sequence[float], *,
               budget: int, threads: int = 0):
    super().__init__(store, hyper.constants, plan.dtype("params"), plan.dtype("grads"), threads,
                     hyper.moment_dtype)
    self.plan, self.hyper, self.decays, self.budget = plan, hyper, list(decays), budget
    self.ranks = plan.ranks
    # (leaf, layer) pairs this pipeline updates (master and moments in the store), whose grads
    # it reads from the store, and whose compute params it writes there: the timeline says
    moves = timeline(plan)
    layers = lambda ms: {(m.leaf, l) for m in ms if m.dst == Tier.NVME for l in range(m.start, m.stop)}
    self._on_nvme = {"master": layers(moves.select(Phase.OPTIMIZER)),
                     "params": layers(moves.select(Phase.AFTER)),
                     "grads": layers(moves.select(Phase.BACKWARD, "grads"))}
    self._nvme = self._on_nvme["master"]
    self._scalars = jax.jit(hyper.scalars)
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
    units = pack_units(parts, [l.num_layers if l.stacked else None for l in self.plan.leaves])
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

  def grad_keys(self) -> list[str]:
    """The swap-store keys of the grads this pipeline reads from the store."""
    return [self.key("grads", p) for p in self.parts if self.on_store("grads", p)]

  @property
  def grads_all_on_nvme(self) -> bool:
    return all(self.on_store("grads", p) for p in self.parts)

  @property
  def grads_on_store(self) -> bool:
    """Whether backward writes any of the grads this pipeline reads into the store."""
    return any(self.on_store("grads", p) for p in self.parts)

  def step(self, count: int, grad_of: Callable[[Part], np.ndarray] | None = None,
           gate: "GradGate | None" = None,
           grad_norm: float | Callable[[], float] | None = None) -> dict[PartKey, np.ndarray]:
    """One AdamW step over every sub-group (see `StreamAdam.stream`); `grad_norm` (the global
    norm of all grads, or a callable asked for it at the first update) is needed when the
    AdamW clips. Returns the new compute params of the parts whose params are not in the
    store."""
    # jitted, like in the step: XLA's compiled pow/schedule can differ from eager by an ulp
    lr, bc1, bc2, step = (x.item() for x in self._scalars(jnp.int32(count)))
    clip = self.hyper.max_grad_norm
    if clip is not None and grad_norm is None:
      raise ValueError("this AdamW clips grads (max_grad_norm): pass the step's grad_norm.")
    known: list[float] = []

    def norm() -> float:
      if not known:
        known.append(grad_norm() if callable(grad_norm) else grad_norm)
      return known[0]

    outs: dict[PartKey, np.ndarray] = {
        (p.leaf, p.rank, p.layer): np.empty(self.plan.leaves[p.leaf].local_shape, self.params_dtype)
        for p in self.parts if not self.on_store("params", p)}
    out_of = lambda p: outs[(p.leaf, p.rank, p.layer)].reshape(-1)
    self.stream(lr, bc1, bc2, self.decays, grad_of, out_of, gate, norm, clip, step)
    return outs


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
