"""Hugging Face `config.json` and our model configs, both ways.

`config_from_hf` reads a checkpoint's settings as a `LlamaConfig` (Llama,
Mistral, Qwen2, Qwen3, Phi-3, OLMo 2, Gemma, Gemma 2, Gemma 3's text model) or a `GPTConfig`
(GPT-2), with `transformers`'
defaults for what the file leaves out, and refuses by name what our models
would compute otherwise; `config_to_hf` writes one back, keeping the fields of
a source checkpoint's config.
"""

from __future__ import annotations

from typing import Any

from . import rope
from .config import GPTConfig
from .llama import LlamaConfig

ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                 "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                 "phi3": "Phi3ForCausalLM", "olmo2": "Olmo2ForCausalLM",
                 "gemma": "GemmaForCausalLM", "gemma2": "Gemma2ForCausalLM",
                 "gemma3_text": "Gemma3ForCausalLM"}
LLAMA_TYPES = tuple(ARCHITECTURES)
# transformers' defaults for what a config.json leaves out, where they are not ours
CONTEXT = {"llama": 2048, "mistral": 131072, "qwen2": 32768, "qwen3": 32768,  # positions
           "phi3": 4096, "olmo2": 2048, "gemma": 8192, "gemma2": 8192, "gemma3_text": 131072}
EPS = {"phi3": 1e-5, "olmo2": 1e-5}  # rms_norm_eps (1e-6 for the others)
GEMMA2, GEMMA3 = "gemma2", "gemma3_text"
HEAD_DIM = {"qwen3": 128, "gemma": 256, GEMMA2: 256, GEMMA3: 256}  # (others: hidden / heads)
ACT = dict.fromkeys(("gemma", GEMMA2, GEMMA3), "gelu_pytorch_tanh")  # (silu for the others)
TIED = ("gemma", GEMMA2, GEMMA3)   # tie_word_embeddings (false for the others)
# the families of sliding-window and global layers (Gemma 3's each with its rope): every n-th
# layer global where config.json gives no layer_types (its sliding_window_pattern, Gemma 3's),
# and their logits' soft caps where it gives none (final, attention)
LAYERED = {GEMMA2: 2, GEMMA3: 6}
SOFTCAPS = {GEMMA2: (30.0, 50.0), GEMMA3: (None, None)}
# transformers' Gemma3TextConfig defaults for the sizes a config.json may leave out (the
# text_config of a multimodal Gemma 3 checkpoint often does)
GEMMA3_SIZES = {"vocab_size": 262208, "hidden_size": 2304, "intermediate_size": 9216,
                "num_hidden_layers": 26, "num_attention_heads": 8, "num_key_value_heads": 4}
LAYER_TYPES = {"sliding_attention": "sliding", "full_attention": "full"}  # config.json's: ours
# hidden_act of config.json -> LlamaConfig.activation (transformers' ACT2FN: gelu_new and
# gelu_pytorch_tanh are both the tanh approximation); back, the first of each
ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu": "gelu", "gelu_pytorch_tanh": "gelu_tanh",
               "gelu_new": "gelu_tanh"}
HF_ACTIVATIONS = {ours: theirs for theirs, ours in reversed(ACTIVATIONS.items())}
# the families whose q, k, v and o projections have no bias (config.json's attention_bias)
UNBIASED = ("llama", "qwen3", "olmo2", "gemma", GEMMA2, GEMMA3)
# what sets a family's blocks apart (LlamaConfig's qk_norm and its span, qkv_bias, post_norm,
# norm_offset, embed_scale): the one family that holds a model of each; the others, none of them
FEATURES = {"qwen3": dict(qk_norm=True, qk_norm_span="head"), "qwen2": dict(qkv_bias=True),
            "olmo2": dict(qk_norm=True, qk_norm_span="all", post_norm=True),
            "gemma": dict(norm_offset=True, embed_scale=True),
            GEMMA2: dict(norm_offset=True, embed_scale=True, sandwich_norm=True),
            GEMMA3: dict(norm_offset=True, embed_scale=True, qk_norm=True, qk_norm_span="head",
                         sandwich_norm=True)}
PLAIN = {**dict.fromkeys(("qk_norm", "qkv_bias", "post_norm", "norm_offset", "embed_scale",
                          "sandwich_norm"), False), "qk_norm_span": "head"}   # a Llama's
# the families whose layers take config.json's sliding_window (Gemma's sliding ones alone),
# with transformers' default
WINDOWED = {"mistral": 4096, "phi3": None, GEMMA2: 4096, GEMMA3: 4096}


def config_from_hf(hf: dict[str, Any], remat: bool = True) -> GPTConfig | LlamaConfig:
  """Our config of a Hugging Face `config.json` dict; a clear error for what we do not run."""
  kind = hf.get("model_type")
  if hf.get("quantization_config"):
    method = (hf["quantization_config"] or {}).get("quant_method", "unnamed")
    raise ValueError(f"the checkpoint is quantized ({method}): zinfjax trains float weights; "
                     "use the model's bf16 or fp32 release.")
  if kind == "gemma3":  # a multimodal checkpoint: its text model
    return config_from_hf(text_config(hf), remat)
  if kind == GEMMA3:
    hf = {**GEMMA3_SIZES, **hf}
  if kind in LLAMA_TYPES:
    scaling, local = _ropes(kind, hf)
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type not in ("default", None, *rope.KINDS):
      raise ValueError(f"rope_scaling of type {rope_type!r} is not supported (the default "
                       f"rotary embedding, or scaled: {', '.join(rope.KINDS)}).")
    theta = scaling["rope_theta"] if local else hf.get("rope_theta",
                                                       scaling.get("rope_theta", 10000.0))
    partial = scaling.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    if partial != 1.0:
      raise ValueError(f"partial_rotary_factor={partial} is not supported (rotary positions on "
                       "every dimension of a head).")
    act = hf.get("hidden_activation" if kind in LAYERED else "hidden_act") or ACT.get(kind, "silu")
    if kind == "gemma" and act == "gelu":  # the releases' legacy name for it (transformers')
      act = "gelu_pytorch_tanh"
    if act not in ACTIVATIONS:
      raise ValueError(f"hidden_act {act!r} is not supported (the MLP's gate: "
                       f"{', '.join(ACTIVATIONS)}).")
    if hf.get("use_bidirectional_attention"):
      raise ValueError("use_bidirectional_attention=true is not supported (causal attention "
                       "only).")
    if hf.get("use_sliding_window"):
      raise ValueError("use_sliding_window=true is not supported (full causal attention only).")
    kinds = set(hf.get("layer_types") or ()) - {"full_attention"}
    if kinds and kind not in WINDOWED:  # Mistral's layers all take its window
      raise ValueError(f"layer_types {sorted(kinds)} are not supported (full causal attention "
                       "only).")
    if kind == "llama" and hf.get("mlp_bias"):
      raise ValueError("mlp_bias=true is not supported.")
    if kind in UNBIASED and hf.get("attention_bias"):
      raise ValueError("attention_bias=true (biases on the q, k, v and o projections) is not "
                       "supported (Qwen2's q, k and v biases are).")
    heads = hf["num_attention_heads"]
    return LlamaConfig(
        vocab_size=hf["vocab_size"], hidden=hf["hidden_size"],
        intermediate=hf["intermediate_size"], num_layers=hf["num_hidden_layers"],
        num_heads=heads, num_kv_heads=hf.get("num_key_value_heads") or heads,
        head_dim=hf.get("head_dim", HEAD_DIM.get(kind)),
        rope_theta=float(theta),
        rope_scaling=_rope_scaling(rope_type, scaling, hf),
        rms_eps=float(hf.get("rms_norm_eps", EPS.get(kind, 1e-6))),
        tie_embeddings=bool(hf.get("tie_word_embeddings", kind in TIED)),
        **FEATURES.get(kind, {}),
        seq_len=hf.get("max_position_embeddings", CONTEXT[kind]),
        sliding_window=hf.get("sliding_window", WINDOWED[kind]) if kind in WINDOWED else None,
        activation=ACTIVATIONS[act], remat=remat,
        **(_layered(kind, hf, local) if kind in LAYERED else {}))
  if kind == "gpt2":
    if hf.get("activation_function", "gelu_new") not in ("gelu_new", "gelu_pytorch_tanh"):
      raise ValueError(f"GPT-2 activation {hf['activation_function']!r} is not supported.")
    if abs(hf.get("layer_norm_epsilon", 1e-5) - 1e-5) > 1e-12:
      raise ValueError("GPT-2 layer_norm_epsilon other than 1e-5 is not supported.")
    if not hf.get("scale_attn_weights", True) or hf.get("scale_attn_by_inverse_layer_idx"):
      raise ValueError("GPT-2 attention scaled otherwise than by 1/sqrt(head dim) "
                       "(scale_attn_weights, scale_attn_by_inverse_layer_idx) is not supported.")
    if not hf.get("tie_word_embeddings", True):
      raise ValueError("GPT-2 with tie_word_embeddings=false (an output head of its own) is not "
                       "supported: zinfjax's GPT projects with the token embedding.")
    if hf.get("n_inner") not in (None, 4 * hf["n_embd"]):
      raise ValueError(f"GPT-2 n_inner={hf['n_inner']} is not supported (the MLP is 4 x n_embd "
                       f"= {4 * hf['n_embd']} wide).")
    return GPTConfig(vocab_size=hf["vocab_size"], seq_len=hf["n_positions"],
                     num_layers=hf["n_layer"], num_heads=hf["n_head"], hidden=hf["n_embd"],
                     remat=remat)
  raise ValueError(f"model_type {kind!r} is not supported; zinfjax reads "
                   f"{', '.join(LLAMA_TYPES + ('gpt2',))}.")


def text_config(hf: dict[str, Any]) -> dict[str, Any]:
  """The text model's config.json of a multimodal Gemma 3 checkpoint's (its `text_config`, with
  the checkpoint's tied embeddings and token ids)."""
  ids = {k: hf[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in hf}
  tied = {k: hf[k] for k in ("tie_word_embeddings",) if k in hf}   # the checkpoint's head
  return {**ids, **(hf.get("text_config") or {}), **tied, "model_type": GEMMA3,
          "architectures": [ARCHITECTURES[GEMMA3]]}


def _ropes(kind: str, hf: dict) -> tuple[dict, dict | None]:
  """config.json's rope parameters: every layer's (Gemma 3's global layers'), with their
  rope_theta, and Gemma 3's sliding layers' (None for the others), with transformers' defaults
  and its reading of the older fields (rope_scaling, rope_local_base_freq)."""
  given = hf.get("rope_parameters") or {}
  if kind != GEMMA3:
    return hf.get("rope_scaling") or given, None
  full = {"rope_theta": hf.get("rope_theta", 1e6), **(given.get("full_attention") or {}),
          **(hf.get("rope_scaling") or {})}
  return full, {"rope_theta": hf.get("rope_local_base_freq", 1e4),
                **(given.get("sliding_attention") or {})}


def _layered(kind: str, hf: dict, local: dict | None) -> dict[str, Any]:
  """Gemma 2's and 3's LlamaConfig fields: their layers' kinds, Gemma 3's sliding layers' rope,
  the attention logits' scale, the soft caps."""
  if local and local.get("rope_type", "default") != "default":
    raise ValueError(f"the sliding layers' rope of type {local['rope_type']!r} is not supported "
                     "(theirs is the default rotary embedding, unscaled).")
  final, attn = (hf.get(f"{k}_logit_softcapping", default)
                 for k, default in zip(("final", "attn"), SOFTCAPS[kind]))
  n, every = hf["num_hidden_layers"], hf.get("sliding_window_pattern", LAYERED[kind])
  types = hf.get("layer_types") or [
      "full_attention" if (i + 1) % every == 0 else "sliding_attention" for i in range(n)]
  if set(types) - set(LAYER_TYPES):
    raise ValueError(f"layer_types {sorted(set(types) - set(LAYER_TYPES))} are not supported "
                     f"(Gemma's layers are {' or '.join(LAYER_TYPES)}).")
  return dict(layer_types=tuple(LAYER_TYPES[t] for t in types),
              local_rope_theta=float(local["rope_theta"]) if local else None,
              query_pre_attn_scalar=int(hf.get("query_pre_attn_scalar", 256)),
              final_softcap=None if final is None else float(final),
              attn_softcap=None if attn is None else float(attn))


def _rope_scaling(kind: str | None, scaling: dict, hf: dict) -> rope.RopeScaling | None:
  """Our `RopeScaling` of HF's dict, with `transformers`' defaults for what it leaves out."""
  if kind not in rope.KINDS:
    return None
  longest = hf.get("max_position_embeddings", CONTEXT.get(hf.get("model_type"), 2048))
  original = int(hf.get("original_max_position_embeddings")   # Phi-3 keeps it outside
                 or scaling.get("original_max_position_embeddings") or longest)
  factor = scaling.get("factor")
  if factor is None and kind != "yarn":  # yarn's is the ratio of the two contexts
    raise ValueError(f"rope_scaling of type {kind!r} gives no factor; add the checkpoint's.")
  fields = {"factor": float(longest / original if factor is None and kind == "yarn" else factor)}
  if kind in ("llama3", "yarn"):
    fields["original_max_position_embeddings"] = original
  if kind == "llama3":
    fields.update(low_freq_factor=float(scaling["low_freq_factor"]),
                  high_freq_factor=float(scaling["high_freq_factor"]))
  if kind == "yarn":
    attention, factor = scaling.get("attention_factor"), fields["factor"]
    if attention is None and scaling.get("mscale") and scaling.get("mscale_all_dim"):
      attention = (rope.mscale(factor, scaling["mscale"])
                   / rope.mscale(factor, scaling["mscale_all_dim"]))
    fields.update(beta_fast=float(scaling.get("beta_fast") or 32),
                  beta_slow=float(scaling.get("beta_slow") or 1),
                  truncate=bool(scaling.get("truncate", True)),
                  attention_factor=None if attention is None else float(attention))
  return rope.RopeScaling(kind, **fields)


def config_to_hf(c: GPTConfig | LlamaConfig, base: dict[str, Any] | None = None) -> dict[str, Any]:
  """A `config.json` dict for `c` (fields of `base`, e.g. the source checkpoint's, kept; of a
  multimodal Gemma 3 checkpoint, its text model's: the export is that text model alone)."""
  out = dict(text_config(base) if (base or {}).get("model_type") == "gemma3" else base or {})
  if isinstance(c, LlamaConfig):
    features = lambda kind: {**PLAIN, **FEATURES.get(kind, {})}
    has = {k: getattr(c, k) for k in features(None)}
    has["qk_norm_span"] = c.qk_norm_span if c.qk_norm else "head"  # no norm: no span
    held = [k for k in FEATURES if features(k) == has]
    kind = out.get("model_type", held[0] if held else "mistral" if c.sliding_window else "llama")
    if c.sliding_window and kind not in WINDOWED:
      raise ValueError(f"a {kind} checkpoint has no sliding window: a model with "
                       f"sliding_window={c.sliding_window} is written as a Mistral one.")
    if features(kind) != has:
      raise ValueError(f"a {kind} checkpoint cannot hold this model ({has}): Qwen3's alone "
                       "norms each head's queries and keys, Qwen2's alone has q, k and v biases "
                       "(and none on o), OLMo 2's alone norms after attention and the MLP and "
                       "the whole q and k projections, Gemma's alone scales its norms by 1 + "
                       "weight and its embedding by sqrt(hidden) (Gemma 3's norms besides the "
                       "q and k heads', before and after attention and the MLP).")
    layered = (c.layer_types, c.query_pre_attn_scalar, c.attn_softcap, c.final_softcap)
    if (kind not in LAYERED and layered != (None,) * 4) or (
        c.local_rope_theta is not None and kind != GEMMA3):
      raise ValueError(f"a {kind} checkpoint cannot hold this model: Gemma 2's and 3's alone "
                       "give their layers' kinds (layer_types), query_pre_attn_scalar and soft "
                       "caps, and Gemma 3's alone a local rope.")
    out.update(model_type=kind, architectures=[ARCHITECTURES[kind]], vocab_size=c.vocab_size,
               hidden_size=c.hidden, intermediate_size=c.intermediate,
               num_hidden_layers=c.num_layers, num_attention_heads=c.num_heads,
               num_key_value_heads=c.num_kv_heads, head_dim=c.dim, rope_theta=c.rope_theta,
               rms_norm_eps=c.rms_eps, tie_word_embeddings=c.tie_embeddings,
               max_position_embeddings=c.seq_len)
    out["hidden_activation" if kind in LAYERED else "hidden_act"] = HF_ACTIVATIONS[c.activation]
    if kind in UNBIASED:
      out["attention_bias"] = False
    if kind in WINDOWED:
      out["sliding_window"] = c.sliding_window
    if kind in LAYERED:
      out.update(_layered_to_hf(c))
    if kind == GEMMA3:
      out.update(_gemma3_ropes(c))
    elif c.rope_scaling is not None or base is None:  # the rope of `c`, in both of HF's forms
      out["rope_scaling"] = _rope_hf(c, theta=False) if c.rope_scaling else None
      out["rope_parameters"] = _rope_hf(c)
  else:
    out.update(model_type="gpt2", architectures=["GPT2LMHeadModel"], vocab_size=c.vocab_size,
               n_positions=c.seq_len, n_layer=c.num_layers, n_head=c.num_heads, n_embd=c.hidden,
               layer_norm_epsilon=1e-5, activation_function="gelu_new", tie_word_embeddings=True)
  return out


def _layered_to_hf(c: LlamaConfig) -> dict[str, Any]:
  """Gemma 2's and 3's config.json fields for `c`: its layers' kinds, logits' scale, caps."""
  names = {ours: theirs for theirs, ours in LAYER_TYPES.items()}
  return dict(layer_types=[names[t] for t in _kinds(c)],
              query_pre_attn_scalar=c.query_pre_attn_scalar or c.dim,
              final_logit_softcapping=c.final_softcap, attn_logit_softcapping=c.attn_softcap)


def _gemma3_ropes(c: LlamaConfig) -> dict[str, Any]:
  """Gemma 3's config.json ropes for `c`: its global layers' and its sliding layers'."""
  if c.local_rope_theta is None and c.rope_scaling is not None and "sliding" in _kinds(c):
    raise ValueError("Gemma 3's sliding layers take an unscaled rope: this model scales its "
                     "sliding layers' rope too; give local_rope_theta.")
  local = {"rope_type": "default", "rope_theta": c.local_rope_theta or c.rope_theta}
  return dict(rope_scaling=None,
              rope_parameters={"full_attention": _rope_hf(c), "sliding_attention": local})


def _kinds(c: LlamaConfig) -> tuple[str, ...]:
  """Each layer's attention, "full" or "sliding" (by its window, `LlamaConfig.windows`)."""
  return tuple("full" if window is None else "sliding" for window in c.windows)


def _rope_hf(c: LlamaConfig, theta: bool = True) -> dict[str, Any]:
  """The rope of `c` (its global layers') as HF's `rope_parameters`: type, scaling and (with
  `theta`) rope_theta; without it, as `rope_scaling`."""
  rope_hf = {"rope_type": "default", **(c.rope_scaling.to_hf() if c.rope_scaling else {})}
  return {**rope_hf, "rope_theta": c.rope_theta} if theta else rope_hf

def family(hf: dict[str, Any]) -> str:
  """The model family a config.json names, as people write it ("Qwen3", "GPT-2")."""
  kind = hf.get("model_type", "")
  named = {"gpt2": "GPT-2", "phi3": "Phi-3", "olmo2": "OLMo 2", "gemma": "Gemma",
           GEMMA2: "Gemma 2", GEMMA3: "Gemma 3", "gemma3": "Gemma 3"}
  return named.get(kind) or ARCHITECTURES.get(kind, kind).removesuffix("ForCausalLM")
