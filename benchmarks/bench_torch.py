"""What the PyTorch bridge (fadev.torch.attention) costs over calling fadev's kernels directly.

Direct: fadev.flash_attention / fadev.flash_attention_backward on float64 NumPy arrays (what the kernels
read). Bridge: fadev.torch.attention on float32 torch tensors, then out.backward(dout): the float32 ->
float64 copies, the autograd bookkeeping and the float64 -> float32 results. Validated first: the
bridge's output and gradients equal the direct results (fa2(bf16) values are exact in float32) bit for
bit. Then direct and bridge runs alternate, ``--repeats`` times each (50x more at N=16, which shows the
fixed per-call cost); the bridge's own time is each bridge call minus the kernel calls inside it.

    python benchmarks/bench_torch.py [--n 1024] [--repeats 9] [--threads N]
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


class KernelClock:
    """Times the kernel calls the bridge makes (fadev.torch._Kernel.forward / .backward wrap the same
    fadev.flash_attention / flash_attention_backward as the direct runs), so each bridge call splits into
    kernel time and bridge time. On a busy machine this is the steady figure: both parts come from the
    same call, while separate direct and bridge calls see different load."""

    def __init__(self):
        self.seconds = 0.0
        for name in ("forward", "backward"):
            setattr(ft._Kernel, name, self._wrap(getattr(ft._Kernel, name)))

    def _wrap(self, fn):
        def timed_call(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - t0
        return timed_call


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=1024, help="sequence length (B=1, H=4, D=64)")
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--threads", type=int, default=None, help="fadev worker threads (default: fadev's)")
    args = ap.parse_args()
    if args.threads:
        fadev.set_num_threads(args.threads)
    policy = fadev.Policy.fa2("bf16")
    print(f"# {platform.machine()}, {fadev.get_num_threads()} fadev threads, torch {torch.__version__}, "
          f"numpy {np.__version__}, policy {policy.name}, B=1 H=4 D=64, float32 tensors")
    clock = KernelClock()
    rows = []
    for n in (args.n, 16):
        arrays, tensors, dout = setup(n)
        validate(arrays, tensors, dout, policy)
        for backward in (False, True):
            t = {"direct": [], "bridge": [], "inside": []}
            direct(arrays, policy, backward)  # warm-up
            bridge(tensors, dout, policy, backward)
            for _ in range(args.repeats if n > 16 else 50 * args.repeats):
                t0 = time.perf_counter()
                direct(arrays, policy, backward)
                t1 = time.perf_counter()
                clock.seconds = 0.0
                bridge(tensors, dout, policy, backward)
                t["bridge"].append(time.perf_counter() - t1)
                t["direct"].append(t1 - t0)
                t["inside"].append(clock.seconds)
            extra = statistics.median(b - i for b, i in zip(t["bridge"], t["inside"]))
            rows.append((n, "forward+backward" if backward else "forward", t, extra))
    print("validated: bridge output and gradients equal the direct kernels' bit for bit\n")
    print("| N | pass | direct ms (best / median) | bridge ms (best / median) | kernels in bridge ms (best) | "
          "bridge / direct - 1 (best) | bridge's own time (median) | own time / direct (best) |")
    print("|---|---|---|---|---|---|---|---|")
    for n, what, t, extra in rows:
        best = {m: min(v) for m, v in t.items()}
        med = {m: statistics.median(v) for m, v in t.items()}
        print(f"| {n} | {what} | {1e3 * best['direct']:.3f} / {1e3 * med['direct']:.3f} | "
              f"{1e3 * best['bridge']:.3f} / {1e3 * med['bridge']:.3f} | {1e3 * best['inside']:.3f} | "
              f"{100 * (best['bridge'] / best['direct'] - 1):+.1f}% | {1e6 * extra:.0f} us | "
              f"{100 * extra / best['direct']:.2f}% |")
    print("(own time: each bridge call minus the kernel calls inside it; direct and bridge calls alternate)")

if __name__ == "__main__":
    main()
