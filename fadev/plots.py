"""Shared plotting helpers of the experiments, in the style of Golden et al.'s figures: deviations on log
axes, one line or bar per kernel, error bars = standard deviation over input seeds.

Figures are built without pyplot (no global state, any backend; a notebook shows one with
``display(fig)``): :func:`figure` makes a styled Figure and its axes grid, :func:`save` writes PNG and
SVG, :func:`errors` and :func:`positive` prepare error bars and log-axis values, :func:`value_scale` keeps a log axis for data
that spans decades. Each experiment draws
its own figures (``fadev.experiments.NAME.figures``).
"""
from __future__ import annotations

import os

import numpy as np

COLORS = {"flash": "#d62728", "baseline": "#1f77b4", "diff": "#2ca02c", "bf16": "#d62728", "fp16": "#1f77b4",
          "other": "#7f7f7f"}
_RC = {"font.size": 10, "axes.titlesize": 11, "axes.labelsize": 10, "legend.fontsize": 8.5, "xtick.labelsize": 9,
       "ytick.labelsize": 9, "axes.grid": True, "grid.alpha": 0.3, "axes.spines.top": False,
       "axes.spines.right": False, "svg.fonttype": "none"}


def figure(w, h, nrows=1, ncols=1, **kw):
    """(Figure, 2-D array of axes) of size w x h inches, in the shared style; ``kw`` goes to subplots."""
    import matplotlib
    from matplotlib.figure import Figure
    with matplotlib.rc_context(_RC):
        fig = Figure(figsize=(w, h), layout="constrained")
        axes = fig.subplots(nrows, ncols, squeeze=False, **kw)
    for ax in axes.ravel():  # rc_context is gone once drawing happens: apply the style to each axes now
        ax.grid(True, alpha=0.3, which="major")
        ax.spines[["top", "right"]].set_visible(False)
        ax.tick_params(labelsize=9)
    return fig, axes


def save(fig, stem):
    """Write fig to STEM.png (150 dpi) and STEM.svg; returns the two paths."""
    import matplotlib
    os.makedirs(os.path.dirname(os.path.abspath(stem)), exist_ok=True)
    paths = []
    with matplotlib.rc_context(_RC):
        for ext, kw in (("png", {"dpi": 150}), ("svg", {})):
            path = f"{stem}.{ext}"
            fig.savefig(path, **kw)
            paths.append(path)
    return paths


def errors(df, col):
    """Error bars for column stem ``col``: its ``.std`` column with NaN as 0 (None without one)."""
    std = df.get(f"{col}.std")
    return None if std is None else np.nan_to_num(std.to_numpy(dtype=float))


def value_scale(ax, values, decades=1.0) -> str:
    """Put ``ax``'s y axis on a log scale where the positive finite ``values`` drawn on it span at least
    ``decades`` decades (max/min >= 10**decades), else on a linear one from 0, so a narrow range (4.0e-3 to
    4.6e-3) is not drawn as if it grew or fell by orders of magnitude; returns 'log' or 'linear'."""
    v = np.asarray(values, dtype=float)
    v = v[np.isfinite(v) & (v > 0)]
    scale = "log" if len(v) and v.max() >= v.min() * 10 ** decades else "linear"
    ax.set_yscale(scale)
    if scale == "linear" and len(v):  # from 0: a 15% change looks like 15%, not like the whole axis
        ax.set_ylim(0, v.max() * 1.1)
        ax.ticklabel_format(axis="y", style="sci", scilimits=(-3, 3))
    return scale


def positive(values):
    """Values for a log axis: zeros and NaNs become NaN (not drawn)."""
    v = np.asarray(values, dtype=float)
    return np.where(v > 0, v, np.nan)


__all__ = ["COLORS", "figure", "save", "errors", "positive"]
