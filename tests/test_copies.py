"""The CUDA handlers' copy stream (ffi/cuda/copies.h) on a machine without a GPU: built with a
stand-in CUDA runtime that runs each call at once and logs its stream
(tests/cuda_fake/cuda_runtime_api.h) beside the real swap store, and checked by
tests/cuda_fake/copies_test.cc: shards arrive intact both ways, host<->device copies run on the
copy stream and never on XLA's, staging buffers are reused only once drained, a read that finds
no free buffer is copied from the host, one taken with other shapes is refused."""

import glob
import os
import shutil
import subprocess

import pytest

from helpers import REPO

CORE = ["buffer", "pool", "aio", "store", "store_extents", "store_io", "store_manifest",
        "store_txn", "files", "workers"]


@pytest.fixture(scope="module")
def copies_test(tmp_path_factory):
  cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
  if cxx is None:
    pytest.skip("no C++ compiler (CXX, g++ or c++) to build the copy-stream test")
  exe = str(tmp_path_factory.mktemp("copies") / "copies_test")
  sources = [os.path.join(REPO, "tests", "cuda_fake", "copies_test.cc")] + [
      os.path.join(REPO, "ffi", "core", f"{name}.cc") for name in CORE]
  assert set(sources[1:]) <= set(glob.glob(os.path.join(REPO, "ffi", "core", "*.cc")))
  built = subprocess.run([cxx, "-std=c++17", "-O1", "-I", os.path.join(REPO, "tests", "cuda_fake"),
                          "-I", os.path.join(REPO, "ffi"), *sources, "-lpthread", "-o", exe],
                         capture_output=True, text=True, timeout=300)
  assert built.returncode == 0, built.stderr[-4000:]
  return exe


@pytest.mark.parametrize("where", ["drive", "memory"])
def test_copy_stream_moves_shards_off_xlas_stream(copies_test, where, tmp_path):
  folder = "memory" if where == "memory" else str(tmp_path / "swap")
  if where == "drive":
    os.makedirs(folder)
  done = subprocess.run([copies_test, folder], capture_output=True, text=True, timeout=120)
  assert done.returncode == 0, done.stdout + done.stderr
  assert "checks passed" in done.stdout
