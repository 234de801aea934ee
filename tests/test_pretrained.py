"""Existing weights into every tier, Hugging Face checkpoints in and out, eval and the model view.

The tiny checkpoints and their `transformers` logits under tests/data/hf are
made by scripts/make_hf_testdata.py (transformers is not a test dependency).
"""

import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import zinfjax
from zinfjax.models import GPT, GPTConfig, hf, lm_loss, rope
from zinfjax.weights import safetensors, source

from helpers import REPO, random_batches
from placements import PLACEMENTS, placed

HF = os.path.join(REPO, "tests", "data", "hf")
CFG = GPTConfig(vocab_size=67, seq_len=16, num_layers=3, num_heads=2, hidden=32)


def _tx(placement):
  return optax.adamw(1e-3) if placement.states_on_device else zinfjax.optim.adamw(1e-3)


def _close(state):
  state.close()  # joins the run's threads and frees its swap folder for the next init


def _max_diff(a, b) -> float:
  return max(float(np.max(np.abs(np.asarray(x) - np.asarray(y))))
             for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def _loss_of_logits(logits, tokens) -> float:
  x = jnp.asarray(logits[:, :-1])
  return float(optax.softmax_cross_entropy_with_integer_labels(x, tokens[:, 1:]).mean())


@pytest.mark.parametrize("placement", list(PLACEMENTS), indirect=True)
def test_weights_stream_into_every_tier(placement, mesh):
  """A model in memory, its pure dict, and a factory returning it all start the run from exactly
  those weights (fp32, bit-exact) on every placement; the first loss is the model's own."""
  trained = GPT(CFG, rngs=nnx.Rngs(11))
  want = nnx.to_pure_dict(nnx.state(trained))
  batch = random_batches(1, 8, 16, CFG.vocab_size, seed=3)[0]
  make = lambda rngs: GPT(CFG, rngs=rngs)
  for params in (trained, want):
    state = zinfjax.init(make, _tx(placement), placement.zero(), mesh, params=params)
    assert _max_diff(state.full_params(), want) == 0.0
    state, metrics = zinfjax.train_step(state, batch, lm_loss)
    np.testing.assert_allclose(float(metrics["loss"]), float(lm_loss(trained, batch)), rtol=1e-6)
    _close(state)
  assert zinfjax.weights.existing_weights(lambda rngs: trained) is not None
  assert zinfjax.weights.existing_weights(make) is None
  state = zinfjax.init(lambda rngs: trained, _tx(placement), placement.zero(), mesh)
  assert _max_diff(state.full_params(), want) == 0.0
  _close(state)


def test_bad_weights_are_refused_before_anything_is_written(mesh, tmp_path):
  want = nnx.to_pure_dict(nnx.state(GPT(CFG, rngs=nnx.Rngs(0))))
  make = lambda rngs: GPT(CFG, rngs=rngs)
  missing = {k: v for k, v in want.items() if k != "ln_f"}
  nvme, device = placed("nvme", tmp_path), placed("device", tmp_path)
  with pytest.raises(ValueError, match="missing ln_f/bias, ln_f/scale"):
    zinfjax.init(make, _tx(nvme), nvme.zero(), mesh, params=missing)
  assert not os.path.exists(tmp_path / "swap" / "rank0" / "swap.bin") or \
      os.path.getsize(tmp_path / "swap" / "rank0" / "swap.bin") == 0
  wrong = jax.tree.map(lambda x: x, want)
  wrong["wte"]["embedding"] = np.zeros((66, 32), np.float32)
  with pytest.raises(ValueError, match=r"wte/embedding: model \(67, 32\), weights \(66, 32\)"):
    zinfjax.init(make, _tx(device), device.zero(), mesh, params=wrong)
  extra = {**want, "head": {"kernel": np.ones((2, 2), np.float32)}}
  with pytest.raises(ValueError, match="unexpected head/kernel"):
    zinfjax.init(make, _tx(device), device.zero(), mesh, params=extra)


# ------------------------------------------------------------------ Hugging Face
@pytest.mark.parametrize("family", ["llama", "qwen2", "gpt2", "mistral", "llama3", "qwen3",
                                    "yarn", "phi3", "olmo2", "gemma", "gemma2", "gemma3",
                                    "gemma3mm"])
def test_logits_equal_transformers(family):
  """Our model on the checkpoint's weights gives `transformers`' logits (fp32, abs 1e-5); the
  Mistral one's sliding window (5) is shorter than its 12 tokens; the Llama 3.1 one's rope
  scaling moves its logits by 0.1 (the same model unscaled is that far off); the Qwen3 one
  norms each head's queries and keys, and the YaRN one scales its rope; the Phi-3 one fuses q, k
  and v, and gate and up; the OLMo 2 one norms after attention and the MLP; the Gemma one gates
  with gelu, scales its norms by 1 + weight and its embedding by sqrt(hidden); the Gemma 2 one
  soft-caps its attention and output logits (at 2 and 3, where the caps matter); the Gemma 3 one's
  sliding (5 < 12 tokens) and global layers alternate, each with its rope, and it norms before and
  after attention and the MLP; the multimodal Gemma 3's text model gives its logits of text. The
  config counts the checkpoint's (text model's) params exactly."""
  config, make, weights = hf.load(os.path.join(HF, family))
  ckpt = safetensors.Checkpoint(os.path.join(HF, family))
  tower = hf.TEXT_PREFIXES[hf.text_prefix(set(ckpt))][1]
  assert config.num_params == sum(int(np.prod(ckpt[n].shape)) for n in ckpt if n.startswith(tower))
  ref = np.load(os.path.join(HF, family, "reference.npz"))
  model = nnx.eval_shape(lambda: make(nnx.Rngs(0)))
  nnx.update(model, jax.tree.map(lambda t: jnp.asarray(t.read(())), weights,
                                 is_leaf=source.is_tensor))
  logits = np.asarray(model(jnp.asarray(ref["tokens"])))
  assert np.abs(ref["logits"]).max() > 1.0  # not a near-uniform model
  np.testing.assert_allclose(logits, ref["logits"], atol=1e-5, rtol=0)


def test_hf_configs_round_trip_and_what_we_cannot_run_is_refused():
  """config.json -> our config -> config.json -> our config is the same config for every family
  (Mistral's sliding window too, written as Mistral's with no source config); what our models
  would compute otherwise than `transformers` is refused by name, not run."""
  def again(config, base=None):  # head_dim is written out where the source left it implied
    back = hf.config_from_hf(hf.config_to_hf(config, base))
    return back.replace(head_dim=None) if getattr(config, "head_dim", 0) is None else back

  for family in ("llama", "qwen2", "gpt2", "mistral", "llama3", "qwen3", "yarn", "phi3",
                 "olmo2", "gemma", "gemma2", "gemma3", "gemma3mm"):
    base = hf.read_config(os.path.join(HF, family))
    config = hf.config_from_hf(base)
    assert again(config, base) == config, family
    assert again(config) == config, family   # written with no source config
  mistral = hf.config_from_hf(hf.read_config(os.path.join(HF, "mistral")))
  assert mistral.sliding_window == 5
  # the family train_gpt names: config.json's, not the class of ours that runs it
  assert {f: hf.family(hf.read_config(os.path.join(HF, f))) for f in ("gpt2", "olmo2", "qwen3")
          } == {"gpt2": "GPT-2", "olmo2": "OLMo 2", "qwen3": "Qwen3"}
  assert hf.config_to_hf(mistral)["model_type"] == "mistral"
  llama3 = hf.config_from_hf(hf.read_config(os.path.join(HF, "llama3")))
  assert llama3.rope_scaling == rope.RopeScaling("llama3", 8.0, 1.0, 4.0, 64)
  legacy = {**hf.read_config(os.path.join(HF, "llama")), "rope_theta": 5e5,  # transformers 4's
            "rope_scaling": {"type": "linear", "factor": 4.0}}
  assert hf.config_from_hf(legacy).rope_scaling == rope.RopeScaling("linear", 4.0)
  assert hf.config_from_hf(legacy).rope_theta == 5e5
  qwen2 = hf.read_config(os.path.join(HF, "qwen2"))
  assert hf.config_from_hf({**qwen2, "sliding_window": 4}).sliding_window is None  # not in use
  for change, problem in [({"use_sliding_window": True}, "use_sliding_window"),
                          ({"layer_types": ["sliding_attention", "full_attention"]},
                           "layer_types"),
                          ({"rope_parameters": {"rope_type": "longrope"}}, "rope_scaling"),
                          ({"partial_rotary_factor": 0.5}, "partial_rotary_factor=0.5"),
                          ({"hidden_act": "relu"}, "hidden_act 'relu' is not supported"),
                          ({"use_bidirectional_attention": True}, "causal attention only"),
                          ({"model_type": "gemma3n"}, "model_type 'gemma3n' is not supported"),
                          ({"model_type": "gemma5"}, "model_type 'gemma5' is not supported; "),
                          ({"quantization_config": {"quant_method": "fp8"}},
                           "quantized \\(fp8\\): zinfjax trains float weights")]:
    with pytest.raises(ValueError, match=problem):
      hf.config_from_hf({**qwen2, **change})
  gpt2 = hf.read_config(os.path.join(HF, "gpt2"))
  for change, problem in [({"scale_attn_by_inverse_layer_idx": True}, "scaled otherwise"),
                          ({"scale_attn_weights": False}, "scaled otherwise"),
                          ({"n_inner": 100}, "n_inner=100"),
                          ({"tie_word_embeddings": False}, "an output head of its own"),
                          ({"activation_function": "relu"}, "activation")]:
    with pytest.raises(ValueError, match=problem):
      hf.config_from_hf({**gpt2, **change})
  assert hf.config_from_hf({**gpt2, "n_inner": 4 * gpt2["n_embd"]}) == hf.config_from_hf(gpt2)
  with pytest.raises(ValueError, match="written as a Mistral one"):
    hf.config_to_hf(mistral, hf.read_config(os.path.join(HF, "llama")))
  qwen3 = hf.config_from_hf(hf.read_config(os.path.join(HF, "qwen3")))
  assert qwen3.qk_norm and not qwen3.qkv_bias and hf.config_to_hf(qwen3)["model_type"] == "qwen3"
  given = {k: v for k, v in hf.read_config(os.path.join(HF, "qwen3")).items() if k != "head_dim"}
  assert hf.config_from_hf(given).dim == 128   # Qwen3's default, not hidden / heads
  given = {k: v for k, v in hf.read_config(os.path.join(HF, "mistral")).items()
           if k not in ("sliding_window", "max_position_embeddings")}
  assert (hf.config_from_hf(given).sliding_window, hf.config_from_hf(given).seq_len) == (
      4096, 131072)   # Mistral's defaults
  llama = hf.read_config(os.path.join(HF, "llama"))
  for config, base in [(qwen3, llama), (hf.config_from_hf(qwen2), llama), (qwen3, qwen2)]:
    with pytest.raises(ValueError, match=f"a {base['model_type']} checkpoint cannot hold"):
      hf.config_to_hf(config, base)
  with pytest.raises(ValueError, match="attention_bias=true \\(biases on the q, k, v and o"):
    hf.config_from_hf({**llama, "attention_bias": True})
  # Phi-3: transformers' defaults (no sliding window, eps 1e-5, 4096 positions); its fused
  # projections' rows checked against the config's heads
  phi3 = {k: v for k, v in hf.read_config(os.path.join(HF, "phi3")).items()
          if k not in ("sliding_window", "rms_norm_eps", "max_position_embeddings")}
  given = hf.config_from_hf(phi3)
  assert (given.sliding_window, given.rms_eps, given.seq_len) == (None, 1e-5, 4096)
  olmo2 = hf.config_from_hf(hf.read_config(os.path.join(HF, "olmo2")))
  assert olmo2.post_norm and olmo2.qk_norm_span == "all"
  assert hf.config_to_hf(olmo2)["model_type"] == "olmo2"   # the one family that holds it
  assert hf.config_to_hf(olmo2.replace(qk_norm=False, post_norm=False))["model_type"] == "llama"
  with pytest.raises(ValueError, match="a qwen3 checkpoint cannot hold .* OLMo 2's alone"):
    hf.config_to_hf(olmo2, hf.read_config(os.path.join(HF, "qwen3")))
  # Gemma: transformers' defaults (tied, head_dim 256, 8192 positions, GeGLU); its releases'
  # legacy hidden_act "gelu" is the tanh approximation, as transformers reads it; a Llama's is not
  gemma = {k: v for k, v in hf.read_config(os.path.join(HF, "gemma")).items()
           if k not in ("tie_word_embeddings", "head_dim", "max_position_embeddings",
                        "hidden_act")}
  given = hf.config_from_hf(gemma)
  assert (given.tie_embeddings, given.dim, given.seq_len, given.activation) == (
      True, 256, 8192, "gelu_tanh")
  assert given.norm_offset and given.embed_scale and hf.config_to_hf(given)["model_type"] == "gemma"
  assert hf.config_from_hf({**gemma, "hidden_act": "gelu"}).activation == "gelu_tanh"
  assert hf.config_from_hf({**llama, "hidden_act": "gelu"}).activation == "gelu"
  assert hf.config_to_hf(given.replace(activation="gelu"))["hidden_act"] == "gelu"
  with pytest.raises(ValueError, match="a llama checkpoint cannot hold .* Gemma's alone"):
    hf.config_to_hf(given, llama)
  # Gemma 3: its older fields read as transformers reads them (its layer_types and
  # rope_parameters from sliding_window_pattern, rope_local_base_freq and rope_scaling)
  gemma3 = hf.read_config(os.path.join(HF, "gemma3"))
  legacy = {**{k: v for k, v in gemma3.items() if k not in ("layer_types", "rope_parameters")},
            "rope_theta": 5e5, "rope_local_base_freq": 2e4, "sliding_window_pattern": 2,
            "rope_scaling": {"rope_type": "linear", "factor": 8.0}, "num_hidden_layers": 4}
  given = hf.config_from_hf(legacy)
  assert (given.layer_types, given.rope_theta, given.local_rope_theta, given.rope_scaling) == (
      ("sliding", "full") * 2, 5e5, 2e4, rope.RopeScaling("linear", 8.0))
  assert hf.config_from_hf(hf.config_to_hf(given)) == given
  assert hf.family(gemma3) == "Gemma 3"
  # Gemma 2: transformers' soft caps (30 and 50) where config.json names none, none where it
  # gives null; every other layer global where it gives no layer_types
  gemma2 = {k: v for k, v in hf.read_config(os.path.join(HF, "gemma2")).items()
            if k not in ("final_logit_softcapping", "attn_logit_softcapping", "layer_types")}
  given = hf.config_from_hf(gemma2)
  assert (given.final_softcap, given.attn_softcap, given.layer_types) == (
      30.0, 50.0, ("sliding", "full", "sliding"))
  given = hf.config_from_hf({**gemma2, "final_logit_softcapping": None})
  assert given.final_softcap is None and hf.config_from_hf(hf.config_to_hf(given)) == given
  for change, problem in [({"layer_types": ["chunked_attention"] * 3}, "chunked_attention"),
                          ({"rope_parameters": {"sliding_attention": {"rope_type": "yarn"}}},
                           "sliding layers' rope of type 'yarn'")]:
    with pytest.raises(ValueError, match=problem):
      hf.config_from_hf({**gemma3, **change})
  mistral = hf.config_from_hf(hf.read_config(os.path.join(HF, "mistral")))
  with pytest.raises(ValueError, match="Gemma 2's and 3's alone give their layers' kinds"):
    hf.config_to_hf(mistral.replace(layer_types=("sliding", "full")))
  with pytest.raises(ValueError, match="Gemma 3's alone a local rope"):
    hf.config_to_hf(given.replace(local_rope_theta=1e4))   # a Gemma 2: one rope
  wrong = hf.config_from_hf({**phi3, "num_key_value_heads": 4})
  with pytest.raises(ValueError, match="qkv_proj.weight' .* has 64 rows where config.json's "
                                       "heads and sizes make 96"):
    hf.load_weights(os.path.join(HF, "phi3"), wrong)


@pytest.mark.parametrize("family,placement", [("llama", "nvme"), ("qwen2", "pinned"),
                                              ("gpt2", "split"), ("llama", "pipeline"),
                                              ("qwen3", "pipeline"), ("phi3", "split"),
                                              ("olmo2", "nvme"), ("gemma", "pinned"),
                                              ("gemma2", "pipeline"), ("gemma3", "split")],
                         indirect=["placement"])
def test_checkpoint_streams_into_zero3(family, placement, mesh):
  """Each checkpoint streamed (memory-mapped safetensors, one shard at a time) into a placement:
  the ZeRO-3 eval loss equals the loss of transformers' logits, and training lowers it."""
  folder = os.path.join(HF, family)
  config, make, weights = hf.load(folder)
  ref = np.load(os.path.join(folder, "reference.npz"))
  tokens = np.tile(ref["tokens"], (4, 1))   # 8 rows for 8 devices
  batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
  state = zinfjax.init(make, _tx(placement), placement.zero(), mesh, params=weights)
  loss = float(zinfjax.eval_step(state, batch, lm_loss)["loss"])
  np.testing.assert_allclose(loss, _loss_of_logits(ref["logits"], ref["tokens"]), rtol=1e-5)
  for _ in range(3):
    state, metrics = zinfjax.train_step(state, batch, lm_loss)
  assert float(zinfjax.eval_step(state, batch, lm_loss)["loss"]) < loss - 0.01
  _close(state)


@pytest.mark.parametrize("family", ["llama", "gpt2", "qwen3", "phi3", "olmo2", "gemma",
                                    "gemma2", "gemma3"])
def test_export_round_trip(family, mesh, tmp_path):
  """`hf.save` from a training state (NVMe included) writes the checkpoint's names, shapes and
  values back: reading it again is bit-exact, sharded with an index as well."""
  folder = os.path.join(HF, family)
  config, make, weights = hf.load(folder)
  split = placed("split", tmp_path)
  state = zinfjax.init(make, _tx(split), split.zero(), mesh, params=weights)
  out = tmp_path / "export"
  files = hf.save(str(out), config, state, base_config=hf.read_config(folder),
                  max_shard_bytes=40_000)
  assert safetensors.INDEX in files and len(files) > 2
  theirs, ours = safetensors.Checkpoint(folder), safetensors.Checkpoint(str(out))
  names = {n for n in theirs if not hf.IGNORED.search(n)}
  assert set(ours) == names
  for n in names:
    np.testing.assert_array_equal(ours[n], theirs[n], err_msg=n)
  again = hf.load(str(out))[2]
  assert _max_diff(jax.tree.map(lambda t: t.read(()), again, is_leaf=source.is_tensor),
                   state.full_params()) == 0.0
  assert hf.read_config(str(out))["torch_dtype"] == "float32"
  hf.save(str(tmp_path / "bf16"), config, state, dtype=jnp.bfloat16,   # rounded, and said so
          base_config=hf.read_config(folder))
  half = safetensors.Checkpoint(str(tmp_path / "bf16"))
  assert hf.read_config(str(tmp_path / "bf16"))["torch_dtype"] == "bfloat16"
  for n in names:
    assert half[n].dtype == jnp.bfloat16
    np.testing.assert_array_equal(half[n], theirs[n].astype(jnp.bfloat16), err_msg=n)
  with pytest.raises(ValueError, match="writes float weights: dtype int8 is none of float32"):
    hf.save(str(tmp_path / "int8"), config, state, dtype=np.int8)
  assert not os.path.exists(tmp_path / "int8")
  _close(state)


def test_a_multimodal_gemma3_trains_and_exports_its_text_model(tmp_path):
  """A multimodal Gemma 3 checkpoint (Gemma3ForConditionalGeneration) is read for its text
  model: the vision tower and projector are left out, a stray tensor of the text model is still
  refused; the export is that text model alone, a Gemma3ForCausalLM checkpoint whose tensors are
  the source's text tensors, bit for bit."""
  folder = os.path.join(HF, "gemma3mm")
  config, make, weights = hf.load(folder)
  assert hf.family(hf.read_config(folder)) == "Gemma 3" and config.layer_types == ("sliding",
                                                                                   "full")
  hf.save(str(tmp_path / "out"), config, weights_of(weights), base_config=hf.read_config(folder))
  out = hf.read_config(str(tmp_path / "out"))
  assert (out["model_type"], out["architectures"], "vision_config" in out) == (
      "gemma3_text", ["Gemma3ForCausalLM"], False)
  theirs, ours = safetensors.Checkpoint(folder), safetensors.Checkpoint(str(tmp_path / "out"))
  text = {n: n.replace("language_model.model.", "model.") for n in theirs
          if n.startswith("language_model.")}
  assert set(ours) == set(text.values()) and len(set(theirs)) > len(text)   # towers left out
  for n, m in text.items():
    np.testing.assert_array_equal(ours[m], theirs[n], err_msg=n)
  stray = tmp_path / "stray"
  shutil.copytree(folder, stray)
  tensors = {n: np.asarray(theirs[n]) for n in theirs}
  safetensors.write(str(stray / "model.safetensors"), [
      (n, (x.shape, x.dtype, lambda x=x: x)) for n, x in
      {**tensors, "language_model.model.extra.weight": np.ones(3, np.float32)}.items()])
  with pytest.raises(ValueError, match="does not use: language_model.model.extra.weight"):
    hf.load(str(stray))


def weights_of(tree):
  """A tree of lazily read tensors as arrays."""
  return jax.tree.map(lambda t: np.asarray(t.read(())), tree, is_leaf=source.is_tensor)


def test_export_replaces_a_folder_whole_or_not_at_all(tmp_path):
  """`hf.save` into a folder of an earlier export: a failed one leaves it as it was; one that
  succeeds leaves none of the earlier export's other shards (an index naming old shards would
  load the old weights)."""
  config, make, weights = hf.load(os.path.join(HF, "gpt2"))
  model = make(nnx.Rngs(0))
  out = tmp_path / "out"
  hf.save(str(out), config, model, max_shard_bytes=40_000)
  before = {p.name: p.read_bytes() for p in out.iterdir()}
  assert safetensors.INDEX in before

  class Failing:
    def full_leaf(self, path, layer=None):
      if "h" in path.split("/")[0] or "blocks" in path:
        raise OSError("the disk went away")
      return np.asarray(hf._get(nnx.to_pure_dict(nnx.state(model)), path))
  with pytest.raises(OSError, match="the disk went away"):
    hf.save(str(out), config, Failing())
  assert {p.name: p.read_bytes() for p in out.iterdir()} == before
  hf.save(str(out), config, model)   # one file now
  assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]


def test_export_carries_the_tokenizer_and_generation_files(tmp_path):
  """`hf.save(..., copy_from=source)` copies the source folder's tokenizer, chat template and
  generation files along with the weights (train_gpt --export does, from --init-from), and
  nothing else of it; without it, none."""
  source = tmp_path / "source"
  shutil.copytree(os.path.join(HF, "gpt2"), source)
  companions = {"tokenizer.json": b'{"model": {"type": "BPE"}}', "merges.txt": b"#v\na b\n",
                "generation_config.json": b'{"do_sample": true}'}
  for name, data in {**companions, "notes.txt": b"mine"}.items():
    (source / name).write_bytes(data)
  config, make, _ = hf.load(str(source))
  model = make(nnx.Rngs(0))
  hf.save(str(tmp_path / "out"), config, model, copy_from=str(source))
  assert {p.name: p.read_bytes() for p in (tmp_path / "out").iterdir()
          if p.name not in ("config.json", "model.safetensors")} == companions
  hf.save(str(tmp_path / "bare"), config, model)
  assert sorted(p.name for p in (tmp_path / "bare").iterdir()) == ["config.json",
                                                                   "model.safetensors"]


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "yarn", "phi3", "olmo2", "gemma",
                                    "gemma2", "gemma3", "gemma3mm"])
def test_export_loads_in_transformers(family, mesh, tmp_path):
  """A fine-tuned export loads with `from_pretrained` and gives our logits (needs transformers)."""
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  folder = os.path.join(HF, family)
  config, make, weights = hf.load(folder)
  ref = np.load(os.path.join(folder, "reference.npz"))
  tokens = np.tile(ref["tokens"], (4, 1))
  pinned = placed("pinned", tmp_path)
  state = zinfjax.init(make, _tx(pinned), pinned.zero(), mesh, params=weights)
  state, _ = zinfjax.train_step(state, {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]},
                                lm_loss)
  hf.save(str(tmp_path / "out"), config, state, base_config=hf.read_config(folder))
  model = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "out")).eval()
  with torch.no_grad():
    theirs = model(torch.tensor(ref["tokens"])).logits.float().numpy()
  ours = np.asarray(state.model()(jnp.asarray(ref["tokens"])))
  assert np.abs(theirs - ref["logits"]).max() > 1e-4   # the export holds the trained weights
  np.testing.assert_allclose(ours, theirs, atol=1e-5, rtol=0)


def test_safetensors_errors_name_the_file(tmp_path):
  path = str(tmp_path / "x.safetensors")
  safetensors.write(path, [("a", ((3, 4), np.float32, lambda: np.ones((3, 4), np.float32)))])
  assert np.array_equal(safetensors.File(path)["a"], np.ones((3, 4)))
  with open(path, "r+b") as f:
    f.truncate(os.path.getsize(path) - 8)
  with pytest.raises(safetensors.FormatError, match="x.safetensors.*truncated or damaged"):
    safetensors.File(path)
  (tmp_path / "empty").mkdir()
  with pytest.raises(FileNotFoundError, match="neither model.safetensors nor"):
    safetensors.Checkpoint(str(tmp_path / "empty"))


# ------------------------------------------------------------------ using the model
@pytest.mark.parametrize("placement", ["device", "stage1", "nvme"], indirect=True)
def test_eval_step_and_model_view(placement, mesh):
  """eval_step is the forward loss of the current params on every tier and changes nothing; a
  model from state.model() stays valid (same values) after later steps donate the state."""
  batches = random_batches(3, 8, 16, CFG.vocab_size, seed=5)
  make = lambda rngs: GPT(CFG, rngs=rngs)
  state = zinfjax.init(make, _tx(placement), placement.zero(), mesh, rng=2)
  evaluate = jax.jit(lm_loss)
  model = state.model()
  before = float(evaluate(model, batches[1]))
  np.testing.assert_allclose(float(zinfjax.eval_step(state, batches[1], lm_loss)["loss"]), before,
                             rtol=1e-6)
  for b in batches:
    state, metrics = zinfjax.train_step(state, b, lm_loss)
  assert float(evaluate(model, batches[1])) == before
  now = float(zinfjax.eval_step(state, batches[1], lm_loss)["loss"])
  assert float(zinfjax.eval_step(state, batches[1], lm_loss)["loss"]) == now
  np.testing.assert_allclose(now, float(evaluate(state.model(), batches[1])), rtol=1e-6)
  assert abs(now - before) > 1e-4
  _close(state)


def test_metrics_carry_the_learning_rate(mesh, tmp_path):
  schedule = optax.linear_schedule(1e-3, 0.0, 10)
  batch = random_batches(1, 8, 16, CFG.vocab_size)[0]
  make = lambda rngs: GPT(CFG, rngs=rngs)
  for tx, name in ((optax.inject_hyperparams(optax.adamw)(learning_rate=schedule), "device"),
                   (zinfjax.optim.adamw(schedule), "nvme")):
    state = zinfjax.init(make, tx, placed(name, tmp_path).zero(), mesh)
    lrs = []
    for _ in range(3):
      state, metrics = zinfjax.train_step(state, batch, lm_loss)
      lrs.append(float(metrics["lr"]))
    np.testing.assert_allclose(lrs, [float(schedule(i)) for i in range(3)], rtol=1e-6)
    _close(state)


def test_masked_and_multi_transform_freeze(mesh, tmp_path):
  """optax.multi_transform and optax.masked with set_to_zero train on ZeRO like on one device:
  the frozen leaves do not move, the others match nnx.Optimizer (fp32: losses 1e-6; params to
  1e-6 but for at most 1 in 1000 elements, and those to 1% of the 3e-3 moved)."""
  batches = random_batches(3, 8, 16, CFG.vocab_size, seed=1)
  labels = lambda p: jax.tree_util.tree_map_with_path(
      lambda path, _: "frozen" if "wte" in jax.tree_util.keystr(path) else "train", p)
  txs = [optax.multi_transform({"train": optax.adam(1e-3), "frozen": optax.set_to_zero()}, labels),
         optax.chain(optax.masked(optax.set_to_zero(), lambda p: jax.tree.map(
             lambda x: x.shape[0] == CFG.vocab_size, p)), optax.adam(1e-3))]
  make = lambda rngs: GPT(CFG, rngs=rngs)
  for tx in txs:
    ref = make(nnx.Rngs(0))
    start = nnx.to_pure_dict(nnx.state(ref))
    opt = nnx.Optimizer(ref, tx, wrt=nnx.Param)
    state = zinfjax.init(make, tx, placed("device", tmp_path).zero(), mesh, params=start)
    for b in batches:
      state, metrics = zinfjax.train_step(state, b, lm_loss)
      loss, grads = nnx.value_and_grad(lm_loss)(ref, b)
      opt.update(ref, grads)
      np.testing.assert_allclose(float(metrics["loss"]), float(loss), rtol=1e-6)
    got = state.full_params()
    # Adam's step is ~lr wherever a grad is tiny, so the grads' summation order shows as a few
    # elements off by ~1e-3 of lr (6e-6 seen on an AVX-512 machine); the rest agree to 1e-7
    diff = np.concatenate([np.abs(np.asarray(x) - np.asarray(y)).ravel() for x, y in zip(
        jax.tree.leaves(got), jax.tree.leaves(nnx.to_pure_dict(nnx.state(ref))))])
    assert np.mean(diff > 1e-6) <= 1e-3 and diff.max() < 3e-5
    assert _max_diff(got["wte"], start["wte"]) == 0.0
    assert _max_diff(got["blocks"], start["blocks"]) > 1e-3
