"""Checkpoint chunk files moved by the engine: plain zarr3, both ways with tensorstore."""

import os

import ml_dtypes
import numpy as np
import pytest
import tensorstore as ts

from zinfjax import _engine
from zinfjax.checkpoint.zarr import Array, Grid, spec, write_chunks
from zinfjax.offload.aligned import aligned_empty


def make(path, shape, chunk, dtype=np.float32, codecs=None):
  s = spec(os.fspath(path), shape, dtype, chunk)
  if codecs is not None:
    s["metadata"]["codecs"] = codecs
  return ts.open(s).result()


def random(shape, dtype=np.float32, seed=0):
  return np.random.default_rng(seed).standard_normal(shape).astype(dtype)


def crc32c_reference(data: bytes) -> int:
  """CRC-32C one byte at a time, from its definition (reflected polynomial 0x82F63B78)."""
  table = []
  for i in range(256):
    c = i
    for _ in range(8):
      c = (c >> 1) ^ (0x82F63B78 if c & 1 else 0)
    table.append(c)
  c = 0xFFFFFFFF
  for b in data:
    c = (c >> 8) ^ table[(c ^ b) & 0xFF]
  return c ^ 0xFFFFFFFF


def test_crc32c_is_castagnoli():
  assert _engine.crc32c(b"123456789") == 0xE3069283  # the standard check value
  assert _engine.crc32c(b"") == 0
  x = random(1001)
  assert _engine.crc32c(x) != _engine.crc32c(x[:-1])
  # lengths around the engine's 3 x 8 KiB lanes, at an odd start
  data = np.random.default_rng(3).integers(0, 256, 3 * 3 * 8192 + 77, np.uint8)
  for start, stop in [(0, 3 * 8192), (1, 3 * 8192 + 1), (5, len(data)), (0, 3 * 8192 - 1)]:
    assert _engine.crc32c(data[start:stop]) == crc32c_reference(data[start:stop].tobytes())


@pytest.mark.parametrize("nbytes", [4, 4092, 4096, 5000, (9 << 20) + 12])
def test_files_in_place_match_the_staged_path(tmp_path, nbytes):
  """A payload in an aligned buffer with room (`sizes`) is written and read with no staging
  copy: the files are byte for byte those of the staged path, and read back the same."""
  payload = random(nbytes // 4, seed=nbytes).view(np.uint8)
  room = aligned_empty(_engine.align_up(nbytes + 4), np.uint8)
  room[:nbytes] = payload
  staged, in_place = os.fspath(tmp_path / "staged"), os.fspath(tmp_path / "in_place")
  _engine.write_files([staged], [payload.copy()])
  _engine.write_files([in_place], [room], sizes=[nbytes])
  with open(staged, "rb") as a, open(in_place, "rb") as b:
    assert a.read() == b.read()
  assert os.path.getsize(in_place) == nbytes + 4
  for path in (staged, in_place):
    out = aligned_empty(_engine.align_up(nbytes + 4), np.uint8)
    out.fill(7)
    _engine.read_files([path], [out], sizes=[nbytes])
    np.testing.assert_array_equal(out[:nbytes], payload)
  with pytest.raises(_engine.EngineError, match="less than its size"):
    _engine.read_files([in_place], [room[:8]], sizes=[nbytes + 8])
  flipped = aligned_empty(_engine.align_up(nbytes + 4), np.uint8)
  with open(in_place, "r+b") as f:  # a damaged byte is refused on the in-place path too
    f.seek(nbytes // 2)
    byte = f.read(1)
    f.seek(nbytes // 2)
    f.write(bytes([byte[0] ^ 1]))
  with pytest.raises(_engine.CorruptShardError, match="CRC-32C"):
    _engine.read_files([in_place], [flipped], sizes=[nbytes])


@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16])
def test_engine_writes_what_tensorstore_reads(tmp_path, dtype):
  """Whole chunks (edge chunks cut by the shape included) written by the engine."""
  shape, chunk = (3, 10, 7), (1, 4, 7)
  make(tmp_path / "a", shape, chunk, dtype)
  grid = Grid.of(os.fspath(tmp_path / "a"))
  assert grid is not None and grid.chunk == chunk and grid.dtype == np.dtype(dtype)
  data = random(shape, dtype)
  whole = (slice(0, 2), slice(0, 10), slice(0, 7))
  write_chunks([(grid, whole, [(whole, data[:2])]),
                (grid, (slice(2, 3), slice(4, 10), slice(0, 7)), [((slice(2, 3), slice(4, 10), slice(0, 7)), data[2:, 4:])])])
  write_chunks([(grid, (slice(2, 3), slice(0, 4), slice(0, 7)), [((slice(2, 3), slice(0, 4), slice(0, 7)), data[2:, :4])])])
  got = make_open(tmp_path / "a").read().result()
  np.testing.assert_array_equal(got, data)


def test_chunks_gathered_from_shards_on_any_axis(tmp_path):
  """Chunks made by the engine from shards split on the last axis (each chunk's rows
  interleave the shards), the last shard padded past the shape, as devices hold them."""
  shape, chunk = (3, 5, 10), (1, 5, 10)
  make(tmp_path / "a", shape, chunk)
  grid = Grid.of(os.fspath(tmp_path / "a"))
  data = random(shape, seed=3)
  parts = []
  for k in range(3):  # 4 columns each: the last shard's 2 columns past the shape are padding
    region = (slice(0, 3), slice(0, 5), slice(4 * k, 4 * k + 4))
    shard = np.full((3, 5, 4), np.nan, np.float32)
    shard[..., :min(4, 10 - 4 * k)] = data[..., 4 * k:4 * k + 4]
    parts.append((region, shard))
  write_chunks([(grid, (slice(0, 3), slice(0, 5), slice(0, 10)), parts)])
  np.testing.assert_array_equal(make_open(tmp_path / "a").read().result(), data)
  with pytest.raises(ValueError, match="not covered"):  # a shard missing: refused, not zeroed
    write_chunks([(grid, (slice(0, 3), slice(0, 5), slice(0, 10)), parts[:2])])


def test_chunks_scattered_into_every_target(tmp_path):
  """One read fills several buffers (device shards, one padded past the shape, one of another
  dtype) with their parts of each chunk."""
  shape, chunk = (4, 6, 5), (2, 6, 5)
  arr = make(tmp_path / "a", shape, chunk)
  data = random(shape, seed=4)
  special = np.array([0x7FC00000, 0xFFC00001, 0x7F800000, 0x7F7FFFFF, 0x00000001, 0x80008000,
                      0x3F808000, 0x3F818000, 0x3F80FFFF], np.uint32).view(np.float32)
  data[1:3, 0, :] = special[:5]  # NaNs, inf, the largest float, denormals, halfway cases
  data[2:4, 1, :4] = special[5:].reshape(1, 4).repeat(2, 0)
  arr.write(data).result()
  stored = Array(os.fspath(tmp_path / "a"))
  boxes = [(slice(0, 4), slice(0, 6), slice(2 * k, 2 * k + 2)) for k in range(3)]
  outs = [np.zeros((4, 6, 2), np.float32) for _ in boxes]
  cast = np.zeros((4, 6, 2), ml_dtypes.bfloat16)
  stored.scatter((slice(1, 4), slice(0, 6), slice(0, 5)), list(zip(boxes, outs)) + [(boxes[1], cast)])
  for box, out in zip(boxes, outs):
    want = np.zeros((4, 6, 2), np.float32)
    inside = data[1:, :, box[2]]
    want[1:, :, :inside.shape[-1]] = inside
    np.testing.assert_array_equal(out, want)
  # cast by the engine as numpy casts (round to nearest even, NaN kept), bit for bit
  np.testing.assert_array_equal(cast[1:].view(np.uint16),
                                data[1:, :, 2:4].astype(ml_dtypes.bfloat16).view(np.uint16))
  ints = np.zeros((4, 6, 2), np.int32)  # any other cast is numpy's
  with np.errstate(invalid="ignore"):  # NaN to int
    stored.scatter((slice(0, 4), slice(0, 6), slice(0, 5)), [(boxes[0], ints)])
    np.testing.assert_array_equal(ints, data[..., :2].astype(np.int32))


def test_engine_box_copies_match_numpy(tmp_path):
  """Strided, reversed, transposed and bfloat16 boxes copied into and out of a file's payload;
  copies that do not fit are refused before any I/O."""
  rng = np.random.default_rng(5)
  nbytes = 6 * 8 * 4
  room = _engine.align_up(nbytes + 4)
  buf = aligned_empty(room, np.uint8)
  payload = buf[:nbytes].view(np.float32).reshape(6, 8)
  a, b = rng.random((3, 8), dtype=np.float32), rng.random((10, 16), dtype=np.float32)
  path = os.fspath(tmp_path / "x")
  _engine.write_files([path], [buf], sizes=[nbytes], copies=[[(payload[:3], a), (payload[3:], b[2:5, 1::2])]])
  want = np.concatenate([a, b[2:5, 1::2]])
  out = np.zeros((6, 8), np.float32)
  _engine.read_files([path], [out])
  np.testing.assert_array_equal(out, want)
  into = aligned_empty(room, np.uint8)
  read = into[:nbytes].view(np.float32).reshape(6, 8)
  t, r = np.zeros((8, 6), np.float32), np.zeros((20, 20), np.float32)
  bf = np.zeros((6, 16), ml_dtypes.bfloat16)
  _engine.read_files([path], [into], sizes=[nbytes], copies=[[
      (t.T, read), (r[::-2, 3:11][:6], read), (bf, into[:nbytes].view(ml_dtypes.bfloat16).reshape(6, 16))]])
  np.testing.assert_array_equal(t.T, want)
  np.testing.assert_array_equal(r[::-2, 3:11][:6], want)
  np.testing.assert_array_equal(bf.view(np.uint16), want.view(np.uint16).reshape(6, 16))
  frozen = np.zeros((6, 8), np.float32)
  frozen.flags.writeable = False
  for copy, match in [((t, read), "shapes or dtypes"), ((read, bf[:, :8]), "shapes or dtypes"),
                      ((t.T, out), "outside"),
                      ((frozen, read), "read-only")]:
    with pytest.raises(_engine.EngineError, match=match):
      _engine.read_files([path], [into], sizes=[nbytes], copies=[[copy]])
  with pytest.raises(_engine.EngineError, match="outside"):  # a gather must fill the payload
    _engine.write_files([path], [buf], sizes=[nbytes], copies=[[(out, payload)]])


def make_open(path):
  return ts.open(spec(os.fspath(path))).result()


def test_engine_reads_what_tensorstore_wrote_any_region(tmp_path):
  shape, chunk = (4, 9, 6), (1, 4, 3)
  arr = make(tmp_path / "a", shape, chunk)
  data = random(shape, seed=1)
  arr.write(data).result()
  stored = Array(os.fspath(tmp_path / "a"))
  assert stored.grid is not None
  for region in [(slice(0, 4), slice(0, 9), slice(0, 6)), (slice(1, 2), slice(4, 8), slice(0, 3)),
                 (slice(1, 3), slice(2, 9), slice(1, 5)), (slice(3, 4), slice(8, 9), slice(5, 6))]:
    np.testing.assert_array_equal(stored.read(region)(), data[region])


def test_a_damaged_or_truncated_chunk_is_refused(tmp_path):
  arr = make(tmp_path / "a", (2, 8), (1, 8))
  arr.write(random((2, 8))).result()
  stored = Array(os.fspath(tmp_path / "a"))
  path = stored.grid.file((1, 0))
  raw = bytearray(open(path, "rb").read())
  raw[5] ^= 1
  open(path, "wb").write(bytes(raw))
  with pytest.raises(_engine.CorruptShardError, match="CRC-32C"):
    stored.read((slice(0, 2), slice(0, 8)))()
  open(path, "wb").write(bytes(raw[:-3]))
  with pytest.raises(_engine.CorruptShardError, match="bytes, expected"):
    stored.read((slice(1, 2), slice(0, 8)))()
  np.testing.assert_array_equal(stored.read((slice(0, 1), slice(0, 8)))(),
                                arr[0:1].read().result())  # the sound chunk still reads


def test_other_layouts_and_partial_chunks_go_through_tensorstore(tmp_path):
  # compressed chunks: not plain, read and written by tensorstore
  codecs = [{"name": "bytes", "configuration": {"endian": "little"}},
            {"name": "zstd", "configuration": {"level": 1}}]
  make(tmp_path / "z", (4, 6), (2, 3), codecs=codecs)
  stored = Array(os.fspath(tmp_path / "z"))
  assert stored.grid is None and stored.shape == (4, 6) and stored.chunk == (2, 3)
  data = random((4, 6), seed=2)
  stored.write((slice(0, 4), slice(0, 6)), [((slice(0, 4), slice(0, 6)), data)])()
  np.testing.assert_array_equal(stored.read((slice(1, 3), slice(2, 5)))(), data[1:3, 2:5])
  # a plain array, region cutting chunks: tensorstore writes it (read-modify-write)
  make(tmp_path / "p", (4, 6), (2, 3))
  plain = Array(os.fspath(tmp_path / "p"))
  plain.write((slice(0, 4), slice(0, 6)), [((slice(0, 4), slice(0, 6)), data)])()
  plain.write((slice(1, 2), slice(1, 2)), [((slice(1, 2), slice(1, 2)), np.full((1, 1), 7.0, np.float32))])()
  data[1, 1] = 7.0
  np.testing.assert_array_equal(make_open(tmp_path / "p").read().result(), data)


def test_a_failing_file_stops_the_call_with_its_name(tmp_path):
  """An error in one file of a call (no folder to create it in, a file missing) is raised
  naming it, after the call's other threads stop: nothing hangs."""
  nbytes = 3 << 20  # several files, each a piece, over the engine's threads
  bufs = [random((nbytes // 4,), seed=i) for i in range(12)]
  paths = [os.fspath(tmp_path / f"f{i}") for i in range(12)]
  paths[7] = os.fspath(tmp_path / "missing" / "f7")
  with pytest.raises(_engine.EngineError, match="missing/f7"):
    _engine.write_files(paths, bufs, 4)
  paths[7] = os.fspath(tmp_path / "f7")
  _engine.write_files(paths, bufs, 4)
  os.remove(paths[3])
  outs = [np.empty_like(b) for b in bufs]
  with pytest.raises(_engine.EngineError, match="f3"):
    _engine.read_files(paths, outs, 4)
