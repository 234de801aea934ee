"""Stage 3 memory bounds, read from the compiled step's `memory_analysis()`."""

import jax
import optax
import pytest

import zinfjax
from zinfjax.memory import estimate_memory, tier_bytes
from zinfjax.models import GPT, GPTConfig, lm_loss
from zinfjax.draw import master_initializer
from zinfjax.step import shard_batch

from helpers import random_batches

WIDTH, SEQ, BATCH = 256, 16, 8


def compiled_step(mesh, layers, precision="fp32"):
  config = GPTConfig(vocab_size=64, seq_len=SEQ, num_layers=layers, num_heads=4, hidden=WIDTH)
  state = zinfjax.init(lambda r: GPT(config, rngs=r), optax.adam(1e-3),
                       zinfjax.ZeroConfig(stage=3, precision=precision), mesh)
  step = zinfjax.make_train_step(state, lm_loss)
  batch = shard_batch(state.engine, random_batches(1, BATCH, SEQ, 64)[0])
  return state, step.jitted.lower(state, batch).compile().memory_analysis()


@pytest.fixture(scope="module")
def analyses(mesh):
  return {layers: compiled_step(mesh, layers) for layers in (4, 16)}


def test_arguments_are_one_eighth_of_the_states(analyses):
  for layers, (state, analysis) in analyses.items():
    total = sum(x.nbytes for x in jax.tree.leaves((state.params, state.master, state.opt_state)))
    scalars = sum(x.nbytes for x in jax.tree.leaves(state) if x.ndim == 0)
    per_device = analysis.argument_size_in_bytes
    # params, master, mu, nu: each device holds 1/8 (+ scalars, + the batch)
    batch_bytes = 2 * (BATCH // 8) * SEQ * 4
    assert per_device <= (total - scalars) / 8 + scalars * 8 + batch_bytes + 1024, (layers, per_device)
    assert per_device >= (total - scalars) / 8
    assert tier_bytes(state.master)["device"] * 8 == sum(x.nbytes for x in jax.tree.leaves(state.master))


def test_temporaries_do_not_hold_gathered_layers(analyses):
  """16 vs 4 layers: temp growth is activations + sharded grads, never gathered params."""
  (_, small), (_, large) = analyses[4], analyses[16]
  growth_per_layer = (large.temp_size_in_bytes - small.temp_size_in_bytes) / 12
  full_layer = 12 * WIDTH * WIDTH * 4              # one gathered layer, fp32
  sharded_layer = full_layer / 8
  checkpoint = (BATCH // 8) * SEQ * WIDTH * 4      # one block input per layer
  assert growth_per_layer <= checkpoint + 1.5 * sharded_layer, growth_per_layer
  assert growth_per_layer < 0.25 * full_layer
  # and the whole temporary space holds at most a few gathered layers, whatever the depth
  assert large.temp_size_in_bytes < small.temp_size_in_bytes + 12 * 0.25 * full_layer


def test_paper_memory_model_reproduces_figure_2a():
  """The 0.1T row of the paper's Figure 2a: 80 layers, hidden 10K, 128 heads."""
  est = estimate_memory(layers=80, hidden=10 * 1024, heads=128, seq_len=1024, batch_per_device=4,
                        devices=16, stage=3)
  tib, gib = 2 ** 40, 2 ** 30
  assert est.num_params == 12 * 80 * (10 * 1024) ** 2
  assert round(est.model_states / tib, 2) == 1.83
  assert abs(est.activation_working_memory / gib - 1.63) < 0.01
  ckpt_32 = estimate_memory(layers=80, hidden=10 * 1024, heads=128, batch_per_device=32)
  assert round(ckpt_32.activation_checkpoints / tib, 2) == 0.05
  assert est.per_device["device"] == est.model_states // 16


def test_memory_model_places_states_on_their_tiers():
  est = estimate_memory(layers=2, hidden=64, heads=4, devices=4, stage=3, offload_param="nvme",
                        offload_optimizer="pinned_host")
  n = est.num_params
  assert est.per_device == {"device": 0, "pinned_host": 16 * n // 4, "nvme": 4 * n // 4}
  stage1 = estimate_memory(layers=2, hidden=64, heads=4, devices=4, stage=1)
  assert stage1.per_device["device"] == 4 * n + 16 * n // 4
  with pytest.raises(ValueError, match="offload_param"):
    estimate_memory(layers=2, hidden=64, heads=4, offload_param="disk")


def test_init_never_materializes_the_whole_model(mesh):
  """The initializer's per-device output and temporaries are a fraction of the model."""
  config = GPTConfig(vocab_size=64, seq_len=SEQ, num_layers=8, num_heads=4, hidden=WIDTH)
  state = zinfjax.init(lambda r: GPT(config, rngs=r), optax.sgd(0.1), zinfjax.ZeroConfig(), mesh)
  init_fn = master_initializer(state.engine, lambda r: GPT(config, rngs=r))
  analysis = init_fn.lower(jax.random.key(0)).compile().memory_analysis()
  total = sum(x.nbytes for x in jax.tree.leaves(state.master))
  assert analysis.output_size_in_bytes <= total / 8 + 4096
  assert analysis.temp_size_in_bytes < total / 4, (analysis.temp_size_in_bytes, total)


@pytest.mark.parametrize("param,optimizer,atomic,host", [
    ("pinned_host", "nvme", True, "xla"), ("nvme", "nvme", False, "xla"),
    ("device", "pinned_host", True, "xla"),
    # the host pipeline: pinned-host states in the RAM store, twice when steps are all or nothing
    ("pinned_host", "nvme", True, "pipeline"), ("pinned_host", "pinned_host", True, "pipeline"),
    ("device", "pinned_host", False, "pipeline"),
    ("pinned_host", "pinned_host", False, "pipeline")])
def test_bytes_per_param_match_the_plan(param, optimizer, atomic, host, tmp_path):
  """`bytes_per_param` times the params equals what the plan keeps on each tier (the swap
  stores' copies of all-or-nothing steps included), to the stores' alignment padding and, in
  host RAM, the few layers of new params on their way back to the device (`RETURNING` of 8)."""
  import jax
  import zinfjax
  from zinfjax.autoplace import RETURNING, need, read_bytes, returned_bytes
  from zinfjax.engine import build_engine
  from zinfjax.memory import bytes_per_param
  from zinfjax.models import GPT, get_config
  config = get_config("tiny", num_layers=8, hidden=256, num_heads=4)
  zero = zinfjax.ZeroConfig(offload_param=param, offload_optimizer=optimizer,
                            nvme_path=str(tmp_path), nvme_atomic_steps=atomic,
                            host_optimizer=host, host_atomic_steps=atomic and host == "pipeline")
  plan = build_engine(lambda r: GPT(config, rngs=r), zinfjax.optim.adamw(1e-3), zero,
                      zinfjax.make_mesh(jax.devices()[:1]), open_store_=False).plan
  n = sum(leaf.num_layers * leaf.local_size for leaf in plan.leaves)
  per = bytes_per_param(param, None, optimizer, atomic_nvme=atomic, host_optimizer=host,
                        atomic_host=atomic)
  held = need(plan, zero)
  stores = {"nvme"} | ({"pinned_host"} if zero.with_host_pipeline().host_store else set())
  assert (host == "pipeline") == ("pinned_host" in stores)
  # the plan's count of the new params of device layers on their way back: a few layers' worth
  # (the embeddings', one layer, whole), which a count per param leaves out
  mapped = zero.with_host_pipeline()
  # (and their grads on their way to the update)
  coming = returned_bytes(plan, mapped) + read_bytes(plan, mapped) if param == "device" else 0
  reading = plan.stack_layer_size + max(leaf.local_size for leaf in plan.leaves)
  assert coming <= sum(min(leaf.num_layers, RETURNING) * leaf.local_size * 2
                       for leaf in plan.leaves) + reading * 2
  assert (coming > 0) == (param == "device" and host == "pipeline"), coming
  for tier in ("device", "pinned_host", "nvme"):
    if tier in stores:  # + padding to 4 KiB per shard
      room = held[tier] - (coming if tier == "pinned_host" else 0)
      assert per[tier] * n <= room <= per[tier] * n * 1.1, (tier, held[tier], per[tier] * n)
    else:  # arrays: exact
      assert held[tier] == per[tier] * n, tier
  expect = {("pinned_host", "nvme", True): {"pinned_host": 4 + 2, "nvme": 24},
            ("pinned_host", "pinned_host", True): {"pinned_host": 4 + 2 + 24},
            # the new params go back to the device as they are made: none a param
            ("device", "pinned_host", False): {"device": 4, "pinned_host": 12},
            ("pinned_host", "pinned_host", False): {"pinned_host": 2 + 2 + 12}}
  if host == "pipeline":
    assert {t: b for t, b in per.items() if b} == expect[param, optimizer, atomic]
  # the delayed update's host arrays: the plan's count and the per-param one agree
  late = zero.replace(delay_update="all")
  extra = bytes_per_param(param, None, optimizer, atomic_nvme=atomic, host_optimizer=host,
                          atomic_host=atomic, delay_update="all")["pinned_host"]
  extra -= per["pinned_host"]
  new_params = returned_bytes(plan, mapped) if param == "device" else 0  # the delay's now
  assert need(plan, late)["pinned_host"] - held["pinned_host"] == extra * n - new_params
  # (a RAM store alone, rewritten in place, keeps the grads in their twins: 2 B less; params
  # in pinned-host arrays had their new params counted already: 2 B less)
  twins = (param, optimizer, atomic, host) == ("pinned_host", "pinned_host", False, "pipeline")
  in_store = optimizer == "nvme" or host == "pipeline"
  returned = 2 if in_store and param == "pinned_host" and host == "xla" else 0
  assert extra == (4 if twins else 6 - returned if in_store else 0)


@pytest.mark.parametrize("param,optimizer,atomic,host", [
    ("device", "device", True, "xla"), ("pinned_host", "nvme", True, "xla"),
    ("nvme", "nvme", True, "xla"), ("nvme", "nvme", False, "xla"),
    ("pinned_host", "pinned_host", True, "pipeline")])
def test_frozen_params_keep_their_params_alone_as_the_plan_does(param, optimizer, atomic, host,
                                                                  tmp_path):
  """A LoRA fine-tune (`trainable=nnx.LoRAParam`): the estimate's bytes, `per_param` for the
  adapters and `per_frozen_param` for the weights they adapt, equal the plan's on every tier (to
  the stores' padding); the frozen weights keep no grads, master or moments, and the estimate
  of the whole model drops from 20 bytes a param to 2 for each of them."""
  import jax
  from flax import nnx
  import zinfjax
  from zinfjax.autoplace import need
  from zinfjax.engine import build_engine
  from zinfjax.memory import estimate_memory
  from zinfjax.models import GPT, get_config
  config = get_config("tiny", num_layers=8, hidden=256, num_heads=4).replace(lora_rank=4)
  zero = zinfjax.ZeroConfig(offload_param=param, offload_optimizer=optimizer,
                            nvme_path=str(tmp_path), nvme_atomic_steps=atomic,
                            host_optimizer=host, host_atomic_steps=atomic and host == "pipeline",
                            trainable=nnx.LoRAParam)
  plan = build_engine(lambda r: GPT(config, rngs=r), zinfjax.optim.adamw(1e-3), zero,
                      zinfjax.make_mesh(jax.devices()[:1]), open_store_=False).plan
  t = sum(leaf.size for leaf in plan.leaves if leaf.trainable)
  f = sum(leaf.size for leaf in plan.leaves if not leaf.trainable)
  assert 0 < 20 * t < f
  est = estimate_memory(layers=8, hidden=256, heads=4, offload_param=param,
                        offload_optimizer=optimizer, atomic_nvme=atomic, host_optimizer=host,
                        atomic_host=atomic and host == "pipeline", num_params=t + f,
                        trainable_params=t)
  held = need(plan, zero)
  for tier in held:
    want = est.per_param[tier] * t + est.per_frozen_param[tier] * f
    assert want <= held[tier] <= want * 1.05, (tier, held[tier], want)
  assert est.model_states == 2 * f + 20 * t
  assert est.per_device[param] >= 2 * (t + f) and sum(est.per_device.values()) == 2 * f + 20 * t
  with pytest.raises(ValueError, match="trainable_params=11 must be between 0 and the 10"):
    estimate_memory(layers=1, hidden=8, heads=1, num_params=10, trainable_params=11)


def test_the_delayed_update_counts_its_host_arrays():
  """delay_update="all" adds the held grads twice and the new params (6 B a param) to host RAM
  where the optimizer is in a store, nowhere else; a RAM store alone, rewritten in place, holds
  the grads once (in their twins: 4 B); params in pinned-host arrays count their new params
  without the delay too, so it adds 4 B there; the estimate passes it on."""
  from zinfjax.memory import bytes_per_param, estimate_memory
  for param, optimizer, host, atomic, extra in [
      ("pinned_host", "pinned_host", "pipeline", False, 4),
      ("pinned_host", "pinned_host", "pipeline", True, 6),
      ("nvme", "nvme", "xla", False, 6), ("device", "nvme", "xla", False, 6),
      ("pinned_host", "nvme", "xla", False, 4)]:
    base = bytes_per_param(param, None, optimizer, host_optimizer=host, atomic_host=atomic)
    late = bytes_per_param(param, None, optimizer, host_optimizer=host, atomic_host=atomic,
                           delay_update="all")
    assert {t: late[t] - base[t] for t in base} == {"device": 0, "pinned_host": extra, "nvme": 0}
  # the optimizer in arrays: no host pipeline, nothing delayed
  assert (bytes_per_param("pinned_host", None, "pinned_host", delay_update="all")
          == bytes_per_param("pinned_host", None, "pinned_host"))
  est = estimate_memory(layers=2, hidden=64, heads=4, offload_param="nvme",
                        offload_optimizer="nvme", delay_update="all")
  assert est.per_param["pinned_host"] == 6


def test_the_largest_operator_is_a_layer_of_a_stack_or_a_whole_leaf():
  """A stack's weight counts one layer (hd x 4hd in the MLP, not L of them), a leaf outside the
  stacks whole: the embedding once the vocabulary outgrows 4hd; frozen weights (LoRA) keep
  their params alone; the estimate takes the bytes as its working memory."""
  from flax import nnx
  from zinfjax.memory import largest_operator
  shape = lambda **kw: nnx.eval_shape(lambda: GPT(GPTConfig(
      num_layers=3, hidden=32, num_heads=4, seq_len=16, **kw), rngs=nnx.Rngs(0)))
  assert largest_operator(shape(vocab_size=100)) == ("blocks.block.fc.kernel", (32, 128),
                                                     4 * 32 * 128)
  assert largest_operator(shape(vocab_size=200)) == ("wte.embedding", (200, 32), 4 * 200 * 32)
  lora = shape(vocab_size=100, lora_rank=2)
  assert largest_operator(lora, nnx.LoRAParam)[2] == 2 * 32 * 128
  est = estimate_memory(layers=3, hidden=32, heads=4, operator_bytes=4 * 200 * 32)
  assert est.model_state_working_memory == 4 * 200 * 32
  assert estimate_memory(layers=3, hidden=32, heads=4).model_state_working_memory == 16 * 32 ** 2


def test_xla_gpu_pinned_host_limit_is_raised_and_checked():
  """XLA:GPU's pinned-host cap (64 GiB unless set) is raised to 90% of the machine's RAM where
  the environment leaves it unset, never lowered, and a plan above it is refused by name."""
  import os
  from zinfjax import hostlimit
  env = {}
  hostlimit.raise_default(env, ram=512 << 30)
  assert env == {hostlimit.ENV: "460"}
  env = {}
  hostlimit.raise_default(env, ram=16 << 30)
  assert env == {hostlimit.ENV: "64"}
  env = {hostlimit.ENV: "32"}
  hostlimit.raise_default(env, ram=512 << 30)
  assert env == {hostlimit.ENV: "32"}
  assert hostlimit.ENV in os.environ  # importing zinfjax set it (or the environment had)
  with pytest.raises(ValueError, match=f"set {hostlimit.ENV}=101 "):
    hostlimit.check((100 << 30) + 1, "gpu", {hostlimit.ENV: "64"})
  hostlimit.check((100 << 30) + 1, "cpu", {hostlimit.ENV: "64"})  # XLA:CPU has no such cap
  hostlimit.check(64 << 30, "gpu", {hostlimit.ENV: "64"})


def test_host_room_leaves_xla_gpu_host_update_its_copies(monkeypatch):
  """XLA:GPU's host update holds 2.3x its pinned-host states (measured on an H200): under it the
  RAM a plan may fill is that share, under the host pipeline or on XLA:CPU all of it; and
  offload="auto"'s default host budget follows."""
  from zinfjax import autoplace, hostlimit
  ram = 115 << 30
  assert hostlimit.host_room(ram, "gpu", "xla") == int(ram / 2.3) < ram // 2
  assert hostlimit.host_room(ram, "gpu", "pipeline") == ram
  assert hostlimit.host_room(ram, "cpu", "xla") == ram
  monkeypatch.setattr(autoplace, "_available_ram", lambda: 2 * ram)
  config = zinfjax.ZeroConfig(offload="auto", host_optimizer="xla")
  want = (int(autoplace.HOST_SHARE * 2 * ram) - config.pinned_budget) // len(jax.local_devices())
  assert autoplace.default_budgets(config)["pinned_host"] == want  # CPU: no copies to leave room for
  monkeypatch.setattr(autoplace, "host_room", lambda r, platform, h: hostlimit.host_room(r, "gpu", h))
  got = autoplace.default_budgets(config)["pinned_host"]
  assert got == (int(int(autoplace.HOST_SHARE * 2 * ram) / 2.3) - config.pinned_budget) // len(jax.local_devices())
  pipeline = autoplace.default_budgets(config.replace(host_optimizer="pipeline"))["pinned_host"]
  assert pipeline == want > got


def test_xla_gpu_host_update_that_would_run_out_of_ram_is_warned_before_compiling():
  """A plan whose pinned-host states, under XLA:GPU's host update (2.3x at its peak), would need
  more than 90% of the machine's RAM is warned of with the fix; the host pipeline, XLA:CPU and
  a plan that fits are not."""
  import warnings
  from zinfjax import hostlimit
  ram = 128 << 30
  with pytest.warns(UserWarning, match="host_optimizer='pipeline'") as caught:
    hostlimit.warn_copies(60 << 30, "gpu", "xla", ram)
  assert "about 138 GiB here" in str(caught[0].message)
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    hostlimit.warn_copies(60 << 30, "gpu", "pipeline", ram)
    hostlimit.warn_copies(60 << 30, "cpu", "xla", ram)
    hostlimit.warn_copies(40 << 30, "gpu", "xla", ram)  # 92 GiB at its peak: fits in 115
