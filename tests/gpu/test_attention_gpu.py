"""The explicit attention on a GPU's long sequences (Gemma 2's capped logits, and any shape cuDNN
refuses): a block of queries at a time, equal to the whole form, one block's logits live.

Run by scripts/gpu_check.sh on a GPU machine; skipped (with the reason) elsewhere.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from zinfjax.models import attention

pytestmark = pytest.mark.gpu


def _loss(window, block):
  return lambda q, k, v, w: (attention.explicit_attention(
      q, k, v, window, None, 30.0, block=block).astype(jnp.float32) * w).sum()


@pytest.mark.parametrize("window", [None, 1000])
def test_blocked_explicit_attention_equals_the_whole_form_and_holds_a_block(window, gpu_mesh):
  """bf16 queries, GQA, Gemma 2's cap of 30: at 2048 positions the blocked form's values and
  grads equal the whole form's to 1% of their norm; at 8192 its step (value and grads) holds
  at most 4 blocks' fp32 logits of temporaries and under a quarter of the whole form's (XLA:GPU's
  memory-aware schedule; compiled for an H100: 0.9 GiB against 6.0, 0.30 under the window)."""
  device = gpu_mesh.devices.flat[0]
  keys = jax.random.split(jax.random.key(3), 4)
  make = lambda t: [jax.device_put(jax.random.normal(key, (1, t, n, 64), dtype), device)
                    for key, n, dtype in zip(keys, (8, 2, 2, 8), (jnp.bfloat16,) * 3 + (
                        jnp.float32,))]
  q, k, v, w = make(2048)
  blocked, whole = (jax.jit(jax.value_and_grad(_loss(window, b), (0, 1, 2))) for b in (1024, 2048))
  (_, got), (_, want) = blocked(q, k, v, w), whole(q, k, v, w)
  forward = lambda block: jax.jit(lambda q, k, v: attention.explicit_attention(
      q, k, v, window, None, 30.0, block=block))(q, k, v)
  for name, a, b in zip(("out", "dq", "dk", "dv"), [forward(1024), *got], [forward(2048), *want]):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    assert np.linalg.norm(a - b) <= 1e-2 * np.linalg.norm(b), name
  if device.platform != "gpu":
    return  # the CPU dry run: XLA:CPU's schedule keeps more blocks live
  shapes = [jax.ShapeDtypeStruct(x.shape[:1] + (8192,) + x.shape[2:], x.dtype) for x in (q, k, v, w)]
  temp = lambda block: (jax.jit(jax.value_and_grad(_loss(window, block), (0, 1, 2)))
                        .lower(*shapes).compile().memory_analysis().temp_size_in_bytes)
  logits = 8 * 1024 * 8192 * 4  # one block's [heads, queries, keys] in fp32
  assert temp(1024) <= 4 * logits and temp(1024) * 4 < temp(8192), (temp(1024), temp(8192))
