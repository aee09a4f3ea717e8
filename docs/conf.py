"""Sphinx configuration of the attnx documentation site.

Build it with ``pip install -e ".[docs]" && sphinx-build -W docs docs/_build``. The stack is
the one Flax, Optax, Chex and Orbax use: sphinx-book-theme, MyST markdown (myst-nb, which also
executes the tutorials when the site is built), autodoc + autosummary with napoleon for the API
reference from the docstrings.
"""

from __future__ import annotations

import os
import sys

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(__file__))
# Tutorials train small models on the CPU; never pick up an accelerator or print TPU warnings.
os.environ.setdefault("JAX_PLATFORMS", "cpu")

project = "attnx"
author = "the attnx authors"
copyright = "2026, the attnx authors"
release = "0.1.0"

extensions = [
    "myst_nb",
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "sphinx.ext.napoleon",
    "sphinx.ext.mathjax",
    # MathJax from a registry wheel, copied into _static/mathjax: formulas render offline.
    "sphinx-mathjax-offline",
    "sphinx.ext.viewcode",
    "api_coverage",
]

source_suffix = {".rst": "restructuredtext", ".md": "myst-nb", ".ipynb": "myst-nb"}
exclude_patterns = ["_build", "Thumbs.db", ".DS_Store", "README.md"]
master_doc = "index"

html_theme = "sphinx_book_theme"
html_title = "attnx"
html_theme_options = {
    "show_toc_level": 2,
    "navigation_with_keys": False,
}

# MyST: $...$ math, definition lists, heading anchors for links such as page.md#section.
myst_enable_extensions = ["dollarmath", "amsmath", "colon_fence", "deflist", "attrs_inline"]
myst_heading_anchors = 4

# Tutorials run on every build (CI executes them); ATTNX_DOCS_EXECUTE=off skips them locally.
nb_execution_mode = "off" if os.environ.get("ATTNX_DOCS_EXECUTE") == "off" else "force"
nb_execution_timeout = 600
nb_execution_raise_on_error = True
nb_execution_show_tb = True

autosummary_generate = True
# Empty: Sphinx reads any value here as an override (False would turn "show-inheritance" on).
autodoc_default_options = {}
autodoc_typehints = "signature"
autodoc_member_order = "bysource"
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_rtype = False
add_module_names = False
