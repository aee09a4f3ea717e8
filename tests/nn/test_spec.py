"""attnx.nn.spec: the attention-dict spec, variant names, make_attention."""

import pytest

import attnx.nn as an
from attnx import core


def test_attention_spec_variants():
  assert an.attention_spec("linear_elu") == {"type": "linear", "feature_map": "elu_plus_one"}
  assert an.attention_spec("linear_favor") == {"type": "linear", "feature_map": "favor_plus"}
  assert an.attention_spec("metric") == {"type": "metric"}
  assert an.attention_spec("metric:weighting=relu") == {"type": "metric", "weighting": "relu"}
  assert an.attention_spec("relu") == {"type": "dot", "weighting": "relu"}
  assert an.attention_spec("power:p=3") == {"type": "dot", "weighting": "power:p=3"}
  assert an.attention_spec("gaussian:h=2")["score"] == "neg_sq_dist"
  variants = an.list_attention_variants()
  assert {"linear_elu", "linear_favor", "metric"} <= set(variants)
  assert set(core.list_weightings()) <= set(variants)


def test_unknown_variant_lists_weightings_and_special_variants():
  with pytest.raises(ValueError, match="Unknown weighting 'softmaxx'") as e:
    an.attention_spec("softmaxx")
  assert "sparsemax" in str(e.value) and "linear_favor" in str(e.value)
  with pytest.raises(ValueError, match="Valid weightings"):
    an.attention_spec("metric:weighting=nope")


def test_make_attention_builds_each_type():
  for variant, cls in (("relu", an.MultiHeadAttention), ("linear_elu", an.LinearAttention),
                       ("metric", an.MetricAttention)):
    module = an.make_attention(an.attention_spec(variant), num_heads=2, is_causal=True)
    assert isinstance(module, cls) and module.is_causal
  with pytest.raises(ValueError, match="Bad attention spec"):
    an.make_attention({"type": "linear", "weighting": "relu"}, num_heads=2)


def test_dict_form_builds_the_same_model_as_the_variant_name():
  for variant in ("gaussian", "boxcar:h=0.5", "relu"):
    by_dict = an.resolve_attention({"weighting": variant})
    assert by_dict == an.attention_spec(variant), variant
    built = [an.make_attention(a, num_heads=2, name="attention")
             for a in (by_dict, an.attention_spec(variant), variant)]
    assert built[0] == built[1] == built[2], variant
  assert an.resolve_attention({"weighting": "gaussian"})["score"] == "neg_sq_dist"
  assert "score" not in an.resolve_attention({"weighting": "relu"})  # MHA's default applies
  # The same holds inside models: both forms give the same frozen attention field.
  vits = [an.VisionTransformer(num_classes=3, hidden_dim=8, num_heads=2, attention=a)
          for a in ({"weighting": "gaussian"}, an.attention_spec("gaussian"))]
  assert vits[0].attention == vits[1].attention
  # An explicit distance score is kept.
  assert an.resolve_attention({"weighting": "gaussian", "score": "metric"})["score"] == "metric"


def test_ssmax_learned_learns_s_per_head_from_0_43():
  # SSMax as published: s a parameter per head, starting where the fixed "ssmax:s=0.43"
  # is (the same outputs at initialization), and trained (a non-zero gradient).
  import jax
  import jax.numpy as jnp

  tokens = jnp.arange(16).reshape(2, 8) % 5
  gpt = lambda attention: an.GPT(vocab_size=5, num_layers=1, num_heads=2, hidden_dim=8,
                                 mlp_dim=16, max_len=8, attention=attention)
  learned, fixed = gpt("ssmax_learned"), gpt("ssmax:s=0.43")
  params = learned.init(jax.random.PRNGKey(0), tokens)["params"]
  s = params["block_0"]["attention"]["ssmax_s"]
  assert s.shape == (2,) and jnp.allclose(s, 0.43)
  plain = jax.tree_util.tree_map(lambda x: x, params)
  del plain["block_0"]["attention"]["ssmax_s"]
  assert jnp.allclose(learned.apply({"params": params}, tokens),
                      fixed.apply({"params": plain}, tokens), atol=1e-6)
  loss = lambda p: jnp.sum(learned.apply({"params": p}, tokens) ** 2)
  assert jnp.all(jnp.abs(jax.grad(loss)(params)["block_0"]["attention"]["ssmax_s"]) > 0)
