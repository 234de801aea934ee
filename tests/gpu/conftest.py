"""GPU tests: run on one CUDA GPU (scripts/gpu_check.sh), skipped with the reason elsewhere.

fp32 matmuls run at full precision here (no TF32), so placements can be compared
with the all-device run to 1e-5.
"""

import os

import jax
import pytest


def gpus() -> list:
  if os.environ.get("ZINFJAX_GPU_TESTS_ON_CPU"):  # dry run of the test code itself (no CUDA path)
    return jax.devices("cpu")
  try:
    return jax.devices("gpu")
  except RuntimeError:  # no CUDA backend in this jax, or no GPU/driver on this machine
    return []


def pytest_collection_modifyitems(config, items):
  if any(item.get_closest_marker("gpu") for item in items) and not gpus():
    skip = pytest.mark.skip(reason="needs a CUDA GPU: jax.devices('gpu') is empty here "
                                   "(scripts/gpu_check.sh runs these on a GPU machine)")
    for item in items:
      if item.get_closest_marker("gpu"):
        item.add_marker(skip)


@pytest.fixture(scope="session")
def gpu_mesh():
  import zinfjax
  jax.config.update("jax_default_matmul_precision", "highest")
  return zinfjax.make_mesh(devices=gpus()[:1])
