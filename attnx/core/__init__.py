"""attnx.core: pure functional attention with a pluggable score s and weighting F.

    out_i = Σ_j w_ij v_j,   w_ij = F(s(q_i, k_j)) / Σ_l F(s(q_i, k_l))

Imports only jax/numpy; every function works under jit, vmap, grad and shard_map.
"""

from attnx.core import masks, score_mods, thresholds
from attnx.core.api import (
    BLOCKED_MIN_SCORES,
    IMPLEMENTATIONS,
    ROW_BLOCKED_MIN_SCORES,
    Explanation,
    attention,
    attention_weights,
    causal_mask,
    check_compatible,
    explain,
)
from attnx.core.flax_adapter import flax_attention_fn
from attnx.core.implementations import (
    Blocked,
    Dense,
    Implementation,
    Pallas,
    Problem,
    SplitKV,
    get_implementation,
    list_implementations,
)
from attnx.core.kernels.pallas import PallasVerification, verify_pallas
from attnx.core.kernels.pallas.autotune import TuneResult, autotune
from attnx.core.kernels.xla.pointwise import blocked_attention
from attnx.core.linear import (
    elu_plus_one_features,
    favor_features,
    favor_plus_features,
    linear_attention,
)
from attnx.core.nadaraya_watson import nadaraya_watson
from attnx.core.paged import append_to_pages, paged_attention
from attnx.core.parallel.ring import ring_attention, ring_work, zigzag_permute, zigzag_unpermute
from attnx.core.residuals import EntmaxResidual, SharedThreshold, merge_attention, residual_kind
from attnx.core.score_mods import ScoreMod, alibi, alibi_slopes, relative_table, soft_cap
from attnx.core.scores import (
    Score,
    additive,
    bilinear,
    cosine,
    dot,
    get_score,
    list_scores,
    metric,
    neg_sq_dist,
    scaled_dot,
)
from attnx.core.thresholds import (
    ThresholdStats,
    ThresholdSums,
    combine_threshold_stats,
    solve_threshold,
    threshold_stats,
    threshold_sums,
    thresholded_attention,
)
from attnx.core.weightings import (
    LogF,
    Pointwise,
    RowNormalizer,
    describe_weightings,
    get_weighting,
    list_weightings,
    parse_weighting_name,
    register_weighting,
    weights,
)
from attnx.core.weightings.rownorm import softpick, ssmax, stick_breaking
from attnx.core.weightings.simplex import entmax15, entmax_bisect, sparsemax

__all__ = [
    "BLOCKED_MIN_SCORES", "IMPLEMENTATIONS", "ROW_BLOCKED_MIN_SCORES", "Blocked", "Dense",
    "Explanation", "Implementation", "LogF", "Pallas", "PallasVerification", "Pointwise",
    "EntmaxResidual", "Problem", "SharedThreshold", "SplitKV", "ThresholdStats",
    "ThresholdSums", "append_to_pages", "combine_threshold_stats", "merge_attention",
    "paged_attention", "residual_kind", "solve_threshold", "threshold_stats", "threshold_sums",
    "thresholded_attention", "thresholds", "TuneResult", "autotune",
    "RowNormalizer", "Score", "ScoreMod",
    "additive", "alibi", "alibi_slopes", "attention", "attention_weights", "bilinear",
    "blocked_attention", "causal_mask",
    "check_compatible", "cosine", "describe_weightings", "dot", "elu_plus_one_features",
    "entmax15", "entmax_bisect", "explain", "favor_features", "favor_plus_features",
    "flax_attention_fn", "get_implementation", "get_score", "get_weighting",
    "linear_attention", "list_implementations", "list_scores", "list_weightings", "masks",
    "metric",
    "nadaraya_watson", "neg_sq_dist", "parse_weighting_name", "register_weighting",
    "relative_table", "ring_attention", "ring_work", "scaled_dot", "score_mods", "soft_cap",
    "softpick", "sparsemax", "ssmax",
    "stick_breaking", "verify_pallas", "weights", "zigzag_permute", "zigzag_unpermute",
]
