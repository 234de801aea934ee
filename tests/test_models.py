"""The NNX GPT and Llama, the scanned `Stack`, attention and the chunked loss."""

import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from zinfjax.models import GPT, get_config

TINY = get_config("tiny")


@pytest.fixture(scope="module")
def model():
  return GPT(TINY, rngs=nnx.Rngs(0))


def test_logits_shape_and_params(model):
  tokens = jax.random.randint(jax.random.key(1), (2, 16), 0, TINY.vocab_size)
  logits = model(tokens)
  assert logits.shape == (2, 16, TINY.vocab_size) and logits.dtype == jnp.float32
  n = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
  assert n == TINY.num_params
  assert model.blocks.block.qkv.kernel.shape == (TINY.num_layers, 64, 192)  # stacked on layer axis


def test_scan_equals_python_loop_over_layers(model):
  x = jax.random.normal(jax.random.key(2), (2, 16, TINY.hidden))
  graphdef, state = nnx.split(model.blocks.block)
  y = x
  for i in range(TINY.num_layers):
    y = nnx.merge(graphdef, jax.tree.map(lambda a: a[i], state))(y)
  np.testing.assert_allclose(model.blocks(x), y, rtol=1e-5, atol=1e-5)


def test_remat_does_not_change_gradients():
  tokens = jax.random.randint(jax.random.key(3), (2, 16), 0, TINY.vocab_size)

  def grads(remat):
    model = GPT(TINY.replace(remat=remat), rngs=nnx.Rngs(0))
    return nnx.grad(lambda m: m(tokens).mean())(model)

  a, b = grads(True), grads(False)
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-7)
  # the two really differ in what they trace: remat wraps the block in a checkpoint
  def jaxpr(remat):
    graphdef, state = nnx.split(GPT(TINY.replace(remat=remat), rngs=nnx.Rngs(0)))
    loss = lambda s: nnx.merge(graphdef, s)(tokens).mean()
    return str(jax.make_jaxpr(jax.grad(loss))(state))

  assert "remat" in jaxpr(True) and "remat" not in jaxpr(False)


def test_causal(model):
  tokens = jax.random.randint(jax.random.key(4), (1, 16), 0, TINY.vocab_size)
  changed = tokens.at[0, 10].set((tokens[0, 10] + 1) % TINY.vocab_size)
  a, b = model(tokens), model(changed)
  np.testing.assert_allclose(a[0, :10], b[0, :10], rtol=1e-6)
  assert not np.allclose(a[0, 10:], b[0, 10:])


def test_tied_embedding_feeds_the_output(model):
  x = jnp.ones((1, 1, TINY.hidden))
  # a sum of 64 terms of ~0.02 in another order: atol for the entries that nearly cancel
  np.testing.assert_allclose(model.wte.attend(x)[0, 0], model.wte.embedding[...].sum(-1), rtol=1e-5,
                             atol=1e-6)


def test_presets_cover_the_paper():
  for name, (layers, hidden) in {"10b": (50, 4096), "1t": (128, 25600), "gpt2-xl": (48, 1600)}.items():
    c = get_config(name)
    assert (c.num_layers, c.hidden) == (layers, hidden)
  assert abs(get_config("1t").num_params / 1e12 - 1.0) < 0.02


@pytest.mark.parametrize("heads,kv_heads,window", [(4, 4, None), (8, 2, None), (8, 2, 5)])
def test_causal_attention_equals_jax_dot_product_attention(heads, kv_heads, window):
  """`models.attention.causal_attention` (the explicit form here, cuDNN's fused attention on a
  GPU) against `jax.nn.dot_product_attention(..., is_causal=True)` on random inputs: fp32 to
  1e-5, with grouped-query heads and a sliding window (Mistral's: the `window` latest positions)
  too; its gradients likewise; the future never leaks, nor does the past beyond the window."""
  from zinfjax.models.attention import causal_attention
  keys = jax.random.split(jax.random.key(3), 3)
  q = jax.random.normal(keys[0], (2, 24, heads, 16))
  k, v = (jax.random.normal(key, (2, 24, kv_heads, 16)) for key in keys[1:])
  local = None if window is None else (window - 1, 0)
  reference = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True,
                                                           local_window_size=local)
  ours = lambda q, k, v: causal_attention(q, k, v, window)
  np.testing.assert_allclose(ours(q, k, v), reference(q, k, v), rtol=1e-5, atol=1e-5)
  loss = lambda f: lambda *a: jnp.sum(jnp.sin(f(*a)))
  got = jax.grad(loss(ours), argnums=(0, 1, 2))(q, k, v)
  want = jax.grad(loss(reference), argnums=(0, 1, 2))(q, k, v)
  for g, w in zip(got, want):
    np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5)
  k2 = k.at[:, -1].set(5.0)  # the last position's keys change: earlier outputs do not
  np.testing.assert_array_equal(ours(q, k2, v)[:, :-1], ours(q, k, v)[:, :-1])
  if window is not None:
    v3 = v.at[:, 0].set(5.0)  # the first values: seen by the first `window` positions alone
    changed = np.abs(np.asarray(ours(q, k, v3) - ours(q, k, v))).max(axis=(0, 2, 3))
    assert (changed[:window] > 0).all() and (changed[window:] == 0).all()
    # a window the whole sequence fits in is no window, to the bit
    np.testing.assert_array_equal(causal_attention(q, k, v, 24), causal_attention(q, k, v))


def test_cudnn_that_does_not_compile_falls_back_to_the_explicit_form(monkeypatch):
  """Where cuDNN's fused attention is chosen (a GPU, bf16, head dim 64) but does not compile for
  the shape, the attention warns once per shape and computes the explicit form, not a failed
  step; `ZINFJAX_ATTENTION=explicit` skips cuDNN without asking. Here the compile probe fails
  for real: this jax has no cuDNN."""
  from zinfjax.models import attention
  monkeypatch.setattr(attention.jax, "default_backend", lambda: "gpu")
  attention.cudnn_compiles.cache_clear()
  keys = jax.random.split(jax.random.key(4), 3)
  q = jax.random.normal(keys[0], (2, 16, 4, 64), jnp.bfloat16)
  k, v = (jax.random.normal(key, (2, 16, 2, 64), jnp.bfloat16) for key in keys[1:])
  with pytest.warns(UserWarning, match=r"does not compile for queries \(2, 16, 4, 64\)"):
    got = jax.jit(attention.causal_attention)(q, k, v)
  np.testing.assert_array_equal(got, attention.explicit_attention(q, k, v))
  with warnings.catch_warnings():
    warnings.simplefilter("error")  # asked once per shape
    attention.causal_attention(q, k, v)
  attention.cudnn_compiles.cache_clear()
  monkeypatch.setenv("ZINFJAX_ATTENTION", "explicit")
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    np.testing.assert_array_equal(attention.causal_attention(q, k, v), got)
  assert attention.cudnn_compiles.cache_info().currsize == 0
  attention.cudnn_compiles.cache_clear()


@pytest.mark.parametrize("model,chunk", [("gpt", 7), ("gpt", 64), ("llama", 5), ("llama_tied", 1024)])
def test_chunked_loss_equals_the_full_logits_loss(model, chunk):
  """lm_loss in chunks of tokens (padded last chunk included) against optax's cross entropy of the
  whole fp32 logits: loss to 1e-6, every gradient to 1e-5, on random weights and tokens."""
  import optax
  from zinfjax.models import Llama, LlamaConfig, lm_loss
  rngs = nnx.Rngs(3)
  if model == "gpt":
    net = GPT(get_config("tiny", num_layers=2), rngs=rngs)
  else:
    net = Llama(LlamaConfig(vocab_size=97, hidden=32, num_layers=2, num_heads=4, num_kv_heads=2,
                            intermediate=64, seq_len=16, tie_embeddings=model == "llama_tied"),
                rngs=rngs)
  vocab = net.config.vocab_size
  key = jax.random.key(0)
  tokens = jax.random.randint(key, (3, 13), 0, vocab)
  batch = {"inputs": tokens, "targets": jnp.roll(tokens, -1, axis=1)}
  graph, params = nnx.split(net)

  def full(p):
    logits = nnx.merge(graph, p)(batch["inputs"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean()

  chunked = lambda p: lm_loss(nnx.merge(graph, p), batch, chunk=chunk)
  (want, g_want), (got, g_got) = (jax.value_and_grad(f)(params) for f in (full, chunked))
  np.testing.assert_allclose(got, want, rtol=1e-6)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7), g_got, g_want)


@pytest.mark.parametrize("model,chunk", [("gpt", 7), ("plain", None)])
def test_negative_targets_are_ignored_and_bad_ids_give_nan(model, chunk):
  """Targets < 0 (-100 in Hugging Face's labels) drop out of the mean: the loss and its grads
  equal optax's cross entropy averaged over the other targets (chunked and full-logits paths).
  A target past the vocabulary, or an input id outside it (negative too, which `jnp.take`
  would count from the end), gives NaN, in the loss and in its grads, instead of a loss on
  another token or grads towards no target. Targets of another shape than the inputs are
  refused by name."""
  import optax
  from zinfjax.models import lm_loss
  net = GPT(get_config("tiny", num_layers=2), rngs=nnx.Rngs(4))
  vocab = net.config.vocab_size
  loss = (functools.partial(lm_loss, chunk=chunk) if model != "plain"
          else lambda m, b: lm_loss(_Logits(m), b))
  tokens = jax.random.randint(jax.random.key(1), (3, 13), 0, vocab)
  targets = jnp.roll(tokens, -1, axis=1)
  keep = jax.random.bernoulli(jax.random.key(2), 0.6, targets.shape)
  batch = {"inputs": tokens, "targets": jnp.where(keep, targets, -100)}
  graph, params = nnx.split(net)

  def want(p):
    ce = optax.softmax_cross_entropy_with_integer_labels(nnx.merge(graph, p)(tokens), targets)
    return jnp.sum(jnp.where(keep, ce, 0.0)) / jnp.sum(keep)

  got = lambda p: loss(nnx.merge(graph, p), batch)
  (w, g_w), (v, g_v) = (jax.value_and_grad(f)(params) for f in (want, got))
  np.testing.assert_allclose(v, w, rtol=1e-6)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7), g_v, g_w)
  assert 0 < int(jnp.sum(keep)) < keep.size
  scored = jax.jit(lambda p, b: loss(nnx.merge(graph, p), b))
  grads = jax.jit(jax.grad(lambda p, b: loss(nnx.merge(graph, p), b)))
  for bad in ({**batch, "targets": batch["targets"].at[0, 0].set(vocab)},
              {**batch, "inputs": tokens.at[1, 2].set(-1)},
              {**batch, "inputs": tokens.at[1, 2].set(vocab)}):
    assert np.isnan(float(scored(params, bad)))
    assert np.isnan(float(optax.tree.norm(grads(params, bad))))  # a step skips it
  assert float(scored(params, {**batch, "targets": jnp.full_like(targets, -100)})) == 0.0
  with pytest.raises(ValueError, match=r"targets of shape \(3, 12\) for inputs of shape \(3, 13\)"):
    scored(params, {**batch, "targets": batch["targets"][:, 1:]})


class _Logits:
  """A model seen through its logits alone (no `features`/`head`): lm_loss's full-logits path."""

  def __init__(self, model):
    self.model = model

  def __call__(self, tokens):
    return self.model(tokens)


def dot_operands(jaxpr) -> list[tuple]:
  """(dtype, shape) of both operands of every matrix product in a jaxpr, scan and remat bodies
  included."""
  from zinfjax.interpret import subjaxprs
  found = []
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "dot_general":
      found.append(tuple((str(v.aval.dtype), v.aval.shape) for v in eqn.invars))
    for sub in subjaxprs(eqn):
      found += dot_operands(sub)
  return found


@pytest.mark.parametrize("model", ["gpt", "llama", "gemma", "gemma2", "gemma3"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_matrix_products_run_in_the_params_dtype(model, dtype):
  """With its params cast to bf16 (as zinfjax hands them to the model under mixed precision),
  every matrix product of forward and backward takes bf16 operands, the blocks' and the loss's,
  and the logits come out in fp32; in fp32 everything stays fp32. (`nnx.Embed` alone would
  promote the first activation to fp32, and so would Gemma's embedding scale or its norms if
  they kept fp32, or Gemma 2's soft caps; Gemma 3's layers choose their attention in a
  `lax.cond`.) The one exception
  is the explicit attention's backward (the CPU's and cuDNN's fallback): its fp32 logits'
  gradient, [.., T, .., T, ..], meets bf16 q or k."""
  from zinfjax.models import Llama, LlamaConfig, lm_loss
  rngs = nnx.Rngs(5)
  if model == "gpt":
    net = GPT(get_config("tiny", num_layers=2), rngs=rngs)
  else:
    gemma = dict(activation="gelu_tanh", norm_offset=True, embed_scale=True, tie_embeddings=True)
    gemma3 = dict(gemma, sandwich_norm=True, qk_norm=True, sliding_window=4,
                  layer_types=("sliding", "full"), local_rope_theta=100.0, query_pre_attn_scalar=6)
    gemma2 = dict(gemma, sandwich_norm=True, sliding_window=4, layer_types=("sliding", "full"),
                  query_pre_attn_scalar=6, attn_softcap=2.0, final_softcap=3.0)
    net = Llama(LlamaConfig(vocab_size=97, hidden=32, num_layers=2, num_heads=4, num_kv_heads=2,
                            intermediate=64, seq_len=16,
                            **{"gemma": gemma, "gemma2": gemma2, "gemma3": gemma3}.get(model, {})),
                rngs=rngs)
  graph, params = nnx.split(net)
  params = jax.tree.map(lambda a: a.astype(dtype), params)
  # 12 tokens: no other dim of these models is 12, so [.., T, .., T, ..] names attention logits
  tokens = jax.random.randint(jax.random.key(1), (2, 12), 0, net.config.vocab_size)
  batch = {"inputs": tokens, "targets": jnp.roll(tokens, -1, axis=1)}
  grads = jax.make_jaxpr(jax.grad(lambda p: lm_loss(nnx.merge(graph, p), batch)))(params)
  products = dot_operands(grads.jaxpr)
  assert len(products) >= 8 * net.config.num_layers, products  # the blocks' forward and backward
  t = tokens.shape[1]
  for (a, a_shape), (b, _) in products:
    logits_grad = dtype == "bfloat16" and a == "float32" and a_shape.count(t) == 2
    assert (a, b) == (dtype, dtype) or (logits_grad and b == dtype), products
  assert sum((a, b) == (dtype, dtype) for (a, _), (b, _) in products) >= 6 * net.config.num_layers
  assert nnx.merge(graph, params)(tokens).dtype == jnp.float32


def test_mixed_precision_steps_feed_attention_bf16(monkeypatch):
  """Through zinfjax's step under the default bf16 precision, the blocks' attention receives
  bf16 queries, keys and values: the inputs cuDNN's fused attention takes on a GPU."""
  import zinfjax
  from zinfjax.models import gpt, lm_loss
  seen = []
  real = gpt.causal_attention
  monkeypatch.setattr(gpt, "causal_attention",
                      lambda q, k, v: seen.append((q.dtype, k.dtype, v.dtype)) or real(q, k, v))
  config = get_config("tiny", num_layers=2)
  state = zinfjax.init(lambda r: GPT(config, rngs=r), zinfjax.optim.adamw(1e-3), zinfjax.ZeroConfig(),
                       zinfjax.make_mesh(1), 0)
  tokens = np.random.default_rng(0).integers(0, config.vocab_size, (2, 33)).astype(np.int32)
  state, metrics = zinfjax.train_step(state, {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]},
                                      lm_loss)
  assert np.isfinite(float(metrics["loss"]))
  assert seen and set(seen) == {(np.dtype(jnp.bfloat16),) * 3}, seen
  state.close()


@pytest.mark.parametrize("promote", [True, False])
def test_a_stack_fed_fp32_under_mixed_precision_warns(promote):
  """A model whose embedding promotes its lookups to fp32 (`nnx.Embed` called as is) feeds its
  Stack fp32 activations under bf16: zinfjax's step warns, naming the stack and the fix; the
  bundled GPT (lookups in the table's dtype) trains without that warning."""
  import zinfjax
  from zinfjax.models import lm_loss

  class Promoting(GPT):
    def features(self, tokens_BxT):
      x_BxTxD = self.wte(tokens_BxT) + self.wpe(jnp.arange(tokens_BxT.shape[1]))
      return self.ln_f(self.blocks(x_BxTxD))

  config = get_config("tiny", num_layers=2)
  model = Promoting if promote else GPT
  state = zinfjax.init(lambda r: model(config, rngs=r), zinfjax.optim.adamw(1e-3),
                       zinfjax.ZeroConfig(), zinfjax.make_mesh(1), 0)
  tokens = np.random.default_rng(1).integers(0, config.vocab_size, (2, 33)).astype(np.int32)
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    state, metrics = zinfjax.train_step(state, {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]},
                                        lm_loss)
  state.close()
  said = [str(w.message) for w in caught if "Stack #0 receives" in str(w.message)]
  assert np.isfinite(float(metrics["loss"]))
  if promote:
    assert said and "float32 activations while its params are bfloat16" in said[0], said
    assert "nnx.Embed" in said[0] and "embedding.lookup" in said[0]
  else:
    assert not said, said


def _products(jaxpr) -> int:
  """dot_generals in a jaxpr, inside scans and custom rules too (each body counted once)."""
  from zinfjax.interpret import subjaxprs
  return sum(e.primitive.name == "dot_general" for e in jaxpr.eqns) + sum(
      _products(inner) for e in jaxpr.eqns for inner in subjaxprs(e))


@pytest.mark.parametrize("project", ["tied", "dense"])
def test_chunked_loss_and_its_grads_equal_the_full_logits(project):
  """fp32, ragged chunks, a cotangent other than 1: the loss and its grads to the rows and the
  weight equal those of the whole [tokens, vocab] logits; the grads are taken as each chunk's
  logits are made (one product for the logits, one per grad: none made again in backward),
  and a weight that is not differentiated gets no product for its grad."""
  from zinfjax.models import chunked_cross_entropy
  from zinfjax.models import loss as L
  fn = getattr(L, project)
  n, d, v, chunk = 300, 16, 100, 64
  x = jax.random.normal(jax.random.key(1), (n, d), jnp.float32)
  w = jax.random.normal(jax.random.key(2), (v, d) if project == "tied" else (d, v), jnp.float32)
  targets = jax.random.randint(jax.random.key(3), (n,), 0, v)
  full = lambda x, w: 3.0 * jnp.mean(L._chunk_losses(fn(x, w), targets))
  chunked = lambda x, w: 3.0 * chunked_cross_entropy(x, w, fn, targets, chunk)
  np.testing.assert_allclose(chunked(x, w), full(x, w), rtol=1e-6)
  for got, want in zip(jax.grad(chunked, (0, 1))(x, w), jax.grad(full, (0, 1))(x, w)):
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)
  np.testing.assert_allclose(jax.grad(chunked)(x, w), jax.grad(full)(x, w), rtol=1e-5, atol=1e-7)
  assert _products(jax.make_jaxpr(jax.grad(chunked, (0, 1)))(x, w).jaxpr) == 3
  assert _products(jax.make_jaxpr(jax.grad(chunked))(x, w).jaxpr) == 2
  assert _products(jax.make_jaxpr(chunked)(x, w).jaxpr) == 1


def test_the_default_chunk_is_the_largest_whose_fp32_logits_fit():
  """1024 tokens at least, doubled while a chunk's fp32 logits fit LOSS_CHUNK_BYTES; the loss
  scores a batch in chunks of it."""
  from zinfjax.models.loss import LOSS_CHUNK_BYTES, default_chunk
  assert default_chunk(32768) == 4096 and default_chunk(128256) == 1024
  for vocab in (65, 50257, 151936):
    chunk = default_chunk(vocab)
    assert chunk == 1024 or chunk * vocab * 4 <= LOSS_CHUNK_BYTES < 2 * chunk * vocab * 4
  config = get_config("tiny", num_layers=1, hidden=32, num_heads=2, seq_len=64,
                      vocab_size=LOSS_CHUNK_BYTES // (4 * 2048))  # chunks of 2048 tokens
  from zinfjax.interpret import subjaxprs
  from zinfjax.models import lm_loss
  graphdef, params = nnx.split(GPT(config, rngs=nnx.Rngs(0)))
  tokens = jnp.zeros((64, 64), jnp.int32)  # 4096 tokens: two chunks
  jaxpr = jax.make_jaxpr(lambda p: lm_loss(nnx.merge(graphdef, p),
                                           {"inputs": tokens, "targets": tokens}))(params)

  def lengths(jx):  # every scan's length, nested ones too
    for e in jx.eqns:
      if e.primitive.name == "scan":
        yield e.params["length"]
      for inner in subjaxprs(e):
        yield from lengths(inner)

  assert 2 in list(lengths(jaxpr.jaxpr)), list(lengths(jaxpr.jaxpr))


def test_chunked_loss_holds_no_token_by_vocab_fp32_array():
  """bf16: the loss's program has no fp32 array of [tokens, vocab] (only chunk-sized ones)."""
  from zinfjax.models import chunked_cross_entropy
  from zinfjax.models.loss import tied
  n, d, v, chunk = 512, 16, 1000, 64
  x = jax.random.normal(jax.random.key(1), (n, d), jnp.bfloat16)
  table = jax.random.normal(jax.random.key(2), (v, d), jnp.bfloat16)
  targets = jax.random.randint(jax.random.key(3), (n,), 0, v)
  grad = jax.grad(lambda x, w: chunked_cross_entropy(x, w, tied, targets, chunk), (0, 1))
  jaxpr = jax.make_jaxpr(grad)(x, table)

  def shapes(jx):  # every value the program makes, inside scans and remats too
    for eqn in jx.eqns:
      yield from (var.aval for var in eqn.outvars)
      for p in eqn.params.values():
        for inner in (p if isinstance(p, (tuple, list)) else [p]):
          inner = getattr(inner, "jaxpr", inner)
          if hasattr(inner, "eqns"):
            yield from shapes(inner)

  big = [a for a in shapes(jaxpr.jaxpr) if getattr(a, "dtype", None) == jnp.float32
         and len(a.shape) >= 2 and a.shape[-1] == v and np.prod(a.shape[:-1]) > chunk]
  assert not big, big
  seen = [a for a in shapes(jaxpr.jaxpr) if getattr(a, "shape", ())[-1:] == (v,)
          and getattr(a, "dtype", None) == jnp.float32]
  assert seen  # the chunk's fp32 logits are there: the check looked inside the scan
