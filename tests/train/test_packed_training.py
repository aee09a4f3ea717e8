"""Training on packed documents through attnx.train (issue: packed language-model training):
the rows of attnx.data.packing reach the model's segment_ids / positions, the loss skips
padding, a resumed run is bit-identical, and a model trained so sees nothing of another document
in its row — for every weighting F of the language-model experiment."""

from __future__ import annotations

import shutil

import jax
import numpy as np
import pytest
from support.train_stand_ins import TinyMLP

from attnx import nn, train
from attnx.constants import IGNORE_INDEX
from attnx.data import packing
from attnx.nn import lm
from experiments import language_model

VOCAB, L = 23, 16


def _rows(seed: int = 0, count: int = 60, max_len: int = 12) -> dict[str, np.ndarray]:
  rng = np.random.default_rng(seed)
  docs = [rng.integers(0, VOCAB, size=int(rng.integers(2, max_len))) for _ in range(count)]
  return packing.pack_documents(docs, L)


def _model(weighting: str) -> nn.GPT:
  config = language_model.get_config("tiny")
  config.model.context = L
  return language_model.build_model(config, VOCAB)(nn.attention_spec(weighting))


def _fit(model, rows, **kw):
  config = dict(optimizer=train.optimizer_config(learning_rate=3e-3, warmup_steps=2),
                num_steps=6, num_seeds=1, log_every=3, progress=False, tensorboard=False)
  config.update({k: v for k, v in kw.items() if k != "workdir"})
  return train.fit(model, train_data=train.loader(rows, 4), workdir=kw.get("workdir"),
                   config=train.FitConfig(**config))


def _two_document_row(rows: dict[str, np.ndarray]) -> int:
  return int(np.flatnonzero((rows["segment_ids"].max(1) >= 2)
                            & (rows["segment_ids"] > 0).all(1))[0])


PACKABLE = [w for w in language_model.WEIGHTINGS if lm.takes_segments(w)]


def test_every_weighting_but_linear_attention_trains_on_packed_rows():
  assert set(language_model.WEIGHTINGS) - set(PACKABLE) == {"linear_elu"}
  with pytest.raises(ValueError, match="segment_ids need an attention of type 'dot'"):
    _fit(_model("linear_elu"), _rows(), num_steps=1)
  config = language_model.get_config("packed")
  assert "linear_elu" not in config.weightings
  config.weightings = "softmax,linear_elu"
  with pytest.raises(ValueError, match="config.packing=.first_fit. .* linear_elu cannot"):
    language_model.validate_config(config)


@pytest.mark.parametrize("weighting", PACKABLE)
@pytest.mark.split_by_jax
def test_a_model_trained_on_packed_rows_sees_nothing_of_another_document(weighting):
  rows = _rows()
  model = _model(weighting)
  res = _fit(model, rows)
  params = jax.tree.map(lambda a: np.asarray(a)[0], res.params)
  apply = train.make_apply_fn(model)
  r = _two_document_row(rows)
  batch = {k: v[r:r + 1] for k, v in rows.items()}
  ids = batch["segment_ids"][0]
  logits = np.asarray(apply(params, batch, True, jax.random.PRNGKey(0)))
  rng = np.random.default_rng(1)
  for seg in (1, 2):  # change every other document of the row: this one's logits stay
    other = batch["inputs"].copy()
    where = ids != seg
    other[0, where] = (other[0, where] + rng.integers(1, VOCAB, where.sum())) % VOCAB
    changed = np.asarray(apply(params, dict(batch, inputs=other), True, jax.random.PRNGKey(0)))
    np.testing.assert_allclose(changed[0, ids == seg], logits[0, ids == seg], atol=2e-6,
                               err_msg=f"{weighting}: document {seg} saw another one")
    assert not np.allclose(changed[0, where], logits[0, where], atol=1e-3)
  # Each document gets the logits it gets alone, from position 0 (the positions restart).
  for seg in (1, 2):
    tokens = batch["inputs"][:, ids == seg]
    alone = np.asarray(model.apply({"params": params}, tokens))
    np.testing.assert_allclose(logits[0, ids == seg], alone[0], atol=2e-5, rtol=1e-5)


def test_the_loss_skips_padding_and_equals_the_mean_over_documents():
  rows = _rows(seed=3)
  model = _model("softmax")
  params = jax.tree.map(lambda a: np.asarray(a)[0], _fit(model, rows, num_steps=2).params)
  padded = np.flatnonzero((rows["segment_ids"] == 0).any(1))
  assert len(padded), "the sample should have padding"
  batch = {k: v[padded[:4]] for k, v in rows.items()}
  out = train.make_apply_fn(model)(params, batch, True, jax.random.PRNGKey(0))
  loss, metrics = train.softmax_xent(out, batch)
  # Reference in float64: cross-entropy over the tokens of documents only.
  logits = np.asarray(out, np.float64)
  keep = batch["segment_ids"] > 0
  lse = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
  picked = np.take_along_axis(logits, np.where(keep, batch["targets"], 0)[..., None], -1)[..., 0]
  np.testing.assert_allclose(float(loss), (lse - picked)[keep].mean(), rtol=1e-5)
  assert np.all(batch["targets"][~keep] == IGNORE_INDEX)
  # Padding tokens change nothing the loss reads.
  noisy = batch["inputs"].copy()
  noisy[~keep] = (noisy[~keep] + 5) % VOCAB
  out2 = train.make_apply_fn(model)(params, dict(batch, inputs=noisy), True,
                                     jax.random.PRNGKey(0))
  np.testing.assert_allclose(float(train.softmax_xent(out2, batch)[0]), float(loss), rtol=1e-6)


def test_a_resumed_packed_run_is_bit_identical(tmp_path):
  rows = _rows(seed=5)
  model = _model("sigmoid:normalization=none")
  wd = str(tmp_path / "wd")
  full = _fit(model, rows, num_steps=8, num_seeds=2, checkpoint_every=4, workdir=wd)
  shutil.rmtree(tmp_path / "wd" / "checkpoints" / "run" / "8")
  resumed = _fit(model, rows, num_steps=8, num_seeds=2, checkpoint_every=4, workdir=wd)
  assert full.start_step == 0 and resumed.start_step == 4
  jax.tree.map(np.testing.assert_array_equal, full.params, resumed.params)


def test_packed_rows_for_a_model_without_segment_ids_are_refused():
  rows = _rows()
  arrays = {"inputs": rows["inputs"].astype(np.float32), "targets": rows["targets"] % 2,
            "segment_ids": rows["segment_ids"]}
  with pytest.raises(ValueError, match=r"packed documents \(segment_ids\) but TinyMLP"):
    _fit(TinyMLP(), arrays, num_steps=1)
