"""`ZeroConfig`: how model states are partitioned and in which precision they train."""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Literal, Mapping, Sequence

from .tier import TIERS, Tier, TierSplit, parse_split, split_tiers  # noqa: F401

Precision = Literal["bf16", "fp32"]
# who updates the optimizer states in pinned host (`ZeroConfig.host_optimizer`)
HOST_OPTIMIZERS = ("auto", "xla", "pipeline", "stream")


def host_pipeline_applies(host_optimizer: str, param_tiers: Sequence[str],
                          optimizer_tiers: Sequence[str]) -> bool:
  """Whether `host_optimizer` puts the pinned-host states in the RAM store (see
  `ZeroConfig.with_host_pipeline`): it is "pipeline", an optimizer state is off the device, and
  some state is in pinned host."""
  return (host_optimizer == "pipeline" and bool({Tier.PINNED_HOST, Tier.NVME} & set(optimizer_tiers))
          and Tier.PINNED_HOST in (*param_tiers, *optimizer_tiers))


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
    offload: "auto" chooses `offload_param` and `offload_optimizer` per layer
      from `tier_budgets` before anything is allocated (`zinfjax.autoplace`):
      the fastest tiers to the params and grads, then to the optimizer
      states; a model that cannot fit is refused, naming each tier's
      shortfall. None (default): the tiers given below.
    tier_budgets: with offload="auto", bytes each device may hold on each tier
      ({"device": ..., "pinned_host": ..., "nvme": ...}); a tier left out takes
      its default: half the device's free memory (none on a CPU platform), half
      the host's available memory, and the free space under `nvme_path`, each
      split over the process's devices.
    offload_param: tier of the compute params (stage 3): "device" (HBM),
      "pinned_host" (host memory, copied to the device layer by layer ahead of
      use) or "nvme" (the swap store under `nvme_path`, read layer by layer);
      or a per-layer split (see below).
    offload_grad: tier of the gradients; they are reduce-scattered straight
      into the tier of their params, so it can only be that tier (None: same).
    offload_optimizer: tier of the fp32 master params and optimizer state.
      "device" runs any optax transformation in the step; "pinned_host" runs
      zinfjax's C++ AdamW on the host next to its states; "nvme" streams them
      through host buffers in pipelined sub-groups; or a per-layer split.
      Anything but "device" needs `tx=zinfjax.optim.adamw(...)` (or `adam`).

  A per-layer split puts the first layers of every `Stack` on one tier and
  the next ones on another: "device:2,pinned_host" (the first 2 layers on
  device, the rest in pinned host), "pinned_host:0.25,nvme" (the first
  quarter in pinned host, the rest on NVMe), "device:1,pinned_host:2,nvme";
  or the same as a dict, `{"pinned_host": 0.25, "nvme": None}`. An int is a
  layer count, a float a fraction of each stack's layers, and the last tier
  takes the rest. Leaves outside the stacks (embeddings, final norm) live on
  the first tier named.
    nvme_path: folder (or folders, striped) of the swap store; created if
      missing. Each process keeps its files in `nvme_path/rank{process}/`.
    pinned_budget: bytes of pinned host buffers for NVMe transfers (staging
      pool and the optimizer's rotating sub-group buffers). The host pipeline's
      RAM store keeps the buffers a step's transfers borrow where they borrow
      any (about three layers of params and grads, `Plan.lent_bytes`) even
      beyond it.
    nvme_prefetch_depth: layers read from NVMe ahead of the device prefetch:
      while layer i computes, layer i+prefetch_depth is copied to the device and
      layers up to i+prefetch_depth+nvme_prefetch_depth are being read.
    offload_activations: keep each block's activation checkpoint in pinned
      host memory between the forward and backward pass.
    layer_residuals: what the ZeRO-3 layer scan keeps for backward.
      "recompute": each layer's input only; backward runs the block again
      (least memory, a third more compute). "save": every layer's residuals
      (the block's activations; its params are gathered again, never kept),
      no recompute. "dots": only its matrix products' outputs; backward
      recomputes the elementwise rest and attention's forward from them
      (about a fifth of "save"'s bytes and less HBM traffic, 1% more
      products). "auto" (default): "dots" where one stack's fit
      `residual_budget`, else recompute. Saving needs tiles=1,
      micro_batches=1 and offload_activations=False; otherwise it recomputes.
    residual_budget: bytes one stack's saved residuals may take under "auto"
      (a stack split over tiers runs a scan per tier, each with its layers'
      share);
      None: half of what the device's model states leave of its memory
      limit where the platform reports one, else 0 (recompute; XLA:CPU
      reports none).
    nvme_atomic_steps: a step is all or nothing on NVMe: the params and
      optimizer states it rewrites there go to fresh extents, committed when
      the step ends; a step that fails (an I/O error, a corrupted shard)
      rolls them back to the previous step's. Costs a second copy of those
      states' space on the drive (reserved at init); False rewrites in place.
    nvme_io_threads: shards the swap store moves at once. Each shard (one
      rank's piece of one layer) is often a single I/O block, so this is the
      drive's queue depth for the step's many small transfers.
    ordered_collectives: issue the step's collectives one at a time in program
      order, the same on every device (`zinfjax.ordering`). None (default):
      on where devices run independent operations concurrently and share a
      thread pool (XLA:CPU), where collectives reached in different orders
      deadlock; off on GPUs, whose streams already give one order.
    trainable: which params train, as an nnx filter (like `nnx.Optimizer(...,
      wrt=...)`): e.g. `nnx.LoRAParam` for LoRA adapters, or a function
      `(path, variable) -> bool`. The others are frozen: they keep their
      compute params on their tier and no grads, fp32 master or optimizer
      state anywhere (stage 3). None (default): every `nnx.Param`.
    micro_batches: each `Stack` runs the batch as this many micro-batches,
      all of them through one layer before the next (layer-major gradient
      accumulation): a layer's params move between tiers and are gathered
      once per pass whatever the count, and a block's temporaries are those
      of one micro-batch. The batch per device must be a multiple of it.
      Layers outside the stacks (embeddings, head, loss) see the whole batch.
    skip_nonfinite: a step whose gradients hold a NaN or an infinity (a
      non-finite global norm) changes nothing: params, master params and
      optimizer states (its count included) stay as they were, and the
      step's metrics say `skipped` = 1. On NVMe this rests on all-or-nothing
      steps (`nvme_atomic_steps`). False applies the update whatever it holds.
    host_optimizer: who updates the optimizer states placed in pinned host
      memory. "auto" (the default): "pipeline" on a GPU with zinfjax's CUDA
      handlers (on an H200 its step ran 1.5-1.9x faster than "xla"'s, at half
      the RAM) and with `delay_update` or `host_atomic_steps`, which only it
      does; "xla" elsewhere (`for_platform`). "xla": the step's program,
      in XLA's host computation. "stream": the step's program on the device, after
      backward, a layer at a time: each layer's master and moments cross to
      the device and back (twice their bytes over the host link per step, no
      CPU work, one layer's states in device memory at a time); needs
      zinfjax's AdamW. "pipeline": pinned host becomes the NVMe tier without the
      drive: every pinned-host state (params, grads, master params, moments)
      lives in a swap store in host RAM; backward writes each layer's grads
      there and the host pipeline (the C++ AdamW on host threads) updates
      master, moments and params where the store keeps them, with no copies.
      With skip_nonfinite=False and no clipping, each layer is updated while
      backward runs on the layers below it; otherwise after backward (or under
      it too, with `host_atomic_steps`). Needs zinfjax's AdamW; its steps are
      not all-or-nothing (as with "xla") unless `host_atomic_steps`. With
      states on NVMe as well (e.g. params in pinned host, the optimizer on
      NVMe, or a per-layer split of both), each shard lives in the store of
      its tier, RAM's or the drive's, and one pipeline updates them all (the
      RAM shards in place, the drive's streamed through its buffers); steps
      are then all or nothing over both stores as `nvme_atomic_steps` says
      (its copies in RAM too: read from the committed copy, written to the new).
    host_atomic_steps: with host_optimizer="pipeline", steps are all or nothing
      in the RAM store as on NVMe (`nvme_atomic_steps`): each step writes new
      copies of the params and optimizer states it updates (twice their RAM; the
      update reads the old copy and writes the new, no copy made), so the update runs under backward
      with clipping and skip_nonfinite as well, rolled back and redone when the
      global norm turns out to need it.
    delay_update: which updates the host pipeline (optimizer states on NVMe,
      or in pinned host with host_optimizer="pipeline") makes one step late.
      "tail": the leaves backward reaches last, those outside the stacks (the
      embedding, the final norm, an untied head): their grads are held and
      applied (with their own step's count and clipping) while the next
      step's forward runs, so no step waits for their update after backward.
      "all": every part the pipeline updates (ZeRO-Offload's delayed
      parameter update): the update with the grads held from the step before
      runs on the host while the step's whole program runs, so the host's
      AdamW hides behind forward and backward, with nothing speculative (the
      held grads' norm is known, clipping and skip_nonfinite need no redo);
      it holds a copy of those grads and of the new params in host RAM
      between steps (a RAM store alone keeps a second buffer of each, and the
      two trade places after each step: no copy). The trade: those params see
      each step's grads one step later (the first step leaves them as they
      were; checkpoints keep the held grads, and a run resumed with the same
      delay applies them, as `zinfjax.flush_updates` does before an export).
      "none" (default): no delay.
      With offload="auto", a placement that keeps every optimizer state on
      the device has nothing to delay: it runs as "none" (any other
      placement without the host pipeline is refused).
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
  offload: str | None = None
  tier_budgets: Mapping[str, int] | None = None
  offload_param: Tier | str | Mapping = Tier.DEVICE
  offload_grad: Tier | str | Mapping | None = None
  offload_optimizer: Tier | str | Mapping = Tier.DEVICE
  nvme_path: str | Sequence[str] | None = None
  pinned_budget: int = 256 << 20
  nvme_prefetch_depth: int = 1
  offload_activations: bool = False
  nvme_io_threads: int = 4
  nvme_atomic_steps: bool = True
  ordered_collectives: bool | None = None
  trainable: Any = None
  host_nice: int = 5
  micro_batches: int = 1
  layer_residuals: str = "auto"
  residual_budget: int | None = None
  skip_nonfinite: bool = True
  host_optimizer: str = "auto"
  host_atomic_steps: bool = False
  delay_update: str = "none"

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
    if self.layer_residuals not in ("recompute", "save", "dots", "auto"):
      raise ValueError(f"ZeroConfig.layer_residuals must be 'recompute', 'save', 'dots' or "
                       f"'auto', got {self.layer_residuals!r}.")
    if self.residual_budget is not None and not (
        isinstance(self.residual_budget, int) and self.residual_budget >= 0):
      raise ValueError(f"ZeroConfig.residual_budget must be bytes (an int >= 0) or None, got "
                       f"{self.residual_budget!r}.")
    if not isinstance(self.micro_batches, int) or isinstance(self.micro_batches, bool) or \
        self.micro_batches < 1:
      raise ValueError(f"ZeroConfig.micro_batches must be an int >= 1, got {self.micro_batches!r}.")
    if self.tiles > 1 and self.stage != 3:
      raise ValueError(
          f"ZeroConfig.tiles={self.tiles} needs stage=3: tiling gathers each weight tile from its "
          "shards, and stages 1 and 2 keep whole params on every device.")
    self._check_offload()

  def _check_offload(self) -> None:
    if self.offload not in (None, "auto"):
      raise ValueError(f"ZeroConfig.offload must be None or 'auto', got {self.offload!r}.")
    if self.offload == "auto" and (self.offload_param, self.offload_optimizer) != (
        Tier.DEVICE, Tier.DEVICE):
      raise ValueError(
          f"ZeroConfig(offload='auto') chooses offload_param and offload_optimizer itself; got "
          f"offload_param={self.offload_param!r}, offload_optimizer={self.offload_optimizer!r}: "
          "give either offload='auto' (with tier_budgets) or the tiers.")
    if self.offload == "auto" and self.stage != 3:
      raise ValueError(f"ZeroConfig(offload='auto') needs stage=3, got stage={self.stage}.")
    budgets = self.tier_budgets
    if budgets is not None and (self.offload != "auto" or not isinstance(budgets, Mapping) or any(
        t not in TIERS or not isinstance(b, int) or isinstance(b, bool) or b < 0
        for t, b in budgets.items())):
      raise ValueError(
          f"ZeroConfig.tier_budgets={budgets!r}: with offload='auto', give bytes per device (int "
          f">= 0) for any of {TIERS}, e.g. tier_budgets={{'device': 8 << 30}}.")
    for name in ("offload_param", "offload_optimizer"):
      parse_split(getattr(self, name), name)
    if self.offload_grad is not None and parse_split(self.offload_grad, "offload_grad") != self.param_split:
      raise ValueError(
          f"ZeroConfig.offload_grad={self.offload_grad!r} differs from offload_param="
          f"{self.offload_param!r}: gradients are reduce-scattered straight into the tier of their "
          "params. Leave offload_grad unset (or equal to offload_param).")
    if self.offloads and self.stage != 3:
      raise ValueError(
          f"offloading (offload_param={self.offload_param!r}, offload_optimizer="
          f"{self.offload_optimizer!r}, offload_activations={self.offload_activations}) needs "
          f"stage=3, got stage={self.stage}: zinfjax moves each rank's 1/dp shard of every state "
          "between tiers, and stages 1 and 2 keep whole params on every device. ZeRO-Offload's "
          "setup (params on the device, the optimizer on the host) is stage=3 with "
          "offload_param='device' (the default).")
    if self.host_optimizer not in HOST_OPTIMIZERS:
      raise ValueError(f"ZeroConfig.host_optimizer must be one of {', '.join(map(repr, HOST_OPTIMIZERS))}, "
                       f"got {self.host_optimizer!r}.")
    if self.host_store and self.host_optimizer != "pipeline":
      raise ValueError(
          f"ZeroConfig: the tier {Tier.HOST_STORE.value!r} is pinned host as host_optimizer="
          "'pipeline' keeps it, made by with_host_pipeline(); name 'pinned_host' and set "
          "host_optimizer='pipeline' instead.")
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
    if not isinstance(self.skip_nonfinite, bool):
      raise ValueError(f"ZeroConfig.skip_nonfinite must be True or False, got {self.skip_nonfinite!r}.")
    if not isinstance(self.host_atomic_steps, bool):
      raise ValueError(f"ZeroConfig.host_atomic_steps must be True or False, got "
                       f"{self.host_atomic_steps!r}.")
    if self.host_atomic_steps and self.host_optimizer in ("xla", "stream"):
      raise ValueError(f"ZeroConfig.host_atomic_steps=True is for the host pipeline, but host_"
                       f"optimizer={self.host_optimizer!r} updates in the step's program: set "
                       "host_optimizer='pipeline' (or 'auto'), or drop host_atomic_steps.")
    if self.delay_update not in ("none", "tail", "all"):
      raise ValueError(f"ZeroConfig.delay_update must be 'none', 'tail' or 'all', got "
                       f"{self.delay_update!r}.")
    if not isinstance(self.nvme_atomic_steps, bool):
      raise ValueError("ZeroConfig.nvme_atomic_steps must be True or False, got "
                       f"{self.nvme_atomic_steps!r}.")
    if not isinstance(self.nvme_prefetch_depth, int) or self.nvme_prefetch_depth < 0:
      raise ValueError("ZeroConfig.nvme_prefetch_depth must be an int >= 0, got "
                       f"{self.nvme_prefetch_depth!r}.")
    if not isinstance(self.nvme_io_threads, int) or not 1 <= self.nvme_io_threads <= 64:
      raise ValueError("ZeroConfig.nvme_io_threads must be an int from 1 to 64, got "
                       f"{self.nvme_io_threads!r}.")
    if self.ordered_collectives not in (None, True, False):
      raise ValueError("ZeroConfig.ordered_collectives must be None (auto), True or False, got "
                       f"{self.ordered_collectives!r}.")
    if not isinstance(self.host_nice, int) or not 0 <= self.host_nice <= 19:
      raise ValueError(f"ZeroConfig.host_nice must be an int from 0 to 19, got {self.host_nice!r}.")

  @property
  def param_split(self) -> TierSplit:
    """Tiers of the compute params (and grads) per layer, e.g. (("device", 2), ("pinned_host", None))."""
    return parse_split(self.offload_param, "offload_param")

  @property
  def optimizer_split(self) -> TierSplit:
    """Tiers of the fp32 master params and optimizer states per layer."""
    return parse_split(self.offload_optimizer, "offload_optimizer")

  @property
  def offloads(self) -> bool:
    """Whether any state leaves the device (or activations go to the host)."""
    tiers = split_tiers(self.param_split) + split_tiers(self.optimizer_split)
    return set(tiers) != {Tier.DEVICE} or self.offload_activations or self.offload == "auto"

  @property
  def uses_nvme(self) -> bool:
    return Tier.NVME in split_tiers(self.param_split) + split_tiers(self.optimizer_split)

  @property
  def host_store(self) -> bool:
    """Whether a state is in the swap store in host RAM (`with_host_pipeline`)."""
    return Tier.HOST_STORE in split_tiers(self.param_split) + split_tiers(self.optimizer_split)

  def for_platform(self, platform: str, cuda_handlers: bool) -> "ZeroConfig":
    """The config with host_optimizer="auto" settled for the mesh's `platform`: "pipeline" on a
    GPU where zinfjax's CUDA handlers are built (the C++ AdamW on host threads beside the
    step, instead of XLA:GPU's host computation), and wherever the config asks for what only
    the pipeline does (`delay_update`, `host_atomic_steps`); else "xla" (on XLA:CPU the host
    computation is the program's own). Other values are kept."""
    if self.host_optimizer != "auto":
      return self
    pipeline = (platform in ("gpu", "cuda") and cuda_handlers or self.delay_update != "none"
                or self.host_atomic_steps)
    return self.replace(host_optimizer="pipeline" if pipeline else "xla")

  def with_host_pipeline(self) -> "ZeroConfig":
    """The config the engine plans with: under host_optimizer="pipeline", with an optimizer
    state off the device, every pinned-host segment (params and their grads, master params and
    moments) becomes a segment of the swap store in host RAM (`Tier.HOST_STORE`), which the
    step and the host pipeline use as they use the drive's. Steps are all or nothing as
    `nvme_atomic_steps` says where a state is on the drive too (one transaction over both
    stores), else as `host_atomic_steps` says. Otherwise itself."""
    if self.host_store or not host_pipeline_applies(
        self.host_optimizer, split_tiers(self.param_split), split_tiers(self.optimizer_split)):
      return self
    to_store = lambda split: tuple((Tier.HOST_STORE if t is Tier.PINNED_HOST else t, a)
                                   for t, a in split)
    atomic = self.nvme_atomic_steps if self.uses_nvme else self.host_atomic_steps
    return self.replace(offload_optimizer=to_store(self.optimizer_split),
                        offload_param=to_store(self.param_split), offload_grad=None,
                        nvme_atomic_steps=atomic)

  @property
  def uses_store(self) -> bool:
    """Whether a state lives in a swap store (on the drive, or in host RAM)."""
    return self.uses_nvme or self.host_store

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
