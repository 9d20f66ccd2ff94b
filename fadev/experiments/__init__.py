"""Reproduction experiments: Golden et al., "Is Flash Attention Stable?" (arXiv 2405.02803), and beyond.

Each experiment is a module with ``run(size, out, device, workers, progress, **overrides) -> DataFrame``
(one aggregated row per configuration: mean/std over seeds), ``plot(df, out_dir) -> [paths]``,
``findings(df) -> [Finding]``, its ``SIZES`` ("quick": minutes on a laptop CPU; "full": paper scale,
for a many-core machine or a GPU) and ``TITLE``. Raw per-seed rows go to ``out/NAME.jsonl`` through
:mod:`fadev.sweep` (resumable: rerunning skips finished points). :func:`reproduce` runs them all and
writes the figures and ``report.md``.

============  =====================================================================================
precision     Figs 3-4: flash under paper(F) vs baseline under naive(F), each vs golden, per format
seqlen        Fig 5: flash vs baseline over the sequence length at fixed tiles
algorithm     Fig 6: tile area, swapped and non-square tiles, block_q, SRAM rule, loop order, ...
attribution   which policy stage is to blame: raise / lower one stage at a time
kernels       presets of real kernels (fa2, fa1, naive, torch_math) vs golden; PyTorch SDPA on a GPU
fp8           FlashAttention-3 Table 3: outlier inputs, fp16 and fp8 with scaling and Hadamard rotation
============  =====================================================================================
"""
from __future__ import annotations

import os
import time

from . import algorithm, attribution, fp8, kernels, precision, seqlen
from .common import Finding
from .quant import hadamard, quantize, random_signs

EXPERIMENTS = {m.NAME: m for m in (precision, seqlen, algorithm, attribution, kernels, fp8)}
"""{name: module} in report order."""


def run(name, size="quick", out=None, device="cpu", workers=1, progress=False, **overrides):
    """Run one experiment by name; returns its DataFrame (see the module's ``run``)."""
    if name not in EXPERIMENTS:
        raise ValueError(f"unknown experiment {name!r}; known: {', '.join(EXPERIMENTS)}")
    return EXPERIMENTS[name].run(size, out=out, device=device, workers=workers, progress=progress, **overrides)


def findings(name, df, device="cpu"):
    mod = EXPERIMENTS[name]
    return mod.findings(df, device) if name == "kernels" else mod.findings(df)


def reproduce(size="quick", out="results", device="cpu", only=None, workers=1, progress=False, log=None):
    """Run the experiments (all, or the names in ``only``), write out/NAME.jsonl (raw rows), out/NAME.csv
    (the aggregated table), the figures (PNG and SVG) and out/report.md. Returns {name: {"df", "figures",
    "findings", "seconds"}}. ``log``: a callable taking a line of progress text (e.g. print)."""
    from .. import report
    names = list(EXPERIMENTS) if not only else list(only)
    unknown = [n for n in names if n not in EXPERIMENTS]
    if unknown:
        raise ValueError(f"unknown experiment(s) {', '.join(map(repr, unknown))}; known: {', '.join(EXPERIMENTS)}")
    os.makedirs(out, exist_ok=True)
    results = {}
    for name in names:
        start = time.perf_counter()
        if log:
            log(f"[{name}] {EXPERIMENTS[name].TITLE} ({size}) ...")
        df = run(name, size, out=out, device=device, workers=workers, progress=progress)
        df.to_csv(os.path.join(out, f"{name}.csv"), index=False)
        figures = EXPERIMENTS[name].plot(df, out)
        results[name] = {"df": df, "figures": figures, "findings": findings(name, df, device),
                         "seconds": time.perf_counter() - start}
        if log:
            log(f"[{name}] done in {results[name]['seconds']:.1f} s: {len(df)} rows, {len(figures)} figure files")
    report.write(os.path.join(out, "report.md"), results, size=size, device=device)
    return results


__all__ = ["EXPERIMENTS", "Finding", "run", "findings", "reproduce", "hadamard", "quantize", "random_signs"]
