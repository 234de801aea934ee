"""The static fetch/prefetch schedule of a scanned stack, computed before `jit` as data.

For a stack of L layers run forward (or backward, in reverse), with device
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
from typing import Sequence

import numpy as np

from .placement import Plan


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


def grad_write_order(plan: Plan, stack_calls: Sequence[int] = ()) -> list[tuple[int, int]]:
  """(leaf, layer) in the order the backward pass writes the grads.

  Backward runs the stacks in the reverse of the order the forward pass ran
  them (`stack_calls`, indices into `plan.stacks`, as the step saw them when
  it was traced; stacks it did not see keep the plan's order), each from its
  last layer down, with every leaf of a layer at once; the grads of the
  leaves outside the stacks are complete only when backward ends.
  """
  order = list(dict.fromkeys(list(stack_calls) + list(range(len(plan.stacks)))))
  out = []
  for index in reversed(order):
    stack = plan.stacks[index]
    out += [(leaf, layer) for layer in reversed(range(stack.num_layers)) for leaf in stack.leaves]
  in_stacks = {leaf for s in plan.stacks for leaf in s.leaves}
  return out + [(leaf.index, 0) for leaf in plan.leaves if leaf.index not in in_stacks]
