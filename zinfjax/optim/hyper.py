"""AdamW's hyperparameters and the pieces of its math shared by every tier.

`zinfjax.optim.adamw` (the optax-facing transformation) and the engine's
optimizer strategies (device, pinned host, NVMe) take the same `AdamHyper`,
so one AdamW runs wherever its states live.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from .kernel import AdamConstants, bias_corrections


# nnx's names of weight matrices: Linear's and Embed's, LoRA's adapters
MATRIX_NAMES = ("kernel", "embedding", "lora_a", "lora_b")


def decay_matrices(params: Any) -> Any:
  """A weight-decay mask (`mask=` of `adamw`, or optax's): True on the weight matrices (nnx's
  `kernel`, `embedding`, LoRA's `lora_a`, `lora_b`), False on biases and norm scales, as GPT-2
  and Hugging Face's Trainer decay. By name, not by `ndim >= 2`: a `Stack`'s leaves carry the
  layer axis, so its biases and scales are 2-D there."""
  def named(path, _) -> bool:
    keys = [k.key for k in path if isinstance(k, jax.tree_util.DictKey) and isinstance(k.key, str)]
    return bool(keys) and keys[-1] in MATRIX_NAMES
  return jax.tree_util.tree_map_with_path(named, params)


def weight_decays(params: Any, weight_decay: float, mask: Any) -> list[float]:
  """Per leaf of `params`: `weight_decay`, or 0 where `mask` (tree or callable) says no."""
  leaves = jax.tree.leaves(params)
  if mask is None:
    return [float(weight_decay)] * len(leaves)
  flags = jax.tree.leaves(mask(params) if callable(mask) else mask)
  if len(flags) != len(leaves):
    raise ValueError(f"weight decay mask has {len(flags)} leaves but params have {len(leaves)}.")
  return [float(weight_decay) if bool(f) else 0.0 for f in flags]


@dataclasses.dataclass(frozen=True)
class AdamHyper:
  """The hyperparameters of one AdamW, for whichever tier runs it."""

  schedule: Callable[[Any], Any]
  constants: AdamConstants
  weight_decay: float
  mask: Any = None
  max_grad_norm: float | None = None  # clip grads to this global norm first (None: no clipping)
  moment_dtype: Any = np.dtype(np.float32)  # float32, or bfloat16 (stochastic rounding)

  def decays(self, params: Any) -> list[float]:
    return weight_decays(params, self.weight_decay, self.mask)

  def scalars(self, count) -> tuple:
    """(lr, bc1, bc2, step) of the step after `count` steps (count not yet incremented; `step`
    is count + 1, the seed of bf16 moments' rounding)."""
    c = self.constants
    bc1, bc2 = bias_corrections(c.b1, c.b2, count + 1)
    return jnp.asarray(self.schedule(count), jnp.float32), bc1, bc2, jnp.asarray(count + 1, jnp.int32)


def clip_scale(norm, max_norm: float | None):
  """What `optax.clip_by_global_norm(max_norm)` does to grads of global norm `norm`:
  `g` below the limit, else `g / norm * max_norm` (None when there is no limit)."""
  if max_norm is None:
    return None
  return lambda g: jax.lax.select(norm < max_norm, g, (g / norm.astype(g.dtype)) * max_norm)
