"""attnx.nn: Flax linen modules built on ``attnx.core``.

Every attention system of the source documents as a module whose weighting F and score s are
chosen by name; models take an ``attention`` dict (see :func:`attention_spec`), so softmax can
be swapped for ReLU, sigmoid, sparsemax, a kernel or a learned metric by changing one string.
"""

from attnx import _flax  # noqa: F401  (first: a flax too old for this jax says so)
from attnx.nn import lm  # a namespace: lm.gpt_builder, ...
from attnx.nn.additive import AdditiveAttention, LuongAttention
from attnx.nn.attention import MultiHeadAttention
from attnx.nn.channel_spatial import CBAM, SmallCNN, SqueezeExcite
from attnx.nn.gpt import GPT, generate, gpt_from_spec, load_model_spec, save_model_spec
from attnx.nn.linear import LinearAttention, redraw_features
from attnx.nn.metric import MetricAttention
from attnx.nn.nadaraya_watson import NadarayaWatsonRegressor, leave_one_out_mse
from attnx.nn.rnn_seq2seq import RNNSeq2Seq
from attnx.nn.rotary import apply_rotary
from attnx.nn.seq2seq import Seq2Seq, greedy_decode
from attnx.nn.sequence import SequenceClassifier, SequenceRegressor
from attnx.nn.similarity import SimilarityAveraging
from attnx.nn.spec import (
    attention_spec,
    list_attention_variants,
    make_attention,
    resolve_attention,
)
from attnx.nn.transformer import (
    Decoder,
    DecoderBlock,
    Encoder,
    EncoderBlock,
    LearnedPositionEmbedding,
    MlpBlock,
    SinusoidalPositionEmbedding,
)
from attnx.nn.vit import VisionTransformer

__all__ = [
    "CBAM", "GPT", "AdditiveAttention", "Decoder", "DecoderBlock", "Encoder", "EncoderBlock",
    "LearnedPositionEmbedding", "LinearAttention", "LuongAttention", "MetricAttention",
    "MlpBlock", "MultiHeadAttention", "NadarayaWatsonRegressor", "RNNSeq2Seq", "Seq2Seq",
    "SequenceClassifier", "SequenceRegressor", "SimilarityAveraging",
    "SinusoidalPositionEmbedding", "SmallCNN",
    "SqueezeExcite", "VisionTransformer", "apply_rotary", "attention_spec", "generate",
    "gpt_from_spec", "greedy_decode", "leave_one_out_mse", "list_attention_variants",
    "load_model_spec",
    "make_attention", "redraw_features", "resolve_attention", "save_model_spec",
    "lm",
]
