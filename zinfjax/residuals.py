"""A layer's backward residuals saved by the forward scan, so backward need not recompute it.

With `ZeroConfig.layer_residuals="recompute"` the ZeRO-3 layer scan keeps
only each layer's input and backward runs the whole block again (a third
more compute). Otherwise the forward pass pulls back each layer with
`jax.vjp` and keeps residuals:

* "save": all of them, the block's every activation (layer norms' fp32
  intermediates and an activation function's included);
* "dots": only the outputs of its matrix products (those without batch
  dims: the dense layers); backward recomputes the cheap rest from them (the
  layer norms, the activation function, attention's fused forward). For a
  GPT block about a fifth of "save"'s bytes: compiled for an H100
  (scripts/compile_gpu.py, 8 x 2048 at 16k tokens) its step writes 30% fewer
  bytes to HBM than under "save", for 1% more products;
* "auto": "dots" where the stack's fit the budget, else recompute.

Residuals that backward has anyway, the layer's gathered params (gathered
again in backward, as every ZeRO-3 layer is), its input and the call's
extra args, are not kept: they are named by their position among those
values, and only the others (the block's activations) are stacked over the
layers.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp

from .partition import is_layout

MODES = ("recompute", "save", "dots", "auto")
# what jax.checkpoint saves in each saving mode (None: everything the pullback holds)
POLICIES: dict[str, Callable | None] = {
    "save": None, "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable}


def saving(mode: str) -> str | None:
  """The saving mode a scan under `mode` traces its pullback with ("auto": "dots", whose
  residuals `keep` then weighs against the budget), None for "recompute"."""
  return "dots" if mode == "auto" else mode if mode in POLICIES else None


@jax.tree_util.register_pytree_node_class
@dataclasses.dataclass(eq=False)
class Residuals:
  """One layer's pullback: its structure (static), per residual leaf the index of a value
  backward has (`known`) or -1, and the leaves kept (arrays, stacked over layers by the scan)."""

  treedef: Any
  sources: tuple[int, ...]
  kept: list

  def tree_flatten(self):
    return list(self.kept), (self.treedef, self.sources)

  @classmethod
  def tree_unflatten(cls, aux, children):
    return cls(aux[0], aux[1], list(children))

  @property
  def nbytes(self) -> int:
    return sum(math.prod(x.shape) * x.dtype.itemsize for x in self.kept)


@dataclasses.dataclass(frozen=True)
class Layer:
  """One layer of a scan as backward differentiates it: which params are trained, which
  per-call args are floats (their cotangents add up over layers). `plan` is the scan's
  `gather.ScanPlan`."""

  layouts: list
  treedef: Any
  flags: list          # per param leaf: trained
  trained: list        # indices of the trained param leaves
  diff: list           # indices of the float args (their cotangents add up over layers)
  arg_leaves: list
  arg_tree: Any

  @classmethod
  def of(cls, plan, args: tuple) -> "Layer":
    layouts, treedef = jax.tree.flatten(plan.layouts, is_leaf=is_layout)
    flags = [True] * len(layouts) if plan.trainable is None else jax.tree.leaves(plan.trainable)
    arg_leaves, arg_tree = jax.tree.flatten(args)
    return cls(layouts, treedef, flags, [k for k, f in enumerate(flags) if f],
               [i for i, a in enumerate(arg_leaves) if _inexact(a)], arg_leaves, arg_tree)

  def block(self, plan, full: list) -> Callable:
    """The layer as a function of (trained params, input, arg leaves), the rest closed over."""
    def fn(trained_params, h, leaves):
      params = [None if f else x for x, f in zip(full, self.flags)]
      for k, p in zip(self.trained, trained_params):
        params[k] = p
      return plan.apply(jax.tree.unflatten(self.treedef, params), h,
                        jax.tree.unflatten(self.arg_tree, leaves))
    return fn

  def pull(self, plan, full: list, h: jax.Array, mode: str = "save") -> tuple[jax.Array, Callable]:
    """The layer's output and pullback (to trained params, input, float args), holding the
    residuals saving `mode` keeps."""
    def f(t, h, d):
      leaves = list(self.arg_leaves)
      for k, a in zip(self.diff, d):
        leaves[k] = a
      return self.block(plan, full)(t, h, leaves)
    if POLICIES[mode] is not None:
      f = jax.checkpoint(f, policy=POLICIES[mode])
    return jax.vjp(f, [full[k] for k in self.trained], h, [self.arg_leaves[k] for k in self.diff])

  def known(self, full: list, h: jax.Array) -> list:
    """What backward has for a layer without saving it: its gathered params, input, args."""
    return list(full) + [h] + list(self.arg_leaves)


def split(pullback: Any, known: Sequence[Any]) -> Residuals:
  """`pullback` (from `jax.vjp`) with the residuals that are `known` values (by identity)
  replaced by their index."""
  leaves, treedef = jax.tree.flatten(pullback)
  sources, kept = [], []
  for r in leaves:
    k = next((j for j, a in enumerate(known) if r is a), -1)
    sources.append(k)
    if k < 0:
      kept.append(r)
  return Residuals(treedef, tuple(sources), kept)


def pullback(res: Residuals, known: Sequence[Any]) -> Callable:
  """The pullback `split` took apart, with the `known` values of this layer put back."""
  kept = iter(res.kept)
  return jax.tree.unflatten(res.treedef, [next(kept) if k < 0 else known[k] for k in res.sources])


def device_budget(state_bytes: int = 0) -> int:
  """Bytes the saved residuals may take where "auto" is asked, on the first device: the
  `free_share` of its memory limit, or 0 (recompute) where the platform reports none (CPU)."""
  try:
    stats = jax.devices()[0].memory_stats() or {}
  except Exception:  # noqa: BLE001  (a platform without memory stats)
    stats = {}
  return free_share(stats.get("bytes_limit", 0), state_bytes)


def free_share(limit: int, state_bytes: int, fraction: float = 0.5) -> int:
  """`fraction` of what a device's model states (`state_bytes`) leave of its memory `limit`:
  the rest is for the step's other temporaries."""
  return max(0, int((limit - state_bytes) * fraction))


def keep(mode: str, layer_bytes: int, layers: int, budget: int) -> bool:
  """Whether a stack's scan keeps residuals of `layer_bytes` a layer: always where a saving
  mode was asked for, never for "recompute", and under "auto" when all its layers' fit in
  `budget` bytes."""
  if mode == "auto":
    return layer_bytes * layers <= budget
  return mode in POLICIES


def _inexact(x) -> bool:
  return jnp.issubdtype(jnp.result_type(x), jnp.inexact)
