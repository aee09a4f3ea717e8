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
