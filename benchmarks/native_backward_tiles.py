"""The native backward per (D, N, causal): every wgmma tile (deterministic and atomic), mma.sync's first tile
(deterministic), and the defaults a user gets (fadev.torch_native.plan), beside SDPA flash and cuDNN; bf16, H 16.

    PYTHONPATH=. python benchmarks/native_backward_tiles.py [NxB,...]   (default 1024x16,4096x4,16384x1)

ms per backward (benchmarks/timing.py's cuda_seconds: windows of back-to-back calls between CUDA events, median)
and the ratio to SDPA flash and cuDNN in the same run. The 64 x 128 tile runs the producer / consumer kernel
(cuda/native_backward_tma_wgmma.cu); its "cp.async" lines are the same tile on the cp.async kernel
(FADEV_NATIVE_TMA_BWD=0): the same bits deterministic. Needs a CUDA GPU with compute capability 9.0 (the wgmma tiles) and fadev
built with FADEV_CUDA=1. Results: benchmarks/README.md, "The wgmma backward at D 128, the wgmma dq pass, strided
layouts" and "The backward's dK/dV kernel on a producer warpgroup"."""
import os
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import fadev
from fadev import native_tiles
from fadev import torch_native as tn
from timing import cuda_seconds

if not (torch.cuda.is_available() and fadev.cuda_available()):
    sys.exit("native_backward_tiles needs a CUDA GPU, PyTorch with CUDA and fadev built with FADEV_CUDA=1")
if torch.cuda.get_device_capability() != (9, 0):
    sys.exit("native_backward_tiles times the wgmma kernels: it needs compute capability 9.0 (H100, H200)")

def t(fn):
    """ms per call (timing.cuda_seconds: windows of back-to-back calls, so the host's time per call is hidden)."""
    return cuda_seconds(fn) * 1e3


print(torch.cuda.get_device_name(), torch.__version__)
spec = sys.argv[1] if len(sys.argv) > 1 else "1024x16,4096x4,16384x1"
shapes = [(int(n), int(b)) for n, b in (x.split("x") for x in spec.split(","))]
for D in (64, 128):
    for N, B in shapes:
        for causal in (False, True):
            g = torch.Generator(device="cuda").manual_seed(0)
            q, k, v, do = (torch.randn(B, 16, N, D, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(4))
            res = {}
            for name, be in (("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION)):
                qq, kk, vv = (x.clone().requires_grad_() for x in (q, k, v))
                with sdpa_kernel(be):
                    o = F.scaled_dot_product_attention(qq, kk, vv, is_causal=causal)
                    res[f"sdpa {name}"] = t(lambda: torch.autograd.grad(o, (qq, kk, vv), do, retain_graph=True))
            for bq, bk in native_tiles(D, backward=True, mma="wgmma"):
                for det in (True, False):
                    p = tn.plan(q, k, v, causal, None, False, None, None, bq, bk, det, "sync", "wgmma")
                    out, lse = tn.run_forward(p, q, k, v)
                    name = f"wgmma {bq}x{bk}{' det' if det else ''}"
                    res[name] = t(lambda: tn.run_backward(p, q, k, v, out, lse, do))
                    if (bq, bk) == (64, 128):  # the producer / consumer kernel's tile: the cp.async kernel too
                        os.environ["FADEV_NATIVE_TMA_BWD"] = "0"
                        res[name + " cp.async"] = t(lambda: tn.run_backward(p, q, k, v, out, lse, do))
                        del os.environ["FADEV_NATIVE_TMA_BWD"]
            bq, bk = native_tiles(D, backward=True, mma="sync")[0]
            p = tn.plan(q, k, v, causal, None, False, None, None, bq, bk, True, "sync", "sync")
            out, lse = tn.run_forward(p, q, k, v)
            res[f"sync {bq}x{bk} det"] = t(lambda: tn.run_backward(p, q, k, v, out, lse, do))
            p = tn.plan(q, k, v, causal)
            out, lse = tn.run_forward(p, q, k, v)
            res[f"defaults {p.mma[1]} {p.tiles[1]}"] = t(lambda: tn.run_backward(p, q, k, v, out, lse, do))
            print(f"## D {D} N {N} B {B} causal {causal}")
            for key, ms in res.items():
                flash, cudnn = res["sdpa flash"] / ms, res["sdpa cudnn"] / ms
                print(f"  {key:34s} {ms:8.3f} ms  {flash:5.2f}x flash  {cudnn:5.2f}x cudnn")
            sys.stdout.flush()
