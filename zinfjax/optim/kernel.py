"""The fused AdamW kernel from JAX (XLA FFI, CPU) and the identical reference math in jnp.

Both follow optax.adamw operation by operation: moments, bias correction,
`m / (sqrt(v) + eps)`, decoupled weight decay on the fp32 master, then
`master + update * (-lr)`. The jnp version matches optax bit for bit; the
C++ kernel (no fused multiply-adds) agrees to float32 rounding.

Moments may be kept in bf16 (`adamw(moment_dtype="bfloat16")`: 8 optimizer bytes per
parameter instead of 12): they are read exactly, updated in fp32 and stored with
stochastic rounding (`stochastic_bf16`), whose random bits hash each value with the step,
so the jnp and C++ versions round every value the same way.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
from jax.experimental import compute_on as _compute_on
import jax.numpy as jnp
import numpy as np

from .. import _engine, _ffi  # noqa: F401  (_ffi registers the handlers)


@dataclasses.dataclass(frozen=True)
class AdamConstants:
  """Step-independent hyperparameters, as the float32 values optax computes with."""

  b1: float
  b2: float
  eps: float

  @property
  def attrs(self) -> dict:
    f32 = np.float32
    # (1 - b) is computed in Python double precision, then rounded, exactly as optax does.
    return dict(b1=f32(self.b1), one_minus_b1=f32(1 - self.b1), b2=f32(self.b2),
                one_minus_b2=f32(1 - self.b2), eps=f32(self.eps))


def bias_corrections(b1: float, b2: float, count: jax.Array) -> tuple[jax.Array, jax.Array]:
  """`1 - b**count` for both moments, as optax computes them (count already incremented)."""
  return (1 - b1 ** count).astype(jnp.float32), (1 - b2 ** count).astype(jnp.float32)


MOMENT_DTYPES = (np.dtype(np.float32), np.dtype(jnp.bfloat16))


def moment_dtype(dtype: Any) -> np.dtype:
  """`dtype` as one of the moment dtypes (float32, bfloat16), or a clear error."""
  try:
    got = np.dtype(dtype)
  except TypeError:
    got = None
  if got not in MOMENT_DTYPES:
    raise ValueError(f"moment_dtype must be float32 or bfloat16, got {dtype!r}.")
  return got


def _mix32(x: jax.Array) -> jax.Array:
  """A 32-bit integer hash (lowbias32), as the C++ kernel's Mix32."""
  x = x ^ (x >> 16)
  x = x * jnp.uint32(0x7FEB352D)
  x = x ^ (x >> 15)
  x = x * jnp.uint32(0x846CA68B)
  return x ^ (x >> 16)


def moment_seed(step: jax.Array, which: int) -> jax.Array:
  """The rounding seed of step `step` (count after the update) for moment `which` (0: m, 1: v)."""
  step = jnp.asarray(step).astype(jnp.uint32)
  return _mix32(step * jnp.uint32(0x9E3779B9) + jnp.uint32((which * 0x85EBCA6B) & 0xFFFFFFFF)
                + jnp.uint32(1))


def stochastic_bf16(x: jax.Array, seed: jax.Array) -> jax.Array:
  """fp32 -> bf16, rounded up with probability (dropped bits) / 2^16: unbiased, so the second
  moment's 0.1% increments (b2 = 0.999) add up instead of rounding away under bf16's 0.4%
  spacing. The random bits hash the bits the value keeps with `seed` (as the C++ kernel's
  ToBF16Stochastic); non-finite values round to nearest."""
  bits = jax.lax.bitcast_convert_type(x, jnp.uint32)
  up = ((bits + (_mix32((bits >> 16) ^ seed) & jnp.uint32(0xFFFF))) >> 16).astype(jnp.uint16)
  return jnp.where(jnp.isfinite(x), jax.lax.bitcast_convert_type(up, jnp.bfloat16),
                   x.astype(jnp.bfloat16))


def adamw_jnp(master, m, v, grad, lr, bc1, bc2, c: AdamConstants, weight_decay: float,
              step: Any = 0, ok: Any = None):
  """Reference AdamW on one leaf; returns (master, m, v). bf16 moments are updated in fp32 and
  stored with `stochastic_bf16` seeded by `step` (the count after this update).

  `ok` (a scalar bool, optional): where False every state comes back exactly as it was. The
  selections sit inside the update, so a skipped step stays one elementwise pass over the
  states, in place: no branch (XLA:GPU copies every state around a `lax.cond`) and no
  temporaries beyond those of the update alone, on XLA:CPU and XLA:GPU."""
  dtype = m.dtype
  g = grad.astype(jnp.float32)
  old_m, old_v = m.astype(jnp.float32), v.astype(jnp.float32)
  m = (1 - c.b1) * g + c.b1 * old_m
  v = (1 - c.b2) * (g ** 2) + c.b2 * old_v
  if ok is not None:  # the update below then stays finite (a skipped step's grad may not be)
    m, v = jnp.where(ok, m, old_m), jnp.where(ok, v, old_v)
  update = (m / bc1) / (jnp.sqrt(v / bc2 + 0.0) + c.eps)
  if weight_decay:
    update = update + weight_decay * master
  if dtype == jnp.bfloat16:  # a kept bf16 moment rounds back to itself (no bits dropped)
    m, v = stochastic_bf16(m, moment_seed(step, 0)), stochastic_bf16(v, moment_seed(step, 1))
  new = master + update * (-lr)
  return (new if ok is None else jnp.where(ok, new, master)), m, v


def adamw_host(master, m, v, grad, lr, bc1, bc2, c: AdamConstants, weight_decay: float,
               params_dtype, platform: str, apply=True,
               step: Any = 0) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
  """AdamW on one leaf in host memory, inside `on_host`: the fused C++ kernel on CPU
  platforms; elsewhere the same math in jnp. XLA:GPU compiles host code in its own plugin,
  which looks handlers up for its "Host" platform, and jax registers a plugin's handlers for
  its device platform alone (seen on an H200 with jax 0.11.2: the compile stops the process,
  "No FFI handler registered for zinfjax_adamw"). The C++ kernel reaches a GPU run's host
  states through `host_optimizer="pipeline"` instead."""
  if platform == "cpu":
    return adamw_ffi(master, m, v, grad, lr, bc1, bc2, c, weight_decay, params_dtype, apply, step)
  master, m, v = adamw_jnp(master, m, v, grad, lr, bc1, bc2, c, weight_decay, step,
                           None if apply is True else apply)
  return master, m, v, master.astype(params_dtype)


def on_host(out_memory_spaces):
  """A decorator: `f` as one computation on the host CPU (XLA's `device_host`), its outputs in
  the given memory spaces. jax 0.10 spells it `compute_on2(compute_type=, out_memory_spaces=)`;
  jax 0.11 renamed that `compute_on` (the older context manager is gone)."""
  fn = getattr(_compute_on, "compute_on2", None) or _compute_on.compute_on
  return fn(compute_type="device_host", out_memory_spaces=out_memory_spaces)


def adamw_ffi(master, m, v, grad, lr, bc1, bc2, c: AdamConstants, weight_decay: float,
              params_dtype, apply=True,
              step: Any = 0) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
  """The C++ kernel on one leaf; returns (master, m, v, params in `params_dtype`). `apply`
  False (a traced bool) leaves the states as they are (a skipped step); `step` seeds the
  rounding of bf16 moments."""
  like = lambda x: jax.ShapeDtypeStruct(master.shape, x.dtype)
  call = jax.ffi.ffi_call(
      "zinfjax_adamw", (like(master), like(m), like(v), jax.ShapeDtypeStruct(master.shape, params_dtype)),
      input_output_aliases={0: 0, 1: 1, 2: 2}, vmap_method="broadcast_all")
  scalar = lambda x: jnp.asarray(x, jnp.float32).reshape(())
  return call(master, m, v, grad, scalar(lr), scalar(bc1), scalar(bc2),
              jnp.asarray(step, jnp.int32).reshape(()), jnp.asarray(apply, jnp.bool_).reshape(()),
              weight_decay=np.float32(weight_decay), **c.attrs)


def adamw_numpy(master: np.ndarray, m: np.ndarray, v: np.ndarray, grad: np.ndarray,
                params_out: np.ndarray | None, lr: float, bc1: float, bc2: float,
                c: AdamConstants, weight_decay: float, threads: int = 0, step: int = 0,
                sources: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None) -> None:
  """The C++ kernel on host numpy buffers, in place (grad, params_out and both moments may be
  bfloat16; `step` seeds bf16 moments' rounding). With `sources` (master, m, v: another copy,
  apart from the outputs), the states are read from those and written to master, m, v."""
  _engine.adamw(master.reshape(-1), _flat(m), _flat(v), _flat(grad),
                None if params_out is None else _flat(params_out), float(np.float32(lr)),
                weight_decay=float(np.float32(weight_decay)), bc1=float(bc1), bc2=float(bc2),
                threads=threads, seed=int(step) & 0xFFFFFFFF,
                sources=None if sources is None else [_flat(x) for x in sources],
                **_floats(c))


@functools.lru_cache(maxsize=16)
def _floats(c: AdamConstants) -> dict[str, float]:
  """`c.attrs` as Python floats, made once per constants (asked at every kernel call)."""
  return {k: float(x) for k, x in c.attrs.items()}


def _flat(x: np.ndarray) -> np.ndarray:
  x = x.reshape(-1)
  return x.view(np.uint16) if x.dtype.itemsize == 2 else x


def isa() -> str:
  """The instruction set the kernel dispatches to here (avx512, avx2 or generic)."""
  return _engine.adam_isa()
