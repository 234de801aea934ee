"""`TrainState` and its creation: every state placed where the plan says, never whole on one device.

A state held in arrays is a tree like the params whose leaves are tuples: one
array per segment of the leaf on `device` or `pinned_host` (see
`placement.py`); its NVMe segments are in the swap store.
"""

from __future__ import annotations

import dataclasses
import weakref
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from . import gather as G
from .config import ZeroConfig
from .engine import Engine, ModelFactory, build_engine, leaf_names, with_store
from .layers import one_layer
from .optim.host import HostAdamState
from .ordering import needs_order, ordered_collectives
from .partition import norm_region
from .placement import Plan
from .shards import host_shards
from .weights.source import as_tree, match
from .weights.stream import existing_weights, stream_states


class _EngineRef:
  """A state's engine as pytree metadata, held weakly. jax keeps treedefs (of jitted steps'
  arguments and shardings) in caches keyed weakly on functions the engine itself references:
  a strong reference there would keep every engine ever built alive, with its swap store's
  threads and its compiled programs. The `TrainState` holds its engine strongly."""

  __slots__ = ("ref",)

  def __init__(self, engine: "Engine"):
    self.ref = weakref.ref(engine)

  def __eq__(self, other: object) -> bool:
    return isinstance(other, _EngineRef) and self.ref == other.ref

  def __hash__(self) -> int:
    return hash(self.ref)

  def get(self) -> "Engine":
    engine = self.ref()
    if engine is None:
      raise RuntimeError("this TrainState's engine no longer exists (its states were dropped).")
    return engine


@dataclasses.dataclass
class TrainState:
  """Arrays of a ZeRO run (`engine` is static metadata; `engine.plan` says where all lives)."""

  step: jax.Array
  params: Any        # compute params: per leaf, a tuple of its array segments
  master: Any        # fp32 master params (storage form, split over `data`), likewise
  opt_state: Any     # optax state of `engine.tx` (optimizer on device) or HostAdamState
  engine: Engine = dataclasses.field(metadata=dict(static=True))

  def full_params(self, dtype=jnp.float32) -> Any:
    """The params in their logical shapes, from every tier (tests, export): the fp32 master of
    each trained leaf, the compute params of each frozen one."""
    plan = self.engine.plan
    return plan.unflatten([jnp.asarray(self._full(leaf, dtype)) for leaf in plan.leaves])

  def full_leaf(self, name: str, dtype=np.float32) -> np.ndarray:
    """One leaf's fp32 master (a frozen leaf: its compute params) in its logical shape, by its
    path (e.g. "layers/block/q/kernel"), as numpy: an export reads one leaf at a time."""
    found = [l for l in self.engine.plan.leaves if l.name == name]
    if not found:
      raise KeyError(f"the model has no leaf {name!r}.")
    return self._full(found[0], dtype)

  def _full(self, leaf, dtype) -> np.ndarray:
    plan = self.engine.plan
    state = "master" if leaf.trainable else "params"
    x = _whole(plan, leaf, plan.flatten(getattr(self, state))[leaf.index], self.engine.store, state)
    index = tuple(slice(0, n) for n in leaf.layout.shape)
    return np.asarray(x[index], dtype)

  def model(self) -> nnx.Module:
    """An ordinary NNX model holding the current master params (gathered whole)."""
    return nnx.merge(self.engine.graphdef, self.full_params())


_FIELDS = ("step", "params", "master", "opt_state")
jax.tree_util.register_pytree_with_keys(
    TrainState,
    lambda s: ([(jax.tree_util.GetAttrKey(f), getattr(s, f)) for f in _FIELDS], _EngineRef(s.engine)),
    lambda ref, children: TrainState(*children, ref.get()),
    lambda s: ([getattr(s, f) for f in _FIELDS], _EngineRef(s.engine)))


def _whole(plan: Plan, leaf, parts: tuple, store, state: str = "master") -> np.ndarray:
  """One leaf's `state` (master, or ZeRO-3 params) in storage shape, joined from its segments
  (one process)."""
  arrays = iter(parts)
  pieces = []
  for seg in leaf.segments(state):
    if seg.tier != "nvme":
      # a copy: numpy may view a CPU buffer that the next (donating) step reuses
      pieces.append(np.array(next(arrays), copy=True))
      continue
    if jax.process_count() > 1:
      raise NotImplementedError("full_params gathers every rank's NVMe shards: one process only.")
    ranks = []
    for r in range(plan.dp):
      layers = [store.read(leaf.key(state, r, j)).wait() for j in range(seg.start, seg.stop)]
      ranks.append(np.stack(layers) if leaf.stacked else layers[0])
    lay = leaf.layout
    pieces.append(ranks[0] if lay.axis is None else np.concatenate(ranks, axis=lay.axis))
  return np.concatenate(pieces) if leaf.stacked else pieces[0]


def untuple(plan: Plan, tree: Any) -> Any:
  """A whole-leaf state (one array segment per leaf) as a plain tree of arrays (None for a
  frozen leaf, which optax skips)."""
  return plan.unflatten([parts[0] if parts else None for parts in plan.flatten(tree)])


def retuple(plan: Plan, tree: Any) -> Any:
  return plan.unflatten([() if x is None else (x,) for x in plan.flatten(tree)])


def gather_params(plan: Plan, master: Any, ordered: bool | None = None) -> Any:
  """Stages 1 and 2: whole compute params on every rank (cast, all-gather, unpad); the
  all-gathers one after another where `ordering.needs_order` says so."""
  dtype, leaves = plan.compute_dtype, plan.leaves
  storage = [leaf.layout.spec(plan.axis) for leaf in leaves]

  def body(*xs):
    return tuple(G.gather(x.astype(dtype), leaf.layout, plan.axis) for x, leaf in zip(xs, leaves))

  if needs_order(plan.mesh, ordered):
    body = ordered_collectives(body)
  out = jax.shard_map(body, mesh=plan.mesh, in_specs=tuple(storage),
                      out_specs=tuple(P() for _ in leaves), check_vma=False)(
                          *[p[0] for p in plan.flatten(master)])
  return plan.unflatten([(x,) for x in out])


def opt_state_shardings(engine: Engine, master: Any) -> Any:
  """Param-shaped parts of an optax state are split like the master; the rest replicated."""
  abstract = jax.eval_shape(engine.tx.init, master)
  storage = jax.tree.map(lambda x: x.sharding, master)
  whole = NamedSharding(engine.mesh, P())
  # masked params (optax.masked, multi_transform with set_to_zero) hold a MaskedNode: kept
  masked = lambda x: isinstance(x, optax.MaskedNode)
  return optax.tree_map_params(
      engine.tx, lambda x, sharding: x if masked(x) else sharding, abstract, storage,
      transform_non_params=lambda x: x if masked(x) else whole, is_leaf=masked)


def master_initializer(engine: Engine, model_factory: ModelFactory, leaves=None):
  """`key -> fp32 master leaves` (all, or the indices in `leaves`), jitted straight into their
  sharded storage form: each device draws only its own shard (partitionable RNG)."""
  plan = engine.plan
  chosen = list(range(len(plan.leaves))) if leaves is None else list(leaves)

  def make(key):
    model = model_factory(nnx.Rngs(key))
    flat = plan.flatten(nnx.to_pure_dict(nnx.state(model)))
    return [plan.leaves[i].layout.pad(flat[i].astype(jnp.float32)) for i in chosen]

  shardings = [plan.sharding(plan.leaves[i], "device") for i in chosen]
  return jax.jit(make, out_shardings=shardings)


def layer_initializer(engine: Engine, model_factory: ModelFactory, leaf: int):
  """`(key, layer) -> fp32 storage form of one layer of stacked leaf `leaf``, equal to that
  layer of `master_initializer`'s value bit for bit, drawn in one layer's memory (every
  `Stack` builds only that block: `zinfjax.layers.one_layer`)."""
  plan = engine.plan
  layout = plan.leaves[leaf].layout.layer()

  def make(key, layer):
    with one_layer(layer):
      model = model_factory(nnx.Rngs(key))
    x = plan.flatten(nnx.to_pure_dict(nnx.state(model)))[leaf]
    return layout.pad(x[0].astype(jnp.float32))

  sharding = NamedSharding(plan.mesh, layout.spec(engine.config.axis))
  return jax.jit(make, out_shardings=sharding)


def _created(stage: int) -> tuple[str, ...]:
  """The states init creates from a random draw: the master, and under ZeRO-3 the params."""
  return ("master", "params") if stage == 3 else ("master",)


def _by_layer(plan: Plan, leaf, stage: int) -> bool:
  """Whether init draws this leaf one layer at a time: stacked, and not all of it on the device
  (a whole draw would hold the leaf and its RNG temporaries in host memory, or in HBM the
  leaf was placed elsewhere to spare)."""
  return leaf.stacked and any(s.tier != "device" for st in _created(stage) for s in leaf.segments(st))


def _write(plan: Plan, leaf, state: str, rank: int, layer: int, data, store, pipeline,
           tickets: list) -> None:
  """One rank's fp32 shard of one layer, written as `state`'s NVMe copy."""
  if state == "master":
    tickets += pipeline.write_layer(leaf.index, rank, layer, data)
  elif not leaf.params_with_master(layer):  # else the pipeline wrote the params too
    tickets.append(store.write(leaf.key("params", rank, layer),
                               np.asarray(data).astype(plan.dtype(state))))


def _place(plan: Plan, leaf, x: jax.Array, state: str, store, pipeline, tickets: list) -> tuple:
  """One leaf's whole storage-form value `x` put on its segments' tiers for `state`."""
  dtype = plan.dtype(state)
  parts = []
  shards = None
  for seg in leaf.segments(state):
    if seg.tier != "nvme":
      piece = x if seg.layers == leaf.num_layers else leaf.take(x, seg)
      # a program, not device_put: each state gets its own buffers (fp32 params are not the master)
      put = jax.jit(lambda v: v.astype(dtype), out_shardings=plan.sharding(leaf, seg.tier))
      parts.append(put(piece))
      continue
    shards = host_shards(x, plan.mesh) if shards is None else shards
    for rank, shard in shards.items():
      for layer in range(seg.start, seg.stop):
        _write(plan, leaf, state, rank, layer, shard[layer] if leaf.stacked else shard, store,
               pipeline, tickets)
  return tuple(parts)


def _place_by_layer(engine: Engine, model_factory: ModelFactory, leaf, key) -> dict[str, tuple]:
  """A stacked leaf drawn one layer at a time, each layer put on its tier as it comes: NVMe
  layers written (while the next is drawn), the layers of array segments copied into their
  devices' host buffers, which become the segment's arrays at the end. Host memory holds two
  layers beside what the tiers hold anyway, whatever the depth. Returns each created state's
  array parts, as `_place` does."""
  plan = engine.plan
  draw = layer_initializer(engine, model_factory, leaf.index)
  arrays = {(state, seg): _segment_buffers(plan, leaf, state, seg)
            for state in _created(plan.stage) for seg in leaf.array_segments(state)}
  writing: list = []
  for layer in range(leaf.num_layers):
    x = draw(key, layer)
    for (state, seg), bufs in arrays.items():
      if layer in seg:
        for shard in x.addressable_shards:
          bufs[shard.device][layer - seg.start] = np.asarray(shard.data)
    tickets: list = []
    on_nvme = [st for st in _created(plan.stage)
               if any(s.tier == "nvme" and layer in s for s in leaf.segments(st))]
    if on_nvme:
      for rank, data in host_shards(x, plan.mesh).items():
        for state in on_nvme:
          _write(plan, leaf, state, rank, layer, data, engine.store, engine.pipeline, tickets)
    del x
    for t in writing:  # the previous layer's writes ran while this one was drawn
      t.wait()
    writing = tickets
  for t in writing:
    t.wait()
  out: dict[str, list] = {state: [] for state in _created(plan.stage)}
  for (state, seg), bufs in arrays.items():
    sharding = plan.sharding(leaf, seg.tier)
    shape = leaf.segment_shape(seg)
    parts = [jax.device_put(buf, jax.sharding.SingleDeviceSharding(d, memory_kind=sharding.memory_kind))
             for d, buf in bufs.items()]
    out[state].append(jax.make_array_from_single_device_arrays(shape, sharding, parts))
    bufs.clear()
  return {state: tuple(parts) for state, parts in out.items()}


def _segment_buffers(plan: Plan, leaf, state: str, seg) -> dict:
  """Host buffers, one per local device, for an array segment's shards (filled layer by layer)."""
  shape = leaf.segment_shape(seg)
  sharding = plan.sharding(leaf, seg.tier)
  return {d: np.empty([s.stop - s.start for s in norm_region(index, shape)], plan.dtype(state))
          for d, index in sharding.addressable_devices_indices_map(shape).items()}


def make_states(engine: Engine, model_factory: ModelFactory, rng=0, *, abstract: bool,
                weights: list | None = None) -> TrainState:
  """The initial `TrainState` of `engine` (or its sharded `ShapeDtypeStruct`s when `abstract`):
  from `model_factory`'s random init, or streamed from `weights` when given (a tensor or None
  per plan leaf, as `_matched` gives them)."""
  plan, mesh = engine.plan, engine.mesh
  rep = NamedSharding(mesh, P())
  key = rng if isinstance(rng, jax.Array) else jax.random.key(rng)
  if abstract:
    step = jax.ShapeDtypeStruct((), jnp.int32, sharding=rep)
    master = plan.abstract("master")
    if engine.hyper is None:
      tree = untuple(plan, master)
      opt = jax.eval_shape(jax.jit(engine.tx.init, out_shardings=opt_state_shardings(engine, tree)), tree)
    else:
      opt = HostAdamState(step, master, master)
    return TrainState(step, plan.abstract("params"), master, opt, engine)

  if weights is not None:
    fresh = lambda i: tuple(x[0] for x in _random_states(engine, model_factory, key, [i]))
    masters, params = stream_states(engine, weights, fresh)
  else:
    masters, params = _random_states(engine, model_factory, key)
  master = plan.unflatten(masters)
  params = (plan.unflatten(params) if plan.stage == 3 else
            gather_params(plan, master, engine.config.ordered_collectives))
  step = jax.device_put(jnp.zeros((), jnp.int32), rep)
  if engine.hyper is None:
    tree = untuple(plan, master)
    opt = jax.jit(engine.tx.init, out_shardings=opt_state_shardings(engine, tree))(tree)
  else:
    zeros = jax.jit(lambda m: jax.tree.map(jnp.zeros_like, m),
                    out_shardings=jax.tree.map(lambda x: x.sharding, master))
    opt = HostAdamState(jax.device_put(jnp.zeros((), jnp.int32), rep), zeros(master), zeros(master))
  return TrainState(step, params, master, opt, engine)


def _matched(engine: Engine, model_factory: ModelFactory, weights: Any, init_missing: Any) -> list:
  """`weights` matched to the plan's leaves; refused (naming the leaf) when they do not fit."""
  may_miss = frozenset()
  if init_missing is not None:
    may_miss = leaf_names(nnx.eval_shape(lambda: model_factory(nnx.Rngs(0))), init_missing)
  return match(engine.plan, as_tree(weights), may_miss)


def _random_states(engine: Engine, model_factory: ModelFactory, key,
                   only: list[int] | None = None) -> tuple[list, list]:
  """(master parts, ZeRO-3 param parts) per leaf (all, or those in `only`, in that order) from
  the factory's initializers."""
  plan = engine.plan
  chosen = list(range(len(plan.leaves))) if only is None else list(only)
  masters, params, tickets = [None] * len(plan.leaves), [None] * len(plan.leaves), []
  by_layer = [i for i in chosen if _by_layer(plan, plan.leaves[i], plan.stage)]
  for i in by_layer:  # stacked leaves not all on the device: one layer at a time
    parts = _place_by_layer(engine, model_factory, plan.leaves[i], key)
    masters[i] = parts["master"]
    params[i] = parts["params"] if plan.stage == 3 else None
  rest = [i for i in chosen if i not in by_layer]
  # without NVMe the rest of the master is one program; with it one leaf at a time, so host
  # memory holds at most one leaf while the states stream to the swap store
  groups = ([rest] if rest else []) if engine.store is None else [[i] for i in rest]
  for group in groups:
    values = master_initializer(engine, model_factory, group)(key)
    for i, x in zip(group, values):
      leaf = plan.leaves[i]
      masters[i] = _place(plan, leaf, x, "master", engine.store, engine.pipeline, tickets)
      if plan.stage == 3:
        params[i] = _place(plan, leaf, x, "params", engine.store, engine.pipeline, tickets)
      for t in tickets:
        t.wait()
      tickets.clear()
      del x
  if engine.store is not None:
    engine.store.sync()
  return [masters[i] for i in chosen], [params[i] for i in chosen]


def init(model_factory: ModelFactory, tx: optax.GradientTransformation, config: ZeroConfig,
         mesh, rng: int | jax.Array = 0, *, params: Any = None,
         init_missing: Any = None) -> TrainState:
  """Create a sharded `TrainState` without ever holding the whole model on one device.

  Args:
    model_factory: `rngs -> nnx.Module`, e.g. `lambda rngs: GPT(cfg, rngs=rngs)`; with
      `params` it gives only the model's structure (nothing is initialized).
    tx: any optax transformation with the optimizer on the device; with it on
      a host tier (or split over tiers), `zinfjax.optim.adamw(...)`.
    config: the ZeRO settings (placement included).
    mesh: a mesh with a `config.axis` axis (see `make_mesh`).
    rng: seed or PRNG key for the parameters.
    params: existing weights to start from instead of a random init: an nnx model or state,
      a nested dict of arrays like `nnx.to_pure_dict(nnx.state(model))`, or of
      `zinfjax.weights` Tensors (e.g. `zinfjax.models.hf.load_weights(folder, cfg)` over
      safetensors). Each rank's shard is read and put straight into its tier, one leaf at
      a time. A factory that returns an already built model is streamed the same way.
    init_missing: an nnx filter (e.g. `nnx.LoRAParam`): leaves it selects that `params` lacks
      (new adapters) come from the model's initializers (seeded by `rng`).
  """
  if params is None:
    params = existing_weights(model_factory)
  engine = build_engine(model_factory, tx, config, mesh, open_store_=False)
  # bad weights are refused before the drive is touched
  weights = None if params is None else _matched(engine, model_factory, params, init_missing)
  engine = with_store(engine)
  try:
    return make_states(engine, model_factory, rng, abstract=False, weights=weights)
  except BaseException:
    if engine.store is not None:
      engine.store.close()
    raise


def abstract_init(model_factory: ModelFactory, tx: optax.GradientTransformation,
                  config: ZeroConfig, mesh) -> TrainState:
  """The `TrainState` `init` would make, as sharded `ShapeDtypeStruct`s: nothing is allocated.

  Lower a step on it to read its memory before committing to a model size:
  `make_train_step(s, loss).jitted.lower(s, batch).compile().memory_analysis()`.
  """
  engine = build_engine(model_factory, tx, config, mesh, open_store_=False)
  return make_states(engine, model_factory, abstract=True)


