"""Per-layer weights (`layers.0.*`, `layers.1.*` ...) to a `Stack`'s stacked layout and back.

A model written with one module per layer gathers all its params at once
under ZeRO-3; rewritten with `zinfjax.Stack`, its blocks' weights live on one
leading layer axis. These helpers convert checkpoints between the two
layouts by name (lazily: stacking makes `Stacked` tensors read on use).
"""

from __future__ import annotations

import re
from typing import Any, Mapping

import jax
import numpy as np

from ..partition import key_name
from .source import Stacked, as_tensor, is_tensor


def _flat(tree: Any) -> dict[str, Any]:
  flat, _ = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_tensor)
  return {"/".join(key_name(k) for k in path): x for path, x in flat}


def stack_layers(weights: Mapping[str, Any], pattern: str = "layers.{i}.",
                 into: str = "layers/block/", sep: str = ".") -> dict[str, Any]:
  """Flat per-layer `weights` (names like `layers.3.mlp.fc.kernel`) as our names
  (`layers/block/mlp/fc/kernel`, stacked on axis 0); other names have `sep` turned into '/'."""
  regex = re.compile(re.escape(pattern).replace(re.escape("{i}"), r"(\d+)"))
  groups: dict[str, dict[int, Any]] = {}
  out: dict[str, Any] = {}
  for name, value in weights.items():
    m = regex.match(name)
    if m is None:
      out[name.replace(sep, "/")] = value
      continue
    suffix = name[m.end():].replace(sep, "/")
    groups.setdefault(suffix, {})[int(m.group(1))] = as_tensor(value)
  for suffix, layers in groups.items():
    n = max(layers) + 1
    if sorted(layers) != list(range(n)):
      missing = sorted(set(range(n)) - set(layers))
      raise ValueError(f"{pattern.format(i=missing[0])}{suffix.replace('/', sep)} is missing: "
                       f"the layers of {suffix!r} must be numbered 0..{n - 1}.")
    out[into + suffix] = Stacked([layers[i] for i in range(n)])
  return out


def unstack_layers(params: Any, stacked: str = "layers/block/", pattern: str = "layers.{i}.",
                   sep: str = ".") -> dict[str, np.ndarray]:
  """The inverse of `stack_layers`: a params tree (or flat dict) as flat per-layer names."""
  out: dict[str, np.ndarray] = {}
  for name, value in _flat(params).items():
    x = value.read(()) if is_tensor(value) else np.asarray(value)
    if not name.startswith(stacked):
      out[name.replace("/", sep)] = x
      continue
    suffix = name[len(stacked):].replace("/", sep)
    for i in range(x.shape[0]):
      out[pattern.format(i=i) + suffix] = x[i]
  return out
