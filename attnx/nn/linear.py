"""Linear attention (Katharopoulos et al. 2020; FAVOR+ of Choromanski et al. 2020).

out_i = φ(q_i)ᵀ Σ_j φ(k_j) v_jᵀ / φ(q_i)ᵀ Σ_j φ(k_j): the weighting F(q·k) is replaced by a
feature-map inner product φ(q)·φ(k), so the cost is linear in the sequence length. The kernel
is ``core.linear_attention``; this module owns the projections and, for FAVOR+, the random
feature matrix ω [M, H], stored as a non-trainable variable in the ``"favor"`` collection so it
can be redrawn during training (``redraw=True`` or :func:`redraw_features`).
"""

from __future__ import annotations

import functools
from typing import Any

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp

from attnx import core
from attnx.nn import _util

Array = jax.Array

FEATURE_MAPS = ("elu_plus_one", "favor_plus")
FAVOR_COLLECTION = "favor"


class LinearAttention(nn.Module, kw_only=True):
  """Multi-head linear attention with the flax MHA projection layout (query/key/value/out).

  Attributes:
    num_heads: heads N.
    qkv_features: total q/k/v width (default: input features), divisible by N.
    out_features: output width (default: input features).
    feature_map: ``"elu_plus_one"`` (elu(x) + 1) or ``"favor_plus"`` (positive random
      features approximating softmax).
    num_features: FAVOR+ random features M (default: core's default, 256).
    is_causal: causal (prefix-sum) linear attention.
    use_bias, dtype, param_dtype, kernel_init: as in flax.
  """

  num_heads: int
  qkv_features: int | None = None
  out_features: int | None = None
  feature_map: str = "elu_plus_one"
  num_features: int | None = None
  is_causal: bool = False
  use_bias: bool = True
  dtype: Any = None
  param_dtype: Any = jnp.float32
  kernel_init: Any = nn.linear.default_kernel_init

  def __post_init__(self):
    where = type(self).__name__
    if self.feature_map not in FEATURE_MAPS:
      raise ValueError(f"{where}: unknown feature_map {self.feature_map!r}; valid: "
                       f"{', '.join(FEATURE_MAPS)}.")
    _util.check_heads(self.qkv_features or self.num_heads, self.num_heads, None, where)
    if self.num_features is not None and self.num_features <= 0:
      raise ValueError(f"{where}: num_features must be positive, got {self.num_features}.")
    super().__post_init__()

  @nn.compact
  def __call__(self, inputs_q: Array, inputs_kv: Array | None = None, *,
               mask: Array | None = None, bias: Array | None = None,
               deterministic: bool = True, decode: bool = False, redraw: bool = False,
               return_weights: bool = False) -> Array:
    """``inputs_q [B, T, Dq]``, ``inputs_kv [B, S, Dkv]`` -> ``[B, T, out_features]``.

    Args:
      mask: the mask of every ``attnx.nn`` attention module — boolean (or 0/1 float),
        broadcastable to ``[B, N, T, S]``, True = attend — restricted to what linear attention
        can express: a key padding mask, of size 1 along N and T (e.g. ``[B, 1, 1, S]``).
        Other masks do not factorize and raise (causality: ``is_causal``).
      deterministic: unused (no dropout on implicit weights); kept for a uniform interface.
      redraw: draw a fresh ω from the ``"favor"`` RNG stream (needs ``mutable=["favor"]``).
      bias, decode, return_weights: not supported (linear attention never forms the T×S
        weights and keeps no KV cache); accepted only to raise a clear error.
    """
    del deterministic
    where = type(self).__name__
    _util.check_no_decode(decode, where)
    if bias is not None or return_weights:
      raise ValueError(f"{where} never forms the [T, S] weights: score bias and "
                       "return_weights are not supported; use attention type 'dot'.")
    if inputs_kv is None:
      inputs_kv = inputs_q
    chex.assert_rank([inputs_q, inputs_kv], 3)  # core.linear_attention is [B, T, N, H]
    chex.assert_equal_shape_prefix([inputs_q, inputs_kv], 1)
    features = self.out_features or inputs_q.shape[-1]
    qkv_features = self.qkv_features or inputs_q.shape[-1]
    _util.check_heads(qkv_features, self.num_heads, None, type(self).__name__)
    head_dim = qkv_features // self.num_heads
    dense = functools.partial(
        nn.DenseGeneral, axis=-1, features=(self.num_heads, head_dim), dtype=self.dtype,
        param_dtype=self.param_dtype, kernel_init=self.kernel_init, use_bias=self.use_bias)
    q = dense(name="query")(inputs_q)
    k = dense(name="key")(inputs_kv)
    v = dense(name="value")(inputs_kv)
    kw: dict[str, Any] = dict(feature_map=self.feature_map, is_causal=self.is_causal)
    if self.feature_map == "favor_plus":
      m = self.num_features or _default_num_features(head_dim)
      omega = self.variable(FAVOR_COLLECTION, "omega",
                            lambda: core.favor_features(self.make_rng("params"), m, head_dim))
      if redraw:
        omega.value = core.favor_features(self.make_rng(FAVOR_COLLECTION), m, head_dim)
      kw["features"] = omega.value
    if mask is not None:
      kw["key_mask"] = _key_padding(_util.as_bool_mask(mask), inputs_q.shape[0],
                                    self.num_heads, inputs_q.shape[1], inputs_kv.shape[1])
    x = core.linear_attention(q, k, v, **kw)
    return nn.DenseGeneral(features=features, axis=(-2, -1), use_bias=self.use_bias,
                           dtype=self.dtype, param_dtype=self.param_dtype,
                           kernel_init=self.kernel_init, name="out")(x)


def _key_padding(mask: Array, b: int, n: int, t: int, s: int) -> Array:
  """A mask broadcastable to [B, N, T, S] that is constant over N and T -> key mask [B, S]."""
  full = (b, n, t, s)
  ok = mask.ndim <= 4
  if ok:
    m = mask.reshape((1,) * (4 - mask.ndim) + mask.shape)
    ok = m.shape[1] == m.shape[2] == 1 and all(d in (1, f) for d, f in zip(m.shape, full,
                                                                           strict=True))
  if not ok:
    raise ValueError(f"LinearAttention takes only key padding masks: size 1 along heads and "
                     f"queries, broadcastable to [B, 1, 1, S] = {(b, 1, 1, s)} (True = attend); "
                     f"got {mask.shape}. A general [T, S] mask does not factorize through the "
                     "feature map (for causality use is_causal=True).")
  return jnp.broadcast_to(m[:, 0, 0, :], (b, s))


def _default_num_features(head_dim: int) -> int:
  # core's default (256); few features give large FAVOR+ errors (docs/references.md).
  del head_dim
  return getattr(core.linear, "DEFAULT_NUM_FEATURES", 256)


def redraw_features(variables: Any, rng: Array) -> Any:
  """Returns ``variables`` with every FAVOR+ ω in the ``"favor"`` collection redrawn.

  Works for any model containing :class:`LinearAttention` layers (each layer gets its own key);
  shapes are kept, so jitted train steps do not recompile.
  """
  if FAVOR_COLLECTION not in variables:
    return variables
  leaves, treedef = jax.tree_util.tree_flatten(variables[FAVOR_COLLECTION])
  keys = jax.random.split(rng, max(len(leaves), 1))
  new = [core.favor_features(kk, *leaf.shape[-2:]).astype(leaf.dtype).reshape(leaf.shape)
         if leaf.ndim == 2 else _redraw_stacked(kk, leaf) for kk, leaf in zip(keys, leaves,
                                                                              strict=False)]
  out = dict(variables)
  out[FAVOR_COLLECTION] = jax.tree_util.tree_unflatten(treedef, new)
  return out


def _redraw_stacked(key: Array, leaf: Array) -> Array:
  """ω stacked over leading axes (vmapped seeds, scanned layers): one draw per slice."""
  lead = leaf.shape[:-2]
  keys = jax.random.split(key, int(jnp.prod(jnp.array(lead))))
  draw = jax.vmap(lambda kk: core.favor_features(kk, *leaf.shape[-2:]))(keys)
  return draw.reshape(leaf.shape).astype(leaf.dtype)
