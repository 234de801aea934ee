"""zinfjax on a GPU against the hardware, all measured in one run.

  python scripts/bench_gpu.py --out /tmp/bench            # on a GPU machine
  python scripts/bench_gpu.py --out /tmp/bench --tiny     # the same code on CPU, tiny sizes

One table (also written as JSON under --out):

* host <-> device GB/s, both directions: plain pinned `cudaMemcpyAsync`
  (torch, else cupy: the ceiling), `jax.device_put` across memory kinds
  (outside and inside jit: how `pinned_host` states move), and zinfjax's CUDA
  swap handlers (a jitted scan through the store, the store in /dev/shm so
  the disk is not what is measured);
* the GPU's bf16 matmul rate (8192^3, random inputs): the MFU denominator;
* the disk under --nvme-path: fio (or dd) ceiling and the zinfjax store;
* the GPT step (or with `--init-from`, a Hugging Face checkpoint's model from
  its config.json alone, randomly initialized: `data/shapes`) (tokens/s,
  TFLOP/s, MFU by the model's standard count) with states all on device (compute
  alone), params + optimizer on pinned host, and on NVMe, at each --tokens;
  the NVMe row also against max(compute alone, I/O alone), I/O alone being
  the step's bytes moved through the store with nothing else running; each
  row's loss after its steps (every row starts from the same init and takes
  the same batches, so the losses agree to bf16 rounding: a quick check that
  a placement computes what the device does).
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import os
import shutil
import signal
import sys
import tempfile
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_adam import (bench_calls, bench_host, bench_zinfjax, copy_bandwidth,  # noqa: E402
                        kernel_pass)
from bench_step import io_alone, median_step  # noqa: E402
from _gpu_limits import (ceiling_copy, disk, matmul_rate, memory_kind_copies,  # noqa: E402
                         numpy_copies, peaks, swap_copies)
from _gpu_table import DEVICE_ROW, SPEC_TFLOPS, phase_line, ratios, table  # noqa: E402

# (key, params tier, optimizer tier, row name)
PLACEMENTS = [("device", "device", "device", DEVICE_ROW),
              ("device-explicit", "device", "device",
               "all on device, explicit attention (ZINFJAX_ATTENTION=explicit: no cuDNN)"),
              ("pinned", "pinned_host", "pinned_host", "params + optimizer on pinned_host"),
              ("pipeline", "pinned_host", "pinned_host",
               "params + optimizer on pinned_host, host pipeline"),
              ("pipeline-under", "pinned_host", "pinned_host",
               "params + optimizer on pinned_host, host pipeline under backward"),
              ("pipeline-delayed-all", "pinned_host", "pinned_host",
               "params + optimizer on pinned_host, host pipeline beside the step, every update "
               "one step late"),
              ("pipeline-delayed-all-bf16", "pinned_host", "pinned_host",
               "params + optimizer on pinned_host, host pipeline beside the step, every update "
               "one step late, bf16 moments"),
              ("pipeline-under-bf16", "pinned_host", "pinned_host",
               "params + optimizer on pinned_host, host pipeline under backward, bf16 moments"),
              # ZeRO-Offload's setup: the params on the device, their optimizer on the host
              ("offload", "device", "pinned_host",
               "params on the device, optimizer on pinned_host, host pipeline"),
              ("offload-delayed-all", "device", "pinned_host",
               "params on the device, optimizer on pinned_host, host pipeline beside the step, "
               "every update one step late"),
              # after the pipeline rows: a row XLA:GPU has yet to compile runs last at its tokens
              ("stream", "pinned_host", "pinned_host",
               "params + optimizer on pinned_host, update streamed through the device a layer at a time"),
              ("pipeline-delayed", "pinned_host", "pinned_host",
               "params + optimizer on pinned_host, host pipeline under backward, delayed tail"),
              ("pipeline-atomic", "pinned_host", "pinned_host",
               "params + optimizer on pinned_host, host pipeline under backward, all or nothing"),
              ("nvme", "nvme", "nvme", "params + optimizer on nvme"),
              ("mixed", "pinned_host", "nvme", "params on pinned_host, optimizer on nvme, host "
               "pipeline under backward (RAM + drive stores), rewritten in place")]
# untimed steps before each row's: the compile, and under "all" the first lends of the RAM
# store's twins (each page-locked on a GPU the first time: steps 2 and 3)
WARMUP = 3
# rows run only when --placements names them (the bench stage's 10 minutes hold the others)
OPT_IN = {"mixed", "pipeline-atomic", "device-explicit", "stream", "pipeline-delayed-all-bf16",
          "pipeline-under-bf16", "offload", "offload-delayed-all"}


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--out", required=True, help="folder for bench_gpu.json")
  p.add_argument("--init-from", default=None, metavar="HF_FOLDER",
                 help="time a Hugging Face checkpoint's model (its config.json alone, random "
                      "init) instead of the GPT; --layers cuts it, --hidden/--heads do not apply")
  p.add_argument("--layers", type=int, default=8)
  p.add_argument("--hidden", type=int, default=2048)
  p.add_argument("--heads", type=int, default=16)
  p.add_argument("--seq-len", type=int, default=1024)
  p.add_argument("--tokens", default=None,
                 help="tokens per step, comma-separated (default 4096,16384,65536; --tiny 64,128)")
  p.add_argument("--nvme-tokens", default=None,
                 help="token counts also run on NVMe (default 16384; --tiny 64)")
  p.add_argument("--nvme-path", default=None, help="swap store folder (default: a temp folder)")
  p.add_argument("--copy-mib", type=int, default=1024, help="bytes per host<->device copy")
  p.add_argument("--pinned-budget", type=int, default=8192,
                 help="MiB of page-locked buffers the store keeps (hold a few layers: buffers it "
                      "cannot keep are unpinned and pinned again)")
  p.add_argument("--steps", type=int, default=3, help="timed steps per row (after WARMUP untimed)")
  p.add_argument("--sections", default="copies,matmul,disk,host,steps",
                 help="comma-separated sections to run, or single parts of one (copies.ceiling, "
                      "copies.memory_kinds, copies.swap); a failing part is recorded and the rest run")
  p.add_argument("--placements", default=",".join(p[0] for p in PLACEMENTS if p[0] not in OPT_IN),
                 help="comma-separated keys of the step rows to run (nvme and mixed only at "
                      "--nvme-tokens; default: all but "
                      f"{sorted(OPT_IN)}); peaks are the process's: one key per run gives each "
                      "its own")
  p.add_argument("--tiny", action="store_true", help="small sizes: a check of the script on CPU")
  p.add_argument("--isolate", type=int, default=0, metavar="SECONDS",
                 help="run each step row in a child process stopped after SECONDS: a crash or a "
                      "hang costs that row alone, and each row's peaks are its own (their "
                      "output: OUT/rows.log)")
  args = p.parse_args(argv)
  unknown = set(args.placements.split(",")) - {k for k, *_ in PLACEMENTS}
  if unknown:
    p.error(f"unknown --placements {sorted(unknown)}; choose from {[k for k, *_ in PLACEMENTS]}")
  if args.tiny:
    args.layers, args.hidden, args.heads, args.seq_len = 2, 64, 4, 32
    args.copy_mib, args.steps, args.pinned_budget = 8, 2, 64
  args.tokens = args.tokens or ("64,128" if args.tiny else "4096,16384,65536")
  args.nvme_tokens = args.nvme_tokens or ("64" if args.tiny else "16384")
  return args


def delay_of(name: str) -> str:
  """The `ZeroConfig.delay_update` of the step row called `name`."""
  return "all" if "every update one step late" in name else (
      "tail" if "delayed tail" in name else "none")


def host_optimizer_of(name: str) -> str:
  """The `ZeroConfig.host_optimizer` of the step row called `name`."""
  if "host pipeline" in name:
    return "pipeline"
  return "stream" if "streamed through the device" in name else "xla"


def row_specs(args) -> list[tuple[int, tuple]]:
  """(tokens, PLACEMENTS entry) of every step row the arguments ask for, in run order."""
  nvme_tokens = {int(t) for t in args.nvme_tokens.split(",") if t}
  wanted = set(args.placements.split(","))
  return [(tokens, p) for tokens in [int(t) for t in args.tokens.split(",")] for p in PLACEMENTS
          if p[0] in wanted and ("nvme" not in (p[1], p[2]) or tokens in nvme_tokens)]


def isolated_steps(args, peak_tflops: float | None, root: str, rows: list[dict], saved) -> list[dict]:
  """Each step row in a child process of this script (`--isolate` seconds at most): a row that
  crashes, hangs or runs out of memory is recorded as failed and the next one runs."""
  import subprocess
  keep = ["--layers", str(args.layers), "--hidden", str(args.hidden), "--heads", str(args.heads),
          "--seq-len", str(args.seq_len), "--pinned-budget", str(args.pinned_budget),
          "--steps", str(args.steps)] + ["--tiny"] * args.tiny + (
              ["--init-from", args.init_from] if args.init_from else [])
  for tokens, (key, *_, name) in row_specs(args):
    out = os.path.join(root, f"row-{tokens}-{key}")
    command = [sys.executable, os.path.abspath(__file__), "--out", out, "--sections", "steps",
               "--tokens", str(tokens), "--nvme-tokens", str(tokens), "--placements", key,
               "--nvme-path", out, *keep]
    t0, log = time.perf_counter(), os.path.join(args.out, "rows.log")
    with open(log, "a") as f:  # every row's whole output, in one file beside the table
      f.write(f"\n===== {name} at {tokens} tokens =====\n")
      f.flush()
      start = f.tell()
      try:
        done = subprocess.run(command, timeout=args.isolate, stdout=f, stderr=subprocess.STDOUT)
        rc = done.returncode
        why = (None if rc == 0 else f"exit {rc}" if rc > 0
               else f"exit by {signal.Signals(-rc).name}")  # SIGSEGV: a crash in native code
      except subprocess.TimeoutExpired:
        why = f"stopped after {args.isolate} s (a hang, or a row longer than --isolate)"
    with open(log, errors="replace") as f:
      f.seek(start)
      output = f.read()
    for line in output.splitlines():  # what the row warned of (a fallback, say)
      if "Warning" in line:
        print("    " + line.strip()[:300], flush=True)
    if why and why.startswith("exit"):
      why += ": " + " ".join(output[-300:].split()).replace("|", "/")  # fit for a table cell
    found = os.path.join(out, "bench_gpu.json")
    child = json.load(open(found))["steps"] if os.path.exists(found) else []
    for row in child:
      if "tflops" in row and peak_tflops:
        row["mfu"] = row["tflops"] / peak_tflops
    rows.extend(child or [{"tokens": tokens, "placement": name, "error": why or "no row written"}])
    print(f"  [{name} at {tokens} tokens, own process: {time.perf_counter() - t0:.0f} s"
          f"{', ' + why.splitlines()[0] if why else ''}]", flush=True)
    shutil.rmtree(out, ignore_errors=True)
    saved()
  return rows


def bench_model(args):
  """(config, model factory) of the step rows' model (the GPT, or `--init-from`'s): the one
  `host_alone` sizes itself by."""
  from zinfjax.models import GPT, get_config
  if args.init_from:
    from _shapes import hf_model
    return hf_model(args.init_from, args.layers, args.seq_len, "bench_gpu")[:2]
  config = get_config("tiny", num_layers=args.layers, hidden=args.hidden, num_heads=args.heads,
                      seq_len=args.seq_len, vocab_size=32768 if not args.tiny else 65)
  return config, lambda r: GPT(config, rngs=r)


def bench_config(args):
  return bench_model(args)[0]


def model_name(args) -> str:
  """The step rows' model in the table's words: its shape, params and sequence length."""
  from zinfjax.progress import human_count
  config = bench_config(args)
  name = (f"{args.init_from} ({config.num_layers} layers)" if args.init_from
          else f"GPT {config.num_layers} x {config.hidden}")
  return f"{name}, {human_count(config.num_params)} params, sequences of {args.seq_len}"


def gpt_steps(jax, args, peak_tflops: float | None, root: str, rows: list[dict], saved) -> list[dict]:
  """GPT steps at each placement and token count; `rows` grows and `saved()` runs after each."""
  import numpy as np
  import zinfjax
  from zinfjax.models import lm_loss
  config, factory = bench_model(args)
  seq = args.seq_len
  mesh = zinfjax.make_mesh(1)
  specs = row_specs(args)
  for tokens in dict.fromkeys(t for t, _ in specs):
    batch_size = max(1, tokens // seq)
    rng = np.random.default_rng(tokens)
    batches = [{k: rng.integers(0, config.vocab_size, (batch_size, seq)).astype(np.int32)
                for k in ("inputs", "targets")} for _ in range(args.steps + WARMUP)]
    flops = config.train_flops(batch_size * seq, seq)  # 6 N T + causal attention
    for _, param, optimizer, name in [p for t, p in specs if t == tokens]:
      os.environ["ZINFJAX_ATTENTION"] = "explicit" if "explicit attention" in name else "auto"
      atomic = "all or nothing" in name
      zero = zinfjax.ZeroConfig(offload_param=param, offload_optimizer=optimizer,
                                pinned_budget=args.pinned_budget << 20,
                                host_optimizer=host_optimizer_of(name),
                                # the update under backward: no skipping of non-finite steps,
                                # unless the steps are all or nothing (rolled back when skipped)
                                skip_nonfinite="under backward" not in name or atomic,
                                host_atomic_steps=atomic,
                                delay_update=delay_of(name),
                                nvme_atomic_steps="rewritten in place" not in name,
                                nvme_path=os.path.join(root, f"steps-{tokens}-{param}")
                                if "nvme" in (param, optimizer) else None)
      state = None
      try:
        moments = "bfloat16" if "bf16 moments" in name else "float32"
        state = zinfjax.init(factory, zinfjax.optim.adamw(1e-4, moment_dtype=moments), zero,
                             mesh, 0)
        step, state, metrics = median_step(state, batches, lm_loss, WARMUP)
        rows.append({"tokens": batch_size * seq, "placement": name, "step_s": step,
                     "tokens_per_s": batch_size * seq / step,
                     # MFU needs the matmul rate: a row run in its own process gets it from its parent
                     "tflops": flops / step / 1e12,
                     "mfu": flops / step / 1e12 / peak_tflops if peak_tflops else None,
                     "mfu_spec": flops / step / 1e12 / SPEC_TFLOPS,
                     "loss": float(metrics["loss"]), **peaks(jax),
                     # the swap copies on the copy stream (the default), or XLA's stream (=0)
                     "copy_stream": os.environ.get("ZINFJAX_COPY_STREAM", "1") != "0"})
        rows[-1].update(where_it_went(state, metrics, args.steps + WARMUP))
        if param == "nvme":  # the same bytes through the store with nothing else running
          rows[-1]["io_alone_s"] = io_alone(state.engine.store)["seconds"]
        print(f"  {name} at {tokens} tokens: {step:.3f} s{phase_line(rows[-1])}", flush=True)
      except Exception as e:  # noqa: BLE001  (the other rows still run)
        traceback.print_exc()
        rows.append({"tokens": batch_size * seq, "placement": name,
                     "error": f"{type(e).__name__}: {str(e)[:300]}"})
      saved()
      if state is not None and state.engine.store is not None:
        state.engine.store.close()
      del state
      gc.collect()
  return rows


def where_it_went(state, metrics: dict, steps: int) -> dict:
  """The last step's phases as the step reports them (program, host optimizer, its waits), and
  the lent buffers the store made over all `steps` (one per step or more: `pinned_budget` keeps
  too few, so each is allocated and page-locked again)."""
  out = {"phases": {k: float(v) for k, v in metrics.items() if k.endswith("_s")}}
  if state.engine.store is not None:
    stats = state.engine.store.stats()  # a mixed store's: each tier's under its name
    stores = [v for v in stats.values() if isinstance(v, dict) and "buffers_made" in v] or [stats]
    out["buffers_made"] = {"count": sum(s["buffers_made"][0] for s in stores),
                           "bytes": sum(s["buffers_made"][1] for s in stores), "steps": steps}
    out["mapping_pinned_bytes"] = sum(s.get("mapping_pinned_bytes", 0) for s in stores)
    if state.engine.pipeline is not None and state.engine.store.memory:
      out["kernel_pass"] = kernel_pass(state.engine.pipeline)  # last: it updates the states
  return out


def host_alone(args) -> dict:
  """The host's side of a pinned-host step with nothing else running: copy bandwidth on every
  core, the C++ AdamW kernel over the bench GPT's params, and one host-pipeline step over them
  in the RAM store (bf16 grads in, bf16 params out, updated in place), best of 3. The pipeline
  rows cannot beat max(compute, that step)."""
  config = bench_config(args)
  n, hidden = config.num_params, config.hidden
  layer = 12 * hidden ** 2  # one block's params: the pipeline's sub-groups are about this
  cores = os.cpu_count() or 1
  # one kernel call over a block's largest tensor by the threads it is split over (the kernel
  # starts them per call): what that start costs on this host's cores
  largest = 4 * hidden ** 2
  calls = bench_calls([largest], sorted({1, max(1, cores // 4), cores}), 3)[largest]
  found = {"params": n, "threads": cores,
           "copy_gbs": copy_bandwidth(min(n * 4, 1 << 30), 3) / 1e9,
           "adam_s": bench_zinfjax(n, 3),
           "pipeline_s": bench_host(n, layer, 3)["in place"],
           "call_ms_by_threads": {t: s * 1e3 for t, s in calls.items()}}
  if any("bf16" in name for name in args.placements.split(",")):  # the bf16-moment rows' bound
    import ml_dtypes
    found["pipeline_bf16_s"] = bench_host(n, layer, 3, ml_dtypes.bfloat16,
                                          atomic=False)["in place"]
  return found


def main(argv=None) -> int:
  args = parse_args(argv)
  os.makedirs(args.out, exist_ok=True)
  if args.isolate:  # the rows' processes share the GPU with this one: none may take it all
    os.environ["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
  import jax
  import zinfjax  # noqa: F401  (registers the handlers)
  device = jax.devices()[0]
  root = args.nvme_path or tempfile.mkdtemp(prefix="zinfjax-bench-gpu-")
  shm = tempfile.mkdtemp(prefix="zinfjax-bench-shm-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
  nbytes = args.copy_mib << 20
  print(f"device: {device.device_kind} ({device.platform}), jax {jax.__version__}", flush=True)
  result = {"device": device.device_kind, "platform": device.platform, "model": model_name(args)}
  path = os.path.join(args.out, "bench_gpu.json")
  sections = set(args.sections.split(","))

  def saved() -> None:
    with open(path, "w") as f:
      json.dump(result, f, indent=1)

  def part(name: str, fn) -> None:
    """Runs one part; a failure is recorded (with its traceback) and the next part runs."""
    if name.split(".")[0] not in sections and name not in sections:  # a section, or one part
      return
    t0 = time.perf_counter()
    try:
      result[name.split(".")[-1]] = fn()
    except Exception:  # noqa: BLE001  (the whole table is worth more than one part)
      result.setdefault("errors", {})[name] = traceback.format_exc()
      print(f"{name}: FAILED\n{traceback.format_exc()}", flush=True)
    print(f"[{name}: {time.perf_counter() - t0:.0f} s] {str(result.get(name.split('.')[-1], ''))[:300]}",
          flush=True)
    saved()  # after every part: a run cut short keeps what it measured

  part("copies.ceiling", lambda: ceiling_copy(nbytes) if device.platform == "gpu"
       else {"tool": "n/a (no GPU)"})
  part("copies.memory_kinds", lambda: memory_kind_copies(jax, nbytes))
  part("copies.swap", lambda: swap_copies(jax, nbytes, shm))
  part("copies.numpy", lambda: numpy_copies(jax, nbytes))
  result["matmul_n"] = 256 if args.tiny else 8192
  part("matmul.matmul_tflops", lambda: matmul_rate(jax, result["matmul_n"]))
  part("disk.disk", lambda: disk(root, 64 << 20 if args.tiny else 4 << 30))
  part("host.host", lambda: host_alone(args))

  result["steps"] = []
  steps = isolated_steps if args.isolate else functools.partial(gpt_steps, jax)
  part("steps.steps", lambda: ratios(steps(args, result.get("matmul_tflops"), root,
                                           result["steps"], saved), result.get("host"),
                                     result.get("memory_kinds"), bench_config(args).num_params))
  print(table(result))
  shutil.rmtree(shm, ignore_errors=True)
  if not args.nvme_path:
    shutil.rmtree(root, ignore_errors=True)
  return 1 if result.get("errors") else 0


if __name__ == "__main__":
  sys.exit(main())
