"""Checkpoints of a `TrainState` on every tier (orbax-checkpoint, zarr3 through tensorstore)."""

from .errors import CheckpointError, CheckpointMismatch
from .export import CheckpointParams, master_params
from .manager import FORMAT, Checkpointer

__all__ = ["Checkpointer", "CheckpointError", "CheckpointMismatch", "CheckpointParams",
           "master_params", "FORMAT"]
