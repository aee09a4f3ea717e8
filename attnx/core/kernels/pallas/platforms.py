"""Code chosen per lowering platform, not per host.

A function traced on one machine may be lowered for another: ``jax.jit(f).trace(...).lower(
lowering_platforms=("cuda",))`` on a CPU host, ``jax.export(f, platforms=["cuda", "tpu"])``,
ahead-of-time compilation for a chip that is not there (:mod:`attnx.aot`). Asking
``jax.default_backend()`` while tracing picks the host's code for all of them. :func:`by_platform`
instead stages the GPU and the TPU code side by side; each lowering keeps its platform's code
only, and a multi-platform export keeps both, selected where the program is compiled.

Why not ``jax.lax.platform_dependent``: in a multi-platform lowering (jax 0.10–0.12) it lowers
each kept branch for *every* platform, and a Pallas kernel built for Triton cannot be lowered
for a TPU ("Compiler params for platform gpu cannot be used for tpu lowering"). The primitive
here lowers each branch for its own platforms only (JAX's per-platform lowering rules), and
carries its derivative as a custom VJP whose forward and backward are again chosen per
platform. JAX internals it relies on (registering lowering and batching rules) stay in this
module. The Triton kernels of the GPU branch lower for the GPU the caller named with
``jax.sharding.use_abstract_mesh`` (an ``AbstractDevice``), the host's GPU, or else an H100
(:func:`attnx.core.kernels.pallas.triton.pallas_call`).

A branch that cannot run on its platform (its code raises ValueError while traced) becomes
:func:`unlowerable`: the program still traces, and lowering it for that platform raises the
branch's error. Lowering for any other platform (a CPU) raises the caller's message.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jex_core
from jax.interpreters import batching, mlir

Array = jax.Array

GPU_PLATFORMS = ("cuda", "rocm")
_BRANCHES = ("gpu", "tpu", "other")  # "other": every platform that is neither


def _fail(*_: Any, reason: str, **__: Any) -> Any:
  raise ValueError(reason)


_unlowerable_p = jex_core.Primitive("attnx_unlowerable")
_unlowerable_p.def_impl(_fail)
_unlowerable_p.def_abstract_eval(
    lambda *, shape, dtype, reason: jax.core.ShapedArray(shape, dtype))
mlir.register_lowering(_unlowerable_p, _fail)


def unlowerable(shape: tuple[int, ...], dtype: Any, reason: str) -> Array:
  """An array of ``shape`` and ``dtype`` that no platform can compute: evaluating it, or
  lowering a program that needs it, raises ``ValueError(reason)``. Tracing is fine, so a
  platform's branch can stand in for code that only another platform runs."""
  # A symbolic dim (jax.export with a polymorphic batch) stays one.
  shape = tuple(d if jax.export.is_symbolic_dim(d) else int(d) for d in shape)
  return _unlowerable_p.bind(shape=shape, dtype=np.dtype(dtype),
                             reason=str(reason))


# The primitive: operands -> the outputs of the branch for the platform being lowered.
# Params gpu, tpu, other: ClosedJaxprs with the same input and output types.
_by_platform_p = jex_core.Primitive("attnx_by_platform")
_by_platform_p.multiple_results = True
_by_platform_p.def_abstract_eval(lambda *_, gpu, tpu, other: gpu.out_avals)
_by_platform_p.def_impl(
    lambda *args, **branches: jax.jit(lambda *a: _by_platform_p.bind(*a, **branches))(*args))


def _lowering(branch: str) -> Callable[..., Any]:
  def rule(ctx: Any, *args: Any, **branches: jex_core.ClosedJaxpr) -> Any:
    # lower_fun lowers the jaxpr for ctx.platforms, which JAX has narrowed to this rule's.
    fun = jex_core.jaxpr_as_fun(branches[branch])
    return mlir.lower_fun(fun, multiple_results=True)(ctx, *args)
  return rule


for _platform in GPU_PLATFORMS:
  mlir.register_lowering(_by_platform_p, _lowering("gpu"), platform=_platform)
mlir.register_lowering(_by_platform_p, _lowering("tpu"), platform="tpu")
mlir.register_lowering(_by_platform_p, _lowering("other"))


def _trace(fn: Callable[..., Sequence[Array]], args: Sequence[Any]) -> jex_core.ClosedJaxpr:
  jaxpr = jax.make_jaxpr(fn)(*args)
  if any(isinstance(c, jax.core.Tracer) for c in jaxpr.consts):
    raise ValueError("a by_platform branch closes over a traced value; pass it as an operand")
  return jaxpr


def _batch(args: Sequence[Array], dims: Sequence[Any], **branches: jex_core.ClosedJaxpr):
  size = next(x.shape[d] for x, d in zip(args, dims, strict=True) if d is not None)
  in_axes = list(dims)  # None: not mapped
  specs = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in args]
  batched = {n: _trace(jax.vmap(jex_core.jaxpr_as_fun(j), in_axes=in_axes, axis_size=size),
                       specs) for n, j in branches.items()}
  outs = _by_platform_p.bind(*args, **batched)
  return outs, [0] * len(outs)


batching.primitive_batchers[_by_platform_p] = _batch


def _bind(fns: dict[str, Callable[..., Sequence[Array]]], args: Sequence[Any]) -> list[Array]:
  return _by_platform_p.bind(*args, **{n: _trace(fns[n], args) for n in _BRANCHES})


def by_platform(*operands: Any, gpu: Callable[..., Array], tpu: Callable[..., Array],
                out: jax.ShapeDtypeStruct, other: str | Callable[..., Array]) -> Array:
  """``gpu(*operands)`` where the program is lowered for a GPU (cuda, rocm), ``tpu(*operands)``
  for a TPU, and an error with message ``other`` for any other platform.

  Differentiable (reverse mode) in the floating-point operands: the derivative is each
  branch's own, chosen per platform in the same way, and operands whose gradient is not asked
  for are not differentiated (a branch's custom VJP sees them as unperturbed). Works under
  ``jax.vmap``.

  Args:
    *operands: pytrees of arrays passed to the branch that runs.
    gpu, tpu: the branches; both must return an array like ``out``. A branch that raises
      ValueError while traced is replaced by :func:`unlowerable` with its message.
    out: the shape and dtype of the result.
    other: the branch for any other platform (a CPU), or the error message lowering for one
      raises (e.g. "needs a GPU or TPU").

  Raises:
    ValueError: now, when both branches raised (the error of the host's kind of device, else
      the GPU's); at lowering, for a platform whose branch raised, or for any other platform.
  """
  flat, tree = jax.tree.flatten(operands)
  errors: dict[str, ValueError] = {}

  def guarded(name: str, fn: Callable[..., Array]) -> Callable[..., Array]:
    def branch(*ops: Any) -> Array:
      if name not in errors:
        try:
          return fn(*ops)
        except ValueError as e:
          errors[name] = e
      # Outside the handler: run eagerly, this raises the same message without a chain.
      return unlowerable(out.shape, out.dtype, str(errors[name]))
    return branch

  fns = {"gpu": guarded("gpu", gpu), "tpu": guarded("tpu", tpu),
         "other": other if callable(other)
         else lambda *_: unlowerable(out.shape, out.dtype, other)}
  def on_leaves(fn: Callable[..., Array]) -> Callable[..., list[Array]]:
    return lambda *xs: [fn(*jax.tree.unflatten(tree, xs))]

  primal = {n: on_leaves(f) for n, f in fns.items()}
  primal_jaxprs = {n: _trace(primal[n], flat) for n in _BRANCHES}
  if len(errors) == 2:  # neither kind of device can run it: say so at once
    raise errors["tpu" if jax.default_backend() == "tpu" else "gpu"]

  @jax.custom_vjp
  def call(*xs: Array) -> Array:
    return _by_platform_p.bind(*xs, **primal_jaxprs)[0]

  def call_fwd(*primals: Any) -> tuple[Array, Any]:
    xs = [p.value for p in primals]
    diff = [p.perturbed and jnp.issubdtype(jnp.result_type(x), jnp.inexact)
            for p, x in zip(primals, xs, strict=True)]
    res_trees: dict[str, Any] = {}

    def forward(name: str) -> Callable[..., list[Array]]:
      def f(*xs: Array) -> list[Array]:
        def g(*dxs: Array) -> Array:
          it = iter(dxs)
          return primal[name](*[next(it) if d else x for x, d in zip(xs, diff, strict=True)])[0]
        o, pullback = jax.vjp(g, *[x for x, d in zip(xs, diff, strict=True) if d])
        leaves, res_trees[name] = jax.tree.flatten(pullback)
        return [o, *leaves]
      return f

    fwd_jaxprs = {n: _trace(forward(n), xs) for n in _BRANCHES}
    res_avals = {n: fwd_jaxprs[n].out_avals[1:] for n in _BRANCHES}

    def padded(name: str) -> Callable[..., list[Array]]:
      # Every branch returns the residuals of all three, zeros for the others' (types must
      # agree); the lowering for one platform never reads the others' and XLA drops them.
      def f(*xs: Array) -> list[Array]:
        o, *mine = jex_core.jaxpr_as_fun(fwd_jaxprs[name])(*xs)
        rest = [mine if m == name else [jnp.zeros(a.shape, a.dtype) for a in res_avals[m]]
                for m in _BRANCHES]
        return [o, *itertools.chain(*rest)]
      return f

    outs = _bind({n: padded(n) for n in _BRANCHES}, xs)
    counts = [len(res_avals[n]) for n in _BRANCHES]
    starts = dict(zip(_BRANCHES, itertools.accumulate([0, *counts]), strict=False))

    def backward(name: str) -> Callable[..., list[Array]]:
      def f(*args: Array) -> list[Array]:
        *res, ct = args
        mine = res[starts[name]:starts[name] + len(res_avals[name])]
        return list(jax.tree.unflatten(res_trees[name], mine)(ct))
      return f

    def pullback(res: Sequence[Array], ct: Any) -> tuple[Array | None, ...]:
      if isinstance(ct, jax.custom_derivatives.SymbolicZero):
        return (None,) * len(xs)
      cts = iter(_bind({n: backward(n) for n in _BRANCHES}, [*res, ct]))
      return tuple(next(cts) if d else None for d in diff)

    # Partial: the pullback (static) and the residuals (arrays) as one residual pytree.
    return outs[0], jax.tree_util.Partial(pullback, outs[1:])

  call.defvjp(call_fwd, lambda res, ct: res(ct), symbolic_zeros=True)
  return call(*flat)
