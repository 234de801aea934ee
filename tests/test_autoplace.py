"""offload="auto": per-layer tiers from budgets; the plan fits, trains like all-device, and a
model that cannot fit is refused before anything is allocated."""


import jax
import numpy as np
import optax
import pytest

import zinfjax
from zinfjax.autoplace import PlacementError, need
from zinfjax.engine import build_engine
from zinfjax.memory import tier_bytes
from zinfjax.models import GPT, get_config, lm_loss
from zinfjax.placement import Tier

from helpers import text_batches

CONFIG = get_config("tiny", num_layers=8)
STEPS = 12


def gpt(rngs):
  return GPT(CONFIG, rngs=rngs)


def tx():
  return zinfjax.optim.adamw(3e-3, weight_decay=0.1)


def budgets_of(mesh, param, optimizer, path, **options):
  """The bytes per device that the placement (param, optimizer) holds on each tier."""
  zero = zinfjax.ZeroConfig(precision="fp32", offload_param=param, offload_optimizer=optimizer,
                            nvme_path=path, **options)
  engine = build_engine(gpt, tx(), zero, mesh, open_store_=False)
  return need(engine.plan, zero)


def test_auto_splits_layers_over_the_budgets_and_trains_like_all_device(mesh, tmp_path):
  """Budgets that hold the params of 2 of the 8 layers on the device and, in host memory, the
  other 6 layers' params and about half of the optimizer states: the plan is exactly that
  split, stays within every budget, and trains to the all-device losses."""
  path = str(tmp_path / "nvme")
  budgets = budgets_of(mesh, "device:2,pinned_host", "pinned_host:4,nvme", path)
  slack = 1000  # bytes: far less than one layer of any state
  budgets = {t: b + slack for t, b in budgets.items()}
  zero = zinfjax.ZeroConfig(precision="fp32", offload="auto", tier_budgets=budgets, nvme_path=path)
  state = zinfjax.init(gpt, tx(), zero, mesh)
  auto = state.engine.auto
  assert (auto.offload_param, auto.offload_optimizer) == ("device:2,pinned_host", "pinned_host:4,nvme")
  assert state.engine.config.offload_param == "device:2,pinned_host"
  assert "params+grads device:2,pinned_host, optimizer pinned_host:4,nvme" in auto.table()
  batches = text_batches(STEPS, batch=16, seq=32, seed=4)
  losses = []
  for batch in batches:
    state, metrics = zinfjax.train_step(state, batch, lm_loss)
    losses.append(float(metrics["loss"]))
    held = tier_bytes(state)  # what the progress line reports, per device
    held["nvme"] = state.engine.store.stats()["bytes_used"] // len(jax.local_devices())
    assert all(held[t] <= budgets[t] for t in held), (held, budgets)
  assert held["device"] > 0 and held["pinned_host"] > 0 and held["nvme"] > 0
  state.engine.store.close()
  ref_zero = zinfjax.ZeroConfig(precision="fp32")
  ref = zinfjax.init(gpt, optax.adamw(3e-3, weight_decay=0.1), ref_zero, mesh)
  ref_losses = []
  for batch in batches:
    ref, metrics = zinfjax.train_step(ref, batch, lm_loss)
    ref_losses.append(float(metrics["loss"]))
  rel = np.abs(np.asarray(losses) - ref_losses) / np.asarray(ref_losses)
  assert losses[-1] < losses[0] - 0.3
  assert np.all(rel < 1e-6), rel


def test_auto_keeps_everything_on_the_fastest_tier_that_holds_it(mesh, tmp_path):
  big = {"device": 1 << 30, "pinned_host": 1 << 30, "nvme": 1 << 30}
  zero = zinfjax.ZeroConfig(precision="fp32", offload="auto", tier_budgets=big)
  engine = build_engine(gpt, optax.adamw(1e-3), zero, mesh, open_store_=False)
  assert (engine.config.offload_param, engine.config.offload_optimizer) == ("device", "device")
  assert engine.tx is not None and engine.hyper is None  # any optax transformation runs
  # no NVMe folder: the states that do not fit on the device go to host memory, never NVMe
  small = dict(big, device=0)
  zero = zinfjax.ZeroConfig(precision="fp32", offload="auto", tier_budgets=small)
  engine = build_engine(gpt, tx(), zero, mesh, open_store_=False)
  assert (engine.config.offload_param, engine.config.offload_optimizer) == (
      "pinned_host", "pinned_host")


def test_auto_delays_the_updates_of_the_host_pipeline_where_it_places_any(mesh, tmp_path):
  """delay_update="all" with offload="auto": where the budgets keep every optimizer state on the
  device there is nothing to delay (it runs as "none", where an explicit device placement is
  refused); where they put some in the host pipeline, those are delayed, and their held grads
  count in RAM's need."""
  big = {"device": 1 << 30, "pinned_host": 1 << 30, "nvme": 1 << 30}
  late = dict(precision="fp32", offload="auto", host_optimizer="pipeline", delay_update="all")
  engine = build_engine(gpt, tx(), zinfjax.ZeroConfig(**late, tier_budgets=big), mesh,
                        open_store_=False)
  assert (engine.config.offload_optimizer, engine.config.delay_update) == ("device", "none")
  with pytest.raises(ValueError, match="delay_update='all'.*no optimizer state is in the host"):
    build_engine(gpt, tx(), zinfjax.ZeroConfig(precision="fp32", delay_update="all"), mesh,
                 open_store_=False)
  # room on the device for the params and no optimizer state: the optimizer goes to RAM
  device = budgets_of(mesh, "device", "pinned_host", str(tmp_path),
                      host_optimizer="pipeline")["device"]
  small = dict(big, device=device)
  now = build_engine(gpt, tx(), zinfjax.ZeroConfig(**dict(late, delay_update="none"),
                                                   tier_budgets=small), mesh, open_store_=False)
  engine = build_engine(gpt, tx(), zinfjax.ZeroConfig(**late, tier_budgets=small), mesh,
                        open_store_=False)
  assert engine.config.delay_update == "all" and engine.plan.optimizer_in_store
  assert engine.auto.offload_optimizer == now.auto.offload_optimizer == "pinned_host"
  assert engine.auto.need[Tier.PINNED_HOST] > now.auto.need[Tier.PINNED_HOST]


def test_a_model_that_cannot_fit_is_refused_before_anything_is_allocated(mesh, tmp_path):
  path = tmp_path / "nvme"
  budgets = {"device": 0, "pinned_host": 10_000, "nvme": 100_000}
  zero = zinfjax.ZeroConfig(precision="fp32", offload="auto", tier_budgets=budgets,
                            nvme_path=str(path))
  with pytest.raises(PlacementError, match=r"nvme needs .* of a 97.66 KiB budget \(.* short\)"):
    zinfjax.init(gpt, tx(), zero, mesh)
  assert not path.exists()
  no_nvme = zinfjax.ZeroConfig(precision="fp32", offload="auto", tier_budgets=dict(budgets))
  with pytest.raises(PlacementError, match="Give ZeroConfig.nvme_path a folder"):
    zinfjax.init(gpt, tx(), no_nvme, mesh)
  # host memory a byte short of what it holds with every layer on NVMe (the held grads of
  # delay_update="all" among it): the fix is its budget, not the drive
  least = budgets_of(mesh, "nvme", "nvme", str(path), delay_update="all")
  short = dict(least, pinned_host=least["pinned_host"] - 1, nvme=1 << 40)
  with pytest.raises(PlacementError, match=r"pinned_host needs .* \(1 B short\)\. Raise "
                     r"tier_budgets for pinned_host: that is the least it holds") as refused:
    build_engine(gpt, tx(), zinfjax.ZeroConfig(precision="fp32", offload="auto",
                                               delay_update="all", tier_budgets=short,
                                               nvme_path=str(path)), mesh, open_store_=False)
  assert "nvme_path" not in str(refused.value)
  with pytest.raises(ValueError, match="offload='auto' put optimizer states off the device"):
    build_engine(gpt, optax.adam(1e-3), zinfjax.ZeroConfig(
        offload="auto", tier_budgets={"device": 0, "pinned_host": 1 << 30}), mesh,
        open_store_=False)


@pytest.mark.parametrize("kwargs,match", [
    (dict(offload="fast"), "offload must be None or 'auto'"),
    (dict(offload="auto", offload_param="nvme"), "chooses offload_param and offload_optimizer"),
    (dict(offload="auto", stage=2), "needs stage=3"),
    (dict(offload="auto", tier_budgets={"hbm": 1}), "tier_budgets"),
    (dict(tier_budgets={"device": 1}), "tier_budgets"),
])
def test_bad_auto_config(kwargs, match):
  with pytest.raises(ValueError, match=match):
    zinfjax.ZeroConfig(**kwargs)


@pytest.mark.parametrize("atomic", [True, False])
def test_auto_counts_the_ram_store_of_the_host_pipeline(mesh, tmp_path, atomic):
  """Under host_optimizer="pipeline" the pinned-host states are in a swap store in RAM: the
  budgets a split needs (counted on the engine's plan, in the RAM store) give that split back,
  and the table says which tiers hold the second copy of all-or-nothing steps. Plans only."""
  path = str(tmp_path / "nvme")
  # all or nothing with and without the drive: else the RAM store's copies would go with it
  options = dict(host_optimizer="pipeline", nvme_atomic_steps=atomic, host_atomic_steps=atomic)
  split = ("device:2,pinned_host", "pinned_host:4,nvme")
  budgets = budgets_of(mesh, *split, path, **options)
  assert budgets != budgets_of(mesh, *split, path)  # the store's padding (and copies) count
  zero = zinfjax.ZeroConfig(precision="fp32", offload="auto", tier_budgets=budgets,
                            nvme_path=path, **options)
  auto = build_engine(gpt, tx(), zero, mesh, open_store_=False).auto
  assert (auto.offload_param, auto.offload_optimizer) == split
  assert auto.need == budgets
  assert auto.copies == (("pinned_host", "nvme") if atomic else ())
  rows = {line.split()[0]: line for line in auto.table().splitlines()[1:]}
  for tier in ("device", "pinned_host", "nvme"):
    assert ("second copy" in rows[tier]) == (tier in auto.copies), rows[tier]


def test_the_new_params_the_host_pipeline_returns_count_in_host_ram(mesh, tmp_path):
  """Params in arrays, their optimizer in a store: the host pipeline makes their new params in
  host RAM. On the device they go back as they are made (`RETURNING` layers of a leaf on
  their way); in pinned-host arrays the step puts them back after the update, one param in
  the params' dtype a layer. The budgets count them (else a 13B placement that fitted on paper
  took its step out of RAM), once: under the delayed update they are the delayed parts'
  arrays already."""
  from zinfjax.autoplace import RETURNING, delayed_bytes, read_bytes, returned_bytes
  zero = zinfjax.ZeroConfig(offload_param="device:6,pinned_host", offload_optimizer="pinned_host",
                            host_optimizer="pipeline", nvme_path=str(tmp_path / "nvme"))
  plan = build_engine(gpt, tx(), zero, mesh, open_store_=False).plan
  mapped = zero.with_host_pipeline()
  # layers 0-5 of each stack and the leaves outside them (with the first tier) on the device:
  # RETURNING (< 6) layers of each at a time
  want = sum((RETURNING if leaf.stacked else 1) * leaf.local_size * 2 for leaf in plan.leaves)
  assert RETURNING < 6 and returned_bytes(plan, mapped) == want > 0
  store = sum(plan.nvme_disk_bytes(mapped.nvme_atomic_steps, ranks=1,
                                   tier=Tier.HOST_STORE).values())
  # and their grads on their way to the update: a layer of the stack and the leaf being read
  layer = sum(leaf.local_size for leaf in plan.leaves if leaf.stacked)
  grads = (layer + max(leaf.local_size for leaf in plan.leaves)) * 2
  assert read_bytes(plan, mapped) == grads
  # one layer on the device: no more than that layer's grads (and the leaves outside the stacks)
  one = mapped.replace(offload_param="device:1,pinned_host")
  small = build_engine(gpt, tx(), one, mesh, open_store_=False).plan
  assert read_bytes(small, one) == sum(leaf.local_size for leaf in small.leaves) * 2 < grads
  assert need(plan, zero)[Tier.PINNED_HOST] == store + want + grads
  late = mapped.replace(delay_update="all")
  assert returned_bytes(plan, late) == 0 and delayed_bytes(plan, late) > want
  assert read_bytes(plan, late) == grads  # read to the host, held or not
  # XLA's host update keeps pinned-host optimizer states in arrays: nothing comes back
  xla = zero.replace(host_optimizer="xla")
  assert returned_bytes(build_engine(gpt, tx(), xla, mesh, open_store_=False).plan, xla) == 0
  # params in pinned-host arrays (XLA's), their optimizer on the drive: every layer, whole
  drive = xla.replace(offload_param="device:6,pinned_host", offload_optimizer="nvme")
  plan = build_engine(gpt, tx(), drive, mesh, open_store_=False).plan
  hosted = sum((leaf.num_layers - 6) * leaf.local_size * 2 for leaf in plan.leaves if leaf.stacked)
  assert returned_bytes(plan, drive) == want + hosted and hosted > 0
  # and their grads, read a segment at a time and held through the update
  assert read_bytes(plan, drive) == grads + hosted
