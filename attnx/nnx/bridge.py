"""Training NNX models with :mod:`attnx.train`: the linen face of an NNX model.

:func:`attnx.train.fit` (and the experiments) call a model the linen way: ``init`` per seed,
``apply`` with the parameters. Flax's bridge gives an NNX model that face
(``flax.nnx.bridge.to_linen``: the NNX module is built from its class and arguments inside
``init``, split into its state and merged back inside every ``apply``), so fit trains an NNX
model with everything a linen one gets: seeds by vmap, data parallelism, checkpoints that
resume bit-identical, evaluators, reports. :func:`to_linen` is that bridge for attnx's models;
:func:`linen_twin` gives the linen model with the same parameters, which the analysis probes
(the attention statistics, the model file, sampling) read: the parameter trees of
:mod:`attnx.nnx` and :mod:`attnx.nn` models are the same by construction.
"""

from __future__ import annotations

from typing import Any

from flax.nnx import bridge

from attnx import nn as linen_nn
from attnx.nnx.gpt import GPT
from attnx.nnx.vit import VisionTransformer

# NNX model -> (its linen twin, the NNX-only arguments the twin does not take).
_TWINS: dict[type, tuple[type, tuple[str, ...]]] = {
    GPT: (linen_nn.GPT, ()),
    VisionTransformer: (linen_nn.VisionTransformer, ("image_size", "in_channels")),
}


def to_linen(nnx_class: type, /, **kwargs: Any) -> bridge.ToLinen:
  """The linen module :func:`attnx.train.fit` trains for NNX model ``nnx_class(**kwargs,
  rngs=...)`` (``flax.nnx.bridge.to_linen``; each seed's ``rngs`` come from fit's keys).

  Example:
    >>> import numpy as np
    >>> from attnx import nnx as anx, train
    >>> model = anx.to_linen(anx.GPT, vocab_size=16, num_layers=1, num_heads=2, hidden_dim=16,
    ...                      mlp_dim=32, max_len=8, attention="relu")
    >>> tokens = np.random.default_rng(0).integers(0, 16, (32, 9)).astype(np.int32)
    >>> arrays = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
    >>> config = train.FitConfig(num_steps=4, num_seeds=2, log_every=2, progress=False,
    ...                          tensorboard=False, optimizer=train.optimizer_config())
    >>> result = train.fit(model, train_data=train.loader(arrays, 8), config=config)
    >>> sorted(result.params)[:2], result.seeds
    (['block_0', 'embed'], [0, 1])
  """
  if not isinstance(nnx_class, type):
    raise TypeError(f"to_linen takes an NNX model class and its arguments (to_linen(anx.GPT, "
                    f"...)), not {type(nnx_class).__name__}: fit builds one model per seed.")
  if "rngs" in kwargs:
    raise ValueError("to_linen: leave out rngs; fit gives each seed its own.")
  return bridge.to_linen(nnx_class, **kwargs)


def is_nnx(model: Any) -> bool:
  """Whether ``model`` is an NNX model behind Flax's bridge (:func:`to_linen`).

  Example:
    >>> from attnx import nn, nnx as anx
    >>> kw = dict(num_classes=3, attention="relu")
    >>> anx.is_nnx(anx.to_linen(anx.VisionTransformer, image_size=8, in_channels=1, **kw))
    True
    >>> anx.is_nnx(nn.VisionTransformer(**kw))
    False
  """
  return isinstance(model, bridge.ToLinen)


def linen_twin(model: Any) -> Any:
  """The :mod:`attnx.nn` model with the same arguments and parameter tree as the NNX model
  behind ``model`` (:func:`to_linen`), or ``model`` itself when it is not one.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from attnx import nnx as anx
    >>> model = anx.to_linen(anx.GPT, vocab_size=16, num_layers=1, num_heads=2, hidden_dim=16,
    ...                      mlp_dim=32, max_len=8, positions="rotary")
    >>> tokens = jnp.zeros((1, 8), jnp.int32)
    >>> params = model.init(jax.random.key(0), tokens)["params"]
    >>> twin = anx.linen_twin(model)
    >>> type(twin).__name__, bool(jnp.allclose(twin.apply({"params": params}, tokens),
    ...                                         model.apply({"params": params}, tokens),
    ...                                         atol=1e-5))
    ('GPT', True)
  """
  if not is_nnx(model):
    return model
  if model.nnx_class not in _TWINS:
    raise ValueError(f"{model.nnx_class.__name__} has no linen twin in attnx.nn; the analysis "
                     f"that reads one needs an attnx.nnx model of "
                     f"{', '.join(c.__name__ for c in _TWINS)}.")
  cls, drop = _TWINS[model.nnx_class]
  return cls(**{k: v for k, v in dict(model.kwargs).items() if k not in drop})
