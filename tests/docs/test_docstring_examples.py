"""The ``>>>`` examples in attnx's docstrings run and print what they show.

Every module of the attnx package (``pkgutil.walk_packages``) is searched with
``doctest.DocTestFinder``; each module that has examples is one test case, run with
``ELLIPSIS | NORMALIZE_WHITESPACE`` and failing on any failed example. A floor on the number of
such modules keeps a finder that silently finds nothing (a renamed package, examples turned
into plain text) from passing.
"""

from __future__ import annotations

import doctest
import importlib
import pkgutil

import pytest

import attnx

OPTIONFLAGS = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE

# The modules that carry examples: attnx.core (dispatch, weightings, scores, ring), attnx.nn
# (attention, gpt, spec), attnx.data (loader, listops), attnx.train (loop, data) and
# attnx.analysis (stats). Raise it when examples are added to another module.
MIN_MODULES_WITH_EXAMPLES = 12


def _raise(name: str) -> None:
  raise ImportError(f"walking the attnx package: cannot import {name}")


def _module_names() -> list[str]:
  return sorted(m.name for m in pkgutil.walk_packages(attnx.__path__, "attnx.", onerror=_raise))


def _doctests(name: str) -> list[doctest.DocTest]:
  module = importlib.import_module(name)
  tests = doctest.DocTestFinder(exclude_empty=True).find(module, name)
  return sorted((t for t in tests if t.examples), key=lambda t: t.name)


_WITH_EXAMPLES = [name for name in _module_names() if _doctests(name)]


def test_the_finder_sees_every_module_with_examples():
  assert len(_WITH_EXAMPLES) >= MIN_MODULES_WITH_EXAMPLES, (
      f"doctest found examples in {len(_WITH_EXAMPLES)} modules, expected at least "
      f"{MIN_MODULES_WITH_EXAMPLES}: {_WITH_EXAMPLES}")


@pytest.mark.parametrize("name", _WITH_EXAMPLES)
def test_docstring_examples(name):
  runner = doctest.DocTestRunner(optionflags=OPTIONFLAGS)
  report: list[str] = []
  for test in _doctests(name):
    runner.run(test, out=report.append)
  results = runner.summarize(verbose=False)
  assert results.failed == 0, (
      f"{results.failed} of {results.attempted} examples failed in {name}:\n" + "".join(report))
