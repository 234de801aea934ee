"""What a compiled XLA program runs, read from its optimized HLO text (any backend).

`matmul_flops` adds up the matrix products the program executes: every `dot`
(inside fusions too: XLA:GPU's Triton GEMMs), cuBLAS GEMM custom calls, and
cuDNN's fused attention (its four products, halved when causal), each times
the trip counts of the loops around it. Set against the model's 6·N·T plus
attention it tells how much a step recomputes before anything is timed.
`written_bytes` adds up what its kernels write: a floor of its memory traffic.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from collections import Counter

_BYTES = {"f64": 8, "f32": 4, "bf16": 2, "f16": 2, "s32": 4, "u32": 4, "s64": 8, "u64": 8,
          "s8": 1, "u8": 1, "pred": 1, "s16": 2, "u16": 2, "f8e4m3fn": 1, "f8e5m2": 1}
_HEADER = re.compile(r"^(ENTRY )?(%[\w.\-]+) ")
# "%name = TYPE opcode(" where TYPE is one array shape or a tuple of them
_INSTR = re.compile(r"^\s*(?:ROOT )?(%[\w.\-]+) = (\(.*?\)|\w+\[[0-9,]*\](?:\{[^}]*\})?) "
                    r"([\w\-]+)\((.*)$")
_SHAPE = re.compile(r"(\w+)\[([0-9,]*)\]")
_CALLS = re.compile(r"(?:calls|body|to_apply|true_computation|false_computation)=(%[\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_TRIPS = re.compile(r'"known_trip_count":\{"n":"(\d+)"')
_TARGET = re.compile(r'custom_call_target="([^"]+)"')


def shape(text: str) -> tuple[str, tuple[int, ...]]:
  """(dtype, dims) of the first array shape in `text`."""
  m = _SHAPE.search(text)
  return m.group(1), tuple(int(d) for d in m.group(2).split(",") if d)


def nbytes(text: str) -> int:
  dtype, dims = shape(text)
  return math.prod(dims) * _BYTES.get(dtype, 4)


@dataclasses.dataclass
class Instr:
  name: str
  type: str       # its result type as printed (an array shape or a tuple)
  opcode: str
  rest: str       # operands and attributes

  @property
  def operands(self) -> list[str]:
    depth, end = 1, 0
    for end, ch in enumerate(self.rest):
      depth += {"(": 1, ")": -1}.get(ch, 0)
      if depth == 0:
        break
    return re.findall(r"%[\w.\-]+", self.rest[:end])


def computations(hlo: str) -> tuple[dict[str, list[Instr]], str]:
  """The module's computations by name (instructions in order) and the entry's name."""
  comps: dict[str, list[Instr]] = {}
  entry, current = "", None
  for line in hlo.splitlines():
    head = _HEADER.match(line)
    if head and line.rstrip().endswith("{"):
      current = comps.setdefault(head.group(2), [])
      entry = head.group(2) if head.group(1) else entry
      continue
    m = _INSTR.match(line)
    if m and current is not None:
      current.append(Instr(*m.groups()))
  return comps, entry


def _dot_flops(ins: Instr, shapes: dict[str, str]) -> tuple[float, str]:
  lhs = shapes.get(ins.operands[0], "")
  dims = shape(lhs)[1] if lhs else ()
  contracting = re.search(r"lhs_contracting_dims=\{([0-9,]*)\}", ins.rest)
  k = math.prod(dims[int(c)] for c in contracting.group(1).split(",") if c) if contracting else 1
  return 2.0 * math.prod(shape(ins.type)[1]) * k, shape(lhs)[0] if lhs else "?"


def _gemm_flops(ins: Instr, shapes: dict[str, str]) -> tuple[float, str]:
  """A cuBLAS GEMM custom call: its dims from the backend config."""
  config = re.search(r'"dot_dimension_numbers":(\{[^}]*\})', ins.rest)
  lhs = shapes.get(ins.operands[0], "")
  dims = shape(lhs)[1] if lhs else ()
  k = 1
  if config:
    for c in json.loads(config.group(1)).get("lhs_contracting_dimensions", []):
      k *= dims[int(c)]
  return 2.0 * math.prod(shape(ins.type)[1]) * k, shape(lhs)[0] if lhs else "?"


def _attention_flops(ins: Instr, shapes: dict[str, str], backward: bool) -> float:
  """cuDNN's fused attention: q k^T and p v forward (four with the backward's dq, dk, dv and
  the recomputed logits: 2.5x), halved under a causal mask. q is [B, T, N, H]."""
  q = shape(shapes.get(ins.operands[0], ""))[1]
  if len(q) != 4:
    return 0.0
  b, t, n, h = q
  kv = shape(shapes.get(ins.operands[1], ""))[1]
  s = kv[1] if len(kv) == 4 else t
  causal = 0.5 if '"mask_type":"CAUSAL"' in ins.rest or "CAUSAL" in ins.rest else 1.0
  return 4.0 * b * n * t * s * h * causal * (2.5 if backward else 1.0)


@dataclasses.dataclass
class Flops:
  """Matrix-product FLOPs a program executes, by operand dtype, and its attention's."""

  by_dtype: Counter
  attention: float = 0.0

  @property
  def total(self) -> float:
    return sum(self.by_dtype.values()) + self.attention


def matmul_flops(hlo: str) -> Flops:
  """The FLOPs of the products `hlo` (optimized HLO text) runs, loops' trip counts applied."""
  comps, entry = computations(hlo)
  memo: dict[str, Flops] = {}

  def visit(name: str) -> Flops:
    if name in memo:
      return memo[name]
    memo[name] = Flops(Counter())  # a cycle (none in HLO) counts once
    out = Flops(Counter())
    instrs = comps.get(name, [])
    shapes = {i.name: i.type for i in instrs}
    for ins in instrs:
      if ins.opcode in ("dot", "convolution"):
        flops, dtype = _dot_flops(ins, shapes)
        out.by_dtype[dtype] += flops
      elif ins.opcode == "custom-call":
        target = (_TARGET.search(ins.rest) or [None, ""])[1]
        if target.startswith("__cublas"):
          flops, dtype = _gemm_flops(ins, shapes)
          out.by_dtype[dtype] += flops
        elif target.startswith("__cudnn$fmha"):
          out.attention += _attention_flops(ins, shapes, "Backward" in target)
      trips = int((_TRIPS.search(ins.rest) or [None, 1])[1]) if ins.opcode == "while" else 1
      called = _CALLS.findall(ins.rest)
      branches = _BRANCHES.search(ins.rest)
      if ins.opcode == "conditional":  # the costliest branch
        names = (re.findall(r"%[\w.\-]+", branches.group(1)) if branches else called)
        parts = [visit(c) for c in names]
        called, extra = [], max(parts, key=lambda f: f.total, default=Flops(Counter()))
        out.by_dtype.update(extra.by_dtype)
        out.attention += extra.attention
      for c in called:
        inner = visit(c)
        for k, v in inner.by_dtype.items():
          out.by_dtype[k] += v * trips
        out.attention += inner.attention * trips
    memo[name] = out
    return out

  return visit(entry)


def custom_calls(hlo: str) -> Counter:
  """Custom-call targets and how often each appears in the program text."""
  return Counter(_TARGET.findall(hlo))


def entry_copies(hlo: str, dtype: str = "f32") -> int:
  """Bytes the entry computation copies as `dtype` arrays (e.g. states around a branch)."""
  comps, entry = computations(hlo)
  return sum(nbytes(i.type) for i in comps.get(entry, [])
             if i.opcode == "copy" and i.type.startswith(dtype + "["))


# instructions that write nothing of their own (views, control flow, whose bodies are counted)
_NO_WRITE = {"parameter", "get-tuple-element", "tuple", "bitcast", "constant", "while",
             "conditional", "call", "after-all", "partition-id", "replica-id"}
_BODIES = re.compile(r"(?:body|true_computation|false_computation|to_apply)=(%[\w.\-]+)")


def _array_bytes(text: str) -> int:
  return sum(math.prod(int(d) for d in dims.split(",") if d) * _BYTES.get(dtype, 4)
             for dtype, dims in _SHAPE.findall(text))


def written_bytes(hlo: str) -> int:
  """Bytes the program's kernels write, loops' trip counts applied: each instruction's output
  outside fusions, where a dynamic-update-slice (alone or at a fusion's root) writes its update
  in place. Reads come on top: a floor of its memory traffic."""
  comps, entry = computations(hlo)
  memo: dict[str, int] = {}

  def update_bytes(ins: Instr, types: dict[str, str]) -> int | None:
    if ins.opcode == "dynamic-update-slice":
      return _array_bytes(types.get(ins.operands[1], ""))
    fused = re.search(r"calls=(%[\w.\-]+)", ins.rest) if ins.opcode == "fusion" else None
    body = comps.get(fused.group(1), []) if fused else []
    if body and body[-1].opcode == "dynamic-update-slice":
      return _array_bytes({i.name: i.type for i in body}.get(body[-1].operands[1], ""))
    return None

  def visit(name: str) -> int:
    if name in memo:
      return memo[name]
    memo[name] = 0
    instrs = comps.get(name, [])
    types = {i.name: i.type for i in instrs}
    total = 0
    for ins in instrs:
      in_place = update_bytes(ins, types)
      if in_place is not None:
        total += in_place
      elif ins.opcode not in _NO_WRITE:
        total += _array_bytes(ins.type)
      bodies = [visit(c) for c in _BODIES.findall(ins.rest)] if ins.opcode in (
          "while", "conditional", "call") else []
      if ins.opcode == "conditional":  # one branch runs: the costliest
        branches = _BRANCHES.search(ins.rest)
        bodies = [max([visit(c) for c in re.findall(r"%[\w.\-]+", branches.group(1))]
                      if branches else bodies, default=0)]
      trips = int((_TRIPS.search(ins.rest) or [None, 1])[1]) if ins.opcode == "while" else 1
      total += sum(bodies) * trips
    memo[name] = total
    return total

  return visit(entry)
