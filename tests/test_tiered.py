"""Params/grads and optimizer states on device, pinned host or NVMe give the all-device losses."""

import gc
import os
import weakref

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import zinfjax
from zinfjax.models import GPT, get_config, lm_loss
from zinfjax.offload import EngineError, NoSpaceError
from zinfjax.step import shard_batch

from helpers import text_batches, zero_training

TINY = get_config("tiny")
STEPS = 20
TIERS = ("device", "pinned_host", "nvme")
# every params x optimizer placement; activation offload on for every other one (and all-device)
PLACEMENTS = [(p, o, i % 2 == 0) for i, (p, o) in enumerate((p, o) for p in TIERS for o in TIERS)]


def make_tx():
  return zinfjax.optim.adamw(optax.warmup_cosine_decay_schedule(0.0, 3e-3, 5, STEPS),
                             weight_decay=0.1)


def train(zero, mesh, batches, tx=None):
  return zero_training(lambda r: GPT(TINY, rngs=r), tx or make_tx(), zero, mesh, batches, lm_loss)


@pytest.fixture(scope="module")
def batches():
  return text_batches(STEPS, batch=16, seq=32, seed=1)


@pytest.fixture(scope="module")
def reference(mesh, batches):
  """The all-device ZeRO-3 run (optax.adamw: the same math as the device tier's AdamW)."""
  tx = optax.adamw(optax.warmup_cosine_decay_schedule(0.0, 3e-3, 5, STEPS), weight_decay=0.1)
  losses, state = train(zinfjax.ZeroConfig(precision="fp32"), mesh, batches, tx)
  return losses, state.full_params()


def kinds(tree):
  return {x.sharding.memory_kind for x in jax.tree.leaves(tree)}


@pytest.mark.parametrize("param,optimizer,activations", PLACEMENTS)
def test_placement_matches_all_device(param, optimizer, activations, mesh, batches, reference,
                                      tmp_path):
  zero = zinfjax.ZeroConfig(precision="fp32", offload_param=param, offload_optimizer=optimizer,
                            offload_activations=activations, nvme_path=str(tmp_path / "nvme"))
  losses, state = train(zero, mesh, batches)
  ref_losses, ref_params = reference
  assert losses[-1] < losses[0] - 0.3
  rel = np.abs(losses - ref_losses) / ref_losses
  assert np.all(rel < 1e-6), rel
  for got, want in zip(jax.tree.leaves(state.full_params()), jax.tree.leaves(ref_params)):
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-5)  # ~0.3% of one lr step

  # the states really live where the config says
  plan = state.engine.plan
  if param == "nvme":
    assert jax.tree.leaves(state.params) == [] and plan.tiers("params") == {"nvme"}
    assert any(k.startswith("p/blocks/") for k in state.engine.store.keys())
    assert any(k.startswith("g/blocks/") for k in state.engine.store.keys())
  else:
    assert kinds(state.params) == {param}
  if optimizer == "nvme":
    assert jax.tree.leaves(state.master) == [] and plan.tiers("master") == {"nvme"}
    assert state.engine.pipeline.last_step["bytes_read"] > 0
  else:
    assert kinds(state.master) == {optimizer}
  jitted = zinfjax.make_train_step(state, lm_loss).jitted
  args = (state, shard_batch(state.engine, batches[0]))
  hlo = jitted.lower(*args).as_text()
  assert ("zinfjax_adamw" in hlo) == (optimizer == "pinned_host")
  assert ("zinfjax_swap_read_start" in hlo) == (param == "nvme")
  # host-memory values inside the step (XLA:CPU lowers the moves to no-ops: one memory there)
  jaxpr = str(jax.make_jaxpr(lambda *a: jitted(*a))(*args))
  assert ("<host>" in jaxpr) == (activations or "pinned_host" in (param, optimizer))


CLIP = 0.5  # below the tiny GPT's grad norms (about 1 to 3) in these steps: clipping is active


@pytest.fixture(scope="module")
def clipped_reference(mesh, batches):
  """All-device run of optax.clip_by_global_norm + optax.adamw (10 steps)."""
  tx = optax.chain(optax.clip_by_global_norm(CLIP),
                   optax.adamw(optax.warmup_cosine_decay_schedule(0.0, 3e-3, 5, STEPS),
                               weight_decay=0.1))
  losses, state = train(zinfjax.ZeroConfig(precision="fp32"), mesh, batches[:10], tx)
  return losses, state.full_params()


@pytest.mark.parametrize("param,optimizer", [("device", "pinned_host"), ("pinned_host", "nvme"),
                                             ("nvme", "nvme")])
def test_host_optimizer_clips_like_optax(param, optimizer, mesh, batches, clipped_reference,
                                         reference, tmp_path):
  """zinfjax.optim.adamw(max_grad_norm=...) on the host tiers equals optax's clip + adamw chain."""
  tx = zinfjax.optim.adamw(optax.warmup_cosine_decay_schedule(0.0, 3e-3, 5, STEPS),
                           weight_decay=0.1, max_grad_norm=CLIP)
  zero = zinfjax.ZeroConfig(precision="fp32", offload_param=param, offload_optimizer=optimizer,
                            nvme_path=str(tmp_path / "nvme"))
  losses, state = train(zero, mesh, batches[:10], tx)
  ref_losses, ref_params = clipped_reference
  np.testing.assert_allclose(losses, ref_losses, rtol=1e-6)
  assert np.abs(ref_losses - reference[0][:10]).max() > 1e-3  # the clipping did change the run
  for got, want in zip(jax.tree.leaves(state.full_params()), jax.tree.leaves(ref_params)):
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-5)


@pytest.fixture(scope="module")
def nvme_run(mesh, batches, tmp_path_factory):
  path = tmp_path_factory.mktemp("nvme") / "not" / "yet" / "there"
  zero = zinfjax.ZeroConfig(precision="fp32", offload_param="nvme", offload_optimizer="nvme",
                            nvme_path=str(path))
  state = zinfjax.init(lambda r: GPT(TINY, rngs=r), make_tx(), zero, mesh, 0)
  return path, state


def test_missing_nvme_path_is_created(nvme_run):
  path, state = nvme_run
  assert (path / "rank0" / "swap.bin").exists()


def test_nvme_optimizer_runs_under_backward(mesh, batches, tmp_path):
  """Without clipping, the optimizer starts while backward still writes grads: it reaches
  sub-groups whose grads are not on NVMe yet and waits for them. (8 layers of width 256, so
  backward outlasts the moment the host pipeline starts, even on a loaded machine.)"""
  zero = zinfjax.ZeroConfig(precision="fp32", offload_param="nvme", offload_optimizer="nvme",
                            nvme_path=str(tmp_path / "nvme"))
  config = get_config("tiny", num_layers=8, hidden=256)
  state = zinfjax.init(lambda r: GPT(config, rngs=r), make_tx(), zero, mesh, 0)
  waits = 0
  for batch in batches[:2]:
    state, metrics = zinfjax.train_step(state, batch, lm_loss)
    assert np.isfinite(float(metrics["loss"]))
    waits += metrics["nvme_grad_waits"]
  assert waits > 0
  # the optimizer and I/O threads run host_nice (5) below the program's threads
  nice = thread_nice()
  program = {n for name, n in nice if name.startswith("tf_XLA")}
  background = {name: n for name, n in nice if name.startswith(("zinfjax-optim", "zinfjax-io"))}
  assert len(program) == 1 and {"zinfjax-optim", "zinfjax-io"} <= set(background)
  assert set(background.values()) == {min(19, program.pop() + 5)}
  # a dropped run is freed: jax's jit caches keep the step's treedefs, which must not keep the
  # engine (its store's threads, its compiled programs) alive
  engine, store = weakref.ref(state.engine), weakref.ref(state.engine.store)
  del state
  gc.collect()
  assert engine() is None and store() is None


def thread_nice() -> list[tuple[str, int]]:
  """(name, nice) of this process's threads, from /proc."""
  out = []
  for tid in os.listdir("/proc/self/task"):
    stat = open(f"/proc/self/task/{tid}/stat").read()
    name = stat[stat.index("(") + 1:stat.rindex(")")]
    out.append((name, int(stat[stat.rindex(")") + 2:].split()[16])))
  return out


def test_corrupted_swap_file_between_steps_is_named(nvme_run, batches):
  path, state = nvme_run
  state, _ = zinfjax.train_step(state, batches[0], lm_loss)
  key = "p/blocks/block/fc/kernel/r3/l1"
  offset = state.engine.store.entry(key)["offset"]
  with open(path / "rank0" / "swap.bin", "r+b") as f:
    f.seek(offset + 100)
    f.write(b"\xde\xad\xbe\xef")
  with pytest.raises(Exception, match="checksum mismatch for shard 'p/blocks/block/fc/kernel/r3/l1'"):
    state, metrics = zinfjax.train_step(state, batches[1], lm_loss)
    float(metrics["loss"])


def test_unwritable_nvme_path(tmp_path, mesh):
  blocker = tmp_path / "a_file"
  blocker.write_text("not a folder")
  zero = zinfjax.ZeroConfig(offload_param="nvme", nvme_path=str(blocker / "nvme"))
  with pytest.raises(EngineError, match="nvme_path"):
    zinfjax.init(lambda r: GPT(TINY, rngs=r), make_tx(), zero, mesh, 0)


def test_not_enough_space_fails_before_writing(tmp_path, mesh):
  huge = get_config("tiny", num_layers=96, hidden=12288, num_heads=96)  # ~175B params
  zero = zinfjax.ZeroConfig(offload_param="nvme", offload_optimizer="nvme", nvme_path=str(tmp_path))
  with pytest.raises(NoSpaceError, match=r"need [\d.]+ TiB \(params [\d.]+ GiB.* optimizer .*\): free space"):
    zinfjax.init(lambda r: GPT(huge, rngs=r), make_tx(), zero, mesh, 0)
  swap = tmp_path / "rank0" / "swap.bin"
  assert not swap.exists() or os.path.getsize(swap) == 0


def test_host_optimizer_needs_zinfjax_adamw(mesh):
  zero = zinfjax.ZeroConfig(offload_optimizer="pinned_host")
  with pytest.raises(ValueError, match=r"needs tx=zinfjax.optim.adamw"):
    zinfjax.init(lambda r: GPT(TINY, rngs=r), optax.adamw(1e-3), zero, mesh, 0)
  clipped = optax.chain(optax.clip_by_global_norm(1.0), zinfjax.optim.adamw(1e-3))
  with pytest.raises(ValueError, match=r"adamw\(\.\.\., max_grad_norm=c\) instead of optax.chain"):
    zinfjax.init(lambda r: GPT(TINY, rngs=r), clipped, zero, mesh, 0)


@pytest.mark.parametrize("kwargs,match", [
    (dict(offload_param="nvme"), "nvme_path is not set"),
    (dict(offload_param="disk"), "offload_param must be one of"),
    (dict(stage=2, offload_optimizer="pinned_host"), "needs stage=3.*stage=3 with offload_param"),
    (dict(offload_param="pinned_host", offload_grad="device"), "offload_grad"),
    (dict(pinned_budget=1000), "pinned_budget"),
])
def test_bad_offload_config(kwargs, match):
  with pytest.raises(ValueError, match=match):
    zinfjax.ZeroConfig(**kwargs)


def test_swap_folder_of_another_run_is_reused_not_grown(tmp_path, mesh, batches):
  """A fresh run empties the swap folders it is given and sizes their files for its own states
  (grads included) at init, whatever a previous run left there: another model, stripe count."""
  first, second = tmp_path / "a", tmp_path / "b"
  wide = get_config("tiny", hidden=256)
  zero = zinfjax.ZeroConfig(precision="fp32", offload_param="nvme", offload_optimizer="nvme",
                            nvme_path=[str(first), str(second)])
  state = zinfjax.init(lambda r: GPT(wide, rngs=r), make_tx(), zero, mesh, 0)
  state.engine.store.close()
  swap = first / "rank0" / "swap.bin"
  wide_bytes = os.path.getsize(swap)

  # the same first folder, one stripe and a smaller model: no CorruptShardError, no growth
  zero = zinfjax.ZeroConfig(precision="fp32", offload_param="nvme", offload_optimizer="nvme",
                            nvme_path=str(first))
  state = zinfjax.init(lambda r: GPT(TINY, rngs=r), make_tx(), zero, mesh, 0)
  store = state.engine.store
  by_state = state.engine.plan.nvme_bytes()
  # the states, and a second copy of the params and optimizer for all-or-nothing steps
  need = sum(by_state.values()) + by_state["params"] + by_state["optimizer"]
  size = -(-need // (1 << 20)) << 20  # whole 1 MiB stripe units
  assert os.path.getsize(swap) == size < wide_bytes  # reserved at init, surplus given back
  entries = [store.entry(k) for k in store.keys()]  # only this run's shards, all inside it
  assert entries and all(e["offset"] + e["nbytes"] <= need for e in entries)
  state, metrics = zinfjax.train_step(state, batches[0], lm_loss)
  assert np.isfinite(float(metrics["loss"]))
  store.sync()
  assert os.path.getsize(swap) == size  # the grads written at step 1 had their space already
  assert store.stats()["bytes_used"] <= need
  store.close()


@pytest.mark.parametrize("param,optim,precision", [
    ("nvme", "nvme", "fp32"), ("nvme", "nvme", "bf16"), ("pinned_host:3,nvme", "pinned_host:5,nvme", "fp32"),
    ("device:2,nvme", "device:2,pinned_host", "fp32"),
    ("device:5,pinned_host", "device:3,pinned_host:4,nvme", "bf16")])
def test_init_draws_one_layer_at_a_time_with_the_same_values(param, optim, precision, mesh, tmp_path):
  """Stacked leaves not all on the device are drawn one layer at a time (host memory of one
  layer beyond what the tiers hold, whatever the depth), each layer put on its tier, with the
  values of the whole-model init bit for bit: params (bf16 ones cast by XLA) and master in
  every tier, and NVMe moments all zero."""
  from zinfjax.draw import layer_initializer, master_initializer
  config = get_config("tiny", num_layers=8)
  factory = lambda r: GPT(config, rngs=r)
  ref = zinfjax.init(factory, make_tx(), zinfjax.ZeroConfig(precision=precision), mesh, 7)
  zero = zinfjax.ZeroConfig(precision=precision, offload_param=param, offload_optimizer=optim,
                            nvme_path=str(tmp_path / "nvme"))
  state = zinfjax.init(factory, zinfjax.optim.adamw(1e-3), zero, mesh, 7)
  for got, want in zip(jax.tree.leaves(state.full_params()), jax.tree.leaves(ref.full_params())):
    assert got.dtype == want.dtype
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  moments = [k for k in state.engine.store.keys() if k.startswith(("o/m/", "o/v/"))]
  assert bool(moments) == ("nvme" in optim)
  assert not any(state.engine.store.read(k).wait().any() for k in moments)
  if precision == "bf16":  # the NVMe shards: fp32 master and bf16 params, those of the reference
    plan, store, checked = state.engine.plan, state.engine.store, 0
    for name, dtype in (("master", np.float32), ("params", jnp.bfloat16)):
      for leaf, (full,) in zip(plan.leaves, plan.flatten(getattr(ref, name))):
        for rank in plan.ranks:
          for layer in range(leaf.num_layers if leaf.stacked else 1):
            if leaf.tier(name, layer) == "nvme":
              got = store.read(leaf.key(name, rank, layer)).wait()
              want = np.asarray(full)[plan.region(leaf, rank, layer)].reshape(got.shape)
              assert got.dtype == dtype
              np.testing.assert_array_equal(got, want)
              checked += 1
    assert checked > (200 if param == "nvme" else 30)
  plan = state.engine.plan
  for name, tree in (("params", state.params), ("master", state.master)):
    for leaf, parts in zip(plan.leaves, plan.flatten(tree)):
      segs = leaf.array_segments(name)
      assert len(parts) == len(segs), (leaf.name, name)
      for part, seg in zip(parts, segs):  # each array part in its tier, with its layers' values
        assert part.sharding.memory_kind == seg.tier and part.shape == leaf.segment_shape(seg)
  if param != "nvme":
    fc = next(l for l in plan.leaves if l.name == "blocks/block/fc/kernel")
    (first,) = plan.flatten(state.master)[fc.index][:1]
    want = plan.flatten(ref.master)[fc.index][0]
    np.testing.assert_array_equal(np.asarray(first), np.asarray(want)[:first.shape[0]])
  engine = state.engine
  fc = next(l for l in engine.plan.leaves if l.name == "blocks/block/fc/kernel")
  key = jax.random.key(7)
  one = layer_initializer(engine, factory, [fc.index]).lower(key, 0).compile().memory_analysis()
  whole = master_initializer(engine, factory, [fc.index]).lower(key).compile().memory_analysis()
  layer_bytes = 4 * fc.local_size  # one device's shard of one layer (the analysis is per device)
  assert one.output_size_in_bytes == layer_bytes
  assert one.temp_size_in_bytes + one.output_size_in_bytes <= 5 * layer_bytes  # RNG temporaries
  assert whole.temp_size_in_bytes + whole.output_size_in_bytes >= 8 * layer_bytes
  engine.store.close()


@pytest.mark.parametrize("dtype", [np.float32, jnp.bfloat16])
def test_pinned_reads_equal_plain_reads(mesh, monkeypatch, dtype):
  """On an accelerator the step's grad reads cross through a pinned-host copy of each device
  shard (`shards.pinned_reads`: one DMA, which numpy views, where XLA's plain transfer stages
  it); forced on the CPU, every shard, whole or one layer of it, reads as the plain read does,
  from a pinned-host array; a shard in pinned host already is read as it is; a read that does
  not ask for the pinned route (init's, checkpoints') never takes it."""
  from jax.sharding import NamedSharding, PartitionSpec as P
  from zinfjax import shards
  x = jax.device_put(np.random.default_rng(0).standard_normal((3, 32, 6)).astype(dtype),
                     NamedSharding(mesh, P(None, "data")))
  plain = {layer: shards.host_shards(x, mesh, layer) for layer in (None, 1)}
  assert not shards.pinned_reads(mesh.devices.flat[0])  # a CPU: numpy views the shard itself
  monkeypatch.setenv(shards.PINNED_READS, "1")
  assert shards.pinned_reads(mesh.devices.flat[0])
  for layer in (None, 1):
    started = shards.start_host_shards(x, mesh, layer, pinned=True)
    assert {a.sharding.memory_kind for a in started.values()} == {"pinned_host"}
    got = shards.to_host(started)
    assert got.keys() == plain[layer].keys() and len(got) == 8
    for rank, want in plain[layer].items():
      assert np.any(want != 0) and got[rank].dtype == want.dtype
      np.testing.assert_array_equal(got[rank], want)
    unasked = shards.start_host_shards(x, mesh, layer)  # the plain way, even where forced
    assert {a.sharding.memory_kind for a in unasked.values()} == {"device"}
  held = jax.device_put(x, x.sharding.with_memory_kind("pinned_host"))
  for rank, a in shards.start_host_shards(held, mesh, pinned=True).items():  # (no device op)
    assert a.sharding.memory_kind == "pinned_host"
    np.testing.assert_array_equal(np.asarray(a), plain[None][rank])
  monkeypatch.setenv(shards.PINNED_READS, "0")
  assert not shards.pinned_reads(mesh.devices.flat[0])
  for a in shards.start_host_shards(x, mesh, pinned=True).values():
    assert a.sharding.memory_kind == "device"


def test_init_reads_the_plain_way_where_pinned_reads_are_on(mesh, tmp_path, monkeypatch):
  """XLA:GPU's pinned-host pool keeps the most it has lent at once for the life of the
  process, so init, which reads an fp32 layer of the master (or a whole leaf) at a time, two
  layers in flight, must not take the pinned route: with pinned reads forced on, init of
  device layers and store layers (RAM's and the drive's) reads them all the plain way."""
  from zinfjax import draw
  from zinfjax.shards import PINNED_READS
  config = get_config("tiny", num_layers=8)
  kinds, start = [], draw.start_host_shards
  def spied(x, m, layer=None, pinned=False):
    out = start(x, m, layer, pinned)
    kinds.extend(a.sharding.memory_kind for a in out.values())
    return out
  monkeypatch.setattr(draw, "start_host_shards", spied)
  monkeypatch.setenv(PINNED_READS, "1")
  zero = zinfjax.ZeroConfig(precision="bf16", offload_param="device:5,pinned_host",
                            offload_optimizer="device:3,pinned_host:4,nvme",
                            host_optimizer="pipeline", nvme_path=str(tmp_path))
  state = zinfjax.init(lambda r: GPT(config, rngs=r), zinfjax.optim.adamw(1e-3), zero, mesh, 7)
  assert any(k.startswith("p/") for k in state.engine.store.keys())  # store params written
  assert kinds and set(kinds) == {"device"}, set(kinds)  # read, and never through pinned host
  state.engine.store.close()


def test_init_keeps_device_params_off_the_host(mesh, monkeypatch):
  """Params on the device with their optimizer in RAM's store (the largest model's plan):
  init fills each device segment in HBM in place, layer by layer, cast by XLA; no layer of it
  waits in a host buffer (before: the whole segment of a leaf, 6.7 layers here, growing with
  depth), no bf16 cast of a layer crosses to the host (the store keeps no compute params here:
  on a GPU each crossed 2 bytes a param), and each layer goes into its donated segment with no
  second copy of it in HBM."""
  import tracemalloc
  from zinfjax import draw
  crossed = []  # the dtypes of what init reads to the host (on CPU, views: not traced below)
  real = draw.host_shards
  monkeypatch.setattr(draw, "host_shards", lambda x, *a, **k: crossed.append(x.dtype) or real(
      x, *a, **k))
  wide = get_config("tiny", num_layers=8, hidden=256, num_heads=4)  # the params outweigh the rest
  zero = zinfjax.ZeroConfig(precision="bf16", offload_param="device",
                            offload_optimizer="pinned_host", host_optimizer="pipeline")
  factory = lambda r: GPT(wide, rngs=r)
  zinfjax.init(factory, make_tx(), zero, mesh, 0).engine.store.close()  # compiled, traced
  # when each drawn layer's copy to the host starts, against when the layers are put
  events, start, put = [], draw.start_host_shards, draw._LayerFill.put
  monkeypatch.setattr(draw, "start_host_shards", lambda x, *a: events.append(
      ("start", x.dtype)) or crossed.append(x.dtype) or start(x, *a))
  monkeypatch.setattr(draw._LayerFill, "put", lambda self, layer, *a: events.append(
      ("put", layer)) or put(self, layer, *a))
  tracemalloc.start()
  try:
    state = zinfjax.init(factory, make_tx(), zero, mesh, 0)
    jax.block_until_ready(state.params)
    peak = tracemalloc.get_traced_memory()[1]
  finally:
    tracemalloc.stop()
  plan = state.engine.plan
  assert kinds(state.params) == {"device"} and plan.leaves[0].num_layers == 8
  layer = sum(l.local_size for l in plan.leaves if l.stacked) * len(plan.ranks) * 2
  assert peak < 1.5 * layer, (peak / layer, layer)  # 0.85 of a bf16 layer measured
  assert crossed and set(crossed) == {np.dtype(np.float32)}, crossed  # the master alone
  # each layer's master starts crossing before the layer before it is put: it crosses while
  # the host writes that one to the store
  assert {e[1] for e in events if e[0] == "start"} == {np.dtype(np.float32)}
  before = [sum(e[0] == "start" for e in events[:events.index(("put", k))]) for k in range(8)]
  per_layer = before[0] // 2
  assert per_layer > 0 and before == [(k + 2) * per_layer for k in range(7)] + [
      8 * per_layer], before
  from jax.sharding import NamedSharding, PartitionSpec
  from zinfjax.shards import set_layer
  for leaf, (x,) in zip(plan.leaves, plan.flatten(state.params)):
    if leaf.stacked:
      one = jax.ShapeDtypeStruct(x.shape[1:], jnp.float32,
                                 sharding=NamedSharding(mesh, PartitionSpec(*x.sharding.spec[1:])))
      used = set_layer(x.sharding).lower(x, one, np.int32(1)).compile().memory_analysis()
      assert used.alias_size_in_bytes == used.output_size_in_bytes > 0, used
      assert used.temp_size_in_bytes <= x.nbytes // x.shape[0] // len(plan.ranks), used
  state.engine.store.close()


def test_init_and_load_report_the_params_placed(mesh, tmp_path, monkeypatch):
  """`init(progress=...)` hears of the params placed as they are (layer by layer where the
  stacks are drawn so), in order, ending at every param of the model: for a random init and
  for a load of existing weights; `init_line` words it."""
  import io
  from flax import nnx
  from zinfjax import progress
  monkeypatch.setattr(progress, "REPORT_EVERY_S", 0.0)  # every layer and leaf reported
  config = get_config("tiny", num_layers=4)
  factory = lambda r: GPT(config, rngs=r)
  total = sum(x.size for x in jax.tree.leaves(nnx.state(nnx.eval_shape(lambda: factory(
      nnx.Rngs(0))), nnx.Param)))
  for i, weights in enumerate((None, nnx.state(factory(nnx.Rngs(3)), nnx.Param))):
    heard = []
    zero = zinfjax.ZeroConfig(offload_optimizer="nvme", nvme_path=str(tmp_path / f"nvme{i}"))
    state = zinfjax.init(factory, zinfjax.optim.adamw(1e-3), zero, mesh, 0, params=weights,
                         progress=lambda done, all_, s: heard.append((done, all_, s)))
    done = [d for d, _, _ in heard]
    assert len(heard) > config.num_layers and done == sorted(done) and done[0] > 0, heard
    assert {a for _, a, _ in heard} == {total} and done[-1] == total
    if weights is None:  # the stacked leaves drawn (and reported) one layer at a time
      layer = sum(l.size // l.num_layers for l in state.engine.plan.leaves if l.stacked)
      steps = [b - a for a, b in zip([0, *done], done)]
      assert steps.count(layer) >= config.num_layers, (steps, layer)
    state.engine.store.close()
  out = io.StringIO()
  progress.init_line(out, "loading")(7_800_000_000, 17_300_000_000, 12.0)
  assert out.getvalue() == "loading  45% | 7.8B of 17.3B params | 12 s, about 15 s left\n"
