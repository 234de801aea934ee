"""How `largest_gpt.py` sizes its runs: each tier's room on this machine, what a placement needs
there (the paper's states, and zinfjax's delayed update in RAM), and the mixed placement's plan
for a layer count, searched in a CPU child process. Nothing here trains or holds a device."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

SCRIPTS = os.path.dirname(os.path.abspath(__file__))
GIB = 1 << 30


def rooms(args, nvme_path: str, limit: int | None, platform: str) -> dict[str, int]:
  """Bytes of states each tier may hold per device (before `--fill`): measured unless given; RAM's
  less what XLA's host update copies on a GPU (`zinfjax.hostlimit.host_room`)."""
  out = {}
  if args.hbm_gib is not None:
    out["device"] = int(args.hbm_gib * GIB)
  elif limit is None:
    raise SystemExit(f"{platform} devices report no memory limit: pass --hbm-gib.")
  else:
    out["device"] = int(limit)
  if args.ram_gib is not None:
    out["pinned_host"] = int(args.ram_gib * GIB)
  else:
    from zinfjax.progress import host_memory
    seen = host_memory()
    if seen is None:
      raise SystemExit("this host reports no available RAM (/proc/meminfo): pass --ram-gib.")
    out["pinned_host"] = max(0, seen[0] - int(args.host_reserve_gib * GIB)) // args.devices
  from zinfjax.hostlimit import host_room
  out["pinned_host"] = host_room(out["pinned_host"], platform, args.host_optimizer)
  if args.disk_gib is not None:
    out["nvme"] = int(args.disk_gib * GIB)
  else:
    os.makedirs(nvme_path, exist_ok=True)
    out["nvme"] = shutil.disk_usage(nvme_path).free // args.devices
  return out


def gpt_config(layers: int, args):
  """The GPT `train_gpt.py` builds with `layers` layers."""
  from zinfjax.models import get_config
  return get_config("tiny", num_layers=layers, hidden=args.hidden, num_heads=args.heads,
                    vocab_size=65, seq_len=args.seq_len)


def num_params(layers: int, args) -> int:
  """Parameters of that GPT (embeddings counted)."""
  return gpt_config(layers, args).num_params


def estimate(layers: int, args, **placement):
  """zinfjax.memory's estimate for `layers` layers of the runs' GPT, on one device's share."""
  from zinfjax.memory import estimate_memory
  return estimate_memory(layers=layers, hidden=args.hidden, heads=args.heads,
                         seq_len=args.seq_len, devices=args.devices,
                         batch_per_device=max(1, args.batch_size // args.devices),
                         num_params=num_params(layers, args), **placement)


def working(est) -> int:
  """Bytes per device the step works in beyond the states: activations and working memory."""
  return est.activation_checkpoints + est.activation_working_memory + est.model_state_working_memory


def need(layers: int, tier: str, args) -> dict[str, int]:
  """Bytes per device on each tier for `layers` layers with params and optimizer on `tier`: the
  paper's states, and in RAM what zinfjax's delayed update holds (`delay_of`)."""
  from zinfjax.memory import bytes_per_param
  est = estimate(layers, args, offload_param=tier, offload_optimizer=tier,
                 bf16_moments=getattr(args, "bf16_moments", False))
  out = dict(est.per_device)
  out["device"] += working(est)
  ram = lambda d: bytes_per_param(tier, None, tier, host_optimizer=args.host_optimizer,
                                  atomic_nvme=False, delay_update=d)["pinned_host"]
  share = -(-est.num_params // args.devices)
  out["pinned_host"] += int((ram(delay_of(tier, args)) - ram("none")) * share)
  return out


def delay_of(tier: str, args) -> str:
  """A run's `delay_update`: `--delay-update` where the host pipeline updates its optimizer (on
  the drive, in RAM under the pipeline, or as the mixed plan says), else nothing to delay."""
  piped = tier in ("nvme", "mixed") or (tier == "pinned_host" and args.host_optimizer == "pipeline")
  return args.delay_update if piped else "none"


def mixed_budgets(layers: int, room: dict[str, int], args) -> dict[str, int]:
  """`offload="auto"` budgets per device for `layers` layers: each tier's room x `--fill`, the
  device's less the activations and working memory (zinfjax.memory's estimate)."""
  fill = {t: int(args.fill * room[t]) for t in ("device", "pinned_host", "nvme")}
  return dict(fill, device=max(0, fill["device"] - working(estimate(layers, args))))


def mixed_plan(layers: int, room: dict[str, int], args, folder: str) -> dict | None:
  """The placement `offload="auto"` chooses for `layers` layers (its splits and the bytes per tier
  per device), or None where the model does not fit the budgets. Builds the plan only."""
  import zinfjax
  from zinfjax.autoplace import PlacementError
  from zinfjax.engine import build_engine
  from zinfjax.models import GPT
  config = gpt_config(layers, args)
  zero = zinfjax.ZeroConfig(offload="auto", tier_budgets=mixed_budgets(layers, room, args),
                            nvme_path=folder, nvme_atomic_steps=False,
                            pinned_budget=args.pinned_budget << 20,
                            host_optimizer=args.host_optimizer, delay_update=args.delay_update)
  try:
    tx = zinfjax.optim.adamw(1e-3, moment_dtype="bfloat16" if args.bf16_moments else "float32")
    auto = build_engine(lambda r: GPT(config, rngs=r), tx, zero, zinfjax.make_mesh(),
                        open_store_=False).auto
  except PlacementError:
    return None
  return {"offload_param": auto.offload_param, "offload_optimizer": auto.offload_optimizer,
          "need": {str(t): int(b) for t, b in auto.need.items()}, "budgets": auto.budgets,
          "host_arrays": auto.host_arrays}


def search_mixed(room: dict[str, int], args, folder: str,
                 layers: int | None = None) -> tuple[int, dict | None]:
  """The most layers `mixed_plan` places and its placement (or, given `layers`, that count's
  placement), asked of a child process on the CPU with `--devices` host devices: this one must
  not hold the GPU."""
  code = ("import json, sys, types; sys.path.insert(0, sys.argv[1]); import _largest_plan as L; "
          "a = json.loads(sys.argv[2]); ns = types.SimpleNamespace(**a['args']); "
          "place = lambda n: L.mixed_plan(n, a['room'], ns, a['folder']); "
          "print(json.dumps(L.bisect(place) if a['layers'] is None "
          "else (a['layers'], place(a['layers']))))")
  env = {**os.environ, "JAX_PLATFORMS": "cpu",
         "XLA_FLAGS": f"--xla_force_host_platform_device_count={args.devices}"}
  payload = json.dumps({"room": room, "args": vars(args), "folder": folder, "layers": layers})
  out = subprocess.run([sys.executable, "-c", code, SCRIPTS, payload], capture_output=True,
                       text=True, env=env, cwd="/")
  if out.returncode:
    raise SystemExit(f"the mixed placement search failed:\n{out.stderr[-3000:]}")
  found, plan = json.loads(out.stdout.strip().splitlines()[-1])
  return found, plan


def bisect(place) -> tuple[int, object]:
  """The largest n >= 1 with `place(n)` not None (doubling, then halving) and its value;
  (0, None) when not even one layer places."""
  lo, hi, best = 0, 1, None
  while (got := place(hi)) is not None:
    lo, hi, best = hi, hi * 2, got
  while hi - lo > 1:
    mid = (lo + hi) // 2
    got = place(mid)
    lo, hi, best = (mid, hi, got) if got is not None else (lo, mid, best)
  return lo, best


def largest(tier: str, room: dict[str, int], args) -> int:
  """The most layers whose estimate fits `room` x `--fill` on every tier (0: not even one)."""
  fits = lambda n: all(b <= args.fill * room[t] for t, b in need(n, tier, args).items() if b)
  return bisect(lambda n: True if fits(n) else None)[0]
