"""Figures of the reproduction experiments, in the style of Golden et al.'s: deviations on log axes,
one line or bar per kernel, error bars = standard deviation over input seeds.

Every ``fig_*`` function takes an experiment's DataFrame (fadev.experiments.NAME.run) and returns a
:class:`matplotlib.figure.Figure` built without pyplot (no global state, any backend; a notebook shows
it with ``display(fig)``); :func:`save` writes it as PNG and SVG; ``plot_*`` do both for the CLI.
"""
from __future__ import annotations

import os

import numpy as np

COLORS = {"flash": "#d62728", "baseline": "#1f77b4", "diff": "#2ca02c", "bf16": "#d62728", "fp16": "#1f77b4",
          "other": "#7f7f7f"}
_RC = {"font.size": 10, "axes.titlesize": 11, "axes.labelsize": 10, "legend.fontsize": 8.5, "xtick.labelsize": 9,
       "ytick.labelsize": 9, "axes.grid": True, "grid.alpha": 0.3, "axes.spines.top": False,
       "axes.spines.right": False, "svg.fonttype": "none"}


def _figure(w, h, nrows=1, ncols=1, **kw):
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


def _err(df, col):
    std = df.get(f"{col}.std")
    return None if std is None else np.nan_to_num(std.to_numpy(dtype=float))


def _positive(values):
    """Values for a log axis: zeros and NaNs become NaN (not drawn)."""
    v = np.asarray(values, dtype=float)
    return np.where(v > 0, v, np.nan)


# ------------------------------------------------------------------ 1. precision (Figs 3-4)

def _format_labels(df):
    return [f"{f}\n(p={b})" for f, b in zip(df["format"], df["bits"])]


def fig_precision_flash_vs_baseline(df):
    """Fig 3: max and mean |flash - baseline| per format (fewest significand bits first), log y."""
    fig, ax = _figure(6.4, 3.8)
    ax = ax[0, 0]
    x = np.arange(len(df))
    for col, label, marker in (("flash_vs_baseline.max_abs", "max |flash − baseline|", "o"),
                               ("flash_vs_baseline.rmse", "RMS(flash − baseline)", "s")):
        ax.errorbar(x, _positive(df[f"{col}.mean"]), yerr=_err(df, col), marker=marker, capsize=3, label=label,
                    color=COLORS["diff"] if marker == "o" else COLORS["other"])
    ax.set_yscale("log")
    ax.set_xticks(x, _format_labels(df))
    ax.set_ylabel("difference")
    ax.set_xlabel("format (p = significand bits)")
    r = df.iloc[0]
    ax.set_title(f"Flash (paper(F)) vs baseline (naive(F)), N={int(r['N'])}, D={int(r['D'])}, "
                 f"tiles {int(r['block_q'])}×{int(r['block_kv'])}")
    ax.legend()
    return fig


def fig_precision_vs_golden(df):
    """Fig 4: flash and baseline vs golden per format (grouped bars, log y), ratio annotated."""
    fig, ax = _figure(7.2, 4.0)
    ax = ax[0, 0]
    x = np.arange(len(df))
    w = 0.38
    flash = _positive(df["flash_vs_golden.rmse.mean"])
    base = _positive(df["baseline_vs_golden.rmse.mean"])
    ax.bar(x - w / 2, flash, w, yerr=_err(df, "flash_vs_golden.rmse"), capsize=2, color=COLORS["flash"],
           label="flash, paper(F)")
    ax.bar(x + w / 2, base, w, yerr=_err(df, "baseline_vs_golden.rmse"), capsize=2, color=COLORS["baseline"],
           label="baseline, naive(F)")
    ax.set_yscale("log")
    top = np.nanmax(np.concatenate([flash, base]))
    ax.set_ylim(top=top * 30)
    for xi, f, b, ratio in zip(x, flash, base, df["ratio.rmse.mean"]):
        if np.isfinite(ratio):
            ax.text(xi, np.nanmax([f, b]) * 2.2, f"{ratio:.3g}×", ha="center", fontsize=8.5)
        elif np.isnan(b) and np.isfinite(f):
            ax.text(xi + w / 2, f, "exact", ha="center", va="bottom", fontsize=7.5, rotation=90,
                    color=COLORS["baseline"])
    ax.set_xticks(x, _format_labels(df))
    ax.set_ylabel("RMSE vs fp64 golden")
    ax.set_xlabel("format (p = significand bits)")
    r = df.iloc[0]
    ax.set_title(f"Deviation from fp64 golden, N={int(r['N'])} (labels: flash RMSE ÷ baseline RMSE)")
    ax.legend(loc="upper right")
    return fig


def plot_precision(df, out_dir):
    return (save(fig_precision_flash_vs_baseline(df), os.path.join(out_dir, "fig3_precision_flash_vs_baseline")) +
            save(fig_precision_vs_golden(df), os.path.join(out_dir, "fig4_precision_vs_golden")))


# ------------------------------------------------------------------ 2. sequence length (Fig 5)

def fig_seqlen(df):
    """Fig 5: max |flash - baseline|, relative L2, and mean ± std of flash - baseline vs N (log2 x)."""
    fmts = list(dict.fromkeys(df["format"]))
    fig, axes = _figure(10, 6.6, 2, 2)
    (a_max, a_rel), (a_m1, a_m2) = axes
    for fmt in fmts:
        g = df[df["format"] == fmt].sort_values("N")
        c = COLORS.get(fmt, COLORS["other"])
        a_max.errorbar(g["N"], _positive(g["flash_vs_baseline.max_abs.mean"]),
                       yerr=_err(g, "flash_vs_baseline.max_abs"), marker="o", capsize=3, color=c, label=fmt)
        a_rel.errorbar(g["N"], _positive(g["flash_vs_baseline.rel_l2.mean"]),
                       yerr=_err(g, "flash_vs_baseline.rel_l2"), marker="o", capsize=3, color=c, label=fmt)
    for ax, title, ylabel in ((a_max, "Max difference", "max |flash − baseline|"),
                              (a_rel, "Relative L2 difference", "‖flash − baseline‖ / ‖baseline‖")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(title)
        ax.set_ylabel(ylabel)
        ax.legend()
    for ax, fmt in zip((a_m1, a_m2), fmts[:2] + [None] * (2 - len(fmts[:2]))):
        if fmt is None:
            ax.set_visible(False)
            continue
        g = df[df["format"] == fmt].sort_values("N")
        c = COLORS.get(fmt, COLORS["other"])
        mean = g["flash_vs_baseline.mean_diff.mean"].to_numpy(dtype=float)
        std = g["flash_vs_baseline.std_diff.mean"].to_numpy(dtype=float)
        ax.fill_between(g["N"], mean - std, mean + std, color=c, alpha=0.2, label="± std of the difference")
        ax.plot(g["N"], mean, marker="o", color=c, label="mean of flash − baseline")
        ax.axhline(0, color="black", lw=0.6)
        ax.set_xscale("log", base=2)
        ax.set_title(f"Mean and std of the difference, {fmt}")
        ax.set_ylabel("flash − baseline")
        ax.legend(loc="upper left")
    for ax in axes[1]:
        ax.set_xlabel("sequence length N (keys)")
    r = df.iloc[0]
    fig.suptitle(f"Flash (paper(F)) vs baseline (naive(F)) over sequence length, tiles {int(r['block_q'])}×"
                 f"{int(r['block_kv'])}, D={int(r['D'])}")
    return fig


def plot_seqlen(df, out_dir):
    return save(fig_seqlen(df), os.path.join(out_dir, "fig5_seqlen"))


# ------------------------------------------------------------------ 3. algorithm (Fig 6)

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
    fig, axes = _figure(13, 3.5 * nrows, nrows, ncols, sharey=True)
    vals = _positive(df["flash_vs_golden.rmse.mean"])
    lo, hi = np.nanmin(vals) / 3, np.nanmax(vals) * 6
    for ax, group in zip(axes.ravel(), groups):
        g = df[df["group"] == group]
        x = np.arange(len(g))
        colors = [COLORS["baseline"] if str(p).startswith("fa2") else COLORS["flash"] for p in g["policy"]]
        bars = ax.bar(x, _positive(g["flash_vs_golden.rmse.mean"]), yerr=_err(g, "flash_vs_golden.rmse"),
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
    fig.legend(handles=[Patch(color=COLORS["flash"], label="paper(bf16)"), Patch(color=COLORS["baseline"],
                                                                                 label="fa2(bf16)"),
                        Patch(facecolor="#cccccc", hatch="//", edgecolor="white",
                              label="≡ bit-identical to a bar on its left")],
               loc="outside lower center", ncols=3, fontsize=9)
    r = df.iloc[0]
    fig.suptitle(f"Flash attention knobs, bf16, N={int(r['N'])}, D={int(r['D'])}: only block_kv, normalisation, "
                 f"exp form and the state format can matter")
    return fig


def plot_algorithm(df, out_dir):
    return save(fig_algorithm(df), os.path.join(out_dir, "fig6_algorithm"))


# ------------------------------------------------------------------ 4. attribution

def fig_attribution(df):
    """Bars per stage: RMSE relative to the start policy (log x; < 1: raising the stage helps, > 1:
    lowering it hurts), share of the MSE annotated; rows = direction, columns = format."""
    fmts = list(dict.fromkeys(df["format"]))
    dirs = [d for d in ("raise", "lower") if d in set(df["direction"])]
    fig, axes = _figure(5.2 * len(fmts), 3.6 * len(dirs), len(dirs), len(fmts))
    for i, direction in enumerate(dirs):
        for j, fmt in enumerate(fmts):
            ax = axes[i, j]
            g = df[(df["format"] == fmt) & (df["direction"] == direction) & (df["stage"] != "none")]
            start = df[(df["format"] == fmt) & (df["direction"] == direction) & (df["stage"] == "none")]
            y = np.arange(len(g))
            ratio = g["ratio"].to_numpy(dtype=float)
            color = COLORS["diff"] if direction == "raise" else COLORS["flash"]
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


def plot_attribution(df, out_dir):
    return save(fig_attribution(df), os.path.join(out_dir, "attribution"))


# ------------------------------------------------------------------ 5. real-kernel presets

_IMPL_STYLE = {"emulated fa2": ("#d62728", "o", "-"), "emulated fa1": ("#ff7f0e", "v", "-"),
               "emulated naive": ("#1f77b4", "s", "-"), "emulated torch_math": ("#2ca02c", "^", "-"),
               "torch flash": ("#d62728", "o", "--"), "torch efficient": ("#9467bd", "D", "--"),
               "torch cudnn": ("#8c564b", "P", "--"), "torch math": ("#2ca02c", "^", "--"),
               "torch math, reduced": ("#1f77b4", "s", "--")}


def fig_kernels(df):
    """RMSE vs golden over N per implementation (log-log); emulations solid, PyTorch kernels dashed."""
    fmts = list(dict.fromkeys(df["format"]))
    fig, axes = _figure(4.6 * len(fmts) + 1.8, 3.9, 1, len(fmts), sharey=True)
    for ax, fmt in zip(axes[0], fmts):
        g = df[df["format"] == fmt]
        for impl in dict.fromkeys(g["impl"]):
            h = g[g["impl"] == impl].sort_values("N")
            color, marker, ls = _IMPL_STYLE.get(impl, (COLORS["other"], "x", ":"))
            ax.errorbar(h["N"], _positive(h["vs_golden.rmse.mean"]), yerr=_err(h, "vs_golden.rmse"), color=color,
                        marker=marker, ls=ls, capsize=2, label=impl, markerfacecolor="none" if ls == "--" else color)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("sequence length N (keys)")
        ax.set_title(f"{fmt}: real-kernel presets vs golden")
    axes[0, 0].set_ylabel("RMSE vs fp64 golden")
    handles, labels = axes[0, 0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside right center", fontsize=8)
    return fig


def plot_kernels(df, out_dir):
    return save(fig_kernels(df), os.path.join(out_dir, "kernels"))


# ------------------------------------------------------------------ 6. FA3 Table 3

def fig_fp8(df):
    """Horizontal bars: RMSE vs golden per variant (log x), FA3 Table 3's values as black diamonds."""
    fig, ax = _figure(7.6, 0.42 * len(df) + 1.4)
    ax = ax[0, 0]
    y = np.arange(len(df))
    colors = [COLORS["baseline"] if k == "baseline" else COLORS["flash"] for k in df["kernel"]]
    rmse = _positive(df["vs_golden.rmse.mean"])
    ax.barh(y, rmse, xerr=_err(df, "vs_golden.rmse"), color=colors, height=0.6, capsize=2,
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
    fig.legend(handles=[Patch(color=COLORS["baseline"], label="baseline (fadev)"),
                        Patch(color=COLORS["flash"], label="flash (fadev)"),
                        Line2D([], [], marker="D", color="black", ls="none", label="FA3 Table 3 reports")],
               loc="outside lower center", ncols=3, fontsize=8.5)
    return fig


def plot_fp8(df, out_dir):
    return save(fig_fp8(df), os.path.join(out_dir, "fa3_table3"))


__all__ = ["save", "fig_precision_flash_vs_baseline", "fig_precision_vs_golden", "fig_seqlen", "fig_algorithm",
           "fig_attribution", "fig_kernels", "fig_fp8", "plot_precision", "plot_seqlen", "plot_algorithm",
           "plot_attribution", "plot_kernels", "plot_fp8"]
