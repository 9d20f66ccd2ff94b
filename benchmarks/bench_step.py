"""A training step on each attention, and fadev's host time per attention call (validate, then time).

    python benchmarks/bench_step.py [--steps 20] [--arms sdpa,eager,native,fa2,paper,naive]
                                    [--model llama64|gqa128|mha128] [--quick] [--device cpu] [--profile]
    python benchmarks/bench_step.py --host-only     # no GPU needed: fadev's host time per native call

(fadev importable: an installed build, or PYTHONPATH=. for an in-place one.)

The model is the training-drift study's Llama (fadev.training.lm: transformers' LlamaForCausalLM, hidden 512,
8 layers, 8 query / 4 key-value heads, SwiGLU 1376, byte vocabulary; ``--quick``: a small one) trained on batch
8 x 1024 bytes under ``torch.autocast(dtype=torch.bfloat16)`` with AdamW, one arm at a time on one GPU:

  sdpa    attn_implementation="sdpa" (PyTorch picks its backend)
  eager   attn_implementation="eager" (materialised)
  native  fadev's native kernel through fadev.hf, defaults (``use(kernel="native")``)
  fa2     fadev's emulated fa2(bf16) through fadev.hf (``use("fa2:bf16")``)
  paper   fadev's emulated paper(bf16)
  naive   fadev's emulated naive(bf16) baseline (``use("naive:bf16", kernel="baseline")``: the drift studies' baseline)

``--profile``: after the timing, one more step per arm under torch.profiler, and the kernels that took the most
device time (CPU time on ``--device cpu``), so that a step's time can be read kernel by kernel.

Validation first: every arm's loss after the same 2 updates from the same init is finite and within 2% of
sdpa's (the kernels differ only by rounding). Then ``--rounds`` rounds, each ``--steps`` updates of every arm in turn
(each ended by a CUDA synchronize; alternating, as a shared host's slow spells come and go): the median step time per
arm and its ratio to sdpa's, and the ratio within each round (its median and range: the run's own spread).

Host time per call: fadev.hf.attention_forward + backward on a tiny problem (B 1, H 8 / 4, N 128, D 64), whose
GPU work is a few microseconds, timed as the wall time of 200 back-to-back calls without synchronizing inside
the loop, beside transformers' sdpa_attention_forward on the same tensors: the difference is what fadev's
Python layer adds per call.

Host time without a GPU (``--host-only``, also printed after the GPU table): the native path on CPU tensors with the
binding's launches recorded instead of run (fadev.torch_native._dry_run), forward + backward through fadev.hf and
through fadev.torch_native, beside a torch.autograd.Function that only allocates the same results (PyTorch's own
cost of any extension op): the difference is fadev's host time per call up to the binding.
"""
import argparse
import math
import statistics
import sys
import time

import torch

ARMS = ("sdpa", "eager", "native", "fa2", "paper", "naive")
MODELS = {  # issue 25: the drift study's Llama (head dim 64, grouped-query), and head dim 128 with and without GQA
    "llama64": dict(hidden=512, layers=8, heads=8, heads_kv=4, ffn=1376),
    "gqa128": dict(hidden=1024, layers=8, heads=8, heads_kv=4, ffn=2752),
    "mha128": dict(hidden=1024, layers=8, heads=8, heads_kv=8, ffn=2752),
}


def model_and_context(arm, config, device):
    from fadev import hf
    from fadev.training import lm
    implementation = {"sdpa": "sdpa", "eager": "eager"}.get(arm, lm.ATTENTION)
    model = lm.build(config, 0, "fp32", device, implementation)
    if arm == "native":
        ctx = hf.use(kernel="native")
    elif arm in ("fa2", "paper"):
        ctx = hf.use(f"{arm}:bf16")
    elif arm == "naive":
        ctx = hf.use("naive:bf16", kernel="baseline")
    else:
        ctx = hf.use(kernel="sdpa")
    return model, ctx


def batches(config, n, device):
    from fadev.training import text
    corpus = text.load(config.data)
    return [tuple(torch.from_numpy(t).to(device) for t in text.batch(corpus.train, s, config.batch, config.seq, 0))
            for s in range(n)]


def sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def step_fn(model, ctx, opt, device):
    from fadev.training import lm

    def step(x, y):
        with ctx:
            with torch.autocast(device, dtype=torch.bfloat16):
                loss = lm.loss_of(model, x, y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
        opt.step()
        return loss
    return step


def build_arm(arm, config, data, device):
    """(step function, loss after 2 updates) of a fresh model and AdamW under ``arm`` (the same init every arm)."""
    model, ctx = model_and_context(arm, config, device)
    opt = torch.optim.AdamW(model.parameters(), lr=config.lr)
    step = step_fn(model, ctx, opt, device)
    losses = [float(step(*data[i]).detach()) for i in range(2)]
    return step, losses[-1]


def time_arms(steps_of, data, steps, rounds, device):
    """{arm: [[seconds of each step] per round]}: ``rounds`` rounds, each ``steps`` updates of every arm in turn
    (alternating, so that a slow spell of a shared host falls on every arm), each step ended by a synchronize."""
    times = {a: [] for a in steps_of}
    for r in range(rounds):
        for arm, step in steps_of.items():
            got = []
            for i in range(steps):
                sync(device)
                t0 = time.perf_counter()
                step(*data[(r * steps + i + 2) % len(data)])
                sync(device)
                got.append(time.perf_counter() - t0)
            times[arm].append(got[1:] if len(got) > 1 else got)
    return times


def measure(arms, config, steps, rounds, device, profile=0):
    """(losses after 2 updates, time_arms' times, {arm: profiler table} when ``profile``) of ``arms`` (sdpa among
    them); exits naming the arms whose loss is not finite or not within 2% of sdpa's."""
    data = batches(config, rounds * steps + 2, device)
    built = {a: build_arm(a, config, data, device) for a in arms}
    losses = {a: loss for a, (_, loss) in built.items()}
    bad = [a for a, loss in losses.items() if not (math.isfinite(loss) and abs(loss / losses["sdpa"] - 1) <= 0.02)]
    if bad:
        sys.exit(f"validation failed: loss after 2 updates {({a: losses[a] for a in bad})} vs sdpa's "
                 f"{losses['sdpa']}")
    times = time_arms({a: step for a, (step, _) in built.items()}, data, steps, rounds, device)
    tables = {a: kernels(step, data[0], device, profile) for a, (step, _) in built.items()} if profile else {}
    return losses, times, tables


def print_steps(losses, times):
    """The table of record: per arm the median step, its ratio to sdpa's, and the ratio within each round."""
    print("| attention | ms / step (median) | / sdpa | / sdpa per round (median, range) | loss after 2 updates |\n"
          "|---|---|---|---|---|")
    ref = statistics.median(t for r in times["sdpa"] for t in r)
    for a, per_round in times.items():
        med = statistics.median(t for r in per_round for t in r)
        ratios = [statistics.median(r) / statistics.median(s) for r, s in zip(per_round, times["sdpa"])]
        print(f"| {a} | {med * 1e3:.1f} | {med / ref:.2f} | {statistics.median(ratios):.2f} "
              f"({min(ratios):.2f}-{max(ratios):.2f}) | {losses[a]:.4f} |")


def kernels(step, batch, device, rows):
    """torch.profiler's table of one step: the ``rows`` operations and kernels with the most self device time
    (self CPU time on the CPU)."""
    from torch.profiler import ProfilerActivity, profile
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=activities) as prof:
        step(*batch)
        sync(device)
    key = "self_cuda_time_total" if device == "cuda" else "self_cpu_time_total"
    return prof.key_averages().table(sort_by=key, row_limit=rows, max_name_column_width=70)


def host_us_per_call(device, calls=200):
    """{kernel: microseconds per forward + backward call on a tiny problem} for fadev native (CUDA only), fadev
    fa2(bf16) emulated and transformers' sdpa."""
    from types import SimpleNamespace

    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from fadev import hf
    module = SimpleNamespace(is_causal=True, num_key_value_groups=2, training=True)
    q = torch.randn(1, 8, 128, 64, device=device, dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(1, 4, 128, 64, device=device, dtype=torch.bfloat16, requires_grad=True) for _ in range(2))

    def timed(fn, ctx):
        def once():
            with ctx:
                out, _ = fn(module, q, k, v, None, dropout=0.0, scaling=0.125, is_causal=True)
                out.sum().backward()
        for _ in range(10):
            once()
        sync(device)
        t0 = time.perf_counter()
        for _ in range(calls):
            once()
        sync(device)
        return (time.perf_counter() - t0) / calls * 1e6
    out = {"native": timed(hf.attention_forward, hf.use(kernel="native"))} if device == "cuda" else {}
    out["fa2(bf16) emulated"] = timed(hf.attention_forward, hf.use("fa2:bf16"))
    out["transformers' sdpa"] = timed(sdpa_attention_forward, hf.use(kernel="sdpa"))
    return out


class _Null(torch.autograd.Function):
    """What any extension op costs PyTorch: out and lse allocated in the forward, three gradients in the backward."""

    @staticmethod
    def forward(ctx, q, k, v):
        ctx.save_for_backward(q, k, v)
        torch.empty(q.shape[:3], dtype=torch.float32, device=q.device)
        return torch.empty(q.shape, dtype=q.dtype, device=q.device)

    @staticmethod
    def backward(ctx, dout):
        return tuple(torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in ctx.saved_tensors)


def host_only(calls=2000):
    """{path: microseconds per forward + backward} of the native path on CPU tensors with the binding's launches
    recorded, not run (fadev.torch_native._dry_run): through fadev.hf.attention_forward, through
    fadev.torch_native.native_attention, and a torch.autograd.Function that only allocates its results."""
    from types import SimpleNamespace

    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from fadev import hf
    from fadev import torch_native as tn
    module = SimpleNamespace(is_causal=True, num_key_value_groups=2, training=True)
    # N 16: 16 KiB tensors, below glibc's mmap threshold, so the CPU allocator's page faults (which PyTorch's CUDA
    # caching allocator does not have) stay out of the numbers; the host path does not depend on the size
    q = torch.randn(1, 8, 16, 64, dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(1, 4, 16, 64, dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    gout = torch.zeros(1, 16, 8, 64, dtype=torch.bfloat16)

    def timed(paths, rounds=20):
        """{name: best over ``rounds`` rounds of us per call}, the paths taking turns in each round, so that a
        shared machine's interruptions (which only add) do not fall on one path's rounds alone."""
        per_round = max(1, calls // rounds)
        best = dict.fromkeys(paths, math.inf)
        for once in paths.values():
            for _ in range(max(10, per_round)):
                once()
        for _ in range(rounds):
            for name, once in paths.items():
                t0 = time.perf_counter()
                for _ in range(per_round):
                    once()
                best[name] = min(best[name], (time.perf_counter() - t0) / per_round * 1e6)
        return best

    def through_hf():
        out, _ = hf.attention_forward(module, q, k, v, None, dropout=0.0, scaling=0.125, is_causal=True)
        torch.autograd.grad(out, (q, k, v), gout)

    def direct():
        out = tn.native_attention(q, k, v, is_causal=True, scale=0.125, enable_gqa=True)
        torch.autograd.grad(out, (q, k, v), gout.transpose(1, 2))

    def null():
        torch.autograd.grad(_Null.apply(q, k, v), (q, k, v), gout.transpose(1, 2))

    def sdpa_null():  # transformers' sdpa integration, its SDPA call replaced by the no-work op
        with hf.use(kernel="sdpa"):
            out, _ = sdpa_attention_forward(module, q, k, v, None, dropout=0.0, scaling=0.125, is_causal=True)
        torch.autograd.grad(out, (q, k, v), gout)

    real = torch.nn.functional.scaled_dot_product_attention
    torch.nn.functional.scaled_dot_product_attention = lambda q, k, v, **kw: _Null.apply(q, k, v)
    try:
        with tn._dry_run(), hf.use(kernel="native"):
            return timed({"fadev native (hf)": through_hf, "fadev native (torch_native)": direct,
                          "autograd.Function, no work": null, "transformers' sdpa (hf), no work": sdpa_null})
    finally:
        torch.nn.functional.scaled_dot_product_attention = real


def print_host_only():
    import platform
    result = host_only()
    where = platform.processor() or platform.machine()
    print(f"\nhost time per native forward + backward, binding launches recorded not run ({where}, torch "
          f"{torch.__version__}, best of 20 rounds):")
    for name, us in result.items():
        print(f"  {name}: {us:.1f} us")
    own = result["fadev native (torch_native)"] - result["autograd.Function, no work"]
    print(f"  fadev's own (torch_native - autograd.Function): {own:.1f} us")
    own = result["fadev native (hf)"] - result["transformers' sdpa (hf), no work"]
    print(f"  through transformers, fadev native - transformers' sdpa (both without kernel work): {own:+.1f} us")


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=20, help="timed steps per arm in each round")
    p.add_argument("--rounds", type=int, default=3, help="rounds; each runs --steps steps of every arm in turn")
    p.add_argument("--arms", default=",".join(ARMS))
    p.add_argument("--model", choices=tuple(MODELS), default="llama64",
                   help="llama64: hidden 512, 8 / 4 heads (D 64); gqa128: hidden 1024, 8 / 4 heads (D 128); "
                        "mha128: hidden 1024, 8 / 8 heads (D 128); all 8 layers, batch 8 x 1024")
    p.add_argument("--quick", action="store_true", help="a small model of the same head dim (2 layers, sequence 256)")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                   help="cpu: a check of this program without a GPU (no native arm; CPU timings mean little)")
    p.add_argument("--host-only", action="store_true", help="only fadev's host time per native call (no GPU needed)")
    p.add_argument("--profile", type=int, nargs="?", const=15, default=0, metavar="ROWS",
                   help="then one step per arm under torch.profiler: its ROWS (15) costliest kernels")
    args = p.parse_args()
    if args.steps < 1 or args.rounds < 1:
        p.error(f"--steps and --rounds must be at least 1, got {args.steps} and {args.rounds}")
    if args.host_only:
        return print_host_only()
    import fadev
    from fadev.training import lm
    if args.device == "cuda" and not (torch.cuda.is_available() and fadev.cuda_available()):
        sys.exit("bench_step --device cuda needs a CUDA GPU, PyTorch with CUDA and fadev built with FADEV_CUDA=1")
    arms = [a for a in args.arms.split(",") if a]
    unknown = [a for a in arms if a not in ARMS or (a == "native" and args.device != "cuda")]
    if unknown or "sdpa" not in arms:
        sys.exit(f"--arms: choose from {', '.join(ARMS)}, sdpa included; got {args.arms!r}")
    size = dict(MODELS[args.model], seq=1024)
    if args.quick:  # the same head dim and grouping, two layers, a quarter of the width
        size.update(hidden=size["hidden"] // 4, heads=size["heads"] // 4, heads_kv=max(1, size["heads_kv"] // 4),
                    ffn=size["ffn"] // 4, layers=2, seq=256)
    config = lm.LMConfig(**size, batch=8, lr=3e-4)
    losses, times, tables = measure(arms, config, args.steps, args.rounds, args.device, args.profile)
    host = host_us_per_call(args.device)
    where = torch.cuda.get_device_name() if args.device == "cuda" else "CPU"
    print(f"\n{where}, torch {torch.__version__}; Llama {args.model} ({lm.parameters(config):,} parameters, "
          f"{config.heads} / {config.heads_kv} heads of D {config.hidden // config.heads}), batch {config.batch} x "
          f"{config.seq}, bf16 autocast, AdamW; {args.rounds} rounds of {args.steps} steps per arm, alternating\n")
    print_steps(losses, times)
    print("\nper attention call, forward + backward, tiny problem (wall time of 200 calls): " +
          ", ".join(f"{k} {us:.0f} us" for k, us in host.items()))
    print_host_only()
    for a, table in tables.items():
        print(f"\none step of {a}, torch.profiler (the costliest {args.profile}):\n{table}")


if __name__ == "__main__":
    main()
