"""Train-step construction: one per-seed step, vmapped over seeds, optionally data-parallel.

A train state is a dict pytree with a leading seed axis on every leaf:
  params     model parameters
  opt_state  optax state
  extra      (only if the model has them) non-trained variable collections, e.g. FAVOR+
             random features: passed to apply, never updated
  key        raw uint32 PRNG key per seed (dropout key at step t is fold_in(key, t))
  bad_step   int32, first step whose loss was NaN/Inf (-1 if none); tracked on device so that
             detecting a blow-up needs no host sync per step.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from attnx.train import workarounds
from attnx.train.losses import LossFn, loss_sums, reduce_sums

ApplyFn = Callable[..., jax.Array]


def accepts_arg(fn: Callable, name: str) -> bool:
  try:
    params = inspect.signature(fn).parameters
  except (TypeError, ValueError):
    return True
  return name in params or any(p.kind is p.VAR_KEYWORD for p in params.values())


def model_inputs(batch: dict) -> tuple:
  """Default positional model inputs: (inputs,) or (inputs, decoder_inputs) for seq2seq."""
  if "decoder_inputs" in batch:
    return batch["inputs"], batch["decoder_inputs"]
  return (batch["inputs"],)


# Batch entries of packed rows (attnx.data.packing) that a model takes by name.
PACKED_KEYS = ("segment_ids", "positions")


def packed_kwargs(model: nn.Module, batch: dict) -> dict:
  """The batch's packed-row entries (:data:`PACKED_KEYS`), passed to the model by name.

  Raises:
    ValueError: the batch has one that the model's __call__ does not take — dropping it would
      let every token attend across the documents of its row.
  """
  keys = [k for k in PACKED_KEYS if k in batch]
  missing = [k for k in keys if not accepts_arg(type(model).__call__, k)]
  if missing:
    raise ValueError(
        f"The batch holds packed documents ({', '.join(missing)}) but "
        f"{type(model).__name__}.__call__ takes no {' / '.join(missing)} argument: its tokens "
        "would attend across the documents of a row. Use a model that takes them (e.g. "
        "attnx.nn.GPT) or unpacked data.")
  return {k: batch[k] for k in keys}


def make_apply_fn(model: nn.Module,
                  inputs_fn: Callable[[dict], tuple] = model_inputs) -> ApplyFn:
  """`apply(params, batch, deterministic, rng, extra=None) -> outputs` (attnx's convention).

  `deterministic` is only passed when the module's __call__ accepts it, so plain Flax modules
  work too. A batch of packed rows passes its ``segment_ids`` / ``positions`` by name
  (:func:`packed_kwargs`).
  """
  takes_det = accepts_arg(type(model).__call__, "deterministic")

  def apply(params, batch, deterministic, rng, extra=None):
    kwargs = {"deterministic": deterministic} if takes_det else {}
    variables = {"params": params, **(extra or {})}
    return model.apply(variables, *inputs_fn(batch), rngs={"dropout": rng}, **kwargs,
                       **packed_kwargs(model, batch))

  return apply


def init_state(model: nn.Module, tx: optax.GradientTransformation, seeds: list[int],
               sample_batch: dict,
               inputs_fn: Callable[[dict], tuple] = model_inputs) -> dict:
  """Stacked train state for `seeds` (params init from PRNGKey(seed), one compiled program).

  The seeds are initialized one after another (`workarounds.init_seeds`: a vmapped orthogonal
  initializer deadlocks XLA's CPU pool on 2 cores); the values equal vmap's.
  """
  takes_det = accepts_arg(type(model).__call__, "deterministic")
  inputs = inputs_fn(sample_batch)

  def one(seed_key):
    pkey, dkey, skey = jax.random.split(seed_key, 3)
    kwargs = {"deterministic": True} if takes_det else {}
    variables = dict(model.init({"params": pkey, "dropout": dkey}, *inputs, **kwargs,
                                **packed_kwargs(model, sample_batch)))
    params = variables.pop("params")
    state = {"params": params, "opt_state": tx.init(params), "key": skey,
             "bad_step": jnp.int32(-1)}
    if variables:
      state["extra"] = variables
    return state

  keys = jnp.stack([jax.random.PRNGKey(s) for s in seeds])
  return jax.jit(lambda ks: workarounds.init_seeds(one, ks))(keys)


def seed_step(state: dict, batch: dict, step: jax.Array, *, apply_fn: ApplyFn, loss_fn: LossFn,
              tx: optax.GradientTransformation, axis_name: str | None = None):
  """One optimization step for one seed; with `axis_name`, a data-parallel step over it.

  Data parallelism minimizes the global mean loss: sum over all shards / count over all shards
  (see `attnx.train.losses`). Each shard differentiates its own sum divided by the global
  count, and the gradients are psum'd, which is that mean's gradient even when shards hold
  different numbers of valid positions. Metrics are global sums / global counts too.
  """
  rng = jax.random.fold_in(state["key"], step)
  if axis_name is not None:
    # Different dropout masks on different data shards.
    rng = jax.random.fold_in(rng, jax.lax.axis_index(axis_name))
  sums_fn = loss_sums(loss_fn)

  def objective(params):
    out = apply_fn(params, batch, False, rng, state.get("extra"))
    sums = sums_fn(out, batch)
    total, count = sums["loss"]
    if axis_name is not None:
      count = jax.lax.psum(jax.lax.stop_gradient(count), axis_name)
    return total / jnp.maximum(count, 1), sums

  grads, sums = jax.grad(objective, has_aux=True)(state["params"])
  if axis_name is not None:
    grads = jax.lax.psum(grads, axis_name)
  loss, metrics = reduce_sums(sums, axis_name)
  metrics = dict(metrics, loss=loss)
  updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
  params = optax.apply_updates(state["params"], updates)
  finite = jnp.isfinite(metrics["loss"])
  bad = jnp.where((state["bad_step"] < 0) & ~finite, step.astype(jnp.int32), state["bad_step"])
  new_state = dict(state, params=params, opt_state=opt_state, bad_step=bad)
  return new_state, metrics


def make_step(apply_fn: ApplyFn, loss_fn: LossFn, tx: optax.GradientTransformation,
              parallel: str = "none", mesh: jax.sharding.Mesh | None = None,
              donate: bool = True) -> Callable:
  """`step(state, batch, step) -> (state, metrics)` over stacked seeds.

  parallel="none": jit(vmap(seed_step)). "shard_map": the batch axis (axis 1 of [S, B, ...])
  is sharded over the mesh's `data` axis, params replicated, gradients reduced over it (see
  `seed_step`); on a 2-D (data, seq) mesh (`parallel.data_mesh(sequence_parallel)`) every
  array's sequence axis (axis 2) is sharded over `seq` too, and the loss and gradients are
  reduced over both (the model's attention must then be ring attention over `seq`, e.g.
  ``MultiHeadAttention(sequence_axis="seq")``). "pmap": the same as "shard_map" on a 1-D mesh
  with jax.pmap; state has a leading device axis and batches are [D, S, B/D, ...].
  """
  kw = dict(apply_fn=apply_fn, loss_fn=loss_fn, tx=tx)
  donate_argnums = (0,) if donate else ()
  if parallel == "none":
    f = jax.vmap(functools.partial(seed_step, **kw), in_axes=(0, 0, None))
    return jax.jit(f, donate_argnums=donate_argnums)
  axes = tuple(mesh.axis_names) if parallel == "shard_map" and mesh is not None else ("data",)
  axis_name = axes if len(axes) > 1 else axes[0]
  inner = jax.vmap(functools.partial(seed_step, axis_name=axis_name, **kw), in_axes=(0, 0, None))
  if parallel == "shard_map":
    from jax.sharding import PartitionSpec as P
    assert mesh is not None, "shard_map needs a mesh"
    # check_vma=False: with it on, autodiff already psums the gradient of the replicated
    # (unvarying) params over `data`, and seed_step's own psum would count it D times. Off,
    # shard_map differentiates per shard as pmap does, so one seed_step serves both modes.
    f = jax.shard_map(inner, mesh=mesh, in_specs=(P(), P(None, *axes), P()),
                      out_specs=(P(), P()), check_vma=False)
    return jax.jit(f, donate_argnums=donate_argnums)
  if parallel == "pmap":
    return jax.pmap(inner, axis_name="data", in_axes=(0, 0, None),
                    donate_argnums=donate_argnums)
  raise ValueError(f"parallel={parallel!r} is not one of ('none', 'shard_map', 'pmap')")
