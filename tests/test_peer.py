"""The DeepSpeed peer (scripts/peer_deepspeed.py) trains the same GPT as zinfjax's bench, set up
the same way. The torch parts need `pip install '.[peer]'` and are skipped without it."""

import inspect
import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest

from helpers import REPO, load_script as load

SCRIPTS = os.path.join(REPO, "scripts")


@pytest.fixture(scope="module")
def peer():
  return load("peer_deepspeed")


def test_deepspeed_config_matches_zinfjax_bench(peer):
  """ZeRO-3 and bf16 everywhere; each placement offloads what its name says; AdamW's
  hyper-parameters are zinfjax.optim.adamw's defaults as bench_gpu.py uses them."""
  import zinfjax
  from zinfjax.models import get_config
  defaults = inspect.signature(zinfjax.optim.adamw).parameters
  offloaded = {}
  for placement in peer.PLACEMENTS:
    config = peer.ds_config(placement, 16, "/tmp/x", 2048)
    zero = config["zero_optimization"]
    assert zero["stage"] == 3 and config["bf16"]["enabled"] and config["gradient_clipping"] == 0
    assert config["train_micro_batch_size_per_gpu"] == 16
    adam = config["optimizer"]["params"]
    assert config["optimizer"]["type"] == "AdamW" and adam["lr"] == 1e-4
    assert (adam["betas"], adam["eps"], adam["weight_decay"]) == (
        [defaults["b1"].default, defaults["b2"].default], defaults["eps"].default,
        defaults["weight_decay"].default)
    offloaded[placement] = (zero.get("offload_param", {}).get("device"),
                            zero.get("offload_optimizer", {}).get("device"))
  assert offloaded == {"device": (None, None), "cpu": ("cpu", "cpu"), "nvme": ("nvme", "nvme")}
  assert peer.ds_config("nvme", 1, "/tmp/x", 64)["zero_optimization"]["offload_param"]["nvme_path"] == "/tmp/x"
  with pytest.raises(ValueError, match="--nvme-path"):
    peer.ds_config("nvme", 1, None, 64)
  args = peer.parse_args(["--out", "/tmp/x", "--layers", "3", "--hidden", "96", "--heads", "4"])
  ours = get_config("tiny", num_layers=3, hidden=96, num_heads=4, seq_len=1024, vocab_size=32768)
  assert peer.gpt_config(args).num_params == ours.num_params
  assert peer.gpt_config(args).train_flops(4096) == ours.train_flops(4096)


def test_compare_table_pairs_each_peer_row_with_ours(peer):
  """Each DeepSpeed row is followed by zinfjax's rows at its placement and token count, with
  zinfjax / DeepSpeed in tokens/s; rows of other token counts or placements are not paired."""
  def row(tokens, name, tokens_per_s):
    return {"tokens": tokens, "placement": name, "step_s": tokens / tokens_per_s,
            "tokens_per_s": tokens_per_s, "tflops": 1.0, "mfu": 0.1, "mfu_spec": 0.1,
            "peak_hbm": 3 << 30, "peak_rss": 5 << 30}
  peer_rows = [dict(row(64, peer.ds_name(p), 1000.0), ds_placement=p) for p in ("cpu", "nvme")]
  ours = [row(64, "params + optimizer on pinned_host, host pipeline under backward", 2500.0),
          row(64, "params + optimizer on nvme", 1500.0), row(128, "params + optimizer on nvme", 9.0),
          row(64, "all on device (compute alone)", 9.0)]
  lines = peer.compare_table({"steps": ours}, {"rows": peer_rows}).splitlines()[2:]
  assert [line.split(" | ")[1] for line in lines] == [
      peer.ds_name("cpu"), "zinfjax: " + ours[0]["placement"],
      peer.ds_name("nvme"), "zinfjax: " + ours[1]["placement"]]
  assert lines[1].endswith("| 2.50x |") and lines[3].endswith("| 1.50x |")
  assert "| 3.0 | 5.0 |" in lines[0]


def test_torch_gpt_is_the_flax_gpt():
  """With the Flax GPT's (random) weights copied in, the peer's torch GPT gives the same loss
  in fp32 on random tokens: same layers, head split, init-independent shapes and tied head."""
  torch = pytest.importorskip("torch", reason="the peer's torch model needs torch ('.[peer]')")
  import jax
  from flax import nnx
  from zinfjax.models import GPT, get_config, lm_loss
  sys.path.insert(0, SCRIPTS)
  from _torch_gpt import GPT as TorchGPT, num_params
  config = get_config("tiny", num_layers=2, hidden=64, num_heads=4, seq_len=32, vocab_size=97)
  model = GPT(config, rngs=nnx.Rngs(0))
  state = nnx.state(model, nnx.Param)
  leaves, treedef = jax.tree.flatten(state)
  rng = np.random.default_rng(0)
  nnx.update(model, jax.tree.unflatten(treedef, [rng.normal(0, 0.3, x.shape).astype(np.float32)
                                                  for x in leaves]))
  p = nnx.state(model, nnx.Param)
  ours = TorchGPT(config.vocab_size, config.seq_len, config.num_layers, config.num_heads, config.hidden)
  assert num_params(ours) == config.num_params
  t = lambda x: torch.from_numpy(np.array(x))
  with torch.no_grad():
    ours.wte.weight.copy_(t(p["wte"]["embedding"][...]))
    ours.wpe.weight.copy_(t(p["wpe"]["embedding"][...]))
    ours.ln_f.weight.copy_(t(p["ln_f"]["scale"][...]))
    ours.ln_f.bias.copy_(t(p["ln_f"]["bias"][...]))
    block = p["blocks"]["block"]
    for i, b in enumerate(ours.blocks):
      for name in ("qkv", "proj", "fc", "out"):
        getattr(b, name).weight.copy_(t(block[name]["kernel"][...][i]).T)
        getattr(b, name).bias.copy_(t(block[name]["bias"][...][i]))
      for name in ("ln1", "ln2"):
        getattr(b, name).weight.copy_(t(block[name]["scale"][...][i]))
        getattr(b, name).bias.copy_(t(block[name]["bias"][...][i]))
  tokens = rng.integers(0, config.vocab_size, (3, config.seq_len + 1))
  batch = {"inputs": tokens[:, :-1].astype(np.int32), "targets": tokens[:, 1:].astype(np.int32)}
  expected = float(lm_loss(model, batch))
  ours.eval()
  with torch.no_grad():
    got = float(ours(torch.from_numpy(batch["inputs"]).long(), torch.from_numpy(batch["targets"]).long()))
  assert expected > 1.0 and got == pytest.approx(expected, rel=1e-5)


def test_peer_dry_run_trains_on_cpu(tmp_path):
  """`peer_deepspeed.py --dry-run`: DeepSpeed ZeRO-3 with nothing offloaded and with params and
  optimizer offloaded to CPU each train the tiny GPT one timed step on CPU, in their own
  process, and write bench_gpu.json-style rows."""
  pytest.importorskip("torch", reason="the DeepSpeed peer needs torch and deepspeed ('.[peer]')")
  pytest.importorskip("deepspeed", reason="the DeepSpeed peer needs deepspeed ('.[peer]')")
  done = subprocess.run([sys.executable, os.path.join(SCRIPTS, "peer_deepspeed.py"), "--out",
                         str(tmp_path), "--dry-run", "--placements", "device,cpu"],
                        capture_output=True, text=True, timeout=900, cwd=REPO)
  assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
  rows = json.loads((tmp_path / "peer_deepspeed.json").read_text())["rows"]
  assert [r["ds_placement"] for r in rows] == ["device", "cpu"]
  for r in rows:
    assert r["step_s"] > 0 and r["tokens"] == 64 and r["peak_rss"] > 0
    # random tokens from 65 ids on a fresh GPT: the loss starts near log(65)
    assert all(abs(loss - math.log(65)) < 0.3 for loss in r["losses"]), r["losses"]
