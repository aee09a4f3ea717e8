"""The differential net: dense, blocked, the automatic choice and the Pallas kernels (GPU and
TPU, in Pallas' interpreter) against a float64 brute force, values and gradients.

Two samples (machinery in tests/support/differential.py, reference in tests/support/reference.py):

* CI: :data:`BRANCH_CASES`, written to reach every branch point of the kernels on purpose —
  the causal triangle at lengths above 512 and above the causal leaf size through the default
  dispatch, every tile-size branch (None, powers of 2, multiples of 8 that are not, odd,
  rejected), T ≠ S with causal, length 1, GQA, chunks of heads, every bias shape, every mask
  kind — plus :data:`CI_RANDOM` random draws.
* ``-m differential``: ``ATTNX_DIFF_CASES`` (default 5000) random cases: configurations drawn
  from seeds ``ATTNX_DIFF_FIRST`` (default 0) on — B, T and S from 0 to 3000, GQA, head sizes,
  causal, masks with fully masked rows, bias shapes, tiles, every registered weighting and
  score, f32/bf16 — each run on :data:`INSTANCES` independent random inputs (data, masks,
  padding lengths), which reuse its compiled programs. ``ATTNX_DIFF_KIND=row`` (or
  ``pointwise``) draws the weighting from one family only, for a kernel change that touches
  only that family's kernels; ``ATTNX_DIFF_IMPLS=split_kv,auto`` runs only those
  implementations of each case.
"""

from __future__ import annotations

import dataclasses
import math
import os

import pytest
from support import differential as diff

from attnx.core import weightings as wlib
from attnx.core.kernels.xla import rows as blocked_rows

C = diff.Case
_NO_PALLAS = dict(pallas="none")
# Each entry reaches a branch point of a kernel (blocked.py, kernels/pallas/, api.py)
# that a random draw reaches only by luck; the comment says which.
BRANCH_CASES = (
    # The lengths through the default dispatch (causal triangle with P > 1 leaves of
    # d = 72, 96, 136 rows: squares whose default 256-key tile does not divide them).
    C(seed=1, t=513, s=513, n=2, h=32, hv=32, causal=True, only=("auto",)),
    C(seed=2, t=700, s=700, n=2, h=32, hv=32, causal=True, only=("auto",)),
    C(seed=3, t=1500, s=1500, n=2, h=32, hv=32, causal=True, only=("auto",)),
    C(seed=4, t=1025, s=1025, b=2, n=4, kh=2, h=16, hv=16, causal=True, bias="1x1x",
      mask="padding", only=("auto",)),
    # The tile table, unnormalized relu (off by 14 before the fix), tiles capping the
    # squares (user_bq/user_bk), 8k and odd tiles.
    C(seed=5, t=70, s=70, weighting="relu:normalization=none", causal=True, block_q=32,
      block_k=32, **_NO_PALLAS),
    C(seed=6, t=100, s=100, causal=True, block_q=24, block_k=40, **_NO_PALLAS),
    C(seed=7, t=257, s=257, weighting="sigmoid:normalization=none", causal=True, block_q=128,
      block_k=128, **_NO_PALLAS),
    C(seed=8, t=120, s=120, weighting="power:p=3", causal=True, block_q=7, block_k=13,
      **_NO_PALLAS),
    # Causal T ≠ S (keys past T never seen; rows past S see every key), GQA, bias + mask.
    C(seed=9, t=300, s=130, b=2, n=4, kh=2, causal=True, bias="xx1x", mask="random",
      **_NO_PALLAS),
    C(seed=10, t=130, s=300, n=3, kh=1, causal=True, bias="x1xx", mask="rows", block_q=64,
      block_k=32, **_NO_PALLAS),
    # Causal bias blocks: [1, N, T, S] over B = 2 (broadcast to the pieces), [B, 1, 1, S]
    # (key rows only), [1, 1, T, 1] (query rows only), [B, N, 1, 1] (the same block).
    C(seed=11, t=100, s=100, b=2, n=2, causal=True, bias="1xxx", block_q=16, **_NO_PALLAS),
    C(seed=12, t=100, s=100, b=2, n=2, causal=True, bias="x11x", block_q=16, **_NO_PALLAS),
    C(seed=13, t=100, s=100, b=2, n=2, causal=True, bias="11x1", block_q=16, **_NO_PALLAS),
    C(seed=14, t=100, s=100, b=2, n=2, causal=True, bias="xx11", block_q=16, **_NO_PALLAS),
    # Chunks of heads (heads_per_chunk < B·K: the fori loop over chunks, bias chunk slices).
    C(seed=15, t=256, s=256, b=4, n=8, kh=4, h=16, hv=16, block_q=256, block_k=256,
      bias="xx11", mask="columns", **_NO_PALLAS),
    C(seed=16, t=256, s=256, b=3, n=8, kh=4, h=16, hv=16, block_q=256, block_k=256,
      causal=True, bias="1xxx", **_NO_PALLAS),
    C(seed=35, t=256, s=256, b=4, n=8, kh=4, h=16, hv=16, block_q=256, block_k=256,
      **_NO_PALLAS),  # chunks without a bias
    C(seed=36, t=100, s=100, b=2, n=2, causal=True, bias="1x11", block_q=16,
      **_NO_PALLAS),  # one [1, N, 1, 1] bias block for every piece
    # Normalizations and F: online max with a denominator offset, α ≠ 1, "length" with and
    # without masking, "none", every F' branch; bf16.
    C(seed=17, t=600, s=600, weighting="softmax_plus_one", causal=True, **_NO_PALLAS),
    C(seed=18, t=90, s=77, weighting="softmax:alpha=2", dtype="bfloat16", mask="random",
      **_NO_PALLAS),
    C(seed=19, t=530, s=530, weighting="relu:normalization=length", causal=True,
      **_NO_PALLAS),
    C(seed=20, t=64, s=90, weighting="relu:normalization=length", **_NO_PALLAS),
    C(seed=37, t=64, s=64, weighting="relu:normalization=length", block_q=32, block_k=32,
      **_NO_PALLAS),  # "length" with every key valid and no padding: l = S
    C(seed=21, t=45, s=45, weighting="gaussian:h=0.5,normalization=none", score="neg_sq_dist",
      magnitude=0.3, causal=True, block_q=16, **_NO_PALLAS),
    C(seed=22, t=40, s=52, weighting="triangular:h=2", score="metric", magnitude=0.3,
      **_NO_PALLAS),
    C(seed=23, t=33, s=33, weighting="entmax:alpha=1.3", score="cosine", causal=True,
      mask="rows", **_NO_PALLAS),
    C(seed=24, t=40, s=40, weighting="stick_breaking", score="additive", causal=True,
      **_NO_PALLAS),
    C(seed=25, t=31, s=47, weighting="sparsemax", score="bilinear", mask="padding",
      **_NO_PALLAS),
    # Empty sequences and rejected tiles (every implementation raises the same ValueError).
    C(seed=26, t=0, s=17, **_NO_PALLAS),
    C(seed=27, t=17, s=0, causal=True, **_NO_PALLAS),
    C(seed=28, t=40, s=40, block_q=0, block_k=0),
    # Pallas (GPU and TPU kernels in the interpreter): length 1 and head size 1 (padded),
    # causal T ≠ S, GQA, bias and mask, bf16, tiles.
    C(seed=29, t=1, s=1, n=2, h=1, hv=1),
    C(seed=30, t=1, s=37, n=4, kh=2, causal=True, bias="xxxx"),
    C(seed=31, t=70, s=33, b=1, n=4, kh=2, causal=True, mask="random", bias="1x1x"),
    C(seed=32, t=45, s=100, n=2, dtype="bfloat16", weighting="relu", causal=True,
      mask="padding"),
    C(seed=33, t=130, s=130, weighting="sigmoid", block_q=32, block_k=128, bias="x11x"),
    C(seed=34, t=40, s=40, weighting="softmax", block_q=24, block_k=24),  # GPU/TPU reject 24
    # The whole-row kernels (blocked_rows.py, streaming.py): every family; several query blocks
    # with causal tile skipping (T > CAUSAL_BLOCK_Q) and the reverse walk of stick-breaking;
    # ragged and odd tiles; threshold passes of sparsemax / entmax (Newton from the left for
    # α ≤ 2, from the right for α > 2, the exact last step for α ∈ {1.5, 2}, renormalized for
    # other α); SSMax's per-row n from masks, bias and causal; chunks of heads; bf16.
    C(seed=38, t=600, s=600, weighting="stick_breaking", causal=True, only=("auto",)),
    C(seed=39, t=600, s=600, weighting="sparsemax", causal=True, only=("auto",)),
    C(seed=40, t=130, s=77, b=2, n=4, kh=2, weighting="ssmax", causal=True, mask="random",
      bias="x1xx", block_q=24, block_k=16),
    C(seed=41, t=77, s=130, weighting="ssmax:s=0.5", causal=True, mask="rows", block_q=7,
      block_k=13),
    C(seed=42, t=100, s=90, weighting="softpick", mask="padding", bias="1x1x", block_q=16,
      block_k=24, magnitude=2.0),
    C(seed=43, t=300, s=300, b=2, n=2, weighting="softpick", causal=True, dtype="bfloat16",
      block_k=64),
    C(seed=44, t=120, s=150, b=2, n=4, kh=2, weighting="stick_breaking", mask="random",
      bias="xxxx", block_q=32, block_k=40),
    C(seed=45, t=150, s=120, weighting="stick_breaking", causal=True, mask="columns",
      block_q=16, block_k=8),
    C(seed=46, t=90, s=90, weighting="entmax15", causal=True, mask="rows", bias="11xx",
      block_q=16, block_k=16),
    C(seed=47, t=70, s=110, n=2, weighting="entmax:alpha=1.3", bias="x11x", block_q=24,
      block_k=32),
    C(seed=48, t=70, s=70, weighting="entmax:alpha=3", causal=True, block_q=16, block_k=16),
    C(seed=49, t=64, s=100, weighting="sparsemax:scale=2", dtype="bfloat16", mask="padding",
      block_q=32, block_k=24),
    C(seed=50, t=256, s=256, b=4, n=8, kh=4, h=16, hv=16, weighting="entmax15",
      block_q=256, block_k=256, bias="xx11", mask="columns"),  # chunks of heads
    C(seed=51, t=256, s=256, b=3, n=8, kh=4, h=16, hv=16, weighting="ssmax", causal=True,
      block_q=256, block_k=256, bias="1xxx"),  # chunks of heads, causal
    # The whole-row Pallas kernels (kernels/pallas/*rows.py, GPU and TPU kernels, interpreted):
    # tiles (16, 128) are valid on both backends and give S > 128 two ragged key tiles (the
    # default GPU tiles give 64-key tiles); causal tile skipping with T > 128 and stick-
    # breaking's reverse walk and carries; entmax threshold passes; masks with empty rows,
    # every bias shape, GQA, T ≠ S, bf16, length 1, a non-dot score (GPU kernels only).
    C(seed=60, t=70, s=150, b=2, n=4, kh=2, weighting="ssmax", causal=True, mask="random",
      bias="x1xx", block_q=16, block_k=128),
    C(seed=61, t=150, s=140, weighting="ssmax:s=0.5", mask="rows", block_q=32, block_k=128),
    C(seed=62, t=100, s=150, weighting="softpick", mask="padding", bias="1x1x", magnitude=2.0,
      block_q=16, block_k=128),
    C(seed=63, t=150, s=150, weighting="stick_breaking", causal=True, mask="columns",
      block_q=16, block_k=128),
    C(seed=64, t=60, s=140, b=2, n=4, kh=2, weighting="stick_breaking", mask="random",
      bias="xxxx"),
    C(seed=65, t=90, s=150, weighting="sparsemax", causal=True, mask="rows", bias="11xx",
      block_q=16, block_k=128),
    C(seed=66, t=130, s=130, weighting="entmax15", dtype="bfloat16", causal=True, block_q=16,
      block_k=128),
    C(seed=67, t=70, s=140, weighting="entmax:alpha=1.3", bias="x11x"),
    C(seed=68, t=70, s=150, n=4, kh=1, weighting="entmax:alpha=3", causal=True, block_q=16,
      block_k=128),
    C(seed=69, t=64, s=100, weighting="sparsemax:scale=2", dtype="bfloat16", mask="padding"),
    C(seed=70, t=150, s=150, weighting="softpick", dtype="bfloat16", causal=True, block_q=16,
      block_k=128),
    C(seed=71, t=40, s=150, weighting="stick_breaking", score="cosine", causal=True,
      mask="rows"),
    C(seed=72, t=1, s=1, n=2, h=1, hv=1, weighting="ssmax"),
    # Zero-tile skipping: banded inputs (local-attention-like rows), so that whole key tiles
    # are zero: blocked through the default dispatch (every pass skips; its causal tiles of
    # 512: the last, ragged query block has a zero tile), and the Pallas kernels (output
    # pass and backward skip) with several key tiles per row.
    C(seed=73, t=1100, s=1100, weighting="sparsemax", causal=True, structure="banded",
      only=("auto",)),
    C(seed=74, t=160, s=160, n=2, weighting="entmax15", causal=True, structure="banded",
      mask="columns", block_q=16, block_k=128),
    # float32 above H = 64 on the GPU: dK and dV in two passes (the pointwise and the row
    # kernels' two_pass_dkv; the row pass then does not skip zero tiles), GQA, a bias, masks.
    C(seed=75, t=90, s=70, n=4, kh=2, h=64, hv=40, weighting="gaussian", score="neg_sq_dist",
      causal=True, bias="1x1x", mask="padding", pallas="gpu", only=("dense", "pallas")),
    C(seed=76, t=70, s=90, n=2, h=130, hv=130, weighting="entmax15", mask="columns",
      pallas="gpu", only=("dense", "pallas")),
    C(seed=77, t=60, s=60, n=2, h=72, hv=72, weighting="stick_breaking", causal=True,
      bias="x11x", pallas="gpu", only=("dense", "pallas")),
    # Structured masks (attnx.core.masks): the blocked pointwise kernel's tile kinds (skipped,
    # full without the elementwise mask, partial) and spans, forward and backward; documents
    # across tile boundaries with padding, GQA and a bias; T ≠ S; the whole-row and Pallas
    # paths that read the mask materialized.
    C(seed=78, t=300, s=300, b=2, n=4, kh=2, causal=True, structured="combo", bias="x1xx",
      block_q=32, block_k=16, **_NO_PALLAS),
    C(seed=79, t=130, s=70, n=2, weighting="sigmoid:normalization=none", structured="window",
      block_q=16, block_k=16, **_NO_PALLAS),
    C(seed=80, t=200, s=200, b=3, n=2, weighting="relu:normalization=length",
      structured="lengths", block_q=24, block_k=40, **_NO_PALLAS),
    C(seed=81, t=90, s=90, n=2, weighting="softmax_plus_one", structured="prefix", causal=True,
      block_q=16, block_k=32, **_NO_PALLAS),
    C(seed=82, t=100, s=100, n=4, kh=2, weighting="stick_breaking", structured="segments",
      causal=True, pallas="gpu"),
    C(seed=83, t=64, s=64, n=2, weighting="gaussian", score="neg_sq_dist",
      structured="mask_mod", block_q=16, block_k=16, pallas="gpu"),
    # The whole-row kernel's structured tiles (skipped, full, partial) in every pass: SSMax's
    # n_i counted per tile (with a bias, and in bf16: the row kernel), stick-breaking's stick
    # walked backwards over documents, softpick, sparsemax's threshold with zero-tile
    # skipping on a banded window, entmax on packed documents with GQA and T != S; SSMax
    # without a bias runs as softmax in the pointwise kernel with the mask's counts.
    C(seed=84, t=200, s=200, b=2, n=4, kh=2, weighting="ssmax", structured="combo",
      bias="x1xx", causal=True, block_q=24, block_k=16, **_NO_PALLAS),
    C(seed=85, t=150, s=150, n=2, weighting="ssmax", dtype="bfloat16", structured="window",
      block_q=16, block_k=32, **_NO_PALLAS),
    C(seed=86, t=130, s=130, b=2, n=2, weighting="stick_breaking", structured="segments",
      causal=True, block_q=16, block_k=24, **_NO_PALLAS),
    C(seed=87, t=120, s=90, b=2, n=2, weighting="softpick", structured="lengths", block_q=16,
      block_k=16, **_NO_PALLAS),
    C(seed=88, t=300, s=300, n=2, weighting="sparsemax", causal=True, structure="banded",
      structured="window", block_q=32, block_k=32, **_NO_PALLAS),
    C(seed=89, t=140, s=100, b=2, n=4, kh=2, weighting="entmax15", structured="segments",
      block_q=16, block_k=16, **_NO_PALLAS),
    C(seed=90, t=100, s=100, b=2, n=2, weighting="ssmax", structured="prefix", causal=True,
      block_q=16, block_k=16, **_NO_PALLAS),
    # Skipped tiles between attended ones (sink keys | a window), in both kernels.
    C(seed=91, t=260, s=260, b=2, n=2, weighting="stick_breaking", structured="sinks",
      causal=True, block_q=16, block_k=16, **_NO_PALLAS),
    C(seed=92, t=260, s=200, b=2, n=4, kh=2, structured="sinks", causal=True, block_q=16,
      block_k=16, **_NO_PALLAS),
    C(seed=93, t=260, s=260, n=2, weighting="entmax15", structured="sinks", block_q=16,
      block_k=24, **_NO_PALLAS),
    # Sigmoid's b = −log n with n the query's document / key length (a per-query bias
    # added to the caller's), in every implementation.
    C(seed=94, t=120, s=120, b=2, n=4, kh=2, weighting="sigmoid:normalization=none",
      structured="segments", causal=True, bias="x1xx", block_q=16, block_k=32, pallas="gpu"),
    C(seed=95, t=90, s=130, b=3, n=2, weighting="sigmoid:normalization=none",
      structured="lengths", block_q=16, block_k=16, **_NO_PALLAS),
    # The Pallas kernels read structured masks per tile (spans before the kernel, ids and
    # lengths loaded per tile; kernels/pallas/masking.py), Triton and Mosaic: stick-breaking's
    # carries across skipped tiles (sinks | a window leaves holes in a row's span), entmax's
    # threshold over documents with GQA and T ≠ S, SSMax's n_i counted per tile, a head- and
    # batch-dependent mask_mod, sigmoid's per-sequence n, sparsemax's zero tiles on a band,
    # a prefix-LM; tiles (16, 128) fit both backends' rules.
    C(seed=96, t=160, s=160, b=2, n=2, weighting="stick_breaking", structured="sinks",
      causal=True, block_q=16, block_k=16, pallas="gpu"),
    C(seed=97, t=160, s=160, b=2, n=2, weighting="stick_breaking", structured="combo",
      causal=True, block_q=16, block_k=128),
    C(seed=98, t=150, s=130, b=2, n=4, kh=2, weighting="entmax15", structured="segments",
      block_q=16, block_k=16, pallas="gpu"),
    C(seed=99, t=150, s=150, b=2, n=2, weighting="ssmax", structured="combo", causal=True,
      bias="x1xx", block_q=16, block_k=32, pallas="gpu"),
    C(seed=100, t=160, s=160, n=2, weighting="ssmax", dtype="bfloat16", structured="window",
      block_q=16, block_k=128),
    C(seed=101, t=140, s=140, b=2, n=4, kh=2, structured="mask_mod", block_q=16, block_k=128),
    C(seed=102, t=130, s=150, b=2, n=2, weighting="sigmoid", structured="lengths", block_q=16,
      block_k=16, pallas="gpu"),
    C(seed=103, t=160, s=160, n=2, weighting="sparsemax", causal=True, structure="banded",
      structured="window", block_q=16, block_k=16, pallas="gpu"),
    C(seed=104, t=150, s=150, b=2, n=2, weighting="softpick", structured="prefix", causal=True,
      block_q=32, block_k=128),
    # Score modifications (attnx.core.score_mods), dense and blocked: the pointwise kernel's
    # causal call through the tiles of a causal mask with ALiBi's learned slopes and a window;
    # a soft cap in bf16 with a bias (the cap before the bias); stick-breaking's stick and
    # entmax's threshold passes over a learned table with GQA and T ≠ S; SSMax's scaled
    # modified scores with the user fn (b, h and positions) and a bias; sigmoid's
    # per-document n beside ALiBi; zero tiles of a band under a cap; chunks of heads.
    C(seed=105, t=150, s=150, b=2, n=4, kh=2, causal=True, structured="window",
      score_mod="alibi", block_q=16, block_k=32, **_NO_PALLAS),
    C(seed=106, t=130, s=130, b=2, n=2, dtype="bfloat16", bias="1x1x", score_mod="cap",
      block_q=16, block_k=16, magnitude=2.0, **_NO_PALLAS),
    C(seed=107, t=140, s=120, b=2, n=4, kh=2, weighting="stick_breaking", causal=True,
      score_mod="table", block_q=16, block_k=16, **_NO_PALLAS),
    C(seed=108, t=120, s=150, n=4, kh=1, weighting="entmax15", score_mod="table",
      structured="segments", block_q=16, block_k=32, **_NO_PALLAS),
    C(seed=109, t=150, s=150, b=2, n=2, weighting="ssmax", bias="x1xx", score_mod="fn",
      causal=True, block_q=16, block_k=16, **_NO_PALLAS),
    C(seed=110, t=150, s=150, b=2, n=2, weighting="sigmoid", structured="segments",
      score_mod="alibi", causal=True, block_q=32, block_k=16, **_NO_PALLAS),
    C(seed=111, t=160, s=160, n=2, weighting="sparsemax", causal=True, structure="banded",
      score_mod="cap", block_q=16, block_k=16, **_NO_PALLAS),
    C(seed=112, t=600, s=600, b=3, n=4, kh=2, weighting="relu", score_mod="fn",
      structured="combo", **_NO_PALLAS),
    # Attention sinks (a key of zero value before each row's keys): the online max and the
    # plain sum with a denominator offset, bf16, GQA, chunks of heads; SSMax counting the sink
    # and scaling its score; softpick's max start; the entmax threshold passes and zero tiles
    # with the sink in every pass; rows without a key (lengths 0) keep a zero output.
    C(seed=113, t=150, s=150, b=2, n=4, kh=2, causal=True, structured="window", sinks=True,
      block_q=16, block_k=32, **_NO_PALLAS),
    C(seed=114, t=130, s=140, b=2, n=2, weighting="softmax_plus_one", dtype="bfloat16",
      sinks=True, bias="xx11", block_q=16, block_k=16, **_NO_PALLAS),
    C(seed=115, t=140, s=140, b=2, n=2, weighting="relu", structured="segments", sinks=True,
      score_mod="alibi", block_q=16, block_k=16, **_NO_PALLAS),
    C(seed=116, t=150, s=150, b=2, n=4, kh=2, weighting="ssmax", bias="x1xx", causal=True,
      sinks=True, block_q=16, block_k=16, **_NO_PALLAS),
    C(seed=117, t=120, s=150, n=2, weighting="softpick", causal=True, sinks=True,
      score_mod="cap", block_q=16, block_k=32, **_NO_PALLAS),
    C(seed=118, t=160, s=160, n=2, weighting="entmax15", causal=True, structure="banded",
      sinks=True, block_q=16, block_k=16, **_NO_PALLAS),
    C(seed=119, t=130, s=150, b=3, n=2, weighting="sparsemax", structured="lengths",
      sinks=True, score_mod="fn", block_q=16, block_k=16, **_NO_PALLAS),
    C(seed=120, t=600, s=600, b=3, n=4, kh=2, weighting="sigmoid", sinks=True,
      structured="combo", **_NO_PALLAS),
    # A soft cap and sinks in the pointwise Pallas kernels (kernels/pallas/common.py: the cap
    # in tile_scores, 1 − tanh² in the dQ and dK/dV kernels; the sink in each row's starting
    # state, d sinks from the row statistic outside the kernels), Triton and Mosaic where
    # the tiles fit both ((16|32, 128); T and S not multiples of them), Triton alone with
    # (16|32, 16|32) tiles: the online max with GQA, causal and T ≠ S; sigmoid's sum with
    # rows whose keys are all padding (the sink their only weight, O = 0); cap and sinks
    # under a structured window's skipped tiles; relu's sum with the bias after the cap (its
    # gradient is dS, without the cap's derivative); bf16 with a denominator offset; rows
    # past the query length; α ≠ 1 with rows a dense mask empties.
    C(seed=121, t=100, s=150, b=2, n=4, kh=2, causal=True, score_mod="cap", magnitude=2.0,
      block_q=16, block_k=128),
    C(seed=122, t=90, s=140, b=2, n=2, weighting="sigmoid", sinks=True, mask="padding",
      block_q=32, block_k=128),
    C(seed=123, t=130, s=120, n=2, score_mod="cap", sinks=True, structured="window",
      causal=True, block_q=16, block_k=16),
    C(seed=124, t=70, s=100, b=2, n=2, weighting="relu", score_mod="cap", bias="xxxx",
      mask="random", magnitude=2.0, block_q=16, block_k=128),
    C(seed=125, t=120, s=120, b=2, n=4, kh=2, dtype="bfloat16", weighting="softmax_plus_one",
      score_mod="cap", sinks=True, causal=True, bias="1x1x", magnitude=2.0, block_q=16,
      block_k=128),
    C(seed=126, t=100, s=90, b=3, n=2, weighting="sigmoid", score_mod="cap", sinks=True,
      structured="lengths", magnitude=2.0, block_q=16, block_k=128),
    C(seed=127, t=50, s=70, n=2, weighting="softmax:alpha=2", score_mod="cap", sinks=True,
      mask="rows", bias="11xx", block_q=32, block_k=32),
    # ALiBi in the pointwise Pallas kernels (kernels/pallas/common.py: alibi_tile after the cap
    # and the bias at global positions, in the forward, dQ and dK/dV kernels; d slopes from
    # the dQ kernel's per-row sums), Triton and Mosaic where the tiles fit both: the online
    # max, causal, GQA (each query head its own slope), T ≠ S not multiples of the tiles;
    # sigmoid's sum, symmetric (not causal), padding keys and sinks; relu with a
    # differentiated full bias (dS, the same cotangent the slopes read) under query/key
    # lengths, G = 4; bf16 with a denominator offset and sinks. (The cap with ALiBi:
    # tests/core/test_score_mods.py.)
    C(seed=128, t=100, s=150, b=2, n=4, kh=2, causal=True, score_mod="alibi", magnitude=2.0,
      block_q=16, block_k=128),
    C(seed=129, t=90, s=140, b=2, n=2, weighting="sigmoid", score_mod="alibi", sinks=True,
      mask="padding", block_q=32, block_k=128),
    C(seed=130, t=70, s=60, b=2, n=4, kh=1, weighting="relu", score_mod="alibi", bias="xxxx",
      structured="lengths", block_q=16, block_k=16),
    C(seed=131, t=120, s=120, b=2, n=4, kh=2, dtype="bfloat16", weighting="softmax_plus_one",
      score_mod="alibi", sinks=True, causal=True, bias="1x1x", magnitude=2.0, block_q=16,
      block_k=128),
    # A soft cap in the whole-row Pallas kernels (kernels/pallas/rows.py: the cap in the tile
    # scores of every pass, threshold passes included; 1 − tanh² on the cotangent reaching
    # q·k in the dQ and dK/dV kernels, dS without it), Triton and Mosaic where the tiles fit
    # both: SSMax causal GQA under key/query lengths (its c_i counts unchanged by the cap);
    # stick-breaking (reversed walk, carries) with padding keys and a differentiated full
    # bias; entmax's threshold passes and skipped tiles under a causal window (Triton's
    # 16 x 16 tiles); bf16 sparsemax causal GQA; softpick with rows a dense mask empties.
    C(seed=132, t=100, s=150, b=2, n=4, kh=2, weighting="ssmax", causal=True,
      structured="lengths", score_mod="cap", magnitude=2.0, block_q=16, block_k=128),
    C(seed=133, t=90, s=140, b=2, n=2, weighting="stick_breaking", score_mod="cap",
      mask="padding", bias="xxxx", magnitude=2.0, block_q=16, block_k=128),
    C(seed=134, t=130, s=120, n=2, weighting="entmax15", score_mod="cap", structured="window",
      causal=True, magnitude=2.0, block_q=16, block_k=16),
    C(seed=135, t=120, s=120, b=2, n=4, kh=2, dtype="bfloat16", weighting="sparsemax",
      score_mod="cap", causal=True, bias="1x1x", magnitude=2.0, block_q=16, block_k=128),
    C(seed=136, t=50, s=70, n=2, weighting="softpick", score_mod="cap", mask="rows",
      bias="11xx", magnitude=2.0, block_q=32, block_k=32),
    # ALiBi in the whole-row Pallas kernels (slopes an operand of every kernel, d slopes from
    # the dQ kernels' per-row sums; Triton and Mosaic where tiles fit): stick-breaking causal
    # GQA with padding keys; entmax15 symmetric under key/query lengths with a full bias;
    # bf16 SSMax causal, G = 3 (Triton's [Gp] row of slopes padded; its c_i times the
    # ALiBi'd score).
    C(seed=137, t=100, s=150, b=2, n=4, kh=2, weighting="stick_breaking", causal=True,
      score_mod="alibi", mask="padding", magnitude=2.0, block_q=16, block_k=128),
    C(seed=138, t=90, s=140, b=2, n=2, weighting="entmax15", score_mod="alibi",
      structured="lengths", bias="xxxx", block_q=16, block_k=128),
    C(seed=139, t=120, s=120, b=1, n=6, kh=2, dtype="bfloat16", weighting="ssmax",
      score_mod="alibi", causal=True, magnitude=2.0, block_q=16, block_k=128),
    # Attention sinks in the whole-row Pallas kernels (the sink folded into each row's
    # threshold passes and starting state; d sinks and SSMax's dc term outside the kernels):
    # entmax15 causal GQA under key/query lengths (the sink a key of τ's passes); SSMax with
    # a cap, padding keys and a differentiated full bias (n_i counts the sink); softpick with
    # ALiBi and rows a dense mask empties (the sink alone: zero output), Triton's 32 x 32 tiles.
    C(seed=140, t=100, s=150, b=2, n=4, kh=2, weighting="entmax15", sinks=True, causal=True,
      structured="lengths", magnitude=2.0, block_q=16, block_k=128),
    C(seed=141, t=90, s=140, b=2, n=2, weighting="ssmax", sinks=True, score_mod="cap",
      mask="padding", bias="xxxx", magnitude=2.0, block_q=16, block_k=128),
    C(seed=142, t=50, s=70, n=2, weighting="softpick", sinks=True, score_mod="alibi",
      mask="rows", block_q=32, block_k=32),
    # A relative table in the Triton kernels (the extended table read per tile, d ext from the
    # dQ kernels' atomic adds, folded back to the table outside): softmax causal GQA, T ≠ S,
    # a clipped table [N, 31] (distances past ±15 read its ends) with a differentiated bias;
    # entmax15 (its threshold passes) with sinks and key lengths, the full table [N, 2·90 − 1].
    C(seed=143, t=100, s=150, b=2, n=4, kh=2, causal=True, score_mod="table", table_len=31,
      bias="1x1x", block_q=16, block_k=32, pallas="gpu"),
    C(seed=144, t=90, s=70, n=2, weighting="entmax15", score_mod="table", sinks=True,
      structured="lengths", block_q=16, block_k=16, pallas="gpu"),
    # ... and in the Mosaic kernels too (each tile's window of the reversed table, d ext from
    # the dQ kernels' diagonal sums): sigmoid GQA with sinks and a clipped table, T ≠ S over
    # 128-key tiles; causal SSMax with the full table and key lengths.
    C(seed=145, t=70, s=150, b=2, n=4, kh=2, weighting="sigmoid", score_mod="table",
      table_len=31, sinks=True, block_q=16, block_k=128),
    C(seed=146, t=60, s=140, n=2, weighting="ssmax", causal=True, score_mod="table",
      structured="lengths", block_q=16, block_k=128),
    # Sum-normalized sigmoid streams log σ with the running max (weightings.LogF): rows whose
    # every σ(s + b) is below float32's range — b = −110 puts all of them there, where σ/Σσ
    # would be 0/0 — keep float64's weights in every implementation and lowering, with sinks
    # (log σ of the sink), a cap and a differentiated bias (the slope σ(−x) reaches dS);
    # ALiBi past a short key length at T = 1000 (dense and blocked: the rows an H100 found).
    C(seed=147, t=100, s=150, b=2, n=4, kh=2, weighting="sigmoid:bias=-110", causal=True,
      mask="padding", sinks=True, block_q=16, block_k=128),
    C(seed=148, t=90, s=70, n=2, weighting="sigmoid:bias=-110", score_mod="cap", bias="xxxx",
      mask="rows", block_q=32, block_k=32),
    C(seed=149, t=1000, s=1000, b=2, n=4, kh=2, weighting="sigmoid",
      score_mod="alibi", causal=True, mask="padding", pallas="none"),
    # Split-KV decoding (the automatic choice for T ≤ 8 against S ≥ 1024: chunks merged by each
    # family's rule) with the residual of every implementation that returns one: softmax GQA
    # (4 query heads packed per KV head) under key lengths with sinks; stick-breaking (merged
    # in key order) under a window; entmax15 (its threshold over the whole row, sinks a key of
    # it) with a cap; SSMax (c_i from the whole row's count) and softpick (ε counted once);
    # T = 3 causal sigmoid with ALiBi; S = 1531 (a prime: one chunk).
    C(seed=150, t=1, s=2048, b=2, n=8, kh=2, h=16, hv=16, structured="lengths", sinks=True,
      residual=True, pallas="none"),
    C(seed=151, t=1, s=1536, b=2, n=4, kh=2, weighting="stick_breaking", structured="window",
      residual=True, pallas="none"),
    C(seed=152, t=2, s=1200, n=4, kh=1, weighting="entmax15", sinks=True, score_mod="cap",
      residual=True, pallas="none"),
    C(seed=153, t=1, s=1100, b=3, n=2, weighting="ssmax", mask="padding", bias="x1x1",
      residual=True, pallas="none"),
    C(seed=154, t=4, s=1024, n=2, weighting="softpick", sinks=True, mask="random",
      residual=True, pallas="none"),
    C(seed=155, t=3, s=1531, b=2, n=4, kh=2, weighting="sigmoid", causal=True,
      score_mod="alibi", residual=True, pallas="none"),
    C(seed=156, t=1, s=1024, n=2, weighting="relu:normalization=length", mask="padding",
      residual=True, pallas="none"),
    C(seed=157, t=2, s=1024, n=2, weighting="sparsemax", dtype="bfloat16", residual=True,
      pallas="none"),
    # Split-KV on the Pallas kernels (kernels/pallas/split.py: the chunks a batch axis of the
    # GPU kernels, interpreted; merged with the family's rule; positions made dense first):
    # every family that splits at lengths in the thousands, none a power of two but one —
    # softmax GQA under key lengths with sinks (8 chunks); stick-breaking (chunks merged in key
    # order; −|q − k|² scores keep β small, so that every chunk holds weight; XLA's split-KV
    # too); SSMax (the whole row's c_i given to every chunk) with a bias;
    # softpick (ε once) with sinks; sigmoid with ALiBi (dense bias) over a prime S (ragged last
    # tile); "length" (chunk counts added); softmax_plus_one in bf16 with a relative table
    # (the offset once); more chunks asked than tiles (a chunk per tile).
    C(seed=160, t=1, s=2000, b=2, n=8, kh=2, h=16, hv=16, structured="lengths", sinks=True,
      residual=True, block_k=64, splits=8, only=("pallas_split",)),
    C(seed=161, t=2, s=1500, n=4, kh=2, weighting="stick_breaking", score="neg_sq_dist",
      magnitude=0.3, mask="padding", residual=True, block_k=64, splits=4,
      only=("pallas_split", "split_kv")),
    C(seed=162, t=1, s=1100, b=3, n=2, weighting="ssmax", mask="padding", bias="x1x1",
      residual=True, block_k=32, splits=3, only=("pallas_split",)),
    C(seed=163, t=4, s=1024, n=2, weighting="softpick", sinks=True, mask="random",
      residual=True, block_k=64, splits=4, only=("pallas_split",)),
    C(seed=164, t=3, s=1531, b=2, n=4, kh=2, weighting="sigmoid", mask="padding",
      score_mod="alibi", residual=True, block_k=64, splits=4, only=("pallas_split",)),
    C(seed=165, t=1, s=1030, n=2, weighting="relu:normalization=length", mask="padding",
      residual=True, block_k=16, splits=5, only=("pallas_split",)),
    C(seed=166, t=2, s=1030, n=2, weighting="softmax_plus_one", dtype="bfloat16",
      score_mod="table", residual=True, block_k=32, splits=8, only=("pallas_split",)),
    C(seed=167, t=1, s=300, n=2, score_mod="cap", causal=True, block_k=16, splits=64,
      only=("pallas_split",)),
)
CI_RANDOM = 4
INSTANCES = 5  # random inputs per configuration in the large run (compiling dominates a case)
_FIRST = int(os.environ.get("ATTNX_DIFF_FIRST", "0"))
_COUNT = int(os.environ.get("ATTNX_DIFF_CASES", "5000"))
_KIND = os.environ.get("ATTNX_DIFF_KIND") or None  # "pointwise" or "row": one family only
# "split_kv,auto" (say): only these implementations of each case, for a change to one of them.
_ONLY = tuple(x for x in os.environ.get("ATTNX_DIFF_IMPLS", "").split(",") if x) or None


def _assert_passes(case: diff.Case, instances: int = 1) -> None:
  failures = diff.check(case, instances)
  assert not failures, f"{case.label()}\n" + "\n".join(failures)


@pytest.mark.differential
@pytest.mark.parametrize("seed", range(_FIRST, _FIRST + -(-_COUNT // INSTANCES)))
def test_random_case(seed):
  case = diff.draw(seed, _KIND)
  if _ONLY is not None:
    case = dataclasses.replace(case, only=_ONLY)
  _assert_passes(case, INSTANCES)


# Whole-row branch cases that repeat a family/backend/branch the CI sample already reaches
# (tests/core/test_blocked_rows.py and test_pallas_rows.py run every family): -m exhaustive,
# which keeps CI within its 20 minutes.
_EXHAUSTIVE_BRANCHES = {41, 42, 43, 45, 46, 47, 48, 49, 50, 51, 60, 61, 62, 63, 64, 65, 66, 67,
                        68, 69, 70, 71}
# Pointwise Pallas cases whose causal / mask / bias / GQA / tile grid tests/core/
# test_pallas_attention.py runs in CI too.
_EXHAUSTIVE_BRANCHES |= {31, 33}
# Whole-row Pallas cases with a cap or ALiBi whose family × lowering tests/core/test_score_mods.py
# compares with the float64 dense result in CI (132, 137 and 139 stay: a family each, bf16).
_EXHAUSTIVE_BRANCHES |= {133, 134, 136, 138}


@pytest.mark.parametrize("case", [
    pytest.param(c, marks=pytest.mark.exhaustive) if c.seed in _EXHAUSTIVE_BRANCHES else c
    for c in BRANCH_CASES], ids=lambda c: f"branch{c.seed}")
@pytest.mark.split_by_jax
def test_branch_case(case):
  _assert_passes(case)


@pytest.mark.parametrize("case", [c for c in BRANCH_CASES if c.structure == "banded"],
                         ids=lambda c: f"branch{c.seed}")
def test_banded_branch_cases_have_zero_tiles(case):
  # The skip branch is reached: the blocked kernel's table of all-zero tiles is not empty.
  x = diff.inputs(case)
  skipped, visited = blocked_rows.zero_tiles(
      x["q"], x["k"], x["v"], weighting=wlib.get_weighting(case.weighting),
      scale=1 / math.sqrt(case.h), mask=x["mask"], is_causal=case.causal,
      block_q=case.block_q, block_k=case.block_k)
  assert 0 < int(skipped.sum()) < int(visited.sum())


@pytest.mark.split_by_jax
@pytest.mark.parametrize("seed", range(CI_RANDOM))
def test_random_case_ci_sample(seed):
  _assert_passes(diff.draw(1_000_000 + seed))
