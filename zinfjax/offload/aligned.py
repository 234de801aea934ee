"""Host arrays whose data starts on the swap store's 4 KiB boundary."""

from __future__ import annotations

import numpy as np

from .. import _engine


def aligned_empty(shape, dtype) -> np.ndarray:
  """An uninitialized array whose data starts on a 4 KiB boundary.

  Transfers to and from such arrays skip the staging copy (zero-copy O_DIRECT).
  """
  dtype = np.dtype(dtype)
  nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
  raw = np.empty(nbytes + _engine.ALIGNMENT, np.uint8)
  start = -raw.ctypes.data % _engine.ALIGNMENT
  return raw[start:start + nbytes].view(dtype).reshape(shape)
