"""The ``fadev sweep`` command: TOML configs of sweep points (fadev.sweep runs them), and the CLI's
shared argparse validator."""
from __future__ import annotations

import argparse
import os
import sys

from .running import run
from .schema import PARAMS, expand, point_key, validate


def load_config(path):
    """(points, options) from a TOML config: ``[base]`` fixed parameters, ``[grid]`` lists (cartesian
    product), ``[[points]]`` explicit points (each combined with the grid), ``[sweep]`` options ``out``
    and ``workers``. Points are validated by :func:`run`."""
    try:
        import tomllib
    except ImportError:  # Python 3.10
        try:
            import tomli as tomllib
        except ImportError:
            raise ImportError("reading TOML configs needs Python >= 3.11 (tomllib) or the tomli package") from None
    with open(path, "rb") as fh:
        try:
            cfg = tomllib.load(fh)
        except tomllib.TOMLDecodeError as e:
            raise ValueError(f"{path}: not valid TOML: {e}") from None
    unknown = set(cfg) - {"base", "grid", "points", "sweep"}
    if unknown:
        raise ValueError(f"{path}: unknown top-level key(s) {', '.join(sorted(unknown))}; expected [base], [grid], "
                         f"[[points]], [sweep]")
    options = dict(cfg.get("sweep", {}))
    bad = set(options) - {"out", "workers"}
    if bad:
        raise ValueError(f"{path}: unknown [sweep] option(s) {', '.join(sorted(bad))}; known: out, workers")
    return expand(cfg.get("grid"), cfg.get("points"), cfg.get("base")), options


def positive_int(text):
    """argparse type: a positive integer (the fadev CLI's one validator for counts)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def add_subcommand(subparsers):
    """Register ``sweep`` on an argparse subparsers object (fadev/__main__.py calls this)."""
    sp = subparsers.add_parser(
        "sweep", help="run a parameter sweep from a TOML config; rows appended to a results file",
        description="Run every point of CONFIG (TOML: [base] fixed parameters, [grid] lists combined as a "
                    "cartesian product, [[points]] explicit points, [sweep] out/workers defaults). Each point's "
                    "row is appended to the results file as it finishes; rerunning skips finished points. "
                    "Parameters: " + ", ".join(PARAMS) + ", stage.NAME, ref_stage.NAME, tag.NAME.")
    sp.add_argument("config", metavar="CONFIG.toml", help="sweep configuration (see examples/sweep_example.toml)")
    sp.add_argument("--out", help="results file, .jsonl or .csv (default: [sweep] out in the config, else "
                                  "results/CONFIG_NAME.jsonl)")
    sp.add_argument("--workers", type=positive_int, help="worker processes (default: [sweep] workers, else 1)")
    sp.add_argument("--no-progress", action="store_true", help="no progress bar")
    sp.add_argument("--dry-run", action="store_true", help="validate the points and print how many there are")
    sp.set_defaults(func=cmd_sweep)
    return sp


def cmd_sweep(args) -> int:
    try:
        points, options = load_config(args.config)
        canon = validate(points)
    except (OSError, ValueError) as e:
        print(f"fadev sweep: {e}", file=sys.stderr)
        return 2
    out = args.out or options.get("out") or os.path.join(
        "results", os.path.splitext(os.path.basename(args.config))[0] + ".jsonl")
    workers = args.workers or options.get("workers", 1)
    distinct = len({point_key(p) for p in canon})
    if args.dry_run:
        print(f"{len(points)} points ({distinct} distinct), all valid; results would go to {out}")
        return 0
    try:
        df = run(canon, out, workers=workers, progress=not args.no_progress)
    except (OSError, ValueError, RuntimeError) as e:
        print(f"fadev sweep: {e}", file=sys.stderr)
        return 1
    print(f"{len(df)} rows in {out}")
    return 0


__all__ = ["load_config", "positive_int", "add_subcommand", "cmd_sweep"]
