"""zinfjax.optim.adamw on every tier against optax.adamw, and the fused C++ kernel."""

import dataclasses
import os
import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest
from flax import nnx

import zinfjax
from zinfjax.models import GPT, get_config, lm_loss
from zinfjax.optim.adam import OffloadedTransformation
from zinfjax.optim.kernel import AdamConstants, adamw_jnp, adamw_numpy

from helpers import text_batches

TIERS = ["device", "pinned_host", "nvme"]
STEPS = 100


def make_params(dtype=jnp.float32, seed=0):
  rng = np.random.default_rng(seed)
  return {"w": jnp.asarray(rng.standard_normal((37, 65)), dtype),
          "b": jnp.asarray(rng.standard_normal(1001), dtype),
          "scale": {"s": jnp.asarray(rng.standard_normal(7) + 1.0, dtype)}}


def grad_noise(params, steps, seed=1):
  rng = np.random.default_rng(seed)
  return [jax.tree.map(lambda p: jnp.asarray(rng.standard_normal(p.shape), jnp.float32), params)
          for _ in range(steps)]


def train(tx, params, noise):
  """`steps` updates with fresh random grads that also depend on the params."""
  state = tx.init(params)

  @jax.jit
  def step(params, state, noise):
    grads = jax.tree.map(lambda p, e: (e + 0.5 * p.astype(jnp.float32)).astype(p.dtype), params, noise)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  for n in noise:
    params, state = step(params, state, n)
  return params, state


def rel_err(a, b):
  return max(float(jnp.max(jnp.abs(x.astype(jnp.float32) - y)) / jnp.max(jnp.abs(y)))
             for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def offloaded(tmp_path, offload, *args, **kwargs):
  return zinfjax.optim.adamw(*args, offload=offload, nvme_path=str(tmp_path / "nvme"),
                             sub_group_size=1024, **kwargs)


SCHEDULE = optax.warmup_cosine_decay_schedule(0.0, 1e-2, 10, STEPS)
MASK = lambda p: {"w": True, "b": False, "scale": {"s": False}}


@pytest.fixture(scope="module")
def reference():
  params = make_params()
  noise = grad_noise(params, STEPS)
  return params, noise, train(optax.adamw(SCHEDULE, weight_decay=0.1, mask=MASK), params, noise)[0]


@pytest.mark.parametrize("offload", TIERS)
def test_matches_optax_adamw_for_100_steps(offload, tmp_path, reference):
  params, noise, want = reference
  tx = offloaded(tmp_path, offload, SCHEDULE, weight_decay=0.1, mask=MASK)
  got, state = train(tx, params, noise)
  assert rel_err(got, want) < 1e-6
  assert rel_err(got, params) > 1e-2  # it really trained
  assert int(state.count) == STEPS
  if offload == "pinned_host":
    assert {x.sharding.memory_kind for x in jax.tree.leaves((state.master, state.mu))} == {"pinned_host"}
  if offload == "nvme":
    assert len(jax.tree.leaves(state)) == 1  # only the count: the states live on disk
    parts = tx.nvme.parts  # leaves cut into sub-groups of at most sub_group_size elements
    assert len(tx.nvme.store.keys()) == 3 * len(parts) and len(parts) > 3
    assert max(p.size for p in parts) == 1024


@pytest.mark.parametrize("offload", TIERS)
def test_bf16_params_are_the_rounded_master(offload, tmp_path):
  params = make_params(jnp.bfloat16)
  tx = offloaded(tmp_path, offload, 3e-3, weight_decay=0.1)
  got, state = train(tx, params, grad_noise(params, 5))
  assert {x.dtype for x in jax.tree.leaves(got)} == {jnp.dtype(jnp.bfloat16)}
  if offload == "nvme":
    pipe = tx.nvme
    masters = [np.concatenate([pipe.store.read(pipe.key("master", p)).wait()
                               for p in pipe.parts if p.leaf == i])
               for i in range(len(pipe.shapes))]
  else:
    masters = [np.asarray(m).reshape(-1) for m in jax.tree.leaves(state.master)]
  for p, m in zip(jax.tree.leaves(got), masters):
    rounded = m.astype(ml_dtypes.bfloat16)  # numpy's cast rounds to nearest even
    np.testing.assert_array_equal(np.asarray(p).reshape(-1).view(np.uint16), rounded.view(np.uint16))
    assert not np.array_equal(m, rounded.astype(np.float32))  # the master keeps more bits


@pytest.mark.parametrize("offload", TIERS)
def test_inside_optax_chain_with_clipping(offload, tmp_path, reference):
  params, noise, _ = reference
  want, _ = train(optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-2, weight_decay=0.05)),
                  params, noise[:30])
  tx = optax.chain(optax.clip_by_global_norm(1.0), offloaded(tmp_path, offload, 1e-2, weight_decay=0.05))
  got, _ = train(tx, params, noise[:30])
  assert rel_err(got, want) < 1e-6


@pytest.mark.parametrize("offload", TIERS)
def test_with_nnx_optimizer_on_the_tiny_gpt(offload, tmp_path):
  config = get_config("tiny")
  batches = text_batches(6, batch=8, seq=32, seed=3)

  def losses(tx):
    model = GPT(config, rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)

    @nnx.jit
    def step(model, optimizer, batch):
      loss, grads = nnx.value_and_grad(lm_loss)(model, batch)
      optimizer.update(model, grads)
      return loss

    return np.array([float(step(model, optimizer, b)) for b in batches])

  want = losses(optax.adamw(3e-3, weight_decay=0.1))
  got = losses(offloaded(tmp_path, offload, 3e-3, weight_decay=0.1))
  assert want[-1] < want[0] - 0.2
  np.testing.assert_allclose(got, want, rtol=1e-5)


def test_kernel_matches_reference_math_with_threads_and_bf16():
  rng = np.random.default_rng(5)
  n = 300_001  # several threads' chunks and a ragged tail
  master = rng.standard_normal(n).astype(np.float32)
  m, v = (rng.standard_normal(n) * 0.1).astype(np.float32), rng.random(n).astype(np.float32)
  grad = rng.standard_normal(n).astype(ml_dtypes.bfloat16)
  c = AdamConstants(0.9, 0.95, 1e-8)
  want = adamw_jnp(jnp.asarray(master), jnp.asarray(m), jnp.asarray(v), jnp.asarray(grad),
                   1e-3, 0.19, 0.0975, c, 0.01)
  out = np.empty(n, ml_dtypes.bfloat16)
  adamw_numpy(master, m, v, grad, out, 1e-3, 0.19, 0.0975, c, 0.01, threads=3)
  for got, ref in zip((master, m, v), want):
    np.testing.assert_allclose(got, np.asarray(ref), rtol=2e-7, atol=1e-9)
  np.testing.assert_array_equal(out.view(np.uint16), master.astype(ml_dtypes.bfloat16).view(np.uint16))
  assert zinfjax.optim.isa() in ("avx512", "avx2", "generic")


@pytest.mark.parametrize("moments", [np.float32, ml_dtypes.bfloat16])
@pytest.mark.parametrize("grads,params", [(np.float32, np.float32),
                                          (ml_dtypes.bfloat16, ml_dtypes.bfloat16)])
def test_kernel_reads_another_copy_bit_for_bit(moments, grads, params):
  """With `sources`, the kernel reads master and moments from one copy and writes another
  (an all-or-nothing step in RAM): bit for bit the in-place update, the sources untouched;
  a source overlapping an output is refused."""
  rng = np.random.default_rng(6)
  n = 200_003
  old = (rng.standard_normal(n).astype(np.float32), (rng.standard_normal(n) * 0.1).astype(moments),
         (rng.random(n) * 0.01).astype(moments))
  kept = [x.copy() for x in old]
  grad = rng.standard_normal(n).astype(grads)
  c = AdamConstants(0.9, 0.95, 1e-8)
  run = lambda states, out, sources=None: adamw_numpy(*states, grad, out, 1e-3, 0.19, 0.0975, c,
                                                      0.01, threads=3, step=4, sources=sources)
  in_place, out = [x.copy() for x in old], np.empty(n, params)
  run(in_place, out)
  new, new_out = [np.full(n, np.nan, x.dtype) for x in old], np.empty(n, params)
  run(new, new_out, old)
  bits = lambda x: x.view(np.uint16) if x.dtype.itemsize == 2 else x.view(np.uint32)
  for got, want in zip(new + [new_out], in_place + [out]):
    np.testing.assert_array_equal(bits(got), bits(want))
  for got, want in zip(old, kept):
    np.testing.assert_array_equal(bits(got), bits(want))
  with pytest.raises(zinfjax.offload.EngineError, match="a source overlaps an output"):
    run(new, new_out, (new[0], old[1], old[2]))


# ------------------------------------------------------------------ bad input

def test_mismatched_tree_structure():
  params = make_params()
  tx = zinfjax.optim.adamw(1e-3, offload="pinned_host")
  state = tx.init(params)
  with pytest.raises(ValueError, match="do not match the params the optimizer was initialized with"):
    tx.update({"w": params["w"], "b": params["b"]}, state, params)


def test_non_float_leaves():
  with pytest.raises(ValueError, match=r"\['step'\] has dtype int32"):
    zinfjax.optim.adamw(1e-3).init({"w": jnp.ones(3), "step": jnp.zeros((), jnp.int32)})


def test_bad_options():
  with pytest.raises(ValueError, match="offload must be one of"):
    zinfjax.optim.adamw(1e-3, offload="disk")
  with pytest.raises(ValueError, match="needs nvme_path"):
    zinfjax.optim.adamw(1e-3, offload="nvme")
  # each of these trains without an error, to a wrong answer (moments that never decay, ascent)
  for kwargs, named in [({"b1": 1.0}, "b1=1.0 (0 <= b1 < 1)"), ({"b2": 1.5}, "b2=1.5"),
                        ({"eps": -1e-8}, "eps=-1e-08"),
                        ({"weight_decay": -0.1}, "weight_decay=-0.1"),
                        ({"learning_rate": -1e-3}, "learning_rate=-0.001 (>= 0)")]:
    with pytest.raises(ValueError, match=re.escape(f"adamw: {named}")):
      zinfjax.optim.adamw(**{"learning_rate": 1e-3, **kwargs})
  zinfjax.optim.adamw(0.0, b1=0.0, eps=0.0, weight_decay=0.0)  # the edges are fine


def test_nvme_store_missing_or_corrupted(tmp_path):
  params = make_params()
  tx = offloaded(tmp_path, "nvme", 1e-3)
  state = tx.init(params)
  grads = jax.tree.map(jnp.ones_like, params)
  tx.update(grads, state, params)
  store = tx.nvme.store
  key = tx.nvme.key("mu", tx.nvme.parts[2])
  assert key.startswith("o/m/") and "/r0/l" in key  # the engine's key scheme
  entry = store.entry(key)
  with open(os.path.join(store.folder, "swap.bin"), "r+b") as f:
    f.seek(entry["offset"] + 100)
    f.write(b"\x01\x02\x03\x04")
  with pytest.raises(Exception, match=re.escape(f"checksum mismatch for shard '{key}'")):
    jax.block_until_ready(tx.update(grads, state, params))
  os.truncate(os.path.join(store.folder, "swap.bin"), 0)
  with pytest.raises(Exception, match="truncated"):
    jax.block_until_ready(tx.update(grads, state, params))


@pytest.mark.parametrize("offload", TIERS)
def test_max_grad_norm_matches_optax_clip_chain(offload, tmp_path):
  """The grads here have a global norm near 50: a limit of 5 clips every step."""
  params = make_params(seed=4)
  noise = grad_noise(params, 20, seed=5)
  want, _ = train(optax.chain(optax.clip_by_global_norm(5.0), optax.adamw(SCHEDULE, weight_decay=0.1)),
                  params, noise)
  unclipped, _ = train(optax.adamw(SCHEDULE, weight_decay=0.1), params, noise)
  got, _ = train(offloaded(tmp_path, offload, SCHEDULE, weight_decay=0.1, max_grad_norm=5.0),
                 params, noise)
  assert rel_err(got, want) < 1e-6
  assert rel_err(unclipped, want) > 1e-4  # the limit really clipped


def test_max_grad_norm_must_be_positive():
  with pytest.raises(ValueError, match="max_grad_norm must be positive"):
    zinfjax.optim.adamw(1e-3, max_grad_norm=0.0)


@pytest.mark.parametrize("slots", [3, 5, 8])
def test_pipeline_reads_ahead_without_reusing_a_busy_slot(slots):
  """run_pipeline keeps slots-2 sub-groups reading ahead, and reads into a slot only once
  the writes of the sub-group that used it before are done."""
  from zinfjax.optim.stream import run_pipeline
  count, events, done = 11, [], set()

  class T:
    def __init__(self, tag):
      self.tag = tag

    def wait(self):
      done.add(self.tag)

  def read(k):
    # the slot k uses was k-slots's: its writes must be complete
    assert k < slots or ("w", k - slots) in done, (k, sorted(done))
    events.append(("read", k))
    return [T(("r", k))]

  def compute(k):
    assert ("r", k) in done
    in_flight = [j for kind, j in events if kind == "read" and ("r", j) not in done]
    assert in_flight == list(range(k + 1, min(k + slots - 2, count - 1) + 1))
    events.append(("compute", k))

  stats = run_pipeline(count, read, compute, lambda k: [T(("w", k))], slots)
  assert [k for kind, k in events if kind == "compute"] == list(range(count))
  assert {("w", k) for k in range(count)} <= done
  assert set(stats) == {"read_wait_s", "compute_s", "write_wait_s", "step_s"}
  with pytest.raises(ValueError, match="at least 3"):
    run_pipeline(count, read, compute, lambda k: [], 2)


def test_sub_groups_pack_small_leaves_without_growing_the_buffers():
  """pack_units: each rank's layer is split into sub-groups of consecutive leaves, never
  larger than the largest shard, with aligned, non-overlapping parts, every part once."""
  from zinfjax.optim.stream import ALIGN, Part, pack_units
  sizes = [64, 64, 98304, 384, 32768, 64, 64, 64, 131072, 256, 131072, 64, 4097, 3]
  layers = [3] * 12 + [None, None]
  parts = [Part(leaf, rank, layer, sizes[leaf])
           for layer in reversed(range(3)) for rank in range(2) for leaf in range(12)]
  parts += [Part(leaf, rank, 0, sizes[leaf]) for rank in range(2) for leaf in (12, 13)]
  units = pack_units(parts, layers)
  packed = [p for u in units for p in u.parts]
  assert [dataclasses.replace(p, offset=0) for p in packed] == parts
  assert len(units) < len(parts)
  for u in units:
    assert u.size <= max(sizes)
    assert len({(p.rank, p.layer, layers[p.leaf] is None) for p in u.parts}) == 1
    ends = 0
    for p in u.parts:
      assert p.offset % ALIGN == 0 and p.offset >= ends
      ends = p.offset + p.size
    assert ends == u.size


@pytest.mark.parametrize("memory", [True, False])
def test_a_pipeline_laid_out_again_updates_like_a_new_one(memory, tmp_path):
  """The pipeline keeps each part's store keys and buffer views once made; a new layout (other
  leaves, sizes and names under the same part ids) must not see the old ones: it updates bit for
  bit like a pipeline built for it, in the RAM store and through the drive's buffers."""
  from zinfjax.optim.nvme import NvmeAdam, _slice
  rng = np.random.default_rng(3)

  def pipeline(folder):
    return NvmeAdam(str(folder), sub_group_size=1024, memory=memory,
                    constants=AdamConstants(0.9, 0.999, 1e-8))

  def step(pipe, shapes, names):
    pipe.configure(shapes, names)
    params = [rng.standard_normal(int(np.prod(s)), np.float32) for s in shapes]
    grads = [rng.standard_normal(p.size, np.float32).astype(ml_dtypes.bfloat16) for p in params]
    return params, grads

  def run(pipe, params, grads):
    pipe.host_init(*params)
    outs = [np.zeros(p.size, ml_dtypes.bfloat16) for p in params]
    for _ in range(2):
      pipe.stream(1e-2, 0.1, 0.001, [0.01] * len(params), lambda p: _slice(grads[p.leaf], p),
                  lambda p: _slice(outs[p.leaf], p), step=1)
    return [o.astype(np.float32) for o in outs]

  again = pipeline(tmp_path / "again")
  run(again, *step(again, [(3000,), (40,)], ["a", "b"]))
  shapes, names = [(40,), (2500,), (7,)], ["c", "d", "e"]
  params, grads = step(again, shapes, names)
  fresh = pipeline(tmp_path / "fresh")
  fresh.configure(shapes, names)
  want = run(fresh, params, grads)
  got = run(again, params, grads)
  for a, b in zip(got, want):
    np.testing.assert_array_equal(a, b)
  assert not np.array_equal(got[1], params[1].astype(ml_dtypes.bfloat16).astype(np.float32))
  again.close()
  fresh.close()


@pytest.mark.parametrize("moments", [jnp.float32, jnp.bfloat16])
def test_a_skipped_update_is_folded_into_the_pass(moments):
  """`adamw_jnp(..., ok=)`: True is the plain update bit for bit; False gives back every state
  bit for bit, even from a grad of NaN and inf (nothing of it reaches the states)."""
  rng = np.random.default_rng(7)
  n = 4099
  master = jnp.asarray(rng.standard_normal(n), jnp.float32)
  m = jnp.asarray(rng.standard_normal(n) * 0.1, moments)
  v = jnp.asarray(rng.random(n) * 0.01, moments)
  grad = rng.standard_normal(n).astype(np.float32)
  grad[::7], grad[3::11] = np.nan, np.inf
  c = AdamConstants(0.9, 0.95, 1e-8)
  run = jax.jit(lambda g, ok: adamw_jnp(master, m, v, g, 1e-3, 0.19, 0.0975, c, 0.01, 5, ok),
                static_argnums=())
  plain = jax.jit(lambda g: adamw_jnp(master, m, v, g, 1e-3, 0.19, 0.0975, c, 0.01, 5))
  finite = jnp.asarray(np.nan_to_num(grad, nan=0.5, posinf=-2.0))
  for got, want in zip(run(finite, jnp.bool_(True)), plain(finite)):
    np.testing.assert_array_equal(np.asarray(got).view(np.uint8), np.asarray(want).view(np.uint8))
  assert not np.array_equal(np.asarray(plain(finite)[0]), np.asarray(master))
  for got, old in zip(run(jnp.asarray(grad), jnp.bool_(False)), (master, m, v)):
    assert got.dtype == old.dtype
    np.testing.assert_array_equal(np.asarray(got).view(np.uint8), np.asarray(old).view(np.uint8))


@pytest.mark.parametrize("make_tx", [lambda: zinfjax.optim.adamw(1e-3, weight_decay=0.1),
                                     lambda: optax.adamw(1e-3, weight_decay=0.1)],
                         ids=["zinfjax", "optax"])
def test_skipping_nonfinite_steps_costs_no_memory(make_tx):
  """With the optimizer on the device, a step that may skip its update compiles to no more
  temporaries than one that may not (no old and new states alive together), and zinfjax's
  AdamW needs no branch for it."""
  config = get_config("tiny", num_layers=2, hidden=64, num_heads=4, seq_len=32, vocab_size=128)
  mesh = zinfjax.make_mesh(1)
  batch = {k: jax.ShapeDtypeStruct((4, 32), jnp.int32, sharding=jax.sharding.NamedSharding(
      mesh, jax.sharding.PartitionSpec("data"))) for k in ("inputs", "targets")}
  programs = {}
  for skip in (True, False):
    zero = zinfjax.ZeroConfig(offload_optimizer="device", skip_nonfinite=skip)
    state = zinfjax.abstract_init(lambda r: GPT(config, rngs=r), make_tx(), zero, mesh)
    programs[skip] = zinfjax.make_train_step(state, lm_loss).jitted.lower(state, batch).compile()
  temps = {k: p.memory_analysis().temp_size_in_bytes for k, p in programs.items()}
  assert temps[True] <= temps[False] + 1024, temps
  if isinstance(make_tx(), OffloadedTransformation):
    assert " conditional(" not in programs[True].as_text()


@pytest.mark.parametrize("platform", ["cpu", "gpu"])
def test_unless_skipped_keeps_the_states_in_either_form(platform):
  """The branch (XLA:CPU) and the selection (XLA:GPU) forms give the update, or the states
  as they were."""
  from zinfjax.update import unless_skipped
  states = {"a": jnp.arange(5.0), "n": jnp.int32(3)}
  update = lambda s: jax.tree.map(lambda x: x + 1, s)
  for ok, want in ((True, update(states)), (False, states)):
    got = jax.jit(lambda s, ok: unless_skipped(ok, update, (s,), lambda s: s, platform))(
        states, jnp.bool_(ok))
    jax.tree.map(np.testing.assert_array_equal, got, want)


@pytest.mark.parametrize("offload_optimizer", ["device", "pinned_host"])
def test_decay_matrices_decays_weights_not_biases_or_norm_scales(offload_optimizer, mesh):
  """`decay_matrices` (train_gpt.py's mask) is True on kernels and embeddings alone, whether the
  tree is nnx.Optimizer's (Variable paths) or the engine's stacked one (whose biases and scales
  are 2-D, so `ndim >= 2` would decay them); ZeRO training with it equals single-device optax's
  AdamW with it (1e-5), and every scale and bias is then further from where decay pulls it."""
  from helpers import reference_losses, zero_training
  make = lambda rngs: GPT(get_config("tiny"), rngs=rngs)
  model = make(nnx.Rngs(0))
  names = lambda tree: {jax.tree_util.keystr(p): bool(v) for p, v in
                        jax.tree_util.tree_leaves_with_path(zinfjax.optim.decay_matrices(tree))}
  flags = names(nnx.state(model, nnx.Param))  # "['blocks']['block']['fc']['kernel'].value"
  assert all(v == (k.split("'")[-2] in ("kernel", "embedding")) for k, v in flags.items())
  assert sum(flags.values()) == 6 and len(flags) == 16, flags  # wte, wpe, 4 kernels
  assert names(state_tree := nnx.to_pure_dict(nnx.state(model, nnx.Param))) == {
      k.removesuffix(".value"): v for k, v in flags.items()}, state_tree.keys()
  batches = text_batches(4, batch=8, seq=32, seed=3)
  tx = lambda wd: optax.adamw(3e-3, weight_decay=wd, mask=zinfjax.optim.decay_matrices)
  want_losses, want = reference_losses(make, tx(0.5), lm_loss, batches)
  ours = zinfjax.optim.adamw(3e-3, weight_decay=0.5, mask=zinfjax.optim.decay_matrices)
  zero = zinfjax.ZeroConfig(precision="fp32", offload_optimizer=offload_optimizer)
  losses, state = zero_training(make, ours, zero, mesh, batches, lm_loss)
  np.testing.assert_allclose(losses, want_losses, rtol=1e-5)
  got = state.full_params()
  assert max(float(np.abs(np.asarray(a) - np.asarray(b)).max())
             for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want))) < 1e-5
  _, all_decayed = reference_losses(make, optax.adamw(3e-3, weight_decay=0.5), lm_loss, batches)
  for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(want), jax.tree.leaves(all_decayed)):
    if not zinfjax.optim.decay_matrices({str(path[-1].key): 0})[str(path[-1].key)]:
      assert np.abs(np.asarray(x)).sum() > np.abs(np.asarray(y)).sum(), path
