"""The report of a character language-model comparison, from its config: how it was run, then
what came out.

An experiment that trains one character GPT per attention variant
(:func:`attnx.train.experiment.run_comparison` with :func:`attnx.nn.lm.gpt_builder` and the
data of :mod:`attnx.data.char_lm`) declares its variants and its claim; this module writes the
rest. :func:`check_config` checks the settings the report reads before anything trains,
:func:`describe` is the report's introduction (data, model, positions, optimizer,
seeds, learning curves), :func:`finish` the ``finish`` callback that adds, after the
learning curves: the final losses in nats and bits per character, the length generalization
(:func:`attnx.analysis.report_length`), the attention statistics
(:func:`attnx.analysis.report_attention`), one sample per variant
(:func:`attnx.train.sampling.report_samples`) with the model files sample.py reads, every
variant's verdict against the reference (:func:`attnx.train.experiment.report_verdicts`) and
``<name>.json`` with the numbers.

The config keys read (the language-model experiment's): ``model`` (``num_layers``,
``num_heads``, ``hidden_dim``, ``mlp_dim``, ``context``, ``positions``, ``dropout_rate``),
``optimizer`` (``learning_rate``, ``warmup_steps``, ``end_learning_rate_ratio``, ``b2``,
``weight_decay``, ``grad_clip_norm``), ``packing``, ``num_steps``, ``batch_size``, ``seed``,
``num_seeds``, ``curve_windows``, ``eval_every``, ``eval_windows``, ``context_multipliers``,
``length_verdicts``, ``length_windows``, ``margin``, ``stats_windows``, ``sink_threshold``,
``small_weight``, ``heatmap_layer`` and ``sample`` (``num_tokens``, ``temperature``,
``top_k``, ``seed``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from attnx.analysis import report as analysis_report
from attnx.nn.lm import attention_of, positions_for
from attnx.train import evaluators, experiment, sampling
from attnx.train.report import Report

__all__ = ["check_config", "describe", "finish", "positions_note"]


def check_config(config: Any, validation_tokens: int | None) -> None:
  """Raises ValueError, naming the key, for report settings that cannot be honoured: length
  generalization beyond the ``validation_tokens`` there are (None: the model reads 1× only,
  so any text does; :func:`attnx.train.evaluators.check_length_options`), a sink threshold or
  small weight outside (0, 1), a margin ≤ 0 or a heat-map layer the model does not have."""
  L = int(config.model.context)
  evaluators.check_length_options(
      config.context_multipliers, config.length_verdicts, config.length_windows, L,
      validation_tokens, int(config.eval_windows) * L)
  if not 0 < config.sink_threshold < 1 or not 0 < config.small_weight < 1:
    raise ValueError("config.sink_threshold and config.small_weight must be in (0, 1).")
  if not config.margin > 0:
    raise ValueError("config.margin must be > 0 (nats).")
  if not -config.model.num_layers <= config.heatmap_layer < config.model.num_layers:
    raise ValueError(f"config.heatmap_layer={config.heatmap_layer} is not a layer of "
                     f"{config.model.num_layers}.")


def _positions(config: Any, specs: Mapping[str, Any], study: Sequence[str]) -> str:
  """The positions of the model sentence: the study's, or the config's and which variants
  keep learned ones."""
  if study:
    return f"positions per variant ({', '.join(study)})"
  p = config.model.positions
  linear = ", ".join(w for w, s in specs.items() if positions_for(attention_of(s), p) != p)
  linear = f" (learned for {linear}: no rotary linear attention in attnx)" if linear else ""
  return f"{p} positions{linear}"


def describe(config: Any, specs: Mapping[str, Any], *, vocab_size: int, data: str,
             documents: str = "document", study: Sequence[str] = (), model: str = "GPT",
             closing: str = "") -> str:
  """The introduction: ``data`` (what was read), the vocabulary and context, packing (each
  of the ``documents`` apart), ``model`` (how to call the GPT) and its sizes and positions
  (``specs``: {variant: spec}; ``study``: the positions study), the optimizer, the seeds and
  the learning curves, then ``closing``."""
  m, opt = config.model, config.optimizer
  packing = (f"; training rows pack each {documents} apart (grain's "
             f"{config.packing.replace('_', '-')} packing, segment ids, positions restarting per "
             "document; a document longer than the context is cut into pieces, each its own "
             "segment), validation on windows as without packing" if config.packing else "")
  return (f"Data: {data}, vocabulary {vocab_size} characters, context {m.context}{packing}. "
          f"Model: {model} with {m.num_layers} layer(s), {m.num_heads} heads, width "
          f"{m.hidden_dim}, MLP {m.mlp_dim}, tied embeddings, dropout {m.dropout_rate:g}, "
          f"{_positions(config, specs, study)}. {config.num_steps} steps of batch "
          f"{config.batch_size}, AdamW lr {opt.learning_rate:g} (warmup {opt.warmup_steps}, "
          f"cosine to {opt.learning_rate * opt.end_learning_rate_ratio:g}), β₂ {opt.b2:g}, "
          f"weight decay {opt.weight_decay:g}, gradient clip {opt.grad_clip_norm:g}; seeds "
          f"{config.seed}..{config.seed + config.num_seeds - 1}. Learning curves: validation "
          f"loss on the first {config.curve_windows} windows every {config.eval_every} steps; "
          "final metrics on every validation window." + (f" {closing}" if closing else ""))


def positions_note(positions: str, study: Sequence[str] = ()) -> str:
  """What the length generalization can read beyond the training context, by positions."""
  if study:
    return (f"Positions per variant (F@positions: {', '.join(study)}; ALiBi and none "
            "extrapolate with no table, RoPE rotates further).")
  return f"Positions: {positions} " + (
      "(RoPE; nanoGPT uses learned positions, which cannot evaluate beyond L). Linear "
      "attention has no rotary variant in attnx and keeps learned positions: n/a beyond "
      "1×." if positions == "rotary" else
      "(learned, as nanoGPT): a table of L positions, so only 1× is evaluated.")


def _payload(config: Any, result: experiment.TaskResult, **parts: Any) -> dict[str, Any]:
  """The numbers of the JSON file: final metrics per variant (lists over seeds), speed, every
  outcome and the ``parts`` the sections returned."""
  from attnx.data.char_lm import bits_per_char  # noqa: PLC0415 (attnx.data: heavy import)

  fits, L = result.fits, int(config.model.context)
  metric = lambda key: {w: np.asarray(r.final_metrics[key]).tolist() for w, r in fits.items()
                        if key in r.final_metrics}
  length = parts.pop("length_verdicts")
  return {
      "val_loss": metric("loss"), "test_loss": metric("test_loss"),
      "val_bpc": {w: bits_per_char(v).tolist() for w, v in metric("loss").items()},
      "loss_by_context": metric("loss_by_context"),
      "context_multipliers": [int(k) for k in config.context_multipliers],
      "tokens_per_second": {w: config.batch_size * L / r.seconds_per_step
                            for w, r in fits.items()},
      "compile_seconds": {w: r.compile_seconds for w, r in fits.items()},
      "outcomes": {w: c.outcome for w, c in result.comparisons.items()},
      "length_outcomes": {k: {w: c.outcome for w, c in v.items()} for k, v in length.items()},
      "kernels": parts.pop("kernels"),
      "eval_seconds_by_context": {w: v[0] for w, v in metric("eval_seconds_by_context").items()},
      "failures": dict(result.failures), **parts}


def finish(config: Any, specs: Mapping[str, Any], *, task: str, vocab: str, prompt: str,
           stream: np.ndarray, data: Mapping[str, Any], reference: str, orientation: str,
           test_note: str, study: Sequence[str] = (), label: str = "weighting",
           dataset: str = "shakespeare", name: str = "language_model"
           ) -> Callable[[Report, dict[str, experiment.TaskResult]], dict[str, Any]]:
  """The ``finish`` of :func:`attnx.train.experiment.run_comparison` (module docstring).

  Args:
    config: the experiment config (keys in the module docstring).
    specs: {variant: what ``Task.build_model`` took}.
    task: the task whose result is reported; ``dataset`` and ``data`` its dataset and builder
      config (recorded in the model files).
    vocab, prompt: the vocabulary (token id -> character) and the samples' prompt.
    stream: the validation token stream the ``"loss_by_length"`` evaluator read.
    reference: the variant every other is judged against.
    orientation: the loss section's text (e.g. a published number to compare with).
    test_note: the end of the loss table's caption: what the test split is, if any.
    study: the positions study (:func:`positions_note`).
    label, name: the variants' column and the JSON file's name (``<workdir>/<name>.json``).
  """
  L, mults = int(config.model.context), [int(k) for k in config.context_multipliers]

  def finish_fn(rep: Report, results: dict[str, experiment.TaskResult]) -> dict[str, Any]:
    result = results[task]
    fits = result.fits  # result.comparisons: each variant vs the reference on the metric
    build = lambda variant: sampling.linen_model(result, specs[variant])
    runs = sampling.save_models(rep.workdir, result, specs, vocab, dataset=dataset, data=data,
                                num_steps=int(config.num_steps))
    rep.section(f"Loss per {label} (nats and bits per character)")
    rep.text(orientation)
    rep.table(analysis_report.loss_rows(result, int(config.batch_size) * L, label=label,
                                        reference=reference),
              caption=f"Final metrics after {config.num_steps} steps, mean ± std over "
                      f"{config.num_seeds} seeds. tokens/s per model = batch × context / seconds "
                      "per step (the seeds train together, vmapped, so the machine processes "
                      f"num_seeds times as many); {test_note}")
    length_verdicts, kernels = analysis_report.report_length(
        rep, fits, build, stream, context=L, multipliers=mults, judged=config.length_verdicts,
        margin=config.margin, num_seeds=config.num_seeds, length_windows=config.length_windows,
        limit_tokens=int(config.eval_windows) * L, label=label, unit="characters",
        note=positions_note(config.model.positions, study), reference=reference)
    attention = analysis_report.report_attention(
        rep, fits, build, result.arrays["eval"]["inputs"],
        examples=f"the first {config.stats_windows} validation windows of {L} characters",
        threshold=config.sink_threshold, small=config.small_weight,
        layer=config.heatmap_layer, label=label,
        title="Attention statistics (after Zuhri et al. 2025, softpick)")
    texts = sampling.report_samples(rep, result, specs, vocab, prompt, config.sample,
                                    context=L, runs=runs, label=label)
    rep.section(f"Verdicts: each variant vs {reference} on validation loss")
    experiment.report_verdicts(rep, result, config.num_seeds, reference, label,
                               "validation loss (nats; lower is better)")
    payload = _payload(config, result, length_verdicts=length_verdicts, kernels=kernels,
                       samples=texts, runs=runs, task=result.task.name, prompt=prompt,
                       attention=attention)
    rep.save_json(name, payload)
    return payload

  return finish_fn
