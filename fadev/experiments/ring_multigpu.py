"""Ring attention across real GPUs: out/LSE/gradient error vs fp64 against the ring size W, and speed.

One attention layer (causal, B = 1, H heads of dimension D) run by fadev.distributed.ring_attention on W
ranks, one process per GPU, NCCL between them (gloo on CPU tensors where there is no GPU), for every
W, layout, merge, per-piece kernel, input format (bf16, fp16) and input kind (normal, outlier), N up to
128k; each rank's out, LSE, dQ, dK, dV against an fp64 answer computed on the rank's own device
(:func:`reference`, exact attention in fp64 torch, chunked over the queries), the errors summed over the
ranks (relative L2 of the whole tensor). Beside it, PyTorch's own context parallelism
(torch.distributed.tensor.experimental.context_parallel around SDPA's flash kernel: the ecosystem's
reference ring) measured the same way, and the tokens per second of forward + backward.

kernel "emulated" also checks the contract of fadev.distributed: every rank's output, LSE and gradients
equal the single-process simulation's (fadev.ring_attention and its backward on the full tensors) bit for
bit (column bit_exact).

Launch: ``torchrun --nproc-per-node P -m fadev ring-multigpu --full`` (one rank per GPU; W runs on ranks
0..W-1) or ``python -m fadev ring-multigpu --spawn P`` (P local processes; nccl when PyTorch sees P GPUs).
"""
from __future__ import annotations

import json
import os
import time

import numpy as np

from .. import plots, report
from ..attention import random_qkv
from ..ring import LAYOUTS, MERGES, RingMerge
from . import common
from .common import Finding
from .ring_dist import TIMEOUT_DOC, fit_ring_sizes, ran_on, run_ranks

__all__ = ["run", "findings", "table", "figures", "ran_on", "reference"]

NAME = "ring_multigpu"
TITLE = "Ring attention across GPUs: error vs fp64 against W, PyTorch's context parallelism, tokens/s"
FIGURES = ("ring_multigpu_error_vs_W", "ring_multigpu_error_vs_N", "ring_multigpu_tokens_per_s")
REPRODUCE = False
OPTIONS = ()
"""The shared options its command takes: its ranks are its own processes on the GPUs: no --device, no --cluster."""
QUANTITIES = ("out", "lse", "dq", "dk", "dv")
KERNELS = ("emulated", "sdpa", "native", "torch_cp")
MERGE_COLORS = {"lowp_partials": "#d62728", "fp32_partials": "#1f77b4", "lowp_running": "#ff7f0e",
                "allgather": "#2ca02c", "torch_cp": "#7f7f7f"}
REAL_ALLGATHER = RingMerge.preset("allgather").replace(partial_grad="grad")
"""allgather as a real kernel runs it: each piece's dK/dV arrive in the input format (the preset keeps fp32)."""
REAL_PARTIALS = {"fp32_partials": "lowp_partials", "allgather": REAL_ALLGATHER.name}
"""The emulated merge a real kernel's merge behaves as: its partials arrive in the input format."""
KERNEL_NAMES = {"sdpa": "PyTorch's flash kernel", "native": "fadev's native kernel"}
SPEED_MERGE = "fp32_partials"
"""The merge of the speed rows (ring-flash-attention's: fp32 running out and LSE)."""

INTRO = (
    "One causal attention layer (B = 1, H heads of dimension D, random inputs rounded to the format F) as "
    "ring attention over W processes, one per GPU, exchanging K/V and dK/dV through torch.distributed "
    "(fadev.distributed.ring_attention, policy fa2(F) in every piece). Per-piece kernels: emulated (fadev's "
    "bit-exact emulation of FlashAttention-2, whose errors are the single-process simulation's prediction), "
    "sdpa (PyTorch's CUDA flash kernel, the partials ring-flash-attention merges), native (fadev's "
    "tensor-core kernel); merges as in the `ring` experiment. torch_cp is PyTorch's own context "
    "parallelism (torch.distributed.tensor.experimental.context_parallel around SDPA's flash kernel, its "
    "head-tail load balancing, fp32 merge; W = 1 is plain SDPA flash; it returns no LSE). Error = relative "
    "L2 error of the whole tensor (all ranks' shards) against exact fp64 attention of the same rounded "
    "inputs. bit_exact (emulated only): every rank's out, LSE, dQ, dK, dV equal the single-process "
    "simulation's bit for bit. Speed rows: forward + backward of the whole layer, median of the repeats, "
    f"bf16, zigzag, merge {SPEED_MERGE}, every rank's inputs already sharded (torch_cp's time includes "
    "context_parallel's own sharding of its buffers); tokens/s = N / seconds.")

SIZES = {
    "quick": {"spawn": 2, "Ws": (1, 2), "Ns": (256,), "long_Ns": (), "fmts": ("bf16", "fp16"),
              "dists": ("normal", "outlier"), "layouts": ("zigzag", "contiguous"),
              "kernels": ("emulated", "sdpa"), "heads": 2, "dim": 64, "emu_max_N": 4096, "speed_Ns": (512,),
              "reps": 2, "chunk": 1024, "timeout": 300.0},
    "full": {"spawn": 8, "Ws": (1, 2, 4, 8), "Ns": (4096, 16384), "long_Ns": (131072,), "fmts": ("bf16", "fp16"),
             "dists": ("normal", "outlier"), "layouts": ("zigzag", "contiguous"),
             "kernels": ("emulated", "sdpa", "native", "torch_cp"), "heads": 2, "dim": 128, "emu_max_N": 4096,
             "speed_Ns": (16384, 131072), "reps": 3, "chunk": 1024, "timeout": 1800.0},
}
SIZE_DOCS = {"spawn": "local processes to spawn (ignored under torchrun, whose world is used)",
             "Ws": "ring sizes W (each at most the number of processes)",
             "Ns": "sequence lengths N run with every layout, format and input kind",
             "long_Ns": "longer N run with layout zigzag and normal inputs only",
             "fmts": "input formats F (bf16, fp16)", "dists": "input kinds (normal, outlier)",
             "layouts": "sequence layouts over the ranks", "kernels": f"per-piece kernels ({', '.join(KERNELS)})",
             "heads": "heads H", "dim": "head dimension D", "emu_max_N": "largest N the emulated kernel runs at",
             "speed_Ns": "N of the speed rows", "reps": "timed repeats of each speed row",
             "chunk": "query rows per block of the fp64 reference", "timeout": TIMEOUT_DOC}


# ---------------------------------------------------------------- the fp64 answer

def reference(q, k, v, dout, scale, causal=True, chunk=1024):
    """(out, lse, dq, dk, dv) of exact attention in fp64 on the tensors' device: torch (B, H, N, D) q, k, v,
    dout (any float dtype; computed in float64), query blocks of ``chunk`` rows (memory ~ 4 chunk N)."""
    import torch
    q, k, v, dout = (t.to(torch.float64) for t in (q, k, v, dout))
    N = q.shape[2]
    out, dq = torch.empty_like(q), torch.empty_like(q)
    lse = torch.empty(q.shape[:3], dtype=torch.float64, device=q.device)
    dk, dv = torch.zeros_like(k), torch.zeros_like(v)
    for lo in range(0, N, chunk):
        hi = min(N, lo + chunk)
        nk = hi if causal else N  # keys past the block's last query are masked for every row of it
        qc, doc, kc, vc = q[:, :, lo:hi], dout[:, :, lo:hi], k[:, :, :nk], v[:, :, :nk]
        s = torch.matmul(qc, kc.transpose(-1, -2)) * scale
        if causal:
            rows = torch.arange(lo, hi, device=q.device)[:, None]
            s.masked_fill_(torch.arange(nk, device=q.device)[None, :] > rows, float("-inf"))
        m = s.amax(-1, keepdim=True)
        p = torch.exp(s - m)
        total = p.sum(-1, keepdim=True)
        lse[:, :, lo:hi] = (m + torch.log(total))[..., 0]
        p /= total
        o = torch.matmul(p, vc)
        out[:, :, lo:hi] = o
        ds = p * (torch.matmul(doc, vc.transpose(-1, -2)) - (doc * o).sum(-1, keepdim=True))
        dq[:, :, lo:hi] = torch.matmul(ds, kc) * scale
        dk[:, :, :nk] += torch.matmul(ds.transpose(-1, -2), qc) * scale
        dv[:, :, :nk] += torch.matmul(p.transpose(-1, -2), doc)
        del s, p, ds
    return out, lse, dq, dk, dv


def _inputs(N, H, D, fmt, dist_name, seed=0):
    """(q, k, v, dout): fp64 NumPy arrays (1, H, N, D) holding values of ``fmt``; dout normal."""
    q, k, v = random_qkv((1, H, N, D), dist=dist_name, seed=seed, fmt=fmt)
    dout = random_qkv((1, H, N, D), dist="normal", seed=seed + 1000, fmt=fmt)[0]
    return q, k, v, dout


# ---------------------------------------------------------------- one configuration on the ranks

def _sums(test, ref):
    """[sum (t - r)^2, sum r^2] (float64 on the tensors' device)."""
    import torch
    d = test.to(torch.float64) - ref
    return torch.stack([(d * d).sum(), (ref * ref).sum()])


def _fadev_run(shards, layout, merge, kernel, fmt, group):
    """This rank's [out, lse, dq, dk, dv] from fadev.distributed.ring_attention; ``shards``: this rank's q,
    k, v, dout (torch, fp64 holding ``fmt`` values)."""
    from .. import distributed as fd
    x = [t.clone().requires_grad_(True) for t in shards[:3]]
    out, lse = fd.ring_attention(*x, f"fa2:{fmt}", layout=layout, merge=merge, causal=True, kernel=kernel,
                                 group=group, return_lse=True)
    out.backward(shards[3])
    return [out.detach(), lse] + [t.grad for t in x]


def _cp_run(tensors, W, fmt, mesh, gather=True):
    """[out, None, dq, dk, dv] of PyTorch's context parallelism over ``mesh`` (W = 1: plain SDPA flash, mesh
    None); ``tensors``: the full q, k, v, dout on this rank's GPU. With ``gather``, the full tensors (every
    rank of the mesh holds them: context_parallel_unshard all-gathers), else this rank's shards."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[fmt]
    bufs = [t.to(dtype) for t in tensors]
    if W == 1:
        x = [t.requires_grad_(True) for t in bufs[:3]]
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
            out = F.scaled_dot_product_attention(*x, is_causal=True)
        out.backward(bufs[3])
        return [out.detach(), None] + [t.grad for t in x]
    from torch.distributed.tensor.experimental import context_parallel
    from torch.distributed.tensor.experimental._attention import context_parallel_unshard
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]), context_parallel(
            mesh, buffers=bufs, buffer_seq_dims=[2] * 4, no_restore_buffers=set(bufs)):
        x = [t.detach().requires_grad_(True) for t in bufs[:3]]
        out = F.scaled_dot_product_attention(*x, is_causal=True)  # looked up now: context_parallel patched it
        out.backward(bufs[3])
    got = [out.detach()] + [t.grad for t in x]
    if gather:
        got = context_parallel_unshard(mesh, got, [2] * 4)
    return [got[0], None] + list(got[1:])


_MESHES = {}


def _mesh(W, world, group):
    """A DeviceMesh over ranks 0..W-1 (its ranks call this), made once per W."""
    if W not in _MESHES:
        from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
        _MESHES[W] = init_device_mesh("cuda", (W,)) if W == world else DeviceMesh.from_group(group, "cuda")
    return _MESHES[W]


def _errors(got, ref_shards, comm_sum):
    """{quantity: relative L2 error} over all ranks' shards; ``got`` None: this rank holds none of it (a
    quantity no rank holds is NaN); comm_sum: the all-reduce (sum) of a tensor over the ring's ranks."""
    import torch
    dev = ref_shards[0].device
    parts = [_sums(g, r) if g is not None else torch.zeros(2, dtype=torch.float64, device=dev)
             for g, r in zip(got, ref_shards)]
    total = comm_sum(torch.stack(parts)).cpu().numpy()
    return {qn: float(np.sqrt(a / b)) if b > 0 else float("nan") for qn, (a, b) in zip(QUANTITIES, total)}


def _bit_exact(got, tensors_np, W, rank, layout, merge, fmt, device):
    """Whether this rank's emulated results equal the single-process simulation's, bit for bit."""
    from .. import distributed as fd
    from ..ring import ring_attention, ring_attention_backward
    q, k, v, dout = tensors_np
    kw = dict(world_size=W, layout=layout, merge=merge, causal=True, device=device)
    out, lse = ring_attention(q, k, v, f"fa2:{fmt}", return_lse=True, **kw)
    grads = ring_attention_backward(q, k, v, out, lse, dout, f"fa2:{fmt}", **kw)
    want = [fd.shard(np.asarray(a), W, rank, layout=layout) for a in (out, lse[..., None])]
    want = [want[0], want[1][..., 0]] + [fd.shard(np.asarray(g), W, rank, layout=layout) for g in grads]
    return all(np.array_equal(g.detach().cpu().numpy().astype(np.float64).view(np.int64),
                              np.asarray(w, dtype=np.float64).view(np.int64)) for g, w in zip(got, want))


# ---------------------------------------------------------------- the study on every rank

def _configs(cfg):
    """(N, fmt, dist, layouts) in run order: long N with zigzag and normal inputs only."""
    for N in tuple(cfg["Ns"]) + tuple(n for n in cfg["long_Ns"] if n not in cfg["Ns"]):
        long = N not in cfg["Ns"]
        for fmt in cfg["fmts"]:
            for dist_name in (("normal",) if long else cfg["dists"]):
                yield N, fmt, dist_name, (("zigzag",) if long else cfg["layouts"])


def _runs(cfg, N, layouts, cuda):
    """(layout, kernel, merge) of one input: emulated up to emu_max_N; torch_cp (zigzag: its head-tail
    load balancing) on GPUs only."""
    for layout in layouts:
        for kernel in cfg["kernels"]:
            if kernel == "emulated" and N > cfg["emu_max_N"]:
                continue
            if kernel == "emulated":
                for merge in MERGES + (REAL_ALLGATHER,):
                    yield layout, kernel, merge
                continue
            if kernel == "torch_cp":
                if layout == "zigzag" and cuda:
                    yield layout, kernel, "torch_cp"
                continue
            for merge in MERGES:
                yield layout, kernel, merge


def _study(rank, world, cfg, path):
    """Every rank: each configuration on ranks 0..W-1 (this rank's GPU under nccl); rank 0 appends the rows."""
    import torch
    import torch.distributed as dist

    from .. import distributed as fd
    cuda = dist.get_backend() == "nccl"
    dev = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    groups = {W: dist.new_group(list(range(W))) for W in cfg["Ws"]}
    H, D = cfg["heads"], cfg["dim"]
    scale = 1.0 / np.sqrt(D)

    def write(row):
        with open(path, "a") as f:
            f.write(json.dumps(row) + "\n")

    for N, fmt, dist_name, layouts in _configs(cfg):
        host = _inputs(N, H, D, fmt, dist_name)
        full = [torch.from_numpy(a).to(dev) for a in host]
        ref = reference(*full, scale, chunk=cfg["chunk"])
        for W in cfg["Ws"]:
            for layout, kernel, merge in _runs(cfg, N, layouts, cuda):
                row = {"phase": "error", "N": N, "fmt": fmt, "dist": dist_name, "W": W, "layout": layout,
                       "kernel": kernel, "merge": getattr(merge, "name", merge), "H": H, "D": D,
                       "device": dev.type}
                if rank < W:
                    g = groups[W]
                    start = time.perf_counter()
                    if kernel == "torch_cp":
                        got = _cp_run(full, W, fmt, _mesh(W, world, g) if W > 1 else None)
                        got, ref_part = (got if rank == 0 else [None] * 5), ref
                    else:
                        shards = [fd.shard(t, W, rank, layout=layout) for t in full]
                        got = _fadev_run(shards, layout, merge, kernel, fmt, g)
                        ref_part = [fd.shard(ref[1][..., None], W, rank, layout=layout)[..., 0] if i == 1 else
                                    fd.shard(r, W, rank, layout=layout) for i, r in enumerate(ref)]
                    row["seconds"] = time.perf_counter() - start

                    def total(t, op=dist.ReduceOp.SUM):
                        dist.all_reduce(t, op=op, group=g)
                        return t
                    row.update(_errors(got, ref_part, total))
                    if kernel == "emulated":
                        same = _bit_exact(got, host, W, rank, layout, merge, fmt, "cuda" if cuda else None)
                        row["bit_exact"] = bool(total(torch.tensor([int(same)], device=dev), dist.ReduceOp.MIN))
                if rank == 0:
                    write(row)
                dist.barrier()
        del full, ref
    _speed(rank, world, cfg, groups, dev, cuda, write)


def _speed(rank, world, cfg, groups, dev, cuda, write):
    """Speed rows: forward + backward of the layer per kernel (emulated excluded), W and N; median of reps
    after one warm-up run."""
    import torch
    import torch.distributed as dist

    from .. import distributed as fd
    H, D = cfg["heads"], cfg["dim"]
    kernels = [k for k in cfg["kernels"] if k != "emulated" and (cuda or k != "torch_cp")]
    for N in cfg["speed_Ns"]:
        full = [torch.from_numpy(a).to(dev) for a in _inputs(N, H, D, "bf16", "normal")]
        for W in cfg["Ws"]:
            for kernel in kernels:
                times = []
                if rank < W:
                    shards = [fd.shard(t, W, rank, layout="zigzag") for t in full]
                    for _ in range(cfg["reps"] + 1):
                        dist.barrier(group=groups[W])
                        if cuda:
                            torch.cuda.synchronize()
                        start = time.perf_counter()
                        if kernel == "torch_cp":
                            _cp_run(full, W, "bf16", _mesh(W, world, groups[W]) if W > 1 else None, gather=False)
                        else:
                            _fadev_run(shards, "zigzag", SPEED_MERGE, kernel, "bf16", groups[W])
                        if cuda:
                            torch.cuda.synchronize()
                        dist.barrier(group=groups[W])
                        times.append(time.perf_counter() - start)
                if rank == 0:
                    sec = float(np.median(times[1:]))
                    write({"phase": "speed", "N": N, "fmt": "bf16", "dist": "normal", "W": W, "layout": "zigzag",
                           "kernel": kernel, "merge": "torch_cp" if kernel == "torch_cp" else SPEED_MERGE,
                           "H": H, "D": D, "seconds": sec, "tokens_per_s": N / sec})
                dist.barrier()


def run(size="quick", out=None, *, device="cpu", workers=1, progress=False, cluster=None, **overrides):
    """Run the study (spawning ``spawn`` local ranks, or on torchrun's world) and return its rows (error rows
    and speed rows, column ``phase``). Its ranks are its own processes: ``cluster`` must be None or local."""
    if cluster and cluster.get("executor", "local") != "local":
        raise ValueError("cluster: ring-multigpu runs its own ranks (--spawn or torchrun), not a sweep on a cluster")
    cfg = fit_ring_sizes(common.sizes(SIZES, size, overrides), overrides)
    bad = [k for k in cfg["kernels"] if k not in KERNELS]
    if bad:
        raise ValueError(f"kernels: unknown {bad}; known: {', '.join(KERNELS)}")
    for name, known in (("fmts", ("bf16", "fp16")), ("dists", ("normal", "outlier")), ("layouts", LAYOUTS)):
        if any(x not in known for x in cfg[name]):
            raise ValueError(f"{name}: expected values among {', '.join(known)}, got {', '.join(cfg[name])}")
    if cfg["dim"] not in (64, 128) and "native" in cfg["kernels"]:
        raise ValueError(f"dim: kernel native runs head dimension 64 or 128, got {cfg['dim']}")
    parts = 2 * max(cfg["Ws"])
    if any(N % parts for N in tuple(cfg["Ns"]) + tuple(cfg["long_Ns"]) + tuple(cfg["speed_Ns"])):
        raise ValueError(f"Ns: every N must be divisible by 2 max(Ws) = {parts} (zigzag)")
    import torch
    gpu_kernels = [k for k in cfg["kernels"] if k in ("native", "torch_cp")]
    if gpu_kernels and not torch.cuda.is_available():
        raise ValueError(f"kernels: {', '.join(gpu_kernels)} run on CUDA GPUs only; PyTorch sees none here")
    return run_ranks(_study, cfg, out, NAME)


# ---------------------------------------------------------------- report

def _errs(df):
    return df[df["phase"] == "error"]


def _series(df, kernel, merge, x, **fixed):
    sel = df[(df["kernel"] == kernel) & (df["merge"] == merge)]
    for k, v in fixed.items():
        sel = sel[sel[k] == v]
    return sel.sort_values(x)


def _focus(df):
    """The slice the figures and W findings use: the largest N, bf16 (else the first format), normal, zigzag."""
    e = _errs(df)
    fmt = "bf16" if "bf16" in set(e["fmt"]) else sorted(set(e["fmt"]))[0]
    return {"N": int(e["N"].max()), "fmt": fmt, "dist": "normal", "layout": "zigzag"}


STYLES = {"emulated": ":x", "sdpa": "-o", "native": "--s", "torch_cp": "-D"}


def _panels(e, x, fixed, xlabel, stem):
    """out, dq, dk errors against ``x`` for every (kernel, merge) at the ``fixed`` columns; the figure's files."""
    fig, axes = plots.figure(12, 4, 1, 3)
    for ax, qn in zip(axes.ravel(), ("out", "dq", "dk")):
        for kernel, merge in sorted({(k, m) for k, m in zip(e["kernel"], e["merge"])}):
            sel = _series(e, kernel, merge, x, **fixed)
            if len(sel):
                ax.plot(sel[x], plots.positive(sel[qn]), STYLES[kernel], ms=4,
                        color=MERGE_COLORS.get(merge, "#9467bd"), label=f"{kernel}, {merge}")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel(xlabel)
        ax.set_ylabel(f"rel. L2 error of {qn} vs fp64")
        ax.set_title(", ".join(f"{k}={v}" for k, v in fixed.items()), fontsize=8)
    axes.ravel()[0].legend(fontsize=6)
    return plots.save(fig, stem)


def figures(df, out_dir):
    e, focus = _errs(df), _focus(df)
    paths = _panels(e, "W", focus, "ring size W (GPUs)", os.path.join(out_dir, FIGURES[0]))
    fixed = {"W": int(e["W"].max()), "fmt": focus["fmt"], "dist": "normal", "layout": "zigzag"}
    paths += _panels(e, "N", fixed, "sequence length N", os.path.join(out_dir, FIGURES[1]))
    s = df[df["phase"] == "speed"]
    fig, axes = plots.figure(6, 4)
    ax = axes[0, 0]
    for (kernel, N), sel in s.groupby(["kernel", "N"]):
        sel = sel.sort_values("W")
        ax.plot(sel["W"], sel["tokens_per_s"], STYLES[kernel], ms=4, label=f"{kernel}, N={N}")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("ring size W (GPUs)")
    ax.set_ylabel("tokens/s, forward + backward")
    ax.legend(fontsize=7)
    paths += plots.save(fig, os.path.join(out_dir, FIGURES[2]))
    return paths


def _ratio_text(values):
    v = np.asarray([x for x in values if np.isfinite(x)])
    return "n/a" if not len(v) else f"median x{np.median(v):.2f}, max x{v.max():.2f}"


def _paired(a, b, key_cols, qn):
    """a[qn] / b[qn] over the rows of a and b (DataFrames) that agree on key_cols."""
    m = a.merge(b, on=key_cols, suffixes=("_a", "_b"))
    return (m[f"{qn}_a"] / m[f"{qn}_b"]).to_numpy(dtype=float)


def findings(df, *, device="cpu") -> list:
    e, out = _errs(df), []
    if not len(e):
        return out
    Wmin, Wmax = int(e["W"].min()), int(e["W"].max())
    keys = ["N", "fmt", "dist", "layout", "kernel", "merge"]
    emu = e[e["kernel"] == "emulated"]
    if len(emu):
        exact = emu["bit_exact"].astype(bool)
        out.append(Finding(
            "fadev.distributed with kernel emulated vs the single-process simulation, on real ranks",
            f"{int(exact.sum())} of {len(emu)} configurations (W = {', '.join(map(str, sorted(set(emu['W']))))}; "
            f"N = {', '.join(map(str, sorted(set(emu['N']))))}; every layout, merge, format and input kind run) "
            "equal it bit for bit in out, LSE, dQ, dK and dV on every rank", holds=bool(exact.all()), source="fadev"))
    focus = _focus(df)
    for kernel in [k for k in ("sdpa", "native", "torch_cp", "emulated") if k in set(e["kernel"])]:
        ke = e[e["kernel"] == kernel]
        if Wmax > Wmin:
            parts = []
            for merge in sorted(set(ke["merge"])):
                me = ke[ke["merge"] == merge]
                lo, hi = me[me["W"] == Wmin], me[me["W"] == Wmax]
                parts.append(f"{merge}: " + "; ".join(
                    f"{qn} {_ratio_text(_paired(hi, lo, keys, qn))}" for qn in ("out", "dq", "dk", "dv")))
            out.append(Finding(f"{kernel}: error at W={Wmax} / error at W={Wmin}, over every N, format, input "
                               "kind and layout run", " | ".join(parts)))
        sel = ke[(ke["W"] == Wmax) & (ke["N"] == focus["N"]) & (ke["fmt"] == focus["fmt"])
                 & (ke["dist"] == "normal") & (ke["layout"] == "zigzag")]
        if len(sel) > 1:
            best = sel.sort_values("dk").iloc[0]
            out.append(Finding(
                f"{kernel}: the merges at W={Wmax}, N={focus['N']}, {focus['fmt']}, normal, zigzag (rel. L2 error "
                "of out / dq / dk / dv)",
                "; ".join(f"{r.merge}: {r.out:.2e} / {r.dq:.2e} / {r.dk:.2e} / {r.dv:.2e}"
                          for r in sel.sort_values("dk").itertuples()) + f"; smallest dK error: {best['merge']}"))
    for kernel in [k for k in ("sdpa", "native") if k in set(e["kernel"]) and "emulated" in set(e["kernel"])]:
        # a real kernel hands its partial out and dK/dV over in its input format: fp32_partials' fp32 pieces
        # cannot happen, and its prediction is lowp_partials' (the identity of the two is its own finding)
        a = e[e["kernel"] == kernel].drop(columns="kernel")
        a = a.assign(merge=a["merge"].replace(REAL_PARTIALS))
        b = e[e["kernel"] == "emulated"].drop(columns="kernel")
        k2 = ["N", "fmt", "dist", "layout", "merge", "W"]
        dev = np.concatenate([np.abs(_paired(a, b, k2, qn) - 1) for qn in ("out", "dq", "dk", "dv")])
        dev = dev[np.isfinite(dev)]
        if len(dev) and "device" in e and (e["device"] == "cuda").all():  # PyTorch's CPU flash is not FA2
            out.append(Finding(
                f"the real ring ({KERNEL_NAMES[kernel]} per piece) vs fadev's simulation of it (fa2 emulated, "
                "fp32_partials predicted as lowp_partials): relative L2 errors of out, dQ, dK, dV within 15% of "
                "the prediction", f"{len(dev)} pairs: largest deviation {100 * dev.max():.1f}%, median "
                f"{100 * np.median(dev):.1f}%", holds=bool(dev.max() <= 0.15), source="fadev"))
        lo = e[(e["kernel"] == kernel) & (e["merge"] == "lowp_partials")]
        hi = e[(e["kernel"] == kernel) & (e["merge"] == "fp32_partials")]
        k3 = ["N", "fmt", "dist", "layout", "W"]
        same = np.concatenate([_paired(hi, lo, k3, qn) for qn in ("out", "dq", "dk", "dv")])
        if len(same):
            out.append(Finding(
                f"{kernel}: merge fp32_partials vs lowp_partials with a real kernel (error ratio, every "
                "configuration and quantity)", f"x{np.nanmin(same):.4f} to x{np.nanmax(same):.4f} over "
                f"{len(same)} pairs: the kernel's partials arrive rounded to the input format, so merging them in "
                "fp32 changes nothing"
                if np.nanmax(np.abs(same - 1)) < 1e-9 else f"x{np.nanmin(same):.3f} to x{np.nanmax(same):.3f} "
                f"over {len(same)} pairs"))
    if {"torch_cp", "sdpa"} <= set(e["kernel"]):
        cp = e[e["kernel"] == "torch_cp"].drop(columns=["kernel", "merge"])
        ours = e[(e["kernel"] == "sdpa") & (e["merge"] == "fp32_partials")].drop(columns=["kernel", "merge"])
        k2 = ["N", "fmt", "dist", "layout", "W"]
        out.append(Finding(
            "PyTorch's context parallelism vs fadev's ring of the same flash kernel with merge fp32_partials "
            "(error of torch_cp / error of fadev sdpa)",
            "; ".join(f"{qn} {_ratio_text(_paired(cp, ours, k2, qn))}" for qn in ("out", "dq", "dk", "dv"))))
    out += _speed_findings(df[df["phase"] == "speed"])
    return out


def _speed_findings(s):
    if not len(s):
        return []
    N = int(s["N"].max())
    s = s[s["N"] == N]
    parts = []
    for kernel, sel in s.groupby("kernel"):
        sel = sel.sort_values("W")
        first, last = sel.iloc[0], sel.iloc[-1]
        scale = last["tokens_per_s"] / first["tokens_per_s"]
        parts.append(f"{kernel}: {first['tokens_per_s']:.3g} at W={int(first['W'])} -> {last['tokens_per_s']:.3g} at "
                     f"W={int(last['W'])} (x{scale:.2f})")
    return [Finding(f"tokens/s of forward + backward, N={N}, bf16", "; ".join(parts))]


def table(df) -> str:
    e = _errs(df)
    lines = ["| N | fmt | inputs | W | layout | kernel | merge | out | lse | dq | dk | dv | bit_exact | s |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in e.sort_values(["N", "fmt", "dist", "layout", "kernel", "merge", "W"]).to_dict("records"):
        exact = r.get("bit_exact")
        exact = "" if exact is None or (isinstance(exact, float) and np.isnan(exact)) else ("yes" if exact else "NO")
        lines.append(f"| {r['N']} | {r['fmt']} | {r['dist']} | {r['W']} | {r['layout']} | {r['kernel']} | "
                     f"{report.escape(r['merge'])} | " + " | ".join(
                         "-" if not np.isfinite(r[q]) else f"{r[q]:.2e}" for q in QUANTITIES)
                     + f" | {exact} | {r['seconds']:.1f} |")
    s = df[df["phase"] == "speed"]
    if len(s):
        lines += ["", "Speed (forward + backward, bf16, zigzag):", "",
                  "| N | W | kernel | merge | s | tokens/s |", "|---|---|---|---|---|---|"]
        for r in s.sort_values(["N", "kernel", "W"]).to_dict("records"):
            lines.append(f"| {r['N']} | {r['W']} | {r['kernel']} | {report.escape(r['merge'])} | "
                         f"{r['seconds']:.3f} | {r['tokens_per_s']:.3g} |")
    return "\n".join(lines)
