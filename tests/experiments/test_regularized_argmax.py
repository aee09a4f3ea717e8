"""regularized_argmax: the generic simplex solver agrees with attnx.core; tiny preset runs."""

import json
import os
import sys

import numpy as np
import pytest
from support import legs

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from experiments import regularized_argmax as exp  # noqa: E402


@pytest.mark.parametrize("name,alpha", [("shannon", None), ("gini", None), ("tsallis", 1.5),
                                        ("tsallis", 3.0)])
def test_solver_matches_closed_form(name, alpha):
  s = np.array([1.2, -0.3, 0.8, -2.0, 0.1])
  p_solver, ok = exp.solve_simplex(s, 0.7, name, alpha)
  p_core = exp.closed_form(s, 0.7, name, alpha)
  assert ok
  np.testing.assert_allclose(p_solver, p_core, atol=1e-3)
  assert abs(p_solver.sum() - 1) < 1e-9


def test_sparsemax_reference_example():
  # docs/references.md: x = [−2, 0, 0.5] -> sparsemax [0, .25, .75].
  p, _ = exp.solve_simplex(np.array([-2.0, 0.0, 0.5]), 1.0, "gini")
  np.testing.assert_allclose(p, [0, 0.25, 0.75], atol=1e-6)


def test_unknown_regularizer_and_preset():
  with pytest.raises(ValueError, match="shannon"):
    exp.regularizer("renyi")
  with pytest.raises(ValueError, match="tiny"):
    exp.get_config("huge")


@legs.experiment_run
def test_tiny_end_to_end(tmp_path):
  out = exp.run(exp.get_config("tiny"), str(tmp_path))
  assert out["max_abs_diff"] < 1e-3
  assert out["verdict"] is True
  results = json.loads((tmp_path / "results.json").read_text())
  rows = results["tables"][0]["rows"]
  assert {r["core map"] for r in rows} >= {"softmax", "sparsemax", "entmax15"}
  assert all(r["max abs diff (solver vs core)"] < 1e-3 for r in rows)
  sparsity = {r["alpha"]: r for r in results["tables"][1]["rows"]}
  assert sparsity[1.0]["τ=1"] == 0.0 and sparsity[2.0]["τ=1"] > 0.5
  assert results["verdicts"][0]["held"] is True
  for fig in ("entmax_curves.png", "simplex_maps.png", "sparsity.png"):
    assert (tmp_path / fig).exists()
  assert "Generic solver vs closed forms" in (tmp_path / "report.md").read_text()
