"""The explicit attention taken a block of queries at a time on long sequences: the same values
and grads as the whole [T, T] form, fewer products and temporaries, and the same training inside
zinfjax's layer scans."""

import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import zinfjax
from helpers import SCRIPTS, random_batches, reference_losses, zero_training
from zinfjax.models import Llama, LlamaConfig, attention, lm_loss

sys.path.insert(0, SCRIPTS)
import _hlo  # noqa: E402


def _qkv(t: int, heads: int, kv_heads: int, h: int = 16, seed: int = 0):
  rng = np.random.default_rng(seed)
  return [jnp.asarray(rng.standard_normal((2, t, n, h)), jnp.float32)
          for n in (heads, kv_heads, kv_heads)]


@pytest.mark.parametrize("heads, kv_heads, window, softcap", [
    (4, 4, None, None), (4, 2, 7, None), (4, 1, 20, 5.0), (2, 2, 64, 3.0), (4, 2, 1, None)])
@pytest.mark.parametrize("block", [8, 13])
def test_blocks_equal_the_whole_form_values_and_grads(heads, kv_heads, window, softcap, block):
  """fp32, random inputs, 40 positions in blocks of 8 (even) or 13 (a short last one): values
  and the grads of q, k and v to 1e-6 of the unblocked form, with GQA, windows shorter and
  longer than a block, Gemma 2's cap, and a window of one (each query sees itself alone)."""
  q, k, v = _qkv(40, heads, kv_heads)
  weights = jnp.asarray(np.random.default_rng(1).standard_normal((2, 40, heads, 16)), jnp.float32)

  def loss(block):
    return lambda q, k, v: (attention.explicit_attention(
        q, k, v, window, 12.0, softcap, block=block) * weights).sum()

  whole, blocked = loss(40), loss(block)
  forward = jax.jit(attention.explicit_attention, static_argnums=(3, 4, 5, 6))
  np.testing.assert_allclose(forward(q, k, v, window, 12.0, softcap, block),
                             forward(q, k, v, window, 12.0, softcap, 40), rtol=1e-6, atol=1e-6)
  grads = lambda f: jax.jit(jax.grad(f, (0, 1, 2)))(q, k, v)
  for got, want in zip(grads(blocked), grads(whole)):
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


def _dots(jaxpr) -> list[tuple[str, ...]]:
  """The operand dtypes of every dot_general in `jaxpr` and the programs inside it."""
  from jax._src import core
  out = []
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "dot_general":
      out.append(tuple(str(x.aval.dtype) for x in eqn.invars))
    for sub in core.jaxprs_in_params(eqn.params):
      out += _dots(sub)
  return out


@pytest.mark.parametrize("kv_heads", [4, 2])
def test_the_logits_grads_multiply_in_the_inputs_dtype(kv_heads):
  """In fp32 the logits' custom backward is the plain product's, bit for bit; in bf16 every
  product of the grad (dq and dk included) takes bf16 operands, where autodiff multiplied the
  fp32 logit grads by upcast q and k, and the grads stay within bf16's rounding of fp32's."""
  q, k, _ = _qkv(24, 4, kv_heads)
  spec = "bqhk,bthk->bhqt" if kv_heads == 4 else "bqgrk,btgk->bgrqt"
  if kv_heads != 4:
    q = q.reshape(2, 24, kv_heads, 4 // kv_heads, 16)
  weights = jnp.asarray(np.random.default_rng(2).standard_normal((2, 4, 24, 24)), jnp.float32)
  weights = weights.reshape(jnp.einsum(spec, q, k).shape)
  ours = lambda q, k: (attention._logits(spec, q, k) * weights).sum()
  plain = lambda q, k: (jnp.einsum(spec, q, k, preferred_element_type=jnp.float32)
                        * weights).sum()
  for got, want in zip(jax.grad(ours, (0, 1))(q, k), jax.grad(plain, (0, 1))(q, k)):
    np.testing.assert_array_equal(got, want)

  q16, k16, v16 = (x.astype(jnp.bfloat16) for x in _qkv(40, 4, kv_heads))
  out = jnp.asarray(np.random.default_rng(3).standard_normal((2, 40, 4, 16)), jnp.float32)
  loss = lambda q, k, v: (attention.explicit_attention(q, k, v, None, None, 5.0, block=16)
                          .astype(jnp.float32) * out).sum()
  grad = jax.grad(loss, (0, 1, 2))
  assert set(_dots(jax.make_jaxpr(grad)(q16, k16, v16).jaxpr)) == {("bfloat16", "bfloat16")}
  want = grad(*(x.astype(jnp.float32) for x in (q16, k16, v16)))
  for got, ref in zip(grad(q16, k16, v16), want):
    assert float(jnp.abs(got.astype(jnp.float32) - ref).max() / jnp.abs(ref).max()) < 1e-2


def test_a_long_sequence_runs_fewer_products_and_holds_less(monkeypatch):
  """4096 positions, 8 heads, blocks of 512: the whole form's step (value and grads) runs 3
  squares of products (forward, backward's two) and holds [T, T] fp32 logits; in blocks it runs
  the causal (n + 1) / 2n of them (plus at most each block's forward again, its recompute), the
  band's alone under a window, and holds under 60% of the whole form's temporaries (XLA:CPU
  plans 968 against 1832 MiB; compiled for an H100, 175 against 1028 MiB).
  ZINFJAX_EXPLICIT_BLOCK sets the default block (0: all)."""
  t, n = 4096, 8
  q = jax.ShapeDtypeStruct((1, t, n, 64), jnp.bfloat16)
  weights = jax.ShapeDtypeStruct((1, t, n, 64), jnp.float32)

  def compiled(block, window=None):
    loss = lambda q, k, v, w: (attention.explicit_attention(
        q, k, v, window, block=block).astype(jnp.float32) * w).sum()
    return jax.jit(jax.value_and_grad(loss, (0, 1, 2))).lower(q, q, q, weights).compile()

  whole, blocked, band = compiled(t), compiled(512), compiled(512, window=512)
  square = 2 * n * t * t * 64 * 2  # q·k and p·v, forward
  flops = lambda c: _hlo.matmul_flops(c.as_text()).total
  temp = lambda c: c.memory_analysis().temp_size_in_bytes
  for default, same in (("0", whole), ("512", blocked)):  # the whole sequence at once; 512
    monkeypatch.setenv("ZINFJAX_EXPLICIT_BLOCK", default)
    chosen = compiled(None)
    assert (flops(chosen), temp(chosen)) == (flops(same), temp(same)), default
  assert flops(whole) == 3 * square
  blocks = t // 512
  causal = square * (blocks + 1) / (2 * blocks)
  assert 3 * causal <= flops(blocked) <= 4 * causal
  # under a 512 window each block but the first sees its own and the 511 keys before it
  seen = square * (512 + (blocks - 1) * 1023) / blocks / t
  assert 3 * seen <= flops(band) <= 4 * seen
  assert temp(whole) >= n * t * t * 4  # at least the [T, T] fp32 logits of every head
  assert temp(band) < temp(blocked) < 0.6 * temp(whole), (temp(band), temp(blocked), temp(whole))


# Gemma 2's layers (capped logits, sliding and global in turn) with GQA, 16 positions
GEMMA2 = LlamaConfig(vocab_size=59, hidden=32, intermediate=64, num_layers=4, num_heads=4,
                     num_kv_heads=2, head_dim=16, seq_len=16, tie_embeddings=True,
                     activation="gelu_tanh", norm_offset=True, embed_scale=True,
                     sandwich_norm=True, sliding_window=6, layer_types=("sliding", "full") * 2,
                     query_pre_attn_scalar=24, attn_softcap=5.0, final_softcap=10.0)


@pytest.mark.parametrize("zero", [
    dict(offload_param="pinned_host:1,nvme:2,device", offload_optimizer="device:2,nvme"),
    dict(layer_residuals="save"), dict(micro_batches=2, tiles=2)],
    ids=["split", "saved", "micro+tiles"])
def test_blocks_train_as_the_whole_form_in_the_layer_scans(zero, mesh, tmp_path, monkeypatch):
  """A Gemma 2 shaped model whose 16 positions are blocks of 5 (the last of 1:
  ZINFJAX_EXPLICIT_BLOCK=5), in zinfjax's
  layer scans (a stack split over tiers, saved residuals, micro-batches and tiles): losses equal
  the model's own scan with the whole form on one device (fp32, 1e-5), each param leaf to 1e-5
  on average."""
  batches = random_batches(3, 16, 16, GEMMA2.vocab_size, seed=7)
  make = lambda r: Llama(GEMMA2, rngs=r)
  want_losses, want = reference_losses(make, optax.adamw(1e-2, weight_decay=0.1), lm_loss,
                                       batches)
  monkeypatch.setenv("ZINFJAX_EXPLICIT_BLOCK", "5")
  tx = (zinfjax.optim.adamw(1e-2, weight_decay=0.1) if "offload_optimizer" in zero
        else optax.adamw(1e-2, weight_decay=0.1))
  config = zinfjax.ZeroConfig(precision="fp32", nvme_path=str(tmp_path / "nvme"), **zero)
  losses, state = zero_training(make, tx, config, mesh, batches, lm_loss)
  np.testing.assert_allclose(losses, want_losses, rtol=1e-5)
  for got, expected in zip(jax.tree.leaves(state.full_params()), jax.tree.leaves(want)):
    assert np.abs(np.asarray(got) - np.asarray(expected)).mean() < 1e-5
  state.close()
