"""The GPT training step compiled for an H100 or H200 on a machine without a GPU: what XLA:GPU
makes of it, before any device time is spent.

  pip install "jax[cuda13]"   # the CUDA plugin and its libraries: no GPU or driver needed
  python scripts/compile_gpu.py --tokens 16384,65536
  python scripts/compile_gpu.py --target h200 --layer-residuals recompute --json out.json
  python scripts/compile_gpu.py --init-from HF_FOLDER --layers 4 --seq-len 2048 --tokens 32768
  python scripts/compile_gpu.py --target h200 --layers 42 --hidden 5120 --heads 40 --vocab 65 \
      --tokens 8192 --offload-optimizer device:15,pinned_host --bf16-moments

XLA compiles for a GPU described in text (`--target`: its memory, bandwidth,
SMs, compute capability) with no device present (jax's deviceless
`topologies`). The model is a GPT of `--layers/--hidden/--heads/--vocab`, or
with `--init-from` a Hugging Face checkpoint's (its config.json alone: GPT-2
or the Llama family, Gemma's sliding layers included), `--layers` cutting it.
For each token count, the step with every state on the device (the row
`bench_gpu.py` times first, or the optimizer placed by `--offload-optimizer`)
is compiled, and one table row says:

* residuals: what the layer scan keeps for backward ("save", "dots" or
  recompute; `ZeroConfig.layer_residuals`) and its bytes per layer, under the
  budget the GPU would give it (half of what the states leave of XLA's
  allocator limit, `--mem-fraction` of the memory; or `--residual-budget`);
* products run: the TFLOPs of the matrix products the program executes (every
  dot, cuBLAS GEMM and cuDNN attention call, times the loops' trip counts:
  `_hlo.py`), against the model's 6·N·T + causal attention: more than 1.0x is
  recompute (the MFU the step can reach at best is model / run);
* written: GiB the program's kernels write to HBM (`_hlo.written_bytes`:
  outputs outside fusions, in-place updates by their size, loops applied),
  a floor of its memory traffic;
* not bf16: product TFLOPs with other than bf16 operands;
* cuDNN: the fused attention's forward / backward calls in the program;
* HBM: arguments + temporaries from `memory_analysis()`, against the
  allocator's limit (what must fit) and the target's memory;
* state copies: fp32 bytes the entry computation copies (states copied around
  a branch, each step).

`--offload-optimizer` places the optimizer states (fp32 master and moments)
per layer, as `ZeroConfig.offload_optimizer` does: where they are off the
device, the host pipeline updates them in its stores (RAM's, the drive's)
outside the program, which then holds only device arrays, so it compiles here
and its HBM is that of the run (`largest_gpt.py`'s mixed plans keep params on
the device this way). Params off the device are not compiled here: a
device-less target reports no host memory, and their program calls the swap
store, which needs the GPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from collections import Counter

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

# XLA's GPU description (`stream_executor.GpuTargetConfigProto`) of each target
_DEVICE = """gpu_device_info {{
  threads_per_block_limit: 1024 threads_per_warp: 32 shared_memory_per_block: 49152
  shared_memory_per_core: 233472 threads_per_core_limit: 2048 core_count: 132
  fpus_per_core: 128 block_dim_limit_x: 2147483647 block_dim_limit_y: 65535
  block_dim_limit_z: 65535 memory_bandwidth: {bandwidth} l2_cache_size: 52428800
  clock_rate_ghz: 1.98 device_memory_size: {memory} shared_memory_per_block_optin: 232448
  cuda_compute_capability {{ major: 9 }} registers_per_core_limit: 65536
  registers_per_block_limit: 65536
}}
platform_name: "CUDA"
dnn_version_info {{ major: 9 minor: 10 }}
runtime_version {{ major: 13 minor: 0 }}
device_description_str: "{name}"
"""
TARGETS = {"h100": dict(name="NVIDIA H100 80GB HBM3", memory=84929347584, bandwidth=3352320000000),
           "h200": dict(name="NVIDIA H200", memory=150754820096, bandwidth=4800000000000)}
TARGET_CAPABILITY = (9, 0)  # both targets' (`cuda_compute_capability` above)
ALLOCATOR_FRACTION = 0.75  # of the memory XLA:GPU's allocator takes (XLA_PYTHON_CLIENT_MEM_FRACTION)
GIB = 1 << 30


def parse_args(argv=None) -> argparse.Namespace:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--target", default="h100", choices=sorted(TARGETS))
  p.add_argument("--init-from", default=None, metavar="HF_FOLDER",
                 help="a Hugging Face checkpoint's model (GPT-2, the Llama family): its "
                      "config.json alone, the weights unread (a folder, or the file)")
  p.add_argument("--layers", type=int, default=None, help="(default: 8, or the checkpoint's)")
  p.add_argument("--hidden", type=int, default=None, help="the GPT's (default 2048)")
  p.add_argument("--heads", type=int, default=None, help="the GPT's (default 16)")
  p.add_argument("--seq-len", type=int, default=1024)
  p.add_argument("--vocab", type=int, default=None, help="the GPT's (default 32768)")
  p.add_argument("--tokens", default="4096,16384,65536", help="tokens per step, comma-separated")
  p.add_argument("--layer-residuals", default="auto", choices=("recompute", "save", "dots", "auto"))
  p.add_argument("--residual-budget", type=float, default=None,
                 help="GiB the saved residuals may take (default: what the target's GPU gives)")
  p.add_argument("--attention", default="cudnn", choices=("cudnn", "explicit"))
  p.add_argument("--explicit-block", type=int, default=None, metavar="N",
                 help="queries per block of the explicit form (where it runs: Gemma 2's capped "
                      "logits, --attention explicit); 0: the whole [T, T] at once (default "
                      "attention.EXPLICIT_BLOCK)")
  p.add_argument("--offload-optimizer", default="device",
                 help="tier of the optimizer states, or a per-layer split such as "
                      "'device:15,pinned_host' (off the device: the host pipeline's stores)")
  p.add_argument("--bf16-moments", action="store_true", help="Adam's moments in bf16")
  p.add_argument("--mem-fraction", type=float, default=ALLOCATOR_FRACTION,
                 help="of the GPU's memory XLA's allocator takes (XLA_PYTHON_CLIENT_MEM_FRACTION)")
  p.add_argument("--hlo", default=None, help="folder to write each program's optimized HLO to")
  p.add_argument("--json", default=None, help="write the rows to this file too")
  args = p.parse_args(argv)
  shape = {"hidden": 2048, "heads": 16, "vocab": 32768}
  given = [f"--{k}" for k in shape if getattr(args, k) is not None]
  if args.init_from and given:
    p.error(f"{', '.join(given)}: the checkpoint's config.json gives the model's shape with "
            "--init-from (--layers and --seq-len may cut it).")
  for k, v in shape.items():
    setattr(args, k, v if getattr(args, k) is None else getattr(args, k))
  return args


def model_of(args):
  """(config, model factory, its name in the table) of the GPT or `--init-from`'s model, cut to
  `--layers` (`_shapes.hf_model`)."""
  from zinfjax.models import GPT, get_config
  if args.init_from:
    from _shapes import hf_model
    return hf_model(args.init_from, args.layers, args.seq_len, "compile_gpu")
  config = get_config("tiny", num_layers=args.layers or 8, hidden=args.hidden,
                      num_heads=args.heads, seq_len=args.seq_len, vocab_size=args.vocab)
  return config, lambda r: GPT(config, rngs=r), f"GPT {config.num_layers} x {config.hidden}"


def gpu_mesh(target: str):
  """A one-GPU mesh of the `target` description, with no device present."""
  import jax
  from jax.experimental import topologies
  try:
    topology = topologies.get_topology_desc(
        platform="cuda", topology="1x1x1", target_config=_DEVICE.format(**TARGETS[target]))
  except Exception as e:  # noqa: BLE001  (no plugin: NotImplementedError or RuntimeError)
    raise SystemExit(f"compile_gpu: XLA:GPU is not installed here ({type(e).__name__}: "
                     f"{str(e).splitlines()[0][:160]}). Install jax's CUDA plugin, which needs "
                     "no GPU: pip install \"jax[cuda13]\"") from None
  return topologies.make_mesh(topology, (1,), ("data",)), jax


def answer_for_the_target(capability: tuple[int, int]) -> None:
  """jax asks the local GPU's compute capability before some cuDNN attention shapes (head dim
  256 on Hopper and later); none is present here, so the target's is the answer."""
  try:
    from jax._src.cudnn import fused_attention_stablehlo as fused
  except ImportError:  # another jax: its own checks stand
    return
  parse = lambda text: tuple(int(x) for x in text.split("."))
  fused.check_compute_capability = lambda text: capability >= parse(text)
  fused.is_cuda_compute_capability_equal = lambda text: capability == parse(text)


def zero_config(args):
  """The step's `ZeroConfig`: every param on the device, the optimizer states where
  `--offload-optimizer` says; off the device they are the host pipeline's (as
  `largest_gpt.py` runs them: NVMe rewritten in place), updated outside the program."""
  import tempfile

  import zinfjax
  zero = zinfjax.ZeroConfig(layer_residuals=args.layer_residuals)
  if args.offload_optimizer == "device":
    return zero
  try:
    return dataclasses.replace(
        zero, offload_optimizer=args.offload_optimizer, host_optimizer="pipeline",
        nvme_path=os.path.join(tempfile.gettempdir(), "zinfjax-compile-gpu"),
        nvme_atomic_steps=False)
  except ValueError as e:
    raise SystemExit(f"compile_gpu: --offload-optimizer {args.offload_optimizer!r}: {e}") from None


def placed(args) -> str:
  """The placement, in the table's words."""
  moments = ", bf16 moments" if args.bf16_moments else ""
  if args.offload_optimizer == "device":
    return "all states on the device" + moments
  return f"params on the device, optimizer {args.offload_optimizer}{moments}"


def compile_step(args, mesh, tokens: int) -> dict:
  """Compile the step (every state on the device, or the optimizer where `--offload-optimizer`
  says) for `tokens` tokens; its row of the table."""
  import jax
  import jax.numpy as jnp
  from jax.sharding import NamedSharding, PartitionSpec as P

  import _hlo
  import zinfjax
  from zinfjax import residuals as R
  from zinfjax.models import lm_loss
  from zinfjax.tier import Tier

  config, factory, _ = model_of(args)
  target = TARGETS[args.target]
  limit = int(target["memory"] * args.mem_fraction)  # the allocator's limit, as the GPU reports it
  tx = zinfjax.optim.adamw(1e-4, moment_dtype="bfloat16" if args.bf16_moments else "float32")
  make = lambda zero: zinfjax.abstract_init(factory, tx, zero, mesh)
  zero = zero_config(args)
  try:
    budget = (int(args.residual_budget * GIB) if args.residual_budget is not None else
              R.free_share(limit, make(zero).engine.plan.tier_bytes()[Tier.DEVICE]))
  except ValueError as e:  # a split the model's layers cannot take
    raise SystemExit(f"compile_gpu: {e}") from None
  state = make(dataclasses.replace(zero, residual_budget=budget))
  batch = {k: jax.ShapeDtypeStruct((max(1, tokens // args.seq_len), args.seq_len), jnp.int32,
                                   sharding=NamedSharding(mesh, P("data")))
           for k in ("inputs", "targets")}
  tried = []  # the scan's residual choice as it traces: (bytes per layer, kept)
  keep = R.keep

  def watched(mode: str, nbytes: int, layers: int, budget: int) -> bool:
    tried.append((nbytes, keep(mode, nbytes, layers, budget)))
    return tried[-1][1]

  R.keep = watched  # observed, not changed
  try:
    t0 = time.perf_counter()
    program = zinfjax.make_train_step(state, lm_loss).jitted.lower(state, batch).compile()
    seconds = time.perf_counter() - t0
  finally:
    R.keep = keep
  hlo = program.as_text()
  if args.hlo:
    os.makedirs(args.hlo, exist_ok=True)
    with open(os.path.join(args.hlo, f"step-{tokens}.hlo"), "w") as f:
      f.write(hlo)
  kept = [n for n, k in tried if k]
  mode = R.saving(args.layer_residuals) if kept else "recompute"
  flops = _hlo.matmul_flops(hlo)
  model = config.train_flops(batch["inputs"].shape[0] * args.seq_len, args.seq_len)
  attention = Counter()  # cuDNN fused attention calls: backward (True) or forward
  for call, n in _hlo.custom_calls(hlo).items():
    if call.startswith("__cudnn$fmha"):
      attention["Backward" in call] += n
  memory = program.memory_analysis()
  hbm = memory.argument_size_in_bytes + memory.temp_size_in_bytes
  return {"tokens": tokens, "residuals": mode,
          "residual_gib_per_layer": kept[0] / GIB if kept else 0.0,
          "run_tflop": flops.total / 1e12, "model_tflop": model / 1e12,
          "run_over_model": flops.total / model, "written_gib": _hlo.written_bytes(hlo) / GIB,
          "not_bf16_tflop": sum(v for k, v in flops.by_dtype.items() if k != "bf16") / 1e12,
          "cudnn_forward": attention[False], "cudnn_backward": attention[True],
          "hbm_gib": hbm / GIB, "hbm_fraction": hbm / target["memory"], "hbm_of_limit": hbm / limit,
          "arguments_gib": memory.argument_size_in_bytes / GIB,
          "temporaries_gib": memory.temp_size_in_bytes / GIB,
          "state_copies_gib": _hlo.entry_copies(hlo) / GIB, "compile_s": seconds}


def table(rows: list[dict], args) -> str:
  config, _, name = model_of(args)
  head = (f"{name} ({config.num_heads} heads, seq {args.seq_len}, vocab "
          f"{config.vocab_size}), {placed(args)}, compiled for {TARGETS[args.target]['name']} "
          f"(no GPU present), layer_residuals={args.layer_residuals}, attention {args.attention}"
          + ("" if args.explicit_block is None else
             f", explicit form in blocks of {args.explicit_block or 'all'} queries"))
  lines = [head, "", "| tokens | residuals (GiB/layer) | products run TFLOP | model TFLOP | run / model "
           "| written GiB | not bf16 TFLOP | cuDNN fwd / bwd | HBM GiB: arguments + temporaries "
           f"(of the {args.mem_fraction:.0%} limit / of memory) | state copies GiB |",
           "|---|---|---|---|---|---|---|---|---|---|"]
  for r in rows:
    lines.append(f"| {r['tokens']} | {r['residuals']} ({r['residual_gib_per_layer']:.2f}) | "
                 f"{r['run_tflop']:.2f} | {r['model_tflop']:.2f} | {r['run_over_model']:.3f}x | "
                 f"{r['written_gib']:.1f} | "
                 f"{r['not_bf16_tflop']:.2f} | {r['cudnn_forward']} / {r['cudnn_backward']} | "
                 f"{r['arguments_gib']:.1f} + {r['temporaries_gib']:.1f} = {r['hbm_gib']:.1f} "
                 f"({r['hbm_of_limit']:.0%} / {r['hbm_fraction']:.0%}) | "
                 f"{r['state_copies_gib']:.2f} |")
  return "\n".join(lines)


def main(argv=None) -> int:
  args = parse_args(argv)
  # before jax starts: compile for the target without asking a driver, and no device needed
  os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")
  os.environ["CUDA_VISIBLE_DEVICES"] = "-1"
  os.environ["ZINFJAX_ATTENTION"] = args.attention  # the CPU is jax's backend here
  if args.explicit_block is not None:
    os.environ["ZINFJAX_EXPLICIT_BLOCK"] = str(args.explicit_block)
  zero_config(args)  # a misspelt tier, or a model that cannot be, is refused before XLA:GPU is
  model_of(args)     # asked for
  mesh, _ = gpu_mesh(args.target)
  answer_for_the_target(TARGET_CAPABILITY)
  rows = [compile_step(args, mesh, int(t)) for t in args.tokens.split(",")]
  print(table(rows, args), flush=True)
  if args.json:
    with open(args.json, "w") as f:
      json.dump({"target": args.target, "args": vars(args), "rows": rows}, f, indent=1)
  return 0


if __name__ == "__main__":
  sys.exit(main())
