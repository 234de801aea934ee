"""Token data: text through the char tokenizer, uint16 .bin and .npy token files, the
batches, and the errors a bad data file gets."""

import numpy as np
import pytest

from zinfjax.models import CharTokenizer, TokenDataset, load_tokens

from helpers import DATA


def test_char_tokenizer_round_trip():
  tokens, vocab = load_tokens(DATA)
  assert vocab == 65 and tokens.dtype == np.uint16 and len(tokens) > 1_000_000
  text = open(DATA, encoding="utf-8").read()[:500]
  tok = CharTokenizer.from_text(open(DATA, encoding="utf-8").read())
  assert tok.decode(tok.encode(text)) == text


def test_bin_tokens_are_memory_mapped(tmp_path):
  ids = np.random.default_rng(0).integers(0, 50257, 4096).astype(np.uint16)
  path = tmp_path / "train.bin"
  ids.tofile(path)
  tokens, vocab = load_tokens(path)
  assert isinstance(tokens, np.memmap) and vocab == 50257
  np.testing.assert_array_equal(tokens, ids)
  batch = next(TokenDataset(tokens, 32, 4, seed=0))
  assert batch["inputs"].shape == (4, 32) and batch["inputs"].dtype == np.int32
  np.testing.assert_array_equal(batch["inputs"][:, 1:], batch["targets"][:, :-1])


def test_missing_data_file_names_the_flag(tmp_path):
  with pytest.raises(FileNotFoundError, match="--data"):
    load_tokens(tmp_path / "nope.txt")


def test_a_dataset_of_empty_batches_is_refused():
  tokens = np.arange(100, dtype=np.uint16)
  for kwargs, named in [({"batch_size": 0}, "batch_size must be a positive int, got 0"),
                        ({"seq_len": 8.0}, "seq_len must be a positive int, got 8\\.0")]:
    with pytest.raises(ValueError, match=f"TokenDataset.{named}"):
      TokenDataset(**{"tokens": tokens, "seq_len": 8, "batch_size": 2, **kwargs})


@pytest.mark.parametrize("name,content,problem", [
    ("empty.txt", b"", "is empty"),
    ("empty.bin", b"", "is empty"),
    ("odd.bin", b"\x01\x00\x02", "has 3 bytes, not a whole number of uint16"),
    ("latin1.txt", "caf\u00e9 cr\u00e8me".encode("latin-1"), "is not UTF-8 text \\(byte 3"),
    ("binary.txt", b"ab\x00\x00cd", "holds NUL bytes"),
])
def test_bad_data_files_name_the_file_and_the_problem(tmp_path, name, content, problem):
  path = tmp_path / name
  path.write_bytes(content)
  with pytest.raises(ValueError, match=problem) as e:
    load_tokens(path)
  assert str(path) in str(e.value)


def test_npy_token_ids_of_any_width_and_wide_ids_in_a_bin_refused(tmp_path):
  """A .npy of token ids is read memory-mapped whatever its integer dtype (a vocabulary past
  65536); the same uint32 ids written raw as a .bin would train on [id, 0, id, 0, ...]: refused,
  saying to use .npy; a .npy that is not 1-D integers, or ids out of range, are refused."""
  ids = np.random.default_rng(0).integers(0, 150_000, 1000).astype(np.uint32)
  np.save(tmp_path / "ids.npy", ids)
  tokens, vocab = load_tokens(tmp_path / "ids.npy", 151_936)
  assert isinstance(tokens, np.memmap) and vocab == 151_936
  np.testing.assert_array_equal(tokens, ids)
  batch = TokenDataset(tokens, seq_len=8, batch_size=2).at(0)
  assert batch["inputs"].dtype == np.int32 and batch["inputs"].max() < 151_936
  small = ids % 60_000
  small.tofile(tmp_path / "wide.bin")
  with pytest.raises(ValueError, match="every other one 0: it holds wider ids .* np.save"):
    load_tokens(tmp_path / "wide.bin")
  small.astype(np.uint16).tofile(tmp_path / "ok.bin")
  np.testing.assert_array_equal(load_tokens(tmp_path / "ok.bin", 60_000)[0], small)
  for bad, problem in [(ids.reshape(10, 100), "shape \\(10, 100\\)"),
                       (ids.astype(np.float32), "float32 array"),
                       (np.array([3, -1, 4], np.int64), "token id -1"),
                       (ids, "token id \\d+ >= vocab_size 50257")]:
    np.save(tmp_path / "bad.npy", bad)
    with pytest.raises(ValueError, match=problem):
      load_tokens(tmp_path / "bad.npy")
  (tmp_path / "junk.npy").write_bytes(b"not an array at all")
  with pytest.raises(ValueError, match="is not a .npy array of token ids"):
    load_tokens(tmp_path / "junk.npy")
