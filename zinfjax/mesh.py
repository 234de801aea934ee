"""The data mesh: every device on one `data` axis."""

from __future__ import annotations

from typing import Sequence

import jax
import numpy as np
from jax.sharding import Mesh


def make_mesh(devices: Sequence[jax.Device] | int | None = None, axis: str = "data") -> Mesh:
  """A 1-D mesh named `axis` over `devices` (default: all devices; an int: the first N)."""
  all_devices = jax.devices()
  if devices is None:
    devices = all_devices
  elif isinstance(devices, int):
    if not 1 <= devices <= len(all_devices):
      raise ValueError(
          f"asked for {devices} devices but JAX sees {len(all_devices)}. On CPU, set "
          f"XLA_FLAGS=--xla_force_host_platform_device_count={devices} before importing jax.")
    devices = all_devices[:devices]
  return Mesh(np.asarray(devices), (axis,))
