"""The engine's AdamW where its states live in arrays: on the device or in pinned host memory.

Both run inside the step's `shard_map`, on each rank's local shards:

* `device_update`: XLA on the device (the same math as optax.adamw, in jnp);
* `pinned_update`: the fused C++ kernel on the CPU next to the states (an XLA
  custom call on the host, `kernel.on_host`); grads go to the host, the
  new compute params come back to the device;
* `streamed_update` (`host_optimizer="stream"`): pinned-host states updated on
  the device, a layer at a time: each layer's master and moments cross to the
  device, are updated by XLA and go back, so the link to the host, not the
  CPU's memory, bounds the update, and the device holds one layer's states.

The NVMe tier streams its states through the host instead: `pipeline.py`.
"""

from __future__ import annotations

import os
from typing import Any, Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
from jax import lax

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


def clipped(grads: list, clip: Callable | None) -> list:
  """`grads` after the global-norm clipping `clip` (None: as they are)."""
  return grads if clip is None else [clip(g) for g in grads]


def device_update(hyper: AdamHyper, decays: Sequence[float], scalars: tuple, masters: list,
                  mus: list, nus: list, grads: list, params_dtype, platform: str = "cpu",
                  stacked: Sequence[bool] = (), clip: Callable | None = None) -> Updated:
  """AdamW on device-resident shards (jnp, bit-identical to optax.adamw). `scalars` are
  (lr, bc1, bc2, step) and optionally `ok`: False keeps every state as it was. `clip` (every
  update takes it): the global-norm clipping each grad gets first, or None."""
  lr, bc1, bc2, step, *ok = scalars
  grads = clipped(grads, clip)
  # a skipped step is folded into the update (`adamw_jnp`'s `ok`): one in-place pass either way
  out = [adamw_jnp(m, mu, nu, g, lr, bc1, bc2, hyper.constants, wd, step, ok[0] if ok else None)
         for m, mu, nu, g, wd in zip(masters, mus, nus, grads, decays)]
  new_m, new_mu, new_nu = ([x[i] for x in out] for i in range(3))
  return new_m, new_mu, new_nu, [m.astype(params_dtype) for m in new_m]


def pinned_update(hyper: AdamHyper, decays: Sequence[float], scalars: tuple, masters: list,
                  mus: list, nus: list, grads: list, params_dtype, platform: str = "cpu",
                  stacked: Sequence[bool] = (), clip: Callable | None = None) -> Updated:
  """AdamW on pinned-host shards on the CPU; params come back to the device.

  The fused C++ kernel on a CPU mesh, the same math in jnp compiled for the host on
  GPU (`kernel.adamw_host`).
  """
  if not masters:
    return [], [], [], []
  lr, bc1, bc2, step, *ok = scalars
  ok = ok[0] if ok else jnp.bool_(True)
  grads = [tiers.to_tier(g, Tier.PINNED_HOST) for g in clipped(grads, clip)]

  @on_host(out_memory_spaces=[[tiers.HOST] * len(masters)] * 4)
  def update(masters, mus, nus, grads, lr, bc1, bc2, step, ok):
    out = [adamw_host(m, mu, nu, g, lr, bc1, bc2, hyper.constants, wd, params_dtype, platform, ok,
                      step) for m, mu, nu, g, wd in zip(masters, mus, nus, grads, decays)]
    return [list(x) for x in zip(*out)]

  new_m, new_mu, new_nu, params = update(masters, mus, nus, grads, lr, bc1, bc2, step, ok)
  host = lambda xs: [tiers.to_tier(x, Tier.PINNED_HOST) for x in xs]
  return (host(new_m), host(new_mu), host(new_nu),
          [tiers.to_device(p, Tier.PINNED_HOST) for p in params])


# The form of `streamed_update`'s scan: "carry" (the default) writes each layer's states back
# into the pinned-host stacks it carries, in place; "stack" stacks them into new pinned-host
# arrays as the scan's outputs (XLA's activation-offloading form; twice the states' host memory
# while the step runs). A switch, so a GPU run can compare the two.
FORM_ENV = "ZINFJAX_STREAM_UPDATE_FORM"


def streamed_update(hyper: AdamHyper, decays: Sequence[float], scalars: tuple, masters: list,
                    mus: list, nus: list, grads: list, params_dtype, platform: str = "cpu",
                    stacked: Sequence[bool] = (), clip: Callable | None = None) -> Updated:
  """AdamW on pinned-host shards computed on the device (the same math as `device_update`,
  bit for bit): a stacked shard (`stacked`) a layer at a time in a scan, each layer's states
  brought to the device, updated and sent back; any other shard whole. The new params stay
  on the device, as `pinned_update`'s come back to it."""
  host = Tier.PINNED_HOST

  def one(wd: float) -> Callable:
    def update(m, mu, nu, g):
      """`device_update` of one layer (its grads clipped inside it) with the states brought over
      and sent back."""
      states = ([tiers.to_device(x, host)] for x in (m, mu, nu))
      (m,), (mu,), (nu,), (params,) = device_update(hyper, [wd], scalars, *states, [g],
                                                    params_dtype, clip=clip)
      return tiers.to_tier(m, host), tiers.to_tier(mu, host), tiers.to_tier(nu, host), params
    return update

  in_place = os.environ.get(FORM_ENV, "carry") != "stack"
  out = []
  for m, mu, nu, g, wd, layered in zip(masters, mus, nus, grads, decays,
                                       stacked or [False] * len(masters)):
    update = one(wd)
    if not layered:
      out.append(update(m, mu, nu, g))
      continue
    at = lambda x, i: lax.dynamic_index_in_dim(x, i, 0, keepdims=False)
    layers = jnp.arange(m.shape[0])
    if in_place:
      def layer(states, i, update=update, g=g):
        """Layer i's states updated where they lie in the carried stacks."""
        *new, params = update(*(at(x, i) for x in states), at(g, i))
        return tuple(lax.dynamic_update_index_in_dim(x, y, i, 0)
                     for x, y in zip(states, new)), params

      (m, mu, nu), params = lax.scan(layer, (m, mu, nu), layers)
      out.append((m, mu, nu, params))
    else:
      def stacked_anew(_, i, update=update, xs=(m, mu, nu, g)):
        """Layer i's new states and params, which the scan stacks into new arrays."""
        return None, update(*(at(x, i) for x in xs))

      out.append(lax.scan(stacked_anew, None, layers)[1])
  return tuple([x[k] for x in out] for k in range(4))


UPDATES = {Tier.DEVICE: device_update, Tier.PINNED_HOST: pinned_update}
# who updates the pinned-host states, by `ZeroConfig.host_optimizer` (the host pipeline's are
# in its store, not in arrays)
PINNED_UPDATES = {"xla": pinned_update, "stream": streamed_update}


def updates(host_optimizer: str) -> dict[Tier, Callable[..., Updated]]:
  """The update of each array tier under `host_optimizer`."""
  return {**UPDATES, Tier.PINNED_HOST: PINNED_UPDATES.get(host_optimizer, pinned_update)}
