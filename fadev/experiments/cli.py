"""Command-line subcommands of the experiments: ``reproduce`` and one per experiment.

``python -m fadev reproduce [--quick|--full] [--device cpu|cuda] [--out DIR] [--only NAME,...]`` runs the
experiments and writes DIR/report.md; ``python -m fadev NAME [...]`` runs one experiment (its size
parameters can be overridden one by one, e.g. ``python -m fadev seqlen --Ns 128,1024 --seeds 2``) and
writes DIR/NAME.md next to its results and figures; NAME's underscores are written as dashes
(``train-drift``). Every experiment's subcommand is built the same way from its module (SIZES,
SIZE_DOCS, the docstring). fadev/__main__.py registers them through :func:`add_subcommands`.
"""
from __future__ import annotations

import argparse
import os
import re
import sys
import time

from .. import report
from ..sweep.cli import add_cluster_options, positive_int, run_options
from . import EXPERIMENTS, common, document, reproduce, run_one
from .rerender import rerender


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


SIZE_HELP = {"quick": "small sizes: minutes on a laptop CPU (the default)",
             "full": "paper-scale sizes (more query rows, longer sequences, more seeds): for a many-core machine or "
                     "a GPU"}


def _common(sp, sizes=("quick", "full"), options=("device", "cluster")):
    """The options every experiment command shares: --SIZE for each size, --out, --workers, --no-progress, and
    where they work (``options``, an experiment's OPTIONS): --device; --cluster and --gpus-per-point.
    ``sizes``: {size: parameters} or names."""
    group = sp.add_mutually_exclusive_group()
    for size in sizes:
        if isinstance(sizes, dict):
            text = f"{size} sizes{' (the default)' if size == 'quick' else ''}: " + \
                ", ".join(f"{k}={_shown(v)}" for k, v in sizes[size].items())
        else:
            text = SIZE_HELP[size]
        group.add_argument(f"--{size}", dest="size", action="store_const", const=size, help=text)
    sp.set_defaults(size="quick", device="cpu", cluster={"executor": "local"}, gpus_per_point=None)
    if "device" in options:
        sp.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="cuda: also measure PyTorch's real SDPA kernels (experiment 'kernels') where PyTorch "
                             "sees a GPU, and run fadev's emulation on the GPU where fadev has CUDA attention kernels "
                             "(else on the CPU, and the run says so; train-drift: models and attention on the GPU); "
                             "default cpu")
    sp.add_argument("--out", default="results", metavar="DIR",
                    help="output folder for results (NAME.jsonl raw rows, resumable; NAME.csv tables), figures "
                         "(PNG + SVG) and the report (default: results)")
    sp.add_argument("--workers", type=positive_int, default=None,
                    help="worker processes for the sweep engine (default 1: one process, the C kernels use every "
                         "core; with --cluster: Ray's CPUs)")
    if "cluster" in options:
        add_cluster_options(sp)
    sp.add_argument("--no-progress", dest="progress", action="store_false", help="no progress output on stderr")


def plain(text) -> str:
    """Docstring text as a terminal reads it: Sphinx roles (:func:`x`) and double backquotes (``x``) become
    plain `x`, whitespace is collapsed."""
    text = re.sub(r":[a-z]+:`~?([^`]+)`", r"`\1`", text)
    return " ".join(text.replace("``", "`").split())


def help_text(doc, limit=700) -> str:
    """A command's description from a module docstring: its first paragraph, then the next ones while they are
    prose (not a list or table, not a lead-in ending in ':') and the text stays under ``limit`` characters;
    whole sentences only, in plain text (:func:`plain`)."""
    paragraphs = [p.strip() for p in (doc or "").strip().split("\n\n") if p.strip()]
    if not paragraphs:
        return ""
    chosen = [paragraphs[0]]
    for p in paragraphs[1:]:
        if p[0] in "*-=|" or p.rstrip().endswith(":") or len(plain(" ".join(chosen + [p]))) > limit:
            break
        chosen.append(p)
    text = plain(" ".join(chosen))
    if text.endswith(":"):  # the first paragraph itself leads into a list: keep its whole sentences
        cut = max(text.rfind(". ", 0, len(text) - 1), text.rfind("; ", 0, len(text) - 1))
        text = text[:cut + 1] if cut > 0 else text[:-1] + "."
    return text


def _shown(v):
    return ",".join(map(str, v)) if isinstance(v, tuple) else str(v)


def _size_option(sp, key, quick, full, doc, values=None):
    """--KEY-WITH-DASHES overriding one size parameter KEY, typed from its quick value (the spelling with
    underscores is accepted too: fadev.__main__.dashed); ``values``: the help's text of the defaults (default:
    the quick and full values)."""
    names = [f"--{key.replace('_', '-')}"]
    help_text = f"{doc} ({values or f'quick: {_shown(quick)}; full: {_shown(full)}'})"
    if isinstance(quick, bool):
        sp.add_argument(*names, dest=key, action=argparse.BooleanOptionalAction, default=None, help=help_text)
        return
    if isinstance(quick, tuple):
        sample = (quick or full or ("",))[0]  # an empty quick tuple: typed from the full one
        kind = _int_list if isinstance(sample, int) else _str_list
    else:
        kind = {int: positive_int, float: float}.get(type(quick), str)
    sp.add_argument(*names, dest=key, type=kind, default=None, help=help_text,
                    metavar="A,B,..." if isinstance(quick, tuple) else key.upper())


TORCH_CPU = "pip install torch --index-url https://download.pytorch.org/whl/cpu"
"""The one command that adds PyTorch's CPU build (~200 MB; `pip install torch` pulls the multi-GB CUDA build)."""


def notes(results, device) -> list:
    """Lines for the terminal on what a run could not do as asked: `--device cuda` that ran on the CPU (which
    experiments, why), and the checks skipped for want of PyTorch (with the command that adds it)."""
    lines, fell = [], {}
    for name, r in results.items():
        match = re.match(r"the CPU \((?:asked for `--device cuda`: )?([^)]*)\)", r.get("ran_on") or "")
        if device == "cuda" and match:
            fell.setdefault(match.group(1), []).append(name)
    if fell:
        lines.append("note: --device cuda ran on the CPU for " +
                     "; ".join(f"{', '.join(names)} ({why})" for why, names in fell.items()))
    if not common.torch_available() and any(getattr(r["experiment"], "NEEDS_TORCH", "") for r in results.values()):
        skipped = "; ".join(r["experiment"].NEEDS_TORCH for r in results.values()
                            if getattr(r["experiment"], "NEEDS_TORCH", ""))
        lines.append(f"note: PyTorch is not installed, so this run skipped {skipped}; add it with `{TORCH_CPU}` "
                     "and run the same command again (finished points are read back)")
    return lines


def cmd_reproduce(args) -> int:
    start = time.perf_counter()
    try:
        results = reproduce(args.size, args.out, args.device, only=args.only, workers=args.workers,
                            progress=args.progress, log=lambda line: print(line, flush=True),
                            cluster=run_options(args))
    except (OSError, ValueError, RuntimeError, ImportError) as e:
        print(f"fadev reproduce: {e}", file=sys.stderr)
        return 1
    found = [f for r in results.values() for f in r["findings"]]
    print(f"\n{report.count_line(found)}; report: {os.path.join(args.out, 'report.md')} "
          f"({time.perf_counter() - start:.0f} s)")
    for line in notes(results, args.device):
        print(line)
    return 0


def _variants(exp):
    """(option, {value: (sizes, docs)}, help) of an experiment with several workloads, else None."""
    return getattr(exp, "WORKLOADS", None)


def _all_sizes(exp):
    """{value: sizes} of each workload ({None: SIZES} for an experiment with one)."""
    variants = _variants(exp)
    return {v: table[0] for v, table in variants[1].items()} if variants else {None: exp.SIZES}


def _cmd_experiment(name, command):
    def cmd(args) -> int:
        exp = EXPERIMENTS[name]
        variants = _variants(exp)
        chosen = getattr(args, variants[0]) if variants else None
        sizes = _all_sizes(exp)[chosen][args.size]
        overrides = {k: getattr(args, k) for k in sizes if getattr(args, k, None) is not None}
        foreign = sorted({k for table in _all_sizes(exp).values() for k in table[args.size]} - set(sizes))
        foreign = [k for k in foreign if getattr(args, k, None) is not None]
        if foreign:
            print(f"fadev {command}: --{foreign[0].replace('_', '-')} is not a setting of --{variants[0]} {chosen}",
                  file=sys.stderr)
            return 2
        shown = command
        if variants:
            overrides[variants[0]] = chosen
            if chosen != next(iter(variants[1])):
                shown = f"{command} --{variants[0]} {chosen}"
        for key in getattr(exp, "SHOWN_OPTIONS", ()):  # settings that choose the study, not its size
            if overrides.get(key) not in (None, sizes.get(key)):
                shown += f" --{key.replace('_', '-')} {overrides[key]}"
        # the regenerate command: every other setting the command line changed (not those that only say how this
        # call runs, an experiment's RUN_OPTIONS), and the device
        again = "".join(f" --{key.replace('_', '-')} {_shown(value)}" for key, value in overrides.items()
                        if key not in getattr(exp, "SHOWN_OPTIONS", ()) + getattr(exp, "RUN_OPTIONS", ())
                        and (not variants or key != variants[0]) and value != sizes.get(key))
        again += f" --device {args.device}" if getattr(args, "device", "cpu") != "cpu" else ""
        try:
            result = run_one(name, size=args.size, out=args.out, device=args.device, workers=args.workers,
                             progress=args.progress, cluster=run_options(args), **overrides)
        except (OSError, ValueError, RuntimeError, ImportError) as e:
            print(f"fadev {command}: {e}", file=sys.stderr)
            return 1
        path = document(os.path.join(args.out, f"{name}.md"), {name: result}, args.size, args.device,
                        command=f"python -m fadev {shown} --{args.size}{again} --out DIR",
                        title=f"{exp.TITLE} (`python -m fadev {shown}`)")
        for f in result["findings"]:
            print(f.markdown())
        print(f"\n{len(result['df'])} rows in {os.path.join(args.out, name + '.csv')}; figures: "
              f"{', '.join(os.path.basename(p) for p in result['figures'])}; report: {path} "
              f"({result['seconds']:.0f} s)")
        for line in notes({name: result}, args.device):
            print(line)
        return 0
    return cmd


def cmd_report(args) -> int:
    try:
        path, results = rerender(args.dir, out=args.out, size=args.size, until=args.until)
    except (OSError, ValueError, KeyError) as e:
        print(f"fadev report: {e}", file=sys.stderr)
        return 1
    found = [f for r in results.values() for f in r["findings"]]
    print(f"{report.count_line(found)}; report: {', '.join(path) if isinstance(path, list) else path}")
    return 0


def add_subcommands(sub):
    """Register ``reproduce``, ``report`` and the experiment subcommands on an argparse subparsers object."""
    default = [n for n, m in EXPERIMENTS.items() if m.REPRODUCE]
    sp = sub.add_parser(
        "reproduce", help="reproduce Golden et al. (arXiv 2405.02803) and more: experiments, figures, report.md",
        description="Run the reproduction experiments (" + ", ".join(default) + "; --only adds " +
                    ", ".join(n for n in EXPERIMENTS if n not in default) + "), write their raw rows "
                    "(DIR/NAME.jsonl, resumable), tables (DIR/NAME.csv), figures (PNG and SVG) and DIR/report.md, "
                    "which states each finding with our number next to the paper's claim and whether it holds.")
    _common(sp)
    sp.add_argument("--only", type=_names, default=None, metavar="NAME,...",
                    help="run only these experiments (comma-separated): " + ", ".join(EXPERIMENTS))
    sp.set_defaults(func=cmd_reproduce)
    rp = sub.add_parser("report", help="render a recorded results folder's report again from its CSVs",
                        description="Read DIR/NAME.csv of every experiment in DIR, compute the findings and tables "
                                    "with the current code and write the report in the current format (the recorded "
                                    "numbers; the recorded header, sizes lines and figures kept). Replaces DIR's "
                                    "report (report.md or NAME.md) unless --out is given.")
    rp.add_argument("dir", metavar="DIR", help="a results folder, e.g. docs/results/kernels-quick-h100-2026-11-22")
    rp.add_argument("--out", default=None, metavar="FILE",
                    help="write the report here instead (a folder where DIR holds one report per experiment)")
    rp.add_argument("--until", type=int, default=None, metavar="STEP",
                    help="train-drift --model llama runs: read the run up to update STEP (a logged step every arm "
                         "reached), for a run whose lease ended before every arm was done; the report says so, later "
                         "renderings keep the cut, and the figures are drawn again from those rows")
    group = rp.add_mutually_exclusive_group()
    for size in ("quick", "full"):
        group.add_argument(f"--{size}", dest="size", action="store_const", const=size,
                           help=f"the run used {size} sizes (default: as its report says)")
    rp.set_defaults(func=cmd_report, size=None)
    for name, exp in EXPERIMENTS.items():
        command = name.replace("_", "-")
        first = plain((exp.__doc__ or "").strip().split("\n\n")[0])
        first = first.split(". ")[0].rstrip(".")
        ep = sub.add_parser(command, help=first.split(": ", 1)[-1] if first.startswith("Experiment ") else first,
                            description=help_text(exp.__doc__) + " Writes DIR/" + name + ".jsonl, "
                            f"DIR/{name}.csv, the figures and DIR/{name}.md.")
        _common(ep, exp.SIZES, getattr(exp, "OPTIONS", ("device", "cluster")))
        variants = _variants(exp)
        if variants:
            ep.add_argument(f"--{variants[0]}", choices=tuple(variants[1]), default=next(iter(variants[1])),
                            help=variants[2])
        tables = variants[1] if variants else {None: (exp.SIZES, exp.SIZE_DOCS)}
        seen = set()
        for value, (sizes, docs) in tables.items():
            for key, quick in sizes["quick"].items():
                if key in seen:
                    continue
                seen.add(key)
                where = {v: t for v, (t, _) in tables.items() if key in t["quick"]}
                values = "; ".join(f"--{variants[0]} {v}: quick {_shown(t['quick'][key])}, full {_shown(t['full'][key])}"
                                   for v, t in where.items()) if variants else None
                _size_option(ep, key, quick, sizes["full"][key], docs.get(key, key), values)
        ep.set_defaults(func=_cmd_experiment(name, command))
