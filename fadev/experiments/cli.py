"""Command-line subcommands of the reproduction: ``reproduce`` and one per experiment.

``python -m fadev reproduce [--quick|--full] [--device cpu|cuda] [--out DIR] [--only NAME,...]`` runs the
experiments and writes DIR/report.md; ``python -m fadev NAME [...]`` runs one experiment (its size
parameters can be overridden one by one, e.g. ``python -m fadev seqlen --Ns 128,1024 --seeds 2``) and
writes DIR/NAME.md next to its results and figures. fadev/__main__.py registers them through
:func:`add_subcommands`.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

from . import EXPERIMENTS, reproduce
from ..sweep_cli import positive_int
from .common import SIZE_DOCS


def _int_list(text):
    try:
        values = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def _str_list(text):
    values = tuple(x.strip() for x in text.split(",") if x.strip())
    if not values:
        raise argparse.ArgumentTypeError(f"expected a comma-separated list, got {text!r}")
    return values


def _names(text):
    names = _str_list(text)
    unknown = [n for n in names if n not in EXPERIMENTS]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown experiment(s) {', '.join(unknown)}; known: {', '.join(EXPERIMENTS)}")
    return names


def _common(sp):
    size = sp.add_mutually_exclusive_group()
    size.add_argument("--quick", dest="size", action="store_const", const="quick",
                      help="small sizes: minutes on a laptop CPU (the default)")
    size.add_argument("--full", dest="size", action="store_const", const="full",
                      help="paper-scale sizes (more query rows, longer sequences, more seeds): for a many-core "
                           "machine or a GPU")
    sp.set_defaults(size="quick")
    sp.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                    help="cuda: also measure PyTorch's real SDPA kernels (experiment 'kernels') where PyTorch sees "
                         "a GPU, and run fadev's emulation on the GPU where fadev has CUDA attention kernels "
                         "(else on the CPU); default cpu")
    sp.add_argument("--out", default="results", metavar="DIR",
                    help="output folder for results (NAME.jsonl raw rows, resumable; NAME.csv tables), figures "
                         "(PNG + SVG) and the report (default: results)")
    sp.add_argument("--workers", type=positive_int, default=1,
                    help="worker processes for the sweep engine (default 1: one process, the C kernels use every "
                         "core)")
    sp.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bars on stderr")


def _size_option(sp, key, quick, full):
    """--KEY overriding one size parameter, typed from its quick value."""
    if isinstance(quick, tuple) and quick and isinstance(quick[0], int):
        kind, shown = _int_list, lambda v: ",".join(map(str, v))
    elif isinstance(quick, tuple):
        kind, shown = _str_list, lambda v: ",".join(v)
    elif isinstance(quick, int):
        kind, shown = positive_int, str
    else:
        kind, shown = str, str
    sp.add_argument(f"--{key}", type=kind, default=None, metavar=key.upper() if kind in (positive_int, str) else "A,B,...",
                    help=f"{SIZE_DOCS.get(key, key)} (quick: {shown(quick)}; full: {shown(full)})")


def cmd_reproduce(args) -> int:
    start = time.perf_counter()
    try:
        results = reproduce(args.size, args.out, args.device, only=args.only, workers=args.workers,
                            progress=args.progress, log=lambda line: print(line, flush=True))
    except (OSError, ValueError, RuntimeError) as e:
        print(f"fadev reproduce: {e}", file=sys.stderr)
        return 1
    held = [f for r in results.values() for f in r["findings"] if f.holds is not None]
    n_ok = sum(f.holds for f in held)
    print(f"\n{n_ok} of {len(held)} paper claims hold; report: {os.path.join(args.out, 'report.md')} "
          f"({time.perf_counter() - start:.0f} s)")
    return 0


def _cmd_experiment(name):
    def cmd(args) -> int:
        from .. import report
        mod = EXPERIMENTS[name]
        overrides = {k: getattr(args, k) for k in mod.SIZES["quick"] if getattr(args, k, None) is not None}
        start = time.perf_counter()
        try:
            df = mod.run(args.size, out=args.out, device=args.device, workers=args.workers, progress=args.progress,
                         **overrides)
        except (OSError, ValueError, RuntimeError) as e:
            print(f"fadev {name}: {e}", file=sys.stderr)
            return 1
        df.to_csv(os.path.join(args.out, f"{name}.csv"), index=False)
        figures = mod.plot(df, args.out)
        from . import findings
        found = findings(name, df, args.device)
        result = {name: {"df": df, "figures": figures, "findings": found, "seconds": time.perf_counter() - start}}
        path = report.write(os.path.join(args.out, f"{name}.md"), result, size=args.size, device=args.device)
        for f in found:
            print(f.markdown())
        print(f"\n{len(df)} rows in {os.path.join(args.out, name + '.csv')}; figures: "
              f"{', '.join(os.path.basename(p) for p in figures)}; report: {path}")
        return 0
    return cmd


def add_subcommands(sub):
    """Register ``reproduce`` and the experiment subcommands on an argparse subparsers object."""
    sp = sub.add_parser(
        "reproduce", help="reproduce Golden et al. (arXiv 2405.02803) and more: experiments, figures, report.md",
        description="Run the reproduction experiments (" + ", ".join(EXPERIMENTS) + "), write their raw rows "
                    "(DIR/NAME.jsonl, resumable), tables (DIR/NAME.csv), figures (PNG and SVG) and DIR/report.md, "
                    "which states each finding with our number next to the paper's claim and whether it holds.")
    _common(sp)
    sp.add_argument("--only", type=_names, default=None, metavar="NAME,...",
                    help="run only these experiments (comma-separated): " + ", ".join(EXPERIMENTS))
    sp.set_defaults(func=cmd_reproduce)
    for name, mod in EXPERIMENTS.items():
        doc = (mod.__doc__ or "").strip().split("\n\n")
        ep = sub.add_parser(name, help=doc[0].split(":", 1)[-1].strip().rstrip("."),
                            description=" ".join(" ".join(doc[:2]).split()) + " Writes DIR/" + name + ".jsonl, "
                            f"DIR/{name}.csv, the figures and DIR/{name}.md.")
        _common(ep)
        for key, quick in mod.SIZES["quick"].items():
            _size_option(ep, key, quick, mod.SIZES["full"][key])
        ep.set_defaults(func=_cmd_experiment(name))
