"""Checkpoints of a `TrainState` on every tier, through orbax-checkpoint.

One orbax step folder per saved step (`directory/<step>/`), written under a
temporary name and renamed once every process is done (a save killed half
way leaves the previous steps intact), the last `keep` kept:

  meta/metadata   JSON: format, step, every leaf's logical shape and dtype,
                  the ZeRO config and mesh it came from, the caller's `extra`
  state/<name>    one zarr3 array per leaf (tensorstore), in its logical
                  (unpadded) shape, chunked as one rank's shard of one layer,
                  every chunk crc32c-checked

Leaf names: `step`, `master/{leaf}` (fp32 master params) and the optimizer's
under `opt/` (zinfjax's host AdamW: `opt/count`, `opt/mu/{leaf}`,
`opt/nu/{leaf}`, whether its states were on pinned host or NVMe). Compute
params are not stored: they are the master cast to the compute dtype. The
format knows nothing of the run's mesh or tiers, so a checkpoint restores
onto any number of devices and any placement.

Each process writes and reads only its own shards. Device and pinned-host
shards are copied to host memory in `save` and written in the background;
NVMe shards are streamed from the swap store into the checkpoint one shard at
a time before `save` returns (the next step overwrites them in place).
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Callable, Iterator

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import tensorstore as ts
from jax.sharding import NamedSharding, PartitionSpec as P
from orbax.checkpoint._src import asyncio_utils
from orbax.checkpoint._src.futures import future

from .optim.sharded import shard_key
from .partition import LeafLayout, _key_name, is_layout
from .tiered import leaf_names, local_ranks, local_shape

FORMAT = "zinfjax-checkpoint/1"
IN_FLIGHT = 8  # NVMe shards on their way to the checkpoint at once (each one in host memory)


class CheckpointError(ValueError):
  """A checkpoint that cannot be restored here (missing, damaged, or from another run)."""


@dataclasses.dataclass
class Leaf:
  """One stored array: where it lives in the run (jax.Array or swap-store keys) and its layout."""

  name: str
  shape: tuple[int, ...]            # logical shape
  dtype: np.dtype
  layout: LeafLayout | None = None  # None: stored and restored whole
  array: Any = None                 # a jax.Array (save), or a ShapeDtypeStruct with sharding (restore)
  nvme: tuple[tuple[str, Any], ...] = ()  # (key base, dtype) in the swap store; the first is read
  derived: bool = False             # restored from `name` but not saved itself (compute params)


# ------------------------------------------------------------------ leaves
def state_leaves(state) -> list[Leaf]:
  """The leaves of `state` (a TrainState, real or abstract) under their checkpoint names."""
  from .optim.sharded import HostAdamState
  engine = state.engine
  config = engine.config
  lays = jax.tree.leaves(engine.layouts, is_leaf=is_layout)
  names = jax.tree.leaves(leaf_names(engine.layouts))
  f32 = np.dtype(np.float32)
  per_leaf = lambda tree: [None] * len(lays) if tree is None else jax.tree.leaves(tree)
  master, params = per_leaf(state.master), per_leaf(state.params)
  params_nvme = config.offload_param == "nvme"
  compute = np.dtype(config.compute_dtype)

  out = [Leaf("step", (), np.dtype(np.int32), array=state.step)]
  for name, lay, m, p in zip(names, lays, master, params):
    nvme = ((f"o/master/{name}", f32),) if m is None else ()
    nvme += ((f"p/{name}", compute),) if params_nvme else ()
    out.append(Leaf(f"master/{name}", lay.shape, f32, lay, m, nvme))
    if p is not None:
      out.append(Leaf(f"master/{name}", lay.shape, f32, lay, p, derived=True))

  opt = state.opt_state
  if isinstance(opt, HostAdamState):
    out.append(Leaf("opt/count", (), np.dtype(np.int32), array=opt.count))
    for moment, key in (("mu", "o/m"), ("nu", "o/v")):
      for name, lay, x in zip(names, lays, per_leaf(getattr(opt, moment))):
        nvme = ((f"{key}/{name}", f32),) if x is None else ()
        out.append(Leaf(f"opt/{moment}/{name}", lay.shape, f32, lay, x, nvme))
    return out
  # any optax state: param-shaped leaves are split like the master, the rest are stored whole
  not_param = object()
  labels = optax.tree_map_params(engine.tx, lambda _, lay: lay, opt, engine.layouts,
                                 transform_non_params=lambda _: not_param)
  flat_labels = jax.tree.leaves(labels, is_leaf=lambda x: is_layout(x) or x is not_param)
  for (path, x), lab in zip(jax.tree_util.tree_flatten_with_path(opt)[0], flat_labels):
    name = "opt/" + "/".join(_key_name(k) for k in path)
    lay = lab if is_layout(lab) else None
    out.append(Leaf(name, lay.shape if lay else tuple(x.shape), np.dtype(x.dtype), lay, x))
  return out


def _chunks(leaf: Leaf, dp: int) -> list[int]:
  """One rank's shard of one layer (the unit every tier moves), in logical coordinates."""
  shape = list(leaf.shape)
  lay = leaf.layout
  if lay is not None:
    if lay.axis is not None:
      shape[lay.axis] = lay.padded // dp
    if lay.stacked:
      shape[0] = 1
  return [max(1, s) for s in shape]


def _spec(path: str, leaf: Leaf | None = None, dp: int = 1) -> dict:
  # an open option, not stored: without it, all-zero chunks (fresh moments) would not be written
  spec = {"driver": "zarr3", "kvstore": {"driver": "file", "path": path},
          "store_data_equal_to_fill_value": True,
          "context": {"file_io_concurrency": {"limit": 16}}}  # many small chunks: keep the disk busy
  if leaf is None:
    return {**spec, "open": True}
  metadata = {"shape": list(leaf.shape), "data_type": np.dtype(leaf.dtype).name,
              "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": _chunks(leaf, dp)}},
              "codecs": [{"name": "bytes", "configuration": {"endian": "little"}},
                         {"name": "crc32c"}]}
  return {**spec, "metadata": metadata, "create": True, "delete_existing": True}


# ------------------------------------------------------------------ regions
Region = tuple[slice, ...]


def _norm(index: tuple, shape: tuple[int, ...]) -> Region:
  return tuple(slice(*s.indices(n)[:2]) for s, n in zip(index, shape))


def _clip(region: Region, shape: tuple[int, ...]) -> Region:
  """The part of `region` (storage coordinates, maybe padded) inside the logical `shape`."""
  return tuple(slice(min(s.start, n), min(s.stop, n)) for s, n in zip(region, shape))


def _local(clipped: Region, region: Region) -> Region:
  return tuple(slice(c.start - r.start, c.stop - r.start) for c, r in zip(clipped, region))


def _nvme_units(leaf: Leaf, ranks: list[int], dp: int) -> Iterator[tuple[int, int, Region]]:
  """(rank, layer, region in storage coordinates) of this process's swap-store shards."""
  lay = leaf.layout
  full = list(lay.storage_shape)
  for rank in ranks:
    for layer in range(lay.shape[0] if lay.stacked else 1):
      region = [slice(0, n) for n in full]
      if lay.stacked:
        region[0] = slice(layer, layer + 1)
      if lay.axis is not None:
        size = lay.padded // dp
        region[lay.axis] = slice(rank * size, (rank + 1) * size)
      yield rank, layer, tuple(region)


# ------------------------------------------------------------------ orbax handler
@dataclasses.dataclass
class _Run:
  """What the handler needs of the running engine."""

  leaves: list[Leaf]
  dp: int
  ranks: list[int]      # this process's data-axis positions
  store: Any = None     # the process's swap store (NVMe leaves)


class StateHandler(ocp.AsyncCheckpointHandler):
  """Saves and restores `Leaf`s as zarr3 arrays, each process its own shards."""

  def __init__(self):
    self._barriers = 0

  def _sync(self, what: str) -> None:
    self._barriers += 1
    ocp.multihost.sync_global_processes(f"zinfjax_{what}_{self._barriers}")

  async def async_save(self, directory, args: "StateSave") -> list:
    run = args.run
    saved = [leaf for leaf in run.leaves if not leaf.derived]
    if jax.process_index() == 0:
      opened = [ts.open(_spec(os.fspath(directory / leaf.name), leaf, run.dp)) for leaf in saved]
      for o in opened:
        o.result()
    self._sync("created")
    writes: list[tuple[str, Region, np.ndarray]] = []
    for leaf in saved:
      path = os.fspath(directory / leaf.name)
      if leaf.array is None:   # NVMe: stream now, shard by shard, before the next step rewrites it
        _stream_nvme_to(path, leaf, run)
        continue
      for shard in leaf.array.addressable_shards:
        if shard.replica_id:
          continue
        region = _norm(shard.index, leaf.array.shape)
        clipped = _clip(region, leaf.shape)
        data = np.array(shard.data)[_local(clipped, region)]  # a copy: the state is donated next
        writes.append((path, clipped, data))

    async def commit():
      arrays: dict[str, Any] = {}
      pending = []
      for path, region, data in writes:
        if path not in arrays:
          arrays[path] = ts.open(_spec(path)).result()
        pending.append(arrays[path][region].write(data))
      for p in pending:
        p.result()

    return [future.CommitFutureAwaitingContractedSignals(commit(), name="zinfjax_state")]

  def save(self, directory, args: "StateSave") -> None:
    async def run():
      for f in await self.async_save(directory, args):
        f.result()
    asyncio_utils.run_sync(run())

  def restore(self, directory, args: "StateRestore") -> dict[str, jax.Array]:
    run = args.run
    out = {}
    opened: dict[str, Any] = {}
    for leaf in run.leaves:
      path = os.fspath(directory / leaf.name)
      if path not in opened:
        opened[path] = _open_checked(path, leaf)
      arr = opened[path]
      if leaf.nvme:  # e.g. the master on pinned host and its compute params on NVMe: both
        _stream_to_nvme(arr, leaf, run)
      if leaf.array is not None:
        out[leaf.name + ("#derived" if leaf.derived else "")] = _read_array(arr, leaf)
    return out


@ocp.args.register_with_handler(StateHandler, for_save=True)
@dataclasses.dataclass
class StateSave(ocp.args.CheckpointArgs):
  run: _Run


@ocp.args.register_with_handler(StateHandler, for_restore=True)
@dataclasses.dataclass
class StateRestore(ocp.args.CheckpointArgs):
  run: _Run


def _read(arr, region: Region, leaf: Leaf, dtype) -> np.ndarray:
  """`region` (storage coordinates) of a stored leaf, zero where it is padding."""
  clipped = _clip(region, leaf.shape)
  out = np.zeros([s.stop - s.start for s in region], dtype)
  try:
    data = arr[clipped].read().result()
  except Exception as e:  # tensorstore reports damaged chunks as ValueError/IOError
    raise CheckpointError(f"checkpoint array {leaf.name!r} is damaged or truncated ({e}).") from e
  out[_local(clipped, region)] = data.astype(dtype)
  return out


def _read_array(arr, leaf: Leaf) -> jax.Array:
  """A jax.Array with the target's shape, dtype and sharding (memory kind included)."""
  target = leaf.array
  sharding = target.sharding
  cache: dict[tuple, np.ndarray] = {}  # replicated targets read each region once
  arrays = []
  for device, index in sharding.addressable_devices_indices_map(target.shape).items():
    region = _norm(index, target.shape)
    key = tuple((s.start, s.stop) for s in region)
    if key not in cache:
      cache[key] = _read(arr, region, leaf, target.dtype)
    one = jax.sharding.SingleDeviceSharding(device, memory_kind=sharding.memory_kind)
    arrays.append(jax.device_put(cache[key], one))
  return jax.make_array_from_single_device_arrays(target.shape, sharding, arrays)


def _stream_to_nvme(arr, leaf: Leaf, run: _Run) -> None:
  """Write this process's swap-store shards of `leaf` from the checkpoint, one at a time."""
  tickets = []
  for rank, layer, region in _nvme_units(leaf, run.ranks, run.dp):
    data = _read(arr, region, leaf, np.float32)
    data = data.reshape(local_shape(leaf.layout, run.dp))
    for t in tickets:
      t.wait()
    tickets = [run.store.write(shard_key(base, rank, layer), data.astype(dtype))
               for base, dtype in leaf.nvme]
  for t in tickets:
    t.wait()


def _stream_nvme_to(path: str, leaf: Leaf, run: _Run) -> None:
  """Copy this process's swap-store shards of `leaf` into the checkpoint array at `path`."""
  arr = ts.open(_spec(path)).result()
  base = leaf.nvme[0][0]
  replicated = leaf.layout.axis is None
  units = [u for u in _nvme_units(leaf, run.ranks, run.dp) if not replicated or u[0] == 0]
  reading = run.store.read(shard_key(base, *units[0][:2])) if units else None
  writing: list = []  # at most IN_FLIGHT shards in host memory
  for i, (rank, layer, region) in enumerate(units):
    data = reading.wait()
    reading = run.store.read(shard_key(base, *units[i + 1][:2])) if i + 1 < len(units) else None
    if len(writing) >= IN_FLIGHT:
      writing.pop(0).result()
    clipped = _clip(region, leaf.shape)
    data = data.reshape([s.stop - s.start for s in region])
    writing.append(arr[clipped].write(np.ascontiguousarray(data[_local(clipped, region)])))
  for w in writing:
    w.result()


def _open_checked(path: str, leaf: Leaf):
  """The stored array of `leaf`, after checking it is all there."""
  if not os.path.isdir(path):
    raise CheckpointError(f"checkpoint has no array {leaf.name!r} (no folder {path}).")
  try:
    arr = ts.open(_spec(path)).result()
  except Exception as e:
    raise CheckpointError(f"checkpoint array {leaf.name!r} at {path} cannot be opened ({e}).") from e
  if arr.shape:
    chunks = arr.chunk_layout.write_chunk.shape
    expected = int(np.prod([-(-n // c) for n, c in zip(arr.shape, chunks)], dtype=np.int64))
    found = sum(len(files) for _, _, files in os.walk(os.path.join(path, "c")))
  else:  # a scalar is one chunk file named "c"
    expected, found = 1, int(os.path.exists(os.path.join(path, "c")))
  if found < expected:
    raise CheckpointError(
        f"checkpoint array {leaf.name!r} at {path} is truncated: {found} of its {expected} "
        "chunks are there (a save that did not finish, or files lost).")
  return arr


# ------------------------------------------------------------------ manager
class Checkpointer:
  """Saves and restores zinfjax training states in `directory`, keeping the last `keep`.

    ckpt = Checkpointer("/ckpt/run1", keep=3)
    ckpt.save(state, extra={"data_step": 100})     # returns once the state may change
    state, extra = ckpt.restore(model_factory, tx, config, mesh)   # latest step

  `save` is asynchronous: device and pinned-host shards are written in the
  background (NVMe shards before it returns); `wait()` blocks until the last
  save is committed. Every process of a multi-process run calls both.
  """

  def __init__(self, directory: str | os.PathLike, *, keep: int | None = 3, async_save: bool = True):
    if keep is not None and keep < 1:
      raise ValueError(f"keep={keep}: keep at least 1 checkpoint (or None for all).")
    self.directory = os.path.abspath(os.fspath(directory))
    if os.path.exists(self.directory) and not os.path.isdir(self.directory):
      raise CheckpointError(f"checkpoint directory {self.directory} is a file; give a folder.")
    options = ocp.CheckpointManagerOptions(
        max_to_keep=keep, create=False, enable_async_checkpointing=async_save,
        async_options=ocp.AsyncOptions(create_directories_asynchronously=False))
    self._handler = StateHandler()
    self._manager = None
    self._options = options

  @property
  def manager(self) -> ocp.CheckpointManager:
    if self._manager is None:
      self._manager = ocp.CheckpointManager(
          self.directory, options=self._options,
          item_handlers={"state": self._handler, "meta": ocp.JsonCheckpointHandler()})
    return self._manager

  def all_steps(self) -> list[int]:
    """Committed steps, oldest first (folders of unfinished saves are not steps)."""
    if not os.path.isdir(self.directory):
      return []
    return sorted(self.manager.all_steps())

  def latest_step(self) -> int | None:
    steps = self.all_steps()
    return steps[-1] if steps else None

  # ---------------------------------------------------------------- save
  def save(self, state, *, extra: dict | None = None) -> bool:
    """Save `state` as step `state.step`; False when that step is already saved."""
    step = int(jax.device_get(state.step.addressable_data(0)))
    os.makedirs(self.directory, exist_ok=True)
    if step in self.all_steps():
      return False
    engine = state.engine
    leaves = state_leaves(state)
    meta = {"format": FORMAT, "step": step,
            "leaves": {l.name: {"shape": list(l.shape), "dtype": np.dtype(l.dtype).name}
                       for l in leaves if not l.derived},
            "config": _config_json(engine.config), "devices": engine.dp,
            "processes": jax.process_count(), "extra": extra or {}}
    run = _Run(leaves, engine.dp, local_ranks(engine.mesh, engine.config.axis), engine.store)
    self.manager.save(step, args=ocp.args.Composite(state=StateSave(run), meta=ocp.args.JsonSave(meta)))
    return True

  def wait(self) -> None:
    """Block until every save started is committed."""
    if self._manager is not None:
      self._manager.wait_until_finished()

  # ---------------------------------------------------------------- restore
  def metadata(self, step: int | None = None) -> dict:
    """The JSON metadata of `step` (default: the latest); `["step"]` is the step it holds."""
    step = self._step(step)
    path = os.path.join(self.directory, str(step), "meta", "metadata")
    try:
      with open(path) as f:
        meta = json.load(f)
    except (OSError, ValueError) as e:
      raise CheckpointError(f"checkpoint step {step} in {self.directory} has no readable "
                            f"metadata ({e}); restore another step: {self.all_steps()}.") from e
    if meta.get("format") != FORMAT:
      raise CheckpointError(f"{path} is not a {FORMAT} checkpoint (format {meta.get('format')!r}).")
    return meta

  def _step(self, step: int | None) -> int:
    steps = self.all_steps()
    if not steps:
      raise CheckpointError(f"no checkpoint in {self.directory}: it holds no committed step.")
    if step is None:
      return steps[-1]
    if step not in steps:
      raise CheckpointError(f"no checkpoint for step {step} in {self.directory}; saved steps: {steps}.")
    return step

  def restore(self, model_factory: Callable, tx: optax.GradientTransformation, config, mesh, *,
              step: int | None = None):
    """`(state, extra)`: the training state of `step` (default: the latest) placed as `config`
    says on `mesh`, whatever placement and device count it was saved from."""
    from .train import TrainState, build_engine, make_states
    meta = self.metadata(step)
    step = meta["step"]
    engine = build_engine(model_factory, tx, config, mesh, open_store=True)
    target = make_states(engine, model_factory, abstract=True)
    leaves = _restore_targets(target)
    _check_compatible(meta, leaves, self.directory, step)
    run = _Run(leaves, engine.dp, local_ranks(mesh, config.axis), engine.store)
    restored = self.manager.restore(step, args=ocp.args.Composite(state=StateRestore(run)))["state"]
    if engine.store is not None:
      engine.store.sync()

    def take(name, tree, derived=False):
      if tree is None:
        return None
      flat = [restored[f"{name(i)}{'#derived' if derived else ''}"]
              for i in range(len(jax.tree.leaves(tree)))]
      return jax.tree.unflatten(jax.tree.structure(tree), flat)

    names = jax.tree.leaves(leaf_names(engine.layouts))
    master = take(lambda i: f"master/{names[i]}", target.master)
    params = take(lambda i: f"master/{names[i]}", target.params, derived=True)
    opt_state = _restore_opt(target, restored, names)
    state = TrainState(restored["step"], params, master, opt_state, engine)
    return state, meta.get("extra", {})

  def close(self) -> None:
    if self._manager is not None:
      self._manager.wait_until_finished()
      self._manager.close()
      self._manager = None

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.close()


def master_params(directory: str | os.PathLike, step: int | None = None) -> Iterator[tuple[str, np.ndarray]]:
  """`(leaf name, fp32 array)` of a checkpoint's master params, one leaf at a time in full
  logical shape, without building a model or a mesh (for export, like `zero_to_fp32`)."""
  ckpt = Checkpointer(directory)
  meta = ckpt.metadata(step)
  folder = os.path.join(ckpt.directory, str(meta["step"]), "state")
  for name, info in meta["leaves"].items():
    if not name.startswith("master/"):
      continue
    leaf = Leaf(name, tuple(info["shape"]), np.dtype(info["dtype"]))
    arr = _open_checked(os.path.join(folder, name), leaf)
    yield name[len("master/"):], _read(arr, tuple(slice(0, n) for n in leaf.shape), leaf, np.float32)


def _replicated_scalar(mesh) -> jax.ShapeDtypeStruct:
  return jax.ShapeDtypeStruct((), jnp.int32, sharding=NamedSharding(mesh, P()))


def _restore_targets(target) -> list[Leaf]:
  """`state_leaves` of an abstract state, with scalars that must come back as arrays."""
  leaves = state_leaves(target)
  for leaf in leaves:
    if leaf.name in ("step", "opt/count") and not isinstance(leaf.array, jax.ShapeDtypeStruct):
      leaf.array = _replicated_scalar(target.engine.mesh)
  return leaves


def _restore_opt(target, restored: dict, names: list[str]):
  from .optim.sharded import HostAdamState
  opt = target.opt_state
  if isinstance(opt, HostAdamState):
    moment = lambda m, tree: None if tree is None else jax.tree.unflatten(
        jax.tree.structure(tree), [restored[f"opt/{m}/{n}"] for n in names])
    return HostAdamState(restored["opt/count"], moment("mu", opt.mu), moment("nu", opt.nu))
  paths, treedef = jax.tree_util.tree_flatten_with_path(opt)
  return jax.tree.unflatten(treedef, [restored["opt/" + "/".join(_key_name(k) for k in path)]
                                      for path, _ in paths])


def _check_compatible(meta: dict, leaves: list[Leaf], directory: str, step: int) -> None:
  """Clear errors when the checkpoint holds another model or another optimizer's state."""
  saved = meta["leaves"]
  wanted = {l.name: (list(l.shape), np.dtype(l.dtype).name) for l in leaves if not l.derived}
  where = f"checkpoint step {step} in {directory}"
  model = lambda d: {k: v for k, v in d.items() if k.startswith("master/")}
  diff = [(k, saved.get(k), wanted.get(k)) for k in sorted(set(model(saved)) | set(model(wanted)))
          if (saved[k]["shape"] if k in saved else None) != (wanted[k][0] if k in wanted else None)]
  if diff:
    k, there, here = diff[0]
    there = there["shape"] if there else "absent"
    here = here[0] if here else "absent"
    raise CheckpointError(
        f"{where} was saved from another model: {len(diff)} params differ, e.g. {k!r} has shape "
        f"{there} there and {here} here. Build the model with the config it was trained with, "
        "or use another checkpoint directory.")
  opt_saved = {k for k in saved if k.startswith("opt/")}
  opt_wanted = {k for k in wanted if k.startswith("opt/")}
  if opt_saved != opt_wanted:
    missing = sorted(opt_wanted - opt_saved)[:3]
    raise CheckpointError(
        f"{where} holds another optimizer's state (this run needs {missing} ...). Restore with the "
        "optimizer it was saved with; zinfjax's host AdamW states restore across pinned_host and "
        "nvme, optax states only onto offload_optimizer='device' with the same optax chain.")
  for k in sorted(opt_wanted):
    if saved[k]["shape"] != wanted[k][0]:
      raise CheckpointError(f"{where}: optimizer state {k!r} has shape {saved[k]['shape']} there and "
                            f"{wanted[k][0]} here.")


def _config_json(config) -> dict:
  out = {}
  for f in dataclasses.fields(config):
    v = getattr(config, f.name)
    out[f.name] = v if isinstance(v, (int, float, str, bool, type(None), list)) else str(v)
  return out
