"""`GPTConfig`, the named presets (GPT-2 sizes and the ZeRO-Infinity paper's models) and the
standard count of a training step's FLOPs (the MFU numerator).

Plain Python (no jax or flax): the torch peer (`scripts/peer_deepspeed.py`) loads it alone.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence


def check_lora_rank(owner: str, rank: int) -> None:
  """A LoRA rank is an int >= 0 (0: no adapters)."""
  if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
    raise ValueError(f"{owner}.lora_rank must be an int >= 0 (0: no adapters), got {rank!r}.")


def attention_flops(tokens: int, seq_len: int, width: int, windows: Sequence[int | None]) -> int:
  """Causal attention's FLOPs over `tokens` tokens in sequences of `seq_len`, one layer per entry
  of `windows` (None: full attention): q·k and p·v, 2 FLOPs per multiply-add, forward and
  backward, so 12 · T · keys · width per layer, `width` being the queries' (heads x head dim).

  `keys` is the keys a query sees on average: s/2 when full (the standard 12·L·T·s·d / 2); with
  a window of w < s keys, w - w²/(2s) (the first w queries ramp up as in the full case, the
  rest see w).
  """
  # 12 · T · (w - w²/2s) · width = 6 · T · width · (2sw - w²) / s, in ints: exact when full
  seen = [seq_len if w is None else min(w, seq_len) for w in windows]
  return sum(6 * tokens * width * (2 * seq_len * w - w * w) // seq_len for w in seen)


def train_flops(matmul_params: int, tokens: int, seq_len: int, width: int,
                windows: Sequence[int | None], frozen: bool = False) -> int:
  """6 · `matmul_params` · T plus the causal attention of `attention_flops`; 4 · N · T when the
  params are `frozen` (LoRA's base weights: backward carries grads through them to the
  activations, but takes none for them; the adapters' few FLOPs are left out)."""
  return (4 if frozen else 6) * matmul_params * tokens + attention_flops(tokens, seq_len, width,
                                                                         windows)


@dataclasses.dataclass(frozen=True)
class GPTConfig:
  """Shape of a GPT: pre-LN blocks, learned positions, GELU MLP 4x, tied embedding.

  Attributes:
    vocab_size: number of token ids (any size; ZeRO pads it when sharding).
    seq_len: longest sequence (size of the position table).
    num_layers: transformer blocks, stacked on one layer axis.
    num_heads: attention heads; must divide `hidden`.
    hidden: model width (the paper's hd).
    remat: recompute each block in backward, keeping one checkpoint per block.
    lora_rank: > 0 makes every projection of the blocks an `nnx.LoRALinear` of this rank
      (adapters `nnx.LoRAParam`, train them with `ZeroConfig(trainable=nnx.LoRAParam)`).
  """

  vocab_size: int = 65
  seq_len: int = 64
  num_layers: int = 2
  num_heads: int = 4
  hidden: int = 64
  remat: bool = True
  lora_rank: int = 0

  def __post_init__(self):
    for name in ("vocab_size", "seq_len", "num_layers", "num_heads", "hidden"):
      value = getattr(self, name)
      if not isinstance(value, int) or value < 1:
        raise ValueError(f"GPTConfig.{name} must be a positive int, got {value!r}.")
    check_lora_rank("GPTConfig", self.lora_rank)
    if self.hidden % self.num_heads:
      raise ValueError(
          f"GPTConfig.hidden={self.hidden} is not divisible by num_heads="
          f"{self.num_heads}; pick a head count that divides the width.")

  @property
  def num_params(self) -> int:
    """Exact parameter count (tied embedding counted once; LoRA adapters not counted)."""
    d, v, t, l = self.hidden, self.vocab_size, self.seq_len, self.num_layers
    block = (d * 3 * d + 3 * d) + (d * d + d) + (d * 4 * d + 4 * d) + (4 * d * d + d) + 4 * d
    return v * d + t * d + l * block + 2 * d

  def train_flops(self, tokens: int, seq_len: int | None = None, frozen: bool = False) -> int:
    """FLOPs of one training step over `tokens` tokens in sequences of `seq_len` (default the
    config's), counted the standard way (`train_flops`): 6·N·T plus causal attention's
    12·L·T·s·d / 2 (4·N·T with `frozen` params: LoRA's)."""
    s = self.seq_len if seq_len is None else seq_len
    return train_flops(self.num_params, tokens, s, self.hidden, [None] * self.num_layers, frozen)

  def replace(self, **changes) -> "GPTConfig":
    return dataclasses.replace(self, **changes)


# name -> (layers, hidden, heads); seq_len 1024, GPT-2 vocabulary unless said.
_SIZES = {
    "gpt2-small": (12, 768, 12),
    "gpt2-medium": (24, 1024, 16),
    "gpt2-large": (36, 1280, 20),
    "gpt2-xl": (48, 1600, 25),
    # ZeRO-Infinity, Table 1 and Appendix Table 4 (hidden "K" = 1024).
    "1.4b": (40, 1536, 16),
    "2.5b": (32, 2560, 32),
    "10b": (50, 4096, 16),
    "13b": (64, 4096, 16),
    "20b": (98, 4096, 32),
    "50b": (62, 8192, 64),
    "100b": (125, 8192, 64),
    "0.5t": (124, 18432, 128),
    "1t": (128, 25600, 256),
    "5t": (174, 49152, 384),
    "10t": (200, 65536, 512),
    "20t": (205, 90112, 704),
}

PRESETS: dict[str, GPTConfig] = {
    "tiny": GPTConfig(vocab_size=65, seq_len=64, num_layers=2, num_heads=4, hidden=64),
    "small": GPTConfig(vocab_size=65, seq_len=256, num_layers=6, num_heads=6, hidden=384),
    **{name: GPTConfig(vocab_size=50257, seq_len=1024, num_layers=l, num_heads=h, hidden=d)
       for name, (l, d, h) in _SIZES.items()},
}


def get_config(name: str, **overrides) -> GPTConfig:
  """The preset `name` with `overrides` applied; a clear error for unknown names."""
  try:
    config = PRESETS[name]
  except KeyError:
    raise ValueError(
        f"Unknown GPT preset {name!r}. Choose one of: {', '.join(PRESETS)}; "
        "or pass --layers/--hidden/--heads.") from None
  overrides = {k: v for k, v in overrides.items() if v is not None}
  return config.replace(**overrides) if overrides else config
