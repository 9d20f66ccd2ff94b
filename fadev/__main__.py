"""fadev's command line: ``python -m fadev SUBCOMMAND`` (or the ``fadev`` script).

Subcommands:
  demo   round a fixed random sample to every built-in format and print its deviation from the fp64
         original (max |d|, max relative, RMSE, relative L2, Wasserstein-1).
  sweep  run a parameter sweep from a TOML config, one row per point appended to a results file
         (resumable; see fadev/sweep/).
  reproduce  run the reproduction of Golden et al. (arXiv 2405.02803): experiments, figures, report.md;
         precision, seqlen, algorithm, attribution, kernels, fp8, ring, train-drift run one experiment
         each (fadev/experiments/, one module per experiment).

Each subcommand is a function ``cmd_NAME(args) -> int`` registered in :func:`build_parser`.
"""
from __future__ import annotations

import argparse
import sys

import numpy as np

import fadev

from .experiments.cli import add_subcommands as add_experiments
from .sweep.cli import add_subcommand as add_sweep


def _sample(n: int, seed: int) -> np.ndarray:
    """The demo input: standard normal values, a tenth of them scaled into a heavy tail (x 2^k,
    |k| <= 12) so that the narrow formats' subnormals and overflow show up in the table."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(n)
    tail = rng.random(n) < 0.1
    x[tail] *= np.exp2(rng.integers(-12, 13, tail.sum()))
    return x


def cmd_demo(args) -> int:
    x = _sample(args.n, args.seed)
    print(f"fadev {fadev.__version__}: {args.n} values (seed {args.seed}; standard normal, 10% scaled by 2^-12..2^12)"
          f" rounded with mode={args.mode!r}, compared with the fp64 original\n")
    header = f"{'format':9} {'p':>3} {'range':>21} {'max_abs':>10} {'max_rel':>10} {'rmse':>10} {'rel_l2':>10} " \
             f"{'wasserstein':>11} {'nan/inf':>7}"
    print(header)
    print("-" * len(header))
    for name, fmt in fadev.formats.items():
        y = fadev.round(x, fmt, args.mode, seed=args.seed)
        finite = np.isfinite(y)  # overflow (inf, or NaN in fp8_e4m3) is counted, not averaged
        c = fadev.compare(y[finite], x[finite])
        span = f"[{fmt.smallest_subnormal:.1e}, {fmt.largest:.1e}]"
        print(f"{name:9} {fmt.precision:3d} {span:>21} {c.max_abs:10.3e} {c.max_rel:10.3e} {c.rmse:10.3e} "
              f"{c.rel_l2:10.3e} {c.wasserstein:11.3e} {int((~finite).sum()):7d}")
    print("\nmetrics over the elements that stay finite; nan/inf counts those that overflow (fp8_e4m3 has no inf:"
          " NaN).\nmax_rel <= u = 2^-p inside a format's normal range; 1.0 means a value underflowed to 0.")
    return 0


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fadev", description="Numerical deviation of attention kernels.")
    parser.add_argument("--version", action="version", version=f"fadev {fadev.__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    demo = sub.add_parser("demo", help="round a random sample to every built-in format; print metrics vs fp64")
    demo.add_argument("--n", type=_positive_int, default=10_000, help="sample size (default 10000)")
    demo.add_argument("--seed", type=int, default=0, help="sample seed, also the stochastic-rounding seed")
    demo.add_argument("--mode", default="rne", choices=["rne", "rtz", "stochastic"], help="rounding mode")
    demo.set_defaults(func=cmd_demo)

    add_sweep(sub)  # sweep: run a TOML parameter sweep (fadev/sweep/)

    add_experiments(sub)  # reproduce + one per experiment (fadev/experiments/)
    return parser


def dashed(argv) -> list:
    """``argv`` with every long option's name in fadev's one flag style, dashes (``--log_every`` ->
    ``--log-every``, ``--gpus_per_point=2`` -> ``--gpus-per-point=2``): underscores are accepted as aliases.
    Values, positional arguments and everything after ``--`` are left as they are."""
    out = []
    for i, arg in enumerate(argv):
        if arg == "--":
            return out + list(argv[i:])
        if arg.startswith("--"):
            name, eq, value = arg.partition("=")
            arg = name.replace("_", "-") + eq + value
        out.append(arg)
    return out


def main(argv=None) -> int:
    args = build_parser().parse_args(dashed(sys.argv[1:] if argv is None else argv))
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
