"""experiments/mqar.py: the solve rule, the two-part claim, and the tiny preset end to end."""

import json
import os
import sys

import numpy as np
from support import legs

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from experiments import mqar as exp  # noqa: E402


def _solves(*accs):
  """Softmax's per-width "solves" of mqar_claim for the given seed accuracies."""
  acc = {"softmax": {16 * (i + 1): np.asarray(a, float) for i, a in enumerate(accs)}}
  return list(exp.mqar_claim(acc, 0.99, 0.01)[2]["softmax_solves"].values())


def test_softmax_solves_by_the_t_interval():
  assert _solves([0.999, 0.998, 0.999], [0.5, 0.6, 0.55]) == [True, False]
  assert _solves([0.5, 0.6], [0.999, 0.95]) == [None, None]  # 2 seeds: t = 12.7; straddles
  assert _solves([0.995]) == [None]  # one seed: always inconclusive
  assert _solves([np.nan, 1.0]) == [False]  # a diverged seed never solves


def _acc(**per_width):
  return {w: {d: np.asarray(v, float) for d, v in zip((32, 64, 128), vals, strict=True)}
          for w, vals in per_width.items()}


def test_claim_the_zoology_shape_holds():
  acc = _acc(softmax=[[0.6, 0.62], [0.999, 0.998], [1.0, 1.0]],
             linear_elu=[[0.2, 0.21], [0.4, 0.41], [0.8, 0.82]])
  claim, text, info = exp.mqar_claim(acc, 0.99, 0.01)
  assert claim.held is True and info["first_solved_width"] == 64
  assert "d=32: no" in text and "d=64: yes" in text
  assert "linear_elu at d=128 vs d=32 (accuracy ↑): better" in text


def test_claim_fails_when_linear_matches_softmax_or_softmax_never_solves():
  same = _acc(softmax=[[0.999, 0.999], [1.0, 1.0], [1.0, 1.0]],
              linear_elu=[[0.999, 0.999], [1.0, 1.0], [1.0, 1.0]])
  assert exp.mqar_claim(same, 0.99, 0.01)[0].held is False  # within noise, not worse
  never = _acc(softmax=[[0.3, 0.301], [0.4, 0.401], [0.5, 0.501]],
               linear_elu=[[0.2, 0.21], [0.3, 0.31], [0.4, 0.41]])
  claim, text, _ = exp.mqar_claim(never, 0.99, 0.01)
  assert claim.held is False and "stays below" in text
  # Softmax solves, linear is worse but does not improve with d: open, not refuted.
  flat = _acc(softmax=[[0.999, 0.998], [1.0, 1.0], [1.0, 1.0]],
              linear_elu=[[0.24, 0.241], [0.25, 0.25], [0.24, 0.242]])
  assert exp.mqar_claim(flat, 0.99, 0.01)[0].held is None
  unclear = _acc(softmax=[[0.999, 0.9], [0.999, 0.9], [0.999, 0.9]],
                 linear_elu=[[0.2, 0.21], [0.3, 0.31], [0.4, 0.41]])
  assert exp.mqar_claim(unclear, 0.99, 0.01)[0].held is None
  # Means above the threshold that 2 seeds cannot certify: the linear part is still judged.
  close = _acc(softmax=[[0.997, 0.992], [0.999, 0.993], [1.0, 0.991]],
               linear_elu=[[0.2, 0.21], [0.3, 0.31], [0.5, 0.51]])
  claim, text, info = exp.mqar_claim(close, 0.99, 0.01)
  assert claim.held is None and info["reference_width"] == 32 and "cannot certify" in text


@legs.experiment_run
def test_tiny_preset_end_to_end(tmp_path, monkeypatch):
  monkeypatch.setenv("ATTNX_DATA_DIR", str(tmp_path / "data"))
  c = exp.get_config("tiny")
  c.update(dict(progress=False, widths=(16,), num_steps=10))  # one width: half the compiles
  out = exp.run(c, str(tmp_path / "wd"))
  acc = out["finish"]["accuracy"]
  assert set(acc) == {"softmax", "linear_elu"} and set(acc["softmax"]) == {16}
  assert all(len(v) == 2 and 0 <= min(v) and max(v) <= 1 for v in acc["softmax"].values())
  report = open(out["report"]).read()
  assert "Accuracy vs model width" in report and "Verdict rule" in report
  assert os.path.exists(tmp_path / "wd" / "mqar_accuracy_vs_width.png")
  results = json.load(open(tmp_path / "wd" / "results.json"))
  assert len(results["verdicts"]) == 1  # one verdict: the experiment's, not one per width
  # What the attention does (attnx.analysis), per weighting, layer and head, at each width:
  # linear attention forms no weights (n/a), softmax's causal rows sum to one.
  assert "Attention statistics at d = 16" in report
  assert os.path.exists(tmp_path / "wd" / "attention_heatmap_d16.png")
  stats = out["finish"]["attention"][16]
  assert set(stats) == {"softmax", "linear_elu"}
  soft, lin = stats["softmax"], stats["linear_elu"]
  layers, heads = c.num_layers, c.num_heads
  assert np.shape(soft["entropy_by_head"]) == (2, layers, heads)
  assert np.shape(soft["max_kurtosis"]) == np.shape(soft["sink_rate"]) == (2, layers)
  assert np.all(np.asarray(soft["max_weight"]) > 0) and np.all(np.asarray(soft["entropy"]) >= 0)
  assert np.isnan(lin["entropy_by_head"]).all() and np.isfinite(lin["mean_kurtosis"]).all()
  table = next(t for t in results["tables"] if "layer and head" in (t["caption"] or ""))
  assert {"weighting", "layer", "head", "sink rate", "share = 0", "share < 0.001",
          "entropy (nats)", "max weight"} <= set(table["columns"])
  assert len(table["rows"]) == 2 * layers * heads
  assert {r["entropy (nats)"] for r in table["rows"] if r["weighting"] == "linear_elu"} == {
      "n/a"}


def test_bad_weightings_name_the_key():
  import pytest

  c = exp.get_config("tiny")
  c.weightings = "softmax,relux"
  with pytest.raises(ValueError, match="config.weightings: .*relux"):
    exp.validate_config(c)
  c.weightings = "relu,sigmoid"
  with pytest.raises(ValueError, match="must include softmax"):
    exp.validate_config(c)
  c.weightings = "softmax,power:p=abc"  # parameters are checked too
  with pytest.raises(ValueError, match="config.weightings"):
    exp.validate_config(c)


def test_conv_preset_gives_every_model_the_short_convolution():
  import pytest

  from attnx import nn

  c = exp.get_config("conv")
  assert tuple(c.widths) == (32, 64, 128) and c.short_conv == 3
  for w in ("softmax", "linear_elu"):
    assert exp._task(c, 32).build_model(nn.attention_spec(w)).short_conv == 3
  assert exp._task(exp.get_config(), 32).build_model(nn.attention_spec("softmax")).short_conv == 0
  c.short_conv = -1
  with pytest.raises(ValueError, match="short_conv"):
    exp.validate_config(c)
