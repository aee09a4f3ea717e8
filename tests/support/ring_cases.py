"""The cases of ring attention's multi-device check (tests/support/ring_check.py, run by
tests/core/test_ring.py): a module without side effects, so that the test can list them
without starting JAX with 8 fake devices."""

from __future__ import annotations

from support import differential as diff

DEVICES = 8
C = diff.Case
T = DEVICES * 24  # 192: 24 positions per device, 16 zigzag chunks of 12
Z, K = "zigzag", "contiguous"
# name: (case, layout). Every pointwise weighting of the registry (and the variants whose
# streaming rule differs) at least once, the whole-row families that stream, both layouts
# causal and not, every way a bias or mask can be sharded (key padding masks and [B, 1, 1, S]
# biases travel with K/V; [.., T, 1] stay; [.., T, S] hold every key), GQA.
CASES = {
    "softmax_full_gqa": (C(seed=1, t=T, s=T, b=2, n=4, kh=2, mask="padding", bias="x11x"), K),
    "softmax_causal": (C(seed=2, t=T, s=T, causal=True, mask="random", bias="xxxx"), K),
    "softmax_zigzag_gqa": (C(seed=3, t=T, s=T, n=4, kh=2, causal=True, mask="padding",
                             bias="1x1x"), Z),
    "softmax_plus_one_zigzag": (C(seed=4, t=T, s=T, weighting="softmax_plus_one", causal=True,
                                  mask="rows", bias="11x1"), Z),
    "exp_alpha2_full_zigzag": (C(seed=5, t=T, s=T, weighting="exp:alpha=2",
                                 mask="columns"), Z),
    "sigmoid_none_causal": (C(seed=6, t=T, s=T, weighting="sigmoid:normalization=none",
                              causal=True), K),
    "sigmoid_none_full": (C(seed=7, t=T, s=T, weighting="sigmoid:normalization=none"), K),
    "sigmoid_zigzag": (C(seed=8, t=T, s=T, weighting="sigmoid", causal=True, mask="padding"), Z),
    "relu_length_zigzag": (C(seed=9, t=T, s=T, weighting="relu:normalization=length",
                             causal=True, mask="random"), Z),
    "relu_length_full": (C(seed=10, t=T, s=T, weighting="relu:normalization=length"), K),
    "relu_full_padding": (C(seed=11, t=T, s=T, weighting="relu", mask="padding"), K),
    "relu_none_zigzag": (C(seed=12, t=T, s=T, weighting="relu:normalization=none",
                           causal=True), Z),
    "relu2_causal": (C(seed=13, t=T, s=T, weighting="relu2", causal=True), K),
    "softplus_zigzag_gqa": (C(seed=14, t=T, s=T, n=4, kh=2, weighting="softplus",
                              causal=True), Z),
    "elu_plus_one_full": (C(seed=15, t=T, s=T, weighting="elu_plus_one", mask="columns",
                            bias="xx11"), K),
    "taylor_exp_causal": (C(seed=16, t=T, s=T, weighting="taylor_exp", causal=True), K),
    "power3_zigzag": (C(seed=17, t=T, s=T, weighting="power:p=3", causal=True,
                        mask="padding"), Z),
    # (power:p=0.5 has an unbounded F' near 0: the reference's kink rule then leaves out
    # almost every dq and dk entry, so the non-causal case takes the default p = 2.)
    "power_full": (C(seed=18, t=T, s=T, weighting="power"), K),
    "gaussian_zigzag": (C(seed=19, t=T, s=T, weighting="gaussian", score="neg_sq_dist",
                          magnitude=0.3, causal=True), Z),
    "gaussian_none_full": (C(seed=20, t=T, s=T, weighting="gaussian:h=0.5,normalization=none",
                             score="neg_sq_dist", magnitude=0.3), K),
    "boxcar_causal": (C(seed=21, t=T, s=T, weighting="boxcar:h=2", score="neg_sq_dist",
                        magnitude=0.3, causal=True), K),
    "triangular_metric_zigzag": (C(seed=22, t=T, s=T, weighting="triangular:h=2",
                                   score="metric", magnitude=0.3, causal=True), Z),
    "epanechnikov_full": (C(seed=23, t=T, s=T, weighting="epanechnikov:h=3",
                            score="neg_sq_dist", magnitude=0.3, bias="x1x1"), K),
    "ssmax_zigzag": (C(seed=30, t=T, s=T, weighting="ssmax", causal=True, mask="padding",
                       bias="x11x"), Z),
    "ssmax_full_gqa": (C(seed=31, t=T, s=T, n=4, kh=2, weighting="ssmax:s=0.5", mask="random",
                         bias="xxxx"), K),
    "ssmax_causal_nomask": (C(seed=32, t=T, s=T, weighting="ssmax", causal=True), K),
    "ssmax_query_masks": (C(seed=41, t=T, s=T, weighting="ssmax", causal=True, mask="rows",
                            bias="11x1"), Z),
    "softpick_zigzag": (C(seed=33, t=T, s=T, weighting="softpick", causal=True,
                          mask="columns", bias="1x1x", magnitude=2.0), Z),
    # Causal: a key attended by every row would be left out of the comparison as soon as one
    # row has a score near softpick's kink at 0 (a whole-row weighting couples the row).
    "softpick_causal_gqa": (C(seed=34, t=T, s=T, n=4, kh=2, weighting="softpick", bias="xxxx",
                              causal=True, magnitude=2.0), K),
    "stick_causal": (C(seed=35, t=T, s=T, weighting="stick_breaking", causal=True,
                       mask="padding", bias="x11x"), K),
    "stick_full_gqa": (C(seed=36, t=T, s=T, n=4, kh=2, weighting="stick_breaking",
                         mask="random"), K),
    "stick_cosine_causal": (C(seed=37, t=T, s=T, weighting="stick_breaking", score="cosine",
                              causal=True, mask="rows"), K),
    "stick_zigzag_causal": (C(seed=38, t=T, s=T, weighting="stick_breaking", causal=True,
                              mask="padding", bias="x11x"), Z),
    "stick_zigzag_full_gqa": (C(seed=39, t=T, s=T, n=4, kh=2, weighting="stick_breaking",
                                mask="random", bias="xxxx"), Z),
    # Structured masks (attnx.core.masks) of the global sequence: packed documents, a window,
    # documents with a window; sigmoid's n of each query's document.
    "softmax_documents_zigzag": (C(seed=42, t=T, s=T, b=2, n=4, kh=2, causal=True,
                                   structured="segments"), Z),
    "sigmoid_none_documents": (C(seed=43, t=T, s=T, b=2, weighting="sigmoid:normalization=none",
                                 structured="segments", bias="x11x"), K),
    "stick_window_causal": (C(seed=44, t=T, s=T, weighting="stick_breaking", causal=True,
                              structured="window"), K),
    "ssmax_combo_zigzag": (C(seed=45, t=T, s=T, weighting="ssmax", causal=True,
                             structured="combo"), Z),
    # Narrow windows (27 and 14 keys): most steps' shards do not meet and are skipped.
    "softmax_window_skips_gqa": (C(seed=53, t=T, s=T, n=4, kh=2, causal=True,
                                   structured="window", bias="x11x"), K),
    "relu_length_window_skips_zigzag": (C(seed=71, t=T, s=T, weighting="relu:normalization=length",
                                          causal=True, structured="window"), Z),
    # Each step evaluates its own block of the mask (steps.MaskRows): stick-breaking's zigzag
    # runs visit half shards; a head- and batch-dependent mask_mod in passes over the heads.
    "stick_zigzag_documents": (C(seed=72, t=T, s=T, b=2, weighting="stick_breaking", causal=True,
                                 structured="segments"), Z),
    "softmax_mask_mod_passes_gqa": (C(seed=73, t=T, s=T, b=2, n=4, kh=2, structured="mask_mod"),
                                    K),
    # Score modifications and sinks (attnx.core.score_mods; support.differential's "cap",
    # "alibi" with learned slopes, "table" of 2T − 1 learned entries, "fn": a score_mod of
    # both with a cap and the flat batch index): at the global positions of the whole
    # sequence and the global query heads (GQA in passes of one kv head); the sinks counted
    # once per row. Their parameters' gradients are compared too.
    "softmax_alibi_sinks_zigzag_gqa": (C(seed=80, t=T, s=T, n=4, kh=2, causal=True,
                                         score_mod="alibi", sinks=True), Z),
    "sigmoid_fn_sinks_full": (C(seed=81, t=T, s=T, b=2, weighting="sigmoid", score_mod="fn",
                                sinks=True, mask="padding"), K),
    "sigmoid_none_table_causal": (C(seed=82, t=T, s=T, weighting="sigmoid:normalization=none",
                                    causal=True, score_mod="table"), K),
    "ssmax_cap_sinks_causal_gqa": (C(seed=90, t=T, s=T, n=4, kh=2, weighting="ssmax:s=0.5",
                                     causal=True, score_mod="cap", sinks=True,
                                     mask="padding"), K),
    # (Shorter: softpick's kink at 0 leaves a parameter's gradient uncompared as soon as one
    # score of the problem sits near it.)
    "softpick_table_sinks_zigzag": (C(seed=85, t=64, s=64, weighting="softpick", causal=True,
                                      score_mod="table", sinks=True, magnitude=2.0), Z),
    # (Also on the Pallas steps: a cap in their kernels and the ring's sinks, pointwise. The
    # bias −110 puts every σ, the sinks' too, below float32's range: log σ streams them.)
    "sigmoid_cap_sinks_zigzag_gqa": (C(seed=87, t=T, s=T, n=4, kh=2,
                                       weighting="sigmoid:bias=-110", causal=True,
                                       score_mod="cap", sinks=True), Z),
    # Symmetric ALiBi (not causal), zigzag: every step's blocks span two chunks of rows and
    # of keys (the Pallas steps run each pair of chunks as a block of its own).
    "ssmax_alibi_full_zigzag": (C(seed=88, t=T, s=T, weighting="ssmax", score_mod="alibi"), Z),
    "stick_alibi_zigzag": (C(seed=85, t=T, s=T, weighting="stick_breaking", causal=True,
                             score_mod="alibi"), Z),
    "stick_fn_full_gqa": (C(seed=86, t=T, s=T, n=4, kh=2, weighting="stick_breaking",
                            score_mod="fn"), K),
}
# The cases with a score modification or sinks.
MOD_CASES = tuple(name for name, (case, _) in CASES.items()
                  if case.score_mod != "none" or case.sinks)
# Cases that run their kv heads in passes of one (kv_head_block=1: two rings one after the
# other, each over half the heads): a per-head bias and one broadcast over the heads, SSMax's
# row scales, stick-breaking's zigzag carries, under check_vma too (softmax_zigzag_gqa).
PASSES = {"softmax_full_gqa": 1, "softmax_zigzag_gqa": 1, "ssmax_full_gqa": 1,
          "softpick_causal_gqa": 1, "stick_zigzag_full_gqa": 1, "softmax_mask_mod_passes_gqa": 1,
          "softmax_alibi_sinks_zigzag_gqa": 1, "ssmax_cap_sinks_causal_gqa": 1,
          "stick_fn_full_gqa": 1}
# Also run with the Pallas kernels at every step (implementation=core.Pallas(interpret=True),
# in Pallas' interpreter; name + PALLAS): each family, both layouts, causal and not, GQA in
# passes, the three bias shardings and the global-length rules (sigmoid's b, ReLU's count,
# SSMax's n), a soft cap with sinks (a pointwise F and SSMax, whose n counts the sink), and
# ALiBi (causal, symmetric) and relative tables at the global positions in every family: the
# zigzag steps' blocks split into their chunks, the global query heads of GQA passes.
PALLAS = "@pallas"
PALLAS_CASES = ("softmax_full_gqa", "relu_length_zigzag", "ssmax_full_gqa",
                "stick_zigzag_full_gqa", "ssmax_combo_zigzag", "ssmax_cap_sinks_causal_gqa",
                "sigmoid_cap_sinks_zigzag_gqa", "softmax_alibi_sinks_zigzag_gqa",
                "sigmoid_none_table_causal", "ssmax_alibi_full_zigzag",
                "softpick_table_sinks_zigzag", "stick_alibi_zigzag")
# With -m exhaustive only (CI time): their family, layout and GQA passes are in a case above
# with a modification (softmax zigzag GQA, unnormalized sigmoid causal, softpick zigzag,
# stick-breaking causal).
PALLAS_EXHAUSTIVE = ("softmax_zigzag_gqa", "sigmoid_none_causal", "softpick_zigzag",
                     "stick_causal")
# Also run inside jax.shard_map(..., check_vma=True) (name + VMA): the kernels' loop starts
# typed as varying, replicated parameters' gradients summed over the devices by the ring.
VMA = "@check_vma"
# (A pointwise F with GQA and a travelling bias; a replicated bias, whose gradient the ring
# sums; stick-breaking's two directions; and learned_params' replicated parameters.)
VMA_CASES = ("softmax_zigzag_gqa", "elu_plus_one_full", "stick_zigzag_causal",
             "softmax_alibi_sinks_zigzag_gqa")
