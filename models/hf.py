"""Hugging Face checkpoints in and out: config.json, tensor names and layouts, safetensors.

`load(folder)` reads a checkpoint folder (config.json plus safetensors, one file
or sharded with an index) as `(config, model factory, weights)`: the weights are
a tree of `zinfjax.weights` Tensors in our model's layout (per-layer
`model.layers.N.*` tensors stacked on the `Stack`'s layer axis, `nn.Linear`
weights transposed), memory-mapped and read shard by shard when passed to
`zinfjax.init(..., params=weights)`. `save(folder, config, params)` writes the
same format back, one tensor at a time, so `transformers` loads it with
`from_pretrained`. Families: Llama, Mistral, Qwen2, Qwen3, Phi-3, OLMo 2, Gemma,
Gemma 2, Gemma 3 (its text model, a multimodal checkpoint's too: `TEXT_PREFIXES`)
(`models/llama.py`) and GPT-2 (`models/gpt.py`); their config.json: `hf_config.py`.
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
from zinfjax.weights.source import Rows

from .config import GPTConfig
from .gpt import GPT
from .hf_config import (ARCHITECTURES, CONTEXT, LLAMA_TYPES, config_from_hf,  # noqa: F401
                        config_to_hf, family)
from .llama import Llama, LlamaConfig

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
  """Our leaf `path` <- HF tensor `name` (`{i}`: one per layer, stacked), maybe transposed;
  with `rows`, those rows of it (one projection of a fused one, Phi-3's)."""

  path: str
  name: str
  transpose: bool = False
  rows: tuple[int, int] | None = None


# the text model's names in a checkpoint: its own (`model.layers...`), or a multimodal one's
# (Gemma 3's, as saved and as transformers names it in memory) -> (its output head, the
# checkpoint's tensors that are the text model's; those outside, other towers', are left out)
TEXT_PREFIXES = {"model.": ("lm_head.weight", ""),
                 "language_model.model.": ("language_model.lm_head.weight", "language_model."),
                 "model.language_model.": ("lm_head.weight", "model.language_model.")}


def text_prefix(names) -> str:
  """Which of `TEXT_PREFIXES` a checkpoint's tensor `names` use (`model.` where none)."""
  return next((p for p in TEXT_PREFIXES if p + "embed_tokens.weight" in names), "model.")


def llama_rules(c: LlamaConfig, fused: bool = False, prefix: str = "model.") -> list[Rule]:
  """The Llama family's tensors; `fused`: Phi-3's, q, k and v in one `qkv_proj` and gate and
  up in one `gate_up_proj`, their rows in that order; `prefix`: one of `TEXT_PREFIXES`."""
  layer = prefix + "layers.{i}."
  norms = (("post_attention_layernorm", "post_feedforward_layernorm") if c.post_norm
           else ("input_layernorm", "pre_feedforward_layernorm") if c.sandwich_norm
           else ("input_layernorm", "post_attention_layernorm"))  # OLMo 2's follow, or precede
  rules = [Rule("embed/embedding", prefix + "embed_tokens.weight"),
           Rule("layers/block/ln1/scale", layer + norms[0] + ".weight"),
           Rule("layers/block/ln2/scale", layer + norms[1] + ".weight"),
           Rule("norm/scale", prefix + "norm.weight")]
  if c.sandwich_norm:  # Gemma 3's, after attention and the MLP
    rules += [Rule("layers/block/post_attn_norm/scale", layer + "post_attention_layernorm.weight"),
              Rule("layers/block/post_mlp_norm/scale", layer + "post_feedforward_layernorm.weight")]
  q, kv = c.num_heads * c.dim, c.num_kv_heads * c.dim
  rows = {"q": (0, q), "k": (q, q + kv), "v": (q + kv, q + 2 * kv),
          "gate": (0, c.intermediate), "up": (c.intermediate, 2 * c.intermediate)}
  for ours, theirs in (("q", "self_attn.q_proj"), ("k", "self_attn.k_proj"),
                       ("v", "self_attn.v_proj"), ("o", "self_attn.o_proj"),
                       ("gate", "mlp.gate_proj"), ("up", "mlp.up_proj"),
                       ("down", "mlp.down_proj")):
    if fused and ours in rows:
      theirs = "self_attn.qkv_proj" if ours in "qkv" else "mlp.gate_up_proj"
    rules.append(Rule(f"layers/block/{ours}/kernel", layer + theirs + ".weight", True,
                      rows[ours] if fused and ours in rows else None))
    if c.qkv_bias and ours in "qkv":
      rules.append(Rule(f"layers/block/{ours}/bias", layer + theirs + ".bias"))
  if c.qk_norm:
    rules += [Rule(f"layers/block/{x}_norm/scale", layer + f"self_attn.{x}_norm.weight")
              for x in "qk"]
  if not c.tie_embeddings:
    rules.append(Rule("lm_head/kernel", TEXT_PREFIXES[prefix][0], True))
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


def factory(c: GPTConfig | LlamaConfig) -> Callable[[nnx.Rngs], nnx.Module]:
  return (lambda rngs: Llama(c, rngs=rngs)) if isinstance(c, LlamaConfig) else (
      lambda rngs: GPT(c, rngs=rngs))


def rules_for(c: GPTConfig | LlamaConfig, names=(), kind: str | None = None) -> list[Rule]:
  """The rules of `c` in the layout of the checkpoint whose tensor `names` are given, or of
  config.json's `kind` (model_type)."""
  if isinstance(c, LlamaConfig):
    return llama_rules(c, kind == "phi3" or any(".qkv_proj." in n for n in names),
                       text_prefix(names))
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
  stored = set(ckpt)
  rules = rules_for(config, stored)
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
    if rule.rows is not None:  # one projection of a fused one, whose rows the parts fill
      fill = max(r.rows[1] for r in rules if r.name == rule.name)
      if tensors[0].shape[0] != fill:
        raise ValueError(f"{names[0]!r} in {ckpt.path} has {tensors[0].shape[0]} rows where "
                         f"config.json's heads and sizes make {fill}; does it match the weights?")
      tensors = [Rows(t, *rule.rows) for t in tensors]
    if rule.transpose:
      tensors = [Transposed(t) for t in tensors]
    flat[rule.path] = Stacked(tensors) if "{i}" in rule.name else tensors[0]
  tied = getattr(config, "tie_embeddings", True)
  head, tower = TEXT_PREFIXES[text_prefix(stored)]   # GPT-2's: "model."'s, lm_head and all
  extra = [n for n in ckpt if n not in used and not IGNORED.search(n)
           and not (tied and n == head) and n.startswith(tower)]
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


def load(folder: str, remat: bool = True):
  """`(config, model factory, weights)` of a Hugging Face checkpoint folder."""
  config = config_from_hf(read_config(folder), remat=remat)
  return config, factory(config), load_weights(folder, config)


# ---------------------------------------------------------------------------- out
def tensors(config, leaf: Callable[[str, int | None], np.ndarray], dtype, kind: str | None = None
            ) -> Iterator[tuple[str, Any]]:
  """(HF name, (shape, dtype, produce)) of every tensor in the layout of config.json's `kind`;
  `leaf(path, i)` gives one leaf's layer `i` (None: the whole leaf, one outside the stacks), so
  an export holds one layer at a time (of a fused tensor, its parts, joined)."""
  def layer_of(rules: list[Rule], i: int | None) -> Callable[[], np.ndarray]:
    def produce():
      xs = [np.asarray(leaf(r.path, i)) for r in rules]
      xs = [x.T if r.transpose else x for r, x in zip(rules, xs)]
      return xs[0] if len(xs) == 1 else np.concatenate(xs)
    return produce

  abstract = nnx.eval_shape(lambda: factory(config)(nnx.Rngs(0)))   # shapes of the base weights
  shapes = nnx.to_pure_dict(nnx.state(abstract))
  rules = rules_for(config, kind=kind)
  for name in dict.fromkeys(r.name for r in rules):  # in order; a fused tensor's parts at once
    parts = [r for r in rules if r.name == name]
    shape = tuple(_get(shapes, parts[0].path).shape[1 if "{i}" in name else 0:])
    shape = shape[::-1] if parts[0].transpose else shape
    shape = (sum(r.rows[1] - r.rows[0] for r in parts), *shape[1:]) if parts[0].rows else shape
    if "{i}" in name:
      for i in range(config.num_layers):
        yield name.format(i=i), (shape, dtype, layer_of(parts, i))
    else:
      yield name, (shape, dtype, layer_of(parts, None))


def save(folder: str, config: GPTConfig | LlamaConfig, params: Any, dtype=np.float32,
         base_config: dict[str, Any] | None = None, max_shard_bytes: int = 5 << 30,
         copy_from: str | None = None) -> list[str]:
  """Write `params` (a `zinfjax.TrainState`, an nnx model, or its pure dict of arrays) as a
  Hugging Face checkpoint folder that `transformers` loads with `from_pretrained` (LoRA
  adapters merged into the weights they adapt: `config` may be the base model's or the
  adapted one's). `copy_from`, the checkpoint folder the model came from, gives the
  tokenizer and generation files it holds (`COMPANION_FILES`), copied along. From a
  multimodal Gemma 3 `base_config`, the text model is written (Gemma3ForCausalLM)."""
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
    layout = tensors(config, leaf, dtype, hf_config["model_type"])
    files = safetensors.write_sharded(staging, layout, max_shard_bytes, {"format": "pt"})
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
