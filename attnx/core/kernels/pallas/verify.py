"""The explicit verification of the Pallas kernels, and the automatic choice's policy.

* :func:`verify_pallas` — a one-time self-check per (backend, weighting, dtype, head size)
  (:func:`self_check` compares with the blocked kernel), cached, one warning when it fails. It
  runs eagerly on inputs of its own, outside any caller's trace.
* :func:`decline_reason` / :func:`choose_pallas` — the automatic choice's policy: GPU/TPU
  only, whole-row weightings on a GPU only, verified combinations only
  (:class:`attnx.core.implementations.pallas.PallasImplementation` asks it).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from attnx.core.kernels.pallas import tiles, wrapper
from attnx.core.weightings import Pointwise

Array = jax.Array

__all__ = ["SELF_CHECK_RTOL", "PallasVerification", "choose_pallas", "clear_verifications",
           "decline_reason", "self_check", "verify_pallas", "weighting_key"]

_LOG = logging.getLogger(__name__)


# The answers of verify_pallas, per (backend, weighting_key, dtype name, head_dim): None when
# the self-check passed, else its reason.
_VERIFIED: dict[tuple[Any, ...], str | None] = {}


# Relative tolerance of the self-check: max |pallas − blocked| / max |blocked| over the output
# and the gradients. Wrong kernels are off by O(1); rounding differences (bf16 probabilities,
# default-precision matmuls on a TPU) stay far below these.
SELF_CHECK_RTOL = {"float32": 2e-2, "bfloat16": 8e-2, "float16": 8e-2}


def _value_key(x: Any, depth: int = 0) -> Any:
  if isinstance(x, (bool, int, float, str, type(None))):
    return x
  if callable(x) and depth < 4 and hasattr(x, "__code__"):
    cells = tuple(_value_key(c.cell_contents, depth + 1) for c in (x.__closure__ or ()))
    return (x.__code__, cells)
  return id(x)


def weighting_key(w: Any) -> tuple[Any, ...]:
  """A hashable identity of a weighting's math: its fields and its F's code and closure (a
  whole-row weighting: its name and streaming parameters).

  Two ``get_weighting("power:p=3")`` calls give equal keys; two different user callables
  (even with the same ``__name__``) give different ones.
  """
  if not isinstance(w, Pointwise):
    return (w.name, w.stream)
  log_f = None if w.log_f is None else tuple(
      _value_key(getattr(w.log_f, f)) for f in ("fn", "bound", "shifted"))
  return (w.name, w.normalization, w.exp_alpha, w.denominator_offset, w.distance_kernel,
          _value_key(w.fn), log_f)


def clear_verifications() -> None:
  """Forgets every :func:`verify_pallas` answer (for tests, or after changing the kernels)."""
  _VERIFIED.clear()


def self_check(backend: str, weighting: Any, dtype: Any, head_dim: int, *,
               kernel: Callable[..., Array] | None = None, interpret: bool = False,
               seed: int = 0) -> str | None:
  """Compiles and runs the Pallas kernel on a small problem and compares it with the blocked
  kernel: output and gradients w.r.t. q, k, v (B = 1, T = S = 256 → 8 × 8 tiles on a GPU, N = 2
  query heads sharing K = 1 kv head, causal). Returns None if they agree within
  :data:`SELF_CHECK_RTOL`, else a reason; compile/run errors propagate. The default check
  of :func:`verify_pallas`, which runs it eagerly outside any caller's trace.

  ``kernel`` replaces :func:`.wrapper.pallas_attention` (for tests: a kernel made to fail or to
  be wrong). Distance kernels (``w.distance_kernel``) get scores −‖q − k‖² through
  ``Score.to_dot`` (head_dim counts the two extra columns), the others q·k/√H.
  """
  from attnx.core.kernels.xla.pointwise import blocked_attention  # noqa: PLC0415
  from attnx.core.kernels.xla.rows import blocked_row_attention  # noqa: PLC0415

  kernel = kernel or wrapper.pallas_attention
  blocked = blocked_attention if isinstance(weighting, Pointwise) else blocked_row_attention
  dtype = jnp.dtype(dtype)
  rng = np.random.default_rng(seed)
  n, t = 2, 64 if interpret else 256
  kw = dict(weighting=weighting, is_causal=True)
  normal = lambda *shape: rng.standard_normal(shape).astype(np.float32)
  # NumPy outside the compiled programs, so that the check stays eager also when called
  # directly (not through verify_pallas) while a caller's function is traced.
  if getattr(weighting, "distance_kernel", False) and head_dim > 2:
    # Score.to_dot of neg_sq_dist: s = [2q, −‖q‖², −1]·[k, 1, ‖k‖²] = −‖q − k‖².
    xq, xk = normal(1, t, 1, head_dim - 2) * 0.5, normal(1, t, 1, head_dim - 2) * 0.5
    qq, kk = np.sum(xq * xq, -1, keepdims=True), np.sum(xk * xk, -1, keepdims=True)
    q = np.repeat(np.concatenate([2 * xq, -qq, -np.ones_like(qq)], -1), n, axis=2)
    k = np.concatenate([xk, np.ones_like(kk), kk], -1)
    kw["scale"] = 1.0
  else:
    q, k = normal(1, t, n, head_dim), normal(1, t, 1, head_dim)
    kw["scale"] = 1.0 / math.sqrt(head_dim)
  args = [x.astype(dtype) for x in (q, k, normal(1, t, 1, head_dim))]
  ct = normal(1, t, n, head_dim)

  def run(fn):
    def prog(q, k, v):
      loss = lambda q, k, v: jnp.sum(fn(q, k, v).astype(jnp.float32) * ct)
      return fn(q, k, v), jax.grad(loss, argnums=(0, 1, 2))(q, k, v)
    out, grads = jax.jit(prog).lower(*args).compile()(*args)
    return [np.asarray(x).astype(np.float32) for x in (out, *grads)]

  got = run(lambda q, k, v: kernel(q, k, v, backend=backend, interpret=interpret, **kw))
  want = run(lambda q, k, v: blocked(q, k, v, **kw))
  rtol = SELF_CHECK_RTOL.get(dtype.name, 8e-2)
  for name, a, b in zip(("output", "dq", "dk", "dv"), got, want, strict=True):
    ref = float(np.max(np.abs(b))) if b.size else 0.0
    err = float(np.max(np.abs(a - b))) if a.size else 0.0
    if not np.isfinite(err) or err > rtol * max(ref, 1e-6):
      return (f"{name} differs from the blocked kernel: max abs error {err:.3g} vs max "
              f"|blocked| {ref:.3g} (tolerance {rtol:g} relative)")
  return None


@dataclasses.dataclass(frozen=True)
class PallasVerification:
  """What :func:`verify_pallas` found for one (backend, weighting, dtype, head size).

  Truthy iff ``ok``.

  Attributes:
    ok: the Pallas kernels compiled, ran and agreed with the blocked kernel (now, or in an
      earlier call: answers are cached per process).
    reason: None when ``ok``, else why not: the combination is not supported (no GPU/TPU,
      dtype, head size: :func:`.tiles.supported`), a result differs from the blocked kernel, or
      the compile/run error (its type and first line).
    backend: "gpu" or "tpu", or None when no Pallas backend applies.
    weighting: the weighting's name.
    dtype: the dtype's name.
    head_dim: the head size verified.
    checked: whether the answer comes from a self-check (run now or cached); False when the
      combination was rejected before compiling anything.
  """

  ok: bool
  reason: str | None
  backend: str | None
  weighting: str
  dtype: str
  head_dim: int
  checked: bool

  def __bool__(self) -> bool:
    return self.ok


def _run_check(check_fn: Callable[..., str | None], backend: str, weighting: Any, dtype: str,
               head_dim: int) -> str | None:
  """``check_fn``'s reason (None: passed); an exception it raises is a reason too."""
  try:
    # The check builds its own concrete inputs from the static description it gets (never an
    # array of the caller), and ensure_compile_time_eval makes it run eagerly even when
    # verify_pallas is called while the caller's function is traced by jit/grad/vmap: nothing
    # is staged into the caller's program.
    with jax.ensure_compile_time_eval():
      return check_fn(backend, weighting, dtype, head_dim)
  except Exception as e:  # noqa: BLE001 - any compile/run failure means "not verified"
    first = str(e).strip().splitlines()[0][:300] if str(e).strip() else ""
    return f"{type(e).__name__}: {first}"


def verify_pallas(weighting: Any, dtype: Any, head_dim: int, *, backend: str | None = None,
                  value_head_dim: int | None = None,
                  check_fn: Callable[..., str | None] | None = None) -> PallasVerification:
  """Verifies that the Pallas kernels run ``weighting`` correctly on this machine: compiles and
  runs them once on a small problem of their own and compares with the blocked kernel
  (:func:`self_check`: output and gradients).

  The automatic choice (``attnx.core.attention(..., implementation=None)``) uses Pallas on a
  GPU/TPU only for verified combinations, and verifies a new one the first time it meets it.
  Calling this ahead of time moves that compile and run (seconds) out of the first model call
  and shows the answer; a failing combination makes the automatic choice use the blocked
  kernel, with one warning. An explicit ``implementation="pallas"`` never consults it.

  Answers are cached per (backend, weighting, dtype, head_dim) for the process, so the check
  runs at most once per combination (:func:`clear_verifications` forgets them). The check
  sees only this static description, never the caller's arrays, and runs eagerly on concrete
  inputs of its own, also when called while a function is being traced (jit, grad, vmap):
  it adds nothing to the caller's program.

  Args:
    weighting: a weighting name (``"softmax"``, ``"power:p=3"``), object or callable F.
    dtype: the dtype the kernels compute in (the query's, after the score's transform).
    head_dim: the query/key head size the kernels see (a distance score adds 2 columns).
    backend: "gpu"/"tpu" (aliases as :func:`.tiles.resolve_backend`) or None for the default
      device; a CPU gives ``ok=False`` (the interpreter is for tests, not a backend to choose).
    value_head_dim: the value head size, checked against the backend's limits (the self-check
      itself uses ``head_dim`` for the values).
    check_fn: ``(backend, weighting, dtype_name, head_dim) -> reason | None`` replacing
      :func:`self_check` (tests use it to make a check fail); a raised exception is a reason.

  Returns:
    A :class:`PallasVerification` (truthy iff ``ok``).
  """
  from attnx.core.weightings import get_weighting  # noqa: PLC0415 (weightings imports jax only)

  w = get_weighting(weighting)
  dt = jnp.dtype(dtype).name
  head_dim = int(head_dim)
  result = functools.partial(PallasVerification, weighting=w.name, dtype=dt, head_dim=head_dim)
  try:
    be = tiles.resolve_backend(backend)
  except ValueError as e:  # a CPU (backend None) or an unknown name
    return result(ok=False, reason=str(e), backend=None, checked=False)
  reason = tiles.supported(w, backend=be, dtype=dt, head_dim=head_dim,
                           value_head_dim=value_head_dim)
  if reason is not None:
    return result(ok=False, reason=reason, backend=be, checked=False)
  key = (be, weighting_key(w), dt, head_dim)
  if key not in _VERIFIED:
    reason = _run_check(check_fn or self_check, be, w, dt, head_dim)
    if reason is not None:
      _LOG.warning("Pallas attention self-check failed for backend=%s, weighting=%s, dtype=%s, "
                   "head_dim=%d: %s. Using implementation='blocked' for this combination.",
                   be, w.name, dt, head_dim, reason)
    _VERIFIED[key] = reason
  reason = _VERIFIED[key]
  return result(ok=reason is None, reason=reason, backend=be, checked=True)


def decline_reason(backend: str | None, weighting: Any, dtype: Any, head_dim: int, *,
                   value_head_dim: int | None = None,
                   check_fn: Callable[..., str | None] | None = None) -> str | None:
  """Why the automatic choice should not use the Pallas kernels for this combination, or None
  when it should (it then runs them instead of the blocked kernel).

  Not on a CPU; whole-row weightings on a GPU only (measured 3–13× the blocked kernel's
  fwd+bwd on an H100; on a TPU their kernels hold whole sequences in VMEM and run on explicit
  request only); otherwise only if :func:`verify_pallas` passes (run with ``check_fn`` the
  first time; one warning if it fails). Arguments as :func:`verify_pallas`.
  """
  try:
    be = tiles.resolve_backend(backend)
  except ValueError as e:
    return str(e)
  if not isinstance(weighting, Pointwise) and be != "gpu":
    return (f"the automatic choice runs the whole-row Pallas kernels ({weighting.name!r}) on a "
            "GPU only: on a TPU they hold whole sequences in VMEM (implementation='pallas' runs "
            "them on request)")
  v = verify_pallas(weighting, dtype, head_dim, backend=be, value_head_dim=value_head_dim,
                    check_fn=check_fn)
  if v.ok:
    return None
  return f"the Pallas self-check failed: {v.reason}" if v.checked else v.reason


def choose_pallas(backend: str | None, weighting: Any, dtype: Any, head_dim: int, *,
                  value_head_dim: int | None = None,
                  check_fn: Callable[..., str | None] | None = None) -> bool:
  """Whether ``implementation=None`` uses the Pallas kernels for this combination:
  :func:`decline_reason` is None. Explicit ``implementation="pallas"`` never asks."""
  return decline_reason(backend, weighting, dtype, head_dim, value_head_dim=value_head_dim,
                        check_fn=check_fn) is None
