"""Rotary position embedding as Hugging Face's Llama family computes it.

The default rope (frequencies `theta ** (-2i / head_dim)`), and the two scalings
that change only the frequencies, so training within the model's
`max_position_embeddings` is the same function as `transformers`' forward:
Llama 3.1's frequency-dependent one (`rope_type: "llama3"`: long wavelengths
slowed by `factor`, short ones kept, the band between interpolated) and the
linear one (every frequency slowed by `factor`).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

KINDS = ("llama3", "linear")


@dataclasses.dataclass(frozen=True)
class RopeScaling:
  """HF's `rope_scaling` (`rope_parameters`) of kind "llama3" or "linear"."""

  kind: str
  factor: float
  low_freq_factor: float = 1.0     # llama3: wavelengths past original / low are slowed
  high_freq_factor: float = 4.0    # llama3: wavelengths under original / high are kept
  original_max_position_embeddings: int = 8192

  def __post_init__(self):
    if self.kind not in KINDS:
      raise ValueError(f"RopeScaling.kind {self.kind!r} is none of {KINDS}.")
    if not self.factor > 0:
      raise ValueError(f"RopeScaling.factor must be positive, got {self.factor!r}.")
    if self.kind == "llama3" and not self.high_freq_factor > self.low_freq_factor:
      raise ValueError(f"RopeScaling: high_freq_factor {self.high_freq_factor} must exceed "
                       f"low_freq_factor {self.low_freq_factor}.")

  def to_hf(self) -> dict:
    out = {"rope_type": self.kind, "factor": self.factor}
    if self.kind == "llama3":
      out.update(low_freq_factor=self.low_freq_factor, high_freq_factor=self.high_freq_factor,
                 original_max_position_embeddings=self.original_max_position_embeddings)
    return out


def frequencies(head_dim: int, theta: float, scaling: RopeScaling | None = None) -> jax.Array:
  """The `head_dim // 2` inverse frequencies (fp32), scaled as `scaling` says."""
  inv_freq = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
  if scaling is None:
    return inv_freq
  factor = scaling.factor
  if scaling.kind == "linear":
    return inv_freq / factor
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
  cos, sin = jnp.cos(freqs_TxK)[:, None], jnp.sin(freqs_TxK)[:, None]
  x = x_BxTxHxK.astype(jnp.float32)
  half = k // 2
  rotated = jnp.concatenate([-x[..., half:], x[..., :half]], -1)
  return (x * cos + rotated * sin).astype(x_BxTxHxK.dtype)
