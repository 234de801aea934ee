"""`ZeroConfig`: how model states are partitioned and in which precision they train."""

from __future__ import annotations

import dataclasses
from typing import Literal

Precision = Literal["bf16", "fp32"]


@dataclasses.dataclass(frozen=True)
class ZeroConfig:
  """ZeRO settings, validated on construction.

  Attributes:
    stage: 1 partitions the fp32 master params and optimizer state over the
      `data` axis; 2 also the gradients (reduce-scatter instead of all-reduce);
      3 also the compute params, gathered layer by layer just before use.
    precision: "bf16" computes with bf16 params and grads against fp32 master
      params and fp32 optimizer state; "fp32" computes in fp32 (exact tests).
    persistence_threshold: leaves with fewer elements stay replicated (biases,
      layer norms): gathering them costs more latency than it saves memory.
    prefetch_depth: layers gathered ahead of the one computing (0 = none).
    axis: name of the data-parallel mesh axis.
    tiles: memory-centric tiling (stage 3): each large matrix product in a
      block runs as a scan over this many tiles of its weight, each tile's
      shard gathered, used and released in turn (1 = off).
  """

  stage: int = 3
  precision: Precision = "bf16"
  persistence_threshold: int = 0
  prefetch_depth: int = 1
  axis: str = "data"
  tiles: int = 1

  def __post_init__(self):
    if self.stage not in (1, 2, 3):
      raise ValueError(
          f"ZeroConfig.stage must be 1, 2 or 3, got {self.stage!r}. Stage 1 shards "
          "optimizer states, 2 also gradients, 3 also parameters.")
    if self.precision not in ("bf16", "fp32"):
      raise ValueError(
          f"ZeroConfig.precision must be 'bf16' or 'fp32', got {self.precision!r}.")
    if not isinstance(self.persistence_threshold, int) or self.persistence_threshold < 0:
      raise ValueError(
          "ZeroConfig.persistence_threshold must be an int >= 0 (elements), got "
          f"{self.persistence_threshold!r}.")
    if not isinstance(self.prefetch_depth, int) or self.prefetch_depth < 0:
      raise ValueError(
          f"ZeroConfig.prefetch_depth must be an int >= 0, got {self.prefetch_depth!r}.")

    if not isinstance(self.tiles, int) or self.tiles < 1:
      raise ValueError(f"ZeroConfig.tiles must be an int >= 1, got {self.tiles!r}.")
    if self.tiles > 1 and self.stage != 3:
      raise ValueError(
          f"ZeroConfig.tiles={self.tiles} needs stage=3: tiling gathers each weight tile from its "
          "shards, and stages 1 and 2 keep whole params on every device.")

  @property
  def compute_dtype(self):
    import jax.numpy as jnp
    return jnp.bfloat16 if self.precision == "bf16" else jnp.float32

  def replace(self, **changes) -> "ZeroConfig":
    return dataclasses.replace(self, **changes)
