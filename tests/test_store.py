"""Swap stores: bit-exact round trips on every backend, and every bad input's error."""

import os
import shutil
import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest

from zinfjax import _engine
from zinfjax.offload import (AioStore, CorruptShardError, EngineError, MissingShardError,
                             NoSpaceError, ShardMismatchError, StoreLockedError, aligned_empty,
                             open_store)

BACKENDS = {
    "aio-io_uring": lambda path: AioStore(path, backend="auto", block_size=64 << 10, queue_depth=8),
    "aio-threads": lambda path: AioStore(path, backend="threads", block_size=64 << 10),
    "aio-striped": lambda path: AioStore([path / "nvme0", path / "nvme1", path / "nvme2"],
                                         block_size=16 << 10, queue_depth=16),
    "tensorstore": lambda path: open_store("tensorstore", path),
}
DTYPES = [np.float32, ml_dtypes.bfloat16, np.float16, np.int8]


def random_array(rng, size, dtype):
  if np.dtype(dtype).kind == "i":
    return rng.integers(-128, 127, size).astype(dtype)
  return rng.standard_normal(size).astype(dtype)


@pytest.fixture(params=list(BACKENDS))
def store(request, tmp_path):
  s = BACKENDS[request.param](tmp_path)
  yield s
  s.close()


def test_round_trip_is_bit_exact(store):
  rng = np.random.default_rng(0)
  # sizes around and off 4 KiB multiples, a multi-block shard, a scalar-ish one
  sizes = [1, 3, 4095, 4097, 10_001, 300_007, 1 << 16]
  arrays = {f"shard{i}/{np.dtype(dt).name}": random_array(rng, n, dt)
            for i, n in enumerate(sizes) for dt in DTYPES}
  tickets = [store.write(k, a) for k, a in arrays.items()]  # all in flight together
  for t in tickets:
    t.wait()
  reads = {k: store.read(k) for k in arrays}
  for k, a in arrays.items():
    b = reads[k].wait()
    assert b.dtype == a.dtype and b.shape == a.shape
    assert a.tobytes() == b.tobytes(), k
  assert sorted(store.keys()) == sorted(arrays)


def test_rewrite_in_place_and_read_into(store):
  rng = np.random.default_rng(1)
  a, b = random_array(rng, (64, 33), np.float32), random_array(rng, (64, 33), np.float32)
  store.write("w", a).wait()
  store.write("w", b).wait()
  out = np.empty_like(b)
  assert store.read("w", out).wait() is out
  np.testing.assert_array_equal(out, b)


def test_aio_reports_backend_and_uses_io_uring(tmp_path):
  s = AioStore(tmp_path, backend="io_uring")
  assert s.backend == "io_uring"  # available on these kernels
  assert AioStore(tmp_path / "t", backend="threads").backend == "threads"
  assert s.stats()["direct"] is True


def test_striping_spreads_blocks_over_paths(tmp_path):
  paths = [tmp_path / f"nvme{i}" for i in range(3)]
  s = AioStore(paths, block_size=16 << 10)
  s.write("big", np.ones(3 * (16 << 10) // 4 * 4, np.float32)).wait()
  s.sync()
  sizes = [os.path.getsize(p / "rank0" / "swap.bin") for p in paths]
  assert all(size >= 4 * (16 << 10) for size in sizes), sizes  # every drive holds stripes


def test_every_stripe_folder_is_locked(tmp_path):
  """A second store sharing any stripe folder with a live one is refused (naming that folder),
  and takes no lock on the folders it did get to."""
  x, y, z = (tmp_path / n for n in "xyz")
  first = AioStore([x, y], block_size=16 << 10)
  with pytest.raises(StoreLockedError, match=f"swap folder {y}/rank0 is in use by this process "
                                             f"\\(pid {os.getpid()}\\)"):
    AioStore([z, y], block_size=16 << 10)
  AioStore([z], block_size=16 << 10).close()  # z was released when the second store failed
  first.close()
  AioStore([x, y], block_size=16 << 10).close()  # and close() releases every folder


def test_a_folder_named_twice_is_refused(tmp_path):
  """The same folder twice (or through a link) would stripe over itself and corrupt the store."""
  d = tmp_path / "d"
  with pytest.raises(EngineError, match="names the folder .* twice"):
    AioStore([d, d])
  (tmp_path / "link").symlink_to(d)
  with pytest.raises(EngineError, match="names the folder .* twice"):
    AioStore([d, tmp_path / "link"])
  AioStore([d]).close()  # nothing left locked


def test_manifest_survives_reopen(tmp_path):
  a = np.random.default_rng(2).standard_normal(5000).astype(np.float32)
  s = AioStore(tmp_path, rank=3)
  s.write("kept", a).wait()
  s.close()
  assert os.path.exists(tmp_path / "rank3" / "manifest.tsv")
  again = AioStore(tmp_path, rank=3)
  np.testing.assert_array_equal(again.read("kept").wait(), a)
  again.close()
  with pytest.raises(CorruptShardError, match="block size"):
    AioStore(tmp_path, rank=3, block_size=8192)


def test_a_store_whose_folder_was_removed_says_so_when_closed(tmp_path):
  """Not "disk full?": the folder is gone. The store is released all the same."""
  s = AioStore(tmp_path / "gone", block_size=16 << 10)
  s.write("x", np.arange(5000, dtype=np.float32)).wait()
  shutil.rmtree(tmp_path / "gone")
  with pytest.raises(EngineError, match="is gone .*close the run's state"):
    s.close()
  assert s.closed
  s.close()  # nothing left to do
  again = AioStore(tmp_path / "gone", block_size=16 << 10)  # and nothing left locked
  assert again.keys() == []
  again.close()


# ------------------------------------------------------------------ bad input

def written(store, key="x", n=20_000, dtype=np.float32):
  a = np.random.default_rng(3).standard_normal(n).astype(dtype)
  store.write(key, a).wait()
  store.sync()
  return a


def swap_file(store, key):
  if isinstance(store, AioStore):
    return os.path.join(store.folder, "swap.bin"), store.entry(key)["offset"]
  return os.path.join(store.folder, key), 0


def test_missing_key(store):
  with pytest.raises(MissingShardError, match="never written"):
    store.read("nope")


def test_dtype_or_shape_mismatch(store):
  written(store)
  with pytest.raises(ShardMismatchError, match="written as float32"):
    store.read("x", np.empty(20_000, ml_dtypes.bfloat16)).wait()
  with pytest.raises(ShardMismatchError, match="written as float32"):
    store.read("x", np.empty((100, 200), np.float32)).wait()


def test_corrupted_file(store):
  a = written(store)
  path, offset = swap_file(store, "x")
  with open(path, "r+b") as f:
    f.seek(offset + 1000)
    f.write(b"\xde\xad\xbe\xef")
  with pytest.raises(CorruptShardError, match="checksum mismatch.*corrupted"):
    store.read("x").wait()
  written(store, "y")  # the store keeps working for other shards
  assert store.read("y").wait().shape == a.shape


def test_short_file(store):
  written(store)
  path, offset = swap_file(store, "x")
  os.truncate(path, offset + 4096)
  with pytest.raises(CorruptShardError, match="truncated"):
    store.read("x").wait()


def test_no_space_is_clear_and_keeps_earlier_shards(tmp_path):
  s = AioStore(tmp_path, block_size=64 << 10)
  a = written(s, "early")
  s.engine.set_fault_free_bytes(100_000)  # test-only switch: pretend the disk is nearly full
  with pytest.raises(NoSpaceError, match=r"no space left .* needs \d+ more bytes"):
    s.write("big", np.ones(1 << 20, np.float32)).wait()
  np.testing.assert_array_equal(s.read("early").wait(), a)
  assert "big" not in s.keys()


def test_no_space_on_a_real_small_filesystem(tmp_path):
  mnt = tmp_path / "small"
  mnt.mkdir()
  if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)],
                    capture_output=True).returncode != 0:
    pytest.skip("mounting a small tmpfs needs root; the fault-switch test covers ENOSPC")
  s = None
  try:
    s = AioStore(mnt, block_size=64 << 10)
    a = written(s, "fits", n=50_000)
    with pytest.raises(NoSpaceError, match=str(mnt)):
      s.write("too-big", np.ones(2 << 20, np.float32)).wait()
    np.testing.assert_array_equal(s.read("fits").wait(), a)
  finally:
    if s is not None:
      s.close()
    subprocess.run(["umount", str(mnt)], capture_output=True)


def test_folder_in_use_by_another_process(tmp_path):
  holder = subprocess.Popen(
      [sys.executable, "-c", "import sys, zinfjax.offload as o; s = o.AioStore(sys.argv[1]); "
       "print('ready', flush=True); sys.stdin.read()", str(tmp_path)],
      stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=tmp_path)
  try:
    assert holder.stdout.readline().strip() == "ready"
    with pytest.raises(StoreLockedError, match=rf"in use by another process \(pid {holder.pid}\)"):
      AioStore(tmp_path)
  finally:
    holder.communicate("", timeout=60)
  AioStore(tmp_path).close()  # free again once the holder exits


def test_unwritable_or_missing_nvme_path(tmp_path):
  created = tmp_path / "does" / "not" / "exist"
  AioStore(created).close()
  assert (created / "rank0").is_dir()
  blocker = tmp_path / "file"
  blocker.write_text("not a folder")
  with pytest.raises(EngineError, match="cannot create nvme_path folder.*writable nvme_path"):
    AioStore(blocker / "sub")
  with pytest.raises(EngineError, match="writable nvme_path"):
    open_store("tensorstore", blocker / "sub")


def test_bad_store_options(tmp_path):
  with pytest.raises(EngineError, match="block_size must be a multiple of 4096"):
    AioStore(tmp_path, block_size=1000)
  with pytest.raises(EngineError, match="unknown aio backend"):
    AioStore(tmp_path / "b", backend="spdk")


# ---------------------------------------------------------------- pinned pool

def test_pool_reuses_buffers_within_budget():
  pool = _engine.PinnedPool(4 * 8192, 8192)
  assert pool.capacity == 4
  leases = [pool.acquire(1.0) for _ in range(4)]
  assert pool.try_acquire() is None
  with pytest.raises(TimeoutError, match=r"pool exhausted.*budget 32768 bytes.*raise the pinned"):
    pool.acquire(0.05)
  for lease in leases:
    lease.release()
  for _ in range(10):
    pool.acquire(1.0).release()
  stats = pool.stats()
  assert stats["allocated_bytes"] == 4 * 8192 and stats["peak_in_use_bytes"] == 4 * 8192
  assert stats["timeouts"] == 1 and stats["waits"] >= 1 and stats["acquires"] == 14
  lease = pool.acquire(1.0)
  view = memoryview(lease)
  assert view.nbytes == 8192 and np.frombuffer(view, np.uint8).ctypes.data % 4096 == 0


def test_store_staging_stays_within_its_budget(tmp_path):
  s = AioStore(tmp_path, block_size=64 << 10, queue_depth=32, pinned_budget=256 << 10)
  aligned = aligned_empty(1 << 20, np.float32)  # 4 KiB-aligned: zero-copy, no staging
  aligned[:] = 1.5
  s.write("aligned", aligned).wait()
  assert s.stats()["pool"]["acquires"] == 0
  # a view 4 bytes in is not 4 KiB-aligned: every block is staged through the pool
  sources = [np.arange((1 << 20) + 1, dtype=np.float32)[1:] for _ in range(4)]
  tickets = [s.write(f"k{i}", src) for i, src in enumerate(sources)]
  for t in tickets:
    t.wait()
  np.testing.assert_array_equal(s.read("k3").wait(), sources[3])
  pool = s.stats()["pool"]
  assert pool["allocated_bytes"] <= 256 << 10 and pool["peak_in_use_bytes"] <= 256 << 10
  assert pool["acquires"] >= 4 * (4 << 20) // (64 << 10)


def test_checksum_is_deterministic_and_sensitive():
  data = np.random.default_rng(4).integers(0, 255, 100_003).astype(np.uint8)
  assert _engine.checksum(data) == _engine.checksum(data.copy())
  flipped = data.copy()
  flipped[77_777] ^= 1
  assert _engine.checksum(flipped) != _engine.checksum(data)


def test_generation_counts_completed_writes_and_wakes_waiters(tmp_path):
  """The NVMe optimizer waits on these for grads a running backward pass writes."""
  import threading
  s = AioStore(tmp_path)
  x = np.random.default_rng(7).standard_normal(4096).astype(np.float32)
  assert s.generation("g/w/r0/l0") == 0
  assert not s.wait_generation("g/w/r0/l0", 1, 0.05)  # times out
  writer = threading.Timer(0.2, lambda: s.write("g/w/r0/l0", x).wait())
  writer.start()
  assert s.wait_generation("g/w/r0/l0", 1, 10.0)
  writer.join()
  s.write("g/w/r0/l0", x + 1).wait()
  assert s.generation("g/w/r0/l0") == 2
  np.testing.assert_array_equal(s.read("g/w/r0/l0").wait(), x + 1)
  s.close()


def test_grad_gate_fails_instead_of_waiting_forever(tmp_path):
  from zinfjax.optim.gate import GradGate
  s = AioStore(tmp_path)
  gate = GradGate(s, ["g/w/r0/l0"], program_done=lambda: True)
  assert not gate.ready("g/w/r0/l0")
  with pytest.raises(RuntimeError, match="finished without writing grad shard 'g/w/r0/l0'"):
    gate.wait("g/w/r0/l0", poll_s=0.05)
  s.write("g/w/r0/l0", np.ones(8, np.float32)).wait()
  assert gate.ready("g/w/r0/l0")
  s.close()


def test_many_shards_in_one_transfer(tmp_path):
  """write_many / read_many move several shards (odd sizes, several blocks, mixed dtypes) as
  one job: bit-exact, each shard checked and published on its own."""
  store = AioStore(tmp_path, block_size=16 << 10, queue_depth=4)
  rng = np.random.default_rng(5)
  arrays = {f"m/{i}": random_array(rng, n, dt)
            for i, (n, dt) in enumerate([(1, np.float32), (4097, ml_dtypes.bfloat16),
                                         (100_003, np.float32), (3 << 14, np.int8)])}
  before = {k: store.generation(k) for k in arrays}
  store.write_many(list(arrays.items())).wait()
  assert all(store.generation(k) == before[k] + 1 for k in arrays)
  outs = {k: np.empty_like(a) for k, a in arrays.items()}
  got = store.read_many(list(outs.items())).wait()
  assert all(g is outs[k] for g, k in zip(got, arrays))
  for k, a in arrays.items():
    assert a.tobytes() == outs[k].tobytes(), k

  with pytest.raises(MissingShardError, match="'nope'"):
    store.read_many([("m/0", outs["m/0"]), ("nope", np.empty(3, np.float32))])
  with pytest.raises(ShardMismatchError, match="'m/2' was written as float32"):
    store.read_many([("m/2", np.empty(100_003, np.float16))])
  with pytest.raises(ValueError, match="writable C-contiguous"):
    store.read_many([("m/2", np.empty((2, 100_003), np.float32)[:, 0])])
  store.sync()
  path, offset = os.path.join(store.folder, "swap.bin"), store.entry("m/2")["offset"]
  with open(path, "r+b") as f:
    f.seek(offset + 5000)
    f.write(b"\xde\xad\xbe\xef")
  with pytest.raises(CorruptShardError, match="checksum mismatch for shard 'm/2'"):
    store.read_many(list(outs.items())).wait()
  store.close()


def test_a_closed_store_says_so(tmp_path):
  store = AioStore(tmp_path)
  store.write("a", np.arange(4, dtype=np.float32)).wait()
  store.close()
  store.close()  # a second close does nothing
  for use in (lambda: store.read("a"), lambda: store.keys(), lambda: store.stats()):
    with pytest.raises(ValueError, match=rf"swap store in .*{tmp_path.name}.* is closed"):
      use()
  reopened = AioStore(tmp_path)
  np.testing.assert_array_equal(reopened.read("a").wait(), np.arange(4, dtype=np.float32))
  reopened.close()


def test_tensorstore_store_takes_a_relative_folder(tmp_path, monkeypatch):
  from zinfjax.offload import TensorstoreStore
  (tmp_path / "run").mkdir()
  monkeypatch.chdir(tmp_path / "run")
  store = TensorstoreStore("../ts")
  x = np.random.default_rng(0).normal(size=(3, 5)).astype(np.float32)
  store.write("a", x).wait()
  np.testing.assert_array_equal(store.read("a").wait(), x)
  assert store.folder.startswith(str(tmp_path / "ts"))


def test_fresh_store_forgets_another_layout(tmp_path):
  """fresh=True opens a folder written with another block size and stripe count as empty,
  keeping its file's space for reuse; without it the mismatch is named."""
  old = AioStore([tmp_path / "a", tmp_path / "b"], block_size=64 << 10)
  written(old, "x", n=300_000)
  old.close()
  with pytest.raises(CorruptShardError, match="same nvme paths and block size"):
    AioStore(tmp_path / "a")
  s = AioStore(tmp_path / "a", fresh=True)
  assert s.keys() == [] and s.allocated_bytes > 0
  a = written(s, "y")
  s.reserve(0, exact=True)  # gives back what lies beyond the store's shards
  assert os.path.getsize(swap_file(s, "y")[0]) == 1 << 20
  np.testing.assert_array_equal(s.read("y").wait(), a)
  s.close()


def _rss_shmem() -> int:
  """This process's resident shared memory in bytes (a memory store's pages, once mapped)."""
  with open("/proc/self/status") as f:
    return next(int(line.split()[1]) << 10 for line in f if line.startswith("RssShmem:"))


def test_a_memory_store_maps_its_pages_as_it_grows_and_copies_on_threads():
  """A memory store makes and maps the pages it grows by as it grows, on threads (where
  fallocate zeroed them on one thread and left each first write to fault a page at a time);
  they read as zeros until written and go back when it shrinks. A shard of many copy pieces
  (4 MiB each, on two threads or more from 64 MiB) goes in and comes out whole."""
  store = AioStore([], memory=True)
  before = _rss_shmem()
  store.reserve(160 << 20, exact=True)
  assert store.allocated_bytes == 160 << 20
  assert _rss_shmem() - before >= 150 << 20  # mapped at the reserve, not at the first write
  big = np.random.default_rng(0).integers(0, 256, (72 << 20) + 12345, dtype=np.uint8)
  store.write("big", big).wait()
  zeros = np.zeros(8 << 20, np.uint8)
  store.write_zeros("zeros", zeros).wait()
  assert store.stats()["bytes_left_zero"] == zeros.nbytes
  out = np.empty_like(big)
  store.read("big", out).wait()
  np.testing.assert_array_equal(out, big)
  np.testing.assert_array_equal(store.read("zeros").wait(), zeros)
  mapped = _rss_shmem()
  store.reserve(0, exact=True)  # gives back what lies past the shards
  assert store.allocated_bytes == (81 << 20) and mapped - _rss_shmem() >= 70 << 20
  np.testing.assert_array_equal(store.read("big").wait(), big)
  store.close()


ZERO_STORES = {
    "drive": lambda path, **kw: AioStore(path, block_size=64 << 10, **kw),
    "striped": lambda path, **kw: AioStore([path / "nvme0", path / "nvme1"], block_size=16 << 10,
                                           **kw),
    "memory": lambda path: AioStore([], memory=True),
}


@pytest.mark.parametrize("kind", list(ZERO_STORES))
def test_zeros_on_fresh_space_are_registered_not_written(kind, tmp_path):
  """write_zeros on space never written (a fresh store's tail) registers the shard without
  writing a byte; where the extent may hold other bytes (a shard rewritten in place, the
  space of a reused file) it writes them. Every read gives zeros and passes its checksum."""
  n = 300_007
  zeros = np.zeros(n, np.float32)
  left = lambda st: st.stats()["bytes_left_zero"]
  s = ZERO_STORES[kind](tmp_path)
  s.write_zeros("z", zeros).wait()
  a = written(s, "r", n=n)
  assert left(s) == 4 * n and s.bytes_moved[1] == a.nbytes  # only "r" was written
  s.write_zeros("r", zeros).wait()  # over "r", in place: written
  assert left(s) == 4 * n and s.bytes_moved[1] == 2 * a.nbytes
  for key in ("z", "r"):
    np.testing.assert_array_equal(s.read(key).wait(), zeros)
  s.close()
  if kind == "memory":  # a new mapping each time: nothing is reused
    return
  old = ZERO_STORES[kind](tmp_path / "reused")  # a file of other bytes, reused by a fresh store
  written(old, "big", n=n)
  old.close()
  s = ZERO_STORES[kind](tmp_path / "reused", fresh=True)
  for key in ("z1", "z2"):  # on the old file's bytes: written
    s.write_zeros(key, zeros).wait()
    np.testing.assert_array_equal(s.read(key).wait(), zeros)
  assert left(s) == 0
  s.write_zeros("z3", zeros).wait()  # past all of it: left as it is
  assert left(s) == 4 * n
  np.testing.assert_array_equal(s.read("z3").wait(), zeros)
  s.close()


def test_default_backend_is_the_faster_one_measured(tmp_path, monkeypatch):
  """backend="auto" times both backends on the drive at the first open, keeps the faster
  (shortest write + read), reports it, and remembers it for the drive."""
  from zinfjax.offload import probe
  monkeypatch.setattr(probe, "CACHE_FILE", str(tmp_path / "cache" / "io-probe.json"))
  monkeypatch.setattr(probe, "_cache", {})
  s = AioStore(tmp_path / "a")
  rates = s.probe["gbps"]
  assert set(rates) <= {"io_uring", "threads"} and "threads" in rates
  assert all(w > 0 and r > 0 for w, r in rates.values())
  assert s.backend == s.probe["backend"] == min(rates, key=lambda b: 1 / rates[b][0] + 1 / rates[b][1])
  assert s.stats()["probe"] == s.probe
  a = written(s)
  np.testing.assert_array_equal(s.read("x").wait(), a)
  s.close()
  assert not any(p.name.startswith(".probe") for p in tmp_path.iterdir())  # it cleaned up

  def no_probe(*args):
    raise AssertionError("probed again")

  monkeypatch.setattr(probe, "_probe", no_probe)
  monkeypatch.setattr(probe, "_cache", {})  # a new process: the cache file answers
  s = AioStore(tmp_path / "b")
  backend = s.backend
  s.close()
  assert backend == min(rates, key=lambda b: 1 / rates[b][0] + 1 / rates[b][1])
  assert AioStore(tmp_path / "c", backend="threads").backend == "threads"


def test_store_transaction_commits_or_rolls_back(tmp_path):
  s = AioStore(tmp_path, block_size=64 << 10)
  a, b = np.arange(5000, dtype=np.float32), np.arange(3000, dtype=np.float32)
  s.write("o/a", a).wait()
  s.write("g/b", b).wait()
  used = s.stats()["bytes_used"]
  s.begin(["o/"])
  s.write("o/a", -a).wait()          # to a fresh extent
  s.write("o/new", b).wait()
  s.write("g/b", -b).wait()          # not versioned: in place
  np.testing.assert_array_equal(s.read("o/a").wait(), -a)  # readers see the newest
  s.rollback()
  np.testing.assert_array_equal(s.read("o/a").wait(), a)
  np.testing.assert_array_equal(s.read("g/b").wait(), -b)
  assert "o/new" not in s.keys()
  s.begin(["o/"])
  s.write("o/a", 2 * a).wait()
  s.commit()
  np.testing.assert_array_equal(s.read("o/a").wait(), 2 * a)
  for _ in range(3):  # later steps reuse the freed extents: the store stops growing
    s.begin(["o/"])
    s.write("o/a", 3 * a).wait()
    s.commit()
  assert s.stats()["bytes_used"] <= used + 2 * 20480 + 12288
  s.close()


@pytest.mark.parametrize("memory", [False, True])
def test_store_rolls_back_some_keys_and_keeps_the_rest(memory, tmp_path):
  """`rollback(keys)` undoes the transaction's writes of those keys alone (a step's optimizer
  update redone) and keeps the others for `commit` (the step's program's own writes)."""
  s = AioStore(tmp_path, block_size=64 << 10, memory=memory)
  rng = np.random.default_rng(0)
  a, b, c = (rng.standard_normal(4000).astype(np.float32) for _ in range(3))
  s.write("p/a", a).wait()
  s.write("o/b", b).wait()
  s.begin(["p/", "o/"])
  s.write("p/a", -a).wait()
  s.write("o/b", -b).wait()
  s.write("o/new", c).wait()
  s.rollback(["o/b", "o/new", "o/never-written"])
  assert s.in_transaction
  np.testing.assert_array_equal(s.read("p/a").wait(), -a)
  np.testing.assert_array_equal(s.read("o/b").wait(), b)
  assert "o/new" not in s.keys()
  s.write("o/b", 2 * b).wait()  # redone: a fresh extent again, the committed copy kept
  s.rollback(["o/b"])
  np.testing.assert_array_equal(s.read("o/b").wait(), b)
  s.write("o/b", 3 * b).wait()
  s.commit()
  np.testing.assert_array_equal(s.read("p/a").wait(), -a)
  np.testing.assert_array_equal(s.read("o/b").wait(), 3 * b)
  with pytest.raises(EngineError, match="outside a transaction"):
    s.rollback(["o/b"])
  s.close()
