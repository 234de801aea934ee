"""Optimizers whose states live on device, pinned host or NVMe (optax-compatible)."""

from .adam import NvmeAdamState, OffloadAdamState, adam, adamw
from .hyper import decay_matrices
from .kernel import isa

__all__ = ["adam", "adamw", "decay_matrices", "OffloadAdamState", "NvmeAdamState", "isa"]
