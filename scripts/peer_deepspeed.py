"""The peer: DeepSpeed ZeRO-3 with its states offloaded, on the GPT and shapes of bench_gpu.py.

  python scripts/peer_deepspeed.py --out OUT                      # a GPU machine with deepspeed
  python scripts/peer_deepspeed.py --out OUT --dry-run            # CPU: tiny GPT, one step each
  python scripts/peer_deepspeed.py --compare OUT/peer_deepspeed.json --ours OUT/*/bench_gpu.json

The same GPT as `models/gpt.py` (`_torch_gpt.py`: same layers, hidden, heads, vocabulary,
tied embedding, bf16, fused attention, one recomputed checkpoint per block, chunked loss),
trained by DeepSpeed ZeRO-3 at each placement:

  device       ZeRO-3 with nothing offloaded (compute alone)
  cpu          offload_param + offload_optimizer to pinned CPU memory (DeepSpeedCPUAdam)
  nvme         offload_param + offload_optimizer to NVMe (its async_io op, libaio)

AdamW (lr 1e-4, weight decay 1e-4, no clipping) like bench_gpu.py's; random tokens; the median
step after one warm-up; TFLOP/s by `GPTConfig.train_flops` (6 N T + causal attention), MFU of
the bf16 matmul rate measured in the same run (after the placements); the process's peak HBM
(torch's allocator, init included, as zinfjax's rows count it) and peak RSS.
Each placement runs in its own process, so the peaks are its own. Rows go to
OUT/peer_deepspeed.json in bench_gpu.json's form; `--compare` prints one table of both with
the ratio zinfjax / DeepSpeed in tokens/s.

Installing the peer where there is no network: `scripts/peer_bundle.sh DIR` builds the wheels
(deepspeed with DS_BUILD_OPS=0: its ops are built on first use with the machine's compiler)
and libaio; `gpu_check.sh`'s `peer` stage installs them from DIR.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

SCRIPTS = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(SCRIPTS)
sys.path.insert(0, SCRIPTS)
from _gpu_table import SPEC_TFLOPS  # noqa: E402  (bench_gpu.py's second MFU denominator)
PLACEMENTS = ("device", "cpu", "nvme")
# zinfjax's bench_gpu.py placement names that match each DeepSpeed placement
OURS = {"device": ("all on device",), "cpu": ("params + optimizer on pinned_host",),
        "nvme": ("params + optimizer on nvme",)}
ROW = "PEER_ROW "  # the child's result line


def ds_name(placement: str) -> str:
  return {"device": "DeepSpeed ZeRO-3, all on device",
          "cpu": "DeepSpeed ZeRO-3, params + optimizer offloaded to cpu (pinned)",
          "nvme": "DeepSpeed ZeRO-3, params + optimizer offloaded to nvme"}[placement]


def parse_args(argv=None) -> argparse.Namespace:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--out", help="folder for peer_deepspeed.json")
  p.add_argument("--layers", type=int, default=8)
  p.add_argument("--hidden", type=int, default=2048)
  p.add_argument("--heads", type=int, default=16)
  p.add_argument("--seq-len", type=int, default=1024)
  p.add_argument("--vocab", type=int, default=32768)
  p.add_argument("--tokens", default="16384", help="tokens per step, comma-separated")
  p.add_argument("--placements", default=",".join(PLACEMENTS), help=f"some of {PLACEMENTS}")
  p.add_argument("--nvme-path", default=None, help="DeepSpeed's swap folder (default: a temp folder)")
  p.add_argument("--steps", type=int, default=3, help="timed steps (after one warm-up)")
  p.add_argument("--timeout", type=int, default=900, help="seconds per placement")
  p.add_argument("--dry-run", action="store_true",
                 help="CPU: a tiny GPT, one timed step per placement DeepSpeed runs on a CPU")
  p.add_argument("--compare", metavar="PEER_JSON",
                 help="print the side-by-side table of this peer_deepspeed.json and --ours")
  p.add_argument("--ours", nargs="+", default=[], metavar="BENCH_GPU_JSON",
                 help="bench_gpu.py's results (one per placement: each with its own peaks)")
  p.add_argument("--one", help=argparse.SUPPRESS)  # the child: one placement at --tokens
  args = p.parse_args(argv)
  if args.dry_run:
    args.layers, args.hidden, args.heads, args.seq_len, args.vocab = 2, 64, 4, 32, 65
    args.tokens, args.steps = "64", 1
  bad = set(args.placements.split(",")) - set(PLACEMENTS)
  if bad:
    p.error(f"unknown placement(s) {sorted(bad)}; choose from {PLACEMENTS}")
  if not args.compare and not args.out:
    p.error("--out is required (or --compare PEER_JSON --ours BENCH_GPU_JSON...)")
  return args


def gpt_config(args):
  """`models/config.py`'s GPTConfig at these shapes (loaded by path: no jax in this process)."""
  spec = importlib.util.spec_from_file_location("_gpt_config", os.path.join(REPO, "models", "config.py"))
  mod = sys.modules.setdefault(spec.name, importlib.util.module_from_spec(spec))
  spec.loader.exec_module(mod)
  return mod.GPTConfig(vocab_size=args.vocab, seq_len=args.seq_len, num_layers=args.layers,
                       num_heads=args.heads, hidden=args.hidden, remat=True)


def ds_config(placement: str, batch_size: int, nvme_path: str | None, hidden: int) -> dict:
  """DeepSpeed's config for one placement: ZeRO-3, bf16, AdamW as zinfjax's bench uses it.

  Buckets follow DeepSpeed's ZeRO-Infinity guidance (prefetch and live parameters a few
  layers' worth, hidden^2 scaled); NVMe adds its aio settings and swap buffers."""
  if placement not in PLACEMENTS:
    raise ValueError(f"unknown placement {placement!r}; choose from {PLACEMENTS}")
  layer = 12 * hidden * hidden
  zero = {"stage": 3, "overlap_comm": True, "contiguous_gradients": True,
          "reduce_bucket_size": hidden * hidden, "stage3_prefetch_bucket_size": 2 * layer,
          "stage3_param_persistence_threshold": 10 * hidden,
          "stage3_max_live_parameters": 4 * layer, "stage3_max_reuse_distance": 4 * layer,
          "sub_group_size": 1 << 28}
  config = {"train_micro_batch_size_per_gpu": batch_size, "gradient_accumulation_steps": 1,
            "bf16": {"enabled": True}, "gradient_clipping": 0.0, "steps_per_print": 1 << 30,
            "wall_clock_breakdown": False, "zero_allow_untested_optimizer": True,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "betas": [0.9, 0.999],
                                                      "eps": 1e-8, "weight_decay": 1e-4}},
            "zero_optimization": zero}
  if placement == "device":  # torch's AdamW (foreach): no FusedAdam build with nvcc on a bare machine
    config["optimizer"]["params"]["torch_adam"] = True
  elif placement == "cpu":
    zero["offload_param"] = {"device": "cpu", "pin_memory": True}
    zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
  elif placement == "nvme":
    if not nvme_path:
      raise ValueError("the nvme placement needs a folder: pass --nvme-path")
    zero["offload_param"] = {"device": "nvme", "nvme_path": nvme_path, "pin_memory": True,
                             "buffer_count": 6, "buffer_size": max(1 << 24, 2 * layer),
                             "max_in_cpu": 0}
    zero["offload_optimizer"] = {"device": "nvme", "nvme_path": nvme_path, "pin_memory": True,
                                 "buffer_count": 4, "fast_init": False}
    config["aio"] = {"block_size": 1 << 20, "queue_depth": 32, "thread_count": 8,
                     "single_submit": False, "overlap_events": True}
  return config


def one(args) -> dict:
  """The child: train `args.one` for warm-up + `args.steps` steps; returns its row."""
  import numpy as np
  import torch
  os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
  os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
  for k, v in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1"}.items():
    os.environ.setdefault(k, v)
  import deepspeed
  from _torch_gpt import GPT, num_params

  gpu = torch.cuda.is_available()
  config = gpt_config(args)
  tokens = int(args.tokens)
  batch_size = max(1, tokens // config.seq_len)
  deepspeed.init_distributed(dist_backend="nccl" if gpu else "gloo", verbose=False)
  ds = ds_config(args.one, batch_size, args.nvme_path, config.hidden)
  remote = {"device": None, "cpu": "cpu", "nvme": "nvme"}[args.one]
  t0 = time.perf_counter()
  with deepspeed.zero.Init(config_dict_or_path=ds, remote_device=remote, pin_memory=gpu,
                           dtype=torch.bfloat16):
    model = GPT(config.vocab_size, config.seq_len, config.num_layers, config.num_heads, config.hidden)
  deepspeed.zero.register_external_parameter(model, model.wte.weight)  # the tied output projection
  engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds)
  init_s = time.perf_counter() - t0
  device = engine.device
  rng = np.random.default_rng(tokens)
  batches = [[torch.from_numpy(rng.integers(0, config.vocab_size, (batch_size, config.seq_len)))
              .to(device) for _ in range(2)] for _ in range(args.steps + 1)]
  sync = torch.cuda.synchronize if gpu else (lambda: None)
  times, losses = [], []
  for i, (inputs, targets) in enumerate(batches):
    t0 = time.perf_counter()
    loss = engine(inputs, targets)
    engine.backward(loss)
    engine.step()
    losses.append(float(loss.detach()))
    sync()
    if i:
      times.append(time.perf_counter() - t0)
  step = statistics.median(times)
  n = batch_size * config.seq_len
  flops = config.train_flops(n)
  assert num_params(model) == config.num_params, (num_params(model), config.num_params)
  return {"tokens": n, "placement": ds_name(args.one), "ds_placement": args.one,
          "step_s": step, "tokens_per_s": n / step, "tflops": flops / step / 1e12,
          "mfu_spec": flops / step / 1e12 / SPEC_TFLOPS, "loss": losses[-1], "losses": losses,
          "init_s": init_s, "params": config.num_params,
          "peak_hbm": torch.cuda.max_memory_allocated() if gpu else None,
          "peak_rss": peak_rss()}


def peak_rss() -> int:
  """This process's peak RSS in bytes: VmHWM, as zinfjax.progress.peak_rss reads it (this script
  imports no zinfjax); ru_maxrss would carry a large parent's peak over the exec."""
  with open("/proc/self/status") as f:
    return next((int(l.split()[1]) << 10 for l in f if l.startswith("VmHWM:")), 0)


def matmul_rate(n: int = 8192) -> float | None:
  """bf16 n^3 matmul TFLOP/s through torch on the GPU (random inputs; None without a GPU)."""
  import torch
  if not torch.cuda.is_available():
    return None
  a, b = (torch.randn(n, n, device="cuda", dtype=torch.bfloat16) for _ in range(2))
  times = []
  for _ in range(6):
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(10):
      a @ b
    torch.cuda.synchronize()
    times.append(time.perf_counter() - t0)
  return 10 * 2 * n ** 3 / statistics.median(times[1:]) / 1e12


def child_env(dry_run: bool) -> dict:
  env = dict(os.environ)
  env["PYTHONPATH"] = os.pathsep.join([SCRIPTS, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
  if dry_run:
    env["DS_ACCELERATOR"] = "cpu"
    env["CUDA_VISIBLE_DEVICES"] = ""
  return env


def run_all(args) -> dict:
  """Every placement at every token count, each in a child process; the rows as JSON."""
  os.makedirs(args.out, exist_ok=True)
  root = args.nvme_path or tempfile.mkdtemp(prefix="zinfjax-peer-ds-")
  result = {"peer": "deepspeed", "rows": [], "matmul_tflops": None}
  try:
    import deepspeed
    import torch
    result["versions"] = {"deepspeed": deepspeed.__version__, "torch": torch.__version__}
  except ImportError as e:
    raise SystemExit(f"the peer needs torch and deepspeed: {e}. Install them with "
                     "`pip install '.[peer]'`, or from a bundle made by scripts/peer_bundle.sh.")
  path = os.path.join(args.out, "peer_deepspeed.json")
  for tokens in args.tokens.split(","):
    for placement in args.placements.split(","):
      swap = os.path.join(root, f"{placement}-{tokens}")
      os.makedirs(swap, exist_ok=True)
      cmd = [sys.executable, os.path.abspath(__file__), "--one", placement, "--tokens", tokens,
             "--layers", str(args.layers), "--hidden", str(args.hidden), "--heads", str(args.heads),
             "--seq-len", str(args.seq_len), "--vocab", str(args.vocab), "--steps", str(args.steps),
             "--nvme-path", swap, "--out", args.out]
      t0 = time.perf_counter()
      failed = lambda why: {"tokens": int(tokens), "ds_placement": placement,
                            "placement": ds_name(placement), "error": why}
      try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout,
                              env=child_env(args.dry_run))
        log = done.stdout + done.stderr
        rows = [json.loads(line[len(ROW):]) for line in done.stdout.splitlines() if line.startswith(ROW)]
        last = log.strip().splitlines()[-1][:300] if log.strip() else f"exit {done.returncode}"
        row = rows[0] if rows else failed(last)
      except subprocess.TimeoutExpired as e:
        out = e.stdout or ""
        log = out.decode(errors="replace") if isinstance(out, bytes) else out
        row = failed(f"timed out after {args.timeout} s")
      with open(os.path.join(args.out, f"peer_{placement}_{tokens}.log"), "w") as f:
        f.write(log)
      result["rows"].append(row)
      print(f"  DeepSpeed {placement} at {tokens} tokens: "
            f"{row.get('step_s', row.get('error'))} ({time.perf_counter() - t0:.0f} s)", flush=True)
      with open(path, "w") as f:
        json.dump(result, f, indent=1)
  # last, in this process: the children had the GPU to themselves
  result["matmul_tflops"] = None if args.dry_run else matmul_rate()
  for row in result["rows"]:
    if result["matmul_tflops"] and "tflops" in row:
      row["mfu"] = row["tflops"] / result["matmul_tflops"]
  with open(path, "w") as f:
    json.dump(result, f, indent=1)
  return result


def gib(x) -> str:
  return f"{x / 2**30:.1f}" if x else ""


def compare_table(ours: dict, peer: dict) -> str:
  """One Markdown table: each DeepSpeed placement and zinfjax's rows at the same placement and
  token count, with tokens/s, TFLOP/s, MFU (of each run's measured matmul and of the spec),
  peak HBM and RSS (GiB), and zinfjax / DeepSpeed in tokens/s."""
  lines = ["| tokens/step | placement | step s | tokens/s | TFLOP/s | MFU (measured matmul) "
           f"| MFU ({SPEC_TFLOPS:.0f} spec) | peak HBM GiB | peak RSS GiB | zinfjax / DeepSpeed |",
           "|---|---|---|---|---|---|---|---|---|---|"]

  def line(row: dict, name: str, ratio: str) -> str:
    if "error" in row:
      return f"| {row['tokens']} | {name} | failed: {row['error']} |"
    mfu = f"{row['mfu']:.1%}" if row.get("mfu") else ""
    return (f"| {row['tokens']} | {name} | {row['step_s']:.3f} | {row['tokens_per_s']:.0f} "
            f"| {row['tflops']:.1f} | {mfu} | {row['mfu_spec']:.1%} | {gib(row.get('peak_hbm'))} "
            f"| {gib(row.get('peak_rss'))} | {ratio} |")

  for theirs in peer.get("rows", []):
    lines.append(line(theirs, theirs["placement"], ""))
    for row in ours.get("steps", []):
      if row["tokens"] != theirs["tokens"] or not row["placement"].startswith(OURS[theirs["ds_placement"]]):
        continue
      ratio = (f"{row['tokens_per_s'] / theirs['tokens_per_s']:.2f}x"
               if "error" not in row and "error" not in theirs else "")
      lines.append(line(row, f"zinfjax: {row['placement']}", ratio))
  return "\n".join(lines)


def main(argv=None) -> int:
  args = parse_args(argv)
  if args.one:
    print(ROW + json.dumps(one(args)), flush=True)
    return 0
  if args.compare:
    with open(args.compare) as f:
      peer = json.load(f)
    ours = {"steps": [], "matmul_tflops": None, "device": "?"}
    for path in args.ours:
      with open(path) as f:
        one_run = json.load(f)
      ours["steps"] += one_run.get("steps", [])
      ours["device"], ours["matmul_tflops"] = one_run.get("device"), one_run.get("matmul_tflops")
    print(f"\nzinfjax vs DeepSpeed {peer.get('versions', {}).get('deepspeed', '')} on {ours['device']} "
          f"(bf16 matmul: zinfjax run {ours['matmul_tflops'] or 0:.0f}, DeepSpeed run "
          f"{peer.get('matmul_tflops') or 0:.0f} TFLOP/s)")
    print(compare_table(ours, peer))
    return 0
  result = run_all(args)
  failed = [r for r in result["rows"] if "error" in r]
  for r in failed:
    print(f"DeepSpeed {r['ds_placement']} at {r['tokens']} tokens failed: {r['error']}")
  return 1 if failed else 0


if __name__ == "__main__":
  sys.exit(main())
