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

import numpy as np
import pandas as pd

from ..policy import STAGES, Policy
from . import common
from .common import Finding

NAME = "attribution"
TITLE = "Attribution by stage (beyond the paper)"
FIGURES = ("attribution",)

SIZES = {
    "quick": {"formats": ("bf16", "fp16"), "N": 16384, "n_query": 64, "D": 64, "block_q": 64, "block_kv": 64,
              "seeds": 3},
    "full": {"formats": ("bf16", "fp16"), "N": 16384, "n_query": 1024, "D": 64, "block_q": 64, "block_kv": 64,
             "seeds": 10},
}

WALKS = {"raise": ("paper", "fp32"), "lower": ("fa2", None)}
"""direction: (start preset, target format; None = the input format F)."""


def stages_to_change(start, fmt, target):
    """Stages of start(F) whose format is not already the target (input and state excluded)."""
    pol = Policy.preset(start, fmt)
    target = target or fmt
    return [s for s in STAGES if s not in ("input", "state") and getattr(pol, s).name != target]


def run(size="quick", out=None, device="cpu", workers=1, progress=False, **overrides) -> pd.DataFrame:
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
    rows = common.run_points(points, out, NAME, workers, progress)
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


def findings(df) -> list:
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


def plot(df, stem_dir):
    from .. import plots
    return plots.plot_attribution(df, stem_dir)
