"""``flax_attention_fn``: attnx attention as a drop-in ``attention_fn`` for Flax.

Works with ``flax.linen.MultiHeadDotProductAttention(attention_fn=...)`` (which passes the
keyword arguments the function declares) and ``flax.nnx.MultiHeadAttention(attention_fn=...)``
(which passes all of its own, ``is_causal`` included), so any Flax model can swap softmax for
another weighting F. Every argument either entry point passes is honoured or refused: the
returned function has no catch-all ``**kwargs``, so an argument a future Flax adds raises a
``TypeError`` naming it instead of being dropped (a dropped ``is_causal`` once let a causal NNX
model see the future).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from attnx.core import api as attention_lib
from attnx.core import implementations as impl_lib
from attnx.core.implementations import Implementation

Array = jax.Array


def _matmul_precision(precision: Any) -> str | None:
  """Flax's ``precision`` (None, a ``lax.Precision``, its name, or a pair of equal ones) as the
  name :func:`jax.default_matmul_precision` takes."""
  if isinstance(precision, tuple | list):
    if len(set(precision)) != 1:
      raise ValueError(f"flax_attention_fn: precision {precision!r} differs between the two "
                       "operands; attnx applies one precision to its matmuls.")
    precision = precision[0]
  if precision is None:
    return None
  if isinstance(precision, str):
    precision = jax.lax.Precision(precision)
  if isinstance(precision, jax.lax.Precision):
    return {jax.lax.Precision.DEFAULT: "default", jax.lax.Precision.HIGH: "high",
            jax.lax.Precision.HIGHEST: "highest"}[precision]
  raise TypeError(f"flax_attention_fn: precision must be None, a jax.lax.Precision or its "
                  f"name, got {precision!r}.")


def flax_attention_fn(weighting: Any = "softmax", score: Any = "scaled_dot", *,
                      implementation: str | Implementation | None = None,
                      score_params: dict[str, Any] | None = None,
                      weighting_params: dict[str, Any] | None = None,
                      scale: float | None = None,
                      interpret: bool = False) -> Callable[..., Array]:
  """Returns ``attention_fn(query, key, value, bias=None, mask=None, ..., is_causal=False)``.

  The returned function takes exactly the arguments of Flax's own ``dot_product_attention``
  (linen's and NNX's) and honours each:

  - ``mask`` (bool or float 0/1, as ``flax.linen.make_attention_mask`` builds it) and
    ``is_causal`` (query i attends keys j ≤ i, top-left aligned as Flax's ``tril``), combined
    when both are given;
  - ``dropout_rate``, ``dropout_rng``, ``deterministic``, ``broadcast_dropout``: attention
    dropout as ``flax.linen.dot_product_attention`` draws it (same RNG use, so with
    ``weighting="softmax"`` the result equals the stock module even with dropout);
  - ``dtype``: query, key and value are cast to it (the math stays float32 for bf16/f16);
  - ``precision``: the precision of the score and value matmuls of the XLA implementations
    (dense, blocked), through :func:`jax.default_matmul_precision`; the Pallas kernels fix
    their own (bf16/f32 operands, f32 accumulation);
  - ``module`` (Flax passes it with ``sow_weights=True``): the weights, before dropout as Flax
    sows them, are sown into ``intermediates/attention_weights``;
  - ``force_fp32_for_softmax`` (linen): attnx computes F in float32 for bf16/f16 inputs
    always, so True is what it does anyway; False gives the same float32 math;
  - ``qk_attn_weights_einsum`` / ``attn_weights_value_einsum`` (linen): attnx computes its own
    scores, so a custom einsum cannot be honoured: anything but None raises a ValueError;
  - ``weighting_params`` (call time, overriding the one given here): the weighting's learnable
    arrays, e.g. ``{"s": s}`` for ``ssmax``, with gradients (an NNX module passes its
    ``nnx.Param``).

  One result differs from Flax's by design: a query whose every key is masked (a padded
  position) gets a zero row, attnx's edge-case contract for every implementation, where Flax's
  softmax averages every value; every other query matches.

  Any other keyword is a ``TypeError`` naming it. Dropout and sowing need the weights, so they
  are not available with ``implementation="blocked"`` or ``"pallas"`` (a ValueError at call
  time). ``implementation`` is an implementation object with its kernel settings
  (``core.Pallas(interpret=True)`` runs the Pallas kernel in Pallas' interpreter, e.g. on a
  CPU) or its name; ``interpret`` is deprecated (a DeprecationWarning; removed in the next
  release) for ``core.Pallas(interpret=True)``.
  Everything static is validated here, at construction (:func:`~attnx.core.check_compatible`,
  and that a parametrized score gets its ``score_params``), so a bad configuration fails before
  any model is built.

  Raises:
    ValueError: unknown weighting/score/implementation, a distance kernel on a similarity
      score, a weighting or score that cannot stream with ``implementation="blocked"``, or
      missing/unknown ``score_params``.
  """
  settings = impl_lib.legacy_settings("flax_attention_fn", interpret=interpret)
  auto_settings = settings if implementation is None else {}  # the automatic choice's
  if implementation is not None:
    implementation = impl_lib.configure(implementation, settings, "flax_attention_fn")
  try:
    attention_lib.check_compatible(weighting, score, implementation)
    attention_lib.check_score_params(score, score_params)
  except ValueError as e:
    raise ValueError(f"flax_attention_fn: {e}") from None
  default_weighting_params = weighting_params

  def attention_fn(query: Array, key: Array, value: Array, bias: Array | None = None,
                   mask: Array | None = None, broadcast_dropout: bool = True,
                   dropout_rng: jax.Array | None = None, dropout_rate: float = 0.0,
                   deterministic: bool = False, dtype: Any = None, precision: Any = None,
                   module: Any = None, is_causal: bool = False,
                   force_fp32_for_softmax: bool = False,
                   qk_attn_weights_einsum: Any = None, attn_weights_value_einsum: Any = None,
                   weighting_params: dict[str, Any] | None = None) -> Array:
    del force_fp32_for_softmax  # F runs in float32 for low-precision inputs either way
    for name, einsum in (("qk_attn_weights_einsum", qk_attn_weights_einsum),
                         ("attn_weights_value_einsum", attn_weights_value_einsum)):
      if einsum is not None:
        raise ValueError(f"flax_attention_fn: {name} is not supported: attnx computes the "
                         "scores and the weighted sum itself (leave it None).")
    if weighting_params is None:
      weighting_params = default_weighting_params
    if mask is not None:
      mask = jnp.asarray(mask).astype(jnp.bool_)
    if dtype is not None:
      query, key, value = (jnp.asarray(x, dtype) for x in (query, key, value))
    # Dropout and sowing need the weights: core.attention runs the dense path for them.
    with jax.default_matmul_precision(_matmul_precision(precision)), warnings.catch_warnings():
      if auto_settings:  # deprecated keywords, warned about at construction
        warnings.filterwarnings("ignore", "attention.* is deprecated", DeprecationWarning)
      out = attention_lib.attention(
          query, key, value, bias, mask, weighting=weighting, score=score, scale=scale,
          is_causal=bool(is_causal), score_params=score_params,
          weighting_params=weighting_params, implementation=implementation,
          dropout_rate=dropout_rate, dropout_rng=dropout_rng, deterministic=deterministic,
          broadcast_dropout=broadcast_dropout, return_weights=module is not None,
          **auto_settings)
    if module is None:
      return out
    out, w = out
    module.sow("intermediates", "attention_weights", w)
    return out

  name = f"attnx_attention_{getattr(weighting, '__name__', weighting)}"
  attention_fn.__name__ = attention_fn.__qualname__ = name
  return attention_fn
