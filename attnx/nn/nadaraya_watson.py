"""Nadaraya-Watson regression as attention pooling.

Martínez-Ramón, Ajith & Kurup's slides on attention, eq. 4-5; d2l §11.2.

g(x) = Σ_i y_i K(x, x_i) / Σ_j K(x, x_j): the query is x, the keys are the training inputs and
the values the training targets. The kernel is fixed, has a learned bandwidth, or is the
slides' learnable form K = exp(−((x − x_i) w)² / 2). A learned bandwidth is fitted on the
training set alone by :func:`leave_one_out_mse`.
"""

from __future__ import annotations

from typing import Any

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from attnx import core

Array = jax.Array

MODES = ("fixed", "learned_bandwidth", "learned_w")


class NadarayaWatsonRegressor(nn.Module, kw_only=True):
  """Kernel regression g(x) = Σ_i K(x, x_i) y_i / Σ_j K(x, x_j) via ``core.nadaraya_watson``.

  Every mode is the fixed kernel of unit bandwidth on rescaled inputs, K_h(x, x') =
  K_1(x/h, x'/h), so the learned modes work with any kernel (a boxcar has zero gradient).

  Attributes:
    kernel: ``"gaussian"``, ``"boxcar"``, ``"triangular"`` (the slides' "Epanechnikov"),
      ``"epanechnikov"``, or any weighting spec applied to the score −‖x − x_i‖².
    bandwidth: h for ``"fixed"``, and the initial h for ``"learned_bandwidth"``.
    mode: ``"fixed"`` (no parameters), ``"learned_bandwidth"`` (param ``log_bandwidth``), or
      ``"learned_w"`` (param ``w``, init 1/h, K = K_1((x − x_i) w), the slides / d2l).
    dtype: dtype of the inputs' computation and of the predictions (default: inferred from
      the inputs); kernel weights are computed in float32 for low-precision inputs.
    param_dtype: dtype of the learned parameter.
  """

  kernel: Any = "gaussian"
  bandwidth: float = 1.0
  mode: str = "fixed"
  dtype: Any = None
  param_dtype: Any = jnp.float32

  def __post_init__(self):
    if self.mode not in MODES:
      raise ValueError(f"NadarayaWatsonRegressor: unknown mode {self.mode!r}; valid: "
                       f"{', '.join(MODES)}.")
    if not self.bandwidth > 0:
      raise ValueError(f"NadarayaWatsonRegressor: bandwidth must be > 0, got {self.bandwidth}.")
    if isinstance(self.kernel, str):
      core.get_weighting(self.kernel)  # unknown kernel names fail here, listing valid ones
    super().__post_init__()

  @nn.compact
  def __call__(self, x_query: Array, x_train: Array, y_train: Array, *,
               return_weights: bool = False) -> Array | tuple[Array, Array]:
    """``x_query [Q]|[Q, D]``, ``x_train [n]|[n, D]``, ``y_train [n]|[n, Dy]``.

    Returns predictions ``[Q]``/``[Q, Dy]`` (and weights ``[Q, n]`` if requested).
    """
    xq, xt, y = jnp.asarray(x_query), jnp.asarray(x_train), jnp.asarray(y_train)
    if xq.ndim not in (1, 2) or xt.ndim != xq.ndim:
      raise ValueError(f"x_query {xq.shape} and x_train {xt.shape} must both be [n] or [n, D].")
    chex.assert_rank(y, {1, 2})
    chex.assert_equal_shape_prefix([xt, y], 1)  # one target per training point
    if xq.ndim == 2:
      chex.assert_equal_shape_suffix([xq, xt], 1)  # same feature dim D
    # Default: the inputs' float dtype (integer inputs compute in the default float).
    dtype = self.dtype if self.dtype is not None else jnp.result_type(xq, xt, y, float)
    xq, xt, y = xq.astype(dtype), xt.astype(dtype), y.astype(dtype)
    if self.mode == "fixed":
      inv_h = 1.0 / self.bandwidth
    elif self.mode == "learned_bandwidth":
      log_h = self.param("log_bandwidth", nn.initializers.constant(jnp.log(self.bandwidth)),
                         (), self.param_dtype)
      inv_h = jnp.exp(-log_h).astype(dtype)
    else:
      inv_h = self.param("w", nn.initializers.constant(1.0 / self.bandwidth), (),
                         self.param_dtype).astype(dtype)
    # The bandwidth lives in the input scaling: named kernels run with h = 1.
    out = core.nadaraya_watson(xq * inv_h, xt * inv_h, y, kernel=self.kernel, bandwidth=1.0,
                               return_weights=return_weights)
    pred, w = out if return_weights else (out, None)
    chex.assert_shape(pred, xq.shape[:1] + y.shape[1:])
    pred = pred.astype(dtype)
    return (pred, w) if return_weights else pred


def leave_one_out_mse(model: NadarayaWatsonRegressor, params: Any, x_train: Array,
                      y_train: Array) -> Array:
  """Mean squared error of predicting each training point from the other n − 1 (a vmap over
  the points, each with its own key set): the criterion that fits a learned bandwidth or
  ``w`` on the training set alone. With the point itself among the keys the loss would be
  minimized by h → 0 (every point predicts itself), the classic interpolation trap.

  ``x_train [n]|[n, D]``, ``y_train [n]|[n, Dy]``, n ≥ 2; ``params``: ``model``'s.
  """
  x, y = jnp.asarray(x_train), jnp.asarray(y_train)
  n = x.shape[0]
  if n < 2:
    raise ValueError(f"leave_one_out_mse needs at least 2 training points, got {n}.")
  others = np.array([[j for j in range(n) if j != i] for i in range(n)])  # [n, n − 1]
  pred = jax.vmap(lambda q, k, v: model.apply({"params": params}, q[None], k, v)[0])(
      x, x[others], y[others])
  return jnp.mean(jnp.square(pred - y))
