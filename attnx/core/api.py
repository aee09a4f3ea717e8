"""The attention API: `attention`, `attention_weights` and `explain` (the dispatcher).

Arguments are checked and turned into a problem by :mod:`attnx.core.problem`; this module
picks the implementation that runs it.

Same layout and mask/bias semantics as ``jax.nn.dot_product_attention``: ``q`` is
``[batch..., T, N, H]``, ``k`` and ``v`` are ``[batch..., S, K, H]`` with ``N`` a multiple of
``K`` (grouped-query attention), ``mask`` is boolean (True = attend) and ``bias`` additive, both
broadcastable to ``[batch..., N, T, S]``.

The implementations are objects (:mod:`attnx.core.implementations`, one module each), each
saying whether it can run a problem (``supports(problem)``: None or a reason):

* ``"pallas"`` — fused Pallas kernels (Triton on a GPU, Mosaic on a TPU);
* ``"blocked"`` — streams key tiles flash-style in XLA with O(T) memory and a recomputing
  custom VJP; it runs every :class:`~attnx.core.weightings.Pointwise` weighting and the
  whole-row weightings with a streaming family, with every score that is a dot product of
  transformed vectors (all built-in scores but ``additive``);
* ``"dense"`` — materializes the ``[N, T, S]`` weights; every weighting and score works.

:func:`attention` describes the call once as a :class:`~attnx.core.implementations.Problem`
(shapes, dtypes, flags: no array). An explicit ``implementation="name"`` runs that object or
raises a ValueError with its reason; ``implementation=None`` walks the list above in order and
takes the first implementation that supports the problem and does not decline it (blocked and
Pallas decline problems too small to pay off; Pallas also declines a CPU and combinations
whose one-time verification, :func:`~attnx.core.kernels.pallas.verify.verify_pallas`, failed).
:func:`explain` answers which one a call runs and why the others do not.

All obey one edge-case contract (:mod:`attnx.core.contract`): empty sequences, rows without a
valid key (a zero output where ``jax.nn`` averages all values), NaN/Inf inputs reaching exactly
the rows that attend them, weightings with an unbounded F', bf16/f16.

Dropout on the weights (``dropout_rate``/``dropout_rng``/``deterministic``/``broadcast_dropout``,
the arguments and RNG use of ``flax.linen.dot_product_attention``) and ``return_weights`` need
the weights, so they run the dense implementation. This is the one place attnx computes
"weights → dropout → values": :func:`~attnx.core.flax_attention_fn` and every ``attnx.nn``
module call :func:`attention`.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any

import jax
import jax.numpy as jnp

from attnx.core import implementations as impl_lib
from attnx.core import masks as masks_lib
from attnx.core import problem as problem_lib
from attnx.core import residuals as residuals_lib
from attnx.core.contract import nonfinite_inputs
from attnx.core.implementations import (
  BLOCKED_MIN_SCORES,
  ROW_BLOCKED_MIN_SCORES,
  Implementation,
  Problem,
  get_implementation,
  list_implementations,
  streams,
)
from attnx.core.implementations import split_kv as split_kv_lib
from attnx.core.implementations.dense import (
  causal_mask,
  combined_mask,
  dense_scores,
  repeat_kv,
  weights_with_sinks,
)
from attnx.core.problem import check_compatible, check_score_params

Array = jax.Array
IMPLEMENTATIONS = impl_lib.NAMES  # from the simplest; list_implementations(): dispatch order

__all__ = ["BLOCKED_MIN_SCORES", "IMPLEMENTATIONS", "ROW_BLOCKED_MIN_SCORES", "Explanation",
           "attention", "attention_weights", "causal_mask", "check_compatible",
           "check_score_params", "explain", "get_implementation", "list_implementations",
           "streams"]


def attention_weights(query: Array, key: Array, bias: Array | None = None,
                      mask: Array | None = None, *, weighting: Any = "softmax",
                      score: Any = "scaled_dot", is_causal: bool = False,
                      scale: float | None = None,
                      score_params: dict[str, Any] | None = None,
                      query_seq_lengths: Array | None = None,
                      key_value_seq_lengths: Array | None = None,
                      local_window_size: int | tuple[int, int] | None = None,
                      segment_ids: Any = None, logits_soft_cap: float | None = None,
                      score_mod: Any = None, score_mod_params: Any = None,
                      sinks: Array | None = None) -> Array:
  """The attention weights w [batch..., N, T, S] (float32) of :func:`attention`.

  Always dense: it materializes the T×S weights. Arguments as in :func:`attention` (``mask``
  a boolean array or a structured mask of :mod:`attnx.core.masks`).

  Example:
    Equal keys get equal weights; causal rows see keys up to their own position:

    >>> import jax.numpy as jnp, numpy as np
    >>> from attnx import core
    >>> q = k = jnp.ones((1, 3, 1, 2))  # [batch, T, N, H]
    >>> w = core.attention_weights(q, k, is_causal=True)  # [batch, N, T, S]
    >>> print(np.asarray(w[0, 0]).round(3))
    [[1.    0.    0.   ]
     [0.5   0.5   0.   ]
     [0.333 0.333 0.333]]
  """
  scores, valid, w, sinks = scores_and_valid(**locals())
  if scores.size == 0:
    return scores
  return weights_with_sinks(scores, w, valid, sinks)


def scores_and_valid(query: Array, key: Array, bias: Array | None = None,
                     mask: Array | None = None, **kwargs: Any
                     ) -> tuple[Array, Array | None, Any, Any]:
  """(scores [batch..., N, T, S] float32, the valid mask broadcastable to them or None, the
  resolved weighting, the checked sinks) for :func:`attention_weights`' arguments
  (``kwargs``: its keywords; an unknown one raises TypeError): the dense scores every dense
  path of :mod:`attnx.core` forms (zeros of that shape when T or S is 0)."""
  a = inspect.signature(attention_weights).bind(query, key, bias, mask, **kwargs)
  a.apply_defaults()
  o = a.arguments
  q, k = jnp.asarray(query), jnp.asarray(key)
  q, k, _, bias, mask, w, sc, params, scale, structured = problem_lib.prepare(
      q, k, k, bias, mask, o["weighting"], o["score"], o["scale"], o["score_params"],
      {n: o[n] for n in ("query_seq_lengths", "key_value_seq_lengths", "local_window_size",
                         "segment_ids")})
  (t, n), s = q.shape[-3:-1], k.shape[-3]
  mask = masks_lib.combine(mask, structured, q.shape[:-3], n, t, s)
  mod = problem_lib.score_modification(o["logits_soft_cap"], o["score_mod"],
                                       o["score_mod_params"], q)
  sinks = problem_lib.check_sinks(o["sinks"], w, n, q.dtype)
  if q.size == 0 or s == 0:
    return jnp.zeros((*q.shape[:-3], n, t, s), jnp.float32), None, w, sinks
  q, k, _, bias = nonfinite_inputs(q, k, None, bias)
  scores = dense_scores(q, repeat_kv(k, n), bias, sc, params, scale, mod)
  return scores, combined_mask(mask, o["is_causal"], t, s), w, sinks


def _walk(problem: Problem, order: tuple[Implementation, ...]) -> tuple[Implementation,
                                                                        dict[str, str]]:
  """The automatic choice: the first implementation in ``order`` (the dispatch order) that
  supports ``problem`` and does not decline it; also why it passed over the ones before it
  that could run it."""
  declined = {}
  for impl in order:
    if impl.supports(problem) is None:
      why = impl.declines(problem)
      if why is None:
        return impl, declined
      declined[impl.name] = why
  raise AssertionError(f"no implementation runs {problem}")  # dense runs every problem


def _select(problem: Problem,
            chosen: Implementation | tuple[Implementation, ...]) -> Implementation:
  """The implementation :func:`attention` runs: the explicit one (ValueError with its reason
  when it cannot run ``problem``) or the automatic choice over an order."""
  if isinstance(chosen, tuple):
    return _walk(problem, chosen)[0]
  reason = chosen.supports(problem)
  if reason is not None:
    raise ValueError(reason)
  return chosen


@dataclasses.dataclass(frozen=True)
class Explanation:
  """Which implementation :func:`attention` runs for one call, and why the others do not.

  ``str()`` gives one line per implementation.

  Attributes:
    problem: the static description the implementations judged.
    chosen: the implementation :func:`attention` runs; None when the explicit
      ``implementation`` cannot run the problem (:func:`attention` raises
      ``ValueError(reasons[implementation])``).
    reasons: for every implementation, in dispatch order (:func:`list_implementations`):
      None if it can run the problem, else why not.
    declined: with ``implementation=None``: the implementations before ``chosen`` that could
      run the problem but were passed over, with why (too small to pay off, a CPU, a failed
      Pallas verification). Empty for an explicit implementation.
    mask_tiles: with a structured mask (:mod:`attnx.core.masks`), how the chosen
      implementation's kernel meets it — ``{"tiles": (bq, bk), "skipped": ..., "unmasked":
      ..., "masked": ...}`` tile counts — or None (no structured mask, a kernel that reads it
      materialized, or ids/lengths being traced).
  """

  problem: Problem
  chosen: str | None
  reasons: dict[str, str | None]
  declined: dict[str, str]
  mask_tiles: dict[str, Any] | None = None

  def __str__(self) -> str:
    lines = []
    for name, reason in self.reasons.items():
      if name == self.chosen:
        status = "runs this call"
      elif reason is not None:
        status = f"cannot run it: {reason}"
      elif name in self.declined:
        status = f"passed over: {self.declined[name]}"
      else:
        status = "can run it (not chosen)"
      lines.append(f"{name}: {status}")
    if self.mask_tiles:
      m = self.mask_tiles
      total = m["skipped"] + m["unmasked"] + m["masked"]
      lines.append(f"{self.chosen} skips {m['skipped']} of {total} tiles of "
                   f"{m['tiles'][0]}x{m['tiles'][1]} under the structured mask; "
                   f"{m['unmasked']} run without the elementwise mask, {m['masked']} with it")
    return "\n".join(lines)


def explain(query: Array, key: Array, value: Array, bias: Array | None = None,
            mask: Array | None = None, *, implementation: str | Implementation | None = None,
            block_q: int | None = None, block_k: int | None = None, interpret: bool = False,
            **kwargs: Any) -> Explanation:
  """Which implementation ``attention(query, key, value, bias, mask, **kwargs)`` runs, and why
  each other one cannot run it or was passed over, without running it.

  Takes exactly the arguments of :func:`attention` and raises the same ValueError for bad
  input (shapes, dtypes, unknown names); an implementation that cannot run the call is not an
  error here but a reason. With ``implementation=None`` on a GPU/TPU this may run the one-time
  Pallas verification (:func:`~attnx.core.kernels.pallas.verify.verify_pallas`), as the call
  itself would.

  Example:
    >>> import jax.numpy as jnp
    >>> from attnx import core
    >>> q = k = v = jnp.ones((1, 16, 2, 8))
    >>> print(core.explain(q, k, v))
    pallas: ...
    blocked: passed over: T·S = 16·16 = 256 scores per head is below BLOCKED_MIN_SCORES =
    262144, where dense is faster
    dense: runs this call
    >>> core.explain(q, k, v, implementation="blocked", return_weights=True).chosen is None
    True
    >>> core.explain(q, k, v, implementation=core.Blocked(block_q=8)).chosen
    'blocked'
  """
  settings = impl_lib.legacy_settings("explain", block_q=block_q, block_k=block_k,
                                      interpret=interpret)
  chosen = impl_lib.configure(implementation, settings, "explain")
  problem, inputs = problem_lib.plan(query, key, value, bias, mask, **kwargs)
  order = chosen if isinstance(chosen, tuple) else tuple(
      chosen if impl.name == chosen.name else impl for impl in impl_lib.dispatch_order())
  reasons = {impl.name: impl.supports(problem) for impl in order}
  if isinstance(chosen, tuple):
    impl, declined = _walk(problem, chosen)
  else:
    impl, declined = (chosen if reasons[chosen.name] is None else None), {}
  tiles = None if impl is None or problem.empty else impl.mask_tiles(problem, inputs)
  return Explanation(problem, None if impl is None else impl.name, reasons, declined, tiles)


def attention(query: Array, key: Array, value: Array, bias: Array | None = None,
              mask: Array | None = None, *, weighting: Any = "softmax",
              score: Any = "scaled_dot", is_causal: bool = False, scale: float | None = None,
              implementation: str | Implementation | None = None,
              score_params: dict[str, Any] | None = None,
              block_q: int | None = None, block_k: int | None = None,
              dropout_rate: float = 0.0, dropout_rng: Array | None = None,
              deterministic: bool = False, broadcast_dropout: bool = True,
              return_weights: bool = False, interpret: bool = False,
              weighting_params: dict[str, Any] | None = None,
              query_seq_lengths: Array | None = None,
              key_value_seq_lengths: Array | None = None,
              local_window_size: int | tuple[int, int] | None = None,
              segment_ids: Any = None, logits_soft_cap: float | None = None,
              score_mod: Any = None, score_mod_params: Any = None,
              sinks: Array | None = None, return_residual: bool = False,
              normalize_output: bool = True) -> Array | tuple[Array, Any]:
  """Attention with a pluggable score s and weighting F, optional dropout on the weights.

  Args:
    query: ``[batch..., T, N, H]``.
    key: ``[batch..., S, K, H]``; ``N`` must be a multiple of ``K`` (GQA).
    value: ``[batch..., S, K, Hv]``.
    bias: optional additive score bias broadcastable to ``[batch..., N, T, S]``.
    mask: optional boolean mask broadcastable to ``[batch..., N, T, S]``; True = attend. Or a
      structured mask of :mod:`attnx.core.masks` (``masks.sliding_window(128, 0)``,
      ``masks.segment_ids(ids)``, ``masks.from_fn(mask_mod)``, combined with ``&``/``|``).
    weighting: F — a name from ``list_weightings()``, ``"name:k=v"`` (``"power:p=3"``,
      ``"entmax:alpha=1.5"``), a Weighting, or a callable F(z) (sum-normalized).
    score: s — a name from ``list_scores()``, ``"cosine:temperature=0.1"``, or a callable
      ``(q, k) -> [batch..., N, T, S]``.
    is_causal: query i attends keys j ≤ i (top-left aligned, as in jax.nn).
    scale: multiplies the score; default 1/√H for ``scaled_dot`` and 1 for the others.
    implementation: an implementation object with its kernel settings — ``core.Dense()``,
      ``core.Blocked(block_q=..., block_k=...)`` (flash-style in XLA, O(T) memory),
      ``core.Pallas(block_q=..., block_k=..., interpret=...)`` (fused Pallas kernels: Triton
      on GPU, Mosaic on TPU; :mod:`attnx.core.kernels.pallas`) — or its name (``"dense"``,
      ``"blocked"``, ``"pallas"``: the defaults), or None: the first of
      ``list_implementations()`` (pallas, blocked, dense) that supports the call and does not
      decline it — dense for small problems; for large streamable ones the blocked kernel, or
      on a GPU/TPU the Pallas kernel once its one-time verification against blocked passed
      for that (backend, weighting, dtype, head size)
      (:func:`~attnx.core.kernels.pallas.verify.verify_pallas`: run eagerly on inputs of its
      own, also when this call is being traced; one warning and blocked if it fails). An
      explicit implementation runs or raises a ValueError saying why it cannot (an explicit
      Pallas never falls back). :func:`explain` shows the choice and the reasons.
    score_params: arrays for parametrized scores: ``bilinear`` (W), ``metric`` (L),
      ``additive`` (Wq, Wk, v); scalars for ``cosine`` (temperature).
    block_q, block_k: deprecated (removed in the next release; a DeprecationWarning): the tile
      caps, now ``core.Blocked(block_q=...)`` / ``core.Pallas(block_q=...)``. With a name or
      None they apply to the implementations that have tiles.
    dropout_rate: dropout on the weights, in [0, 1) (a Python number): each weight is kept
      with probability 1 − rate and rescaled by 1/(1 − rate).
    dropout_rng: the PRNG key of that dropout; required when dropout applies.
    deterministic: turns dropout off (evaluation). The argument convention is flax's
      ``dot_product_attention`` (default False: ``dropout_rate > 0`` alone means dropout, so
      a forgotten key raises instead of silently skipping dropout), and so is the RNG use:
      with ``weighting="softmax"`` and the same key the output equals flax's.
    broadcast_dropout: one [T, S] dropout mask shared by the batch and head dims (as flax);
      False draws one mask per weight.
    return_weights: also return the weights ``[batch..., N, T, S]`` (float32), as
      :func:`attention_weights` gives them: before dropout.
    interpret: deprecated (removed in the next release; a DeprecationWarning): now
      ``core.Pallas(interpret=True)``, Pallas' interpreter (the only way on a CPU: for tests;
      slow).
    weighting_params: arrays for the parameters the weighting declares learnable
      (``get_weighting(w).learnable``), which then get gradients: ``{"s": s}`` for ``ssmax``
      (a scalar or one value per query head, shape ``[N]``; Nakanishi 2025 learn s per head).
      Every implementation that runs the weighting takes them.
    query_seq_lengths, key_value_seq_lengths: int ``[batch...]``: ``jax.nn``'s padding
      lengths (query i < Lq_b, key j < Lkv_b); :func:`attnx.core.masks.seq_lengths`.
    local_window_size: ``jax.nn``'s window: query i attends keys i − left ≤ j ≤ i + right for
      ``(left, right)``, an int w meaning ``(w, w)``; :func:`attnx.core.masks.sliding_window`.
    segment_ids: packed documents: int ``[batch..., T]`` (self-attention) or a pair
      ``(q_ids [batch..., T], kv_ids [batch..., S])``; a pair attends where the ids are equal
      and not negative (a negative id is padding); :func:`attnx.core.masks.segment_ids`.
      These keywords, ``mask``, ``bias`` and ``is_causal`` combine (a pair must pass all).
    logits_soft_cap: c > 0: each score becomes c·tanh(s/c) before the bias and F (Gemma 2;
      tokamax's and splash attention's name), for every F.
    score_mod: FlexAttention's hook, ``fn(score, b, h, q_idx, kv_idx, params) -> score``,
      applied after the cap and the bias, before F, on broadcasting arrays (``b`` the flat
      batch index, ``h`` the query head, ``q_idx``/``kv_idx`` global positions); or a
      :class:`~attnx.core.score_mods.ScoreMod` such as ``core.alibi(core.alibi_slopes(N))``
      (:mod:`attnx.core.score_mods`). Evaluated per tile by the streaming kernels (never a
      T×S array); it must return scores of the shape and dtype it is given.
    score_mod_params: the pytree of float arrays ``score_mod`` reads (ALiBi slopes, a
      relative-position table); they get gradients.
    sinks: attention sinks, a float array ``[N]`` (learnable: it gets a gradient): every query
      of head h also attends a virtual key of score ``sinks[h]`` and zero value (gpt-oss), so
      the row's weights share their sum with it (softmax: e^{sink} joins the denominator). F
      sees it as a key of the row; the cap, the bias and ``score_mod`` do not apply to it,
      and SSMax counts it. For the weightings that divide by a sum over the row's keys
      (pointwise F with ``normalization="sum"``, SSMax, softpick, sparsemax, α-entmax); a
      ValueError for the others.
    return_residual: also return the row state that merges attention over disjoint key
      chunks (:func:`attnx.core.merge_attention`): for softmax the log-sum-exp
      ``[batch..., T, N]``, as ``jax.nn.dot_product_attention(..., return_residual=True)``;
      for the other weightings what :mod:`attnx.core.residuals` documents (a log normalizer,
      stick-breaking's log survival, entmax's threshold). Differentiable. Runs on the
      dense, split-KV, blocked and Pallas implementations (and ``ring_attention``).
    normalize_output: False returns the numerator Σ_j F_ij v_j (float32) instead of the
      output (tokamax's flag), which is the output times the residual's normalizer
      (:func:`attnx.core.residuals.unnormalize`); for softmax in float32 it overflows where
      the log-sum-exp passes ~88: merge normalized outputs with their residuals instead.

  Dropout and ``return_weights`` need the weights themselves, so they run the dense
  implementation (``implementation=None`` picks it); ``implementation="blocked"``, which never
  forms them, raises a ValueError with either.

  Returns:
    ``[batch..., T, N, Hv]`` in the query's dtype (math is float32 for bf16/f16 inputs), or
    ``(output, weights)`` with ``return_weights``, ``(output, residual)`` with
    ``return_residual``.

  Edge cases (the same in every implementation; :mod:`attnx.core.contract`):

  * T = 0 gives an empty output, S = 0 a zero output; gradients are zero.
  * A row with no valid key (fully masked, or every F(s) = 0) gives zeros with zero gradients.
  * Masked keys are never touched: NaN/Inf in a masked key, value or bias entry changes nothing
    (no output, no gradient but its own, which is 0).
  * NaN/Inf inputs: output row i is all NaN iff it has a valid key and q_i, or k_j, v_j or
    bias_ij (NaN or +Inf) of a valid key j, is non-finite — as in ``jax.nn``. A bias of −Inf
    is a score of −Inf (weight F(−∞) = 0 for every built-in F but ``taylor_exp``). A NaN row's
    gradients reach only its dq and the keys it attends.
  * Finite inputs give finite outputs and gradients for every built-in weighting (scores up
    to ~1e4); ``power:p<1`` uses F(s) = F'(s) = 0 for s < 2⁻¹²⁶, where F' is unbounded.
  * Parameters are validated when the weighting/score is parsed: ``"power:p=abc"`` or
    ``"cosine:temperature=0"`` raise a ValueError naming the parameter and its range.
  * The returned weights follow the same contract (empty: an empty ``[..., N, T, S]``; zero
    rows for rows without a valid key; where the output is NaN, NaN at the row's valid keys
    and 0 at its masked ones), and dropout keeps it: a dropped weight of a NaN row is still
    NaN, a zero row stays zero.
  * Under ``jax.debug_infs(True)`` / ``jax.debug_nans(True)`` finite inputs raise nothing
    (dense, blocked; masks use the dtype's finite minimum, as ``jax.nn``).

  Exporting (``jax.export``) with a symbolic batch: the batch dims ``[batch...]`` (of q, k,
  v and of a mask/bias that has them) may be symbolic, forward and gradient, for
  ``"dense"``, ``"blocked"``, None and ``core.Pallas(interpret=True)``. T, S, N, K, H
  and Hv must be static for ``"blocked"`` and ``"pallas"`` (dense takes them symbolic too,
  and None then runs it). The compiled Pallas kernels take no symbolic batch (JAX's Pallas
  lowerings need a static grid): ``"pallas"`` raises a ValueError and None runs blocked.

  Raises:
    ValueError: bad shapes or dtypes, a tile size below 1 (when the object is made), an
      unknown or incompatible weighting/score/implementation, ``dropout_rate`` outside
      [0, 1), dropout without ``dropout_rng``, or an explicit implementation that cannot run
      the call (e.g. dropout / ``return_weights`` with ``implementation="blocked"``; the
      message is that implementation's ``supports`` reason).

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from attnx import core
    >>> kq, kk, kv = jax.random.split(jax.random.key(0), 3)
    >>> q = jax.random.normal(kq, (2, 5, 4, 8))   # [batch, T, N, H]
    >>> k = jax.random.normal(kk, (2, 7, 2, 8))   # [batch, S, K, H]: 2 kv heads (GQA)
    >>> v = jax.random.normal(kv, (2, 7, 2, 16))  # [batch, S, K, Hv]
    >>> core.attention(q, k, v).shape
    (2, 5, 4, 16)
    >>> out, w = core.attention(q, k, v, weighting="sparsemax", return_weights=True)
    >>> w.shape, bool(jnp.allclose(w.sum(-1), 1.0)), bool((w == 0).any())
    ((2, 4, 5, 7), True, True)
    >>> core.attention(q, k, v, weighting="relu", score="cosine:temperature=0.1",
    ...                is_causal=True).shape
    (2, 5, 4, 16)
    >>> fast = core.attention(q, k, v, implementation=core.Blocked(block_q=8, block_k=8))
    >>> bool(jnp.allclose(fast, core.attention(q, k, v), atol=1e-5))
    True
  """
  settings = impl_lib.legacy_settings("attention", block_q=block_q, block_k=block_k,
                                      interpret=interpret)
  chosen = impl_lib.configure(implementation, settings, "attention")
  problem, inputs = problem_lib.plan(
      query, key, value, bias, mask, weighting=weighting, score=score, is_causal=is_causal,
      scale=scale, score_params=score_params, dropout_rate=dropout_rate,
      dropout_rng=dropout_rng, deterministic=deterministic,
      broadcast_dropout=broadcast_dropout, return_weights=return_weights,
      weighting_params=weighting_params, query_seq_lengths=query_seq_lengths,
      key_value_seq_lengths=key_value_seq_lengths, local_window_size=local_window_size,
      segment_ids=segment_ids, logits_soft_cap=logits_soft_cap, score_mod=score_mod,
      score_mod_params=score_mod_params, sinks=sinks, return_residual=return_residual,
      normalize_output=normalize_output)
  impl = _select(problem, chosen)
  if problem.empty:  # no query, or no key: every row has no valid key
    p = problem
    dtype = p.dtype if p.normalize_output else jnp.promote_types(p.dtype, jnp.float32)
    out = jnp.zeros((*p.batch, p.t, p.num_heads, p.value_head_dim), dtype)
    if p.return_residual:
      if inputs.sinks is not None and p.t:  # the sink is the rows' one key
        return split_kv_lib.sink_only_rows(p, inputs)
      return out, residuals_lib.empty_residual(p.weighting, (*p.batch, p.t, p.num_heads))
    return ((out, jnp.zeros((*p.batch, p.num_heads, p.t, p.s), jnp.float32))
            if p.return_weights else out)
  return impl(problem, inputs)
