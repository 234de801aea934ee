"""The largest GPT that trains on this machine, per placement: sized from its memory, then trained.

  python scripts/largest_gpt.py --out OUT --nvme-path /local_nvme/big [--placements device pinned_host nvme]

For each placement (params and optimizer on one tier, grads with the params), the machine's room
on that tier, times `--fill`, bounds the model: the GPU's HBM (jax's `bytes_limit`: XLA takes 75%
of it unless `XLA_PYTHON_CLIENT_MEM_FRACTION`, passed on to the runs, says otherwise), the host's
available RAM less `--host-reserve-gib`, or the free space under `--nvme-path`. The most layers at
`--hidden` whose states (zinfjax.memory's estimate, embeddings counted) fit every tier it uses
train with `train_gpt.py` for `--steps` steps. If that run fails (out of memory), the layers
shrink by `--shrink` and it runs again, up to `--tries` runs. The table: layers, params, states
per tier, step s, tokens/s, TFLOP/s, losses, peak HBM and RSS; OUT/largest_gpt.json holds every
run. `--hbm-gib`, `--ram-gib` and `--disk-gib` (per device) replace the measured rooms (a check of
the script on a small machine). `--deadline` bounds all the runs together (each run's timeout is
cut to what is left; a try with under a minute left is not started). A mixed run the host kills
for memory (SIGKILL, the out-of-memory killer) is tried again at the same layers with
`--oom-reserve-gib` more RAM kept back, where RAM is measured: the plan then puts more on the
drive, and the layers shrink only if they no longer place.

The placement `mixed` uses every tier at once: zinfjax's `offload="auto"` fills HBM first, then
host RAM, then the drive, layer by layer (params before optimizer states), with each tier's
room x `--fill` as its budget (the device's less the activations' estimate). The search builds
the plan alone (no state, in a CPU child process) for each layer count and keeps the largest
that fits; NVMe steps rewrite in place (`--no-atomic-steps`: atomic ones need the drive twice).
With `--delay-update all` the host's AdamW runs beside the next step's program instead of after
it (the step's time is then about the longer of the two), and its held grads and new params
count in RAM's need: the same rooms place less. Such a run's loss is judged from its second step
on (the second may run the first's params unchanged). The table's "program / after it" splits
the last step: the program, then the host's work after it (the host pipeline's update, where
it runs after backward).

Each run trains one batch `--steps` times with no warm-up, so its first AdamW step moves every
weight by about the learning rate, all in the direction that lowers the loss: the blocks'
outputs move by about lr x hidden x layers together, and past a point the loss rises instead
(measured on CPU from hidden 512 to 4096 and 3 to 80 layers: BENCHMARKS.md, "The largest
model's learning rate and host optimizer"). The default learning rate is therefore
`LR_WIDTH_DEPTH / (hidden x layers)`, and the table says whether the loss fell at every step.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time

SCRIPTS = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, SCRIPTS)
from _gpu_table import SPEC_TFLOPS  # noqa: E402  (bench_gpu.py's second MFU denominator)
from _largest_plan import (  # noqa: E402,F401  (the tests reach them through this script)
    GIB, delay_of, gpt_config, largest, mixed_budgets, mixed_plan, need, num_params, rooms,
    search_mixed)
LR_WIDTH_DEPTH = 0.02  # lr x hidden x layers of the default learning rate (see above)
KILLED = -9  # a run's exit status when the kernel's out-of-memory killer (SIGKILL) stopped it
MIN_TRY_S = 60  # under --deadline, a try with less time than this left is not started


def default_lr(hidden: int, layers: int) -> float:
  """The learning rate whose first step (no warm-up, AdamW's first update about lr per weight)
  lowers the loss at `hidden` x `layers`: the loss rose at lr x hidden x layers = 0.12 and
  above, barely moved at 0.06 and fell at 0.05 and below; this keeps a margin of 2.5x."""
  return LR_WIDTH_DEPTH / (hidden * layers)


def loss_falls(records: list[dict], late: bool = False) -> bool:
  """Whether a run's loss fell at every step it logged (and it logged two or more). `late`:
  updates one step late (`--delay-update all`), so the second step may run the first's params
  unchanged where the host pipeline holds every layer's optimizer: from the second step on,
  and the last below the first."""
  losses = [r["loss"] for r in records]
  if late:
    return len(losses) > 2 and losses[-1] < losses[0] and loss_falls(records[1:])
  return len(losses) > 1 and all(b < a for a, b in zip(losses, losses[1:]))


def devices_here(devices: int | None) -> tuple[str, int, int | None]:
  """(platform, devices used, a device's memory limit in bytes or None), asked of a child
  process: this one must not hold the GPU (or its memory) while the runs train."""
  code = ("import json, jax; d = jax.devices(); "
          "print(json.dumps([d[0].platform, len(d), (d[0].memory_stats() or {}).get('bytes_limit')]))")
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                       cwd="/", env={**os.environ, "XLA_PYTHON_CLIENT_PREALLOCATE": "false"})
  platform, count, limit = json.loads(out.stdout.strip().splitlines()[-1])
  return platform, devices or count, limit


def train(tier: str, layers: int, args, folder: str, budgets: dict | None = None,
          timeout: float | None = None) -> dict:
  """One `train_gpt.py` run, stopped after `timeout` s (`--timeout`); its metrics, return code
  and the tail of its output. `mixed` trains with `--offload auto` and `budgets`."""
  timeout = args.timeout if timeout is None else timeout
  metrics = os.path.join(args.out, f"{tier}_{layers}.jsonl")
  lr = args.lr if args.lr is not None else default_lr(args.hidden, layers)
  cmd = [sys.executable, os.path.join(SCRIPTS, "train_gpt.py"), "--preset", "tiny",
         "--layers", str(layers), "--hidden", str(args.hidden), "--heads", str(args.heads),
         "--seq-len", str(args.seq_len), "--batch-size", str(args.batch_size),
         "--steps", str(args.steps), "--log-every", "1", "--same-batch", "--warmup-steps", "0",
         "--lr", str(lr), "--delay-update", delay_of(tier, args),
         "--metrics-jsonl", metrics] + (["--bf16-moments"] if args.bf16_moments else [])
  if tier == "mixed":
    cmd += ["--offload", "auto"] + [f"--budget={t}={b}" for t, b in budgets.items()]
  else:
    cmd += ["--offload-param", tier, "--offload-optimizer", tier]
  if tier in ("nvme", "mixed"):
    cmd += ["--nvme-path", folder, "--no-atomic-steps", "--pinned-budget", str(args.pinned_budget)]
  if tier in ("pinned_host", "mixed"):
    cmd += ["--host-optimizer", args.host_optimizer]
  cmd += ["--devices", str(args.devices)]
  t0 = time.perf_counter()
  try:
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    code, text = out.returncode, out.stdout + out.stderr
  except subprocess.TimeoutExpired as e:  # counted as a failure: the next try is smaller
    code = 124
    text = "".join(x.decode() if isinstance(x, bytes) else x for x in (e.stdout, e.stderr) if x)
    text += f"\n(stopped after {timeout:.0f} s)"
  records = []
  if os.path.exists(metrics):
    with open(metrics) as f:
      records = [json.loads(line) for line in f]
  return {"tier": tier, "layers": layers, "lr": lr, "returncode": code,
          "wall_s": time.perf_counter() - t0, "records": records, "tail": text[-3000:]}


def next_try(tier: str, layers: int, run: dict, room: dict[str, int], args, folder: str,
             limit: int | None, platform: str) -> tuple[int, dict[str, int]]:
  """The layers and rooms of the try after the failed `run`. A mixed run the host killed for
  memory (SIGKILL) keeps its layers, with `--oom-reserve-gib` more RAM kept back, where RAM
  is measured (`rooms` again: the plan then puts more on the drive); any other failure keeps
  `--shrink` of the layers in the same rooms."""
  if (tier == "mixed" and run["returncode"] == KILLED and args.ram_gib is None
      and args.oom_reserve_gib > 0):
    args.host_reserve_gib += args.oom_reserve_gib
    print(f"{tier}: killed, most likely for host memory: {layers} layers again with "
          f"{args.host_reserve_gib:g} GiB of RAM kept back", flush=True)
    return layers, rooms(args, folder, limit, platform)
  return int(layers * args.shrink), room


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--out", required=True, help="folder for largest_gpt.json and the runs' metrics")
  p.add_argument("--placements", nargs="+", default=["device", "pinned_host", "nvme"],
                 choices=["device", "pinned_host", "nvme", "mixed"])
  p.add_argument("--hidden", type=int, default=4096)
  p.add_argument("--heads", type=int, default=32)
  p.add_argument("--seq-len", type=int, default=1024)
  p.add_argument("--batch-size", type=int, default=8, help="global batch (examples per step)")
  p.add_argument("--steps", type=int, default=3)
  p.add_argument("--layers", type=int, default=None,
                 help="train this many layers instead of the most that fit (checked to fit first)")
  p.add_argument("--bf16-moments", action="store_true",
                 help="Adam's moments in bf16 (8 optimizer bytes per parameter instead of 12)")
  p.add_argument("--host-optimizer", default="pipeline", choices=("xla", "pipeline", "stream"),
                 help="who updates the optimizer states in pinned host (train_gpt.py's flag): "
                      "'pipeline' (the default), the C++ AdamW on host threads, the states in a "
                      "store in RAM; 'xla', the step's program (on a GPU, RAM's room / 2.3 for "
                      "states); 'stream', the program on the device, a layer's states at a time")
  p.add_argument("--delay-update", default="none", choices=("none", "tail", "all"),
                 help="ZeroConfig.delay_update of the runs, counted in their plans: 'all' runs the "
                      "host's AdamW beside the next step's program (ZeRO-Offload's delayed update)")
  p.add_argument("--lr", type=float, default=None,
                 help=f"learning rate (default: {LR_WIDTH_DEPTH} / (hidden x layers), see above)")
  p.add_argument("--devices", type=int, default=None, help="devices used (default: all)")
  p.add_argument("--fill", type=float, default=0.85, help="share of each tier's room the states may take")
  p.add_argument("--host-reserve-gib", type=float, default=8.0,
                 help="host RAM kept for the runtime, data and staging (measured RAM only)")
  p.add_argument("--nvme-path", default=None, help="swap store folder (default: under --out)")
  p.add_argument("--pinned-budget", type=int, default=4096, help="MiB of pinned buffers for NVMe")
  for room_flag in ("--hbm-gib", "--ram-gib", "--disk-gib"):  # rooms given (see above)
    p.add_argument(room_flag, type=float, default=None)
  p.add_argument("--shrink", type=float, default=0.8, help="layers kept after a failed run")
  p.add_argument("--tries", type=int, default=2, help="runs per placement at most")
  p.add_argument("--timeout", type=int, default=540, help="seconds per run")
  p.add_argument("--deadline", type=float, default=None,
                 help="seconds for all the runs together (each run's timeout cut to what is left)")
  p.add_argument("--oom-reserve-gib", type=float, default=20.0,
                 help="RAM kept back in addition after a mixed run killed for host memory")
  args = p.parse_args(argv)
  from zinfjax.progress import human_bytes
  os.makedirs(args.out, exist_ok=True)
  folder = os.path.abspath(args.nvme_path or os.path.join(args.out, "nvme"))
  platform, args.devices, limit = devices_here(args.devices)
  room = first_room = rooms(args, folder, limit, platform)
  deadline = None if args.deadline is None else time.monotonic() + args.deadline
  print(f"{args.devices} {platform} device(s); room per device: "
        + ", ".join(f"{t} {human_bytes(b)}" for t, b in room.items()), flush=True)
  runs = []
  for tier in args.placements:
    placed = None
    if tier == "mixed":
      layers, placed = search_mixed(room, args, folder, args.layers)
    else:
      layers = largest(tier, room, args)
    if args.layers is not None:  # a given count: trained only where its states fit
      fits = placed is not None if tier == "mixed" else args.layers <= layers
      if not fits:
        most = ("run without --layers for the most that do" if tier == "mixed"
                else f"at most {layers}")
        print(f"{tier}: {args.layers} layers of {args.hidden} do not fit ({most}); "
              "pass fewer --layers", flush=True)
        continue
      layers = args.layers
    for _ in range(args.tries):
      left = None if deadline is None else deadline - time.monotonic()
      if left is not None and left < MIN_TRY_S:
        print(f"{tier}: {left:.0f} s left of --deadline: no more tries", flush=True)
        break
      if tier == "mixed" and placed is None and layers >= 1:  # after a failed run: its plan
        _, placed = search_mixed(room, args, folder, layers)
        if placed is None:  # rooms that shrank (more RAM kept back): the most that place now
          layers, placed = search_mixed(room, args, folder)
      if layers < 1:
        print(f"{tier}: not even one layer of {args.hidden} fits", flush=True)
        break
      states = placed["need"] if placed else need(layers, tier, args)
      print(f"{tier}: {layers} layers, states per device "
            + ", ".join(f"{t} {human_bytes(b)}" for t, b in states.items() if b)
            + (f" (params {placed['offload_param']}, optimizer {placed['offload_optimizer']})"
               if placed else ""), flush=True)
      run = train(tier, layers, args, folder,
                  mixed_budgets(layers, room, args) if tier == "mixed" else None,
                  None if left is None else min(args.timeout, left - 10))
      run.update(need=states, room=room, host_reserve_gib=args.host_reserve_gib)
      if placed:  # host_arrays: of pinned host's need, the host pipeline's arrays, not states
        run["placement"] = {k: placed[k] for k in ("offload_param", "offload_optimizer",
                                                   "host_arrays")}
      runs.append(run)
      # after every run: a call cut short keeps the runs before
      with open(os.path.join(args.out, "largest_gpt.json"), "w") as f:
        json.dump({"room": first_room, "args": vars(args), "runs": runs}, f, indent=1)
      shutil.rmtree(folder, ignore_errors=True)
      last = run["records"][-1] if run["records"] else {}
      print(f"{tier}: exit {run['returncode']} after {run['wall_s']:.0f} s"
            + (f", loss {last['loss']:.4f}, {last['step_time_s']:.2f} s/step" if last else ""), flush=True)
      if run["returncode"] == 0:
        break
      print(f"{tier}: {layers} layers failed (exit {run['returncode']}):\n{run['tail'][-1500:]}", flush=True)
      layers, room = next_try(tier, layers, run, room, args, folder, limit, platform)
      placed = None
  print(f"\nGPT x{args.hidden} ({args.heads} heads), {args.batch_size} x {args.seq_len} tokens a step, "
        f"{args.steps} steps (the first compiles), delay_update {args.delay_update}; states may "
        f"take {args.fill:.0%} of each tier's room\n")
  # program / after it: the step's program, then the host's work it waited for (the host
  # pipeline's update after backward, its grads read and new params put back)
  print("| placement | layers | params B | states per device | exit | step s (last) | "
        "program / after it s | "
        f"tokens/s | TFLOP/s | MFU ({SPEC_TFLOPS:.0f} spec) | lr | loss first -> last | peak HBM GiB | "
        "peak RSS GiB (RAM free at least) | disk used GB | wall s |")
  print("|---" * 16 + "|")
  late = lambda run: delay_of(run["tier"], args) == "all"  # judged from the second step on
  for run in runs:
    config, rs = gpt_config(run["layers"], args), run["records"]
    n = config.num_params
    states = ", ".join(f"{t} {human_bytes(b)}" for t, b in run["need"].items() if b)
    trained = ["-"] * 5 + [f"{run['lr']:.2g}"] + ["-"] * 4  # a run that wrote no step
    if rs:
      last = rs[-1]
      # 6·N·T plus causal attention, the standard count (GPTConfig.train_flops)
      tflops = config.train_flops(args.batch_size * args.seq_len) / last["step_time_s"] / 1e12
      hbm = [r["peak_hbm"] for r in rs if r.get("peak_hbm") is not None]
      disk = last.get("tiers", {}).get("nvme", 0) * args.devices
      free = [r["least_ram_available"] for r in rs if r.get("least_ram_available") is not None]
      split = (f"{last['fwd_bwd_s']:.2f} / {last['after_program_s']:.2f}"
               if "after_program_s" in last else "-")  # no host pipeline: the program alone
      trained = [f"{last['step_time_s']:.2f}", split, f"{last['tokens_per_s']:,.0f}",
                 f"{tflops:.1f}", f"{tflops / SPEC_TFLOPS:.1%}" if platform == "gpu" else "-",
                 f"{run['lr']:.2g}", f"{rs[0]['loss']:.3f} -> {last['loss']:.3f}"
                 + (" (falls at every step)" if loss_falls(rs, late(run))
                    else " (**not falling**)"),
                 f"{max(hbm) / GIB:.2f}" if hbm else "-",
                 f"{max(r['peak_rss'] for r in rs) / GIB:.2f}"
                 + (f" ({min(free) / GIB:.1f})" if free else ""), f"{disk / 1e9:.1f}"]
    where = run["tier"] + (" (params {offload_param}; optimizer {offload_optimizer})".format(
        **run["placement"]) if "placement" in run else "")
    print("| " + " | ".join([where, str(run["layers"]), f"{n / 1e9:.2f}", states,
                             str(run["returncode"]), *trained, f"{run['wall_s']:.0f}"]) + " |")
  # each placement's last run: it ran, and its loss fell
  last = {run["tier"]: run["returncode"] == 0 and loss_falls(run["records"], late(run))
          for run in runs}
  return 0 if len(last) == len(args.placements) and all(last.values()) else 1


if __name__ == "__main__":
  sys.exit(main())
