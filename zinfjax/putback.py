"""The host pipeline's new compute params, back into the step's arrays.

Where a layer's optimizer is in a swap store and its params are arrays (on the
device, say), the host pipeline makes the new params on the host, one part (a
rank's shard of one layer) at a time. `PutBack` returns each layer to its
device array as soon as this process's ranks have all made it (an in-place
update of the donated array), so the host holds a layer or two of them rather
than two bytes a param of every such layer until the update ends (22 GiB at
13B params). It takes a part only once the step is known to stand: while the
program still runs, the update under backward is a guess (redone when the step
needs clipping, undone when it is skipped), and a layer written to the device
could not be taken back. What it does not take, `finish` puts back at the end.
A part's host array whose copy on the device is done serves a later part's new params
(`HostPool`): the update writes the same pages again, not new ones it must fault in.
"""

from __future__ import annotations

import concurrent.futures
import threading
from typing import Any, Callable, Sequence

import jax
import numpy as np

from .placement import Plan, Tier
from .shards import from_host_shards, host_shards, set_layer

Verdict = Callable[[], "bool | None"]  # None: not known yet; True: the step stands; False: not
RETURNING = 2  # layers of a leaf's new params in host RAM on their way to the device


class HostPool:
  """Host arrays of new params whose copy on the device is done, for later parts' new params.

  A new host array costs a page fault a page and the zeroing of it when it is first written
  (about 0.1 ms a MB, on the update's path); one written again costs neither. It keeps at most
  `caps[(shape, dtype)]` arrays of a shape (a layer of each leaf: with the layer on its way,
  the `RETURNING` layers `autoplace` counts).
  """

  def __init__(self, caps: dict[tuple[tuple[int, ...], np.dtype], int]):
    self.caps = caps
    self.made = 0  # arrays `take` made new
    self._free: dict[tuple, list[np.ndarray]] = {}
    self._lock = threading.Lock()

  @property
  def bytes(self) -> int:
    return sum(a.nbytes for free in self._free.values() for a in free)

  def give(self, arrays: Sequence[np.ndarray]) -> None:
    with self._lock:
      for a in arrays:
        key = (a.shape, a.dtype)
        free = self._free.setdefault(key, [])
        if len(free) < self.caps.get(key, 0):
          free.append(a)

  def take(self, shape: tuple[int, ...], dtype) -> np.ndarray:
    """An array of this shape and dtype from the pool, else a new one."""
    with self._lock:
      free = self._free.get((tuple(shape), np.dtype(dtype)))
      if free:
        return free.pop()
      self.made += 1
    return np.empty(shape, dtype)


class PutBack:
  """The step's param arrays (`params`, in the plan's tree), updated from the pipeline's parts.

  `verdict()` says whether the pass's new params stand: None while that is not known (the
  caller keeps the part for `finish`), True (returned now), False (the pass is redone or
  skipped: the part is dropped). It is asked until it answers, then not again.
  """

  def __init__(self, plan: Plan, params: Any, verdict: Verdict, pool: HostPool | None = None):
    self.plan, self.verdict, self.pool = plan, verdict, pool
    self.flat = [list(parts) for parts in plan.flatten(params)]
    self._stands: bool | None = None
    self._layers: dict[tuple[int, int], dict[int, np.ndarray]] = {}  # (leaf, layer) -> shards
    self.returned = 0  # layers returned while the update ran
    # one layer on its way at a time, on a thread of its own: the host's copy of layer k
    # overlaps the update of layer k + 1 (`RETURNING` counts the two)
    self._worker: concurrent.futures.ThreadPoolExecutor | None = None
    self._sent: concurrent.futures.Future | None = None
    self._spent: list[np.ndarray] = []  # whole-segment views whose layer is on the device
    self._landing: tuple[jax.Array, list[np.ndarray]] | None = None  # the last layer put
    # a CPU device may alias a numpy array it is given: each layer goes as a copy there
    self._copy = plan.mesh.devices.flat[0].platform == "cpu"

  def wants(self, leaf: int, layer: int) -> bool:
    """Whether that layer's new params may go back as they are made: its params are an array
    on the device, where one layer of a stack is updated in place."""
    found = _segment(self.plan, leaf, layer)
    return found is not None and found[1].tier is Tier.DEVICE

  def take(self, leaf: int, rank: int, layer: int, array: np.ndarray) -> bool:
    """Offer rank `rank`'s new params of `layer` of `leaf`: True when taken (returned with the
    layer's other ranks, or dropped with the pass), False when the caller keeps them."""
    if self._stands is None:
      self._stands = self.verdict()
      if self._stands is None:
        return False
    if not self._stands:
      return True
    shards = self._layers.setdefault((leaf, layer), {})
    shards[rank] = array
    if len(shards) == len(self.plan.ranks):
      self._wait()
      self._landed()  # the layer before: its host arrays serve the layer after this one
      if self._worker is None:
        self._worker = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="zinfjax-put")
      self._sent = self._worker.submit(self._put, leaf, layer, self._layers.pop((leaf, layer)))
      self.returned += 1
    return True

  def _wait(self) -> None:
    """The layer on its way is in its array (raising what putting it there raised)."""
    sent, self._sent = self._sent, None
    if sent is not None:
      sent.result()

  def again(self) -> None:
    """The pass is being redone with the verdict known: every part of it stands."""
    self._stands = True

  def finish(self, outs: dict[tuple[int, int, int], np.ndarray]) -> Any:
    """The params tree with the rest of the update's new params (`outs`, per (leaf, rank,
    layer)) put back too."""
    self._wait()
    if self._worker is not None:
      self._worker.shutdown()
      self._worker = None
    outs = {**outs, **{(leaf, r, layer): a for (leaf, layer), shards in self._layers.items()
                       for r, a in shards.items()}}
    self._layers.clear()
    first = self.plan.ranks[0]
    for leaf in self.plan.leaves:
      for j, seg in enumerate(leaf.array_segments("params")):
        layers = [l for l in range(seg.start, seg.stop) if (leaf.index, first, l) in outs]
        if not layers:
          continue
        if seg.tier is Tier.DEVICE:  # a layer at a time, in place: no second copy in HBM
          for l in layers:
            self._landed()
            self._put(leaf.index, l, {r: outs[(leaf.index, r, l)] for r in self.plan.ranks})
          continue
        x = self.flat[leaf.index][j]
        if len(layers) == seg.layers:  # all of it is new: no need to read the old values back
          shards = {r: (stacked([outs[(leaf.index, r, l)] for l in layers]) if leaf.stacked
                        else outs[(leaf.index, r, layers[0])]) for r in self.plan.ranks}
        else:
          shards = {r: np.array(s) for r, s in host_shards(x, self.plan.mesh).items()}
          for l in layers:
            for r, shard in shards.items():
              shard[l - seg.start if leaf.stacked else ...] = outs[(leaf.index, r, l)]
        self.flat[leaf.index][j] = from_host_shards(shards, x.sharding, x.shape)
    self._landed(wait=False)  # a leaf outside the stacks: before a later program takes it
    return self.plan.unflatten([tuple(p) for p in self.flat])

  def _put(self, leaf: int, layer: int, shards: dict[int, np.ndarray]) -> None:
    """One layer's new params (every rank of this process) into its array; its host arrays
    land (`_landed`) before the next layer is put."""
    plan_leaf = self.plan.leaves[leaf]
    j, seg = _segment(self.plan, leaf, layer)
    x = self.flat[leaf][j]
    host = {r: a.copy() if self._copy else a for r, a in shards.items()}  # written again later
    if plan_leaf.stacked:
      one = from_host_shards({r: a[None] for r, a in host.items()}, x.sharding,
                             (1, *x.shape[1:]))
      self.flat[leaf][j] = set_layer(x.sharding)(x, one, np.int32(layer - seg.start))
    else:
      one = self.flat[leaf][j] = from_host_shards(host, x.sharding, x.shape)
    self._landing = (one, list(shards.values()))

  def _landed(self, wait: bool = True) -> None:
    """The layer put before is on the device: its host arrays are spent, the views of a whole
    segment's buffer (`NvmePipeline._new_params`) for the next step (`spent`), the others for
    the pool. (Asked before the next layer is put, so one layer's copy on the device is held,
    as `autoplace` counts.) Not `wait`ing: only if its copy is done. A leaf outside the stacks
    is its own new array: once a later program took it (donated), its host arrays are let go,
    not pooled (no telling when its copy ended)."""
    if self._landing is None:
      return
    one, arrays = self._landing
    if one.is_deleted():
      self._landing = None
      return
    if not wait and not one.is_ready():
      return
    one.block_until_ready()
    self._spent.extend(a for a in arrays if a.base is not None)
    if self.pool is not None:
      self.pool.give([a for a in arrays if a.base is None])
    self._landing = None

  def spent(self) -> list[np.ndarray]:
    """After `finish`: the views of whole-segment buffers it put into device arrays, each now
    free to be written again (its copy to the device done; the other host arrays went to the
    pool). Asked when they are wanted, not at `finish`, so the step never waits for its last
    copy."""
    self._landed()
    return self._spent


def _segment(plan: Plan, leaf: int, layer: int):
  """(index among the leaf's param arrays, segment) of `layer`, or None: not an array."""
  return next(((j, s) for j, s in enumerate(plan.leaves[leaf].array_segments("params"))
               if layer in s), None)


def whole_buffers(spent: Sequence[np.ndarray]) -> list[np.ndarray]:
  """The [layers, ...] buffers of which every layer is in `spent` (as a view): the pipeline's
  new params of a whole segment (`NvmePipeline._new_params`), all put back on the device."""
  views: dict[int, list[np.ndarray]] = {}
  for a in spent:
    if isinstance(a.base, np.ndarray) and a.base.shape[1:] == a.shape:
      views.setdefault(id(a.base), []).append(a)
  return [v[0].base for v in views.values() if len(v) == v[0].base.shape[0]]


def reuse(free: list[np.ndarray], shape: tuple[int, ...], dtype) -> np.ndarray:
  """A buffer of `free` with this shape and dtype (taken from it), else a new one: written
  again, its pages are not faulted in again (a page fault a 4 KiB page, a core's time)."""
  for i, b in enumerate(free):
    if b.shape == shape and b.dtype == dtype:
      return free.pop(i)
  return np.empty(shape, dtype)


def stacked(layers: list[np.ndarray]) -> np.ndarray:
  """`np.stack(layers)`, or the buffer they are consecutive views of (the pipeline makes a
  whole segment's new params so, `NvmePipeline._new_params`): no second copy."""
  base = layers[0].base
  at = lambda a: a.__array_interface__["data"][0]
  if (isinstance(base, np.ndarray) and base.shape == (len(layers), *layers[0].shape)
      and base.dtype == layers[0].dtype and base.flags.c_contiguous
      and all(a.base is base and at(a) == at(base) + i * base.strides[0]
              for i, a in enumerate(layers))):
    return base
  return np.stack(layers)
