"""attnx.data.paths: the data dirs, below the builders and the loader (which re-export them);
no builder imports the loader, so attnx.data has no import cycle (char_lm, which reads the
text datasets through the loader, sits above it)."""

from __future__ import annotations

import ast
import os

import attnx.data as D
from attnx.data import loader, paths

DATA = os.path.dirname(os.path.abspath(paths.__file__))


def test_data_dirs_argument_then_environment_then_default(monkeypatch):
  for fn, env, default in ((paths.attnx_data_dir, "ATTNX_DATA_DIR",
                            os.path.join(".cache", "attnx", "tensorflow_datasets")),
                           (paths.catalog_data_dir, "TFDS_DATA_DIR", "tensorflow_datasets")):
    monkeypatch.delenv(env, raising=False)
    assert fn() == os.path.join(os.path.expanduser("~"), default)
    monkeypatch.setenv(env, "/from/env")
    assert fn() == "/from/env"
    assert fn("/x/../y") == "/y"  # the argument wins, normalized


def test_loader_and_package_re_export_the_same_functions():
  for name in ("attnx_data_dir", "catalog_data_dir"):
    assert getattr(loader, name) is getattr(paths, name) is getattr(D, name)


def test_no_module_below_the_loader_imports_it():
  above = {"__init__.py", "loader.py", "char_lm.py"}  # char_lm reads datasets through the loader
  for name in sorted(os.listdir(DATA)):
    if not name.endswith(".py") or name in above:
      continue
    with open(os.path.join(DATA, name)) as f:
      tree = ast.parse(f.read())
    mods = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    mods |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    mods |= {f"{n.module}.{a.name}" for n in ast.walk(tree)
             if isinstance(n, ast.ImportFrom) and n.module for a in n.names}
    assert not {m for m in mods if m in ("attnx.data.loader", "attnx.data")}, name
