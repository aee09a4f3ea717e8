"""attnx.analysis: what a trained model's attention does, for any attnx model.

:func:`probe` reads every attention layer's weights (through the dense kernel, whatever
implementation the model trains with) and every block's output; :func:`statistics` turns them
into per-layer and per-head statistics — sink rate, shares of exact zeros and of small
weights, row entropy, maximum weight — and the hidden-state kurtosis (:mod:`.stats` defines
each). Experiments declare them as the ``"attention_stats"`` evaluator (loss vs evaluation
length: ``"loss_by_length"``, :mod:`attnx.train.evaluators`) and write them with
:func:`report_attention` / :func:`report_length`; :func:`plot_weights` draws heat maps.

attnx.analysis sits above attnx.train (docs/architecture.md) and imports it: the
``"attention_stats"`` evaluator is registered into :mod:`attnx.train.evaluators` from
:mod:`attnx.analysis.evaluators` when this package is imported.
"""

from attnx import _flax  # noqa: F401  (first: a flax too old for this jax says so)
from attnx.analysis import evaluators as _evaluators  # noqa: F401  (registers "attention_stats")
from attnx.analysis import invariance, language_model  # namespaces: invariance.shift_table, ...
from attnx.analysis.report import (
    layer_weights,
    loss_rows,
    plot_simplex,
    plot_weights,
    report_attention,
    report_length,
    statistics_rows,
)
from attnx.analysis.stats import (
    HEAD_STATS,
    HIDDEN_STATS,
    SINK_THRESHOLD,
    SMALL_WEIGHT,
    Probe,
    attention_kernel,
    attention_statistics,
    dense_model,
    has_weights,
    hidden_statistics,
    kurtosis,
    probe,
    statistics,
)

__all__ = [
    "HEAD_STATS", "HIDDEN_STATS", "SINK_THRESHOLD", "SMALL_WEIGHT", "Probe", "attention_kernel",
    "attention_statistics", "dense_model", "has_weights", "hidden_statistics", "kurtosis",
    "layer_weights", "loss_rows", "plot_weights", "probe", "report_attention", "report_length",
    "statistics", "statistics_rows", "plot_simplex",
    "language_model", "invariance",
]
