"""`train_gpt.py`'s command line: its flags, and the checks that refuse what cannot work before
anything is loaded or compiled."""

from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile
from pathlib import Path

DEFAULT_DATA = Path(__file__).resolve().parents[1] / "data" / "tinyshakespeare.txt"
TIERS = ("device", "pinned_host", "nvme")


def parse_args(argv=None, description: str | None = None) -> argparse.Namespace:
  """The run's flags (`description`: the script's help text)."""
  p = argparse.ArgumentParser(description=description,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--preset", default="tiny", help="model preset (see zinfjax.models.PRESETS)")
  p.add_argument("--init-from", default=None, metavar="HF_FOLDER",
                 help="fine-tune this Hugging Face checkpoint folder (config.json + safetensors): "
                      "its weights are streamed into the placement's tiers")
  p.add_argument("--lora-rank", type=int, default=0,
                 help="with --init-from: train LoRA adapters of this rank on every projection "
                      "of the blocks, the pretrained weights frozen (no grads, master or "
                      "optimizer state); --export merges them into the weights")
  p.add_argument("--export", default=None, metavar="FOLDER",
                 help="at the end, write the model as a Hugging Face checkpoint folder (with "
                      "the --init-from folder's tokenizer and generation files)")
  p.add_argument("--export-dtype", default=None, choices=("float32", "bfloat16"),
                 help="the --export weights' dtype (default float32: bfloat16 halves the folder "
                      "but rounds away a fine-tune's updates under 1/256 of a weight)")
  p.add_argument("--eval-every", type=int, default=0,
                 help="every N steps, the loss on held-out data (the last 10%% of the tokens)")
  p.add_argument("--layers", type=int, help="override the preset's number of layers")
  p.add_argument("--hidden", type=int, help="override the preset's width")
  p.add_argument("--heads", type=int, help="override the preset's attention heads")
  p.add_argument("--zero-stage", type=int, default=3, choices=(1, 2, 3))
  p.add_argument("--precision", default="bf16", choices=("bf16", "fp32"))
  p.add_argument("--prefetch-depth", type=int, default=1)
  p.add_argument("--tiles", type=int, default=1,
                 help="memory-centric tiling of each block's matrix products (ZeRO-3)")
  p.add_argument("--collectives", default="auto", choices=("auto", "ordered", "unordered"),
                 help="issue the step's collectives in one program order on every device "
                      "(auto: on CPU meshes, where XLA may otherwise deadlock)")
  p.add_argument("--offload", default=None, choices=("auto",),
                 help="auto: choose the tiers of every state per layer from the budgets "
                      "(--budget; defaults: half the free device memory, half the available host "
                      "memory, the free space under --nvme-path), printed at start")
  p.add_argument("--budget", action="append", default=[], metavar="TIER=SIZE",
                 help="with --offload auto: bytes per device on a tier, e.g. device=40GiB "
                      "(repeatable)")
  p.add_argument("--offload-param", default="device", metavar="TIER[:N],...",
                 help=f"tier of the bf16 params (and their grads), one of {TIERS}, or a per-layer "
                      "split: 'device:2,pinned_host' puts the first 2 layers of each stack on the "
                      "device and the rest in pinned host; needs --zero-stage 3")
  p.add_argument("--offload-grad", default=None, metavar="TIER",
                 help="tier of the grads (they follow --offload-param; only that tier is accepted)")
  p.add_argument("--offload-optimizer", default="device", metavar="TIER[:N],...",
                 help="tier of the fp32 master params and Adam moments, or a per-layer split such "
                      "as 'pinned_host:0.25,nvme' (a fraction or a layer count per tier, the last "
                      "takes the rest); anything but device runs zinfjax's AdamW on each tier")
  p.add_argument("--nvme-path", action="append", default=None,
                 help="folder of the NVMe swap store (repeat to stripe over several drives)")
  p.add_argument("--pinned-budget", type=int, default=256,
                 help="MiB of pinned host buffers for NVMe")
  p.add_argument("--nvme-prefetch-depth", type=int, default=1,
                 help="layers read from NVMe ahead of the device prefetch")
  p.add_argument("--no-atomic-steps", action="store_true",
                 help="rewrite NVMe states in place (nvme_atomic_steps=False): half the drive "
                      "space, but a step that fails on NVMe is not rolled back")
  p.add_argument("--host-optimizer", default="auto", choices=("auto", "xla", "pipeline", "stream"),
                 help="who updates the optimizer states in pinned host memory: 'auto' (the "
                      "default), 'pipeline' on a GPU or with --delay-update or "
                      "--host-atomic-steps, and 'xla' elsewhere; the step's XLA "
                      "program on the host ('xla'), zinfjax's host pipeline (C++ AdamW on host "
                      "threads, states in a store in RAM, updated in place; beside the drive's "
                      "store when states are on NVMe too), or the step's program on the device, "
                      "each layer's states brought over and sent back ('stream')")
  p.add_argument("--host-atomic-steps", action="store_true",
                 help="with the host pipeline: all-or-nothing steps in the RAM store "
                      "(twice its RAM), so the update runs under backward with clipping and "
                      "skips too")
  p.add_argument("--delay-update", choices=("none", "tail", "all"), default="none",
                 help="updates the host pipeline makes one step late, beside the next step's "
                      "program: 'tail', the leaves outside the stacks (embedding, final norm); "
                      "'all', every one (ZeroConfig.delay_update); with --export, the last "
                      "step's are applied before its checkpoint and the export")
  p.add_argument("--nvme-io-threads", type=int, default=4,
                 help="shards the swap store moves at once (the drive's queue depth)")
  p.add_argument("--offload-activations", action="store_true",
                 help="keep activation checkpoints in pinned host memory")
  p.add_argument("--micro-batches", type=int, default=1, metavar="N",
                 help="run each layer on N micro-batches of the batch in turn (layer-major "
                      "gradient accumulation: params move once per step, one micro-batch's "
                      "temporaries); the batch per device must be a multiple of N")
  p.add_argument("--steps", type=int, default=200)
  p.add_argument("--batch-size", type=int, default=16, help="global batch (examples per step)")
  p.add_argument("--seq-len", type=int, default=None, help="tokens per example (default: preset)")
  p.add_argument("--lr", type=float, default=3e-3)
  p.add_argument("--weight-decay", type=float, default=0.1,
                 help="AdamW's decay of the weight matrices (biases and norm scales undecayed)")
  p.add_argument("--bf16-moments", action="store_true",
                 help="keep Adam's moments in bf16 with stochastic rounding (8 optimizer bytes per "
                      "parameter instead of 12; scripts/bench_moments.py compares the loss curves)")
  p.add_argument("--clip", type=float, default=1.0,
                 help="clip grads to this global norm (0: off). With the optimizer on NVMe, "
                      "clipping runs it after backward (it needs the norm); 0 lets it run under "
                      "backward")
  p.add_argument("--schedule-steps", type=int, default=None,
                 help="length of the learning-rate schedule (default: --steps); keep it fixed when "
                      "a run is continued with a larger --steps")
  p.add_argument("--warmup-steps", type=int, default=None,
                 help="linear warmup from 0 (default: a tenth of --steps, at most 100; 0: none)")
  p.add_argument("--same-batch", action="store_true",
                 help="train every step on the first batch (a check that the loss falls, free of "
                      "batch-to-batch noise)")
  p.add_argument("--data", default=str(DEFAULT_DATA),
                 help="text file, or token ids: a uint16 .bin or a .npy")
  p.add_argument("--devices", type=int, default=None,
                 help="devices per process on the data axis (host devices when there is no "
                      "accelerator); the mesh spans every process's devices")
  p.add_argument("--checkpoint-dir", default=None, help="folder of the run's checkpoints")
  p.add_argument("--save-every", type=int, default=0,
                 help="save a checkpoint every N steps (with --checkpoint-dir the last step is "
                      "saved whatever N; 0: only the last)")
  p.add_argument("--keep", type=int, default=3, help="checkpoints kept (the newest)")
  p.add_argument("--resume", action="store_true",
                 help="continue from the newest checkpoint in --checkpoint-dir that restores (a "
                      "damaged newer one is skipped, with the reason); none yet: from scratch")
  p.add_argument("--resume-step", type=int, default=None, metavar="N",
                 help="continue from the checkpoint of step N (implies --resume)")
  p.add_argument("--distributed", action="store_true",
                 help="join a multi-process run found by JAX's cluster detection (SLURM, Open MPI, "
                      "...); scripts/launch.py sets this up by itself")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--metrics-jsonl", default=None,
                 help="write one JSON object per step here (a resumed run keeps the records up "
                      "to the step it resumes from)")
  p.add_argument("--log-every", type=int, default=10)
  p.add_argument("--peak-tflops", type=float, default=None,
                 help="a device's bf16 matmul peak, for the MFU the progress line shows (default: "
                      "the datasheet's of a known GPU; none on a CPU)")
  return p.parse_args(argv)


def check_args(args) -> None:
  """Numbers and flags that cannot work, refused before anything is loaded or compiled."""
  for name in ("steps", "batch_size", "seq_len", "devices", "layers", "hidden", "heads",
               "log_every"):
    value = getattr(args, name, None)
    if value is not None and value < (0 if name == "steps" else 1):
      flag = "--" + name.replace("_", "-")
      raise SystemExit(f"error: {flag} {value}: give a positive number"
                       + (" (leave it out to use every device)" if name == "devices" else "") + ".")
  if getattr(args, "peak_tflops", None) is not None and not args.peak_tflops > 0:
    raise SystemExit(f"error: --peak-tflops {args.peak_tflops}: give the device's bf16 TFLOP/s, "
                     "above 0 (leave it out for the datasheet's of a known GPU).")
  for name in ("save_every", "eval_every"):
    if getattr(args, name) < 0:
      flag = "--" + name.replace("_", "-")
      raise SystemExit(f"error: {flag} {getattr(args, name)}: give a number of steps above 0 "
                       "(0, the default: never).")
  if args.keep < 1:
    raise SystemExit(f"error: --keep {args.keep}: keep at least 1 checkpoint.")
  for flag in ("offload_param", "offload_grad", "offload_optimizer"):
    value = getattr(args, flag) or ""
    if "nvme" in [t.split(":")[0].strip() for t in value.split(",")] and not args.nvme_path:
      raise SystemExit(f"error: --{flag.replace('_', '-')} {value} puts states on NVMe: give "
                       "--nvme-path FOLDER, a folder on a fast local drive.")
  if args.lora_rank < 0:
    raise SystemExit(f"error: --lora-rank {args.lora_rank}: give a positive rank (0: no LoRA).")
  if args.budget and not args.offload:
    raise SystemExit("error: --budget sets the budgets of --offload auto; add --offload auto.")
  if args.lora_rank and args.zero_stage != 3:
    raise SystemExit(f"error: --lora-rank {args.lora_rank} trains the adapters alone, with the "
                     f"base weights frozen, which needs --zero-stage 3 (got {args.zero_stage}): "
                     "stages 1 and 2 rebuild every param from its fp32 master.")
  if not (math.isfinite(args.lr) and args.lr >= 0):
    raise SystemExit(f"error: --lr {args.lr}: the learning rate must be a finite number, "
                     "0 or above.")
  for name, zero in (("weight_decay", "no decay"), ("clip", "no clipping"),
                     ("schedule_steps", "--steps"), ("warmup_steps", "no warmup"), ("seed", "")):
    value = getattr(args, name)
    if value is not None and not (math.isfinite(value) and value >= 0):
      flag = "--" + name.replace("_", "-")
      raise SystemExit(f"error: {flag} {value}: give a finite number, 0 or above"
                       + (f" (0: {zero})" if zero else "") + ".")
  if args.lr == 0:
    print("warning: --lr 0: the weights will not change (a run to check the pipeline, "
          "checkpoints or an export).", file=sys.stderr)
  if args.init_from:
    given = [f"--{n}" for n in ("layers", "hidden", "heads") if getattr(args, n) is not None]
    if given:
      raise SystemExit(f"error: {', '.join(given)} with --init-from: the model's shape comes from "
                       f"{os.path.join(args.init_from, 'config.json')}; leave them out.")
  if args.export_dtype and not args.export:
    raise SystemExit(f"error: --export-dtype {args.export_dtype} sets the dtype of --export: "
                     "add --export FOLDER.")
  args.export_dtype = args.export_dtype or "float32"
  check_outputs(args)


def check_outputs(args) -> None:
  """The files the run writes at its end (--export) or on the way (--metrics-jsonl), checked
  writable now: a run must not train for hours and then fail to write its result."""
  if args.export:
    folder = os.path.abspath(args.export)
    if os.path.exists(folder) and not os.path.isdir(folder):
      raise SystemExit(f"error: --export {args.export} is an existing file; give a folder.")
    if args.init_from and os.path.realpath(folder) == os.path.realpath(args.init_from):
      raise SystemExit(f"error: --export {args.export} is the --init-from folder: the export "
                       "would replace the weights this run starts from (and a --resume reads "
                       "its config there). Export into another folder.")
    try:
      os.makedirs(folder, exist_ok=True)
      with tempfile.TemporaryFile(dir=folder):
        pass
    except OSError as e:
      raise SystemExit(f"error: --export {args.export}: cannot write there ({e.strerror or e});"
                       " give a writable folder.") from None
  if args.metrics_jsonl:
    if os.path.isdir(args.metrics_jsonl):
      raise SystemExit(f"error: --metrics-jsonl {args.metrics_jsonl} is a folder; give a file "
                       "path (such as metrics.jsonl in it).")
    try:
      with open(args.metrics_jsonl, "a"):
        pass
    except OSError as e:
      raise SystemExit(f"error: --metrics-jsonl {args.metrics_jsonl}: cannot write it "
                       f"({e.strerror or e}).") from None


def check_metrics_file(args) -> None:
  """--metrics-jsonl names a metrics file or a new one, not data the run would empty (checked
  once jax may be imported: zinfjax.progress brings it)."""
  from zinfjax.progress import metrics_problem
  problem = args.metrics_jsonl and metrics_problem(args.metrics_jsonl)
  if problem:
    raise SystemExit(f"error: --metrics-jsonl {args.metrics_jsonl}: {problem}.")


def check_no_resave(saved: list[int], start: int, args) -> None:
  """A run going on from `start` must not reach a step the checkpoint folder already holds
  and would save: a save never replaces a step, so that step's new state would be dropped
  and a later --resume would take the old one (a --resume-step to an earlier step, or a
  damaged newest step skipped)."""
  again = [s for s in saved if start < s <= args.steps
           and (s == args.steps or args.save_every and s % args.save_every == 0)]
  if again:
    raise SystemExit(
        f"error: {args.checkpoint_dir} already holds step(s) {again}, which this run (from step "
        f"{start} to {args.steps}) would save again, and a save never replaces a step. Move "
        f"those steps' folders out of it, or stop before them (--steps {again[0] - 1}).")


def lr_schedule(args):
  """--lr's schedule: warm-up (--warmup-steps, default a tenth of the run up to 100 steps), then
  cosine decay to a tenth over --schedule-steps (default --steps)."""
  import optax
  total = args.schedule_steps or args.steps
  warmup = max(1, min(100, total // 10)) if args.warmup_steps is None else args.warmup_steps
  if warmup:
    return optax.warmup_cosine_decay_schedule(0.0, args.lr, warmup_steps=warmup,
                                              decay_steps=max(total, warmup + 1),
                                              end_value=args.lr / 10)
  return optax.cosine_decay_schedule(args.lr, decay_steps=max(total, 1), alpha=0.1)


def model_flops(args, config, seq_len: int, mesh) -> dict:
  """`Progress`'s FLOP count of a step: the model's standard count (4·N·T for LoRA's frozen
  weights) per device of `mesh`, and their bf16 peak (--peak-tflops, or their datasheet's)."""
  from zinfjax.datasheet import bf16_tflops
  flops = config.train_flops(args.batch_size * seq_len, seq_len, frozen=bool(args.lora_rank))
  return {"flops_per_device": flops / mesh.devices.size,
          "peak_tflops": args.peak_tflops or bf16_tflops(mesh.devices.flat[0].device_kind)}
