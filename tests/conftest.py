"""Test setup: 8 host devices (set before jax is imported) and shared helpers."""

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           " --xla_force_host_platform_device_count=8").strip()

import jax  # noqa: E402
import pytest  # noqa: E402

from placements import ZERO3, Placement, placed  # noqa: E402

SLOW = os.path.join(os.path.dirname(__file__), "slow.txt")


def pytest_collection_modifyitems(config, items):
  """Mark the tests tests/slow.txt lists (made by scripts/slow_tests.py from a timed run) with
  `slow`: `pytest -m "not slow"` is the quick run."""
  with open(SLOW) as f:
    slow = {line.strip() for line in f if line.strip() and not line.startswith("#")}
  for item in items:
    if item.nodeid in slow:
      item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="session")
def mesh():
  import zinfjax
  assert len(jax.devices()) == 8, "tests expect 8 host devices"
  return zinfjax.make_mesh()


@pytest.fixture(params=ZERO3)
def placement(request, tmp_path) -> Placement:
  """Runs the test once per ZeRO-3 placement of tests/placements.py (or those it names with
  `parametrize("placement", [...], indirect=True)`)."""
  return placed(request.param, tmp_path)
