"""When every shard moves, computed from the plan before `jit`, as data.

`timeline(plan)` lists the step's moves: which state of which layers of
which leaf goes from which tier to which, in which phase (forward, backward,
optimizer, after). The step's program, its NVMe/host pipeline and its tests
read them there instead of deciding per tier in their own code.

`layer_schedule` is the fetch/prefetch order inside one scanned stack. For a stack of L layers run forward (or backward, in reverse), with device
prefetch depth d and NVMe read-ahead n, scan step i computes layer i while

  * layer `arrive[i]` (i+d forward, i-d backward) arrives on the device from
    its tier and is all-gathered into the prefetch queue, and
  * the NVMe read of layer `read[i]` (i+d+n, i-d-n) starts,

so reads run n layers ahead of the host-to-device copies, which run d layers
ahead of compute. The prologue fetches the first d layers and starts the
first d+n reads before the scan. Indices past the ends are clamped (the last
layer is fetched again; cheap, and it keeps every scan step the same shape).
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Sequence

import numpy as np

from .placement import Plan, Segment, Tier


@dataclasses.dataclass(frozen=True)
class LayerSchedule:
  """Layer indices per scan position (the scan runs positions in `order`)."""

  arrive: np.ndarray            # int32[L]: layer arriving on device at position i
  read: np.ndarray              # int32[L]: layer whose NVMe read starts at position i
  prologue_arrive: tuple[int, ...]
  prologue_read: tuple[int, ...]
  reverse: bool

  @property
  def num_layers(self) -> int:
    return len(self.arrive)


def layer_schedule(num_layers: int, depth: int, nvme_depth: int = 0, *,
                   reverse: bool = False) -> LayerSchedule:
  """The schedule of one pass; `reverse=True` for the backward pass (layers L-1 ... 0)."""
  if num_layers < 1:
    raise ValueError(f"a stack needs at least one layer, got {num_layers}.")
  last = num_layers - 1
  step = -1 if reverse else 1
  clamp = lambda i: int(np.clip(i, 0, last))
  positions = np.arange(num_layers)
  start = last if reverse else 0
  return LayerSchedule(
      arrive=np.clip(positions + step * depth, 0, last).astype(np.int32),
      read=np.clip(positions + step * (depth + nvme_depth), 0, last).astype(np.int32),
      prologue_arrive=tuple(clamp(start + step * k) for k in range(depth)),
      prologue_read=tuple(clamp(start + step * k) for k in range(depth + nvme_depth)),
      reverse=reverse)


class Phase(str, enum.Enum):
  """Where in a step a move happens."""

  FORWARD = "forward"      # params to the device, all-gathered just before their layer runs
  BACKWARD = "backward"    # params again (recomputed layers); grads out to their tier per layer
  OPTIMIZER = "optimizer"  # each optimizer segment updated where it lives, from its grads
  AFTER = "after"          # the new compute params onto their tiers


@dataclasses.dataclass(frozen=True)
class Move:
  """`state` of layers [start, stop) of leaf `leaf` goes from `src` to `dst` in `phase`.

  An optimizer move (state "master", with its moments) has `src == dst`: the
  update runs where the states live, in the step's program for array tiers
  and in the host pipeline for NVMe. An "after" move with `src` NVMe is made
  by that pipeline too (the params it writes back)."""

  state: str
  leaf: int
  start: int
  stop: int
  src: Tier
  dst: Tier
  phase: Phase

  @property
  def in_program(self) -> bool:
    """Made by the step's compiled program (else by the host pipeline around it)."""
    return not (self.phase in (Phase.OPTIMIZER, Phase.AFTER) and not self.src.holds_arrays)


def _overlap(a: Segment, b: Segment) -> tuple[int, int]:
  return max(a.start, b.start), min(a.stop, b.stop)


@dataclasses.dataclass(frozen=True)
class Timeline:
  """The moves of one training step, and the order backward produces the grads."""

  moves: tuple[Move, ...]
  grad_order: tuple[tuple[int, int], ...]  # (leaf, layer), as backward writes them

  def select(self, phase: Phase, state: str | None = None, leaf: int | None = None) -> list[Move]:
    return [m for m in self.moves if m.phase == phase and state in (None, m.state)
            and leaf in (None, m.leaf)]

  def program_updates(self, num_leaves: int) -> list[list[tuple[int, int]]]:
    """Per leaf, the layer ranges whose optimizer update the program runs."""
    out: list[list[tuple[int, int]]] = [[] for _ in range(num_leaves)]
    for m in self.select(Phase.OPTIMIZER):
      if m.in_program:
        out[m.leaf].append((m.start, m.stop))
    return out


def timeline(plan: Plan, stack_order: Sequence[int] = ()) -> Timeline:
  """The moves of a step under `plan`.

  `stack_order` is the order the model's forward runs its stacks (indices
  into `plan.stacks`; `grads.forward_order` finds it; stacks not named keep
  the plan's order): backward runs them in reverse, each from its last layer
  down, with every leaf of a layer at once; the grads of the leaves outside
  the stacks are complete only when backward ends.
  """
  moves = []
  for leaf in plan.leaves:
    i = leaf.index
    for seg in leaf.params:
      moves.append(Move("params", i, seg.start, seg.stop, seg.tier, Tier.DEVICE, Phase.FORWARD))
      if leaf.trainable:
        moves.append(Move("params", i, seg.start, seg.stop, seg.tier, Tier.DEVICE,
                          Phase.BACKWARD))
        moves.append(Move("grads", i, seg.start, seg.stop, Tier.DEVICE, seg.tier,
                          Phase.BACKWARD))
    for opt in leaf.optimizer:
      moves.append(Move("master", i, opt.start, opt.stop, opt.tier, opt.tier, Phase.OPTIMIZER))
      for seg in leaf.params:
        lo, hi = _overlap(opt, seg)
        if lo < hi:
          moves.append(Move("params", i, lo, hi, opt.tier, seg.tier, Phase.AFTER))
  order = list(dict.fromkeys(list(stack_order) + list(range(len(plan.stacks)))))
  grads = []
  for index in reversed(order):
    stack = plan.stacks[index]
    grads += [(leaf, layer) for layer in reversed(range(stack.num_layers)) for leaf in stack.leaves]
  in_stacks = {leaf for s in plan.stacks for leaf in s.leaves}
  grads += [(leaf.index, 0) for leaf in plan.leaves if leaf.index not in in_stacks]
  return Timeline(tuple(moves), tuple(grads))
