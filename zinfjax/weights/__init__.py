"""Existing weights into a zinfjax run: sources readable by region, safetensors, streaming."""

from . import safetensors
from .source import Array, Stacked, Tensor, Transposed, as_tree, is_tensor
from .layers import stack_layers, unstack_layers
from .stream import existing_weights, stream_states

__all__ = ["Array", "Stacked", "Tensor", "Transposed", "as_tree", "is_tensor", "safetensors",
           "existing_weights", "stream_states", "stack_layers", "unstack_layers"]
