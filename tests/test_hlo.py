"""scripts/_hlo.py: the matrix products a compiled program runs, read from its HLO (checked on
XLA:CPU programs, and on XLA:GPU's custom calls as they print), and scripts/compile_gpu.py: its
refusals, and its rows for a placed optimizer (compiled here for the CPU)."""

import importlib.util
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import REPO

SCRIPTS = os.path.join(REPO, "scripts")
sys.path.insert(0, SCRIPTS)
import _hlo  # noqa: E402


def test_products_are_counted_with_their_loops():
  """A scan of 5 layers (a while loop, or unrolled), a product after it, and their gradient:
  every product's 2·M·N·K, times the iterations that run it."""
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.standard_normal((8, 16)), jnp.float32)
  ws = jnp.asarray(rng.standard_normal((5, 16, 16)), jnp.float32)

  def loss(ws, x):
    h, _ = jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), x, ws)
    return (h @ h.T).sum()

  layer, last = 2 * 8 * 16 * 16, 2 * 8 * 8 * 16
  forward = _hlo.matmul_flops(jax.jit(loss).lower(ws, x).compile().as_text())
  assert forward.by_dtype == {"f32": 5 * layer + last} and forward.total == 5 * layer + last
  # with the gradient to the weights: each layer's product again (saved inputs, no recompute)
  # and its two pullbacks (to h and to w); h h^T's forward and its pullback (one or two
  # products, as XLA folds (g + g^T) h)
  both = _hlo.matmul_flops(jax.jit(jax.value_and_grad(loss)).lower(ws, x).compile().as_text())
  assert 15 * layer + 2 * last <= both.total <= 15 * layer + 3 * last, both
  assert both.attention == 0


GPU_HLO = """HloModule m

%branch_a (p: f32[4]) -> f32[4] {
  %p = f32[4]{0} parameter(0)
  ROOT %d = f32[4]{0} add(%p, %p)
}

%branch_b (q: f32[4]) -> f32[4] {
  %q = f32[4]{0} parameter(0)
  ROOT %e = f32[4]{0} multiply(%q, %q)
}

%body (t: (s32[], bf16[64,32])) -> (s32[], bf16[64,32]) {
  %t = (s32[], bf16[64,32]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%t), index=0
  %a = bf16[64,32]{1,0} get-tuple-element(%t), index=1
  %w = bf16[32,32]{1,0} constant({...})
  %g = (bf16[64,32]{1,0}, s8[1024]{0}) custom-call(%a, %w), custom_call_target="__cublas$gemm", backend_config={"gemm_backend_config":{"dot_dimension_numbers":{"lhs_contracting_dimensions":["1"],"rhs_contracting_dimensions":["0"],"lhs_batch_dimensions":[],"rhs_batch_dimensions":[]}}}
  %o = bf16[64,32]{1,0} get-tuple-element(%g), index=0
  ROOT %r = (s32[], bf16[64,32]{1,0}) tuple(%i, %o)
}

%cond (c: (s32[], bf16[64,32])) -> pred[] {
  %c = (s32[], bf16[64,32]{1,0}) parameter(0)
  ROOT %k = pred[] constant(true)
}

ENTRY %main (x: bf16[64,32], q: bf16[2,128,4,64], s: f32[4], b: pred[]) -> f32[4] {
  %x = bf16[64,32]{1,0} parameter(0)
  %q = bf16[2,128,4,64]{3,2,1,0} parameter(1)
  %s = f32[4]{0} parameter(2)
  %b = pred[] parameter(3)
  %z = s32[] constant(0)
  %t0 = (s32[], bf16[64,32]{1,0}) tuple(%z, %x)
  %loop = (s32[], bf16[64,32]{1,0}) while(%t0), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"3"}}
  %f = (bf16[2,128,4,64]{3,2,1,0}, f32[2,4,128]{2,1,0}, u8[0]{0}) custom-call(%q, %q, %q), custom_call_target="__cudnn$fmhaSoftmax", backend_config={"cudnn_fmha_backend_config":{"mask_type":"CAUSAL"}}
  %copy.1 = f32[4]{0} copy(%s)
  %big = f32[64,4]{1,0} broadcast(%s), dimensions={1}
  %row = f32[1,4]{1,0} reshape(%s)
  %dus = f32[64,4]{1,0} dynamic-update-slice(%big, %row, %z, %z)
  %br = f32[4]{0} conditional(%b, %copy.1, %copy.1), true_computation=%branch_a, false_computation=%branch_b
  ROOT %out = f32[4]{0} add(%br, %br)
}
"""


def test_gpu_custom_calls_are_counted():
  """cuBLAS GEMMs by their dims (inside a loop of 3), cuDNN's causal attention, state copies,
  the bytes kernels write."""
  flops = _hlo.matmul_flops(GPU_HLO)
  assert flops.by_dtype == {"bf16": 3 * 2 * 64 * 32 * 32}
  assert flops.attention == 4 * 2 * 4 * 128 * 128 * 64 * 0.5
  assert _hlo.custom_calls(GPU_HLO) == {"__cublas$gemm": 1, "__cudnn$fmhaSoftmax": 1}
  # a sliding window of 32 keys (jax writes 0 for none): a query sees 32 - 32²/(2·128) on
  # average, as the model's count says
  causal = '"mask_type":"CAUSAL"'
  for window, keys in [(32, 32 - 32 ** 2 / 256), (0, 64), (128, 64)]:
    text = GPU_HLO.replace(causal, f'{causal},"sliding_window_length":{window}')
    assert _hlo.matmul_flops(text).attention == 4 * 2 * 4 * 128 * keys * 64
  assert _hlo.entry_copies(GPU_HLO) == 16
  # the loop's GEMM output and workspace 3 times, the attention's outputs, the copy, the
  # broadcast, the row (reshaped, then written in place by the update), the costlier branch,
  # the sum
  loop, attention = 3 * (64 * 32 * 2 + 1024), 2 * 128 * 4 * 64 * 2 + 2 * 4 * 128 * 4
  assert _hlo.written_bytes(GPU_HLO) == loop + attention + 16 + 64 * 4 * 4 + 2 * 16 + 16 + 16


def test_compile_gpu_says_what_to_install_without_xla_gpu():
  """Where jax's CUDA plugin is missing, the script says how to get it (no GPU needed)."""
  try:
    installed = importlib.util.find_spec("jax_plugins.xla_cuda13") is not None
  except ImportError:  # no jax_plugins package at all
    installed = False
  if installed:
    pytest.skip("jax's CUDA plugin is installed here: the refusal cannot be shown")
  out = subprocess.run([sys.executable, os.path.join(SCRIPTS, "compile_gpu.py"), "--tokens", "64"],
                       capture_output=True, text=True, timeout=300)
  assert out.returncode != 0
  assert 'pip install "jax[cuda13]"' in out.stderr, out.stderr


def test_compile_gpu_refuses_a_misspelt_tier_before_asking_for_xla_gpu():
  """A bad --offload-optimizer is named, with the tiers there are, whether or not XLA:GPU is
  installed: nothing is compiled."""
  out = subprocess.run([sys.executable, os.path.join(SCRIPTS, "compile_gpu.py"), "--tokens", "64",
                        "--offload-optimizer", "devcie:2,pinned_host"],
                       capture_output=True, text=True, timeout=300)
  assert out.returncode != 0
  assert "--offload-optimizer 'devcie:2,pinned_host'" in out.stderr, out.stderr
  assert "('device', 'pinned_host', 'nvme')" in out.stderr and "pip install" not in out.stderr


def test_compile_gpu_rows_drop_the_optimizer_the_host_pipeline_holds():
  """The step compiled with the optimizer of all but the first layer in the host pipeline's
  store: the program's arguments are smaller by exactly the optimizer bytes the plan moved off
  the device (master and bf16 moments, 8 bytes a param), and it computes the same products."""
  import compile_gpu
  import zinfjax
  from zinfjax.models import GPT, get_config
  from zinfjax.tier import Tier

  mesh = zinfjax.make_mesh(1)
  rows, device_bytes = {}, {}  # each placement's row, and its plan's bytes on the device
  for optimizer in ("device", "device:1,pinned_host"):
    args = compile_gpu.parse_args(["--layers", "4", "--hidden", "64", "--heads", "4", "--seq-len",
                                   "32", "--vocab", "65", "--offload-optimizer", optimizer,
                                   "--bf16-moments", "--layer-residuals", "recompute"])
    rows[optimizer] = compile_gpu.compile_step(args, mesh, 128)
    tx = zinfjax.optim.adamw(1e-4, moment_dtype="bfloat16")
    config = get_config("tiny", num_layers=4, hidden=64, num_heads=4, seq_len=32, vocab_size=65)
    state = zinfjax.abstract_init(lambda r: GPT(config, rngs=r), tx,
                                  compile_gpu.zero_config(args), mesh)
    device_bytes[optimizer] = state.engine.plan.tier_bytes()[Tier.DEVICE]
  whole, placed = rows["device"], rows["device:1,pinned_host"]
  gone = device_bytes["device"] - device_bytes["device:1,pinned_host"]
  block = 12 * 64 * 64 + 13 * 64  # a GPT block's params: qkv, proj, MLP in and out, biases, norms
  assert gone == 3 * 8 * block, (gone, block)
  assert (whole["arguments_gib"] - placed["arguments_gib"]) * 2**30 == pytest.approx(gone, rel=1e-9)
  assert placed["run_tflop"] == pytest.approx(whole["run_tflop"], rel=1e-9)
  assert placed["hbm_gib"] < whole["hbm_gib"] and placed["residuals"] == "recompute"
  assert "optimizer device:1,pinned_host, bf16 moments" in compile_gpu.table([placed], args)


def test_compile_gpu_takes_a_checkpoints_model_from_its_config():
  """--init-from reads config.json alone (a folder or the file), --layers keeps the first
  layers with their kinds: the row's model TFLOP is that model's standard count, and the step
  runs its products (here without recompute) once plus the explicit form's masked half of
  attention, less the norms the count rounds in."""
  import compile_gpu
  import zinfjax
  from zinfjax.models import hf
  from zinfjax.models.config import attention_flops

  folder = os.path.join(REPO, "tests", "data", "hf", "gemma3")
  args = compile_gpu.parse_args(["--init-from", os.path.join(folder, "config.json"), "--layers",
                                 "2", "--seq-len", "32", "--layer-residuals", "save",
                                 "--attention", "explicit"])
  config, _, name = compile_gpu.model_of(args)
  assert config.num_layers == 2 and config.layer_types == ("sliding", "full")
  assert config.sliding_window == 5 and name == f"{hf.family(hf.read_config(folder))} 2 x 32"
  row = compile_gpu.compile_step(args, zinfjax.make_mesh(1), 128)
  model = config.train_flops(128, 32)
  assert row["model_tflop"] * 1e12 == pytest.approx(model, rel=1e-12)
  norms = 4 * config.hidden + 2 * config.dim  # in, out of attention and MLP; q and k per head
  masked = attention_flops(128, 32, config.num_heads * config.dim, [None, None])
  windows = masked - attention_flops(128, 32, config.num_heads * config.dim, [5, None])
  expected = model + masked + windows - 6 * 128 * (2 * norms + config.hidden)
  assert row["run_tflop"] * 1e12 == pytest.approx(expected, rel=1e-12)
  assert name in compile_gpu.table([row], args)


@pytest.mark.parametrize("flags, says", [
    (["--hidden", "64"], "--hidden: the checkpoint's config.json gives the model's shape"),
    (["--seq-len", "4096"], "--seq-len 4096 is longer than the model's 64"),
    (["--layers", "5"], "--layers 5: LlamaConfig.layer_types must give"),
])
def test_compile_gpu_refuses_a_model_it_cannot_make_before_asking_for_xla_gpu(flags, says):
  gemma3 = os.path.join(REPO, "tests", "data", "hf", "gemma3")
  out = subprocess.run([sys.executable, os.path.join(SCRIPTS, "compile_gpu.py"), "--tokens", "64",
                        "--init-from", gemma3, *flags], capture_output=True, text=True, timeout=300)
  assert out.returncode != 0 and says in out.stderr, out.stderr
  assert "pip install" not in out.stderr and "Traceback" not in out.stderr
