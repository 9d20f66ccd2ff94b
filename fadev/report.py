"""report.md for ``python -m fadev reproduce``: each finding with our number next to the paper's claim.

:func:`write` takes the results of :func:`fadev.experiments.reproduce` ({name: {"df", "figures",
"findings", "seconds"}}) and writes one Markdown file: a summary table of every claim with a verdict,
then one section per experiment (setup, figures, the aggregated table, findings).
"""
from __future__ import annotations

import datetime
import os
import platform

import numpy as np

from . import __version__

PAPER = "Golden et al., \"Is Flash Attention Stable?\", arXiv 2405.02803"

INTRO = {
    "precision": (
        "Flash attention under `paper(F)` (the paper's re-implementation: every stored tensor in F, each "
        "matmul/reduction accumulating in fp32) against baseline attention under `naive(F)` (PyTorch's matmul, "
        "fused softmax, matmul in F), both against an fp64 golden run. Inputs are drawn N(0, 1) and rounded to F, "
        "so all three runs see identical inputs and only the arithmetic differs."),
    "seqlen": (
        "The same comparison at bf16 and fp16 with fixed 64 x 64 tiles as the number of keys N grows. Each query "
        "row adds one block sum per K/V block into its running l and O (N / block_kv rounded additions in F), "
        "while the outputs themselves shrink like 1/sqrt(N): the absolute difference first falls with the output "
        "magnitude, then rises; the relative difference rises throughout."),
    "algorithm": (
        "One knob changed at a time from flash under `paper(bf16)` with 64 x 64 tiles (and `fa2(bf16)` where "
        "FlashAttention-2 sets a knob differently).\n\n"
        "**Which knobs change nothing, and why.** Each query row's output depends only on that row, the keys and "
        "the values: grouping rows into query blocks (`block_q`, Br) and the order in which query blocks and K/V "
        "blocks are visited (`loop_order`) cannot change a single rounding of a row. What a row sees is the "
        "sequence of its K/V blocks -- their size `block_kv` (Bc: how many block sums are added into the running "
        "l and O, each addition rounded) -- the normalisation form (eager divides O every block), the exp form "
        "(exp2 rounds a different constant into the scale), and the `state` format, the format O and l are written "
        "to memory in between K/V blocks, which only the kv_outer (FlashAttention-1) order uses. The table shows it: "
        "rows marked in `same as` are equal to the last bit in all 16 recorded statistics for every seed (the tests "
        "check the outputs bit for bit). The paper's tile findings are block_kv findings: a larger tile area or the "
        "FA1 SRAM rule's larger M raises Bc; swapping Br > Bc lowers it; 'square vs non-square' changes nothing as "
        "long as Bc stays."),
    "attribution": (
        "Which intermediate is to blame. `raise`: from `paper(F)`, one stage at a time to fp32 (share = fraction of "
        "the start's mean squared error removed: 1 - (rmse/rmse_start)^2). `lower`: from `fa2(F)`, one stage at a "
        "time to F (share = that stage's added MSE over all stages' added MSE). Stages already in the target format "
        "are left out; inputs are exact in F, so `input` never matters here."),
    "kernels": (
        "The presets that model real kernels against golden: `fa2(F)` (FlashAttention-2: fp32 scores/softmax/"
        "statistics, P in F, 128 x 64 tiles, exp2), `fa1(F)` (kv_outer, eager, O and l stored in F between K/V "
        "blocks), `naive(F)` and `torch_math(F)` (SDPA's math backend: fp32 inside). On a GPU with PyTorch, "
        "`--device cuda` adds PyTorch's real SDPA backends on the same inputs (flash, memory-efficient, cuDNN, "
        "math, and math with `allow_fp16_bf16_reduction_math_sdp(True)`: without it the math backend upcasts "
        "fp16/bf16 to fp32)."),
    "fp8": (
        "FlashAttention-3 §4.3 / Table 3: inputs N(0, 1) + N(0, 100) x Bernoulli(0.001) (`random_qkv(dist="
        "\"outlier\")`), drawn in fp16; RMSE against fp64 attention on the same fp16 values. fp8 = E4M3 with "
        "**per-tensor scaling** (one scale amax/448 per (batch, head) matrix: x is stored as round_e4m3(x / s) and "
        "used as s * that) or **block quantisation** (one scale per block of rows: block_q = 128 rows of Q, "
        "block_kv = 128 rows of K and V). **Hadamard** = FA3's incoherent processing: random +-1 signs, then the "
        "normalised Walsh-Hadamard transform along D (csrc/hadamard.c, D log2 D fp64 butterflies) applied to Q and "
        "K before quantisation (Q K^T is unchanged in exact arithmetic). Baseline fp8 = `naive(fp16)` with P cast to "
        "fp8 for the P.V product (FA3: per-tensor scaling, fp32 matmul accumulators, softmax results in fp16); FA3 "
        "fp8 = flash under `fa2(fp8_e4m3)` (fp32 scores, statistics and accumulators; P in fp8), output in bf16, "
        "128 x 128 tiles. FA3's fp16 path has FA2's numerics with other tiles (fa2(fp16), 128 x 128). FA3 does "
        "not state N and D for Table 3 in the text reproduced here; absolute RMSE depends on them (outputs shrink "
        "like 1/sqrt(N)), the ratios less so."),
}

TABLES = {
    "precision": [("format", "format", "s"), ("bits", "p", "d"),
                  ("flash_vs_golden.rmse", "flash vs golden RMSE", "pm"),
                  ("baseline_vs_golden.rmse", "baseline vs golden RMSE", "pm"),
                  ("ratio.rmse", "ratio (RMSE)", "pmx"), ("flash_vs_golden.max_abs", "flash max", "e"),
                  ("baseline_vs_golden.max_abs", "baseline max", "e"), ("ratio.max_abs", "ratio (max)", "pmx"),
                  ("flash_vs_baseline.max_abs", "max |flash - baseline|", "pm")],
    "seqlen": [("format", "format", "s"), ("N", "N", "d"), ("flash_vs_baseline.max_abs", "max |diff|", "pm"),
               ("flash_vs_baseline.mean_diff", "mean diff", "e"), ("flash_vs_baseline.std_diff", "std diff", "e"),
               ("flash_vs_baseline.rel_l2", "rel L2 diff", "e"), ("flash_vs_golden.rmse", "flash RMSE", "e"),
               ("baseline_vs_golden.rmse", "baseline RMSE", "e"), ("ratio.rmse", "ratio", "x")],
    "algorithm": [("group", "group", "s"), ("variant", "variant", "s"), ("block_q", "Br", "d"),
                  ("block_kv", "Bc", "d"), ("loop_order", "loop", "s"), ("normalize", "norm", "s"), ("exp", "exp", "s"),
                  ("state", "state", "s"), ("flash_vs_golden.rmse", "RMSE vs golden", "e6"),
                  ("flash_vs_baseline.max_abs", "max |flash - baseline|", "e"), ("same_as", "same as", "s")],
    "attribution": [("format", "format", "s"), ("direction", "walk", "s"), ("stage", "stage", "s"),
                    ("flash_vs_golden.rmse", "RMSE vs golden", "pm"), ("ratio", "/ start", "x"),
                    ("share", "share", "%")],
    "kernels": [("impl", "implementation", "s"), ("format", "format", "s"), ("N", "N", "d"),
                ("vs_golden.rmse", "RMSE vs golden", "pm"), ("vs_golden.max_abs", "max |d|", "e"),
                ("vs_golden.rel_l2", "rel L2", "e")],
    "fp8": [("variant", "variant", "s"), ("vs_golden.rmse", "RMSE vs golden", "pm"),
            ("fa3_reported", "FA3 Table 3", "e"), ("vs_golden.max_abs", "max |d|", "e"),
            ("vs_golden.rel_l2", "rel L2", "e")],
}
"""Columns of each section's table: (column or column stem with .mean/.std, header, style)."""


def _cell(row, col, style):
    if style == "s":
        v = row.get(col, "")
        return "" if v is None or (isinstance(v, float) and np.isnan(v)) else str(v)
    if style in ("pm", "pmx"):
        m, s = row.get(f"{col}.mean", np.nan), row.get(f"{col}.std", np.nan)
        if m is None or not np.isfinite(m):
            return "n/a"
        body = f"{m:.3g}x" if style == "pmx" else f"{m:.3e}"
        return body + (f" ± {s:.1e}" if s is not None and np.isfinite(s) and s > 0 else "")
    v = row.get(col, row.get(f"{col}.mean", np.nan))
    if v is None or (isinstance(v, float) and not np.isfinite(v)):
        return "n/a" if style != "%" else ""
    if style == "d":
        return str(int(v))
    if style == "x":
        return f"{v:.3g}x"
    if style == "%":
        return f"{v:.0%}"
    if style == "e6":
        return f"{v:.6e}"
    return f"{v:.3e}"


def table(df, columns) -> str:
    """A Markdown table of df's rows with the given (column, header, style) columns."""
    head = "| " + " | ".join(_md(h) for _, h, _ in columns) + " |"
    rule = "|" + "|".join("---" for _ in columns) + "|"
    lines = [head, rule]
    for row in df.to_dict("records"):
        lines.append("| " + " | ".join(_md(_cell(row, c, s)) for c, _, s in columns) + " |")
    return "\n".join(lines)


def write(path, results, size="quick", device="cpu"):
    """Write report.md to ``path`` from reproduce()'s results; returns the path."""
    from .experiments import EXPERIMENTS
    from .experiments.common import torch_cuda
    out_dir = os.path.dirname(os.path.abspath(path))
    total = sum(r["seconds"] for r in results.values())
    lines = [f"# Reproducing {PAPER} with fadev", "",
             f"fadev {__version__}, `{size}` sizes, device `{device}`"
             f"{' (PyTorch sees a GPU)' if torch_cuda() else ''}; {platform.machine()} {platform.system()}, Python "
             f"{platform.python_version()}, {os.cpu_count()} CPUs; {datetime.date.today().isoformat()}; "
             f"{total:.0f} s in this invocation (finished points are read back, not recomputed). Regenerate with "
             f"`python -m fadev reproduce --{size} --out DIR`.", "",
             "Method. Every arithmetic result is rounded to the format of the stage it belongs to (fadev's precision "
             "policies, DESIGN.md); deviations are measured against an fp64 golden run on the same inputs and "
             "averaged over input seeds (± = standard deviation over seeds). Query rows are independent, so each "
             "experiment computes a sample of query rows (`n_query`) against all N keys: the statistics are those of "
             "the full N x N attention at O(n_query N D) cost (fadev/experiments/common.py).", ""]
    verdicts = [(name, f) for name, r in results.items() for f in r["findings"] if f.holds is not None]
    if verdicts:
        lines += ["## Summary of the claims", "", "| experiment | claim | ours | paper | verdict |",
                  "|---|---|---|---|---|"]
        for name, f in verdicts:
            lines.append(f"| {name} | {_md(f.claim)} | {_md(f.ours)} | {_md(f.paper)} | "
                         f"{'holds' if f.holds else '**does not hold**'} |")
        lines.append("")
    for i, (name, r) in enumerate(results.items(), 1):
        mod = EXPERIMENTS[name]
        df = r["df"]
        lines += [f"## {i}. {mod.TITLE}", "", INTRO.get(name, ""), "",
                  f"Sizes (`{size}`): " + ", ".join(f"{k}={_short(v)}" for k, v in mod.SIZES[size].items()) +
                  f". Raw rows: `{name}.jsonl`; this table: `{name}.csv`; {r['seconds']:.1f} s.", ""]
        for fig in r["figures"]:
            if fig.endswith(".png"):
                rel = os.path.relpath(fig, out_dir)
                lines += [f"![{os.path.basename(fig)}]({rel})", ""]
        lines += ["Findings:", ""] + [f.markdown() for f in r["findings"]] + [""]
        if name in TABLES:
            lines += [table(df, TABLES[name]), ""]
    with open(path, "w") as fh:
        fh.write("\n".join(lines))
    return path


def _md(text) -> str:
    """Text for a Markdown table cell: pipes escaped."""
    return str(text).replace("|", "\\|")


def _short(v):
    if isinstance(v, (tuple, list)):
        if len(v) > 4 and all(isinstance(x, int) for x in v):
            return f"{v[0]}..{v[-1]} ({len(v)} values)"
        return "/".join(map(str, v))
    return str(v)
