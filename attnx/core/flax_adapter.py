"""``flax_attention_fn``: attnx attention as a drop-in ``attention_fn`` for Flax.

Works with ``flax.linen.MultiHeadDotProductAttention(attention_fn=...)`` (which passes only the
keyword arguments the function declares) and ``flax.nnx.MultiHeadAttention(attention_fn=...)``
(which passes all of them), so any Flax model can swap softmax for another weighting F.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from attnx.core import dispatch as attention_lib

Array = jax.Array


def flax_attention_fn(weighting: Any = "softmax", score: Any = "scaled_dot", *,
                      implementation: str | None = None,
                      score_params: dict[str, Any] | None = None,
                      scale: float | None = None,
                      interpret: bool = False) -> Callable[..., Array]:
  """Returns ``attention_fn(query, key, value, bias=None, mask=None, **flax_kwargs)``.

  Flax's conventions are kept: masks may be float 0/1 (as ``flax.linen.make_attention_mask``
  builds them), attention dropout is :func:`~attnx.core.attention`'s, which follows
  ``flax.linen.dot_product_attention`` (same RNG use, so with ``weighting="softmax"`` the result
  equals the stock module even with dropout), and when Flax passes ``module``
  (``sow_weights=True``) the weights (before dropout, as flax sows them) are sown into
  ``intermediates/attention_weights``. Dropout and sowing need the weights, so they are not
  available with ``implementation="blocked"`` or ``"pallas"`` (a ValueError at call time;
  ``interpret=True`` runs the Pallas kernel in Pallas' interpreter, e.g. on a CPU). Everything
  static
  is validated here, at construction (:func:`~attnx.core.check_compatible`, and that a
  parametrized score gets its ``score_params``), so a bad configuration fails before any model
  is built.

  Raises:
    ValueError: unknown weighting/score/implementation, a distance kernel on a similarity
      score, a weighting or score that cannot stream with ``implementation="blocked"``, or
      missing/unknown ``score_params``.
  """
  try:
    attention_lib.check_compatible(weighting, score, implementation)
    attention_lib.check_score_params(score, score_params)
  except ValueError as e:
    raise ValueError(f"flax_attention_fn: {e}") from None

  def attention_fn(query: Array, key: Array, value: Array, bias: Array | None = None,
                   mask: Array | None = None, broadcast_dropout: bool = True,
                   dropout_rng: jax.Array | None = None, dropout_rate: float = 0.0,
                   deterministic: bool = False, dtype: Any = None, precision: Any = None,
                   module: Any = None, **unused: Any) -> Array:
    del precision, unused  # attnx picks its own precision: f32 math for low-precision inputs
    if mask is not None:
      mask = jnp.asarray(mask).astype(jnp.bool_)
    if dtype is not None:
      query, key, value = (jnp.asarray(x, dtype) for x in (query, key, value))
    # Dropout and sowing need the weights: core.attention runs the dense path for them.
    out = attention_lib.attention(
        query, key, value, bias, mask, weighting=weighting, score=score, scale=scale,
        score_params=score_params, implementation=implementation, dropout_rate=dropout_rate,
        dropout_rng=dropout_rng, deterministic=deterministic,
        broadcast_dropout=broadcast_dropout, return_weights=module is not None,
        interpret=interpret)
    if module is None:
      return out
    out, w = out
    module.sow("intermediates", "attention_weights", w)
    return out

  attention_fn.__name__ = f"attnx_attention_{getattr(weighting, '__name__', weighting)}"
  return attention_fn
