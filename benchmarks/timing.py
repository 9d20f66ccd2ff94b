"""Timing helpers shared by the benchmark programs (`python benchmarks/NAME.py` puts this folder on sys.path)."""
import time

import fadev


def best_seconds(fn, repeat):
    """Best wall time of `repeat` calls of fn() after one warm-up call."""
    fn()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def with_threads(n, fn):
    """fn() run with fadev.set_num_threads(n); the previous count is restored after."""
    old = fadev.get_num_threads()
    fadev.set_num_threads(n)
    try:
        return fn()
    finally:
        fadev.set_num_threads(old)
