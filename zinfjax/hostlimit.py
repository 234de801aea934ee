"""XLA:GPU's cap on pinned host memory, raised to what the machine has.

XLA's GPU client refuses pinned-host allocations beyond
`XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB` (64 GiB unless set), read once when the
client starts, so host tiers could not use a larger machine's RAM. Importing
zinfjax sets it, where the environment does not, to 90% of the machine's RAM
(never below XLA's default); a plan whose pinned-host states exceed the limit
in effect is refused when the engine is built, before anything is allocated.
"""

from __future__ import annotations

import os
from typing import MutableMapping

ENV = "XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB"
XLA_DEFAULT_GB = 64
SHARE = 0.9  # of the machine's RAM: the rest for the runtime, data and the NVMe staging buffers


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
