"""The native forward's wgmma tiles (block_q 128: the producer / consumer TMA kernel; the others: the cp.async
kernel) beside SDPA's flash and cuDNN forward, and the default backward beside theirs, bf16, N 1k-16k, causal or not.
Kernel time: windows of 20 back-to-back calls (host time hidden behind the queue), median of 7.

    python benchmarks/native_tiles_gpu.py        (a Hopper GPU; PYTHONPATH at the root for an in-place build)
"""
import statistics

import torch
import torch.nn.functional as F
from torch.nn.attention import sdpa_kernel, SDPBackend
from fadev import torch_native as tn

def t(fn, calls=20, windows=7):
    for _ in range(3): fn()
    torch.cuda.synchronize()
    res = []
    for _ in range(windows):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(calls): fn()
        b.record(); torch.cuda.synchronize()
        res.append(a.elapsed_time(b) / calls)
    return statistics.median(res)

print(torch.cuda.get_device_name(), torch.__version__, flush=True)
shapes = [(8, 8, 4, 1024, 64), (8, 8, 8, 1024, 128), (4, 16, 16, 4096, 64), (4, 16, 16, 4096, 128),
          (1, 16, 16, 16384, 64), (1, 16, 16, 16384, 128)]
for (B, H, HK, N, D) in shapes:
    for causal in (False, True):
        g = torch.Generator(device="cuda").manual_seed(0)
        q = torch.randn(B, H, N, D, device="cuda", generator=g, dtype=torch.bfloat16)
        k, v = (torch.randn(B, HK, N, D, device="cuda", generator=g, dtype=torch.bfloat16) for _ in range(2))
        do = torch.randn_like(q)
        flops = 4 * B * H * N * N * D / (2 if causal else 1)
        kk, vv = (x.repeat_interleave(H // HK, 1) for x in (k, v))
        ref = {}
        for name, be in (("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION)):
            with sdpa_kernel([be]):
                ref[name] = t(lambda: F.scaled_dot_product_attention(q, kk, vv, is_causal=causal))
                qq, k2, v2 = (x.detach().clone().requires_grad_() for x in (q, kk, vv))
                o = F.scaled_dot_product_attention(qq, k2, v2, is_causal=causal)
                ref[name + "_b"] = t(lambda: torch.autograd.grad(o, (qq, k2, v2), do, retain_graph=True))
        line = (f"{B}x{H}/{HK}x{N}x{D} c={causal:d} fwd flash {ref['flash']:.3f} cudnn {ref['cudnn']:.3f} "
                f"bwd flash {ref['flash_b']:.3f} cudnn {ref['cudnn_b']:.3f}")
        for tile in ((128, 128), (128, 64), (64, 64), (64, 128)):
            p = tn.plan(q, k, v, causal, None, H != HK, block_q=tile[0], block_kv=tile[1], mma="wgmma")
            ms = t(lambda: tn.run_forward(p, q, k, v))
            line += (f" | {tile[0]}x{tile[1]} {ms:.3f} ({flops / ms / 1e9:.0f} TF, {ref['flash'] / ms:.2f}f "
                     f"{ref['cudnn'] / ms:.2f}c)")
        p = tn.plan(q, k, v, causal, None, H != HK)
        out, lse = tn.run_forward(p, q, k, v)
        bw = t(lambda: tn.run_backward(p, q, k, v, out, lse, do))
        line += (f" || default {p.tiles} bwd {bw:.3f} ({2.5 * flops / bw / 1e9:.0f} TF, {ref['flash_b'] / bw:.2f}f "
                 f"{ref['cudnn_b'] / bw:.2f}c)")
        print(line, flush=True)
