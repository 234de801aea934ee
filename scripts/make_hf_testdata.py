"""Build the tiny Hugging Face checkpoints and reference logits under tests/data/hf.

Needs `transformers` and `torch` (the optional `hf` extra), which the tests do
not: they read what this script committed. Each model is random (seeded), with
every weight perturbed so a wrong transpose, name or norm shows in the logits:

  llama   Llama, grouped-query attention, untied head, sharded safetensors + index
  qwen2   Qwen2, q/k/v biases, tied embeddings, rope_theta 1e6
  gpt2    GPT-2, odd vocabulary (101)
  mistral Mistral, a sliding window (5) shorter than the reference's 12 tokens, head_dim 16
          (not hidden / heads)
  llama3  Llama 3.1's rope scaling (factor 8, original context 64: one of the head's four
          frequencies kept, one interpolated, two slowed), tied embeddings
  qwen3   Qwen3, each head's queries and keys RMS-normed, head_dim 16 (not hidden / heads),
          untied head, rope_theta 1e6
  yarn    Qwen3 with YaRN's rope scaling (factor 4, original context 32: of the head's eight
          frequencies one kept, one on the ramp, six slowed; cos and sin scaled by 1.139)
  phi3    Phi-3, q, k and v fused in one projection and gate and up in another, a sliding
          window (6), grouped-query attention
  olmo2   OLMo 2, norms after attention and the MLP (not before), the whole q and k
          projections RMS-normed
  gemma   Gemma, GeGLU (gelu's tanh approximation), norms scaling by 1 + weight, the
          embedding scaled by sqrt(hidden), tied embeddings, head_dim 16 (not hidden / heads)
  gemma2  Gemma 2: Gemma's and besides norms before and after attention and the MLP, sliding
          (window 5 < 12 tokens) and global layers in turn, logits scaled by 24 ** -0.5,
          attention logits soft-capped at 2 and output logits at 3 (small, so the caps matter)
  gemma3  Gemma 3 (text): Gemma's and besides norms before and after attention and the MLP,
          each head's queries and keys normed, 3 layers (sliding, global, sliding: a window of
          5 < 12 tokens, the local rope's base 1e4 unscaled, the global's 1e6 with a linear
          scaling of 2), logits scaled by 24 ** -0.5 (not head_dim's)
  gemma3mm  a multimodal Gemma 3 (Gemma3ForConditionalGeneration, a tiny vision tower): its
          text model is what zinfjax reads; the reference is its logits of text tokens

For each: `config.json`, safetensors, and `reference.npz` with `tokens` [2, 12]
and the fp32 `logits` of `transformers`' forward. Besides, `rope.json`: for each
rope scaling of `ROPES` (as a config.json gives it), the inverse frequencies and
attention factor `transformers` computes.

  python scripts/make_hf_testdata.py [--out tests/data/hf] [--models mistral ...] [--rope]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil

import numpy as np


def models():
  import transformers as T

  common = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                num_attention_heads=4, max_position_embeddings=64, rms_norm_eps=1e-6)
  return {
      "llama": (T.LlamaForCausalLM, T.LlamaConfig(**common, num_key_value_heads=2,
                                                  rope_theta=10000.0, tie_word_embeddings=False),
                "40KB"),
      "qwen2": (T.Qwen2ForCausalLM, T.Qwen2Config(**common, num_key_value_heads=2,
                                                   rope_theta=1e6, tie_word_embeddings=True),
                None),
      "gpt2": (T.GPT2LMHeadModel, T.GPT2Config(vocab_size=101, n_positions=32, n_embd=32,
                                               n_layer=2, n_head=4), None),
      "mistral": (T.MistralForCausalLM, T.MistralConfig(**common, num_key_value_heads=2,
                                                         head_dim=16, sliding_window=5,
                                                         tie_word_embeddings=False), None),
      "llama3": (T.LlamaForCausalLM, T.LlamaConfig(
          **{**common, "max_position_embeddings": 128}, num_key_value_heads=2,
          tie_word_embeddings=True, rope_parameters={
              "rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
              "high_freq_factor": 4.0, "original_max_position_embeddings": 64}), None),
      "qwen3": (T.Qwen3ForCausalLM, T.Qwen3Config(**common, num_key_value_heads=2, head_dim=16,
                                                   rope_theta=1e6, tie_word_embeddings=False),
                None),
      "yarn": (T.Qwen3ForCausalLM, T.Qwen3Config(
          **{**common, "max_position_embeddings": 128}, num_key_value_heads=2, head_dim=16,
          tie_word_embeddings=True, rope_parameters={
              "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
              "original_max_position_embeddings": 32}), None),
      "phi3": (T.Phi3ForCausalLM, T.Phi3Config(**common, num_key_value_heads=2, sliding_window=6,
                                                 pad_token_id=0, eos_token_id=2,
                                                 tie_word_embeddings=False),
               None),
      "olmo2": (T.Olmo2ForCausalLM, T.Olmo2Config(**common, num_key_value_heads=2, pad_token_id=0,
                                                   eos_token_id=2, tie_word_embeddings=False),
                None),
      "gemma": (T.GemmaForCausalLM, T.GemmaConfig(**common, num_key_value_heads=2, head_dim=16,
                                                   hidden_act="gelu_pytorch_tanh", pad_token_id=0,
                                                   eos_token_id=1, bos_token_id=2,
                                                   tie_word_embeddings=True), None),
      "gemma2": (T.Gemma2ForCausalLM, T.Gemma2Config(
          **{**common, "num_hidden_layers": 3}, num_key_value_heads=2, head_dim=16,
          hidden_activation="gelu_pytorch_tanh", sliding_window=5, query_pre_attn_scalar=24,
          attn_logit_softcapping=2.0, final_logit_softcapping=3.0, pad_token_id=0,
          eos_token_id=1, bos_token_id=2, tie_word_embeddings=True), None),
      "gemma3": (T.Gemma3ForCausalLM, T.Gemma3TextConfig(
          **{**common, "num_hidden_layers": 3}, num_key_value_heads=2, head_dim=16,
          hidden_activation="gelu_pytorch_tanh", sliding_window=5, query_pre_attn_scalar=24,
          layer_types=["sliding_attention", "full_attention", "sliding_attention"],
          rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0,
                                              "rope_theta": 1e6},
                           "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}},
          pad_token_id=0, eos_token_id=1, bos_token_id=2, tie_word_embeddings=True), None),
      "gemma3mm": (T.Gemma3ForConditionalGeneration, T.Gemma3Config(
          text_config=T.Gemma3TextConfig(
              **common, num_key_value_heads=2, head_dim=16, sliding_window=5,
              query_pre_attn_scalar=16, layer_types=["sliding_attention", "full_attention"],
              pad_token_id=0, eos_token_id=1, bos_token_id=2).to_dict(),
          vision_config=T.SiglipVisionConfig(
              hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
              image_size=28, patch_size=14).to_dict(),
          mm_tokens_per_image=4, boi_token_index=125, eoi_token_index=126,
          image_token_index=127), None),
  }


# rope scalings of a Llama config.json (head_dim 16, max_position_embeddings 128): every
# field of yarn's, its defaults, and the others
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}
ROPES = [
    {"rope_theta": 10000.0, "rope_scaling": YARN},
    {"rope_theta": 1e6, "rope_scaling": {**YARN, "beta_fast": 16, "beta_slow": 2,
                                         "truncate": False}},
    {"rope_theta": 10000.0, "rope_scaling": {**YARN, "mscale": 1.0, "mscale_all_dim": 0.5}},
    {"rope_theta": 10000.0, "rope_scaling": {**YARN, "attention_factor": 1.5}},
    {"rope_theta": 10000.0, "rope_scaling": {**YARN, "factor": None}},
    {"rope_theta": 10000.0, "rope_scaling": {"type": "yarn", "factor": 2.0}},   # transformers 4's
    {"rope_theta": 10000.0, "rope_scaling": {"rope_type": "dynamic", "factor": 2.0}},
    {"rope_theta": 10000.0, "rope_scaling": {"rope_type": "linear", "factor": 2.0}},
    {"rope_theta": 5e5, "rope_scaling": {"rope_type": "llama3", "factor": 8.0,
                                         "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                         "original_max_position_embeddings": 64}},
]


def rope_references(out: str) -> None:
  """`rope.json`: each of `ROPES` as a config.json, and what `transformers` makes of it."""
  import transformers as T
  from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

  cases = []
  for rope in ROPES:
    hf = {"model_type": "llama", "vocab_size": 128, "hidden_size": 64, "intermediate_size": 64,
          "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 4,
          "head_dim": 16, "max_position_embeddings": 128, **rope}
    given = json.loads(json.dumps(hf))   # transformers fills in the dicts it is given
    config = T.LlamaConfig(**{k: v for k, v in given.items() if k != "model_type"})
    kind = config.rope_parameters["rope_type"]
    inv_freq, factor = ROPE_INIT_FUNCTIONS[kind](config, "cpu")
    cases.append({"config": hf, "inv_freq": inv_freq.tolist(), "attention_factor": factor})
  with open(os.path.join(out, "rope.json"), "w", encoding="utf-8") as f:
    json.dump(cases, f, indent=1)
  print(f"rope.json: {len(cases)} scalings")


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "..", "tests", "data",
                                                "hf"))
  ap.add_argument("--models", nargs="+", help="build these alone (default: all)")
  ap.add_argument("--rope", action="store_true", help="rope.json alone (default: with all)")
  args = ap.parse_args()
  import torch

  if args.rope or not args.models:
    rope_references(args.out)
  if args.rope and not args.models:
    return

  for k, (name, (cls, config, shard)) in enumerate(models().items()):
    if args.models and name not in args.models:
      continue
    torch.manual_seed(k)
    model = cls(config).eval()
    with torch.no_grad():
      for p in model.parameters():
        p.add_(0.1 * torch.randn_like(p))
    folder = os.path.join(args.out, name)
    shutil.rmtree(folder, ignore_errors=True)
    kwargs = {"max_shard_size": shard} if shard else {}
    model.save_pretrained(folder, safe_serialization=True, **kwargs)
    # text tokens alone (a multimodal model's image tokens, the vocabulary's last 3, left out)
    vocab = (config.text_config.vocab_size - 3 if hasattr(config, "text_config")
             else config.vocab_size)
    tokens = np.random.RandomState(k).randint(0, vocab, (2, 12))
    with torch.no_grad():
      logits = model(torch.tensor(tokens)).logits.float().numpy()
    np.savez(os.path.join(folder, "reference.npz"), tokens=tokens, logits=logits)
    for extra in ("generation_config.json",):
      path = os.path.join(folder, extra)
      if os.path.exists(path):
        os.remove(path)
    size = sum(os.path.getsize(os.path.join(folder, f)) for f in os.listdir(folder))
    print(f"{name:6s} {sum(p.numel() for p in model.parameters()):7d} params  "
          f"{size / 1024:6.1f} KiB  {sorted(os.listdir(folder))}")


if __name__ == "__main__":
  main()
