"""The offload tiers: swap stores for NVMe and the XLA custom calls that reach them."""

from . import swap
from .kvstore import TensorstoreStore, open_store
from .store import (AioStore, CorruptShardError, EngineError, MissingShardError, NoSpaceError,
                    PoolExhaustedError, ShardMismatchError, StoreLockedError, SwapStore, Ticket,
                    aligned_empty)

__all__ = ["AioStore", "TensorstoreStore", "SwapStore", "Ticket", "aligned_empty", "open_store", "swap",
           "EngineError", "NoSpaceError", "CorruptShardError", "MissingShardError",
           "ShardMismatchError", "StoreLockedError", "PoolExhaustedError"]
