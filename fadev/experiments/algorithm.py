"""Experiment 3 (Golden et al., Fig 6): which algorithmic knobs of flash attention move its deviation.

Flash attention under paper(bf16) (and fa2(bf16) for the knobs FlashAttention-2 fixes differently) with
one knob changed at a time, each run compared with golden and with baseline under naive(bf16):

* tile area: square tiles Br = Bc = 16 ... 256;
* swapped block dimensions: (Br, Bc) against (Bc, Br);
* tile shape at equal area (64 x 64 against 32 x 128, 128 x 32, ...);
* block_q alone (Bc fixed): Br = 16 ... 256;
* FlashAttention-1's SRAM rule: Bc = ceil(M / 4D), Br = min(Bc, D) for M = 16 ... 128 KiB;
* loop order: q_outer (FA2) against kv_outer (FA1), with the running O and l written to memory between
  K/V blocks in the input format (``state`` = bf16, as FlashAttention-1 does) or kept in the
  accumulator formats (state unset);
* normalisation: deferred (FA2) against eager (FA1);
* exp form: exp against exp2 with log2(e) folded into the scale.

Why most of these change nothing: each query row's output depends only on that row, the keys and the
values, so grouping rows into query blocks (block_q) and the order in which blocks of rows are visited
(loop order) cannot change a single rounding. What a row sees is the sequence of K/V blocks: their size
block_kv (how many block sums are added into the running l and O, each addition rounded), the
normalisation form (how often O is divided), the exp form (which constant is rounded into the scale),
and the format O and l are stored in between blocks (``state``, which only kv_outer uses). The figure
and the table show identical rows where the theory says so: equal to the last bit in every recorded
statistic (tests/test_experiments.py checks the outputs bit for bit).
"""
from __future__ import annotations

import os

import numpy as np
import pandas as pd

from .. import plots, report
from . import common
from .common import Finding
from .precision import tidy

NAME = "algorithm"
TITLE = "Algorithm and tiling (Fig 6)"
FIGURES = ("fig6_algorithm",)

INTRO = (
    "One knob changed at a time from flash under `paper(bf16)` with 64 x 64 tiles (and `fa2(bf16)` where "
    "FlashAttention-2 sets a knob differently).\n\n**Which knobs change nothing, and why.** Each query row's "
    "output depends only on that row, the keys and the values: grouping rows into query blocks (`block_q`, "
    "Br) and the order in which query blocks and K/V blocks are visited (`loop_order`) cannot change a "
    "single rounding of a row. What a row sees is the sequence of its K/V blocks -- their size `block_kv` "
    "(Bc: how many block sums are added into the running l and O, each addition rounded) -- the "
    "normalisation form (eager divides O every block), the exp form (exp2 rounds a different constant into "
    "the scale), and the `state` format, the format O and l are written to memory in between K/V blocks, "
    "which only the kv_outer (FlashAttention-1) order uses. The table shows it: rows marked in `same as` are "
    "equal to the last bit in all 16 recorded statistics for every seed (the tests check the outputs bit for "
    "bit). The paper's tile findings are block_kv findings: a larger tile area or the FA1 SRAM rule's larger "
    "M raises Bc; swapping Br > Bc lowers it; 'square vs non-square' changes nothing as long as Bc stays.")
"""The report's prose before the figures."""

COLUMNS = [
    ("group", "group", "s"), ("variant", "variant", "s"), ("block_q", "Br", "d"), ("block_kv", "Bc", "d"),
    ("loop_order", "loop", "s"), ("normalize", "norm", "s"), ("exp", "exp", "s"), ("state", "state", "s"),
    ("flash_vs_golden.rmse", "RMSE vs golden", "e6"), ("flash_vs_baseline.max_abs", "max |flash - baseline|", "e"),
    ("same_as", "same as", "s"),
]
"""The report table's columns: (column or column stem with .mean/.std, header, style); see fadev.report.table."""


REPRODUCE = True
"""Part of ``python -m fadev reproduce``'s default set."""

SIZES = {
    "quick": {"fmt": "bf16", "N": 16384, "n_query": 64, "D": 64, "seeds": 3},
    "full": {"fmt": "bf16", "N": 16384, "n_query": 1024, "D": 64, "seeds": 10},
}
SIZE_DOCS = common.SIZE_DOCS

GROUPS = ("tile area", "swap", "equal area", "block_q", "sram", "loop order", "normalize", "exp")


def variants(fmt="bf16", D=64):
    """[(group, label, point fields)]; the first variant of each group is its reference."""
    paper = f"paper:{fmt}"
    fa2 = f"fa2:{fmt}"
    out = []
    for b in (16, 32, 64, 128, 256):
        out.append(("tile area", f"{b}x{b}", {"policy": paper, "block_q": b, "block_kv": b}))
    for big, small in ((64, 16), (128, 32), (256, 64)):
        out.append(("swap", f"{small}x{big}", {"policy": paper, "block_q": small, "block_kv": big}))
        out.append(("swap", f"{big}x{small} (swapped)", {"policy": paper, "block_q": big, "block_kv": small}))
    for bq, bkv in ((64, 64), (32, 128), (128, 32), (16, 256), (256, 16)):
        out.append(("equal area", f"{bq}x{bkv}", {"policy": paper, "block_q": bq, "block_kv": bkv}))
    for bq in (64, 16, 32, 128, 256):
        out.append(("block_q", f"{bq}x64", {"policy": paper, "block_q": bq, "block_kv": 64}))
    for kib in (16, 32, 64, 128):
        bc = -(-kib * 1024 // (4 * D))
        out.append(("sram", f"M={kib} KiB ({min(bc, D)}x{bc})", {"policy": paper, "sram_bytes": kib * 1024}))
    tiles = {"block_q": 64, "block_kv": 64}
    out += [
        ("loop order", "paper q_outer", {"policy": paper, **tiles, "loop_order": "q_outer"}),
        ("loop order", "paper kv_outer", {"policy": paper, **tiles, "loop_order": "kv_outer"}),
        ("loop order", "fa2 q_outer", {"policy": fa2, **tiles, "loop_order": "q_outer"}),
        ("loop order", "fa2 kv_outer", {"policy": fa2, **tiles, "loop_order": "kv_outer"}),
        ("loop order", f"fa2 kv_outer, state={fmt}", {"policy": fa2, **tiles, "loop_order": "kv_outer",
                                                       "stage.state": fmt}),
        ("normalize", "paper deferred", {"policy": paper, **tiles, "normalize": "deferred"}),
        ("normalize", "paper eager", {"policy": paper, **tiles, "normalize": "eager"}),
        ("normalize", "fa2 deferred", {"policy": fa2, **tiles, "normalize": "deferred"}),
        ("normalize", "fa2 eager", {"policy": fa2, **tiles, "normalize": "eager"}),
        ("exp", "paper exp", {"policy": paper, **tiles, "exp": "exp"}),
        ("exp", "paper exp2", {"policy": paper, **tiles, "exp": "exp2"}),
        ("exp", "fa2 exp", {"policy": fa2, **tiles, "exp": "exp"}),
        ("exp", "fa2 exp2", {"policy": fa2, **tiles, "exp": "exp2"}),
    ]
    return out


def run(size="quick", out=None, *, device="cpu", workers=1, progress=False, cluster=None,
        **overrides) -> pd.DataFrame:
    """One row per (group, variant): its settings, mean/std over seeds of flash_vs_golden.*,
    flash_vs_baseline.* (baseline under naive(F)), and ``same_as``: the variant of the same group (or of
    the same policy within a group) whose output is identical in every recorded statistic for every seed
    ('' if none). Results in out/algorithm.jsonl."""
    s = common.sizes(SIZES, size, overrides)
    fmt = s["fmt"]
    points = []
    for group, label, fields in variants(fmt, s["D"]):
        for seed in range(s["seeds"]):
            points.append({"kernel": "flash", **fields, "ref_kernel": "baseline", "ref_policy": f"naive:{fmt}",
                           "N": s["n_query"], "N_kv": s["N"], "D": s["D"], "seed": seed, "device": device,
                           "tag.group": group, "tag.variant": label})
    rows = common.run_points(points, out, NAME, workers, progress, cluster)
    for col in ("sram_bytes", "stage.state"):
        if col not in rows.columns:
            rows[col] = None
    rows["state"] = rows["stage.state"].fillna("-")
    rows["sram_bytes"] = rows["sram_bytes"].fillna(0).astype(int)
    for f in ("block_q", "block_kv", "loop_order", "normalize", "exp"):
        rows[f] = rows[f"used.{f}"]
    by = ["tag.group", "tag.variant", "policy", "block_q", "block_kv", "sram_bytes", "loop_order", "normalize", "exp",
          "state", "N", "N_kv", "D"]
    df = tidy(rows, by).rename(columns={"tag.group": "group", "tag.variant": "variant", "N": "n_query",
                                        "N_kv": "N"})
    df["same_as"] = _same_as(rows, df)
    return df


def _same_as(rows, df):
    """For each aggregated row: the first earlier variant in its group with bit-identical statistics for
    every seed."""
    cols = sorted(c for c in rows.columns if c.startswith(("vs_golden.", "vs_ref.")))
    sig = {}
    for (group, label), g in rows.groupby(["tag.group", "tag.variant"], sort=False):
        sig[(group, label)] = tuple(map(tuple, g.sort_values("seed")[cols].to_numpy().tolist()))
    same = []
    for group, label in zip(df["group"], df["variant"]):
        match = ""
        for (g2, l2), s2 in sig.items():
            if g2 != group:
                continue
            if l2 == label:
                break
            if s2 == sig[(group, label)]:
                match = l2
                break
        same.append(match)
    return same


def _dev(df, group, label, metric="flash_vs_golden.rmse.mean"):
    r = df[(df["group"] == group) & (df["variant"] == label)]
    return float(r[metric].iloc[0]) if len(r) else np.nan


def loop_order_finding(lo) -> Finding:
    """fadev's invariance check on the "loop order" group: kv_outer equals q_outer bit for bit for each
    policy while the state is unset, and differs once the state is stored in F. Every statement is read
    from ``same_as``; the format is the policies'."""
    by = dict(zip(lo["variant"], lo["same_as"]))
    fmt = dict(zip(lo["variant"], lo["policy"]))
    dev = dict(zip(lo["variant"], lo["flash_vs_golden.rmse.mean"]))
    pairs = [(v, v.replace("kv_outer", "q_outer")) for v in by if v.endswith(" kv_outer")]
    equal = [f"{fmt[a].replace(':', '(')})" for a, b in pairs if by[a] == b]
    unequal = [f"{fmt[a].replace(':', '(')})" for a, b in pairs if by[a] != b]
    parts = []
    if equal:
        parts.append(f"kv_outer == q_outer bit for bit under {' and '.join(equal)} (state unset)")
    if unequal:
        parts.append(f"kv_outer differs from q_outer under {' and '.join(unequal)} (state unset)")
    for v in (v for v in by if "state=" in v):
        ref = "fa2 q_outer" if "fa2 q_outer" in dev else next(iter(dev))
        parts.append(f"{v}: {'identical to ' + by[v] if by[v] else 'differs'}, RMSE {dev[v]:.2e} vs {ref} "
                     f"{dev[ref]:.2e}")
    ok = bool(pairs) and not unequal and all(by[v] == "" for v in by if "state=" in v)
    return Finding("loop order changes nothing unless the state format differs", "; ".join(parts),
                   "docs/design.md: only block_kv, normalisation, exp form and state matter", ok, "fadev")


def findings(df, *, device="cpu") -> list:
    out = []
    area = df[df["group"] == "tile area"]
    if len(area) > 1:
        rm = area["flash_vs_golden.rmse.mean"].to_numpy()
        mx = area["flash_vs_baseline.max_abs.mean"].to_numpy()
        out.append(Finding(
            "larger tiles, smaller deviation (square tiles " + " -> ".join(area["variant"]) + ")",
            "RMSE vs golden " + " -> ".join(f"{v:.2e}" for v in rm) + "; max |flash - baseline| " +
            " -> ".join(f"{v:.2e}" for v in mx),
            "increasing tile size decreases deviation", bool(np.all(np.diff(rm) < 0)), "golden"))
    swap = df[df["group"] == "swap"]
    if len(swap):
        pairs, ok = [], True
        labels = list(swap["variant"])
        for i in range(0, len(labels) - 1, 2):
            a, b = _dev(df, "swap", labels[i]), _dev(df, "swap", labels[i + 1])
            pairs.append(f"{labels[i]} {a:.2e} -> {labels[i + 1]} {b:.2e} ({b / a:.2g}x)")
            ok = ok and b > a
        out.append(Finding(
            "swapping block dimensions (Br <= Bc, as FA1's rule Br = min(Bc, d) gives, made Br > Bc)",
            "RMSE vs golden " + "; ".join(pairs) + " -- the swap shrinks block_kv",
            "swapping block dimensions increases deviation", ok, "golden"))
    bq = df[df["group"] == "block_q"]
    if len(bq):
        same = bool((bq["same_as"].iloc[1:] != "").all())
        out.append(Finding(
            "square vs non-square tiles with block_kv fixed (Br = 16 ... 256, Bc = 64)",
            ("identical to the last bit in every statistic for every seed" if same else "NOT identical") +
            f" (RMSE vs golden {bq['flash_vs_golden.rmse.mean'].iloc[0]:.6e} for all)",
            "square vs non-square tiles: no effect", same, "golden"))
    eq = df[df["group"] == "equal area"]
    if len(eq):
        by_bc = eq.sort_values("block_kv")["flash_vs_golden.rmse.mean"].to_numpy()
        order = "falls monotonically with block_kv" if np.all(np.diff(by_bc) < 0) else "is NOT monotone in block_kv"
        pairs = ", ".join(f"{v} {r:.2e}" for v, r in zip(eq["variant"], eq["flash_vs_golden.rmse.mean"]))
        out.append(Finding("tile shape at equal area 4096 (this changes block_kv too)",
                           f"RMSE vs golden {pairs}: it {order}, whatever block_q"))
    lo = df[df["group"] == "loop order"]
    if len(lo):
        out.append(loop_order_finding(lo))
    for group, a, b in (("normalize", "deferred", "eager"), ("exp", "exp", "exp2")):
        g = df[df["group"] == group]
        if len(g):
            parts = []
            for pol in ("paper", "fa2"):
                x, y = _dev(df, group, f"{pol} {a}"), _dev(df, group, f"{pol} {b}")
                parts.append(f"{pol}: {a} {x:.2e}, {b} {y:.2e} ({y / x:.3g}x)")
            out.append(Finding(f"{a} vs {b}", "RMSE vs golden " + "; ".join(parts)))
    return out


def table(df) -> str:
    return report.table(df, COLUMNS)


_GROUP_TITLES = {"tile area": "Tile area (Br = Bc)", "swap": "Swapped block dims (Br×Bc)",
                 "equal area": "Equal area, shape varies", "block_q": "block_q alone (Bc = 64)",
                 "sram": "FA1 rule: SRAM size M", "loop order": "Loop order / state format",
                 "normalize": "Normalisation", "exp": "exp vs exp2"}


def fig_algorithm(df):
    """Fig 6: one panel per knob group; bars = flash RMSE vs golden (log y, shared), identical outputs
    hatched and labelled '≡ reference'."""
    groups = list(dict.fromkeys(df["group"]))
    ncols = 4
    nrows = -(-len(groups) // ncols)
    fig, axes = plots.figure(13, 3.5 * nrows, nrows, ncols, sharey=True)
    vals = plots.positive(df["flash_vs_golden.rmse.mean"])
    lo, hi = np.nanmin(vals) / 3, np.nanmax(vals) * 6
    for ax, group in zip(axes.ravel(), groups):
        g = df[df["group"] == group]
        x = np.arange(len(g))
        colors = [plots.COLORS["baseline"] if str(p).startswith("fa2") else plots.COLORS["flash"] for p in g["policy"]]
        bars = ax.bar(x, plots.positive(g["flash_vs_golden.rmse.mean"]), yerr=plots.errors(g, "flash_vs_golden.rmse"),
                      capsize=2, color=colors)
        for bar, same in zip(bars, g["same_as"]):
            if same:
                bar.set_hatch("//")
                bar.set_edgecolor("white")
                ax.text(bar.get_x() + bar.get_width() / 2, bar.get_height() * 1.25, "≡", ha="center", fontsize=11)
        ax.set_xticks(x, [v.replace(" (swapped)", "\nswapped").replace(", state=", "\nstate=").replace(" (", "\n(")
                          for v in g["variant"]], rotation=0 if len(g) <= 3 else 35, ha="center" if len(g) <= 3
                      else "right", fontsize=7.5)
        ax.set_yscale("log")
        ax.set_ylim(lo, hi)
        ax.set_title(_GROUP_TITLES.get(group, group))
    for ax in axes.ravel()[len(groups):]:
        ax.set_visible(False)
    for row in axes:
        row[0].set_ylabel("RMSE vs golden")
    from matplotlib.patches import Patch
    fig.legend(handles=[Patch(color=plots.COLORS["flash"], label="paper(bf16)"), Patch(color=plots.COLORS["baseline"],
                                                                                 label="fa2(bf16)"),
                        Patch(facecolor="#cccccc", hatch="//", edgecolor="white",
                              label="≡ bit-identical to a bar on its left")],
               loc="outside lower center", ncols=3, fontsize=9)
    r = df.iloc[0]
    fig.suptitle(f"Flash attention knobs, bf16, N={int(r['N'])}, D={int(r['D'])}: only block_kv, normalisation, "
                 f"exp form and the state format can matter")
    return fig


def figures(df, out_dir):
    """Draw and save the figures (PNG and SVG); returns their paths."""
    return plots.save(fig_algorithm(df), os.path.join(out_dir, "fig6_algorithm"))
