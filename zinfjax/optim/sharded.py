"""AdamW over the engine's sharded states where they live: pinned host or NVMe.

`train_step` uses these when `ZeroConfig.offload_optimizer` is a host tier:

* `host_update` runs inside the step's `shard_map`: each rank's fp32 master
  and moments stay in pinned host memory and the C++ kernel updates them on
  the CPU (an XLA custom call under `compute_on("device_host")`), returning
  the new compute params.
* `NvmePipeline` runs on the host after or under the backward pass: each
  rank's shards of one layer are packed into sub-groups (a few leaves each,
  none larger than the largest shard), streamed through 3 to 8 rotating
  pinned buffer sets (as many as `pinned_budget` holds): while sub-group k
  is updated, the next ones are being read and k-1 written, so NVMe reads,
  the CPU kernel and NVMe writes overlap.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.compute_on import compute_on

from ..offload import tiers
from ..offload.store import AioStore, aligned_empty
from .kernel import AdamConstants, adamw_ffi, adamw_numpy, bias_corrections
from .nvme import SLOTS, run_pipeline

MAX_SLOTS = 8  # NVMe pipeline: up to 6 sub-groups read ahead of the one being updated


@dataclasses.dataclass(frozen=True)
class AdamHyper:
  """The hyperparameters of a `zinfjax.optim.adamw`, for the engine to run it itself."""

  schedule: Callable[[Any], Any]
  constants: AdamConstants
  weight_decay: float
  mask: Any = None
  max_grad_norm: float | None = None  # clip grads to this global norm first (None: no clipping)

  def decays(self, params: Any) -> list[float]:
    from .adam import _weight_decays
    return _weight_decays(params, self.weight_decay, self.mask)

  def scalars(self, count) -> tuple:
    """(lr, bc1, bc2) of the step after `count` steps (count not yet incremented)."""
    c = self.constants
    bc1, bc2 = bias_corrections(c.b1, c.b2, count + 1)
    return jnp.asarray(self.schedule(count), jnp.float32), bc1, bc2


class HostAdamState(NamedTuple):
  """Optimizer state of the engine's host AdamW: moments on pinned host (None on NVMe)."""

  count: jax.Array
  mu: Any
  nu: Any


def clip_scale(norm, max_norm: float | None):
  """What `optax.clip_by_global_norm(max_norm)` does to grads of global norm `norm`:
  `(g, norm, max_norm)` -> `g` below the limit, else `g / norm * max_norm`."""
  if max_norm is None:
    return None
  return lambda g: jax.lax.select(norm < max_norm, g, (g / norm.astype(g.dtype)) * max_norm)


def host_update(hyper: AdamHyper, decays: Sequence[float], count: jax.Array, masters: list,
                mus: list, nus: list, grads: list, params_dtype) -> tuple[list, list, list, list]:
  """One AdamW step on this rank's host-resident shards (call inside `shard_map`).

  Returns the new masters, moments (pinned host) and compute params (device).
  """
  lr, bc1, bc2 = hyper.scalars(count)
  grads = [tiers.to_tier(g, "pinned_host") for g in grads]

  @compute_on("device_host")
  @jax.jit
  def update(masters, mus, nus, grads, lr, bc1, bc2):
    out = [adamw_ffi(m, mu, nu, g, lr, bc1, bc2, hyper.constants, wd, params_dtype)
           for m, mu, nu, g, wd in zip(masters, mus, nus, grads, decays)]
    return [list(x) for x in zip(*out)]

  new_m, new_mu, new_nu, params = update(masters, mus, nus, grads, lr, bc1, bc2)
  host = lambda xs: [tiers.to_tier(x, "pinned_host") for x in xs]
  return host(new_m), host(new_mu), host(new_nu), [tiers.to_device(p, "pinned_host") for p in params]


@dataclasses.dataclass(frozen=True)
class Part:
  """Rank `rank`'s shard of layer `layer` of leaf `leaf`, at `offset` in its sub-group's buffers."""

  leaf: int
  rank: int
  layer: int
  size: int
  offset: int = 0


@dataclasses.dataclass(frozen=True)
class Unit:
  """One sub-group: shards of one rank's layer, moved as one transfer and updated together."""

  parts: tuple[Part, ...]
  size: int  # elements of buffer it takes (parts aligned to ALIGN elements)


ALIGN = 1024  # elements: a part's fp32 buffers start on a 4 KiB boundary (zero-copy transfers)


def pack_units(parts: Sequence[Part], layers: Sequence[int | None]) -> list[Unit]:
  """Consecutive parts of one rank's layer, packed into sub-groups no larger than the largest
  part: the small leaves (biases, norms) ride along instead of costing a transfer each, and
  the buffers stay as large as they were."""
  cap = max((p.size for p in parts), default=0)
  units: list[Unit] = []
  group: list[Part] = []
  used = 0

  def close():
    nonlocal group, used
    if group:
      units.append(Unit(tuple(group), used))
    group, used = [], 0

  for p in parts:
    same = group and (group[0].rank, group[0].layer, layers[group[0].leaf] is None) == (
        p.rank, p.layer, layers[p.leaf] is None)
    start = -(-used // ALIGN) * ALIGN
    if not same or start + p.size > cap:
      close()
      start = 0
    group.append(dataclasses.replace(p, offset=start))
    used = start + p.size
  close()
  return units


def shard_key(base: str, rank: int, layer: int = 0) -> str:
  """The store key the XLA custom calls use for one rank's shard of one layer."""
  return f"{base}/r{rank}/l{layer}"


class NvmePipeline:
  """AdamW over states in the swap store, for the ranks this process owns.

  Args:
    store: the process's swap store.
    names: one key per leaf (e.g. "blocks/block/mlp/fc1/kernel").
    shapes: per leaf, one layer's local shard shape.
    layers: per leaf, its number of layers (None: not stacked).
    ranks: the data-axis positions of this process's devices.
    hyper, decays: AdamW hyperparameters and per-leaf weight decay.
    params_dtype: dtype of the compute params it writes.
    params_on_nvme, grads_on_nvme: where compute params go and grads come from.
    budget: bytes the rotating buffers may take.
  """

  def __init__(self, store: AioStore, names: Sequence[str], shapes: Sequence[tuple[int, ...]],
               layers: Sequence[int | None], ranks: Sequence[int], hyper: AdamHyper,
               decays: Sequence[float], params_dtype, grads_dtype, *, params_on_nvme: bool,
               grads_on_nvme: bool, budget: int, threads: int = 0):
    self.store, self.names, self.hyper, self.decays = store, list(names), hyper, list(decays)
    self.shapes = [tuple(s) for s in shapes]
    self.layers = list(layers)
    self.params_dtype, self.grads_dtype = np.dtype(params_dtype), np.dtype(grads_dtype)
    self.params_on_nvme, self.grads_on_nvme, self.threads = params_on_nvme, grads_on_nvme, threads
    # in the order backward writes the grads: stacked layers from the last one down, then the
    # leaves outside the stacks (their grads come at the end), so the update of a layer can run
    # while backward is still on the layers below it
    parts = [Part(i, r, layer, int(np.prod(shape, dtype=np.int64)))
             for r in ranks for i, shape in enumerate(self.shapes)
             for layer in range(layers[i] or 1)]
    parts = sorted(parts, key=lambda u: (self.layers[u.leaf] is None, -u.layer, u.rank, u.leaf))
    self.units = pack_units(parts, self.layers)
    largest = max((u.size for u in self.units), default=0)
    per_set = largest * (12 + self.params_dtype.itemsize + self.grads_dtype.itemsize)
    if SLOTS * per_set > budget:
      raise ValueError(
          f"the NVMe optimizer needs {SLOTS} buffer sets for its largest sub-group (one rank's "
          f"shard of one layer, {largest:,} elements): {SLOTS * per_set / 2**20:.1f} MiB, more than "
          f"the {budget / 2**20:.1f} MiB of ZeroConfig.pinned_budget left for it. Raise pinned_budget "
          "or split the model over more devices.")
    # more sets where the budget allows: reads run further ahead of the kernel
    self.slots = int(min(MAX_SLOTS, budget // max(per_set, 1)))
    self.pinned_bytes = self.slots * per_set
    self._slots: list[dict[str, np.ndarray]] = []
    self._scalars = jax.jit(hyper.scalars)
    self.last_step: dict[str, float] = {}

  def key(self, what: str, part: Part) -> str:
    return shard_key(f"{what}/{self.names[part.leaf]}", part.rank, part.layer)

  @property
  def parts(self) -> list[Part]:
    return [p for u in self.units for p in u.parts]

  def _slot(self, k: int) -> dict[str, np.ndarray]:
    if not self._slots:
      n = max(u.size for u in self.units)
      self._slots = [{"master": aligned_empty(n, np.float32), "m": aligned_empty(n, np.float32),
                      "v": aligned_empty(n, np.float32), "grad": aligned_empty(n, self.grads_dtype),
                      "param": aligned_empty(n, self.params_dtype)} for _ in range(self.slots)]
    return self._slots[k % self.slots]

  def _views(self, k: int, part: Part) -> dict[str, np.ndarray]:
    """Part `part` of sub-group k's buffers, in its leaf's shape."""
    return {name: buf[part.offset:part.offset + part.size].reshape(self.shapes[part.leaf])
            for name, buf in self._slot(k).items()}

  # ---------------------------------------------------------------- init
  def write_leaf(self, leaf: int, master_shards: dict[int, np.ndarray]) -> None:
    """Store one leaf's fp32 master shards (rank -> local storage shard) with zero moments,
    and its compute params when they live on NVMe."""
    tickets = []
    for rank, shard in master_shards.items():
      shard = np.asarray(shard, np.float32)
      stacked = self.layers[leaf] is not None
      for layer in range(self.layers[leaf] or 1):
        unit = Part(leaf, rank, layer, 0)
        data = np.ascontiguousarray(shard[layer] if stacked else shard)
        zeros = np.zeros_like(data)
        tickets += [self.store.write(self.key("o/master", unit), data),
                    self.store.write(self.key("o/m", unit), zeros),
                    self.store.write(self.key("o/v", unit), zeros)]
        if self.params_on_nvme:
          tickets.append(self.store.write(self.key("p", unit), data.astype(self.params_dtype)))
      for t in tickets:
        t.wait()
      tickets = []

  # ---------------------------------------------------------------- step
  def grad_keys(self) -> list[str]:
    """The swap-store keys of the grads this pipeline reads (when they are on NVMe)."""
    return [self.key("g", p) for p in self.parts] if self.grads_on_nvme else []

  def step(self, count: int, grads: list[dict[int, np.ndarray]] | None,
           gate: "GradGate | None" = None, grad_norm: float | None = None) -> list[dict[int, np.ndarray]]:
    """One AdamW step over every sub-group.

    `grads` (per leaf, rank -> local shard) when they are not on NVMe. With
    `gate`, the grads on NVMe are still being written by a running backward
    pass: each sub-group's grad is read once the gate says it is there.
    `grad_norm` (the global norm of all grads) is needed when the AdamW
    clips (`hyper.max_grad_norm`).
    Returns the new compute params (per leaf, rank -> local shard) unless
    they are written to NVMe (then empty dicts).
    """
    # jitted, like in the step: XLA's compiled pow/schedule can differ from eager by an ulp
    lr, bc1, bc2 = (float(x) for x in self._scalars(jnp.int32(count)))
    c = self.hyper.constants
    clip = self.hyper.max_grad_norm
    if clip is not None and grad_norm is None:
      raise ValueError("this AdamW clips grads (max_grad_norm): pass the step's grad_norm.")
    outs: list[dict[int, np.ndarray]] = [{} for _ in self.names]
    if not self.params_on_nvme:
      for u in self.parts:
        if u.rank not in outs[u.leaf]:
          shape = ((self.layers[u.leaf],) if self.layers[u.leaf] else ()) + self.shapes[u.leaf]
          outs[u.leaf][u.rank] = np.empty(shape, self.params_dtype)
    reading = [("o/master", "master"), ("o/m", "m"), ("o/v", "v")]
    reading += [("g", "grad")] if self.grads_on_nvme else []
    writing = [("o/master", "master"), ("o/m", "m"), ("o/v", "v")]
    writing += [("p", "param")] if self.params_on_nvme else []

    def views(k, names):
      out = []
      for p in self.units[k].parts:
        bufs = self._views(k, p)
        out += [(self.key(what, p), bufs[buf]) for what, buf in names]
      return out

    def read_when_written(key, out):
      gate.wait(key)
      return self.store.read(key, out)

    def start_read(k):
      """One transfer for the sub-group's shards; a grad backward has not written yet is read
      on its own once it is there."""
      now, late = [], []
      for key, out in views(k, reading):
        waits = gate is not None and key.startswith("g/") and not gate.ready(key)
        (late if waits else now).append((key, out))
      return [self.store.read_many(now)] + [
          _Deferred(functools.partial(read_when_written, key, out)) for key, out in late]

    def compute(k):
      for u in self.units[k].parts:
        slot = {name: x.reshape(-1) for name, x in self._views(k, u).items()}
        if self.grads_on_nvme:
          grad = slot["grad"]
        else:
          g = grads[u.leaf][u.rank]
          grad = np.ascontiguousarray(g[u.layer] if self.layers[u.leaf] else g).reshape(-1)
        if clip and grad_norm >= clip:  # as optax.clip_by_global_norm, in the grads' dtype
          grad = ((grad / grad.dtype.type(grad_norm)) * grad.dtype.type(clip)).astype(grad.dtype)
        param = slot["param"] if self.params_on_nvme else (
            outs[u.leaf][u.rank][u.layer] if self.layers[u.leaf] else outs[u.leaf][u.rank]).reshape(-1)
        adamw_numpy(slot["master"], slot["m"], slot["v"], grad, param, lr, bc1, bc2, c,
                    self.decays[u.leaf], self.threads)

    stats = run_pipeline(len(self.units), start_read, compute,
                         lambda k: [self.store.write_many(views(k, writing))], self.slots)
    sizes = {"master": 4, "m": 4, "v": 4, "grad": self.grads_dtype.itemsize,
             "param": self.params_dtype.itemsize}
    stats["bytes_read"] = sum(p.size * sizes[b] for p in self.parts for _, b in reading)
    stats["bytes_written"] = sum(p.size * sizes[b] for p in self.parts for _, b in writing)
    self.last_step = stats
    return outs


class _Deferred:
  """A read that starts when it is first waited on (its data was not written yet)."""

  def __init__(self, start: Callable[[], Any]):
    self._start, self._ticket = start, None

  def wait(self):
    if self._ticket is None:
      self._ticket = self._start()
    return self._ticket.wait()


class GradGate:
  """Tells the NVMe optimizer which grads a running backward pass has written.

  Built just before the step's program is dispatched: each grad key must
  reach one more completed write than it had then. `program_done()` says
  whether the program has finished; a grad still missing after that means
  the program failed to write it, and `wait` raises the engine's recorded
  error instead of waiting forever.
  """

  def __init__(self, store: AioStore, keys: Sequence[str], program_done: Callable[[], bool]):
    self.store, self.program_done = store, program_done
    self.want = {k: store.generation(k) + 1 for k in keys}
    self.waited = 0  # grads the optimizer reached before backward had written them

  def ready(self, key: str) -> bool:
    return self.store.generation(key) >= self.want[key]

  def wait(self, key: str, poll_s: float = 0.5) -> None:
    self.waited += 1
    while not self.store.wait_generation(key, self.want[key], poll_s):
      if self.program_done() and not self.ready(key):
        self.store.raise_deferred()
        raise RuntimeError(f"the step's program finished without writing grad shard {key!r}.")
