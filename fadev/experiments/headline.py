"""The headline that opens a reproduction's report: three to five sentences, each computed from the run's data.

It reconciles the two results a reader meets first in the summary: Golden et al.'s flash/baseline ratio at
bf16 (flash under the paper's policy, every stored tensor in bf16) and FlashAttention-3's "FA2/FA3 are more
accurate than the baseline" (FlashAttention-2's real policy, fp32 statistics and accumulators). The two
compare different policies; the attribution study names the stage that makes the difference. Each sentence
appears only where the experiment it reads is in the results.
"""
from __future__ import annotations

import numpy as np

STAGE_WORDS = {"stats": "the softmax statistics (the row sum l and its updates, the LSE)",
               "out_acc": "the running output O kept between K/V blocks",
               "score_acc": "the Q.K^T accumulator", "pv_acc": "the P.V accumulator", "score": "the scores S",
               "p": "the probabilities P", "softmax": "the exponentials"}
"""Report words for the policy stages an attribution can blame."""


def _x(v) -> str:
    return f"{v:.3g}x"


def _precision(df):
    by = df.set_index("format")
    if "bf16" not in by.index:
        return None
    r = by.loc["bf16"]
    return (f"At bf16 (N = {int(r['N'])}, {int(r['block_q'])}x{int(r['block_kv'])} tiles), flash under the paper's "
            f"policy paper(bf16) deviates {_x(r['ratio.rmse.mean'])} as much as the baseline naive(bf16) from the "
            f"fp64 answer (RMSE; the mean over {int(r['ratio.rmse.count'])} seeds of each seed's ratio), where Golden "
            f"et al. report ~10x.")


def _attribution(df):
    g = df[(df["format"] == "bf16") & (df["direction"] == "raise")]
    if g.empty or g["share"].dropna().empty:
        return None
    top = g.loc[g["share"].idxmax()]
    start = float(g.loc[g["stage"] == "none", "flash_vs_golden.rmse.mean"].iloc[0])
    return (f"That gap is the policy's, not the tiling's: raising {STAGE_WORDS.get(top['stage'], top['stage'])} "
            f"alone to fp32 removes {top['share']:.0%} of paper(bf16)'s squared error (RMSE {start:.2e} -> "
            f"{top['flash_vs_golden.rmse.mean']:.2e}).")


def _kernels(df):
    rm = {(i, n): v for i, f, n, v in zip(df["impl"], df["format"], df["N"], df["vs_golden.rmse.mean"]) if f == "bf16"}
    both = [n for (i, n) in rm if i == "emulated fa2" and ("emulated naive", n) in rm]
    if not both:
        return None
    n = max(both)
    fa2, naive = rm[("emulated fa2", n)], rm[("emulated naive", n)]
    word = "more" if fa2 < naive else "less"
    factor = naive / fa2 if fa2 < naive else fa2 / naive
    return (f"FlashAttention-2's real policy fa2(bf16), whose statistics and accumulators are fp32, is "
            f"{_x(factor)} {word} accurate than the baseline at N = {int(n)} (RMSE {fa2:.2e} vs {naive:.2e}).")


def _fp8(df):
    rm = dict(zip(df["variant"], df["vs_golden.rmse.mean"]))
    if "FA2 fp16" not in rm or "baseline fp16" not in rm:
        return None
    ratio = rm["baseline fp16"] / rm["FA2 fp16"]
    return (f"FlashAttention-3's \"FA2/FA3 more accurate than the baseline\" compares that real policy, not "
            f"paper(F), with the baseline: the baseline's RMSE is {_x(ratio)} FA2's at fp16.")


def _seqlen(df):
    g = df[df["format"] == "bf16"].sort_values("N")
    if len(g) < 2:
        return None
    N, ratio = g["N"].to_numpy(), g["ratio.rmse.mean"].to_numpy()
    lo, hi = int(np.argmin(ratio)), int(np.argmax(ratio))
    return (f"The paper(bf16) ratio depends on the sequence length: {_x(ratio[lo])} at N = {int(N[lo])}, "
            f"{_x(ratio[hi])} at N = {int(N[hi])}.")


def headline(results) -> list:
    """The headline paragraph of ``results`` ({name: {"df", ...}}) as a one-item list, or [] where none of the
    experiments it reads (precision, attribution, kernels, fp8, seqlen) ran."""
    dfs = {name: r["df"] for name, r in results.items() if r.get("df") is not None and len(r["df"])}
    sentences = []
    for name, make in (("precision", _precision), ("attribution", _attribution), ("kernels", _kernels),
                       ("fp8", _fp8), ("seqlen", _seqlen)):
        if name in dfs:
            sentences.append(make(dfs[name]))
    sentences = [s for s in sentences if s]
    return ["**In short.** " + " ".join(sentences)] if sentences else []


__all__ = ["headline", "STAGE_WORDS"]
