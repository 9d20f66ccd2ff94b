"""The backward half of the kernels experiment: emulated backward presets vs real kernels' backward.

For each format F (fp16, bf16), sequence length N (queries = keys = N, D = 64, one head), causal or not and
seed: q, k, v and dO drawn in F; the reference gradients are fp64 autograd (PyTorch's math backend in
float64 where PyTorch is importable, else fadev's golden backward); every implementation's dq, dk, dv are
compared with them (RMSE and mean |err|).

Emulated (always, on ``device``): fadev's forward then backward under ``fa2(F)``, ``fa1(F)``, ``efficient(F)``,
``cudnn(F)`` (flash) and ``naive(F)``, ``torch_math(F)`` (baseline), each backward from its own forward's out and lse.

Real: on a CUDA GPU, PyTorch's SDPA backward through autograd (``torch.nn.attention.sdpa_kernel``) for the
flash, memory-efficient, cuDNN and math backends (math both ways of
``allow_fp16_bf16_reduction_math_sdp``) and fadev's native tensor-core backward; without a GPU, PyTorch's
CPU math backend (both ways: the same composite as on the GPU) and flash backward, labelled "(cpu)".

The verdict (:func:`within`): an emulation reproduces a kernel when every ratio emulated / real of the
metric, over N, causal and dq/dk/dv, lies within +-10%.
"""
from __future__ import annotations

import functools
import itertools
import time

import numpy as np
import pandas as pd

from ..attention import baseline_attention, flash_attention
from ..backward import baseline_attention_backward, flash_attention_backward
from ..formats import round as fround
from ..native import native_attention, native_attention_backward, native_tiles
from ..policy import Policy
from . import common
from .common import Finding

NAME = "kernels_backward"
SIZES = {
    "quick": {"formats": ("fp16", "bf16"), "Ns": (256, 512), "D": 64, "seeds": 2, "causal": (False, True)},
    "full": {"formats": ("fp16", "bf16"), "Ns": (512, 2048, 8192, 16384), "D": 64, "seeds": 2,
             "causal": (False, True)},
}
EMULATED = (("fa2", "flash"), ("fa1", "flash"), ("efficient", "flash"), ("cudnn", "flash"), ("naive", "baseline"),
            ("torch_math", "baseline"), ("naive, split scale", "baseline"))
"""Presets and kernels; "naive, split scale" is naive(F) on the math backend's pre-scaled q, k (:func:`_split_scale`)."""
GPU_BACKENDS = ("flash", "efficient", "cudnn", "math", "math, reduced", "fadev native")
CPU_BACKENDS = ("math", "math, reduced", "flash")
MODELS = {"torch flash": "fa2", "torch efficient": "efficient", "torch cudnn": "cudnn", "fadev native": "fa2",
          "torch math": "torch_math", "torch math, reduced": "naive, split scale", "torch math (cpu)": "torch_math",
          "torch math, reduced (cpu)": "naive, split scale"}
"""Which emulation models which real backward: the forward's pairs (the reduced math backend by naive on the
pre-scaled q, k), the memory-efficient (xformers/CUTLASS) backward by ``efficient(F)`` (dS from the P it stored
in F, the scale on dS), cuDNN's by ``cudnn(F)`` (fa2 with the scale on dS), and PyTorch's CPU math backend both ways (the same composite as on the GPU). PyTorch's
CPU flash backward is another algorithm: shown, not paired."""
GRADS = ("dq", "dk", "dv")
METRICS = ("rmse", "mean_abs")
TOLERANCE = 0.10


def _inputs(N, D, seed, fmt):
    """(q, k, v, dout), each (1, 1, N, D) in F: q, k, v as the forward experiments draw them, dO from seed."""
    q, k, v = common.inputs(N, N, D, seed, fmt)
    dout = fround(np.random.default_rng([seed, N, 7]).standard_normal((1, 1, N, D)), fmt)
    return q, k, v, dout


def _torch():
    try:
        import torch
        return torch
    except ImportError:
        return None


@functools.lru_cache(maxsize=2)
def _reference(N, D, seed, fmt, causal, device):
    """fp64 gradients: PyTorch autograd through its float64 math backend, or fadev's golden backward."""
    q, k, v, dout = _inputs(N, D, seed, fmt)
    torch = _torch()
    if torch is None:
        g = Policy.golden()
        out, lse = flash_attention(q, k, v, g, causal=causal, return_lse=True, device=device)
        return flash_attention_backward(q, k, v, out, lse, dout, g, causal=causal, device=device)
    dev = "cuda" if device == "cuda" and torch.cuda.is_available() else "cpu"
    grads, _ = _torch_grads(torch, (q, k, v, dout), torch.float64, dev, causal, "math")
    return grads


def _torch_grads(torch, arrays, dtype, dev, causal, backend, reduced=False):
    """(dq, dk, dv) as float64 arrays from autograd through one SDPA backend, and None or an error text."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    kind = {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
            "cudnn": SDPBackend.CUDNN_ATTENTION, "math": SDPBackend.MATH}[backend]
    q, k, v, dout = (torch.from_numpy(np.array(a)).to(dev, dtype) for a in arrays)  # exact: in F
    for t in (q, k, v):
        t.requires_grad_(True)
    flag = torch.backends.cuda.fp16_bf16_reduction_math_sdp_allowed()
    try:
        torch.backends.cuda.allow_fp16_bf16_reduction_math_sdp(reduced)
        with sdpa_kernel([kind]):
            out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)  # Nq = Nk: both masks agree
        out.backward(dout)
    except RuntimeError as e:  # a backend that does not support this shape, dtype or device
        return None, str(e).splitlines()[0][:200]
    finally:
        torch.backends.cuda.allow_fp16_bf16_reduction_math_sdp(flag)
    return tuple(t.grad.to(torch.float64).cpu().numpy() for t in (q, k, v)), None


def times_sqrt_scale(x, fmt, dim):
    """R_F(R_fp32(x * f)), f = R_fp32(sqrt(dim^-1/2)): how PyTorch's math backend in reduced precision scales
    q and k (aten's _scaled_dot_product_attention_math, "Scale q, k before matmul for stability"; a tensor
    in F times a Python scalar is computed in fp32 and rounded to F), and how autograd scales their
    gradients. Attention on the results with scale 1 under naive(F) is that backend, forward and backward
    (measured against PyTorch's CPU math backend, bf16, N = 1024 and 16384: forward RMSE 1.000x the
    backend's, where plain naive(F) gives 0.87-0.88x)."""
    return fround(fround(x * fround(np.sqrt(dim ** -0.5), "fp32"), "fp32"), fmt)


def _split_scale(arrays, fmt, causal, device):
    """The reduced math backend's backward from naive(F): q and k pre-scaled by f, matmul, softmax, matmul
    in F with no further scale, the gradients of the scaled q and k times f. f = 8^-1/2 for D = 64 is no
    power of two, so each product rounds: error naive(F) alone (the scale on the scores) lacks."""
    q, k, v, dout = arrays
    D = q.shape[-1]
    qs, ks = times_sqrt_scale(q, fmt, D), times_sqrt_scale(k, fmt, D)
    dqs, dks, dv = _emulated("naive", "baseline", (qs, ks, v, dout), fmt, causal, device, scale=1.0)
    return times_sqrt_scale(dqs, fmt, D), times_sqrt_scale(dks, fmt, D), dv


def _emulated(preset, kernel, arrays, fmt, causal, device, scale=None):
    if preset == "naive, split scale":
        return _split_scale(arrays, fmt, causal, device)
    q, k, v, dout = arrays
    pol = Policy.preset(preset, fmt)
    if kernel == "flash":
        out, lse = flash_attention(q, k, v, pol, causal=causal, scale=scale, return_lse=True, device=device)
        return flash_attention_backward(q, k, v, out, lse, dout, pol, causal=causal, scale=scale, device=device)
    out, lse = baseline_attention(q, k, v, pol, causal=causal, scale=scale, return_lse=True, device=device)
    return baseline_attention_backward(q, k, v, out, lse, dout, pol, causal=causal, scale=scale, device=device)


def _native(torch, arrays, fmt, causal, D):
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}[fmt]
    q, k, v, dout = (torch.from_numpy(np.array(a)).to("cuda", dtype) for a in arrays)
    bq, bkv = (128, 64) if (128, 64) in native_tiles(D) else native_tiles(D)[0]
    out, lse = native_attention(q, k, v, causal=causal, block_q=bq, block_kv=bkv, mma="sync", return_lse=True)
    grads = native_attention_backward(q, k, v, out, lse, dout, causal=causal,  # the backward's own default tile
                                      mma="sync", deterministic=False)  # atomic dq, as FlashAttention-2 (and as recorded)
    return tuple(g.to(torch.float64).cpu().numpy() for g in grads)


def _row_metrics(grads, ref) -> dict:
    return {f"{g}.{m}": v for g, t, r in zip(GRADS, grads, ref) for m, v in
            ((m, common.metrics("x", t, r)[f"x.{m}"]) for m in METRICS)}


def _evaluate(point):
    """All implementations on one (format, N, causal, seed): a dict of impl -> metric columns."""
    fmt, N, causal, D, device = point["format"], point["N"], point["causal"], point["D"], point["device"]
    arrays = _inputs(N, D, point["seed"], fmt)
    ref = _reference(N, D, point["seed"], fmt, causal, device)
    if point["impl"].startswith("emulated "):
        preset = point["impl"].removeprefix("emulated ")
        return _row_metrics(_emulated(preset, dict(EMULATED)[preset], arrays, fmt, causal, device), ref)
    torch = _torch()
    nan = {f"{g}.{m}": float("nan") for g in GRADS for m in METRICS}
    if point["impl"] == "fadev native":
        return {**_row_metrics(_native(torch, arrays, fmt, causal, D), ref), "error": None}
    backend = point["impl"].removeprefix("torch ").removesuffix(" (cpu)")
    dev = "cpu" if point["impl"].endswith("(cpu)") else "cuda"
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}[fmt]
    grads, error = _torch_grads(torch, arrays, dtype, dev, causal, backend.removesuffix(", reduced"),
                                reduced=backend.endswith(", reduced"))
    return {**(nan if grads is None else _row_metrics(grads, ref)), "error": error}


def real_impls(device) -> list:
    """The real kernels measured: the GPU's on device='cuda' with a GPU visible to PyTorch, PyTorch's CPU
    backward otherwise (none without PyTorch)."""
    if device == "cuda" and common.torch_cuda():
        return [b if b.startswith("fadev") else f"torch {b}" for b in GPU_BACKENDS]
    return [f"torch {b} (cpu)" for b in CPU_BACKENDS] if _torch() is not None else []


def run(size="quick", out=None, *, device="cpu", progress=False, budget_s=None, impls=None,
        **overrides) -> pd.DataFrame:
    """One row per (impl, format, N, causal): mean over seeds of {dq,dk,dv}.{rmse,mean_abs}. Raw rows in
    out/kernels_backward.jsonl (resumable: a second run with the same ``out`` skips finished points).
    ``budget_s``: start no new (N, format, causal) after this many seconds (Ns ascending); those left out are
    in ``df.attrs["skipped"]``. ``impls``: measure only these implementations (names as in the "impl" column:
    "emulated fa2", "torch efficient", ...; default: every emulation and the device's real kernels)."""
    s = common.sizes(SIZES, size, overrides)
    known = [f"emulated {p}" for p, _ in EMULATED] + real_impls(device)
    if impls is not None:
        unknown = [i for i in impls if i not in known]
        if unknown or not impls:
            raise ValueError(f"impls: unknown or unavailable here {unknown or impls!r}; known: {', '.join(known)}")
    impls = known if impls is None else [i for i in known if i in impls]
    device = common.sweep_device(device)  # where the emulation runs: the GPU only with fadev's CUDA kernels
    start, frames, skipped = time.perf_counter(), [], []
    for N, fmt, causal in itertools.product(sorted(s["Ns"]), s["formats"], s["causal"]):
        if budget_s is not None and time.perf_counter() - start > budget_s:
            skipped.append((N, fmt, causal))
            continue
        points = [{"impl": impl, "format": fmt, "N": N, "causal": causal, "D": s["D"], "seed": seed, "device": device}
                  for impl in impls for seed in range(s["seeds"])]
        frames.append(common.run_custom(points, _evaluate, out, NAME, progress))
    if not frames:
        raise ValueError(f"kernels_backward: budget_s={budget_s} left no point to run")
    rows = pd.concat(frames, ignore_index=True)
    cols = [f"{g}.{m}" for g in GRADS for m in METRICS]
    df = rows.groupby(["impl", "format", "N", "causal"], sort=False)[cols].mean().reset_index()
    if "error" in rows.columns:
        errors = rows.dropna(subset=["error"]).groupby(["impl", "format", "N", "causal"])["error"].first()
        df["error"] = [errors.get(tuple(r), "") for r in df[["impl", "format", "N", "causal"]].itertuples(index=False)]
    df.attrs["skipped"] = skipped
    return df


def ratios(df, metric="mean_abs") -> pd.DataFrame:
    """One row per (real kernel, its model, format, N, causal) present in ``df``: ratio emulated / real of
    ``metric`` for dq, dk and dv (NaN where the real kernel has no value)."""
    rows = []
    keyed = df.set_index(["impl", "format", "N", "causal"])
    for (fmt, N, causal), _ in df.groupby(["format", "N", "causal"], sort=False):
        for real, model in MODELS.items():
            a, b = (f"emulated {model}", fmt, N, causal), (real, fmt, N, causal)
            if a not in keyed.index or b not in keyed.index:
                continue
            r = {"real": real, "model": model, "format": fmt, "N": N, "causal": causal}
            for g in GRADS:
                r[g] = keyed.at[a, f"{g}.{metric}"] / keyed.at[b, f"{g}.{metric}"]
            rows.append(r)
    return pd.DataFrame(rows, columns=["real", "model", "format", "N", "causal", *GRADS])


def within(values, tol=TOLERANCE):
    """The verdict: True when every value is finite and within [1 - tol, 1 + tol]; None when there are none."""
    v = np.asarray(list(values), dtype=float)
    if v.size == 0:
        return None
    return bool(np.all(np.isfinite(v)) and np.all(np.abs(v - 1) <= tol))


def findings(df, metric="mean_abs") -> list:
    """A finding per (real kernel, format): the range of emulated/real ratios of ``metric`` per gradient
    over N and causal, where it leaves +-10%, and the verdict."""
    rt = ratios(df, metric)
    if not len(rt):
        where = sorted({i for i in df["impl"] if not i.startswith("emulated")})
        if where:
            text = (f"measured on the CPU only ({', '.join(where)}): kernels no emulation models; PyTorch's GPU "
                    "backward kernels need `--device cuda` on a GPU")
        elif _torch() is None:
            text = ("not measured: PyTorch is not installed (the real backward is PyTorch's autograd; its math "
                    "backend runs on the CPU). `pip install torch --index-url https://download.pytorch.org/whl/cpu` "
                    "adds it; the same command then measures it")
        else:
            text = "not measured: no real backward kernel ran in this run"
        return [Finding("backward: emulated presets vs real kernels", text)]
    out = []
    for (real, model, fmt), g in rt.groupby(["real", "model", "format"], sort=False):
        parts = [f"{gr} {g[gr].min():.3f}x-{g[gr].max():.3f}x" for gr in GRADS]
        bad = [f"N={r.N}{' causal' if r.causal else ''} {gr} {getattr(r, gr):.3f}x" for r in g.itertuples(index=False)
               for gr in GRADS if not within([getattr(r, gr)])]
        text = f"mean |err| ratio {', '.join(parts)} over N {g['N'].min()}..{g['N'].max()}, causal and not"
        text += f"; outside +-{TOLERANCE:.0%}: {', '.join(bad[:4])}{' ...' if len(bad) > 4 else ''}" if bad else ""
        out.append(Finding(f"backward {fmt}: emulated {model} vs {real}", text,
                           f"emulation within +-{TOLERANCE:.0%} of the kernel", within(g[list(GRADS)].values.ravel()),
                           source="fadev"))
    return out


def table(df, metric="mean_abs") -> str:
    """The ratio table in Markdown: one line per (real, format, N, causal)."""
    rt = ratios(df, metric)
    lines = ["| real kernel | emulation | format | N | causal | dq | dk | dv |", "|---|---|---|---|---|---|---|---|"]
    for r in rt.itertuples(index=False):
        cells = [r.real, r.model, r.format, r.N, r.causal] + [f"{getattr(r, g):.3f}" for g in GRADS]
        lines.append("| " + " | ".join(map(str, cells)) + " |")
    return "\n".join(lines)
