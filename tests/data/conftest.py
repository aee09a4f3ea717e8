"""Shared fixtures: one temporary data dir per test session."""

import os
import sys

import pytest

# Make `import attnx` work under plain `pytest` too (python -m pytest adds the cwd).
_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if _REPO not in sys.path:
  sys.path.insert(0, _REPO)


@pytest.fixture(scope="session")
def data_dir(tmp_path_factory):
  """A fresh attnx data dir; tiny configs are prepared into it once per session."""
  return str(tmp_path_factory.mktemp("attnx_tfds"))
