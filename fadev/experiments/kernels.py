"""Experiment 5: the presets that model real kernels, against golden, over the sequence length.

Emulated (always): flash attention under ``fa2(F)`` (FlashAttention-2: fp32 scores, softmax and
statistics, P in F, 128 x 64 tiles, exp2), ``fa1(F)`` (kv_outer, eager, state in F) and baseline attention
under ``naive(F)`` (matmul, fused softmax, matmul in F) and ``torch_math(F)`` (PyTorch SDPA's math backend:
everything in fp32, output in F), for F = fp16 and bf16.

Real (only with ``device='cuda'`` where PyTorch sees a GPU): PyTorch's own SDPA backends on the same
inputs -- flash, memory-efficient, cuDNN and math -- and fadev's native tensor-core kernel (fa2's tiles).
The math backend upcasts fp16/bf16 to fp32 inside (what torch_math models) unless
``torch.backends.cuda.allow_fp16_bf16_reduction_math_sdp(True)``; it is measured both ways ("math" and
"math, reduced"). The emulations are meant to reproduce these kernels' error statistics (docs/design.md):
fa2 ~ flash, torch_math ~ math, naive ~ math reduced.
"""
from __future__ import annotations

import os

import pandas as pd

from .. import plots, report
from ..native import native_attention, native_tiles
from . import common
from .common import Finding

NAME = "kernels"
TITLE = "Real-kernel presets vs golden"
FIGURES = ("kernels",)

INTRO = (
    "The presets that model real kernels against golden: `fa2(F)` (FlashAttention-2: fp32 "
    "scores/softmax/statistics, P in F, 128 x 64 tiles, exp2), `fa1(F)` (kv_outer, eager, O and l stored in "
    "F between K/V blocks), `naive(F)` and `torch_math(F)` (SDPA's math backend: fp32 inside). On a GPU with "
    "PyTorch, `--device cuda` adds PyTorch's real SDPA backends on the same inputs (flash, memory-efficient, "
    "cuDNN, math, and math with `allow_fp16_bf16_reduction_math_sdp(True)`: without it the math backend "
    "upcasts fp16/bf16 to fp32).")
"""The report's prose before the figures."""

COLUMNS = [
    ("impl", "implementation", "s"), ("format", "format", "s"), ("N", "N", "d"),
    ("vs_golden.rmse", "RMSE vs golden", "pm"), ("vs_golden.max_abs", "max |d|", "e"),
    ("vs_golden.rel_l2", "rel L2", "e"),
]
"""The report table's columns: (column or column stem with .mean/.std, header, style); see fadev.report.table."""


REPRODUCE = True
"""Part of ``python -m fadev reproduce``'s default set."""

SIZES = {
    "quick": {"formats": ("fp16", "bf16"), "Ns": (256, 1024, 4096, 16384), "n_query": 64, "D": 64, "seeds": 3},
    "full": {"formats": ("fp16", "bf16"), "Ns": (256, 1024, 4096, 16384, 65536), "n_query": 1024, "D": 64,
             "seeds": 5},
}
SIZE_DOCS = common.SIZE_DOCS

EMULATED = (("fa2", "flash"), ("fa1", "flash"), ("naive", "baseline"), ("torch_math", "baseline"))
TORCH_BACKENDS = ("flash", "efficient", "cudnn", "math", "math, reduced", "fadev native")
MODELS = {"torch flash": "fa2", "torch efficient": "fa2", "torch cudnn": "fa2", "torch math": "torch_math",
          "torch math, reduced": "naive", "fadev native": "fa2"}
"""Which emulation models which PyTorch backend."""


def run(size="quick", out=None, *, device="cpu", workers=1, progress=False, cluster=None,
        **overrides) -> pd.DataFrame:
    """One row per (impl, format, N): mean/std over seeds of vs_golden.{rmse, max_abs, rel_l2}; ``impl`` is
    'emulated fa2', ..., or 'torch flash', ... (PyTorch rows only when device='cuda' and torch sees a GPU).
    Results in out/kernels.jsonl and out/kernels_torch.jsonl."""
    s = common.sizes(SIZES, size, overrides)
    points = [{"kernel": kernel, "policy": f"{preset}:{fmt}", "N": min(s["n_query"], N), "N_kv": N, "D": s["D"],
               "seed": seed, "device": device}
              for preset, kernel in EMULATED for fmt in s["formats"] for N in s["Ns"] for seed in range(s["seeds"])]
    rows = common.run_points(points, out, NAME, workers, progress, cluster)
    rows["impl"] = "emulated " + rows["policy"].str.split(":").str[0]
    rows["format"] = rows["policy"].str.split(":").str[1]
    rows["N_kv"] = rows["N_kv"].fillna(rows["N"]).astype(int)
    frames = [rows]
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
    return df.rename(columns={"N": "n_query", "N_kv": "N"})


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
        out = native_attention(tq, tk, tv, block_q=tiles[0], block_kv=tiles[1])
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


def findings(df, *, device="cpu") -> list:
    out = []
    big = df[df["N"] == df["N"].max()]
    for fmt, g in big.groupby("format", sort=False):
        parts = ", ".join(f"{i} {r:.2e}" for i, r in zip(g["impl"], g["vs_golden.rmse.mean"]))
        out.append(Finding(f"{fmt}, RMSE vs golden at N={int(g['N'].iloc[0])}", parts))
    torch_rows = df[df["impl"].str.startswith("torch")]
    if not len(torch_rows):
        out.append(Finding("PyTorch's real SDPA kernels",
                           "not measured: this run had no CUDA GPU visible to PyTorch (or --device cpu); the "
                           "table holds fadev's emulations only. Run `python -m fadev kernels --device cuda` on a "
                           "GPU machine to put them side by side."))
        return out
    for (fmt, N), g in df.groupby(["format", "N"], sort=False):
        if N != df["N"].max():
            continue
        rm = dict(zip(g["impl"], g["vs_golden.rmse.mean"]))
        for real, model in MODELS.items():
            if real in rm and f"emulated {model}" in rm and rm[real] == rm[real]:
                ratio = rm[f"emulated {model}"] / rm[real]
                out.append(Finding(f"{fmt} N={N}: emulated {model} vs {real}",
                                   f"RMSE {rm[f'emulated {model}']:.2e} vs {rm[real]:.2e} ({ratio:.3g}x)",
                                   "the emulation reproduces the kernel's error statistics", bool(0.5 <= ratio <= 2)))
    return out


def table(df) -> str:
    return report.table(df, COLUMNS)


_IMPL_STYLE = {"emulated fa2": ("#d62728", "o", "-"), "emulated fa1": ("#ff7f0e", "v", "-"),
               "emulated naive": ("#1f77b4", "s", "-"), "emulated torch_math": ("#2ca02c", "^", "-"),
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
    """Draw and save the figures (PNG and SVG); returns their paths."""
    return plots.save(fig_kernels(df), os.path.join(out_dir, "kernels"))
