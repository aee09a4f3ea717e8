"""attnx in Flax NNX: native NNX modules that run the same functions as :mod:`attnx.nn`.

``from attnx import nnx as anx`` (beside ``from flax import nnx``):

* :class:`MultiHeadAttention`: a drop-in for ``flax.nnx.MultiHeadAttention`` with every attnx
  option (weighting F, score s, implementation, GQA, RoPE, masks and segment ids, windows,
  soft-cap, sinks, ALiBi, learned SSMax s, KV cache).
"""

from attnx.nnx.attention import MultiHeadAttention

__all__ = ["MultiHeadAttention"]
