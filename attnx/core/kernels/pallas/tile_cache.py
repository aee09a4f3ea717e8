"""Tuned GPU tiles: the cache file :func:`attnx.core.autotune` writes and the kernels read.

A tuned entry holds the forward, dQ and dK/dV launches (tile, warps, dK/dV in two passes) that
won on a chip for one call signature (:func:`signature`: the weighting, dtype, padded head
sizes, causality, GQA group and the power-of-2 buckets of T and S), with the timings they won
by. The file is JSON, versioned (:data:`VERSION`); an entry counts only on the chip and jaxlib
it was timed with, so a driver or compiler update, or another GPU, falls back to the built-in
table (:mod:`.tiles`) until it is tuned again.

Where: ``$ATTNX_TILE_CACHE`` (a file path; ``off`` reads and writes none), else
``$XDG_CACHE_HOME/attnx/pallas_tiles.json`` (``~/.cache/attnx/pallas_tiles.json``). The kernels
read it only when the process runs on a GPU (:func:`device_chip`): a CPU that lowers a program
for a GPU, the tests and the program hashes see the built-in table only.
"""

from __future__ import annotations

import contextlib
import contextvars
import json
import os
import pathlib
import time
from collections.abc import Iterator, Mapping
from typing import Any

import jax
import jax.numpy as jnp

FORMAT = "attnx-pallas-tiles"
VERSION = 1
KERNELS = ("fwd", "dq", "dkv")

__all__ = ["FORMAT", "KERNELS", "VERSION", "cache_path", "device_chip", "entry_id", "load",
           "lookup", "override", "overriding", "signature", "store"]

# Launches that replace the table's while the tuner times a candidate (None: none).
_OVERRIDE: contextvars.ContextVar[Any] = contextvars.ContextVar("attnx_tile_override",
                                                                default=None)


@contextlib.contextmanager
def override(launches: Any) -> Iterator[None]:
  """Within the block, every GPU kernel traced takes ``launches`` (a
  :class:`~attnx.core.kernels.pallas.tiles.GpuTiles`) instead of its table's or the cache's:
  how the tuner times a candidate."""
  token = _OVERRIDE.set(launches)
  try:
    yield
  finally:
    _OVERRIDE.reset(token)


def overriding() -> Any:
  """The launches of an enclosing :func:`override`, or None."""
  return _OVERRIDE.get()


def cache_path() -> pathlib.Path | None:
  """The cache file (see the module docstring), or None when ``ATTNX_TILE_CACHE=off``."""
  env = os.environ.get("ATTNX_TILE_CACHE")
  if env is not None:
    return None if env.strip().lower() in ("", "off", "none", "0") else pathlib.Path(env)
  base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
  return pathlib.Path(base) / "attnx" / "pallas_tiles.json"


def device_chip() -> str | None:
  """The chip this process runs its kernels on (jax's ``device_kind``) when it is a GPU, else
  None: the cache is read for GPUs only."""
  if jax.default_backend() != "gpu":
    return None
  return jax.devices()[0].device_kind


def _jaxlib() -> str:
  import jaxlib  # noqa: PLC0415

  return jaxlib.__version__


def _bucket(n: int) -> int:
  return 1 << max(int(n) - 1, 0).bit_length()


def signature(weighting: Any, t: int, s: int, head_dim: int, value_head_dim: int, dtype: Any,
              causal: bool, group: int) -> dict[str, Any]:
  """The call signature tiles are tuned for (chip and jaxlib are added by :func:`entry_id`):
  the weighting's name, the dtype, the head sizes padded to 16, causal or not, the GQA group
  and T, S rounded up to powers of 2."""
  pad = lambda h: -(-int(h) // 16) * 16
  return {"weighting": getattr(weighting, "name", str(weighting)),
          "dtype": jnp.dtype(dtype).name, "head_dim": pad(head_dim),
          "value_head_dim": pad(value_head_dim), "causal": bool(causal), "group": int(group),
          "t": _bucket(t), "s": _bucket(s)}


def entry_id(chip: str, sig: Mapping[str, Any], jaxlib: str | None = None) -> str:
  """The cache key of a signature on a chip and jaxlib."""
  parts = [chip, jaxlib or _jaxlib()] + [f"{k}={sig[k]}" for k in sorted(sig)]
  return "|".join(parts)


_LOADED: dict[str, tuple[float, dict[str, Any]]] = {}


def load(path: pathlib.Path | None = None) -> dict[str, Any]:
  """The cache's entries of this :data:`VERSION` (``{}`` for a missing, unreadable or other
  version's file), re-read when the file changes."""
  path = cache_path() if path is None else path
  if path is None or not path.exists():
    return {}
  mtime = path.stat().st_mtime
  hit = _LOADED.get(str(path))
  if hit is not None and hit[0] == mtime:
    return hit[1]
  try:
    data = json.loads(path.read_text())
  except (OSError, ValueError):
    data = {}
  ok = isinstance(data, dict) and data.get("format") == FORMAT and data.get("version") == VERSION
  entries = dict(data.get("entries", {})) if ok else {}
  _LOADED[str(path)] = (mtime, entries)
  return entries


def lookup(sig: Mapping[str, Any], chip: str | None = None,
           path: pathlib.Path | None = None) -> dict[str, Any] | None:
  """The tuned launches ``{"fwd": [block_q, block_k, warps, two_pass], "dq": ..., "dkv": ...}``
  of a signature on ``chip`` (default: this process' GPU; None on a CPU) under this jaxlib, or
  None."""
  chip = device_chip() if chip is None else chip
  if chip is None:
    return None
  entry = load(path).get(entry_id(chip, sig))
  return None if entry is None else entry.get("tiles")


def store(sig: Mapping[str, Any], chip: str, tiles: Mapping[str, Any], record: Mapping[str, Any],
          path: pathlib.Path | None = None) -> pathlib.Path | None:
  """Writes a signature's winning launches and their ``record`` (timings, spread, candidates)
  into the cache (atomically: a temporary file renamed over it), keeping the other entries of
  this version. Returns the path (None when the cache is off)."""
  path = cache_path() if path is None else path
  if path is None:
    return None
  entries = dict(load(path))
  entries[entry_id(chip, sig)] = {
      "chip": chip, "jaxlib": _jaxlib(), "signature": dict(sig),
      "date": time.strftime("%Y-%m-%dT%H:%MZ", time.gmtime()),
      "tiles": {k: list(tiles[k]) for k in KERNELS}, **dict(record)}
  path.parent.mkdir(parents=True, exist_ok=True)
  tmp = path.with_suffix(path.suffix + f".tmp{os.getpid()}")
  tmp.write_text(json.dumps({"format": FORMAT, "version": VERSION, "entries": entries},
                            indent=1, sort_keys=True))
  os.replace(tmp, path)
  _LOADED.pop(str(path), None)
  return path
