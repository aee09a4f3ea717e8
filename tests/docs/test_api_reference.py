"""The API reference (docs/api/*.md) documents exactly the public names, each with a docstring.

The public names of a package are its ``__all__`` (``public_names`` of docs/api_coverage.py, the
Sphinx extension that runs the same comparison on the built site). Each package has one page,
docs/api/<name>.md for attnx.<name>; its directives are read from the page's source, without
building: ``autofunction``/``autoclass``/``autoexception``/``autodata``/``automodule`` entries
(which render the docstrings) and ``autosummary`` tables, in ``{eval-rst}`` blocks or in MyST
directive syntax, each name resolved against the page's ``currentmodule``. Every public name
must be described by an entry and listed in a table, no page may document a name that is not
public, and every public object must have a docstring of its own.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
API_DIR = os.path.join(ROOT, "docs", "api")

# Directives that describe one object (and render its docstring).
DESCRIBE = ("autofunction", "autoclass", "autoexception", "autodata", "automodule")
# Directives nested in a class description, for its methods and properties.
MEMBER = ("automethod", "autoproperty", "autoattribute")


def _api_coverage():
  path = os.path.join(ROOT, "docs", "api_coverage.py")
  spec = importlib.util.spec_from_file_location("api_coverage", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


api_coverage = _api_coverage()
PACKAGES = api_coverage.PACKAGES

# `.. name:: argument` (reST, any indentation) or ```{name} argument (MyST).
_RST = re.compile(r"^(?P<indent> *)\.\. (?:py:)?(?P<name>[\w-]+)::[ \t]*(?P<arg>\S*)\s*$")
_MYST = re.compile(r"^(?P<indent> *)(?P<fence>`{3,}|:{3,})\{(?:py:)?(?P<name>[\w-]+)\}[ \t]*"
                   r"(?P<arg>\S*)\s*$")


def parse_page(text: str) -> list[tuple[str, str, str | None]]:
  """(directive, full name, class) for every object a page names, in page order.

  Names are resolved against the ``currentmodule`` (or ``module``/``automodule``) in effect;
  autosummary entries are the lines of the directive's body; member directives nested in an
  ``autoclass`` carry that class's full name as the third item.
  """
  lines = text.splitlines()
  module = None
  klass: tuple[int, str] | None = None  # (indent, full name) of the enclosing autoclass
  out: list[tuple[str, str, str | None]] = []

  def full(name: str) -> str:
    if name.startswith("attnx.") or module is None:
      return name
    return f"{module}.{name}"

  i = 0
  while i < len(lines):
    line = lines[i]
    m = _RST.match(line) or _MYST.match(line)
    i += 1
    if not m:
      if klass is not None and line.strip() and len(line) - len(line.lstrip()) <= klass[0]:
        klass = None
      continue
    indent, name, arg = len(m.group("indent")), m.group("name"), m.group("arg")
    if klass is not None and indent <= klass[0]:
      klass = None
    if name in ("currentmodule", "module"):
      module = None if arg == "None" else arg
    elif name in DESCRIBE:
      out.append((name, full(arg), None))
      if name == "automodule":
        module = arg
      klass = (indent, full(arg)) if name in ("autoclass", "autoexception") else None
    elif name in MEMBER:
      out.append((name, arg, klass[1] if klass else None))
    elif name == "autosummary":
      # Options (":nosignatures:"), then the entries, up to the end of the indented body or
      # of the MyST fence.
      fence = m.groupdict().get("fence")
      while i < len(lines):
        entry = lines[i]
        if fence and entry.strip().startswith(fence[0] * 3):
          i += 1
          break
        if not fence and entry.strip() and len(entry) - len(entry.lstrip()) <= indent:
          break
        i += 1
        word = entry.strip()
        if word and not word.startswith(":") and not word.startswith(".."):
          out.append(("autosummary", full(word.lstrip("~")), None))
  return out


def _page(package: str) -> str:
  return os.path.join(API_DIR, package.rpartition(".")[2] + ".md")


def _entries(package: str) -> list[tuple[str, str, str | None]]:
  with open(_page(package), encoding="utf-8") as f:
    return parse_page(f.read())


def test_every_package_has_a_page():
  assert sorted(os.path.basename(_page(p)) for p in PACKAGES) == sorted(
      f for f in os.listdir(API_DIR) if f.endswith(".md"))


@pytest.mark.parametrize("package", PACKAGES)
def test_every_public_name_is_described_and_listed(package):
  entries = _entries(package)
  described = {name for kind, name, _ in entries if kind in DESCRIBE}
  listed = {name for kind, name, _ in entries if kind == "autosummary"}
  public = api_coverage.public_names(package)
  page = os.path.relpath(_page(package), ROOT)
  not_described = [n for n in public if f"{package}.{n}" not in described]
  not_listed = [n for n in public if f"{package}.{n}" not in listed]
  assert not not_described, (
      f"{page} has no autofunction/autoclass/autodata/automodule entry for these public names "
      f"of {package}: {not_described}")
  assert not not_listed, f"{page} lists these public names of {package} in no autosummary: " \
                         f"{not_listed}"


@pytest.mark.parametrize("package", PACKAGES)
def test_pages_document_only_public_names(package):
  public = {f"{package}.{n}" for n in api_coverage.public_names(package)}
  entries = [(kind, name) for kind, name, _ in _entries(package) if kind not in MEMBER]
  extra = sorted({f"{kind} {name}" for kind, name in entries if name not in public})
  assert not extra, (
      f"{os.path.relpath(_page(package), ROOT)} documents names that are not in "
      f"{package}.__all__ (document each object under its public path, "
      f"e.g. attnx.core.attention): {extra}")


@pytest.mark.parametrize("package", PACKAGES)
def test_no_object_is_described_twice(package):
  described = [name for kind, name, _ in _entries(package) if kind in DESCRIBE]
  twice = sorted({n for n in described if described.count(n) > 1})
  assert not twice, f"described more than once (a duplicate object description): {twice}"


@pytest.mark.parametrize("package", PACKAGES)
def test_member_entries_name_members_of_their_class(package):
  missing = []
  for kind, name, klass in _entries(package):
    if kind not in MEMBER:
      continue
    if klass is None:
      missing.append(f"{kind} {name} (not inside an autoclass)")
      continue
    module_name, _, class_name = klass.rpartition(".")
    cls = getattr(importlib.import_module(module_name), class_name)
    if not hasattr(cls, name):
      missing.append(f"{kind} {klass}.{name}")
    elif not inspect.getdoc(inspect.getattr_static(cls, name)):
      missing.append(f"{kind} {klass}.{name} (no docstring)")
  assert not missing, f"bad member entries: {missing}"


@pytest.mark.parametrize("package", PACKAGES)
def test_every_public_object_has_a_docstring(package):
  assert api_coverage.missing_docstrings(package) == []


def test_the_parser_reads_both_syntaxes():
  page = "\n".join([
      "```{eval-rst}", ".. currentmodule:: attnx.core", "", ".. autosummary::", "   :nosignatures:",
      "", "   attention", "   ~attnx.core.weights", "", ".. autoclass:: Score", "",
      "   .. automethod:: __call__", "", ".. autofunction:: attention", "```", "",
      "```{autodata} IMPLEMENTATIONS", "```", "```{autosummary}", "dot", "```"])
  assert parse_page(page) == [
      ("autosummary", "attnx.core.attention", None), ("autosummary", "attnx.core.weights", None),
      ("autoclass", "attnx.core.Score", None), ("automethod", "__call__", "attnx.core.Score"),
      ("autofunction", "attnx.core.attention", None),
      ("autodata", "attnx.core.IMPLEMENTATIONS", None), ("autosummary", "attnx.core.dot", None)]
