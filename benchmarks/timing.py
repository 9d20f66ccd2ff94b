"""Timing helpers shared by the benchmark programs (`python benchmarks/NAME.py` puts this folder on sys.path)."""
import statistics
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


def cuda_window_seconds(fn, calls):
    """Seconds a call when ``calls`` fn() calls are queued back to back between one pair of CUDA events."""
    import torch
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(calls):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / calls


def cuda_seconds(fn, repeat=5, window=5e-3):
    """Median GPU time of one fn() call in seconds (CUDA events), after a warm-up call. Each timed window holds
    enough back-to-back calls to last about ``window`` seconds (at most 20): a single call of a short kernel would
    also time the host's work in fn() (argument checks, output allocation) while the GPU waits for it, and that
    share swings with the host's load."""
    import torch
    fn()
    torch.cuda.synchronize()
    calls = int(min(20, max(1, window / cuda_window_seconds(fn, 1))))
    return statistics.median(cuda_window_seconds(fn, calls) for _ in range(repeat))
