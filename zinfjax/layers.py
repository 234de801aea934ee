"""`Stack`: N copies of a block with parameters stacked on a leading layer axis.

A model that builds its repeated blocks with `Stack` runs them with `nnx.scan`
(one compiled block, whatever the depth), and lets zinfjax run the same blocks
layer by layer under ZeRO-3: zinfjax finds every `Stack` in a model and swaps
its scan for one that gathers each layer's shards just before use, releases
them right after, and prefetches the next layer (see `zinfjax.gather`).
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Callable, Iterator

import jax
import jax.numpy as jnp
from flax import nnx

from . import micro

_ONE_LAYER: contextvars.ContextVar = contextvars.ContextVar("zinfjax_one_layer", default=None)
_MICRO_BATCHES: contextvars.ContextVar = contextvars.ContextVar("zinfjax_micro", default=1)
_LAYER: contextvars.ContextVar = contextvars.ContextVar("zinfjax_layer", default=None)


@contextlib.contextmanager
def micro_batches(n: int) -> Iterator[None]:
  """Inside, every `Stack` runs each layer on `n` micro-batches in turn (see `zinfjax.micro`)."""
  token = _MICRO_BATCHES.set(n)
  try:
    yield
  finally:
    _MICRO_BATCHES.reset(token)


@contextlib.contextmanager
def one_layer(layer: int | jax.Array) -> Iterator[None]:
  """Inside, every `Stack` builds only block `layer` (kept on a leading axis of 1), drawn from
  the same random streams as the whole stack: its values equal the stack's `[layer]` bit for
  bit. Init uses it to draw a deep model one layer at a time, in one layer's memory."""
  token = _ONE_LAYER.set(layer)
  try:
    yield
  finally:
    _ONE_LAYER.reset(token)


@contextlib.contextmanager
def at_layer(index: jax.Array) -> Iterator[None]:
  """Inside, `layer_index()` is `index`: the scans that run a `Stack`'s blocks (its own and
  zinfjax's layer by layer ones) trace each block inside this."""
  token = _LAYER.set(index)
  try:
    yield
  finally:
    _LAYER.reset(token)


def layer_index() -> jax.Array:
  """The index in its `Stack` of the block being traced (an int32 scalar, traced): for blocks
  whose layers differ by more than their params, such as Gemma 3's sliding-window and global
  layers, which choose with it (`lax.cond`) while every layer stays one compiled block."""
  index = _LAYER.get()
  if index is None:
    raise RuntimeError("layer_index() was asked outside a Stack's layers: only a block that a "
                       "Stack runs (or zinfjax's layer scans in its place) knows its index.")
  return index


class Stack(nnx.Module):
  """`num_layers` blocks made by `make_block`, stacked on axis 0 and scanned.

  Args:
    make_block: `rngs -> nnx.Module`, one block; its `__call__(x, *args) -> x`
      keeps the shape of `x` (the carried activation); `args` (attention mask,
      positions, segment ids ...) are the same for every layer.
    num_layers: depth of the stack.
    rngs: randomness for the blocks' parameters (split once per layer).
    remat: recompute each block's activations in the backward pass, keeping
      only its input (one activation checkpoint per block).
  """

  def __init__(self, make_block: Callable[[nnx.Rngs], nnx.Module],
               num_layers: int, *, rngs: nnx.Rngs, remat: bool = True):
    if num_layers < 1:
      raise ValueError(f"Stack needs num_layers >= 1, got {num_layers}.")

    @nnx.vmap(in_axes=(0,), out_axes=0)
    def build(rngs: nnx.Rngs) -> nnx.Module:
      return make_block(rngs)

    layer = _ONE_LAYER.get()

    @nnx.split_rngs(splits=num_layers)
    def create(rngs: nnx.Rngs) -> nnx.Module:
      if layer is not None:  # the one layer's keys of every stream: a stack of 1
        graphdef, streams = nnx.split(rngs)
        rngs = nnx.merge(graphdef, jax.tree.map(
            lambda k: jax.lax.dynamic_slice_in_dim(k, layer, 1), streams))
      return build(rngs)

    self.block = create(rngs)
    self.num_layers = num_layers
    self.remat = remat

  def __call__(self, x: jax.Array, *args) -> jax.Array:
    def step(block: nnx.Module, x: jax.Array, args: tuple) -> jax.Array:
      return block(x, *args)

    if self.remat:
      step = nnx.remat(step)

    n = _MICRO_BATCHES.get()

    @nnx.scan(in_axes=(0, nnx.Carry, None, 0), out_axes=nnx.Carry)
    def run(block: nnx.Module, x: jax.Array, args: tuple, index: jax.Array) -> jax.Array:
      with at_layer(index):
        if n == 1:
          return step(block, x, args)
        # micro-batches in a plain scan over the layer's (pure) state, each recomputed alone
        graphdef, state = nnx.split(block)
        call = lambda state, x, args: nnx.merge(graphdef, state)(x, *args)
        if self.remat:
          call = jax.checkpoint(call)
        return micro.apply(lambda xm, am: call(state, xm, am), n, x, args)

    return run(self.block, x, args, jnp.arange(self.num_layers, dtype=jnp.int32))


def stack_paths(model: nnx.Module) -> tuple[tuple, ...]:
  """The paths of `model`'s `Stack`s (their leaves carry a leading layer axis)."""
  return tuple(tuple(path) for path, node in nnx.iter_graph(model) if isinstance(node, Stack))
