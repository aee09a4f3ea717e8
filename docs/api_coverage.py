"""Sphinx extension: the API reference documents every public name, each with a docstring.

The public names of a module are its ``__all__``. At the end of a build this compares them with
the objects the Python domain registered (``.. autofunction::``, ``.. autoclass::``,
``.. autodata::`` and autosummary entries) and warns for each name that is missing or has no
docstring; ``sphinx-build -W`` turns the warnings into a failed build. ``tests/docs`` runs the
same comparison on the API pages' source without building.
"""

from __future__ import annotations

import importlib
import inspect

# The packages whose public names the API reference must cover.
PACKAGES = ("attnx.core", "attnx.nn", "attnx.nnx", "attnx.data", "attnx.train",
            "attnx.train.benchmark", "attnx.analysis")


def public_names(package: str) -> list[str]:
  """The names ``package`` exports: its ``__all__``."""
  module = importlib.import_module(package)
  names = getattr(module, "__all__", None)
  if names is None:
    raise ValueError(f"{package} defines no __all__; the API reference cannot know its names")
  return list(names)


def missing_docstrings(package: str) -> list[str]:
  """Public names of ``package`` whose object carries no docstring of its own."""
  module = importlib.import_module(package)
  out = []
  for name in public_names(package):
    obj = getattr(module, name)
    if inspect.ismodule(obj) or callable(obj) or inspect.isclass(obj):
      doc = inspect.getdoc(obj)
      if not doc or not doc.strip():
        out.append(name)
  return out


def _check(app, exception):
  if exception is not None:
    return
  from sphinx.util import logging
  logger = logging.getLogger(__name__)
  documented = set(app.env.get_domain("py").objects)
  for package in PACKAGES:
    for name in public_names(package):
      if f"{package}.{name}" not in documented:
        logger.warning("API reference: %s.%s is public but not documented", package, name)
    for name in missing_docstrings(package):
      logger.warning("API reference: %s.%s has no docstring", package, name)


def _drop_type_docstrings(app, what, name, obj, options, lines):
  """A constant's own docstring is its type's (int, tuple, dict): not about the constant.

  The constant's description is written on its API page instead. ``==``, not ``is``: a built-in
  type's ``__doc__`` is a new string each time.
  """
  del app, name, options
  if what == "data" and type(obj).__doc__ is not None and obj.__doc__ == type(obj).__doc__:
    lines.clear()


def setup(app):
  app.connect("autodoc-process-docstring", _drop_type_docstrings)
  app.connect("build-finished", _check)
  return {"parallel_read_safe": True, "parallel_write_safe": True}
