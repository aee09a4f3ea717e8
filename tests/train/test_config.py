"""attnx.train.config: config keys shared by every experiment (distributed init, data_dir,
re-launch overrides), the config helpers, and FitConfig (fit's settings as one validated, frozen
object built from experiment configs)."""

from __future__ import annotations

import dataclasses
import os

import ml_collections
import numpy as np
import optax
import pytest

from attnx import train
from attnx.train import config as tc


def test_distributed_keys_reach_jax_distributed_initialize():
  c = train.base_config()
  assert tc.distributed_kwargs(c) == {"coordinator_address": None, "num_processes": None,
                                      "process_id": None}  # all auto-detected
  c.update(distributed=True, coordinator_address="10.0.0.1:1234", num_processes=4, process_id=3)
  train.validate(c)
  assert tc.distributed_kwargs(c) == {"coordinator_address": "10.0.0.1:1234",
                                      "num_processes": 4, "process_id": 3}
  c.process_id = 4
  with pytest.raises(ValueError, match=r"config\.num_processes=4 .*process_id=4"):
    train.validate(c)
  c.update(process_id=3, heartbeat_timeout_seconds=20)
  assert tc.distributed_kwargs(c)["heartbeat_timeout_seconds"] == 20
  c.heartbeat_timeout_seconds = -1
  with pytest.raises(ValueError, match=r"heartbeat_timeout_seconds=-1 must be an integer >= 0"):
    train.validate(c)
  c.update(distributed=False, process_id=0, heartbeat_timeout_seconds=0)
  with pytest.raises(ValueError, match=r"only used with config\.distributed=True"):
    train.validate(c)


def test_data_dir_becomes_the_catalog_data_dir(tmp_path, monkeypatch):
  import attnx.data

  monkeypatch.delenv("TFDS_DATA_DIR", raising=False)
  c = train.base_config()
  tc.apply_data_dir(c)  # "" leaves the default alone
  assert attnx.data.catalog_data_dir() == os.path.expanduser("~/tensorflow_datasets")
  c.data_dir = str(tmp_path)
  train.validate(c)
  tc.apply_data_dir(c)
  assert attnx.data.catalog_data_dir() == str(tmp_path)
  expected = f"dir '{tmp_path}'.*--config.data_dir="
  with pytest.raises(attnx.data.DatasetNotFoundError, match=expected):
    attnx.data.load_arrays("mnist", "test")  # no data_dir= argument: the config's is used
  c.data_dir = str(tmp_path / "missing")
  with pytest.raises(ValueError, match=r"config\.data_dir=.*missing' is not a directory"):
    train.validate(c)


def test_config_overrides_list_every_changed_leaf():
  ref = train.base_config()
  ref.optimizer = train.optimizer_config()
  ref.names = ("a", "b")
  c = ml_collections.ConfigDict(ref.to_dict())
  c.update(num_seeds=3, parallel="pmap", progress=False, names=("a",))
  c.optimizer.learning_rate = 0.02
  flags = tc.config_overrides(c, ref, exclude=("parallel",))
  assert sorted(flags) == ["--config.names=('a',)", "--config.num_seeds=3",
                           "--config.optimizer.learning_rate=0.02", "--config.progress=False"]


@pytest.mark.parametrize("key, value, pattern", [
    ("num_steps", 0, r"config\.num_steps must be >= 1, got 0"),
    ("train.num_steps", -3, r"config\.train\.num_steps must be >= 1, got -3"),  # nested too
    ("train.batch_size", 0, r"config\.train\.batch_size must be >= 1"),
    ("checkpoint_every", -1, r"config\.checkpoint_every must be >= 0 \(0 turns it off\)"),
    ("log_every", -10, r"config\.log_every must be >= 0"),
    ("train.eval_every", -1, r"config\.train\.eval_every must be >= 0"),
    ("keep_checkpoints", 0, r"config\.keep_checkpoints must be >= 1"),
])
def test_validate_rejects_counts_fit_cannot_use(key, value, pattern):
  c = train.base_config()
  c.update(keep_checkpoints=2, train=ml_collections.ConfigDict(
      dict(num_steps=5, batch_size=4, eval_every=0)))
  train.validate(c)  # valid as built: 0 turns checkpoints and evaluation off
  node = c
  *parents, leaf = key.split(".")
  for p in parents:
    node = node[p]
  node[leaf] = value
  with pytest.raises(ValueError, match=pattern):
    train.validate(c)


def test_check_batch_size_names_key_size_and_dataset():
  c = ml_collections.ConfigDict(dict(train=dict(batch_size=64)))
  train.check_batch_size(c, "train.batch_size", 64, "'digits'")  # a batch may take them all
  with pytest.raises(ValueError, match=r"config\.train\.batch_size=64 is larger than the 63 "
                                       r"training examples of 'digits'; use at most 63"):
    train.check_batch_size(c, "train.batch_size", 63, "'digits'")


def test_config_helpers(tmp_path):
  assert train.split_list("softmax, relu,,sparsemax") == ["softmax", "relu", "sparsemax"]
  assert train.split_list(("a", "b")) == ["a", "b"]
  c = train.base_config()
  train.validate(c)
  c.parallel = "dp"
  with pytest.raises(ValueError, match=r"config\.parallel='dp'.*none, shard_map, pmap"):
    train.validate(c)
  (tmp_path / "exp_a.py").write_text(
      '"""Does A beat B?\n\nMore."""\nPRESETS = ("default", "tiny")\n'
      "def get_config(preset=None):\n  pass\n")
  (tmp_path / "helper.py").write_text("X = 1\n")
  exps = train.list_experiments(str(tmp_path))
  assert exps == [{"name": "exp_a", "path": str(tmp_path / "exp_a.py"),
                   "summary": "Does A beat B?", "presets": ["default", "tiny"]}]
  assert "exp_a: Does A beat B?" in train.format_experiments(str(tmp_path))


def test_variant_lists_and_choices_name_the_key():
  assert train.variant_list("softmax, relu:normalization=none ,bias=1,ssmax") == [
      "softmax", "relu:normalization=none,bias=1", "ssmax"]
  assert train.variant_list("bias=0,softmax") == ["bias=0", "softmax"]  # nothing to continue
  c = ml_collections.ConfigDict(dict(weightings="softmax,sigmoid:normalization=none,bias=1"))
  assert train.attention_variants(c, reference="softmax") == [
      "softmax", "sigmoid:normalization=none,bias=1"]
  for value, match in (("softmax,relux", r"config\.weightings: .*relux"),
                       ("relu", "must include softmax"), ("", "config.weightings is empty")):
    c.weightings = value
    with pytest.raises(ValueError, match=match):
      train.attention_variants(c, reference="softmax")
  train.check_choices(c, "kernels", ["gaussian"], ("gaussian", "boxcar"))
  with pytest.raises(ValueError, match=r"config\.kernels has invalid entries \['cosine'\]; "
                                       r"valid choices: gaussian, boxcar"):
    train.check_choices(c, "kernels", ["gaussian", "cosine"], ("gaussian", "boxcar"))

def test_list_experiments_reads_presets_from_a_preset_fns_dict(tmp_path):
  """``PRESETS = tuple(PRESET_FNS)`` is not a literal: the keys of the PRESET_FNS dict name the
  presets (as `python launch.py --list` shows them), also keys from a comprehension over a
  literal; the last readable assignment of PRESETS wins, and an unreadable one (a name never
  bound to a literal) leaves an earlier literal in place."""
  (tmp_path / "exp_b.py").write_text(
      '"""B."""\nPRESET_FNS: dict = {"default": lambda c: None, "tiny": _tiny}\n'
      "PRESETS = tuple(PRESET_FNS)\ndef get_config(preset=None):\n  pass\n")
  (tmp_path / "exp_c.py").write_text(
      '"""C."""\nPRESETS = ("default", "wide")\n'
      'PRESET_FNS = {"default": f, **{t: g(t) for t in TASKS}}\nPRESETS = tuple(PRESET_FNS)\n'
      "def get_config(preset=None):\n  pass\n")
  (tmp_path / "exp_d.py").write_text(
      '"""D."""\nPRESETS = tuple(OTHER)\ndef get_config(preset=None):\n  pass\n')
  (tmp_path / "exp_e.py").write_text(  # keys from a comprehension over a literal: read too
      '"""E."""\nTASKS = ("a", "b", "c")\nPRESET_FNS = {"default": f, **{t: g(t) for t in '
      'TASKS if t != "b"}, "all": g(",".join(TASKS))}\nPRESETS = tuple(PRESET_FNS)\n'
      "def get_config(preset=None):\n  pass\n")
  (tmp_path / "exp_f.py").write_text(  # never runs the module's code: a call is not read
      '"""F."""\nPRESETS = tuple(open("/etc/passwd"))\ndef get_config(preset=None):\n  pass\n')
  exps = {e["name"]: e["presets"] for e in train.list_experiments(str(tmp_path))}
  assert exps == {"exp_b": ["default", "tiny"], "exp_c": ["default", "wide"], "exp_d": [],
                  "exp_e": ["default", "a", "c", "all"], "exp_f": []}
  assert "presets: default, tiny" in train.format_experiments(str(tmp_path))


def _experiment_config() -> ml_collections.ConfigDict:
  c = train.base_config()
  c.update(num_steps=40, eval_every=20, keep_checkpoints=2, batch_size=32, weightings="softmax",
           optimizer=train.optimizer_config(learning_rate=0.01))
  return c


def test_from_config_reads_the_standard_keys_and_overrides_win():
  c = _experiment_config()
  c.update(seed=7, num_seeds=3, parallel="pmap", progress=False, checkpoint_every=10,
           log_every=5)
  fc = train.FitConfig.from_config(c)
  assert (fc.num_steps, fc.num_seeds, fc.seed, fc.eval_every, fc.log_every) == (40, 3, 7, 20, 5)
  assert (fc.checkpoint_every, fc.keep_checkpoints, fc.parallel) == (10, 2, "pmap")
  assert fc.progress is False and fc.optimizer.learning_rate == 0.01
  assert fc.loss == "softmax_xent" and fc.tensorboard is True  # not in the config: defaults
  # Overrides (e.g. from a nested config.train) win; the config is not changed.
  fc = train.FitConfig.from_config(c, num_steps=5, loss="mse", tensorboard=False)
  assert (fc.num_steps, fc.loss, fc.tensorboard, fc.num_seeds) == (5, "mse", False, 3)
  assert c.num_steps == 40
  # Without the keys: what the caller passes, else the defaults.
  fc = train.FitConfig.from_config(ml_collections.ConfigDict(), num_steps=3,
                                   optimizer=optax.sgd(0.1))
  assert (fc.num_seeds, fc.seed, fc.log_every, fc.parallel) == (1, 0, 10, "none")


def test_frozen_and_replaceable():
  fc = train.FitConfig(num_steps=10, optimizer=optax.sgd(0.1))
  with pytest.raises(dataclasses.FrozenInstanceError):
    fc.num_steps = 20  # type: ignore[misc]
  other = dataclasses.replace(fc, num_seeds=4)
  assert (other.num_seeds, fc.num_seeds) == (4, 1)
  # numpy integers (e.g. from array arithmetic) become plain ints.
  assert type(train.FitConfig(num_steps=np.int64(5), optimizer=optax.sgd(0.1)).num_steps) is int


@pytest.mark.parametrize("field, value, pattern", [
    ("num_steps", 0, r"FitConfig\.num_steps must be >= 1, got 0"),
    ("num_seeds", 0, r"FitConfig\.num_seeds must be >= 1, got 0"),
    ("seed", -1, r"FitConfig\.seed must be >= 0, got -1"),
    ("log_every", -1, r"FitConfig\.log_every must be >= 0 \(0: only at the end\), got -1"),
    ("eval_every", -5, r"FitConfig\.eval_every must be >= 0"),
    ("checkpoint_every", -1, r"FitConfig\.checkpoint_every must be >= 0"),
    ("keep_checkpoints", 0, r"FitConfig\.keep_checkpoints must be >= 1"),
    ("num_steps", 2.5, r"FitConfig\.num_steps must be an integer, got 2\.5"),
    ("num_seeds", True, r"FitConfig\.num_seeds must be an integer, got True"),
    ("progress", "yes", r"FitConfig\.progress must be True or False, got 'yes'"),
    ("parallel", "dp", r"FitConfig\.parallel='dp' is not one of none, shard_map, pmap"),
    ("loss", "hinge", r"FitConfig\.loss='hinge' is not one of softmax_xent, mse"),
    ("optimizer", "adam", r"FitConfig\.optimizer must be an optimizer_config\(\) ConfigDict"),
    ("optimizer", train.optimizer_config(name="lion"),
     r"FitConfig\.optimizer\.name='lion' is not one of"),
    ("optimizer", train.optimizer_config(learning_rate=0.0),
     r"FitConfig\.optimizer\.learning_rate must be > 0"),
])
def test_invalid_fields_fail_naming_the_field(field, value, pattern):
  ok = dict(num_steps=10, optimizer=train.optimizer_config())
  train.FitConfig(**ok)  # valid as built
  with pytest.raises(ValueError, match=pattern) as e:
    train.FitConfig(**{**ok, field: value})
  assert e.value.field == field
  # From an experiment config, the message also says where the value came from.
  c = ml_collections.ConfigDict({**_experiment_config().to_dict(), field: value})
  with pytest.raises(ValueError, match=pattern + r".* \(from config\." + field + r"\)$"):
    train.FitConfig.from_config(c)
  with pytest.raises(ValueError, match=r"\(from " + field + r"=\)$"):
    train.FitConfig.from_config(_experiment_config(), **{field: value})


def test_from_config_requires_steps_and_optimizer_and_rejects_unknown_fields():
  with pytest.raises(ValueError, match=r"FitConfig\.num_steps is required: set "
                                       r"config\.num_steps or pass num_steps="):
    train.FitConfig.from_config(train.base_config(), optimizer=optax.sgd(0.1))
  with pytest.raises(ValueError, match=r"FitConfig\.optimizer is required"):
    train.FitConfig.from_config(train.base_config(), num_steps=3)
  with pytest.raises(ValueError, match=r"unknown field\(s\) batch_size, lr; fields: num_steps"):
    train.FitConfig.from_config(_experiment_config(), lr=0.1, batch_size=3)


def test_fit_takes_only_a_fit_config():
  with pytest.raises(TypeError, match=r"config must be a FitConfig \(FitConfig\.from_config"):
    train.fit(None, train_data=None, config=_experiment_config())
  with pytest.raises(TypeError, match="num_steps"):  # the old keyword list is gone
    train.fit(None, train_data=None, config=None, num_steps=3)  # type: ignore[call-arg]


def test_preset_config_is_the_default_changed_by_one_function():
  import ml_collections

  from attnx.train.config import preset_config

  def default():
    return ml_collections.ConfigDict(dict(steps=10, width=8))

  def tiny(c):
    c.steps = 2

  presets = {"default": lambda c: None, "tiny": tiny}
  assert preset_config(None, default, presets).steps == 10
  c = preset_config("tiny", default, presets, "demo")
  assert (c.steps, c.width, c.preset) == (2, 8, "tiny")
  with pytest.raises(ValueError, match="Unknown preset 'huge' for demo; valid presets: default"):
    preset_config("huge", default, presets, "demo")
