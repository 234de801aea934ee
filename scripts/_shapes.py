"""A Hugging Face checkpoint's model from its config.json alone (no weights read), cut to its
first layers: the shapes `compile_gpu.py` compiles and `bench_gpu.py` times (`data/shapes` holds
public checkpoints' files)."""

from __future__ import annotations

import os


def hf_model(path: str, layers: int | None, seq_len: int, script: str):
  """(config, model factory, name) of the checkpoint at `path` (a folder, or its config.json),
  with `layers` of its layers (None: all; a layered model keeps its first layers' kinds) for
  sequences of `seq_len`. A file that cannot be read, or a cut it cannot take, ends `script`
  with the reason."""
  from zinfjax.models import hf
  folder = (os.path.dirname(path) or ".") if path.endswith(".json") else path
  try:
    raw = hf.read_config(folder)
    config = hf.config_from_hf(raw)
  except (FileNotFoundError, ValueError) as e:
    raise SystemExit(f"{script}: --init-from {path}: {e}") from None
  if layers:
    kinds = getattr(config, "layer_types", None)
    try:
      config = config.replace(num_layers=layers, **({"layer_types": kinds[:layers]} if kinds else {}))
    except ValueError as e:  # more layers than a layered checkpoint names the kinds of
      raise SystemExit(f"{script}: --layers {layers}: {e}") from None
  if seq_len > config.seq_len:
    raise SystemExit(f"{script}: --seq-len {seq_len} is longer than the model's {config.seq_len}.")
  return config, hf.factory(config), f"{hf.family(raw)} {config.num_layers} x {config.hidden}"
