"""Threefry on XLA:CPU at memory speed, with the same bits.

JAX lowers its threefry2x32 hash for XLA:CPU as a rolled loop of five steps, so
each step reads and writes the whole counter array again; on other platforms it
uses the straight-line form, which XLA fuses into one pass. Both forms compute
the same integer ops, so the bits are the same; on a 2-core VM the straight
form draws normals 4x faster (1.33 against 0.33 GB/s of fp32), which makes a
random init bound by the disk instead of the RNG.

`unrolled_threefry()` swaps JAX's CPU lowering rule for the straight one while
programs are lowered inside it, and `jit_unrolled(f, ...)` is `jax.jit` whose
lowering always happens inside it. With a JAX whose internals differ both are
no-ops: the draws are then slower, never different.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Callable, Iterator

import jax

_lock = threading.Lock()
_depth = 0
_saved: Any = None


def _rule():
  """(JAX's lowering table for CPU, threefry's primitive, its straight-line rule), or None
  where this JAX keeps them elsewhere."""
  try:
    from jax._src.interpreters import mlir
    try:
      from jax._src.random import threefry2x32 as tf
    except ImportError:  # JAX before the random package
      from jax._src import prng as tf
    table = mlir._platform_specific_lowerings["cpu"]
    return table, tf.threefry2x32_p, tf._threefry2x32_lowering_rule
  except (ImportError, AttributeError, KeyError, TypeError):
    return None


def _install(prim, rule) -> bool:
  """Register `rule` as `prim`'s CPU lowering (out of line where this JAX can); whether it
  could."""
  from jax._src.interpreters import mlir
  try:
    try:
      mlir.register_lowering(prim, rule, platform="cpu", inline=False)
    except TypeError:  # a JAX without `inline`
      mlir.register_lowering(prim, rule, platform="cpu")
    return True
  except Exception:  # a registry that differs: JAX's own lowering stays
    return False


@contextlib.contextmanager
def unrolled_threefry() -> Iterator[bool]:
  """Programs lowered inside use the straight-line threefry on CPU; yields whether it could.

  The swap is process-wide while any such block is open (reentrant, thread-safe). A program
  another thread lowers meanwhile only draws faster: its bits are the same."""
  global _depth, _saved
  found = _rule()
  if found is None:
    yield False
    return
  table, prim, straight = found
  with _lock:
    swapped = _depth > 0  # else the first open block swaps the rule in, keeping JAX's
    if not swapped:
      _saved = table.get(prim)
      swapped = _install(prim, straight)
    _depth += swapped
  if not swapped:
    yield False
    return
  try:
    yield True
  finally:
    with _lock:
      _depth -= 1
      if _depth == 0:
        if _saved is None:
          table.pop(prim, None)
        else:
          table[prim] = _saved
        _saved = None


class _Jitted:
  """`jax.jit(f, **kw)` that is lowered inside `unrolled_threefry()` (on a call or `.lower`)."""

  def __init__(self, f: Callable, **kw):
    self._jit = jax.jit(f, **kw)

  def __call__(self, *args):
    with unrolled_threefry():
      return self._jit(*args)

  def lower(self, *args):
    with unrolled_threefry():
      return self._jit.lower(*args)


def jit_unrolled(f: Callable, **kw) -> _Jitted:
  """`jax.jit(f, **kw)` whose threefry draws use the straight-line lowering on CPU."""
  return _Jitted(f, **kw)
