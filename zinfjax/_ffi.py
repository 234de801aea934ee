"""Registers the engine's XLA FFI handlers once per process, at import.

The CUDA handlers are registered wherever they were built (XLA keeps them for
its CUDA platform); nothing here touches a backend, so a multi-process run can
still call `jax.distributed.initialize` after `import zinfjax`.
"""

from __future__ import annotations

import os
import re

import jax

from . import _engine


def installed_ffi_api() -> tuple[int, int] | None:
  """The XLA FFI API version of the installed jaxlib, read from the headers it ships (None where
  they are missing)."""
  try:
    with open(os.path.join(jax.ffi.include_dir(), "xla", "ffi", "api", "c_api.h")) as f:
      text = f.read()
  except (OSError, AttributeError):
    return None
  found = [re.search(rf"#define XLA_FFI_API_{part}\s+(\d+)", text) for part in ("MAJOR", "MINOR")]
  return (int(found[0][1]), int(found[1][1])) if all(found) else None


def check_ffi_api(built: tuple[int, int], installed: tuple[int, int] | None) -> None:
  """Raises ImportError where handlers of FFI API `built` cannot be registered with a jaxlib of
  API `installed`: XLA would refuse them when its backend starts, and then no jax array could be
  made in this process. A build isolated from the installed jax (plain `pip install`) takes the
  newest jax's headers."""
  if installed is None or (built[0] == installed[0] and built[1] <= installed[1]):
    return
  raise ImportError(
      f"zinfjax's XLA FFI handlers were built with FFI API {built[0]}.{built[1]} (the headers of "
      f"the jax present at build time), but the installed jax {jax.__version__} "
      f"runs API {installed[0]}.{installed[1]}: registering them would stop jax's backend from "
      "starting. Rebuild zinfjax against the installed jax: pip install --no-build-isolation "
      "--no-deps --force-reinstall <zinfjax source folder> (or upgrade jax and jaxlib).")


def register() -> bool:
  """Registers the CPU handlers, and the CUDA ones where they were built; returns whether
  those were."""
  check_ffi_api(tuple(_engine.ffi_api_version()), installed_ffi_api())
  cpu = _engine.registrations()
  for name, capsule in cpu.items():
    jax.ffi.register_ffi_target(name, capsule, platform="cpu")
  try:
    from . import _engine_cuda  # built only where the CUDA toolkit was found
  except ImportError:  # not built, or its CUDA runtime is missing on this machine
    return False
  for name, capsule in _engine_cuda.registrations(_engine.store_lookup()).items():
    jax.ffi.register_ffi_target(name, capsule, platform="CUDA")
  return True


# whether the CUDA swap handlers are registered (the host pipeline needs them on a GPU)
CUDA_HANDLERS = register()
