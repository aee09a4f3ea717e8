"""TFDS catalog datasets that `attnx.data.load` supports by name.

They are never downloaded by attnx (this code must work offline): prepare them
on a machine with internet access in array_record format, e.g.

    tfds build mnist --file_format=array_record

and copy `~/tensorflow_datasets/mnist` into the TFDS data dir used here
(`data_dir=` argument, else `$TFDS_DATA_DIR`, else `~/tensorflow_datasets`).
Images become float32 in [0, 1] ("image" -> "inputs"), labels int32
("label" -> "targets"); imdb_reviews text becomes byte tokens (LRA "Text"
style: id = byte + 1, PAD = 0, truncated/padded to `max_length`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from attnx.data._base import DatasetInfo


class DatasetNotFoundError(FileNotFoundError):
  """A catalog dataset is not prepared in the data dir (attnx never downloads)."""


@dataclasses.dataclass(frozen=True)
class CatalogSpec:
  """Static metadata of a supported catalog dataset (usable without its files)."""

  kind: str  # "image" | "text"
  input_shape: tuple[int, ...]
  num_classes: int
  splits: dict[str, int]
  description: str
  defaults: dict[str, Any] = dataclasses.field(default_factory=dict)


CATALOG: dict[str, CatalogSpec] = {
  "mnist": CatalogSpec(
    "image", (28, 28, 1), 10, {"train": 60000, "test": 10000}, "MNIST handwritten digits."
  ),
  "fashion_mnist": CatalogSpec(
    "image", (28, 28, 1), 10, {"train": 60000, "test": 10000}, "Fashion-MNIST (Zalando)."
  ),
  "cifar10": CatalogSpec(
    "image", (32, 32, 3), 10, {"train": 50000, "test": 10000}, "CIFAR-10 natural images."
  ),
  "imdb_reviews": CatalogSpec(
    "text",
    (1000,),
    2,
    {"train": 25000, "test": 25000, "unsupervised": 50000},
    "IMDB movie reviews, byte-level tokens (LRA 'Text' task uses 1000-4000 bytes).",
    {"max_length": 1000},
  ),
}

BYTE_VOCAB_SIZE = 257  # PAD=0, byte b -> b + 1


def catalog_params(name: str, **kwargs: Any) -> dict[str, Any]:
  """Validates catalog kwargs against the dataset's defaults."""
  spec = CATALOG[name]
  unknown = sorted(set(kwargs) - set(spec.defaults))
  if unknown:
    raise ValueError(
      f"Unknown config kwarg(s) {unknown} for catalog dataset {name!r}; valid keys: "
      f"{sorted(spec.defaults)}."
    )
  params = {**spec.defaults, **kwargs}
  if "max_length" in params:
    params["max_length"] = int(params["max_length"])
    if params["max_length"] < 1:
      raise ValueError(f"max_length must be >= 1, got {params['max_length']}.")
  return params


def catalog_info(name: str, splits: dict[str, int] | None = None, **kwargs: Any) -> DatasetInfo:
  spec = CATALOG[name]
  params = catalog_params(name, **kwargs)
  if spec.kind == "image":
    return DatasetInfo(
      name=name,
      task="classification",
      input_shape=spec.input_shape,
      input_dtype="float32",
      num_classes=spec.num_classes,
      vocab_size=None,
      target_vocab_size=None,
      seq_len=None,
      splits=dict(splits or spec.splits),
      description=spec.description,
    )
  max_length = params["max_length"]
  return DatasetInfo(
    name=name,
    task="classification",
    input_shape=(max_length,),
    input_dtype="int32",
    num_classes=spec.num_classes,
    vocab_size=BYTE_VOCAB_SIZE,
    target_vocab_size=None,
    seq_len=max_length,
    splits=dict(splits or spec.splits),
    description=spec.description,
    extras={"pad_id": 0, "keys": ["inputs", "targets", "mask"]},
  )


def encode_bytes(text: bytes | str, max_length: int) -> tuple[np.ndarray, np.ndarray]:
  """Byte tokens (id = byte + 1) padded with 0 to `max_length`, and the mask."""
  if isinstance(text, str):
    text = text.encode("utf-8")
  raw = np.frombuffer(bytes(text)[:max_length], dtype=np.uint8).astype(np.int32) + 1
  ids = np.zeros((max_length,), np.int32)
  ids[: raw.size] = raw
  return ids, ids > 0


def make_postprocess(name: str, **kwargs: Any):
  """Per-example function mapping a TFDS catalog example to attnx's keys."""
  spec = CATALOG[name]
  params = catalog_params(name, **kwargs)

  if spec.kind == "image":

    def post_image(ex: dict[str, Any]) -> dict[str, np.ndarray]:
      image = np.asarray(ex["image"])
      if image.ndim == 2:
        image = image[..., None]
      return {
        "inputs": image.astype(np.float32) / np.float32(255.0),
        "targets": np.asarray(ex["label"], np.int32),
      }

    return post_image

  max_length = params["max_length"]

  def post_text(ex: dict[str, Any]) -> dict[str, np.ndarray]:
    text = ex["text"]
    if isinstance(text, np.ndarray):
      text = text.item()
    ids, mask = encode_bytes(text, max_length)
    return {"inputs": ids, "targets": np.asarray(ex["label"], np.int32), "mask": mask}

  return post_text


def not_found_message(name: str, data_dir: str, reason: str = "") -> str:
  return (
    f"Catalog dataset {name!r} is not prepared (array_record format) in the TFDS data dir "
    f"{data_dir!r}{': ' + reason if reason else ''}. attnx never downloads data. To "
    f"prepare it, run `tfds build {name} --file_format=array_record` on a machine with "
    f"internet access and copy ~/tensorflow_datasets/{name} into {data_dir!r} (or pass "
    f"data_dir= / --config.data_dir=, or set $TFDS_DATA_DIR). Datasets attnx builds "
    f"itself work offline: see attnx.data.list_datasets()."
  )
