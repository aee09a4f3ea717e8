"""attnx: the mathematics of attention in JAX/Flax.

``attnx.core`` — pure functional kernels with pluggable score s and weighting F;
``attnx.nn`` — Flax linen modules; ``attnx.nnx`` — Flax NNX modules (attention, blocks, GPT,
ViT); ``attnx.data`` — datasets; ``attnx.train`` — experiment machinery;
``attnx.analysis`` — what a trained model's attention does (weights, sinks, sparsity, entropy,
hidden-state kurtosis, heat maps).
"""

__version__ = "0.1.0"
