"""scripts/fuzz_configs.py and fuzz_processes.py: random configs against optax and against one
process, and tolerances that catch real bugs."""

import os
import subprocess
import sys

import numpy as np
import optax

from helpers import REPO, load_script, script_env

fuzz = load_script("fuzz_configs")
import _fuzz_reference as ref  # noqa: E402 - on the path once fuzz_configs is loaded


def test_random_configs_train_as_optax_does_through_a_checkpoint_and_a_nan_step():
  """Two drawn trials, each resumed halfway from a checkpoint onto another placement, with one
  NaN step skipped. Seed 11: params in pinned host, the optimizer split over NVMe, pinned host
  and the device, clipping, 2 devices, resumed with params over the device and NVMe and the
  optimizer in pinned host under the host pipeline, 4 devices; seed 14: both split over all
  three tiers, 2 tiles, the layer norms frozen, resumed with params over NVMe and pinned host."""
  out = subprocess.run([sys.executable, os.path.join(REPO, "scripts", "fuzz_configs.py"),
                        "--seeds", "11", "14", "--restore", "--nan", "--timeout", "300"],
                       cwd=REPO, capture_output=True, text=True, timeout=900, env=script_env())
  assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
  assert "passed=2 refused=0 failed=0" in out.stdout, out.stdout


def test_random_configs_with_a_delayed_update_train_as_its_reference():
  """Seed 512: delay_update="all", params over pinned host and NVMe, the optimizer over NVMe,
  pinned host and the device (the device's layer is not delayed), 8 devices; seed 528: "all"
  with the optimizer in pinned host under the host pipeline, clipping every step."""
  out = subprocess.run([sys.executable, os.path.join(REPO, "scripts", "fuzz_configs.py"),
                        "--seeds", "512", "528", "--delay", "--timeout", "300"],
                       cwd=REPO, capture_output=True, text=True, timeout=900, env=script_env())
  assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
  assert "passed=2 refused=0 failed=0" in out.stdout, out.stdout
  assert out.stdout.count("'delay_update': 'all'") == 2


def test_a_bf16_llama_with_lora_trains_as_on_the_device_through_a_nan_step():
  """bf16, against the same run with every state on the device. Seed 4201: a Llama with LoRA
  adapters only training, params and optimizer on NVMe under XLA's host optimizer, 2 tiles, 2
  micro-batches, 8 devices; seed 4204: params on the device, the optimizer over pinned host
  and NVMe under the AdamW stream, 4 devices. Each skips one NaN step."""
  out = subprocess.run([sys.executable, os.path.join(REPO, "scripts", "fuzz_configs.py"),
                        "--seeds", "4201", "4204", "--model", "llama", "--lora", "--precision",
                        "bf16", "--nan", "--timeout", "300"],
                       cwd=REPO, capture_output=True, text=True, timeout=900, env=script_env())
  assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
  assert "passed=2 refused=0 failed=0" in out.stdout, out.stdout
  assert out.stdout.count("'precision': 'bf16'") == 2
  assert out.stdout.count("'trainable': 'lora'") == 2


def test_two_processes_train_a_drawn_config_as_one_through_a_resume():
  """scripts/fuzz_processes.py, seed 202: params over the device and pinned host, the optimizer
  over pinned host, the device and NVMe, every update a step late, 2 tiles, clipping; two
  processes of 4 devices save at step 2, a second launch resumes (the held grads of the
  delayed update in the checkpoint), and every loss equals one process of 8, and so does
  the model each layout exports (two processes from their last checkpoint)."""
  out = subprocess.run([sys.executable, os.path.join(REPO, "scripts", "fuzz_processes.py"),
                        "--seeds", "202", "--resume", "--params", "--timeout", "300"],
                       cwd=REPO, capture_output=True, text=True, timeout=900, env=script_env())
  assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
  assert "ok=1 refused=0 failed=0" in out.stdout, out.stdout
  assert "--delay-update all" in out.stdout and "worst param element" in out.stdout


def test_two_exports_differing_by_one_update_are_caught():
  """The processes fuzz's param check passes rounding noise, not a tensor one update behind
  (a layer's params a step stale, or the checkpoint before the last exported)."""
  processes = load_script("fuzz_processes")
  rng = np.random.default_rng(0)
  one = {f"w{i}": rng.normal(0, 0.02, (16, 8)).astype(np.float32) for i in range(3)}
  noise = {k: v + rng.normal(0, 1e-7, v.shape).astype(np.float32) for k, v in one.items()}
  assert processes.compare_params(one, noise)[0] is None
  stale = dict(noise, w1=noise["w1"] - 1e-3 * np.sign(rng.normal(size=(16, 8))))
  bad, _ = processes.compare_params(one, stale)
  assert bad is not None and "(w1)" in bad
  assert "tensors exported" in processes.compare_params(one, {"w0": one["w0"]})[0]


def test_the_comparison_catches_a_wrong_weight_decay_and_a_step_count_off_by_one(monkeypatch):
  """The tolerances pass the same training in another summation order but not a small bug:
  weight decay 0.11 for 0.1, or a schedule a step ahead (a skipped step that counted)."""
  from zinfjax.models import GPT, get_config
  gpt = get_config("tiny", num_layers=2)
  make_model = lambda r: GPT(gpt, rngs=r)
  data = fuzz.batches(3, gpt.vocab_size, nan_step=None)
  want = ref.reference(make_model, 0.5, data, None)
  assert ref.compare(want[0], want[2], *want) is None

  def bugged(weight_decay=0.1, shift=0):
    base = ref.schedule()
    tx = optax.adamw(lambda count: base(count + shift), weight_decay=weight_decay)
    monkeypatch.setattr(ref, "reference_tx", lambda clip: optax.chain(
        optax.clip_by_global_norm(clip), tx))
    losses, _, params = ref.reference(make_model, 0.5, data, None)
    return ref.compare(losses, params, *want)

  assert "param leaf" in bugged(weight_decay=0.11)
  assert bugged(shift=1) is not None
  assert np.all(np.isfinite(want[0]))


def test_the_tolerance_widens_to_a_models_own_rounding_and_no_further(monkeypatch):
  """An OLMo 2 shaped Llama (norms on the MLP's and attention's outputs, q/k norms) amplifies
  fp32 rounding past fp32's element tolerance: started one ulp away, its own reference moves
  that far, and the calibrated tolerance allows twice that, taking six starts where two show it
  amplifies (how far it moves varies tenfold). A GPT keeps fp32's tolerance from two. A weight
  decay of 0.11 for 0.1 is still caught on the Llama."""
  from zinfjax.models import GPT, get_config
  shape = {"num_layers": 3, "vocab_size": 65, "lora_rank": 0, "hidden": 64, "intermediate": 96,
           "num_heads": 4, "num_kv_heads": 1, "tie_embeddings": True, "qkv_bias": True,
           "seq_len": 32, "sliding_window": None, "qk_norm": True, "qk_norm_span": "head",
           "post_norm": True}
  llama = fuzz.model_maker("llama", shape)
  data = fuzz.batches(2505, shape["vocab_size"], nan_step=None)
  want = ref.reference(llama, 1000.0, data, None)
  starts, reference = [], ref.reference
  monkeypatch.setattr(ref, "reference", lambda *a, jitter=None: (
      starts.append(jitter), reference(*a, jitter=jitter))[1])
  tol, floor = ref.calibrated(ref.FP32, want, llama, 1000.0, data, None)
  assert floor["element"] > ref.FP32.element and tol.element == 2 * floor["element"]
  assert starts == list(range(6))   # a model that amplifies: four starts more than the two
  config = get_config("tiny", num_layers=2)
  gpt = lambda r: GPT(config, rngs=r)
  gpt_data = fuzz.batches(3, config.vocab_size, nan_step=None)
  assert ref.calibrated(ref.FP32, reference(gpt, 0.5, gpt_data, None), gpt, 0.5, gpt_data,
                        None)[0] == ref.FP32
  assert starts[6:] == [0, 1]
  monkeypatch.setattr(ref, "reference", reference)
  monkeypatch.setattr(ref, "reference_tx", lambda clip: optax.chain(
      optax.clip_by_global_norm(clip), optax.adamw(ref.schedule(), weight_decay=0.11)))
  losses, _, params = ref.reference(llama, 1000.0, data, None)
  assert "param leaf" in ref.compare(losses, params, *want, tol)
