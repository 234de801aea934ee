"""Checkpoints of a `TrainState` on every tier (orbax-checkpoint, zarr3 through tensorstore)."""

from .handler import CheckpointError
from .manager import FORMAT, Checkpointer, master_params

__all__ = ["Checkpointer", "CheckpointError", "master_params", "FORMAT"]
