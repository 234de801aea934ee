"""The tiers a shard lives on, and a config's per-layer split of a stack over them.

`Tier` is the one place tiers are spelled: everything else names them through it.
"""

from __future__ import annotations

import enum
from typing import Any, Mapping


class Tier(str, enum.Enum):
  """Where a shard lives: HBM and pinned host memory (JAX memory kinds, held in `jax.Array`s),
  or the swap store on NVMe. Equal to its name as a string (configs and JSON speak strings).

  `HOST_STORE` is pinned host as the host pipeline keeps it (`host_optimizer="pipeline"`): a
  swap store in host RAM. Configs never name it; `ZeroConfig.with_host_pipeline` makes it."""

  DEVICE = "device"
  PINNED_HOST = "pinned_host"
  NVME = "nvme"
  HOST_STORE = "host_store"

  __hash__ = str.__hash__  # a key of a dict or set, found by its string too
  __str__ = lambda self: self.value  # noqa: E731 - printed, formatted and repr'd as the string
  __format__ = lambda self, spec: format(self.value, spec)  # noqa: E731
  __repr__ = lambda self: repr(self.value)  # noqa: E731

  @property
  def holds_arrays(self) -> bool:
    """A tier of `jax.Array`s (a JAX memory kind), not a swap store."""
    return self in (Tier.DEVICE, Tier.PINNED_HOST)

  @property
  def medium(self) -> "Tier":
    """The memory a shard on this tier takes: HBM, host RAM (pinned_host) or the drive."""
    return Tier.PINNED_HOST if self is Tier.HOST_STORE else self

  @property
  def memory_kind(self) -> str:
    """The JAX memory kind of an array on this tier."""
    if not self.holds_arrays:
      raise ValueError(f"{self.value} shards live in a swap store, not in a JAX memory kind.")
    return self.value


TIERS = (Tier.DEVICE, Tier.PINNED_HOST, Tier.NVME)  # the tiers a config names
# a per-layer split: (tier, layers or fraction of each stack's layers), the last one None (the rest)
TierSplit = tuple[tuple[Tier, "int | float | None"], ...]


def parse_split(value: Any, name: str) -> TierSplit:
  """A tier, a split string ("device:2,pinned_host") or a dict/pairs, as a `TierSplit`."""
  if isinstance(value, str):
    pairs = []
    for item in value.split(","):
      tier, _, amount = item.strip().partition(":")
      pairs.append((tier.strip(), _amount(amount.strip(), name) if amount else None))
  elif isinstance(value, Mapping):
    pairs = list(value.items())
  elif isinstance(value, (tuple, list)):
    pairs = [tuple(p) for p in value]
  else:
    raise ValueError(f"ZeroConfig.{name} must be one of {TIERS} or a per-layer split such as "
                     f"'device:2,pinned_host', got {value!r}.")
  example = f"e.g. {name}='pinned_host:0.25,nvme' (the first quarter of each stack's layers in " \
            "pinned host, the rest on NVMe)"
  tiers = [p[0] for p in pairs]
  bad = [t for t in tiers if t not in TIERS and t is not Tier.HOST_STORE]
  if bad or not pairs:
    raise ValueError(f"ZeroConfig.{name} must be one of {TIERS} or a per-layer split of them, "
                     f"got {value!r}; {example}.")
  if len(set(tiers)) != len(tiers):
    raise ValueError(f"ZeroConfig.{name}={value!r} names a tier twice; name each tier once, "
                     f"{example}.")
  for tier, amount in pairs[:-1]:
    ok = (isinstance(amount, int) and not isinstance(amount, bool) and amount >= 0) or (
        isinstance(amount, float) and 0.0 <= amount <= 1.0)
    if not ok:
      raise ValueError(f"ZeroConfig.{name}={value!r}: {tier!r} needs a layer count (int >= 0) or "
                       f"a fraction of the layers (0.0 to 1.0); {example}.")
  if pairs[-1][1] is not None and len(pairs) > 1:
    raise ValueError(f"ZeroConfig.{name}={value!r}: the last tier ({pairs[-1][0]!r}) takes the "
                     f"remaining layers, so give it no amount; {example}.")
  return tuple((Tier(t), a) for t, a in pairs[:-1]) + ((Tier(pairs[-1][0]), None),)


def _amount(text: str, name: str) -> int | float:
  try:
    if text.endswith("%"):
      return float(text[:-1]) / 100
    return float(text) if "." in text else int(text)
  except ValueError:
    raise ValueError(f"ZeroConfig.{name}: {text!r} is neither a layer count nor a fraction "
                     "(write 2, 0.25 or 25%).") from None


def split_tiers(split: TierSplit) -> tuple[Tier, ...]:
  return tuple(t for t, _ in split)
