"""The ``"attention_stats"`` evaluator: :func:`attnx.analysis.statistics` over stacked seeds.

attnx.analysis sits above attnx.train (docs/architecture.md: imports flow down), so the
evaluator that needs the statistics is registered from here, into the registry of
:mod:`attnx.train.evaluators`, when ``attnx.analysis`` is imported (experiments that declare it
import ``attnx.analysis`` for its report sections). attnx.train imports nothing of
attnx.analysis.

``"attention_stats"``: what the attention of any attnx model does on the first
``eval_options["stats_examples"]`` (default 32) evaluation inputs, per attention layer and
head: sink rate at ``sink_threshold`` (default :data:`~attnx.analysis.SINK_THRESHOLD`), shares
of the valid weights equal to 0 and below ``small_weight`` (default
:data:`~attnx.analysis.SMALL_WEIGHT`), row entropy and maximum weight (``<stat>`` [seeds,
layers], ``<stat>_by_head`` [seeds, layers, heads]; NaN for linear attention), and the
hidden-state kurtosis per block (``max_kurtosis``, ``mean_kurtosis`` [seeds, blocks]). The
weights come from the dense kernel whatever implementation the model trains with.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import numpy as np

from attnx.analysis import stats
from attnx.nnx import bridge as nnx_bridge
from attnx.train import evaluators


@evaluators.register_evaluator("attention_stats")
def _attention_stats(model: Any, arrays: Mapping[str, np.ndarray],
                     task: Any) -> evaluators.EvalFn:
  opts = dict(getattr(task, "eval_options", None) or {})
  # The probes read a linen model's sown weights: an NNX model is read by its linen twin,
  # which has the same parameter tree (attnx.nnx.linen_twin).
  model = nnx_bridge.linen_twin(model)
  x = np.asarray(arrays["inputs"])[:int(opts.get("stats_examples", 32))]
  settings = dict(threshold=float(opts.get("sink_threshold", stats.SINK_THRESHOLD)),
                  small=float(opts.get("small_weight", stats.SMALL_WEIGHT)))
  fn = jax.jit(jax.vmap(lambda p, e, inputs: stats.statistics(
      model, p, inputs, extra_variables=e, **settings), in_axes=(0, 0, None)))

  def eval_fn(params_stacked, extra_variables=None) -> dict[str, np.ndarray]:
    return {k: np.asarray(v, np.float64)
            for k, v in fn(params_stacked, extra_variables or {}, x).items()}

  return eval_fn
