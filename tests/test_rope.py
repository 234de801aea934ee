"""Rotary embedding scalings against `transformers`: what `models/rope.py` computes of each
rope scaling a Hugging Face config.json gives (the checkpoints' logits: test_pretrained.py)."""

import json
import os

import numpy as np
import pytest

from zinfjax.models import hf, rope

from helpers import REPO

HF = os.path.join(REPO, "tests", "data", "hf")


def test_rope_scalings_change_the_frequencies_as_transformers_does():
  """Linear scaling slows every frequency by its factor; Llama 3.1's keeps the short wavelengths,
  slows the long ones by the factor and blends those between, continuously at both edges; a
  scaling that is not one is refused by name. (Against transformers: the llama3 checkpoint's
  logits, below.)"""
  plain = np.asarray(rope.frequencies(64, 5e5))
  np.testing.assert_allclose(rope.frequencies(64, 5e5, rope.RopeScaling("linear", 4.0)),
                             plain / 4, rtol=1e-7)
  scaled = np.asarray(rope.frequencies(64, 5e5, rope.RopeScaling("llama3", 8.0, 1.0, 4.0, 8192)))
  wavelength = 2 * np.pi / plain
  short, long = wavelength < 8192 / 4, wavelength > 8192
  assert short.sum() and long.sum() and (~short & ~long).sum()  # all three bands in play
  np.testing.assert_array_equal(scaled[short], plain[short])
  np.testing.assert_allclose(scaled[long], plain[long] / 8, rtol=1e-6)
  ratio = plain / scaled
  assert ((ratio >= 1 - 1e-6) & (ratio <= 8 + 1e-5)).all() and (np.diff(ratio) >= -1e-6).all()
  with pytest.raises(ValueError, match="kind 'longrope' is none of"):
    rope.RopeScaling("longrope", 4.0)
  with pytest.raises(ValueError, match="high_freq_factor 1.0 must exceed"):
    rope.RopeScaling("llama3", 8.0, 1.0, 1.0)
  with pytest.raises(ValueError, match="yarn's beta_fast 1.0 must be at least beta_slow 2.0"):
    rope.RopeScaling("yarn", 4.0, beta_fast=1.0, beta_slow=2.0)


def test_rope_scalings_of_config_json_equal_transformers():
  """Each rope scaling of `tests/data/hf/rope.json` (YaRN's with its defaults and with each of
  its fields, transformers 4's form, dynamic NTK, linear, Llama 3.1's), read from a config.json
  as `hf` reads it, gives the inverse frequencies and attention factor `transformers` computes
  (fp32, rtol 1e-6), and is written back as the same scaling."""
  with open(os.path.join(HF, "rope.json"), encoding="utf-8") as f:
    cases = json.load(f)
  for case in cases:
    config = hf.config_from_hf(case["config"])
    scaling = config.rope_scaling
    given = case["config"]["rope_scaling"]
    np.testing.assert_allclose(rope.frequencies(config.dim, config.rope_theta, scaling),
                               case["inv_freq"], rtol=1e-6, err_msg=str(given))
    assert scaling.scale == pytest.approx(case["attention_factor"], rel=1e-12), given
    assert hf.config_from_hf(hf.config_to_hf(config)).rope_scaling == scaling, given
  yarn = [c["config"]["rope_scaling"] for c in cases][0]
  with pytest.raises(ValueError, match="'linear' gives no factor"):
    hf.config_from_hf({**cases[0]["config"], "rope_scaling": {"rope_type": "linear"}})
  assert yarn["rope_type"] == "yarn" and cases[0]["attention_factor"] > 1.1
