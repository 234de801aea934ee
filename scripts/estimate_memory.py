"""The ZeRO-Infinity memory model (paper, section 3) for a preset, a custom shape, or a Hugging
Face checkpoint's config.

  python scripts/estimate_memory.py --preset 1t --devices 16 --offload-param nvme --offload-optimizer nvme
  python scripts/estimate_memory.py --layers 50 --hidden 4096 --heads 16 --json
  python scripts/estimate_memory.py --init-from HF_FOLDER --plan --budget device=70GiB
  python scripts/estimate_memory.py --preset 2.5b --plan --budget device=40GiB \
      --budget pinned_host=60GiB --nvme-path /local_nvme/zinfjax

`--plan` builds the run's placement plan (no memory allocated) with
`offload="auto"` for the given budgets (bytes per device; a tier left out
takes zinfjax's default) and prints where each state goes, the bytes per tier,
and the step time it allows: the largest of compute, host<->device traffic,
NVMe traffic and the host optimizer, at the rates given (defaults: one H100).

`--init-from` reads the shape of a Hugging Face checkpoint folder (its
config.json: Llama, Mistral, Qwen2, Qwen3, Phi-3, OLMo 2, GPT-2; no weight is read) and counts its
parameters exactly instead of 12·nl·hd².

With an exact count (`--init-from`, `--lora-rank`), the model-state working memory is that
model's largest operator's (`zinfjax.memory.largest_operator`: one layer of a stack, or a
weight outside the stacks, as a large vocabulary's embedding), not the paper's GPT MLP.

`--lora-rank R` counts a LoRA fine-tune (`ZeroConfig(trainable=nnx.LoRAParam)`):
the adapters of rank R train, and the weights they adapt, frozen, keep their
params alone: no grads, no master, no moments.

`--json` prints one object whose keys are the fields of
`zinfjax.memory.MemoryEstimate` (all sizes in bytes) plus `inputs`.
"""

from __future__ import annotations

import argparse
import json
import sys


def parse_args(argv=None) -> argparse.Namespace:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--preset", help="model preset (see zinfjax.models.PRESETS)")
  p.add_argument("--init-from", metavar="HF_FOLDER",
                 help="the model of a Hugging Face checkpoint folder (its config.json alone)")
  p.add_argument("--layers", type=int)
  p.add_argument("--hidden", type=int)
  p.add_argument("--heads", type=int)
  p.add_argument("--seq-len", type=int, default=None,
                 help="tokens per sequence (default 1024, or the --init-from model's if shorter)")
  p.add_argument("--batch-per-device", type=int, default=1)
  p.add_argument("--devices", type=int, default=1, help="data-parallel devices in total")
  p.add_argument("--devices-per-node", type=int, default=None, help="default: --devices")
  p.add_argument("--zero-stage", type=int, default=3, choices=(0, 1, 2, 3))
  p.add_argument("--checkpoint-interval", type=int, default=1, help="blocks per activation checkpoint (ci)")
  p.add_argument("--offload-param", default="device", choices=("device", "pinned_host", "nvme"))
  p.add_argument("--offload-grad", default=None, choices=("device", "pinned_host", "nvme"))
  p.add_argument("--offload-optimizer", default="device", choices=("device", "pinned_host", "nvme"))
  p.add_argument("--json", action="store_true", help="print the numbers as JSON")
  p.add_argument("--no-atomic-nvme", dest="atomic_nvme", action="store_false",
                 help="NVMe steps rewrite in place (ZeroConfig.nvme_atomic_steps=False)")
  p.add_argument("--bf16-moments", action="store_true",
                 help="Adam's moments in bf16 (adamw(moment_dtype='bfloat16')): 8 optimizer bytes "
                      "per parameter instead of 12")
  p.add_argument("--host-optimizer", default="xla", choices=("xla", "pipeline", "stream"),
                 help="ZeroConfig.host_optimizer: with 'pipeline' the pinned-host states live in "
                      "a swap store in RAM (its shards twice with all-or-nothing steps); 'stream' "
                      "needs what 'xla' does")
  p.add_argument("--host-atomic-steps", action="store_true",
                 help="ZeroConfig.host_atomic_steps: all-or-nothing steps in the RAM store "
                      "(--host-optimizer pipeline, no state on NVMe)")
  p.add_argument("--delay-update", default="none", choices=("none", "tail", "all"),
                 help="ZeroConfig.delay_update: 'all' keeps the held grads twice and the new "
                      "params in host RAM (6 B a param; 'tail' only the leaves outside the "
                      "stacks, counted by --plan)")
  p.add_argument("--lora-rank", type=int, default=0,
                 help="LoRA adapters of this rank alone train (train_gpt.py --lora-rank): the "
                      "frozen weights keep their params alone (params counted exactly)")
  p.add_argument("--plan", action="store_true",
                 help="print the placement offload='auto' chooses and the step time it allows")
  p.add_argument("--budget", action="append", default=[], metavar="TIER=SIZE",
                 help="bytes per device on a tier, e.g. device=40GiB (repeatable; --plan)")
  p.add_argument("--nvme-path", default=None, help="the swap store folder (--plan)")
  p.add_argument("--precision", default="bf16", choices=("bf16", "fp32"))
  p.add_argument("--tflops", type=float, default=735.0, help="matmul TFLOP/s per device (--plan)")
  p.add_argument("--link-gbs", type=float, default=50.0, help="host<->device GB/s per device")
  p.add_argument("--nvme-read-gbs", type=float, default=2.0, help="NVMe read GB/s per device")
  p.add_argument("--nvme-write-gbs", type=float, default=2.0, help="NVMe write GB/s per device")
  p.add_argument("--adam-gelems", type=float, default=1.0,
                 help="host AdamW, billions of elements per second per device")
  return p.parse_args(argv)


def fmt(n: float) -> str:
  for unit in ("B", "KB", "MB", "GB", "TB", "PB"):
    if abs(n) < 1000 or unit == "PB":
      return f"{n:,.2f} {unit}"
    n /= 1000
  return str(n)


def show_plan(args, layers: int, hidden: int, heads: int, config=None) -> int:
  """The placement offload='auto' picks for the budgets, and the step time it allows (for
  `config`, a Hugging Face model's, or the GPT of that shape)."""
  import os
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                             f" --xla_force_host_platform_device_count={args.devices}")
  import zinfjax
  from flax import nnx
  from zinfjax.autoplace import PlacementError, Rates, predict
  from zinfjax.engine import build_engine
  from zinfjax.models import hf
  from zinfjax.progress import parse_budgets
  try:
    budgets = parse_budgets(args.budget)
  except ValueError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  config = model_config(args, layers, hidden, heads, config).replace(lora_rank=args.lora_rank)
  try:
    zero = zinfjax.ZeroConfig(precision=args.precision, offload="auto", nvme_path=args.nvme_path,
                              trainable=nnx.LoRAParam if args.lora_rank else None,
                              tier_budgets=budgets or None, nvme_atomic_steps=args.atomic_nvme,
                              host_optimizer=args.host_optimizer,
                              host_atomic_steps=args.host_atomic_steps,
                              delay_update=args.delay_update)
    engine = build_engine(hf.factory(config), zinfjax.optim.adamw(1e-4), zero,
                          zinfjax.make_mesh(args.devices), open_store_=False)
  except (PlacementError, ValueError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 1
  rates = Rates(args.tflops * 1e12, args.link_gbs * 1e9, args.nvme_read_gbs * 1e9,
                args.nvme_write_gbs * 1e9, args.adam_gelems * 1e9)
  tokens = args.seq_len * args.batch_per_device
  got = predict(engine.plan, tokens, config.num_params, rates)
  print(f"{model_name(args)} {layers} layers x {hidden} hidden ({config.num_params / 1e9:,.2f}B "
        f"params{lora_note(args, engine.plan)}), {args.precision}, ZeRO-3 on {args.devices} "
        f"devices, {tokens} tokens per device per step")
  print(engine.auto.table())
  print(f"step time it allows: {got['step_s']:.3f} s ({got['bound']} bound; "
        f"{tokens / got['step_s']:,.0f} tokens/s per device)")
  for name, seconds in got["terms"].items():
    print(f"  {name:<15} {seconds:8.3f} s")
  return 0


def exact_counts(config, lora_rank: int) -> tuple[int, int | None, tuple]:
  """Counted on `config`'s abstract model with LoRA adapters of `lora_rank` (0: none): every
  param, those that train (the adapters; None: all) and the largest operator
  (`zinfjax.memory.largest_operator`, an `Operator`)."""
  import jax
  from flax import nnx
  from zinfjax.memory import largest_operator
  from zinfjax.models import hf
  model = nnx.eval_shape(lambda: hf.factory(config.replace(lora_rank=lora_rank))(nnx.Rngs(0)))
  size = lambda kind: sum(x.size for x in jax.tree.leaves(nnx.state(model, kind)))
  trains = nnx.LoRAParam if lora_rank else nnx.Param   # a LoRAParam is an nnx.Param
  return (size(nnx.Param), size(nnx.LoRAParam) if lora_rank else None,
          largest_operator(model, trains))


def lora_note(args, plan) -> str:
  """The LoRA adapters' share of the params, as the plan holds them (its trainable leaves)."""
  if not args.lora_rank:
    return ""
  adapters = sum(leaf.size for leaf in plan.leaves if leaf.trainable)
  return f" and {adapters / 1e6:,.2f}M of LoRA adapters of rank {args.lora_rank}"


def model_config(args, layers: int, hidden: int, heads: int, config=None):
  """`config` (a Hugging Face model's), or the GPT of the preset and shape given."""
  if config is not None:
    return config
  from zinfjax.models import get_config
  return get_config(args.preset or "tiny", num_layers=layers, hidden=hidden, num_heads=heads,
                    seq_len=args.seq_len)


def model_name(args) -> str:
  return f"the model of {args.init_from}:" if args.init_from else "GPT"


def hf_model(args):
  """The --init-from folder's model config at --seq-len (default: 1024, or its own if shorter);
  a ValueError (or OSError) says what is wrong with the flags or the folder."""
  from zinfjax.models import hf
  given = [f"--{n}" for n in ("preset", "layers", "hidden", "heads") if getattr(args, n)]
  if given:
    raise ValueError(f"{', '.join(given)} with --init-from: the shape comes from its "
                     "config.json; leave them out.")
  config = hf.config_from_hf(hf.read_config(args.init_from))
  if args.seq_len and args.seq_len > config.seq_len:
    raise ValueError(f"--seq-len {args.seq_len} is longer than the model's {config.seq_len}.")
  args.seq_len = args.seq_len or min(1024, config.seq_len)
  return config.replace(seq_len=args.seq_len)


def main(argv=None) -> int:
  args = parse_args(argv)
  from zinfjax.memory import estimate_memory
  layers, hidden, heads = args.layers, args.hidden, args.heads
  try:
    config = hf_model(args) if args.init_from else None  # exact: a Hugging Face model's
  except (OSError, ValueError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  if config is not None:
    layers, hidden, heads = config.num_layers, config.hidden, config.num_heads
  args.seq_len = args.seq_len or 1024
  if args.preset:
    from zinfjax.models import get_config
    preset = get_config(args.preset)
    layers, hidden = layers or preset.num_layers, hidden or preset.hidden
    heads = heads or preset.num_heads
  if not (layers and hidden and heads):
    print("error: give --preset NAME or all of --layers, --hidden and --heads.", file=sys.stderr)
    return 2
  if args.lora_rank < 0:
    print(f"error: --lora-rank {args.lora_rank}: give a positive rank (0: no LoRA).",
          file=sys.stderr)
    return 2
  if args.plan:
    return show_plan(args, layers, hidden, heads, config)
  num_params = trainable = operator = None
  if config is not None or args.lora_rank:  # counted exactly on the model, adapters included
    config = model_config(args, layers, hidden, heads, config)
    num_params, trainable, operator = exact_counts(config, args.lora_rank)
  est = estimate_memory(layers=layers, hidden=hidden, heads=heads, seq_len=args.seq_len,
                        num_params=num_params, trainable_params=trainable,
                        batch_per_device=args.batch_per_device, devices=args.devices,
                        devices_per_node=args.devices_per_node, stage=args.zero_stage,
                        checkpoint_interval=args.checkpoint_interval,
                        offload_param=args.offload_param, offload_grad=args.offload_grad,
                        offload_optimizer=args.offload_optimizer, atomic_nvme=args.atomic_nvme,
                        bf16_moments=args.bf16_moments, host_optimizer=args.host_optimizer,
                        atomic_host=args.host_atomic_steps, delay_update=args.delay_update,
                        operator_bytes=operator.bytes if operator else None)
  inputs = {k: v for k, v in vars(args).items() if k != "json"}
  inputs.update(layers=layers, hidden=hidden, heads=heads)
  if args.json:
    largest = {"name": operator.name, "shape": list(operator.shape)} if operator else None
    print(json.dumps({**est.as_dict(), "largest_operator": largest, "inputs": inputs}, indent=2))
    return 0
  print(f"{model_name(args)} {layers} layers x {hidden} hidden, {heads} heads: "
        f"{est.num_params / 1e9:,.2f}B params ({'exact' if config else '12·nl·hd²'}), "
        f"ZeRO-{args.zero_stage} on {args.devices} devices")
  if trainable is not None:
    print(f"  of which {trainable / 1e6:,.2f}M train (LoRA adapters of rank {args.lora_rank}); "
          "the others, frozen, keep their params alone")
  whole = "20 B/param" if trainable is None else "2 B/frozen param, 20 B/trainable one"
  rows = [(f"model states, whole model ({whole})", est.model_states)]
  rows += [(f"model states per device on {t}", b) for t, b in est.per_device.items()]
  rows += [(f"model states per node on {t}", b) for t, b in est.per_node.items()]
  rows += [("activation checkpoints per device", est.activation_checkpoints),
           (f"model-state working memory ({operator_note(operator)})",
            est.model_state_working_memory),
           ("activation working memory per device", est.activation_working_memory)]
  width = max(len(r[0]) for r in rows)
  for name, value in rows:
    print(f"  {name:<{width}}  {fmt(value):>14}")
  kept = ", ".join(f"{t} {b:g}" for t, b in est.per_param.items() if b)
  print(f"  zinfjax keeps per parameter (bytes, before the split over devices): {kept}"
        + copies_note(args))
  if trainable is not None:
    kept = ", ".join(f"{t} {b:g}" for t, b in est.per_frozen_param.items() if b)
    print(f"  and per frozen parameter: {kept}")
  return 0


def operator_note(operator) -> str:
  """What the model-state working memory holds: the paper's GPT MLP, or a real model's largest
  operator (its params, and grads where it trains)."""
  if operator is None:
    return "4·hd·4hd"
  return f"{operator.name}, {'x'.join(map(str, operator.shape))}"


def copies_note(args) -> str:
  """Which swap stores `per_param` counts twice (all-or-nothing steps), and how to say once."""
  from zinfjax.memory import copied_tiers
  twice = copied_tiers(args.offload_param, args.offload_optimizer, atomic_nvme=args.atomic_nvme,
                       host_optimizer=args.host_optimizer, atomic_host=args.host_atomic_steps)
  if not twice:
    return ""
  names = " and ".join({"pinned_host": "in the RAM store", "nvme": "on NVMe"}[t] for t in twice)
  undo = "--no-atomic-nvme" if "nvme" in twice else "without --host-atomic-steps"
  return f"; params and optimizer states {names} twice (all-or-nothing steps; {undo}: once)"

if __name__ == "__main__":
  sys.exit(main())
