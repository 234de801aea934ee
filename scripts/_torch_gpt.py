"""The GPT of `models/gpt.py` in PyTorch, for the DeepSpeed peer (`peer_deepspeed.py`).

The same layers and shapes: pre-LN blocks, learned positions, fused qkv, GELU (tanh) MLP 4x,
tied embedding, GPT-2's init (residual projections scaled by 1/sqrt(2 layers)). Layer norms,
softmax and the loss in fp32 over bf16 parameters and activations, like the Flax model under
mixed precision; attention is `scaled_dot_product_attention` (flash / cuDNN on a GPU); every
block is recomputed in backward (one checkpoint per block, like `GPTConfig.remat`), and the
loss scores the tied output projection in chunks of tokens, each recomputed in backward, so
the full logits never live at once (like `models/loss.py`).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

LOSS_CHUNK = 8192  # tokens scored at once


def layer_norm(x: torch.Tensor, ln: nn.LayerNorm) -> torch.Tensor:
  """LayerNorm in fp32 (weights upcast), back to the activations' dtype."""
  y = F.layer_norm(x.float(), ln.normalized_shape, ln.weight.float(), ln.bias.float(), ln.eps)
  return y.to(x.dtype)


class Linear(nn.Linear):
  """nn.Linear with weights ~ N(0, std) and zero bias, set in __init__ (ZeRO-3's `zero.Init`
  partitions a module's parameters when its outermost __init__ returns: later init is lost)."""

  def __init__(self, fan_in: int, fan_out: int, std: float = 0.02):
    super().__init__(fan_in, fan_out)
    nn.init.normal_(self.weight, std=std)
    nn.init.zeros_(self.bias)


class Embedding(nn.Embedding):
  """nn.Embedding with weights ~ N(0, 0.02), set in __init__ (see `Linear`)."""

  def __init__(self, num: int, features: int):
    super().__init__(num, features)
    nn.init.normal_(self.weight, std=0.02)


class Block(nn.Module):
  """x + attn(ln1(x)); x + mlp(ln2(x))."""

  def __init__(self, hidden: int, heads: int, layers: int):
    super().__init__()
    self.heads = heads
    self.ln1, self.ln2 = nn.LayerNorm(hidden, eps=1e-5), nn.LayerNorm(hidden, eps=1e-5)
    out_std = 0.02 / math.sqrt(2 * layers)  # GPT-2: residual projections scaled down
    self.qkv, self.proj = Linear(hidden, 3 * hidden), Linear(hidden, hidden, out_std)
    self.fc, self.out = Linear(hidden, 4 * hidden), Linear(4 * hidden, hidden, out_std)

  def forward(self, x_BxTxD: torch.Tensor) -> torch.Tensor:
    b, t, d = x_BxTxD.shape
    q, k, v = self.qkv(layer_norm(x_BxTxD, self.ln1)).view(b, t, 3, self.heads, d // self.heads).unbind(2)
    y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                       is_causal=True)
    x_BxTxD = x_BxTxD + self.proj(y.transpose(1, 2).reshape(b, t, d))
    h = F.gelu(self.fc(layer_norm(x_BxTxD, self.ln2)), approximate="tanh")
    return x_BxTxD + self.out(h)


def _chunk_loss(x_NxD: torch.Tensor, wte_VxD: torch.Tensor, targets_N: torch.Tensor) -> torch.Tensor:
  logits = (x_NxD @ wte_VxD.t()).float()
  return F.cross_entropy(logits, targets_N, reduction="sum")


class GPT(nn.Module):
  """(inputs, targets) `[B, T]` -> mean next-token cross-entropy (fp32)."""

  def __init__(self, vocab_size: int, seq_len: int, layers: int, heads: int, hidden: int):
    super().__init__()
    self.wte, self.wpe = Embedding(vocab_size, hidden), Embedding(seq_len, hidden)
    self.blocks = nn.ModuleList(Block(hidden, heads, layers) for _ in range(layers))
    self.ln_f = nn.LayerNorm(hidden, eps=1e-5)

  def forward(self, inputs_BxT: torch.Tensor, targets_BxT: torch.Tensor) -> torch.Tensor:
    t = inputs_BxT.shape[1]
    x = self.wte(inputs_BxT) + self.wpe(torch.arange(t, device=inputs_BxT.device))
    for block in self.blocks:
      x = checkpoint(block, x, use_reentrant=False) if self.training else block(x)
    x_NxD = layer_norm(x, self.ln_f).flatten(0, 1)
    targets_N = targets_BxT.flatten()
    total = sum(checkpoint(_chunk_loss, x_NxD[i:i + LOSS_CHUNK], self.wte.weight,
                           targets_N[i:i + LOSS_CHUNK], use_reentrant=False)
                for i in range(0, targets_N.numel(), LOSS_CHUNK))
    return total / targets_N.numel()


def num_params(model: nn.Module) -> int:
  """Parameters counted once each (the tied embedding once), whether or not ZeRO-3 partitioned
  them (`ds_numel` is a partitioned parameter's full size)."""
  return sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())
