"""BUILD (Bazel) and ffi/CMakeLists.txt name the same C++ sources, and the engine imports."""

import os
import re

from helpers import REPO


def sources(text: str, pattern: str) -> set[str]:
  return set(re.findall(pattern, text))


def test_bazel_and_cmake_build_the_same_sources():
  cmake = open(os.path.join(REPO, "ffi", "CMakeLists.txt")).read()
  bazel = open(os.path.join(REPO, "BUILD")).read()
  in_cmake = {"ffi/" + s for s in sources(cmake, r"\b([\w/]+\.cc)\b")}
  in_bazel = sources(bazel, r'"(ffi/[\w/]+\.cc)"')
  assert in_cmake == in_bazel
  on_disk = {os.path.relpath(os.path.join(d, f), REPO).replace(os.sep, "/")
             for d, _, files in os.walk(os.path.join(REPO, "ffi")) for f in files if f.endswith(".cc")}
  assert on_disk == in_cmake, "every C++ source is built by both"


def test_engine_module_is_built_and_installed():
  from zinfjax import _engine
  assert _engine.ALIGNMENT == 4096
  assert _engine.align_up(1) == 4096 and _engine.align_up(8192) == 8192
  assert _engine.build_info()["cplusplus"] >= 201703


def test_cuda_module_when_the_toolkit_was_found():
  """Where CMake found CUDA, the handler module is built and loads without a GPU."""
  import importlib.util
  import pytest
  if importlib.util.find_spec("zinfjax._engine_cuda") is None:
    pytest.skip("built without the CUDA toolkit: CPU handlers only")
  from zinfjax import _engine, _engine_cuda
  # every swap call the CPU handlers serve (the scan's prefetch uses read_start/read_wait)
  handlers = _engine_cuda.registrations(_engine.store_lookup())
  assert set(handlers) == set(_engine.registrations()) - {"zinfjax_adamw"}  # AdamW runs on host
