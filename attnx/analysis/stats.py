"""What a trained model's attention does: its weights and hidden states, and their statistics.

:func:`probe` runs any attnx model (``attnx.nn.GPT``, ``VisionTransformer``,
``SequenceClassifier``, ``SequenceRegressor``, ``Seq2Seq``, ...) once and returns every
attention layer's weights ``[B..., N, T, S]`` with the entries each query may attend (its
causality and mask, as the layer received them) and every transformer block's output (the
residual stream). It works whatever implementation the model trains with: the weights come
from a copy of the model on the dense kernel, unsharded (:func:`dense_model`), which is what
an evaluation on a few short inputs wants; loss vs length is the job of
``attnx.train.evaluators``' ``"loss_by_length"``, through the model's own kernels.

The statistics (:func:`attention_statistics`, per head; :func:`hidden_statistics`; both per
layer in :func:`statistics`):

* **sink rate** at a threshold τ: the share of inputs in which a head's mean weight on key 0
  over all query rows exceeds τ (Gu et al. 2024, "When Attention Sink Emerges in Language
  Models: An Empirical View", τ = 0.3, as the softpick paper uses it);
* **share = 0** and **share < ε**: the share of the valid weights (key ≤ query for causal
  attention, masked keys excluded) that are exactly 0 / below ε;
* **entropy**: of each query row's valid weights read as a distribution, p = w / Σ w (w
  itself for a normalized F; negative weights count as 0), in nats; the mean over the rows
  with Σ w > 0 (log n for a uniform row over n keys);
* **max weight**: the largest valid weight of each row, raw (an unnormalized F may exceed 1),
  the mean over the rows with a valid entry;
* **kurtosis** of the hidden states: for each token the Pearson kurtosis m₄/m₂² over the
  hidden dimension (3 for a Gaussian vector, 1 for ±1, large when a few features carry
  massive activations), reported as the maximum and the mean over tokens.

Linear attention forms no weight matrix: its weight statistics are NaN; kurtosis is reported.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import flax.linen as linen
import jax.numpy as jnp
from flax import struct

from attnx import core
from attnx.nn import spec as spec_lib
from attnx.nn.linear import LinearAttention
from attnx.nn.transformer import DecoderBlock, EncoderBlock

SINK_THRESHOLD = 0.3  # Gu et al. 2024's τ
SMALL_WEIGHT = 1e-3
HEAD_STATS = ("sink_rate", "zero_share", "small_share", "entropy", "max_weight")
HIDDEN_STATS = ("max_kurtosis", "mean_kurtosis")
_ATTENTION = tuple(spec_lib.ATTENTION_TYPES.values())
_BLOCKS = (EncoderBlock, DecoderBlock)


@struct.dataclass
class Probe:
  """One forward pass, seen from inside (a pytree: it can leave ``jax.jit``).

  Attributes:
    weights: per attention layer, in call order, ``[B..., N, T, S]`` (None: linear attention).
    valid: per attention layer, a boolean broadcastable to its weights: the entries the
      query may attend (causality and mask); None where ``weights`` is None.
    hidden: per transformer block, its output ``[B..., T, D]``.
    attention_names, block_names: the modules' paths (``"block_0/attention"``).
    heads: per attention layer, its number of (query) heads.
  """

  weights: tuple[Any, ...]
  valid: tuple[Any, ...]
  hidden: tuple[Any, ...]
  attention_names: tuple[str, ...] = struct.field(pytree_node=False)
  block_names: tuple[str, ...] = struct.field(pytree_node=False)
  heads: tuple[int, ...] = struct.field(pytree_node=False)


def has_weights(attention: Any) -> bool:
  """Whether an attention spec forms a weight matrix (every type but linear)."""
  return spec_lib.resolve_attention(attention)["type"] != "linear"


def dense_model(model: linen.Module) -> linen.Module:
  """``model`` with every attention on the dense kernel (``implementation=None``, which picks
  it when weights are asked for) and unsharded (``sequence_axis=None``): the weights are a
  whole-sequence matrix that blocked, Pallas and ring attention never form. The parameters
  are the same."""
  changes: dict[str, Any] = {}
  for field in ("implementation", "sequence_axis"):
    if getattr(model, field, None) is not None:
      changes[field] = None
  for field in ("attention", "cross_attention"):
    if getattr(model, field, None) is not None:
      spec = spec_lib.resolve_attention(getattr(model, field))
      for key in ("implementation", "sequence_axis"):
        spec.pop(key, None)
      changes[field] = spec
  return model.clone(**changes) if changes else model


def _path(module: linen.Module) -> str:
  return "/".join(str(p) for p in module.path)


def probe(model: linen.Module, params: Any, inputs: Any, *,
          extra_variables: Mapping[str, Any] | None = None, **kwargs: Any) -> Probe:
  """Weights, valid entries and block outputs of ``model.apply(variables, inputs, **kwargs)``.

  Every attention module (:data:`attnx.nn.spec.ATTENTION_TYPES`) is called with
  ``return_weights=True`` through a flax method interceptor, which also reads the mask it
  receives and its ``is_causal``; every :class:`~attnx.nn.EncoderBlock` /
  :class:`~attnx.nn.DecoderBlock` output is kept. The model runs as :func:`dense_model`; the
  outputs are unchanged. jit-able; ``params`` may also be a full variables dict.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from attnx import analysis, nn
    >>> model = nn.GPT(vocab_size=16, num_layers=2, num_heads=2, hidden_dim=16, mlp_dim=32,
    ...                max_len=8, attention="relu")
    >>> tokens = jnp.arange(16).reshape(2, 8)
    >>> params = model.init(jax.random.key(0), tokens)["params"]
    >>> p = analysis.probe(model, params, tokens)
    >>> p.attention_names, p.heads
    (('block_0/attention', 'block_1/attention'), (2, 2))
    >>> p.weights[0].shape, p.hidden[0].shape  # [B, N, T, S] and [B, T, D]
    ((2, 2, 8, 8), (2, 8, 16))
    >>> stats = analysis.statistics(model, params, tokens)
    >>> stats["entropy"].shape, stats["entropy_by_head"].shape  # [layers], [layers, N]
    ((2,), (2, 2))
  """
  variables = dict(params) if "params" in params else {"params": params}
  variables.update(extra_variables or {})
  weights, valid, names, heads, hidden, blocks = [], [], [], [], [], []

  def intercept(next_fun, args, kw, context):
    module = context.module
    if context.method_name != "__call__":
      return next_fun(*args, **kw)
    if isinstance(module, _BLOCKS):
      out = next_fun(*args, **kw)
      hidden.append(out)
      blocks.append(_path(module))
      return out
    if not isinstance(module, _ATTENTION):
      return next_fun(*args, **kw)
    names.append(_path(module))
    heads.append(int(module.num_heads))
    if isinstance(module, LinearAttention):
      weights.append(None)
      valid.append(None)
      return next_fun(*args, **kw)
    out, w = next_fun(*args, **{**kw, "return_weights": True})
    t, s = w.shape[-2:]
    ok = jnp.ones((t, s), bool)
    if module.is_causal:
      ok = jnp.tril(ok)  # query i attends key j ≤ i (top-left aligned, as core.attention)
    if kw.get("mask") is not None:
      ok = jnp.logical_and(ok, jnp.asarray(kw["mask"]).astype(bool))
    weights.append(w)
    valid.append(ok)
    return out

  with linen.intercept_methods(intercept):
    dense_model(model).apply(variables, inputs, **kwargs)
  return Probe(tuple(weights), tuple(valid), tuple(hidden), tuple(names), tuple(blocks),
               tuple(heads))


def _head_sums(weights: Any, valid: Any, threshold: float, small: float
               ) -> dict[str, tuple[Any, Any]]:
  """{statistic: (numerator [N], denominator [N])}: a head's value is their ratio, a layer's
  the ratio of their sums over heads (so a layer pools every head's entries)."""
  w = jnp.asarray(weights, jnp.float32)
  ok = jnp.broadcast_to(jnp.asarray(True if valid is None else valid, bool), w.shape)
  w = jnp.moveaxis(w, -3, 0).reshape(w.shape[-3], -1, *w.shape[-2:])  # [N, B, T, S]
  ok = jnp.moveaxis(ok, -3, 0).reshape(w.shape)
  entries = ok.sum((1, 2, 3)).astype(jnp.float32)
  count = lambda x: jnp.where(ok, x, False).sum((1, 2, 3)).astype(jnp.float32)
  sink = (w[..., 0].mean(-1) > threshold).astype(jnp.float32)  # [N, B]
  pos = jnp.where(ok, jnp.maximum(w, 0.0), 0.0)
  total = pos.sum(-1, keepdims=True)
  p = pos / jnp.where(total > 0, total, 1.0)
  row_h = -jnp.where(p > 0, p * jnp.log(jnp.where(p > 0, p, 1.0)), 0.0).sum(-1)  # [N, B, T]
  has_mass, has_key = total[..., 0] > 0, ok.any(-1)
  row_max = jnp.where(ok, w, -jnp.inf).max(-1)
  f32 = lambda x: x.sum((1, 2)).astype(jnp.float32)
  return {"sink_rate": (sink.sum(-1), jnp.full(sink.shape[:1], sink.shape[1], jnp.float32)),
          "zero_share": (count(w == 0), entries),
          "small_share": (count(w < small), entries),
          "entropy": (f32(jnp.where(has_mass, row_h, 0.0)), f32(has_mass)),
          "max_weight": (f32(jnp.where(has_key, row_max, 0.0)), f32(has_key))}


def attention_statistics(weights: Any, valid: Any = None, *, threshold: float = SINK_THRESHOLD,
                         small: float = SMALL_WEIGHT) -> dict[str, Any]:
  """Per head, over every leading (batch) axis: {statistic: [N]} of one layer's weights
  ``[B..., N, T, S]`` (jnp or numpy), for the statistics of :data:`HEAD_STATS` (module
  docstring). ``valid``: the entries a query may attend, broadcastable to the weights
  (default all; a causal layer's ``jnp.tril``). NaN where a head has nothing to average.

  Example:
    One causal head over three queries; the zeros above the diagonal are not valid entries,
    so they do not count as zero weights:

    >>> import jax.numpy as jnp
    >>> from attnx import analysis
    >>> w = jnp.array([[[[1.0, 0.0, 0.0], [0.5, 0.5, 0.0], [0.9, 0.05, 0.05]]]])  # [B, N, T, S]
    >>> stats = analysis.attention_statistics(w, jnp.tril(jnp.ones((3, 3), bool)))
    >>> {name: round(float(value[0]), 3) for name, value in stats.items()}
    {'sink_rate': 1.0, 'zero_share': 0.0, 'small_share': 0.0, 'entropy': 0.363, 'max_weight': 0.8}
  """
  return {k: n / d for k, (n, d) in _head_sums(weights, valid, threshold, small).items()}


def kurtosis(hidden: Any) -> Any:
  """Pearson kurtosis m₄/m₂² over the last (hidden) axis, per token: ``[..., D] -> [...]``.

  Example:
    >>> import jax.numpy as jnp, numpy as np
    >>> from attnx import analysis
    >>> h = jnp.array([[1.0, -1.0, 1.0, -1.0], [0.0, 0.0, 0.0, 4.0]])  # two tokens, D = 4
    >>> print(np.asarray(analysis.kurtosis(h)).round(3))  # ±1: 1; one large feature: more
    [1.    2.333]
  """
  h = jnp.asarray(hidden, jnp.float32)
  c = h - h.mean(-1, keepdims=True)
  m2 = (c ** 2).mean(-1)
  return (c ** 4).mean(-1) / jnp.maximum(m2 ** 2, 1e-30)


def hidden_statistics(hidden: Any) -> dict[str, Any]:
  """``max_kurtosis`` and ``mean_kurtosis`` over the tokens of a block output ``[..., D]``."""
  k = kurtosis(hidden)
  return {"max_kurtosis": k.max(), "mean_kurtosis": k.mean()}


def statistics(model: linen.Module, params: Any, inputs: Any, *,
               extra_variables: Mapping[str, Any] | None = None,
               threshold: float = SINK_THRESHOLD, small: float = SMALL_WEIGHT,
               **kwargs: Any) -> dict[str, Any]:
  """Every statistic of the module docstring for one model on ``inputs`` (jit-able):

  * ``<stat>_by_head`` [layers, N] and ``<stat>`` [layers] (every head's entries pooled; for
    the sink rate the mean over heads) for each of :data:`HEAD_STATS`, one row per attention
    layer in call order (NaN rows for linear attention);
  * ``max_kurtosis`` and ``mean_kurtosis`` [blocks]: per transformer block output.
  """
  pr = probe(model, params, inputs, extra_variables=extra_variables, **kwargs)
  out: dict[str, list] = {k: [] for s in HEAD_STATS for k in (s, f"{s}_by_head")}
  for w, ok, n in zip(pr.weights, pr.valid, pr.heads, strict=True):
    if w is None:
      sums = {s: (jnp.full((n,), jnp.nan), jnp.ones((n,))) for s in HEAD_STATS}
    else:
      sums = _head_sums(w, ok, threshold, small)
    for s, (num, den) in sums.items():
      out[f"{s}_by_head"].append(num / den)
      out[s].append(num.sum() / den.sum())
  stacked = {k: jnp.stack(v) if v else jnp.zeros((0,)) for k, v in out.items()}
  for k in HIDDEN_STATS:
    stacked[k] = jnp.stack([hidden_statistics(h)[k] for h in pr.hidden]) if pr.hidden else (
        jnp.zeros((0,)))
  return stacked


def attention_kernel(model: linen.Module, length: int, causal: bool = True) -> str:
  """The implementation :func:`attnx.core.attention` runs for ``model``'s self-attention over
  ``length`` tokens (evaluation: no dropout, no weights), as the dispatcher itself answers it
  (:func:`attnx.core.explain` on inputs of the model's head shape); "none (linear)" for
  linear attention, which has no [T, T] scores."""
  spec = spec_lib.resolve_attention(model.block_attention() if hasattr(model, "block_attention")
                                    else model.attention)
  if spec["type"] not in ("dot", "metric"):
    return "none (linear)"
  # attnx.nn's metric attention folds its L and τ into the features: a plain distance score.
  score = "neg_sq_dist" if spec["type"] == "metric" else spec.get("score", "scaled_dot")
  q = jnp.zeros((1, int(length), model.num_heads, model.hidden_dim // model.num_heads))
  return core.explain(q, q, q, weighting=spec.get("weighting", "softmax"), score=score,
                      is_causal=causal, implementation=spec.get("implementation")).chosen


__all__ = ["HEAD_STATS", "HIDDEN_STATS", "SINK_THRESHOLD", "SMALL_WEIGHT", "Probe",
           "attention_kernel", "attention_statistics", "dense_model", "has_weights",
           "hidden_statistics", "kurtosis", "probe", "statistics"]
