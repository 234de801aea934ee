"""Optimizers whose states live on device, pinned host or NVMe (optax-compatible)."""

from .adam import NvmeAdamState, OffloadAdamState, adam, adamw
from .kernel import isa

__all__ = ["adam", "adamw", "OffloadAdamState", "NvmeAdamState", "isa"]
