"""The engine's AdamW where its states live in arrays: on the device or in pinned host memory.

Both run inside the step's `shard_map`, on each rank's local shards:

* `device_update`: XLA on the device (the same math as optax.adamw, in jnp);
* `pinned_update`: the fused C++ kernel on the CPU next to the states (an XLA
  custom call on the host, `kernel.on_host`); grads go to the host, the
  new compute params come back to the device.

The NVMe tier streams its states through the host instead: `pipeline.py`.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Sequence

import jax
import jax.numpy as jnp

from ..offload import tiers
from ..placement import Tier
from .hyper import AdamHyper
from .kernel import adamw_host, adamw_jnp, on_host


class HostAdamState(NamedTuple):
  """Optimizer state of the engine's AdamW: the step count and the moments held in arrays
  (per leaf, a tuple with one array per optimizer segment on the device or pinned host)."""

  count: jax.Array
  mu: Any
  nu: Any


Updated = tuple[list, list, list, list]  # new masters, moments, compute params


def device_update(hyper: AdamHyper, decays: Sequence[float], scalars: tuple, masters: list,
                  mus: list, nus: list, grads: list, params_dtype, platform: str = "cpu") -> Updated:
  """AdamW on device-resident shards (jnp, bit-identical to optax.adamw). `scalars` are
  (lr, bc1, bc2, step) and optionally `ok`: False keeps every state as it was."""
  lr, bc1, bc2, step, *ok = scalars
  # a skipped step is folded into the update (`adamw_jnp`'s `ok`): one in-place pass either way
  out = [adamw_jnp(m, mu, nu, g, lr, bc1, bc2, hyper.constants, wd, step, ok[0] if ok else None)
         for m, mu, nu, g, wd in zip(masters, mus, nus, grads, decays)]
  new_m, new_mu, new_nu = ([x[i] for x in out] for i in range(3))
  return new_m, new_mu, new_nu, [m.astype(params_dtype) for m in new_m]


def pinned_update(hyper: AdamHyper, decays: Sequence[float], scalars: tuple, masters: list,
                  mus: list, nus: list, grads: list, params_dtype, platform: str = "cpu") -> Updated:
  """AdamW on pinned-host shards on the CPU; params come back to the device.

  The fused C++ kernel on a CPU mesh, the same math in jnp compiled for the host on
  GPU (`kernel.adamw_host`).
  """
  if not masters:
    return [], [], [], []
  lr, bc1, bc2, step, *ok = scalars
  ok = ok[0] if ok else jnp.bool_(True)
  grads = [tiers.to_tier(g, Tier.PINNED_HOST) for g in grads]

  @on_host(out_memory_spaces=[[tiers.HOST] * len(masters)] * 4)
  def update(masters, mus, nus, grads, lr, bc1, bc2, step, ok):
    out = [adamw_host(m, mu, nu, g, lr, bc1, bc2, hyper.constants, wd, params_dtype, platform, ok,
                      step) for m, mu, nu, g, wd in zip(masters, mus, nus, grads, decays)]
    return [list(x) for x in zip(*out)]

  new_m, new_mu, new_nu, params = update(masters, mus, nus, grads, lr, bc1, bc2, step, ok)
  host = lambda xs: [tiers.to_tier(x, Tier.PINNED_HOST) for x in xs]
  return (host(new_m), host(new_mu), host(new_nu),
          [tiers.to_device(p, Tier.PINNED_HOST) for p in params])


UPDATES = {Tier.DEVICE: device_update, Tier.PINNED_HOST: pinned_update}
