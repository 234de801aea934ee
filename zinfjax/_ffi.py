"""Registers the engine's XLA FFI handlers once per process, at import.

The CUDA handlers are registered wherever they were built (XLA keeps them for
its CUDA platform); nothing here touches a backend, so a multi-process run can
still call `jax.distributed.initialize` after `import zinfjax`.
"""

import jax

from . import _engine


def register() -> None:
  for name, capsule in _engine.registrations().items():
    jax.ffi.register_ffi_target(name, capsule, platform="cpu")
  try:
    from . import _engine_cuda  # built only where the CUDA toolkit was found
  except ImportError:  # not built, or its CUDA runtime is missing on this machine
    return
  for name, capsule in _engine_cuda.registrations(_engine.store_lookup()).items():
    jax.ffi.register_ffi_target(name, capsule, platform="CUDA")


register()
