"""Registers the engine's XLA FFI handlers once per process, at import.

The CUDA handlers are registered wherever they were built (XLA keeps them for
its CUDA platform); nothing here touches a backend, so a multi-process run can
still call `jax.distributed.initialize` after `import zinfjax`.
"""

import jax

from . import _engine


# CPU handlers also registered for the CUDA platform: XLA:GPU compiles host computations
# (`compute_on("device_host")`) in its own plugin, whose FFI registry holds CUDA handlers only;
# these run on host buffers alone (`kernel.adamw_host` with ZINFJAX_HOST_ADAM=ffi)
HOST_ON_CUDA = ("zinfjax_adamw",)


def register() -> None:
  cpu = _engine.registrations()
  for name, capsule in cpu.items():
    jax.ffi.register_ffi_target(name, capsule, platform="cpu")
  try:
    from . import _engine_cuda  # built only where the CUDA toolkit was found
  except ImportError:  # not built, or its CUDA runtime is missing on this machine
    return
  for name, capsule in _engine_cuda.registrations(_engine.store_lookup()).items():
    jax.ffi.register_ffi_target(name, capsule, platform="CUDA")
  for name in HOST_ON_CUDA:
    jax.ffi.register_ffi_target(name, cpu[name], platform="CUDA")


register()
