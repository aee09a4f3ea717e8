"""attnx.nn.gpt: the decoder-only GPT (KV cache == full causal pass, causality, tied embeddings,
positions), generate (seeded, greedy == argmax of the full forward, cache == recompute), dropout,
training under attnx.train.fit, and the model files of sample.py."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attnx import train
from attnx.nn import GPT, generate, gpt_from_spec, load_model_spec, save_model_spec

V, T = 13, 10
TOKENS = jax.random.randint(jax.random.PRNGKey(0), (2, T), 0, V)


def tiny(**kw) -> GPT:
  args = dict(vocab_size=V, num_layers=1, num_heads=2, hidden_dim=16, mlp_dim=32, max_len=T)
  return GPT(**{**args, **kw})


def init(model, x=TOKENS, **kw):
  return model.init(jax.random.PRNGKey(1), x, **kw)


def greedy_reference(model, params, prompt, n):
  """Greedy decoding by re-running the full forward pass on the whole (zero-padded) sequence
  and reading the logits after the last known token (the model is causal: tested above)."""
  t0 = prompt.shape[1]
  seq = np.zeros((prompt.shape[0], t0 + n), np.int32)
  seq[:, :t0] = np.asarray(prompt)
  forward = jax.jit(lambda x: model.apply({"params": params}, x))
  for t in range(t0, t0 + n):
    seq[:, t] = np.argmax(np.asarray(forward(seq)[:, t - 1]), -1)
  return seq


@pytest.mark.split_by_jax
@pytest.mark.parametrize("attention, positions", [
    ("softmax", "learned"), ("relu", "rotary"), ("sigmoid", "learned"),
    pytest.param("softmax", "rotary", marks=pytest.mark.slow),
    pytest.param("relu", "learned", marks=pytest.mark.slow),
    pytest.param("sigmoid", "rotary", marks=pytest.mark.slow)])
def test_kv_cache_steps_equal_full_causal_pass(attention, positions):
  model = tiny(attention=attention, positions=positions, num_layers=2)
  variables = init(model, decode=True)
  full = model.apply({"params": variables["params"]}, TOKENS)
  step = jax.jit(lambda cache, tok: model.apply({"params": variables["params"], "cache": cache},
                                                tok, decode=True, mutable=["cache"]))
  cache, steps = variables["cache"], []
  for t in range(T):
    logits, mut = step(cache, TOKENS[:, t:t + 1])
    cache = mut["cache"]
    steps.append(logits)
  chex.assert_trees_all_close(jnp.concatenate(steps, axis=1), full, atol=2e-5)


@pytest.mark.parametrize("attention", ["softmax", "relu", "linear_elu"])
def test_changing_a_future_token_leaves_earlier_logits(attention):
  model = tiny(attention=attention)
  params = init(model)["params"]
  other = TOKENS.at[:, 6].set((TOKENS[:, 6] + 1) % V)
  a, b = model.apply({"params": params}, TOKENS), model.apply({"params": params}, other)
  np.testing.assert_array_equal(np.asarray(a[:, :6]), np.asarray(b[:, :6]))
  assert np.abs(np.asarray(a[:, 6:] - b[:, 6:])).max() > 1e-4


@pytest.mark.parametrize("tied", [True, False])
def test_tied_embeddings_share_the_parameter(tied):
  model = tiny(tie_embeddings=tied)
  params = init(model)["params"]
  assert ("lm_head" in params) != tied
  assert params["embed"]["embedding"].shape == (V, 16)
  # Tokens 0 only: rows 1.. of the embedding reach the logits only through the output layer.
  zeros = jnp.zeros((1, T), jnp.int32)
  grad = jax.jit(jax.grad(lambda p: model.apply({"params": p}, zeros).sum()))(params)
  rows = np.abs(np.asarray(grad["embed"]["embedding"][1:])).max()
  assert (rows > 1e-6) == tied


def test_positions_learned_raise_beyond_max_len_rotary_does_not():
  model = tiny()
  params = init(model)["params"]
  long = jnp.zeros((1, 2 * T), jnp.int32)
  with pytest.raises(ValueError, match="exceeds max_len=10.*rotary"):
    model.apply({"params": params}, long)
  rotary = tiny(positions="rotary")
  params = init(rotary)["params"]
  assert "pos_embedding" not in params
  out = rotary.apply({"params": params}, jnp.zeros((1, 4 * T), jnp.int32))
  assert out.shape == (1, 4 * T, V) and bool(jnp.isfinite(out).all())


def test_bad_configurations_raise():
  with pytest.raises(ValueError, match="positions='rotary'.*'linear'"):
    tiny(attention="linear_elu", positions="rotary")
  with pytest.raises(ValueError, match="positions must be one of"):
    tiny(positions="sinusoidal")
  with pytest.raises(ValueError, match="implementation='blocked' applies to attention types"):
    tiny(attention="linear_elu", implementation="blocked")
  with pytest.raises(ValueError, match="vocab_size must be a positive integer"):
    tiny(vocab_size=0)


@pytest.mark.parametrize("positions", ["learned", pytest.param("rotary", marks=pytest.mark.slow)])
def test_generate_seeded_and_greedy_is_argmax_of_full_forward(positions):
  model = tiny(positions=positions, attention="relu")
  params = init(model)["params"]
  prompt = TOKENS[:, :3]
  greedy = generate(model, params, prompt, 7, rng=jax.random.PRNGKey(0), temperature=0.0)
  np.testing.assert_array_equal(np.asarray(greedy), greedy_reference(model, params, prompt, 7))
  assert greedy.shape == (2, T) and greedy.dtype == jnp.int32
  np.testing.assert_array_equal(np.asarray(greedy[:, :3]), np.asarray(prompt))
  top1 = generate(model, params, prompt, 7, rng=jax.random.PRNGKey(5), top_k=1)
  np.testing.assert_array_equal(np.asarray(top1), np.asarray(greedy))
  sample = lambda seed, **kw: np.asarray(generate(model, params, prompt, 7,
                                                  rng=jax.random.PRNGKey(seed), **kw))
  a = sample(3, temperature=2.0)
  np.testing.assert_array_equal(a, sample(3, temperature=2.0))  # same rng -> same tokens
  np.testing.assert_array_equal(a, sample(3, temperature=2.0, use_cache=False))  # both paths
  assert not np.array_equal(a, sample(4, temperature=2.0))
  assert ((a >= 0) & (a < V)).all()


@pytest.mark.parametrize("attention", ["softmax", "stick_breaking"])
def test_generate_prompts_of_different_lengths_with_a_paged_cache(attention):
  """A right-padded batch of prompts of different lengths gives each prompt's own greedy
  continuation, with the contiguous cache, a paged one and recomputation alike."""
  model = tiny(attention=attention, positions="rotary")
  params = init(model)["params"]
  lengths = np.asarray([2, 5, 3])
  prompts = jax.random.randint(jax.random.PRNGKey(7), (3, 5), 0, V)
  key = jax.random.PRNGKey(0)
  outs = [generate(model, params, prompts, 3, rng=key, temperature=0.0, prompt_lengths=lengths,
                   **kw) for kw in (dict(), dict(cache_page_size=3), dict(use_cache=False))]
  chex.assert_trees_all_equal(outs[0], outs[1])
  chex.assert_trees_all_equal(outs[0], outs[2])
  for i, n in enumerate(lengths):
    alone = generate(model, params, prompts[i:i + 1, :n], 8 - n, rng=key, temperature=0.0)
    np.testing.assert_array_equal(outs[0][i], alone[0])
  with pytest.raises(ValueError, match="prompt_lengths must be int"):
    generate(model, params, prompts, 3, rng=key, prompt_lengths=np.asarray([0, 5, 3]))
  with pytest.raises(ValueError, match="needs use_cache=True or None"):
    generate(model, params, prompts, 3, rng=key, use_cache=False, cache_page_size=2)


def test_generate_without_kv_cache_recomputes():
  model = tiny(attention="linear_elu")
  assert not model.supports_kv_cache
  params = init(model)["params"]
  out = generate(model, params, TOKENS[:, :4], 6, rng=jax.random.PRNGKey(0), temperature=0.0)
  np.testing.assert_array_equal(np.asarray(out),
                                greedy_reference(model, params, TOKENS[:, :4], 6))
  with pytest.raises(ValueError, match="'linear_elu'.*keeps no KV cache"):
    generate(model, params, TOKENS[:, :4], 6, rng=jax.random.PRNGKey(0), use_cache=True)


def test_generate_learned_positions_beyond_max_len_crops_the_context():
  model = tiny()
  params = init(model)["params"]
  out = generate(model, params, TOKENS[:, :4], 2 * T, rng=jax.random.PRNGKey(0),
                 temperature=0.0)
  assert out.shape == (2, 4 + 2 * T)
  # The last token is the argmax given the last max_len tokens before it.
  last = model.apply({"params": params}, out[:, -T - 1:-1])[:, -1]
  np.testing.assert_array_equal(np.asarray(out[:, -1]), np.asarray(jnp.argmax(last, -1)))
  with pytest.raises(ValueError, match="exceed context=10"):
    generate(model, params, TOKENS[:, :4], 2 * T, rng=jax.random.PRNGKey(0), use_cache=True)
  with pytest.raises(ValueError, match="context=11 exceeds max_len=10"):
    generate(model, params, TOKENS[:, :4], 2, rng=jax.random.PRNGKey(0), context=11)
  with pytest.raises(ValueError, match="context must be a positive int"):
    generate(model, params, TOKENS[:, :4], 2, rng=jax.random.PRNGKey(0), context=0)


def test_generate_rotary_crops_to_the_training_context_unless_told_otherwise():
  model = tiny(positions="rotary")
  params = init(model)["params"]
  gen = lambda **kw: generate(model, params, TOKENS[:, :4], 2 * T, rng=jax.random.PRNGKey(0),
                              temperature=0.0, **kw)
  cropped, longer = gen(), gen(context=4 + 2 * T)
  # Default (nanoGPT): each token is the argmax given the last max_len tokens before it.
  last = model.apply({"params": params}, cropped[:, -T - 1:-1])[:, -1]
  np.testing.assert_array_equal(np.asarray(cropped[:, -1]), np.asarray(jnp.argmax(last, -1)))
  # A context that holds everything: the KV cache, equal to the argmax of the full forward.
  np.testing.assert_array_equal(np.asarray(longer),
                                greedy_reference(model, params, TOKENS[:, :4], 2 * T))
  np.testing.assert_array_equal(np.asarray(gen(context=4 + 2 * T, use_cache=False)),
                                np.asarray(longer))


def test_dropout_only_when_not_deterministic():
  model = tiny(dropout_rate=0.3, attention_dropout_rate=0.2)
  params = init(model)["params"]
  run = lambda det, seed: np.asarray(model.apply({"params": params}, TOKENS, deterministic=det,
                                                 rngs={"dropout": jax.random.PRNGKey(seed)}))
  np.testing.assert_array_equal(run(True, 0), run(True, 1))
  np.testing.assert_array_equal(run(True, 0), np.asarray(model.apply({"params": params},
                                                                     TOKENS)))
  assert np.abs(run(False, 0) - run(True, 0)).max() > 1e-3
  assert np.abs(run(False, 0) - run(False, 1)).max() > 1e-3


def test_trains_under_fit():
  rng = np.random.default_rng(0)
  # Next token = previous + 1 (mod V) from a random start: learnable in a few steps.
  starts = rng.integers(0, V, size=(64, 1))
  seq = (starts + np.arange(T + 1)) % V
  arrays = {"inputs": seq[:, :-1].astype(np.int32), "targets": seq[:, 1:].astype(np.int32)}
  config = train.FitConfig(num_steps=25, optimizer=train.optimizer_config(learning_rate=1e-2),
                           log_every=5, progress=False, tensorboard=False)
  res = train.fit(tiny(positions="rotary", dropout_rate=0.1), train_data=train.loader(arrays, 16),
                  config=config)
  losses = [float(np.mean(h["loss"])) for h in res.history]
  assert losses[-1] < 0.7 * losses[0], losses


def test_model_spec_round_trip(tmp_path):
  model = tiny(attention={"weighting": "entmax:alpha=1.5"}, positions="rotary",
               dtype=jnp.bfloat16)
  path = tmp_path / "lm" / "run" / "model.json"
  vocab = "\nabcdefghijkl"
  save_model_spec(path, model, vocab=vocab, dataset="shakespeare")
  spec = load_model_spec(path)
  assert "".join(spec["vocab"]) == vocab and spec["dataset"] == "shakespeare"
  assert spec["encoding"] == "utf-8 characters"
  again = gpt_from_spec(spec)
  assert again == model
  with pytest.raises(ValueError, match="vocabulary has 3 tokens"):
    save_model_spec(path, model, vocab="abc")
