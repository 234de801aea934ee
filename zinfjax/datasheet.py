"""Dense bf16 matmul peaks of known GPUs, from their makers' datasheets: the MFU denominator a
training run reports when none was given or measured.

Dense means without 2:4 sparsity (datasheets print the sparse rate first, twice this). The
match is on `jax.Device.device_kind`, first entry contained in it wins, so a variant (PCIe, NVL)
comes before its family's name.
"""

from __future__ import annotations

# (part of device_kind, dense bf16 TFLOP/s)
BF16_TFLOPS: tuple[tuple[str, float], ...] = (
    ("H100 PCIe", 756.0),
    ("H100 NVL", 835.0),
    ("H100", 989.0),   # SXM (device_kind "NVIDIA H100 80GB HBM3")
    ("GH200", 989.0),
    ("H200", 989.0),
    ("H800", 989.0),
    ("A100", 312.0),
    ("A800", 312.0),
    ("B200", 2250.0),
    ("L40S", 362.0),
    ("L40", 181.0),
    ("L4", 121.0),
)


def bf16_tflops(device_kind: str) -> float | None:
  """The datasheet's dense bf16 TFLOP/s of a device of this kind; None when unknown (a CPU)."""
  for part, tflops in BF16_TFLOPS:
    if part in device_kind:
      return tflops
  return None
