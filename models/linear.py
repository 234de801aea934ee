"""The blocks' projections: `nnx.Linear`, or `nnx.LoRALinear` when the config asks for adapters."""

from __future__ import annotations

from typing import Callable

from flax import nnx


def linears(lora_rank: int, rngs: nnx.Rngs) -> Callable[..., nnx.Module]:
  """`linear(in, out, bias, init)`: a plain projection, or with `lora_rank` > 0 one with LoRA
  adapters of that rank (`nnx.LoRAParam`: the base kernel and bias stay `nnx.Param`, so
  `ZeroConfig(trainable=nnx.LoRAParam)` trains the adapters alone)."""

  def linear(i: int, o: int, bias: bool, init: nnx.Initializer) -> nnx.Module:
    if lora_rank:
      return nnx.LoRALinear(i, o, lora_rank=lora_rank, use_bias=bias, kernel_init=init,
                            rngs=rngs)
    return nnx.Linear(i, o, use_bias=bias, kernel_init=init, rngs=rngs)
  return linear
