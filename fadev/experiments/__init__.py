"""Experiments: Golden et al., "Is Flash Attention Stable?" (arXiv 2405.02803), and beyond.

One experiment = one module of this package, registered in :data:`EXPERIMENTS`. Every module has:

==============================================  =========================================================
``NAME``, ``TITLE``                             file stem of its outputs (NAME.jsonl, NAME.csv, NAME.md;
                                                subcommand ``python -m fadev NAME`` with ``_`` as ``-``)
``INTRO``                                       the report's prose: what is run and why
``SIZES``, ``SIZE_DOCS``                        {size: {parameter: value}} ("quick": minutes on a laptop
                                                CPU; "full": paper scale), what each parameter means
``FIGURES``                                     the stems of its figure files
``REPRODUCE``                                   whether ``reproduce`` runs it by default
``OPTIONS`` (optional)                          the shared options its command takes where they work:
                                                "device", "cluster" (default both)
``NEEDS_TORCH`` (optional)                      what a run without PyTorch skips (the CLI says so)
``run(size, out, *, device, workers,            one aggregated row per configuration; raw rows in
progress, cluster, **overrides) -> DataFrame``  out/NAME.jsonl (resumable: finished points are skipped);
                                                ``cluster``: fadev.sweep.run's executor options or None
``findings(df, *, device) -> [Finding]``        each claim with our number, the paper's, a verdict
``table(df) -> str``                            the report's Markdown table
``figures(df, out_dir) -> [paths]``             the figures, PNG and SVG
==============================================  =========================================================

:func:`reproduce` runs them and writes report.md through :mod:`fadev.report`, which knows none of them.
Adding an experiment: one module with the attributes above and one entry in :data:`EXPERIMENTS`.

============  =====================================================================================
precision     Figs 3-4: flash under paper(F) vs baseline under naive(F), each vs golden, per format
seqlen        Fig 5: flash vs baseline over the sequence length at fixed tiles
algorithm     Fig 6: tile area, swapped and non-square tiles, block_q, SRAM rule, loop order, ...
attribution   which policy stage is to blame: raise / lower one stage at a time
kernels       presets of real kernels (fa2, fa1, naive, torch_math) vs golden; PyTorch SDPA on a GPU
              and fadev's native kernel per forward tile beside fa2 emulated with its tiles
fp8           FlashAttention-3 Table 3: outlier inputs, fp16 and fp8 with scaling and Hadamard rotation
ring          ring attention's error vs the number of ranks, and candidate causes (not in reproduce)
ring_dist     ring attention on real ranks (torch.distributed): a deep model's gradient error vs W and
              depth (not in reproduce)
ring_multigpu ring attention across GPUs (torch.distributed, nccl): out/LSE/gradient error vs fp64 against W,
              PyTorch's context parallelism beside it, tokens/s (not in reproduce)
train_drift   Section 5: weight drift of training with flash vs baseline attention (PyTorch; not in
              reproduce)
============  =====================================================================================
"""
from __future__ import annotations

import os
import time

from .. import report
from . import algorithm, attribution, fp8, kernels, precision, ring, ring_dist, ring_multigpu, seqlen, train_drift
from . import common
from .common import METHOD, PAPER, Finding, torch_cuda
from .headline import headline
from .quant import hadamard, quantize, random_signs

EXPERIMENTS = {m.NAME: m for m in (precision, seqlen, algorithm, attribution, kernels, fp8, ring, ring_dist, ring_multigpu,
                                   train_drift)}
"""{name: module} in report order."""


def _experiment(name):
    if name not in EXPERIMENTS:
        raise ValueError(f"unknown experiment {name!r}; known: {', '.join(EXPERIMENTS)}")
    return EXPERIMENTS[name]


def run(name, *, size="quick", out=None, device="cpu", workers=1, progress=False, cluster=None, **overrides):
    """Run one experiment by name; returns its DataFrame (see the module's ``run``). ``cluster``: the
    executor options of :func:`fadev.sweep.run` (e.g. {"executor": "ray", "address": "auto"}), None: local."""
    return _experiment(name).run(size, out, device=device, workers=workers, progress=progress, cluster=cluster,
                                 **overrides)


def findings(name, df, device="cpu"):
    """The findings of experiment ``name`` from its DataFrame."""
    return _experiment(name).findings(df, device=device)


def run_one(name, *, size="quick", out="results", device="cpu", workers=1, progress=False, cluster=None,
            **overrides) -> dict:
    """Run one experiment and write out/NAME.csv and its figures; returns {"experiment", "sizes", "df",
    "figures", "findings", "seconds", "ran_on", "intro"} (a result for :func:`document`; sizes: the parameters
    used (the run's ``df.attrs["settings"]`` where it sets them); intro: ``df.attrs["intro"]`` or None, the
    report's prose when the run chose its own;
    ran_on: where it actually ran, the module's ``ran_on(device)`` where it has one, else
    :func:`common.ran_on`)."""
    exp = _experiment(name)
    start = time.perf_counter()
    os.makedirs(out, exist_ok=True)
    df = exp.run(size, out, device=device, workers=workers, progress=progress, cluster=cluster, **overrides)
    df.to_csv(os.path.join(out, f"{name}.csv"), index=False)
    figures = exp.figures(df, out)
    sizes = df.attrs.get("settings") or {**exp.SIZES[size], **{k: v for k, v in overrides.items() if v is not None}}
    return {"experiment": exp, "sizes": sizes, "df": df, "figures": figures,
            "findings": exp.findings(df, device=device), "seconds": time.perf_counter() - start,
            "ran_on": getattr(exp, "ran_on", common.ran_on)(device), "intro": df.attrs.get("intro")}


def document(path, results, size="quick", device="cpu", command=None, title=None):
    """Write the Markdown report of ``results`` ({name: run_one's result}) to ``path``; returns the path.
    ``command``: how to regenerate it (default: ``python -m fadev reproduce``); ``title``: the heading
    (default: the reproduction's). The method paragraph opens it when an experiment samples query rows
    (has an ``n_query`` size parameter)."""
    sampled = any("n_query" in r["experiment"].SIZES[size] for r in results.values())
    where = {}
    for name, r in results.items():
        where.setdefault(r.get("ran_on") or common.ran_on(device), []).append(name)
    device_text = next(iter(where)) if len(where) == 1 else \
        "; ".join(f"{', '.join(names)} on {text}" for text, names in where.items())
    return report.write(path, results, title=title or f"Reproducing {PAPER} with fadev",
                        command=command or f"python -m fadev reproduce --{size} --out DIR", size=size,
                        device=device_text,
                        device_note=" (PyTorch sees a GPU)" if torch_cuda() else "",
                        preamble=[METHOD] if sampled else [], headline=headline(results))


def reproduce(size="quick", out="results", device="cpu", only=None, workers=1, progress=False, log=None,
              cluster=None):
    """Run the experiments (those with ``REPRODUCE``, or the names in ``only``), write out/NAME.jsonl (raw
    rows), out/NAME.csv (the aggregated table), the figures (PNG and SVG) and out/report.md. Returns {name:
    {"experiment", "sizes", "df", "figures", "findings", "seconds"}}. ``log``: a callable taking a line of progress
    text (e.g. print); ``cluster``: as :func:`run`."""
    names = [n for n, m in EXPERIMENTS.items() if m.REPRODUCE] if not only else list(only)
    unknown = [n for n in names if n not in EXPERIMENTS]
    if unknown:
        raise ValueError(f"unknown experiment(s) {', '.join(map(repr, unknown))}; known: {', '.join(EXPERIMENTS)}")
    os.makedirs(out, exist_ok=True)
    results = {}
    for name in names:
        if log:
            log(f"[{name}] {EXPERIMENTS[name].TITLE} ({size}) ...")
        results[name] = run_one(name, size=size, out=out, device=device, workers=workers, progress=progress,
                                cluster=cluster)
        if log:
            r = results[name]
            log(f"[{name}] done in {r['seconds']:.1f} s: {len(r['df'])} rows, {len(r['figures'])} figure files")
    document(os.path.join(out, "report.md"), results, size, device)
    return results


__all__ = ["EXPERIMENTS", "Finding", "run", "findings", "run_one", "document", "reproduce", "hadamard", "quantize",
           "random_signs"]
