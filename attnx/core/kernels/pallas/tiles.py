"""The Pallas kernels' backends, what each supports, and their tiles.

* :func:`resolve_backend` / :func:`backend_for_platform` — the kernel family ("gpu": Triton,
  "tpu": Mosaic) of a name or a JAX platform;
* :func:`supported` — why a combination cannot run (None when it can);
* :func:`default_block_sizes` / :func:`check_block_sizes` — per-backend tile rules, the GPU's
  from tables of spill-free tiles per dtype width, head size and streaming family;
* :func:`kernel_tiles` — the tiles and GPU launch parameters of one problem.
"""

from __future__ import annotations

import dataclasses
import numbers
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from attnx.core.kernels.common import round_up
from attnx.core.kernels.pallas import tile_cache
from attnx.core.kernels.pallas.rows import streams
from attnx.core.weightings import Pointwise

BACKENDS = ("gpu", "tpu")
_BACKEND_ALIASES = {"gpu": "gpu", "cuda": "gpu", "rocm": "gpu", "triton": "gpu", "tpu": "tpu",
                    "mosaic": "tpu"}
_DTYPES = {"gpu": ("float32", "bfloat16", "float16"), "tpu": ("float32", "bfloat16")}
GPU_MAX_HEAD_DIM = 256  # after padding to a multiple of 16: larger tiles do not fit in registers
GPU_MIN_BLOCK = 16  # tl.dot needs every matmul dim ≥ 16
TPU_SUBLANES = 8
TPU_LANES = 128

__all__ = ["BACKENDS", "GPU_MAX_HEAD_DIM", "GPU_MIN_BLOCK", "TPU_LANES", "TPU_SUBLANES",
           "BlockSizes", "GpuTier", "GpuTile", "GpuTiles", "backend_for_platform",
           "check_block_sizes", "default_block_sizes", "gpu_tier", "gpu_tiles", "kernel_tiles",
           "pow2", "q_align", "resolve_backend", "supported", "timed_kernels", "tuned_tiles"]


def resolve_backend(backend: str | None = None, interpret: bool = False) -> str:
  """``"gpu"`` or ``"tpu"``: the kernel family to build.

  ``None`` follows ``jax.default_backend()``; on a CPU it is an error unless ``interpret``
  (then the GPU kernels run in Pallas' interpreter). ``"cuda"``, ``"rocm"``, ``"triton"``
  mean ``"gpu"`` and ``"mosaic"`` means ``"tpu"``. An explicit backend is accepted on any
  machine, so that a CPU can trace and lower the kernels for a GPU/TPU.
  """
  if backend is None:
    return backend_for_platform(jax.default_backend(), interpret)
  name = _BACKEND_ALIASES.get(str(backend).lower())
  if name is None:
    raise ValueError(f"Unknown Pallas backend {backend!r}; valid: 'gpu' (Triton) or 'tpu' "
                     "(Mosaic), or None for the default device.")
  return name


def backend_for_platform(platform: str, interpret: bool = False) -> str:
  """``"gpu"`` or ``"tpu"``: the kernel family for the JAX platform ``platform`` (what
  ``jax.default_backend()`` names); a CPU is an error unless ``interpret``."""
  if platform in _BACKEND_ALIASES:
    return _BACKEND_ALIASES[platform]
  if interpret:
    return "gpu"
  raise ValueError(
      f"implementation='pallas' needs a GPU or TPU; this machine runs JAX on {platform!r}. "
      "Use implementation=core.Pallas(interpret=True) (here: interpret=True) to run the "
      "kernels in Pallas' interpreter (slow; for testing), or implementation='blocked' (the "
      "XLA flash-style kernel) on a CPU.")


def supported(weighting: Any, *, backend: str | None = None, dtype: Any = None,
              head_dim: int | None = None, value_head_dim: int | None = None,
              interpret: bool = False) -> str | None:
  """Why ``implementation="pallas"`` cannot run this combination, or None if it can.

  Checks the weighting (pointwise, or a whole-row weighting with a streaming family:
  :mod:`attnx.core.kernels.pallas.rows`), the backend (a GPU/TPU, or ``interpret`` on a CPU),
  the dtype (float32/bfloat16, and float16 on the GPU) and the GPU's head-size limit
  (:data:`GPU_MAX_HEAD_DIM` after padding to a multiple of 16). Whether F lowers on the backend is
  found out by compiling it (:func:`self_check`).
  """
  if not isinstance(weighting, Pointwise) and not streams(weighting):
    name = getattr(weighting, "name", type(weighting).__name__)
    return (f"weighting {name!r} normalizes whole rows and has no streaming form; use "
            "implementation='dense'")
  try:
    be = resolve_backend(backend, interpret)
  except ValueError as e:
    return str(e)
  if dtype is not None:
    name = jnp.dtype(dtype).name
    if name not in _DTYPES[be]:
      return (f"dtype {name} is not supported by the Pallas {be} kernels (supported: "
              f"{', '.join(_DTYPES[be])}); use implementation='blocked'")
  if be == "gpu":
    for label, h in (("head dim", head_dim), ("value head dim", value_head_dim)):
      if h is not None and round_up(h, GPU_MIN_BLOCK) > GPU_MAX_HEAD_DIM:
        return (f"{label} {h} exceeds the GPU kernel's limit {GPU_MAX_HEAD_DIM}; use "
                "implementation='blocked'")
  return None


def pow2(x: int) -> int:
  return max(GPU_MIN_BLOCK, 1 << max(int(x) - 1, 0).bit_length())


@dataclasses.dataclass(frozen=True)
class BlockSizes:
  """Tile sizes of the three kernels: forward, dQ and dK/dV (queries × keys each)."""

  block_q: int
  block_k: int
  block_q_dq: int
  block_k_dq: int
  block_q_dkv: int
  block_k_dkv: int


class GpuTile(NamedTuple):
  """One GPU kernel's launch: a ``block_q`` × ``block_k`` tile on ``warps`` warps."""

  block_q: int
  block_k: int
  warps: int
  # dK/dV only: dK and dV in two passes of one accumulator each (the scores computed twice; the
  # dV pass needs neither V nor dP), where the fused pass spilled registers at every tile tried.
  two_pass_dkv: bool = False


class GpuTiles(NamedTuple):
  """The launches of the three GPU kernels: forward, dQ and dK/dV."""

  fwd: GpuTile
  dq: GpuTile
  dkv: GpuTile

  def block_sizes(self) -> BlockSizes:
    return BlockSizes(block_q=self.fwd.block_q, block_k=self.fwd.block_k,
                      block_q_dq=self.dq.block_q, block_k_dq=self.dq.block_k,
                      block_q_dkv=self.dkv.block_q, block_k_dkv=self.dkv.block_k)


class GpuTier(NamedTuple):
  """A row of the GPU tile table: the tiles of one dtype width up to a padded head size."""

  float32: bool  # 32-bit dtypes (else 16-bit)
  max_head_dim: int  # the largest padded head size of the tier (256: every larger one too)
  tiles: GpuTiles
  # The tier's dQ and dK/dV tiles were chosen by time on a GPU (tools/gpu_tile_sweep.py), not by
  # the compile-time proxy "no register spills": a spill there is a measured trade.
  timed: bool = False


# GPU tiles and warps per kernel, by dtype width and padded head size, with overrides per
# streaming family: for each kernel the first of a small grid of candidates that compiled with
# no register spills for an H100 *and* an A100 (ptxas at XLA's production settings;
# experiments/kernel_compile.py) for the F of the tier (pointwise: softmax, sigmoid, power,
# softplus; every whole-row family), causal GQA at T = 2048: Triton's tutorial tiles spilled
# (docs/guides/pallas.md). Where a GPU was at hand the dQ and dK/dV tiles were then chosen by
# time instead (GpuTier.timed: the spill-free ones made fwd+bwd 2.2-2.4x slower, fewer threads
# in flight costing more than the spills saved). Where the fused dK/dV pass spilled at every
# tile (float32 at H > 64: the dK and dV accumulators and the K, V tiles in registers), dK and
# dV run as two passes (GpuTile.two_pass_dkv). Where no candidate was spill-free (the distance
# kernels' dK at H = 128; stick-breaking's dK at float32 H = 256 with a bias) the table keeps
# the best one (docs/known_limits.md). Tiers are tried in order. The distance kernels run their
# dot form (H + 2 columns) in float32: H = 64 and 128 land in the float32 tiers of 80 and 160.
_GPU_TIERS: tuple[GpuTier, ...] = (
    GpuTier(False, 64, GpuTiles(fwd=GpuTile(128, 64, 8), dq=GpuTile(64, 64, 4),
                                dkv=GpuTile(64, 64, 4)), timed=True),
    GpuTier(False, 128, GpuTiles(fwd=GpuTile(128, 32, 8), dq=GpuTile(64, 32, 4),
                                 dkv=GpuTile(64, 64, 4)), timed=True),
    GpuTier(False, 256, GpuTiles(fwd=GpuTile(64, 64, 8), dq=GpuTile(64, 16, 8),
                                 dkv=GpuTile(16, 64, 8))),
    GpuTier(True, 64, GpuTiles(fwd=GpuTile(128, 32, 8), dq=GpuTile(64, 16, 8),
                               dkv=GpuTile(16, 32, 4))),
    GpuTier(True, 80, GpuTiles(fwd=GpuTile(32, 64, 4), dq=GpuTile(64, 16, 8),
                               dkv=GpuTile(16, 16, 8, two_pass_dkv=True))),
    GpuTier(True, 128, GpuTiles(fwd=GpuTile(32, 32, 8), dq=GpuTile(64, 16, 8),
                                dkv=GpuTile(16, 64, 8, two_pass_dkv=True))),
    GpuTier(True, 160, GpuTiles(fwd=GpuTile(32, 32, 8), dq=GpuTile(64, 16, 8),
                                dkv=GpuTile(16, 64, 8, two_pass_dkv=True))),
    GpuTier(True, 256, GpuTiles(fwd=GpuTile(32, 32, 8), dq=GpuTile(16, 16, 8),
                                dkv=GpuTile(16, 16, 8, two_pass_dkv=True))),
)
# Per family, per tier (keyed by the tier's (float32, max_head_dim)): the kernels whose tiles
# differ (a GpuTiles field -> its tile). Stick-breaking's dQ keeps 32 query rows on 4 warps
# (its carries; its key tile is the dK/dV kernel's).
_GPU_FAMILY_TIERS: dict[str, dict[tuple[bool, int], dict[str, GpuTile]]] = {
    "entmax": {(False, 64): dict(fwd=GpuTile(64, 64, 8)),
               (False, 128): dict(fwd=GpuTile(32, 64, 4)),
               (False, 256): dict(fwd=GpuTile(32, 64, 8), dkv=GpuTile(16, 32, 8)),
               (True, 128): dict(fwd=GpuTile(32, 64, 8), dkv=GpuTile(16, 16, 8)),
               (True, 256): dict(dq=GpuTile(32, 16, 8))},
    "softpick": {(False, 128): dict(fwd=GpuTile(64, 64, 8)),
                 (False, 256): dict(fwd=GpuTile(32, 64, 8))},
    "stick_breaking": {
        (False, 64): dict(fwd=GpuTile(128, 32, 8), dq=GpuTile(32, 32, 4),
                          dkv=GpuTile(16, 32, 4)),
        (False, 128): dict(dq=GpuTile(32, 32, 4), dkv=GpuTile(16, 32, 4)),
        (False, 256): dict(fwd=GpuTile(32, 64, 8), dq=GpuTile(16, 16, 4),
                           dkv=GpuTile(16, 16, 8)),
        (True, 64): dict(dq=GpuTile(32, 32, 4)),
        (True, 128): dict(fwd=GpuTile(32, 64, 8), dq=GpuTile(32, 16, 4),
                          dkv=GpuTile(16, 16, 8, two_pass_dkv=True)),
        (True, 256): dict(dq=GpuTile(16, 16, 4)),
    },
}
# TPU tiles as in JAX's splash attention (bigger tiles amortize the per-grid-step overhead).
_TPU_DEFAULT = dict(block_q=256, block_k=512, block_q_dq=256, block_k_dq=256,
                    block_q_dkv=256, block_k_dkv=256)


def q_align(backend: str, dtype: Any) -> int:
  """TPU query tiles: a multiple of the sublane count of the dtype's (8·packing, 128) tile."""
  return TPU_SUBLANES * (4 // min(jnp.dtype(dtype).itemsize, 4)) if backend == "tpu" else 1


def check_block_sizes(backend: str, dtype: Any = jnp.float32, **blocks: int | None) -> None:
  """Raises ValueError for a tile size the backend's lowering rejects.

  GPU (Triton): powers of 2, at least 16. TPU (Mosaic): query tiles a multiple of 8 (16 for
  16-bit dtypes), key tiles a multiple of 128 (the key axis is the lane axis of every tile).
  """
  be = resolve_backend(backend)
  for name, value in blocks.items():
    if value is None:
      continue
    if not isinstance(value, numbers.Integral) or value < 1:
      raise ValueError(f"{name} must be a positive int, got {value!r}")
    if be == "gpu":
      if value < GPU_MIN_BLOCK or value & (value - 1):
        raise ValueError(
            f"{name}={value} is not valid for the GPU (Triton) kernels: Pallas' Triton "
            f"lowering needs power-of-2 tiles, and tl.dot at least {GPU_MIN_BLOCK} (e.g. "
            f"{max(GPU_MIN_BLOCK, 1 << (int(value).bit_length() - 1))}).")
    else:
      is_q = name.startswith("block_q")
      align = q_align(be, dtype) if is_q else TPU_LANES
      if value % align:
        raise ValueError(
            f"{name}={value} is not valid for the TPU (Mosaic) kernels: "
            f"{'query' if is_q else 'key'} tiles must be a multiple of {align} "
            f"({'sublanes of a ' + jnp.dtype(dtype).name + ' tile' if is_q else 'lanes'}).")


def gpu_tier(head_dim: int | None, dtype: Any) -> GpuTier:
  """The row of :data:`_GPU_TIERS` for a padded head size and a dtype."""
  wide = jnp.dtype(dtype).itemsize > 2
  hp = head_dim or 0
  return next(t for t in _GPU_TIERS
              if t.float32 == wide and (hp <= t.max_head_dim or t.max_head_dim == 256))


def _family_tiles(tier: GpuTier, family: str | None) -> dict[str, GpuTile]:
  return _GPU_FAMILY_TIERS.get(family or "", {}).get((tier.float32, tier.max_head_dim), {})


def gpu_tiles(head_dim: int | None, family: str | None, dtype: Any) -> GpuTiles:
  """The GPU kernels' tiles and warps for a padded head size, a dtype and a streaming family
  (None: pointwise F), from :data:`_GPU_TIERS` and :data:`_GPU_FAMILY_TIERS`."""
  tier = gpu_tier(head_dim, dtype)
  return tier.tiles._replace(**_family_tiles(tier, family))


def timed_kernels(head_dim: int | None, family: str | None, dtype: Any) -> frozenset[str]:
  """The kernels (``"dq"``, ``"dkv"``) whose GPU tiles were chosen by time on a GPU
  (:attr:`GpuTier.timed`; a streaming family's own tiles were chosen by compiling)."""
  tier = gpu_tier(head_dim, dtype)
  if not tier.timed:
    return frozenset()
  return frozenset({"dq", "dkv"}) - set(_family_tiles(tier, family))


def default_block_sizes(backend: str, t: int, s: int, dtype: Any = jnp.float32,
                        block_q: int | None = None, block_k: int | None = None, *,
                        head_dim: int | None = None, family: str | None = None,
                        launch: GpuTiles | None = None) -> BlockSizes:
  """The tiles used for T queries and S keys (``block_q``/``block_k`` override all kernels).

  Defaults (queries × keys): GPU by dtype width and head size (``head_dim``, the padded one;
  without it the H ≤ 64 tier, e.g. bf16: forward 128 × 64, dQ 64 × 16, dK/dV 16 × 32) and by
  a whole-row weighting's streaming ``family``, the tiles that compiled without register
  spills for an H100 and an A100 (:data:`_GPU_TIERS`); TPU forward 256 × 512, backward
  256 × 256. Every tile is then capped at the (aligned) sequence: GPU at the next power of 2
  (≥ 16), TPU at T rounded up to 8 (16 for 16-bit dtypes) and S rounded up to 128. ``launch``:
  GPU launches to take the tiles from instead of the table's (tuned ones).
  """
  be = resolve_backend(backend)
  check_block_sizes(be, dtype, block_q=block_q, block_k=block_k)
  sizes = dict(_TPU_DEFAULT)
  if be == "gpu":
    launch = gpu_tiles(head_dim, family, dtype) if launch is None else launch
    sizes = dataclasses.asdict(launch.block_sizes())
  for name in sizes:
    given = block_q if name.startswith("block_q") else block_k
    if given is not None:
      sizes[name] = int(given)
  if be == "gpu":
    cap_q, cap_k = pow2(t), pow2(s)
  else:
    cap_q, cap_k = round_up(max(t, 1), q_align(be, dtype)), round_up(max(s, 1), TPU_LANES)
  return BlockSizes(**{n: min(v, cap_q if n.startswith("block_q") else cap_k)
                       for n, v in sizes.items()})


def tuned_tiles(weighting: Any, t: int, s: int, h: int, hv: int, dtype: Any, causal: bool,
                group: int) -> GpuTiles | None:
  """The GPU launches for this call from the tuner: those it is timing now
  (:func:`.tile_cache.override`), else the winners :func:`attnx.core.autotune` cached for this
  signature on this process' GPU (:mod:`.tile_cache`; none on a CPU), else None."""
  chosen = tile_cache.overriding()
  if chosen is not None:
    return chosen
  raw = tile_cache.lookup(tile_cache.signature(weighting, t, s, h, hv, dtype, causal, group))
  if raw is None:
    return None
  return GpuTiles(*(GpuTile(*raw[k]) for k in tile_cache.KERNELS))


def kernel_tiles(be: str, weighting: Any, t: int, s: int, h: int, hv: int, dtype: Any,
                 block_q: int | None, block_k: int | None, *, causal: bool = False,
                 group: int = 1) -> tuple[BlockSizes, GpuTiles | None]:
  """The tiles (:func:`default_block_sizes`, checked) and, on the GPU, the kernels' launches
  (:func:`gpu_tiles`: warps, dK/dV as two passes; None on the TPU) of a T × S problem of head
  sizes H, Hv. Without tiles given, a GPU takes tuned launches where there are some
  (:func:`tuned_tiles`; ``causal`` and the GQA ``group`` are part of their signature)."""
  rows = not isinstance(weighting, Pointwise)
  # The GPU's padded head size (a multiple of 16) picks its tiles.
  family = weighting.stream.family if rows else None
  launch = None
  if be == "gpu":
    if block_q is None and block_k is None:
      launch = tuned_tiles(weighting, t, s, h, hv, dtype, causal, group)
    if launch is None:
      launch = gpu_tiles(round_up(max(h, hv), GPU_MIN_BLOCK), family, dtype)
  blocks = default_block_sizes(be, t, s, dtype, block_q, block_k,
                               head_dim=round_up(max(h, hv), GPU_MIN_BLOCK), family=family,
                               launch=launch)
  if rows and weighting.stream.suffix_carries:
    # Stick-breaking's dQ pass saves its carries at the dK/dV pass's key tiles.
    blocks = dataclasses.replace(blocks, block_k_dq=blocks.block_k_dkv)
  return blocks, launch
