"""`train_gpt.py --init-from`: fine-tune a Hugging Face checkpoint on every tier, resume, export."""

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from helpers import DATA, REPO, script_env

SCRIPT = os.path.join(REPO, "scripts", "train_gpt.py")
LLAMA = os.path.join(REPO, "tests", "data", "hf", "llama")
ENV = script_env()


def _run(args, ok=True):
  done = subprocess.run([sys.executable, SCRIPT, *args], cwd=REPO, capture_output=True, text=True,
                        timeout=600, env=ENV)
  if ok:
    assert done.returncode == 0, done.stderr[-3000:]
  return done


def test_finetune_checkpoint_resume_and_export(tmp_path):
  tokens = np.frombuffer(open(DATA, "rb").read()[:60000], np.uint8).astype(np.uint16) % 128
  data = tmp_path / "tokens.bin"
  tokens.tofile(data)
  metrics = tmp_path / "m.jsonl"
  source = tmp_path / "llama"  # with the files an export carries along
  shutil.copytree(LLAMA, source)
  (source / "generation_config.json").write_text('{"do_sample": true, "temperature": 0.6}')
  common = ["--init-from", str(source), "--data", str(data), "--devices", "4", "--batch-size", "4",
            "--seq-len", "32", "--precision", "fp32", "--lr", "3e-3",
            "--offload-param", "pinned_host:1,nvme", "--offload-optimizer", "nvme",
            "--delay-update", "tail",
            "--nvme-path", str(tmp_path / "swap"), "--checkpoint-dir", str(tmp_path / "ckpt"),
            "--save-every", "3", "--eval-every", "3", "--metrics-jsonl", str(metrics),
            "--export", str(tmp_path / "out")]
  out = _run(common + ["--steps", "6"]).stdout
  assert "Llama from" in out and "loaded" in out and "exported" in out
  assert "every update but the last step's" not in out
  # with --export the last step's update --delay-update holds back is applied before the last
  # checkpoint (which holds no grads then, as step 3's does) and the export, which equals it
  from zinfjax.checkpoint import Checkpointer, CheckpointParams
  from zinfjax.weights import safetensors
  with Checkpointer(tmp_path / "ckpt") as ckpt:
    assert ckpt.metadata(3)["held"] is not None and ckpt.metadata(6)["held"] is None
  saved = CheckpointParams(tmp_path / "ckpt", 6)
  exported = safetensors.Checkpoint(str(tmp_path / "out"))
  for leaf, name in [("embed/embedding", "model.embed_tokens.weight"),
                     ("layers/block/ln1/scale", "model.layers.1.input_layernorm.weight")]:
    want = saved.full_leaf(leaf)[1 if leaf.startswith("layers/") else ...]
    np.testing.assert_array_equal(np.asarray(exported[name], np.float32), want, err_msg=leaf)
  records = [json.loads(l) for l in metrics.read_text().splitlines()]
  evals = [r["eval_loss"] for r in records if "eval_loss" in r]
  assert len(evals) == 2 and all("lr" in r for r in records) and records[-1]["lr"] > 0
  assert os.path.exists(tmp_path / "out" / "model.safetensors")
  assert json.load(open(tmp_path / "out" / "config.json"))["model_type"] == "llama"
  assert (tmp_path / "out" / "generation_config.json").read_text() == (
      source / "generation_config.json").read_text()
  out = _run(common + ["--steps", "9", "--resume", "--export-dtype", "bfloat16"]).stdout
  assert "resumed from step 6" in out
  assert json.load(open(tmp_path / "out" / "config.json"))["torch_dtype"] == "bfloat16"
  half = safetensors.Checkpoint(str(tmp_path / "out"))
  assert {str(half[n].dtype) for n in half} == {"bfloat16"}
  resumed = [json.loads(l) for l in metrics.read_text().splitlines()]
  assert [r["step"] for r in resumed] == list(range(1, 10))  # the first run's records kept
  assert resumed[:6] == records

  done = _run(["--init-from", LLAMA, "--data", DATA, "--devices", "2", "--steps", "1"], ok=False)
  assert done.returncode != 0 and "needs the model's tokenizer" in done.stderr
  assert "Traceback" not in done.stderr
  done = _run(["--init-from", LLAMA, "--export-dtype", "bfloat16"], ok=False)
  assert done.returncode != 0
  assert "--export-dtype bfloat16 sets the dtype of --export" in done.stderr


def test_finetune_lora_exports_merged_weights(tmp_path):
  tokens = np.frombuffer(open(DATA, "rb").read()[:40000], np.uint8).astype(np.uint16) % 128
  data = tmp_path / "tokens.bin"
  tokens.tofile(data)
  metrics = tmp_path / "m.jsonl"
  common = ["--init-from", LLAMA, "--data", str(data), "--devices", "2", "--batch-size", "4",
            "--seq-len", "32", "--lr", "1e-2", "--precision", "fp32", "--checkpoint-dir",
            str(tmp_path / "ckpt")]
  out = _run(common + ["--steps", "4", "--lora-rank", "2", "--offload-param", "nvme",
                       "--offload-optimizer", "pinned_host", "--nvme-path", str(tmp_path / "swap"),
                       "--export", str(tmp_path / "out"), "--metrics-jsonl", str(metrics)]).stdout
  assert "training LoRA adapters of rank 2 only" in out and "exported" in out
  from zinfjax.models import hf
  config = hf.load(LLAMA)[0]  # the frozen weights take no grads: 4·N·T, not 6
  frozen, full = config.train_flops(4 * 32, 32, frozen=True), config.train_flops(4 * 32, 32)
  records = [json.loads(l) for l in metrics.read_text().splitlines()]
  assert len(records) == 4 and frozen < full
  for r in records:
    assert r["tflops_per_device"] * r["step_time_s"] * 1e12 * 2 == pytest.approx(frozen)
  done = _run(common + ["--steps", "5", "--resume"], ok=False)   # without its adapters
  assert done.returncode != 0 and "Traceback" not in done.stderr
  assert "trained with another model (lora_rank 2 there, 0 here)" in done.stderr
  from zinfjax.weights import safetensors
  theirs = safetensors.Checkpoint(LLAMA)
  ours = safetensors.Checkpoint(str(tmp_path / "out"))
  assert set(ours) == set(theirs)   # merged: the base names only, no adapters
  changed = [n for n in ours if not np.array_equal(ours[n], theirs[n])]
  assert changed and all("proj" in n for n in changed)   # only the adapted projections moved
  # consolidate.py writes the trained adapters and the frozen base weights, each under its name
  consolidated = tmp_path / "params.safetensors"
  subprocess.run([sys.executable, os.path.join(REPO, "scripts", "consolidate.py"),
                  str(tmp_path / "ckpt"), str(consolidated)], check=True, capture_output=True,
                 timeout=300, env=ENV)
  from zinfjax.checkpoint import CheckpointParams
  saved = CheckpointParams(str(tmp_path / "ckpt"))
  written = safetensors.Checkpoint(str(consolidated))
  assert sorted(written) == sorted(n.replace("/", ".") for n in saved)
  assert any("lora" in n for n in written) and any(n.endswith("q.kernel") for n in written)
  for name in saved:
    np.testing.assert_array_equal(written[name.replace("/", ".")], saved.full_leaf(name))
  q = np.asarray(theirs["model.layers.1.self_attn.q_proj.weight"])  # frozen: as loaded
  np.testing.assert_array_equal(written["layers.block.q.kernel"][1], q.T)
  done = _run(["--preset", "tiny", "--lora-rank", "2", "--steps", "1"], ok=False)
  assert done.returncode != 0 and "--lora-rank adapts a pretrained model" in done.stderr
