"""Bad configuration gives a clear error that names the fix."""

import numpy as np
import optax
import pytest

import zinfjax
from zinfjax.models import GPT, get_config, lm_loss


@pytest.mark.parametrize("kwargs,match", [
    (dict(stage=4), "stage must be 1, 2 or 3"),
    (dict(stage=0), "stage must be 1, 2 or 3"),
    (dict(precision="fp16"), "precision must be 'bf16' or 'fp32'"),
    (dict(prefetch_depth=-1), "prefetch_depth must be an int >= 0"),
    (dict(persistence_threshold=-5), "persistence_threshold"),
    (dict(nvme_io_threads=0), "nvme_io_threads must be an int from 1 to 64"),
    (dict(host_nice=-1), "host_nice must be an int from 0 to 19"),
])
def test_bad_zero_config(kwargs, match):
  with pytest.raises(ValueError, match=match):
    zinfjax.ZeroConfig(**kwargs)


def test_unknown_preset_lists_the_choices():
  with pytest.raises(ValueError, match=r"Unknown GPT preset 'gpt5'.*tiny.*gpt2-small"):
    get_config("gpt5")


def test_heads_must_divide_width():
  with pytest.raises(ValueError, match="not divisible by num_heads"):
    get_config("tiny", num_heads=5)


def test_lora_rank_is_an_int_of_at_least_zero():
  from zinfjax.models import LlamaConfig
  for make in (lambda r: get_config("tiny", lora_rank=r), lambda r: LlamaConfig(lora_rank=r)):
    for bad in (-1, 2.0, True):
      with pytest.raises(ValueError, match=f"lora_rank must be an int >= 0.*got {bad!r}"):
        make(bad)
    assert make(3).lora_rank == 3


def test_a_llama_gates_with_silu_or_gelu_alone():
  from zinfjax.models import LlamaConfig
  with pytest.raises(ValueError, match="activation must be one of silu, gelu, gelu_tanh, got "
                                       "'relu'"):
    LlamaConfig(activation="relu")


def test_batch_not_divisible_by_devices(mesh):
  config = get_config("tiny")
  state = zinfjax.init(lambda r: GPT(config, rngs=r), optax.sgd(0.1), zinfjax.ZeroConfig(), mesh)
  batch = {"inputs": np.ones((6, 8), np.int32), "targets": np.ones((6, 8), np.int32)}
  with pytest.raises(ValueError, match="multiple of 8"):
    zinfjax.train_step(state, batch, lm_loss)


def test_too_many_devices():
  with pytest.raises(ValueError, match="xla_force_host_platform_device_count"):
    zinfjax.make_mesh(64)


def test_mesh_without_data_axis(mesh):
  from jax.sharding import Mesh
  other = Mesh(mesh.devices, ("model",))
  with pytest.raises(ValueError, match="no 'data' axis"):
    zinfjax.init(lambda r: GPT(get_config("tiny"), rngs=r), optax.sgd(0.1), zinfjax.ZeroConfig(), other)
