"""ZeRO-Infinity placement: params, grads and optimizer states on device, pinned host or NVMe.

Each rank owns 1/dp of every state on every tier and moves only that shard.
Where things live (`ZeroConfig.offload_*`):

  params      device / pinned_host arrays (storage form, compute dtype), or
              per-rank, per-layer shards `p/{leaf}` in the swap store
  grads       reduce-scattered in the backward scan straight to the params'
              tier (`g/{leaf}` on NVMe)
  optimizer   fp32 master + moments: optax on device, the C++ AdamW on pinned
              host inside the step, or the NVMe sub-group pipeline after it
              (`o/{master,m,v}/{leaf}`)

With the optimizer on device or pinned host a step is one jitted program;
with it on NVMe, the jitted forward/backward is followed by the host pipeline
(it writes the new params to their tier itself).
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import math
import os
import shutil
import threading
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

from .offload import tiers
from .offload.store import AioStore, NoSpaceError
from .optim.sharded import (GradGate, HostAdamState, NvmePipeline, clip_scale, host_update,
                            shard_key)
from .partition import LeafLayout, is_layout

ANCHOR = (1, 2)  # per rank: [token, sum of squares] of a leaf's grads written to NVMe


# ------------------------------------------------------------------ layout
def leaf_names(layouts: Any) -> Any:
  """A store key per leaf: its path, e.g. "blocks/block/mlp/fc1/kernel"."""
  from .partition import _key_name
  return jax.tree_util.tree_map_with_path(
      lambda path, _: "/".join(_key_name(k) for k in path), layouts, is_leaf=is_layout)


def local_shape(layout: LeafLayout, dp: int) -> tuple[int, ...]:
  """One rank's shard of one layer (the unit moved between tiers)."""
  shape = list(layout.storage_shape)
  if layout.axis is not None:
    shape[layout.axis] //= dp
  return tuple(shape[1:] if layout.stacked else shape)


def nvme_leaves(layouts: Any, dp: int, store: int, prefix: str, dtype) -> Any:
  """`NvmeLeaf` per leaf, keys `{prefix}/{leaf name}`."""
  return jax.tree.map(
      lambda lay, name: tiers.NvmeLeaf(store, f"{prefix}/{name}", local_shape(lay, dp),
                                       jnp.dtype(dtype), lay.shape[0] if lay.stacked else None),
      layouts, leaf_names(layouts), is_leaf=is_layout)


def local_ranks(mesh, axis: str) -> list[int]:
  """Positions on the data axis of this process's devices."""
  return [r for r, d in enumerate(mesh.devices.reshape(-1)) if d.process_index == jax.process_index()]


def nvme_bytes(config, layouts: Any, dp: int, ranks: int) -> dict[str, int]:
  """Bytes this process's ranks keep in the swap store, by state."""
  elems = sum(math.prod(local_shape(lay, dp)) * (lay.shape[0] if lay.stacked else 1)
              for lay in jax.tree.leaves(layouts, is_leaf=is_layout)) * ranks
  itemsize = jnp.dtype(config.compute_dtype).itemsize
  out = {"params": 0, "grads": 0, "optimizer": 0}
  if config.offload_param == "nvme":
    out["params"] = out["grads"] = elems * itemsize
  if config.offload_optimizer == "nvme":
    out["optimizer"] = elems * 12
  return out


def open_store(config, layouts: Any, dp: int, ranks: int) -> AioStore:
  """The process's swap store, after checking the states fit on the drive (before any write)."""
  need = nvme_bytes(config, layouts, dp, ranks)
  store = AioStore(config.nvme_paths, jax.process_index(), io_threads=config.nvme_io_threads,
                   pinned_budget=max(1 << 20, config.pinned_budget // 4), io_nice=config.host_nice)
  store.defer_errors()  # raised after each step: see `checked`
  free = sum(shutil.disk_usage(p).free for p in config.nvme_paths) + store.stats()["bytes_used"]
  total = sum(need.values())
  if total > free:
    store.close()
    gb = lambda n: f"{n / 1e9:.2f} GB"
    raise NoSpaceError(
        f"nvme_path {config.nvme_paths} has {gb(free)} free, but the states placed on NVMe need "
        f"{gb(total)} (params {gb(need['params'])}, grads {gb(need['grads'])}, optimizer "
        f"{gb(need['optimizer'])}): free space there, add folders to nvme_path, or keep some "
        "states off NVMe (offload_param / offload_optimizer).")
  return store


def host_shards(x: jax.Array, mesh) -> dict[int, np.ndarray]:
  """rank -> this process's local shard of `x`, as numpy."""
  devices = list(mesh.devices.reshape(-1))
  return {devices.index(s.device): np.asarray(s.data) for s in x.addressable_shards}


def from_host_shards(shards: dict[int, np.ndarray], sharding: NamedSharding, shape) -> jax.Array:
  """The inverse of `host_shards`: a global array from per-rank numpy shards."""
  devices = list(sharding.mesh.devices.reshape(-1))
  arrays = [jax.device_put(shards[devices.index(d)],
                           jax.sharding.SingleDeviceSharding(d, memory_kind=sharding.memory_kind))
            for d in sharding.addressable_devices]
  return jax.make_array_from_single_device_arrays(shape, sharding, arrays)


def make_engine(engine, *, abstract: bool):
  """`engine` with its swap store, NVMe leaf maps and optimizer pipeline (when used)."""
  import dataclasses
  config, dp = engine.config, engine.dp
  if config.offload_optimizer != "device" and getattr(engine.tx, "hyper", None) is None:
    raise ValueError(
        f"offload_optimizer={config.offload_optimizer!r} runs zinfjax's host AdamW next to the "
        f"states, so it needs tx=zinfjax.optim.adamw(...) (or adam), got {engine.tx!r}. Use "
        "offload_optimizer='device' to train with any optax transformation.")
  if config.offload_optimizer != "device" and engine.tx.offload != "device":
    raise ValueError(
        f"the optimizer tier is set by ZeroConfig.offload_optimizer ({config.offload_optimizer!r});"
        f" build the tx without offload= (got adamw(offload={engine.tx.offload!r})).")
  if not config.uses_nvme or abstract:
    return engine
  ranks = local_ranks(engine.mesh, config.axis)
  store = open_store(config, engine.layouts, dp, len(ranks))
  param_nvme = grad_nvme = pipeline = None
  if config.offload_param == "nvme":
    param_nvme = nvme_leaves(engine.layouts, dp, store.handle, "p", config.compute_dtype)
    grad_nvme = nvme_leaves(engine.layouts, dp, store.handle, "g", config.compute_dtype)
  if config.offload_optimizer == "nvme":
    lays = jax.tree.leaves(engine.layouts, is_leaf=is_layout)
    abstract_master = jax.tree.map(lambda lay: jax.ShapeDtypeStruct(lay.storage_shape, jnp.float32),
                                   engine.layouts, is_leaf=is_layout)
    pipeline = NvmePipeline(
        store, jax.tree.leaves(leaf_names(engine.layouts)), [local_shape(l, dp) for l in lays],
        [l.shape[0] if l.stacked else None for l in lays], ranks, engine.tx.hyper,
        engine.tx.hyper.decays(abstract_master), config.compute_dtype, config.compute_dtype,
        params_on_nvme=config.offload_param == "nvme", grads_on_nvme=config.offload_param == "nvme",
        budget=config.pinned_budget - config.pinned_budget // 4)
  return dataclasses.replace(engine, store=store, param_nvme=param_nvme, grad_nvme=grad_nvme,
                             pipeline=pipeline)


def read_master(engine) -> Any:
  """The fp32 master params from the swap store, as global arrays (one process only)."""
  if jax.process_count() > 1:
    raise NotImplementedError("read_master gathers every rank's shards: single process only.")
  pipeline, dp = engine.pipeline, engine.dp
  out = []
  for i, lay in enumerate(jax.tree.leaves(engine.layouts, is_leaf=is_layout)):
    ranks = []
    for r in range(dp):
      layers = [engine.store.read(shard_key(f"o/master/{pipeline.names[i]}", r, j)).wait()
                for j in range(pipeline.layers[i] or 1)]
      ranks.append(np.stack(layers) if lay.stacked else layers[0])
    out.append(ranks[0] if lay.axis is None else np.concatenate(ranks, axis=lay.axis))
  return jax.tree.unflatten(jax.tree.structure(engine.layouts, is_leaf=is_layout), out)


# -------------------------------------------------------------------- init
def init_states(engine, model_factory, key, *, abstract: bool):
  """(params, master, opt_state) placed as `engine.config` says."""
  from .train import master_initializer
  config, mesh = engine.config, engine.mesh
  storage = engine.storage_specs()
  dtype = config.compute_dtype
  param_kind = tiers.KINDS[config.offload_param]
  params_sh = None if param_kind is None else engine.named(storage, param_kind)
  leaves_abstract = jax.eval_shape(master_initializer(engine, model_factory), key)
  if abstract:
    with_sh = lambda tree, sh, dt=None: jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, dt or a.dtype, sharding=s), tree, sh)
    params = None if params_sh is None else with_sh(leaves_abstract, params_sh, dtype)
    if config.offload_optimizer == "nvme":
      return params, None, HostAdamState(jnp.int32(0), None, None)
    master = with_sh(leaves_abstract, engine.named(storage, tiers.KINDS[config.offload_optimizer]))
    if config.offload_optimizer == "pinned_host":
      return params, master, HostAdamState(jnp.int32(0), master, master)
    from .train import _opt_state_shardings
    opt_init = jax.jit(engine.tx.init, out_shardings=_opt_state_shardings(
        engine, master, engine.named(storage)))
    return params, master, jax.eval_shape(opt_init, master)

  cast = lambda x: x.astype(dtype)
  if not config.uses_nvme:
    master = master_initializer(engine, model_factory)(key)
    params = jax.jit(lambda m: jax.tree.map(cast, m), out_shardings=params_sh)(master)
    if config.offload_optimizer == "pinned_host":
      host = engine.named(storage, "pinned_host")
      master = jax.device_put(master, host)
      zeros = jax.jit(lambda m: jax.tree.map(jnp.zeros_like, m), out_shardings=host)
      return params, master, HostAdamState(_zero_count(mesh), zeros(master), zeros(master))
    return params, master, _device_opt_init(engine, master)

  # NVMe: make the master one leaf at a time (XLA drops the other leaves' init), so host memory
  # holds at most one leaf while the states stream to the swap store
  paths, treedef = jax.tree_util.tree_flatten_with_path(leaves_abstract)
  store_sh = jax.tree.leaves(engine.named(storage))
  param_sh = jax.tree.leaves(params_sh) if params_sh is not None else [None] * len(paths)
  param_nvme = jax.tree.leaves(engine.param_nvme) if engine.param_nvme is not None else None
  masters, params = [], []
  for i, ((path, _), sh) in enumerate(zip(paths, store_sh)):
    make = jax.jit(lambda k, path=path: _at(master_initializer(engine, model_factory)(k), path),
                   out_shardings=sh)
    leaf = make(key)
    if config.offload_optimizer == "nvme":
      engine.pipeline.write_leaf(i, host_shards(leaf, mesh))
      masters.append(None)
    elif config.offload_optimizer == "pinned_host":
      masters.append(jax.device_put(leaf, sh.with_memory_kind("pinned_host")))
    else:
      masters.append(leaf)
    if config.offload_param == "nvme":
      if config.offload_optimizer != "nvme":  # the pipeline wrote them already otherwise
        _write_param_shards(engine.store, param_nvme[i], host_shards(leaf, mesh), dtype)
      params.append(None)
    else:
      params.append(jax.device_put(leaf.astype(dtype), param_sh[i]))
    del leaf
  engine.store.sync()
  unflat = lambda xs: None if all(x is None for x in xs) else jax.tree.unflatten(treedef, xs)
  params, master = unflat(params), unflat(masters)
  if config.offload_optimizer == "nvme":
    return params, None, HostAdamState(_zero_count(mesh), None, None)
  if config.offload_optimizer == "pinned_host":
    zeros = jax.jit(lambda m: jax.tree.map(jnp.zeros_like, m),
                    out_shardings=engine.named(storage, "pinned_host"))
    return params, master, HostAdamState(_zero_count(mesh), zeros(master), zeros(master))
  return params, master, _device_opt_init(engine, master)


def _at(tree: Any, path) -> Any:
  for k in path:
    tree = tree[k.key]
  return tree


def _zero_count(mesh) -> jax.Array:
  return jax.device_put(jnp.zeros((), jnp.int32), NamedSharding(mesh, P()))


def _device_opt_init(engine, master):
  from .train import _opt_state_shardings
  shardings = _opt_state_shardings(engine, master, engine.named(engine.storage_specs()))
  return jax.jit(engine.tx.init, out_shardings=shardings)(master)


def _write_param_shards(store: AioStore, leaf: tiers.NvmeLeaf, shards: dict[int, np.ndarray],
                        dtype) -> None:
  tickets = []
  for rank, shard in shards.items():
    for layer in range(leaf.layers or 1):
      data = shard[layer] if leaf.layers else shard
      tickets.append(store.write(shard_key(leaf.key, rank, layer), np.asarray(data).astype(dtype)))
  for t in tickets:
    t.wait()


# -------------------------------------------------------------------- step
def make_step(state, loss_fn):
  """`(state, batch) -> (state, metrics)` for an offloaded placement."""
  from .train import TrainState, _local_loss_and_grads, shard_batch
  engine = state.engine
  config, mesh, axis = engine.config, engine.mesh, engine.config.axis
  storage = engine.storage_specs()
  nvme_params = config.offload_param == "nvme"
  param_kind = tiers.KINDS[config.offload_param]
  anchor_specs = jax.tree.map(lambda _: P(axis), storage, is_leaf=lambda x: isinstance(x, P))
  grad_specs = anchor_specs if nvme_params else storage
  rep = NamedSharding(mesh, P())

  def grads_of(params, batch):
    """loss, grads (tier arrays, or per-leaf anchors' [token, sumsq]), squared norm."""
    if nvme_params:
      anchor = NamedSharding(mesh, P(axis))
      params = jax.tree.map(lambda _: jax.lax.with_sharding_constraint(
          jnp.zeros((engine.dp,) + ANCHOR[1:], jnp.float32), anchor), storage,
          is_leaf=lambda x: isinstance(x, P))
    fn = jax.shard_map(lambda p, b: _local_loss_and_grads(engine, loss_fn, p, b), mesh=mesh,
                       in_specs=(anchor_specs if nvme_params else storage, P(axis)),
                       out_specs=(P(), grad_specs), check_vma=False)
    loss, grads = fn(params, batch)
    if nvme_params:
      sq = sum(jnp.sum(a[:, 1]) for a in jax.tree.leaves(grads))
    else:
      sq = sum(jnp.sum(jnp.square(tiers.to_device(g, config.offload_param).astype(jnp.float32)))
               for g in jax.tree.leaves(grads))
    return loss, grads, sq

  def read_grads(anchors):
    """Grads written to NVMe in the backward pass, read back after their writes."""
    def body(anchors):
      rank = tiers.rank(axis)
      return jax.tree.map(lambda a, leaf: leaf.read_all(a[0, 0].astype(jnp.int32), rank),
                          anchors, engine.grad_nvme)
    return jax.shard_map(body, mesh=mesh, in_specs=(anchor_specs,), out_specs=storage,
                         check_vma=False)(anchors)

  def write_params(params):
    def body(params):
      rank = tiers.rank(axis)
      tokens = jax.tree.map(lambda x, leaf: leaf.write_all(x, rank), params, engine.param_nvme)
      return sum(jax.tree.leaves(tokens)).reshape(1)
    return jax.shard_map(body, mesh=mesh, in_specs=(storage,), out_specs=P(axis),
                         check_vma=False)(params)

  def place_params(new_params):
    if nvme_params:
      return None, write_params(new_params)
    return new_params, None

  if config.offload_optimizer in ("device", "pinned_host"):
    def step(state, batch):
      loss, grads, sq = grads_of(state.params, batch)
      grads = read_grads(grads) if nvme_params else jax.tree.map(
          lambda g: tiers.to_device(g, config.offload_param), grads)
      if config.offload_optimizer == "device":
        grads32 = jax.tree.map(lambda g: g.astype(jnp.float32), grads)
        updates, opt_state = engine.tx.update(grads32, state.opt_state, state.master)
        master = optax.apply_updates(state.master, updates)
        new_params = jax.tree.map(lambda m: m.astype(config.compute_dtype), master)
      else:
        master, opt_state, new_params = _host_adam_step(engine, state, grads, jnp.sqrt(sq))
      params, token = place_params(new_params)
      metrics = {"loss": loss, "grad_norm": jnp.sqrt(sq)}
      if token is not None:
        metrics["nvme_token"] = jnp.sum(token)
      return TrainState(state.step + 1, params, master, opt_state, engine), metrics

    shardings = jax.tree.map(lambda x: x.sharding, state)
    jitted = jax.jit(step, donate_argnums=(0,), out_shardings=(shardings, rep),
                     in_shardings=(shardings, NamedSharding(mesh, P(axis))))

    def run(state, batch):
      return checked(engine, jitted(state, shard_batch(engine, batch)))

    run.jitted = jitted
    return run

  # optimizer on NVMe: jitted forward/backward, then the host pipeline
  def grad_step(params, batch):
    loss, grads, sq = grads_of(params, batch)
    return loss, grads, jnp.sqrt(sq)

  params_sh = None if nvme_params else jax.tree.map(lambda x: x.sharding, state.params)
  grads_sh = (jax.tree.map(lambda s: NamedSharding(mesh, s), anchor_specs,
                           is_leaf=lambda x: isinstance(x, P)) if nvme_params else params_sh)
  jitted = jax.jit(grad_step, in_shardings=(params_sh, NamedSharding(mesh, P(axis))),
                   out_shardings=(rep, grads_sh, rep))
  pipeline = engine.pipeline
  grad_keys = pipeline.grad_keys()
  clips = engine.tx.hyper.max_grad_norm is not None
  # the pipeline under backward runs on its own thread, below the program's threads in priority
  optimizer_thread = concurrent.futures.ThreadPoolExecutor(
      1, thread_name_prefix="zinfjax-optim", initializer=lower_priority, initargs=(config.host_nice,))

  def run(state, batch):
    t0 = time.perf_counter()
    count = int(state.opt_state.count)
    batch = shard_batch(engine, batch)
    extra = {}
    if not nvme_params or clips:  # the optimizer runs after the program (clipping needs the norm)
      loss, grads, norm = checked(engine, jitted(state.params, batch))
      t1 = time.perf_counter()
      host_grads = None if nvme_params else [host_shards(g, mesh) for g in jax.tree.leaves(grads)]
      del grads
      outs = pipeline.step(count, host_grads, grad_norm=float(norm))
    else:  # grads land on NVMe layer by layer: update each layer while backward goes on below it
      running: list = []
      ended: list[float] = []
      gate = GradGate(engine.store, grad_keys,
                      lambda: bool(ended) or (bool(running) and all(x.is_ready() for x in jax.tree.leaves(running))))
      running.extend(jitted(state.params, batch))  # dispatched; runs while the pipeline waits
      watch = threading.Thread(target=lambda: (jax.block_until_ready(running),
                                               ended.append(time.perf_counter())), daemon=True)
      watch.start()
      outs = optimizer_thread.submit(pipeline.step, count, None, gate).result()
      loss, grads, norm = checked(engine, tuple(running))
      watch.join()
      t1 = ended[0]
      extra["nvme_grad_waits"] = gate.waited
    params = None
    if not nvme_params:
      leaves = [from_host_shards(o, x.sharding, x.shape)
                for o, x in zip(outs, jax.tree.leaves(state.params))]
      params = jax.tree.unflatten(jax.tree.structure(state.params), leaves)
    opt_state = HostAdamState(jax.device_put(jnp.int32(count + 1), rep), None, None)
    new = TrainState(state.step + 1, params, None, opt_state, engine)
    stats = pipeline.last_step
    metrics = {"loss": loss, "grad_norm": norm, "fwd_bwd_s": t1 - t0,
               "optimizer_s": stats["step_s"], "adam_s": stats["compute_s"],
               "nvme_read_wait_s": stats["read_wait_s"], "nvme_write_wait_s": stats["write_wait_s"],
               "nvme_bytes_read": stats["bytes_read"], "nvme_bytes_written": stats["bytes_written"],
               **extra}
    return new, metrics

  run.jitted = jitted
  return run


def lower_priority(nice: int, name: bytes = b"zinfjax-optim") -> None:
  """Name the calling thread (for top -H) and add `nice` to its nice value (Linux: per
  thread; threads it starts, such as the AdamW kernel's, inherit it)."""
  try:
    ctypes.CDLL(None).prctl(15, ctypes.c_char_p(name[:15]), 0, 0, 0)  # PR_SET_NAME
  except (OSError, AttributeError):
    pass
  if nice > 0 and hasattr(os, "setpriority"):
    tid = threading.get_native_id()
    os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + nice))


def checked(engine, outputs):
  """`outputs` once the step is done, raising any error its NVMe transfers recorded."""
  if engine.store is not None:
    jax.block_until_ready(outputs)
    engine.store.raise_deferred()
  return outputs


def _host_adam_step(engine, state, grads, grad_norm):
  """The C++ AdamW on each rank's pinned-host shards, inside the jitted step."""
  config, axis = engine.config, engine.config.axis
  storage = engine.storage_specs()
  hyper = engine.tx.hyper
  clip = clip_scale(grad_norm, hyper.max_grad_norm)
  if clip is not None:
    grads = jax.tree.map(clip, grads)
  decays = hyper.decays(state.master)
  treedef = jax.tree.structure(state.master)

  def body(count, masters, mus, nus, grads):
    m, mu, nu, params = host_update(hyper, decays, count, jax.tree.leaves(masters),
                                    jax.tree.leaves(mus), jax.tree.leaves(nus),
                                    jax.tree.leaves(grads), config.compute_dtype)
    return tuple(jax.tree.unflatten(treedef, x) for x in (m, mu, nu, params))

  count = state.opt_state.count
  master, mu, nu, params = jax.shard_map(
      body, mesh=engine.mesh, in_specs=(P(), storage, storage, storage, storage),
      out_specs=(storage,) * 4, check_vma=False)(count, state.master, state.opt_state.mu,
                                                 state.opt_state.nu, grads)
  return master, HostAdamState(count + 1, mu, nu), params
