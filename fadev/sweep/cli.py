"""The ``fadev sweep`` command: TOML configs of sweep points (fadev.sweep runs them), and the CLI's
shared argparse validator."""
from __future__ import annotations

import argparse
import os
import sys

from .executors import import_ray
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


def cluster_option(text):
    """argparse type of ``--cluster``: "local", "ray" or "ray=ADDRESS" -> sweep.run options
    {"executor", "address"}; "ray" without Ray installed is an error saying how to install it."""
    name, _, address = text.partition("=")
    if name == "local" and not address:
        return {"executor": "local"}
    if name != "ray" or (_ and not address):
        raise argparse.ArgumentTypeError(f"expected local, ray or ray=ADDRESS (auto, HOST:PORT, ray://HOST:PORT), "
                                         f"got {text!r}")
    try:
        import_ray()
    except ImportError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return {"executor": "ray", "address": address or None}


def positive_float(text):
    """argparse type: a number > 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {value}")
    return value


def add_cluster_options(sp):
    """--cluster [ray[=ADDRESS]] and --gpus-per-point (every command that sweeps takes them)."""
    sp.add_argument("--cluster", type=cluster_option, nargs="?", const="ray", default={"executor": "local"},
                    metavar="ray[=ADDRESS]",
                    help="run the points as Ray tasks: --cluster alone or ray starts a local Ray instance "
                         "(--workers CPUs); ray=auto joins the cluster of `ray start --head` on this machine, "
                         "ray=HOST:PORT or ray=ray://HOST:PORT another one (needs pip install 'fadev[ray]')")
    sp.add_argument("--gpus-per-point", type=positive_float, default=None, metavar="G",
                    help="with --cluster: GPUs each point on device cuda asks Ray for (default 1; 0.25: four "
                         "points share a GPU)")


def run_options(args):
    """sweep.run's executor options from parsed --cluster/--gpus-per-point; ValueError if misused."""
    options = dict(args.cluster)
    if args.gpus_per_point is not None:
        if options["executor"] != "ray":
            raise ValueError("--gpus-per-point needs --cluster ray")
        options["gpus_per_point"] = args.gpus_per_point
    return options


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
    add_cluster_options(sp)
    sp.add_argument("--no-progress", action="store_true", help="no progress bar")
    sp.add_argument("--dry-run", action="store_true", help="validate the points and print how many there are")
    sp.set_defaults(func=cmd_sweep)
    return sp


def cmd_sweep(args) -> int:
    try:
        points, options = load_config(args.config)
        canon = validate(points)
        cluster = run_options(args)
    except (OSError, ValueError) as e:
        print(f"fadev sweep: {e}", file=sys.stderr)
        return 2
    out = args.out or options.get("out") or os.path.join(
        "results", os.path.splitext(os.path.basename(args.config))[0] + ".jsonl")
    # on Ray, --workers alone sizes the chunks (default: the cluster's CPUs); [sweep] workers is for local runs
    workers = args.workers or (None if cluster["executor"] == "ray" else options.get("workers", 1))
    distinct = len({point_key(p) for p in canon})
    if args.dry_run:
        print(f"{len(points)} points ({distinct} distinct), all valid; results would go to {out}")
        return 0
    try:
        df = run(canon, out, workers=workers, progress=not args.no_progress, **cluster)
    except (OSError, ValueError, RuntimeError, ImportError) as e:
        print(f"fadev sweep: {e}", file=sys.stderr)
        return 1
    failed = int(df["error"].notna().sum()) if "error" in df.columns else 0
    print(f"{len(df)} rows in {out}" + (f"; {failed} points failed (column 'error'; a rerun retries them)"
                                        if failed else ""))
    return 1 if failed else 0


__all__ = ["load_config", "positive_int", "positive_float", "cluster_option", "add_cluster_options", "run_options",
           "add_subcommand", "cmd_sweep"]
