"""Registers the engine's XLA FFI handlers (CPU) once per process, at import."""

import jax

from . import _engine


def register() -> None:
  for name, capsule in _engine.registrations().items():
    jax.ffi.register_ffi_target(name, capsule, platform="cpu")


register()
