"""Two swap stores as one: the host-RAM store's shards and the drive's, each key in its tier's.

Under `host_optimizer="pipeline"` with states on NVMe too, the pinned-host shards
live in a store in host RAM (`Tier.HOST_STORE`) and the NVMe ones in the drive's
store (`Tier.NVME`). `MixedStore` routes every call on a key to the store its
tier names (the plan's `key_tier`), splits the calls on many keys, and spans
both with one transaction, so the step, the host pipeline and checkpoints use
it as they use one store. The XLA custom calls name a store by handle: each
segment's calls take its tier's (`handle_for`).
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

import numpy as np

from ..placement import Tier
from .store import AioStore, Ticket


class MixedStore:
  """`stores` (one per tier in `Tier.NVME` / `Tier.HOST_STORE`) as one; `tier_of(key)` names the
  tier of a key's shard. Closes both on `close()`."""

  def __init__(self, stores: Mapping[Tier, AioStore], tier_of: Callable[[str], Tier]):
    self.stores, self._tier_of = dict(stores), tier_of

  def of(self, key: str) -> AioStore:
    """The store that keeps `key`'s shard."""
    return self.stores[self._tier_of(key)]

  def handle_for(self, tier: Tier) -> int:
    """The engine handle of the store of `tier`, for the XLA custom calls of its segments."""
    return self.stores[tier].handle

  def _by_store(self, items: Sequence[tuple[str, Any]]) -> list[tuple[AioStore, list]]:
    """`items` (key first) grouped by the store that keeps their keys."""
    groups: dict[Tier, list] = {}
    for item in items:
      groups.setdefault(self._tier_of(item[0]), []).append(item)
    return [(self.stores[tier], group) for tier, group in groups.items()]

  @property
  def folder(self) -> str:
    return self.stores[Tier.NVME].folder

  @property
  def memory(self) -> bool:
    """False: some shards are on the drive (`lends` says which are updated in place)."""
    return False

  def lends(self, key: str) -> bool:
    """Whether `key`'s shard is updated where it lies: the RAM store's (`AioStore.lends`)."""
    return self.of(key).lends(key)

  def view(self, key: str) -> np.ndarray:
    return self.of(key).view(key)

  def stage(self, key: str) -> tuple[np.ndarray, np.ndarray]:
    return self.of(key).stage(key)

  def write(self, key: str, array: np.ndarray) -> Ticket:
    return self.of(key).write(key, array)

  def write_zeros(self, key: str, zeros: np.ndarray) -> Ticket:
    return self.of(key).write_zeros(key, zeros)

  def read(self, key: str, out: np.ndarray | None = None) -> Ticket:
    return self.of(key).read(key, out)

  def write_many(self, items: Sequence[tuple[str, np.ndarray]]) -> Ticket:
    """One job per store; one ticket for both."""
    return _joined([s.write_many(group) for s, group in self._by_store(items)], None)

  def read_many(self, items: Sequence[tuple[str, np.ndarray]]) -> Ticket:
    """One job per store; `wait()` returns the arrays in `items`' order."""
    tickets = [s.read_many(group) for s, group in self._by_store(items)]
    return _joined(tickets, [out for _, out in items])

  def entry(self, key: str) -> dict:
    return self.of(key).entry(key)

  def generation(self, key: str) -> int:
    return self.of(key).generation(key)

  def wait_generation(self, key: str, generation: int, timeout_s: float) -> bool:
    return self.of(key).wait_generation(key, generation, timeout_s)

  def keys(self) -> list[str]:
    return [k for s in self.stores.values() for k in s.keys()]

  def sync(self) -> None:
    for s in self.stores.values():
      s.sync()

  # one transaction over both stores: a step's writes in RAM and on the drive stand or fall together
  def begin(self, prefixes: Sequence[str]) -> None:
    for s in self.stores.values():
      s.begin(prefixes)

  def commit(self) -> None:
    for s in self.stores.values():
      s.commit()

  def rollback(self, keys: Sequence[str] | None = None) -> None:
    for s in self.stores.values():
      if s.in_transaction:
        s.rollback(keys)

  @property
  def in_transaction(self) -> bool:
    return any(s.in_transaction for s in self.stores.values())

  @property
  def allocated_bytes(self) -> int:
    """Bytes the drive's swap files hold."""
    return self.stores[Tier.NVME].allocated_bytes

  @property
  def bytes_moved(self) -> tuple[int, int]:
    moved = [s.bytes_moved for s in self.stores.values()]
    return sum(r for r, _ in moved), sum(w for _, w in moved)

  def defer_errors(self, on: bool = True) -> None:
    for s in self.stores.values():
      s.defer_errors(on)

  def raise_deferred(self) -> None:
    for s in self.stores.values():
      s.raise_deferred()

  def stats(self) -> dict:
    """The drive store's stats, with `bytes_used` summed over both and each store's under its
    tier's name."""
    out = dict(self.stores[Tier.NVME].stats())
    parts = {str(t): s.stats() for t, s in self.stores.items()}
    return {**out, **parts, "bytes_used": sum(p["bytes_used"] for p in parts.values())}

  @property
  def closed(self) -> bool:
    return all(s.closed for s in self.stores.values())

  def close(self) -> None:
    for s in self.stores.values():
      s.close()


def _joined(tickets: list[Ticket], result: Any) -> Ticket:
  def finish():
    for t in tickets:
      t.wait()
    return result

  return Ticket(finish, tickets)


def store_handle(store: Any, tier: Tier) -> int:
  """The engine handle of the store that keeps `tier`'s shards (`store` itself unless mixed)."""
  return store.handle_for(tier) if isinstance(store, MixedStore) else store.handle


def used_by_medium(store: Any) -> dict[Tier, int]:
  """Bytes the swap store's shards take, by medium (pinned_host for host RAM, nvme)."""
  stores = store.stores if isinstance(store, MixedStore) else {
      Tier.HOST_STORE if store.memory else Tier.NVME: store}
  return {t.medium: s.stats()["bytes_used"] for t, s in stores.items()}
