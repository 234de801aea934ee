"""Which loss functions are the same function, for the engine's cache of compiled steps.

A loop that passes `lambda m, b: loss(m, b)` or `functools.partial(loss, ...)`
to `train_step` makes a new function object every step. Cached by identity,
each one compiled a new step (seconds to minutes) and was kept forever. Two
functions are the same here when they run the same code on the same objects:
the same code, globals, defaults and closure cells, and the same objects under
the global names the code reads (each compared by identity, never by value,
so a changed closure, or a loop variable of a script that the lambda reads as
a global, compiles again), and likewise a `functools.partial`'s function and
arguments or a bound method's function and `self`. What functions it calls
read is baked in when the step is traced, as for any function under
`jax.jit`.
"""

from __future__ import annotations

import functools
import types
import warnings
from typing import Any, Callable, Hashable


class _Same:
  """An object compared and hashed by identity (held, so its id is not reused)."""

  __slots__ = ("obj",)

  def __init__(self, obj: Any):
    self.obj = obj

  def __eq__(self, other: Any) -> bool:
    return isinstance(other, _Same) and other.obj is self.obj

  def __hash__(self) -> int:
    return id(self.obj)


def _cells(fn: types.FunctionType) -> tuple:
  out = []
  for cell in fn.__closure__ or ():
    try:
      out.append(_Same(cell.cell_contents))
    except ValueError:  # a cell not yet filled
      out.append(_Same(cell))
  return tuple(out)


@functools.lru_cache(maxsize=None)
def _names(code: types.CodeType) -> tuple[str, ...]:
  """The global (and attribute) names `code` and the code nested in it read, sorted (once per
  code object: a key is made at every step)."""
  names = set(code.co_names)
  for const in code.co_consts:
    if isinstance(const, types.CodeType):
      names.update(_names(const))
  return tuple(sorted(names))


def _globals_read(fn: types.FunctionType) -> tuple:
  """(name, the object now under it) for each global `fn`'s code reads."""
  found = fn.__globals__
  return tuple((n, _Same(found[n])) for n in _names(fn.__code__) if n in found)


def fn_key(fn: Callable) -> Hashable:
  """A key equal for two callables that run the same code on the same objects."""
  if isinstance(fn, functools.partial):
    return ("partial", fn_key(fn.func), tuple(_Same(a) for a in fn.args),
            tuple(sorted((k, _Same(v)) for k, v in fn.keywords.items())))
  if isinstance(fn, types.MethodType):
    return ("method", fn_key(fn.__func__), _Same(fn.__self__))
  if isinstance(fn, types.FunctionType):
    kwdefaults = tuple(sorted((k, _Same(v)) for k, v in (fn.__kwdefaults__ or {}).items()))
    return ("function", fn.__code__, _Same(fn.__globals__),
            tuple(_Same(d) for d in fn.__defaults__ or ()), kwdefaults, _cells(fn),
            _globals_read(fn))
  return ("object", _Same(fn))


def code_of(key: tuple) -> Any:
  """The code a key runs (its innermost function's), or the object itself."""
  while key[0] in ("partial", "method"):
    key = key[1]
  return key[1] if key[0] == "function" else key[1].obj


class RecompileWarning(UserWarning):
  """A step compiled again for a new function running code already compiled."""


def warn_if_recompiled(cache: dict, key: tuple, what: str, fn: Callable) -> None:
  """Warns when `cache`, keyed by (kind, `fn_key`), already holds a step of `key`'s kind for
  its code under another key: the caller made a function that closes over other objects
  (e.g. a lambda capturing the step number), so each call compiles and keeps a new step."""
  code = code_of(key[1])
  same = sum(1 for k in cache if k[0] == key[0] and code_of(k[1]) is code)
  if same:
    name = getattr(code, "co_name", None) or getattr(fn, "__name__", type(fn).__name__)
    warnings.warn(
        f"{what} compiles again for a new loss function running the same code as {same} it "
        f"compiled before ({name!r}): its closure, defaults, partial arguments or the globals "
        "it reads hold other objects (a value that changes each step?). Each such function "
        "compiles and keeps its own step. Define the loss once outside the loop and pass what "
        "changes in the batch.",
        RecompileWarning, stacklevel=4)
