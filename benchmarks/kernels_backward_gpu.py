"""GPU run of the backward kernels study: fadev's emulated backward presets against PyTorch's real backward.

    PYTHONPATH=. python benchmarks/kernels_backward_gpu.py [--out DIR] [--Ns 512,2048,8192,16384]
        [--formats bf16,fp16] [--seeds 1] [--budget 240] [--impls "emulated efficient,torch efficient"]
        [--probe-Ns 8192,12288,16384,24576] [--probe-budget 100]

For each format, N (queries = keys, D = 64, one head), causal and not: dq, dk, dv of the emulated fa2, fa1,
efficient, cudnn, naive and torch_math presets (fadev's CUDA emulation) and of PyTorch's flash, memory-efficient,
cuDNN and math backward (math with and without allow_fp16_bf16_reduction_math_sdp) and fadev's native kernel,
each against fp64 autograd (``--impls``: only these). Prints the per-implementation errors, the ratio tables
emulated / real (mean |err| and RMSE) and the +-10% verdicts (fadev/experiments/kernels_backward.py). Exit
status 0 when every verdict holds, 1 when one does not, 2 without a usable GPU.

``--probe-Ns``: then, at those (long) N, why cuDNN at fp16 and the reduced math backend at bf16 drift from their
models: the mean |err| ratios fa2 / cuDNN and cudnn-preset / cuDNN (the preset puts the softmax scale on dS before
its fp16 rounding, fa2 on the fp32 sums), naive-split-scale / math-reduced with PyTorch's default cuBLAS reductions
and with ``allow_{bf16,fp16}_reduced_precision_reduction`` off (a split-K reduction in 16 bits would make the real
dq lossier at long N), and the CUDA kernels each backward launched (torch.profiler): a change of cuDNN kernel
with N shows there. No probe point starts after ``--probe-budget`` seconds.

Results go to DIR/kernels_backward.jsonl as they finish; no (N, format, causal) is started after --budget
seconds, and a second run with the same --out resumes where the first stopped. Needs torch with CUDA and fadev
built with FADEV_CUDA=1 (without it the emulation falls back to the CPU, far too slow at these sizes).
"""
import argparse
import contextlib
import sys
import time

import numpy as np

from fadev.experiments import common
from fadev.experiments import kernels_backward as kb


def _list(text, kind):
    return tuple(kind(x) for x in text.split(",") if x.strip())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="results/kernels_backward", help="directory of the resumable jsonl")
    ap.add_argument("--Ns", default="512,2048,8192,16384")
    ap.add_argument("--formats", default="bf16,fp16")
    ap.add_argument("--seeds", type=int, default=1)
    ap.add_argument("--budget", type=float, default=240.0,
                    help="start no new (N, format, causal) after this many seconds")
    ap.add_argument("--impls", default=None, help="only these implementations (comma-separated impl names)")
    ap.add_argument("--probe-Ns", default="", help="long-N probe of the cuDNN and math-reduced drift at these N")
    ap.add_argument("--probe-budget", type=float, default=100.0, help="start no probe point after this many seconds")
    args = ap.parse_args(argv)
    if not common.torch_cuda() or common.sweep_device("cuda") != "cuda":
        print("needs PyTorch with a CUDA GPU and fadev built with FADEV_CUDA=1", file=sys.stderr)
        return 2
    start = time.perf_counter()
    df = kb.run("full", args.out, device="cuda", progress=True, budget_s=args.budget, Ns=_list(args.Ns, int),
                formats=_list(args.formats, str), seeds=args.seeds,
                impls=_list(args.impls, str) if args.impls else None)
    import torch
    print(f"# backward kernels study: {torch.cuda.get_device_name()}, torch {torch.__version__}, "
          f"{time.perf_counter() - start:.0f} s, seeds {args.seeds}")
    cols = ["impl", "format", "N", "causal"] + [f"{g}.mean_abs" for g in kb.GRADS]
    print("\n## mean |err| vs fp64 autograd\n")
    print(df[cols].to_string(index=False, float_format="%.3e"))
    for metric in ("mean_abs", "rmse"):
        print(f"\n## ratio emulated / real, {metric}\n")
        print(kb.table(df, metric))
    if "error" in df:
        for r in df[df["error"].fillna("").astype(str) != ""].itertuples(index=False):
            print(f"- not supported: {r.impl} {r.format} N={r.N} causal={r.causal}: {r.error}")
    print("\n## verdicts (mean |err|)\n")
    found = kb.findings(df)
    for f in found:
        print(f.markdown())
    if df.attrs.get("skipped"):
        print(f"\nnot run (budget), (N, format, causal): {df.attrs['skipped']}; rerun the same command to resume")
    if args.probe_Ns:
        probe(_list(args.probe_Ns, int), _list(args.formats, str), args.probe_budget)
    return 0 if all(f.holds is not False for f in found) else 1


@contextlib.contextmanager
def _reductions(torch, allowed):
    """cuBLAS's reduced-precision (16-bit) reductions of fp16 / bf16 GEMMs allowed or not, restored after."""
    m = torch.backends.cuda.matmul
    old = (m.allow_fp16_reduced_precision_reduction, m.allow_bf16_reduced_precision_reduction)
    m.allow_fp16_reduced_precision_reduction = m.allow_bf16_reduced_precision_reduction = allowed
    try:
        yield
    finally:
        m.allow_fp16_reduced_precision_reduction, m.allow_bf16_reduced_precision_reduction = old


def _kernels(torch, arrays, dtype, causal, backend, reduced=False):
    """Names of the CUDA kernels one backward launches (torch.profiler), or the error text."""
    from torch.profiler import ProfilerActivity, profile
    try:
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            kb._torch_grads(torch, arrays, dtype, "cuda", causal, backend, reduced)
            torch.cuda.synchronize()
        names = {e.key for e in prof.key_averages()}
    except Exception as e:  # the profiler is a diagnosis, never a reason to stop
        return f"(profiler: {type(e).__name__}: {e})"
    skip = ("aten::", "cuda", "Memcpy", "Memset", "autograd", "torch", "ProfilerStep", "Activity")
    return "; ".join(sorted(n[:90] for n in names if not n.startswith(skip))) or "(none seen)"


def probe(Ns, formats, budget):
    """Mean |err| ratios at long N (see the module docstring), one line per (format, N, causal)."""
    import torch
    start = time.perf_counter()
    print("\n## long-N probe: mean |err| ratios dq/dk/dv\n")
    print("| format | N | causal | fa2/cuDNN | cudnn/cuDNN | split/math-red | split/math-red fp32-reductions |")
    print("|---|---|---|---|---|---|---|")
    kernel_lines = []
    for N in sorted(Ns):
        for fmt in formats:
            for causal in (False, True):
                if time.perf_counter() - start > budget:
                    print(f"| {fmt} | {N} | {causal} | not run (probe budget) | | | |")
                    continue
                dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}[fmt]
                arrays = kb._inputs(N, 64, 0, fmt)
                ref = kb._reference(N, 64, 0, fmt, causal, "cuda")
                err = lambda g: np.array([np.abs(a - r).mean() for a, r in zip(g, ref)])  # noqa: E731
                emu = {m: err(kb._emulated(m, dict(kb.EMULATED)[m], arrays, fmt, causal, "cuda"))
                       for m in ("fa2", "cudnn", "naive, split scale")}
                real = {}
                for name, backend, reduced, allowed in (("cudnn", "cudnn", False, True), ("red", "math", True, True),
                                                        ("red32", "math", True, False)):
                    with _reductions(torch, allowed):
                        grads, error = kb._torch_grads(torch, arrays, dtype, "cuda", causal, backend, reduced)
                    real[name] = err(grads) if grads is not None else np.full(3, np.nan)
                cells = [emu["fa2"] / real["cudnn"], emu["cudnn"] / real["cudnn"],
                         emu["naive, split scale"] / real["red"], emu["naive, split scale"] / real["red32"]]
                print(f"| {fmt} | {N} | {causal} | " + " | ".join("/".join(f"{x:.3f}" for x in c) for c in cells)
                      + " |", flush=True)
                if not causal:
                    for name, backend, reduced in (("cuDNN", "cudnn", False), ("math, reduced", "math", True)):
                        kernel_lines.append(f"- {fmt} N={N} {name}: {_kernels(torch, arrays, dtype, causal, backend, reduced)}")
    print("\n## CUDA kernels of each backward (non-causal)\n")
    print("\n".join(kernel_lines))


if __name__ == "__main__":
    sys.exit(main())
