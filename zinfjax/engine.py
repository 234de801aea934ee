"""The `Engine`: static facts of one training run, built once from the model, optimizer,
config and mesh: the model's graph, the placement plan, the optimizer that runs where its
states live, and (when a state is on NVMe) the swap store and the NVMe optimizer pipeline."""

from __future__ import annotations

import dataclasses
import inspect
import os
import shutil
import threading
import warnings
import weakref
from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh

from .autoplace import AutoPlan, plan_placement
from . import _ffi, hostlimit
from .config import ZeroConfig
from .layers import stack_paths as model_stacks
from .offload.mixed import MixedStore
from .offload.store import AioStore, NoSpaceError
from .optim.adam import OffloadedTransformation
from .optim.hyper import AdamHyper
from .optim.pipeline import NvmePipeline
from .partition import plan_layouts
from .placement import Plan, Tier, make_plan
from .progress import human_bytes
from .tier import split_tiers

Path = tuple[Any, ...]
ModelFactory = Callable[[nnx.Rngs], nnx.Module]


class StoreReplacedWarning(UserWarning):
  """A new run opened a swap store on folders an earlier, still open run of this process held."""


@dataclasses.dataclass(eq=False)
class Life:
  """The mutable part of an engine: whether it is closed (and why), and what closing stops."""

  closed: str | None = None
  closers: list = dataclasses.field(default_factory=list)  # callables run once at close


@dataclasses.dataclass(frozen=True, eq=False)
class Engine:
  """What a step needs besides the arrays: graph, plan, optimizer, store."""

  graphdef: Any
  plan: Plan
  config: ZeroConfig
  tx: optax.GradientTransformation
  hyper: AdamHyper | None = None   # the AdamW the engine runs itself (None: `tx` under jit)
  decays: tuple[float, ...] = ()   # its weight decay per leaf
  store: AioStore | MixedStore | None = None  # the swap store(s) of the states off the arrays
  pipeline: NvmePipeline | None = None  # the NVMe optimizer (optimizer segments on NVMe)
  steps: dict = dataclasses.field(default_factory=dict)  # compiled steps by (kind, fn_key(loss_fn))
  auto: AutoPlan | None = None     # the placement offload="auto" chose (its config holds the tiers)
  life: Life = dataclasses.field(default_factory=Life)

  def close(self, why: str = "closed by close()") -> None:
    """Stop the run: join its threads, close its swap store (releasing the folders' locks),
    drop its compiled steps. Every state of this engine is unusable after it; a second close
    does nothing."""
    if self.life.closed is not None:
      return
    self.life.closed = why
    closers, self.life.closers = self.life.closers, []
    try:
      for close in closers:
        close()
    finally:
      self.steps.clear()
      if self.store is not None:
        _forget(self)
        self.store.close()

  @property
  def mesh(self) -> Mesh:
    return self.plan.mesh

  @property
  def dp(self) -> int:
    return self.plan.dp

  @property
  def layouts(self) -> Any:
    return self.plan.layouts

  @property
  def stack_paths(self) -> tuple[Path, ...]:
    return tuple(s.path for s in self.plan.stacks)


def _path_name(path: tuple) -> str:
  """A variable's name in the plan and in messages: its path joined by "/"."""
  return "/".join(map(str, path))


def _some(names: list[str], shown: int = 5) -> str:
  return ", ".join(names[:shown]) + (" ..." if len(names) > shown else "")


def _check_params_only(model: nnx.Module) -> None:
  _, params, other = nnx.split(model, nnx.Param, ...)
  others = [f"{_path_name(path)} ({type(v).__name__})"
            for path, v in nnx.to_flat_state(other)]
  if others:  # the step would not carry them: dropout keys repeat, batch stats never move
    raise ValueError(
        "zinfjax trains models whose state is all nnx.Param; this model also holds "
        f"{len(others)} other variables: {_some(others)}. Build it without them (nnx.Dropout "
        "built without rngs, LayerNorm or RMSNorm for BatchNorm) or keep such state outside "
        "the module.")
  not_float = [f"{_path_name(path)} ({jnp.dtype(v.dtype).name})"
               for path, v in nnx.to_flat_state(params)
               if not jnp.issubdtype(v.dtype, jnp.floating)]
  if not_float:  # cast to the compute dtype and updated by Adam, they would train as floats
    raise ValueError(
        f"zinfjax trains float params; these nnx.Params are not: {_some(not_float)}. Keep "
        "integer tables out of the params (a Python constant or an input in the batch).")


def leaf_names(model: nnx.Module, which: Any = nnx.Param) -> frozenset[str]:
  """The plan's names ("a/b/kernel") of the model's variables that the nnx filter `which` selects."""
  return frozenset(_path_name(path) for path, _ in nnx.to_flat_state(nnx.state(model, which)))


def frozen_leaves(model: nnx.Module, config: ZeroConfig) -> frozenset[str]:
  """Names of the params `config.trainable` leaves out (none when it is None)."""
  if config.trainable is None:
    return frozenset()
  every = leaf_names(model)
  trained = leaf_names(model, config.trainable)
  if not trained:
    raise ValueError(f"ZeroConfig.trainable={config.trainable!r} selects none of the model's "
                     "params: nothing would train.")
  frozen = every - trained
  if frozen and config.stage != 3:
    raise ValueError(f"frozen params (ZeroConfig.trainable) need stage=3, got stage="
                     f"{config.stage}: stages 1 and 2 rebuild every param from its fp32 master.")
  return frozen


def _engine_adamw(tx: optax.GradientTransformation, plan: Plan, config: ZeroConfig) -> AdamHyper | None:
  """The AdamW the engine runs itself (every tier, the device too: one state layout, so
  checkpoints move between tiers), or None when `tx` is another optax transformation."""
  if plan.optimizer_on_device and not isinstance(tx, OffloadedTransformation):
    return None
  if not isinstance(tx, OffloadedTransformation):
    raise ValueError(
        f"offload_optimizer={config.offload_optimizer!r} runs zinfjax's AdamW next to the states "
        f"on each tier, so it needs tx=zinfjax.optim.adamw(...) (or adam) itself, got "
        f"{type(tx).__name__}. Gradient clipping is built in: adamw(..., max_grad_norm=c) "
        "instead of optax.chain(optax.clip_by_global_norm(c), ...); other chains need "
        "offload_optimizer='device', which trains with any optax transformation.")
  if tx.offload != Tier.DEVICE:
    raise ValueError(
        f"the optimizer tier is set by ZeroConfig.offload_optimizer ({config.offload_optimizer!r});"
        f" build the tx without offload= (got adamw(offload={tx.offload!r})).")
  return tx.hyper


def open_store(config: ZeroConfig, plan: Plan) -> AioStore | MixedStore:
  """The process's swap store (the drive's, host RAM's, or both as a `MixedStore`), emptied for
  this run's states, with all of their space (grads included) allocated now: a drive or RAM
  that cannot hold them fails here, not at step 1."""
  stores: dict[Tier, AioStore] = {}
  try:
    for tier in sorted(plan.store_tiers):
      stores[tier] = _open_one(config, plan, tier)
  except BaseException:
    for store in stores.values():
      store.close()
    raise
  if len(stores) == 1:
    return stores.popitem()[1]
  return MixedStore(stores, plan.key_tier)


def _open_one(config: ZeroConfig, plan: Plan, tier: Tier) -> AioStore:
  """The store of `tier`: on the drive (nvme) or in host RAM (host_store). The RAM store keeps
  the buffers it lends a step's transfers (`Plan.lent_bytes`) whatever `pinned_budget` says:
  made again, each would be allocated and page-locked per layer and step."""
  memory = tier is Tier.HOST_STORE
  share = config.pinned_budget // 4 // len(plan.store_tiers)
  store = AioStore([] if memory else config.nvme_paths, jax.process_index(),
                   io_threads=config.nvme_io_threads,
                   pinned_budget=max(1 << 20, share, plan.lent_bytes(tier) if memory else 0),
                   io_nice=config.host_nice, fresh=True, memory=memory)
  store.defer_errors()  # raised after each step (see runner.checked)
  # all-or-nothing steps write the params and optimizer states to fresh extents: a second copy
  need = plan.nvme_disk_bytes(config.nvme_atomic_steps, tier=tier)
  try:
    if memory:  # host RAM: the memory store's NoSpaceError names the lack
      store.reserve(sum(need.values()), exact=True)
      return store
    # what a previous run left in the swap files is reused before the drive's free space
    free = sum(shutil.disk_usage(p).free for p in config.nvme_paths) + store.allocated_bytes
    copies = need["copies"]
    total = sum(need.values())
    if total > free:
      gb = lambda n: human_bytes(n, 2)
      also = (f", and {gb(copies)} for the copies that make a step all or nothing "
              "(nvme_atomic_steps=False saves them)" if copies else "")
      raise NoSpaceError(
          f"nvme_path {config.nvme_paths} has {gb(free)} free, but the states placed on NVMe need "
          f"{gb(total)} (params {gb(need['params'])}, grads {gb(need['grads'])}, optimizer "
          f"{gb(need['optimizer'])}{also}): free space there, add folders to nvme_path, or keep "
          "some states off NVMe (offload_param / offload_optimizer, or a per-layer split).")
    store.reserve(total, exact=True)
  except BaseException:
    store.close()
    raise
  return store


def model_of(model_factory: ModelFactory, rngs: nnx.Rngs) -> nnx.Module:
  """`model_factory(rngs)`, refusing a factory that takes no `rngs` or returns no nnx module,
  with the fix (before flax fails on what it returned)."""
  try:
    inspect.signature(model_factory).bind(rngs)
  except TypeError:
    raise TypeError(
        f"the model factory {getattr(model_factory, '__name__', model_factory)!r} cannot be "
        "called with one argument: zinfjax calls it as model_factory(rngs) with an nnx.Rngs, "
        "e.g. lambda rngs: GPT(config, rngs=rngs).") from None
  except ValueError:  # a callable without a signature to read: called as it is
    pass
  model = model_factory(rngs)
  if not isinstance(model, nnx.Module):
    raise TypeError(f"the model factory returned {type(model).__name__}, not an nnx.Module: it "
                    "must build and return the model, e.g. lambda rngs: GPT(config, rngs=rngs).")
  return model


def build_engine(model_factory: ModelFactory, tx: optax.GradientTransformation,
                 config: ZeroConfig, mesh: Mesh, *, open_store_: bool = True) -> Engine:
  """The `Engine` of a run: the plan of the model's leaves on `mesh`, and (with `open_store_`)
  the swap store and NVMe pipeline its placement needs. Allocates no state."""
  if config.axis not in mesh.shape:
    raise ValueError(f"mesh axes {tuple(mesh.shape)} have no {config.axis!r} axis; "
                     "build the mesh with zinfjax.make_mesh().")
  if not (callable(getattr(tx, "init", None)) and callable(getattr(tx, "update", None))):
    raise TypeError(f"tx must be an optax GradientTransformation, got {type(tx).__name__}: e.g. "
                    "tx=optax.adamw(3e-4), or zinfjax.optim.adamw(3e-4) for states off the device.")
  config = config.for_platform(mesh.devices.flat[0].platform, _ffi.CUDA_HANDLERS)
  abstract_model = nnx.eval_shape(lambda: model_of(model_factory, nnx.Rngs(0)))
  graphdef, abstract_state = nnx.split(abstract_model)
  _check_params_only(abstract_model)
  stack_paths = model_stacks(abstract_model)
  if config.stage == 3 and not stack_paths:
    warnings.warn(
        "the model has no zinfjax.Stack: under ZeRO-3 each step gathers all of its params at "
        "once (the whole model in compute precision on every device), not layer by layer. "
        "Build its repeated blocks with zinfjax.Stack; zinfjax.weights.stack_layers converts "
        "per-layer weights (layers.0.*, layers.1.* ...) to the stacked layout.", stacklevel=3)
  layouts = plan_layouts(nnx.to_pure_dict(abstract_state), {p + ("block",) for p in stack_paths},
                         mesh.shape[config.axis], config.persistence_threshold)
  frozen = frozen_leaves(abstract_model, config)
  # zinfjax's AdamW may keep its moments in bf16; any other optimizer's states are optax's
  moments = tx.hyper.moment_dtype if isinstance(tx, OffloadedTransformation) else jnp.float32
  auto = None
  if config.offload == "auto":  # the tiers, from the budgets, before anything is allocated
    auto = plan_placement(config, lambda c: make_plan(c, layouts, stack_paths, mesh, frozen,
                                                      moments), config.tier_budgets)
    config = auto.resolve(config)
  given, config = config, config.with_host_pipeline()  # errors speak of the tiers as given
  plan = make_plan(config, layouts, stack_paths, mesh, frozen, moments)
  pinned, platform = (plan.tier_bytes(by_medium=False)[Tier.PINNED_HOST] * len(mesh.local_devices),
                      mesh.devices.flat[0].platform)
  hostlimit.check(pinned, platform)
  hostlimit.warn_copies(pinned, platform, config.host_optimizer)
  try:
    hyper = _engine_adamw(tx, plan, given)
  except ValueError as e:
    if auto is None:
      raise
    raise ValueError(f"offload='auto' put optimizer states off the device ({auto.offload_optimizer}"
                     f") to fit the budgets: {e}") from None
  if config.delay_update != "none" and not plan.optimizer_in_store:
    if auto is not None:  # "auto" kept every optimizer state on the device: nothing to delay
      config = config.replace(delay_update="none")
    else:
      unused = (f" (offload_optimizer={config.offload_optimizer!r} names NVMe, but its splits "
                "take every layer before NVMe gets one)"
                if Tier.NVME in split_tiers(config.optimizer_split) else "")
      raise ValueError(
          f"ZeroConfig.delay_update={config.delay_update!r} delays updates of the host "
          f"pipeline, but no optimizer state is in the host pipeline{unused}: place the "
          "optimizer on NVMe (offload_optimizer='nvme') or in pinned host with "
          "host_optimizer='pipeline', or leave delay_update='none'.")
  decays = ()
  if hyper is not None:
    shapes = plan.unflatten([jax.ShapeDtypeStruct(l.layout.storage_shape, jnp.float32)
                             for l in plan.leaves])
    decays = tuple(hyper.decays(shapes))
  engine = Engine(graphdef, plan, config, tx, hyper, decays, auto=auto)
  return with_store(engine) if open_store_ else engine


# swap folders (real paths) -> the open engine of this process whose store holds them
_holders: dict[str, weakref.ref] = {}
_holders_mu = threading.Lock()


def _folders(config: ZeroConfig) -> list[str]:
  return [os.path.realpath(p) for p in config.nvme_paths]


def _forget(engine: Engine) -> None:
  with _holders_mu:
    for folder, ref in list(_holders.items()):
      if ref() is engine or ref() is None:
        del _holders[folder]


def _replace_holders(config: ZeroConfig) -> None:
  """Close the engines of this process that hold any of `config`'s swap folders: a new store
  there starts empty (it would erase their states anyway), and the folders' locks must be free."""
  with _holders_mu:
    held = {ref() for f in _folders(config) if (ref := _holders.get(f)) is not None}
  for old in held - {None}:
    folders = ", ".join(config.nvme_paths)
    if old.store is not None and old.store.closed:  # closed by hand: the folders are free
      old.close(f"its swap store on {folders} was closed (engine.store.close())")
      continue
    warnings.warn(
        f"zinfjax: the swap store on {folders} was held by an earlier run of this process; it is "
        "closed to open this one, and the TrainStates of that run can no longer be used. Call "
        "state.close() (or use `with zinfjax.init(...) as state:`) when a run is done, or give "
        "each run its own nvme_path.", StoreReplacedWarning, stacklevel=4)
    old.close(f"its swap store on {folders} was replaced by a later zinfjax.init or "
              "Checkpointer.restore on the same nvme_path")


def with_store(engine: Engine) -> Engine:
  """`engine` with the swap store and NVMe pipeline its placement needs (itself without NVMe).
  An earlier engine of this process on the same folders is closed first (`_replace_holders`);
  the store closes when the engine is closed or collected."""
  config, plan = engine.config, engine.plan
  if not config.uses_store or engine.store is not None:
    return engine
  _replace_holders(config)
  store = open_store(config, plan)
  pipeline = None
  if plan.optimizer_in_store:
    try:
      pipeline = NvmePipeline(store, plan, engine.hyper, engine.decays,
                              budget=config.pinned_budget - config.pinned_budget // 4,
                              delay=config.delay_update)
    except BaseException:
      store.close()
      raise
  engine = dataclasses.replace(engine, store=store, pipeline=pipeline)
  with _holders_mu:
    for folder in _folders(config):
      _holders[folder] = weakref.ref(engine)
  weakref.finalize(engine, store.close)  # the last state dropped releases the folders
  return engine
