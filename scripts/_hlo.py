"""What a compiled XLA program runs, read from its optimized HLO text (any backend).

`matmul_flops` adds up the matrix products the program executes: every `dot`
(inside fusions too: XLA:GPU's Triton GEMMs), cuBLAS GEMM custom calls, and
cuDNN's fused attention (its four products over the keys a query sees), each times
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
from typing import Callable

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
_WINDOW = re.compile(r'"sliding_window_length":\s*"?(\d+)')


def shape(text: str) -> tuple[str, tuple[int, ...]]:
  """(dtype, dims) of the first array shape in `text`."""
  m = _SHAPE.search(text)
  return m.group(1), tuple(int(d) for d in m.group(2).split(",") if d)


def array_bytes(text: str) -> int:
  """Bytes of every array shape in `text` (one array, or a tuple's)."""
  return sum(math.prod(int(d) for d in dims.split(",") if d) * _BYTES.get(dtype, 4)
             for dtype, dims in _SHAPE.findall(text))


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


def _executed(hlo: str, cost: Callable[[Instr, dict[str, str], dict], Counter],
              descend: Callable[[Instr], list[str]]) -> Counter:
  """`cost` of every instruction the program runs, added up by key: the computations an
  instruction calls (`descend` picks them) count once per call, a while body times its trip
  count, a conditional's costliest branch once."""
  comps, entry = computations(hlo)
  memo: dict[str, Counter] = {}

  def visit(name: str) -> Counter:
    if name not in memo:
      memo[name] = Counter()  # a cycle (none in HLO) counts once
      instrs = comps.get(name, [])
      types = {i.name: i.type for i in instrs}
      out = Counter()
      for ins in instrs:
        out.update(cost(ins, types, comps))
        if ins.opcode == "conditional":
          branches = _BRANCHES.search(ins.rest)
          names = re.findall(r"%[\w.\-]+", branches.group(1)) if branches else descend(ins)
          out.update(max((visit(c) for c in names), key=lambda c: sum(c.values()),
                         default=Counter()))
          continue
        trips = int((_TRIPS.search(ins.rest) or [None, 1])[1]) if ins.opcode == "while" else 1
        for c in descend(ins):
          out.update({k: v * trips for k, v in visit(c).items()})
      memo[name] = out
    return memo[name]

  return visit(entry)


def _product_flops(ins: Instr, types: dict[str, str], contracting: list[int]) -> Counter:
  """2·(output elements)·(contracted size), keyed by the left operand's dtype."""
  lhs = types.get(ins.operands[0], "")
  dtype, dims = shape(lhs) if lhs else ("?", ())
  k = math.prod(dims[c] for c in contracting)
  return Counter({dtype: 2.0 * math.prod(shape(ins.type)[1]) * k})


def _attention_flops(ins: Instr, types: dict[str, str], backward: bool) -> float:
  """cuDNN's fused attention: q k^T and p v forward (four with the backward's dq, dk, dv and
  the recomputed logits: 2.5x), over the keys each query sees: all, half under a causal mask,
  and under a sliding window of w keys (its `sliding_window_length`) w - w²/2s on average, as
  `models.config.attention_flops` counts them. q is [B, T, N, H]."""
  q = shape(types.get(ins.operands[0], ""))[1]
  if len(q) != 4:
    return 0.0
  b, t, n, h = q
  kv = shape(types.get(ins.operands[1], ""))[1]
  s = kv[1] if len(kv) == 4 else t
  keys = s / 2 if "CAUSAL" in ins.rest else s
  window = int((_WINDOW.search(ins.rest) or [None, 0])[1])
  if 0 < window < s:
    keys = window - window * window / (2 * s)
  return 4.0 * b * n * t * keys * h * (2.5 if backward else 1.0)


def _flops_of(ins: Instr, types: dict[str, str], comps) -> Counter:
  if ins.opcode in ("dot", "convolution"):
    dims = re.search(r"lhs_contracting_dims=\{([0-9,]*)\}", ins.rest)
    return _product_flops(ins, types, [int(c) for c in dims.group(1).split(",") if c]
                          if dims else [])
  target = (_TARGET.search(ins.rest) or [None, ""])[1] if ins.opcode == "custom-call" else ""
  if target.startswith("__cublas"):  # dims from the backend config
    config = re.search(r'"dot_dimension_numbers":(\{[^}]*\})', ins.rest)
    dims = json.loads(config.group(1)).get("lhs_contracting_dimensions", []) if config else []
    return _product_flops(ins, types, [int(c) for c in dims])
  if target.startswith("__cudnn$fmha"):
    return Counter({"attention": _attention_flops(ins, types, "Backward" in target)})
  return Counter()


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
  counts = _executed(hlo, _flops_of, lambda ins: _CALLS.findall(ins.rest))
  attention = counts.pop("attention", 0.0)
  return Flops(Counter({k: v for k, v in counts.items() if v}), attention)


def custom_calls(hlo: str) -> Counter:
  """Custom-call targets and how often each appears in the program text."""
  return Counter(_TARGET.findall(hlo))


def entry_copies(hlo: str, dtype: str = "f32") -> int:
  """Bytes the entry computation copies as `dtype` arrays (e.g. states around a branch)."""
  comps, entry = computations(hlo)
  return sum(array_bytes(i.type) for i in comps.get(entry, [])
             if i.opcode == "copy" and i.type.startswith(dtype + "["))


# instructions that write nothing of their own (views, control flow, whose bodies are counted)
_NO_WRITE = {"parameter", "get-tuple-element", "tuple", "bitcast", "constant", "while",
             "conditional", "call", "after-all", "partition-id", "replica-id"}
_BODIES = re.compile(r"(?:body|true_computation|false_computation|to_apply)=(%[\w.\-]+)")


def _written_by(ins: Instr, types: dict[str, str], comps) -> Counter:
  """What one instruction writes: a dynamic-update-slice (alone or at a fusion's root) its
  update, in place; any other its output, unless it writes nothing of its own."""
  fused = re.search(r"calls=(%[\w.\-]+)", ins.rest) if ins.opcode == "fusion" else None
  body = comps.get(fused.group(1), []) if fused else []
  if ins.opcode == "dynamic-update-slice":
    return Counter({"bytes": array_bytes(types.get(ins.operands[1], ""))})
  if body and body[-1].opcode == "dynamic-update-slice":
    inner = {i.name: i.type for i in body}
    return Counter({"bytes": array_bytes(inner.get(body[-1].operands[1], ""))})
  return Counter({"bytes": 0 if ins.opcode in _NO_WRITE else array_bytes(ins.type)})


def written_bytes(hlo: str) -> int:
  """Bytes the program's kernels write, loops' trip counts applied: each instruction's output
  outside fusions, where a dynamic-update-slice (alone or at a fusion's root) writes its update
  in place. Reads come on top: a floor of its memory traffic."""
  bodies = lambda ins: (_BODIES.findall(ins.rest) if ins.opcode in ("while", "conditional", "call")
                        else [])
  return int(_executed(hlo, _written_by, bodies)["bytes"])
