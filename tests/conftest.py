"""Test setup: 8 host devices (set before jax is imported) and shared helpers."""

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           " --xla_force_host_platform_device_count=8").strip()

import jax  # noqa: E402
import pytest  # noqa: E402

@pytest.fixture(scope="session")
def mesh():
  import zinfjax
  assert len(jax.devices()) == 8, "tests expect 8 host devices"
  return zinfjax.make_mesh()
