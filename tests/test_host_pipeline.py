"""host_optimizer="pipeline": the pinned-host optimizer states in a swap store in host RAM,
updated in place by the host pipeline (the C++ AdamW on host threads). It trains bit for bit
like the update inside XLA's host computation, checkpoints move between the two, and the
memory store itself lends its shards without copies and without outliving its owner."""

import threading

import jax
import numpy as np
import pytest

import zinfjax
from zinfjax.checkpoint import Checkpointer
from zinfjax.models import GPT, get_config, lm_loss
from zinfjax.offload import AioStore
from zinfjax.placement import Tier

from helpers import (assert_same_training, clipped_adamw, four_layer_gpt, scalar_threads,
                     skipped_step, text_batches, zero_training)

STEPS = 6
factory, tx = four_layer_gpt, clipped_adamw


@pytest.fixture(scope="module")
def batches():
  return text_batches(STEPS, batch=16, seq=32, seed=4)


# (params, optimizer, precision, clip): with clipping on (0.5 is below the tiny GPT's grad
# norms: every step clips), per-layer splits, bf16 compute params
CASES = [("device", "pinned_host", "fp32", None),
         ("pinned_host", "pinned_host", "fp32", 0.5),
         ("device:2,pinned_host", "device:1,pinned_host", "bf16", 0.5),
         # the largest model's plan: every param on the device, some layers' optimizer too
         ("device", "device:1,pinned_host", "bf16", 0.5)]


@pytest.mark.parametrize("param,optimizer,precision,clip", CASES)
def test_host_pipeline_trains_bit_for_bit_like_xla(param, optimizer, precision, clip, mesh,
                                                   batches):
  zero = zinfjax.ZeroConfig(precision=precision, offload_param=param, offload_optimizer=optimizer)
  xla_losses, xla = zero_training(factory, tx(clip), zero, mesh, batches, lm_loss)
  losses, state = zero_training(factory, tx(clip), zero.replace(host_optimizer="pipeline"), mesh,
                                batches, lm_loss)
  engine = state.engine
  assert engine.store.memory and engine.pipeline is not None and engine.config.host_store
  # every pinned-host state is in the store: params and grads too, where they were placed
  in_store = {s for l in engine.plan.leaves for s in ("params", "grads", "master")
              if any(seg.tier == Tier.HOST_STORE for seg in l.segments(s))}
  assert in_store == ({"params", "grads", "master"} if "pinned_host" in param else {"master"})
  assert engine.pipeline.last_step["bytes_read"] == 0  # updated in place: no copies
  assert losses[-1] < losses[0]
  assert_same_training(losses, state, xla_losses, xla)
  state.close()


@pytest.mark.parametrize("param", ["pinned_host", "device:1,pinned_host"])
def test_host_pipeline_updates_under_backward(param, mesh, batches):
  """Without clipping or skipping, the host pipeline updates each layer as soon as backward
  has written its grads into the memory store (the step's program still running), and trains
  bit for bit as the XLA host update does."""
  zero = zinfjax.ZeroConfig(precision="bf16", offload_param=param,
                            offload_optimizer="pinned_host", skip_nonfinite=False)
  xla_losses, xla = zero_training(factory, tx(None), zero, mesh, batches, lm_loss)
  state = zinfjax.init(factory, tx(None), zero.replace(host_optimizer="pipeline"), mesh, 0)
  threads = scalar_threads(state.engine.pipeline)
  losses = []
  for batch in batches:
    state, metrics = zinfjax.train_step(state, batch, lm_loss)
    losses.append(float(metrics["loss"]))
    assert "nvme_grad_waits" in metrics  # the update ran beside the program, gated per grad
  assert_same_training(losses, state, xla_losses, xla)
  # its device work is done before the program is dispatched, none on the pipeline's thread
  assert threads == {threading.main_thread().name}
  state.close()
  xla.close()


def test_checkpoints_move_between_the_host_pipeline_and_xla(mesh, batches, tmp_path):
  """Saved from the host pipeline (its moments in the memory store), restored under the XLA
  host update: the rest of the run equals one that never left XLA."""
  zero = zinfjax.ZeroConfig(precision="fp32", offload_param="pinned_host",
                            offload_optimizer="pinned_host")
  straight, _ = zero_training(factory, tx(0.5), zero, mesh, batches, lm_loss)
  half, state = zero_training(factory, tx(0.5), zero.replace(host_optimizer="pipeline"), mesh,
                              batches[:3], lm_loss)
  with Checkpointer(tmp_path / "ckpt") as ckpt:
    ckpt.save(state)
    ckpt.wait()
    state.close()
    state, _ = ckpt.restore(factory, tx(0.5), zero, mesh)
  losses = []
  for batch in batches[3:]:
    state, metrics = zinfjax.train_step(state, batch, lm_loss)
    losses.append(float(metrics["loss"]))
  np.testing.assert_array_equal(np.concatenate([half, losses]), straight)


def test_auto_picks_the_pipeline_on_a_gpu_alone(mesh):
  """host_optimizer="auto" (the default) is the host pipeline on a GPU with zinfjax's CUDA
  handlers and XLA's host update elsewhere; a value given is kept. The engine settles it for
  its mesh: on this CPU mesh the pinned-host states stay arrays, no store."""
  zero = zinfjax.ZeroConfig(offload_param="pinned_host", offload_optimizer="pinned_host")
  assert zero.host_optimizer == "auto"
  picked = lambda z, *where: z.for_platform(*where).host_optimizer
  assert picked(zero, "gpu", True) == picked(zero, "cuda", True) == "pipeline"
  assert picked(zero, "gpu", False) == picked(zero, "cpu", True) == "xla"
  for given in ("xla", "stream", "pipeline"):
    assert picked(zero.replace(host_optimizer=given), "gpu", True) == given
  planned = zinfjax.abstract_init(four_layer_gpt, zinfjax.optim.adamw(1e-3), zero, mesh)
  assert planned.engine.config.host_optimizer == "xla" and planned.engine.store is None


def test_host_pipeline_config_is_checked(mesh, tmp_path):
  with pytest.raises(ValueError,
                     match="host_optimizer must be one of 'auto', 'xla', 'pipeline', 'stream'"):
    zinfjax.ZeroConfig(host_optimizer="cpu")
  # the RAM store's tier is made by with_host_pipeline, never named
  with pytest.raises(ValueError, match="must be one of"):
    zinfjax.ZeroConfig(offload_optimizer="host_store", host_optimizer="pipeline")
  with pytest.raises(ValueError, match="name 'pinned_host' and set host_optimizer='pipeline'"):
    zinfjax.ZeroConfig(offload_optimizer=((Tier.HOST_STORE, None),))
  # nothing on pinned host, or no optimizer state off the device: nothing for the pipeline
  for zero in (zinfjax.ZeroConfig(host_optimizer="pipeline"),
               zinfjax.ZeroConfig(offload_param="pinned_host", host_optimizer="pipeline")):
    assert zero.with_host_pipeline() is zero
  mapped = zinfjax.ZeroConfig(offload_optimizer="device:1,pinned_host",
                              host_optimizer="pipeline").with_host_pipeline()
  assert mapped.host_store and not mapped.nvme_atomic_steps and mapped.nvme_paths == []
  assert [str(t) for t, _ in mapped.optimizer_split] == ["device", "host_store"]
  assert mapped.uses_store and not mapped.uses_nvme
  # with the drive too: params in RAM's store, the optimizer on the drive's, steps all or
  # nothing as nvme_atomic_steps says (host_atomic_steps is for RAM alone)
  both = zinfjax.ZeroConfig(offload_param="pinned_host", offload_optimizer="pinned_host:1,nvme",
                            nvme_path=str(tmp_path), host_optimizer="pipeline").with_host_pipeline()
  assert [str(t) for t, _ in both.param_split] == ["host_store"]
  assert [str(t) for t, _ in both.optimizer_split] == ["host_store", "nvme"]
  assert both.nvme_atomic_steps and both.uses_nvme and both.nvme_paths == [str(tmp_path)]


def test_memory_store_lends_its_shards_in_place():
  """A memory store's `view` is the shard itself: changes are read back, a rolled-back write
  in a transaction leaves the view's bytes, and a view outlives a closed store safely."""
  store = AioStore([], memory=True)
  x = np.random.default_rng(0).standard_normal((3, 5)).astype(np.float32)
  store.write("o/m/a", x).wait()
  view = store.view("o/m/a")
  assert view.shape == (3, 5) and view.dtype == np.float32
  np.testing.assert_array_equal(view, x)
  view *= 2
  np.testing.assert_array_equal(store.read("o/m/a").wait(), 2 * x)
  store.begin(["o/"])
  store.write("o/m/a", np.zeros_like(x)).wait()
  store.rollback()
  np.testing.assert_array_equal(store.read("o/m/a").wait(), 2 * x)
  store.close()
  np.testing.assert_array_equal(view, 2 * x)  # the mapping lives as long as the view


def test_memory_store_stages_the_step_copy_in_a_transaction(tmp_path):
  """`stage` outside a transaction is the shard itself; inside one that versions the key, the
  committed copy to read and a fresh extent to write, nothing copied: readers see the new
  copy, a second stage finds it, rollback brings back the committed bytes, commit keeps the
  new ones, and steps reuse the extents they free. A drive's store does not stage."""
  store = AioStore([], memory=True)
  x = np.random.default_rng(1).standard_normal((4, 6)).astype(np.float32)
  store.write("o/m/a", x).wait()
  store.write("g/a", x + 1).wait()
  src, dst = store.stage("o/m/a")
  assert src is dst and np.shares_memory(dst, store.view("o/m/a"))
  store.begin(["o/"])
  src, dst = store.stage("o/m/a")
  assert src is not dst and not np.shares_memory(src, dst)
  np.testing.assert_array_equal(src, x)
  dst[...] = 3 * x
  np.testing.assert_array_equal(store.read("o/m/a").wait(), 3 * x)
  again_src, again_dst = store.stage("o/m/a")
  assert again_src is again_dst and np.shares_memory(again_dst, dst)
  g_src, g_dst = store.stage("g/a")  # not versioned: in place
  assert g_src is g_dst
  store.rollback()
  np.testing.assert_array_equal(store.read("o/m/a").wait(), x)
  used = []
  for step in range(4):
    store.begin(["o/"])
    src, dst = store.stage("o/m/a")
    dst[...] = src * 2
    store.commit()
    np.testing.assert_array_equal(store.read("o/m/a").wait(), x * 2.0 ** (step + 1))
    used.append(store.stats()["bytes_used"])
  assert used[1:] == used[:-1]  # two extents for the key, reused step after step
  store.close()
  drive = AioStore(tmp_path, backend="threads", fresh=True)
  drive.write("o/m/a", x).wait()
  with pytest.raises(zinfjax.offload.EngineError, match="only a host-memory store stages"):
    drive.stage("o/m/a")
  drive.close()


def test_host_pipeline_needs_zinfjax_adamw(mesh):
  """Another optax transformation is refused before anything is allocated, naming the tier as
  the user gave it (not the store the pipeline uses)."""
  import optax
  zero = zinfjax.ZeroConfig(offload_optimizer="pinned_host", host_optimizer="pipeline")
  with pytest.raises(ValueError, match="offload_optimizer='pinned_host' runs zinfjax's AdamW"):
    zinfjax.abstract_init(factory, optax.sgd(1e-3), zero, mesh)


def test_all_or_nothing_host_steps_update_under_backward_with_clipping_and_skips(mesh, batches):
  """host_atomic_steps: with clipping on every step and a NaN step skipped, the host pipeline
  still updates under backward (speculatively, rolled back where the norm says so), the NaN
  step changes nothing, and the run trains bit for bit as the XLA host update does without it;
  the RAM store holds the copies the all-or-nothing steps need."""
  zero = zinfjax.ZeroConfig(precision="bf16", offload_param="pinned_host",
                            offload_optimizer="pinned_host")
  scaled = lambda model, batch: lm_loss(model, batch) * batch["scale"][0]
  good = [dict(b, scale=np.ones((16,), np.float32)) for b in batches]
  bad = dict(good[1], scale=np.full((16,), np.nan, np.float32))
  xla_losses, xla = zero_training(factory, tx(0.5), zero, mesh, good, scaled)
  state = zinfjax.init(factory, tx(0.5), zero.replace(host_optimizer="pipeline",
                                                      host_atomic_steps=True), mesh, 0)
  assert state.engine.config.nvme_atomic_steps and state.engine.store.memory
  assert state.engine.plan.nvme_disk_bytes(True, tier=Tier.HOST_STORE)["copies"] > 0
  losses = []
  for i, batch in enumerate(good):
    if i == 2:
      state = skipped_step(state, bad, scaled)
    state, metrics = zinfjax.train_step(state, batch, scaled)
    assert "nvme_grad_waits" in metrics and int(metrics["skipped"]) == 0  # beside the program
    losses.append(float(metrics["loss"]))
  assert_same_training(losses, state, xla_losses, xla)
  with pytest.raises(ValueError, match="host_atomic_steps must be True or False"):
    zinfjax.ZeroConfig(host_atomic_steps="yes")
  state.close()
  xla.close()


def test_memory_store_moves_shards_by_copy_and_lends_its_mapping(monkeypatch):
  """A memory store's reads and writes copy between the mapping and the caller's buffer (no
  blocks, no checksum: four times as fast as through its file on a 2-core VM), on random data
  of sizes not a multiple of the alignment, into given and own buffers, inside transactions.
  The swap calls of a step copy straight from and into the mapping: the host pipeline borrows
  no buffer (the CUDA calls do so where the mapping is page-locked). Where buffers are
  borrowed, the RAM store a plan opens keeps them whatever `pinned_budget` says: with 1 MiB,
  a 2 x 256 GPT's step made 10 new ones (each allocated, and page-locked on a GPU, again).
  ZINFJAX_LEND_MAPPING=0 borrows them again, and trains the same."""
  rng = np.random.default_rng(5)
  store = AioStore([], memory=True)
  xs = {f"p/{i}": rng.standard_normal(n).astype(np.float32) for i, n in enumerate((1, 1027, 300_001))}
  for key, x in xs.items():
    store.write(key, x).wait()
  for key, x in xs.items():
    out = np.full_like(x, np.nan)
    store.read(key, out).wait()
    np.testing.assert_array_equal(out, x)
    np.testing.assert_array_equal(store.read(key).wait(), x)
  store.begin(["p/"])
  store.write("p/1", -xs["p/1"]).wait()
  np.testing.assert_array_equal(store.read("p/1").wait(), -xs["p/1"])
  store.rollback()
  np.testing.assert_array_equal(store.read("p/1").wait(), xs["p/1"])
  store.close()

  config = get_config("tiny", num_layers=2, hidden=256, num_heads=4, seq_len=32)
  zero = lambda pipeline: zinfjax.ZeroConfig(
      precision="fp32", offload_param="pinned_host", offload_optimizer="pinned_host",
      host_optimizer="pipeline" if pipeline else "xla", pinned_budget=1 << 20,
      skip_nonfinite=False)
  losses, made = {}, {}
  for how in ("lent", "borrowed", "xla"):
    monkeypatch.setenv("ZINFJAX_LEND_MAPPING", "0" if how == "borrowed" else "1")
    state = zinfjax.init(lambda r: GPT(config, rngs=r), zinfjax.optim.adamw(1e-3),
                         zero(how != "xla"), zinfjax.make_mesh(1), 0)
    losses[how], made[how] = [], []
    for batch in text_batches(4, batch=2, seq=32, seed=6):
      state, metrics = zinfjax.train_step(state, batch, lm_loss)
      losses[how].append(float(metrics["loss"]))
      if how != "xla":
        made[how].append(state.engine.store.stats()["buffers_made"][0])
    if how == "lent":
      lent = state.engine.plan.lent_bytes(Tier.HOST_STORE)
      stats = state.engine.store.stats()
      assert lent > 8 << 20  # layers far above the 1 MiB asked for
      assert stats["pool"]["budget_bytes"] > lent - (1 << 20)  # in whole 1 MiB blocks
      assert stats["bytes_read"] > 0 and stats["bytes_written"] > 0
    state.close()
  assert made["lent"] == [0] * 4
  # kept, not made again: at most one more after the first step (a buffer that first meets
  # another of its size in flight), where 10 a step were made before
  assert made["borrowed"][0] > 0 and made["borrowed"][-1] - made["borrowed"][0] <= 1, made
  assert losses["lent"] == losses["borrowed"] == losses["xla"]


def test_device_params_cross_the_host_once_a_layer_at_a_time(mesh, batches, monkeypatch):
  """Params on the device, their optimizer in the RAM store: the step reads the grads to the
  host a layer at a time (not a whole segment of layers), and each layer's new params go back
  to the device as soon as they are made, so the host holds about one layer of them, not
  every layer until the update ends. At 13B params the whole segments took the step out of
  host RAM on an H100."""
  import tracemalloc
  from zinfjax import runner
  zero = zinfjax.ZeroConfig(precision="bf16", offload_param="device",
                            offload_optimizer="pinned_host", host_optimizer="pipeline")
  wide = get_config("tiny", num_layers=4, hidden=256, num_heads=4)  # the params outweigh the rest
  state = zinfjax.init(lambda r: GPT(wide, rngs=r), tx(None), zero, mesh, 0)
  state, _ = zinfjax.train_step(state, batches[0], lm_loss)  # compiled
  read, start = [], runner.start_host_shards
  monkeypatch.setattr(runner, "start_host_shards", lambda x, m, layer=None, pinned=False: (
      read.append(x.shape if layer is None else x.shape[1:]) or start(x, m, layer, pinned)))
  tracemalloc.start()
  try:
    state, _ = zinfjax.train_step(state, batches[1], lm_loss)
    jax.block_until_ready(state.params)
    peak = tracemalloc.get_traced_memory()[1]
  finally:
    tracemalloc.stop()
  plan = state.engine.plan
  shapes = {l.layout.storage_shape[1:] if l.stacked else l.layout.storage_shape
            for l in plan.leaves}
  assert read and all(s in shapes for s in read), read  # one layer's grads a read
  # about one layer's new params in bf16 at a time, and the Python objects of the grads' device
  # shards on their way (a layer ahead; on a CPU their data are views): 1.3 layers measured
  # before the read ahead, 1.6 with it at this tiny size; every layer in one buffer a segment,
  # put back after the update: 4.1 layers; stacked again: 6
  layer = sum(l.local_size for l in plan.leaves if l.stacked) * len(plan.ranks) * 2
  assert peak < 2 * layer, (peak / layer, layer)
  # the host arrays of new params serve again once their copy is on the device: a step makes
  # no new ones but for a few shards of the leaf put last (of the 8 ranks' 4 layers of each
  # leaf), and keeps at most a layer of each leaf
  pool, parts = state.engine.pipeline.pool, sum(l.num_layers for l in plan.leaves) * 8
  made = pool.made
  state, _ = zinfjax.train_step(state, batches[2], lm_loss)
  assert pool.made - made < len(plan.ranks) < parts, (pool.made - made, parts)
  assert 0 < pool.bytes <= sum(l.local_size for l in plan.leaves) * len(plan.ranks) * 2
  # each layer goes into its donated array in place: no second copy of a stack on the device
  from zinfjax.shards import set_layer
  for leaf, (x,) in zip(plan.leaves, plan.flatten(state.params)):
    if leaf.stacked:
      one = jax.device_put(np.zeros((1, *x.shape[1:]), x.dtype), x.sharding)
      used = set_layer(x.sharding).lower(x, one, np.int32(1)).compile().memory_analysis()
      assert used.alias_size_in_bytes == used.output_size_in_bytes > 0, used
      assert used.temp_size_in_bytes == 0, used
  state.close()


@pytest.mark.parametrize("pinned", ["0", "1"])  # read as on a CPU, or through pinned host
def test_device_grads_cross_a_layer_ahead_of_the_update(pinned, mesh, monkeypatch):
  """The host pipeline reads the device layers' grads in the order it updates them; as it
  takes one, the copies of those after it start, up to a layer of the stack ahead
  (`autoplace.read_bytes` counts them), so a layer crosses while the update runs on the one
  before. Each is copied once a pass (again for a redone update) and is the program's."""
  from zinfjax import runner
  from zinfjax.optim.stream import Part
  from zinfjax.shards import PINNED_READS, host_shards
  zero = zinfjax.ZeroConfig(precision="bf16", offload_param="device",
                            offload_optimizer="pinned_host", host_optimizer="pipeline")
  state = zinfjax.init(factory, tx(None), zero, mesh, 0)
  monkeypatch.setenv(PINNED_READS, pinned)
  plan, pipeline = state.engine.plan, state.engine.pipeline
  rng = np.random.default_rng(0)  # random arrays shaped and placed as the program's grads
  grads = jax.tree.map(lambda x: jax.device_put(
      rng.standard_normal(x.shape).astype(x.dtype), x.sharding), state.params)
  order = pipeline.array_grad_order()
  assert sorted(order) == sorted({(p.leaf, p.layer) for p in pipeline.parts})
  stacked = [layer for leaf, layer in order if plan.leaves[leaf].stacked]
  assert stacked == sorted(stacked, reverse=True)  # as backward writes them: the last first
  flat = plan.flatten(grads)
  leaf_of = {id(x): leaf for leaf, parts in enumerate(flat) for x in parts}
  started, start, kinds = [], runner.start_host_shards, set()
  def spied(x, m, layer=None, pinned=False):
    started.append((leaf_of[id(x)], layer or 0))
    out = start(x, m, layer, pinned)
    kinds.update(a.sharding.memory_kind for a in out.values())
    return out
  monkeypatch.setattr(runner, "start_host_shards", spied)
  size = lambda key: plan.leaves[key[0]].local_size * len(plan.ranks) * 2
  ahead = plan.stack_layer_size * len(plan.ranks) * 2
  assert ahead < sum(size(k) for k in order) / 3  # a window, not the whole step's grads
  grad_of = runner.grad_reader(plan, lambda: grads, order)
  for _ in range(2):  # the second pass: an update redone with clipping reads them again
    started.clear()
    for n, (leaf, layer) in enumerate(order):
      whole = host_shards(flat[leaf][0], plan.mesh)
      for r in plan.ranks:
        g = grad_of(Part(leaf, r, layer, 0))
        want = whole[r][layer] if plan.leaves[leaf].stacked else whole[r]
        np.testing.assert_array_equal(g, want)
        assert np.any(g != 0)
      # started in order, once each: the next ones while a layer of the stack fits ahead
      m = n + 1
      while m < len(order) and sum(size(k) for k in order[n + 1:m + 1]) <= ahead:
        m += 1
      assert started == order[:m], (n, started[n:], order[n:m])
      assert m > n + 1 or n + 1 == len(order)
    assert len(started) == len(order)
  assert kinds == {"pinned_host" if pinned == "1" else "device"}, kinds  # the route asked for
  state.close()
