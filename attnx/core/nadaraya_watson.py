"""Nadaraya-Watson kernel regression: attention pooling with a fixed kernel.

After Martínez-Ramón, Ajith & Kurup's lecture slides "Attention mechanisms".

f(x) = Σ_i K(x, x_i) y_i / Σ_j K(x, x_j): queries are the test inputs, keys the training inputs
and values the training targets; K is any weighting applied to the score −‖x − x_i‖².
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from attnx.core import weightings as weightings_lib

Array = jax.Array


def _as_points(x: Array, name: str) -> Array:
  x = jnp.asarray(x)
  if x.ndim == 1:
    return x[:, None]
  if x.ndim != 2:
    raise ValueError(f"{name} must be [n] or [n, d], got shape {x.shape}")
  return x


def nadaraya_watson(x_query: Array, x_train: Array, y_train: Array, *,
                    kernel: Any = "gaussian", bandwidth: float | Array = 1.0,
                    return_weights: bool = False) -> Array | tuple[Array, Array]:
  """Nadaraya-Watson estimate at ``x_query``.

  Args:
    x_query: ``[Q]`` or ``[Q, D]`` query inputs.
    x_train: ``[n]`` or ``[n, D]`` training inputs (the keys).
    y_train: ``[n]`` or ``[n, Dy]`` training targets (the values).
    kernel: ``"gaussian"`` exp(−d²/2h²), ``"boxcar"`` 1[d ≤ h], ``"triangular"`` (1 − d/h)₊ —
      what the slides and d2l call "Epanechnikov" — ``"epanechnikov"`` ¾(1 − (d/h)²)₊, or any
      weighting spec/callable applied to the score −d².
    bandwidth: h > 0 for the named kernels. May be a traced array for the Gaussian kernel
      (learned bandwidths); the other kernels take a Python float.
    return_weights: also return the ``[Q, n]`` attention weights.

  Returns:
    ``[Q]`` or ``[Q, Dy]`` predictions (0 where no training point has positive weight), and the
    weights if requested.
  """
  xq, xt = _as_points(x_query, "x_query"), _as_points(x_train, "x_train")
  y = jnp.asarray(y_train)
  if xq.shape[1] != xt.shape[1]:
    raise ValueError(f"x_query {xq.shape} and x_train {xt.shape} have different feature dims")
  if y.shape[0] != xt.shape[0]:
    raise ValueError(f"y_train {y.shape} and x_train {xt.shape} have different lengths")
  diff = xq[:, None, :] - xt[None, :, :]
  scores = -jnp.sum(diff * diff, axis=-1)  # exact −d², no cancellation
  if isinstance(bandwidth, jax.Array) or not isinstance(bandwidth, (int, float)):
    if kernel != "gaussian":
      raise ValueError("A traced/array bandwidth is supported for kernel='gaussian' only.")
    w = jax.nn.softmax(scores / (2.0 * jnp.square(bandwidth)), axis=-1)
  else:
    if isinstance(kernel, str) and kernel in weightings_lib.POINTWISE_KERNELS:
      kernel = f"{kernel}:h={float(bandwidth)}"
    w = weightings_lib.weights(scores, kernel, axis=-1)
  pred = jnp.tensordot(w, y.astype(w.dtype), axes=(1, 0))
  return (pred, w) if return_weights else pred
