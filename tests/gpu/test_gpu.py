"""zinfjax on one CUDA GPU: every placement trains like all-device, host tiers are in host
memory and save HBM, and the CUDA swap handlers move shards bit-exactly.

Run by scripts/gpu_check.sh on a GPU machine; skipped (with the reason) elsewhere.
"""

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import zinfjax
from zinfjax.models import GPT, get_config, lm_loss
from zinfjax.offload import AioStore, swap

from helpers import text_batches, zero_training

pytestmark = pytest.mark.gpu

TINY = get_config("tiny")
STEPS = 20
TIERS = ("device", "pinned_host", "nvme")
HERE = os.path.dirname(os.path.abspath(__file__))


def test_cuda_handlers_are_registered():
  from zinfjax import _engine_cuda
  assert _engine_cuda.device_count() >= 1


@pytest.mark.parametrize("window", [None, 100])
@pytest.mark.parametrize("dim,scale_dim", [(64, None), (256, 24)])
def test_cudnn_attention_equals_the_explicit_form(window, dim, scale_dim):
  """cuDNN's fused attention is what a GPU runs for bf16, head dims 64 and (Hopper on) 256 and
  grouped-query heads, with Mistral's sliding window or none, and Gemma 3's logits' scale; it
  and its gradients equal the explicit form's (fp32 logits) to bf16 rounding: 2% of each
  output's norm."""
  from zinfjax.models import attention
  keys = jax.random.split(jax.random.key(5), 4)
  q = jax.random.normal(keys[0], (2, 256, 8, dim), jnp.bfloat16)
  k, v = (jax.random.normal(key, (2, 256, 2, dim), jnp.bfloat16) for key in keys[1:3])
  weights = jax.random.normal(keys[3], q.shape, jnp.float32)
  if jax.default_backend() == "gpu":
    assert attention.use_cudnn(q, k, window)

  def run(f):
    out = jax.jit(lambda *a: f(*a, window, scale_dim))(q, k, v)
    loss = lambda *a: jnp.sum(f(*a, window, scale_dim).astype(jnp.float32) * weights)
    return [out, *jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)]

  for name, got, want in zip(("out", "dq", "dk", "dv"), run(attention.causal_attention),
                             run(attention.explicit_attention)):
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    assert np.linalg.norm(got - want) <= 0.02 * np.linalg.norm(want), name


def test_cuda_swap_handlers_are_bit_exact_against_the_cpu_store(tmp_path, gpu_mesh):
  """Shards written by the CUDA handlers read back bit-exactly through the host store API, and
  shards the host wrote stream into the GPU (prefetching scan) bit-exactly."""
  store = AioStore(tmp_path, block_size=64 << 10)
  gpu = gpu_mesh.devices.flat[0]
  rng = np.random.default_rng(0)
  specs = [((5, 33), np.float32), ((1000,), jnp.bfloat16), ((7, 3), np.float16), ((4097,), np.int8)]
  host = [(rng.normal(size=(4,) + s) * 20).astype(d) for s, d in specs]
  keys = ["gpu/a", "gpu/b", "gpu/c", "gpu/d"]
  layer = lambda i: swap.layer_at(range(4), i)

  @jax.jit
  def put(leaves):
    def one(token, i):
      return token + swap.write_many(store.handle, keys, [x[i] for x in leaves], layer=layer(i)), None
    return jax.lax.scan(one, jnp.int32(0), jnp.arange(4))[0]

  jax.block_until_ready(put(jax.device_put(host, gpu)))
  for k, x in zip(keys, host):
    for i in range(4):
      got = store.read(f"{k}/r0/l{i}").wait()
      assert np.asarray(got).tobytes() == x[i].tobytes(), (k, i)

  fresh = [(rng.normal(size=(4,) + s) * 20).astype(d) for s, d in specs]
  for k, x in zip(keys, fresh):
    for i in range(4):
      store.write(f"{k}/r0/l{i}", x[i]).wait()
  likes = [jax.ShapeDtypeStruct(s, d) for s, d in specs]
  nxt = np.minimum(np.arange(4) + 1, 3)

  @jax.jit
  def stream(token):
    def get(ticket, i):
      xs = swap.read_wait_many(store.handle, keys, ticket, likes, layer=layer(i))
      return swap.read_start_many(store.handle, keys, token, layer=swap.layer_at(nxt, i)), xs
    last, ys = jax.lax.scan(get, swap.read_start_many(store.handle, keys, token, layer=0),
                            jnp.arange(4))
    swap.read_wait_many(store.handle, keys, last, likes, layer=3)
    return ys

  for _ in range(2):  # the second run reuses the pinned buffers the first gave back
    ys = stream(jax.device_put(jnp.int32(0), gpu))
    assert all(y.devices() == {gpu} for y in ys)
    for y, x in zip(ys, fresh):
      assert np.asarray(y).tobytes() == x.tobytes()
  store.close()


def schedule():
  return optax.warmup_cosine_decay_schedule(0.0, 3e-3, 5, STEPS)


@pytest.fixture(scope="module")
def batches():
  return text_batches(STEPS, batch=16, seq=32, seed=1)


@pytest.fixture(scope="module")
def reference(gpu_mesh, batches):
  """All states on the GPU, optax.adamw (the same math as every tier's AdamW)."""
  return zero_training(lambda r: GPT(TINY, rngs=r), optax.adamw(schedule(), weight_decay=0.1),
                       zinfjax.ZeroConfig(precision="fp32"), gpu_mesh, batches, lm_loss)[0]


# the placements whose pinned-host states the host pipeline takes on a GPU (host_optimizer
# "auto"): each also runs with XLA's host update, given
PIPELINED = [("device", "pinned_host"), ("pinned_host", "pinned_host"), ("nvme", "pinned_host"),
             ("pinned_host", "nvme")]


@pytest.mark.parametrize("param,optimizer,host", [(p, o, "auto") for o in TIERS for p in TIERS]
                         + [(p, o, "xla") for p, o in PIPELINED])
def test_every_placement_trains_like_all_device(param, optimizer, host, gpu_mesh, batches,
                                                reference, tmp_path):
  zero = zinfjax.ZeroConfig(precision="fp32", offload_param=param, offload_optimizer=optimizer,
                            nvme_path=str(tmp_path / "nvme"), host_optimizer=host)
  losses, state = zero_training(lambda r: GPT(TINY, rngs=r),
                                zinfjax.optim.adamw(schedule(), weight_decay=0.1), zero, gpu_mesh,
                                batches, lm_loss)
  assert losses[-1] < losses[0] - 0.3
  rel = np.abs(losses - reference) / reference
  assert np.all(rel < 1e-5), rel
  # "auto" is the host pipeline on a GPU (not in a dry run on the CPU): its pinned-host states
  # live in the RAM store
  on_gpu = gpu_mesh.devices.flat[0].platform != "cpu"
  piped = host == "auto" and (param, optimizer) in PIPELINED and on_gpu
  assert state.engine.config.host_store == piped
  stored = {"nvme"} | ({"pinned_host"} if piped else set())
  want = {"device": {"device"}, "pinned_host": {"pinned_host"}, "nvme": set()}
  kinds = lambda tree: {x.sharding.memory_kind for x in jax.tree.leaves(tree)}
  assert kinds(state.params) <= want[param] | {"device"}  # leaves outside the stacks: first tier
  if param != "device":
    assert want[param] <= kinds(state.params) or param in stored
  if optimizer == "pinned_host":
    master = kinds(state.master)
    assert master <= {"pinned_host"} if piped else master == {"pinned_host"}


@pytest.mark.parametrize("param", ["device", "pinned_host"])
def test_host_pipeline_trains_like_all_device(param, gpu_mesh, batches, reference):
  """host_optimizer="pipeline" on the GPU: the pinned-host optimizer states in the RAM store,
  updated by the C++ AdamW on host threads, train like all-device."""
  zero = zinfjax.ZeroConfig(precision="fp32", offload_param=param, offload_optimizer="pinned_host",
                            host_optimizer="pipeline")
  losses, state = zero_training(lambda r: GPT(TINY, rngs=r),
                                zinfjax.optim.adamw(schedule(), weight_decay=0.1), zero, gpu_mesh,
                                batches, lm_loss)
  assert state.engine.store.memory
  rel = np.abs(losses - reference) / reference
  assert np.all(rel < 1e-5), rel
  state.close()


@pytest.mark.parametrize("param", ["device", "pinned_host"])
def test_delayed_update_trains_like_its_reference(param, gpu_mesh):
  """delay_update="all" on the GPU: the held update runs on host threads beside the program (the
  RAM store's mapping lent to the device), and training equals plain AdamW applying each step's
  grads one step later (clipped by their own step's norm)."""
  from test_delayed import DECAY, LR, STEPS as N, check_params, factory, scaled_loss
  from test_delayed_all import late_reference
  feed = [dict(b, scale=np.ones((16,), np.float32))
          for b in text_batches(N, batch=16, seq=32, seed=11)]
  zero = zinfjax.ZeroConfig(precision="fp32", offload_param=param, offload_optimizer="pinned_host",
                            host_optimizer="pipeline", delay_update="all")
  losses, state = zero_training(factory, zinfjax.optim.adamw(LR, weight_decay=DECAY,
                                                             max_grad_norm=0.5),
                                zero, gpu_mesh, feed, scaled_loss)
  want_losses, want = late_reference(feed, 0.5)
  np.testing.assert_allclose(losses, want_losses, rtol=1e-5)
  check_params(state, want)
  state.close()


@pytest.mark.parametrize("param,form", [("pinned_host", "carry"), ("pinned_host", "stack"),
                                        ("device", "carry")])
def test_stream_update_trains_like_all_device(param, form, gpu_mesh, batches, reference,
                                              monkeypatch):
  """host_optimizer="stream" on the GPU: the pinned-host optimizer states brought to the device a
  layer at a time, updated there and sent back (XLA's host offloading compiles it: written in
  place into the stacks the scan carries, or stacked anew), train like all-device and stay in
  pinned host."""
  from zinfjax.optim.host import FORM_ENV
  monkeypatch.setenv(FORM_ENV, form)
  zero = zinfjax.ZeroConfig(precision="fp32", offload_param=param, offload_optimizer="pinned_host",
                            host_optimizer="stream")
  losses, state = zero_training(lambda r: GPT(TINY, rngs=r),
                                zinfjax.optim.adamw(schedule(), weight_decay=0.1), zero, gpu_mesh,
                                batches, lm_loss)
  assert {a.sharding.memory_kind for a in jax.tree.leaves(state.opt_state.mu)} == {"pinned_host"}
  rel = np.abs(losses - reference) / reference
  assert np.all(rel < 1e-5), rel
  state.close()


@pytest.mark.parametrize("atomic", [True, False])
def test_mixed_store_trains_like_all_device(atomic, gpu_mesh, batches, reference, tmp_path):
  """The host pipeline over RAM and the drive on the GPU: params and grads in the RAM store, the
  optimizer in the drive's, updated under backward (all or nothing over both stores, or in
  place: the RAM shards where they lie, the drive's streamed), train like all-device."""
  from zinfjax.offload.mixed import MixedStore
  zero = zinfjax.ZeroConfig(precision="fp32", offload_param="pinned_host", offload_optimizer="nvme",
                            host_optimizer="pipeline", skip_nonfinite=False,
                            nvme_atomic_steps=atomic, nvme_path=str(tmp_path / "nvme"))
  losses, state = zero_training(lambda r: GPT(TINY, rngs=r),
                                zinfjax.optim.adamw(schedule(), weight_decay=0.1), zero, gpu_mesh,
                                batches, lm_loss)
  assert isinstance(state.engine.store, MixedStore)
  rel = np.abs(losses - reference) / reference
  assert np.all(rel < 1e-5), rel
  state.close()


def _peak(param: str, optimizer: str, tmp_path, host_optimizer: str = "xla") -> dict:
  out = subprocess.run([sys.executable, os.path.join(HERE, "peak_worker.py"), param, optimizer,
                        str(tmp_path / f"nvme-{param}-{optimizer}"), host_optimizer],
                       capture_output=True, text=True, timeout=600)
  assert out.returncode == 0, out.stderr[-3000:]
  return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("host_optimizer", ["xla", "stream"])
def test_host_tiers_save_hbm(host_optimizer, tmp_path):
  """A 100M-parameter GPT: with params and optimizer states in pinned host memory, the GPU's
  peak falls by most of the state bytes that left it (fresh processes: peaks only grow), also
  where the update runs on the device (it holds a layer's states at a time, not all)."""
  on_device = _peak("device", "device", tmp_path)
  on_host = _peak("pinned_host", "pinned_host", tmp_path, host_optimizer)
  moved = on_device["tier_bytes"]["device"] - on_host["tier_bytes"]["device"]
  saved = on_device["peak_bytes"] - on_host["peak_bytes"]
  assert moved > 1 << 30
  assert saved > 0.7 * moved, (on_device, on_host)
  assert on_host["losses"][-1] < on_host["losses"][0]


@pytest.mark.parametrize("param,optimizer", [("device", "pinned_host"), ("pinned_host", "nvme"),
                                             ("nvme", "device")])
def test_checkpoint_round_trip_on_the_gpu(param, optimizer, gpu_mesh, batches, tmp_path):
  """Save after 3 steps, restore into a fresh engine: the arrays come back on their tiers
  (memory kinds) and the next 3 steps' losses equal those of the run that went on."""
  from zinfjax.checkpoint import Checkpointer
  make = lambda r: GPT(TINY, rngs=r)
  tx = lambda: zinfjax.optim.adamw(schedule(), weight_decay=0.1)
  zero = lambda name: zinfjax.ZeroConfig(precision="fp32", offload_param=param,
                                         offload_optimizer=optimizer,
                                         nvme_path=str(tmp_path / name))
  state = zinfjax.init(make, tx(), zero("a"), gpu_mesh, 0)
  for batch in batches[:3]:
    state, _ = zinfjax.train_step(state, batch, lm_loss)
  kinds = lambda s: [x.sharding.memory_kind for x in jax.tree.leaves((s.params, s.master, s.opt_state))]
  saved_kinds = kinds(state)
  ckpt = Checkpointer(tmp_path / "ckpt")
  ckpt.save(state)  # written in the background while the next steps donate the state's buffers
  went_on = []
  for batch in batches[3:6]:
    state, metrics = zinfjax.train_step(state, batch, lm_loss)
    went_on.append(float(metrics["loss"]))
  ckpt.close()
  assert kinds(state) == saved_kinds
  restored, _ = Checkpointer(tmp_path / "ckpt").restore(make, tx(), zero("b"), gpu_mesh)
  assert kinds(restored) == kinds(state)
  resumed = []
  for batch in batches[3:6]:
    restored, metrics = zinfjax.train_step(restored, batch, lm_loss)
    resumed.append(float(metrics["loss"]))
  assert resumed == went_on


COPY_STREAM = r"""
import sys
import jax, numpy as np
import zinfjax
from zinfjax.models import GPT, get_config, lm_loss
sys.path.insert(0, sys.argv[1])
from helpers import text_batches
config = get_config("tiny", num_layers=4)
out = {}
for name, zero in [("host", zinfjax.ZeroConfig(precision="fp32", offload_param="pinned_host",
                                               offload_optimizer="pinned_host",
                                               host_optimizer="pipeline")),
                   ("nvme", zinfjax.ZeroConfig(precision="fp32", offload_param="nvme",
                                               offload_optimizer="nvme", nvme_path=sys.argv[3]))]:
  with zinfjax.init(lambda r: GPT(config, rngs=r), zinfjax.optim.adamw(3e-3), zero,
                    zinfjax.make_mesh(1), 0) as state:
    for i, batch in enumerate(text_batches(3, 8, config.seq_len)):
      state, metrics = zinfjax.train_step(state, batch, lm_loss)
      out[f"{name}_loss{i}"] = np.asarray(metrics["loss"])
    for j, x in enumerate(jax.tree.leaves(state.full_params())):
      out[f"{name}_{j}"] = np.asarray(x)
np.savez(sys.argv[2], **out)
"""


def test_grads_through_the_copy_stream_train_bit_for_bit(tmp_path):
  """The copy stream (the default; ZINFJAX_COPY_STREAM=0 turns it off): write_many's grads leave
  the device through a staging buffer and the copy stream instead of XLA's stream; training
  (host pipeline, NVMe) is bit for bit the same. In child processes: a crash is this test's
  failure, not the suite's."""
  script = tmp_path / "copy_stream.py"
  script.write_text(COPY_STREAM)
  out = {}
  for mode in ("0", "1"):
    done = subprocess.run([sys.executable, str(script), os.path.dirname(HERE),
                           str(tmp_path / mode), str(tmp_path / f"swap{mode}")],
                          capture_output=True, text=True, timeout=300, cwd="/",
                          env={**os.environ, "ZINFJAX_COPY_STREAM": mode})
    assert done.returncode == 0, f"copy stream {mode}: exit {done.returncode}\n{done.stderr[-3000:]}"
    out[mode] = np.load(tmp_path / f"{mode}.npz")
  assert set(out["0"].files) == set(out["1"].files)
  for k in out["0"].files:
    np.testing.assert_array_equal(out["1"][k], out["0"][k], err_msg=k)


def test_gemma3_layers_take_fused_attention_in_the_layer_scan(gpu_mesh, monkeypatch):
  """A Gemma 3 shaped model (head dim 256, sliding and global layers chosen per layer with
  `lax.cond`) in bf16 under ZeRO-3 with params in pinned host: its step calls cuDNN's fused
  attention forward and backward on a GPU (both kinds of layer), and trains like the explicit
  form to bf16 rounding (2% of each loss)."""
  from zinfjax.models import Llama, LlamaConfig
  config = LlamaConfig(vocab_size=256, hidden=128, intermediate=256, num_layers=4, num_heads=2,
                       num_kv_heads=1, head_dim=256, seq_len=64, tie_embeddings=True,
                       activation="gelu_tanh", norm_offset=True, embed_scale=True, qk_norm=True,
                       sandwich_norm=True, sliding_window=16, local_rope_theta=1e4,
                       rope_theta=1e6, layer_types=("sliding", "full") * 2,
                       query_pre_attn_scalar=256)
  batches = text_batches(4, batch=8, seq=64, seed=2)
  zero = zinfjax.ZeroConfig(offload_param="pinned_host")

  def run(attention: str):
    monkeypatch.setenv("ZINFJAX_ATTENTION", attention)
    state = zinfjax.init(lambda r: Llama(config, rngs=r), zinfjax.optim.adamw(3e-3), zero,
                         gpu_mesh)
    hlo = zinfjax.make_train_step(state, lm_loss).jitted.lower(state, batches[0]).compile()
    calls = [c for c in hlo.as_text().split("custom_call_target=")[1:]
             if c.startswith('"__cudnn$fmha')]
    losses = []
    for batch in batches:
      state, metrics = zinfjax.train_step(state, batch, lm_loss)
      losses.append(float(metrics["loss"]))
    return np.asarray(losses), calls

  fused, calls = run("auto")
  explicit, none = run("explicit")
  if gpu_mesh.devices.flat[0].platform == "gpu":
    backward = sum("Backward" in c for c in calls)   # each kind of layer's, in the cond
    assert backward >= 2 and len(calls) - backward >= 2, calls
  assert not none and explicit[-1] < explicit[0]
  np.testing.assert_allclose(fused, explicit, rtol=2e-2)
