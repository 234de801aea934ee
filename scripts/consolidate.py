"""Turn a zinfjax checkpoint into one safetensors file of full params (like `zero_to_fp32`).

  python scripts/consolidate.py CKPT_DIR params.safetensors [--step N] [--dtype bf16]

Reads the fp32 master params (a frozen param's own values: LoRA's base weights, say) from a
checkpoint saved on any number of devices, processes and tiers, and writes them in their
logical shapes under dotted names ("blocks.block.attn.qkv.kernel"; stacked layers keep their
leading layer axis). Host memory holds one slab of a tensor at a time: a stacked leaf's layers,
as many as fit 64 MiB (at least one), not the whole leaf.
"""

from __future__ import annotations

import argparse
import os
import sys

DTYPES = {"fp32": "float32", "bf16": "bfloat16"}


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("checkpoint", help="the checkpoint folder (train_gpt.py --checkpoint-dir)")
  p.add_argument("output", help="the .safetensors file to write")
  p.add_argument("--step", type=int, default=None, help="step to export (default: the latest)")
  p.add_argument("--dtype", default="fp32", choices=tuple(DTYPES))
  args = p.parse_args(argv)

  import ml_dtypes
  import numpy as np
  from zinfjax.checkpoint import CheckpointError, CheckpointParams
  from zinfjax.weights import safetensors

  out_dir = os.path.dirname(os.path.abspath(args.output))
  if os.path.isdir(args.output):
    raise SystemExit(f"error: the output {args.output} is a directory; give a file name, e.g. "
                     f"{os.path.join(args.output, 'params.safetensors')}.")
  if not os.path.isdir(out_dir):
    raise SystemExit(f"error: the output's folder {out_dir} does not exist; create it first.")
  dtype = np.dtype(getattr(ml_dtypes, DTYPES[args.dtype], DTYPES[args.dtype]))
  try:
    params = CheckpointParams(args.checkpoint, args.step)  # masters, and a frozen leaf's params
  except (CheckpointError, FileNotFoundError) as e:
    raise SystemExit(f"error: {e}") from None

  def tensor(path: str) -> tuple[str, safetensors.Tensor]:
    """One leaf as the writer takes it: its shape from the metadata, its data read on use."""
    name = path.replace("/", ".")

    def produce():  # the leaf's slabs (a stacked leaf's layers), each written before the next
      print(f"{name}: {list(params.shape(path))}", flush=True)
      return (block.astype(dtype, copy=False) for block in params.blocks(path))

    return name, (params.shape(path), dtype, produce)

  tensors = [tensor(path) for path in params]
  tmp = f"{args.output}.tmp-{os.getpid()}"
  try:
    nbytes = safetensors.write(tmp, tensors, {"format": "pt", "step": str(params.step)})
    os.replace(tmp, args.output)  # never a half-written file under the output name
  except (CheckpointError, OSError) as e:
    where = f" writing {args.output}" if isinstance(e, OSError) else ""
    raise SystemExit(f"error{where}: {e.strerror if isinstance(e, OSError) and e.strerror else e}"
                     f"{'' if isinstance(e, CheckpointError) else ' (nothing was written)'}") from None
  finally:
    if os.path.exists(tmp):  # any failure, Ctrl-C included: no temporary file left behind
      os.remove(tmp)
  print(f"wrote {len(tensors)} tensors ({nbytes / 2**20:.1f} MiB, {args.dtype}) of step "
        f"{params.step} to {args.output}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
