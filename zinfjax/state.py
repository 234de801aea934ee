"""`TrainState` and its creation: every state placed where the plan says, never whole on one device.

A state held in arrays is a tree like the params whose leaves are tuples: one
array per segment of the leaf on `device` or `pinned_host` (see
`placement.py`); its NVMe segments are in the swap store.
"""

from __future__ import annotations

import dataclasses
import warnings
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
from .draw import random_states
from .engine import Engine, ModelFactory, build_engine, leaf_names, with_store
from .optim.host import HostAdamState
from .ordering import needs_order, ordered_collectives
from .placement import Plan
from .progress import InitReport, Tally
from .shards import host_shards
from .weights.source import as_tree, match
from .weights.stream import existing_weights, stream_states

# what jax traces a function's arguments as (() where a jax release has moved it: no check)
_TRACER = getattr(jax.core, "Tracer", ())


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


class UnusableStateError(RuntimeError):
  """A `TrainState` that was donated to a step, or whose run was closed, was used."""


class HeldUpdateWarning(UserWarning):
  """Params were taken out of a state whose last update `ZeroConfig.delay_update` holds back."""


@dataclasses.dataclass
class TrainState:
  """Arrays of a ZeRO run (`engine` is static metadata; `engine.plan` says where all lives).

  A state is consumed by the `train_step` it is given (its arrays are donated, and its NVMe
  shards rewritten): every entry point refuses it afterwards (`UnusableStateError`). `close()`
  (or `with zinfjax.init(...) as state:`) ends the run: threads joined, swap store closed.
  """

  step: jax.Array
  params: Any        # compute params: per leaf, a tuple of its array segments
  master: Any        # fp32 master params (storage form, split over `data`), likewise
  opt_state: Any     # optax state of `engine.tx` (optimizer on device) or HostAdamState
  engine: Engine = dataclasses.field(metadata=dict(static=True))
  # the step count when known without waiting on the device (init, restore, a step's result)
  known_step: int | None = dataclasses.field(default=None, repr=False, compare=False)
  # why this state can no longer be used (the step it was donated to), None while it can
  consumed: str | None = dataclasses.field(default=None, repr=False, compare=False)

  def check_usable(self, use: str) -> None:
    """Raise `UnusableStateError` naming `use` when this state was donated or its run closed
    (a `TypeError` when it is traced: `use` called under jax.jit)."""
    if any(isinstance(x, _TRACER) for x in jax.tree.leaves(self)):
      raise TypeError(
          f"{use} was called inside a jax transformation (jax.jit, grad, vmap, a scan...) on a "
          "traced TrainState. zinfjax's entry points compile their own programs and move states "
          "between tiers outside XLA: call them from plain Python, outside jax.jit.")
    if self.consumed is not None:
      raise UnusableStateError(f"{use}: {self.consumed}")
    closed = self.engine.life.closed
    if closed is not None:
      raise UnusableStateError(
          f"{use}: this TrainState's run is closed ({closed}). Restore it from a checkpoint to go "
          "on with it.")
    if self.arrays_deleted():
      raise UnusableStateError(
          f"{use}: this TrainState's arrays were deleted or donated (to a train_step, or a jitted "
          "function that donates them). Use the state train_step returned: "
          "`state, metrics = zinfjax.train_step(state, batch, loss_fn)`.")

  def arrays_deleted(self) -> bool:
    """Whether any of this state's arrays was deleted or donated."""
    return any(isinstance(x, jax.Array) and x.is_deleted() for x in jax.tree.leaves(self))

  def mark_donated(self, new: "TrainState | None") -> None:
    """Record that a step consumed this state (and returned `new`, when it did)."""
    at = "" if self.known_step is None else f" (step {self.known_step})"
    if new is None:
      self.consumed = (f"this TrainState{at} was donated to a train_step that failed: its arrays "
                       "are gone. Restore the last checkpoint to go on.")
      return
    if self.known_step is not None:
      new.known_step = self.known_step + 1
    nvme = " and rewrote its NVMe shards" if self.engine.store is not None else ""
    self.consumed = (f"this TrainState{at} was donated to train_step, which took its arrays{nvme}."
                     " Use the state it returned: "
                     "`state, metrics = zinfjax.train_step(state, batch, loss_fn)`.")

  def close(self) -> None:
    """End this run: join its threads, close its swap store (releasing the folders), and free
    this state's arrays. Every state of the run is unusable afterwards; a second close does
    nothing. A state dropped without close() is closed when it is collected."""
    self.engine.close("closed by TrainState.close()")
    for x in jax.tree.leaves(self):
      if isinstance(x, jax.Array) and not x.is_deleted():
        x.delete()

  def __enter__(self) -> "TrainState":
    return self

  def __exit__(self, *exc) -> None:
    self.close()

  def full_params(self, dtype=jnp.float32) -> Any:
    """The params in their logical shapes, from every tier (tests, export): the fp32 master of
    each trained leaf, the compute params of each frozen one."""
    self.check_usable("full_params")
    plan = self.engine.plan
    return plan.unflatten([jnp.asarray(self._full(leaf, dtype)) for leaf in plan.leaves])

  def full_leaf(self, name: str, dtype=np.float32, layer: int | None = None) -> np.ndarray:
    """One leaf's fp32 master (a frozen leaf: its compute params) in its logical shape, by its
    path (e.g. "layers/block/q/kernel"), as numpy: an export reads one leaf at a time; of a
    stacked leaf, one `layer` at a time where given (that layer read alone, not the stack)."""
    self.check_usable("full_leaf")
    found = [l for l in self.engine.plan.leaves if l.name == name]
    if not found:
      raise KeyError(f"the model has no leaf {name!r}.")
    leaf = found[0]
    if layer is not None and not (leaf.stacked and 0 <= layer < leaf.num_layers):
      raise IndexError(f"full_leaf({name!r}, layer={layer}): " + (
          f"the leaf has layers 0 to {leaf.num_layers - 1}." if leaf.stacked
          else "the leaf is not stacked; leave layer out."))
    return self._full(leaf, dtype, layer)

  def _full(self, leaf, dtype, layer: int | None = None) -> np.ndarray:
    if jax.process_count() > 1:
      raise NotImplementedError(
          "full_params, full_leaf and model() join every rank's shards in this process, and "
          f"this run has {jax.process_count()} processes, each holding its own. Save a "
          "checkpoint and read it whole: zinfjax.checkpoint.CheckpointParams(directory) "
          "(hf.save takes it; train_gpt.py --export does so with --checkpoint-dir).")
    pipeline, plan = self.engine.pipeline, self.engine.plan
    if pipeline is not None and pipeline.holding is not None:
      warnings.warn(
          "zinfjax: these params miss the last step's update of the parts "
          f"ZeroConfig.delay_update={self.engine.config.delay_update!r} holds back (its grads "
          "wait for a next step); `state = zinfjax.flush_updates(state)` applies it first.",
          HeldUpdateWarning, stacklevel=3)
    state = "master" if leaf.trainable else "params"
    parts = plan.flatten(getattr(self, state))[leaf.index]
    x = _whole(plan, leaf, parts, self.engine.store, state, layer)
    shape = leaf.layout.shape if layer is None else leaf.layout.shape[1:]
    return np.asarray(x[tuple(slice(0, n) for n in shape)], dtype)

  def model(self) -> nnx.Module:
    """An ordinary NNX model holding the current master params (gathered whole)."""
    self.check_usable("TrainState.model()")
    return nnx.merge(self.engine.graphdef, self.full_params())


_FIELDS = ("step", "params", "master", "opt_state")
jax.tree_util.register_pytree_with_keys(
    TrainState,
    lambda s: ([(jax.tree_util.GetAttrKey(f), getattr(s, f)) for f in _FIELDS], _EngineRef(s.engine)),
    lambda ref, children: TrainState(*children, ref.get()),
    lambda s: ([getattr(s, f) for f in _FIELDS], _EngineRef(s.engine)))


def _whole(plan: Plan, leaf, parts: tuple, store, state: str = "master",
           layer: int | None = None) -> np.ndarray:
  """One leaf's `state` (master, or ZeRO-3 params) in storage shape, joined from its segments
  (one process); of a stacked leaf, its `layer` alone where given (only that layer is read)."""
  lay, arrays, pieces = leaf.layout, iter(parts), []
  # ranks join along the sharded axis (one layer's: without the layer axis before it)
  one = int(layer is not None)
  join = lambda ranks: ranks[0] if lay.axis is None else np.concatenate(ranks, axis=lay.axis - one)
  for seg in leaf.segments(state):
    x = next(arrays) if seg.tier.holds_arrays else None
    if layer is not None and layer not in range(seg.start, seg.stop):
      continue
    if x is not None and layer is None:
      # a copy: numpy may view a CPU buffer that the next (donating) step reuses
      pieces.append(np.array(x, copy=True))
    elif x is not None:
      shards = host_shards(x, plan.mesh, layer - seg.start)
      pieces.append(join([np.array(shards[r], copy=True) for r in range(plan.dp)]))
    else:
      ranks = []
      for r in range(plan.dp):
        layers = [store.read(leaf.key(state, r, j)).wait()
                  for j in (range(seg.start, seg.stop) if layer is None else [layer])]
        ranks.append(np.stack(layers) if leaf.stacked and layer is None else layers[0])
      pieces.append(join(ranks))
  return np.concatenate(pieces) if leaf.stacked and layer is None else pieces[0]


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


def make_states(engine: Engine, model_factory: ModelFactory, rng=0, *, abstract: bool,
                weights: list | None = None, progress: InitReport | None = None) -> TrainState:
  """The initial `TrainState` of `engine` (or its sharded `ShapeDtypeStruct`s when `abstract`):
  from `model_factory`'s random init, or streamed from `weights` when given (a tensor or None
  per plan leaf, as `_matched` gives them); the params placed reported to `progress`."""
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
      opt = HostAdamState(step, plan.abstract("mu"), plan.abstract("nu"))
    return TrainState(step, plan.abstract("params"), master, opt, engine, known_step=0)

  tally = Tally(sum(l.size for l in plan.leaves), progress)
  if weights is not None:
    fresh = lambda i: tuple(x[0] for x in random_states(engine, model_factory, key, [i]))
    masters, params = stream_states(engine, weights, fresh, tally)
  else:
    masters, params = random_states(engine, model_factory, key, tally=tally)
  tally.close()
  master = plan.unflatten(masters)
  params = (plan.unflatten(params) if plan.stage == 3 else
            gather_params(plan, master, engine.config.ordered_collectives))
  step = jax.device_put(jnp.zeros((), jnp.int32), rep)
  if engine.hyper is None:
    tree = untuple(plan, master)
    opt = jax.jit(engine.tx.init, out_shardings=opt_state_shardings(engine, tree))(tree)
  else:
    zeros = jax.jit(lambda m: jax.tree.map(lambda x: jnp.zeros_like(x, plan.dtype("mu")), m),
                    out_shardings=jax.tree.map(lambda x: x.sharding, master))
    opt = HostAdamState(jax.device_put(jnp.zeros((), jnp.int32), rep), zeros(master), zeros(master))
  return TrainState(step, params, master, opt, engine, known_step=0)


def _matched(engine: Engine, model_factory: ModelFactory, weights: Any, init_missing: Any) -> list:
  """`weights` matched to the plan's leaves; refused (naming the leaf) when they do not fit."""
  may_miss = frozenset()
  if init_missing is not None:
    may_miss = leaf_names(nnx.eval_shape(lambda: model_factory(nnx.Rngs(0))), init_missing)
  return match(engine.plan, as_tree(weights), may_miss)


def init(model_factory: ModelFactory, tx: optax.GradientTransformation, config: ZeroConfig,
         mesh, rng: int | jax.Array = 0, *, params: Any = None,
         init_missing: Any = None, progress: InitReport | None = None) -> TrainState:
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
    progress: called with (params placed, params in all, seconds so far) every 2 s or so of
      a long init, and once at its end (`zinfjax.progress.init_line` prints a line).
  """
  engine = build_engine(model_factory, tx, config, mesh, open_store_=False)
  if params is None:
    params = existing_weights(model_factory)
  # bad weights are refused before the drive is touched
  weights = None if params is None else _matched(engine, model_factory, params, init_missing)
  engine = with_store(engine)
  try:
    return make_states(engine, model_factory, rng, abstract=False, weights=weights,
                       progress=progress)
  except BaseException:
    engine.close("its init failed")
    raise


def abstract_init(model_factory: ModelFactory, tx: optax.GradientTransformation,
                  config: ZeroConfig, mesh) -> TrainState:
  """The `TrainState` `init` would make, as sharded `ShapeDtypeStruct`s: nothing is allocated.

  Lower a step on it to read its memory before committing to a model size:
  `make_train_step(s, loss).jitted.lower(s, batch).compile().memory_analysis()`.
  """
  engine = build_engine(model_factory, tx, config, mesh, open_store_=False)
  return make_states(engine, model_factory, abstract=True)


