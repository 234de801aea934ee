"""Multi-process runs: JAX's multi-controller runtime, one process per host (or per GPU).

Every process runs the same program on its own devices; the `data` mesh spans
all of them, and each process moves only the shards of its own devices
(its NVMe files live in `nvme_path/rank{process}`). `scripts/launch.py`
starts N local processes; cluster launchers (SLURM, Open MPI, ...) are
detected by `jax.distributed.initialize` itself.
"""

from __future__ import annotations

import os

import jax

ENV_COORDINATOR = "ZINFJAX_COORDINATOR"
ENV_NUM_PROCESSES = "ZINFJAX_NUM_PROCESSES"
ENV_PROCESS_ID = "ZINFJAX_PROCESS_ID"


def from_env() -> dict | None:
  """The process's place in a run started by `scripts/launch.py`, or None."""
  if ENV_COORDINATOR not in os.environ:
    return None
  try:
    return {"coordinator_address": os.environ[ENV_COORDINATOR],
            "num_processes": int(os.environ[ENV_NUM_PROCESSES]),
            "process_id": int(os.environ[ENV_PROCESS_ID])}
  except (KeyError, ValueError) as e:
    raise ValueError(f"{ENV_COORDINATOR} is set, so {ENV_NUM_PROCESSES} and {ENV_PROCESS_ID} must be "
                     f"integers too ({e}); start processes with scripts/launch.py.") from e


def initialize(coordinator_address: str | None = None, num_processes: int | None = None,
               process_id: int | None = None, *, auto: bool = False,
               heartbeat_timeout_s: int = 30, init_timeout_s: int = 120) -> bool:
  """Join a multi-process run; returns whether there is more than one process.

  Uses the arguments, else the variables `scripts/launch.py` sets, else (with
  `auto`) JAX's cluster detection. Must run before any JAX computation. On
  CPU the collectives go over gloo (TCP). A process that stops answering for
  `heartbeat_timeout_s` makes the others fail instead of waiting forever, and
  SIGTERM stops a process at once (JAX's preemption service, which would hold
  it, is turned off).
  """
  args = ({"coordinator_address": coordinator_address, "num_processes": num_processes,
           "process_id": process_id} if coordinator_address else from_env())
  if args is None and not auto:
    return False
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  # JAX's preemption service catches SIGTERM and waits for a sync point zinfjax never reaches:
  # a launcher stopping the survivors of a failed run would wait out its whole grace period
  jax.config.update("jax_enable_preemption_service", False)
  jax.distributed.initialize(**(args or {}), heartbeat_timeout_seconds=heartbeat_timeout_s,
                             initialization_timeout=init_timeout_s)
  return jax.process_count() > 1
