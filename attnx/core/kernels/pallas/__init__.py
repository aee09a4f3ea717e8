"""The Pallas attention kernels: Triton on a GPU, Mosaic on a TPU.

:func:`pallas_attention` runs every pointwise F and the whole-row weightings with a streaming
family as fused kernels, with the contract of
:func:`attnx.core.kernels.xla.pointwise.blocked_attention`.

Modules, each importing only those above it:

* :mod:`.common` — the static :class:`~.common.KernelConfig` of a problem and the tile math
  every kernel shares (scores, validity, causal and length ranges, the pointwise backward);
* :mod:`.triton`, :mod:`.mosaic` — the kernels of pointwise F, one module per lowering;
* :mod:`.masking` — structured masks in the kernels: spans of tiles before them, the mask's
  arrays per tile inside them;
* :mod:`.rows` — the whole-row families' tile loops both lowerings share, SSMax's row scale;
* :mod:`.triton_rows`, :mod:`.mosaic_rows` — the whole-row kernels, one module per lowering;
* :mod:`.tile_cache` — tuned GPU launches: the cache file, a call's signature;
* :mod:`.tiles` — backends, what each supports, tile sizes (the GPU's tile tables, tuned
  launches where cached);
* :mod:`.platforms` — code chosen per lowering platform (:func:`~.platforms.by_platform`);
* :mod:`.wrapper` — :func:`pallas_attention`: checks, padding, the custom VJPs, the kernels of
  each lowering platform;
* :mod:`.verify` — the one-time self-check and the automatic choice's policy;
* :mod:`.states` — raw streaming states from the kernels' normalized outputs;
* :mod:`.split` — split-KV decoding: key chunks as a batch axis of the kernels, merged;
* :mod:`.block` — ring attention's per-step entry points on these kernels;
* :mod:`.autotune` — :func:`~.autotune.autotune`: the GPU kernels' launches timed on the chip.
"""

from attnx.core.kernels.pallas.tiles import (
    BACKENDS,
    GPU_MAX_HEAD_DIM,
    GPU_MIN_BLOCK,
    TPU_LANES,
    BlockSizes,
    backend_for_platform,
    check_block_sizes,
    default_block_sizes,
    resolve_backend,
    supported,
)
from attnx.core.kernels.pallas.verify import (
    PallasVerification,
    choose_pallas,
    clear_verifications,
    decline_reason,
    self_check,
    verify_pallas,
    weighting_key,
)
from attnx.core.kernels.pallas.wrapper import pallas_attention

__all__ = ["BACKENDS", "GPU_MAX_HEAD_DIM", "GPU_MIN_BLOCK", "TPU_LANES", "BlockSizes",
           "PallasVerification", "backend_for_platform", "check_block_sizes", "choose_pallas",
           "clear_verifications", "decline_reason", "default_block_sizes", "pallas_attention",
           "resolve_backend", "self_check", "supported", "verify_pallas", "weighting_key"]
