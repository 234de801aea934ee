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


def test_handlers_built_for_a_newer_ffi_api_are_refused_before_jax_is_broken():
  """A build isolated from the installed jax takes the newest jax's FFI headers; XLA refuses such
  handlers when its backend starts (seen: API 0.5 handlers against jax 0.11's 0.4), and then no
  array can be made. Importing zinfjax says so first, with the fix; this build passes the check."""
  import pytest
  from zinfjax import _engine, _ffi
  built, installed = tuple(_engine.ffi_api_version()), _ffi.installed_ffi_api()
  assert installed is not None and built[1] <= installed[1]
  _ffi.check_ffi_api(built, installed)
  _ffi.check_ffi_api((0, 1), (0, 4))  # older handlers: the framework takes them
  with pytest.raises(ImportError, match=r"API 0\.5 .*runs API 0\.4.*--no-build-isolation"):
    _ffi.check_ffi_api((0, 5), (0, 4))
  with pytest.raises(ImportError, match="Rebuild zinfjax"):
    _ffi.check_ffi_api((1, 0), (0, 4))
