"""`init` and `train_step`: ZeRO-1/2/3 training of a Flax NNX model on a data mesh.

The training state holds, per leaf, the fp32 master params and the optimizer
state in storage form (split over `data`), and the compute params (bf16, or
fp32 in exact mode): split too under stage 3, whole on every rank under 1/2.
One jitted step computes the loss and gradients inside `shard_map` (explicit
collectives, see `gather.py`), then runs any optax transformation on the
sharded fp32 states and refreshes the compute params.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from . import gather as G
from .config import ZeroConfig
from .layers import Stack
from .partition import is_layout, plan_layouts

Path = tuple[Any, ...]
LossFn = Callable[[nnx.Module, Any], jax.Array]


@dataclasses.dataclass(frozen=True, eq=False)
class Engine:
  """Static facts of one training run: the model's graph, layouts, mesh, optimizer."""

  graphdef: Any
  layouts: Any                 # tree of LeafLayout, like the param tree
  stack_paths: tuple[Path, ...]
  config: ZeroConfig
  mesh: Mesh
  tx: optax.GradientTransformation
  store: Any = None        # the process's swap store when a state is on NVMe
  param_nvme: Any = None   # tree of NvmeLeaf: params / grads in the swap store
  grad_nvme: Any = None
  pipeline: Any = None     # the NVMe optimizer pipeline (offload_optimizer="nvme")
  _steps: dict = dataclasses.field(default_factory=dict)

  @property
  def dp(self) -> int:
    return self.mesh.shape[self.config.axis]

  def storage_specs(self) -> Any:
    return jax.tree.map(lambda lay: lay.spec(self.config.axis), self.layouts, is_leaf=is_layout)

  def compute_specs(self) -> Any:
    if self.config.stage == 3:
      return self.storage_specs()
    return jax.tree.map(lambda lay: P(), self.layouts, is_leaf=is_layout)

  def named(self, specs: Any, memory_kind: str | None = None) -> Any:
    return jax.tree.map(lambda s: NamedSharding(self.mesh, s, memory_kind=memory_kind), specs,
                        is_leaf=lambda x: isinstance(x, P))

  @property
  def tiered(self) -> bool:
    """Whether params or optimizer states leave the device (see `tiered.py`)."""
    return "device" != self.config.offload_param or "device" != self.config.offload_optimizer


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class TrainState:
  """Arrays of a ZeRO run (`engine` is static metadata)."""

  step: jax.Array
  params: Any        # compute params; None when they are the master (stage 3, fp32)
  master: Any        # fp32, storage form, split over `data`
  opt_state: Any     # the optax state of `engine.tx` over `master`
  engine: Engine = dataclasses.field(metadata=dict(static=True))

  @property
  def compute_params(self) -> Any:
    return self.master if self.params is None else self.params

  def full_params(self, dtype=jnp.float32) -> Any:
    """The fp32 master params in their logical shapes, as a pure dict (for tests, export)."""
    master = self.master
    if master is None:  # on NVMe: gather the shards from the swap store
      from .tiered import read_master
      master = read_master(self.engine)
    return jax.tree.map(lambda x, lay: lay.unpad(jnp.asarray(x)).astype(dtype), master,
                        self.engine.layouts)

  def model(self) -> nnx.Module:
    """An ordinary NNX model holding the current master params (gathered whole)."""
    return nnx.merge(self.engine.graphdef, self.full_params())


def _stack_paths(model: nnx.Module) -> tuple[Path, ...]:
  return tuple(tuple(path) for path, node in nnx.iter_graph(model) if isinstance(node, Stack))


def _check_params_only(model: nnx.Module) -> None:
  _, _, other = nnx.split(model, nnx.Param, ...)
  leaves = jax.tree.leaves(other)
  if leaves:
    raise ValueError(
        "zinfjax trains models whose state is all nnx.Param; this model also holds "
        f"{len(leaves)} other variables (rng counters, batch stats). Build the model "
        "without dropout/rngs state or keep them outside the module.")


def init(model_factory: Callable[[nnx.Rngs], nnx.Module], tx: optax.GradientTransformation,
         config: ZeroConfig, mesh: Mesh, rng: int | jax.Array = 0) -> TrainState:
  """Create a sharded `TrainState` without ever holding the whole model on one device.

  Args:
    model_factory: `rngs -> nnx.Module`, e.g. `lambda rngs: GPT(cfg, rngs=rngs)`.
    tx: any optax transformation; it runs on the fp32 master params.
    config: the ZeRO settings.
    mesh: a mesh with a `config.axis` axis (see `make_mesh`).
    rng: seed or PRNG key for the parameters.
  """
  return _create(model_factory, tx, config, mesh, rng, abstract=False)


def abstract_init(model_factory: Callable[[nnx.Rngs], nnx.Module], tx: optax.GradientTransformation,
                  config: ZeroConfig, mesh: Mesh) -> TrainState:
  """The `TrainState` `init` would make, as sharded `ShapeDtypeStruct`s: nothing is allocated.

  Lower a step on it to read its memory before committing to a model size:
  `make_train_step(s, loss).jitted.lower(s, batch).compile().memory_analysis()`.
  """
  return _create(model_factory, tx, config, mesh, 0, abstract=True)


def build_engine(model_factory: Callable[[nnx.Rngs], nnx.Module], tx: optax.GradientTransformation,
                 config: ZeroConfig, mesh: Mesh, *, open_store: bool = True) -> Engine:
  """The static `Engine` of a run: layouts of the model's leaves on `mesh`, and (with
  `open_store`) the swap store and NVMe pipeline its placement needs. Allocates no state."""
  if config.axis not in mesh.shape:
    raise ValueError(f"mesh axes {tuple(mesh.shape)} have no {config.axis!r} axis; "
                     "build the mesh with zinfjax.make_mesh().")
  abstract_model = nnx.eval_shape(lambda: model_factory(nnx.Rngs(0)))
  graphdef, abstract_state = nnx.split(abstract_model)
  _check_params_only(abstract_model)
  stack_paths = _stack_paths(abstract_model)
  layouts = plan_layouts(nnx.to_pure_dict(abstract_state),
                         {p + ("block",) for p in stack_paths},
                         mesh.shape[config.axis], config.persistence_threshold)
  engine = Engine(graphdef, layouts, stack_paths, config, mesh, tx)
  if engine.tiered:
    from . import tiered
    engine = tiered.make_engine(engine, abstract=not open_store)
  return engine


def _create(model_factory, tx, config, mesh, rng, *, abstract: bool) -> TrainState:
  engine = build_engine(model_factory, tx, config, mesh, open_store=not abstract)
  return make_states(engine, model_factory, rng, abstract=abstract)


def make_states(engine: Engine, model_factory, rng=0, *, abstract: bool) -> TrainState:
  """The initial `TrainState` of `engine` (or its sharded `ShapeDtypeStruct`s when `abstract`)."""
  config, mesh, tx = engine.config, engine.mesh, engine.tx
  run = jax.eval_shape if abstract else (lambda f, *args: f(*args))
  key = rng if isinstance(rng, jax.Array) else jax.random.key(rng)
  step = run(jax.jit(lambda: jnp.zeros((), jnp.int32), out_shardings=NamedSharding(mesh, P())))
  if engine.tiered:
    from . import tiered
    params, master, opt_state = tiered.init_states(engine, model_factory, key, abstract=abstract)
    return TrainState(step, params, master, opt_state, engine)
  master = run(master_initializer(engine, model_factory), key)
  storage = engine.named(engine.storage_specs())
  opt_init = jax.jit(tx.init, out_shardings=_opt_state_shardings(engine, master, storage))
  opt_state = run(opt_init, master)
  compute = engine.named(engine.compute_specs())
  params = None if (config.stage == 3 and config.precision == "fp32") else run(
      jax.jit(lambda m: _refresh_params(engine, m), out_shardings=compute), master)
  return TrainState(step, params, master, opt_state, engine)


def master_initializer(engine: Engine, model_factory: Callable[[nnx.Rngs], nnx.Module]):
  """`key -> fp32 master params`, jitted straight into their sharded storage form.

  With partitionable RNG each device draws only its own shard, so the whole
  model is never materialized on one device.
  """

  def make_master(key):
    model = model_factory(nnx.Rngs(key))
    pure = nnx.to_pure_dict(nnx.state(model))
    return jax.tree.map(lambda x, lay: lay.pad(x.astype(jnp.float32)), pure, engine.layouts)

  return jax.jit(make_master, out_shardings=engine.named(engine.storage_specs()))


def _opt_state_shardings(engine: Engine, master: Any, storage: Any) -> Any:
  """Param-shaped parts of the optimizer state are split like the master; the rest replicated."""
  abstract = jax.eval_shape(engine.tx.init, master)
  whole = NamedSharding(engine.mesh, P())
  return optax.tree_map_params(engine.tx, lambda _, sharding: sharding, abstract, storage,
                               transform_non_params=lambda _: whole)


def _refresh_params(engine: Engine, master: Any) -> Any:
  """Compute params from the fp32 master: cast (stage 3) or cast + all-gather (1/2)."""
  config = engine.config
  dtype = config.compute_dtype
  if config.stage == 3:
    if config.precision == "fp32":
      return None
    return jax.jit(lambda m: jax.tree.map(lambda x: x.astype(dtype), m))(master)
  return _gather_params(engine, master)


def _gather_params(engine: Engine, master: Any) -> Any:
  axis, dtype = engine.config.axis, engine.config.compute_dtype

  def body(m):
    return jax.tree.map(lambda x, lay: G.gather(x.astype(dtype), lay, axis), m, engine.layouts)

  return jax.shard_map(body, mesh=engine.mesh, in_specs=(engine.storage_specs(),),
                       out_specs=engine.compute_specs(), check_vma=False)(master)


def _get(tree: Any, path: Path) -> Any:
  for k in path:
    tree = tree[k] if isinstance(tree, dict) else getattr(tree, k)
  return tree


def _set_attr(model: nnx.Module, path: Path, value: Any) -> None:
  parent = _get(model, path[:-1])
  if isinstance(parent, (list, dict)):
    parent[path[-1]] = value
  else:
    object.__setattr__(parent, path[-1], value)


def _local_loss_and_grads(engine: Engine, loss_fn: LossFn, params: Any, batch: Any):
  """Per-rank loss and gradients (already reduced to this rank's storage shard)."""
  config, axis, dp = engine.config, engine.config.axis, engine.dp

  tier = config.offload_param
  pairs = (None if engine.param_nvme is None else
           jax.tree.map(lambda a, b: (a, b), engine.param_nvme, engine.grad_nvme))

  def fetch(x, lay, pair=None):
    if lay.stacked:
      return x
    return G.fetch(x, lay, axis) if tier == "device" else G.fetch_from(x, lay, axis, tier, pair)

  def loss_of(params):
    if config.stage == 3:
      stacked = {p: _get(params, p + ("block",)) for p in engine.stack_paths}
      view = (jax.tree.map(fetch, params, engine.layouts) if pairs is None else
              jax.tree.map(fetch, params, engine.layouts, pairs))
      model = nnx.merge(engine.graphdef, view)
      for p, shards in stacked.items():
        stack = _get(model, p)
        sub = lambda tree: None if tree is None else _get(tree, p + ("block",))
        plan = G.ScanPlan(nnx.graphdef(stack.block),
                          jax.tree.map(lambda lay: lay.layer(), _get(engine.layouts, p + ("block",)),
                                       is_leaf=is_layout),
                          stack.num_layers, config.prefetch_depth, axis, config.tiles,
                          param_tier=tier, nvme=sub(engine.param_nvme),
                          grad_nvme=sub(engine.grad_nvme), nvme_depth=config.nvme_prefetch_depth,
                          offload_activations=config.offload_activations)
        _set_attr(model, p, G.ZeroStack(plan, shards))
    else:
      model = nnx.merge(engine.graphdef, params)
    return loss_fn(model, batch) / dp

  loss, grads = jax.value_and_grad(loss_of)(params)
  if config.stage == 1:
    grads = jax.tree.map(lambda g, lay: G.all_reduce_keep_shard(g, lay, axis), grads, engine.layouts)
  elif config.stage == 2:
    grads = jax.tree.map(lambda g, lay: G.reduce_scatter(g, lay, axis), grads, engine.layouts)
  return jax.lax.psum(loss, axis), grads


def make_train_step(state: TrainState, loss_fn: LossFn) -> Callable[[TrainState, Any], tuple[TrainState, dict]]:
  """A jitted `(state, batch) -> (state, metrics)` for `loss_fn(model, local_batch) -> mean loss`.

  `batch` is any pytree of arrays whose leading axis (examples) divides evenly
  over the `data` axis; `loss_fn` sees each rank's slice. The input state is
  donated: use the returned one.
  """
  engine = state.engine
  cached = engine._steps.get(loss_fn)
  if cached is not None:
    return cached
  config, mesh = engine.config, engine.mesh
  if engine.tiered:
    from .tiered import make_step
    engine._steps[loss_fn] = make_step(state, loss_fn)
    return engine._steps[loss_fn]

  def step(state: TrainState, batch: Any):
    grad_fn = jax.shard_map(
        lambda p, b: _local_loss_and_grads(engine, loss_fn, p, b), mesh=mesh,
        in_specs=(engine.compute_specs(), P(config.axis)),
        out_specs=(P(), engine.storage_specs()), check_vma=False)
    loss, grads = grad_fn(state.compute_params, batch)
    grads = jax.tree.map(lambda g: g.astype(jnp.float32), grads)
    updates, opt_state = engine.tx.update(grads, state.opt_state, state.master)
    master = optax.apply_updates(state.master, updates)
    params = _refresh_params(engine, master)
    metrics = {"loss": loss, "grad_norm": optax.tree.norm(grads)}
    return TrainState(state.step + 1, params, master, opt_state, engine), metrics

  shardings = jax.tree.map(lambda x: x.sharding, state)
  jitted = jax.jit(step, donate_argnums=(0,), out_shardings=(shardings, NamedSharding(mesh, P())),
                   in_shardings=(shardings, NamedSharding(mesh, P(config.axis))))

  def run(state: TrainState, batch: Any):
    return jitted(state, shard_batch(engine, batch))

  run.jitted = jitted
  engine._steps[loss_fn] = run
  return run


def shard_batch(engine: Engine, batch: Any) -> Any:
  """Place a host batch on the mesh, split on its leading axis; clear error if uneven."""
  sharding = NamedSharding(engine.mesh, P(engine.config.axis))

  def put(x):
    x = x if isinstance(x, jax.Array) else np.asarray(x)
    if x.ndim == 0 or x.shape[0] % engine.dp:
      raise ValueError(
          f"batch leaf of shape {tuple(x.shape)} does not split over {engine.dp} devices on "
          f"axis {engine.config.axis!r}; use a batch size that is a multiple of {engine.dp}.")
    if jax.process_count() > 1:  # every process holds the global batch; each places its rows
      return jax.make_array_from_callback(x.shape, sharding, lambda index: np.asarray(x[index]))
    return jax.device_put(x, sharding)

  return jax.tree.map(put, batch)


def train_step(state: TrainState, batch: Any, loss_fn: LossFn) -> tuple[TrainState, dict]:
  """One ZeRO training step; compiles once per (loss_fn, shapes) and reuses it."""
  return make_train_step(state, loss_fn)(state, batch)
