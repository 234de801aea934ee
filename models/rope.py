"""Rotary position embedding as Hugging Face's Llama family computes it.

The default rope (frequencies `theta ** (-2i / head_dim)`), and the scalings of
`transformers`' `rope_parameters` that are fixed functions of the position, so
training within the model's `max_position_embeddings` is the same function as
`transformers`' forward:
- "llama3" (Llama 3.1): long wavelengths slowed by `factor`, short ones kept,
  the band between interpolated;
- "linear": every frequency slowed by `factor`;
- "yarn" (Qwen2.5's and Qwen3's long-context setting): short wavelengths kept,
  those longer than the pretraining context slowed by `factor`, a linear ramp
  between, and cos and sin scaled by the attention factor (0.1 ln(factor) + 1);
- "dynamic" (NTK): the default frequencies up to `max_position_embeddings`, the
  longest sequence the model runs (it changes them only for longer ones).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

KINDS = ("llama3", "linear", "yarn", "dynamic")


@dataclasses.dataclass(frozen=True)
class RopeScaling:
  """HF's `rope_scaling` (`rope_parameters`) of one of `KINDS`."""

  kind: str
  factor: float
  low_freq_factor: float = 1.0     # llama3: wavelengths past original / low are slowed
  high_freq_factor: float = 4.0    # llama3: wavelengths under original / high are kept
  original_max_position_embeddings: int = 8192   # llama3, yarn: the pretraining context
  beta_fast: float = 32.0          # yarn: dims of more rotations than this are kept
  beta_slow: float = 1.0           # yarn: dims of fewer rotations than this are slowed
  truncate: bool = True            # yarn: the ramp's ends rounded to whole dims
  attention_factor: float | None = None   # yarn: cos, sin scaled (None: 0.1 ln(factor) + 1)

  def __post_init__(self):
    if self.kind not in KINDS:
      raise ValueError(f"RopeScaling.kind {self.kind!r} is none of {KINDS}.")
    if not self.factor > 0:
      raise ValueError(f"RopeScaling.factor must be positive, got {self.factor!r}.")
    if self.kind == "llama3" and not self.high_freq_factor > self.low_freq_factor:
      raise ValueError(f"RopeScaling: high_freq_factor {self.high_freq_factor} must exceed "
                       f"low_freq_factor {self.low_freq_factor}.")
    if self.kind == "yarn" and not self.beta_fast >= self.beta_slow > 0:
      raise ValueError(f"RopeScaling: yarn's beta_fast {self.beta_fast} must be at least "
                       f"beta_slow {self.beta_slow}, and beta_slow positive.")

  @property
  def scale(self) -> float:
    """What cos and sin are multiplied by: yarn's attention factor, 1 for the others."""
    if self.kind != "yarn":
      return 1.0
    return self.attention_factor if self.attention_factor is not None else mscale(self.factor)

  def to_hf(self) -> dict:
    out = {"rope_type": self.kind, "factor": self.factor}
    if self.kind in ("llama3", "yarn"):
      out["original_max_position_embeddings"] = self.original_max_position_embeddings
    if self.kind == "llama3":
      out.update(low_freq_factor=self.low_freq_factor, high_freq_factor=self.high_freq_factor)
    if self.kind == "yarn":
      out.update(beta_fast=self.beta_fast, beta_slow=self.beta_slow)
      out.update({} if self.truncate else {"truncate": False})
      out.update({} if self.attention_factor is None else
                 {"attention_factor": self.attention_factor})
    return out


def mscale(factor: float, m: float = 1.0) -> float:
  """YaRN's attention factor for a context `factor` times longer: 0.1 m ln(factor) + 1."""
  return 0.1 * m * math.log(factor) + 1.0 if factor > 1 else 1.0


def _yarn(inv_freq: jax.Array, head_dim: int, theta: float, s: RopeScaling) -> jax.Array:
  """YaRN's blend: a dim that turns more than `beta_fast` times over the pretraining context
  is kept, fewer than `beta_slow` slowed by `factor`, a linear ramp between."""
  def dim_of(rotations: float) -> float:  # the dim that turns `rotations` times over it
    return head_dim * math.log(s.original_max_position_embeddings
                               / (rotations * 2 * math.pi)) / (2 * math.log(theta))

  low, high = dim_of(s.beta_fast), dim_of(s.beta_slow)
  if s.truncate:
    low, high = math.floor(low), math.ceil(high)
  low, high = max(low, 0), min(high, head_dim - 1)
  high = high + 0.001 if low == high else high
  ramp = jnp.clip((jnp.arange(head_dim // 2, dtype=jnp.float32) - low) / (high - low), 0, 1)
  return inv_freq / s.factor * ramp + inv_freq * (1 - ramp)


def frequencies(head_dim: int, theta: float, scaling: RopeScaling | None = None) -> jax.Array:
  """The `head_dim // 2` inverse frequencies (fp32), scaled as `scaling` says."""
  inv_freq = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
  if scaling is None or scaling.kind == "dynamic":
    return inv_freq
  factor = scaling.factor
  if scaling.kind == "linear":
    return inv_freq / factor
  if scaling.kind == "yarn":
    return _yarn(inv_freq, head_dim, theta, scaling)
  low, high = scaling.low_freq_factor, scaling.high_freq_factor
  original = scaling.original_max_position_embeddings
  wavelength = 2 * math.pi / inv_freq
  slowed = jnp.where(wavelength > original / low, inv_freq / factor, inv_freq)
  smooth = (original / wavelength - low) / (high - low)
  blended = (1 - smooth) * slowed / factor + smooth * slowed
  between = (wavelength >= original / high) & (wavelength <= original / low)
  return jnp.where(between, blended, slowed)


def rotary(x_BxTxHxK: jax.Array, theta: float, scaling: RopeScaling | None = None) -> jax.Array:
  """Rotary position embedding of positions 0..T-1 (HF's `rotate_half` layout)."""
  t, k = x_BxTxHxK.shape[1], x_BxTxHxK.shape[-1]
  inv_freq = frequencies(k, theta, scaling)
  freqs_TxK = jnp.concatenate([jnp.outer(jnp.arange(t, dtype=jnp.float32), inv_freq)] * 2, -1)
  scale = 1.0 if scaling is None else scaling.scale
  cos, sin = (scale * jnp.cos(freqs_TxK))[:, None], (scale * jnp.sin(freqs_TxK))[:, None]
  x = x_BxTxHxK.astype(jnp.float32)
  half = k // 2
  rotated = jnp.concatenate([-x[..., half:], x[..., :half]], -1)
  return (x * cos + rotated * sin).astype(x_BxTxHxK.dtype)
