"""Test helpers: random data, the plain single-device optax reference, the scripts as modules."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import threading

import jax
import numpy as np
from flax import nnx

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATA = os.path.join(REPO, "data", "tinyshakespeare.txt")
SCRIPTS = os.path.join(REPO, "scripts")


def script_env() -> dict[str, str]:
  """The environment for a script run as a subprocess: this one's, less the host device count
  (the scripts pick their devices), keeping conftest's other XLA flags and compilation cache."""
  flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if "device_count" not in f]
  return {**os.environ, "XLA_FLAGS": " ".join(flags)}


def run_script(args: list[str], timeout: float = 600) -> str:
  """`python ARGS` in the repository root with `script_env()`; its stdout (it must succeed)."""
  out = subprocess.run([sys.executable, *args], cwd=REPO, capture_output=True, text=True,
                       timeout=timeout, env=script_env())
  assert out.returncode == 0, out.stderr[-3000:]
  return out.stdout


def load_script(name: str):
  """scripts/`name`.py as a module (its functions, without running its main)."""
  spec = importlib.util.spec_from_file_location(name, os.path.join(SCRIPTS, f"{name}.py"))
  mod = importlib.util.module_from_spec(spec)
  sys.modules.setdefault(name, mod)
  spec.loader.exec_module(mod)
  return mod


def four_layer_gpt(rngs):
  """The tiny GPT with 4 layers that the host optimizers' tests train (`zinfjax.init`'s factory)."""
  from zinfjax.models import GPT, get_config
  return GPT(get_config("tiny", num_layers=4), rngs=rngs)


def clipped_adamw(clip: float | None):
  """zinfjax's AdamW as those tests run it (lr 3e-3, weight decay 0.1), clipped to `clip`."""
  import zinfjax
  return zinfjax.optim.adamw(3e-3, weight_decay=0.1, max_grad_norm=clip)


def text_batches(n: int, batch: int, seq: int, seed: int = 0) -> list[dict]:
  """Random windows of the shipped tinyshakespeare text (char tokens, vocab 65)."""
  from zinfjax.models import TokenDataset, load_tokens
  tokens, _ = load_tokens(DATA)
  data = TokenDataset(tokens, seq, batch, seed=seed)
  return [next(data) for _ in range(n)]


def random_batches(n: int, batch: int, seq: int, vocab: int, seed: int = 0) -> list[dict]:
  """Fresh random token batches (never zeros)."""
  rng = np.random.default_rng(seed)
  return [{"inputs": rng.integers(0, vocab, (batch, seq)).astype(np.int32),
           "targets": rng.integers(0, vocab, (batch, seq)).astype(np.int32)} for _ in range(n)]


def reference_losses(make_model, tx, loss_fn, batches, seed: int = 0):
  """Losses and final params of `make_model` trained with `tx` on one device, no sharding."""
  device = jax.devices()[0]
  with jax.default_device(device):
    model = make_model(nnx.Rngs(jax.random.key(seed)))
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)

    @nnx.jit
    def step(model, optimizer, batch):
      loss, grads = nnx.value_and_grad(loss_fn)(model, batch)
      optimizer.update(model, grads)
      return loss

    losses = [float(step(model, optimizer, b)) for b in batches]
  return np.asarray(losses), nnx.to_pure_dict(nnx.state(model, nnx.Param))


def zero_training(make_model, tx, zero, mesh, batches, loss_fn, seed: int = 0):
  """Losses and final state of `zinfjax` training with `zero` over `batches`."""
  import zinfjax
  state = zinfjax.init(make_model, tx, zero, mesh, seed)
  losses = []
  for batch in batches:
    state, metrics = zinfjax.train_step(state, batch, loss_fn)
    losses.append(float(metrics["loss"]))
  return np.asarray(losses), state


def arrays(tree) -> list[np.ndarray]:
  return [np.asarray(x) for x in jax.tree.leaves(tree)]


def compute_params(state) -> list[np.ndarray]:
  """Every leaf's compute params joined from their tiers (the swap stores' included)."""
  from zinfjax.state import _whole
  plan = state.engine.plan
  return [_whole(plan, leaf, parts, state.engine.store, "params")
          for leaf, parts in zip(plan.leaves, plan.flatten(state.params))]


def skipped_step(state, batch, loss_fn):
  """`train_step` on a batch whose loss is not finite: the step is skipped (metrics say so)
  and every fp32 master and compute param keeps its bits. Returns the new state."""
  import zinfjax
  before = compute_params(state) + arrays(state.full_params())
  state, metrics = zinfjax.train_step(state, batch, loss_fn)
  assert int(metrics["skipped"]) == 1
  after = compute_params(state) + arrays(state.full_params())
  assert all(np.array_equal(a, b) for a, b in zip(after, before))
  return state


def assert_same_training(losses, state, want_losses, want, rtol: float = 0.0) -> None:
  """Equal losses, fp32 masters and compute params: bit for bit, or to `rtol` (atol rtol/10)."""
  if rtol:
    same = lambda a, b: np.testing.assert_allclose(a, b, rtol=rtol, atol=rtol / 10)
  else:
    same = np.testing.assert_array_equal
  same(losses, want_losses)
  for got, expected in zip(arrays(state.full_params()) + compute_params(state),
                           arrays(want.full_params()) + compute_params(want)):
    same(got, expected)


def scalar_threads(pipeline) -> set[str]:
  """The names of the threads that make the host pipeline's update scalars (a jax computation)
  from now on. Made on its own thread, under the step's program, they would queue on a GPU
  behind the whole program (XLA:GPU runs a device's programs one at a time)."""
  made, names = pipeline._scalars, set()

  def record(count):
    names.add(threading.current_thread().name)
    return made(count)

  pipeline._scalars = record
  return names
