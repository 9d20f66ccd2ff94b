"""Rounding throughput: fadev.round vs ml_dtypes/numpy round trips (validate first, then time).

    python benchmarks/bench_round.py            # 10^8 float64 values for bf16, 10^7 for the other formats
    python benchmarks/bench_round.py --n 1e7    # smaller

Throughput is bytes of float64 input per second, best of --repeat runs (after one warm-up, so the output
buffers' first-touch page faults are not what is measured). The ml_dtypes column is
`x.astype(ml_dtypes.T).astype(np.float64)`: the same values only for float32 sources, since ml_dtypes
rounds float64 through float32 (double rounding); fadev rounds float64 once.
"""
import argparse

import ml_dtypes
import numpy as np

import fadev
from timing import best_seconds

ML = {"bf16": ml_dtypes.bfloat16, "fp16": np.float16, "fp8_e4m3": ml_dtypes.float8_e4m3fn,
      "fp8_e5m2": ml_dtypes.float8_e5m2, "fp32": np.float32}


def same_bits(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    both_nan = np.isnan(a) & np.isnan(b)
    return bool(((a.view(np.uint64) == b.view(np.uint64)) | both_nan).all())


def validate(x):
    """fadev against single-rounding conversions, and the same bits on 1 and 2 threads."""
    x32 = x.astype(np.float32)
    for name, t in ML.items():
        want = x32.astype(t).astype(np.float64)
        assert same_bits(fadev.round(x32, name), want), f"float32 -> {name} differs from ml_dtypes/numpy"
        assert same_bits(fadev.round(x32.astype(np.float64), name), want), f"{name}: float64 path differs"
    assert same_bits(fadev.round(x, "fp16"), x.astype(np.float16)), "float64 -> fp16 differs from numpy"
    assert same_bits(fadev.round(x, "fp32"), x.astype(np.float32)), "float64 -> fp32 differs from numpy"
    for mode in ("rne", "rtz", "stochastic"):
        fadev.set_num_threads(1)
        one = fadev.round(x, "bf16", mode, seed=1)
        fadev.set_num_threads(2)
        assert same_bits(fadev.round(x, "bf16", mode, seed=1), one), f"{mode}: thread count changed bits"


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=float, default=1e8, help="float64 values for the bf16 rows (default 1e8)")
    ap.add_argument("--n-other", type=float, default=1e7, help="values for the other formats (default 1e7)")
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    n, n_other = int(args.n), int(args.n_other)
    rng = np.random.default_rng(0)
    # standard normals scaled over many binades, a few zeros, subnormals and overflows for the slow path
    x = rng.standard_normal(n) * np.exp2(rng.integers(-20, 21, n))
    x[:: 1000] = 0.0
    x[1:: 1000] = 1e-42
    x[2:: 1000] = 1e39
    with np.errstate(over="ignore", invalid="ignore"):  # the planted 1e39s overflow float32
        validate(x[: 2 * 10**6])
    print(f"validated: fadev == ml_dtypes/numpy on float32 sources, == numpy on float64 -> fp16/fp32, "
          f"bits independent of threads; {fadev.get_num_threads()} CPUs")

    rows = []

    def run(fmt, label, threads, fn, data):
        if threads:
            fadev.set_num_threads(threads)
        s = best_seconds(fn, args.repeat)
        rows.append((fmt, label, threads or "-", f"{data.size:.0e}", s * 1e3, data.nbytes / s / 1e9))

    for threads in (1, 2):
        run("bf16", "fadev rne", threads, lambda: fadev.round(x, "bf16"), x)
    with np.errstate(over="ignore"):
        run("bf16", "ml_dtypes astype", None, lambda: x.astype(ml_dtypes.bfloat16).astype(np.float64), x)
    x = None  # free its 800 MB before the next rows
    y = rng.standard_normal(n_other) * np.exp2(rng.integers(-8, 9, n_other))
    for name in ("fp32", "tf32", "fp16", "bf16", "fp8_e4m3", "fp8_e5m2"):
        for mode in ("rne", "rtz", "stochastic"):
            run(name, f"fadev {mode}", 2, lambda: fadev.round(y, name, mode), y)
        if name in ML:
            with np.errstate(over="ignore"):
                run(name, "ml_dtypes/numpy astype", None, lambda: y.astype(ML[name]).astype(np.float64), y)

    print(f"\n{'format':9} {'method':24} {'threads':>7} {'n':>6} {'ms':>9} {'GB/s':>7}")
    for fmt, label, threads, size, ms, gbs in rows:
        print(f"{fmt:9} {label:24} {threads!s:>7} {size:>6} {ms:9.1f} {gbs:7.2f}")


if __name__ == "__main__":
    main()
