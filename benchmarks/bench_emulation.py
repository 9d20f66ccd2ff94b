"""The emulated presets' speed: fa2, paper, naive x bf16, fp16, forward and backward (validate, then time).

    python benchmarks/bench_emulation.py --device cpu     # B 1, H 4, N 1024, D 64; ratios to NumPy fp32 attention
    python benchmarks/bench_emulation.py --device cuda    # B 1, H 16, N 4096, D 64; TFLOP/s beside fp32 SIMT matmul
    python benchmarks/bench_emulation.py --device cuda --step   # and the Llama training step (sdpa, native, fa2, paper)

(fadev importable: an installed build, or PYTHONPATH=. for an in-place one.) naive runs fadev's baseline
(materialised) kernel, fa2 and paper its flash kernel with the preset's tiles.

--device cpu: ms of forward and of forward + backward (best of --repeat after a warm-up, fadev on all its threads),
each divided by the forward time of NumPy fp32 attention (scores = q @ k.T * scale, softmax, @ v, in float32, BLAS
on all cores) on the same q, k, v; and the same calls with the fast paths off (``_core._set_fast_paths(False)``:
the generic code every fast path must equal). Validated first: on a smaller problem the fast and generic paths
give the same bits for every preset and format, forward and backward, and every output is finite and within the
format's error of the fp64 answer.

--device cuda: TFLOP/s of forward and backward per preset and format (forward 4 B H N^2 D flops, backward 10 B H N^2
D, halved when causal), CUDA float64 tensors in and out through fadev's public API, median of --repeat
torch.cuda.Event timings after a warm-up, beside the fp32 SIMT matrix product (torch.matmul on float32 with
torch.backends.cuda.matmul.allow_tf32 = False, 2 n^3 flops) measured in the same run; "kernels" is the GPU's time in
the call's kernels alone (torch.profiler, run after every other timing: CUPTI stays attached once a profiler ran,
and later launches may cost more host time), the rest of the call's time being the GPU waiting for the host. Validated
first: on a small problem the GPU's outputs equal the CPU's bit for bit (any NaN equal to any NaN, docs/numerics.md
"GPU").
--tiled adds the forward on the kernel the warp kernel replaced (FADEV_EMU_WARP=0: cuda/emu_forward_fast.cu's tiled
kernel), timed in the same run, and the speed-up over it.
"""
import argparse
import functools
import math
import os
import sys
import time

import numpy as np

import fadev
from fadev import _core
from timing import best_seconds, cuda_window_seconds

PRESETS = ("fa2", "paper", "naive")
FORMATS = ("bf16", "fp16")


def kernels(preset):
    """(forward, backward) fadev functions of a preset: the baseline for naive, flash for the others."""
    if preset == "naive":
        return fadev.baseline_attention, fadev.baseline_attention_backward
    return fadev.flash_attention, fadev.flash_attention_backward


def problem(B, H, Hkv, N, D, seed=0):
    q, k, v = fadev.random_qkv((B, H, N, D), seed=seed, heads_kv=Hkv)
    dout = np.random.default_rng(seed + 1).standard_normal(q.shape)
    return q, k, v, dout


def run(preset, fmt, q, k, v, dout, causal, backward=True, device=None):
    fwd, bwd = kernels(preset)
    pol = f"{preset}:{fmt}"
    kw = {} if device is None else {"device": device}
    out, lse = fwd(q, k, v, pol, causal=causal, return_lse=True, **kw)
    grads = bwd(q, k, v, out, lse, dout, pol, causal=causal, **kw) if backward else ()
    return (out, lse) + tuple(grads)


def describe(args):
    causal = ", causal" if args.causal else ""
    return f"B {args.batch}, H {args.heads}/{args.heads_kv}, N {args.n}, D {args.dim}{causal}"


def same(a, b):
    a, b = (np.asarray(x, np.float64) for x in (a, b))
    return a.shape == b.shape and bool(((a.view(np.uint64) == b.view(np.uint64)) | (np.isnan(a) & np.isnan(b))).all())


# ------------------------------------------------------------------ CPU


def numpy_attention(q, k, v, causal):
    s = (q @ np.swapaxes(k, -1, -2)) * q.dtype.type(1.0 / math.sqrt(q.shape[-1]))
    if causal:
        n, m = s.shape[-2:]
        s = np.where(np.arange(m)[None, :] <= np.arange(n)[:, None] + (m - n), s, q.dtype.type(-np.inf))
    e = np.exp(s - s.max(-1, keepdims=True))
    return (e / e.sum(-1, keepdims=True)) @ v


def validate_cpu(causal, Hkv_ratio):
    q, k, v, dout = problem(1, 2, max(1, 2 // Hkv_ratio), 160, 40, seed=5)
    golden = fadev.baseline_attention(q, k, v, "golden", causal=causal)
    for preset in PRESETS:
        for fmt in FORMATS:
            old = _core._set_fast_paths(True)
            try:
                fast = run(preset, fmt, q, k, v, dout, causal)
                _core._set_fast_paths(False)
                generic = run(preset, fmt, q, k, v, dout, causal)
            finally:
                _core._set_fast_paths(old)
            for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), fast, generic):
                if not same(a, b):
                    sys.exit(f"validation failed: {preset}:{fmt} {name}: the fast path differs from the generic one")
                if not np.isfinite(a).all():
                    sys.exit(f"validation failed: {preset}:{fmt} {name} is not finite")
            err = np.max(np.abs(fast[0] - golden)) / np.max(np.abs(golden))
            if not err < 2.0 ** -(fadev.formats[fmt].precision - 3):
                sys.exit(f"validation failed: {preset}:{fmt} out is {err:.2e} (relative) from the fp64 answer")


def bench_cpu(args):
    validate_cpu(args.causal, args.heads // args.heads_kv)
    q, k, v, dout = problem(args.batch, args.heads, args.heads_kv, args.n, args.dim)
    if args.heads_kv != args.heads:  # NumPy's twin reads each query head's K/V head
        rep = args.heads // args.heads_kv
        kn, vn = np.repeat(k, rep, axis=1), np.repeat(v, rep, axis=1)
    else:
        kn, vn = k, v
    q32, k32, v32 = (t.astype(np.float32) for t in (q, kn, vn))
    t_np = best_seconds(lambda: numpy_attention(q32, k32, v32, args.causal), args.repeat)
    rows = []
    for preset in PRESETS:
        for fmt in FORMATS:
            fwd, bwd = kernels(preset)
            pol = f"{preset}:{fmt}"
            out, lse = fwd(q, k, v, pol, causal=args.causal, return_lse=True)
            times = {}
            for fast in (True, False) if not args.fast_only else (True,):
                old = _core._set_fast_paths(fast)
                try:
                    t_f = best_seconds(lambda: fwd(q, k, v, pol, causal=args.causal, return_lse=True), args.repeat)
                    t_b = best_seconds(lambda: bwd(q, k, v, out, lse, dout, pol, causal=args.causal), args.repeat)
                finally:
                    _core._set_fast_paths(old)
                times[fast] = (t_f, t_f + t_b)
            rows.append((pol, times))
    shape = describe(args)
    print(f"\nCPU, {fadev.get_num_threads()} fadev threads; {shape}; NumPy fp32 attention forward "
          f"{t_np * 1e3:.1f} ms (best of {args.repeat})\n")
    head = "| preset | forward ms | / NumPy fwd | fwd + bwd ms | / NumPy fwd |"
    if not args.fast_only:
        head += " generic fwd ms | generic fwd + bwd ms |"
    print(head)
    print("|" + "---|" * (head.count("|") - 1))
    for pol, times in rows:
        f, fb = times[True]
        line = f"| {pol} | {f * 1e3:.1f} | {f / t_np:.2f} | {fb * 1e3:.1f} | {fb / t_np:.2f} |"
        if not args.fast_only:
            gf, gfb = times[False]
            line += f" {gf * 1e3:.1f} | {gfb * 1e3:.1f} |"
        print(line)


# ------------------------------------------------------------------ CUDA


def cuda_times(fn, repeat, pre=0):
    """ms of fn() by CUDA events, ``repeat`` times after a warm-up call. With ``pre``, the GPU is first given that many
    cycles of torch.cuda._sleep, so that the host's work before fn()'s first launch runs while the GPU is still busy
    (emulation_host_gap.py)."""
    import torch
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeat):
        if pre:
            torch.cuda._sleep(int(pre))
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return times


def cuda_ms(fn, repeat):
    """Median ms of fn() by CUDA events, after a warm-up call."""
    times = sorted(cuda_times(fn, repeat))
    return times[len(times) // 2]


def queued_ms(fn, repeat):
    """ms a call when ``repeat`` calls are queued back to back, as a training loop or a sweep queues them: one pair of
    events around them all, after a warm-up call. The host's work of a call then runs while the GPU computes the
    call before, as it does in a loop; cuda_ms's per-call events add it to every call."""
    import torch
    fn()
    torch.cuda.synchronize()
    return cuda_window_seconds(fn, repeat) * 1e3


def kernels_ms(fn):
    """ms the GPU spends in fn()'s kernels and memsets (torch.profiler's CUDA activity, one call after a warm-up):
    the call's event time less what the GPU waited for the host."""
    import torch
    from torch.profiler import ProfilerActivity, profile
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(e.device_time for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA) / 1e3


def simt_tflops(repeat, n=8192):
    """fp32 matrix product rate without tensor cores (TF32 off), TFLOP/s."""
    import torch
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        a, b = (torch.randn(n, n, device="cuda", dtype=torch.float32) for _ in range(2))
        ms = cuda_ms(lambda: torch.matmul(a, b), repeat)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = old
    return 2 * n ** 3 / (ms * 1e-3) / 1e12


def bench_cuda(args):
    import torch
    if not (torch.cuda.is_available() and fadev.cuda_available()):
        sys.exit("bench_emulation --device cuda needs a CUDA GPU, PyTorch with CUDA and fadev built with FADEV_CUDA=1")
    small = problem(1, 2, max(1, 2 * args.heads_kv // args.heads), 200, 64, seed=3)
    for preset in PRESETS:
        for fmt in FORMATS:
            cpu = run(preset, fmt, *small, args.causal)
            gpu = run(preset, fmt, *small, args.causal, device="cuda")
            bad = [name for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), cpu, gpu) if not same(a, b)]
            if bad:
                sys.exit(f"validation failed: {preset}:{fmt} {', '.join(bad)}: the GPU differs from the CPU")
    arrays = problem(args.batch, args.heads, args.heads_kv, args.n, args.dim)
    q, k, v, dout = (torch.from_numpy(t).cuda() for t in arrays)
    half = 0.5 if args.causal else 1.0
    base = args.batch * args.heads * args.n ** 2 * args.dim * half
    simt = simt_tflops(args.repeat)
    timed = {}
    for preset in PRESETS:
        fwd, bwd = kernels(preset)
        for fmt in FORMATS:
            pol = f"{preset}:{fmt}"
            out, lse = fwd(q, k, v, pol, causal=args.causal, return_lse=True)
            f = functools.partial(fwd, q, k, v, pol, causal=args.causal, return_lse=True)
            b = functools.partial(bwd, q, k, v, out, lse, dout, pol, causal=args.causal)
            times = {}
            for generic in ((False,) if args.fast_only else (False, True)):  # the GPU's generic kernels beside
                os.environ["FADEV_EMU_GENERIC"] = "1" if generic else "0"
                reps = 1 if generic else args.repeat
                times[generic] = (cuda_ms(f, reps), cuda_ms(b, reps))
            os.environ.pop("FADEV_EMU_GENERIC", None)
            queued = (queued_ms(f, args.repeat), queued_ms(b, args.repeat))
            tiled = None
            if args.tiled:
                os.environ["FADEV_EMU_WARP"] = "0"
                try:
                    tiled = cuda_ms(f, args.repeat)
                finally:
                    os.environ.pop("FADEV_EMU_WARP", None)
            timed[pol] = (f, b, times, queued, tiled)
    # the Llama step, then the kernels' time under torch.profiler, last: after a profiler has run, CUPTI stays
    # attached (pytorch/pytorch#144455) and later launches may cost more host time, which the per-call column would
    # count (H200, one run: the first preset's per-call rate 1.6% below its kernels', the presets timed after a
    # profiler 5.9-6.8% below; a direct before/after check moved one preset of three)
    steps = llama_step(args.step_steps) if args.step else None
    rows = []
    for pol, (f, b, times, queued, tiled) in timed.items():
        busy = (kernels_ms(f), kernels_ms(b))
        for x, (direction, flops) in enumerate((("forward", 4 * base), ("backward", 10 * base))):
            ms = times[False][x]
            tf = flops / (ms * 1e-3) / 1e12
            gen = f"{times[True][x]:.1f} | {times[True][x] / ms:.1f}x" if True in times else "- | -"
            row = (f"| {pol} | {direction} | {ms:.1f} | {tf:.2f} | {100 * tf / simt:.1f}% | {busy[x]:.1f} | "
                   f"{flops / (busy[x] * 1e-3) / 1e12:.2f} | {flops / (queued[x] * 1e-3) / 1e12:.2f} | {gen} |")
            if args.tiled:
                row += f" {tiled:.1f} | {tiled / ms:.2f}x |" if x == 0 else " - | - |"
            rows.append(row)
    shape = describe(args)
    print(f"\n{torch.cuda.get_device_name()}, torch {torch.__version__}; {shape}; CUDA float64 in/out; median of "
          f"{args.repeat}; fp32 SIMT matmul (TF32 off) {simt:.1f} TFLOP/s in this run; generic: the same call "
          f"with FADEV_EMU_GENERIC=1 (one timed run); queued: {args.repeat} calls back to back, one pair of events\n")
    head = ("| preset | direction | ms | TFLOP/s | of fp32 SIMT | kernels ms | kernels TFLOP/s | queued TFLOP/s | "
            "generic ms | speed-up |")
    if args.tiled:
        head += " tiled ms | over tiled |"
    print(head + "\n|" + "---|" * (head.count("|") - 1))
    print("\n".join(rows))
    if steps:
        steps()


def llama_step(steps):
    """The training step of bench_step.py (its Llama, data and optimizer) on sdpa, fadev native and the emulated
    presets, in this program (benchmarks/bench_step.py documents it): measured now, printed by the function it
    returns."""
    import bench_step
    from fadev.training import lm
    config = lm.LMConfig(hidden=512, layers=8, heads=8, heads_kv=4, ffn=1376, seq=1024, batch=8, lr=3e-4)
    losses, times, _ = bench_step.measure(("sdpa", "native", "fa2", "paper"), config, steps, 2, "cuda")

    def show():
        print(f"\nLlama {lm.parameters(config):,} parameters, batch 8 x 1024, bf16 autocast, AdamW; 2 rounds of "
              f"{steps} steps per arm, alternating\n")
        bench_step.print_steps(losses, times)
    return show


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=None, help="default: 4 (cpu), 16 (cuda)")
    p.add_argument("--heads-kv", type=int, default=None, help="K/V heads (grouped-query); default: --heads")
    p.add_argument("--n", type=int, default=None, help="sequence length; default: 1024 (cpu), 4096 (cuda)")
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--causal", action="store_true")
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--fast-only", action="store_true", help="skip timing the generic paths")
    p.add_argument("--tiled", action="store_true", help="cuda: the forward also on the tiled kernel (FADEV_EMU_WARP=0)")
    p.add_argument("--step", action="store_true", help="cuda: also the Llama training step (bench_step.py's)")
    p.add_argument("--step-steps", type=int, default=10, help="timed steps per arm with --step")
    args = p.parse_args()
    cpu = args.device == "cpu"
    args.heads = args.heads or (4 if cpu else 16)
    args.heads_kv = args.heads_kv or args.heads
    args.n = args.n or (1024 if cpu else 4096)
    for name in ("batch", "heads", "heads_kv", "n", "dim", "repeat"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.heads % args.heads_kv:
        p.error("--heads must be a multiple of --heads-kv")
    (bench_cpu if cpu else bench_cuda)(args)


if __name__ == "__main__":
    t0 = time.perf_counter()
    main()
    print(f"\n({time.perf_counter() - t0:.0f} s)")
