"""A stacked leaf read one layer at a time (`full_leaf(path, layer=i)`, of a state on every tier
and of a checkpoint): the same values as the whole leaf's layer i, and what `hf.save` reads, so an
export holds one layer of a leaf in host memory, never the stack."""

import numpy as np
import pytest

import zinfjax
from zinfjax.models import GPT, get_config, hf
from zinfjax.state import _whole
from zinfjax.weights import safetensors

CONFIG = get_config("tiny", num_layers=4)


def factory(r):
  return GPT(CONFIG, rngs=r)


# params and optimizer split over the tiers layer by layer (arrays on the device and in pinned
# host, the drive's store), and every state in RAM's store
PLACEMENTS = {
    "tiers": dict(offload_param="pinned_host:1,nvme:1,device",
                  offload_optimizer="device:1,pinned_host:1,nvme"),
    "ram": dict(offload_param="pinned_host", offload_optimizer="pinned_host",
                host_optimizer="pipeline"),
}


@pytest.fixture(scope="module", params=sorted(PLACEMENTS))
def state(request, mesh, tmp_path_factory):
  zero = zinfjax.ZeroConfig(nvme_path=str(tmp_path_factory.mktemp("swap")),
                            **PLACEMENTS[request.param])
  with zinfjax.init(factory, zinfjax.optim.adamw(1e-3), zero, mesh, rng=3) as state:
    yield state


def test_one_layer_is_the_whole_leafs_layer(state):
  plan, store = state.engine.plan, state.engine.store
  assert any(leaf.stacked for leaf in plan.leaves)
  for name, tree in (("master", state.master), ("params", state.params)):
    for leaf, parts in zip(plan.leaves, plan.flatten(tree)):
      if not leaf.stacked:
        continue
      whole = _whole(plan, leaf, parts, store, name)
      for i in range(leaf.num_layers):
        np.testing.assert_array_equal(_whole(plan, leaf, parts, store, name, i), whole[i],
                                      err_msg=f"{name} {leaf.name} layer {i}")
  stacked = next(l.name for l in plan.leaves if l.stacked)
  whole = state.full_leaf(stacked)
  assert state.full_leaf(stacked, layer=3).shape == whole.shape[1:]
  np.testing.assert_array_equal(state.full_leaf(stacked, layer=3), whole[3])
  with pytest.raises(IndexError, match="layers 0 to 3"):
    state.full_leaf(stacked, layer=4)
  with pytest.raises(IndexError, match="not stacked"):
    state.full_leaf(next(l.name for l in plan.leaves if not l.stacked), layer=0)


def test_an_export_reads_a_layer_at_a_time(state, tmp_path):
  """hf.save of the state asks for each stacked leaf by layer, and writes what the export of the
  whole model (its params gathered) writes."""
  asked = []

  class Spy:
    def full_leaf(self, path, layer=None):
      asked.append((path, layer))
      return state.full_leaf(path, layer=layer)

  hf.save(str(tmp_path / "layers"), CONFIG, Spy())
  hf.save(str(tmp_path / "whole"), CONFIG, state.model())
  stacked = {l.name for l in state.engine.plan.leaves if l.stacked}
  assert stacked and all(layer is not None for path, layer in asked if path in stacked)
  # every leaf (and, for each kernel, the LoRA adapters it would merge, which a GPT has none of)
  assert {p for p, _ in asked if "/lora/" not in p} == {l.name for l in state.engine.plan.leaves}
  got, want = (safetensors.Checkpoint(str(tmp_path / n)) for n in ("layers", "whole"))
  assert set(got) == set(want)
  for name in want:
    np.testing.assert_array_equal(np.asarray(got[name]), np.asarray(want[name]), err_msg=name)


def test_a_checkpoints_layer(state, tmp_path):
  from zinfjax.checkpoint import CheckpointParams, Checkpointer
  with Checkpointer(tmp_path / "ckpt") as ckpt:
    ckpt.save(state)
    ckpt.wait()
  saved = CheckpointParams(tmp_path / "ckpt")
  for leaf in state.engine.plan.leaves:
    whole = saved.full_leaf(leaf.name)
    np.testing.assert_array_equal(whole, state.full_leaf(leaf.name), err_msg=leaf.name)
    if leaf.stacked:
      for i in range(leaf.num_layers):
        np.testing.assert_array_equal(saved.full_leaf(leaf.name, layer=i), whole[i])
  with pytest.raises(IndexError, match="has no layer 9"):
    saved.full_leaf(next(l.name for l in state.engine.plan.leaves if l.stacked), layer=9)


def test_a_checkpoint_in_slabs(state, tmp_path):
  """`blocks` (what consolidate.py writes): a stacked leaf's layers in order, each read alone,
  and a safetensors file written from them is byte for byte the file written from whole leaves."""
  from zinfjax.checkpoint import CheckpointParams, Checkpointer
  with Checkpointer(tmp_path / "ckpt") as ckpt:
    ckpt.save(state)
    ckpt.wait()
  saved = CheckpointParams(tmp_path / "ckpt")
  stacked = {leaf.name for leaf in state.engine.plan.leaves if leaf.stacked}
  for path in saved:
    whole = saved.full_leaf(path)
    one_row = list(saved.blocks(path, max_bytes=1))  # one chunk row a slab
    if path in stacked:
      assert [b.shape for b in one_row] == [(1, *whole.shape[1:])] * len(whole), path
    np.testing.assert_array_equal(np.concatenate(one_row), whole, err_msg=path)
  paths = sorted(saved)
  whole = [(p, (saved.shape(p), np.float32, lambda p=p: saved.full_leaf(p))) for p in paths]
  slabs = [(p, (saved.shape(p), np.float32, lambda p=p: saved.blocks(p, max_bytes=1)))
           for p in paths]
  safetensors.write(str(tmp_path / "whole.safetensors"), whole)
  safetensors.write(str(tmp_path / "slabs.safetensors"), slabs)
  files = (tmp_path / "whole.safetensors", tmp_path / "slabs.safetensors")
  assert files[0].read_bytes() == files[1].read_bytes()


def test_slabs_that_do_not_make_the_tensor_are_refused(tmp_path):
  x = np.arange(24, dtype=np.float32).reshape(4, 3, 2)
  out = str(tmp_path / "t.safetensors")
  safetensors.write(out, [("x", (x.shape, x.dtype, lambda: iter([x[:1], x[1:]]))),
                          ("s", ((), x.dtype, lambda: iter([np.float32(5)])))])
  got = safetensors.Checkpoint(out)
  np.testing.assert_array_equal(got["x"], x)
  assert float(got["s"]) == 5.0
  for slabs, match in (([x[:1], x[2:]], "announced with 4 rows but its slabs hold 3"),
                       ([x[:, :2]], r"has a slab of \(4, 2, 2\)"),
                       ([x[0]], r"has a slab of \(3, 2\)")):
    with pytest.raises(safetensors.FormatError, match=match):
      safetensors.write(out, [("x", (x.shape, x.dtype, lambda s=slabs: iter(s)))])
