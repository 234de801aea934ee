"""Hugging Face checkpoints in and out: config.json, tensor names and layouts, safetensors.

`load(folder)` reads a checkpoint folder (config.json plus safetensors, one file
or sharded with an index) as `(config, model factory, weights)`: the weights are
a tree of `zinfjax.weights` Tensors in our model's layout (per-layer
`model.layers.N.*` tensors stacked on the `Stack`'s layer axis, `nn.Linear`
weights transposed), memory-mapped and read shard by shard when passed to
`zinfjax.init(..., params=weights)`. `save(folder, config, params)` writes the
same format back, one tensor at a time, so `transformers` loads it with
`from_pretrained`. Families: Llama, Mistral, Qwen2, Qwen3 (`models/llama.py`) and
GPT-2 (`models/gpt.py`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import tempfile
from typing import Any, Callable, Iterator

import numpy as np
from flax import nnx

from zinfjax.weights import Stacked, Transposed, safetensors

from . import rope
from .config import GPTConfig
from .gpt import GPT
from .llama import Llama, LlamaConfig

ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                 "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
LLAMA_TYPES = tuple(ARCHITECTURES)
# transformers' defaults for what a config.json leaves out, where they are not ours
CONTEXT = {"llama": 2048, "mistral": 131072, "qwen2": 32768, "qwen3": 32768}  # positions
# the dtypes `save` writes, by numpy name, and their name in config.json's torch_dtype
TORCH_DTYPES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}
# the files besides config and weights that make a folder whole for `transformers`: its
# tokenizer's, its chat template, its generation defaults (`save(..., copy_from=...)`)
COMPANION_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "tokenizer.model", "vocab.json", "merges.txt", "added_tokens.json",
                   "chat_template.jinja", "chat_template.json", "generation_config.json")
# HF buffers and copies that carry no weights of ours
IGNORED = re.compile(r"(rotary_emb\.inv_freq|(^|\.)attn\.bias|(^|\.)attn\.masked_bias)$")


@dataclasses.dataclass(frozen=True)
class Rule:
  """Our leaf `path` <- HF tensor `name` (`{i}`: one per layer, stacked), maybe transposed."""

  path: str
  name: str
  transpose: bool = False


def llama_rules(c: LlamaConfig) -> list[Rule]:
  layer = "model.layers.{i}."
  rules = [Rule("embed/embedding", "model.embed_tokens.weight"),
           Rule("layers/block/ln1/scale", layer + "input_layernorm.weight"),
           Rule("layers/block/ln2/scale", layer + "post_attention_layernorm.weight"),
           Rule("norm/scale", "model.norm.weight")]
  for ours, theirs in (("q", "self_attn.q_proj"), ("k", "self_attn.k_proj"),
                       ("v", "self_attn.v_proj"), ("o", "self_attn.o_proj"),
                       ("gate", "mlp.gate_proj"), ("up", "mlp.up_proj"),
                       ("down", "mlp.down_proj")):
    rules.append(Rule(f"layers/block/{ours}/kernel", layer + theirs + ".weight", True))
    if c.qkv_bias and ours in "qkv":
      rules.append(Rule(f"layers/block/{ours}/bias", layer + theirs + ".bias"))
  if c.qk_norm:
    rules += [Rule(f"layers/block/{x}_norm/scale", layer + f"self_attn.{x}_norm.weight")
              for x in "qk"]
  if not c.tie_embeddings:
    rules.append(Rule("lm_head/kernel", "lm_head.weight", True))
  return rules


def gpt2_rules(c: GPTConfig, prefix: str = "transformer.") -> list[Rule]:
  layer = prefix + "h.{i}."
  rules = [Rule("wte/embedding", prefix + "wte.weight"), Rule("wpe/embedding", prefix + "wpe.weight"),
           Rule("ln_f/scale", prefix + "ln_f.weight"), Rule("ln_f/bias", prefix + "ln_f.bias")]
  for ours, theirs in (("ln1", "ln_1"), ("ln2", "ln_2")):
    rules += [Rule(f"blocks/block/{ours}/scale", layer + theirs + ".weight"),
              Rule(f"blocks/block/{ours}/bias", layer + theirs + ".bias")]
  # GPT-2's Conv1D stores [in, out] like nnx.Linear: no transpose
  for ours, theirs in (("qkv", "attn.c_attn"), ("proj", "attn.c_proj"), ("fc", "mlp.c_fc"),
                       ("out", "mlp.c_proj")):
    rules += [Rule(f"blocks/block/{ours}/kernel", layer + theirs + ".weight"),
              Rule(f"blocks/block/{ours}/bias", layer + theirs + ".bias")]
  return rules


# ---------------------------------------------------------------------------- config
def config_from_hf(hf: dict[str, Any], remat: bool = True) -> GPTConfig | LlamaConfig:
  """Our config of a Hugging Face `config.json` dict; a clear error for what we do not run."""
  kind = hf.get("model_type")
  if hf.get("quantization_config"):
    method = (hf["quantization_config"] or {}).get("quant_method", "unnamed")
    raise ValueError(f"the checkpoint is quantized ({method}): zinfjax trains float weights; "
                     "use the model's bf16 or fp32 release.")
  if kind in LLAMA_TYPES:
    scaling = hf.get("rope_scaling") or (hf.get("rope_parameters") or {})
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type not in ("default", None, *rope.KINDS):
      raise ValueError(f"rope_scaling of type {rope_type!r} is not supported (the default "
                       f"rotary embedding, or scaled: {', '.join(rope.KINDS)}).")
    theta = hf.get("rope_theta", scaling.get("rope_theta", 10000.0))
    partial = scaling.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    if partial != 1.0:
      raise ValueError(f"partial_rotary_factor={partial} is not supported (rotary positions on "
                       "every dimension of a head).")
    if hf.get("hidden_act", "silu") != "silu":
      raise ValueError(f"hidden_act {hf['hidden_act']!r} is not supported (SwiGLU with silu).")
    if hf.get("use_sliding_window"):
      raise ValueError("use_sliding_window=true is not supported (full causal attention only).")
    kinds = set(hf.get("layer_types") or ()) - {"full_attention"}
    if kinds and kind != "mistral":  # Mistral's layers all take its sliding_window
      raise ValueError(f"layer_types {sorted(kinds)} are not supported (full causal attention "
                       "only).")
    if kind == "llama" and hf.get("mlp_bias"):
      raise ValueError("mlp_bias=true is not supported.")
    if kind in ("llama", "qwen3") and hf.get("attention_bias"):
      raise ValueError("attention_bias=true (biases on the q, k, v and o projections) is not "
                       "supported (Qwen2's q, k and v biases are).")
    heads = hf["num_attention_heads"]
    return LlamaConfig(
        vocab_size=hf["vocab_size"], hidden=hf["hidden_size"],
        intermediate=hf["intermediate_size"], num_layers=hf["num_hidden_layers"],
        num_heads=heads, num_kv_heads=hf.get("num_key_value_heads") or heads,
        head_dim=hf.get("head_dim", 128 if kind == "qwen3" else None),
        rope_theta=float(theta),
        rope_scaling=_rope_scaling(rope_type, scaling, hf),
        rms_eps=float(hf.get("rms_norm_eps", 1e-6)),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        qkv_bias=kind == "qwen2", qk_norm=kind == "qwen3",
        seq_len=hf.get("max_position_embeddings", CONTEXT[kind]),
        sliding_window=hf.get("sliding_window", 4096) if kind == "mistral" else None,
        remat=remat)
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
  """A `config.json` dict for `c` (fields of `base`, e.g. the source checkpoint's, kept)."""
  out = dict(base or {})
  if isinstance(c, LlamaConfig):
    kind = out.get("model_type", "qwen3" if c.qk_norm else "qwen2" if c.qkv_bias else
                   "mistral" if c.sliding_window else "llama")
    if c.sliding_window and kind != "mistral":
      raise ValueError(f"a {kind} checkpoint has no sliding window: a model with "
                       f"sliding_window={c.sliding_window} is written as a Mistral one.")
    if c.qk_norm != (kind == "qwen3") or c.qkv_bias != (kind == "qwen2"):
      raise ValueError(f"a {kind} checkpoint cannot hold this model (qk_norm={c.qk_norm}, "
                       f"qkv_bias={c.qkv_bias}): Qwen3's alone norms queries and keys, Qwen2's "
                       "alone has q, k and v biases (and none on o).")
    out.update(model_type=kind, architectures=[ARCHITECTURES[kind]], vocab_size=c.vocab_size,
               hidden_size=c.hidden, intermediate_size=c.intermediate,
               num_hidden_layers=c.num_layers, num_attention_heads=c.num_heads,
               num_key_value_heads=c.num_kv_heads, head_dim=c.dim, rope_theta=c.rope_theta,
               rms_norm_eps=c.rms_eps, tie_word_embeddings=c.tie_embeddings,
               max_position_embeddings=c.seq_len, hidden_act="silu")
    if kind in ("llama", "qwen3"):
      out["attention_bias"] = False
    if kind == "mistral":
      out["sliding_window"] = c.sliding_window
    if c.rope_scaling is not None or base is None:  # the rope of `c`, in both of HF's forms
      rope_hf = {"rope_type": "default", **(c.rope_scaling.to_hf() if c.rope_scaling else {})}
      out["rope_scaling"] = rope_hf if c.rope_scaling else None
      out["rope_parameters"] = {**rope_hf, "rope_theta": c.rope_theta}
  else:
    out.update(model_type="gpt2", architectures=["GPT2LMHeadModel"], vocab_size=c.vocab_size,
               n_positions=c.seq_len, n_layer=c.num_layers, n_head=c.num_heads, n_embd=c.hidden,
               layer_norm_epsilon=1e-5, activation_function="gelu_new", tie_word_embeddings=True)
  return out


def factory(c: GPTConfig | LlamaConfig) -> Callable[[nnx.Rngs], nnx.Module]:
  return (lambda rngs: Llama(c, rngs=rngs)) if isinstance(c, LlamaConfig) else (
      lambda rngs: GPT(c, rngs=rngs))


def rules_for(c: GPTConfig | LlamaConfig, names=()) -> list[Rule]:
  if isinstance(c, LlamaConfig):
    return llama_rules(c)
  prefix = "transformer." if any(n.startswith("transformer.") for n in names) or not names else ""
  return gpt2_rules(c, prefix)


def _nest(flat: dict[str, Any]) -> dict:
  out: dict = {}
  for path, value in flat.items():
    node = out
    *parents, last = path.split("/")
    for p in parents:
      node = node.setdefault(int(p) if p.isdigit() else p, {})
    node[last] = value
  return out


# ---------------------------------------------------------------------------- in
def load_weights(path: str, config: GPTConfig | LlamaConfig) -> dict:
  """The checkpoint's tensors at `path` as our model's tree of lazily read Tensors."""
  ckpt = safetensors.Checkpoint(path)
  rules = rules_for(config, list(ckpt))
  used, flat = set(), {}
  for rule in rules:
    names = ([rule.name.format(i=i) for i in range(config.num_layers)] if "{i}" in rule.name
             else [rule.name])
    missing = [n for n in names if n not in ckpt]
    if missing:
      raise ValueError(f"the checkpoint at {ckpt.path} has no {missing[0]!r} (for {rule.path}); "
                       "does its config.json match its weights?")
    used.update(names)
    tensors = [ckpt.tensor(n) for n in names]
    if rule.transpose:
      tensors = [Transposed(t) for t in tensors]
    flat[rule.path] = Stacked(tensors) if "{i}" in rule.name else tensors[0]
  tied = getattr(config, "tie_embeddings", True)
  extra = [n for n in ckpt if n not in used and not IGNORED.search(n)
           and not (tied and n == "lm_head.weight")]
  if extra:
    raise ValueError(f"the checkpoint at {ckpt.path} has tensors the model does not use: "
                     f"{', '.join(extra[:6])}{' ...' if len(extra) > 6 else ''}.")
  return _nest(flat)


def read_config(folder: str) -> dict[str, Any]:
  """A checkpoint folder's `config.json` as a dict."""
  path = os.path.join(folder, "config.json")
  if not os.path.exists(path):
    raise FileNotFoundError(f"{folder} has no config.json: not a Hugging Face checkpoint folder.")
  try:
    with open(path, encoding="utf-8") as f:
      config = json.load(f)
  except (ValueError, UnicodeDecodeError) as e:
    raise ValueError(f"{path} is not valid JSON ({e}); repair or replace the file.") from None
  if not isinstance(config, dict):
    raise ValueError(f"{path} holds a {type(config).__name__}, not a JSON object of settings.")
  return config


def family(hf: dict[str, Any]) -> str:
  """The model family a config.json names, as people write it ("Qwen3", "GPT-2")."""
  kind = hf.get("model_type", "")
  return "GPT-2" if kind == "gpt2" else ARCHITECTURES.get(kind, kind).removesuffix("ForCausalLM")


def load(folder: str, remat: bool = True):
  """`(config, model factory, weights)` of a Hugging Face checkpoint folder."""
  config = config_from_hf(read_config(folder), remat=remat)
  return config, factory(config), load_weights(folder, config)


# ---------------------------------------------------------------------------- out
def tensors(config, leaf: Callable[[str, int | None], np.ndarray], dtype
            ) -> Iterator[tuple[str, Any]]:
  """(HF name, (shape, dtype, produce)) of every tensor; `leaf(path, i)` gives one leaf's layer
  `i` (None: the whole leaf, one outside the stacks), so an export holds one layer at a time."""
  def layer_of(rule: Rule, i: int | None) -> Callable[[], np.ndarray]:
    def produce():
      x = np.asarray(leaf(rule.path, i))
      return x.T if rule.transpose else x
    return produce

  abstract = nnx.eval_shape(lambda: factory(config)(nnx.Rngs(0)))   # shapes of the base weights
  shapes = nnx.to_pure_dict(nnx.state(abstract))
  for rule in rules_for(config):
    shape = tuple(_get(shapes, rule.path).shape[1 if "{i}" in rule.name else 0:])
    shape = shape[::-1] if rule.transpose else shape
    if "{i}" in rule.name:
      for i in range(config.num_layers):
        yield rule.name.format(i=i), (shape, dtype, layer_of(rule, i))
    else:
      yield rule.name, (shape, dtype, layer_of(rule, None))


def save(folder: str, config: GPTConfig | LlamaConfig, params: Any, dtype=np.float32,
         base_config: dict[str, Any] | None = None, max_shard_bytes: int = 5 << 30,
         copy_from: str | None = None) -> list[str]:
  """Write `params` (a `zinfjax.TrainState`, an nnx model, or its pure dict of arrays) as a
  Hugging Face checkpoint folder that `transformers` loads with `from_pretrained` (LoRA
  adapters merged into the weights they adapt: `config` may be the base model's or the
  adapted one's). `copy_from`, the checkpoint folder the model came from, gives the
  tokenizer and generation files it holds (`COMPANION_FILES`), copied along."""
  if hasattr(params, "full_leaf"):  # read a layer at a time: `full_leaf(path, layer=i)`
    read = lambda path, i: params.full_leaf(path) if i is None else params.full_leaf(path, layer=i)
  else:
    tree = nnx.to_pure_dict(nnx.state(params)) if isinstance(params, nnx.Module) else params
    read = lambda path, i: _get(tree, path) if i is None else _get(tree, path)[i]

  def leaf(path: str, i: int | None) -> np.ndarray:  # LoRA adapters merged in: W + A @ B
    x = np.asarray(read(path, i))
    if path.endswith("/kernel"):  # wherever `params` holds adapters, whatever `config` says
      base = path[:-len("kernel")]
      try:
        a, b = (np.asarray(read(base + f"lora/lora_{n}", i)) for n in "ab")
      except KeyError:  # not an adapted projection (the output head)
        return x
      x = x + np.matmul(a.astype(np.float32), b.astype(np.float32)).astype(x.dtype)
    return x

  dtype = np.dtype(dtype)
  if dtype.name not in TORCH_DTYPES:
    raise ValueError(f"hf.save writes float weights: dtype {dtype.name} is none of "
                     f"{', '.join(TORCH_DTYPES)}.")
  hf_config = config_to_hf(config, base_config)
  for key in {"torch_dtype"} | ({"dtype"} & set(hf_config)):  # the dtype saved, as HF writes it
    hf_config[key] = TORCH_DTYPES[dtype.name]
  # written into a staging folder inside `folder`, moved in once whole: a failed export
  # leaves the folder as it was
  os.makedirs(folder, exist_ok=True)
  staging = tempfile.mkdtemp(prefix=".export-", dir=folder)
  try:
    with open(os.path.join(staging, "config.json"), "w", encoding="utf-8") as f:
      json.dump(hf_config, f, indent=2)
    files = safetensors.write_sharded(staging, tensors(config, leaf, dtype), max_shard_bytes,
                                      {"format": "pt"})
    companions = [n for n in COMPANION_FILES
                  if copy_from and os.path.isfile(os.path.join(copy_from, n))]
    for name in companions:
      shutil.copyfile(os.path.join(copy_from, name), os.path.join(staging, name))
    for name in ["config.json", *files, *companions]:
      os.replace(os.path.join(staging, name), os.path.join(folder, name))
    for name in set(os.listdir(folder)) - set(files):  # an earlier export's other shards
      if safetensors.WEIGHT_FILE.fullmatch(name):
        os.remove(os.path.join(folder, name))
  finally:
    shutil.rmtree(staging, ignore_errors=True)
  return files


def _get(tree: Any, path: str) -> Any:
  for p in path.split("/"):
    tree = tree[int(p)] if isinstance(tree, (list, tuple)) or (p.isdigit() and int(p) in tree) \
        else tree[p]
  return tree
