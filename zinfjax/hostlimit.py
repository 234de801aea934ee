"""XLA:GPU's cap on pinned host memory, raised to what the machine has.

XLA's GPU client refuses pinned-host allocations beyond
`XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB` (64 GiB unless set), read once when the
client starts, so host tiers could not use a larger machine's RAM. Importing
zinfjax sets it, where the environment does not, to 90% of the machine's RAM
(never below XLA's default); a plan whose pinned-host states exceed the limit
in effect is refused when the engine is built, before anything is allocated.
XLA:GPU's host update also copies the states it updates: `host_room` is the
share of RAM a plan may fill under it.
"""

from __future__ import annotations

import os
import warnings
from typing import MutableMapping

ENV = "XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB"
XLA_DEFAULT_GB = 64
SHARE = 0.9  # of the machine's RAM: the rest for the runtime, data and the NVMe staging buffers
# XLA:GPU's host update (host_optimizer="xla") held 2.3x its pinned-host states in RAM at its
# peak on an H200 (host RSS 19.2 GB against 9.7 GB under the host pipeline, which updates the
# same 7.6 GB of states in place): its copies of every state and the update's temporaries.
# XLA:CPU's update makes no such copies.
XLA_HOST_PEAK = 2.3


def _copied(platform: str, host_optimizer: str) -> bool:
  """Whether the pinned-host states are updated by XLA:GPU's host computation (and copied)."""
  return platform in ("gpu", "cuda") and host_optimizer == "xla"


def host_room(ram: int, platform: str, host_optimizer: str) -> int:
  """Bytes of states `ram` bytes of RAM hold: all of it, but under XLA:GPU's host update a
  share (`XLA_HOST_PEAK`), so a plan sized to it is not killed for memory at its first update."""
  return int(ram / XLA_HOST_PEAK) if _copied(platform, host_optimizer) else int(ram)


def warn_copies(pinned_bytes: int, platform: str, host_optimizer: str,
                ram: int | None = None) -> None:
  """Warn, before anything is compiled, where XLA:GPU's host update of a plan's `pinned_bytes`
  of pinned-host states would need more than `SHARE` of the machine's RAM at its peak."""
  ram = ram or machine_ram()
  if not _copied(platform, host_optimizer) or host_room(int(SHARE * ram), platform,
                                                        host_optimizer) >= pinned_bytes:
    return
  warnings.warn(
      f"the plan keeps {pinned_bytes / 2**30:.1f} GiB of states in pinned host memory, updated in "
      f"XLA's host computation (host_optimizer='xla'), which held {XLA_HOST_PEAK}x its states in "
      f"RAM at its peak on an H200: about {XLA_HOST_PEAK * pinned_bytes / 2**30:.0f} GiB here, "
      f"more than {SHARE:.0%} of this machine's {ram / 2**30:.0f} GiB, so the first update may "
      "be killed for memory. Use host_optimizer='pipeline' (the C++ AdamW updates the states in "
      "place in a RAM store, about 1x) or place fewer states on 'pinned_host'.", stacklevel=4)


def machine_ram() -> int:
  """Bytes of physical memory."""
  return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def raise_default(environ: MutableMapping[str, str] = os.environ, ram: int | None = None) -> None:
  """Set the limit to `SHARE` of the machine's RAM in GiB where `environ` does not set it."""
  if ENV not in environ:
    environ[ENV] = str(max(XLA_DEFAULT_GB, int(SHARE * (ram or machine_ram())) >> 30))


def limit_bytes(environ: MutableMapping[str, str] = os.environ) -> int:
  return int(float(environ.get(ENV, XLA_DEFAULT_GB)) * (1 << 30))


def check(pinned_bytes: int, platform: str, environ: MutableMapping[str, str] = os.environ) -> None:
  """Refuse a plan holding more pinned-host bytes in this process than XLA:GPU allows."""
  if platform not in ("gpu", "cuda") or pinned_bytes <= limit_bytes(environ):
    return
  need = -(-pinned_bytes // (1 << 30))
  raise ValueError(
      f"the plan keeps {pinned_bytes / 2**30:.1f} GiB of states in pinned host memory in this "
      f"process, more than XLA:GPU's limit of {limit_bytes(environ) / 2**30:.0f} GiB ({ENV}): "
      f"set {ENV}={need} (or more, if the machine has the RAM) before jax starts, or place fewer "
      "states on 'pinned_host' (offload_param / offload_optimizer, or host_optimizer='pipeline', "
      "whose store is not XLA's).")
