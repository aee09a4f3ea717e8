"""Training steps to time: compiled steps of language models on random tokens, and their timing.

A training benchmark compares the same step of two models (e.g. one attention against
another, or a linen model against its NNX twin): :func:`lm_step` (one plain optax AdamW step
of next-token cross-entropy) and :func:`train_steps` (attnx.train's own step: vmapped seeds,
its optimizer and loss) compile them; :func:`time_steps` runs each once, untimed (its first
loss tells whether the models compute the same function), then times them round-robin;
:func:`timed_fit` times a whole quiet training run.
:func:`causal_lm` is a GPT-style model whose self-attention is attnx's or flax's own, with the
same parameters, to time one against the other.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

from attnx.train.benchmark import time_round_robin_ms

Step = tuple[Any, tuple[Any, ...]]  # (compiled step, its arguments)


ATTENTIONS = ("flax", "attnx")


def causal_lm(attention: str, *, width: int, num_heads: int, num_layers: int,
              vocab_size: int) -> nn.Module:
  """A GPT-style causal language model (tokens [B, T] -> logits [B, T, vocab]): token and
  learned position embeddings, ``num_layers`` pre-LN blocks (causal self-attention, a GELU MLP
  of 4× the width), a final LayerNorm. ``attention`` (:data:`ATTENTIONS`): softmax
  ``attnx.nn.MultiHeadAttention(is_causal=True)`` or flax's ``nn.MultiHeadDotProductAttention``
  under ``nn.make_causal_mask``; both have the same parameters, so one initialization serves
  both models."""
  from attnx import nn as attnx_nn  # noqa: PLC0415

  if attention not in ATTENTIONS:
    raise ValueError(f"attention must be one of {ATTENTIONS}, got {attention!r}")

  class Block(nn.Module):
    @nn.compact
    def __call__(self, x):
      h = nn.LayerNorm()(x)
      if attention == "attnx":
        h = attnx_nn.MultiHeadAttention(num_heads=num_heads, weighting="softmax",
                                        is_causal=True, name="attention")(h)
      else:
        mask = nn.make_causal_mask(jnp.ones(x.shape[:2], jnp.int32))
        h = nn.MultiHeadDotProductAttention(num_heads=num_heads, name="attention")(
            h, mask=mask)
      x = x + h
      h = nn.Dense(4 * width)(nn.LayerNorm()(x))
      return x + nn.Dense(width)(nn.gelu(h))

  class CausalLM(nn.Module):
    @nn.compact
    def __call__(self, tokens):
      x = nn.Embed(vocab_size, width)(tokens)
      pos = self.param("pos_embedding", nn.initializers.normal(0.02), (tokens.shape[-1], width))
      x = x + pos
      for _ in range(num_layers):
        x = Block()(x)
      return nn.Dense(vocab_size)(nn.LayerNorm()(x))

  return CausalLM()


def lm_step(model: Any, *, batch_size: int, seq_len: int, vocab_size: int,
            learning_rate: float, seed: int) -> Step:
  """(compiled step, (params, opt_state, tokens)): forward, backward and an optax AdamW update
  of a flax language model ``model`` (tokens [B, T] -> logits [B, T, vocab]) on next-token
  cross-entropy, for random tokens [batch_size, seq_len + 1] (key ``seed``; parameters from key
  ``seed + 1``). The step returns (params, opt_state, loss)."""
  if seq_len < 1 or batch_size < 1:
    raise ValueError(f"seq_len and batch_size must be >= 1, got {seq_len}, {batch_size}")
  tokens = jax.random.randint(jax.random.PRNGKey(seed), (batch_size, seq_len + 1), 0,
                              vocab_size)
  params = model.init(jax.random.PRNGKey(seed + 1), tokens[:, :-1])
  tx = optax.adamw(learning_rate)

  def step(params, opt_state, tokens):
    def loss_fn(p):
      logits = model.apply(p, tokens[:, :-1])
      return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

    loss, grads = jax.value_and_grad(loss_fn)(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  args = (params, tx.init(params), tokens)
  return jax.jit(step).lower(*args).compile(), args


def train_steps(models: Mapping[str, Any], tokens: np.ndarray) -> dict[str, Step]:
  """{name: (compiled step, (state, batch, step))}: attnx.train's training step
  (``attnx.train.step.make_step``: the seeds vmapped, the default optimizer, softmax
  cross-entropy) of each linen model on next-token prediction of ``tokens`` [seeds, batch,
  T + 1], every model from the first one's initial parameters (so their layouts must match)."""
  from attnx.train import optimizer_config  # noqa: PLC0415
  from attnx.train import step as step_lib  # noqa: PLC0415
  from attnx.train.losses import get_loss  # noqa: PLC0415
  from attnx.train.optim import make_optimizer  # noqa: PLC0415

  if np.ndim(tokens) != 3:
    raise ValueError(f"tokens must be [seeds, batch, T + 1], got shape {np.shape(tokens)}")
  batch = {"inputs": tokens[..., :-1].astype(np.int32),
           "targets": tokens[..., 1:].astype(np.int32)}
  tx = make_optimizer(optimizer_config(), 1000)
  state = step_lib.init_state(next(iter(models.values())), tx, list(range(len(tokens))),
                              {k: v[0, :2] for k, v in batch.items()})
  args = (state, batch, np.int32(0))
  return {name: (jax.jit(step_lib.make_step(step_lib.make_apply_fn(m), get_loss(
      "softmax_xent"), tx, donate=False)).lower(*args).compile(), args)
          for name, m in models.items()}


def timed_fit(model: Any, arrays: Mapping[str, Any], config: Any,
              **overrides: Any) -> tuple[Any, float]:
  """(fit result, wall seconds) of ``attnx.train.fit`` of ``model`` on ``arrays`` in batches of
  ``config.batch_size``, without checkpoints, logs, progress bar or TensorBoard; ``overrides``
  are fields of the fit's ``FitConfig`` (e.g. ``num_seeds``, ``seed``, ``parallel``)."""
  import time  # noqa: PLC0415

  from attnx import train  # noqa: PLC0415

  fit_config = train.FitConfig.from_config(
      config, **{"parallel": "none", "checkpoint_every": 0, "log_every": 0, "progress": False,
                 "tensorboard": False, **overrides})
  t0 = time.perf_counter()
  r = train.fit(model, train_data=train.loader(arrays, config.batch_size, config.data_pipeline),
                config=fit_config)
  return r, time.perf_counter() - t0


def time_steps(steps: Mapping[str, Step], repeats: int,
               loss: Callable[[Any], float]) -> tuple[dict[str, float], dict[str, float]]:
  """({name: median ms}, {name: first loss}): each step run once, untimed (``loss`` reads the
  loss from its outputs), then all timed round-robin
  (:func:`attnx.train.benchmark.time_round_robin_ms`)."""
  losses = {name: loss(jax.block_until_ready(fn(*args))) for name, (fn, args) in steps.items()}
  return time_round_robin_ms(steps, repeats), losses
