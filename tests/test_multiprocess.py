"""Multi-process training on loopback: 2 processes x 4 host devices equal 1 x 8; a dead
process stops the run in bounded time, and a restart resumes from the last checkpoint."""

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from helpers import REPO, script_env

SCRIPTS = os.path.join(REPO, "scripts")
STEPS = 9
# params and optimizer on NVMe (each process its own folder), fp32 so sums agree to rounding
COMMON = ["--preset", "tiny", "--steps", str(STEPS), "--schedule-steps", str(STEPS), "--precision",
          "fp32", "--batch-size", "16", "--seq-len", "32", "--log-every", "3", "--offload-param",
          "nvme", "--offload-optimizer", "nvme"]
ENV = script_env()


def losses(path):
  return {r["step"]: r["loss"] for r in map(json.loads, open(path).read().splitlines())}


def train(tmp, name, *extra, nproc=1, timeout=300, launch=()):
  devices = str(8 // nproc)
  cmd = [os.path.join(SCRIPTS, "train_gpt.py"), *COMMON, "--devices", devices,
         "--nvme-path", str(tmp / f"{name}_nvme"), "--metrics-jsonl", str(tmp / f"{name}.jsonl"),
         *extra]
  if nproc > 1:
    cmd = [os.path.join(SCRIPTS, "launch.py"), "--nproc", str(nproc), *launch, *cmd]
  return subprocess.Popen([sys.executable, *cmd], cwd=REPO, env=ENV, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True)


def finish(proc, timeout=300):
  out, err = proc.communicate(timeout=timeout)
  assert proc.returncode == 0, err[-3000:]
  return out


@pytest.fixture(scope="module")
def single(tmp_path_factory):
  tmp = tmp_path_factory.mktemp("single")
  finish(train(tmp, "one"))
  return losses(tmp / "one.jsonl")


def test_two_processes_equal_one(single, tmp_path):
  out = finish(train(tmp_path, "two", nproc=2))
  assert "on 8 cpu devices (2 processes)" in out
  two = losses(tmp_path / "two.jsonl")
  assert sorted(two) == list(range(1, STEPS + 1))
  np.testing.assert_allclose([two[s] for s in sorted(two)], [single[s] for s in sorted(two)],
                             rtol=1e-5)
  # each process keeps (and moved) only its own devices' shards, in its own folder
  from zinfjax.offload import AioStore
  for process, ranks in ((0, range(4)), (1, range(4, 8))):
    store = AioStore(str(tmp_path / "two_nvme"), process)
    keys = store.keys()
    store.close()
    assert keys and {int(k.split("/r")[-1].split("/")[0]) for k in keys} == set(ranks)


def test_two_processes_put_device_params_back_like_one(tmp_path):
  """Params on the device, their optimizer on NVMe: each process's host pipeline puts the new
  params back a layer at a time (its own ranks' shards, into the global arrays) as one does."""
  extra = ["--offload-param", "device", "--steps", "4", "--schedule-steps", "4"]
  finish(train(tmp_path, "one", *extra, "--export", str(tmp_path / "one_out")))
  # two processes export from the checkpoint of the last step: neither holds every shard
  out = finish(train(tmp_path, "two", *extra, "--export", str(tmp_path / "two_out"),
                     "--checkpoint-dir", str(tmp_path / "two_ckpt"), nproc=2))
  assert "on 8 cpu devices (2 processes)" in out and "exported" in out
  one, two = losses(tmp_path / "one.jsonl"), losses(tmp_path / "two.jsonl")
  assert sorted(two) == sorted(one) == [1, 2, 3, 4] and one[4] < one[1], (one, two)
  np.testing.assert_allclose([two[s] for s in sorted(two)], [one[s] for s in sorted(two)],
                             rtol=1e-5)
  from zinfjax.weights import safetensors
  ours, theirs = (safetensors.Checkpoint(str(tmp_path / f"{n}_out")) for n in ("two", "one"))
  assert set(ours) == set(theirs) and len(ours) > 10
  for name in ours:
    np.testing.assert_allclose(ours[name], theirs[name], atol=1e-5, err_msg=name)
  err = train(tmp_path, "no_ckpt", *extra, "--export", str(tmp_path / "x"), nproc=2)
  _, err = err.communicate(timeout=120)
  assert "--export with 2 processes writes the model from the checkpoint of the last step" in err


def pid_of(process_id: int, marker: str) -> int | None:
  """The pid of the training process `process_id` whose command line holds `marker`."""
  for pid in filter(str.isdigit, os.listdir("/proc")):
    try:
      cmd = open(f"/proc/{pid}/cmdline", "rb").read().decode()
      env = open(f"/proc/{pid}/environ", "rb").read().decode()
    except OSError:
      continue
    if marker in cmd and "train_gpt.py" in cmd and f"ZINFJAX_PROCESS_ID={process_id}\0" in env:
      return int(pid)
  return None


def test_dead_process_stops_the_run_and_restart_resumes(single, tmp_path):
  ckpt = tmp_path / "ckpt"
  # a long run (same schedule) that process 1 leaves by dying after the first checkpoint
  # a grace period longer than the test allows: the survivor must stop on SIGTERM itself
  proc = train(tmp_path, "run", "--steps", "200", "--checkpoint-dir", str(ckpt), "--save-every", "3",
               nproc=2, launch=("--grace-s", "300"))
  deadline = time.monotonic() + 240
  while not (ckpt / "3").is_dir():
    assert proc.poll() is None, proc.communicate()[1][-3000:]
    assert time.monotonic() < deadline, "no checkpoint after 240 s"
    time.sleep(0.2)
  victim = pid_of(1, str(ckpt))
  assert victim is not None
  os.kill(victim, signal.SIGKILL)
  killed = time.monotonic()
  _, err = proc.communicate(timeout=60)  # bounded: the launcher stops the survivor
  assert time.monotonic() - killed < 30
  assert proc.returncode != 0
  assert "process 1 of 2 was killed by SIGKILL" in err
  assert pid_of(0, str(ckpt)) is None  # nothing left running

  from zinfjax.checkpoint import Checkpointer
  saved = Checkpointer(ckpt).latest_step()
  assert saved is not None and saved >= 3 and saved % 3 == 0
  out = finish(train(tmp_path, "resumed", "--checkpoint-dir", str(ckpt), "--save-every", "3",
                     "--resume", nproc=2))
  assert f"resumed from step {saved} " in out
  resumed = losses(tmp_path / "resumed.jsonl")
  assert sorted(resumed) == list(range(saved + 1, STEPS + 1))
  np.testing.assert_allclose([resumed[s] for s in sorted(resumed)],
                             [single[s] for s in sorted(resumed)], rtol=1e-5)

  # the script refuses a checkpoint folder it would damage, and touches nothing in it
  from test_checkpoint import snapshot
  before = snapshot(ckpt)
  for extra, message in ((["--layers", "3", "--resume"],
                          "trained with another model (num_layers 2 there, 3 here)"),
                         ([], "already holds checkpoints")):
    proc = train(tmp_path, "refused", "--checkpoint-dir", str(ckpt), "--save-every", "1", *extra)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode != 0 and message in err, err[-2000:]
  assert snapshot(ckpt) == before
