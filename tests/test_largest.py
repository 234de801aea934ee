"""scripts/largest_gpt.py: the largest model each placement trains, found by a search."""

import json
import os

import pytest

from helpers import SCRIPTS, load_script, run_script as run


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
    most = planned["pinned_host"]
    assert most / 2 <= held["pinned_host"] <= most, (held, planned)
  mod = load_script("largest_gpt")
  args = types.SimpleNamespace(**result["args"])
  more = mixed["layers"] + 1
  assert mod.search_mixed(result["room"], args, str(tmp_path / "nvme"), more)[1] is None


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
