"""Streaming states of the weightings: one definition per family, shared by kernels.

A streaming kernel never holds a whole row of scores. It visits a row's keys tile by tile and
keeps, per query row, a small state; this package says what that state is for each family of
whole-row weighting (see ``docs/references.md``), as pure functions on one tile:

* ``init(rows, hv)``: the state of a row that has seen no key;
* ``update(state, z, valid, v, ctx)``: the state after one more key tile (z the [rows, keys]
  float32 scores, ``valid`` the boolean tile, v the [keys, Hv] values); ``reverse`` families
  (stick-breaking) must be fed the keys from the last one backwards;
* ``merge(a, b)``: the state of two disjoint key ranges of the same rows (split-K, ring
  attention); for ``reverse`` families ``a`` holds the later keys;
* ``finalize(state, ctx)``: (output rows, the row statistics the backward needs);
* ``tile_grad(...)``: the backward of one tile from the saved statistics: the weights (for dV),
  dz (the cotangent of the scores) and the family's per-row carries.

``ctx`` holds per-row constants that depend on the whole row but not on the values: the scale
c_i = s·log n_i of SSMax (:func:`row_scale`), the threshold τ_i of sparsemax/entmax (found by
:func:`entmax_threshold`, a few passes over the key tiles before the output pass).

Each family is a :class:`Family` object in its own module, its functions and its traits
(:mod:`.ssmax`, :mod:`.softpick`, :mod:`.stick_breaking`, :mod:`.entmax`; SSMax and softpick
share :mod:`.running_max`). A :class:`RowStream` names its family and answers the traits from
it, and the module-level :func:`init`, :func:`update`, :func:`merge`, :func:`finalize` and
:func:`tile_grad` of a stream call its family's (:mod:`.rowstream`).

Masked keys (``valid`` False, or a score of −∞) contribute nothing: no weight, no
denominator, no stick. NaN scores at valid keys make the row NaN, as in the dense weightings.

A pointwise F streams with the rules of :mod:`.pointwise` (the online max, or acc += F·V with a
sum, count or nothing beside it). :class:`Ops` (:mod:`.ops`) spells what differs between kernel
languages: the primitives Triton and Mosaic lack, base-2 exponents, where Σ F accumulates and
the layout of the row statistics, so that every backend runs the same tile math.
"""

from attnx.core.streaming.chunks import fold, pointwise_sink, row_sink
from attnx.core.streaming.entmax import (
    MAX_THRESHOLD_PASSES,
    MAX_THRESHOLD_PASSES_F64,
    EntmaxState,
    Threshold,
    entmax_powers,
    entmax_threshold,
    entmax_tile_max,
    entmax_x,
    entmax_zero_tile,
    entmax_zero_tiles,
    max_threshold_passes,
    threshold_sums_fold,
)
from attnx.core.streaming.family import Family, GradCarry
from attnx.core.streaming.ops import F32, LOG2E, XLA, Array, Ops, pv
from attnx.core.streaming.pointwise import (
    online_max_bound,
    online_max_shifted,
    online_max_start,
    online_max_update,
    pointwise_empty,
    pointwise_finalize,
    pointwise_grad_rows,
    pointwise_merge,
    pointwise_tile_grad,
    pointwise_update,
)
from attnx.core.streaming.rowstream import (
    FAMILIES,
    RowStream,
    finalize,
    get_family,
    init,
    merge,
    residual_delta,
    tile_grad,
    update,
)
from attnx.core.streaming.running_max import MaxState
from attnx.core.streaming.ssmax import row_scale
from attnx.core.streaming.stick_breaking import StickState

__all__ = ["F32", "FAMILIES", "LOG2E", "MAX_THRESHOLD_PASSES", "MAX_THRESHOLD_PASSES_F64", "XLA",
           "Array", "EntmaxState", "Family", "GradCarry", "MaxState", "Ops", "RowStream",
           "StickState", "Threshold", "entmax_powers", "entmax_threshold", "entmax_tile_max",
           "entmax_x",
           "entmax_zero_tile", "entmax_zero_tiles", "finalize", "fold", "get_family", "init",
           "max_threshold_passes", "merge", "online_max_bound", "online_max_shifted",
           "online_max_start", "online_max_update", "pointwise_empty", "pointwise_finalize",
           "pointwise_grad_rows", "pointwise_merge", "pointwise_tile_grad", "pointwise_update",
           "pointwise_sink", "pv", "residual_delta", "row_scale", "row_sink",
           "threshold_sums_fold", "tile_grad", "update"]
