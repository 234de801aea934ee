"""Automatic placement: the tier of every state of every layer, from per-tier budgets.

`ZeroConfig(offload="auto", tier_budgets=...)` turns budgets (bytes each
device may hold on each tier) into the per-layer splits `offload_param` and
`offload_optimizer` take, before anything is allocated. The rule follows the
ZeRO-Infinity paper's bandwidth analysis (section 4): a step reads the
compute params twice (forward and backward) and writes their grads, on the
critical path of every layer, while each optimizer state is read and written
once, by the optimizer that runs next to it. So the fastest tiers go to the
params and grads first, device before pinned host before NVMe, and the
optimizer states take what remains, in the same order. Within a state, the
first layers of every `Stack` go to the faster tier (a split such as
"device:2,pinned_host"); the leaves outside the stacks live with the first
tier named. Every candidate is measured with the placement plan itself
(`Plan.tier_bytes`, `Plan.nvme_bytes`), so the budgets are checked against
the bytes the run will hold, not against a formula.
"""

from __future__ import annotations

import dataclasses
import glob
import os
import shutil
from typing import Callable, Mapping

import jax

from .config import ZeroConfig
from .hostlimit import host_room
from .optim.stream import SLOTS
from .placement import TIERS, Plan, Tier
from .progress import human_bytes
from .putback import RETURNING

DEVICE_SHARE = 0.5   # of the device's free memory: the rest is for activations and gathered layers
HOST_SHARE = 0.5     # of the host's available memory
NVME_SHARE = 0.95    # of the free space under nvme_path


class PlacementError(ValueError):
  """The model's states do not fit the tiers' budgets."""


def _gb(n: float) -> str:
  return human_bytes(n, digits=2)


def default_budgets(config: ZeroConfig) -> dict[str, int]:
  """Bytes per device for each tier: a share of the device's free memory (none on a CPU
  platform, whose device memory is the host's), a share of the host's available memory (less
  what XLA:GPU's host update copies, `hostlimit.host_room`), and
  the free space under `nvme_path` (none without one), each split over the local devices."""
  devices = jax.local_devices()
  stats = devices[0].memory_stats() if devices[0].platform != "cpu" else None
  device = 0
  if stats and "bytes_limit" in stats:
    device = int(DEVICE_SHARE * (stats["bytes_limit"] - stats.get("bytes_in_use", 0)))
  ram = host_room(int(HOST_SHARE * _available_ram()), devices[0].platform, config.host_optimizer)
  host = (ram - config.pinned_budget) // len(devices)
  nvme = 0
  for path in config.nvme_paths:
    probe = path
    while not os.path.exists(probe):  # the folder is made at init
      probe = os.path.dirname(probe) or "."
    nvme += shutil.disk_usage(probe).free + sum(  # this process's old swap files are reused
        os.path.getsize(f) for f in glob.glob(os.path.join(path, f"rank{jax.process_index()}", "*.bin")))
  return {Tier.DEVICE: device, Tier.PINNED_HOST: max(0, host),
          Tier.NVME: int(NVME_SHARE * nvme) // len(devices)}


def _available_ram() -> int:
  try:
    with open("/proc/meminfo") as f:
      info = dict(line.split(":", 1) for line in f)
    return int(info["MemAvailable"].split()[0]) * 1024
  except (OSError, KeyError, ValueError):
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


@dataclasses.dataclass(frozen=True)
class AutoPlan:
  """The splits chosen, the budgets they were chosen for, the bytes each tier holds per device
  (a swap store's with the second copy all-or-nothing steps write, on the `copies` tiers), and
  the pinned buffers the run needs (`ZeroConfig.pinned_budget`, raised when the NVMe optimizer
  needs more)."""

  offload_param: str
  offload_optimizer: str
  budgets: dict[str, int]
  need: dict[str, int]
  pinned_budget: int
  copies: tuple[str, ...] = ()  # tiers whose `need` holds a second copy (all-or-nothing steps)
  host_arrays: int = 0  # of pinned host's `need`: the host pipeline's arrays of grads and new
  # params (`host_array_bytes`), not states

  def resolve(self, config: ZeroConfig) -> ZeroConfig:
    """`config` with the tiers (and pinned budget) this plan chose, ready to build."""
    return config.replace(offload=None, tier_budgets=None, offload_param=self.offload_param,
                          offload_optimizer=self.offload_optimizer,
                          pinned_budget=self.pinned_budget)

  def table(self) -> str:
    rows = [f"placement (offload='auto'): params+grads {self.offload_param}, optimizer "
            f"{self.offload_optimizer}, pinned buffers {_gb(self.pinned_budget)} per process"]
    for tier in TIERS:
      share = self.need[tier] / self.budgets[tier] if self.budgets[tier] else 0.0
      rows.append(f"  {tier:<11} {_gb(self.need[tier]):>11} of {_gb(self.budgets[tier]):>11} "
                  f"per device ({share:.0%})" + (", with the second copy of all-or-nothing steps"
                                                 if tier in self.copies else "")
                  + (f", with {_gb(self.host_arrays)} of the host pipeline's grads and new params"
                     if tier == Tier.PINNED_HOST and self.host_arrays else ""))
    return "\n".join(rows)


def need(plan: Plan, config: ZeroConfig) -> dict[str, int]:
  """Bytes per device on each tier: the plan's states, and in a swap store (on NVMe; in pinned
  host under the host pipeline, `with_host_pipeline`) its aligned shards plus the second copy
  all-or-nothing steps write, and host RAM the host pipeline's arrays take (`host_array_bytes`).
  `plan` is made from `config` or from its `with_host_pipeline()` (the engine's `plan`)."""
  out = plan.tier_bytes()
  mapped = config.with_host_pipeline()
  store = lambda tier: sum(plan.nvme_disk_bytes(mapped.nvme_atomic_steps, ranks=1,
                                                tier=tier).values())
  out[Tier.NVME] = store(Tier.NVME)
  if mapped.host_store:  # every pinned-host state is in the RAM store
    out[Tier.PINNED_HOST] = store(Tier.PINNED_HOST) + store(Tier.HOST_STORE)
  out[Tier.PINNED_HOST] += host_array_bytes(plan, mapped)
  return out


def _in_store(tier: Tier, config: ZeroConfig) -> bool:
  """Whether states planned on `tier` live in a swap store (the drive's, or RAM's under the
  host pipeline) rather than in arrays."""
  return not tier.holds_arrays or (tier is Tier.PINNED_HOST and config.host_store)


def _array_layers(leaf, config: ZeroConfig) -> dict[Tier, int]:
  """Per array tier, the layers of `leaf` whose params (and grads) are arrays there and whose
  optimizer is in a swap store: the host pipeline reads their grads and makes their params."""
  layers = dict.fromkeys((Tier.DEVICE, Tier.PINNED_HOST), 0)
  for opt in (s for s in leaf.optimizer if _in_store(s.tier, config)):
    for seg in (s for s in leaf.params if not _in_store(s.tier, config)):
      layers[seg.tier] += max(0, min(opt.stop, seg.stop) - max(opt.start, seg.start))
  return layers


def returned_bytes(plan: Plan, config: ZeroConfig) -> int:
  """Host RAM per device the host pipeline's new compute params take until they are back in
  their arrays, for the layers whose optimizer is in a swap store and whose params are arrays:
  a param of each, in the plan's dtype, where the step puts them back after the update (arrays
  in pinned host); `RETURNING` layers of a leaf where they go back as they are made (on the
  device, `putback.PutBack`). The delayed parts' are counted by `delayed_bytes`."""
  total = 0
  for leaf in plan.leaves:
    if config.delay_update == "all" or (config.delay_update == "tail" and not leaf.stacked):
      continue
    layers = _array_layers(leaf, config)
    total += (min(layers[Tier.DEVICE], RETURNING) + layers[Tier.PINNED_HOST]) * leaf.local_size
  return total * plan.dtype("params").itemsize


def read_bytes(plan: Plan, config: ZeroConfig) -> int:
  """Host RAM per device the grads of the array layers whose optimizer is in a store take as
  the host pipeline reads them (`runner.grad_reader`). On the device: the leaf layer being
  updated, and up to a layer of the largest stack on its way; all of them where they are
  fewer. In pinned-host arrays (no device op slices them): every layer, read a segment at a
  time and held through the update."""
  layers = {leaf.index: _array_layers(leaf, config) for leaf in plan.leaves if leaf.trainable}
  device = {i: n[Tier.DEVICE] for i, n in layers.items()}
  sizes = [plan.leaves[i].local_size for i, n in device.items() if n]
  every = sum(n * plan.leaves[i].local_size for i, n in device.items())
  window = max(sizes) + plan.stack_layer_size if sizes else 0
  hosted = sum(n[Tier.PINNED_HOST] * plan.leaves[i].local_size for i, n in layers.items())
  return (min(every, window) + hosted) * plan.dtype("grads").itemsize


def host_array_bytes(plan: Plan, config: ZeroConfig) -> int:
  """Host RAM per device the host pipeline's arrays take beside the states: grads read, new
  params made, the delayed update's."""
  return delayed_bytes(plan, config) + returned_bytes(plan, config) + read_bytes(plan, config)


def delayed_bytes(plan: Plan, config: ZeroConfig) -> int:
  """Host RAM per device that `config.delay_update`'s arrays take (`memory.DELAY_BYTES` a
  delayed param, in the plan's dtypes: the held grads twice and the new params), for the
  layers whose optimizer is in a swap store: all of them under "all"; under "tail" those of
  the leaves outside the stacks (all of them: a bound). Under "all" with steps rewritten in
  place, a RAM store keeps the held grads and new params it holds in twins instead: once
  each."""
  if config.delay_update == "none":
    return 0
  grads, params = plan.dtype("grads").itemsize, plan.dtype("params").itemsize
  ram = lambda tier: tier is Tier.HOST_STORE or (tier is Tier.PINNED_HOST and config.host_store)
  drive = any(Tier.NVME in plan.tiers(state) for state in ("params", "grads", "master"))
  twins = config.delay_update == "all" and not config.nvme_atomic_steps and not drive
  total = 0
  for leaf in plan.leaves:
    if config.delay_update == "all" or not leaf.stacked:
      for seg in leaf.optimizer:
        if _in_store(seg.tier, config):
          kept = twins and ram(leaf.tier("grads", seg.start))  # in its twin, not in arrays
          total += seg.layers * leaf.local_size * (grads * (1 if kept else 2) + params)
  return total


def _split(fast: list[tuple[str, int]], slow: str, depth: int) -> str:
  """`[("device", 2), ("pinned_host", 3)]` and the slow tier as a split string
  ("device:2,pinned_host:3,nvme"): tiers with no layers left out. Without stacks (depth 0)
  a count of 1 means the whole of the leaves."""
  used = [(t, k) for t, k in fast if k > 0]
  left = max(depth, 1) - sum(k for _, k in used)
  if left > 0:
    used.append((slow, left))
  if len(used) == 1 or depth == 0:
    return used[0][0]
  return ",".join(f"{t}:{k}" for t, k in used[:-1]) + f",{used[-1][0]}"


def pinned_need(plan: Plan, config: ZeroConfig) -> int:
  """The `pinned_budget` the plan's NVMe optimizer needs: `SLOTS` buffer sets of its largest
  part (one rank's shard of one layer: fp32 master, m, v, and the grads and params), which
  get three quarters of the budget (the rest stages the store's transfers)."""
  parts = [leaf.local_size for leaf in plan.leaves
           if any(s.tier == Tier.NVME for s in leaf.optimizer)]
  if not parts:
    return config.pinned_budget
  per_set = max(parts) * (plan.optimizer_bytes + 2 * plan.dtype("params").itemsize)
  return max(config.pinned_budget, -(-SLOTS * per_set * 4 // 3 // (1 << 20)) << 20)


def plan_placement(config: ZeroConfig, build: Callable[[ZeroConfig], Plan],
                   budgets: Mapping[str, int] | None = None) -> AutoPlan:
  """The splits for `config` (offload="auto") under `budgets` (per device; missing tiers
  take `default_budgets`). `build(config)` makes the plan of a candidate. The host budget
  also pays for pinned buffers the NVMe optimizer needs beyond `config.pinned_budget`.
  Raises `PlacementError`, naming each tier's shortfall, when no split fits."""
  budget = dict(default_budgets(config)) if budgets is None or set(budgets) != set(TIERS) else {}
  budget.update(budgets or {})
  first = _choose(config, build, budget)
  pinned = pinned_need(build(first.resolve(config)), config)
  if pinned <= config.pinned_budget:
    return first
  extra = (pinned - config.pinned_budget) // len(jax.local_devices())
  budget[Tier.PINNED_HOST] = max(0, budget[Tier.PINNED_HOST] - extra)
  again = _choose(config.replace(pinned_budget=pinned), build, budget)
  return dataclasses.replace(again, pinned_budget=max(
      pinned, pinned_need(build(again.resolve(config)), config)))


def _fix(short: Mapping[str, int], nvme: bool) -> str:
  """What to change for the tiers `short` of their budgets (`nvme`: a drive is given)."""
  if not nvme:
    return "Give ZeroConfig.nvme_path a folder on a drive with room."
  fixes = ["Free space under nvme_path or add drives to it."] if Tier.NVME in short else []
  fast = [t for t in TIERS if t in short and t != Tier.NVME]
  if fast:  # what no split moves to the drive (leaves outside the stack, buffers, held grads)
    fixes.append(f"Raise tier_budgets for {' and '.join(fast)}: that is the least "
                 f"{'they hold' if len(fast) > 1 else 'it holds'} with every layer that can go "
                 "to NVMe there.")
  return " ".join(fixes)


def _choose(config: ZeroConfig, build: Callable[[ZeroConfig], Plan],
            budget: dict[str, int]) -> AutoPlan:
  """The greedy choice (see the module docstring) for one set of budgets."""
  if not config.nvme_paths:
    budget[Tier.NVME] = 0
  base = config.replace(offload=None, tier_budgets=None, offload_param=Tier.DEVICE,
                        offload_optimizer=Tier.DEVICE)
  depth = max([s.num_layers for s in build(base).stacks], default=0)
  slow = Tier.NVME if config.nvme_paths else Tier.PINNED_HOST

  def candidate(param: str, optimizer: str) -> ZeroConfig:
    return base.replace(offload_param=param, offload_optimizer=optimizer)

  def fits(cfg: ZeroConfig, tiers: tuple[str, ...]) -> bool:
    got = need(build(cfg), cfg)
    return all(got[t] <= budget[t] for t in tiers)

  def most(make: Callable[[int], ZeroConfig], top: int, tiers: tuple[str, ...]) -> int:
    """The most layers (top down to 0) the faster tier can take."""
    return next((k for k in range(top, -1, -1) if fits(make(k), tiers)), 0)

  rest = max(depth, 1)   # without stacks, one unit: all of the leaves
  fast_tiers = (Tier.DEVICE, Tier.PINNED_HOST) if slow == Tier.NVME else (Tier.DEVICE,)
  lay = lambda *fast: _split(list(zip(fast_tiers, fast)), slow, depth)
  # params and grads first: device, then pinned host, the rest on NVMe (optimizer parked slow)
  k_dev = most(lambda k: candidate(lay(k), slow), rest, (Tier.DEVICE,))
  k_host = most(lambda k: candidate(lay(k_dev, k), slow), rest - k_dev,
                (Tier.DEVICE, Tier.PINNED_HOST))
  param = lay(k_dev, k_host)
  # then the optimizer states, in what remains
  o_dev = most(lambda k: candidate(param, lay(k)), rest, (Tier.DEVICE,))
  o_host = most(lambda k: candidate(param, lay(o_dev, k)), rest - o_dev,
                (Tier.DEVICE, Tier.PINNED_HOST))
  optimizer = lay(o_dev, o_host)
  chosen = candidate(param, optimizer)
  plan = build(chosen)
  got = need(plan, chosen)
  short = {t: got[t] - budget[t] for t in TIERS if got[t] > budget[t]}
  if short:
    total = need(build(base), base)[Tier.DEVICE]
    detail = ", ".join(f"{t} needs {_gb(got[t])} of a {_gb(budget[t])} budget ({_gb(n)} short)"
                       for t, n in short.items())
    raise PlacementError(
        f"offload='auto': the model's states ({_gb(total)} per device in all) do not fit the "
        f"tiers' budgets even with the fewest layers on the fast tiers: {detail}. "
        f"{_fix(short, bool(config.nvme_paths))}")
  mapped = chosen.with_host_pipeline()
  stores = ((Tier.PINNED_HOST, mapped.host_store), (Tier.NVME, mapped.uses_nvme))
  copies = tuple(t for t, held in stores if held and mapped.nvme_atomic_steps)
  arrays = host_array_bytes(plan, mapped)
  return AutoPlan(param, optimizer, dict(budget), got, config.pinned_budget, copies, arrays)


@dataclasses.dataclass(frozen=True)
class Rates:
  """What the hardware does per second: matmul FLOP/s of a device, host<->device bytes/s per
  device, NVMe read and write bytes/s per device, and AdamW elements/s on the host."""

  flops: float = 735e12        # bf16 matmul 8192^3 measured on an H100 (BENCHMARKS.md)
  link: float = 50e9           # pinned cudaMemcpyAsync on that H100
  nvme_read: float = 2e9
  nvme_write: float = 2e9
  host_adam: float = 1e9


def predict(plan: Plan, tokens_per_device: int, num_params: int, rates: Rates = Rates()) -> dict:
  """The step time a placement allows, per device, if every transfer hides behind the others
  and behind compute (the bound the schedule aims for): the largest of compute (6 FLOPs per
  param per token; 4 for a frozen one, whose weight gradient is not made), the host<->device
  traffic, the NVMe traffic and the host optimizer."""
  link = read = write = host_elems = frozen = 0.0
  item = plan.dtype("params").itemsize
  for leaf in plan.leaves:
    frozen += 0 if leaf.trainable else leaf.size
    for layer in range(leaf.num_layers):
      p = leaf.local_size * item          # params; grads are the same size
      ptier = leaf.tier("params", layer)
      otier = leaf.tier("master", layer) if leaf.trainable else None
      if ptier != Tier.DEVICE:         # forward and backward reads come over the link,
        link += (3 if leaf.trainable else 2) * p   # the grads go back over it
      if ptier == Tier.NVME:
        read, write = read + 2 * p, write + (p if leaf.trainable else 0)
      if otier is None:
        continue
      if otier != Tier.DEVICE:
        host_elems += leaf.local_size
        if ptier == Tier.DEVICE:       # grads down, new params up
          link += 2 * p
      if otier == Tier.NVME:           # master, m, v in and out; grads read, params written
        read += plan.optimizer_bytes * leaf.local_size + (p if ptier == Tier.NVME else 0)
        write += plan.optimizer_bytes * leaf.local_size + (p if ptier == Tier.NVME else 0)
  share = frozen / max(1, sum(leaf.size for leaf in plan.leaves))
  terms = {"compute": (6 - 2 * share) * num_params * tokens_per_device / rates.flops,
           "host<->device": link / rates.link,
           Tier.NVME: read / rates.nvme_read + write / rates.nvme_write,
           "host optimizer": host_elems / rates.host_adam}
  return {"step_s": max(terms.values()), "bound": max(terms, key=terms.get), "terms": terms,
          "bytes": {"host<->device": link, "nvme_read": read, "nvme_write": write}}
