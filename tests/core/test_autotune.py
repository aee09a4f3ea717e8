"""The GPU tile autotuner (attnx/core/kernels/pallas/autotune.py, tile_cache.py) on a CPU: its
search, cache, versioning and selection with a deterministic fake timer, the kernels running in
Pallas' interpreter (their outputs still checked against the blocked kernel)."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import pytest

from attnx import core
from attnx.core.kernels.pallas import tile_cache, tiles
from attnx.core.kernels.pallas.tiles import GpuTile
from attnx.core.weightings import get_weighting

# One end of the JAX range runs each test (what differs between the ends is JAX's, not this).
pytestmark = pytest.mark.split_by_jax

SHAPE = (1, 32, 2, 16)
CANDS = {"fwd": (GpuTile(16, 16, 4), GpuTile(32, 16, 4)), "dq": (GpuTile(16, 16, 4),),
         "dkv": (GpuTile(16, 32, 4),)}
TABLE = tiles.gpu_tiles(16, None, jnp.float32)
FAST = {("fwd", (16, 16, 4, False)): 3.0, ("dq", (16, 16, 4, False)): 2.0,
        ("dkv", (16, 32, 4, False)): 1.0}


def fake_timer(calls=None):
  """Seconds per run from the launches alone: 10 ms less each fast tile's saving, with a
  spread; the program still runs once (its output was checked before)."""
  def timer(run, launches):
    if calls is not None:
      calls.append(launches)
    ms = 10.0 - sum(v for (kernel, tile), v in FAST.items()
                    if tuple(getattr(launches, kernel)) == tile)
    return [ms * 1e-3, ms * 1.1e-3, ms * 0.9e-3]
  return timer


@pytest.fixture
def cache(tmp_path, monkeypatch):
  path = tmp_path / "tiles.json"
  monkeypatch.setenv("ATTNX_TILE_CACHE", str(path))
  return path


def _tune(**kw):
  args = dict(shape=SHAPE, dtype="float32", candidates=CANDS, timer=fake_timer(),
              interpret=True)
  return core.autotune("softmax", **(args | kw))


def test_the_fastest_verified_launches_win_and_are_cached(cache, monkeypatch):
  res = _tune()
  want = dict(fwd=GpuTile(16, 16, 4), dq=GpuTile(16, 16, 4), dkv=GpuTile(16, 32, 4))
  assert res.launches == res.launches._replace(**want)
  # (The table's dK/dV launch is the fast one already: 10 − 1 ms.)
  assert res.ms == pytest.approx(4.0) and res.table_ms == pytest.approx(9.0)
  assert res.speedup == pytest.approx(2.25)
  data = json.loads(cache.read_text())
  assert data["format"] == tile_cache.FORMAT and data["version"] == tile_cache.VERSION
  (entry,) = data["entries"].values()
  assert entry["chip"] == "interpreter" and entry["signature"] == res.signature
  assert entry["jaxlib"] == __import__("jaxlib").__version__
  timed = [r for r in entry["rows"] if "ms" in r]
  assert all(r["spread"][0] <= r["ms"] <= r["spread"][1] for r in timed)
  assert res.signature == tile_cache.signature(get_weighting("softmax"), 32, 32, 16, 16,
                                               "float32", False, 1)
  # Selection: later calls of the signature on that chip take the winner ...
  w = get_weighting("softmax")
  monkeypatch.setattr(tile_cache, "device_chip", lambda: "interpreter")
  _, launch = tiles.kernel_tiles("gpu", w, 32, 32, 16, 16, jnp.float32, None, None)
  assert launch == res.launches
  # ... not another signature (causal), not a call that names its tiles.
  assert tiles.kernel_tiles("gpu", w, 32, 32, 16, 16, jnp.float32, None, None,
                            causal=True)[1] == TABLE
  assert tiles.kernel_tiles("gpu", w, 32, 32, 16, 16, jnp.float32, 16, None)[1] == TABLE


def test_a_candidate_that_fails_the_check_cannot_win(cache):
  bad = GpuTile(16, 16, 4)
  check = lambda launches, outs, ref: "wrong" if launches.fwd == bad else None
  res = _tune(check=check)
  assert res.launches.fwd != bad
  assert any(r.get("error") == "wrong" for r in res.rows)


def test_the_check_compares_with_the_blocked_kernel(cache, monkeypatch):
  # The default check passes the real kernels (interpreted) and refuses a launch whose output
  # is off by 10 % (here: the kernels under one fwd tile scaled on purpose).
  from attnx.core.kernels.pallas import autotune as at  # noqa: PLC0415

  real, wrong = at.pallas_attention, GpuTile(16, 16, 4)

  def skewed(*args, **kw):
    out = real(*args, **kw)
    launch = tile_cache.overriding()
    return out * 1.1 if launch is not None and launch.fwd == wrong else out

  monkeypatch.setattr(at, "pallas_attention", skewed)
  res = _tune(candidates={"fwd": (wrong, GpuTile(32, 16, 4))})
  errors = [r for r in res.rows if "error" in r]
  assert [r["launches"]["fwd"] for r in errors] == [list(wrong)]
  assert "differs from the blocked kernel" in errors[0]["error"]
  assert res.launches.fwd != wrong


def test_the_table_wins_when_no_candidate_is_faster(cache):
  res = _tune(timer=lambda run, launches: [0.01 if launches == TABLE else 0.02])
  assert res.launches == TABLE and res.speedup == 1.0


def test_budget_zero_times_the_table_only(cache):
  calls = []
  res = _tune(timer=fake_timer(calls), budget_s=0.0)
  assert res.launches == TABLE and set(calls) == {TABLE}


def test_other_versions_and_jaxlibs_are_ignored(cache, monkeypatch):
  res = _tune()
  sig = res.signature
  assert tile_cache.lookup(sig, chip="interpreter") is not None
  assert tile_cache.lookup(sig, chip="NVIDIA H100 80GB HBM3") is None
  data = json.loads(cache.read_text())
  cache.write_text(json.dumps(data | {"version": tile_cache.VERSION + 1}))
  assert tile_cache.load() == {} and tile_cache.lookup(sig, chip="interpreter") is None
  cache.write_text(json.dumps(data))
  monkeypatch.setattr(tile_cache, "_jaxlib", lambda: "0.0.0")
  assert tile_cache.lookup(sig, chip="interpreter") is None
  cache.write_text("{not json")
  assert tile_cache.load() == {}


def test_no_cache_is_read_on_a_cpu(cache):
  _tune()
  assert jax.default_backend() == "cpu" and tile_cache.device_chip() is None
  w = get_weighting("softmax")
  assert tiles.kernel_tiles("gpu", w, 32, 32, 16, 16, jnp.float32, None, None)[1] == TABLE


def test_cache_off(monkeypatch):
  monkeypatch.setenv("ATTNX_TILE_CACHE", "off")
  assert tile_cache.cache_path() is None
  assert _tune().path is None


def test_refusals():
  with pytest.raises(ValueError, match=r"JAX runs on 'cpu' here"):
    core.autotune("softmax", shape=SHAPE)
  with pytest.raises(ValueError, match="interpret=True"):
    core.autotune("softmax", shape=SHAPE, timer=fake_timer())
  with pytest.raises(ValueError, match="unknown kernels"):
    _tune(candidates={"bwd": ()})
  with pytest.raises(ValueError, match="multiple"):
    _tune(kv_heads=3)
  with pytest.raises(ValueError, match="float64"):
    _tune(dtype="float64")
