"""Checkpoints of a `TrainState` on every tier (orbax-checkpoint, zarr3 through tensorstore)."""

from .errors import CheckpointError, CheckpointMismatch
from .manager import FORMAT, Checkpointer, master_params

__all__ = ["Checkpointer", "CheckpointError", "CheckpointMismatch", "master_params", "FORMAT"]
