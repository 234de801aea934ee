"""Registers the engine's XLA FFI handlers once per process, at import (CUDA ones with a GPU)."""

import jax

from . import _engine


def register() -> None:
  for name, capsule in _engine.registrations().items():
    jax.ffi.register_ffi_target(name, capsule, platform="cpu")
  if _has_gpu():
    from . import _engine_cuda  # built only where the CUDA toolkit was found
    for name, capsule in _engine_cuda.registrations().items():
      jax.ffi.register_ffi_target(name, capsule, platform="CUDA")


def _has_gpu() -> bool:
  try:
    return bool(jax.devices("gpu"))
  except RuntimeError:
    return False


register()
