"""Means over the whole global batch from a rank's loss: ignored items weigh nothing.

A zinfjax step runs the loss function on each rank's slice of the batch and
averages the ranks' losses. When a loss is a mean over the items it scores
(the targets that are not ignored: padding, a prompt's tokens), ranks score
different numbers of items, and the mean of their means weighs an item on a
rank with few scored items more than one on a rank with many: the step would
train differently from one device on the whole batch. A loss that divides
its sum by `mean_divisor(count)` instead of by `count` is the mean over every
scored item of the global batch, in the step as on one device.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Iterator

import jax
import jax.numpy as jnp
from jax import lax

_RANKS: contextvars.ContextVar = contextvars.ContextVar("zinfjax_ranks", default=None)


@contextlib.contextmanager
def over_ranks(axis: str, ranks: int) -> Iterator[None]:
  """Inside (a step's `shard_map`, whose loss the `ranks` ranks of `axis` average),
  `mean_divisor` counts the items of every rank."""
  token = _RANKS.set((axis, ranks))
  try:
    yield
  finally:
    _RANKS.reset(token)


def mean_divisor(count: jax.Array) -> jax.Array:
  """What a rank divides its loss summed over `count` scored items by, so that the average of
  the ranks' losses is the mean over the scored items of the whole batch: their number (at
  least 1: nothing scored averages to 0) per rank inside a zinfjax step, else `count` (at
  least 1)."""
  count = jnp.asarray(count, jnp.float32)
  ranks = _RANKS.get()
  if ranks is None:
    return jnp.maximum(count, 1.0)
  axis, n = ranks
  return jnp.maximum(lax.psum(count, axis), 1.0) / n
