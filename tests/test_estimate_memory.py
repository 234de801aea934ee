"""scripts/estimate_memory.py: the paper's memory model, zinfjax's bytes per tier, a plan."""

import json
import os
import subprocess
import sys

import numpy as np

from helpers import REPO, SCRIPTS, run_script as run


def test_estimate_memory_json():
  data = json.loads(run([os.path.join(SCRIPTS, "estimate_memory.py"), "--layers", "50", "--hidden",
                         "4096", "--heads", "16", "--devices", "16", "--offload-optimizer", "nvme",
                         "--json"]))
  n = 12 * 50 * 4096 ** 2
  assert data["num_params"] == n
  assert data["model_states"] == 20 * n
  assert data["per_device"] == {"device": 4 * n // 16, "pinned_host": 0, "nvme": 16 * n // 16}
  assert data["per_node"]["nvme"] == 16 * n
  assert data["model_state_working_memory"] == 16 * 4096 ** 2
  assert data["activation_checkpoints"] == 2 * 1024 * 4096 * 50


def test_estimate_memory_of_a_hugging_face_checkpoint():
  """--init-from takes the shape of a checkpoint folder's config.json and counts its params
  exactly (the tensors its safetensors hold); --plan places that model; --lora-rank counts
  the adapters that train and the frozen rest; a shape given besides, or a sequence past the
  model's, is refused."""
  from zinfjax.weights.safetensors import Checkpoint
  folder = os.path.join(REPO, "tests", "data", "hf", "llama3")
  data = json.loads(run([os.path.join(SCRIPTS, "estimate_memory.py"), "--init-from", folder,
                         "--devices", "2", "--offload-optimizer", "nvme", "--json"]))
  ckpt = Checkpoint(folder)
  n = sum(int(np.prod(ckpt.tensor(k).shape)) for k in ckpt)
  assert data["num_params"] == n and data["inputs"]["seq_len"] == 128  # its own, under 1024
  # the working memory is its largest tensor's (a layer's, as the checkpoint stores them), bf16
  # params and grads, not the paper's GPT MLP
  largest = max(int(np.prod(ckpt.tensor(k).shape)) for k in ckpt)
  assert data["model_state_working_memory"] == 4 * largest
  assert data["largest_operator"] == {"name": "embed.embedding", "shape": [hf_vocab(folder), 32]}
  assert data["per_device"] == {"device": 4 * n // 2, "pinned_host": 0, "nvme": 16 * n // 2}
  out = run([os.path.join(SCRIPTS, "estimate_memory.py"), "--init-from", folder, "--seq-len",
             "64", "--plan", "--budget", "device=100KiB"])
  assert out.startswith(f"the model of {folder}: 2 layers x 32 hidden") and "placement" in out
  # LoRA of rank 2 on every projection (r x (in + out) each): the adapters train, the rest
  # keep their bf16 params alone
  hf = json.loads(open(os.path.join(folder, "config.json"), encoding="utf-8").read())
  d, f = hf["hidden_size"], hf["intermediate_size"]
  k = d // hf["num_attention_heads"]
  q, kv = hf["num_attention_heads"] * k, hf["num_key_value_heads"] * k
  t = 2 * hf["num_hidden_layers"] * (2 * (d + q) + 2 * (d + kv) + 2 * (d + f) + (f + d))
  lora = json.loads(run([os.path.join(SCRIPTS, "estimate_memory.py"), "--init-from", folder,
                         "--devices", "2", "--offload-optimizer", "nvme", "--json",
                         "--lora-rank", "2"]))
  assert lora["num_params"] == n + t and lora["trainable_params"] == t
  assert lora["per_device"] == {"device": n + 2 * t, "pinned_host": 0, "nvme": 8 * t}
  assert lora["per_frozen_param"] == {"device": 2, "pinned_host": 0, "nvme": 0}
  assert lora["model_state_working_memory"] == 2 * largest   # frozen: its params alone
  out = run([os.path.join(SCRIPTS, "estimate_memory.py"), "--init-from", folder, "--plan",
             "--lora-rank", "2"])
  assert f"{t / 1e6:,.2f}M of LoRA adapters of rank 2" in out and "placement" in out
  for extra, problem in [(["--layers", "4"], "--layers with --init-from"),
                         (["--seq-len", "256"], "--seq-len 256 is longer than the model's 128"),
                         (["--lora-rank", "-1"], "--lora-rank -1: give a positive rank")]:
    done = subprocess.run([sys.executable, os.path.join(SCRIPTS, "estimate_memory.py"),
                           "--init-from", folder, *extra], capture_output=True, text=True)
    assert done.returncode == 2 and problem in done.stderr, done.stderr


def hf_vocab(folder: str) -> int:
  with open(os.path.join(folder, "config.json"), encoding="utf-8") as f:
    return json.load(f)["vocab_size"]


def test_estimate_memory_table_for_a_preset():
  stdout = run([os.path.join(SCRIPTS, "estimate_memory.py"), "--preset", "1t", "--devices", "16"])
  assert "1,006.63B params" in stdout and "model-state working memory" in stdout


def test_estimate_memory_counts_the_host_pipelines_ram_store():
  """--host-optimizer pipeline: pinned-host params in the RAM store, twice when the drive's
  steps are all or nothing (the optimizer on NVMe); once without."""
  args = [os.path.join(SCRIPTS, "estimate_memory.py"), "--preset", "tiny", "--offload-param",
          "pinned_host", "--offload-optimizer", "nvme", "--host-optimizer", "pipeline"]
  stdout = run(args)
  assert ("per parameter (bytes, before the split over devices): pinned_host 6, nvme 24; "
          "params and optimizer states in the RAM store and on NVMe twice") in stdout
  assert "pinned_host 4, nvme 12\n" in run(args + ["--no-atomic-nvme"])


def test_estimate_memory_plan_for_budgets(tmp_path):
  """--plan: the placement offload='auto' picks for the budgets (the 2.5B model, abstractly:
  nothing allocated), its bytes per tier and the step time it allows."""
  stdout = run([os.path.join(SCRIPTS, "estimate_memory.py"), "--preset", "2.5b", "--plan",
                "--budget", "device=20GiB", "--budget", "pinned_host=10GiB", "--budget",
                "nvme=100GiB", "--nvme-path", str(tmp_path / "nvme"), "--batch-per-device", "16"])
  # the NVMe optimizer's buffers (3 sets of one layer's largest shard) are raised to what it
  # needs, and the host budget pays for them
  assert ("placement (offload='auto'): params+grads device, optimizer device:9,pinned_host:9,nvme, "
          "pinned buffers 1.56 GiB per process") in stdout
  # and for the new params on their way back to the device (two layers of them) and the grads
  # on their way to the host pipeline (a layer of the stack and the leaf being read)
  assert ("pinned_host    8.40 GiB of    8.69 GiB per device (97%), with 500.19 MiB of the host "
          "pipeline's grads and new params") in stdout
  assert "step time it allows:" in stdout and "nvme bound" in stdout
  assert not (tmp_path / "nvme").exists()
