"""The compiled Pallas kernels on a real GPU against the float64 brute force (skipped elsewhere).

On a CPU the Pallas kernels run only in Pallas' interpreter (tests/core/test_pallas_attention.py,
test_pallas_rows.py) and are lowered for ``cuda``/``tpu`` without compiling them; this module is
the step after that: on a GPU, ``implementation="pallas"`` compiles the Triton kernels (PTX,
registers, shared memory) and runs them. Every streaming weighting — each pointwise F and each
whole-row family — runs forward and backward (q, k, v, bias gradients) through the differential
net's machinery (tests/support/differential.py), which on a GPU runs the compiled kernels and the
automatic choice (Pallas after its self-check) at lengths up to 4096:

* a causal GQA problem at T = S = 1000 (no power of 2: ragged last tiles) with padding, f32;
* a full problem with T ≠ S, a random mask with fully masked rows, a per-key bias, explicit
  tiles, bf16;
* long causal rows at T = S = 4096 for one weighting of each family;
* structured masks (:mod:`attnx.core.masks`, read per tile by the kernels): packed documents
  with a window, sinks with a window, lengths, prefix-LM and a mask_mod at T = 2048 with GQA,
  one weighting of each family;
* a soft cap, ALiBi, relative tables and attention sinks (:mod:`attnx.core.score_mods`) with
  pointwise and whole-row F, causal GQA at T = S = 1000 with padding.

Run on a GPU machine with ``pytest tests/core/test_pallas_device.py``; the large random run of
the net (``-m differential``) also runs the compiled kernels there.
"""

from __future__ import annotations

import jax
import pytest
from support import differential as diff

from attnx.core import api
from attnx.core import weightings as wlib

pytestmark = pytest.mark.skipif(jax.default_backend() != "gpu",
                                reason="needs a GPU: the compiled Triton kernels")

STREAMING = [n for n in diff.WEIGHTINGS if api.streams(wlib.get_weighting(n))]


def _score(weighting: str) -> str:
  scores = diff._compatible_scores(weighting)
  return "scaled_dot" if "scaled_dot" in scores else scores[0]


def _magnitude(score: str) -> float:
  return 0.3 / 8**0.5 if score in ("neg_sq_dist", "metric") else 1.0


def _check(case: diff.Case) -> None:
  assert "pallas" in case.implementations(), case.label()
  failures = diff.check(case)
  assert not failures, f"{case.label()}\n" + "\n".join(failures)


# The structured masks and the long rows first: pytest-xdist hands tests out in this order,
# and a lent GPU's minutes may end before the last (2026-11-27: 50 of 82 in 330 s).
@pytest.mark.parametrize("weighting", ["softmax", "relu", "ssmax", "softpick", "stick_breaking",
                                       "entmax15"])
def test_long_causal_rows(weighting):
  _check(diff.Case(seed=103, b=1, t=4096, s=4096, n=2, kh=1, h=128, hv=128, causal=True,
                   dtype="bfloat16", weighting=weighting, only=("pallas",)))


@pytest.mark.parametrize("structured,weighting", [
    ("combo", "softmax"), ("segments", "sigmoid"), ("sinks", "stick_breaking"),
    ("combo", "ssmax"), ("lengths", "softpick"), ("prefix", "entmax15"),
    ("mask_mod", "relu"), ("window", "sparsemax")])
def test_structured_masks(structured, weighting):
  _check(diff.Case(seed=104, b=2, t=2048, s=2048, n=4, kh=2, h=64, hv=64,
                   causal=structured != "mask_mod", structured=structured, weighting=weighting,
                   only=("pallas",)))


@pytest.mark.parametrize("weighting", STREAMING)
def test_causal_gqa_ragged(weighting):
  score = _score(weighting)
  _check(diff.Case(seed=101, b=1, t=1000, s=1000, n=4, kh=2, h=64, hv=64, causal=True,
                   mask="padding", weighting=weighting, score=score,
                   magnitude=_magnitude(score), only=("pallas", "auto")))


@pytest.mark.parametrize("weighting", STREAMING)
def test_full_mask_bias_bf16_tiles(weighting):
  score = _score(weighting)
  _check(diff.Case(seed=102, b=2, t=333, s=777, n=2, kh=1, h=32, hv=48, mask="random",
                   bias="x11x", block_q=32, block_k=64, dtype="bfloat16", weighting=weighting,
                   score=score, magnitude=_magnitude(score), only=("pallas",)))


# Relative tables ("table"): every distance's entry (table_len 0) or clipped to ±31; the
# GPU's d table comes from the dQ kernels' atomic adds, which Pallas' interpreter does not run.
@pytest.mark.parametrize("weighting,score_mod,sinks,table_len", [
    ("softmax", "table", True, 0), ("sigmoid", "table", False, 63), ("ssmax", "table", True, 0),
    ("entmax15", "table", True, 63), ("stick_breaking", "table", False, 0),
    ("softpick", "table", False, 63),
    ("softmax", "cap", True, 0), ("sigmoid", "none", True, 0), ("relu", "cap", False, 0),
    ("softmax_plus_one", "cap", True, 0), ("softmax", "alibi", True, 0),
    # Rows far past a short key length, every σ below float32's range: log σ streams them.
    ("sigmoid", "alibi", False, 0), ("ssmax", "cap", False, 0),
    ("stick_breaking", "alibi", False, 0), ("entmax15", "cap", False, 0)])
def test_soft_cap_alibi_tables_and_sinks(weighting, score_mod, sinks, table_len):
  _check(diff.Case(seed=105, b=2, t=1000, s=1000, n=4, kh=2, h=64, hv=64, causal=True,
                   mask="padding", weighting=weighting, score_mod=score_mod, sinks=sinks,
                   table_len=table_len, only=("pallas",)))
