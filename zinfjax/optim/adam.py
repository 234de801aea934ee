"""Offloaded Adam(W): an optax `GradientTransformation` whose states live on a chosen tier.

    tx = zinfjax.optim.adamw(3e-4, weight_decay=0.1, offload="pinned_host")

is a drop-in for `optax.adamw(3e-4, weight_decay=0.1)`: same hyperparameters
(schedules included), works in `optax.chain` and with `flax.nnx.Optimizer`.
Its state keeps an fp32 master copy of the params and both moments:

* `offload="device"`: states on the device, updated by XLA (jnp).
* `offload="pinned_host"`: states in pinned host memory, updated on the CPU by
  the fused C++ kernel (an XLA custom call on the host, `kernel.on_host`).
* `offload="nvme"`: states in the swap store under `nvme_path`, streamed
  through the CPU in pipelined sub-groups (see `nvme.py`).

The updates it returns make `optax.apply_updates` land exactly on the new
master params rounded to the params' dtype (round to nearest even for bf16).
"""

from __future__ import annotations

import functools
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.experimental import io_callback

from .kernel import AdamConstants, adamw_host, adamw_jnp, bias_corrections, on_host
from .kernel import moment_dtype as moment_dtype_of  # the argument's name is taken
from .nvme import NvmeAdam
from ..partition import key_name
from ..placement import TIERS, Tier
from .hyper import AdamHyper, clip_scale, weight_decays



class OffloadAdamState(NamedTuple):
  """State for the device and pinned_host tiers."""

  count: jax.Array   # int32 steps taken
  master: Any        # fp32 master params
  mu: Any            # first moment (fp32, or bf16 with moment_dtype)
  nu: Any            # second moment (fp32, or bf16 with moment_dtype)


class NvmeAdamState(NamedTuple):
  """State for the NVMe tier: the arrays live in the swap store, only the count here."""

  count: jax.Array


def _check_params(params: Any) -> None:
  for path, leaf in jax.tree_util.tree_leaves_with_path(params):
    if not jnp.issubdtype(jnp.result_type(leaf), jnp.floating):
      raise ValueError(
          f"zinfjax.optim.adamw trains floating-point params, but {jax.tree_util.keystr(path)} "
          f"has dtype {jnp.result_type(leaf)}; keep it out of the optimizer (e.g. nnx.Optimizer("
          "..., wrt=nnx.Param)) or make it a float.")


def _check_structure(tree: Any, shapes: list[tuple[int, ...]], what: str) -> None:
  got = [tuple(jnp.shape(x)) for x in jax.tree.leaves(tree)]
  if got != shapes:
    raise ValueError(
        f"{what} do not match the params the optimizer was initialized with: expected "
        f"{len(shapes)} leaves of shapes {shapes[:6]}{' ...' if len(shapes) > 6 else ''}, got "
        f"{len(got)} leaves of shapes {got[:6]}{' ...' if len(got) > 6 else ''} "
        f"({jax.tree.structure(tree)}). Pass the grads of the same params, in the same order, "
        "that were given to init.")


def _as_updates(new_params: list, params: list) -> list:
  """fp32 updates u with params + u == new_params once rounded to the params' dtype."""
  return [n.astype(p.dtype).astype(jnp.float32) - p.astype(jnp.float32)
          for n, p in zip(new_params, params)]


def adamw(learning_rate: float | Callable[[jax.Array], jax.Array], b1: float = 0.9,
          b2: float = 0.999, eps: float = 1e-8, weight_decay: float = 1e-4,
          mask: Any = None, *, max_grad_norm: float | None = None, offload: str = Tier.DEVICE,
          nvme_path: str | None = None, moment_dtype: Any = jnp.float32,
          sub_group_size: int = 1 << 22, rank: int = 0, threads: int = 0,
          **store_options) -> optax.GradientTransformation:
  """AdamW with decoupled weight decay, states offloaded to `offload`.

  Args:
    learning_rate, b1, b2, eps, weight_decay, mask: as in `optax.adamw`.
    max_grad_norm: clip the grads to this global norm first, like chaining
      `optax.clip_by_global_norm` in front (which a host-tier engine optimizer
      cannot take: it runs this AdamW itself). None: no clipping.
    offload: "device", "pinned_host" or "nvme".
    nvme_path: folder (or folders) for the NVMe tier's swap store.
    moment_dtype: float32, or bfloat16: both moments kept in bf16 (8 optimizer bytes per
      param instead of 12), updated in fp32 and stored with stochastic rounding (unbiased: a
      bf16 second moment rounded to nearest would stop growing once its 0.1% steps fall
      under bf16's 0.4% spacing). Trains like fp32 moments up to that rounding noise
      (`scripts/bench_moments.py` compares the loss curves).
    sub_group_size: elements per NVMe sub-group (host memory: 36 bytes x 3 x this).
    rank: the NVMe store's rank folder (one per process).
    threads: CPU threads for the host kernel (0: all).
    store_options: passed to `zinfjax.offload.AioStore` (block_size, queue_depth, ...).

  Examples:
    >>> import optax, zinfjax
    >>> tx = optax.chain(optax.clip_by_global_norm(1.0),
    ...                  zinfjax.optim.adamw(1e-3, offload="pinned_host"))
  """
  if offload not in TIERS:
    raise ValueError(f"offload must be one of {TIERS}, got {offload!r}.")
  if offload == Tier.NVME and not nvme_path:
    raise ValueError("offload='nvme' needs nvme_path: a folder on a fast local drive.")
  if max_grad_norm is not None and not max_grad_norm > 0:
    raise ValueError(f"max_grad_norm must be positive (or None), got {max_grad_norm!r}.")
  if not isinstance(learning_rate, (int, float)) and not callable(learning_rate):
    raise ValueError(f"learning_rate must be a float or a schedule, got {learning_rate!r}.")
  bad = [f"{name}={v!r} ({want})" for name, v, ok, want in (
      ("b1", b1, 0 <= b1 < 1, "0 <= b1 < 1"), ("b2", b2, 0 <= b2 < 1, "0 <= b2 < 1"),
      ("eps", eps, eps >= 0, ">= 0"), ("weight_decay", weight_decay, weight_decay >= 0, ">= 0"),
      ("learning_rate", learning_rate, callable(learning_rate) or learning_rate >= 0, ">= 0"))
      if not ok]
  if bad:  # each would train without an error, to a wrong answer (b1 >= 1: moments that grow)
    raise ValueError(f"adamw: {', '.join(bad)}; e.g. adamw(3e-4, b1=0.9, b2=0.95, eps=1e-8, "
                     "weight_decay=0.1).")
  constants = AdamConstants(b1, b2, eps)
  moments = moment_dtype_of(moment_dtype)
  schedule = learning_rate if callable(learning_rate) else (lambda _: learning_rate)
  nvme = (NvmeAdam(nvme_path, rank=rank, sub_group_size=sub_group_size, constants=constants,
                   threads=threads, moment_dtype=moments, **store_options)
          if offload == Tier.NVME else None)
  shapes: list[tuple[int, ...]] = []  # of the params given to init

  def init(params):
    _check_params(params)
    leaves = jax.tree.leaves(params)
    shapes[:] = [tuple(jnp.shape(p)) for p in leaves]
    if nvme is not None:
      paths = jax.tree_util.tree_flatten_with_path(params)[0]
      nvme.configure([jnp.shape(p) for p in leaves],
                     ["/".join(key_name(k) for k in path) for path, _ in paths])
      count = io_callback(nvme.host_init, jax.ShapeDtypeStruct((), jnp.int32), *leaves,
                          ordered=True)
      return NvmeAdamState(count)
    master = jax.tree.map(lambda p: jnp.asarray(p, jnp.float32), params)
    zeros = lambda: jax.tree.map(lambda m: jnp.zeros_like(m, moments), master)
    state = OffloadAdamState(jnp.zeros((), jnp.int32), master, zeros(), zeros())
    if offload == Tier.PINNED_HOST:
      state = state._replace(**{k: jax.device_put(getattr(state, k), jax.memory.Space.Host)
                                for k in ("master", "mu", "nu")})
    return state

  def update(grads, state, params=None):
    if params is None:
      raise ValueError("zinfjax.optim.adamw needs params in update(grads, state, params).")
    if not shapes:  # state made elsewhere (e.g. restored): trust the params
      shapes[:] = [tuple(jnp.shape(p)) for p in jax.tree.leaves(params)]
    _check_structure(grads, shapes, "grads")
    _check_structure(params, shapes, "params")
    treedef = jax.tree.structure(params)
    if max_grad_norm is not None:
      grads = jax.tree.map(clip_scale(optax.tree.norm(grads), max_grad_norm), grads)
    count = optax.safe_int32_increment(state.count)
    bc1, bc2 = bias_corrections(b1, b2, count)
    lr = jnp.asarray(schedule(state.count), jnp.float32)
    decays = weight_decays(params, weight_decay, mask)
    g_leaves, p_leaves = jax.tree.leaves(grads), jax.tree.leaves(params)

    if nvme is not None:
      outs = [jax.ShapeDtypeStruct(jnp.shape(p), jnp.result_type(p)) for p in p_leaves]
      host_step = functools.partial(nvme.host_step, decays, [o.dtype for o in outs])
      new_params = io_callback(host_step, outs, lr, bc1, bc2, count, *g_leaves, ordered=True)
      updates = _as_updates(list(new_params), p_leaves)
      return jax.tree.unflatten(treedef, updates), NvmeAdamState(count)

    masters, mus, nus = (jax.tree.leaves(getattr(state, k)) for k in ("master", "mu", "nu"))
    if offload == Tier.PINNED_HOST:
      platform = jax.default_backend()  # the user's jit runs on the default backend
      @on_host(out_memory_spaces=[[jax.memory.Space.Host] * len(masters)] * 4)
      def host_update(masters, mus, nus, grads, lr, bc1, bc2, step):
        out = [adamw_host(*a, lr, bc1, bc2, constants, wd, jnp.result_type(p), platform,
                          step=step) for *a, wd, p in zip(masters, mus, nus, grads, decays, p_leaves)]
        return [list(x) for x in zip(*out)]

      new_m, new_mu, new_nu, new_params = host_update(masters, mus, nus, g_leaves, lr, bc1, bc2,
                                                      count)
      new_m, new_mu, new_nu = (jax.device_put(x, jax.memory.Space.Host)
                               for x in (new_m, new_mu, new_nu))
      new_params = [jax.device_put(x, jax.memory.Space.Device) for x in new_params]
    else:
      out = [adamw_jnp(*a, lr, bc1, bc2, constants, wd, count)
             for *a, wd in zip(masters, mus, nus, g_leaves, decays)]
      new_m, new_mu, new_nu = (list(x) for x in zip(*out))
      new_params = new_m
    updates = jax.tree.unflatten(treedef, _as_updates(new_params, p_leaves))
    like_state = lambda leaves: jax.tree.unflatten(jax.tree.structure(state.master), leaves)
    return updates, OffloadAdamState(count, like_state(new_m), like_state(new_mu), like_state(new_nu))

  hyper = AdamHyper(schedule, constants, float(weight_decay), mask, max_grad_norm, moments)
  return OffloadedTransformation.make(init, update, hyper, offload, nvme)


class OffloadedTransformation(optax.GradientTransformation):
  """An optax `GradientTransformation` (two fields, so `optax.chain` takes it) that also says
  which AdamW it is: `hyper` (what the engine runs itself on the tiers `ZeroConfig` names),
  `offload` (its own tier in a plain Flax loop) and `nvme` (that tier's pipeline, or None)."""

  hyper: AdamHyper
  offload: str
  nvme: NvmeAdam | None

  @classmethod
  def make(cls, init, update, hyper: AdamHyper, offload: str, nvme: NvmeAdam | None):
    tx = cls(init, update)
    tx.hyper, tx.offload, tx.nvme = hyper, offload, nvme
    return tx


def adam(learning_rate, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8, *,
         offload: str = Tier.DEVICE, **options) -> optax.GradientTransformation:
  """Adam (no weight decay) with states offloaded to `offload`; see `adamw`."""
  return adamw(learning_rate, b1, b2, eps, weight_decay=0.0, offload=offload, **options)
