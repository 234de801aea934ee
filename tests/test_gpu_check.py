"""scripts/gpu_check.sh and bench_gpu.py, run here as far as a machine without a GPU allows."""

import json
import os
import re
import subprocess
import sys
import tarfile

import numpy as np
import pytest

from helpers import REPO, SCRIPTS, load_script


def largest_runs_are_the_largest_that_fit(result: dict) -> None:
  """largest_gpt.py's runs: one per placement, each trained with falling loss, at the most
  layers whose states fit every tier's room (one more does not)."""
  import types
  mod = load_script("largest_gpt")
  args, room = types.SimpleNamespace(**result["args"]), result["room"]
  fits = lambda n, tier: all(b <= args.fill * room[t]
                             for t, b in mod.need(n, tier, args).items() if b)
  assert [r["tier"] for r in result["runs"]] == ["device", "pinned_host", "nvme"]
  for one in result["runs"]:
    losses = [r["loss"] for r in one["records"]]
    assert one["returncode"] == 0 and len(losses) == args.steps and losses[-1] < losses[0], one
    layers = one["layers"]
    assert fits(layers, one["tier"]) and not fits(layers + 1, one["tier"]), layers
  # the nvme run keeps its states on the drive: more layers than the host-memory placements
  assert result["runs"][2]["layers"] > result["runs"][1]["layers"] > result["runs"][0]["layers"] > 1


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
  largest_runs_are_the_largest_that_fit(
      json.loads((out / "largest" / "largest_gpt.json").read_text()))
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
  # the families stage: each model's all-device step, its TFLOP/s by that model's own count
  from zinfjax.models import hf
  for name, test in (("llama3-8b", "llama3"), ("gemma3-1b", "gemma3"), ("gemma2-2b", "gemma2")):
    result = json.loads((out / f"families_{name}" / "bench_gpu.json").read_text())
    config = hf.config_from_hf(hf.read_config(os.path.join(REPO, "tests", "data", "hf", test)))
    flops = config.replace(num_layers=2, layer_types=config.layer_types and
                           config.layer_types[:2]).train_flops(64, 32)
    [row] = result["steps"]
    assert row["tflops"] * row["step_s"] * 1e12 == pytest.approx(flops, rel=1e-9), name
    assert f"tests/data/hf/{test} (2 layers)" in result["model"]
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


def test_bench_gpu_runs_each_row_in_a_process_of_its_own(tmp_path):
  """`bench_gpu.py --isolate S`: a step row whose process outlives S seconds (a hang) is recorded
  as failed with the reason, and the rows after it still run; the table shows every row."""
  out = subprocess.run([sys.executable, os.path.join(SCRIPTS, "bench_gpu.py"), "--out",
                        str(tmp_path), "--tiny", "--sections", "steps", "--placements",
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
