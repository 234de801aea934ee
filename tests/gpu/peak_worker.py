"""Trains a ~100M-parameter GPT for 2 steps on one batch on one GPU with the given placement and prints
{"peak_bytes", "tier_bytes", "losses"} as JSON (a fresh process: the GPU's peak only grows).

  python tests/gpu/peak_worker.py PARAM_TIER OPTIMIZER_TIER NVME_PATH [HOST_OPTIMIZER]
"""

import json
import os
import sys

import jax
import numpy as np

import zinfjax
from zinfjax.models import GPT, get_config, lm_loss


def main(param: str, optimizer: str, nvme: str, host_optimizer: str = "xla") -> None:
  gpu = jax.devices("cpu" if os.environ.get("ZINFJAX_GPU_TESTS_ON_CPU") else "gpu")[0]
  config = get_config("tiny", vocab_size=8192, hidden=1024, num_heads=16, num_layers=8, seq_len=256)
  zero = zinfjax.ZeroConfig(offload_param=param, offload_optimizer=optimizer, nvme_path=nvme,
                            host_optimizer=host_optimizer)
  state = zinfjax.init(lambda r: GPT(config, rngs=r), zinfjax.optim.adamw(1e-3), zero,
                       zinfjax.make_mesh(devices=[gpu]), 0)
  rng = np.random.default_rng(0)
  batch = {k: rng.integers(0, config.vocab_size, (8, 256)).astype(np.int32)
           for k in ("inputs", "targets")}
  losses = []
  for _ in range(2):  # the same batch twice: its loss must fall (random tokens need not)
    state, metrics = zinfjax.train_step(state, batch, lm_loss)
    losses.append(float(metrics["loss"]))
  print(json.dumps({"peak_bytes": gpu.memory_stats()["peak_bytes_in_use"],
                    "tier_bytes": state.engine.plan.tier_bytes(), "losses": losses}))


if __name__ == "__main__":
  main(*sys.argv[1:5])
