"""Token data: a char-level tokenizer for text files, nanoGPT-style uint16 `.bin` files and
`.npy` arrays of token ids (any integer dtype: vocabularies past 65536)."""

from __future__ import annotations

import dataclasses
import os
from typing import Iterator

import numpy as np


@dataclasses.dataclass(frozen=True)
class CharTokenizer:
  """Byte-free character tokenizer: ids are positions in the sorted alphabet of a text."""

  alphabet: str

  @classmethod
  def from_text(cls, text: str) -> "CharTokenizer":
    return cls("".join(sorted(set(text))))

  @property
  def vocab_size(self) -> int:
    return len(self.alphabet)

  def encode(self, text: str) -> np.ndarray:
    table = {c: i for i, c in enumerate(self.alphabet)}
    try:
      return np.fromiter((table[c] for c in text), dtype=np.uint16, count=len(text))
    except KeyError as e:
      raise ValueError(f"character {e.args[0]!r} is not in the tokenizer's alphabet.") from None

  def decode(self, ids) -> str:
    return "".join(self.alphabet[int(i)] for i in ids)


def load_tokens(path: str | os.PathLike, vocab_size: int | None = None) -> tuple[np.ndarray, int]:
  """Tokens and vocabulary size of `path`.

  A `.bin` file holds nanoGPT-style uint16 token ids, a `.npy` file a 1-D
  array of integer ids of any width (`np.save`), both memory-mapped, not read
  whole; their vocabulary is `vocab_size` (default: the GPT-2 size, 50257).
  Any other file is read as UTF-8 text and tokenized by characters.
  """
  path = os.fspath(path)
  if not os.path.isfile(path):
    raise FileNotFoundError(
        f"no data file at {path!r}; pass --data with a text file or a uint16 .bin token file.")
  size = os.path.getsize(path)
  if size == 0:
    raise ValueError(f"data file {path} is empty: give a text file or a token file (a uint16 "
                     ".bin, a .npy).")
  if path.endswith((".bin", ".npy")):
    tokens = _npy_tokens(path) if path.endswith(".npy") else _bin_tokens(path, size)
    vocab = vocab_size or 50257
    if len(tokens) and int(tokens.max()) >= vocab:
      raise ValueError(f"{path} holds token id {int(tokens.max())} >= vocab_size {vocab}.")
    if len(tokens) and np.issubdtype(tokens.dtype, np.signedinteger) and int(tokens.min()) < 0:
      raise ValueError(f"{path} holds token id {int(tokens.min())}: ids are never negative.")
    return tokens, vocab
  try:
    with open(path, encoding="utf-8") as f:
      text = f.read()
  except UnicodeDecodeError as e:
    raise ValueError(
        f"data file {path} is not UTF-8 text (byte {e.start}: {e.object[e.start:e.start + 1]!r}): "
        "convert it (e.g. `iconv -f latin1 -t utf-8`), or give token ids in a file named *.bin "
        "(uint16) or *.npy.") from None
  if "\x00" in text:
    raise ValueError(f"data file {path} holds NUL bytes: it looks binary, not text. A token file "
                     "is named *.bin (uint16 ids) or *.npy.")
  tokenizer = CharTokenizer.from_text(text)
  return tokenizer.encode(text), tokenizer.vocab_size


def _bin_tokens(path: str, size: int) -> np.ndarray:
  """A nanoGPT-style .bin's uint16 ids; refused when its bytes read as wider ids (uint32 ids
  below 65536 leave every other uint16 zero), which would train on [id, 0, id, 0, ...]."""
  if size % 2:
    raise ValueError(
        f"data file {path} has {size} bytes, not a whole number of uint16 token ids (2 bytes "
        "each): it is truncated, or not a nanoGPT-style .bin token file.")
  tokens = np.memmap(path, dtype=np.uint16, mode="r")
  head = np.asarray(tokens[:1 << 16])
  if len(head) >= 64 and not head[1::2].any() and head[0::2].any():
    raise ValueError(
        f"data file {path} reads as uint16 ids with every other one 0: it holds wider ids "
        "(uint32 or int32), which a .bin file cannot say. Save them with np.save as a .npy "
        "file (its dtype is kept), or as uint16 if every id is below 65536.")
  return tokens


def _npy_tokens(path: str) -> np.ndarray:
  """A .npy file's token ids, memory-mapped: a 1-D array of integers."""
  try:
    tokens = np.load(path, mmap_mode="r", allow_pickle=False)
  except ValueError as e:
    raise ValueError(f"data file {path} is not a .npy array of token ids ({e}).") from None
  if tokens.ndim != 1 or not np.issubdtype(tokens.dtype, np.integer):
    raise ValueError(f"data file {path} holds a {tokens.dtype} array of shape {tokens.shape}: "
                     "token ids are a 1-D array of integers (np.save(path, ids)).")
  return tokens


@dataclasses.dataclass
class TokenDataset:
  """Random windows of `seq_len + 1` tokens, as `{"inputs", "targets"}` int32 batches.

  Batch `i` depends only on (`seed`, `i`), so a resumed run continues the
  same stream: set `step` to the number of batches already used.
  """

  tokens: np.ndarray
  seq_len: int
  batch_size: int
  seed: int = 0
  step: int = 0

  def __post_init__(self):
    for name in ("seq_len", "batch_size"):
      value = getattr(self, name)
      if not (isinstance(value, (int, np.integer)) and value >= 1):
        raise ValueError(f"TokenDataset.{name} must be a positive int, got {value!r}.")
    if len(self.tokens) <= self.seq_len + 1:
      raise ValueError(
          f"data has {len(self.tokens)} tokens, too few for seq_len={self.seq_len}.")

  def __iter__(self) -> Iterator[dict[str, np.ndarray]]:
    return self

  def __next__(self) -> dict[str, np.ndarray]:
    batch = self.at(self.step)
    self.step += 1
    return batch

  def at(self, step: int) -> dict[str, np.ndarray]:
    """The batch of step `step` (0-based)."""
    rng = np.random.default_rng([self.seed, step])
    starts = rng.integers(0, len(self.tokens) - self.seq_len - 1, size=self.batch_size)
    windows = np.stack([np.asarray(self.tokens[s:s + self.seq_len + 1]) for s in starts])
    windows = windows.astype(np.int32)
    return {"inputs": windows[:, :-1], "targets": windows[:, 1:]}
