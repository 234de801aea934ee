"""The step's timeline (`schedule.timeline`): its moves agree with the plan layer by layer under
mixed placements; the NVMe pipeline reads its layers and order there."""

import itertools

import jax
import pytest

import zinfjax
from zinfjax.engine import build_engine
from zinfjax.models import GPT, get_config
from zinfjax.placement import Tier
from zinfjax.schedule import Phase, timeline

FOUR = get_config("tiny", num_layers=4)
PLACEMENTS = [("device", "device"), ("pinned_host", "nvme"),
              ("device:1,pinned_host:1,nvme", "pinned_host:1,nvme"),
              ("nvme", "device:2,nvme")]


@pytest.fixture(scope="module")
def mesh():
  return zinfjax.make_mesh(jax.devices()[:4])


def plan_of(mesh, param, optimizer, tmp_path, frozen=None):
  trainable = None if frozen is None else (lambda path, v: frozen not in map(str, path))
  zero = zinfjax.ZeroConfig(precision="fp32", offload_param=param, offload_optimizer=optimizer,
                            nvme_path=str(tmp_path), trainable=trainable)
  return build_engine(lambda r: GPT(FOUR, rngs=r), zinfjax.optim.adamw(1e-3), zero, mesh,
                      open_store_=False).plan


def layers_of(moves, leaf):
  return sorted(l for m in moves if m.leaf == leaf for l in range(m.start, m.stop))


@pytest.mark.parametrize("param,optimizer", PLACEMENTS)
def test_moves_follow_the_plan_layer_by_layer(param, optimizer, mesh, tmp_path):
  plan = plan_of(mesh, param, optimizer, tmp_path, frozen="wpe")
  moves = timeline(plan)
  assert any(not leaf.trainable for leaf in plan.leaves)
  for leaf in plan.leaves:
    every = list(range(leaf.num_layers))
    i = leaf.index
    fwd = moves.select(Phase.FORWARD, "params", leaf=i)
    assert layers_of(fwd, i) == every and all(m.dst == Tier.DEVICE for m in fwd)
    grads = moves.select(Phase.BACKWARD, "grads", leaf=i)
    updates = moves.select(Phase.OPTIMIZER, leaf=i)
    after = moves.select(Phase.AFTER, leaf=i)
    if not leaf.trainable:  # a frozen leaf is fetched, never updated
      assert grads == updates == after == []
      continue
    for name, ms in (("grads", grads), ("optimizer", updates), ("after", after)):
      assert layers_of(ms, i) == every, (leaf.name, name)  # each layer exactly once
    for m, layer in ((m, l) for m in grads + updates + after for l in range(m.start, m.stop)):
      if m.phase == Phase.BACKWARD:
        assert m.dst == leaf.tier("grads", layer)
      elif m.phase == Phase.OPTIMIZER:
        assert m.src == m.dst == leaf.tier("master", layer)
        assert m.in_program == m.src.holds_arrays
      else:
        assert (m.src, m.dst) == (leaf.tier("master", layer), leaf.tier("params", layer))
  # the program updates exactly the optimizer segments held in arrays
  assert moves.program_updates(len(plan.leaves)) == [
      [(s.start, s.stop) for s in l.array_segments("master")] for l in plan.leaves]


def test_grad_order_is_backward_of_the_forward_order(mesh, tmp_path):
  plan = plan_of(mesh, "nvme", "nvme", tmp_path)
  order = timeline(plan).grad_order
  pairs = {(l.index, layer) for l in plan.leaves for layer in range(l.num_layers)}
  assert sorted(order) == sorted(pairs) and len(order) == len(pairs)
  (stack,) = plan.stacks
  stacked = [o for o in order if o[0] in stack.leaves]
  # layers from the last down, every leaf of a layer together; the other leaves after them
  assert [layer for _, layer in stacked] == [l for l in reversed(range(FOUR.num_layers))
                                            for _ in stack.leaves]
  assert list(order[:len(stacked)]) == stacked


@pytest.mark.parametrize("host_optimizer", ["xla", "pipeline"])
def test_pipeline_reads_its_layers_from_the_timeline(host_optimizer, mesh, tmp_path):
  """The pipeline updates, reads and writes in the stores exactly the layers the plan keeps
  there: the drive's, and under the host pipeline RAM's too."""
  zero = zinfjax.ZeroConfig(precision="fp32", offload_param="device:1,pinned_host:1,nvme",
                            offload_optimizer="pinned_host:1,nvme", nvme_path=str(tmp_path),
                            host_optimizer=host_optimizer)
  state = zinfjax.init(lambda r: GPT(FOUR, rngs=r), zinfjax.optim.adamw(1e-3), zero, mesh, 0)
  with state:
    plan, pipeline = state.engine.plan, state.engine.pipeline
    for leaf, layer, name in itertools.product(plan.leaves, range(FOUR.num_layers),
                                               ("master", "params", "grads")):
      if layer >= leaf.num_layers or not leaf.trainable:
        continue
      part = type(pipeline.parts[0])(leaf.index, 0, layer, 0)
      assert pipeline.on_store(name, part) == (not leaf.tier(name, layer).holds_arrays)
    # its sub-groups follow backward's order
    order = [o for o in timeline(plan).grad_order if o in
             {(p.leaf, p.layer) for p in pipeline.parts}]
    assert [(p.leaf, p.layer) for p in pipeline.parts if p.rank == 0] == order
