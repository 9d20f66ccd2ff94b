"""GPU benchmark: validate, then time fadev's CUDA kernels against PyTorch on the same GPU, in one run.

    python benchmarks/gpu.py [--quick]

Prints one table (Markdown) with three parts:
  1. emulated-precision flash / baseline forward per preset (bit-checked against the CPU on a small case
     first), the issue's target row paper(bf16) flash at B=1, H=16, N=16384, D=64 (< 0.5 s);
  2. the native tensor-core kernel (fadev.native_attention) against torch SDPA's flash and cuDNN backends,
     forward and backward, bf16, TFLOP/s = 4 B H N^2 D / time (x2.5 for the backward), each validated
     against fp64 under FlashAttention's rule first: the best tile of each variant, the defaults as a user calls
     them (mma="auto"), and forward + backward through fadev.torch_native with its defaults;
  3. fp64 golden attention (fadev.golden_attention) against the rate of torch's fp64 matmul.
Needs torch with CUDA and a fadev built with FADEV_CUDA=1.
"""
import argparse
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import fadev
from fadev import torch_native
from fadev.monitor import reference_attention
from timing import cuda_seconds


def rows_table(rows):
    head = "| part | kernel | shape | causal | ms | rate | note |\n|---|---|---|---|---|---|---|"
    return "\n".join([head] + [f"| {' | '.join(str(c) for c in r)} |" for r in rows])


def validate_emulated():
    """GPU emulated kernels equal the CPU's bits on a small case, for every preset timed below."""
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, 2, 200, 64)) for _ in range(3))
    for pol in ("paper:bf16", "naive:bf16", "fa2:bf16", "fa1:fp16", "torch_math:bf16"):
        for fn in (fadev.flash_attention, fadev.baseline_attention):
            cpu = fn(q, k, v, pol)
            gpu = fn(q, k, v, pol, device="cuda")
            if not np.array_equal(cpu.view(np.uint64), gpu.view(np.uint64)):
                sys.exit(f"validation failed: {fn.__name__} {pol} GPU differs from CPU")


def emulated_rows(quick):
    rows = []
    N = 4096 if quick else 16384
    shapes = [(1, 16, N, 64)]
    dev = "cuda"
    for B, H, n, D in shapes:
        q, k, v = (torch.randn(B, H, n, D, dtype=torch.float64, device=dev) for _ in range(3))
        for pol in ("paper:bf16", "fa2:bf16", "naive:bf16", "fa1:fp16", "golden"):
            t = cuda_seconds(lambda: fadev.flash_attention(q, k, v, pol), repeat=1 if n > 8192 else 3)
            note = "target < 0.5 s" if pol == "paper:bf16" and n == 16384 and H == 16 else ""
            rows.append(("emulated", f"flash {pol}", f"{B}x{H}x{n}x{D}", "no", f"{t * 1e3:.0f}",
                         f"{4 * B * H * n * n * D / t / 1e12:.2f} TFLOP/s", note))
        nb = min(n, 8192)
        qb, kb, vb = (x[:, :, :nb] for x in (q, k, v))
        for pol in ("paper:bf16", "naive:bf16"):
            t = cuda_seconds(lambda: fadev.baseline_attention(qb, kb, vb, pol), repeat=1)
            rows.append(("emulated", f"baseline {pol}", f"{B}x{H}x{nb}x{D}", "no", f"{t * 1e3:.0f}",
                         f"{4 * B * H * nb * nb * D / t / 1e12:.2f} TFLOP/s", ""))
    return rows


def golden_fp64(q, k, v, causal):
    """fadev's fp64 reference attention (bottom-right causal, as the kernels)."""
    return reference_attention(q, k, v, is_causal=causal, align="bottom_right")


def native_rows(quick, backward=True):
    rows = []
    torch.backends.cuda.allow_fp16_bf16_reduction_math_sdp(True)
    Ns = (4096,) if quick else (4096, 16384)
    for D in (64, 128):
        for N in Ns:
            B, H = (4, 16) if N == 4096 else (1, 16)
            for causal in (False, True):
                q, k, v = (torch.randn(B, H, N, D, dtype=torch.bfloat16, device="cuda") for _ in range(3))
                flops = 4 * B * H * N * N * D / (2 if causal else 1)
                # validate on a slice: error vs fp64 <= 2x the bf16 naive baseline's
                qs, ks, vs = q[:1, :2, :1024], k[:1, :2, :1024], v[:1, :2, :1024]
                gold = golden_fp64(qs, ks, vs, causal)
                with sdpa_kernel(SDPBackend.MATH):
                    naive = F.scaled_dot_product_attention(qs, ks, vs, is_causal=causal)
                mine = fadev.native_attention(qs, ks, vs, causal=causal)
                e_mine = (mine.double() - gold).abs().max().item()
                e_naive = (naive.double() - gold).abs().max().item()
                ok = e_mine <= 2 * e_naive
                shape = f"{B}x{H}x{N}x{D}"
                best = {}  # variant -> (seconds, block_q, block_kv): the fastest tile of each variant
                variants = [(f"{w} rows/warp", dict(warp_rows=w, mma="sync")) for w in fadev.native.WARP_ROWS]
                if torch.cuda.get_device_capability() == (9, 0):  # Hopper's warpgroup MMA
                    variants.append(("wgmma", dict(mma="wgmma")))
                    mine_w = fadev.native_attention(qs, ks, vs, causal=causal, mma="wgmma")
                    e_mine = max(e_mine, (mine_w.double() - gold).abs().max().item())
                    ok = e_mine <= 2 * e_naive
                for label, kw in variants:
                    for bq, bkv in fadev.native_tiles(D, **kw):
                        t = cuda_seconds(lambda: fadev.native_attention(q, k, v, causal=causal, block_q=bq,
                                                                        block_kv=bkv, **kw))
                        if label not in best or t < best[label][0]:
                            best[label] = (t, bq, bkv)
                rates = {}
                for name, backend in (("sdpa flash", SDPBackend.FLASH_ATTENTION),
                                      ("sdpa cudnn", SDPBackend.CUDNN_ATTENTION)):
                    try:
                        with sdpa_kernel(backend):
                            t = cuda_seconds(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal))
                        rates[name] = flops / t
                        rows.append(("native", name, shape, "yes" if causal else "no", f"{t * 1e3:.2f}",
                                     f"{flops / t / 1e12:.0f} TFLOP/s", ""))
                    except RuntimeError as exc:  # a backend not available for this shape/GPU
                        rows.append(("native", name, shape, "yes" if causal else "no", "-", "-", str(exc)[:40]))
                for label, (t_native, bq, bkv) in best.items():
                    rate = flops / t_native
                    rows.append(("native", f"fadev native {bq}x{bkv}, {label}", shape,
                                 "yes" if causal else "no", f"{t_native * 1e3:.2f}", f"{rate / 1e12:.0f} TFLOP/s",
                                 f"{rate / rates.get('sdpa flash', float('nan')):.2f}x sdpa flash, "
                                 f"{rate / rates.get('sdpa cudnn', float('nan')):.2f}x cudnn; err {e_mine:.1e} vs "
                                 f"naive {e_naive:.1e} {'ok' if ok else 'FAILS 2x rule'}"))
                # defaults as a user calls them (mma="auto": its instruction and default tile), beside the best tiles
                mma = fadev.native.auto_mma(D)
                bq, bkv = fadev.native.fit_tile(D, mma=mma, causal=causal, seq_q=N)
                t_def = cuda_seconds(lambda: fadev.native_attention(q, k, v, causal=causal))
                rows.append(("native", f"fadev native defaults ({mma} {bq}x{bkv})", shape, "yes" if causal else "no",
                             f"{t_def * 1e3:.2f}", f"{flops / t_def / 1e12:.0f} TFLOP/s",
                             f"{flops / t_def / rates.get('sdpa flash', float('nan')):.2f}x sdpa flash, "
                             f"{flops / t_def / rates.get('sdpa cudnn', float('nan')):.2f}x cudnn"))
                if not backward:
                    continue
                # backward (2.5x the forward's flops: 5 matmuls of the 2 forward ones' size... as FA reports):
                # every backward tile with atomic dq (the fastest shown), then that tile deterministic
                qg, kg, vg = (x.detach().requires_grad_() for x in (q, k, v))
                out, lse = fadev.native_attention(q, k, v, causal=causal, return_lse=True)
                dout = torch.randn_like(out)
                best_b = {}  # variant -> (seconds, block_q, block_kv, its options)
                variants_b = [(f"{w} keys/warp", dict(warp_rows=w, mma="sync")) for w in fadev.native.WARP_ROWS]
                if torch.cuda.get_device_capability() == (9, 0):
                    variants_b.append(("wgmma", dict(mma="wgmma")))
                for label, kw in variants_b:
                    for bq, bkv in fadev.native_tiles(D, backward=True, **kw):
                        t = cuda_seconds(lambda: fadev.native_attention_backward(
                            q, k, v, out, lse, dout, causal=causal, block_q=bq, block_kv=bkv, deterministic=False,
                            **kw))
                        if label not in best_b or t < best_b[label][0]:
                            best_b[label] = (t, bq, bkv, kw)
                fastest = min(best_b, key=lambda w: best_b[w][0])
                t_b, bq, bkv, kw = best_b[fastest]
                t_det = cuda_seconds(lambda: fadev.native_attention_backward(
                    q, k, v, out, lse, dout, causal=causal, block_q=bq, block_kv=bkv, deterministic=True, **kw))
                with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                    o2 = F.scaled_dot_product_attention(qg, kg, vg, is_causal=causal)
                    t_sb = cuda_seconds(lambda: torch.autograd.grad(o2, (qg, kg, vg), dout, retain_graph=True))
                for label, (t_w, bq_w, bkv_w, _) in best_b.items():
                    rows.append(("native bwd", f"fadev native {bq_w}x{bkv_w}, {label}", shape,
                                 "yes" if causal else "no", f"{t_w * 1e3:.2f}", f"{2.5 * flops / t_w / 1e12:.0f} TFLOP/s",
                                 f"{t_sb / t_w:.2f}x sdpa flash bwd"))
                rows.append(("native bwd", f"fadev native {bq}x{bkv}, {fastest}, deterministic", shape,
                             "yes" if causal else "no", f"{t_det * 1e3:.2f}", f"{2.5 * flops / t_det / 1e12:.0f} TFLOP/s",
                             f"{t_b / t_det:.2f}x atomic; {t_sb / t_det:.2f}x sdpa flash bwd"))
                rows.append(("native bwd", "sdpa flash", shape, "yes" if causal else "no", f"{t_sb * 1e3:.2f}",
                             f"{2.5 * flops / t_sb / 1e12:.0f} TFLOP/s", ""))
                # the backward's defaults (mma="auto", deterministic), and forward + backward through the torch op
                mma = fadev.native.auto_mma(D, backward=True)
                bq, bkv = fadev.native.fit_tile(D, backward=True, mma=mma, causal=causal, seq_q=N)
                t_bd = cuda_seconds(lambda: fadev.native_attention_backward(q, k, v, out, lse, dout, causal=causal))
                rows.append(("native bwd", f"fadev native defaults ({mma} {bq}x{bkv}, deterministic)", shape,
                             "yes" if causal else "no", f"{t_bd * 1e3:.2f}", f"{2.5 * flops / t_bd / 1e12:.0f} TFLOP/s",
                             f"{t_sb / t_bd:.2f}x sdpa flash bwd"))
                with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                    t_sfb = cuda_seconds(lambda: torch.autograd.grad(
                        F.scaled_dot_product_attention(qg, kg, vg, is_causal=causal), (qg, kg, vg), dout))
                t_fb = cuda_seconds(lambda: torch.autograd.grad(
                    torch_native.native_attention(qg, kg, vg, is_causal=causal), (qg, kg, vg), dout))
                rows.append(("native fwd+bwd", "fadev.torch_native, defaults", shape, "yes" if causal else "no",
                             f"{t_fb * 1e3:.2f}", f"{3.5 * flops / t_fb / 1e12:.0f} TFLOP/s",
                             f"{t_sfb / t_fb:.2f}x sdpa flash fwd+bwd ({t_sfb * 1e3:.2f} ms)"))
                try:
                    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                        o3 = F.scaled_dot_product_attention(qg, kg, vg, is_causal=causal)
                        t_cb = cuda_seconds(lambda: torch.autograd.grad(o3, (qg, kg, vg), dout, retain_graph=True))
                    rows.append(("native bwd", "sdpa cudnn", shape, "yes" if causal else "no", f"{t_cb * 1e3:.2f}",
                                 f"{2.5 * flops / t_cb / 1e12:.0f} TFLOP/s", ""))
                except RuntimeError as exc:
                    rows.append(("native bwd", "sdpa cudnn", shape, "yes" if causal else "no", "-", "-",
                                 str(exc)[:40]))
    return rows


def golden_rows(quick):
    rows = []
    n = 4096 if quick else 8192
    a, b = (torch.randn(n, n, dtype=torch.float64, device="cuda") for _ in range(2))
    t_mm = cuda_seconds(lambda: a @ b)
    mm_rate = 2 * n ** 3 / t_mm
    rows.append(("golden", "torch fp64 matmul", f"{n}x{n}x{n}", "-", f"{t_mm * 1e3:.1f}",
                 f"{mm_rate / 1e12:.1f} TFLOP/s", "reference rate"))
    for N, D in ([(4096, 64), (4096, 128)] if quick else [(4096, 64), (4096, 128), (16384, 64), (16384, 128)]):
        B, H = 1, 16 if N == 4096 else 4
        q, k, v = (torch.randn(B, H, N, D, dtype=torch.float64, device="cuda") for _ in range(3))
        ref = golden_fp64(q[:, :1], k[:, :1], v[:, :1], False)
        got = fadev.golden_attention(q[:, :1], k[:, :1], v[:, :1])
        err = ((got - ref).abs().max() / ref.abs().max()).item()
        t = cuda_seconds(lambda: fadev.golden_attention(q, k, v), repeat=3)
        rate = 4 * B * H * N * N * D / t
        rows.append(("golden", "fadev golden (fp64 MMA)", f"{B}x{H}x{N}x{D}", "no", f"{t * 1e3:.1f}",
                     f"{rate / 1e12:.1f} TFLOP/s", f"{rate / mm_rate:.0%} of fp64 matmul; rel err {err:.1e}"))
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="smaller shapes (N = 4096 only)")
    ap.add_argument("--parts", default="emulated,native,golden", help="comma-separated parts to run "
                    "(emulated, native, native-forward: the native forward alone, golden)")
    args = ap.parse_args()
    if not fadev.cuda_available():
        sys.exit("no CUDA device: fadev.cuda_available() is False (build with FADEV_CUDA=1 on a GPU machine)")
    info = fadev.cuda_info()["devices"][0]
    print(f"# {info['name']} (sm_{info['capability'][0]}{info['capability'][1]}), torch {torch.__version__}, "
          f"{time.strftime('%Y-%m-%d')}")
    parts = args.parts.split(",")
    rows = []
    if "emulated" in parts:
        validate_emulated()
        rows += emulated_rows(args.quick)
    if "native" in parts or "native-forward" in parts:
        rows += native_rows(args.quick, backward="native" in parts)
    if "golden" in parts:
        rows += golden_rows(args.quick)
    print(rows_table(rows))


if __name__ == "__main__":
    main()
