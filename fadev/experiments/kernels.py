"""Experiment 5: the presets that model real kernels, against golden, over the sequence length.

Emulated (always): flash attention under ``fa2(F)`` (FlashAttention-2: fp32 scores, softmax and
statistics, P in F, 128 x 64 tiles, exp2), ``fa1(F)`` (kv_outer, eager, state in F) and baseline attention
under ``naive(F)`` (matmul, fused softmax, matmul in F) and ``torch_math(F)`` (PyTorch SDPA's math backend:
everything in fp32, output in F), for F = fp16 and bf16.

Real (only with ``device='cuda'`` where PyTorch sees a GPU): PyTorch's own SDPA backends on the same
inputs -- flash, memory-efficient, cuDNN and math -- and fadev's native tensor-core kernel (fa2's tiles).
The math backend upcasts fp16/bf16 to fp32 inside (what torch_math models) unless
``torch.backends.cuda.allow_fp16_bf16_reduction_math_sdp(True)``; it is measured both ways ("math" and
"math, reduced"). The emulations are meant to reproduce these kernels' error statistics within ±15%
(docs/design.md): fa2 ~ flash, torch_math ~ math, and "naive, q/k pre-scaled" ~ math reduced: that backend
multiplies q and k by sqrt(scale) and rounds both to F before Q K^T (docs/numerics.md), which plain
``naive(F)`` (the paper's baseline, scores scaled after the product) does not; plain naive is ~0.87x its
error at every N.

Native tile sweep (only with ``device='cuda'`` where fadev has a usable CUDA device; kernel_tiles.py): for each
format, N up to 4096 (quick) or 16384 (full) and forward tile (block_q, block_kv) of ``fadev.native_tiles(D)``,
the native kernel's error vs golden beside its prediction, ``fa2(F)`` emulated with the same tiles on the same
inputs: per tile the ratio native/emulated (within ±15%), and how the error moves from the smallest tile to
the largest in both. In ``df.attrs["tiles"]``; on the CPU it is absent.
"""
from __future__ import annotations

import os

import numpy as np
import pandas as pd

from .. import plots, report
from ..attention import baseline_attention
from ..native import native_attention, native_tiles
from ..policy import Policy
from . import common, kernel_tiles, kernels_backward
from .common import Finding

NAME = "kernels"
TITLE = "Real-kernel presets vs golden"
FIGURES = ("kernels",)
EXTRA_FIGURES = (kernel_tiles.FIGURE,)
"""Figures drawn only when their rows were measured: the native tile sweep's (a GPU run)."""

INTRO = (
    "The presets that model real kernels against golden: `fa2(F)` (FlashAttention-2: fp32 "
    "scores/softmax/statistics, P in F, 128 x 64 tiles, exp2), `fa1(F)` (kv_outer, eager, O and l stored in "
    "F between K/V blocks), `naive(F)` and `torch_math(F)` (SDPA's math backend: fp32 inside). On a GPU with "
    "PyTorch, `--device cuda` adds PyTorch's real SDPA backends on the same inputs (flash, memory-efficient, "
    "cuDNN, math, and math with `allow_fp16_bf16_reduction_math_sdp(True)`: without it the math backend "
    "upcasts fp16/bf16 to fp32); where fadev has a CUDA device it also sweeps fadev's native kernel over its "
    "forward tiles (block_q x block_kv) beside `fa2(F)` emulated with the same tiles.")
"""The report's prose before the figures."""

COLUMNS = [
    ("impl", "implementation", "s"), ("format", "format", "s"), ("N", "N", "d"),
    ("vs_golden.rmse", "RMSE vs golden", "pm"), ("vs_golden.max_abs", "max |d|", "e"),
    ("vs_golden.rel_l2", "rel L2", "e"),
]
"""The report table's columns: (column or column stem with .mean/.std, header, style); see fadev.report.table."""


REPRODUCE = True
"""Part of ``python -m fadev reproduce``'s default set."""
NEEDS_TORCH = ("kernels' backward checks (the emulated backward presets against PyTorch's autograd, on the CPU) and, "
               "with --device cuda on a GPU, PyTorch's real SDPA kernels")
"""What a run without PyTorch skips (the CLI says so, with the command that adds it)."""

SIZES = {
    "quick": {"formats": ("fp16", "bf16"), "Ns": (256, 1024, 4096, 16384), "n_query": 64, "D": 64, "seeds": 3},
    "full": {"formats": ("fp16", "bf16"), "Ns": (256, 1024, 4096, 16384, 65536), "n_query": 1024, "D": 64,
             "seeds": 5},
}
SIZE_DOCS = common.SIZE_DOCS

EMULATED = (("fa2", "flash"), ("fa1", "flash"), ("naive", "baseline"), ("torch_math", "baseline"))
TORCH_BACKENDS = ("flash", "efficient", "cudnn", "math", "math, reduced", "fadev native")
PRESCALED = "naive, q/k pre-scaled"
"""The emulation of the math backend with reduced precision: naive(F) on R_F(q sqrt(scale)), R_F(k sqrt(scale))."""
MODELS = {"torch flash": "fa2", "torch efficient": "fa2", "torch cudnn": "fa2", "torch math": "torch_math",
          "torch math, reduced": PRESCALED, "fadev native": "fa2"}
"""Which emulation models which PyTorch backend."""


def run(size="quick", out=None, *, device="cpu", workers=1, progress=False, cluster=None,
        **overrides) -> pd.DataFrame:
    """One row per (impl, format, N): mean/std over seeds of vs_golden.{rmse, max_abs, rel_l2}; ``impl`` is
    'emulated fa2', ..., or 'torch flash', ... (PyTorch rows only when device='cuda' and torch sees a GPU).
    Results in out/kernels.jsonl, out/kernels_prescaled.jsonl and out/kernels_torch.jsonl. ``df.attrs``:
    "backward" (kernels_backward.py) and, with device='cuda' where fadev has a CUDA device, "tiles": the native
    tile sweep (kernel_tiles.py; out/kernels_tiles.jsonl and .csv)."""
    s = common.sizes(SIZES, size, overrides)
    points = [{"kernel": kernel, "policy": f"{preset}:{fmt}", "N": min(s["n_query"], N), "N_kv": N, "D": s["D"],
               "seed": seed, "device": device}
              for preset, kernel in EMULATED for fmt in s["formats"] for N in s["Ns"] for seed in range(s["seeds"])]
    rows = common.run_points(points, out, NAME, workers, progress, cluster)
    rows["impl"] = "emulated " + rows["policy"].str.split(":").str[0]
    rows["format"] = rows["policy"].str.split(":").str[1]
    rows["N_kv"] = rows["N_kv"].fillna(rows["N"]).astype(int)
    ppoints = [{"emulation": PRESCALED, "format": fmt, "N": N, "n_query": min(s["n_query"], N), "D": s["D"],
                "seed": seed} for fmt in s["formats"] for N in s["Ns"] for seed in range(s["seeds"])]
    prows = common.run_custom(ppoints, _prescaled_evaluate, out, NAME + "_prescaled", progress)
    prows["impl"] = "emulated " + PRESCALED
    frames = [rows, prows.rename(columns={"N": "N_kv", "n_query": "N"})]
    if device == "cuda" and common.torch_cuda():
        tpoints = [{"backend": b, "format": fmt, "N": N, "n_query": min(s["n_query"], N), "D": s["D"], "seed": seed}
                   for b in TORCH_BACKENDS for fmt in s["formats"] for N in s["Ns"] for seed in range(s["seeds"])]
        trows = common.run_custom(tpoints, _torch_evaluate, out, NAME + "_torch", progress, cluster, workers)
        trows["impl"] = [b if b.startswith("fadev") else "torch " + b for b in trows["backend"]]
        trows = trows.rename(columns={"N": "N_kv", "n_query": "N"})
        frames.append(trows)
    allrows = pd.concat(frames, ignore_index=True)
    metrics = ["vs_golden.rmse", "vs_golden.max_abs", "vs_golden.rel_l2"]
    df = common.mean_std(allrows, ["impl", "format", "N_kv", "N", "D"], metrics)
    if "error" in allrows.columns:
        errors = allrows.dropna(subset=["error"]).groupby(["impl", "format", "N_kv"])["error"].first()
        df["error"] = [errors.get((i, f, n), "") for i, f, n in zip(df["impl"], df["format"], df["N_kv"])]
    df = df.rename(columns={"N": "n_query", "N_kv": "N"})
    df.attrs["backward"] = _backward(size, out, device, progress, overrides)
    if device == "cuda" and kernel_tiles.available(s["D"]):
        df.attrs["tiles"] = kernel_tiles.run(kernel_tiles.settings(s, size), out, progress=progress)
    return df


def _backward(size, out, device, progress, overrides):
    """The backward study (kernels_backward.py) at its own sizes; with Ns, formats or seeds given for the
    forward, at those (Ns up to the largest of its size)."""
    own = kernels_backward.SIZES[size]
    given = {k: overrides[k] for k in ("formats", "seeds") if overrides.get(k) is not None}
    if overrides.get("Ns") is not None:
        given["Ns"] = tuple(n for n in overrides["Ns"] if n <= max(own["Ns"])) or (min(own["Ns"]),)
    return kernels_backward.run(size, out, device=device, progress=progress, **given)


def naive_prescaled(q, k, v, fmt):
    """PyTorch's math SDPA with ``allow_fp16_bf16_reduction_math_sdp(True)`` in fadev's arithmetic: q and k
    scaled by sqrt(1/sqrt(D)) as that backend does (:func:`kernels_backward.times_sqrt_scale`), then naive(fmt)
    at scale 1: S = R_F(Q' K'^T) with fp32 accumulation, softmax in fp32 written in F, R_F(P V)."""
    D = q.shape[-1]
    qs, ks = kernels_backward.times_sqrt_scale(q, fmt, D), kernels_backward.times_sqrt_scale(k, fmt, D)
    return baseline_attention(qs, ks, v, Policy.naive(fmt), scale=1.0)


def _prescaled_evaluate(point):
    q, k, v = common.inputs(point["N"], point["n_query"], point["D"], point["seed"], point["format"])
    ref = common.golden(point["N"], point["n_query"], point["D"], point["seed"], point["format"])
    return common.metrics("vs_golden", naive_prescaled(q, k, v, point["format"]), ref)


def _torch_evaluate(point):
    """One PyTorch SDPA call on the GPU, compared with fadev's golden on the same (CPU, fp64) inputs."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}[point["format"]]
    q, k, v = common.inputs(point["N"], point["n_query"], point["D"], point["seed"], point["format"])
    ref = common.golden(point["N"], point["n_query"], point["D"], point["seed"], point["format"])
    tq, tk, tv = (torch.from_numpy(t.copy()).to("cuda", dtype) for t in (q, k, v))  # exact: inputs are in F
    if point["backend"] == "fadev native":  # fadev's own FlashAttention-2-style tensor-core kernel, fa2's tiles
        tiles = (128, 64) if (128, 64) in native_tiles(point["D"]) else native_tiles(point["D"])[0]
        out = native_attention(tq, tk, tv, block_q=tiles[0], block_kv=tiles[1], mma="sync")  # as recorded
        return {**common.metrics("vs_golden", out.to(torch.float64).cpu().numpy(), ref), "error": None,
                "torch_version": torch.__version__, "gpu": torch.cuda.get_device_name()}
    backend = {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
               "cudnn": SDPBackend.CUDNN_ATTENTION, "math": SDPBackend.MATH,
               "math, reduced": SDPBackend.MATH}[point["backend"]]
    reduced = point["backend"] == "math, reduced"
    flag = torch.backends.cuda.fp16_bf16_reduction_math_sdp_allowed()
    try:
        torch.backends.cuda.allow_fp16_bf16_reduction_math_sdp(reduced)
        with sdpa_kernel([backend]):
            out = F.scaled_dot_product_attention(tq, tk, tv)
        torch.cuda.synchronize()
    except RuntimeError as e:  # a backend that does not support this shape/dtype/GPU
        return {"error": str(e).splitlines()[0][:200], **{f"vs_golden.{m}": float("nan") for m in common.METRICS}}
    finally:
        torch.backends.cuda.allow_fp16_bf16_reduction_math_sdp(flag)
    test = out.to(torch.float64).cpu().numpy()
    return {**common.metrics("vs_golden", test, ref), "error": None, "torch_version": torch.__version__,
            "gpu": torch.cuda.get_device_name()}


TOLERANCE, within = kernel_tiles.TOLERANCE, kernel_tiles.within
"""The emulations' claim (docs/design.md) and its verdict on one ratio (defined in kernel_tiles.py, which this
module imports)."""


def ran_on(device) -> str:
    """Where the emulations ran, and whether PyTorch's kernels were measured."""
    where = common.ran_on(device)
    if where != "the CPU":
        where += f" (\"{PRESCALED}\": the CPU)"
    if device != "cuda":
        return f"{where}, PyTorch's kernels not run (`--device cpu`)"
    tiles = "; the native tile sweep on the GPU" if kernel_tiles.available(SIZES["quick"]["D"]) else \
        "; no native tile sweep (fadev has no usable CUDA device)"
    if not common.torch_cuda():
        return f"{where}, PyTorch's kernels not run ({_why_no_torch_kernels(device)}){tiles}"
    return f"{where}, PyTorch's kernels on the GPU{tiles}"


def model_checks(df) -> list:
    """One verdict per (format, real kernel, its emulation) over every N measured for both: the
    emulated/real RMSE ratio within ±15% at each N (:func:`within`): holds at every N, partly holds (and
    where) at some, does not hold at none; the text says where it is not."""
    out = []
    for fmt, g in df.groupby("format", sort=False):
        rm = {(i, n): r for i, n, r in zip(g["impl"], g["N"], g["vs_golden.rmse.mean"])}
        for real, model in MODELS.items():
            Ns = sorted(n for (i, n), r in rm.items() if i == real and r == r and (f"emulated {model}", n) in rm)
            if not Ns:
                continue
            ratio = [rm[(f"emulated {model}", n)] / rm[(real, n)] for n in Ns]
            ok = [within(r) for r in ratio]
            out.append(Finding(
                f"{fmt}: emulated {model} vs {real}",
                f"RMSE ratio emulated/real {min(ratio):.3g}x..{max(ratio):.3g}x over N = {Ns[0]}..{Ns[-1]} "
                f"({rm[(f'emulated {model}', Ns[-1])]:.2e} vs {rm[(real, Ns[-1])]:.2e} at N = {Ns[-1]}); "
                f"{common.where_holds(Ns, ok, ratio)}",
                f"within ±{TOLERANCE:.0%} (the emulation reproduces the kernel's error statistics)", all(ok),
                "fadev", partly=common.holds_range(Ns, ok) if any(ok) and not all(ok) else ""))
    return out


def findings(df, *, device="cpu") -> list:
    out = []
    big = df[df["N"] == df["N"].max()]
    for fmt, g in big.groupby("format", sort=False):
        parts = ", ".join(f"{i} {r:.2e}" for i, r in zip(g["impl"], g["vs_golden.rmse.mean"]))
        out.append(Finding(f"{fmt}, RMSE vs golden at N={int(g['N'].iloc[0])}", parts))
    torch_rows = df[df["impl"].str.startswith("torch")]
    if not len(torch_rows):
        out.append(Finding("PyTorch's real SDPA kernels",
                           f"not measured: {_why_no_torch_kernels(device)}; the table holds fadev's emulations "
                           "only. They need a CUDA GPU: `python -m fadev kernels --device cuda` on a GPU machine puts "
                           "them side by side."))
        return out + _backward_findings(df) + _tile_findings(df)
    return out + model_checks(df) + _backward_findings(df) + _tile_findings(df)


def _why_no_torch_kernels(device):
    """Why PyTorch's SDPA kernels were not measured, as report text."""
    if not common.torch_available():
        return "PyTorch is not installed"
    if device != "cuda":
        return "the run used --device cpu (the default)"
    return "PyTorch sees no CUDA GPU here"


def _backward_findings(df):
    return kernels_backward.findings(df.attrs["backward"]) if "backward" in df.attrs else []


def _tile_findings(df):
    """The native tile sweep's verdicts; nothing where it did not run (the CPU)."""
    return kernel_tiles.findings(df.attrs["tiles"]) if "tiles" in df.attrs else []


def table(df) -> str:
    text = report.table(df, COLUMNS)
    if "backward" in df.attrs and len(kernels_backward.ratios(df.attrs["backward"])):
        text += "\n\nBackward, mean |err| ratio emulated / real kernel:\n\n"
        text += kernels_backward.table(df.attrs["backward"])
    if "tiles" in df.attrs:
        text += "\n\nNative tile sweep, RMSE vs golden per forward tile, fadev native beside emulated fa2:\n\n"
        text += kernel_tiles.table(df.attrs["tiles"])
    return text


_IMPL_STYLE = {"emulated fa2": ("#d62728", "o", "-"), "emulated fa1": ("#ff7f0e", "v", "-"),
               "emulated naive": ("#17becf", "s", ":"), "emulated " + PRESCALED: ("#1f77b4", "s", "-"),
               "emulated torch_math": ("#2ca02c", "^", "-"),
               "torch flash": ("#d62728", "o", "--"), "torch efficient": ("#9467bd", "D", "--"),
               "torch cudnn": ("#8c564b", "P", "--"), "torch math": ("#2ca02c", "^", "--"),
               "torch math, reduced": ("#1f77b4", "s", "--")}


def fig_kernels(df):
    """RMSE vs golden over N per implementation (log-log); emulations solid, PyTorch kernels dashed."""
    fmts = list(dict.fromkeys(df["format"]))
    fig, axes = plots.figure(4.6 * len(fmts) + 1.8, 3.9, 1, len(fmts), sharey=True)
    for ax, fmt in zip(axes[0], fmts):
        g = df[df["format"] == fmt]
        for impl in dict.fromkeys(g["impl"]):
            h = g[g["impl"] == impl].sort_values("N")
            color, marker, ls = _IMPL_STYLE.get(impl, (plots.COLORS["other"], "x", ":"))
            ax.errorbar(h["N"], plots.positive(h["vs_golden.rmse.mean"]), yerr=plots.errors(h, "vs_golden.rmse"),
                        color=color, marker=marker, ls=ls, capsize=2, label=impl,
                        markerfacecolor="none" if ls == "--" else color)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("sequence length N (keys)")
        ax.set_title(f"{fmt}: real-kernel presets vs golden")
    axes[0, 0].set_ylabel("RMSE vs fp64 golden")
    handles, labels = axes[0, 0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside right center", fontsize=8)
    return fig


def figures(df, out_dir):
    """Draw and save the figures (PNG and SVG); returns their paths. The tile sweep's only where it ran."""
    paths = plots.save(fig_kernels(df), os.path.join(out_dir, "kernels"))
    if "tiles" in df.attrs:
        paths += kernel_tiles.figures(df.attrs["tiles"], out_dir)
    return paths
