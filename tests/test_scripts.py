"""The command-line scripts run end to end."""

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from helpers import REPO, SCRIPTS, script_env, run_script as run

ENV = script_env()  # the scripts pick devices


def test_train_gpt_writes_metrics_and_learns(tmp_path):
  metrics = tmp_path / "metrics.jsonl"
  stdout = run([os.path.join(SCRIPTS, "train_gpt.py"), "--preset", "tiny", "--zero-stage", "3",
                "--steps", "25", "--batch-size", "8", "--seq-len", "32", "--devices", "4",
                "--log-every", "5", "--metrics-jsonl", str(metrics)])
  assert "ZeRO-3 bf16 on 4 cpu devices" in stdout
  assert "tok/s" in stdout and "ms/step" in stdout and "pinned_host" in stdout
  records = [json.loads(line) for line in metrics.read_text().splitlines()]
  assert [r["step"] for r in records] == list(range(1, 26))
  for r in records:
    assert {"step", "loss", "step_time_s", "tokens_per_s"} <= set(r)
    assert r["tokens_per_s"] > 0 and r["step_time_s"] > 0
  # the least RAM free during each step (what is free at its end, where no sample came)
  ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
  assert all(0 < r["least_ram_available"] < ram for r in records)
  assert "RAM free at least" in stdout
  assert records[-1]["loss"] < records[0]["loss"] - 0.5
  # the model's standard FLOP count per device and second; no MFU without a known peak (a CPU)
  from zinfjax.models import get_config
  flops = get_config("tiny", seq_len=32).train_flops(8 * 32) / 4
  for r in records:
    assert r["tflops_per_device"] == pytest.approx(flops / r["step_time_s"] / 1e12, rel=1e-9)
    assert "mfu" not in r
  assert "TFLOP/s per device" in stdout and "MFU" not in stdout


def test_host_memory_watch_tells_when_ram_runs_low():
  """The watch train_gpt.py starts before init: each step's record gets the least RAM
  available since the one before, and a line says when it falls under 5% of the RAM (at most
  every `quiet_s`), so a run the kernel kills for memory leaves word of how it got there."""
  import time
  from zinfjax import progress
  total, gib = 100 << 30, 1 << 30
  seen = iter([40 * gib, 30 * gib, 4 * gib, 3 * gib, 20 * gib] + [50 * gib] * 10**6)
  said = []
  # its own reader, not a patched progress.host_memory: any other watch alive in the process
  # would draw from the same readings
  watch = progress.HostMemoryWatch(said.append, every_s=0.001, quiet_s=60,
                                   read=lambda: (next(seen), total))
  deadline, took = time.monotonic() + 10, None
  while time.monotonic() < deadline:
    least = watch.least
    if took is None and least is not None and least <= 3 * gib:
      took = watch.take()  # the least since the last take, then afresh
    elif took is not None and least is not None and least >= 20 * gib:
      break
    time.sleep(0.001)
  assert took == 3 * gib and least >= 20 * gib, (took, least)
  watch.close()
  assert not watch.thread.is_alive()
  watch.take()
  assert watch.take() == 50 * gib  # no sample since the last take: what is free now
  assert len(said) == 1 and said[0].startswith("host memory low: 4.0 GiB available of 100.0 GiB")
  assert "resident" in said[0]


def test_train_gpt_rejects_uneven_batch():
  out = subprocess.run([sys.executable, os.path.join(SCRIPTS, "train_gpt.py"), "--devices", "4",
                        "--batch-size", "6", "--steps", "1"], cwd=REPO, capture_output=True,
                       text=True, timeout=300)
  assert out.returncode != 0 and "not divisible by 4 devices" in out.stderr


def test_bench_host_ram_puts_device_params_back_as_made(tmp_path):
  """bench_host_ram.py: the rows train alike (one loss) and the new params put back as they
  are made keep less on the host than those put back after the update."""
  out = run([os.path.join(SCRIPTS, "bench_host_ram.py"), "--layers", "4", "--steps", "1",
             "--hidden", "128", "--optimizer", "nvme", "--nvme-path", str(tmp_path)])
  rows = [line.split("|")[1:-1] for line in out.splitlines() if line.startswith("| 4 |")]
  (after, fresh, made) = [[c.strip() for c in r] for r in rows]
  assert (after[2], fresh[2], made[2]) == ("go back after the update", "go back as made, fresh",
                                           "go back as made")
  assert after[-1] == fresh[-1] == made[-1]
  assert float(made[3].split()[0]) < 0.5 * float(after[3].split()[0])
  # every update one step late: new buffers each step, or the last step's, train alike
  out = run([os.path.join(SCRIPTS, "bench_host_ram.py"), "--layers", "4", "--steps", "1",
             "--hidden", "128", "--delay-update", "all", "--part-elements", "65536",
             "--threads", "1,2"])
  rows = [[c.strip() for c in line.split("|")[1:-1]] for line in out.splitlines()
          if line.startswith("| 4 |")]
  assert [r[2] for r in rows] == ["fresh each step", "reused"] and rows[0][-1] == rows[1][-1]
  assert all(float(r[-2]) > 0 for r in rows), rows
  # the kernel alone over one part, its new params into a new array or the same one again
  calls = [line.split("|")[1:-1] for line in out.split("one kernel call over 65,536")[1]
           .splitlines() if line.startswith(("| 1 |", "| 2 |"))]
  assert len(calls) == 2 and all(float(x) > 0 for c in calls for x in c[1:3]), out


def test_bench_adam_times_the_host_pipeline_in_ram():
  """Table 3: a step over the RAM store in place, all or nothing, and through the buffers;
  table 4: one kernel call per size and thread count; table 5: each per part."""
  data = json.loads(run([os.path.join(SCRIPTS, "bench_adam.py"), "--params", "1e5", "--repeats",
                         "1", "--host-params", "3e5", "--sub-group", "1e5", "--call-sizes",
                         "1e5,3e5", "--call-threads", "1,3", "--small-parts", "6",
                         "--part-size", "2048", "--json"]))
  parts = data["parts"]
  assert len(parts) == 3 and all(t > 0 for t in parts.values()), parts
  rows = data["host"]
  assert len(rows) == 3 and "in place" in rows and all(t > 0 for t in rows.values())
  assert any(name.startswith("all or nothing through the buffers") for name in rows)
  calls = data["calls"]
  assert set(calls) == {"100000", "300000"} and all(
      set(by) == {"1", "3"} and all(t > 0 for t in by.values()) for by in calls.values())


def test_bench_ram_store_times_init_phases_against_the_copy_limits():
  """Every phase of init on RAM's store is timed in each row, beside the copy limits."""
  data = json.loads(run([os.path.join(SCRIPTS, "bench_ram_store.py"), "--gib", "0.05",
                         "--shard-mib", "8", "--repeats", "2", "--json"]))
  assert len(data["rows"]) == 2 and all(
      set(r) == {"reserve", "master", "moments"} and all(t > 0 for t in r.values())
      for r in data["rows"])
  assert {"touched x1", "fresh x1"} <= set(data["limits"]) and all(
      v > 0 for v in data["limits"].values())
  assert data["gib"] == 6 * 8 / 1024  # 6 shards of 8 MiB: the whole shards in 0.05 GiB


def test_train_gpt_nvme_keeps_host_memory_within_the_pinned_budget(tmp_path):
  """Params and optimizer on NVMe: peak RSS of a model whose states are over 10x the pinned
  budget exceeds that of a 2-layer model (the runtime's own memory: Python, JAX/XLA, compiled
  programs, activations, which differ by machine) by less than the budget and a fifth of the
  states. The two runs' peaks are usually 70-160 MiB apart on the 2-core VM, but were 300 MiB
  apart once in a few dozen runs (the budget and a tenth of the states, 272 MiB, was the bound
  then); holding the states, 1.5 GB, or even a third of them, would not fit. With
  `--no-atomic-steps` the swap files hold one copy of the states (16 bytes a param), not the
  second copy of params and optimizer that atomic steps reserve (30)."""
  budget_mib = 128

  def train(layers: int) -> tuple[list[dict], int, str]:
    metrics, nvme = tmp_path / f"metrics{layers}.jsonl", tmp_path / f"nvme{layers}"
    stdout = run([os.path.join(SCRIPTS, "train_gpt.py"), "--preset", "tiny", "--layers", str(layers),
                  "--hidden", "512", "--heads", "8", "--seq-len", "64", "--batch-size", "8",
                  "--steps", "3", "--devices", "8", "--offload-param", "nvme", "--offload-optimizer",
                  "nvme", "--nvme-path", str(nvme), "--pinned-budget", str(budget_mib),
                  "--metrics-jsonl", str(metrics), "--no-atomic-steps"])
    swap = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(nvme) for f in fs)
    return [json.loads(line) for line in metrics.read_text().splitlines()], swap, stdout

  records, swap, stdout = train(24)
  params = 12 * 24 * 512 ** 2
  assert 16 * params < swap < 20 * params
  states = 20 * params  # bf16 params + grads, fp32 master, m, v (and the fp32 grad of the paper's count)
  assert states > 10 * (budget_mib << 20)
  assert all(np.isfinite(r["loss"]) for r in records)
  assert records[-1]["nvme_bytes_read"] >= 12 * params  # the optimizer states really streamed
  base, _, _ = train(2)
  peak, runtime = (max(r["peak_rss"] for r in rs) for rs in (records, base))
  assert peak < runtime + (budget_mib << 20) + states // 5, (
      f"peak RSS {peak / 2**30:.2f} GiB at 24 layers, {runtime / 2**30:.2f} GiB at 2\n{stdout}")


def test_train_gpt_takes_per_layer_splits(tmp_path):
  """The CLI takes per-layer splits (and micro-batches), shows where the plan puts the bytes,
  and refuses a bad one."""
  stdout = run([os.path.join(SCRIPTS, "train_gpt.py"), "--preset", "tiny", "--steps", "3",
                "--batch-size", "8", "--seq-len", "32", "--devices", "4", "--log-every", "1",
                "--micro-batches", "2",
                "--offload-param", "device:1,pinned_host", "--offload-optimizer", "pinned_host:1,nvme",
                "--nvme-path", str(tmp_path / "nvme")])
  assert "params+grads device:1,pinned_host, optimizer pinned_host:1,nvme" in stdout
  assert "2 micro-batches of 1 per device, layer by layer" in stdout
  plan = next(line for line in stdout.splitlines() if line.startswith("model states per device"))
  assert all(f"{tier} 0 B" not in plan for tier in ("device", "pinned_host", "nvme")), plan
  out = subprocess.run([sys.executable, os.path.join(SCRIPTS, "train_gpt.py"), "--devices", "4",
                        "--offload-optimizer", "pinned_host:2,pinned_host", "--steps", "1"],
                       cwd=REPO, capture_output=True, text=True, timeout=300)
  assert out.returncode != 0 and "names a tier twice" in out.stderr
  out = subprocess.run([sys.executable, os.path.join(SCRIPTS, "train_gpt.py"), "--devices", "4",
                        "--batch-size", "8", "--micro-batches", "4", "--steps", "1"],
                       cwd=REPO, capture_output=True, text=True, timeout=300)
  assert out.returncode != 0 and "4 devices x 4 micro-batches; use a multiple of 16" in out.stderr


def test_step_rss_tables_a_step_of_a_mixed_plan(tmp_path):
  """step_rss.py trains two steps of a plan split over the device, RAM's store and the drive,
  and tables the plan's count, the program's temporaries and what RSS and numpy's arrays
  did through the second step."""
  out = run([os.path.join(SCRIPTS, "step_rss.py"), "--hidden", "64", "--heads", "2",
             "--layers", "4", "--seq-len", "32", "--offload-param", "device:2,pinned_host",
             "--offload-optimizer", "pinned_host:3,nvme", "--pinned-budget", "64",
             "--nvme-path", str(tmp_path / "nvme")])
  rows = dict(line.strip("| ").split(" | ") for line in out.splitlines()
              if line.startswith("| ") and "MiB" not in line)
  got = {k: float(v) for k, v in rows.items()}
  assert {"plan: device (per device)", "plan: pinned_host (per device)", "plan: nvme (per device)",
          "plan: host arrays (of pinned host)", "program: temporaries"} <= set(got), got
  assert 0 < got["RSS at the step's start"] <= got["RSS at its peak"]
  assert got["plan: host arrays (of pinned host)"] > 0 and got["numpy's arrays at their peak"] > 0
  losses = out.split("loss ")[1].split(";")[0].split(" -> ")
  assert all(np.isfinite(float(x)) for x in losses), out


def test_train_gpt_bad_data_file_is_one_clear_line(tmp_path):
  """A Latin-1 text file stops the CLI before any compute with the file and the problem named,
  not a UnicodeDecodeError traceback."""
  path = tmp_path / "latin1.txt"
  path.write_bytes("na\u00efve caf\u00e9\n".encode("latin-1") * 100)
  done = subprocess.run([sys.executable, os.path.join(SCRIPTS, "train_gpt.py"), "--preset", "tiny",
                         "--steps", "1", "--data", str(path)], capture_output=True, text=True,
                        timeout=300)
  assert done.returncode != 0
  assert f"error: data file {path} is not UTF-8 text" in done.stderr
  assert "Traceback" not in done.stderr


def test_train_gpt_checkpoint_dir_problems_stop_it_before_compute(tmp_path):
  """An unwritable --checkpoint-dir is one error line before init; --resume-step of a step
  that is not there names the steps that are; one that would save a held step again is
  refused before training."""
  blocker = tmp_path / "file"
  blocker.write_text("not a folder")
  args = [sys.executable, os.path.join(SCRIPTS, "train_gpt.py"), "--preset", "tiny", "--steps", "2",
          "--batch-size", "4", "--seq-len", "16", "--save-every", "1"]
  done = subprocess.run(args + ["--checkpoint-dir", str(blocker / "ckpt")], capture_output=True,
                        text=True, timeout=300, env=ENV)
  assert done.returncode != 0
  assert f"error: cannot write to checkpoint directory {blocker / 'ckpt'}" in done.stderr
  assert "init " not in done.stdout and "Traceback" not in done.stderr
  ckpt = tmp_path / "ckpt"
  run(args[1:] + ["--checkpoint-dir", str(ckpt)])
  done = subprocess.run(args + ["--checkpoint-dir", str(ckpt), "--steps", "3", "--resume-step", "7"],
                        capture_output=True, text=True, timeout=300, env=ENV)
  assert done.returncode != 0
  assert "error: no checkpoint for step 7" in done.stderr and "saved steps: [1, 2]" in done.stderr
  # going back to step 1 would save step 2 again: refused (a save never replaces a step, so
  # the new step 2 would be dropped and a later --resume would take the old one)
  back = ["--checkpoint-dir", str(ckpt), "--steps", "3", "--resume-step", "1"]
  done = subprocess.run(args + back, capture_output=True, text=True, timeout=300, env=ENV)
  assert done.returncode != 0 and "Traceback" not in done.stderr
  assert (f"error: {ckpt} already holds step(s) [2], which this run (from step 1 to 3) would "
          "save again") in done.stderr and "(--steps 1)" in done.stderr, done.stderr[-2000:]
  assert sorted(n for n in os.listdir(ckpt) if n.isdigit()) == ["1", "2"]
  shutil.move(str(ckpt / "2"), str(tmp_path / "old_2"))  # the fix it names
  out = run(args[1:] + back)
  assert "resumed from step 1 " in out
  done = subprocess.run(args + ["--checkpoint-dir", str(ckpt), "--steps", "4", "--resume",
                                "--heads", "2"], capture_output=True, text=True, timeout=300, env=ENV)
  assert done.returncode != 0
  assert "trained with another model (num_heads 4 there, 2 here)" in done.stderr, done.stderr[-2000:]
  # a checkpoint folder and no --save-every: the last step is saved
  last = tmp_path / "last"
  run([a for a in args[1:] if a not in ("--save-every", "1")] + ["--checkpoint-dir", str(last)])
  assert [n for n in os.listdir(last) if n.isdigit()] == ["2"], os.listdir(last)


def test_train_gpt_offload_auto_prints_the_plan_and_keeps_to_it(tmp_path):
  stdout = run([os.path.join(SCRIPTS, "train_gpt.py"), "--preset", "tiny", "--layers", "8",
                "--steps", "2", "--batch-size", "8", "--seq-len", "32", "--devices", "4",
                "--log-every", "1", "--offload", "auto", "--budget", "device=100KiB",
                "--budget", "pinned_host=200KiB", "--nvme-path", str(tmp_path / "nvme")])
  # pinned host's budget also holds the new params the NVMe optimizer sends back to its layers
  # (and the device layer's grads it reads)
  assert ("placement (offload='auto'): params+grads device:1,pinned_host:1,nvme, optimizer nvme"
          in stdout)
  assert "of the host pipeline's grads and new params" in stdout
  assert "of  100.00 KiB per device" in stdout and "of  200.00 KiB per device" in stdout
  out = subprocess.run([sys.executable, os.path.join(SCRIPTS, "train_gpt.py"), "--devices", "4",
                        "--offload", "auto", "--budget", "device=1KiB", "--budget",
                        "pinned_host=1KiB", "--steps", "1"], cwd=REPO, capture_output=True,
                       text=True, timeout=300, env=ENV)
  assert out.returncode != 0 and "Give ZeroConfig.nvme_path a folder" in out.stderr, out.stderr
  assert "Traceback" not in out.stderr


def test_train_gpt_refuses_numbers_that_cannot_work():
  for flags, message in ((["--devices", "0"], "--devices 0: give a positive number"),
                         (["--batch-size", "0"], "--batch-size 0: give a positive number"),
                         (["--lr", "nan"], "--lr nan: the learning rate must be a finite number")):
    done = subprocess.run([sys.executable, os.path.join(SCRIPTS, "train_gpt.py"), *flags],
                          capture_output=True, text=True, timeout=120, env=ENV)
    assert done.returncode != 0 and f"error: {message}" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr


def test_train_gpt_engine_errors_and_divergence_are_one_line(tmp_path):
  """A model too big for the NVMe folder's disk is one `error:` line (no traceback) before any
  step; a run that diverges stops at the step where the loss went non-finite."""
  script = os.path.join(SCRIPTS, "train_gpt.py")
  done = subprocess.run([sys.executable, script, "--preset", "tiny", "--layers", "96", "--hidden",
                         "12288", "--heads", "96", "--offload-param", "nvme", "--offload-optimizer",
                         "nvme", "--nvme-path", str(tmp_path / "nvme"), "--steps", "1"],
                        capture_output=True, text=True, timeout=300, env=ENV)
  assert done.returncode != 0
  assert done.stderr.startswith("error: ") and "free space" in done.stderr, done.stderr[-2000:]
  assert "Traceback" not in done.stderr
  done = subprocess.run([sys.executable, script, "--preset", "tiny", "--steps", "30", "--lr", "1e9",
                         "--batch-size", "8", "--seq-len", "16", "--devices", "1"],
                        capture_output=True, text=True, timeout=300, env=ENV)
  assert done.returncode != 0
  assert "training diverged (try a lower --lr than 1000000000.0)" in done.stderr, done.stderr[-2000:]


def test_a_row_in_a_child_of_a_large_process_reports_its_own_peak_rss():
  """bench_gpu.py --isolate runs each row in a child of a process that may have held many GiB
  (its host section): the row's peak RSS is the child's own (VmHWM), not the parent's peak that
  Linux carries over an exec into ru_maxrss."""
  held = np.ones(1 << 27)  # 1 GiB, touched, in this process
  probe = ("import resource; from zinfjax.progress import peak_rss; "
           "print(peak_rss(), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss << 10)")
  done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                        timeout=120, cwd="/")
  own, carried = map(int, done.stdout.split())
  assert carried >= held.nbytes  # the parent's peak, as ru_maxrss tells it
  assert 0 < own < held.nbytes // 2


def test_the_progress_line_shows_tflops_and_mfu_of_a_known_peak(tmp_path):
  """The model FLOPs of a step per device over its time, as TFLOP/s and, given the device's
  peak (a GPU's datasheet, or --peak-tflops), as MFU, on the line and in the metrics file."""
  import io
  from zinfjax.datasheet import bf16_tflops
  from zinfjax.progress import Progress
  out, metrics = io.StringIO(), str(tmp_path / "m.jsonl")
  progress = Progress(1, stream=out, flops_per_device=2.0e14, peak_tflops=bf16_tflops(
      "NVIDIA H100 80GB HBM3"), metrics_jsonl=metrics)
  progress.update(1, {"loss": 1.0, "step_time_s": 0.5, "tokens_per_s": 10.0})
  progress.close()
  assert "| 400 TFLOP/s per device, MFU 40.4% (of 989)\n" in out.getvalue(), out.getvalue()
  record = json.loads(open(metrics).read())
  assert record["tflops_per_device"] == 400.0 and record["mfu"] == pytest.approx(400 / 989)
  kinds = {"NVIDIA H100 PCIe": 756.0, "NVIDIA H200": 989.0, "NVIDIA GH200 480GB": 989.0,
           "NVIDIA A100-SXM4-80GB": 312.0, "NVIDIA L40S": 362.0, "NVIDIA L40": 181.0,
           "NVIDIA L4": 121.0, "cpu": None, "TFRT_CPU_0": None}
  assert {kind: bf16_tflops(kind) for kind in kinds} == kinds


def test_the_progress_line_names_the_drive_only_where_it_moved_bytes():
  """An offloaded optimizer's breakdown: a step in RAM's store moves nothing through the drive,
  so the line leaves out the drive's waits and bytes, which a step on NVMe shows."""
  import io
  from zinfjax.progress import Progress
  out = io.StringIO()
  progress = Progress(2, stream=out)
  step = {"loss": 1.0, "step_time_s": 0.5, "tokens_per_s": 10.0, "fwd_bwd_s": 0.2,
          "optimizer_s": 0.3, "adam_s": 0.1, "nvme_read_wait_s": 0.02, "nvme_write_wait_s": 0.01}
  progress.update(1, dict(step, nvme_bytes_read=0, nvme_bytes_written=0))
  progress.update(2, dict(step, nvme_bytes_read=1 << 20, nvme_bytes_written=3 << 20))
  ram, drive = out.getvalue().splitlines()[:2]
  assert "optimizer 0.30 s (Adam 0.10 s)" in ram and "NVMe" not in ram, ram
  assert ("(Adam 0.10 s, NVMe read wait 0.02 s, write wait 0.01 s, 1.0 MiB read, 3.0 MiB "
          "written)") in drive, drive


def test_bench_export_holds_a_layer_not_the_stack(tmp_path):
  """bench_export.py: the export a layer at a time (and consolidate's file written in slabs) peaks
  below the largest leaf; the same export reading whole leaves holds at least that leaf."""
  # a leaf of 16 MiB: above the 8 MiB the chunk reads stage in, which slabs of 4 MiB share
  out = run([os.path.join(SCRIPTS, "bench_export.py"), "--layers", "4", "--hidden", "512",
             "--folder", str(tmp_path), "--slab-mib", "4"])
  rows = {line[:26].strip(): line[26:].split() for line in out.splitlines()
          if line.startswith(("a layer", "whole leaves", "consolidate"))}
  layered, whole = float(rows["a layer at a time"][2]), float(rows["whole leaves (before)"][2])
  assert layered < 1.0 <= whole, out
  slabs, whole = float(rows["consolidate, slabs"][2]), float(rows["consolidate (before)"][2])
  assert slabs < 1.0 <= whole, out
