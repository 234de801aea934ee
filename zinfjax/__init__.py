"""zinfjax: ZeRO-Infinity for JAX."""

try:
  from . import _engine  # noqa: F401  (the compiled C++ engine)
except ImportError as e:  # pragma: no cover - depends on how Python was started
  import os as _os
  raise ImportError(
      "zinfjax's compiled engine (zinfjax._engine) is missing: Python imported the source tree "
      f"at {_os.path.dirname(__file__)} instead of an installed zinfjax. Install it with "
      "`pip install .` and run Python from outside the repository root.") from e

from . import hostlimit as _hostlimit
_hostlimit.raise_default()  # before jax starts a GPU client: host tiers may use the machine's RAM
from . import _ffi, optim  # noqa: F401  (_ffi registers the XLA handlers)
from .config import ZeroConfig
from .layers import Stack, layer_index
from .mesh import make_mesh
from .tiling import TiledLinear, tile_matmuls
from .placement import Plan
from .state import HeldUpdateWarning, TrainState, UnusableStateError, abstract_init, init
from .step import make_train_step, train_step
from .evaluate import eval_step, make_eval_step
from .flush import flush_updates
from . import weights  # noqa: F401

__all__ = ["ZeroConfig", "HeldUpdateWarning", "Plan", "Stack", "TiledLinear", "tile_matmuls",
           "TrainState", "UnusableStateError", "abstract_init", "eval_step", "flush_updates",
           "init", "layer_index", "make_eval_step", "make_mesh", "make_train_step", "train_step",
           "weights"]
