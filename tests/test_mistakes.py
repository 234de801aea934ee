"""A user's mistakes: a donated or closed state is refused by every entry point (never a crash
or a wrong answer); swap stores are released and replaced within one process; optimizer
states move between every pair of tiers; bad input stops the CLI before any compute, with
one line naming the problem; nothing saved is lost."""

import functools
import gc
import json
import os
import re
import shutil
import signal
import struct
import subprocess
import sys
import threading
import warnings

import jax
import ml_dtypes
import numpy as np
import pytest
from flax import nnx

import zinfjax
from zinfjax import UnusableStateError
from zinfjax.checkpoint import CheckpointError, Checkpointer
from zinfjax.checkpoint.handler import open_checked, read
from zinfjax.checkpoint.leaves import Leaf
from zinfjax.engine import StoreReplacedWarning
from zinfjax.fnkey import RecompileWarning
from zinfjax.models import GPT, get_config, hf, lm_loss
from zinfjax.progress import open_metrics

from helpers import REPO, load_script, random_batches, script_env

TIERS = ("device", "pinned_host", "nvme")
TINY = get_config("tiny", num_layers=2, hidden=32, num_heads=2, seq_len=16, vocab_size=64)
BATCHES = random_batches(3, batch=8, seq=16, vocab=64, seed=5)
SCRIPT = os.path.join(REPO, "scripts", "train_gpt.py")
ENV = script_env()  # the script picks devices


def factory(rngs):
  return GPT(TINY, rngs=rngs)


def tx():
  return zinfjax.optim.adamw(1e-2, weight_decay=0.1, max_grad_norm=1.0)


def zero(params: str, optimizer: str, nvme) -> zinfjax.ZeroConfig:
  return zinfjax.ZeroConfig(precision="fp32", offload_param=params, offload_optimizer=optimizer,
                            nvme_path=str(nvme))


def loss(state, batch=BATCHES[0]) -> float:
  return float(zinfjax.eval_step(state, batch, lm_loss)["loss"])


# ------------------------------------------------------------------ consumed and closed states
@pytest.mark.parametrize("tier", TIERS)
def test_a_donated_state_is_refused_by_every_entry_point(tier, mesh, tmp_path):
  """With params and optimizer on `tier`, the state given to train_step is refused by eval_step,
  train_step, model(), full_params and a save (before: a segfault on device and pinned host,
  the new weights' loss on NVMe); the returned state is untouched by the refusals."""
  state = zinfjax.init(factory, tx(), zero(tier, tier, tmp_path / "nvme"), mesh, 0)
  before = loss(state)
  new, _ = zinfjax.train_step(state, BATCHES[0], lm_loss)
  after = loss(new)
  assert after < before  # the step changed the weights: an answer from the old state would differ
  uses = {"eval_step": lambda: zinfjax.eval_step(state, BATCHES[0], lm_loss),
          "train_step": lambda: zinfjax.train_step(state, BATCHES[1], lm_loss),
          "TrainState.model()": state.model, "full_params": state.full_params,
          "Checkpointer.save": lambda: Checkpointer(tmp_path / "ckpt").save(state)}
  for use, call in uses.items():
    with pytest.raises(UnusableStateError, match=re.escape(use) + r": this TrainState \(step 0\) "
                       "was donated to train_step.*Use the state it returned"):
      call()
  assert not os.path.exists(tmp_path / "ckpt" / "0")
  # a new object over its pytree (the same donated arrays) is refused too
  copy = jax.tree.map(lambda x: x, state)
  with pytest.raises(UnusableStateError, match="arrays were deleted or donated"):
    zinfjax.eval_step(copy, BATCHES[0], lm_loss)
  newer, _ = zinfjax.train_step(new, BATCHES[1], lm_loss)
  with pytest.raises(UnusableStateError, match=r"\(step 1\) was donated"):
    loss(new)
  assert loss(newer) != after
  newer.close()


def test_nvme_states_restore_in_the_same_process(mesh, tmp_path):
  """A restore onto the nvme_path of a run that is still open replaces its store (a warning;
  that run's states are refused after); after close() (the run's, or its store's alone) or
  once its states are dropped, the folder is free at once; `with` closes the run."""
  cfg = zero("nvme", "nvme", tmp_path / "nvme")
  state = zinfjax.init(factory, tx(), cfg, mesh, 0)
  state, _ = zinfjax.train_step(state, BATCHES[0], lm_loss)
  want = loss(state)
  with Checkpointer(tmp_path / "ckpt") as ckpt:
    ckpt.save(state)
  with pytest.warns(StoreReplacedWarning, match="held by an earlier run of this process"):
    restored, _ = Checkpointer(tmp_path / "ckpt").restore(factory, tx(), cfg, mesh)
  assert loss(restored) == want
  with pytest.raises(UnusableStateError, match="closed .*replaced by a later zinfjax.init or "
                     "Checkpointer.restore on the same nvme_path"):
    loss(state)
  restored.close()
  with warnings.catch_warnings():
    warnings.simplefilter("error", StoreReplacedWarning)
    again, _ = Checkpointer(tmp_path / "ckpt").restore(factory, tx(), cfg, mesh)
    assert loss(again) == want
    del again
    gc.collect()
    # the store alone closed by hand: its folders are free, and its states refused clearly
    hand = zinfjax.init(factory, tx(), cfg, mesh, 0)
    hand.engine.store.close()
    zinfjax.init(factory, tx(), cfg, mesh, 0).close()
    with pytest.raises(UnusableStateError, match=r"run is closed \(its swap store on .* was "
                       r"closed \(engine.store.close\(\)\)\)"):
      loss(hand)
    with zinfjax.init(factory, tx(), cfg, mesh, 0) as fresh:
      assert loss(fresh) != want
  with pytest.raises(UnusableStateError, match=r"run is closed \(closed by TrainState.close\(\)\)"):
    loss(fresh)


def test_a_second_store_on_a_folder_names_this_process(tmp_path):
  from zinfjax.offload import AioStore, StoreLockedError
  first = AioStore(tmp_path, backend="threads")
  with pytest.raises(StoreLockedError, match=rf"in use by this process \(pid {os.getpid()}\).*"
                     r"state.close\(\)"):
    AioStore(tmp_path, backend="threads")
  first.close()
  AioStore(tmp_path, backend="threads").close()


# ------------------------------------------------------------------ optimizer states on any tier
def stored(folder) -> dict[str, np.ndarray]:
  """Every array of a checkpoint's latest step, by name, as stored."""
  ckpt = Checkpointer(folder)
  meta = ckpt.metadata()
  out = {}
  for name, info in meta["leaves"].items():
    leaf = Leaf(name, tuple(info["shape"]), np.dtype(info["dtype"]), None, [])
    arr = open_checked(os.path.join(ckpt.directory, str(meta["step"]), "state", name), leaf)
    out[name] = read(arr, tuple(slice(0, n) for n in leaf.shape), leaf, leaf.dtype)
  return out


@pytest.fixture(scope="module")
def saved(tmp_path_factory, mesh):
  """Per optimizer tier: a checkpoint after 2 steps (moments far from zero)."""
  out = {}
  for tier in TIERS:
    folder = tmp_path_factory.mktemp(f"opt-{tier}")
    with zinfjax.init(factory, tx(), zero("device", tier, folder / "nvme"), mesh, 0) as state:
      for batch in BATCHES[:2]:
        state, _ = zinfjax.train_step(state, batch, lm_loss)
      with Checkpointer(folder / "ckpt") as ckpt:
        ckpt.save(state)
    out[tier] = folder / "ckpt"
  return out


@pytest.mark.parametrize("source", TIERS)
@pytest.mark.parametrize("target", TIERS)
def test_optimizer_states_restore_onto_every_tier(source, target, saved, mesh, tmp_path):
  """A checkpoint of the optimizer on `source` restores with it on `target` and saves back
  bit for bit (master, both moments, counts)."""
  state, _ = Checkpointer(saved[source]).restore(factory, tx(), zero("device", target, tmp_path),
                                                 mesh)
  assert state.engine.plan.tiers("master") == {target}
  with state, Checkpointer(tmp_path / "again") as ckpt:
    ckpt.save(state)
  want, got = stored(saved[source]), stored(tmp_path / "again")
  assert set(got) == set(want) and any(k.startswith("opt/mu/") for k in want)
  for k in want:
    np.testing.assert_array_equal(got[k], want[k], err_msg=k)
  assert all(np.abs(want[k]).max() > 0 for k in want if k.startswith(("opt/mu/", "opt/nu/")))


def cli(*args, ok=True):
  done = subprocess.run([sys.executable, SCRIPT, "--preset", "tiny", "--batch-size", "4",
                         "--seq-len", "16", "--devices", "2", "--log-every", "1", *map(str, args)],
                        cwd=REPO, capture_output=True, text=True, timeout=600, env=ENV)
  assert (done.returncode == 0) == ok, done.stderr[-3000:]
  assert "Traceback" not in done.stderr, done.stderr[-3000:]
  return done


def test_cli_resumes_onto_other_optimizer_tiers(tmp_path):
  """train_gpt.py keeps one optimizer format on every tier: NVMe -> device -> pinned host; the
  plan line counts the all-or-nothing copies on the drive. The metrics file keeps the steps
  before each resume and drops those after its checkpoint (a run killed past it)."""
  metrics = tmp_path / "m.jsonl"
  ckpt = ["--checkpoint-dir", tmp_path / "ckpt", "--save-every", "1", "--metrics-jsonl", metrics]
  out = cli("--steps", "2", "--offload-optimizer", "nvme", "--nvme-path", tmp_path / "nvme", *ckpt)
  plan = re.search(r"model states per device \(plan\): .*nvme ([\d.]+ \w+) \(of which ([\d.]+ \w+) "
                   r"are the copies that make each step all or nothing\)", out.stdout)
  assert plan, out.stdout
  with open(metrics, "a") as f:  # a step past the checkpoint, and a line cut by a kill
    f.write('{"step": 3, "loss": 99.0}\n{"step": 4, "lo')
  out = cli("--steps", "3", "--offload-optimizer", "device", "--resume", *ckpt)
  assert "resumed from step 2 " in out.stdout
  out = cli("--steps", "4", "--offload-optimizer", "pinned_host", "--resume", *ckpt)
  assert "resumed from step 3 " in out.stdout and "step     4/4" in out.stdout
  records = [json.loads(line) for line in open(metrics)]
  assert [r["step"] for r in records] == [1, 2, 3, 4], records
  assert all(np.isfinite(r["loss"]) and r["loss"] != 99.0 for r in records), records


# ------------------------------------------------------------------ batches
def test_a_bad_batch_is_refused_before_the_step_with_its_fix(mesh):
  """Each batch below stops `train_step` with an error naming the problem; the state is not
  consumed (nothing ran), and a good batch trains after them."""
  with zinfjax.init(factory, tx(), zinfjax.ZeroConfig(precision="fp32", micro_batches=2), mesh,
                    rng=0) as state:
    good = {k: np.concatenate([v] * 2) for k, v in BATCHES[0].items()}  # 16 examples
    bad = [
        ({k: v[:7] for k, v in good.items()},
         "does not split over 8 devices on axis 'data'; use a batch size that is a multiple of 8"),
        ({**good, "targets": np.concatenate([good["targets"]] * 2)},
         "different numbers of examples on their leading axis (['inputs'] has 16, ['targets'] has 32)"),
        ({**good, "weight": np.float32(1.0)}, "a batch leaf is a scalar"),
        (BATCHES[0], "ZeroConfig.micro_batches=2 does not divide; use a batch size that is a "
         "multiple of 16"),
        ({**good, "targets": np.where(np.arange(16)[:, None] == 9, 64, good["targets"])},
         "lm_loss: batch['targets'] holds id 64 at (9, 0), outside the model's vocabulary of 64 "
         "ids (0 to 63; a target of -100 is ignored)"),
        ({**good, "name": np.array(["a"] * 16)}, "batch leaf ['name'] holds <U1 values: a batch "
         "holds numeric arrays only"),
        ({"inputs": good["inputs"]}, "lm_loss takes a batch dict with 'inputs' (token ids [B, T]) "
         "and 'targets' (the next ids, -100 to ignore one), got keys ['inputs']"),
        ({k: v[:0] for k, v in good.items()}, "batch leaf of shape (0, 16) holds no examples"),
        ({**good, "targets": good["targets"].tolist()},
         "batch leaf ['targets'] is a Python list of numbers: give an array (np.asarray(...))"),
        ({k: v.reshape(-1)[:16] for k, v in good.items()},
         "lm_loss takes inputs of token ids [B, T] (examples, positions), got 1 axes (16,)"),
        ({**good, "targets": good["targets"].astype(np.float32)},
         "lm_loss: batch['targets'] holds float32 values, not token ids: give integers"),
        ({k: np.concatenate([v, v], axis=1) for k, v in good.items()},
         "sequence of 32 tokens is longer than seq_len=16, the positions the GPT learns: cut "
         "the batch's sequences to at most 16 tokens"),
        ({**good, "inputs": np.where(np.arange(16) == 3, -1, good["inputs"])},
         "lm_loss: batch['inputs'] holds id -1 at (0, 3), outside the model's vocabulary"),
    ]
    for batch, message in bad:
      with pytest.raises(ValueError, match=re.escape(message)):
        zinfjax.train_step(state, batch, lm_loss)
      state.check_usable("the test")
    chunked = functools.partial(lm_loss, chunk=8)  # the check is found through a partial
    with warnings.catch_warnings():
      warnings.simplefilter("ignore", RecompileWarning)  # lm_loss's code, once more
      with pytest.raises(ValueError, match=re.escape(bad[-1][1])):
        zinfjax.train_step(state, bad[-1][0], chunked)
    with pytest.raises(ValueError, match=re.escape(bad[-1][1])):
      zinfjax.eval_step(state, bad[-1][0], lm_loss)
    # inside jax.jit the state is traced: refused by name, not by a tracer error deep inside
    for call in (lambda s: zinfjax.train_step(s, good, lm_loss)[1]["loss"],
                 lambda s: zinfjax.eval_step(s, good, lm_loss)["loss"]):
      with pytest.raises(TypeError, match="inside a jax transformation .* outside jax.jit"):
        jax.jit(call)(state)
      state.check_usable("the test")
    # a leaf of bf16 (an ml_dtypes type, numpy kind "V") is numbers like any other
    good["weight"] = np.ones(16, ml_dtypes.bfloat16)
    state, metrics = zinfjax.train_step(state, good, lm_loss)
    assert np.isfinite(float(metrics["loss"]))


def test_a_model_factory_that_builds_no_model_is_named(mesh):
  """`init` calls `model_factory(rngs)`: one that takes no argument, or returns something that is
  not an nnx module, is refused with the form it needs (not flax's error on what it returned)."""
  cases = [(lambda: factory(nnx.Rngs(0)), "cannot be called with one argument"),
           (lambda rngs: nnx.state(factory(rngs)), "returned State, not an nnx.Module")]
  for make, message in cases:
    for build in (zinfjax.init, zinfjax.abstract_init):
      with pytest.raises(TypeError, match=re.escape(message)):
        build(make, tx(), zinfjax.ZeroConfig(precision="fp32"), mesh)


class _WithIds(nnx.Module):
  def __init__(self, rngs):
    self.w = nnx.Param(jax.random.normal(rngs.params(), (4, 4)))
    self.ids = nnx.Param(jax.numpy.arange(4))

  def __call__(self, x):
    return x @ self.w + self.ids


def test_an_integer_param_is_named(mesh):
  """An int nnx.Param would be cast to the compute dtype and moved by Adam: refused, named."""
  with pytest.raises(ValueError, match=re.escape("these nnx.Params are not: ids (int32)")):
    zinfjax.init(_WithIds, tx(), zinfjax.ZeroConfig(precision="fp32"), mesh)


class _WithState(nnx.Module):
  def __init__(self, rngs):
    self.linear = nnx.Linear(4, 4, rngs=rngs)
    self.norm = nnx.BatchNorm(4, rngs=rngs)

  def __call__(self, x):
    return self.norm(self.linear(x))


def test_state_that_is_no_param_is_named(mesh):
  """Batch stats (or a dropout's rng counter) would not be carried by the step: refused before
  compute, each variable named with its kind and the fix."""
  with pytest.raises(ValueError, match=r"holds 2 other variables: norm/mean \(BatchStat\), "
                     r"norm/var \(BatchStat\)\. Build it without them"):
    zinfjax.init(_WithState, tx(), zinfjax.ZeroConfig(precision="fp32"), mesh)


def test_a_tx_that_is_no_optax_transformation_is_named(mesh):
  """`tx` is checked before the model is traced: None (or an optimizer class rather than its
  transformation) is refused with the form it needs, not an AttributeError from inside."""
  for bad in (None, zinfjax.optim.adamw):
    with pytest.raises(TypeError, match="tx must be an optax GradientTransformation, got"):
      zinfjax.init(factory, bad, zinfjax.ZeroConfig(precision="fp32"), mesh)


# ------------------------------------------------------------------ the CLI's input checks
def train_gpt_main():
  return load_script("train_gpt").main


def test_cli_refuses_bad_input_before_any_compute(tmp_path, monkeypatch, capsys):
  """Each of these stops the CLI with one `error:` line before init (no step is lost)."""
  monkeypatch.setattr(sys, "excepthook", sys.excepthook)  # main() installs its own
  main = train_gpt_main()
  a_file = tmp_path / "file"
  a_file.write_text("x")
  short = tmp_path / "short.txt"
  short.write_text("to be or not")
  broken = tmp_path / "broken"
  shutil.copytree(os.path.join(REPO, "tests", "data", "hf", "llama"), broken)
  (broken / "config.json").write_text('{"model_type": "llama",')
  cases = [
      (["--init-from", broken, "--layers", "3"],
       "--layers with --init-from: the model's shape comes from"),
      (["--init-from", broken], f"{broken / 'config.json'} is not valid JSON"),
      (["--layers", "2", "--offload-param", "device:5,pinned_host"],
       "offload_param='device:5,pinned_host' places 5 layers by count, but the model's stacks "
       "have 2 layers"),
      # the host pipeline keeps pinned host in its store: the message names the tier as given
      (["--layers", "2", "--offload-optimizer", "device:3,pinned_host", "--host-optimizer",
        "pipeline"], "offload_optimizer='device:3,pinned_host' places 3 layers by count"),
      (["--save-every", "-1"], "--save-every -1: give a number of steps above 0"),
      (["--eval-every", "-2"], "--eval-every -2: give a number of steps above 0"),
      (["--keep", "0"], "--keep 0: keep at least 1 checkpoint"),
      (["--init-from", broken, "--lora-rank", "2", "--zero-stage", "2"],
       "--lora-rank 2 trains the adapters alone, with the base weights frozen, which needs "
       "--zero-stage 3 (got 2)"),
      (["--weight-decay", "-0.1"], "--weight-decay -0.1: give a finite number, 0 or above"),
      (["--clip", "-1"], "--clip -1.0: give a finite number, 0 or above (0: no clipping)"),
      (["--clip", "nan"], "--clip nan: give a finite number"),
      (["--seed", "-1"], "--seed -1: give a finite number, 0 or above."),
      (["--warmup-steps", "-3"], "--warmup-steps -3: give a finite number, 0 or above"),
      (["--offload-optimizer", "pinned_host:1,nvme"],
       "--offload-optimizer pinned_host:1,nvme puts states on NVMe: give --nvme-path FOLDER"),
      (["--export", a_file], f"--export {a_file} is an existing file"),
      (["--init-from", broken, "--export", broken],
       f"--export {broken} is the --init-from folder: the export would replace the weights"),
      (["--export", a_file / "out"], f"--export {a_file / 'out'}: cannot write there"),
      (["--metrics-jsonl", tmp_path], f"--metrics-jsonl {tmp_path} is a folder"),
      (["--metrics-jsonl", short], f"--metrics-jsonl {short}: it holds something other than "
       "metrics (no JSON record in its first lines), which the run would overwrite"),
      (["--data", short, "--seq-len", "32"], f"--data {short} has 12 tokens, fewer than one "
       "sequence needs (34 for --seq-len 32)"),
  ]
  for args, message in cases:
    with pytest.raises(SystemExit) as stop:
      main(["--steps", "1", "--batch-size", "8", *map(str, args)])
    assert str(stop.value).startswith("error: ") and message in str(stop.value), (args, stop.value)
    assert "init " not in capsys.readouterr().out
    # the RAM watch it started is stopped too: one left sampling would outlive the run
    assert not [t for t in threading.enumerate() if t.name == "zinfjax-memwatch"], args
  assert short.read_text() == "to be or not"  # the data named as a metrics file is kept
  # a zero learning rate is a valid run (pipelines, exports): a warning, and the weights stay
  out = cli("--steps", "2", "--same-batch", "--lr", "0")
  assert "warning: --lr 0" in out.stderr
  first, last = re.search(r"loss ([\d.]+) -> ([\d.]+)", out.stdout).groups()
  assert first == last


def test_a_metrics_file_never_empties_someone_elses_data(tmp_path):
  """open_metrics refuses a file of other data (fresh or resumed) and leaves it whole; a stream
  such as /dev/stdout (here a log file the shell opened) is written on, never emptied."""
  data = tmp_path / "input.txt"
  data.write_text("to be or not\n")
  for resumed_at in (0, 3):
    with pytest.raises(ValueError, match="holds something other than metrics"):
      open_metrics(str(data), resumed_at)
    assert data.read_text() == "to be or not\n"
  with open(tmp_path / "log.txt", "w") as log:
    log.write("step 1 | loss 4.2\n")
    log.flush()
    for resumed_at in (0, 3):
      with open_metrics(f"/proc/self/fd/{log.fileno()}", resumed_at) as f:
        f.write('{"step": 4}\n')
  assert (tmp_path / "log.txt").read_text() == 'step 1 | loss 4.2\n{"step": 4}\n{"step": 4}\n'


def test_a_tokenizer_past_the_models_vocabulary_is_named(tmp_path, monkeypatch):
  """Text fine-tuning data encoded with ids past the model's embedding (a tokenizer with added
  tokens, or one of another model) is refused before init, naming the id and the vocabulary."""
  import types
  from zinfjax.models import load_tokens
  ids = {"a": 3, "b": 7}
  tokenizer = lambda path: types.SimpleNamespace(  # what tokenizers.Tokenizer.from_file gives
      encode=lambda text: types.SimpleNamespace(ids=[ids[c] for c in text]))
  fake = types.SimpleNamespace(Tokenizer=types.SimpleNamespace(from_file=tokenizer))
  monkeypatch.setitem(sys.modules, "tokenizers", fake)
  (tmp_path / "tokenizer.json").write_text("{}")
  data = tmp_path / "text.txt"
  data.write_text("abba")
  finetune_tokens = load_script("train_gpt").finetune_tokens
  assert finetune_tokens(str(data), str(tmp_path), 8, load_tokens).tolist() == [3, 7, 7, 3]
  with pytest.raises(ValueError, match="token id 7, past the model's vocabulary of 7 ids"):
    finetune_tokens(str(data), str(tmp_path), 7, load_tokens)


def test_a_resume_compares_the_model_as_the_checkpoint_stores_it():
  """A Gemma 3 model's config (its layer_types a tuple, a list once in the checkpoint's JSON)
  resumes its own checkpoint; another layer pattern is refused, naming the field."""
  import dataclasses
  from zinfjax.models import hf
  same_model = load_script("train_gpt").same_model
  config = hf.config_from_hf(hf.read_config(os.path.join(REPO, "tests", "data", "hf", "gemma3")))
  saved = json.loads(json.dumps(dataclasses.asdict(config)))
  same_model(saved, config, "ckpt")
  with pytest.raises(SystemExit, match=r"layer_types \['sliding', 'full', 'sliding'\] there, "
                                       r"\['full', 'full', 'sliding'\] here"):
    same_model(saved, config.replace(layer_types=("full", "full", "sliding")), "ckpt")


def test_weights_with_a_lying_shape_name_the_tensor_and_file(mesh, tmp_path):
  folder = tmp_path / "llama"
  shutil.copytree(os.path.join(REPO, "tests", "data", "hf", "llama"), folder)
  path = folder / "model-00001-of-00003.safetensors"
  raw = path.read_bytes()
  n = struct.unpack("<Q", raw[:8])[0]
  header = json.loads(raw[8:8 + n])
  name = "model.embed_tokens.weight"
  header[name]["shape"] = header[name]["shape"][::-1]  # the same bytes, another shape
  text = json.dumps(header, separators=(",", ":")).encode()
  path.write_bytes(raw[:8] + text.ljust(n) + raw[8 + n:])
  config, make_model, weights = hf.load(str(folder))
  with pytest.raises(ValueError, match=rf"from tensor '{re.escape(name)}' \[32, 128\] of "
                     rf"{re.escape(str(path))}"):
    zinfjax.init(make_model, tx(), zinfjax.ZeroConfig(), mesh, params=weights)


def test_nvme_space_error_scales_its_sizes(mesh, tmp_path, monkeypatch):
  from zinfjax import engine
  from zinfjax.offload import NoSpaceError
  real = shutil.disk_usage
  monkeypatch.setattr(engine.shutil, "disk_usage", lambda p: real(p)._replace(free=1000))
  with pytest.raises(NoSpaceError, match=r"has 1000 B free, but the states placed on NVMe need "
                     r"[\d.]+ (KiB|MiB) \(params [\d.]+ KiB"):
    zinfjax.init(factory, tx(), zero("nvme", "nvme", tmp_path / "nvme"), mesh, 0)


def test_a_save_that_fails_is_one_error_and_leaves_no_partial_folder(mesh, tmp_path, monkeypatch):
  """A drive that fills while NVMe shards are copied into a save: a CheckpointError naming the
  step and the last committed one; its temporary folder is removed; the earlier step stays."""
  from zinfjax.checkpoint import handler
  with zinfjax.init(factory, tx(), zero("nvme", "nvme", tmp_path / "nvme"), mesh, 0) as state:
    state, _ = zinfjax.train_step(state, BATCHES[0], lm_loss)
    ckpt = Checkpointer(tmp_path / "ckpt")
    ckpt.save(state)
    ckpt.wait()
    state, _ = zinfjax.train_step(state, BATCHES[1], lm_loss)

    def full(*args, **kwargs):
      raise OSError(28, "No space left on device")

    monkeypatch.setattr(handler, "save_blocks", full)
    with pytest.raises(CheckpointError, match=r"^saving step 2 to .* failed: OSError: \[Errno 28\] "
                       r"No space left on device\. Nothing earlier was lost \(the last committed "
                       r"checkpoint is step 1\)"):
      ckpt.save(state)
    assert sorted(n for n in os.listdir(tmp_path / "ckpt") if not n.startswith(".")) == ["1"]
    monkeypatch.undo()
    assert ckpt.save(state)
    ckpt.close()
  assert Checkpointer(tmp_path / "ckpt").all_steps() == [1, 2]


def test_ctrl_c_names_the_last_complete_checkpoint(tmp_path):
  ckpt = tmp_path / "ckpt"
  proc = subprocess.Popen(
      [sys.executable, SCRIPT, "--preset", "tiny", "--batch-size", "4", "--seq-len", "16",
       "--devices", "2", "--log-every", "1", "--steps", "100000", "--save-every", "2",
       "--checkpoint-dir", str(ckpt)], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
      text=True, env=ENV)
  try:
    for line in proc.stdout:
      if line.startswith("step     5/"):
        break
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=300)
  finally:
    proc.kill()
  assert proc.returncode == 130, err[-3000:]
  found = re.search(r"interrupted during step (\d+): the last complete checkpoint is step (\d+) "
                    rf"in {re.escape(str(ckpt))} \(--resume goes on from it\)", err)
  assert found and "Traceback" not in err, err[-3000:]
  last = int(found.group(2))
  assert last >= 4 and last == max(Checkpointer(ckpt).all_steps())
