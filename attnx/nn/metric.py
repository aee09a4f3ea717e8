"""Metric attention: attention over a learned pseudo-metric.

Ruan & Zhang, "Towards understanding how attention mechanism works in deep learning" (arXiv
2412.18288), decompose attention into a learnable pseudo-metric and a similarity-based
propagation, and propose "metric-attention". Their exact parametrization is not public, so
this module implements the principled version of the idea, not a reproduction: per head h a
learned linear map L_h (shared by queries and keys) defines the Mahalanobis pseudo-metric

    d_h(x_i, x_j)² = ‖L_h (x_i − x_j)‖²,   s_ij = −τ_h · d_h(x_i, x_j)²,

which is symmetric, non-negative and satisfies the triangle inequality by construction (a
pseudo-metric: L_h may have a kernel). τ_h > 0 is an optional learned temperature. Weights
are w_ij = F(s_ij)/Σ_l F(s_il) for any weighting F (softmax gives a Gaussian kernel).

There is one implementation: ``MultiHeadAttention(score="metric")``. :class:`MetricAttention`
is that module with the score fixed and ``rank`` as the name of its ``score_dim``.
"""

from __future__ import annotations

from typing import Any

from attnx.nn.attention import MultiHeadAttention


class MetricAttention(MultiHeadAttention, kw_only=True):
  """``MultiHeadAttention(score="metric")``: score −τ_h‖L_h(x_i − x_j)‖², any weighting F.

  Every field, argument and parameter is :class:`~attnx.nn.MultiHeadAttention`'s (params
  ``metric`` [D, N, R], ``log_temperature`` [N], ``value``, ``out``), so the two are
  interchangeable on the same parameters. Scores are ≤ 0 here, so weightings that vanish there
  (``core.list_weightings(zero_on_nonpositive=True)``: ``relu``, ``relu2``, ``power``,
  ``softpick``) are rejected; exp-like weightings, the simplex projections and the distance
  kernels are meaningful.

  Attributes:
    rank: rank R of each L_h (default qkv_features // N); another name for ``score_dim``.
    learn_temperature: learn τ_h = exp(log_temperature_h) per head, initialized at ``scale``
      (default 1/√R, the scaled-dot analogue); otherwise τ is fixed there. Default True.
  """

  score: Any = "metric"
  rank: int | None = None

  def __post_init__(self):
    where = type(self).__name__
    if self.score != "metric":
      raise ValueError(f"{where}: the score is 'metric' (got score={self.score!r}); use "
                       "MultiHeadAttention for other scores.")
    if self.rank is not None:
      if self.score_dim is not None and self.score_dim != self.rank:
        raise ValueError(f"{where}: rank={self.rank} and score_dim={self.score_dim} name the "
                         "same width; give one.")
      if self.rank <= 0:
        raise ValueError(f"{where}: rank must be positive, got {self.rank}.")
    super().__post_init__()

  def _score_width(self) -> int | None:
    return self.rank if self.rank is not None else self.score_dim
