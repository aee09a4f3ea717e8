"""One GPT per attention variant from a language model's config, and the checks of that config.

A language-model experiment trains the same :class:`attnx.nn.GPT` once per attention variant:
:func:`gpt_builder` turns a ``model`` config (``num_layers``, ``num_heads``, ``hidden_dim``,
``mlp_dim``, ``context``, ``positions``, ``dropout_rate``, ``tie_embeddings``) into the
``spec -> model`` function that :class:`attnx.train.experiment.Task` takes, in linen or in NNX
(:class:`attnx.nnx.GPT` behind Flax's bridge: the same parameter tree, so analysis, model
files and sampling read either). A variant may bring its own positions
(:class:`Positioned`: a positions study crosses weightings with position encodings).

Attention types without query and key projections (linear attention) can neither rotate nor
take ALiBi, so they keep learned positions (:func:`positions_for`), and take no segment ids, so
they cannot train on packed documents (:func:`takes_segments`). :func:`check_options` names
such a setting, and every other one the GPT would refuse only after data were loaded, as a
ValueError on the ``config.`` key to change.

Example:
  >>> from attnx import nn
  >>> from attnx.nn import lm
  >>> model = dict(num_layers=1, num_heads=2, hidden_dim=16, mlp_dim=32, context=8,
  ...              positions="rotary", dropout_rate=0.0, tie_embeddings=True)
  >>> build = lm.gpt_builder(model, vocab_size=11)
  >>> [build(nn.attention_spec(w)).positions for w in ("softmax", "linear_elu")]
  ['rotary', 'learned']
  >>> build(lm.Positioned(nn.attention_spec("softmax"), "alibi")).positions
  'alibi'
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from attnx import core
from attnx.nn.gpt import GPT
from attnx.nn.gpt_ops import POSITIONS, ROTARY_TYPES
from attnx.nn.spec import attention_spec, resolve_attention

__all__ = ["MODEL_APIS", "Positioned", "attention_of", "check_options", "gpt_builder",
           "positions_for", "takes_segments"]

MODEL_APIS = ("linen", "nnx")


@dataclasses.dataclass(frozen=True)
class Positioned:
  """A variant of a positions study: an attention spec trained with its own positions."""

  attention: Any
  positions: str


def attention_of(spec: Any) -> Any:
  """The attention spec of a variant (a spec, or a :class:`Positioned` one)."""
  return spec.attention if isinstance(spec, Positioned) else spec


def positions_for(spec: Mapping[str, Any] | str, positions: str) -> str:
  """``positions``, except learned positions for attention types that cannot rotate."""
  return positions if resolve_attention(spec)["type"] in ROTARY_TYPES else "learned"


def takes_segments(spec: Mapping[str, Any] | str) -> bool:
  """Whether an attention (spec or variant name) takes packed documents (segment ids): the
  types with a mask, ``"dot"`` and ``"metric"``."""
  return resolve_attention(spec)["type"] in ROTARY_TYPES


def gpt_builder(model: Mapping[str, Any], vocab_size: int, *, api: str = "linen",
                implementation: str | None = None, sequence_axis: str | None = None,
                sequence_layout: str = "contiguous") -> Callable[[Any], Any]:
  """``spec -> GPT`` with the sizes of ``model`` (training context ``model["context"]``).

  Args:
    model: the model config (keys in the module docstring; a ConfigDict or a dict).
    vocab_size: the vocabulary size.
    api: ``"linen"`` (:class:`attnx.nn.GPT`) or ``"nnx"`` (:class:`attnx.nnx.GPT` through
      :func:`attnx.nnx.to_linen`).
    implementation: the attention kernel of the ``"dot"`` and ``"metric"`` types (None:
      automatic); other types take none.
    sequence_axis, sequence_layout: ring attention over that mesh axis (:class:`attnx.nn.GPT`).

  Returns:
    ``build(spec)``: ``spec`` an attention spec (trained with ``model["positions"]``) or a
    :class:`Positioned` one (with its own), each through :func:`positions_for`.
  """
  if api not in MODEL_APIS:
    raise ValueError(f"gpt_builder: api={api!r}; valid: {', '.join(map(repr, MODEL_APIS))}.")

  def build(spec: Any) -> Any:
    positions = spec.positions if isinstance(spec, Positioned) else model["positions"]
    spec = attention_of(spec)
    kind = resolve_attention(spec)["type"]
    kwargs = dict(vocab_size=int(vocab_size), num_layers=model["num_layers"],
                  num_heads=model["num_heads"], hidden_dim=model["hidden_dim"],
                  mlp_dim=model["mlp_dim"], max_len=model["context"], attention=spec,
                  positions=positions_for(spec, positions),
                  tie_embeddings=model["tie_embeddings"], dropout_rate=model["dropout_rate"],
                  implementation=implementation if kind in ROTARY_TYPES else None,
                  sequence_axis=sequence_axis, sequence_layout=sequence_layout)
    if api == "nnx":
      from attnx import nnx as anx  # noqa: PLC0415 (attnx.nnx builds on attnx.nn)

      return anx.to_linen(anx.GPT, **kwargs)
    return GPT(**kwargs)

  return build


def check_options(positions: str, weightings: Sequence[str], *, study: str | Sequence[str] = (),
                  implementation: str = "", api: str = "linen", sequence_parallel: int = 1,
                  sequence_layout: str = "contiguous", context: int | None = None,
                  packing: str = "") -> None:
  """Raises ValueError, naming the ``config.`` key and the valid choices, for a language-model
  setting the GPT cannot train: a bad ``implementation``, ``model_api`` or positions, a
  positions ``study`` (comma-separated or a sequence) with an unknown or repeated entry or a
  weighting that cannot take other positions than learned ones, NNX or packed rows with ring
  attention, packed rows with a weighting that takes no segment ids, or a ``context`` that
  does not split over ``sequence_parallel`` devices (twice as many chunks when zigzag)."""
  if implementation and implementation not in core.IMPLEMENTATIONS:
    raise ValueError(f"config.implementation={implementation!r}; valid: '' (automatic), "
                     f"{', '.join(core.IMPLEMENTATIONS)}.")
  if api not in MODEL_APIS:
    raise ValueError(f"config.model_api={api!r}; valid: 'linen', 'nnx'.")
  sp = int(sequence_parallel)
  if api == "nnx" and sp > 1:
    raise ValueError("config.model_api='nnx' with sequence_parallel > 1: ring attention "
                     "training runs the linen GPT only (model_api='linen').")
  if positions not in POSITIONS:
    raise ValueError(f"config.model.positions={positions!r} is invalid; valid "
                     f"choices: {', '.join(POSITIONS)}.")
  _check_study(study, weightings)
  if packing and (unpackable := [w for w in weightings if not takes_segments(w)]):
    raise ValueError(f"config.packing={packing!r} trains on segment ids, which "
                     f"{', '.join(unpackable)} cannot take (linear attention has no segment "
                     "mask in attnx); leave them out of config.weightings.")
  if packing and sp > 1:
    raise ValueError("config.packing with config.sequence_parallel > 1: ring attention takes no "
                     "segment ids in attnx.nn yet; train packed rows on one device per "
                     "sequence.")
  cut = sp * (2 if sequence_layout == "zigzag" else 1)
  if sp > 1 and context is not None and context % cut:
    raise ValueError(f"config.model.context={context} must be a multiple of "
                     f"{cut} to split over config.sequence_parallel={sp} devices "
                     f"({sequence_layout} layout).")


def _check_study(study: str | Sequence[str], weightings: Sequence[str]) -> None:
  text = study if isinstance(study, str) else ",".join(study)
  kinds = [p.strip() for p in text.split(",") if p.strip()]
  if bad := [p for p in kinds if p not in POSITIONS]:
    raise ValueError(f"config.position_study names {', '.join(map(repr, bad))}; valid "
                     f"positions: {', '.join(POSITIONS)}.")
  if len(set(kinds)) != len(kinds):
    raise ValueError(f"config.position_study={text!r} names a position twice.")
  if kinds and (fixed := [w for w in weightings
                          if positions_for(attention_spec(w), "rotary") != "rotary"]):
    raise ValueError(f"config.position_study: {', '.join(fixed)} cannot take other positions "
                     "than learned ones (linear attention); leave them out of config.weightings.")
