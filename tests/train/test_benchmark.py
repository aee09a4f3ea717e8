"""attnx.train.benchmark: timing against a fake clock (calls, order, medians), XLA's memory
estimate, GFLOP/s, the benchmark number format in a hand-written table, the saved files, steps
to a target."""

from __future__ import annotations

import json
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attnx import train
from attnx.train import benchmark


class _Clock:
  """A fake time.perf_counter: each timed function advances it by its own durations."""

  def __init__(self):
    self.now = 0.0
    self.calls: list[str] = []

  def __call__(self) -> float:
    return self.now

  def fn(self, name: str, durations: list[float]):
    durations = list(durations)

    def call():
      self.calls.append(name)
      self.now += durations.pop(0)
      return name
    return call


@pytest.fixture
def clock(monkeypatch):
  c = _Clock()
  monkeypatch.setattr(benchmark.time, "perf_counter", c)
  return c


def test_time_call_returns_the_result_and_its_seconds(clock):
  assert benchmark.time_call(clock.fn("a", [0.25])) == ("a", 0.25)
  assert clock.calls == ["a"]


def test_time_round_robin_calls_each_function_repeats_times_in_turn(clock):
  fns = [clock.fn("a", [1.0, 9.0, 2.0]), clock.fn("b", [5.0]), clock.fn("c", [3.0, 1.0, 2.0])]
  # b's first run took longer than long_run_s: it is timed in the first round only.
  medians = benchmark.time_round_robin(fns, 3, long_run_s=1.0, first_seconds=[0.5, 4.0, 0.5])
  assert clock.calls == ["a", "b", "c", "a", "c", "a", "c"]
  assert medians == [2.0, 5.0, 2.0]
  fns = [clock.fn("a", [3.0, 1.0, 2.0])]
  assert benchmark.time_round_robin(fns, 3, statistic=min) == [1.0]


def test_time_round_robin_runs_at_least_one_round_and_checks_its_arguments(clock):
  assert benchmark.time_round_robin([clock.fn("a", [1.5])], 0) == [1.5]
  assert clock.calls == ["a"]
  with pytest.raises(ValueError, match="2 functions but 1 first_seconds"):
    benchmark.time_round_robin([clock.fn("a", []), clock.fn("b", [])], 2, first_seconds=[0.0])
  assert clock.calls == ["a"]  # nothing ran


def test_time_repeated_and_named_steps(clock):
  assert benchmark.time_repeated(clock.fn("a", [9.0, 1.0, 3.0, 2.0]), 3, warmup=1) == 2.0
  assert clock.calls == ["a"] * 4
  steps = {"x": (lambda k: clock.fn("x", [0.5, 0.25])(), (0,)),
           "y": (lambda k: clock.fn("y", [1.0])(), (0,))}
  ms = benchmark.time_round_robin_ms(steps, 1)
  assert ms == {"x": 500.0, "y": 1000.0} and clock.calls[4:] == ["x", "y"]


def test_save_writes_the_table_and_the_rows(tmp_path):
  path = benchmark.save(str(tmp_path), {"rows": [{"a": 1.0, "shape": (1, 2)}]}, "| a |\n")
  assert json.loads((tmp_path / "benchmark.json").read_text()) == {
      "rows": [{"a": 1.0, "shape": [1, 2]}]} and path.endswith("benchmark.json")
  assert (tmp_path / "benchmark.md").read_text() == "| a |\n"
  benchmark.save(str(tmp_path), {"x": type})  # what JSON cannot hold: its str
  assert json.loads((tmp_path / "benchmark.json").read_text()) == {"x": "<class 'type'>"}


def test_gflops_and_matmul_rate():
  assert benchmark.gflops(3e9, 0.5) == 6.0
  assert benchmark.matmul_rate(64, repeats=2) > 0


def test_program_memory_reads_xla_estimate():
  mem = types.SimpleNamespace(temp_size_in_bytes=100, argument_size_in_bytes=20,
                              output_size_in_bytes=3)
  fake = types.SimpleNamespace(memory_analysis=lambda: mem)
  assert benchmark.program_memory(fake) == benchmark.ProgramMemory(100.0, 123.0)
  none = benchmark.program_memory(types.SimpleNamespace(memory_analysis=lambda: None))
  assert np.isnan(none.scratch) and none.peak is None
  x = jnp.ones((64, 64), jnp.float32)
  compiled = jax.jit(lambda a: (a @ a).sum(0)).lower(x).compile()
  real = benchmark.program_memory(compiled)
  assert real.scratch >= 0 and real.peak >= real.scratch + x.nbytes + 64 * 4


def test_format_number_in_a_table():
  rows = [{"impl": "blocked", "time ms": 1234.4, "err": 3e-7, "GFLOP/s": 12.345, "x": 0.0},
          {"impl": "a|b", "time ms": 2.5e5, "err": float("nan"), "GFLOP/s": 99.96, "x": 7}]
  assert train.markdown_table(rows, fmt=benchmark.format_number) == (
      "| impl | time ms | err | GFLOP/s | x |\n"
      "|---|---|---|---|---|\n"
      "| blocked | 1234 | 3.0e-07 | 12.3 | 0 |\n"
      "| a\\|b | 2.5e+05 | nan | 100 | 7 |\n")


def test_steps_to_target_and_its_cell():
  hist = [{"step": 10, "eval_accuracy": [0.1, 0.5]}, {"step": 20, "loss": [1, 1]},
          {"step": 30, "eval_accuracy": [0.6, 0.4]}, {"step": 40, "eval_accuracy": [0.7, 0.3]}]
  steps = benchmark.steps_to_target(hist, 0.5, 2)
  np.testing.assert_array_equal(steps, [30, 10])
  assert benchmark.format_steps(steps) == "20 ± 10"
  one = benchmark.steps_to_target(hist, 0.6, 2)
  np.testing.assert_array_equal(one, [30, np.nan])
  assert benchmark.format_steps(one) == "30 (1/2 seeds reached)"
  assert benchmark.format_steps(benchmark.steps_to_target(hist, 0.9, 2)) == "not reached"
  np.testing.assert_array_equal(benchmark.steps_to_target(hist, 1.0, 2, metric="loss"), [20, 20])
