"""attnx in Flax NNX: native NNX modules that run the same functions as :mod:`attnx.nn`.

``from attnx import nnx as anx`` (beside ``from flax import nnx``):

* :class:`MultiHeadAttention`: a drop-in for ``flax.nnx.MultiHeadAttention`` with every attnx
  option (weighting F, score s, implementation, GQA, RoPE, masks and segment ids, windows,
  soft-cap, sinks, ALiBi, learned SSMax s, KV cache).
* :class:`EncoderBlock`, :class:`MlpBlock`, :func:`make_attention`: pre-LN blocks from an
  attention spec (types ``"dot"`` and ``"metric"``).
* :class:`Encoder`: a stack of blocks and a final LayerNorm.
* :class:`GPT`, :func:`gpt_from_spec`: the language model, built from the same kwargs or model
  file as :class:`attnx.nn.GPT`, with its parameter names.
* :class:`VisionTransformer`: the ViT classifier, with the linen model's parameter names.
* :func:`to_linen`, :func:`linen_twin`, :func:`is_nnx`: training an NNX model with
  :func:`attnx.train.fit` (Flax's bridge) and the linen model with the same parameters.
"""

from attnx import _flax  # noqa: F401  (first: a flax too old for this jax says so)
from attnx.nnx.attention import MultiHeadAttention
from attnx.nnx.bridge import is_nnx, linen_twin, to_linen
from attnx.nnx.gpt import GPT, gpt_from_spec
from attnx.nnx.transformer import Encoder, EncoderBlock, MlpBlock, make_attention
from attnx.nnx.vit import VisionTransformer

__all__ = ["GPT", "Encoder", "EncoderBlock", "MlpBlock", "MultiHeadAttention",
           "VisionTransformer", "gpt_from_spec", "is_nnx", "linen_twin", "make_attention",
           "to_linen"]
