"""Existing weights streamed into the plan's tiers, one rank's shard of one leaf at a time.

For each leaf and state (fp32 master; compute params under ZeRO-3) the plan's
segments are filled straight from the source `Tensor`: a `device` or
`pinned_host` segment is made with `jax.make_array_from_callback` (each
device reads only its own box), an `nvme` segment is read one (rank, layer)
shard at a time and written to the swap store with a bounded number of bytes
in flight. Nothing is traced, so no weight becomes a jit constant, and host
memory holds at most a few shards of one leaf.
"""

from __future__ import annotations

import collections
from typing import Any

import jax
import numpy as np

from flax import nnx

from ..partition import Region, clip, local, norm_region, shifted
from ..placement import LeafPlan, Plan, Segment
from ..progress import Tally
from .source import Tensor

IN_FLIGHT = 256 << 20   # bytes of NVMe writes in flight while streaming


def read_storage(leaf: LeafPlan, tensor: Tensor, region: Region, dtype) -> np.ndarray:
  """`region` of the leaf's storage form (padded on its split axis) read from its logical
  `tensor`, as `dtype`: the padding is zeros, as `LeafLayout.pad` makes it."""
  clipped = clip(region, leaf.layout.shape)
  if clipped == region:
    return np.asarray(tensor.read(region), dtype=dtype)
  out = np.zeros([s.stop - s.start for s in region], dtype)
  out[local(clipped, region)] = tensor.read(clipped)
  return out


class _Writes:
  """NVMe write tickets with a cap on the bytes they hold."""

  def __init__(self, limit: int = IN_FLIGHT):
    self.queue: collections.deque = collections.deque()
    self.bytes, self.limit = 0, limit

  def add(self, tickets: list, nbytes: int) -> None:
    self.queue.append((tickets, nbytes))
    self.bytes += nbytes
    while self.bytes > self.limit and len(self.queue) > 1:
      self._pop()

  def _pop(self) -> None:
    tickets, n = self.queue.popleft()
    for t in tickets:
      t.wait()
    self.bytes -= n

  def drain(self) -> None:
    while self.queue:
      self._pop()


def place(plan: Plan, leaf: LeafPlan, tensor: Tensor, state: str, store, pipeline,
          writes: _Writes) -> tuple:
  """One leaf's `state` (master or params) from `tensor`, on every segment's tier."""
  dtype = plan.dtype(state)
  parts = []
  for seg in leaf.segments(state):
    if seg.tier.holds_arrays:
      parts.append(_array(plan, leaf, tensor, seg, dtype))
      continue
    for rank in plan.ranks:
      for layer in range(seg.start, seg.stop):
        if state == "params" and leaf.params_with_master(layer):
          continue  # the master's writes made the NVMe params too
        data = read_storage(leaf, tensor, plan.region(leaf, rank, layer), dtype)
        data = data.reshape(leaf.local_shape)
        if state == "master":
          tickets = pipeline.write_layer(leaf.index, rank, layer, data)
        else:
          tickets = [store.write(leaf.key("params", rank, layer), data)]
        writes.add(tickets, data.nbytes * (3 if state == "master" else 1))
  return tuple(parts)


def _array(plan: Plan, leaf: LeafPlan, tensor: Tensor, seg: Segment, dtype) -> jax.Array:
  shape = leaf.segment_shape(seg)
  read = lambda index: read_storage(leaf, tensor, shifted(norm_region(index, shape), leaf.layout,
                                                          seg.start), dtype)
  return jax.make_array_from_callback(shape, plan.sharding(leaf, seg.tier), read, dtype=dtype)


def stream_states(engine, tensors: list[Tensor | None], fresh=None,
                  tally: Tally | None = None) -> tuple[list, list]:
  """(master parts, ZeRO-3 param parts) per leaf of `engine.plan`, filled from `tensors`; a leaf
  without one (None) from `fresh(index) -> (master parts, param parts)`. Each leaf is counted
  into `tally` once placed (its writes under way)."""
  plan, store, pipeline = engine.plan, engine.store, engine.pipeline
  masters, params = [], []
  writes = _Writes()
  for leaf, tensor in zip(plan.leaves, tensors):
    if tensor is None:
      m, p = fresh(leaf.index)
      masters.append(m)
      params.append(p)
    else:
      masters.append(place(plan, leaf, tensor, "master", store, pipeline, writes))
      params.append(place(plan, leaf, tensor, "params", store, pipeline, writes)
                    if plan.stage == 3 else None)
    if tally is not None:
      tally.add(leaf.size)
  writes.drain()
  if store is not None:
    store.sync()
    if pipeline is not None:
      pipeline.release_zeros()
  return masters, params


def existing_weights(model_factory) -> Any | None:
  """The params of a factory that returns a model it did not create from `rngs` (a trained
  model closed over), as a pure dict of arrays; None when it makes new ones."""
  found: list = []

  def make():
    model = model_factory(nnx.Rngs(0))
    state = nnx.state(model, nnx.Param)
    values = jax.tree.leaves(state)
    if values and not any(isinstance(v, jax.core.Tracer) for v in values):
      found.append(nnx.to_pure_dict(state))
    return nnx.split(model)[1]

  jax.eval_shape(make)
  return found[0] if found else None
