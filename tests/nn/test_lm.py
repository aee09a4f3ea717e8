"""attnx.nn.lm: the GPT of a language model's config per attention variant (sizes, positions a
variant may not take, the kernel only where it applies, linen or NNX with one parameter tree)
and the config checks, each naming its key."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from attnx import nn
from attnx import nnx as anx
from attnx.nn import lm

MODEL = dict(num_layers=1, num_heads=2, hidden_dim=16, mlp_dim=32, context=8,
             positions="rotary", dropout_rate=0.0, tie_embeddings=True)


def test_the_builder_gives_every_variant_the_config_sizes():
  build = lm.gpt_builder(MODEL, 11, implementation="blocked")
  soft, linear = build(nn.attention_spec("softmax")), build(nn.attention_spec("linear_elu"))
  assert isinstance(soft, nn.GPT) and (soft.vocab_size, soft.max_len, soft.hidden_dim) == (
      11, 8, 16)
  # Linear attention cannot rotate and has no kernel choice: learned positions, None.
  assert (soft.positions, soft.implementation) == ("rotary", "blocked")
  assert (linear.positions, linear.implementation) == ("learned", None)
  study = build(lm.Positioned(nn.attention_spec("softmax"), "alibi"))
  assert study.positions == "alibi" and lm.attention_of(lm.Positioned("x", "none")) == "x"
  assert lm.positions_for(nn.attention_spec("metric"), "alibi") == "alibi"
  assert lm.takes_segments("softmax") and not lm.takes_segments("linear_elu")
  with pytest.raises(ValueError, match="api='jax'"):
    lm.gpt_builder(MODEL, 11, api="jax")


def test_linen_and_nnx_builds_share_one_parameter_tree():
  spec = nn.attention_spec("relu:normalization=length")
  linen = lm.gpt_builder(MODEL, 11)(spec)
  bridged = lm.gpt_builder(MODEL, 11, api="nnx")(spec)
  assert anx.is_nnx(bridged) and anx.linen_twin(bridged) == linen
  tokens = np.arange(16).reshape(2, 8) % 11
  params = bridged.init(jax.random.key(0), tokens)["params"]
  np.testing.assert_allclose(linen.apply({"params": params}, tokens),
                             bridged.apply({"params": params}, tokens), atol=1e-5)


@pytest.mark.parametrize("kwargs,match", [
    (dict(implementation="fast"), "config.implementation='fast'; valid: '' "),
    (dict(api="haiku"), "config.model_api='haiku'; valid"),
    (dict(api="nnx", sequence_parallel=2), "model_api='nnx' with sequence_parallel > 1"),
    (dict(positions="rope"), "config.model.positions='rope' is invalid"),
    (dict(study="rotary,rope"), "position_study names 'rope'"),
    (dict(study="none, none"), "position_study='none, none' names a position twice"),
    (dict(study=("alibi",), weightings=("softmax", "linear_elu")),
     "linear_elu cannot take other positions"),
    (dict(packing="first_fit", weightings=("softmax", "linear_elu")),
     "config.packing='first_fit' .* linear_elu cannot take"),
    (dict(packing="best_fit", sequence_parallel=2), "config.packing with config.sequence_para"),
    (dict(sequence_parallel=4, sequence_layout="zigzag", context=20),
     r"context=20 must be a multiple of 8 .*\(zigzag layout\)"),
])
def test_config_checks_name_their_key(kwargs, match):
  kw = {"positions": "rotary", "weightings": ("softmax", "relu"), **kwargs}
  with pytest.raises(ValueError, match=match):
    lm.check_options(kw.pop("positions"), kw.pop("weightings"), **kw)


def test_good_settings_pass():
  lm.check_options("learned", ["softmax", "linear_elu"])
  lm.check_options("rotary", ["softmax", "stick_breaking"], study=["rotary", "none"],
                   packing="first_fit", implementation="blocked", api="nnx")
  lm.check_options("rotary", ["softmax"], sequence_parallel=4, sequence_layout="zigzag",
                   context=32)
