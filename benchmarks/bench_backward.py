"""Attention backward speed: fadev's flash backward against its own flash forward (validate first).

    python benchmarks/bench_backward.py                  # B=1, H=4, D=64, N = 1024 and 2048; memory at 16384
    python benchmarks/bench_backward.py --n 512 1024 --repeat 5 --mem-n 0

The target is fa2("bf16") flash backward <= 3x the same-size flash forward (FlashAttention-2's backward
does about 2.5x the forward's matmul work: it recomputes S and P and adds dP, dV, dK, dQ). fadev rounds
every intermediate per its policy (fa2: bf16 inputs, P and dS, fp32 everything else, exp2, 128 x 64
tiles; paper: every stored tensor bf16, fp32 accumulators, 64 x 64; golden: fp64). Validated first:
golden flash == golden baseline == NumPy float64 gradients (<= 1e-12 relative), the bf16 gradients
finite and near golden, the same bits on 1 and 2 threads. Times are the best of --repeat runs after a
warm-up; the forward is timed with return_lse=True (what a training step saves). The backward's peak
memory is measured in a fresh subprocess (growth of the peak resident set during the call, Linux).
"""
import argparse
import json
import math
import os
import subprocess
import sys
import tempfile

import numpy as np

import fadev
from timing import best_seconds


def numpy_backward(q, k, v, dout):
    """Plain float64 attention gradients with BLAS matmuls (B, H, N, D), no grouping, no mask."""
    scale = 1.0 / math.sqrt(q.shape[-1])
    s = scale * (q @ np.swapaxes(k, -1, -2))
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    dv = np.swapaxes(p, -1, -2) @ dout
    dp = dout @ np.swapaxes(v, -1, -2)
    ds = p * (dp - (dp * p).sum(-1, keepdims=True))
    return scale * (ds @ k), scale * (np.swapaxes(ds, -1, -2) @ q), dv


def rel(a, b):
    return np.max(np.abs(a - b)) / np.max(np.abs(b))


def validate(q, k, v, dout):
    out, lse = fadev.baseline_attention(q, k, v, "golden", return_lse=True)
    base = fadev.baseline_attention_backward(q, k, v, out, lse, dout, "golden")
    out, lse = fadev.flash_attention(q, k, v, "golden", return_lse=True)
    flash = fadev.flash_attention_backward(q, k, v, out, lse, dout, "golden")
    for name, b, f, n in zip("qkv", base, flash, numpy_backward(q, k, v, dout)):
        assert rel(f, b) <= 1e-12, f"golden flash d{name} != golden baseline"
        assert rel(b, n) <= 1e-12, f"golden baseline d{name} != NumPy float64"
    for preset in ("fa2:bf16", "paper:bf16"):
        out, lse = fadev.flash_attention(q, k, v, preset, return_lse=True)
        for name, g, b in zip("qkv", fadev.flash_attention_backward(q, k, v, out, lse, dout, preset), base):
            assert np.isfinite(g).all(), f"{preset}: non-finite d{name}"
            assert rel(g, b) <= 0.05, f"{preset}: d{name} far from golden"
    small = [t[:, :1, :256] for t in (q, k, v, dout)]
    out, lse = fadev.flash_attention(*small[:3], "fa2:bf16", return_lse=True)
    threads = fadev.get_num_threads()
    try:
        runs = []
        for n in (1, 2):
            fadev.set_num_threads(n)
            runs.append(fadev.flash_attention_backward(*small[:3], out, lse, small[3], "fa2:bf16"))
        assert all(np.array_equal(a, b) for a, b in zip(*runs)), "thread count changed bits"
    finally:
        fadev.set_num_threads(threads)


MEMORY_CHILD = """
import json, sys, time
import numpy as np, fadev

def peak_kib():  # VmHWM: the peak resident set since the last reset (ru_maxrss would count the parent's)
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmHWM:"))

saved = np.load(sys.argv[1])
q, k, v, out, lse, dout = (saved[name] for name in ("q", "k", "v", "out", "lse", "dout"))
with open("/proc/self/clear_refs", "w") as refs:
    refs.write("5")  # reset the peak to the current resident set
before = peak_kib()
t0 = time.perf_counter()
grads = fadev.flash_attention_backward(q, k, v, out, lse, dout, sys.argv[2])
seconds = time.perf_counter() - t0
after = peak_kib()
assert all(np.isfinite(g).all() for g in grads)
print(json.dumps({"before_kib": before, "after_kib": after, "seconds": seconds}))
"""


def backward_memory(n, d, policy):
    """Peak RSS growth of one backward call in a fresh process that only loaded its inputs (the forward
    runs here, so its own peak does not hide the backward's)."""
    q, k, v = fadev.random_qkv((1, 1, n, d), seed=0)
    out, lse = fadev.flash_attention(q, k, v, policy, return_lse=True)
    dout = np.random.default_rng(1).standard_normal(q.shape)
    env = dict(os.environ)
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = here + os.pathsep + env.get("PYTHONPATH", "")
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "inputs.npz")
        np.savez(path, q=q, k=k, v=v, out=out, lse=lse, dout=dout)
        res = subprocess.run([sys.executable, "-c", MEMORY_CHILD, path, policy], capture_output=True, text=True,
                             env=env, check=True)
    return json.loads(res.stdout.strip().splitlines()[-1])


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--n", type=int, nargs="+", default=[1024, 2048])
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--mem-n", type=int, default=16384, help="sequence length of the memory run (0: skip)")
    ap.add_argument("--mem-policy", default="fa2:bf16")
    args = ap.parse_args()
    shape = (args.batch, args.heads, min(args.n), args.dim)
    q, k, v = fadev.random_qkv(shape, seed=0)
    validate(q, k, v, np.random.default_rng(1).standard_normal(shape))
    print(f"validated: golden flash == golden baseline == NumPy float64 gradients (<= 1e-12 rel), fa2/paper bf16 "
          f"finite and near golden, bits independent of threads; {fadev.get_num_threads()} threads, shape {shape}")

    print(f"\n{'policy':12} {'N':>6} {'forward ms':>11} {'backward ms':>12} {'ratio':>6} {'target':>7}")
    for n in args.n:
        shape = (args.batch, args.heads, n, args.dim)
        q, k, v = fadev.random_qkv(shape, seed=0)
        dout = np.random.default_rng(1).standard_normal(shape)
        for policy, target in (("fa2:bf16", 3), ("paper:bf16", None), ("golden", None)):
            out, lse = fadev.flash_attention(q, k, v, policy, return_lse=True)
            t_f = best_seconds(lambda: fadev.flash_attention(q, k, v, policy, return_lse=True), args.repeat)
            t_b = best_seconds(lambda: fadev.flash_attention_backward(q, k, v, out, lse, dout, policy), args.repeat)
            goal = f"<= {target}x" if target else "-"
            print(f"{policy:12} {n:6} {t_f * 1e3:11.1f} {t_b * 1e3:12.1f} {t_b / t_f:6.2f} {goal:>7}")

    if args.mem_n:
        n, d = args.mem_n, args.dim
        r = backward_memory(n, d, args.mem_policy)
        growth = (r["after_kib"] - r["before_kib"]) / 1024
        array = n * d * 8 / 2**20
        print(f"\nflash backward {args.mem_policy} memory, B=1 H=1 N={n} D={d}: peak RSS growth during the call "
              f"{growth:.1f} MiB (one float64 (N, D) array: {array:.1f} MiB, dq, dk, dv: {3 * array:.1f} MiB; "
              f"N x N float64 would be {n * n * 8 / 2**30:.1f} GiB); {r['seconds']:.1f} s")


if __name__ == "__main__":
    main()
