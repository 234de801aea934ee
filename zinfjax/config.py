"""`ZeroConfig`: how model states are partitioned and in which precision they train."""

from __future__ import annotations

import dataclasses
import os
from typing import Literal, Sequence

Precision = Literal["bf16", "fp32"]
Tier = Literal["device", "pinned_host", "nvme"]
TIERS = ("device", "pinned_host", "nvme")


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
    offload_param: tier of the compute params (stage 3): "device" (HBM),
      "pinned_host" (host memory, copied to the device layer by layer ahead of
      use) or "nvme" (the swap store under `nvme_path`, read layer by layer).
    offload_grad: tier of the gradients; they are reduce-scattered straight
      into the tier of their params, so it can only be that tier (None: same).
    offload_optimizer: tier of the fp32 master params and optimizer state.
      "device" runs any optax transformation in the step; "pinned_host" runs
      zinfjax's C++ AdamW on the host next to its states; "nvme" streams them
      through host buffers in pipelined sub-groups. The host tiers need
      `tx=zinfjax.optim.adamw(...)` (or `adam`).
    nvme_path: folder (or folders, striped) of the swap store; created if
      missing. Each process keeps its files in `nvme_path/rank{process}/`.
    pinned_budget: bytes of pinned host buffers for NVMe transfers (staging
      pool and the optimizer's rotating sub-group buffers).
    nvme_prefetch_depth: layers read from NVMe ahead of the device prefetch:
      while layer i computes, layer i+prefetch_depth is copied to the device and
      layers up to i+prefetch_depth+nvme_prefetch_depth are being read.
    offload_activations: keep each block's activation checkpoint in pinned
      host memory between the forward and backward pass.
    nvme_io_threads: shards the swap store moves at once. Each shard (one
      rank's piece of one layer) is often a single I/O block, so this is the
      drive's queue depth for the step's many small transfers.
    host_nice: added to the nice value of zinfjax's background host threads
      (the NVMe optimizer pipeline and the swap store's I/O threads), so the
      threads running the XLA program keep the CPU first: on XLA:CPU they
      are the compute itself, on a GPU they launch it. 0 = same priority.
  """

  stage: int = 3
  precision: Precision = "bf16"
  persistence_threshold: int = 0
  prefetch_depth: int = 1
  axis: str = "data"
  tiles: int = 1
  offload_param: Tier = "device"
  offload_grad: Tier | None = None
  offload_optimizer: Tier = "device"
  nvme_path: str | Sequence[str] | None = None
  pinned_budget: int = 256 << 20
  nvme_prefetch_depth: int = 1
  offload_activations: bool = False
  nvme_io_threads: int = 4
  host_nice: int = 5

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
    self._check_offload()

  def _check_offload(self) -> None:
    for name in ("offload_param", "offload_optimizer"):
      if getattr(self, name) not in TIERS:
        raise ValueError(f"ZeroConfig.{name} must be one of {TIERS}, got {getattr(self, name)!r}.")
    if self.offload_grad not in (None, self.offload_param):
      raise ValueError(
          f"ZeroConfig.offload_grad={self.offload_grad!r} differs from offload_param="
          f"{self.offload_param!r}: gradients are reduce-scattered straight into the tier of their "
          "params. Leave offload_grad unset (or equal to offload_param).")
    if self.offloads and self.stage != 3:
      raise ValueError(
          f"offloading (offload_param={self.offload_param!r}, offload_optimizer="
          f"{self.offload_optimizer!r}, offload_activations={self.offload_activations}) needs "
          f"stage=3, got stage={self.stage}: zinfjax moves each rank's 1/dp shard of every state "
          "between tiers, and stages 1 and 2 keep whole params on every device.")
    if self.uses_nvme and not self.nvme_path:
      raise ValueError(
          "a state is placed on 'nvme' but ZeroConfig.nvme_path is not set: give a folder on a "
          "fast local drive, e.g. ZeroConfig(..., nvme_path='/local_nvme/zinfjax').")
    if self.nvme_path is not None:
      paths = [self.nvme_path] if isinstance(self.nvme_path, (str, os.PathLike)) else list(self.nvme_path)
      if not paths or not all(isinstance(p, (str, os.PathLike)) and str(p) for p in paths):
        raise ValueError(f"ZeroConfig.nvme_path must be a folder or a list of folders, got {self.nvme_path!r}.")
    if not isinstance(self.pinned_budget, int) or self.pinned_budget < (1 << 20):
      raise ValueError(f"ZeroConfig.pinned_budget must be an int of at least 1 MiB (bytes), got "
                       f"{self.pinned_budget!r}.")
    if not isinstance(self.nvme_prefetch_depth, int) or self.nvme_prefetch_depth < 0:
      raise ValueError("ZeroConfig.nvme_prefetch_depth must be an int >= 0, got "
                       f"{self.nvme_prefetch_depth!r}.")
    if not isinstance(self.nvme_io_threads, int) or not 1 <= self.nvme_io_threads <= 64:
      raise ValueError("ZeroConfig.nvme_io_threads must be an int from 1 to 64, got "
                       f"{self.nvme_io_threads!r}.")
    if not isinstance(self.host_nice, int) or not 0 <= self.host_nice <= 19:
      raise ValueError(f"ZeroConfig.host_nice must be an int from 0 to 19, got {self.host_nice!r}.")

  @property
  def grad_tier(self) -> str:
    return self.offload_param

  @property
  def offloads(self) -> bool:
    """Whether any state leaves the device (or activations go to the host)."""
    return (self.offload_param != "device" or self.offload_optimizer != "device"
            or self.offload_activations)

  @property
  def uses_nvme(self) -> bool:
    return "nvme" in (self.offload_param, self.offload_optimizer)

  @property
  def nvme_paths(self) -> list[str]:
    if self.nvme_path is None:
      return []
    if isinstance(self.nvme_path, (str, os.PathLike)):
      return [os.fspath(self.nvme_path)]
    return [os.fspath(p) for p in self.nvme_path]

  @property
  def compute_dtype(self):
    import jax.numpy as jnp
    return jnp.bfloat16 if self.precision == "bf16" else jnp.float32

  def replace(self, **changes) -> "ZeroConfig":
    return dataclasses.replace(self, **changes)
