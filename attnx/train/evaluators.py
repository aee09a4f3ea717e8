"""Evaluators chosen by name: how an experiment scores trained (per-seed stacked) parameters.

An evaluator factory takes the trained model, the task's evaluation arrays and the task, and
returns ``eval_fn(params_stacked, extra_variables=None) -> {metric: np.ndarray [num_seeds, ...]}``
(the form :func:`attnx.train.fit` calls during training). Experiments name evaluators in their
task declarations (``Task(evaluators=("accuracy", "loss"))``); a new one is a
:func:`register_evaluator` away and is then usable by every experiment.

Built-in:

* ``"accuracy"``, ``"loss"``, ``"mse"``: dataset means over the evaluation split
  (:func:`attnx.train.evaluate`; targets equal to ``IGNORE_INDEX`` do not count).
* ``"icl_error"``: in-context linear regression (Garg et al. 2022, "What Can Transformers
  Learn In-Context? A Case Study of Simple Function Classes"): squared error / d of the
  prediction read at each x-token, per in-context position (``icl_curve`` [seeds, k]), its
  mean (``mse``) and the last position (``mse_last``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from attnx.train.data import loader
from attnx.train.evaluate import evaluate

EvalFn = Callable[..., dict[str, np.ndarray]]
Factory = Callable[[Any, Mapping[str, np.ndarray], Any], EvalFn]

_EVALUATORS: dict[str, Factory] = {}
EVAL_BATCH = 500  # examples per evaluation batch (CPU memory, not results)


def register_evaluator(name: str, factory: Factory | None = None, *, overwrite: bool = False):
  """Registers ``factory(model, arrays, task) -> eval_fn`` under ``name`` (usable as a
  decorator)."""
  def _register(f: Factory) -> Factory:
    if name in _EVALUATORS and not overwrite:
      raise ValueError(f"evaluator {name!r} is already registered; pass overwrite=True")
    _EVALUATORS[name] = f
    return f
  return _register(factory) if factory is not None else _register


def list_evaluators() -> list[str]:
  return sorted(_EVALUATORS)


def check_evaluators(names: tuple[str, ...]) -> None:
  """ValueError naming the valid evaluators for an unknown name."""
  unknown = [n for n in names if n not in _EVALUATORS]
  if unknown:
    raise ValueError(f"unknown evaluator(s) {unknown}; valid: {', '.join(list_evaluators())}")


def make_eval_fn(names: tuple[str, ...], model: Any, arrays: Mapping[str, np.ndarray],
                 task: Any = None) -> EvalFn:
  """One eval_fn computing every named evaluator (the dataset-mean metrics share one pass)."""
  check_evaluators(names)
  means = tuple(n for n in names if n in _MEAN_METRICS)
  others = [_EVALUATORS[n](model, arrays, task) for n in names if n not in _MEAN_METRICS]

  def eval_fn(params_stacked, extra_variables=None) -> dict[str, np.ndarray]:
    out: dict[str, np.ndarray] = {}
    if means:
      out.update(evaluate(model, params_stacked, loader(arrays, EVAL_BATCH), means,
                          extra_variables=extra_variables))
    for fn in others:
      out.update(fn(params_stacked, extra_variables))
    return out

  return eval_fn


_MEAN_METRICS = ("accuracy", "loss", "mse")
for _name in _MEAN_METRICS:  # listed for discovery; computed together in make_eval_fn
  register_evaluator(_name, lambda model, arrays, task: None)


@register_evaluator("icl_error")
def _icl_error(model: Any, arrays: Mapping[str, np.ndarray], task: Any) -> EvalFn:
  import jax

  dim = int(arrays["inputs"].shape[-1]) - 1

  @jax.jit
  def errors(params, extra, inputs, targets):
    def one(p, e):
      return model.apply({"params": p, **e}, inputs, deterministic=True)
    out = jax.vmap(one)(params, extra)
    return ((out[..., 0::2, 0] - targets) ** 2).sum(1)

  def eval_fn(params_stacked, extra_variables=None) -> dict[str, np.ndarray]:
    total = 0.0
    for b in loader(arrays, EVAL_BATCH // 2):
      total = total + np.asarray(errors(params_stacked, extra_variables or {}, b["inputs"],
                                        b["targets"]))
    curve = total / len(arrays["inputs"]) / dim
    return {"icl_curve": curve, "mse": curve.mean(-1), "mse_last": curve[:, -1]}

  return eval_fn
