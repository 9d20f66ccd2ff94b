"""Deviation metrics speed: fadev vs scipy.stats.wasserstein_distance and plain NumPy (validate first).

    python benchmarks/bench_metrics.py                  # n = 10^6 and 10^7
    python benchmarks/bench_metrics.py --sizes 1000000 --repeat 5

Rows:
  wasserstein fp64   normal data: fadev's sort path (NumPy's np.sort + the C core's O(n) quantile walk) vs scipy
  wasserstein bf16   the same data rounded to bf16: fadev's counting path (O(n + 2^16)) vs scipy
  compare w/o W1     the seven deviation statistics (compensated sums) vs NumPy's one-liners
                     (d = t - r; max|d|, mean, std, mean|d|, rmse, rel_l2, max_rel; plain sums)
fadev runs with 1 and with 2 worker threads; NumPy and scipy are single-threaded here. Times are the best
of --repeat runs (scipy: --scipy-repeat runs, it is slow) after one warm-up.
"""
import argparse

import numpy as np
import scipy.stats

import fadev
from fadev import _core
from timing import best_seconds, with_threads


def numpy_stats(t, r):
    d = t - r
    ad = np.abs(d)
    nz = r != 0
    return {"max_abs": ad.max(), "mean_diff": d.mean(), "std_diff": d.std(), "mean_abs": ad.mean(),
            "rmse": np.sqrt(np.mean(d * d)), "rel_l2": np.linalg.norm(d) / np.linalg.norm(r),
            "max_rel": np.max(ad[nz] / np.abs(r[nz]))}


def validate(a, b, a16, b16):
    """fadev == scipy to 1e-12 relative (both paths), stats == NumPy to 1e-12, same bits on 1 and 2 threads."""
    for x, y, method in ((a, b, "sort"), (a16, b16, "count")):
        assert fadev.metrics._wasserstein_method(x, y) == method, method
        want = scipy.stats.wasserstein_distance(x, y)
        one = with_threads(1, lambda: fadev.wasserstein(x, y))
        two = with_threads(2, lambda: fadev.wasserstein(x, y))
        assert one == two, f"{method}: thread count changed the result"
        assert abs(one - want) <= 1e-12 * want, f"{method}: fadev {one!r} != scipy {want!r}"
    got = with_threads(2, lambda: _core.deviation(a, b))
    assert got == with_threads(1, lambda: _core.deviation(a, b)), "thread count changed the statistics"
    for k, v in numpy_stats(a, b).items():
        assert abs(got[k] - v) <= 1e-12 * abs(v), f"{k}: fadev {got[k]!r} != NumPy {v!r}"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", type=int, nargs="+", default=[10**6, 10**7])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--scipy-repeat", type=int, default=1)
    args = ap.parse_args()
    print(f"{'n':>10} {'metric':<18} {'reference':<10} {'ref s':>8} {'fadev 1t s':>11} {'fadev 2t s':>11} "
          f"{'speed-up 2t':>11}")
    for n in args.sizes:
        rng = np.random.default_rng(n)
        a = rng.standard_normal(n)
        b = a + rng.standard_normal(n) * 1e-2 + 1e-3
        a16, b16 = fadev.round(a, "bf16"), fadev.round(b, "bf16")
        validate(a, b, a16, b16)
        rows = [
            ("wasserstein fp64", "scipy", lambda: scipy.stats.wasserstein_distance(a, b),
             lambda: fadev.wasserstein(a, b), args.scipy_repeat),
            ("wasserstein bf16", "scipy", lambda: scipy.stats.wasserstein_distance(a16, b16),
             lambda: fadev.wasserstein(a16, b16), args.scipy_repeat),
            ("compare w/o W1", "numpy", lambda: numpy_stats(a, b), lambda: _core.deviation(a, b), args.repeat),
        ]
        for name, ref_name, ref_fn, fadev_fn, ref_repeat in rows:
            t_ref = best_seconds(ref_fn, ref_repeat)
            t1 = with_threads(1, lambda: best_seconds(fadev_fn, args.repeat))
            t2 = with_threads(2, lambda: best_seconds(fadev_fn, args.repeat))
            print(f"{n:>10} {name:<18} {ref_name:<10} {t_ref:>8.3f} {t1:>11.3f} {t2:>11.3f} {t_ref / t2:>10.1f}x",
                  flush=True)


if __name__ == "__main__":
    main()
