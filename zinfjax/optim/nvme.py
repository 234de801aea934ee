"""The NVMe tier of `adamw(offload="nvme")`: the one AdamW driver over the params' shapes.

The fp32 master params and both moments of each leaf are cut into sub-groups
of at most `sub_group_size` elements (small leaves packed together), stored
in the swap store under the engine's key scheme and streamed through the
driver's rotating pinned buffers (`stream.StreamAdam`): host memory for the
states is three buffer sets of one sub-group, 3 x 12 bytes x sub_group_size
(3 x 8 with bf16 moments), whatever the model size.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from ..offload.store import AioStore
from ..placement import PREFIX, shard_key
from .kernel import AdamConstants
from .stream import SLOTS, STATES, Part, StreamAdam, pack_units


class NvmeAdam(StreamAdam):
  """Host side of `adamw(offload="nvme")`: owns the store and the staging buffers."""

  def __init__(self, nvme_path, *, rank: int = 0, sub_group_size: int = 1 << 22,
               constants: AdamConstants, threads: int = 0, moment_dtype=np.float32,
               **store_options):
    if sub_group_size < 1024:
      raise ValueError(f"sub_group_size must be >= 1024 elements, got {sub_group_size}.")
    super().__init__(None, constants, np.float32, np.float32, threads, moment_dtype)
    self.path, self.rank, self.sub_group_size = nvme_path, rank, sub_group_size
    self.store_options = store_options
    self.shapes: list[tuple[int, ...]] = []
    self.names: list[str] = []

  def configure(self, shapes: Sequence[tuple[int, ...]], names: Sequence[str] | None = None) -> None:
    """Sub-groups for leaves of `shapes`; `names` (their paths) name their store keys."""
    self.shapes = [tuple(s) for s in shapes]
    self.names = list(names) if names is not None else [f"leaf{i}" for i in range(len(shapes))]
    g = self.sub_group_size
    parts = [Part(i, self.rank, start // g, min(g, n - start), start=start)
             for i, shape in enumerate(self.shapes)
             for n in [int(np.prod(shape, dtype=np.int64))]
             for start in range(0, max(n, 1), g)]
    units = pack_units(parts, [None] * len(self.shapes))
    largest = max((u.size for u in units), default=0)
    self.lay_out(units, SLOTS * sum(self._dtypes()[s].itemsize for s in STATES) * largest, STATES)
    if self.store is None:
      # init creates every state: start from an empty store
      self.store = AioStore(self.path, self.rank, **{"fresh": True, **self.store_options})

  def key(self, state: str, part: Part) -> str:
    """The engine's key scheme, with the sub-group's index within its leaf in place of the
    layer."""
    return shard_key(f"{PREFIX[state]}/{self.names[part.leaf]}", part.rank, part.layer)

  def host_init(self, *params: np.ndarray) -> np.ndarray:
    """Write the fp32 master copy of `params` and zero moments to NVMe."""
    pending: dict[int, list] = {}
    for k, p in enumerate(self.parts):
      for t in pending.pop(k - SLOTS, []):
        t.wait()
      pending[k] = self.write_part(p, _slice(params[p.leaf], p))
    for tickets in pending.values():
      for t in tickets:
        t.wait()
    self.store.sync()
    self.release_zeros()
    return np.int32(0)

  def host_step(self, weight_decays: Sequence[float], params_dtypes: Sequence[np.dtype],
                lr, bc1, bc2, step, *grads: np.ndarray) -> tuple[np.ndarray, ...]:
    """One AdamW step over every sub-group; returns the new params (in `params_dtypes`)."""
    outs = [np.empty(shape, dtype) for shape, dtype in zip(self.shapes, params_dtypes)]
    self.stream(float(lr), float(bc1), float(bc2), weight_decays,
                lambda p: _slice(grads[p.leaf], p), lambda p: _slice(outs[p.leaf], p),
                step=int(step))
    return tuple(outs)


def _slice(x: np.ndarray, part: Part) -> np.ndarray:
  """`part`'s elements of leaf `x`, flat (a view where `x` is contiguous)."""
  return np.asarray(x).reshape(-1)[part.start:part.start + part.size]
