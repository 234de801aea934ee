"""A training process for the checkpoint tests: restore (or start), train, save, report.

  python tests/resume_worker.py --devices 4 --param nvme --optimizer nvme --precision fp32 \
      --ckpt DIR [--restore] --steps 5 --out result.npz [--save-at 2] [--kill-after-save]

The test process imports `make_tx`, `model_factory` and `batches` from here so
both sides train the same model on the same data.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys

STEPS = 10


def model_factory(rngs):
  from zinfjax.models import GPT, get_config
  return GPT(get_config("tiny"), rngs=rngs)


def make_tx(optimizer: str):
  import optax
  import zinfjax
  schedule = optax.warmup_cosine_decay_schedule(0.0, 3e-3, 3, STEPS)
  if optimizer == "device":
    return optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule, weight_decay=0.1))
  return zinfjax.optim.adamw(schedule, weight_decay=0.1)


def batches():
  from helpers import text_batches
  return text_batches(STEPS, batch=16, seq=32, seed=3)


def zero_config(param: str, optimizer: str, precision: str, nvme: str):
  import zinfjax
  return zinfjax.ZeroConfig(precision=precision, offload_param=param, offload_optimizer=optimizer,
                            nvme_path=nvme)


def main() -> int:
  p = argparse.ArgumentParser()
  p.add_argument("--devices", type=int, default=8)
  p.add_argument("--param", default="device")
  p.add_argument("--optimizer", default="device")
  p.add_argument("--precision", default="bf16")
  p.add_argument("--ckpt", required=True)
  p.add_argument("--nvme", default=None)
  p.add_argument("--restore", action="store_true")
  p.add_argument("--steps", type=int, required=True, help="train until this step")
  p.add_argument("--save-at", type=int, action="append", default=[])
  p.add_argument("--kill-after-save", action="store_true",
                 help="SIGKILL this process as soon as the last --save-at save returns")
  p.add_argument("--out", default=None)
  args = p.parse_args()
  flags = os.environ.get("XLA_FLAGS", "")
  os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={args.devices}"
  sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
  import jax
  import numpy as np
  import zinfjax
  from zinfjax.checkpoint import Checkpointer
  from zinfjax.models import lm_loss

  mesh = zinfjax.make_mesh()
  zero = zero_config(args.param, args.optimizer, args.precision, args.nvme)
  tx = make_tx(args.optimizer)
  ckpt = Checkpointer(args.ckpt, keep=3)
  if args.restore:
    state, _ = ckpt.restore(model_factory, tx, zero, mesh)
  else:
    state = zinfjax.init(model_factory, tx, zero, mesh, 0)
  data, losses = batches(), []
  for i in range(int(state.step), args.steps):
    state, metrics = zinfjax.train_step(state, data[i], lm_loss)
    losses.append(float(metrics["loss"]))
    if i + 1 in args.save_at:
      ckpt.save(state)
      if args.kill_after_save and i + 1 == max(args.save_at):
        os.kill(os.getpid(), signal.SIGKILL)
      ckpt.wait()
  ckpt.close()
  if args.out:
    params = {jax.tree_util.keystr(k): np.asarray(v) for k, v in
              jax.tree_util.tree_flatten_with_path(state.full_params())[0]}
    np.savez(args.out, losses=np.asarray(losses), **params)
  return 0


if __name__ == "__main__":
  sys.exit(main())
