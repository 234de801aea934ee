"""The offload tiers: swap stores for NVMe and the XLA custom calls that reach them."""

from . import swap
from .store import (AioStore, CorruptShardError, EngineError, MissingShardError, NoSpaceError,
                    PoolExhaustedError, ShardMismatchError, StoreLockedError, SwapStore,
                    TensorstoreStore, Ticket, open_store)

__all__ = ["AioStore", "TensorstoreStore", "SwapStore", "Ticket", "open_store", "swap",
           "EngineError", "NoSpaceError", "CorruptShardError", "MissingShardError",
           "ShardMismatchError", "StoreLockedError", "PoolExhaustedError"]
