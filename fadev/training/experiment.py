"""``python -m fadev train-drift``: Golden et al.'s training-drift study (arXiv 2405.02803, Section 5,
Figures 7-8) on an open workload -- does flash attention change the trained weights, and by how much
next to a different initialisation and to low-precision training?

Runs (fadev.training.tracker; everything not listed is shared: data order, optimizer, init seed 0):

=================  ========  ===========  =========  ==========================================
run                kernel    attention    model      what it is
=================  ========  ===========  =========  ==========================================
``baseline``       baseline  naive(bf16)  bf16 mix.  the reference: PyTorch-style attention in bf16
``flash_paper``    flash     paper(bf16)  bf16 mix.  the paper's flash re-implementation in bf16
``flash_fa2``      flash     fa2(bf16)    bf16 mix.  FlashAttention-2's kernel numerics
``baseline_seed1`` baseline  naive(bf16)  bf16 mix.  init seed 1: the initialisation bound
``fp32``           baseline  golden       fp32       full-precision training (attention in fp64)
``fp16`` (full)    baseline  naive(fp16)  fp16 mix.  fp16 mixed precision
``control``        baseline  naive(bf16)  bf16 mix.  identical to ``baseline``: must not drift at all
=================  ========  ===========  =========  ==========================================

Flash tiles are scaled to the 64-token sequence: ``block_q = block_kv = flash_block`` (16), so each query
row runs through up to 4 K/V blocks of online-softmax rescaling (at the presets' 64 or 128 the whole
sequence fits in one block and tiling does nothing). "bf16 mix." = autocast-style mixed precision
(fadev.training.digits: matmul inputs, weights, outputs and their gradients in bf16, fp32 accumulation,
fp32 master weights). The low-precision pair ``bf16 mixed vs fp32`` thus changes the precision of the
whole model, attention included (naive(bf16) against golden), as switching a training run to bf16 does.

Pairs: flash paper vs baseline, flash fa2 vs baseline (role "flash"); seed 1 vs seed 0 ("init"); bf16
(and fp16) mixed vs fp32 ("precision"); control vs baseline ("control").
"""
from __future__ import annotations

import dataclasses
import datetime
import math
import os
import platform
import time

import numpy as np

from ..sweep_cli import positive_int


PAPER_RATIO = (0.2, 0.5)
"""Golden et al.: flash's weight drift is ~1/5 to 1/2 of low-precision training's."""

SIZES = {
    "quick": {"width": 64, "heads": 4, "layers": 2, "batch": 32, "lr": 2e-3, "steps": 200, "log_every": 10,
              "eval_images": 96, "flash_block": 16, "fp16": False},
    "full": {"width": 128, "heads": 4, "layers": 4, "batch": 64, "lr": 1e-3, "steps": 2000, "log_every": 50,
             "eval_images": 297, "flash_block": 16, "fp16": True},
}
SIZE_DOCS = {"width": "model width", "heads": "attention heads", "layers": "transformer blocks",
             "batch": "images per update", "lr": "Adam learning rate", "steps": "optimizer updates",
             "log_every": "log distances every so many updates", "eval_images": "held-out images for eval_loss",
             "flash_block": "flash block_q = block_kv", "fp16": "also an fp16 mixed-precision run"}


def runs_and_pairs(flash_block=16, fp16=False, control=True):
    """The experiment's RunSpecs and Pairs (module docstring)."""
    from .tracker import Pair, RunSpec
    tiles = (("block_q", flash_block), ("block_kv", flash_block))
    runs = [RunSpec("baseline", "baseline", "naive:bf16", "bf16"),
            RunSpec("flash_paper", "flash", "paper:bf16", "bf16", tiling=tiles),
            RunSpec("flash_fa2", "flash", "fa2:bf16", "bf16", tiling=tiles),
            RunSpec("baseline_seed1", "baseline", "naive:bf16", "bf16", init_seed=1),
            RunSpec("fp32", "baseline", "golden", "fp32")]
    pairs = [Pair("flash paper(bf16) vs baseline", "flash_paper", "baseline", "flash"),
             Pair("flash fa2(bf16) vs baseline", "flash_fa2", "baseline", "flash"),
             Pair("init seed 1 vs seed 0", "baseline_seed1", "baseline", "init"),
             Pair("bf16 mixed vs fp32", "baseline", "fp32", "precision")]
    if fp16:
        runs.append(RunSpec("fp16", "baseline", "naive:fp16", "fp16"))
        pairs.append(Pair("fp16 mixed vs fp32", "fp16", "fp32", "precision"))
    if control:
        runs.append(RunSpec("control", "baseline", "naive:bf16", "bf16"))
        pairs.append(Pair("control (identical runs)", "control", "baseline", "control"))
    return runs, pairs


def settings(size="quick", **overrides):
    """The size's settings with ``overrides`` (None values ignored); ValueError for unknown names."""
    if size not in SIZES:
        raise ValueError(f"size must be 'quick' or 'full', got {size!r}")
    unknown = sorted(set(overrides) - set(SIZES[size]))
    if unknown:
        raise ValueError(f"unknown setting(s) {', '.join(unknown)}; known: {', '.join(SIZES[size])}")
    s = dict(SIZES[size])
    s.update({k: v for k, v in overrides.items() if v is not None})
    return s


def check_device(device):
    """ValueError/RuntimeError unless ``device`` can run the experiment. On 'cuda' the models and batches live on
    the GPU and fadev.torch runs attention with fadev's GPU kernels (same bits as on the CPU); cuBLAS is put in
    its deterministic mode (CUBLAS_WORKSPACE_CONFIG) so that lockstep runs stay comparable."""
    import fadev
    if device == "cpu":
        return
    if device != "cuda":
        raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")
    if not fadev.cuda_available():
        raise RuntimeError("--device cuda: no CUDA device fadev can use (fadev.cuda_available() is False); run with "
                           "--device cpu")
    import torch
    if not torch.cuda.is_available():
        raise RuntimeError("--device cuda: this PyTorch has no CUDA (install a CUDA build of torch), or run with "
                           "--device cpu")
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # torch's deterministic cuBLAS needs it


def run(size="quick", out="results", device="cpu", log=None, **overrides):
    """Run the experiment into ``out``/train_drift.jsonl (resumable); returns (drift, loss, settings)."""
    from .tracker import TrainConfig, track
    check_device(device)
    s = settings(size, **overrides)
    config = TrainConfig(**{f.name: s[f.name] for f in dataclasses.fields(TrainConfig) if f.name in s})
    runs, pairs = runs_and_pairs(s["flash_block"], s["fp16"])
    os.makedirs(out, exist_ok=True)
    drift, loss = track(config, runs, pairs, out=os.path.join(out, "train_drift.jsonl"), device=device, log=log)
    return drift, loss, s


# ------------------------------------------------------------------ summary numbers

def ratios(drift, metric):
    """{flash pair: {reference role: (geometric-mean ratio over the second half of the logged steps,
    ratio at the last step)}} of flash-vs-baseline drift to each reference pair's drift (for the
    "precision" role, to the first precision pair, bf16 vs fp32)."""
    steps = sorted(drift["step"].unique())
    last = steps[-1]
    late = [s for s in steps if s > 0 and s >= last / 2]
    table = {}
    refs = {}
    for role in ("precision", "init"):
        names = list(dict.fromkeys(drift.loc[drift["role"] == role, "pair"]))
        if names:
            refs[role] = names[0]
    by = drift.set_index(["pair", "step"])[metric]
    for pair in dict.fromkeys(drift.loc[drift["role"] == "flash", "pair"]):
        table[pair] = {}
        for role, ref in refs.items():
            r = np.array([by[(pair, s)] / by[(ref, s)] for s in late], dtype=float)
            good = r[np.isfinite(r) & (r > 0)]
            gmean = float(np.exp(np.mean(np.log(good)))) if len(good) else math.nan
            table[pair][role] = (gmean, float(by[(pair, last)] / by[(ref, last)]), ref)
    return table


# ------------------------------------------------------------------ figures

_STYLE = {"flash": ("-", "o"), "init": ("--", "s"), "precision": (":", "^"), "control": ("-.", "x"),
          "other": ("-", ".")}
_PAIR_COLORS = ["#d62728", "#ff7f0e", "#7f7f7f", "#1f77b4", "#17becf", "#2ca02c", "#9467bd"]


def fig_drift(drift, log_y):
    """Figures 7/8: model max |a - b| and Wasserstein-1 of the weights vs training step, every pair."""
    from ..plots import _figure, _positive
    fig, axes = _figure(11, 4.8, 1, 2)
    for ax, metric, title in ((axes[0, 0], "max_abs", "max |Δw| over all weights"),
                              (axes[0, 1], "wasserstein", "Wasserstein-1 (size-weighted mean over tensors)")):
        for i, pair in enumerate(dict.fromkeys(drift["pair"])):
            g = drift[drift["pair"] == pair].sort_values("step")
            role = g["role"].iloc[0]
            ls, marker = _STYLE.get(role, _STYLE["other"])
            y = g[metric].to_numpy(dtype=float)
            label = pair + (" (0 at every step)" if role == "control" and not np.any(y) else "")
            ax.plot(g["step"], _positive(y) if log_y else y, linestyle=ls, marker=marker, markersize=3.5,
                    color=_PAIR_COLORS[i % len(_PAIR_COLORS)], label=label)
        if log_y:
            ax.set_yscale("log")
        ax.set_xlabel("training step (optimizer updates)")
        ax.set_ylabel("max |Δw|" if metric == "max_abs" else "W1 distance")
        ax.set_title(title)
    handles, labels = axes[0, 0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside lower center", ncol=3, fontsize=8.5)
    fig.suptitle("Weight drift between training runs (run a − run b): flash vs baseline attention, next to another "
                 "init seed and to bf16 training" + (" — log y" if log_y else ""), fontsize=10.5)
    return fig


def fig_loss(loss):
    """Held-out and training loss of every run vs step."""
    from ..plots import _figure
    fig, axes = _figure(11, 4.4, 1, 2)
    for i, run_name in enumerate(dict.fromkeys(loss["run"])):
        g = loss[loss["run"] == run_name].sort_values("step")
        style = {"color": _PAIR_COLORS[i % len(_PAIR_COLORS)], "linestyle": ("-", "--", ":", "-.")[i % 4],
                 "linewidth": 2.2 - 0.25 * i, "label": run_name}
        axes[0, 0].plot(g["step"], g["eval_loss"], **style)
        t = g[g["step"] > 0]
        axes[0, 1].plot(t["step"], t["train_loss"], **style)
    axes[0, 0].set_title("held-out loss (cross-entropy per pixel)")
    axes[0, 1].set_title("training loss (mean since the previous point)")
    for ax in axes[0]:
        ax.set_xlabel("training step")
        ax.set_ylabel("nats per pixel")
    handles, labels = axes[0, 0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside lower center", ncol=len(labels), fontsize=8.5)
    return fig


def plot(drift, loss, out_dir):
    from ..plots import save
    return (save(fig_drift(drift, False), os.path.join(out_dir, "train_drift_linear")) +
            save(fig_drift(drift, True), os.path.join(out_dir, "train_drift_log")) +
            save(fig_loss(loss), os.path.join(out_dir, "train_drift_loss")))


# ------------------------------------------------------------------ report

def _fmt(v):
    return "0" if v == 0 else f"{v:.3g}" if abs(v) >= 1e-3 else f"{v:.2e}"


def verdicts(drift):
    """[(flash pair, metric, ratio to precision, ratio to init, holds)] -- holds: the late-training ratio
    of flash drift to the bf16-vs-fp32 drift lies in the paper's [1/5, 1/2]."""
    out = []
    for metric in ("max_abs", "wasserstein"):
        for pair, refs in ratios(drift, metric).items():
            prec = refs.get("precision", (math.nan,) * 3)
            init = refs.get("init", (math.nan,) * 3)
            holds = PAPER_RATIO[0] <= prec[0] <= PAPER_RATIO[1]
            out.append((pair, metric, prec, init, holds))
    return out


def write_report(path, drift, loss, s, figures, seconds, size, device):
    from ..report import PAPER, _md
    from . import digits
    out_dir = os.path.dirname(os.path.abspath(path))
    runs, pairs = runs_and_pairs(s["flash_block"], s["fp16"])
    last = int(drift["step"].max())
    lines = ["## Training drift: does flash attention change the trained weights?", "",
             f"{PAPER}, Section 5 (Figures 7-8) on an open workload. `{size}` sizes, device `{device}`; "
             f"{platform.machine()}, {os.cpu_count()} CPUs; {datetime.date.today().isoformat()}; {seconds:.0f} s in this "
             f"invocation (logged steps are read back, not recomputed). Regenerate with `python -m fadev train-drift "
             f"--{size} --out DIR`.", "",
             "**Workload.** A label-conditioned autoregressive transformer generating scikit-learn's 8x8 handwritten "
             f"digits pixel by pixel ({digits.LEVELS} intensity levels; 1500 training and 297 held-out images shipped "
             f"with the package): width {s['width']}, {s['heads']} heads (head dim {s['width'] // s['heads']}), "
             f"{s['layers']} blocks, causal attention over 64 tokens, Adam lr {s['lr']}, batch {s['batch']}, "
             f"{s['steps']} updates. Every run shares the data order and (except `baseline_seed1`) the initial "
             "weights; every attention call goes through `fadev.torch.patch_sdpa` with the run's kernel and policy. "
             "One torch thread, deterministic algorithms: identical settings give identical bits "
             "(the control pair).", "",
             "**Mixed precision** (`bf16`): autocast-style, emulated in fp32 tensors -- every matmul outside "
             "attention rounds its input, weight, bias and output (and their gradients) to bf16 with fp32 "
             "accumulation; master weights, embeddings, LayerNorm, residual stream, loss and Adam in fp32. The "
             "low-precision reference `bf16 mixed vs fp32` compares that run (attention naive(bf16)) with an all-fp32 "
             "run (attention golden): everything a switch to bf16 changes. Flash tiles: "
             f"{s['flash_block']}x{s['flash_block']} (a 64-token row spans {math.ceil(64 / s['flash_block'])} K/V "
             "blocks).", "",
             "| run | setting |", "|---|---|"]
    lines += [f"| `{r.name}` | {_md(r.label())} |" for r in runs]
    lines += ["", "**Distances** between the weights of two runs (`fadev.weights.compare`): max |Δw| over all "
              "tensors, and the Wasserstein-1 distance of each tensor's value distribution, averaged over tensors "
              "weighted by size.", ""]
    for fig in figures:
        if fig.endswith(".png"):
            lines += [f"![{os.path.basename(fig)}]({os.path.relpath(fig, out_dir)})", ""]
    steps = sorted(drift["step"].unique())
    shown = sorted({steps[min(len(steps) - 1, round(i * (len(steps) - 1) / 4))] for i in range(5)})
    lines += ["Drift at selected steps (max |Δw| / Wasserstein-1):", "",
              "| pair | " + " | ".join(f"step {st}" for st in shown) + " |",
              "|---|" + "---|" * len(shown)]
    by = drift.set_index(["pair", "step"])
    for p in pairs:
        cells = [f"{_fmt(by.loc[(p.name, st), 'max_abs'])} / {_fmt(by.loc[(p.name, st), 'wasserstein'])}"
                 for st in shown]
        lines.append(f"| {_md(p.name)} | " + " | ".join(cells) + " |")
    lines += ["", f"**Ratios** of flash-vs-baseline drift to the references: geometric mean over the logged steps "
              f"in the second half of training (value at step {last} in brackets). The paper: flash's drift is "
              "1/2..1/5 of low-precision training's (a private text-to-image model); a verdict holds when our "
              "late-training ratio to `bf16 mixed vs fp32` lies in [0.2, 0.5].", "",
              "| flash pair | metric | / low precision (bf16 vs fp32) | / init seed | paper 1/2..1/5 |",
              "|---|---|---|---|---|"]
    for pair, metric, prec, init, holds in verdicts(drift):
        lines.append(f"| {_md(pair)} | {metric} | {prec[0]:.3g} ({prec[1]:.3g}) | {init[0]:.3g} ({init[1]:.3g}) | "
                     f"{'holds' if holds else '**does not hold**'} |")
    control = drift[drift["role"] == "control"]
    if len(control):
        zero = bool((control["max_abs"] == 0).all() and (control["wasserstein"] == 0).all())
        lines += ["", f"Control (two identical runs): drift {'exactly 0 at every logged step' if zero else '**not 0**'}"
                  f" ({len(control)} steps)."]
    lines += ["", _conclusion(drift), ""]
    final = loss[loss["step"] == last].set_index("run")
    lines += [f"Held-out loss at step {last} (nats per pixel; step 0: "
              f"{loss[loss['step'] == 0]['eval_loss'].iloc[0]:.3f}): " +
              ", ".join(f"`{r}` {final.loc[r, 'eval_loss']:.4f}" for r in final.index) + ".",
              "Training time per run (s per update, as logged when the steps ran; 1 torch thread): " +
              ", ".join(f"`{r}` {_per_step(loss, r, s):.3f}" for r in final.index) + ".", "",
              "Raw rows: `train_drift.jsonl` (resumable; checkpoint `train_drift.jsonl.ckpt`); tables "
              "`train_drift.csv`, `train_drift_loss.csv`.", ""]
    with open(path, "w") as fh:
        fh.write("\n".join(lines))
    return path


def _per_step(loss, run_name, s):
    g = loss[(loss["run"] == run_name) & (loss["step"] > 0)].sort_values("step")
    if not len(g):
        return math.nan
    prev = [0] + list(g["step"])[:-1]
    n = np.array(g["step"]) - np.array(prev)
    return float(g["seconds"].sum() / n.sum())


def _conclusion(drift):
    v = verdicts(drift)
    held = [x for x in v if x[4]]
    parts = []
    for pair, metric, prec, init, holds in v:
        parts.append(f"{pair} / {metric}: {prec[0]:.2g}x the low-precision drift, {init[0]:.2g}x the init-seed drift")
    verdict = ("holds for all" if len(held) == len(v) else "holds for none" if not held else
               f"holds for {len(held)} of {len(v)}")
    below = all(x[2][0] < 1 for x in v)
    return (f"**Verdict.** The paper's 1/5..1/2 {verdict} of the (flash pair, metric) combinations; flash's drift is "
            f"{'below' if below else 'not always below'} the low-precision drift. " + "; ".join(parts) + ".")


# ------------------------------------------------------------------ command line

def add_subcommand(sub):
    sp = sub.add_parser("train-drift", help="weight drift of training with flash vs baseline attention (Golden et al. "
                                             "Section 5): runs, figures, train_drift.md",
                        description="Train a small digits-generating transformer with baseline and flash attention, "
                                    "a second init seed, and fp32 vs bf16 mixed precision, in lockstep; log the weight "
                                    "distances (max |dw|, Wasserstein-1) between pairs of runs every few steps "
                                    "(resumable), and write DIR/train_drift.md, figures and CSV tables.")
    size = sp.add_mutually_exclusive_group()
    size.add_argument("--quick", dest="size", action="store_const", const="quick",
                      help="small model, 200 updates: a few minutes on a 2-core CPU (the default)")
    size.add_argument("--full", dest="size", action="store_const", const="full",
                      help="larger model, 2000 updates, an fp16 run too")
    sp.set_defaults(size="quick")
    sp.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="default cpu; cuda: models on the GPU, attention through fadev's GPU kernels")
    sp.add_argument("--out", default="results", metavar="DIR", help="output folder (default: results)")
    for key, quick in SIZES["quick"].items():
        if isinstance(quick, bool):
            continue
        kind = float if isinstance(quick, float) else positive_int
        sp.add_argument(f"--{key.replace('_', '-')}", dest=key, type=kind, default=None, metavar=key.upper(),
                        help=f"{SIZE_DOCS[key]} (quick: {quick}; full: {SIZES['full'][key]})")
    sp.set_defaults(func=cmd_train_drift)


def cmd_train_drift(args) -> int:
    import sys
    overrides = {k: getattr(args, k) for k in SIZES["quick"] if getattr(args, k, None) is not None}
    start = time.perf_counter()
    try:
        drift, loss, s = run(args.size, args.out, args.device, log=lambda line: print(line, flush=True), **overrides)
    except (OSError, ValueError, RuntimeError, ImportError) as e:
        print(f"fadev train-drift: {e}", file=sys.stderr)
        return 1
    drift.to_csv(os.path.join(args.out, "train_drift.csv"), index=False)
    loss.to_csv(os.path.join(args.out, "train_drift_loss.csv"), index=False)
    figures = plot(drift, loss, args.out)
    path = write_report(os.path.join(args.out, "train_drift.md"), drift, loss, s, figures,
                        time.perf_counter() - start, args.size, args.device)
    print(_conclusion(drift))
    print(f"\n{len(drift)} drift rows in {os.path.join(args.out, 'train_drift.csv')}; figures: "
          f"{', '.join(os.path.basename(p) for p in figures)}; report: {path} ({time.perf_counter() - start:.0f} s)")
    return 0


__all__ = ["run", "runs_and_pairs", "settings", "ratios", "verdicts", "plot", "fig_drift", "fig_loss",
           "write_report", "add_subcommand", "SIZES", "PAPER_RATIO"]
