"""GPU run of the backward kernels study: fadev's emulated backward presets against PyTorch's real backward.

    PYTHONPATH=. python benchmarks/kernels_backward_gpu.py [--out DIR] [--Ns 512,2048,8192,16384]
        [--formats bf16,fp16] [--seeds 1] [--budget 240]

For each format, N (queries = keys, D = 64, one head), causal and not: dq, dk, dv of the emulated fa2, fa1,
naive and torch_math presets (fadev's CUDA emulation) and of PyTorch's flash, memory-efficient, cuDNN and
math backward (math with and without allow_fp16_bf16_reduction_math_sdp) and fadev's native kernel, each
against fp64 autograd. Prints the per-implementation errors, the ratio tables emulated / real (mean |err|
and RMSE) and the +-10% verdicts (fadev/experiments/kernels_backward.py). Exit status 0 when every verdict
holds, 1 when one does not, 2 without a usable GPU.

Results go to DIR/kernels_backward.jsonl as they finish; no (N, format, causal) is started after --budget
seconds, and a second run with the same --out resumes where the first stopped. Needs torch with CUDA and fadev
built with FADEV_CUDA=1 (without it the emulation falls back to the CPU, far too slow at these sizes).
"""
import argparse
import sys
import time

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
    args = ap.parse_args(argv)
    if not common.torch_cuda() or common.sweep_device("cuda") != "cuda":
        print("needs PyTorch with a CUDA GPU and fadev built with FADEV_CUDA=1", file=sys.stderr)
        return 2
    start = time.perf_counter()
    df = kb.run("full", args.out, device="cuda", progress=True, budget_s=args.budget, Ns=_list(args.Ns, int),
                formats=_list(args.formats, str), seeds=args.seeds)
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
    return 0 if all(f.holds is not False for f in found) else 1


if __name__ == "__main__":
    sys.exit(main())
