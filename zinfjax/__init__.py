"""zinfjax: ZeRO-Infinity for JAX."""

from .config import ZeroConfig
from .layers import Stack
from .mesh import make_mesh
from .train import TrainState, init, make_train_step, train_step

__all__ = ["ZeroConfig", "Stack", "TrainState", "init", "make_mesh", "make_train_step",
           "train_step"]
