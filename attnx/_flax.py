"""Imported first by attnx's Flax packages (``attnx.nn``, ``attnx.nnx``, ``attnx.train``,
``attnx.analysis``): a flax that cannot import with the installed jax raises an ImportError
that says which flax to install (:func:`attnx._compat.check_flax`), before flax's own error
about a JAX internal."""

from attnx import _compat

_compat.check_flax()
