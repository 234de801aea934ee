"""GPU tests: run on one CUDA GPU (scripts/gpu_check.sh), skipped with the reason elsewhere.

fp32 matmuls run at full precision here (no TF32), so placements can be compared
with the all-device run to 1e-5.
"""

import os

# XLA:GPU adds with atomics where it may (the embedding's gradient is a scatter-add; cuDNN's
# attention backward in 16 bits), so two runs of one step can differ in the last bits: seen on
# an H200, 1.6e-6 relative in a loss and 6e-8 in a restored run's third step. Some tests here
# compare two paths bit for bit: deterministic ops make that a check of the paths alone. Set
# before the GPU backend starts; the child processes the tests start inherit it.
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           " --xla_gpu_deterministic_ops=true").strip()

import jax  # noqa: E402
import pytest  # noqa: E402


def gpus() -> list:
  if os.environ.get("ZINFJAX_GPU_TESTS_ON_CPU"):  # dry run of the test code itself (no CUDA path)
    return jax.devices("cpu")
  try:
    return jax.devices("gpu")
  except RuntimeError:  # no CUDA backend in this jax, or no GPU/driver on this machine
    return []


# tests of the paths that have not yet passed on a GPU run first, so a check cut at its time
# limit (scripts/gpu_check.sh's deadline) has run them; the others keep their file order
FIRST = ("test_cuda_handlers_are_registered", "test_cuda_swap_handlers_are_bit_exact",
         "test_host_pipeline_trains_like_all_device", "test_grads_through_the_copy_stream",
         "test_mixed_store_trains_like_all_device", "test_cudnn_attention_equals_the_explicit",
         "test_gemma3_layers_take_fused_attention", "test_blocked_explicit_attention")


def priority(item) -> int:
  return next((i for i, name in enumerate(FIRST) if item.name.startswith(name)), len(FIRST))


def pytest_collection_modifyitems(config, items):
  # this hook sees the whole session's items: reorder the GPU tests among their own places
  places = [i for i, item in enumerate(items) if item.get_closest_marker("gpu")]
  for i, item in zip(places, sorted((items[i] for i in places), key=priority)):  # stable sort
    items[i] = item
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
