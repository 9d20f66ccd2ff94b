"""Ring attention on real ranks: a deep Llama-style model's gradient error vs ring size W and depth L.

Seed 002 (ring-flash-attention issue #42): "with Llama 405B there are many layers, and with ring sizes of 4
or 8 the numerical errors become catastrophic in backward ... the forward loss value can look quite
reasonable". This experiment runs fadev/experiments/llama.py's decoder with its attention context-parallel
over W real ranks (fadev.distributed.ring_attention: processes exchanging tensors through torch.distributed,
gloo on CPU, nccl on GPUs), forward and backward on one batch, for every merge, W and depth L; it compares
the loss and every parameter's gradient with an fp64 single-process run, and each number with the
single-process simulation's prediction (the same model with fadev.ring_attention on W simulated ranks).

Launch: ``python -m fadev ring-dist --spawn P`` (P local processes; W runs on ranks 0..W-1 of subgroups,
W <= P) or ``torchrun --nproc-per-node P -m fadev ring-dist`` (env://; only rank 0 writes the results).
"""
from __future__ import annotations

import json
import os

import numpy as np

from .. import plots, report
from ..ring import MERGES
from . import common
from .common import Finding

NAME = "ring_dist"
TITLE = "Ring attention on real ranks: a deep model's gradient error vs W and depth"
FIGURES = ("ring_dist_error_vs_W", "ring_dist_error_vs_depth")
REPRODUCE = False
OPTIONS = ()
"""The shared options its command takes: its ranks are its own processes (gloo, or nccl where every rank has a
GPU): no --device, no --cluster."""
POLICY = "fa2:bf16"
TIMEOUT_DOC = ("collective timeout (s): a rank waiting longer in one collective (another rank stalled or died) "
               "ends the study with a one-line error; rank 0 computes the fp64 reference while the others wait")
"""The ``timeout`` size (``--timeout``): a rank raising or dying still ends the others at once (spawn, torchrun's
agent); a stalled one ends them after it."""
MERGE_COLORS = {"lowp_partials": "#d62728", "fp32_partials": "#1f77b4", "lowp_running": "#ff7f0e",
                "allgather": "#2ca02c"}

INTRO = (
    f"A Llama-style decoder (RMSNorm, rotary embeddings, SwiGLU, grouped-query attention; random init, seed 0) "
    f"whose attention runs as ring attention over W processes (fadev.distributed, policy {POLICY} in every "
    "flash call, the merge of each row below), everything else in fp64. One batch of random tokens, causal "
    "language-model loss, forward and backward; the parameter gradients are summed over the ranks. Error = "
    "relative L2 error against the same model in fp64 in one process (exact attention); loss_diff = "
    "|loss - loss_fp64| / |loss_fp64|. Each measured number has beside it the single-process simulation's "
    "prediction (fadev.ring_attention on W simulated ranks inside the same model).")

SIZES = {
    "quick": {"spawn": 4, "Ws": (1, 2, 4), "Ls": (1, 2, 4), "N": 64, "dim": 64, "heads": 4, "heads_kv": 2,
              "layout": "zigzag", "kernels": ("emulated", "sdpa"), "timeout": 300.0},
    "full": {"spawn": 8, "Ws": (1, 2, 4, 8), "Ls": (1, 4, 16, 32), "N": 512, "dim": 128, "heads": 8, "heads_kv": 2,
             "layout": "zigzag", "kernels": ("emulated", "sdpa"), "timeout": 1800.0},
}
SIZE_DOCS = {"spawn": "local processes to spawn (ignored under torchrun, whose world is used)",
             "Ws": "ring sizes W (each at most the number of processes)", "Ls": "model depths L (layers)",
             "N": "tokens in the batch (the sequence)", "dim": "model width", "heads": "query heads",
             "heads_kv": "key/value heads (grouped-query)", "layout": "sequence layout over the ranks",
             "kernels": "per-piece kernels (emulated, sdpa)", "timeout": TIMEOUT_DOC}


def _rel(test, ref):
    return float(np.linalg.norm(test - ref) / np.linalg.norm(ref))


def _errors(loss, grads, ref_loss, ref_grads):
    """{loss_diff, grad, grad_<kind>, grad_L<i>}: relative L2 error of each group of parameters."""
    from .llama import group_of
    out = {"loss_diff": abs(float(loss) - float(ref_loss)) / abs(float(ref_loss))}
    groups = {"grad": list(grads)}
    for name in grads:
        layer, kind = group_of(name)
        groups.setdefault(f"grad_{kind}", []).append(name)
        if layer is not None:
            groups.setdefault(f"grad_L{layer}", []).append(name)
    for g, names in groups.items():
        out[g] = _rel(np.concatenate([grads[n].numpy().ravel() for n in names]),
                      np.concatenate([ref_grads[n].numpy().ravel() for n in names]))
    return out


def _study(rank, world, cfg, path):
    """Every rank: for each L, W, merge, kernel the distributed run on ranks 0..W-1 (on this rank's GPU under
    nccl); rank 0 adds the fp64 reference and the simulation's prediction (CPU) and appends a row to ``path``."""
    import torch.distributed as dist

    from .. import distributed as fd
    from . import llama
    import torch
    groups = {W: dist.new_group(list(range(W))) for W in cfg["Ws"]}
    dev = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    layout, N = cfg["layout"], cfg["N"]
    for L in cfg["Ls"]:
        mc = llama.Config(dim=cfg["dim"], heads=cfg["heads"], heads_kv=cfg["heads_kv"], ffn=2 * cfg["dim"], layers=L)
        params = llama.init(mc, seed=0)
        tokens, targets = llama.batch(mc, 1, N, seed=1)
        full_pos = np.arange(N)
        if rank == 0:
            ref = llama.gradients(params, mc, tokens, targets, full_pos, llama.exact_attention, N)
        for W in cfg["Ws"]:
            for merge in MERGES:
                if rank == 0:  # the prediction, once for every kernel
                    sim = llama.gradients(params, mc, tokens, targets, full_pos,
                                          llama.simulated_attention(POLICY, W, layout, merge), N)
                for kernel in cfg["kernels"]:
                    if rank < W:
                        pos = fd.shard(full_pos[:, None], W, rank, layout=layout)[:, 0]
                        tk, tg = (fd.shard(t[..., None], W, rank, layout=layout)[..., 0] for t in (tokens, targets))

                        def attn(q, k, v):
                            return fd.ring_attention(q, k, v, POLICY, layout=layout, merge=merge, causal=True,
                                                     kernel=kernel, group=groups[W])
                        on_dev = {n: p.to(dev) for n, p in params.items()}
                        loss, grads = llama.gradients(on_dev, mc, tk.to(dev), tg.to(dev), pos, attn, N)
                        for t in [loss] + list(grads.values()):
                            dist.all_reduce(t, group=groups[W])
                        loss, grads = loss.cpu(), {n: g.cpu() for n, g in grads.items()}
                    if rank == 0:
                        row = {"L": L, "W": W, "merge": merge, "kernel": kernel, **_errors(loss, grads, *ref)}
                        row.update({f"pred_{k}": v for k, v in _errors(*sim, *ref).items()})
                        row["max_dev_from_prediction"] = max(
                            _rel(grads[n].numpy(), sim[1][n].numpy()) for n in grads)
                        with open(path, "a") as f:
                            f.write(json.dumps(row) + "\n")
                    dist.barrier()


def run(size="quick", out=None, *, device="cpu", workers=1, progress=False, cluster=None, **overrides):
    """Run the study (spawning ``spawn`` local ranks, or on torchrun's world) and return its rows. Its ranks
    are its own processes, so it takes no sweep executor: ``cluster`` must be None or the local one."""
    if cluster and cluster.get("executor", "local") != "local":
        raise ValueError("cluster: ring-dist runs its own ranks (--spawn or torchrun), not a sweep on a cluster")

    return run_ranks(_study, fit_ring_sizes(common.sizes(SIZES, size, overrides), overrides), out, NAME)


def run_ranks(study, cfg, out, name):
    """The rows (a DataFrame) of ``study`` launched on its ranks (:func:`launch`): the world checked first, then
    out/NAME.jsonl started afresh (a study on ranks is not resumable) and read back once rank 0 wrote it."""
    import pandas as pd

    from .. import distributed as fd
    check_world(cfg)  # before the old results are removed
    fd.timeout_seconds(cfg["timeout"])
    out = out or "results"
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, f"{name}.jsonl")
    if os.path.exists(path):
        os.remove(path)
    launch(study, cfg, path, cfg["timeout"])
    with open(path) as f:
        return pd.DataFrame([json.loads(line) for line in f])


LAUNCHED = {}
"""The last :func:`launch` in this process: {"world": processes, "backend": "nccl" or "gloo"} (for ran_on)."""


def ran_on(device):
    """Where the last launch's ranks ran, as report text (its processes and GPUs, not ``device``)."""
    if not LAUNCHED:
        return common.ran_on(device)
    world = LAUNCHED["world"]
    if LAUNCHED["backend"] == "nccl":
        import torch
        names = sorted({torch.cuda.get_device_name(i) for i in range(min(world, torch.cuda.device_count()))})
        return f"{world} processes, one per GPU ({', '.join(names)}), NCCL"
    return f"{world} processes on the CPU, gloo"


def world_of(cfg) -> int:
    """The number of processes a study runs on: torchrun's world, else cfg["spawn"]."""
    return int(os.environ["WORLD_SIZE"]) if "RANK" in os.environ and "WORLD_SIZE" in os.environ else cfg["spawn"]


def fit_ring_sizes(cfg, overrides) -> dict:
    """``cfg`` with the size's ring sizes cut to the processes given (``--spawn 2 --quick`` runs W = 1, 2), unless
    the ring sizes were chosen too (``Ws`` in ``overrides``: then a size above the world stays an error)."""
    if (overrides or {}).get("Ws") is None:
        world = world_of(cfg)
        cfg = dict(cfg, Ws=tuple(W for W in cfg["Ws"] if W <= world))
    return cfg


def check_world(cfg):
    """The number of processes (:func:`world_of`); ValueError when a ring size exceeds it."""
    world = world_of(cfg)
    too_big = [W for W in cfg["Ws"] if W > world]
    if too_big:
        raise ValueError(f"Ws: ring sizes {too_big} exceed the {world} processes (--spawn or torchrun's world)")
    return world


def launch(study, cfg, path, timeout):
    """Run ``study(rank, world, cfg, path)`` on torchrun's world (env://; ranks other than 0 exit after it) or
    on ``cfg["spawn"]`` spawned local processes (nccl when PyTorch sees that many GPUs, else gloo); every
    ring size in cfg["Ws"] must fit the world."""
    import torch

    from .. import distributed as fd
    world, torchrun = check_world(cfg), "RANK" in os.environ and "WORLD_SIZE" in os.environ
    if torchrun:
        rank, _ = fd.init(timeout=timeout)
        LAUNCHED.update(world=world, backend=torch.distributed.get_backend())
        study(rank, world, cfg, path)
        if rank != 0:
            raise SystemExit(0)  # rank 0 writes the results and the report
    else:
        backend = "nccl" if torch.cuda.is_available() and torch.cuda.device_count() >= world else "gloo"
        LAUNCHED.update(world=world, backend=backend)
        fd.spawn(study, world, cfg, path, backend=backend, timeout=timeout)


def _at(rows, **match):
    return [r for r in rows if all(r[k] == v for k, v in match.items())]


def figures(df, out_dir):
    rows = df.to_dict("records")
    Lmax, Wmax = max(df["L"]), max(df["W"])
    paths = []
    for stem, x, fixed, label in ((FIGURES[0], "W", {"L": Lmax}, "ring size W (ranks)"),
                                  (FIGURES[1], "L", {"W": Wmax}, "depth L (layers)")):
        fig, axes = plots.figure(10, 4, 1, 2)
        for ax, q in zip(axes.ravel(), ("grad", "loss_diff")):
            drawn = []
            for merge in MERGES:
                for kernel, style in zip(sorted(set(df["kernel"])), ("-o", "--s", ":^")):
                    sel = sorted(_at(rows, merge=merge, kernel=kernel, **fixed), key=lambda r: r[x])
                    xs = [r[x] for r in sel]
                    ax.plot(xs, plots.positive([r[q] for r in sel]), style, ms=3, color=MERGE_COLORS[merge],
                            label=f"{merge}, {kernel}")
                    drawn += [r[q] for r in sel] + [r[f"pred_{q}"] for r in sel]
                ax.plot(xs, plots.positive([r[f"pred_{q}"] for r in sel]), "x", ms=7, color=MERGE_COLORS[merge],
                        label=f"{merge} (simulation)")
            ax.set_xscale("log", base=2)
            plots.value_scale(ax, drawn)  # log only where the values span a decade: flat lines stay flat
            ax.set_xlabel(label)
            ax.set_ylabel(f"{'rel. L2 error of all gradients' if q == 'grad' else 'relative loss difference'}")
            ax.set_title(f"{q} vs fp64, " + ", ".join(f"{k}={v}" for k, v in fixed.items()))
        axes.ravel()[0].legend(fontsize=6.5)
        paths += plots.save(fig, os.path.join(out_dir, stem))
    return paths


def _growth(rows, merge, kernel, x, fixed):
    sel = sorted(_at(rows, merge=merge, kernel=kernel, **fixed), key=lambda r: r[x])
    return sel[-1]["grad"] / sel[0]["grad"], sel[0], sel[-1]


def findings(df, *, device="cpu") -> list:
    rows = df.to_dict("records")
    out = []
    for kernel in sorted(set(df["kernel"])):
        Lmax, Wmax, Wmin, Lmin = max(df["L"]), max(df["W"]), min(df["W"]), min(df["L"])
        for merge in MERGES:
            gw, a, b = _growth(rows, merge, kernel, "W", {"L": Lmax})
            gl, c, d = _growth(rows, merge, kernel, "L", {"W": Wmax})
            verdict = "grows" if gw > 1.2 else "does not grow"
            out.append(Finding(
                f"{kernel}, {merge}: gradient error vs W (L={Lmax}) and vs depth (W={Wmax})",
                f"{verdict} with W: {a['grad']:.2e} at W={Wmin} -> {b['grad']:.2e} at W={Wmax} (x{gw:.2f}); "
                f"{'grows' if gl > 1.2 else 'does not grow'} with depth: {c['grad']:.2e} at L={Lmin} -> "
                f"{d['grad']:.2e} at L={Lmax} (x{gl:.2f}); loss difference at W={Wmax}, L={Lmax}: "
                f"{d['loss_diff']:.2e}"))
        worst = _at(rows, kernel=kernel, W=Wmax, L=Lmax)
        best = min(worst, key=lambda r: r["grad"])
        base = _at(worst, merge="lowp_partials")[0]
        gain = (f"x{base['grad'] / best['grad']:.2f} below lowp_partials ({base['grad']:.2e})"
                if best["merge"] != "lowp_partials" else "no other merge is below it")
        out.append(Finding(f"{kernel}: the merge with the smallest gradient error at W={Wmax}, L={Lmax}",
                           f"{best['merge']}: {best['grad']:.2e}, {gain}; the loss differences of all merges "
                           f"there are at most {max(r['loss_diff'] for r in worst):.2e}"))
        if kernel != "emulated":
            dev = (df[df["kernel"] == kernel]["grad"] / df[df["kernel"] == kernel]["pred_grad"] - 1).abs()
            out.append(Finding(f"{kernel}: its gradient error vs the simulation's prediction ({POLICY})",
                               f"within {100 * float(dev.max()):.0f}% in every configuration (median "
                               f"{100 * float(dev.median()):.0f}%)"))
    emu = df[df["kernel"] == "emulated"]
    if len(emu):
        dev = float(emu["max_dev_from_prediction"].max())
        ratio = float((emu["grad"] / emu["pred_grad"] - 1).abs().max())
        text = (f"every parameter gradient within {dev:.1e} (relative L2) of the single-process simulation's; "
                f"the gradient error itself within {ratio:.1e} relative of the predicted one")
        if dev < 1e-12:  # fp64 rounding level: what bit-identical attention leaves (summation order across ranks)
            text += " (fp64 rounding level: the ranks' attention matches the simulation's, the rest of the model " \
                    "differs only in the order of fp64 sums across ranks)"
        out.append(Finding("the simulation's prediction vs the real ranks (kernel emulated)", text,
                           holds=bool(ratio < 0.01), source="fadev"))
    return out


def table(df) -> str:
    lines = ["| kernel | merge | W | L | loss_diff (pred) | grad (pred) | grad_attn | grad_mlp | grad_embed |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in df.sort_values(["kernel", "merge", "L", "W"]).to_dict("records"):
        lines.append(f"| {r['kernel']} | {report.escape(r['merge'])} | {r['W']} | {r['L']} | "
                     f"{r['loss_diff']:.2e} ({r['pred_loss_diff']:.2e}) | {r['grad']:.2e} ({r['pred_grad']:.2e}) | "
                     f"{r['grad_attn']:.2e} | {r['grad_mlp']:.2e} | {r['grad_embed']:.2e} |")
    return "\n".join(lines)
