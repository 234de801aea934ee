"""The command-line scripts run end to end."""

import json
import os
import re
import shutil
import subprocess
import sys
import tarfile

import numpy as np
import pytest

from helpers import REPO, load_script, script_env

SCRIPTS = os.path.join(REPO, "scripts")


ENV = script_env()  # the scripts pick devices


def run(args, timeout=600):
  out = subprocess.run([sys.executable, *args], cwd=REPO, capture_output=True, text=True,
                       timeout=timeout, env=ENV)
  assert out.returncode == 0, out.stderr[-3000:]
  return out.stdout


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


def test_estimate_memory_json():
  data = json.loads(run([os.path.join(SCRIPTS, "estimate_memory.py"), "--layers", "50", "--hidden",
                         "4096", "--heads", "16", "--devices", "16", "--offload-optimizer", "nvme",
                         "--json"]))
  n = 12 * 50 * 4096 ** 2
  assert data["num_params"] == n
  assert data["model_states"] == 20 * n
  assert data["per_device"] == {"device": 4 * n // 16, "pinned_host": 0, "nvme": 16 * n // 16}
  assert data["per_node"]["nvme"] == 16 * n
  assert data["model_state_working_memory"] == 16 * 4096 ** 2
  assert data["activation_checkpoints"] == 2 * 1024 * 4096 * 50


def test_estimate_memory_of_a_hugging_face_checkpoint():
  """--init-from takes the shape of a checkpoint folder's config.json and counts its params
  exactly (the tensors its safetensors hold); --plan places that model; --lora-rank counts
  the adapters that train and the frozen rest; a shape given besides, or a sequence past the
  model's, is refused."""
  from zinfjax.weights.safetensors import Checkpoint
  folder = os.path.join(REPO, "tests", "data", "hf", "llama3")
  data = json.loads(run([os.path.join(SCRIPTS, "estimate_memory.py"), "--init-from", folder,
                         "--devices", "2", "--offload-optimizer", "nvme", "--json"]))
  ckpt = Checkpoint(folder)
  n = sum(int(np.prod(ckpt.tensor(k).shape)) for k in ckpt)
  assert data["num_params"] == n and data["inputs"]["seq_len"] == 128  # its own, under 1024
  assert data["per_device"] == {"device": 4 * n // 2, "pinned_host": 0, "nvme": 16 * n // 2}
  out = run([os.path.join(SCRIPTS, "estimate_memory.py"), "--init-from", folder, "--seq-len",
             "64", "--plan", "--budget", "device=100KiB"])
  assert out.startswith(f"the model of {folder}: 2 layers x 32 hidden") and "placement" in out
  # LoRA of rank 2 on every projection (r x (in + out) each): the adapters train, the rest
  # keep their bf16 params alone
  hf = json.loads(open(os.path.join(folder, "config.json"), encoding="utf-8").read())
  d, f = hf["hidden_size"], hf["intermediate_size"]
  k = d // hf["num_attention_heads"]
  q, kv = hf["num_attention_heads"] * k, hf["num_key_value_heads"] * k
  t = 2 * hf["num_hidden_layers"] * (2 * (d + q) + 2 * (d + kv) + 2 * (d + f) + (f + d))
  lora = json.loads(run([os.path.join(SCRIPTS, "estimate_memory.py"), "--init-from", folder,
                         "--devices", "2", "--offload-optimizer", "nvme", "--json",
                         "--lora-rank", "2"]))
  assert lora["num_params"] == n + t and lora["trainable_params"] == t
  assert lora["per_device"] == {"device": n + 2 * t, "pinned_host": 0, "nvme": 8 * t}
  assert lora["per_frozen_param"] == {"device": 2, "pinned_host": 0, "nvme": 0}
  out = run([os.path.join(SCRIPTS, "estimate_memory.py"), "--init-from", folder, "--plan",
             "--lora-rank", "2"])
  assert f"{t / 1e6:,.2f}M of LoRA adapters of rank 2" in out and "placement" in out
  for extra, problem in [(["--layers", "4"], "--layers with --init-from"),
                         (["--seq-len", "256"], "--seq-len 256 is longer than the model's 128"),
                         (["--lora-rank", "-1"], "--lora-rank -1: give a positive rank")]:
    done = subprocess.run([sys.executable, os.path.join(SCRIPTS, "estimate_memory.py"),
                           "--init-from", folder, *extra], capture_output=True, text=True)
    assert done.returncode == 2 and problem in done.stderr, done.stderr


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


def test_estimate_memory_table_for_a_preset():
  stdout = run([os.path.join(SCRIPTS, "estimate_memory.py"), "--preset", "1t", "--devices", "16"])
  assert "1,006.63B params" in stdout and "model-state working memory" in stdout


def test_estimate_memory_counts_the_host_pipelines_ram_store():
  """--host-optimizer pipeline: pinned-host params in the RAM store, twice when the drive's
  steps are all or nothing (the optimizer on NVMe); once without."""
  args = [os.path.join(SCRIPTS, "estimate_memory.py"), "--preset", "tiny", "--offload-param",
          "pinned_host", "--offload-optimizer", "nvme", "--host-optimizer", "pipeline"]
  stdout = run(args)
  assert ("per parameter (bytes, before the split over devices): pinned_host 6, nvme 24; "
          "params and optimizer states in the RAM store and on NVMe twice") in stdout
  assert "pinned_host 4, nvme 12\n" in run(args + ["--no-atomic-nvme"])


def test_estimate_memory_plan_for_budgets(tmp_path):
  """--plan: the placement offload='auto' picks for the budgets (the 2.5B model, abstractly:
  nothing allocated), its bytes per tier and the step time it allows."""
  stdout = run([os.path.join(SCRIPTS, "estimate_memory.py"), "--preset", "2.5b", "--plan",
                "--budget", "device=20GiB", "--budget", "pinned_host=10GiB", "--budget",
                "nvme=100GiB", "--nvme-path", str(tmp_path / "nvme"), "--batch-per-device", "16"])
  # the NVMe optimizer's buffers (3 sets of one layer's largest shard) are raised to what it
  # needs, and the host budget pays for them
  assert ("placement (offload='auto'): params+grads device, optimizer device:9,pinned_host:9,nvme, "
          "pinned buffers 1.56 GiB per process") in stdout
  # and for the new params on their way back to the device (two layers of them) and the grads
  # on their way to the host pipeline (a layer of the stack and the leaf being read)
  assert ("pinned_host    8.40 GiB of    8.69 GiB per device (97%), with 500.19 MiB of the host "
          "pipeline's grads and new params") in stdout
  assert "step time it allows:" in stdout and "nvme bound" in stdout
  assert not (tmp_path / "nvme").exists()


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


def test_gpu_check_dry_run_runs_every_stage_it_can_here(tmp_path):
  """scripts/gpu_check.sh --dry-run on a machine without a GPU: the GPU tests are collected and
  skipped with their reason, the GPU, checkpoint, largest-model and peer benchmarks run end to
  end at tiny sizes, and a GPU stage run for real fails loudly, naming the stage."""
  out = tmp_path / "check"
  done = subprocess.run(["bash", os.path.join(SCRIPTS, "gpu_check.sh"), str(out), "--dry-run"],
                        capture_output=True, text=True, timeout=900, cwd=REPO)
  assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
  progress = (out / "progress.txt").read_text()
  assert "all stages passed" in progress
  assert "needs a CUDA GPU" in (out / "gpu_tests.log").read_text()
  result = json.loads((out / "bench_gpu.json").read_text())
  assert {r["placement"] for r in result["steps"]} >= {"all on device (compute alone)",
                                                      "params + optimizer on nvme"}
  assert all(r["step_s"] > 0 and np.isfinite(r["loss"]) for r in result["steps"])
  assert "| tokens/step | placement |" in (out / "bench_gpu.log").read_text()
  ckpt = (out / "bench_checkpoint.log").read_text()
  assert "| device | " in ckpt and "| peer: orbax StandardCheckpointer (device) | " in ckpt
  largest_runs_are_the_largest_that_fit(json.loads((out / "largest" / "largest_gpt.json").read_text()))
  # numpy's crossings to and from the device, in the bench and before the largest run
  for folder in (out, out / "copies"):
    rates = json.loads((folder / "bench_gpu.json").read_text())["numpy"]
    assert set(rates) == {"d2h_asarray", "d2h_started", "d2h_via_pinned", "h2d_device_put",
                          "h2d_via_pinned", "duplex"} and all(v > 0 for v in rates.values()), rates
  # the peer stage: zinfjax's side, one process per placement (DeepSpeed's where it is installed)
  for key in ("device", "pinned", "pipeline-under"):
    rows = json.loads((out / f"peer_ours_{key}" / "bench_gpu.json").read_text())["steps"]
    assert rows and all(r["step_s"] > 0 and r["peak_rss"] > 0 for r in rows), rows
  # the copy-stream stage: the same rows with the swap copies on XLA's stream and on their own
  for mode in ("0", "1"):
    rows = json.loads((out / f"copy_stream_{mode}" / "bench_gpu.json").read_text())["steps"]
    assert rows and all(r["step_s"] > 0 and r["copy_stream"] == (mode == "1") for r in rows), rows
  if (out / "peer_deepspeed.json").exists():
    assert "| zinfjax / DeepSpeed |" in (out / "peer_table.txt").read_text()
  # the speed stage: the rows alone, each with the loss of the same batches as all-device,
  # its phases, and the host pipeline's rows against the host's side alone
  speed = json.loads((out / "speed" / "bench_gpu.json").read_text())
  rows = speed["steps"]
  assert {r["placement"] for r in rows} == {
    "all on device (compute alone)",
    "params + optimizer on pinned_host, host pipeline under backward",
    "params + optimizer on pinned_host, host pipeline under backward, delayed tail",
    "params + optimizer on pinned_host, host pipeline beside the step, every update one step late",
    "params + optimizer on pinned_host, host pipeline beside the step, every update one step "
    "late, bf16 moments"}
  assert speed["host"]["pipeline_s"] > 0 and speed["host"]["adam_s"] > 0
  assert speed["host"]["call_ms_by_threads"] and all(
      ms > 0 for ms in speed["host"]["call_ms_by_threads"].values())
  for r in rows:
    base = next(b for b in rows if b["tokens"] == r["tokens"] and b["placement"].startswith("all"))
    # a row whose updates land one step late trains on other params from the second step on
    late = 1e-2 if "one step late" in r["placement"] else 1e-3
    assert abs(r["loss"] - base["loss"]) < late * base["loss"], (r, base)
    assert "phases" in r
    if "host pipeline" in r["placement"]:
      alone = speed["host"]["pipeline_bf16_s" if "bf16 moments" in r["placement"] else "pipeline_s"]
      assert r["host_alone_s"] == alone and r["vs_bound"] > 0
      assert r["phases"]["optimizer_s"] > 0
      # the kernel alone over the parts the row's pipeline updates, on the store and on copies
      k = r["kernel_pass"]
      assert k["parts"] > 0 and k["sample_params"] > 0, k
      assert k["views_s"] > 0 and k["sample_views_s"] > 0 and k["sample_copies_s"] > 0, k
  assert "tests collected" in (out / "cpu_confirm.log").read_text()
  failed = subprocess.run(["bash", os.path.join(SCRIPTS, "gpu_check.sh"), str(tmp_path / "real"),
                           "gpu-tests"], capture_output=True, text=True, timeout=300, cwd=REPO)
  assert failed.returncode != 0
  assert 'FAILED in stage "gpu-tests"' in failed.stdout


def test_gpu_check_keeps_to_its_deadline_and_packs_its_logs(tmp_path):
  """gpu_check.sh for a short device budget: a misspelt stage stops it before anything runs; with
  KEEP_GOING=1 a failed stage is reported and the next one runs; PACK=1 leaves a few files and
  the rest in logs.tgz; a stage the deadline leaves too little time is not started (exit 3)."""
  check = lambda out, stages, **env: subprocess.run(
    ["bash", os.path.join(SCRIPTS, "gpu_check.sh"), str(tmp_path / out), stages],
    capture_output=True, text=True, timeout=300, cwd=REPO, env={**os.environ, **env})
  typo = check("typo", "env,gpu-test")
  assert typo.returncode == 2 and 'unknown stage "gpu-test"' in typo.stderr
  assert not (tmp_path / "typo" / "progress.txt").exists()
  # a real gpu-tests stage fails on a machine without a GPU; env still runs after it
  done = check("going", "gpu-tests,env", KEEP_GOING="1", PACK="1")
  assert done.returncode == 1, done.stdout[-2000:] + done.stderr[-2000:]
  progress = (tmp_path / "going" / "progress.txt").read_text()
  assert 'FAILED in stage "gpu-tests" (exit 1' in progress and "env: " in progress
  assert "summary: gpu-tests FAILED in" in progress and "env passed in" in progress
  # the stage stopped before pytest (jax sees no GPU), so it left no gpu_tests.log
  assert sorted(p.name for p in (tmp_path / "going").iterdir()) == ["logs.tgz", "progress.txt"]
  with tarfile.open(tmp_path / "going" / "logs.tgz") as tar:
    assert {"./env.txt", "./progress.txt"} <= set(tar.getnames())
  late = check("late", "env,gpu-tests", DEADLINE="20")
  assert late.returncode == 3
  progress = (tmp_path / "late" / "progress.txt").read_text()
  assert "not started before the deadline: env gpu-tests" in progress
  assert not (tmp_path / "late" / "env.txt").exists()


def test_gpu_check_second_keeps_the_peers_time_from_the_largest_run(tmp_path):
  """`gpu_check.sh OUT second`, one call for the peer / largest-model issue: env, build,
  largest, peer under one deadline; the largest stage ends by LARGEST_S (here too soon for any
  run: it fails, saying so) and the peer stage still runs after it, zinfjax's side at device
  and at cpu with the host pipeline alone."""
  out = tmp_path / "second"
  # the default 13.2B model does not place in a dry run's rooms; DeepSpeed is not installed here
  env = {**os.environ, "LARGEST_S": "40", "LARGEST_ARGS": "", "PEER_SIDES": "ours"}
  done = subprocess.run(["bash", os.path.join(SCRIPTS, "gpu_check.sh"), str(out), "second",
                         "--dry-run"], capture_output=True, text=True, timeout=600, cwd=REPO,
                        env=env)
  assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-3000:]
  assert sorted(p.name for p in out.iterdir()) == ["logs.tgz", "progress.txt"]  # PACK=1
  progress = (out / "progress.txt").read_text()
  assert "stages env,build,largest,peer (dry run), deadline 560s, keep going" in progress
  took = re.search(r"largest FAILED in (\d+)s", progress)
  assert took and int(took.group(1)) <= 45, progress
  assert re.search(r"peer passed in \d+s", progress) and "build: not run in a dry run" in progress
  with tarfile.open(out / "logs.tgz") as tar:  # the peer at device and cpu: the host pipeline
    names = tar.getnames()
    ours = {"./peer_ours_device/bench_gpu.json", "./peer_ours_pipeline-under/bench_gpu.json"}
    assert ours <= set(names), names
    assert not any(n.startswith("./peer_ours_pinned") for n in names), names
    largest = tar.extractfile("./largest_gpt.log").read().decode()
  assert "s left of --deadline: no more tries" in largest, largest


def test_bench_gpu_runs_each_row_in_a_process_of_its_own(tmp_path):
  """`bench_gpu.py --isolate S`: a step row whose process outlives S seconds (a hang) is recorded
  as failed with the reason, and the rows after it still run; the table shows every row."""
  out = subprocess.run([sys.executable, os.path.join(SCRIPTS, "bench_gpu.py"), "--out", str(tmp_path),
                        "--tiny", "--sections", "steps", "--placements",
                        "device,pipeline-under,offload", "--tokens", "64", "--isolate", "1"],
                       capture_output=True, text=True, timeout=300, cwd=REPO)
  assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
  rows = json.loads((tmp_path / "bench_gpu.json").read_text())["steps"]
  assert [(r["tokens"], r["placement"]) for r in rows] == [
    (64, "all on device (compute alone)"),
    (64, "params + optimizer on pinned_host, host pipeline under backward"),
    (64, "params on the device, optimizer on pinned_host, host pipeline")]
  assert all(r["error"].startswith("stopped after 1 s") for r in rows), rows
  assert "| 64 | all on device (compute alone) | failed: stopped after 1 s" in out.stdout


def test_bench_gpu_bounds_each_host_pipeline_row_by_the_host_step_of_its_moments():
  """`ratios`: a host-pipeline row is bounded by the host's step alone with its own moments'
  dtype (fp32, or bf16 where timed); a bf16 row gets no bound from the fp32 timing."""
  mod = load_script("bench_gpu")
  name = {key: label for key, *_, label in mod.PLACEMENTS}
  times = {"device": 1.0, "pipeline-delayed-all": 3.0, "pipeline-delayed-all-bf16": 2.5}
  rows = lambda: [{"tokens": 64, "placement": name[k], "step_s": s} for k, s in times.items()]
  host = {"pipeline_s": 2.0, "pipeline_bf16_s": 1.5}
  _, fp32, bf16 = mod.ratios(rows(), host)
  assert (fp32["host_alone_s"], fp32["vs_bound"]) == (2.0, 1.5)
  assert (bf16["host_alone_s"], bf16["vs_bound"]) == (1.5, 2.5 / 1.5)
  _, fp32, bf16 = mod.ratios(rows(), {"pipeline_s": 2.0})
  assert fp32["host_alone_s"] == 2.0 and "host_alone_s" not in bf16 and "vs_bound" not in bf16


def largest_runs_are_the_largest_that_fit(result: dict) -> None:
  """largest_gpt.py's runs: one per placement, each trained with falling loss, at the most
  layers whose states fit every tier's room (one more does not)."""
  import types
  mod = load_script("largest_gpt")
  args, room = types.SimpleNamespace(**result["args"]), result["room"]
  fits = lambda n, tier: all(b <= args.fill * room[t] for t, b in mod.need(n, tier, args).items() if b)
  assert [r["tier"] for r in result["runs"]] == ["device", "pinned_host", "nvme"]
  for run in result["runs"]:
    losses = [r["loss"] for r in run["records"]]
    assert run["returncode"] == 0 and len(losses) == args.steps and losses[-1] < losses[0], run
    assert fits(run["layers"], run["tier"]) and not fits(run["layers"] + 1, run["tier"]), run["layers"]
  # the nvme run keeps its states on the drive: more layers than the host-memory placements
  assert result["runs"][2]["layers"] > result["runs"][1]["layers"] > result["runs"][0]["layers"] > 1


@pytest.mark.parametrize("host_optimizer", ["xla", "pipeline"])
def test_largest_gpt_mixed_fills_every_tier(host_optimizer, tmp_path):
  """largest_gpt.py's mixed placement: `offload="auto"` splits the layers over HBM, RAM and the
  drive; the search keeps the most layers that place (one more does not), that run trains with
  falling loss and holds on each tier what the plan said (on the drive, its states; in memory,
  the params without the grads the plan also counts, or under the host pipeline, whose RAM
  store holds grads too, exactly the plan's count)."""
  import types
  out = tmp_path / "largest"
  run([os.path.join(SCRIPTS, "largest_gpt.py"), "--out", str(out), "--placements", "mixed",
       "--hidden", "128", "--heads", "4", "--seq-len", "64", "--batch-size", "4", "--devices", "2",
       "--hbm-gib", "0.005", "--ram-gib", "0.008", "--disk-gib", "0.02", "--pinned-budget", "64",
       "--steps", "4", "--host-optimizer", host_optimizer])  # the default lr: falls at every step
  result = json.loads((out / "largest_gpt.json").read_text())
  (mixed,) = result["runs"]
  losses = [r["loss"] for r in mixed["records"]]
  assert mixed["returncode"] == 0 and losses[-1] < losses[0], mixed["tail"]
  splits = mixed["placement"]["offload_param"] + "," + mixed["placement"]["offload_optimizer"]
  assert all(tier in splits for tier in ("device", "pinned_host", "nvme")), splits
  held, planned = mixed["records"][-1]["tiers"], dict(mixed["need"])  # with the grads too
  arrays = mixed["placement"]["host_arrays"]  # and the new params on their way back
  planned["pinned_host"] -= arrays
  assert abs(held["nvme"] - planned["nvme"]) <= 0.01 * planned["nvme"], (held, planned)
  assert planned["device"] / 2 <= held["device"] <= planned["device"], (held, planned)
  if host_optimizer == "pipeline":
    assert arrays > 0 and held["pinned_host"] == planned["pinned_host"], (held, planned)
  else:
    assert planned["pinned_host"] / 2 <= held["pinned_host"] <= planned["pinned_host"], (held, planned)
  mod = load_script("largest_gpt")
  args = types.SimpleNamespace(**result["args"])
  assert mod.search_mixed(result["room"], args, str(tmp_path / "nvme"), mixed["layers"] + 1)[1] is None


def test_largest_gpt_sizes_for_the_host_optimizer_and_steps_below_overshoot(tmp_path):
  """largest_gpt.py's room in RAM: under XLA's host update on a GPU, what its copies leave
  (`XLA_HOST_PEAK`), else all of it; its default lr keeps lr x hidden x layers at 0.02 (the
  first AdamW step overshot from 0.12 up); a run counts only when its loss fell at every step."""
  import types
  mod = load_script("largest_gpt")
  gib = 1 << 30
  args = lambda host: types.SimpleNamespace(hbm_gib=80.0, ram_gib=115.0, disk_gib=60.0,
                                           devices=1, host_optimizer=host)
  assert mod.rooms(args("xla"), str(tmp_path), None, "gpu")["pinned_host"] == int(115 * gib / 2.3)
  assert mod.rooms(args("pipeline"), str(tmp_path), None, "gpu")["pinned_host"] == 115 * gib
  assert mod.rooms(args("xla"), str(tmp_path), None, "cpu")["pinned_host"] == 115 * gib
  assert mod.default_lr(5120, 55) * 5120 * 55 == pytest.approx(0.02)
  loss = lambda *xs: [{"loss": x} for x in xs]
  assert mod.loss_falls(loss(4.2, 3.9, 3.7))
  assert not mod.loss_falls(loss(4.2, 5.9, 3.9)) and not mod.loss_falls(loss(4.2))
  # every update one step late: the second step may run the first's params unchanged
  assert not mod.loss_falls(loss(4.2, 4.2, 3.9)) and mod.loss_falls(loss(4.2, 4.2, 3.9), True)
  assert not mod.loss_falls(loss(4.2, 3.9, 4.0), True) and not mod.loss_falls(loss(4.2, 3.9), True)


def test_largest_gpt_counts_the_delayed_update_in_its_plans(tmp_path):
  """`--delay-update all`: the held grads and new params count in RAM's need, in a tier's own
  sizing and in the mixed plan (the same rooms place more in RAM, or less), and a model whose
  optimizer the plan keeps on the device still places (nothing to delay)."""
  import types
  mod = load_script("largest_gpt")
  gib = 1 << 30
  args = lambda delay: types.SimpleNamespace(
      hidden=128, heads=4, seq_len=64, batch_size=8, devices=8, bf16_moments=True, fill=0.85,
      host_optimizer="pipeline", delay_update=delay, pinned_budget=64)
  ram = {d: mod.need(4, "pinned_host", args(d))["pinned_host"] for d in ("none", "all")}
  assert ram["all"] > ram["none"], ram
  assert mod.need(4, "device", args("all")) == mod.need(4, "device", args("none"))
  # the plan on this process's 8 devices: room for the params, not for Adam's states
  room = {"device": int(0.0012 * gib), "pinned_host": gib, "nvme": gib}
  plans = {d: mod.mixed_plan(4, room, args(d), str(tmp_path)) for d in ("none", "all")}
  assert all((p["offload_param"], p["offload_optimizer"]) == ("device", "pinned_host")
             for p in plans.values()), plans
  assert plans["all"]["need"]["pinned_host"] > plans["none"]["need"]["pinned_host"], plans
  roomy = dict(room, device=gib)
  assert mod.mixed_plan(4, roomy, args("all"), str(tmp_path))["offload_optimizer"] == "device"


def test_largest_gpt_tries_a_run_killed_for_memory_again_with_more_ram_kept_back(tmp_path,
                                                                                 monkeypatch):
  """A mixed run the host kills for memory (SIGKILL: the two 13.2B runs on the H100 ended so)
  is tried again at the same layers with `--oom-reserve-gib` more RAM kept back (RAM measured
  again: the plan puts more on the drive); where those layers no longer place, the most that
  do; another failure shrinks them; under `--deadline` no try starts with under a minute left
  and a run's timeout is cut to what is left."""
  mod = load_script("largest_gpt")
  gib = 1 << 30
  monkeypatch.setattr(mod, "devices_here", lambda devices: ("gpu", 1, 80 * gib))
  searched, trained, codes = [], [], []

  def search(room, args, folder, layers=None):
    searched.append((dict(room), layers))
    fits = layers is None or room["pinned_host"] >= enough
    n = layers if layers is not None else 30
    return n, ({"need": {"device": gib, "pinned_host": 2 * gib, "nvme": 0}, "budgets": {},
                "offload_param": "device:1,pinned_host", "offload_optimizer": "nvme",
                "host_arrays": 0} if fits else None)

  def train(tier, layers, args, folder, budgets=None, timeout=None):
    trained.append((layers, timeout))
    code = codes.pop(0)
    records = [] if code else [{"loss": 4.0, "step_time_s": 1.0, "tokens_per_s": 8.0,
                                "peak_rss": gib, "tiers": {"nvme": 0}},
                               {"loss": 3.5, "step_time_s": 1.0, "tokens_per_s": 8.0,
                                "peak_rss": gib, "tiers": {"nvme": 0}}]
    return {"tier": tier, "layers": layers, "lr": 1e-3, "returncode": code, "wall_s": 1.0,
            "records": records, "tail": "Killed" if code else ""}

  monkeypatch.setattr(mod, "search_mixed", search)
  monkeypatch.setattr(mod, "train", train)
  argv = ["--out", str(tmp_path / "out"), "--placements", "mixed", "--layers", "42",
          "--hbm-gib", "80", "--disk-gib", "60", "--host-reserve-gib", "0",
          "--oom-reserve-gib", "1", "--tries", "3"]
  enough = 0  # killed, then trained at the same layers with 1 GiB less RAM in the room
  codes[:] = [mod.KILLED, 0]
  assert mod.main(argv) == 0
  assert [n for n, _ in trained] == [42, 42]
  (first, _), (second, layers) = searched
  assert layers == 42 and 0.5 * gib < first["pinned_host"] - second["pinned_host"] < 1.5 * gib
  result = json.loads((tmp_path / "out" / "largest_gpt.json").read_text())
  assert [r["host_reserve_gib"] for r in result["runs"]] == [0, 1]
  # killed, and the layers no longer place with less RAM: the most that do (30 here)
  searched.clear(), trained.clear()
  enough, codes[:] = first["pinned_host"] - gib // 2, [mod.KILLED, 0]
  assert mod.main(argv) == 0 and [n for n, _ in trained] == [42, 30]
  # any other failure: --shrink of the layers in the same rooms
  searched.clear(), trained.clear()
  enough, codes[:] = 0, [1, 0]
  assert mod.main(argv) == 0 and [n for n, _ in trained] == [42, int(42 * 0.8)]
  # under --deadline a run's timeout is what is left (less 10 s), and no try starts with under
  # a minute left
  import time
  import types
  now = [0.0]  # a clock each run moves on by 100 s
  monkeypatch.setattr(mod, "time", types.SimpleNamespace(monotonic=lambda: now[0],
                                                         perf_counter=time.perf_counter))
  monkeypatch.setattr(mod, "train", lambda *a, **k: now.__setitem__(0, now[0] + 100) or train(
      *a, **k))
  trained.clear()
  codes[:] = [mod.KILLED, 0]
  assert mod.main(argv + ["--deadline", "150"]) == 1  # killed, and 50 s left: no second try
  assert trained == [(42, 140)]
  now[0], codes[:] = 0.0, [mod.KILLED, 0]
  trained.clear()
  assert mod.main(argv + ["--deadline", "1000"]) == 0 and trained == [(42, 540), (42, 540)]


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
