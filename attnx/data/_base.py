"""Shared machinery for attnx's own TFDS builders.

Every attnx dataset is a `tfds.core.GeneratorBasedBuilder` written to
array_record (no TensorFlow needed) whose parameters live in a
`tfds.core.BuilderConfig` dataclass. Builders subclass `AttnxBuilder` and
implement three hooks:

* `_features(config)`: the feature dict (name -> TFDS feature connector),
* `_split_sizes(config)`: {split: num_examples},
* `_generate_split(config, split, n, seed)`: a dict of numpy arrays with a
  leading axis of size n (vectorized generation, deterministic given `seed`),

plus `describe(config)` returning the metadata for `attnx.data.get_info`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from typing import Any, ClassVar

import numpy as np
import tensorflow_datasets as tfds

# Keys of `tfds.core.BuilderConfig` that are not dataset parameters.
_TFDS_CONFIG_FIELDS = frozenset(
  ["name", "version", "release_notes", "supported_versions", "description", "tags"]
)
# Fixed ids so that a split's seed does not depend on which other splits exist.
_SPLIT_IDS = {"train": 0, "validation": 1, "test": 2}

TASKS = ("classification", "token_classification", "regression", "seq2seq")


@dataclasses.dataclass
class DatasetInfo:
  """What a model needs to know about a dataset (see `attnx.data.get_info`).

  Attributes:
    name: dataset name as given to `attnx.data.load`.
    task: "classification" | "token_classification" | "regression" | "seq2seq".
    input_shape: shape of one example's "inputs" (no batch axis).
    input_dtype: numpy dtype name of "inputs" ("float32" or "int32").
    num_classes: number of target classes (None for regression).
    vocab_size: input vocabulary size for token inputs (None otherwise).
    target_vocab_size: target vocabulary size (seq2seq), else None.
    seq_len: sequence length of "inputs" (None for non-sequence inputs).
    splits: {split name: number of examples}.
    description: human-readable description.
    config_name: the TFDS builder config name (encodes custom kwargs).
    extras: dataset-specific metadata (vocabularies, target shape, ...).
  """

  name: str
  task: str
  input_shape: tuple[int, ...]
  input_dtype: str
  num_classes: int | None
  vocab_size: int | None
  target_vocab_size: int | None
  seq_len: int | None
  splits: dict[str, int]
  description: str
  config_name: str | None = None
  extras: dict[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(eq=False)
class AttnxConfig(tfds.core.BuilderConfig):
  """Base config: `seed` fixes the generated data (one derived seed per split)."""

  seed: int = 0

  def params(self) -> dict[str, Any]:
    """The dataset parameters (fields other than TFDS bookkeeping)."""
    return {
      f.name: getattr(self, f.name)
      for f in dataclasses.fields(self)
      if f.name not in _TFDS_CONFIG_FIELDS
    }

  def validate(self) -> None:
    """Raises ValueError for inconsistent parameters (override in subclasses)."""


def split_seed(seed: int, split: str) -> int:
  """A deterministic 32-bit seed for (config seed, split)."""
  split_id = _SPLIT_IDS.get(split)
  if split_id is None:
    split_id = int.from_bytes(split.encode()[:8].ljust(8, b"\0"), "little") + 3
  return int(np.random.SeedSequence([int(seed), split_id]).generate_state(1)[0])


def _format_value(value: Any) -> str:
  if isinstance(value, bool):
    return str(value).lower()
  if isinstance(value, float):
    return repr(value)
  if isinstance(value, (tuple, list)):
    return ",".join(_format_value(v) for v in value)
  return str(value)


def _coerce(name: str, value: Any, default: Any) -> Any:
  """Converts `value` to the type of the field's default (e.g. 128.0 -> 128)."""
  try:
    if isinstance(default, bool):
      if isinstance(value, str):
        if value.lower() in ("true", "1", "yes"):
          return True
        if value.lower() in ("false", "0", "no"):
          return False
        raise ValueError(value)
      return bool(value)
    if isinstance(default, int):
      if isinstance(value, float) and not value.is_integer():
        raise ValueError(value)
      return int(value)
    if isinstance(default, float):
      return float(value)
    if isinstance(default, str):
      return str(value)
    if isinstance(default, tuple):
      return tuple(value)
  except (TypeError, ValueError) as e:
    raise ValueError(
      f"Config kwarg {name}={value!r} cannot be converted to {type(default).__name__}."
    ) from e
  return value


class AttnxBuilder(tfds.core.GeneratorBasedBuilder, skip_registration=True):
  """Base class of attnx's own builders (array_record, deterministic generation)."""

  # Bump whenever generation or encoding changes: caches of other versions are ignored.
  VERSION = tfds.core.Version("1.1.0")
  RELEASE_NOTES: ClassVar[dict[str, str]] = {
    "1.0.0": "Initial release.",
    "1.1.0": "Tensors stored with BYTES encoding; final default parameters.",
  }
  DEFAULT_BUILDER_CONFIG_NAME = "default"
  CONFIG_CLASS: ClassVar[type[AttnxConfig]] = AttnxConfig
  HOMEPAGE: ClassVar[str] = ""
  CITATION: ClassVar[str] = ""

  @tfds.core.utils.classproperty
  @classmethod
  def code_path(cls) -> None:
    """No code dir: nothing to download, no checksums (avoids importlib_resources)."""
    return None

  # --- hooks (every dataset defines _features, _generate_split and describe) ----------

  @classmethod
  def _hook_missing(cls, hook: str) -> TypeError:
    return TypeError(f"dataset builder {cls.__name__} does not define {hook}(); every attnx "
                     "dataset defines _features, _generate_split and describe")

  @classmethod
  def _features(cls, config: AttnxConfig) -> dict[str, tfds.features.FeatureConnector]:
    raise cls._hook_missing("_features")

  @classmethod
  def _split_sizes(cls, config: AttnxConfig) -> dict[str, int]:
    return {
      s: int(getattr(config, f"num_{s}"))
      for s in ("train", "validation", "test")
      if int(getattr(config, f"num_{s}", 0)) > 0
    }

  @classmethod
  def _generate_split(
    cls, config: AttnxConfig, split: str, n: int, seed: int
  ) -> Mapping[str, np.ndarray]:
    raise cls._hook_missing("_generate_split")

  @classmethod
  def describe(cls, config: AttnxConfig) -> DatasetInfo:
    raise cls._hook_missing("describe")

  # --- config resolution -------------------------------------------------------

  @classmethod
  def resolve_config(cls, config: str | None = None, **kwargs: Any) -> AttnxConfig:
    """Named config `config` (default "default") with `kwargs` overrides.

    Overrides that change a value produce a custom config named
    "<base>-key1=value1-key2=value2" (sorted keys), so each parameter setting
    is prepared once into its own directory.
    """
    named = {c.name: c for c in cls.BUILDER_CONFIGS}
    base_name = config or cls.DEFAULT_BUILDER_CONFIG_NAME
    if base_name not in named:
      raise ValueError(
        f"Unknown config {base_name!r} for dataset {cls.name!r}; valid configs: "
        f"{sorted(named)}."
      )
    base = named[base_name]
    valid = base.params()
    unknown = sorted(set(kwargs) - set(valid))
    if unknown:
      raise ValueError(
        f"Unknown config kwarg(s) {unknown} for dataset {cls.name!r}; valid keys: "
        f"{sorted(valid)} (plus 'config' to pick a named config: {sorted(named)})."
      )
    changed = {}
    for key, value in kwargs.items():
      value = _coerce(key, value, valid[key])
      if value != valid[key]:
        changed[key] = value
    if not changed:
      return base
    suffix = "-".join(f"{k}={_format_value(v)}" for k, v in sorted(changed.items()))
    cfg = dataclasses.replace(
      base,
      name=f"{base.name}-{suffix}",
      description=f"{base.description} Overrides: {changed}.",
      **changed,
    )
    cfg.validate()
    return cfg

  # --- TFDS implementation -------------------------------------------------------

  def _info(self) -> tfds.core.DatasetInfo:
    config = self.builder_config
    return tfds.core.DatasetInfo(
      builder=self,
      description=self.describe(config).description,
      features=tfds.features.FeaturesDict(self._features(config)),
      homepage=self.HOMEPAGE or None,
      citation=self.CITATION or None,
      disable_shuffling=True,  # keep generation order: index i is example i
      metadata=tfds.core.MetadataDict(params=_jsonable(config.params())),
    )

  def _split_generators(self, dl_manager: tfds.download.DownloadManager):
    del dl_manager  # Nothing to download: everything is generated offline.
    return {
      split: self._generate_examples(split=split, n=n)
      for split, n in self._split_sizes(self.builder_config).items()
    }

  def _generate_examples(self, split: str, n: int) -> Iterator[tuple[int, dict[str, Any]]]:
    config = self.builder_config
    arrays = self._generate_split(config, split, n, split_seed(config.seed, split))
    keys = list(self._features(config))
    for i in range(n):
      yield i, {k: arrays[k][i] for k in keys}


def _jsonable(params: Mapping[str, Any]) -> dict[str, Any]:
  return {k: list(v) if isinstance(v, tuple) else v for k, v in params.items()}


def int_tensor(shape: tuple[int, ...]) -> tfds.features.Tensor:
  return tfds.features.Tensor(shape=shape, dtype=np.int32, encoding=tfds.features.Encoding.BYTES)


def float_tensor(shape: tuple[int, ...]) -> tfds.features.Tensor:
  return tfds.features.Tensor(shape=shape, dtype=np.float32, encoding=tfds.features.Encoding.BYTES)


def bool_tensor(shape: tuple[int, ...]) -> tfds.features.Tensor:
  return tfds.features.Tensor(shape=shape, dtype=np.bool_, encoding=tfds.features.Encoding.BYTES)
