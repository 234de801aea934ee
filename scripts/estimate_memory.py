"""The ZeRO-Infinity memory model (paper, section 3) for a preset or a custom shape.

  python scripts/estimate_memory.py --preset 1t --devices 16 --offload-param nvme --offload-optimizer nvme
  python scripts/estimate_memory.py --layers 50 --hidden 4096 --heads 16 --json

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
  p.add_argument("--layers", type=int)
  p.add_argument("--hidden", type=int)
  p.add_argument("--heads", type=int)
  p.add_argument("--seq-len", type=int, default=1024)
  p.add_argument("--batch-per-device", type=int, default=1)
  p.add_argument("--devices", type=int, default=1, help="data-parallel devices in total")
  p.add_argument("--devices-per-node", type=int, default=None, help="default: --devices")
  p.add_argument("--zero-stage", type=int, default=3, choices=(0, 1, 2, 3))
  p.add_argument("--checkpoint-interval", type=int, default=1, help="blocks per activation checkpoint (ci)")
  p.add_argument("--offload-param", default="device", choices=("device", "pinned_host", "nvme"))
  p.add_argument("--offload-grad", default=None, choices=("device", "pinned_host", "nvme"))
  p.add_argument("--offload-optimizer", default="device", choices=("device", "pinned_host", "nvme"))
  p.add_argument("--json", action="store_true", help="print the numbers as JSON")
  return p.parse_args(argv)


def fmt(n: float) -> str:
  for unit in ("B", "KB", "MB", "GB", "TB", "PB"):
    if abs(n) < 1000 or unit == "PB":
      return f"{n:,.2f} {unit}"
    n /= 1000
  return str(n)


def main(argv=None) -> int:
  args = parse_args(argv)
  from zinfjax.memory import estimate_memory
  layers, hidden, heads = args.layers, args.hidden, args.heads
  if args.preset:
    from zinfjax.models import get_config
    config = get_config(args.preset)
    layers, hidden, heads = layers or config.num_layers, hidden or config.hidden, heads or config.num_heads
  if not (layers and hidden and heads):
    print("error: give --preset NAME or all of --layers, --hidden and --heads.", file=sys.stderr)
    return 2
  est = estimate_memory(layers=layers, hidden=hidden, heads=heads, seq_len=args.seq_len,
                        batch_per_device=args.batch_per_device, devices=args.devices,
                        devices_per_node=args.devices_per_node, stage=args.zero_stage,
                        checkpoint_interval=args.checkpoint_interval,
                        offload_param=args.offload_param, offload_grad=args.offload_grad,
                        offload_optimizer=args.offload_optimizer)
  inputs = {k: v for k, v in vars(args).items() if k != "json"}
  inputs.update(layers=layers, hidden=hidden, heads=heads)
  if args.json:
    print(json.dumps({**est.as_dict(), "inputs": inputs}, indent=2))
    return 0
  print(f"GPT {layers} layers x {hidden} hidden, {heads} heads: {est.num_params / 1e9:,.2f}B params "
        f"(12·nl·hd²), ZeRO-{args.zero_stage} on {args.devices} devices")
  rows = [("model states, whole model (20 B/param)", est.model_states)]
  rows += [(f"model states per device on {t}", b) for t, b in est.per_device.items()]
  rows += [(f"model states per node on {t}", b) for t, b in est.per_node.items()]
  rows += [("activation checkpoints per device", est.activation_checkpoints),
           ("model-state working memory (4·hd·4hd)", est.model_state_working_memory),
           ("activation working memory per device", est.activation_working_memory)]
  width = max(len(r[0]) for r in rows)
  for name, value in rows:
    print(f"  {name:<{width}}  {fmt(value):>14}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
