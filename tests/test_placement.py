"""The placement plan: per-layer tier splits train like all-device, resume onto another split,
models with two stacks keep the NVMe optimizer in backward's order; the package has no import
cycles and no oversized module."""

import ast
import os

import jax
import numpy as np
import optax
import pytest
from flax import nnx

import zinfjax
from zinfjax.checkpoint import Checkpointer
from zinfjax.config import parse_split
from zinfjax.models import GPT, get_config, lm_loss
from zinfjax.placement import Segment, shard_key, split_layers
from zinfjax.schedule import timeline

from helpers import REPO, text_batches, zero_training

FOUR = get_config("tiny", num_layers=4)
STEPS = 20
SCHEDULE = optax.warmup_cosine_decay_schedule(0.0, 3e-3, 5, STEPS)
# zinfjax's AdamW on host tiers against optax's under XLA: the same math, rounded apart. Losses
# differ by up to 3e-7 relative after 20 steps under jax 0.10's XLA:CPU and 5e-6 under jax
# 0.11's; 1e-5 is the bound placements are held to against all-device training.
LOSS_RTOL = 1e-5
# A param moves at most about lr per AdamW step (the update m/sqrt(v) is bounded by ~1), so
# after STEPS steps two roundings of the same run can differ by a small share of that movement,
# whatever the param's own size (one near zero has no relative scale): 0.1% of it, about 3.5e-5.
PARAM_ATOL = 1e-3 * float(sum(SCHEDULE(t) for t in range(STEPS)))
# (params, optimizer): params split device/pinned_host, optimizer split pinned_host/nvme, and
# three-way splits of both
SPLITS = [("device:2,pinned_host", "pinned_host:0.5,nvme"),
          ("pinned_host:1,nvme", "device:1,pinned_host:1,nvme"),
          ("device:1,pinned_host:1,nvme", "nvme")]


def test_split_layers_and_keys():
  assert split_layers(parse_split("device:1,pinned_host:25%,nvme", "x"), 8) == (
      Segment("device", 0, 1), Segment("pinned_host", 1, 3), Segment("nvme", 3, 8))
  assert split_layers(parse_split("pinned_host:0.5,nvme", "x"), None) == (Segment("pinned_host", 0, 1),)
  assert split_layers(parse_split("device:9,nvme", "x"), 4) == (Segment("device", 0, 4),)
  assert shard_key("o/m/blocks/block/fc/kernel", 3, 7) == "o/m/blocks/block/fc/kernel/r3/l7"


def test_plan_answers_where_each_layer_lives(mesh, tmp_path):
  zero = zinfjax.ZeroConfig(offload_param="device:2,pinned_host", offload_optimizer="pinned_host:0.5,nvme",
                            nvme_path=str(tmp_path))
  state = zinfjax.abstract_init(lambda r: GPT(FOUR, rngs=r), zinfjax.optim.adamw(1e-3), zero, mesh)
  plan = state.engine.plan
  kernel = next(l for l in plan.leaves if l.stacked and l.name.endswith("kernel"))
  assert [kernel.tier("params", i) for i in range(4)] == ["device"] * 2 + ["pinned_host"] * 2
  assert [kernel.tier("master", i) for i in range(4)] == ["pinned_host"] * 2 + ["nvme"] * 2
  assert kernel.key("mu", 5, 3) == f"o/m/{kernel.name}/r5/l3"
  embed = next(l for l in plan.leaves if not l.stacked)
  assert embed.tier("params") == "device" and embed.tier("master") == "pinned_host"
  # the arrays hold exactly the array segments, with their memory kinds
  parts = plan.flatten(state.master)[kernel.index]
  assert [(p.shape[0], p.sharding.memory_kind) for p in parts] == [(2, "pinned_host")]
  assert plan.nvme_bytes()["optimizer"] > 0 and plan.nvme_bytes()["params"] == 0


@pytest.fixture(scope="module")
def batches():
  return text_batches(STEPS, batch=16, seq=32, seed=2)


@pytest.fixture(scope="module")
def reference(mesh, batches):
  losses, state = zero_training(lambda r: GPT(FOUR, rngs=r), optax.adamw(SCHEDULE, weight_decay=0.1),
                                zinfjax.ZeroConfig(precision="fp32"), mesh, batches, lm_loss)
  return losses, state.full_params()


@pytest.mark.parametrize("param,optimizer", SPLITS)
def test_per_layer_split_matches_all_device(param, optimizer, mesh, batches, reference, tmp_path):
  zero = zinfjax.ZeroConfig(precision="fp32", offload_param=param, offload_optimizer=optimizer,
                            nvme_path=str(tmp_path / "nvme"))
  losses, state = zero_training(lambda r: GPT(FOUR, rngs=r),
                                zinfjax.optim.adamw(SCHEDULE, weight_decay=0.1), zero, mesh,
                                batches, lm_loss)
  ref_losses, ref_params = reference
  assert losses[-1] < losses[0] - 0.3
  rel = np.abs(losses - ref_losses) / ref_losses
  assert np.all(rel < LOSS_RTOL), rel
  for got, want in zip(jax.tree.leaves(state.full_params()), jax.tree.leaves(ref_params)):
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=PARAM_ATOL)
  plan = state.engine.plan
  assert len({s.tier for l in plan.leaves for s in l.params}) == len(parse_split(param, "p"))
  assert len({s.tier for l in plan.leaves for s in l.optimizer}) == len(parse_split(optimizer, "o"))


def test_resume_onto_another_split_is_exact(mesh, batches, tmp_path):
  factory = lambda r: GPT(FOUR, rngs=r)
  tx = lambda: zinfjax.optim.adamw(SCHEDULE, weight_decay=0.1)
  first = zinfjax.ZeroConfig(precision="fp32", offload_param="device:2,pinned_host",
                             offload_optimizer="pinned_host:0.5,nvme", nvme_path=str(tmp_path / "a"))
  second = zinfjax.ZeroConfig(precision="fp32", offload_param="pinned_host:1,nvme",
                              offload_optimizer="device:3,nvme", nvme_path=str(tmp_path / "b"))
  straight, _ = zero_training(factory, tx(), first.replace(nvme_path=str(tmp_path / "s")), mesh,
                              batches[:10], lm_loss)
  half, state = zero_training(factory, tx(), first, mesh, batches[:5], lm_loss)
  with Checkpointer(tmp_path / "ckpt") as ckpt:
    ckpt.save(state)
    ckpt.wait()
    state.engine.store.close()
    state, _ = ckpt.restore(factory, tx(), second, mesh)
  losses = []
  for batch in batches[5:10]:
    state, metrics = zinfjax.train_step(state, batch, lm_loss)
    losses.append(float(metrics["loss"]))
  # the same states; the loss itself comes from programs of other splits, whose reductions XLA
  # may associate differently (by the CPU's vector width): 1 ulp apart on an AVX-512 EPYC
  np.testing.assert_allclose(np.concatenate([half, losses]), straight, rtol=1e-6, atol=0)
  state.engine.store.close()


class Residual(nnx.Module):
  def __init__(self, width: int, *, rngs: nnx.Rngs):
    self.up = nnx.Linear(32, width, rngs=rngs)
    self.down = nnx.Linear(width, 32, rngs=rngs)

  def __call__(self, x):
    return x + self.down(nnx.gelu(self.up(x)))


class TwoStacks(nnx.Module):
  """Two stacks of different widths; `a_top` sorts first in the tree but runs second."""

  def __init__(self, *, rngs: nnx.Rngs):
    self.embed = nnx.Embed(65, 32, rngs=rngs)
    self.b_bottom = zinfjax.Stack(lambda r: Residual(64, rngs=r), 3, rngs=rngs)
    self.a_top = zinfjax.Stack(lambda r: Residual(128, rngs=r), 2, rngs=rngs)
    self.head = nnx.Linear(32, 65, rngs=rngs)

  def __call__(self, tokens):
    return self.head(self.a_top(self.b_bottom(self.embed(tokens))))


@pytest.fixture(scope="module")
def two_stack_reference(mesh, batches):
  return zero_training(lambda r: TwoStacks(rngs=r), optax.adamw(SCHEDULE, weight_decay=0.1),
                       zinfjax.ZeroConfig(precision="fp32"), mesh, batches[:6], lm_loss)[0]


@pytest.mark.parametrize("param,optimizer", [("pinned_host", "pinned_host"), ("nvme", "nvme"),
                                             ("device:1,nvme", "pinned_host:1,nvme")])
def test_two_stacks_train_under_every_placement(param, optimizer, mesh, batches,
                                                two_stack_reference, tmp_path):
  zero = zinfjax.ZeroConfig(precision="fp32", offload_param=param, offload_optimizer=optimizer,
                            nvme_path=str(tmp_path / "nvme"))
  losses, state = zero_training(lambda r: TwoStacks(rngs=r),
                                zinfjax.optim.adamw(SCHEDULE, weight_decay=0.1), zero, mesh,
                                batches[:6], lm_loss)
  np.testing.assert_allclose(losses, two_stack_reference, rtol=LOSS_RTOL)
  plan, pipeline = state.engine.plan, state.engine.pipeline
  assert [s.path for s in plan.stacks] == [("a_top",), ("b_bottom",)]
  if param == "nvme" and optimizer == "nvme":  # under backward: in the order backward writes
    order = timeline(plan, [1, 0]).grad_order
    first = {(p.leaf, p.layer) for p in pipeline.units[0].parts}
    assert first <= {o for o in order[:len(plan.stacks[0].leaves)]}
    assert plan.leaves[order[0][0]].name.startswith("a_top/") and order[0][1] == 1
    assert [(p.leaf, p.layer) for p in pipeline.parts if p.rank == 0] == [
        o for o in order if plan.leaves[o[0]].tier("master", o[1]) == "nvme"]
  if state.engine.store is not None:
    state.engine.store.close()


def _imports(path: str, package: str) -> set[str]:
  """Modules of `package` that the module at `path` imports at its top level."""
  tree = ast.parse(open(path).read())
  here = os.path.relpath(path, REPO)[:-3].replace(os.sep, ".").removesuffix(".__init__")
  parts = here.split(".")
  out = set()
  for node in tree.body:
    if isinstance(node, ast.ImportFrom):
      if node.level:
        base = parts[:len(parts) - node.level + (1 if path.endswith("__init__.py") else 0)]
        mod = ".".join(base + ([node.module] if node.module else []))
        names = [mod] + [f"{mod}.{a.name}" for a in node.names]
      else:
        names = [node.module]
      out |= {n for n in names if n and n.startswith(package)}
    elif isinstance(node, ast.Import):
      out |= {a.name for a in node.names if a.name.startswith(package)}
  return out


def test_no_import_cycles_and_small_modules():
  root = os.path.join(REPO, "zinfjax")
  files = {}
  for d, _, names in os.walk(root):
    for n in names:
      if n.endswith(".py"):
        path = os.path.join(d, n)
        files[os.path.relpath(path, REPO)[:-3].replace(os.sep, ".").removesuffix(".__init__")] = path
  graph = {m: {i for i in _imports(p, "zinfjax") if i in files and i != m} for m, p in files.items()}
  # packages import their own modules; a cycle is one module reaching itself
  state: dict[str, int] = {}

  def visit(m, stack):
    state[m] = 1
    for n in graph[m]:
      if n.startswith(m + "."):
        continue
      if state.get(n) == 1 and not m.startswith(n + "."):
        raise AssertionError(f"import cycle: {' -> '.join(stack + [m, n])}")
      if n not in state:
        visit(n, stack + [m])
    state[m] = 2

  for m in graph:
    if m not in state:
      visit(m, [])
  sizes = {m: sum(1 for _ in open(p)) for m, p in files.items()}
  assert max(sizes.values()) <= 400, sorted(sizes.items(), key=lambda kv: -kv[1])[:3]
  # no function-level imports of zinfjax modules (the old way around cycles)
  for m, p in files.items():
    for node in ast.walk(ast.parse(open(p).read())):
      if isinstance(node, ast.FunctionDef):
        inner = [n for n in ast.walk(node) if isinstance(n, ast.ImportFrom) and n.level
                 and not all(a.name.startswith("_engine") for a in n.names)]  # optional CUDA module
        assert not inner, f"{m}.{node.name} imports inside a function"


def test_tier_names_live_in_tier_only():
  """Tiers are `tier.Tier` everywhere else: no module outside tier.py spells a tier as a
  string (a comparison, a default, a dict key), so where a tier means something is found by
  one name."""
  from zinfjax.placement import TIERS, Tier
  assert [str(t) for t in TIERS] == ["device", "pinned_host", "nvme"]
  assert Tier.NVME == "nvme" and {"nvme": 1}[Tier.NVME] == 1
  assert f"{Tier.PINNED_HOST}" == "pinned_host"
  assert not Tier.NVME.holds_arrays and Tier.PINNED_HOST.memory_kind == "pinned_host"
  # the host pipeline's RAM store: a store tier, whose bytes are host RAM's
  assert not Tier.HOST_STORE.holds_arrays and Tier.HOST_STORE.medium is Tier.PINNED_HOST
  assert Tier.NVME.medium is Tier.NVME and Tier.HOST_STORE not in TIERS
  with pytest.raises(ValueError, match="live in a swap store"):
    Tier.HOST_STORE.memory_kind
  root = os.path.join(REPO, "zinfjax")
  spelled = []
  for d, _, names in os.walk(root):
    for n in names:
      path = os.path.join(d, n)
      if not n.endswith(".py") or path == os.path.join(root, "tier.py"):
        continue
      for node in ast.walk(ast.parse(open(path).read())):
        if isinstance(node, ast.Constant) and node.value in {str(t) for t in Tier}:
          spelled.append(f"{os.path.relpath(path, REPO)}:{node.lineno}")
  assert not spelled, spelled


def test_slow_list_names_existing_tests():
  """Every entry of tests/slow.txt (the `slow` marker's list) names a test function that exists,
  so a renamed test does not silently join the quick run."""
  with open(os.path.join(REPO, "tests", "slow.txt")) as f:
    entries = [line.strip() for line in f if line.strip() and not line.startswith("#")]
  assert entries
  for entry in entries:
    path, name = entry.split("::")
    name = name.split("[")[0]
    with open(os.path.join(REPO, path)) as f:
      assert f"def {name}(" in f.read(), entry
