"""Where existing weights come from: one `Tensor` per model leaf, read by region.

A `Tensor` has the leaf's logical shape and reads any box of it
(`read(index)`, a tuple of slices) as numpy, touching nothing else: an
in-memory array, one memory-mapped safetensors tensor, a transposed view of
one (`nn.Linear` weights are stored `[out, in]`, `nnx.Linear` kernels
`[in, out]`) or a stack of per-layer tensors (Hugging Face's
`model.layers.N.*` names, stacked on a `zinfjax.Stack`'s layer axis). The
loader (`weights/stream.py`) asks each for one rank's shard of one layer.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol, Sequence

import jax
import numpy as np
from flax import nnx

from ..partition import key_name

Index = tuple[slice, ...]


class Tensor(Protocol):
  """One leaf's existing value, readable by region."""

  shape: tuple[int, ...]
  dtype: np.dtype

  def read(self, index: Index) -> np.ndarray: ...


def _full(index: Index, ndim: int) -> Index:
  return tuple(index) + (slice(None),) * (ndim - len(index))


@dataclasses.dataclass(frozen=True)
class Array:
  """An array in memory (numpy, memory-mapped, or a `jax.Array`)."""

  value: Any

  @property
  def shape(self) -> tuple[int, ...]:
    return tuple(self.value.shape)

  @property
  def dtype(self) -> np.dtype:
    return np.dtype(self.value.dtype)

  def read(self, index: Index) -> np.ndarray:
    return np.asarray(self.value[_full(index, len(self.shape))])


@dataclasses.dataclass(frozen=True)
class Transposed:
  """`source` with its axes permuted by `perm` (as `np.transpose`)."""

  source: Tensor
  perm: tuple[int, ...] = (1, 0)

  @property
  def shape(self) -> tuple[int, ...]:
    return tuple(self.source.shape[p] for p in self.perm)

  @property
  def dtype(self) -> np.dtype:
    return self.source.dtype

  def read(self, index: Index) -> np.ndarray:
    index = _full(index, len(self.perm))
    inner = [slice(None)] * len(self.perm)
    for out_axis, p in enumerate(self.perm):
      inner[p] = index[out_axis]
    return np.transpose(self.source.read(tuple(inner)), self.perm)


@dataclasses.dataclass(frozen=True)
class Rows:
  """Rows `start:stop` of `source` (one projection of a fused one, e.g. Phi-3's `qkv_proj`)."""

  source: Tensor
  start: int
  stop: int

  def __post_init__(self):
    if not 0 <= self.start < self.stop <= self.source.shape[0]:
      raise ValueError(f"rows {self.start}:{self.stop} are not within the "
                       f"{self.source.shape[0]} rows of a tensor{origin(self.source)}.")

  @property
  def shape(self) -> tuple[int, ...]:
    return (self.stop - self.start, *self.source.shape[1:])

  @property
  def dtype(self) -> np.dtype:
    return self.source.dtype

  def read(self, index: Index) -> np.ndarray:
    index = _full(index, len(self.shape))
    rows = range(self.start, self.stop)[index[0]]
    return self.source.read((slice(rows.start, rows.stop, rows.step), *index[1:]))


@dataclasses.dataclass(frozen=True)
class Stacked:
  """Per-layer tensors of equal shape stacked on a new leading (layer) axis."""

  layers: Sequence[Tensor]

  def __post_init__(self):
    shapes = {tuple(t.shape) for t in self.layers}
    if len(shapes) != 1:
      raise ValueError(f"stacked layers must share one shape, got {sorted(shapes)}.")

  @property
  def shape(self) -> tuple[int, ...]:
    return (len(self.layers),) + tuple(self.layers[0].shape)

  @property
  def dtype(self) -> np.dtype:
    return self.layers[0].dtype

  def read(self, index: Index) -> np.ndarray:
    index = _full(index, len(self.shape))
    picked = range(len(self.layers))[index[0]]
    return np.stack([self.layers[i].read(index[1:]) for i in picked])


def is_tensor(x: Any) -> bool:
  return hasattr(x, "read") and hasattr(x, "shape") and hasattr(x, "dtype")


def as_tensor(x: Any) -> Tensor:
  if is_tensor(x):
    return x
  if isinstance(x, nnx.Variable):
    x = x[...]
  if hasattr(x, "shape") and hasattr(x, "dtype"):
    return Array(x)
  raise TypeError(f"a weight must be an array or a zinfjax.weights Tensor, got {type(x).__name__}.")


def as_tree(source: Any) -> Any:
  """A model, nnx state or nested dict of arrays/Tensors as a nested dict of `Tensor`s shaped like
  `nnx.to_pure_dict(nnx.state(model))`."""
  if isinstance(source, nnx.Module):
    source = nnx.state(source, nnx.Param)
  if isinstance(source, nnx.State):
    source = nnx.to_pure_dict(source)
  if not isinstance(source, dict):
    raise TypeError("params must be an nnx model, an nnx.State, or a nested dict of arrays "
                    f"(the model's nnx.to_pure_dict layout), got {type(source).__name__}.")
  return jax.tree.map(as_tensor, source, is_leaf=lambda x: is_tensor(x) or isinstance(x, nnx.Variable))


def match(plan, tree: Any, may_miss: frozenset[str] = frozenset()) -> list[Tensor | None]:
  """The source `Tensor` of every leaf of `plan`, in plan order (None for a leaf named in
  `may_miss` that `tree` lacks); a clear error, before anything is read, for a missing,
  unexpected or misshapen weight."""
  flat, _ = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_tensor)
  by_name = {"/".join(key_name(k) for k in path): t for path, t in flat}
  want = {leaf.name: leaf for leaf in plan.leaves}
  missing = sorted(set(want) - set(by_name) - set(may_miss))
  extra = sorted(set(by_name) - set(want))
  if missing or extra:
    raise ValueError(
        "the weights do not match the model: "
        + (f"missing {_some(missing)}" if missing else "")
        + ("; " if missing and extra else "")
        + (f"unexpected {_some(extra)}" if extra else "")
        + ". Give a tree shaped like nnx.to_pure_dict(nnx.state(model)) (names joined by '/'); "
        "new leaves such as LoRA adapters come from the model's initializers with "
        "init(..., init_missing=nnx.LoRAParam).")
  bad = [f"{n}: model {want[n].layout.shape}, weights {tuple(by_name[n].shape)}{origin(by_name[n])}"
         for n in want if n in by_name and tuple(by_name[n].shape) != tuple(want[n].layout.shape)]
  if bad:
    raise ValueError("the weights' shapes differ from the model's: " + "; ".join(bad[:8])
                     + (f" (and {len(bad) - 8} more)" if len(bad) > 8 else "") + ".")
  return [by_name.get(leaf.name) for leaf in plan.leaves]


def origin(t: Tensor) -> str:
  """Where a tensor comes from (" from tensor 'x' [2, 3] of FILE"), or "" for an array."""
  while True:
    if hasattr(t, "describe"):
      return f" from {t.describe()}"
    if isinstance(t, (Transposed, Rows)):
      t = t.source
    elif isinstance(t, Stacked):
      bad = [l for l in t.layers if hasattr(l, "describe")]
      if not bad:
        return ""
      return f" from {bad[0].describe()} and {len(bad) - 1} more" if len(bad) > 1 else \
          f" from {bad[0].describe()}"
    else:
      return ""


def _some(names: list[str]) -> str:
  return ", ".join(names[:6]) + (f" (and {len(names) - 6} more)" if len(names) > 6 else "")
