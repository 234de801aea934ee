"""Causal self-attention for the models, in their `[B, T, heads, head_dim]` layout.

`jax.nn.dot_product_attention` with `is_causal=True`: cuDNN's fused (flash)
attention on a GPU for bf16/fp16 inputs, where it takes the shapes, and XLA's
(fp32 logits and softmax, no `[T, T]` mask array built by the model) everywhere
else. Grouped-query attention (fewer key/value heads than query heads) is the
same call.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

# head dims cuDNN's fused attention takes (the ones these models use)
CUDNN_HEAD_DIMS = (64, 128)


def use_cudnn(q_BxTxNxH: jax.Array) -> bool:
  """Whether cuDNN's fused attention can run these queries: a GPU backend, a 16-bit dtype and a
  head dim it takes (fp32 runs, the exact tests, stay on XLA)."""
  return (jax.default_backend() == "gpu" and q_BxTxNxH.dtype in (jnp.bfloat16, jnp.float16)
          and q_BxTxNxH.shape[-1] in CUDNN_HEAD_DIMS)


def causal_attention(q_BxTxNxH: jax.Array, k_BxTxKxH: jax.Array, v_BxTxKxH: jax.Array) -> jax.Array:
  """softmax(q k^T / sqrt(H) + causal mask) v, per head (N query heads over K <= N kv heads)."""
  if use_cudnn(q_BxTxNxH):
    try:
      return jax.nn.dot_product_attention(q_BxTxNxH, k_BxTxKxH, v_BxTxKxH, is_causal=True,
                                          implementation="cudnn")
    except (NotImplementedError, ValueError, RuntimeError):  # shapes or a cuDNN it refuses
      pass
  return jax.nn.dot_product_attention(q_BxTxNxH, k_BxTxKxH, v_BxTxKxH, is_causal=True,
                                      implementation="xla")
