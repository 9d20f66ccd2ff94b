"""The kernels experiment's native tile sweep: fadev's tensor-core kernel beside the emulation's prediction, per tile.

For each format F (fp16, bf16), a few sequence lengths N (the kernels experiment's, up to :data:`MAX_N`),
each seed and each forward tile (block_q, block_kv) of ``fadev.native_tiles(D)`` (16 query rows per warp;
the 32-row tiles run the same arithmetic, so they give the same bits and are not repeated): fadev's native
kernel (:func:`fadev.native.native_attention`) and its prediction, ``fa2(F)`` emulated with the same
block_q and block_kv (:func:`fadev.flash_attention` on the CPU), both on the same inputs -- drawn by
:func:`common.inputs` already rounded to F, the values the native kernel reads -- and both against the
fp64 golden answer.

Why: docs/design.md's rule for the native kernel (its error vs golden matches the ``fa2(F)`` emulation
with the same tiles within ±15%) is what lets the emulation's statements about tiles stand for a
production-style kernel. tests/test_cuda_native_emulation.py asserts it at one N; the sweep puts it in the
report per tile and N, with how the error moves from the smallest tile to the largest in both.

GPU only: the kernels experiment runs it with ``device='cuda'`` where fadev has a usable CUDA device
(:func:`available`); elsewhere it is absent (no rows, no findings). Everything but the native call takes
plain arrays (:func:`measure`), and :func:`run` takes the kernel under test as a callable, so the sweep,
its findings, table and figure run on the CPU with a stand-in.
"""
from __future__ import annotations

import functools
import os

import numpy as np
import pandas as pd

from .. import cuda_available, cuda_info, plots, report
from ..attention import flash_attention
from ..native import native_attention, native_tiles
from ..policy import Policy
from . import common
from .common import Finding

TOLERANCE = 0.15
"""The emulations' claim (docs/design.md): each reproduces its kernel's RMSE vs golden within ±15%."""


def within(ratio) -> bool:
    """The verdict on one emulated/real (or real/emulated) RMSE ratio: within ±:data:`TOLERANCE` of 1."""
    return bool(1 - TOLERANCE <= ratio <= 1 + TOLERANCE)


NAME = "kernels_tiles"
"""Stem of the sweep's files: out/kernels_tiles.jsonl (raw rows), out/kernels_tiles.csv (this table)."""
FIGURE = "kernels_tiles"
NATIVE = "fadev native"
EMULATED = "emulated fa2"
IMPLS = (NATIVE, EMULATED)
MAX_N = {"quick": 4096, "full": 16384}
"""The largest N swept per size (the kernels experiment's Ns up to it): a native call is milliseconds, its
emulation and golden on the CPU are what cost."""
FLAT = 0.05
"""A largest/smallest tile error ratio within ±5% of 1 counts as flat: no direction."""
METRICS = ("vs_golden.rmse", "vs_golden.max_abs", "vs_golden.rel_l2")


def available(dim) -> bool:
    """True when the sweep can run here: fadev has a usable CUDA device and native forward tiles at head dim
    ``dim``."""
    return cuda_available() and bool(native_tiles(dim))


def settings(sizes, size) -> dict:
    """The sweep's parameters from the kernels experiment's ``sizes`` (after overrides): its formats, n_query, D
    and seeds, its Ns up to ``MAX_N[size]`` (the smallest N where none is)."""
    Ns = tuple(n for n in sizes["Ns"] if n <= MAX_N[size]) or (min(sizes["Ns"]),)
    return {"formats": tuple(sizes["formats"]), "Ns": Ns, "n_query": sizes["n_query"], "D": sizes["D"],
            "seeds": sizes["seeds"]}


def predict(q, k, v, fmt, block_q, block_kv):
    """The emulation's prediction: flash attention under ``fa2(fmt)`` with the native tile's block_q and block_kv."""
    return flash_attention(q, k, v, Policy.fa2(fmt), block_q=block_q, block_kv=block_kv)


def native_output(q, k, v, fmt, block_q, block_kv):
    """fadev's native kernel on the GPU: NumPy inputs (exact in ``fmt``) in, float64 NumPy holding the fp16/bf16
    output back."""
    return native_attention(q, k, v, block_q=block_q, block_kv=block_kv, dtype=fmt, mma="sync")  # the mma.sync tiles


def measure(q, k, v, ref, fmt, block_q, block_kv, impl, native=native_output) -> dict:
    """vs_golden.{metric} columns of one implementation (``impl``: :data:`NATIVE` or :data:`EMULATED`) on plain
    arrays q, k, v (values in ``fmt``) against ``ref`` (the fp64 answer). ``native(q, k, v, fmt, block_q,
    block_kv) -> array``: the kernel under test."""
    if impl == NATIVE:
        out = native(q, k, v, fmt, block_q, block_kv)
    elif impl == EMULATED:
        out = predict(q, k, v, fmt, block_q, block_kv)
    else:
        raise ValueError(f"impl must be {NATIVE!r} or {EMULATED!r}, got {impl!r}")
    out = np.asarray(out, dtype=np.float64)
    if out.shape != np.shape(ref):
        raise ValueError(f"{impl} {block_q}x{block_kv}: output shape {out.shape}, golden {np.shape(ref)}")
    return common.metrics("vs_golden", out, ref)


def _evaluate(point, native=None):
    """One sweep point: the inputs and golden answer of (N, n_query, D, seed, format), one implementation."""
    args = (point["N"], point["n_query"], point["D"], point["seed"], point["format"])
    q, k, v = common.inputs(*args)
    row = measure(q, k, v, common.golden(*args), point["format"], point["block_q"], point["block_kv"],
                  point["impl"], native or native_output)
    if point["impl"] == NATIVE and native is None:
        row["gpu"] = (cuda_info()["devices"] or [{}])[0].get("name", "")
    return row


def run(params, out=None, *, progress=False, native=None, tiles=None) -> pd.DataFrame:
    """One row per (impl, format, N, block_q, block_kv): mean, std and count over seeds of vs_golden.{rmse,
    max_abs, rel_l2}. ``params``: formats, Ns, n_query, D, seeds (:func:`settings`); each run computes at least
    the largest tile's block_q query rows (a full query tile), at most N. ``native``: the kernel under test,
    ``native(q, k, v, fmt, block_q, block_kv) -> array``, a module-level function (default
    :func:`native_output`, the GPU's; another is named in the points, so its rows never mix with the GPU's).
    ``tiles``: (block_q, block_kv) pairs (default ``fadev.native_tiles(D)``). Raw rows in out/kernels_tiles.jsonl
    (resumable), this table in out/kernels_tiles.csv."""
    tiles = [tuple(int(x) for x in t) for t in (native_tiles(params["D"]) if tiles is None else tiles)]
    if not tiles or any(len(t) != 2 or min(t) < 1 for t in tiles):
        raise ValueError(f"tiles: expected (block_q, block_kv) pairs of positive integers, got {tiles!r} (head dim "
                         f"{params['D']})")
    rows_q = max(params["n_query"], max(bq for bq, _ in tiles))
    extra = {} if native is None else {"native": f"{native.__module__}.{native.__qualname__}"}
    points = [{"impl": impl, "format": fmt, "N": N, "n_query": min(rows_q, N), "D": params["D"], "seed": seed,
               "block_q": bq, "block_kv": bkv, **extra}
              for fmt in params["formats"] for N in params["Ns"] for seed in range(params["seeds"])
              for bq, bkv in tiles for impl in IMPLS]  # one input's points together: the golden cache holds it
    evaluate = _evaluate if native is None else functools.partial(_evaluate, native=native)
    rows = common.run_custom(points, evaluate, out, NAME, progress)
    df = common.mean_std(rows, ["impl", "format", "N", "n_query", "D", "block_q", "block_kv"], METRICS)
    if out is not None:
        df.to_csv(os.path.join(out, f"{NAME}.csv"), index=False)
    return df


# ------------------------------------------------------------------ findings, table, figure

def tile_order(tiles) -> list:
    """(block_q, block_kv) pairs from the smallest tile to the largest: by area, then block_kv (the block
    that sets the arithmetic: the online softmax rescales once per K/V block), then block_q."""
    return sorted({(int(a), int(b)) for a, b in tiles}, key=lambda t: (t[0] * t[1], t[1], t[0]))


def _label(bq, bkv):
    return f"{bq}x{bkv}"


def ratios(tf) -> pd.DataFrame:
    """One row per (format, N, tile) measured for both implementations, smallest tile first: the RMSE vs golden
    of each (``native.mean``/``.std``, ``emulated.mean``/``.std``: over seeds) and ``ratio`` native / emulated
    of the means."""
    cols = ["format", "N", "block_q", "block_kv", "tile", "native.mean", "native.std", "emulated.mean",
            "emulated.std", "ratio"]
    rows = []
    keyed = {(r["impl"], r["format"], int(r["N"]), int(r["block_q"]), int(r["block_kv"])): r
             for r in tf.to_dict("records")} if len(tf) else {}
    for fmt in dict.fromkeys(tf["format"]) if len(tf) else ():
        g = tf[tf["format"] == fmt]
        for N in sorted({int(n) for n in g["N"]}):
            for bq, bkv in tile_order(zip(g["block_q"], g["block_kv"])):
                nat, emu = keyed.get((NATIVE, fmt, N, bq, bkv)), keyed.get((EMULATED, fmt, N, bq, bkv))
                if nat is None or emu is None:
                    continue
                n, e = nat["vs_golden.rmse.mean"], emu["vs_golden.rmse.mean"]
                rows.append([fmt, N, bq, bkv, _label(bq, bkv), n, nat.get("vs_golden.rmse.std", np.nan), e,
                             emu.get("vs_golden.rmse.std", np.nan), n / e if e else np.nan])
    return pd.DataFrame(rows, columns=cols)


def direction(ratio) -> str:
    """'grows', 'shrinks' or 'flat' (within ±:data:`FLAT`): how the error moves from the smallest tile to the
    largest, from their error ratio."""
    if not np.isfinite(ratio):
        return "n/a"
    return "grows" if ratio > 1 + FLAT else "shrinks" if ratio < 1 - FLAT else "flat"


def trend(rt) -> list:
    """Per format, at its largest N: the smallest and largest tile measured, the ratio largest/smallest of the
    native and of the emulated RMSE, their directions, and whether they agree: the same direction, or ratios
    within ±:data:`FLAT` of each other (one just past the flat band, the other just inside it)."""
    out = []
    for fmt, g in rt.groupby("format", sort=False):
        big = g[g["N"] == g["N"].max()]
        if len(big) < 2:
            continue
        small, large = big.iloc[0], big.iloc[-1]  # ratios() orders the tiles smallest first
        rn, re_ = large["native.mean"] / small["native.mean"], large["emulated.mean"] / small["emulated.mean"]
        dn, de = direction(rn), direction(re_)
        agree = bool(dn != "n/a" and de != "n/a" and (dn == de or abs(rn / re_ - 1) <= FLAT))
        out.append({"format": fmt, "N": int(large["N"]), "smallest": small["tile"], "largest": large["tile"],
                    "native": rn, "emulated": re_, "native_direction": dn, "emulated_direction": de,
                    "agree": agree})
    return out


def findings(tf) -> list:
    """Two verdicts per format: every tile's RMSE ratio native/emulated within ±15% at every N (:func:`within`),
    and the emulation's direction of the error from the smallest tile to the largest is the native kernel's."""

    rt = ratios(tf)
    if not len(rt):
        return [Finding("native tiles", "no tile measured for both the native kernel and its emulation")]
    out = []
    for fmt, g in rt.groupby("format", sort=False):
        ok = [within(r) for r in g["ratio"]]
        bad = [f"{t} at N = {n}: {r:.3f}x" for t, n, r, o in zip(g["tile"], g["N"], g["ratio"], ok)
               if not o]
        Ns = sorted(set(g["N"]))
        text = (f"RMSE ratio native/emulated {g['ratio'].min():.3f}x..{g['ratio'].max():.3f}x over "
                f"{g['tile'].nunique()} tiles x N = {Ns[0]}..{Ns[-1]} ({len(g)} pairs); ")
        text += (f"outside ±{TOLERANCE:.0%}: {len(bad)} of {len(g)}: " + ", ".join(bad[:4]) +
                 (" ..." if len(bad) > 4 else "")) if bad else f"all within ±{TOLERANCE:.0%}"
        out.append(Finding(f"native tiles {fmt}: fadev native vs emulated fa2, per tile", text,
                           f"within ±{TOLERANCE:.0%} at every tile (the native kernel's error statistics are the "
                           f"emulation's with the same tiles)", all(ok), "fadev"))
    for t in trend(rt):
        text = (f"at N = {t['N']}, RMSE {t['largest']} / {t['smallest']}: native {t['native']:.3f}x "
                f"({t['native_direction']}), emulated {t['emulated']:.3f}x ({t['emulated_direction']}); "
                f"{'they agree' if t['agree'] else 'they disagree'} (flat: within ±{FLAT:.0%})")
        out.append(Finding(f"native tiles {t['format']}: error from the smallest tile to the largest", text,
                           "the emulation predicts the direction", t["agree"], "fadev"))
    return out


def table(tf) -> str:
    """Markdown: one line per (format, N, tile): both RMSEs vs golden (± std over seeds), their ratio, the ±15%
    verdict (:func:`within`)."""

    rt = ratios(tf)
    rt["shown"] = [f"{r:.3f}x" if np.isfinite(r) else "n/a" for r in rt["ratio"]]
    rt["within"] = ["yes" if within(r) else "**no**" for r in rt["ratio"]]
    return report.table(rt, [("format", "format", "s"), ("N", "N", "d"), ("tile", "tile (block_q x block_kv)", "s"),
                             ("native", f"{NATIVE} RMSE", "pm"), ("emulated", f"{EMULATED} RMSE", "pm"),
                             ("shown", "native / emulated", "s"), ("within", f"within ±{TOLERANCE:.0%}", "s")])


_N_COLORS = ("#1f77b4", "#2ca02c", "#ff7f0e", "#d62728", "#9467bd", "#8c564b")


def fig_tiles(tf):
    """Per format (columns): the RMSE vs golden per tile, smallest tile first, relative to the emulation's at the
    smallest tile (same N; the absolute values are in the table), native dashed with hollow markers beside the
    emulation solid, one colour per N (top); the ratio native / emulated per tile with the ±15% band (bottom)."""

    rt = ratios(tf)
    fmts = list(dict.fromkeys(rt["format"])) or ["(none)"]
    order = tile_order(zip(rt["block_q"], rt["block_kv"]))
    x = {t: i for i, t in enumerate(order)}
    fig, axes = plots.figure(max(4.6, 0.3 * len(order) + 1.5) * len(fmts) + 1.8, 6.4, 2, len(fmts), sharex=True,
                             sharey="row")
    for col, fmt in enumerate(fmts):
        top, bottom = axes[0, col], axes[1, col]
        g = rt[rt["format"] == fmt]
        for i, N in enumerate(sorted(set(g["N"]))):
            h = g[g["N"] == N]
            xs = [x[(bq, bkv)] for bq, bkv in zip(h["block_q"], h["block_kv"])]
            base, color = h["emulated.mean"].iloc[0], _N_COLORS[i % len(_N_COLORS)]
            top.plot(xs, h["emulated.mean"] / base, color=color, marker="o", ls="-", label=f"{EMULATED}, N={N}")
            top.plot(xs, h["native.mean"] / base, color=color, marker="s", ls="--", markerfacecolor="none",
                     label=f"{NATIVE}, N={N}")
            bottom.plot(xs, h["ratio"], color=color, marker="s", ls="-", label=f"N={N}")
        bottom.axhspan(1 - TOLERANCE, 1 + TOLERANCE, color=plots.COLORS["other"], alpha=0.12, lw=0)
        bottom.axhline(1, color=plots.COLORS["other"], lw=0.8)
        bottom.set_xticks(range(len(order)), [_label(*t) for t in order], rotation=60, fontsize=8)
        bottom.set_xlabel("tile block_q x block_kv (smallest first)")
        top.set_title(f"{fmt}: native kernel beside its emulation, per tile")
    axes[0, 0].set_ylabel("RMSE vs golden / emulated\nat the smallest tile")
    axes[1, 0].set_ylabel(f"RMSE native / emulated\n(band: ±{TOLERANCE:.0%})")
    handles, labels = axes[0, 0].get_legend_handles_labels()
    if handles:
        fig.legend(handles, labels, loc="outside right center", fontsize=8)
    return fig


def figures(tf, out_dir):
    """Draw and save the tile figure (PNG and SVG); returns its paths."""
    return plots.save(fig_tiles(tf), os.path.join(out_dir, FIGURE))
