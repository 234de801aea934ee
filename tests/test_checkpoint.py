"""Checkpoints: exact resume in a new process on every tier, restore onto other devices and
placements, atomic saves, export, and clear errors for bad checkpoints (nothing overwritten)."""

import dataclasses
import json
import os
import shutil
import struct
import subprocess
import sys

import jax
import numpy as np
import pytest

import zinfjax
from zinfjax.checkpoint import CheckpointError, CheckpointParams, Checkpointer
from zinfjax.checkpoint.lock import NAME as LOCK
from zinfjax.models import lm_loss

import resume_worker as W
from helpers import REPO, script_env

WORKER = os.path.join(REPO, "tests", "resume_worker.py")
# (params tier, optimizer tier, precision): bf16 where the compute params are a cast of the master
PLACEMENTS = {"device": ("device", "device", "bf16"),
              "pinned_host": ("pinned_host", "pinned_host", "bf16"),
              "nvme": ("nvme", "nvme", "fp32")}
SAVE_AT = 5


def worker(*args, timeout=300):
  out = subprocess.run([sys.executable, WORKER, *map(str, args)], capture_output=True, text=True,
                       timeout=timeout, env=script_env())
  return out


def flat_params(state):
  return {jax.tree_util.keystr(k): np.asarray(v)
          for k, v in jax.tree_util.tree_flatten_with_path(state.full_params())[0]}


def snapshot(folder):
  """Every file under `folder` with its size and modification time (not the run lock, which
  each run that opens the folder rewrites with its pid)."""
  out = {}
  for root, _, files in os.walk(folder):
    for f in files:
      if f == LOCK:
        continue
      st = os.stat(os.path.join(root, f))
      out[os.path.relpath(os.path.join(root, f), folder)] = (st.st_size, st.st_mtime_ns)
  return out


@pytest.fixture(scope="module")
def straight(tmp_path_factory, mesh):
  """Per placement (lazily): 10 steps straight in this process, saving at step 5."""
  runs = {}

  def get(name):
    if name not in runs:
      param, optimizer, precision = PLACEMENTS[name]
      root = tmp_path_factory.mktemp(f"ckpt_{name}")
      zero = W.zero_config(param, optimizer, precision, str(root / "nvme"))
      state = zinfjax.init(W.model_factory, W.make_tx(optimizer), zero, mesh, 0)
      ckpt = Checkpointer(root / "ckpt")
      losses = []
      for i, batch in enumerate(W.batches()):
        state, metrics = zinfjax.train_step(state, batch, lm_loss)
        losses.append(float(metrics["loss"]))
        if i + 1 == SAVE_AT:
          ckpt.save(state)
      ckpt.close()
      runs[name] = dict(root=root, ckpt=root / "ckpt", losses=np.asarray(losses),
                        params=flat_params(state))
    return runs[name]

  return get


@pytest.mark.parametrize("name", list(PLACEMENTS))
def test_resume_in_a_new_process_is_exact(name, straight, tmp_path):
  run = straight(name)
  param, optimizer, precision = PLACEMENTS[name]
  assert Checkpointer(run["ckpt"]).all_steps() == [SAVE_AT]
  out = worker("--param", param, "--optimizer", optimizer, "--precision", precision,
               "--ckpt", run["ckpt"], "--nvme", tmp_path / "nvme", "--restore",
               "--steps", W.STEPS, "--out", tmp_path / "r.npz")
  assert out.returncode == 0, out.stderr[-3000:]
  resumed = np.load(tmp_path / "r.npz")
  np.testing.assert_array_equal(resumed["losses"], run["losses"][SAVE_AT:])
  for k, v in run["params"].items():
    np.testing.assert_array_equal(resumed[k], v, err_msg=k)
  assert run["losses"][-1] < run["losses"][0] - 0.3


def test_restore_nvme_checkpoint_onto_4_devices_in_pinned_host(straight, tmp_path):
  run = straight("nvme")
  out = worker("--devices", 4, "--param", "pinned_host", "--optimizer", "pinned_host",
               "--precision", "fp32", "--ckpt", run["ckpt"], "--restore", "--steps", W.STEPS,
               "--out", tmp_path / "r.npz")
  assert out.returncode == 0, out.stderr[-3000:]
  resumed = np.load(tmp_path / "r.npz")
  # another device count sums in another order: equal up to fp32 rounding
  np.testing.assert_allclose(resumed["losses"], run["losses"][SAVE_AT:], rtol=1e-5)
  for k, v in run["params"].items():
    np.testing.assert_allclose(resumed[k], v, rtol=1e-4, atol=1e-5, err_msg=k)


def test_nvme_streams_in_groups_of_one_layer_equal_one_group(straight, tmp_path, mesh, monkeypatch):
  """The NVMe streams move shards in groups (one swap-store transfer and one chunk-file call
  each). A restore and a save with every layer its own group (many groups in flight) give
  the same swap-store shards and the same chunk files as with all of them in one group."""
  from zinfjax.checkpoint import handler
  run = straight("nvme")
  param, optimizer, precision = PLACEMENTS["nvme"]
  outs = []
  for name, group_bytes in (("one", handler.GROUP_BYTES), ("many", 1)):
    monkeypatch.setattr(handler, "GROUP_BYTES", group_bytes)
    zero = W.zero_config(param, optimizer, precision, str(tmp_path / f"nvme-{name}"))
    state, _ = Checkpointer(run["ckpt"]).restore(W.model_factory, W.make_tx(optimizer), zero, mesh)
    store = state.engine.store
    shards = {k: store.read(k).wait() for k in store.keys() if not k.startswith("g/")}
    with Checkpointer(tmp_path / name) as ckpt:
      ckpt.save(state)
    store.close()
    outs.append((shards, chunk_files(tmp_path / name)))
  (shards_one, chunks_one), (shards_many, chunks_many) = outs
  assert len(shards_one) > 10 and shards_one.keys() == shards_many.keys()
  for k in shards_one:
    np.testing.assert_array_equal(shards_many[k], shards_one[k], err_msg=k)
  assert len(chunks_one) > 10 and chunks_one == chunks_many


def test_restore_reports_the_bytes_placed(straight, tmp_path, mesh, monkeypatch):
  """`restore(progress=...)` hears of the bytes placed as each group of shards is (the NVMe
  stream's, then the arrays'), in order, ending at all of them: at least the fp32 master and
  both moments of every param; `init_line(unit="bytes")` words it."""
  import io
  from zinfjax import progress
  from zinfjax.checkpoint import handler
  monkeypatch.setattr(progress, "REPORT_EVERY_S", 0.0)  # every group reported
  monkeypatch.setattr(handler, "GROUP_BYTES", 1)  # every layer its own group
  run = straight("nvme")
  heard = []
  zero = W.zero_config("pinned_host", "nvme", "fp32", str(tmp_path / "nvme"))
  state, _ = Checkpointer(run["ckpt"]).restore(
      W.model_factory, W.make_tx("nvme"), zero, mesh,
      progress=lambda done, all_, s: heard.append((done, all_, s)))
  params = sum(v.size for v in run["params"].values())
  done = [d for d, _, _ in heard]
  total = {a for _, a, _ in heard}
  assert len(total) == 1 and done[-1] == total.pop() >= 12 * params, (heard[-1], params)
  assert len(heard) > 10 and done == sorted(done) and 0 < done[0] < done[-1], heard
  assert int(state.step) == SAVE_AT
  state.engine.store.close()
  out = io.StringIO()
  progress.init_line(out, "restore", unit="bytes")(3 << 30, 12 << 30, 10.0)
  assert out.getvalue() == "restore  25% | 3.0 GiB of 12.0 GiB | 10 s, about 30 s left\n"


def chunk_files(folder) -> dict[str, bytes]:
  """Every chunk file of the step saved at `SAVE_AT` under `folder`, by path."""
  chunks = {}
  for root, _, files in os.walk(folder / str(SAVE_AT)):
    for f in files:
      path = os.path.join(root, f)
      if os.sep + "c" + os.sep in path or f == "c":
        with open(path, "rb") as fh:
          chunks[os.path.relpath(path, folder)] = fh.read()
  return chunks


def test_save_batches_written_at_once_equal_one_batch(straight, tmp_path, mesh, monkeypatch):
  """A save writes its array blocks in batches, `WRITERS` at once. Batches of one block each
  (tens of them, two writers racing) give the same chunk files as one batch of them all."""
  from zinfjax.checkpoint import handler
  run = straight("pinned_host")
  param, optimizer, precision = PLACEMENTS["pinned_host"]
  zero = W.zero_config(param, optimizer, precision, None)
  state, _ = Checkpointer(run["ckpt"]).restore(W.model_factory, W.make_tx(optimizer), zero, mesh)
  outs, batches, flush = [], [], handler._Writes.flush
  monkeypatch.setattr(handler._Writes, "flush",
                      lambda self: (batches.append(name) if self.batch else None, flush(self))[1])
  for name, first, last in (("one", 1 << 40, 1 << 40), ("many", 1, 1)):
    monkeypatch.setattr(handler, "FIRST_BATCH", first)
    monkeypatch.setattr(handler, "LAST_BATCH", last)
    with Checkpointer(tmp_path / name) as ckpt:
      ckpt.save(state)
    outs.append(chunk_files(tmp_path / name))
  assert batches.count("one") == 1 and batches.count("many") > 20
  assert len(outs[0]) > 10 and outs[0] == outs[1]


@pytest.mark.parametrize("name", ["device", "pinned_host"])
def test_restore_staged_for_copies_equals_buffers_taken_over(name, straight, mesh, monkeypatch):
  """Where the arrays are copies of the host buffers (an accelerator's memory), a restore
  reads each group into one of two reused staging regions. Forced on CPU with a group per
  leaf: every state equals the restore into fresh buffers, the regions served nearly every
  buffer, and overwriting them afterwards changes nothing (the arrays are copies)."""
  from zinfjax.checkpoint import arrays
  run = straight(name)
  param, optimizer, precision = PLACEMENTS[name]
  zero = W.zero_config(param, optimizer, precision, None)

  def restored():
    state, _ = Checkpointer(run["ckpt"]).restore(W.model_factory, W.make_tx(optimizer), zero, mesh)
    return state, jax.tree.leaves((state.master, state.params, state.opt_state))

  _, want = restored()
  stages, takes = [], []
  take = arrays.Staging.take

  class Recorded(arrays.Staging):
    def __init__(self):
      super().__init__()
      stages.append(self)

    def take(self, shape, dtype):
      buf = take(self, shape, dtype)
      takes.append(np.shares_memory(buf, self.region))
      return buf

  monkeypatch.setattr(arrays, "STAGE_ON_CPU", True)
  monkeypatch.setattr(arrays, "GROUP_BYTES", 1)
  monkeypatch.setattr(arrays, "Staging", Recorded)
  state, got = restored()
  assert len(stages) == 2 and len(takes) > 2 * len(jax.tree.leaves(state.master)) and all(takes)
  assert {a.sharding.memory_kind for a in jax.tree.leaves(state.master)} == {param}
  for s in stages:
    s.region.fill(0xFF)  # NaN in every float
  assert len(got) == len(want) > 10
  for a, b in zip(got, want):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_save_killed_midway_leaves_the_previous_checkpoint(tmp_path, mesh):
  ckpt_dir = tmp_path / "ckpt"
  out = worker("--ckpt", ckpt_dir, "--steps", 6, "--save-at", 2, "--save-at", 4,
               "--kill-after-save")
  assert out.returncode == -9, out.stderr[-3000:]
  ckpt = Checkpointer(ckpt_dir)
  assert ckpt.all_steps() == [2]
  assert any(f.startswith("4") for f in os.listdir(ckpt_dir)), os.listdir(ckpt_dir)  # the torn save
  with pytest.warns(UserWarning, match="step 4 is not committed .*reading step 2"):
    assert CheckpointParams(ckpt_dir).step == 2  # an export names the step it could not read
  with pytest.warns(UserWarning, match="step 4 is not committed .*reading step 2"):
    state, _ = ckpt.restore(W.model_factory, W.make_tx("device"), W.zero_config(
        "device", "device", "bf16", None), mesh)  # so does a restore of the latest
  assert int(state.step) == 2
  state.close()
  state, _, skipped = ckpt.restore_newest(W.model_factory, W.make_tx("device"), W.zero_config(
      "device", "device", "bf16", None), mesh)  # the CLI's resume lists the torn step
  assert int(state.step) == 2 and [s for s, _ in skipped] == [4], skipped
  assert "not committed" in skipped[0][1]
  for batch in W.batches()[2:4]:
    state, _ = zinfjax.train_step(state, batch, lm_loss)
  assert ckpt.save(state)
  ckpt.wait()
  assert ckpt.all_steps() == [2, 4]
  ckpt.close()


def test_keeps_the_last_n(straight, tmp_path, mesh):
  run = straight("device")
  ckpt = Checkpointer(run["ckpt"])
  state, _ = ckpt.restore(W.model_factory, W.make_tx("device"),
                          W.zero_config("device", "device", "bf16", None), mesh)
  keep2 = Checkpointer(tmp_path / "c", keep=2)
  for step in (1, 2, 3):
    step_array = jax.device_put(np.int32(step), state.step.sharding)
    assert keep2.save(dataclasses.replace(state, step=step_array))
  assert not keep2.save(dataclasses.replace(state, step=step_array))  # already saved
  keep2.wait()
  assert keep2.all_steps() == [2, 3]
  keep2.close()


def test_consolidate_writes_full_params(straight, tmp_path):
  run = straight("nvme")
  for dtype, np_dtype in (("fp32", np.float32), ("bf16", None)):
    path = tmp_path / f"params_{dtype}.safetensors"
    out = subprocess.run([sys.executable, os.path.join(REPO, "scripts", "consolidate.py"),
                          str(run["ckpt"]), str(path), "--dtype", dtype],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    raw = path.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8:8 + n])
    assert header.pop("__metadata__")["step"] == str(SAVE_AT)
    import ml_dtypes
    np_dtype = np_dtype or ml_dtypes.bfloat16
    # the checkpoint holds step 5: compare with a fresh restore of it
    state, _ = Checkpointer(run["ckpt"]).restore(
        W.model_factory, W.make_tx("nvme"), W.zero_config("pinned_host", "pinned_host", "fp32", None),
        zinfjax.make_mesh())
    want = {".".join(str(getattr(k, "key", k)) for k in path_): np.asarray(v)
            for path_, v in jax.tree_util.tree_flatten_with_path(state.full_params())[0]}
    assert set(header) == set(want)
    for name, info in header.items():
      a, b = info["data_offsets"]
      got = np.frombuffer(raw[8 + n + a:8 + n + b], np_dtype).reshape(info["shape"])
      np.testing.assert_array_equal(got, want[name].astype(np_dtype), err_msg=name)


# ------------------------------------------------------------------ bad checkpoints
@pytest.fixture()
def device_ckpt(straight, tmp_path):
  """A private copy of the device run's checkpoint (tests may damage it)."""
  dst = tmp_path / "ckpt"
  shutil.copytree(straight("device")["ckpt"], dst)
  return dst


def restore(ckpt_dir, mesh, layers=None, optimizer="device", step=None):
  from zinfjax.models import GPT, get_config
  factory = (W.model_factory if layers is None else
             lambda r: GPT(get_config("tiny", num_layers=layers), rngs=r))
  return Checkpointer(ckpt_dir).restore(factory, W.make_tx(optimizer), W.zero_config(
      optimizer, optimizer, "bf16", None), mesh, step=step)


def test_checkpoint_of_another_model_is_refused(device_ckpt, mesh):
  before = snapshot(device_ckpt)
  with pytest.raises(CheckpointError, match=r"another model: \d+ have another shape \(e.g. "
                                            r"'blocks/\S+' \[2, \d+\S* there and \[3, "):
    restore(device_ckpt, mesh, layers=3)
  with pytest.raises(CheckpointError, match="another optimizer"):
    restore(device_ckpt, mesh, optimizer="pinned_host")
  assert snapshot(device_ckpt) == before


def test_missing_step_and_empty_folder(device_ckpt, mesh, tmp_path):
  before = snapshot(device_ckpt)
  with pytest.raises(CheckpointError, match=r"no checkpoint for step 7 .*saved steps: \[5\]"):
    restore(device_ckpt, mesh, step=7)
  with pytest.raises(CheckpointError, match="no checkpoint in"):
    restore(tmp_path / "nothing_here", mesh)
  assert not os.path.exists(tmp_path / "nothing_here")
  assert snapshot(device_ckpt) == before


@pytest.mark.parametrize("damage", ["truncate", "delete"])
def test_damaged_checkpoint_names_the_array(damage, device_ckpt, mesh):
  leaf = device_ckpt / str(SAVE_AT) / "state" / "master" / "blocks" / "block" / "fc" / "kernel"
  chunk = next(os.path.join(r, f) for r, _, fs in os.walk(leaf / "c") for f in fs)
  if damage == "truncate":
    with open(chunk, "r+b") as f:
      f.truncate(os.path.getsize(chunk) // 2)
  else:
    os.remove(chunk)
  before = snapshot(device_ckpt)
  with pytest.raises(CheckpointError, match="'master/blocks/block/fc/kernel'.*(damaged|truncated)"):
    restore(device_ckpt, mesh)
  assert snapshot(device_ckpt) == before


# ------------------------------------------------------------------ one run per directory
HOLD = """
import sys, time
from zinfjax.checkpoint import Checkpointer
ckpt = Checkpointer(sys.argv[1], lock=True)
print("locked", flush=True)
time.sleep(300)
"""


def test_a_second_run_on_the_directory_is_refused_with_the_owner_pid(tmp_path):
  folder = tmp_path / "ckpt"
  holder = subprocess.Popen([sys.executable, "-c", HOLD, str(folder)], stdout=subprocess.PIPE,
                            text=True, cwd=tmp_path)  # not the repository root: the installed zinfjax
  try:
    assert holder.stdout.readline().strip() == "locked"
    with pytest.raises(CheckpointError, match=rf"in use by another run \(pid {holder.pid}\)"):
      Checkpointer(folder, lock=True)
  finally:
    holder.kill()
    holder.wait()
  with Checkpointer(folder, lock=True), Checkpointer(folder, lock=True):  # nothing stale; one
    pass                                                                    # process shares it


def test_an_unwritable_directory_is_refused_when_the_checkpointer_is_made(tmp_path):
  blocker = tmp_path / "file"
  blocker.write_text("not a folder")
  with pytest.raises(CheckpointError, match=r"cannot write to checkpoint directory .*file/ckpt"):
    Checkpointer(blocker / "ckpt", lock=True)


def test_restore_newest_skips_a_damaged_step_and_names_it(device_ckpt, mesh):
  """Steps 5 (sound) and 6 (a chunk deleted): the newest that restores is 5, and 6 is reported
  with the array that is damaged; a checkpoint of another model is refused at once."""
  state, _ = restore(device_ckpt, mesh)
  with Checkpointer(device_ckpt) as ckpt:
    ckpt.save(dataclasses.replace(state, step=jax.device_put(np.int32(6), state.step.sharding)))
  leaf = device_ckpt / "6" / "state" / "master" / "blocks" / "block" / "fc" / "kernel"
  os.remove(next(os.path.join(r, f) for r, _, fs in os.walk(leaf / "c") for f in fs))
  zero = W.zero_config("device", "device", "bf16", None)
  ckpt = Checkpointer(device_ckpt)
  got, _, skipped = ckpt.restore_newest(W.model_factory, W.make_tx("device"), zero, mesh)
  assert int(got.step) == 5
  assert [s for s, _ in skipped] == [6] and "master/blocks/block/fc/kernel" in skipped[0][1]
  from zinfjax.checkpoint import CheckpointMismatch
  from zinfjax.models import GPT, get_config
  with pytest.raises(CheckpointMismatch, match="another model"):
    ckpt.restore_newest(lambda r: GPT(get_config("tiny", num_layers=3), rngs=r),
                        W.make_tx("device"), zero, mesh)


def test_consolidate_fails_cleanly(device_ckpt, tmp_path):
  """An output that is a folder is refused before any work; a damaged chunk stops the export
  with one line naming the array and leaves no temporary file."""
  script = os.path.join(REPO, "scripts", "consolidate.py")
  consolidate = lambda out: subprocess.run([sys.executable, script, str(device_ckpt), str(out)],
                                           capture_output=True, text=True, timeout=300)
  done = consolidate(tmp_path)
  assert done.returncode != 0 and f"error: the output {tmp_path} is a directory" in done.stderr
  leaf = device_ckpt / str(SAVE_AT) / "state" / "master" / "blocks" / "block" / "fc" / "kernel"
  os.remove(next(os.path.join(r, f) for r, _, fs in os.walk(leaf / "c") for f in fs))
  out = tmp_path / "out" / "params.safetensors"
  out.parent.mkdir()
  done = consolidate(out)
  assert done.returncode != 0
  assert "master/blocks/block/fc/kernel" in done.stderr and "Traceback" not in done.stderr
  assert os.listdir(out.parent) == []


@pytest.mark.parametrize("target", ["pinned_host", "nvme"])
def test_zinfjax_adamw_checkpoints_move_between_optimizer_tiers(target, tmp_path, mesh):
  """zinfjax.optim.adamw keeps one state layout on every tier: 3 steps with the optimizer on
  the device, save, restore with it on `target`, 3 more steps equal 6 straight on the device
  (fp32); and a checkpoint saved from `target` restores onto the device."""
  batches = W.batches()[:6]

  def train(state, steps):
    losses = []
    for batch in steps:
      state, metrics = zinfjax.train_step(state, batch, lm_loss)
      losses.append(float(metrics["loss"]))
    return state, losses

  zero = lambda tier: W.zero_config("device", tier, "fp32", str(tmp_path / f"nvme-{tier}"))
  tx = W.make_tx("pinned_host")  # zinfjax.optim.adamw
  state = zinfjax.init(W.model_factory, tx, zero("device"), mesh, 0)
  state, straight = train(state, batches)
  state = zinfjax.init(W.model_factory, tx, zero("device"), mesh, 0)
  state, first = train(state, batches[:3])
  with Checkpointer(tmp_path / "a") as ckpt:
    ckpt.save(state)
  moved, _ = Checkpointer(tmp_path / "a").restore(W.model_factory, tx, zero(target), mesh)
  moved, rest = train(moved, batches[3:])
  np.testing.assert_allclose(first + rest, straight, rtol=1e-5)
  with Checkpointer(tmp_path / "b") as ckpt:
    ckpt.save(moved)
  want = flat_params(moved)
  if moved.engine.store is not None:
    moved.engine.store.close()
  back, _ = Checkpointer(tmp_path / "b").restore(W.model_factory, tx, zero("device"), mesh)
  assert int(back.step) == 6
  got = flat_params(back)
  assert set(got) == set(want)
  for k in want:
    np.testing.assert_array_equal(got[k], want[k], err_msg=k)


def test_a_failed_background_save_is_reported_at_the_next_check(device_ckpt, mesh, tmp_path,
                                                                 monkeypatch):
  """A device-state save that fails in the background (here: disk full while its arrays are
  written) is raised by `check()`, the call made after every step, naming the step and what
  is still committed; it does not wait for the next save."""
  import time
  from zinfjax.checkpoint import handler
  state, _ = restore(device_ckpt, mesh)
  ckpt = Checkpointer(tmp_path / "new", keep=None)
  state, _ = zinfjax.train_step(state, W.batches()[5], lm_loss)
  assert ckpt.save(state)
  ckpt.wait()  # step 6 committed

  def full_disk(items):  # the background writes of whole chunks
    raise OSError(28, "No space left on device", items[0][0].path)

  monkeypatch.setattr(handler, "write_chunks", full_disk)
  state, _ = zinfjax.train_step(state, W.batches()[6], lm_loss)
  assert ckpt.save(state)  # returns before the background writes
  deadline = time.monotonic() + 120
  with pytest.raises(CheckpointError, match=r"saving step 7 .* failed in the background: "
                     r"OSError: .*No space left.*the last committed checkpoint is step 6"):
    while time.monotonic() < deadline:
      ckpt.check()
      time.sleep(0.05)
  ckpt.check()  # reported once
  assert ckpt.all_steps() == [6]
  monkeypatch.undo()
  state, _ = zinfjax.train_step(state, W.batches()[7], lm_loss)
  assert ckpt.save(state)  # the directory still takes saves
  ckpt.close()
  assert Checkpointer(tmp_path / "new").all_steps() == [6, 8]


def test_a_restore_right_after_a_save_waits_for_it(device_ckpt, mesh, tmp_path, monkeypatch):
  """A save returns before its arrays are written; a restore (or `restore_newest`) from the same
  Checkpointer right after waits for it and restores what was saved, not an error that the
  step it lists has no metadata yet."""
  import time
  from zinfjax.checkpoint import handler
  state, _ = restore(device_ckpt, mesh)
  state, _ = zinfjax.train_step(state, W.batches()[5], lm_loss)
  want = jax.tree.map(np.asarray, state.full_params())
  written = handler.write_chunks

  def slow(items):  # the background writes, still going when restore starts
    time.sleep(0.5)
    written(items)

  monkeypatch.setattr(handler, "write_chunks", slow)
  with Checkpointer(tmp_path / "new") as ckpt:
    assert ckpt.save(state)
    for again in (ckpt.restore, lambda *a: ckpt.restore_newest(*a)[:2]):
      got, _ = again(W.model_factory, W.make_tx("device"),
                     W.zero_config("device", "device", "bf16", None), mesh)
      jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, got.full_params()), want)
      got.close()
      assert ckpt.save(state) is False  # step 6 is saved, once
