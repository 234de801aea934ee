"""Random init straight into the tiers: each device draws only its own shard.

Leaves that live whole on the device are drawn in one program (without NVMe)
or one leaf at a time (with it); stacked leaves with any layer elsewhere are
drawn one layer at a time (a layer of all of them in one program), each layer
put on its tier as it comes, so host memory does not grow with depth. Values
equal the whole-model draw bit for bit.
"""

from __future__ import annotations

import functools
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, SingleDeviceSharding

from .engine import Engine, ModelFactory
from .layers import one_layer
from .partition import norm_region
from .placement import Plan, Tier
from .progress import Tally
from .rng import jit_unrolled
from .shards import host_shards, set_layer, start_host_shards, to_host


def master_initializer(engine: Engine, model_factory: ModelFactory, leaves=None):
  """`key -> fp32 master leaves` (all, or the indices in `leaves`), jitted straight into their
  sharded storage form: each device draws only its own shard (partitionable RNG), with
  threefry's straight-line lowering on CPU (`zinfjax.rng`: the same bits, 4x faster)."""
  plan = engine.plan
  chosen = list(range(len(plan.leaves))) if leaves is None else list(leaves)

  def make(key):
    model = model_factory(nnx.Rngs(key))
    flat = plan.flatten(nnx.to_pure_dict(nnx.state(model)))
    return [plan.leaves[i].layout.pad(flat[i].astype(jnp.float32)) for i in chosen]

  shardings = [plan.sharding(plan.leaves[i], Tier.DEVICE) for i in chosen]
  return jit_unrolled(make, out_shardings=shardings)


def layer_initializer(engine: Engine, model_factory: ModelFactory, leaves: Sequence[int],
                      low=None):
  """`(key, layer) -> [fp32 storage form of that layer of each stacked leaf in `leaves`]`,
  equal to that layer of `master_initializer`'s values bit for bit, drawn in one layer's memory
  (every `Stack` builds only that block: `zinfjax.layers.one_layer`), in one program: one
  compile for all the leaves. With a dtype `low`, each entry is (that, the same cast to `low`):
  XLA casts it in the same program."""
  plan = engine.plan
  layouts = [plan.leaves[i].layout.layer() for i in leaves]

  def make(key, layer):
    with one_layer(layer):
      model = model_factory(nnx.Rngs(key))
    flat = plan.flatten(nnx.to_pure_dict(nnx.state(model)))
    xs = [layout.pad(flat[i][0].astype(jnp.float32)) for i, layout in zip(leaves, layouts)]
    return xs if low is None else [(x, x.astype(low)) for x in xs]

  shardings = [NamedSharding(plan.mesh, layout.spec(engine.config.axis)) for layout in layouts]
  return jit_unrolled(make, out_shardings=shardings if low is None else
                      [(sharding, sharding) for sharding in shardings])


def by_depth(leaves) -> dict[int, list]:
  """Stacked leaves by their number of layers, in order: the leaves one layer program draws."""
  depths: dict[int, list] = {}
  for leaf in leaves:
    depths.setdefault(leaf.num_layers, []).append(leaf)
  return depths


def _created(stage: int) -> tuple[str, ...]:
  """The states init creates from a random draw: the master, and under ZeRO-3 the params."""
  return ("master", "params") if stage == 3 else ("master",)


def _by_layer(plan: Plan, leaf, stage: int) -> bool:
  """Whether init draws this leaf one layer at a time: stacked, and not all of it on the device
  (a whole draw would hold the leaf and its RNG temporaries in host memory, or in HBM the
  leaf was placed elsewhere to spare)."""
  return leaf.stacked and any(s.tier != Tier.DEVICE
                              for st in _created(stage) for s in leaf.segments(st))


def _write(plan: Plan, leaf, state: str, rank: int, layer: int, data, store, pipeline,
           tickets: list, low=None) -> None:
  """One rank's fp32 shard of one layer, written as `state`'s NVMe copy (`low`: the same
  shard already in the compute params' dtype, if made)."""
  if state == "master":
    tickets += pipeline.write_layer(leaf.index, rank, layer, data, low)
  elif not leaf.params_with_master(layer):  # else the pipeline wrote the params too
    low = np.asarray(data).astype(plan.dtype(state)) if low is None else low
    tickets.append(store.write(leaf.key("params", rank, layer), low))


def _is(dtype, other) -> bool:
  """Whether `dtype` is `other` (None: no dtype)."""
  return other is not None and np.dtype(dtype) == np.dtype(other)


def _low(plan: Plan):
  """The compute params' dtype when init casts the master to it (bf16), else None (fp32)."""
  dtype = plan.dtype("params")
  return None if np.dtype(dtype) == np.float32 else dtype


def _place(plan: Plan, leaf, x: jax.Array, state: str, store, pipeline, tickets: list) -> tuple:
  """One leaf's whole storage-form value `x` put on its segments' tiers for `state`."""
  dtype = plan.dtype(state)
  parts = []
  shards = None
  for seg in leaf.segments(state):
    if seg.tier.holds_arrays:
      piece = x if seg.layers == leaf.num_layers else leaf.take(x, seg)
      # a program, not device_put: each state gets its own buffers (fp32 params are not the master)
      parts.append(_cast_to(np.dtype(dtype), plan.sharding(leaf, seg.tier))(piece))
      continue
    shards = host_shards(x, plan.mesh) if shards is None else shards
    for rank, shard in shards.items():
      for layer in range(seg.start, seg.stop):
        _write(plan, leaf, state, rank, layer, shard[layer] if leaf.stacked else shard, store,
               pipeline, tickets)
  return tuple(parts)


class _LayerFill:
  """One stacked leaf's created states, filled a drawn layer at a time: device segments in place
  in HBM, cast by XLA, never crossing to the host; the layers of host-array segments copied
  into their devices' host buffers (cast on the device first), which become the segment's
  arrays at the end; store layers written."""

  def __init__(self, engine: Engine, leaf):
    plan = engine.plan
    self.engine, self.plan, self.leaf = engine, plan, leaf
    self.states = _created(plan.stage)
    self.segments = [(state, seg) for state in self.states for seg in leaf.array_segments(state)]
    self.on_device: dict = {}  # (state, segment) -> its array in HBM, made by `_zeros`
    self.on_host = {k: _segment_buffers(plan, leaf, *k) for k in self.segments
                    if k[1].tier != Tier.DEVICE}

  def in_store(self, layer: int) -> list[str]:
    """The created states whose `layer` the swap store keeps."""
    return [st for st in self.states
            if any(not s.tier.holds_arrays and layer in s for s in self.leaf.segments(st))]

  def wants(self, low) -> bool:
    """Whether this leaf takes the draw's cast to the compute dtype `low`: for compute params
    in the store (the cast crosses to the host only for their layers) or host arrays of it."""
    return low is not None and (
        any("params" in self.in_store(layer) for layer in range(self.leaf.num_layers)) or
        any(_is(self.plan.dtype(state), low) for state, _ in self.on_host))

  def crossing(self, layer: int, low) -> tuple[bool, bool]:
    """Whether `put` reads `layer`'s draw, and its cast to `low` (None: none taken), to the
    host: for host arrays of their dtype, and for the store's layers."""
    casts = [low is not None and _is(self.plan.dtype(state), low)
             for state, seg in self.on_host if layer in seg]
    in_store = self.in_store(layer)
    return (bool(in_store) or not all(casts),
            any(casts) or (low is not None and "params" in in_store))

  def put(self, layer: int, x: jax.Array, lows: jax.Array | None,
          started: dict[bool, dict]) -> list:
    """Layer `layer`'s draw `x` (and its cast `lows`, or None) on its tiers; returns the tickets
    of its store writes. `started`: the copies to the host of the draw (False) and the cast
    (True) that `crossing` says cross, begun already (`start_host_shards`)."""
    plan, leaf = self.plan, self.leaf
    for (state, seg), part in self.on_device.items():
      if layer in seg:
        self.on_device[state, seg] = set_layer(part.sharding)(part, x, np.int32(layer - seg.start))
    local: dict[bool, dict] = {}  # rank -> shard on the host, of the draw (False) or its cast

    def on_host(cast: bool) -> dict:  # each read to the host once, for host arrays and store
      if cast not in local:
        local[cast] = to_host(started[cast])
      return local[cast]

    for (state, seg), bufs in self.on_host.items():
      if layer in seg:
        cast = lows is not None and _is(plan.dtype(state), lows.dtype)
        for rank, buf in bufs.items():
          buf[layer - seg.start] = on_host(cast)[rank]
    tickets: list = []
    in_store = self.in_store(layer)
    if in_store:
      low = on_host(True) if lows is not None and "params" in in_store else {}
      for rank, data in on_host(False).items():
        for state in in_store:
          _write(plan, leaf, state, rank, layer, data, self.engine.store, self.engine.pipeline,
                 tickets, low.get(rank))
    return tickets

  def parts(self) -> dict[str, tuple]:
    """Each created state's array parts, as `_place` returns them."""
    out: dict[str, list] = {state: [] for state in self.states}
    for state, seg in self.segments:
      if (state, seg) in self.on_device:
        out[state].append(self.on_device.pop((state, seg)))
        continue
      sharding = self.plan.sharding(self.leaf, seg.tier)
      devices, kind = self.plan.mesh.devices.reshape(-1), sharding.memory_kind
      parts = [jax.device_put(buf, SingleDeviceSharding(devices[r], memory_kind=kind))
               for r, buf in self.on_host.pop((state, seg)).items()]
      out[state].append(jax.make_array_from_single_device_arrays(
          self.leaf.segment_shape(seg), sharding, parts))
    return {state: tuple(parts) for state, parts in out.items()}


def _place_by_layer(engine: Engine, model_factory: ModelFactory, leaves: list, key,
                    tally: Tally | None = None) -> list[dict[str, tuple]]:
  """Stacked leaves of one depth drawn one layer at a time, every leaf's layer in one program
  (one compile), each put on its tiers as it comes (`_LayerFill`): the next layer is drawn,
  and copied to the host, while this one's store writes run. Host memory holds about four
  layers beside what the tiers hold anyway, whatever the depth. Returns each leaf's created states'
  array parts, as `_place` does."""
  plan = engine.plan
  fills = [_LayerFill(engine, leaf) for leaf in leaves]
  _zeros(plan, fills)
  # XLA casts the compute params of store layers and host arrays in the draw's program
  # (several times numpy's bf16 cast, and half the bytes to copy)
  wants = [fill.wants(_low(plan)) for fill in fills]
  low = _low(plan) if any(wants) else None
  draw = layer_initializer(engine, model_factory, [leaf.index for leaf in leaves], low)
  depth, per_layer = leaves[0].num_layers, sum(leaf.size // leaf.num_layers for leaf in leaves)
  writing: list = []

  def drawn_at(layer: int) -> list[tuple]:
    """Layer `layer` drawn: per fill (its draw, its cast or None, the copies to the host of
    what crosses, started: they run while the host writes the layer before)."""
    out = []
    for fill, cast, value in zip(fills, wants, draw(key, layer)):
      x, lows = (value, None) if low is None else value
      lows = lows if cast else None
      out.append((x, lows, {c: start_host_shards(a, plan.mesh) for c, a, go in zip(
          (False, True), (x, lows), fill.crossing(layer, None if lows is None else low)) if go}))
    return out

  drawn = drawn_at(0)
  for layer in range(depth):
    ahead = drawn_at(layer + 1) if layer + 1 < depth else None
    tickets: list = []
    for fill, (x, lows, started) in zip(fills, drawn):
      tickets += fill.put(layer, x, lows, started)
    del x, lows, started
    drawn = ahead
    for t in writing:  # the previous layer's writes ran while this one was drawn
      t.wait()
    writing = tickets
    if tally is not None:
      tally.add(per_layer)
  for t in writing:
    t.wait()
  return [fill.parts() for fill in fills]


def _zeros(plan: Plan, fills: list[_LayerFill]) -> None:
  """The fills' device segments, made where they live (HBM) in one program, to be filled in
  place by `set_layer`."""
  keys = [(fill, k) for fill in fills for k in fill.segments if k[1].tier == Tier.DEVICE]
  specs = tuple((fill.leaf.segment_shape(seg), np.dtype(plan.dtype(state)),
                 plan.sharding(fill.leaf, seg.tier)) for fill, (state, seg) in keys)
  for (fill, k), x in zip(keys, _zeros_of(specs)() if specs else ()):
    fill.on_device[k] = x


@functools.cache
def _cast_to(dtype: np.dtype, sharding) -> Callable:
  """The program that casts an array to `dtype` in `sharding`: one compile for each kind."""
  return jax.jit(lambda v: v.astype(dtype), out_shardings=sharding)


@functools.cache
def _zeros_of(specs: tuple) -> Callable:
  """The program that makes zeros of each (shape, dtype, sharding) in `specs`: one compile for
  each kind of model and plan."""
  return jax.jit(lambda: [jnp.zeros(shape, dtype) for shape, dtype, _ in specs],
                 out_shardings=[sharding for _, _, sharding in specs])


def _segment_buffers(plan: Plan, leaf, state: str, seg) -> dict:
  """Host buffers, one per local device by its rank (as `host_shards`), for an array segment's
  shards (filled layer by layer)."""
  shape = leaf.segment_shape(seg)
  sharding = plan.sharding(leaf, seg.tier)
  devices = list(plan.mesh.devices.reshape(-1))
  return {devices.index(d): np.empty([s.stop - s.start for s in norm_region(index, shape)],
                                     plan.dtype(state))
          for d, index in sharding.addressable_devices_indices_map(shape).items()}


def random_states(engine: Engine, model_factory: ModelFactory, key,
                   only: list[int] | None = None,
                   tally: Tally | None = None) -> tuple[list, list]:
  """(master parts, ZeRO-3 param parts) per leaf (all, or those in `only`, in that order) from
  the factory's initializers; each layer or leaf counted into `tally` once placed."""
  plan = engine.plan
  chosen = list(range(len(plan.leaves))) if only is None else list(only)
  masters, params, tickets = [None] * len(plan.leaves), [None] * len(plan.leaves), []
  by_layer = [i for i in chosen if _by_layer(plan, plan.leaves[i], plan.stage)]
  # stacked leaves not all on the device: a layer at a time
  for leaves in by_depth([plan.leaves[i] for i in by_layer]).values():
    for leaf, parts in zip(leaves, _place_by_layer(engine, model_factory, leaves, key, tally)):
      masters[leaf.index] = parts["master"]
      params[leaf.index] = parts["params"] if plan.stage == 3 else None
  rest = [i for i in chosen if i not in by_layer]
  # without NVMe the rest of the master is one program; with it one leaf at a time, so host
  # memory holds at most two leaves while the states stream to the swap store
  groups = ([rest] if rest else []) if engine.store is None else [[i] for i in rest]
  draw = lambda k: master_initializer(engine, model_factory, groups[k])(key) if k < len(groups) else None
  ahead = draw(0)
  for k, group in enumerate(groups):
    values, ahead = ahead, draw(k + 1)  # the next leaf is drawn while this one is written
    for i, x in zip(group, values):
      leaf = plan.leaves[i]
      masters[i] = _place(plan, leaf, x, "master", engine.store, engine.pipeline, tickets)
      if plan.stage == 3:
        params[i] = _place(plan, leaf, x, "params", engine.store, engine.pipeline, tickets)
      for t in tickets:
        t.wait()
      tickets.clear()
      del x
      if tally is not None:
        tally.add(leaf.size)
  if engine.store is not None:
    engine.store.sync()
    if engine.pipeline is not None:
      engine.pipeline.release_zeros()
  return [masters[i] for i in chosen], [params[i] for i in chosen]
