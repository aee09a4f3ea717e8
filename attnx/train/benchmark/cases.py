"""The cases of an attention benchmark: shapes, weightings, structured masks, FLOPs, inputs.

A case is a dict (``shape`` (B, T, N, H) with S = T, ``impl``, ``weighting``, ``mode``, and
optionally ``score``, ``causal``, ``mask``); a benchmark lists its cases from its config with
these helpers and :mod:`attnx.train.benchmark.runner` measures them into rows. A masked case
(``mask`` in :data:`MASKS`) is causal attention under a structured mask of
``attnx.core.masks``: a causal ``window`` of the last keys up to the query, or ``documents``
packed documents of equal length (segment ids) — or the window as a dense boolean array
(``dense_window``); its time is counted per attended pair (:func:`attended_pairs`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from attnx.core import weightings as wlib
from attnx.train.config import check_choices, split_list

MODES = ("fwd", "fwd+bwd")  # the forward pass; the gradient of sum(out) w.r.t. q, k, v
# A causal window of keys (a structured mask: ``local_window_size``), packed documents (segment
# ids), and the same window as a dense [T, S] boolean ``mask`` (what such a mask cost before
# structured masks: no tile is skipped).
MASKS = ("window", "documents", "dense_window")

Shape = tuple[int, int, int, int]


def parse_shapes(value: Any, key: str = "shapes") -> list[Shape]:
  """Benchmark shapes 'BxTxNxH,...' (or a sequence of such strings) as (B, T, N, H) tuples; a
  ValueError names the key and the bad item."""
  out = []
  for item in split_list(value):
    try:
      b, t, n, h = (int(x) for x in item.lower().split("x"))
    except ValueError:
      raise ValueError(f"config.{key}: bad shape {item!r}; expected 'BxTxNxH'") from None
    out.append((b, t, n, h))
  return out


def shape_label(shape: Sequence[int]) -> str:
  """A row's ``shape`` cell: (1, 4096, 4, 64) -> "1x4096x4x64"."""
  return "x".join(map(str, shape))


def seq_len(label: str) -> int:
  """T of a row's ``shape`` cell: "1x4096x4x64" -> 4096."""
  return int(label.split("x")[1])


def pointwise_names(value: Any) -> list[str]:
  """The weightings listed in ``value``; none listed = every registered pointwise weighting."""
  return split_list(value) or wlib.list_weightings("pointwise")


def case_weighting(name: str, head_dim: int) -> tuple[str, str]:
  """(weighting, score) of a case: distance kernels run on score neg_sq_dist.

  A distance kernel reads the score as −‖q − k‖² (``core.check_compatible``). With no bandwidth
  given, h = √(2H), the typical distance between two N(0, I_H) vectors, so that a
  compactly supported kernel sees about half of the keys instead of none.
  """
  w = wlib.get_weighting(name)
  if not getattr(w, "distance_kernel", False):  # whole-row weightings run on scaled_dot
    return name, "scaled_dot"
  if "h" not in wlib.parse_weighting_name(name)[1]:
    sep = "," if ":" in name else ":"
    name = f"{name}{sep}h={np.sqrt(2.0 * head_dim):.3g}"
  return name, "neg_sq_dist"


def case(shape: Shape, impl: str, name: str, mode: str, **cells: Any) -> dict[str, Any]:
  """A case of weighting ``name`` on its score (:func:`case_weighting`): ``shape``, ``impl``,
  ``weighting``, ``score``, ``mode`` and ``cells`` (e.g. ``causal``, ``mask``)."""
  weighting, score = case_weighting(name, shape[3])
  return dict(shape=shape, impl=impl, weighting=weighting, score=score, mode=mode, **cells)


def check_weightings(config: Any, *, pointwise: Sequence[str] = (), rows: Sequence[str] = (),
                     streaming: Sequence[str] = ()) -> None:
  """Raises ValueError naming the config key of a weighting listed under ``pointwise`` keys
  that is not pointwise, under ``rows`` keys that is not a whole-row weighting with a
  streaming form (the blocked and Pallas kernels), or under ``streaming`` keys that has no
  streaming form (either kind); an unknown name fails in ``get_weighting``."""
  for key in (*pointwise, *rows, *streaming):
    for name in split_list(config[key]):
      w = wlib.get_weighting(name)
      if key in pointwise and not isinstance(w, wlib.Pointwise):
        raise ValueError(f"config.{key}: {name!r} is not a pointwise weighting (whole-row "
                         "weightings go into config.row_weightings)")
      row = isinstance(w, wlib.RowNormalizer) and w.stream is not None
      if key in rows and not row:
        raise ValueError(f"config.{key}: {name!r} is not a streaming whole-row weighting")
      if key in streaming and not (row or isinstance(w, wlib.Pointwise)):
        raise ValueError(f"config.{key}: {name!r} has no streaming kernel")


def check_masks(config: Any, shapes: Sequence[Shape], valid: Sequence[str] = MASKS) -> None:
  """Raises ValueError for an entry of ``config.masks`` not in ``valid``, or, where one is
  listed, a ``config.mask_window`` below 1 or a ``config.mask_documents`` that does not divide
  every T of ``shapes``."""
  masks = split_list(config.masks)
  check_choices(config, "masks", masks, valid)
  if "documents" in masks:
    docs = int(config.mask_documents)
    bad = [t for _, t, _, _ in shapes if docs < 1 or t % docs]
    if bad:
      raise ValueError(f"config.mask_documents = {docs} must divide every T; it does not "
                       f"divide {bad}")
  if {"window", "dense_window"} & set(masks) and int(config.mask_window) < 1:
    raise ValueError(f"config.mask_window must be >= 1, got {config.mask_window}")


def mask_sizes(mask: str, window: int, documents: int) -> dict[str, int | None]:
  """The sizes of a masked row named ``mask`` (:data:`MASKS`, or anything else: none), as
  keywords of :func:`attended_pairs` and :func:`valid_pairs`: ``window`` for "window" and
  "dense_window", ``documents`` for "documents"."""
  return dict(window=int(window) if mask in ("window", "dense_window") else None,
              documents=int(documents) if mask == "documents" else None)


def mask_keywords(mask: str, t: int, window: int, documents: int) -> dict[str, Any]:
  """``attnx.core.attention``'s keywords of a masked row named ``mask`` (with
  ``is_causal=True``) of length ``t``: a causal window of ``window`` keys
  (``local_window_size=(window − 1, 0)``, or for "dense_window" a [T, S] boolean ``mask``), or
  ``documents`` packed documents of equal length (``segment_ids`` [1, T]); none for another
  name. The pairs they attend are :func:`attended_pairs`'."""
  sizes = mask_sizes(mask, window, documents)
  if mask == "dense_window":
    i = jnp.arange(t)
    return dict(mask=i[None, :] >= i[:, None] - (sizes["window"] - 1))
  if sizes["window"] is not None:
    return dict(local_window_size=(sizes["window"] - 1, 0))
  if sizes["documents"] is not None:
    docs = sizes["documents"]
    return dict(segment_ids=jnp.repeat(jnp.arange(docs, dtype=jnp.int32), t // docs)[None])
  return {}


def attended_pairs(t: int, causal: bool = True, window: int | None = None,
                   documents: int | None = None) -> int:
  """The (query, key) pairs a row of T positions attends, the unit of the masked rows' time
  per pair: T² (full), T(T+1)/2 (causal), and for causal attention the pairs within a
  ``window`` of the last keys up to the query, or within each of ``documents`` packed
  documents of equal length."""
  if window is not None:
    w = min(window, t)
    return w * (w + 1) // 2 + (t - w) * w
  if documents is not None:
    n = t // documents
    return documents * n * (n + 1) // 2
  return t * (t + 1) // 2 if causal else t * t


def pair_counter(window: int, documents: int,
                 batch: bool = False) -> Callable[[Mapping[str, Any]], int]:
  """(row fields) -> the pairs a row of length ``T`` with ``causal`` and ``mask`` attends
  (:func:`attended_pairs`; a masked row is causal), with ``batch`` times the B of its ``shape``
  "BxTxNxH" (to compare rows of different shapes): the ``per`` of a time-per-pair ratio
  (:class:`attnx.train.benchmark.ratios.Ratio`)."""
  def pairs(f: Mapping[str, Any]) -> int:
    n = attended_pairs(f["T"], bool(f.get("causal")) or bool(f.get("mask")),
                       **mask_sizes(f.get("mask") or "", window, documents))
    return int(f["shape"].split("x")[0]) * n if batch else n
  return pairs


def valid_pairs(nq: int, s: int, causal: bool, window: int | None = None,
                documents: int | None = None) -> np.ndarray | None:
  """The [nq, S] pairs the first ``nq`` queries attend, written out from the masks'
  definitions (None: every pair, non-causal) — what a float64 reference masks."""
  if not causal:
    return None
  i, j = np.arange(nq)[:, None], np.arange(s)[None, :]
  valid = j <= i
  if window is not None:
    valid &= j >= i - (int(window) - 1)
  if documents is not None:
    length = s // int(documents)
    valid &= (i // length) == (j // length)
  return valid


def flops(shape: Shape, mode: str, pairs: float | None = None, *, causal: bool = False,
          backward: float = 2.5) -> float:
  """FLOPs of the scores a case needs: 4·B·N·pairs·H, pairs T² (T²/2 causal) unless given (a
  masked row's attended pairs); ``backward`` × that for fwd+bwd (2.5: the gradient of q, k
  and v by autodiff; FlashAttention-2's convention counts 3.5)."""
  if mode not in MODES:
    raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
  b, t, n, h = shape
  pairs = t * t * (0.5 if causal else 1.0) if pairs is None else pairs
  return 4.0 * b * n * pairs * h * (backward if mode == "fwd+bwd" else 1.0)


def inputs(shape: Shape, dtype: Any, seed: int) -> tuple[jax.Array, jax.Array, jax.Array]:
  """(q, k, v): standard normal [B, T, N, H] arrays of ``dtype`` from ``seed``."""
  ks = jax.random.split(jax.random.PRNGKey(int(seed)), 3)
  return tuple(jax.random.normal(kk, shape, jnp.dtype(dtype)) for kk in ks)
