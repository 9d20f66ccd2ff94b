"""Experiment 6 (FlashAttention-3, arXiv 2407.08608 §4.3, Table 3): fp16 and fp8 on inputs with outliers.

Inputs: ``random_qkv(dist="outlier")`` -- N(0, 1) plus, in one entry of a thousand, an extra N(0, 100)
term -- drawn in fp16 (what FA3 quantises from); golden is fp64 attention on those fp16 values.

fp16 rows: baseline attention under naive(fp16); flash under fa2(fp16) with FlashAttention-2's 128 x 64
tiles ("FA2"); the same fp32-accumulator policy with 128 x 128 tiles ("FA3": FA3's fp16 path has FA2's
numerics, only its tiles differ).

fp8 (E4M3) rows -- quantisation as fadev.experiments.quant defines it (per-tensor scale amax/448, or
block quantisation: one scale per block_q rows of Q, per block_kv rows of K and V), Q/K/V de-quantised
into the kernel (input stage fp64: the scales' product is applied exactly):

* baseline fp8: per-tensor scaling, baseline attention under naive(fp16) with P cast to fp8 for the P.V
  product (FA3: "per-tensor scaling, matmul accumulator in FP32, intermediate softmax results in FP16");
* FA3 fp8: flash under fa2(fp8_e4m3) (fp32 scores, statistics and accumulators; P in fp8) with a bf16
  output (FA3's fp8 kernel writes bf16), 128 x 128 tiles; with per-tensor or block scaling, with or
  without the randomised Hadamard rotation of Q and K ("incoherent processing": random +-1 signs, then
  the normalised Walsh-Hadamard transform along D, csrc/hadamard.c) before quantisation.
"""
from __future__ import annotations

import functools
import os

import numpy as np
import pandas as pd

from .. import plots, report
from ..attention import baseline_attention, flash_attention, random_qkv
from ..policy import Policy
from . import common
from .common import Finding
from .quant import hadamard, quantize, random_signs

NAME = "fp8"
TITLE = "FP8 and outliers (FlashAttention-3 Table 3)"
FIGURES = ("fa3_table3",)

INTRO = (
    "FlashAttention-3 §4.3 / Table 3: inputs N(0, 1) + N(0, 100) x Bernoulli(0.001) "
    '(`random_qkv(dist="outlier")`), drawn in fp16; RMSE against fp64 attention on the same fp16 values. fp8 '
    "= E4M3 with **per-tensor scaling** (one scale amax/448 per (batch, head) matrix: x is stored as "
    "round_e4m3(x / s) and used as s * that) or **block quantisation** (one scale per block of rows: block_q "
    "= 128 rows of Q, block_kv = 128 rows of K and V). **Hadamard** = FA3's incoherent processing: random "
    "+-1 signs, then the normalised Walsh-Hadamard transform along D (csrc/hadamard.c, D log2 D fp64 "
    "butterflies) applied to Q and K before quantisation (Q K^T is unchanged in exact arithmetic). Baseline "
    "fp8 = `naive(fp16)` with P cast to fp8 for the P.V product (FA3: per-tensor scaling, fp32 matmul "
    "accumulators, softmax results in fp16); FA3 fp8 = flash under `fa2(fp8_e4m3)` (fp32 scores, statistics "
    "and accumulators; P in fp8), output in bf16, 128 x 128 tiles. FA3's fp16 path has FA2's numerics with "
    "other tiles (fa2(fp16), 128 x 128). FA3 does not state N and D for Table 3 in the text reproduced here; "
    "absolute RMSE depends on them (outputs shrink like 1/sqrt(N)), the ratios less so.")
"""The report's prose before the figures."""

COLUMNS = [
    ("variant", "variant", "s"), ("vs_golden.rmse", "RMSE vs golden", "pm"), ("fa3_reported", "FA3 Table 3", "e"),
    ("vs_golden.max_abs", "max |d|", "e"), ("vs_golden.rel_l2", "rel L2", "e"),
]
"""The report table's columns: (column or column stem with .mean/.std, header, style); see fadev.report.table."""


REPRODUCE = True
"""Part of ``python -m fadev reproduce``'s default set."""
OPTIONS = ("cluster",)
"""The shared options its command takes: fp8 scaling runs on the CPU whatever --device says; --cluster spreads its
points."""

SIZES = {
    "quick": {"N": 4096, "n_query": 64, "D": 128, "seeds": 5},
    "full": {"N": 8192, "n_query": 1024, "D": 128, "seeds": 10},
}
SIZE_DOCS = common.SIZE_DOCS

FA3_REPORTED = {"baseline fp16": 3.2e-4, "FA2 fp16": 1.9e-4, "FA3 fp16": 1.9e-4, "baseline fp8 (per-tensor)": 2.4e-2,
                "FA3 fp8 (block, Hadamard)": 9.1e-3}
"""RMSE vs an fp64 reference as FA3's Table 3 reports them."""

VARIANTS = (
    # label, format, kernel, scaling, hadamard
    ("baseline fp16", "fp16", "baseline", "none", False),
    ("FA2 fp16", "fp16", "fa2", "none", False),
    ("FA3 fp16", "fp16", "fa3", "none", False),
    ("baseline fp8 (per-tensor)", "fp8_e4m3", "baseline", "tensor", False),
    ("FA3 fp8 (per-tensor)", "fp8_e4m3", "fa3", "tensor", False),
    ("FA3 fp8 (per-tensor, Hadamard)", "fp8_e4m3", "fa3", "tensor", True),
    ("FA3 fp8 (block)", "fp8_e4m3", "fa3", "block", False),
    ("FA3 fp8 (block, Hadamard)", "fp8_e4m3", "fa3", "block", True),
)
TILES = {"fa2": (128, 64), "fa3": (128, 128)}


def policy(kernel, fmt) -> Policy:
    """The precision policy of one row (module docstring)."""
    if fmt == "fp16":
        return Policy.naive("fp16") if kernel == "baseline" else Policy.fa2("fp16")
    if kernel == "baseline":
        return Policy.naive("fp16").replace(input="fp64", p=fmt, name="baseline fp8")
    return Policy.fa2(fmt).replace(input="fp64", out="bf16", name="FA3 fp8")


@functools.lru_cache(maxsize=2)
def _data(N, n_query, D, seed):
    """Full-length fp16 outlier inputs (quantisation scales see all N rows of Q), the first n_query query
    rows, and golden on those."""
    q, k, v = random_qkv((1, 1, N, D), dist="outlier", seed=seed, fmt="fp16")
    ref = baseline_attention(q[:, :, :n_query], k, v, Policy.golden())
    return q, k, v, ref


def prepare(q, k, v, scaling, rotate, seed, block_q=128, block_kv=128, fmt="fp8_e4m3"):
    """Q, K, V as the fp8 kernel sees them: optionally rotated (Q and K, same signs), then quantised to
    fmt and de-quantised with the given scaling."""
    if rotate:
        signs = random_signs(q.shape[-1], seed=seed)
        q, k = hadamard(q, signs), hadamard(k, signs)
    if scaling == "none":
        return q, k, v
    bq = block_q if scaling == "block" else None
    bkv = block_kv if scaling == "block" else None
    return (quantize(q, fmt, scaling, bq)[0], quantize(k, fmt, scaling, bkv)[0], quantize(v, fmt, scaling, bkv)[0])


def _evaluate(point):
    q, k, v, ref = _data(point["N"], point["n_query"], point["D"], point["seed"])
    label = point["variant"]
    _, fmt, kernel, scaling, rotate = next(r for r in VARIANTS if r[0] == label)
    bq, bkv = TILES.get(kernel, (128, 128))
    q, k, v = prepare(q, k, v, scaling, rotate, point["seed"], bq, bkv)
    q = q[:, :, :point["n_query"]]
    pol = policy(kernel, fmt)
    if kernel == "baseline":
        out = baseline_attention(q, k, v, pol)
    else:
        out = flash_attention(q, k, v, pol, block_q=bq, block_kv=bkv)
    return common.metrics("vs_golden", out, ref)


def run(size="quick", out=None, *, device="cpu", workers=1, progress=False, cluster=None,
        **overrides) -> pd.DataFrame:
    """One row per variant (VARIANTS order): format, kernel, scaling, hadamard, mean/std over seeds of
    vs_golden.{rmse, max_abs, rel_l2}, and ``fa3_reported`` (FA3 Table 3's RMSE, NaN where it has none).
    Results in out/fp8.jsonl. Always on the CPU (fp8 scaling is not a sweep-engine feature)."""
    s = common.sizes(SIZES, size, overrides)
    if s["D"] & (s["D"] - 1):
        raise ValueError(f"D must be a power of two for the Hadamard rotation, got {s['D']}")
    points = [{"variant": label, "N": s["N"], "n_query": s["n_query"], "D": s["D"], "seed": seed}
              for label, *_ in VARIANTS for seed in range(s["seeds"])]
    rows = common.run_custom(points, _evaluate, out, NAME, progress, cluster, workers)
    df = common.mean_std(rows, ["variant", "N", "n_query", "D"], ["vs_golden.rmse", "vs_golden.max_abs",
                                                                  "vs_golden.rel_l2"])
    info = {r[0]: r[1:] for r in VARIANTS}
    df.insert(1, "format", [info[v][0] for v in df["variant"]])
    df.insert(2, "kernel", [info[v][1] for v in df["variant"]])
    df.insert(3, "scaling", [info[v][2] for v in df["variant"]])
    df.insert(4, "hadamard", [info[v][3] for v in df["variant"]])
    df["fa3_reported"] = [FA3_REPORTED.get(v, np.nan) for v in df["variant"]]
    return df


def ran_on(device) -> str:
    """Where this experiment runs whatever ``device`` asks: fp8 scaling is not a sweep-engine feature."""
    return "the CPU (always: fp8 scaling and rotation run outside the sweep engine)"


def findings(df, *, device="cpu") -> list:
    rm = dict(zip(df["variant"], df["vs_golden.rmse.mean"]))
    out = []
    for label, paper in FA3_REPORTED.items():
        if label in rm:
            out.append(Finding(f"RMSE, {label}", f"{rm[label]:.2e}", f"{paper:.1e} (FA3 Table 3)"))
    if "FA2 fp16" in rm and "baseline fp16" in rm:
        out.append(Finding("fp16: FA2/FA3 more accurate than the baseline",
                           f"{rm['FA2 fp16']:.2e} / {rm['FA3 fp16']:.2e} vs {rm['baseline fp16']:.2e} "
                           f"({rm['baseline fp16'] / rm['FA2 fp16']:.3g}x)", "1.7x (3.2e-4 vs 1.9e-4)",
                           bool(rm["FA2 fp16"] < rm["baseline fp16"]), "fa3"))
    best = "FA3 fp8 (block, Hadamard)"
    if best in rm and "baseline fp8 (per-tensor)" in rm:
        gain = rm["baseline fp8 (per-tensor)"] / rm[best]
        out.append(Finding("fp8: FA3 with block quantisation and Hadamard vs baseline fp8",
                           f"{gain:.3g}x lower RMSE", "2.6x (2.4e-2 vs 9.1e-3)", bool(gain > 1), "fa3"))
    for scaling in ("per-tensor", "block"):
        a, b = f"FA3 fp8 ({scaling})", f"FA3 fp8 ({scaling}, Hadamard)"
        if a in rm and b in rm:
            out.append(Finding(f"Hadamard rotation on outlier inputs, {scaling} scaling",
                               f"RMSE {rm[a]:.2e} -> {rm[b]:.2e} ({rm[a] / rm[b]:.3g}x lower)",
                               "incoherent processing reduces quantisation error", bool(rm[b] < rm[a]), "fa3"))
    if "FA3 fp8 (per-tensor)" in rm and "FA3 fp8 (block)" in rm:
        a, b = rm["FA3 fp8 (per-tensor)"], rm["FA3 fp8 (block)"]
        sa = float(df.loc[df["variant"] == "FA3 fp8 (per-tensor)", "vs_golden.rmse.std"].iloc[0])
        sb = float(df.loc[df["variant"] == "FA3 fp8 (block)", "vs_golden.rmse.std"].iloc[0])
        if abs(a - b) <= sa + sb:
            why = ("within the seeds' spread: E4M3's relative rounding error does not depend on the scale while values "
                   "stay in its normal range, so a finer scale only helps values that would underflow")
        else:
            why = f"{'lower' if b < a else 'higher'} by more than the seeds' spread ({b / a:.3g}x)"
        out.append(Finding("block vs per-tensor scaling (no rotation)",
                           f"RMSE {a:.2e} (± {sa:.1e} over seeds) -> {b:.2e} (± {sb:.1e}): {why} (FA3 reports no "
                           f"block-only number)"))
    return out


def table(df) -> str:
    return report.table(df, COLUMNS)


def fig_fp8(df):
    """Horizontal bars: RMSE vs golden per variant (log x), FA3 Table 3's values as black diamonds."""
    fig, ax = plots.figure(7.6, 0.42 * len(df) + 1.4)
    ax = ax[0, 0]
    y = np.arange(len(df))
    colors = [plots.COLORS["baseline"] if k == "baseline" else plots.COLORS["flash"] for k in df["kernel"]]
    rmse = plots.positive(df["vs_golden.rmse.mean"])
    ax.barh(y, rmse, xerr=plots.errors(df, "vs_golden.rmse"), color=colors, height=0.6, capsize=2,
            error_kw={"ecolor": "#444444", "lw": 1})
    rep = df["fa3_reported"].to_numpy(dtype=float)
    ax.scatter(rep, y, marker="D", color="black", zorder=3)
    for yi, v in zip(y, rmse):
        ax.text(v * 0.9, yi, f"{v:.1e}", va="center", ha="right", color="white", fontsize=8, fontweight="bold")
    ax.set_yticks(y, df["variant"])
    ax.invert_yaxis()
    ax.set_xscale("log")
    ax.set_xlim(np.nanmin(rmse) / 8, np.nanmax(np.concatenate([rmse, rep])) * 4)
    ax.set_xlabel("RMSE vs fp64 golden")
    r = df.iloc[0]
    ax.set_title(f"Outlier inputs (FA3 §4.3), N={int(r['N'])}, D={int(r['D'])}")
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch
    fig.legend(handles=[Patch(color=plots.COLORS["baseline"], label="baseline (fadev)"),
                        Patch(color=plots.COLORS["flash"], label="flash (fadev)"),
                        Line2D([], [], marker="D", color="black", ls="none", label="FA3 Table 3 reports")],
               loc="outside lower center", ncols=3, fontsize=8.5)
    return fig


def figures(df, out_dir):
    """Draw and save the figures (PNG and SVG); returns their paths."""
    return plots.save(fig_fp8(df), os.path.join(out_dir, "fa3_table3"))
