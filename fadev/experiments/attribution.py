"""Experiment 4 (beyond the paper): which intermediate is to blame for flash attention's deviation.

Two walks through the precision policy, for F = bf16 and fp16, flash attention with 64 x 64 tiles:

* **raise**: start from ``Policy.paper(F)`` (every stored tensor in F) and raise one stage at a time to
  fp32; a stage's *share* is the fraction of the start's mean squared error (vs golden) that raising it
  alone removes, ``1 - (rmse_raised / rmse_start)^2`` (independent rounding errors add in variance, so
  the shares of independent sources add up to about 1; shared sources make the sum exceed 1).
* **lower**: start from ``Policy.fa2(F)`` (fp32 everywhere but Q/K/V, P and the output) and lower one
  stage at a time to F; a stage's share is its added mean squared error over the sum of all stages'
  added errors, ``(rmse_s^2 - rmse_start^2) / sum_t (rmse_t^2 - rmse_start^2)``.

Stages already in the target format are left out (the accumulators of paper(F) are fp32 already; the
inputs are drawn exactly in F, so ``input`` never matters here; ``state`` only acts with kv_outer).
"""
from __future__ import annotations

import os

import numpy as np
import pandas as pd

from .. import plots, report
from ..policy import STAGES, Policy
from . import common
from .common import Finding

NAME = "attribution"
TITLE = "Attribution by stage (beyond the paper)"
FIGURES = ("attribution",)

INTRO = (
    "Which intermediate is to blame. `raise`: from `paper(F)`, one stage at a time to fp32 (share = fraction "
    "of the start's mean squared error removed: 1 - (rmse/rmse_start)^2). `lower`: from `fa2(F)`, one stage "
    "at a time to F (share = that stage's added MSE over all stages' added MSE). Stages already in the "
    "target format are left out; inputs are exact in F, so `input` never matters here.")
"""The report's prose before the figures."""

COLUMNS = [
    ("format", "format", "s"), ("direction", "walk", "s"), ("stage", "stage", "s"),
    ("flash_vs_golden.rmse", "RMSE vs golden", "pm"), ("ratio", "/ start", "x"), ("share", "share", "%"),
]
"""The report table's columns: (column or column stem with .mean/.std, header, style); see fadev.report.table."""


REPRODUCE = True
"""Part of ``python -m fadev reproduce``'s default set."""

SIZES = {
    "quick": {"formats": ("bf16", "fp16"), "N": 16384, "n_query": 64, "D": 64, "block_q": 64, "block_kv": 64,
              "seeds": 3},
    "full": {"formats": ("bf16", "fp16"), "N": 16384, "n_query": 1024, "D": 64, "block_q": 64, "block_kv": 64,
             "seeds": 10},
}
SIZE_DOCS = common.SIZE_DOCS

WALKS = {"raise": ("paper", "fp32"), "lower": ("fa2", None)}
"""direction: (start preset, target format; None = the input format F)."""


def stages_to_change(start, fmt, target):
    """Stages of start(F) whose format is not already the target (input and state excluded)."""
    pol = Policy.preset(start, fmt)
    target = target or fmt
    return [s for s in STAGES if s not in ("input", "state") and getattr(pol, s).name != target]


def run(size="quick", out=None, *, device="cpu", workers=1, progress=False, cluster=None,
        **overrides) -> pd.DataFrame:
    """One row per (format, direction, stage) (stage 'none' = the start policy): mean/std over seeds of
    flash_vs_golden.rmse and .max_abs, ``ratio`` = rmse / rmse of the start, ``share`` (module docstring).
    Results in out/attribution.jsonl."""
    s = common.sizes(SIZES, size, overrides)
    points = []
    for fmt in s["formats"]:
        for direction, (start, target) in WALKS.items():
            for stage in ["none"] + stages_to_change(start, fmt, target):
                change = {} if stage == "none" else {f"stage.{stage}": target or fmt}
                for seed in range(s["seeds"]):
                    points.append({"kernel": "flash", "policy": f"{start}:{fmt}", **change, "N": s["n_query"],
                                   "N_kv": s["N"], "D": s["D"], "block_q": s["block_q"], "block_kv": s["block_kv"],
                                   "seed": seed, "device": device, "tag.direction": direction, "tag.stage": stage})
    rows = common.run_points(points, out, NAME, workers, progress, cluster)
    rows["format"] = rows["policy"].str.split(":").str[1]
    df = common.mean_std(rows, ["format", "tag.direction", "tag.stage", "policy"],
                         ["vs_golden.rmse", "vs_golden.max_abs"])
    df = df.rename(columns={"tag.direction": "direction", "tag.stage": "stage"})
    df.columns = [c.replace("vs_golden.", "flash_vs_golden.") for c in df.columns]
    ratio, share = [], []
    for (fmt, direction), g in df.groupby(["format", "direction"], sort=False):
        start = float(g.loc[g["stage"] == "none", "flash_vs_golden.rmse.mean"].iloc[0])
        mse = g["flash_vs_golden.rmse.mean"].to_numpy() ** 2
        if direction == "raise":
            sh = 1 - mse / start**2
        else:
            added = mse - start**2
            total = added[added > 0].sum()
            sh = added / total if total > 0 else np.zeros_like(added)
        for idx, r, h in zip(g.index, g["flash_vs_golden.rmse.mean"] / start, sh):
            ratio.append((idx, r))
            share.append((idx, h))
    df["ratio"] = pd.Series(dict(ratio))
    df["share"] = pd.Series(dict(share))
    df.loc[df["stage"] == "none", "share"] = np.nan
    return df


def findings(df, *, device="cpu") -> list:
    out = []
    for (fmt, direction), g in df.groupby(["format", "direction"], sort=False):
        g = g[g["stage"] != "none"].sort_values("share", ascending=False)
        start = df[(df["format"] == fmt) & (df["direction"] == direction) & (df["stage"] == "none")]
        rm = float(start["flash_vs_golden.rmse.mean"].iloc[0])
        top = ", ".join(f"{s} {h:.0%}" for s, h in zip(g["stage"], g["share"]) if h >= 0.05) or "none above 5%"
        if direction == "raise":
            claim = f"{fmt}, from paper({fmt}) (RMSE {rm:.2e}), raising one stage to fp32"
            text = f"share of the MSE removed: {top}"
        else:
            claim = f"{fmt}, from fa2({fmt}) (RMSE {rm:.2e}), lowering one stage to {fmt}"
            text = f"share of the added MSE: {top}"
        out.append(Finding(claim, text))
    return out


def table(df) -> str:
    return report.table(df, COLUMNS)


def fig_attribution(df):
    """Bars per stage: RMSE relative to the start policy (log x; < 1: raising the stage helps, > 1:
    lowering it hurts), share of the MSE annotated; rows = direction, columns = format."""
    fmts = list(dict.fromkeys(df["format"]))
    dirs = [d for d in ("raise", "lower") if d in set(df["direction"])]
    fig, axes = plots.figure(5.2 * len(fmts), 3.6 * len(dirs), len(dirs), len(fmts))
    for i, direction in enumerate(dirs):
        for j, fmt in enumerate(fmts):
            ax = axes[i, j]
            g = df[(df["format"] == fmt) & (df["direction"] == direction) & (df["stage"] != "none")]
            start = df[(df["format"] == fmt) & (df["direction"] == direction) & (df["stage"] == "none")]
            y = np.arange(len(g))
            ratio = g["ratio"].to_numpy(dtype=float)
            color = plots.COLORS["diff"] if direction == "raise" else plots.COLORS["flash"]
            ax.barh(y, ratio - 1, left=1, color=color, height=0.65)
            for yi, r, share in zip(y, ratio, g["share"]):
                label = "0%" if abs(share) < 0.005 else f"{share:.0%}"
                ax.text(r * (1.04 if r >= 1 else 0.96), yi, label, va="center",
                        ha="left" if r >= 1 else "right", fontsize=8)
            ax.axvline(1, color="black", lw=0.8)
            ax.set_xscale("log")
            lo, hi = min(np.nanmin(ratio), 1) / 1.6, max(np.nanmax(ratio), 1) * 1.6
            ax.set_xlim(lo, hi)
            ax.set_yticks(y, g["stage"])
            ax.invert_yaxis()
            rm = float(start["flash_vs_golden.rmse.mean"].iloc[0]) if len(start) else np.nan
            if direction == "raise":
                ax.set_title(f"paper({fmt}) (RMSE {rm:.1e}): raise one stage to fp32")
                ax.set_xlabel("RMSE / RMSE of paper(F)   (labels: share of MSE removed)")
            else:
                ax.set_title(f"fa2({fmt}) (RMSE {rm:.1e}): lower one stage to {fmt}")
                ax.set_xlabel("RMSE / RMSE of fa2(F)   (labels: share of MSE added)")
    return fig


def figures(df, out_dir):
    """Draw and save the figures (PNG and SVG); returns their paths."""
    return plots.save(fig_attribution(df), os.path.join(out_dir, "attribution"))
