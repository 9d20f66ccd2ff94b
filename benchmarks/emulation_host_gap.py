"""Where an emulated forward's time through the API goes beyond its kernels (needs a CUDA GPU).

    python benchmarks/emulation_host_gap.py [preset:fmt:mask:D ...]   (default: the cases below)

preset: naive, fa2 or paper (fadev's emulated forward, CUDA float64 in and out), or sdpa: PyTorch's
scaled_dot_product_attention on its flash backend with fmt's dtype in and out -- the same measurements of a real
kernel's call, so that what the host adds to one call on this machine can be read beside fadev's.

For each case (B 1, H 16, N 4096, after a warm-up call), five numbers, ms:
- api: CUDA events around one call, the median (min-max) of 9, as bench_emulation.py times it;
- preloaded: the same, with the GPU given 2e6 cycles of torch.cuda._sleep before the start event, so that the
  host's work before the first launch runs while the GPU is still busy: the call's GPU time alone, gaps between its
  kernels included;
- kernels: the GPU time of the call's kernels under torch.profiler (bench_emulation.py's), the median (min-max) of 5;
- host: perf_counter around one call on a pre-loaded GPU (the launches do not wait), the median of 9;
- queued: 9 calls back to back between one pair of events, per call (bench_emulation.py's queued_ms), as a training
  loop or a sweep queues them.
preloaded ~ kernels says the call's kernels run back to back; api - preloaded is then the host's time before the
first launch, exposed. Validated first: the pre-loaded call's outputs equal the plain call's bit for bit.
"""
import contextlib
import statistics
import sys
import time

import torch

import fadev
from bench_emulation import cuda_times, kernels_ms, queued_ms

CASES = ("naive:bf16:causal:64", "naive:bf16:plain:64", "paper:fp16:causal:64", "paper:bf16:plain:64",
         "sdpa:bf16:causal:64", "sdpa:bf16:plain:64")
PRESETS = ("naive", "fa2", "paper", "sdpa")
DTYPES = {"bf16": "bfloat16", "fp16": "float16"}


def spread(ms):
    return statistics.median(ms), min(ms), max(ms)


def host(fn):
    hs = []
    for _ in range(9):
        torch.cuda._sleep(int(2e6))
        t = time.perf_counter()
        fn()
        hs.append((time.perf_counter() - t) * 1e3)
        torch.cuda.synchronize()
    return statistics.median(hs)


def parse(case):
    """preset:fmt:mask:D -> (preset, fmt, causal, D)"""
    parts = case.split(":")
    if (len(parts) != 4 or parts[0] not in PRESETS or parts[1] not in DTYPES or parts[2] not in ("causal", "plain")
            or not parts[3].isdigit()):
        raise SystemExit(f"case {case!r}: expected preset:fmt:mask:D with preset one of {', '.join(PRESETS)}, fmt bf16 "
                         "or fp16, mask causal or plain, e.g. naive:bf16:causal:64")
    return parts[0], parts[1], parts[2] == "causal", int(parts[3])


def call(preset, fmt, causal, q, k, v):
    """(the case's call on float64 CUDA q, k, v, returning a tuple; the context it runs in): fadev's emulated forward
    (out and lse), or SDPA on its flash backend on fmt's dtype (the inputs cast once, the backend chosen once, both
    outside the timed call)."""
    if preset == "sdpa":
        from torch.nn.attention import SDPBackend, sdpa_kernel
        from torch.nn.functional import scaled_dot_product_attention
        dt = getattr(torch, DTYPES[fmt])
        q, k, v = (t.to(dt) for t in (q, k, v))
        return (lambda: (scaled_dot_product_attention(q, k, v, is_causal=causal),)), sdpa_kernel(
            SDPBackend.FLASH_ATTENTION)
    fwd = fadev.baseline_attention if preset == "naive" else fadev.flash_attention
    return (lambda: fwd(q, k, v, f"{preset}:{fmt}", causal=causal, return_lse=True)), contextlib.nullcontext()


def main(cases):
    cases = [parse(c) for c in cases]
    if not torch.cuda.is_available():
        raise SystemExit("emulation_host_gap.py needs a CUDA GPU (torch.cuda.is_available() is False)")
    print(torch.cuda.get_device_name(), torch.__version__, "B 1, H 16, N 4096; ms")
    for preset, fmt, causal, D in cases:
        case = f"{preset}:{fmt}:{'causal' if causal else 'plain'}:{D}"
        g = torch.Generator().manual_seed(1)
        q, k, v = (torch.randn(1, 16, 4096, D, generator=g, dtype=torch.float64).cuda() for _ in range(3))
        fn, context = call(preset, fmt, causal, q, k, v)
        with context:
            ref = fn()
            torch.cuda._sleep(int(2e6))
            again = fn()
            if not all(torch.equal(x, y) for x, y in zip(ref, again)):
                raise SystemExit(f"{case}: the pre-loaded call's outputs differ from the plain call's")
            a, b = spread(cuda_times(fn, 9)), spread(cuda_times(fn, 9, pre=2e6))
            kk = spread([kernels_ms(fn) for _ in range(5)])
            print(f"{case:24s} api {a[0]:.3f} ({a[1]:.3f}-{a[2]:.3f})  preloaded {b[0]:.3f} ({b[1]:.3f}-{b[2]:.3f})  "
                  f"kernels {kk[0]:.3f} ({kk[1]:.3f}-{kk[2]:.3f})  host {host(fn):.3f}  queued {queued_ms(fn, 9):.3f}")


if __name__ == "__main__":
    main(sys.argv[1:] or CASES)
