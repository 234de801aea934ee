"""Test setup: 8 host devices (set before jax is imported) and shared helpers."""

import os
import shutil
import tempfile

# The tests check values, not the speed of the code XLA emits for the CPU: LLVM's O0 compiles
# faster (unless XLA_FLAGS names a level).
_FLAGS = os.environ.get("XLA_FLAGS", "")
if "xla_backend_optimization_level" not in _FLAGS:
  _FLAGS += " --xla_backend_optimization_level=0"
os.environ["XLA_FLAGS"] = (_FLAGS + " --xla_force_host_platform_device_count=8").strip()

# Many tests, and the scripts they run as subprocesses, compile the same programs: a
# compilation cache that lives for this run compiles each once (unless one is set already).
_CACHE = None
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
  _CACHE = tempfile.mkdtemp(prefix="zinfjax-tests-jit-")
  os.environ["JAX_COMPILATION_CACHE_DIR"] = _CACHE
  os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
  os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "-1")

import jax  # noqa: E402
import pytest  # noqa: E402

from placements import ZERO3, Placement, placed  # noqa: E402

SLOW = os.path.join(os.path.dirname(__file__), "slow.txt")


def pytest_sessionfinish(session, exitstatus):
  if _CACHE is not None:
    shutil.rmtree(_CACHE, ignore_errors=True)


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
