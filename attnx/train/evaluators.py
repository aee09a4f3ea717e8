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
* ``"noisy_accuracy"``: accuracy with N(0, σ²) noise added to the inputs, at each σ of the
  task's ``eval_options["noise_levels"]`` (``noisy_accuracy`` [seeds, levels]); one noise draw
  from ``eval_options["noise_seed"]`` (default 0), scaled per σ, shared by every model.
* ``"greedy_decode"``: sequence-to-sequence models (:func:`attnx.nn.greedy_decode`): exact
  sequence match (``sequence_accuracy``) and corpus BLEU-4 (``bleu``, :func:`corpus_bleu`)
  of the greedy output against ``targets``, per seed. ``eval_options``: ``bos_id`` (default
  1), ``detokenize`` (token ids -> words; default: ids up to the first ``eos_id``, default 2,
  without PAD 0/BOS).
* ``"alignment"``: teacher-forced attention weights of a model called with
  ``return_alignment=True`` against gold alignments (``alignment`` [N, T], −1 = none):
  how often their argmax is the gold source position (``alignment_accuracy``) and their mean
  mass on it (``gold_mass``).

* ``"accuracy_by_level"``: accuracy (argmax vs ``targets``, every target position,
  ``IGNORE_INDEX`` excluded) on the same examples perturbed at several levels, given as
  ``arrays["inputs_by_level"]`` [levels, N, ...] (e.g. a growing global-noise component);
  ``accuracy_by_level`` [seeds, levels]. Each level is one jitted call over all N examples.
* ``"weight_tv_by_level"``: for models with an ``attention_weights(x) -> [..., L, L]`` method:
  the mean total-variation distance ``½ Σ_j |w_ij − w_ij^ref|`` of each attention row to the
  same row at the reference level (``eval_options["reference_level"]``, default the lowest of
  ``eval_options["levels"]``), on the first ``eval_options["weight_examples"]`` examples
  (default all) of ``inputs_by_level``; ``weight_tv_by_level`` [seeds, levels].
* ``"attention_stats"``: what the attention of any attnx model does
  (:func:`attnx.analysis.statistics`) on the first ``eval_options["stats_examples"]``
  (default 32) evaluation inputs, per attention layer and head: sink rate at
  ``sink_threshold`` (default 0.3), shares of the valid weights equal to 0 and below
  ``small_weight`` (default 1e-3), row entropy and maximum weight (``<stat>`` [seeds, layers],
  ``<stat>_by_head`` [seeds, layers, heads]; NaN for linear attention), and the hidden-state
  kurtosis per block (``max_kurtosis``, ``mean_kurtosis`` [seeds, blocks]). The weights come
  from the dense kernel whatever implementation the model trains with. attnx.analysis sits
  above this module and registers it when imported (:mod:`attnx.analysis.evaluators`); this
  module imports nothing of attnx.analysis.
* ``"loss_by_length"``: a language model's loss vs evaluation length (below), on
  ``eval_options["token_stream"]`` (a 1-D token array, or a function returning it):
  ``loss``, ``accuracy`` [seeds] on every training-length window, ``loss_by_context``
  [seeds, K] at each of ``context_multipliers`` on the first ``length_windows`` windows,
  ``loss_by_position`` [seeds, k_max·L] and ``eval_seconds_by_context`` [seeds, K].
* ``"stream_loss"``: ``<name>_loss`` [seeds] on the training-length windows of each token
  stream of ``eval_options["loss_streams"]`` ({name: stream or function}), e.g. a test split.

Options come from ``task.eval_options`` (:class:`attnx.train.experiment.Task`).

Loss vs evaluation length (language models, any ``model(tokens [B, T]) -> logits``):
:func:`context_windows` cuts one token stream into windows of k times the training context
(the same text at every k), :func:`token_nll_fn` and :func:`window_nll` give the next-token
NLL per position and window in batches of ~``EVAL_TOKENS`` tokens (one compiled program per
window length, never one per window; at long lengths ``implementation=None`` lets
:func:`attnx.core.attention` pick the O(T)-memory streaming kernels), and
:func:`length_comparisons` judges each model's loss increase from 1× to k× against a
reference by the shared rule (:mod:`attnx.train.verdict`).
"""

from __future__ import annotations

import collections
import math
import numbers
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from attnx.train import verdict
from attnx.train.data import loader
from attnx.train.evaluate import evaluate

EvalFn = Callable[..., dict[str, np.ndarray]]
Factory = Callable[[Any, Mapping[str, np.ndarray], Any], EvalFn]

_EVALUATORS: dict[str, Factory] = {}
EVAL_BATCH = 500  # examples per evaluation batch (CPU memory, not results)
# Tokens per batch of window_nll: only speed and memory depend on it. Measured (2026-11-24,
# 2-core Xeon, nanoGPT's CPU GPT, 2 seeds): 4096 tokens take 0.77× the time of 16384 at the
# training context 64 and 0.74× at 4×; 2048 is no faster. At 4096 characters a batch is one
# window (the streaming kernels keep its scratch memory below 0.2 GiB).
EVAL_TOKENS = 4096


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
  """ValueError naming the valid evaluators for an unknown name (and, for
  ``"attention_stats"`` before ``attnx.analysis`` is imported, where it comes from)."""
  unknown = [n for n in names if n not in _EVALUATORS]
  if unknown:
    # attnx.analysis sits above this module and registers "attention_stats" when imported.
    hint = ("; 'attention_stats' is registered by `import attnx.analysis`"
            if "attention_stats" in unknown else "")
    raise ValueError(f"unknown evaluator(s) {unknown}; valid: {', '.join(list_evaluators())}"
                     + hint)


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


def _options(task: Any) -> Mapping[str, Any]:
  """The task's evaluator settings (``Task.eval_options``; {} without a task)."""
  return dict(getattr(task, "eval_options", None) or {})


@register_evaluator("noisy_accuracy")
def _noisy_accuracy(model: Any, arrays: Mapping[str, np.ndarray], task: Any) -> EvalFn:
  opts = _options(task)
  levels = tuple(float(s) for s in opts.get("noise_levels", (0.0,)))
  noise = np.random.default_rng(opts.get("noise_seed", 0)).standard_normal(
      arrays["inputs"].shape).astype(np.float32)

  def eval_fn(params_stacked, extra_variables=None) -> dict[str, np.ndarray]:
    acc = []
    for sigma in levels:
      noisy = {"inputs": arrays["inputs"] + np.float32(sigma) * noise,
               "targets": arrays["targets"]}
      acc.append(evaluate(model, params_stacked, loader(noisy, EVAL_BATCH), ("accuracy",),
                          extra_variables=extra_variables)["accuracy"])
    return {"noisy_accuracy": np.stack(acc, axis=1)}

  return eval_fn


# Corpus BLEU (Papineni et al. 2002): clipped n-gram precisions summed over the corpus,
# geometric mean over n = 1..max_n, brevity penalty from total lengths. No smoothing.

def _ngrams(words: Sequence[str], n: int) -> collections.Counter:
  return collections.Counter(tuple(words[i:i + n]) for i in range(len(words) - n + 1))


def corpus_bleu(hypotheses: Sequence[Sequence[str]], references: Sequence[Sequence[str]],
                max_n: int = 4) -> float:
  """Corpus-level BLEU in [0, 1] with one reference per sentence."""
  if len(hypotheses) != len(references):
    raise ValueError(f"{len(hypotheses)} hypotheses but {len(references)} references")
  matches, totals = [0] * max_n, [0] * max_n
  hyp_len = ref_len = 0
  for hyp, ref in zip(hypotheses, references, strict=True):
    hyp_len += len(hyp)
    ref_len += len(ref)
    for n in range(1, max_n + 1):
      h, r = _ngrams(hyp, n), _ngrams(ref, n)
      matches[n - 1] += sum(min(c, r[g]) for g, c in h.items())
      totals[n - 1] += max(len(hyp) - n + 1, 0)
  if hyp_len == 0 or min(matches) == 0:
    return 0.0
  log_p = sum(math.log(m / t) for m, t in zip(matches, totals, strict=True)) / max_n
  bp = 1.0 if hyp_len > ref_len else math.exp(1.0 - ref_len / hyp_len)
  return bp * math.exp(log_p)


def _until_eos(ids: np.ndarray, eos_id: int, skip: tuple[int, ...] = (0, 1)) -> list[int]:
  out = []
  for i in np.asarray(ids).reshape(-1):
    if int(i) == eos_id:
      break
    if int(i) not in skip:
      out.append(int(i))
  return out


@register_evaluator("greedy_decode")
def _greedy_decode(model: Any, arrays: Mapping[str, np.ndarray], task: Any) -> EvalFn:
  import jax

  from attnx.nn import greedy_decode

  opts = _options(task)
  bos_id, eos_id = int(opts.get("bos_id", 1)), int(opts.get("eos_id", 2))
  detokenize = opts.get("detokenize") or (lambda ids: _until_eos(ids, eos_id, (0, bos_id)))
  src = np.asarray(arrays["inputs"])
  refs = [detokenize(r) for r in arrays["targets"]]
  max_len = int(opts.get("max_len", arrays["targets"].shape[1]))
  # The whole evaluation set in one call (results do not depend on a batch split).
  decode = jax.jit(jax.vmap(lambda p, e, s: greedy_decode(model, {"params": p, **e}, s,
                                                          max_len=max_len, bos_id=bos_id),
                            in_axes=(0, 0, None)))

  def eval_fn(params_stacked, extra_variables=None) -> dict[str, np.ndarray]:
    out = np.asarray(decode(params_stacked, extra_variables or {}, src))
    seq_acc, bleu = [], []
    for per_seed in out:
      hyps = [detokenize(h) for h in per_seed]
      seq_acc.append(np.mean([h == r for h, r in zip(hyps, refs, strict=True)]))
      bleu.append(corpus_bleu(hyps, refs))
    return {"sequence_accuracy": np.asarray(seq_acc), "bleu": np.asarray(bleu)}

  return eval_fn


def alignment_weights(model: Any, params_stacked: Any, src: Any, tgt_in: Any) -> np.ndarray:
  """[seeds, B, T, S] teacher-forced attention weights of an encoder-decoder that returns them
  (``model.apply(..., return_alignment=True)``, e.g. attnx.nn.RNNSeq2Seq), one row per seed
  of ``params_stacked``: the matrices the ``"alignment"`` evaluator scores, for heat maps."""
  import jax

  fn = jax.jit(jax.vmap(lambda p: model.apply({"params": p}, src, tgt_in,
                                              return_alignment=True)[1]))
  return np.asarray(fn(params_stacked))


@register_evaluator("alignment")
def _alignment(model: Any, arrays: Mapping[str, np.ndarray], task: Any) -> EvalFn:
  import jax

  gold = np.asarray(arrays["alignment"])  # [N, T], −1 where there is no gold source word
  ok = gold >= 0
  weights = jax.jit(jax.vmap(
      lambda p, e, s, t: model.apply({"params": p, **e}, s, t, return_alignment=True)[1],
      in_axes=(0, 0, None, None)))

  def eval_fn(params_stacked, extra_variables=None) -> dict[str, np.ndarray]:
    a = np.asarray(weights(params_stacked, extra_variables or {}, arrays["inputs"],
                           arrays["decoder_inputs"]))  # [seeds, N, T, S]
    hit = (a.argmax(-1) == gold[None]) & ok[None]
    mass = np.take_along_axis(a, np.maximum(gold, 0)[None, ..., None], -1)[..., 0]
    return {"alignment_accuracy": hit.sum((1, 2)) / ok.sum(),
            "gold_mass": (mass * ok[None]).sum((1, 2)) / ok.sum()}

  return eval_fn


def _by_level_inputs(arrays: Mapping[str, np.ndarray], opts: Mapping[str, Any]) -> np.ndarray:
  """``arrays["inputs_by_level"]`` [levels, N, ...], checked against ``opts["levels"]``."""
  if "inputs_by_level" not in arrays:
    raise ValueError("this evaluator needs arrays['inputs_by_level'] [levels, N, ...]")
  x = np.asarray(arrays["inputs_by_level"])
  if "levels" in opts and len(opts["levels"]) != len(x):
    raise ValueError(f"eval_options['levels'] has {len(opts['levels'])} entries but "
                     f"inputs_by_level has {len(x)} levels")
  return x


@register_evaluator("accuracy_by_level")
def _accuracy_by_level(model: Any, arrays: Mapping[str, np.ndarray], task: Any) -> EvalFn:
  import jax

  from attnx.constants import IGNORE_INDEX

  inputs = _by_level_inputs(arrays, _options(task))
  targets = np.asarray(arrays["targets"])
  valid = targets != IGNORE_INDEX
  logits_fn = jax.jit(jax.vmap(lambda p, e, x: model.apply({"params": p, **e}, x),
                               in_axes=(0, 0, None)))

  def eval_fn(params_stacked, extra_variables=None) -> dict[str, np.ndarray]:
    acc = []
    for x in inputs:
      logits = np.asarray(logits_fn(params_stacked, extra_variables or {}, x))
      hit = (logits.argmax(-1) == targets[None]) & valid[None]
      acc.append(hit.sum(axis=tuple(range(1, hit.ndim))) / valid.sum())
    return {"accuracy_by_level": np.stack(acc, axis=1)}

  return eval_fn


@register_evaluator("weight_tv_by_level")
def _weight_tv_by_level(model: Any, arrays: Mapping[str, np.ndarray], task: Any) -> EvalFn:
  import jax

  opts = _options(task)
  inputs = _by_level_inputs(arrays, opts)
  limit = opts.get("weight_examples")
  inputs = inputs[:, :limit] if limit else inputs
  levels = list(opts.get("levels", range(len(inputs))))
  ref = levels.index(opts.get("reference_level", min(levels)))
  weights_fn = jax.jit(jax.vmap(
      lambda p, e, x: model.apply({"params": p, **e}, x, method="attention_weights"),
      in_axes=(0, 0, None)))

  def eval_fn(params_stacked, extra_variables=None) -> dict[str, np.ndarray]:
    extra = extra_variables or {}
    w_ref = np.asarray(weights_fn(params_stacked, extra, inputs[ref]))
    tv = []
    for x in inputs:
      w = np.asarray(weights_fn(params_stacked, extra, x))
      tv.append(0.5 * np.abs(w - w_ref).sum(-1).mean(axis=tuple(range(1, w.ndim - 1))))
    return {"weight_tv_by_level": np.stack(tv, axis=1)}

  return eval_fn


# --- loss vs evaluation length ----------------------------------------------------------------


def context_windows(tokens: Any, context: int, multipliers: Sequence[int],
                    limit_tokens: int | None = None) -> dict[int, dict[str, np.ndarray]]:
  """``{k: {"inputs", "targets"} [N_k, k·context]}``: the same text cut longer.

  The first ``limit_tokens`` tokens of the 1-D stream ``tokens`` (default all) are cut into
  N_k = (n − 1) // (k·context) consecutive windows; ``targets`` are the inputs shifted by one
  token. A k whose window does not fit gets N_k = 0 windows.
  """
  tokens = np.asarray(tokens, np.int32).reshape(-1)
  if limit_tokens:
    tokens = tokens[:int(limit_tokens) + 1]
  out = {}
  for k in multipliers:
    length = int(k) * int(context)
    if length < 1:
      raise ValueError(f"window length k·context = {k}·{context} must be ≥ 1")
    rows = np.arange(max(0, (len(tokens) - 1) // length))[:, None] * length + np.arange(length)
    out[int(k)] = {"inputs": tokens[rows], "targets": tokens[rows + 1]}
  return out


def token_nll_fn(model: Any) -> Callable[..., tuple[Any, Any]]:
  """jit(vmap over seeds) of ``(params, extra, inputs [B, T], targets [B, T]) -> (NLL
  [seeds, B, T] in nats, number of correct argmax predictions per window [seeds, B])``.

  ``model.apply`` maps tokens to logits; the log-softmax is taken in float32. One compiled
  program per input shape.
  """
  import jax
  import jax.numpy as jnp

  def one(p, e, x, y):
    logits = model.apply({"params": p, **e}, x).astype(jnp.float32)
    lp = jax.nn.log_softmax(logits, axis=-1)
    nll = -jnp.take_along_axis(lp, y[..., None], axis=-1)[..., 0]
    return nll, (jnp.argmax(logits, -1) == y).sum(-1)

  return jax.jit(jax.vmap(one, in_axes=(0, 0, None, None)))


def window_nll(fn: Callable[..., tuple[Any, Any]], params: Any, extra: Any,
               arrays: Mapping[str, np.ndarray], tokens_per_batch: int | None = None
               ) -> dict[str, np.ndarray]:
  """One pass of ``fn`` (:func:`token_nll_fn`) over every window of ``arrays``.

  Returns ``position``: mean NLL per position over the windows [seeds, T]; ``window``: mean
  NLL of each window [seeds, N]; ``accuracy``: share of correct next-token argmax predictions
  [seeds]. Batches hold max(1, tokens_per_batch // T) windows (default ``EVAL_TOKENS``);
  the last one is padded to the same shape (and the padding dropped), so one window length
  costs one compiled program.
  """
  x, y = np.asarray(arrays["inputs"]), np.asarray(arrays["targets"])
  if x.ndim != 2 or x.shape != y.shape or not x.size:
    raise ValueError(f"window_nll needs inputs and targets of one non-empty shape [N, T]; "
                     f"got {x.shape} and {y.shape}")
  n, t = x.shape
  step = min(n, max(1, int(tokens_per_batch or EVAL_TOKENS) // t))
  nll, correct = [], []
  for i in range(0, n, step):
    xb, yb = x[i:i + step], y[i:i + step]
    if (pad := step - len(xb)):
      xb, yb = (np.concatenate([a, np.zeros((pad, t), a.dtype)]) for a in (xb, yb))
    out = fn(params, extra or {}, xb, yb)
    nll.append(np.asarray(out[0], np.float64)[:, :step - pad])
    correct.append(np.asarray(out[1], np.float64)[:, :step - pad])
  nll_all = np.concatenate(nll, axis=1)  # [seeds, N, T]
  return {"position": nll_all.mean(1), "window": nll_all.mean(2),
          "accuracy": np.concatenate(correct, axis=1).sum(1) / x.size}


def length_comparisons(losses: Mapping[str, Any], multipliers: Sequence[int], margin: float,
                       *, at: int | None = None, reference: str = "softmax"
                       ) -> dict[str, verdict.Comparison]:
  """{name: name vs ``reference`` on the increase of the loss from 1× to ``at``× the
  training context}, by the shared rule (paired by seed, ``margin`` in the loss's units,
  lower is better: the model that "degrades less" wins).

  ``losses``: {name: loss [seeds, K]} with column i at ``multipliers[i]`` (NaN where a model
  cannot evaluate that length, e.g. learned positions); ``at``: default the largest
  multiplier. Models without a loss at 1× or ``at``× are left out, and everything is when the
  reference has none or ``at`` is 1.
  """
  mults = [int(k) for k in multipliers]
  at = max(mults) if at is None else int(at)
  if 1 not in mults or at not in mults:
    raise ValueError(f"length_comparisons needs 1 and at={at} among the multipliers {mults}")
  if reference not in losses or at == 1:
    return {}
  first, last = mults.index(1), mults.index(at)

  def increase(name: str) -> np.ndarray:
    loss = np.asarray(losses[name], np.float64)
    return loss[:, last] - loss[:, first]

  ref = increase(reference)
  if np.isnan(ref).any():
    return {}
  out = {}
  for name in losses:
    if name == reference or np.isnan(inc := increase(name)).any():
      continue
    out[name] = verdict.compare(inc, ref, margin=margin, higher_is_better=False, a_name=name,
                                b_name=reference, metric=f"loss increase 1×→{at}× (nats)")
  return out


def shared_tokens(length_windows: int | None, context: int, limit_tokens: int | None
                  ) -> int | None:
  """How many tokens of a stream every evaluation length reads: ``length_windows`` windows of
  ``context``, at most the final evaluation's ``limit_tokens`` (None: the whole stream)."""
  return min((n for n in (int(length_windows or 0) * int(context), int(limit_tokens or 0))
              if n), default=None)


def check_length_options(multipliers: Sequence[Any], judged: Sequence[Any], length_windows: int,
                         context: int, available: int | None = None,
                         limit_tokens: int | None = None) -> None:
  """ValueError, naming the config keys ``context_multipliers``, ``length_verdicts`` and
  ``length_windows``, unless the multipliers are increasing integers from 1, each judged k is
  one of them above 1, and the shared text (the first ``length_windows`` windows of
  ``context``, at most ``limit_tokens``, of a stream of ``available`` tokens; None: not
  checked) holds one window at the largest k."""
  mults = tuple(multipliers)
  ints = all(isinstance(k, numbers.Integral) and not isinstance(k, bool) for k in mults)
  if not mults or not ints or mults[0] != 1 or list(mults) != sorted(set(mults)):
    raise ValueError(f"config.context_multipliers={mults} must be increasing positive "
                     "integers starting at 1 (the training context), e.g. (1, 2, 4, 16, 64).")
  if any(k not in mults[1:] for k in tuple(judged)):
    raise ValueError(f"config.length_verdicts={tuple(judged)}: each must be one of "
                     f"config.context_multipliers above 1, {mults[1:]}.")
  if length_windows < 0 or (length_windows and length_windows < max(mults)):
    raise ValueError(f"config.length_windows={length_windows} must be 0 (all) or at least the "
                     f"largest context multiplier {max(mults)} (one window at {max(mults)}×).")
  if available is None:
    return
  shared = min(shared_tokens(length_windows, context, limit_tokens) or available, available)
  if shared < max(mults) * context:
    cap = f", at most {limit_tokens:,}" if limit_tokens else ""
    raise ValueError(f"The length evaluation shares {shared:,} tokens (the first "
                     f"config.length_windows={length_windows} × {context}{cap}, of a split of "
                     f"{available:,}): fewer than one window at {max(mults)}× = "
                     f"{max(mults) * context:,}; lower config.context_multipliers or use a "
                     "longer text.")


def _stream(source: Any) -> np.ndarray:
  return np.asarray(source() if callable(source) else source)


@register_evaluator("loss_by_length")
def _loss_by_length(model: Any, arrays: Mapping[str, np.ndarray], task: Any) -> EvalFn:
  """Validation ``loss`` and ``accuracy`` [seeds] on every training-length window of the
  stream, and the length generalization on the first ``length_windows`` of them (their text
  cut into windows of k × the training context): ``loss_by_context`` [seeds, K] for k in
  ``context_multipliers`` (NaN where learned positions cannot reach k·L; rotary, ALiBi and no
  positions run at every k) and
  ``loss_by_position`` [seeds, k_max·L] at the largest k that runs; ``eval_seconds_by_context``
  [seeds, K]: the wall time of each length's pass (compile included; the 1× pass reads the
  whole stream, up to ``limit_tokens``), the same in every seed's row.

  One pass at 1× gives both the whole-stream loss and the 1× entry of the length table (the
  mean over the windows of the shared text), so the 1× windows are evaluated once. One
  compiled program per length (:func:`window_nll`); the model keeps its own implementation
  (``None``: the dispatcher's streaming kernels at long lengths).
  """
  opts = _options(task)
  mults = tuple(int(k) for k in opts.get("context_multipliers", (1,)))
  context = int(opts["context"])
  fn = token_nll_fn(model)
  stream = _stream(opts["token_stream"])
  full = context_windows(stream, context, (1,), opts.get("limit_tokens"))[1]
  wins = context_windows(stream, context, mults, shared_tokens(
      opts.get("length_windows"), context, opts.get("limit_tokens")))
  # A table of max_len learned positions stops there; rotary, ALiBi and no positions do not.
  # (An NNX model's options are its linen twin's fields; imported here: attnx.train itself
  # imports no model package.)
  from attnx.nnx import bridge as nnx_bridge

  fields = nnx_bridge.linen_twin(model)
  table = getattr(fields, "positions", "learned") == "learned"
  max_len = getattr(fields, "max_len", None)
  runs = [k for k in mults if not table or max_len is None or k * context <= max_len]

  def eval_fn(params_stacked, extra_variables=None) -> dict[str, np.ndarray]:
    passes, seconds = {}, {}
    for k in runs:  # 1 first: the whole stream
      start = time.perf_counter()
      passes[k] = window_nll(fn, params_stacked, extra_variables, full if k == 1 else wins[k])
      seconds[k] = time.perf_counter() - start
    one, per_pos = passes[1], {k: p["position"] for k, p in passes.items()}
    by_k = {k: v.mean(-1) for k, v in per_pos.items()}
    by_k[1] = one["window"][:, :len(wins[1]["inputs"])].mean(-1)  # the shared text
    nan = np.full(by_k[1].shape, np.nan)
    return {"loss": one["window"].mean(-1), "accuracy": one["accuracy"],
            "loss_by_context": np.stack([by_k.get(k, nan) for k in mults], axis=1),
            "loss_by_position": per_pos[max(runs)],
            "eval_seconds_by_context": np.stack(
                [np.full(nan.shape, seconds.get(k, np.nan)) for k in mults], axis=1)}

  return eval_fn


@register_evaluator("stream_loss")
def _stream_loss(model: Any, arrays: Mapping[str, np.ndarray], task: Any) -> EvalFn:
  opts = _options(task)
  streams = dict(opts.get("loss_streams") or {})
  fn = token_nll_fn(model) if streams else None
  windows = {name: context_windows(_stream(s), int(opts["context"]), (1,),
                                   opts.get("limit_tokens"))[1] for name, s in streams.items()}

  def eval_fn(params_stacked, extra_variables=None) -> dict[str, np.ndarray]:
    return {f"{name}_loss": window_nll(fn, params_stacked, extra_variables, w)["position"]
            .mean(-1) for name, w in windows.items()}

  return eval_fn
