"""Attention forward speed and memory: fadev's emulated kernels vs plain NumPy attention (validate first).

    python benchmarks/bench_attention.py                 # B=1, H=4, N=2048, D=64; memory at N=32768
    python benchmarks/bench_attention.py --n 1024 --mem-n 8192

NumPy attention is two matmuls and a softmax (scale Q K^T, max, exp, sum, divide, P V) in float32 or
float64, with BLAS on all cores. fadev rounds every intermediate per its policy (fa2("bf16"): bf16
inputs and P, fp32 everything else, exp2 form, 128 x 64 tiles; paper("bf16"): every stored tensor in
bf16, fp32 accumulators; golden: fp64). Times are the best of --repeat runs after one warm-up.
Flash's peak memory is measured in a fresh subprocess (Linux: VmHWM reset through /proc/self/clear_refs
before the call, minus VmRSS then; out is part of it), next to what
materialising the N x N scores in float64 would take.
"""
import argparse
import json
import math
import os
import subprocess
import sys

import numpy as np

import fadev
from timing import best_seconds


def numpy_attention(q, k, v):
    s = (q @ np.swapaxes(k, -1, -2)) * q.dtype.type(1.0 / math.sqrt(q.shape[-1]))
    e = np.exp(s - s.max(-1, keepdims=True))
    return (e / e.sum(-1, keepdims=True)) @ v


def validate(q, k, v):
    """Golden flash == golden baseline to fp64 accuracy, both == NumPy float64, bf16 results finite and
    within bf16 error of golden, and the same bits on 1 and 2 threads."""
    golden_base = fadev.baseline_attention(q, k, v, "golden")
    golden_flash = fadev.flash_attention(q, k, v, "golden")
    scale = np.max(np.abs(golden_base))
    assert np.max(np.abs(golden_flash - golden_base)) <= 1e-13 * scale, "golden flash != golden baseline"
    assert np.max(np.abs(numpy_attention(q, k, v) - golden_base)) <= 1e-13 * scale, "golden != NumPy float64"
    for preset in ("fa2:bf16", "paper:bf16"):
        out = fadev.flash_attention(q, k, v, preset)
        assert np.isfinite(out).all(), f"{preset}: non-finite output"
        assert np.max(np.abs(out - golden_base)) <= 0.05 * scale, f"{preset}: far from golden"
    small = tuple(t[:, :1, :256] for t in (q, k, v))
    threads = fadev.get_num_threads()
    try:
        fadev.set_num_threads(1)
        one = fadev.flash_attention(*small, "fa2:bf16")
        fadev.set_num_threads(2)
        assert np.array_equal(one, fadev.flash_attention(*small, "fa2:bf16")), "thread count changed bits"
    finally:
        fadev.set_num_threads(threads)


MEMORY_CHILD = """
import json, sys, time
import numpy as np, fadev

def status_kib(key):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(key + ":"))

n, d, policy = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
q, k, v = fadev.random_qkv((1, 1, n, d), seed=0)
with open("/proc/self/clear_refs", "w") as f:  # reset the peak (VmHWM) to the current RSS
    f.write("5")
before = status_kib("VmRSS")
t0 = time.perf_counter()
out = fadev.flash_attention(q, k, v, policy)
seconds = time.perf_counter() - t0
peak = status_kib("VmHWM")
assert np.isfinite(out).all()
print(json.dumps({"before_kib": before, "peak_kib": peak, "seconds": seconds}))
"""


def flash_memory(n, d, policy):
    env = dict(os.environ)
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = here + os.pathsep + env.get("PYTHONPATH", "")
    res = subprocess.run([sys.executable, "-c", MEMORY_CHILD, str(n), str(d), policy], capture_output=True,
                         text=True, env=env, check=True)
    return json.loads(res.stdout.strip().splitlines()[-1])


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--n", type=int, default=2048)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--mem-n", type=int, default=32768, help="sequence length of the memory run (0: skip)")
    ap.add_argument("--mem-policy", default="fa2:bf16")
    args = ap.parse_args()
    shape = (args.batch, args.heads, args.n, args.dim)
    q, k, v = fadev.random_qkv(shape, seed=0)
    validate(q, k, v)
    print(f"validated: golden flash == golden baseline == NumPy float64 (<= 1e-13 rel), fa2/paper bf16 finite "
          f"and near golden, bits independent of threads; {fadev.get_num_threads()} threads, shape {shape}")

    q32, k32, v32 = (t.astype(np.float32) for t in (q, k, v))
    t_np32 = best_seconds(lambda: numpy_attention(q32, k32, v32), args.repeat)
    t_np64 = best_seconds(lambda: numpy_attention(q, k, v), args.repeat)
    rows = [
        ("fadev flash fa2(bf16)", best_seconds(lambda: fadev.flash_attention(q, k, v, "fa2:bf16"), args.repeat),
         "NumPy float32", t_np32, 3),
        ("fadev flash paper(bf16)", best_seconds(lambda: fadev.flash_attention(q, k, v, "paper:bf16"), args.repeat),
         "NumPy float32", t_np32, 10),
        ("fadev baseline golden", best_seconds(lambda: fadev.baseline_attention(q, k, v, "golden"), args.repeat),
         "NumPy float64", t_np64, 2),
        ("fadev flash golden", best_seconds(lambda: fadev.flash_attention(q, k, v, "golden"), args.repeat),
         "NumPy float64", t_np64, None),
        ("fadev baseline naive(bf16)",
         best_seconds(lambda: fadev.baseline_attention(q, k, v, "naive:bf16"), args.repeat), "NumPy float32",
         t_np32, None),
    ]
    print(f"\n{'kernel':28} {'ms':>8}   {'vs':14} {'ms':>8} {'ratio':>6} {'target':>7}")
    for name, t, ref_name, t_ref, target in rows:
        goal = f"<= {target}x" if target else "-"
        print(f"{name:28} {t * 1e3:8.1f}   {ref_name:14} {t_ref * 1e3:8.1f} {t / t_ref:6.2f} {goal:>7}")

    if args.mem_n:
        n, d = args.mem_n, args.dim
        r = flash_memory(n, d, args.mem_policy)
        growth = (r["peak_kib"] - r["before_kib"]) / 1024
        inputs = 3 * n * d * 8 / 2**20
        print(f"\nflash {args.mem_policy} memory, B=1 H=1 N={n} D={d}: peak RSS growth during the call "
              f"{growth:.1f} MiB (inputs q, k, v: {inputs:.1f} MiB; out: {n * d * 8 / 2**20:.1f} MiB; "
              f"N x N float64 scores would be {n * n * 8 / 2**30:.1f} GiB); {r['seconds']:.1f} s")


if __name__ == "__main__":
    main()
