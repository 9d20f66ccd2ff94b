"""What the PyTorch bridge (fadev.torch.attention) costs over calling fadev's kernels directly.

Direct: fadev.flash_attention / fadev.flash_attention_backward on float64 NumPy arrays (what the kernels
read). Bridge: fadev.torch.attention on float32 torch tensors, then out.backward(dout): the float32 ->
float64 copies, the autograd bookkeeping and the float64 -> float32 results. Validated first: the
bridge's output and gradients equal the direct results (fa2(bf16) values are exact in float32) bit for
bit. Then direct and bridge runs alternate, ``--repeats`` times each; the table shows the best and the
median time and the bridge's overhead on each.

    python benchmarks/bench_torch.py [--n 1024] [--repeats 7] [--threads N]
"""
import argparse
import platform
import statistics
import time

import numpy as np
import torch

import fadev
import fadev.torch as ft


def setup(n, heads=4, dim=64, seed=0):
    q, k, v = fadev.random_qkv((1, heads, n, dim), seed=seed, fmt="fp32")
    dout = fadev.round(np.random.default_rng(seed + 1).standard_normal(q.shape), "fp32")
    tensors = [torch.from_numpy(a).float().requires_grad_() for a in (q, k, v)]
    return (q, k, v, dout), tensors, torch.from_numpy(dout).float()


def direct(arrays, policy, backward):
    q, k, v, dout = arrays
    out, lse = fadev.flash_attention(q, k, v, policy, return_lse=True)
    if not backward:
        return out, None
    return out, fadev.flash_attention_backward(q, k, v, out, lse, dout, policy)


def bridge(tensors, dout, policy, backward):
    for t in tensors:
        t.grad = None
    out = ft.attention(*tensors, policy)
    if backward:
        out.backward(dout)
    return out, [t.grad for t in tensors] if backward else None


def validate(arrays, tensors, dout, policy):
    out, grads = direct(arrays, policy, True)
    out_t, grads_t = bridge(tensors, dout, policy, True)
    assert out_t.dtype == torch.float32 and np.array_equal(out_t.detach().double().numpy(), out)
    for g, g_t in zip(grads, grads_t):
        assert g_t.dtype == torch.float32 and np.array_equal(g_t.double().numpy(), g)


def timed(fn):
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=1024, help="sequence length (B=1, H=4, D=64)")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--threads", type=int, default=None, help="fadev worker threads (default: fadev's)")
    args = ap.parse_args()
    if args.threads:
        fadev.set_num_threads(args.threads)
    policy = fadev.Policy.fa2("bf16")
    print(f"# {platform.machine()}, {fadev.get_num_threads()} fadev threads, torch {torch.__version__}, "
          f"numpy {np.__version__}, policy {policy.name}")
    rows = []
    for n in (args.n, 16):
        arrays, tensors, dout = setup(n)
        validate(arrays, tensors, dout, policy)
        for backward in (False, True):
            times = {"direct": [], "bridge": []}
            direct(arrays, policy, backward)  # warm-up
            bridge(tensors, dout, policy, backward)
            for _ in range(args.repeats if n > 16 else 50 * args.repeats):
                times["direct"].append(timed(lambda: direct(arrays, policy, backward)))
                times["bridge"].append(timed(lambda: bridge(tensors, dout, policy, backward)))
            best = {m: min(t) for m, t in times.items()}
            med = {m: statistics.median(t) for m, t in times.items()}
            rows.append((n, "forward+backward" if backward else "forward", best, med))
    print("validated: bridge output and gradients equal the direct kernels' bit for bit\n")
    print("| N | pass | direct ms (best / median) | bridge ms (best / median) | overhead (best / median) | "
          "bridge - direct, median |")
    print("|---|---|---|---|---|---|")
    for n, what, best, med in rows:
        over = [100 * (x["bridge"] / x["direct"] - 1) for x in (best, med)]
        print(f"| {n} | {what} | {1e3 * best['direct']:.3f} / {1e3 * med['direct']:.3f} | "
              f"{1e3 * best['bridge']:.3f} / {1e3 * med['bridge']:.3f} | {over[0]:+.1f}% / {over[1]:+.1f}% | "
              f"{1e6 * (med['bridge'] - med['direct']):+.0f} us |")

if __name__ == "__main__":
    main()
