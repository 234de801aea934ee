"""The ZeRO-Infinity memory model (paper, section 3): estimate before you run.

Bytes per parameter in mixed precision with Adam: 2 (bf16 params) + 2 (bf16
grads) + 16 (fp32 master, momentum, variance and gradient) = 20. A transformer
has about 12·nl·hd² parameters. Under ZeRO stage s the optimizer states
(s >= 1), gradients (s >= 2) and parameters (s = 3) are split over the
data-parallel devices; each state lives on its own tier.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, NamedTuple

import jax
from flax import nnx

from .config import host_pipeline_applies
from .layers import stack_paths
from .placement import TIERS, Tier

PARAM_BYTES, GRAD_BYTES, OPTIMIZER_BYTES = 2, 2, 16
# zinfjax's AdamW keeps 12 of the paper's 16 optimizer bytes: the fp32 master and moments (the
# fp32 grad is a transient of the update, in its buffers, not a state)
STATE_BYTES = {"params": PARAM_BYTES, "grads": GRAD_BYTES, "optimizer": 12}
# with adamw(moment_dtype="bfloat16"): the fp32 master and two bf16 moments
BF16_MOMENTS_OPTIMIZER_BYTES = 8
# `ZeroConfig.delay_update`'s host arrays per delayed param: its held grads twice (the ones
# applied and the step's own, copied out of the store as backward writes them) and its new
# params; in a RAM store alone, the grads once (in their twins, `optim.pipeline.TWIN`)
DELAY_BYTES = 2 * GRAD_BYTES + PARAM_BYTES


def bytes_per_param(offload_param: str = Tier.DEVICE, offload_grad: str | None = None,
                    offload_optimizer: str = Tier.DEVICE, *, atomic_nvme: bool = True,
                    bf16_moments: bool = False, host_optimizer: str = "xla",
                    atomic_host: bool = False, delay_update: str = "none") -> dict[str, float]:
  """Bytes each parameter keeps on each tier under zinfjax's mixed precision (bf16 params and
  grads, fp32 master and moments, or bf16 moments with `bf16_moments`), before the split
  over devices and the swap stores' padding of each shard to 4 KiB.

  All-or-nothing steps keep the params and optimizer states of a swap store twice (the
  committed copy and the step's); grads there are scratch, once. The drive's store is
  all or nothing with `atomic_nvme` (`ZeroConfig.nvme_atomic_steps`). Under
  `host_optimizer="pipeline"` the pinned-host states live in a store in RAM
  (`ZeroConfig.with_host_pipeline`), all or nothing with the drive's where a state is on the
  drive, else with `atomic_host` (`ZeroConfig.host_atomic_steps`). `delay_update="all"` adds
  the delayed update's host arrays (`DELAY_BYTES`) to host RAM where the optimizer is in a
  store; "tail" delays only the leaves outside the stacks, which a per-param count leaves out
  (`autoplace.need` counts them from the plan). Params in pinned-host arrays with their
  optimizer in a store add their grads' bytes to host RAM (read and held through the update)
  and, but under "all", their new params'; on the device they cross a layer or two at a
  time (`autoplace.read_bytes`, `autoplace.returned_bytes`)."""
  out = dict.fromkeys(TIERS, 0.0)
  tiers = {"params": offload_param, "grads": offload_grad or offload_param,
           "optimizer": offload_optimizer}
  twice = copied_tiers(offload_param, offload_optimizer, atomic_nvme=atomic_nvme,
                       host_optimizer=host_optimizer, atomic_host=atomic_host)
  size = dict(STATE_BYTES, optimizer=BF16_MOMENTS_OPTIMIZER_BYTES) if bf16_moments else STATE_BYTES
  for state, tier in tiers.items():
    copies = 2 if tier in twice and state != "grads" else 1
    out[Tier(tier)] += size[state] * copies
  in_store = offload_optimizer == Tier.NVME or (offload_optimizer == Tier.PINNED_HOST
                                                 and host_optimizer == "pipeline")
  # the host pipeline reads the grads of pinned-host arrays to host RAM and holds them through
  # the update, and makes their new params there until the step puts them back (under "all"
  # they are the delayed update's)
  arrays = offload_param == Tier.PINNED_HOST and host_optimizer != "pipeline"
  if in_store and arrays:
    out[Tier.PINNED_HOST] += GRAD_BYTES + (PARAM_BYTES if delay_update != "all" else 0)
  if delay_update == "all" and in_store:
    # a RAM store alone, rewritten in place, keeps the grads it holds in their twins: once
    twins = host_optimizer == "pipeline" and Tier.NVME not in tiers.values() and not atomic_host
    kept = twins and tiers["grads"] == Tier.PINNED_HOST
    out[Tier.PINNED_HOST] += DELAY_BYTES - (GRAD_BYTES if kept else 0)
  return out


def copied_tiers(offload_param: str, offload_optimizer: str, *, atomic_nvme: bool = True,
                 host_optimizer: str = "xla", atomic_host: bool = False) -> tuple[Tier, ...]:
  """The tiers whose swap store keeps a second copy of the params and optimizer states it
  holds (all-or-nothing steps; see `bytes_per_param`): NVMe, and pinned host under the host
  pipeline, where a state is placed there."""
  used = (offload_param, offload_optimizer)
  stores = [Tier.PINNED_HOST] if host_pipeline_applies(host_optimizer, used[:1], used[1:]) else []
  stores += [Tier.NVME] if Tier.NVME in used else []
  return tuple(stores) if (atomic_nvme if Tier.NVME in used else atomic_host) else ()


@dataclasses.dataclass(frozen=True)
class MemoryEstimate:
  """All sizes in bytes. Keys of `as_dict()` are the field names (documented in the README)."""

  num_params: int
  model_states: int                    # all model states of the whole model, 20 B/param
  per_device: dict[str, int]           # model states held per device, by tier
  per_node: dict[str, int]             # the same summed over a node's devices, by tier
  activation_checkpoints: int          # per device: 2·bsz·seq·hd·nl/ci
  model_state_working_memory: int      # params + grads of the largest operator (GPT: 4·hd·4hd)
  activation_working_memory: int       # per device: bsz·seq·ci·(16·hd + 2·heads·seq)
  per_param: dict[str, float] = dataclasses.field(default_factory=dict)  # zinfjax's, by tier
  trainable_params: int | None = None  # those that train (the rest frozen); None: all
  per_frozen_param: dict[str, float] = dataclasses.field(default_factory=dict)  # a frozen one's

  def as_dict(self) -> dict[str, Any]:
    return dataclasses.asdict(self)


def estimate_memory(*, layers: int, hidden: int, heads: int, seq_len: int = 1024,
                    batch_per_device: int = 1, devices: int = 1, devices_per_node: int | None = None,
                    stage: int = 3, checkpoint_interval: int = 1, offload_param: str = Tier.DEVICE,
                    offload_grad: str | None = None, offload_optimizer: str = Tier.DEVICE,
                    num_params: int | None = None, atomic_nvme: bool = True,
                    bf16_moments: bool = False, host_optimizer: str = "xla",
                    atomic_host: bool = False, delay_update: str = "none",
                    trainable_params: int | None = None,
                    operator_bytes: int | None = None) -> MemoryEstimate:
  """The paper's estimates for a GPT of `layers` x `hidden` on `devices` data-parallel ranks.

  `offload_grad` follows `offload_param` unless given. `num_params` overrides
  the 12·nl·hd² approximation (e.g. with embeddings counted). `per_param` is what
  zinfjax itself keeps per parameter on each tier (`bytes_per_param`, which reads
  `atomic_nvme`, `host_optimizer`, `atomic_host` and `delay_update`); `bf16_moments` shrinks
  both it and `per_device`'s optimizer states by the moments' 4 bytes.
  `trainable_params` of the `num_params` train (LoRA's adapters, say; None: all): the frozen
  rest keep their params alone (`ZeroConfig.trainable`), no grads and no optimizer states,
  `per_frozen_param` bytes each. `operator_bytes` is the model-state working memory: the
  params and grads of the largest operator (`largest_operator` of a real model); the
  paper's GPT has 4·hd·4hd, the bf16 params and grads of its MLP's hd x 4hd weights.
  """
  for name, tier in (("offload_param", offload_param), ("offload_grad", offload_grad),
                     ("offload_optimizer", offload_optimizer)):
    if tier is not None and tier not in TIERS:
      raise ValueError(f"{name} must be one of {TIERS}, got {tier!r}.")
  if stage not in (0, 1, 2, 3):
    raise ValueError(f"stage must be 0, 1, 2 or 3, got {stage!r}.")
  offload_grad = offload_grad or offload_param
  per_node_devices = devices_per_node or devices
  n = num_params if num_params is not None else 12 * layers * hidden ** 2
  trained = n if trainable_params is None else trainable_params
  if not 0 <= trained <= n:
    raise ValueError(f"trainable_params={trained} must be between 0 and the {n} params.")

  def share(bytes_per_param: int, split: bool, count: int = n) -> int:
    return -(-count * bytes_per_param // devices) if split else count * bytes_per_param

  per_device = dict.fromkeys(TIERS, 0)
  per_device[offload_param] += share(PARAM_BYTES, stage >= 3)
  per_device[offload_grad] += share(GRAD_BYTES, stage >= 2, trained)
  # the paper's 16 optimizer bytes, less the 4 that bf16 moments save
  saved = STATE_BYTES["optimizer"] - BF16_MOMENTS_OPTIMIZER_BYTES if bf16_moments else 0
  per_device[offload_optimizer] += share(OPTIMIZER_BYTES - saved, stage >= 1, trained)
  twice = copied_tiers(offload_param, offload_optimizer, atomic_nvme=atomic_nvme,
                       host_optimizer=host_optimizer, atomic_host=atomic_host)
  frozen = dict.fromkeys(TIERS, 0.0)
  frozen[Tier(offload_param)] += PARAM_BYTES * (2 if offload_param in twice else 1)
  ci = checkpoint_interval
  return MemoryEstimate(
      num_params=n,
      model_states=n * PARAM_BYTES + trained * (GRAD_BYTES + OPTIMIZER_BYTES),
      per_device=per_device,
      per_node={t: b * per_node_devices for t, b in per_device.items()},
      activation_checkpoints=2 * batch_per_device * seq_len * hidden * layers // ci,
      model_state_working_memory=(4 * hidden * 4 * hidden if operator_bytes is None
                                  else operator_bytes),
      activation_working_memory=batch_per_device * seq_len * ci * (16 * hidden + 2 * heads * seq_len),
      per_param=bytes_per_param(offload_param, offload_grad, offload_optimizer,
                                atomic_nvme=atomic_nvme, bf16_moments=bf16_moments,
                                host_optimizer=host_optimizer, atomic_host=atomic_host,
                                delay_update=delay_update),
      trainable_params=trainable_params, per_frozen_param=frozen,
  )


class Operator(NamedTuple):
  """A weight as `largest_operator` finds it: its path, its shape (a stack's: one layer's) and
  the bytes of its bf16 params and, where it trains, grads."""

  name: str
  shape: tuple[int, ...]
  bytes: int


def largest_operator(model: nnx.Module, trainable: Any = nnx.Param) -> Operator:
  """The weight of `model` that takes the most memory while it is used: its bf16 params and,
  where it trains (`trainable`, a `ZeroConfig.trainable` filter), its bf16 grads. A stack's
  weight counts one layer (the step gathers a layer at a time); a weight outside the stacks
  counts whole, as the embedding or the head: in a large vocabulary that one, not the paper's
  MLP, is the largest."""
  stacks = stack_paths(model)
  trains = {tuple(p) for p, _ in nnx.to_flat_state(nnx.state(model, trainable))}
  best = Operator("", (), 0)
  for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
    path = tuple(path)
    stacked = any(path[:len(s)] == s for s in stacks)
    shape = tuple(var.shape)[1 if stacked else 0:]
    size = (PARAM_BYTES + (GRAD_BYTES if path in trains else 0)) * math.prod(shape)
    if size > best.bytes:
      best = Operator(".".join(map(str, path)), shape, size)
  return best


def tier_bytes(tree: Any) -> dict[str, int]:
  """Bytes each device holds of the arrays in `tree`, by memory kind (device 0's share)."""
  held = dict.fromkeys(TIERS, 0)
  for x in jax.tree.leaves(tree):
    if not isinstance(x, jax.Array):
      continue
    kind = getattr(x.sharding, "memory_kind", None) or Tier.DEVICE.memory_kind
    shard = x.addressable_shards[0].data if x.addressable_shards else x
    held[kind if kind in held else Tier.DEVICE] += shard.nbytes
  return held
