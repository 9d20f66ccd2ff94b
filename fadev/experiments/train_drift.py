"""Training drift, ``python -m fadev train-drift``: Golden et al.'s training-drift study (arXiv 2405.02803, Section 5,
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

``--model llama``: the same study at scale on a Hugging Face ``LlamaForCausalLM`` trained on bytes of real
text (the interpreter's standard library), arms as independent resumable tasks, the native tensor-core
kernel at two tilings on a GPU (:data:`LLAMA_SIZES`, :func:`llama_runs_and_pairs`, fadev.training.lm).

The workload and the lockstep tracker live in :mod:`fadev.training` (PyTorch, imported on first use).
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import tempfile
import warnings

import numpy as np

from .. import cuda_available, plots, report, training
from . import train_drift_real as real
from .common import PAPER, Finding

NAME = "train_drift"
TITLE = "Training drift: does flash attention change the trained weights?"
FIGURES = ("train_drift_linear", "train_drift_log", "train_drift_loss")
SHOWN_OPTIONS = ("kernels",)
"""Settings named in the report's title and regenerate command when not the default: they choose the study."""
RUN_OPTIONS = ("budget_s",)
"""Settings left out of the report's regenerate command: they say how one call runs, not what it computes."""
EXTRA_FIGURES = ("train_drift_loglog", "train_drift_layers")
"""Drawn for ``--kernels real`` only."""
REPRODUCE = False
"""Not part of ``python -m fadev reproduce``'s default set (it needs PyTorch; ``--only train_drift`` adds it)."""

INTRO = (
    f"{PAPER}, Section 5 (Figures 7-8) on an open workload.\n\n"
    "**Workload.** A label-conditioned autoregressive transformer generating scikit-learn's 8x8 handwritten "
    "digits pixel by pixel (17 intensity levels; 1500 training and 297 held-out images shipped with the "
    "package; width, heads, blocks, learning rate, batch and updates: the sizes below), causal attention over 64 "
    "tokens, Adam. Every run shares the data order and (except `baseline_seed1`) the initial weights; every "
    "attention call goes through `fadev.torch.patch_sdpa` with the run's kernel and policy. One torch thread, "
    "deterministic algorithms: identical settings give identical bits (the control pair).\n\n"
    "**Mixed precision** (`bf16`): autocast-style, emulated in fp32 tensors -- every matmul outside attention "
    "rounds its input, weight, bias and output (and their gradients) to bf16 with fp32 accumulation; master "
    "weights, embeddings, LayerNorm, residual stream, loss and Adam in fp32. The low-precision reference `bf16 "
    "mixed vs fp32` compares that run (attention naive(bf16)) with an all-fp32 run (attention golden): "
    "everything a switch to bf16 changes. Flash tiles: flash_block x flash_block (at 16, a 64-token row spans "
    "4 K/V blocks).\n\n"
    "**Distances** between the weights of two runs (`fadev.weights.compare`): max |Δw| over all tensors, and "
    "the Wasserstein-1 distance of each tensor's value distribution, averaged over tensors weighted by size.")
"""The report's prose before the figures."""

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

LLAMA_SIZES = {
    "quick": {"hidden": 128, "layers": 4, "heads": 4, "heads_kv": 4, "ffn": 344, "seq": 64, "batch": 8, "lr": 1e-3,
              "steps": 100, "log_every": 10, "checkpoint_every": 50, "eval_windows": 16, "flash_block": 16,
              "native_tiles": ("128x64", "64x64"), "arms": ("all",), "data": "stdlib", "budget_s": math.inf,
              "kernels": "emulated", "log_points": 0},
    "full": {"hidden": 512, "layers": 8, "heads": 8, "heads_kv": 8, "ffn": 1376, "seq": 1024, "batch": 8, "lr": 3e-4,
             "steps": 5000, "log_every": 250, "checkpoint_every": 250, "eval_windows": 32, "flash_block": 64,
             "native_tiles": ("128x64", "64x64"), "arms": ("all",), "data": "stdlib", "budget_s": math.inf,
             "kernels": "emulated", "log_points": 0},
}
"""``--model llama``: quick ~0.86M parameters (CPU), full ~25.6M parameters at sequence 1024 (GPU)."""
LLAMA_DOCS = {"hidden": "model width", "layers": "decoder blocks", "heads": "query heads",
              "heads_kv": "key/value heads (grouped-query when fewer)", "ffn": "SwiGLU width",
              "seq": "bytes per training window", "batch": "windows per update", "lr": "Adam learning rate",
              "steps": "optimizer updates per arm",
              "log_every": "log weights, losses and distances every so many updates",
              "checkpoint_every": "save every arm's state every so many updates (one round of the arms)",
              "eval_windows": "held-out windows for eval_loss", "flash_block": "emulated flash block_q = block_kv",
              "native_tiles": "native-kernel tilings BQxBKV (GPU)",
              "arms": "the arms to train ('all', or names: baseline, flash_paper, flash_fa2, baseline_seed1, fp32, "
                      "native_BQxBKV, native_BQxBKV_again, control); pairs need both their arms",
              "data": "'stdlib' (the interpreter's standard library) or a text file or folder",
              "budget_s": "seconds of training this call may use; arms are saved where they stop, a rerun continues",
              "kernels": "'emulated' (fadev's kernels under precision policies), 'real' (the kernels people train "
                         "with: eager, SDPA flash and fadev's native kernel under real bf16 autocast) or "
                         "'emulated_real' (fadev's emulated naive, fa2 and paper bf16 under real autocast beside the "
                         "real eager and SDPA flash); the last two have their own sizes, "
                         "fadev.experiments.train_drift_real.SIZES, where not set here",
              "log_points": "also log at this many steps spaced evenly on a log scale from update 1"}
WORKLOADS = ("model", {"digits": (SIZES, SIZE_DOCS), "llama": (LLAMA_SIZES, LLAMA_DOCS)},
            "the workload: digits (8x8 images, the default) or llama (a Hugging Face Llama on bytes of real text)")
"""The ``--model`` option: {value: (sizes, their docs)} (fadev.experiments.cli)."""


def runs_and_pairs(flash_block=16, fp16=False, control=True):
    """The experiment's RunSpecs and Pairs (module docstring)."""
    Pair, RunSpec = training.Pair, training.RunSpec
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


def settings(size="quick", model="digits", **overrides):
    """The size's settings of ``model`` with ``overrides`` (None values ignored); ValueError for unknown names."""
    if model not in WORKLOADS[1]:
        raise ValueError(f"model must be one of {', '.join(WORKLOADS[1])}, got {model!r}")
    if "kv_heads" in overrides:  # the spelling before fadev settled on heads_kv (fadev.sweep's, the API's)
        warnings.warn("kv_heads is now heads_kv", DeprecationWarning, stacklevel=2)
        overrides = dict(overrides)
        old = overrides.pop("kv_heads")
        if overrides.get("heads_kv") is None:
            overrides["heads_kv"] = old
    table_ = WORKLOADS[1][model][0]
    if size not in table_:
        raise ValueError(f"size must be 'quick' or 'full', got {size!r}")
    unknown = sorted(set(overrides) - set(table_[size]))
    if unknown:
        raise ValueError(f"unknown setting(s) {', '.join(unknown)} of --model {model}; known: "
                         f"{', '.join(table_[size])}")
    s = dict(table_[size])
    s.update({k: v for k, v in overrides.items() if v is not None})
    if model == "llama":
        if s["kernels"] not in ("emulated",) + real.KINDS:
            raise ValueError(f"kernels must be one of emulated, {', '.join(real.KINDS)}, got {s['kernels']!r}")
        if s["kernels"] in real.KINDS:  # the real study's own sizes, where the call does not set them
            s.update({k: v for k, v in real.SIZES[size].items() if overrides.get(k) is None})
    return s


def check_device(device):
    """ValueError/RuntimeError unless ``device`` can run the experiment. On 'cuda' the models and batches live on
    the GPU and fadev.torch runs attention with fadev's GPU kernels (same bits as on the CPU); cuBLAS is put in
    its deterministic mode (CUBLAS_WORKSPACE_CONFIG) so that lockstep runs stay comparable."""
    if device == "cpu":
        return
    if device != "cuda":
        raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")
    if not cuda_available():
        raise RuntimeError("--device cuda: no CUDA device fadev can use (fadev.cuda_available() is False); run with "
                           "--device cpu")
    import torch
    if not torch.cuda.is_available():
        raise RuntimeError("--device cuda: this PyTorch has no CUDA (install a CUDA build of torch), or run with "
                           "--device cpu")
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # torch's deterministic cuBLAS needs it


def run(size="quick", out=None, *, device="cpu", workers=None, progress=False, cluster=None, model="digits",
        **overrides):
    """Train the runs in lockstep; returns the drift rows (one per pair and logged step) with the loss rows in
    ``df.attrs["loss"]`` and the settings in ``df.attrs["settings"]``. Results in out/train_drift.jsonl
    (resumable) and the loss table in out/train_drift_loss.csv. ``progress``: print a line per logged step;
    Without ``cluster`` (or with a local one) the runs advance in lockstep in one process (``workers`` is
    accepted for the common interface); with ``cluster`` = {"executor": "ray", ...} each run trains as its
    own task (one GPU each on device cuda) and the pairs are compared at the logged checkpoints
    (:func:`fadev.training.track_tasks`: the same rows). ``model="llama"``: :func:`run_llama`."""
    if model == "llama":
        return run_llama(size, out, device=device, workers=workers, progress=progress, cluster=cluster, **overrides)
    check_device(device)
    s = settings(size, model, **overrides)
    config = training.TrainConfig(**{f.name: s[f.name] for f in dataclasses.fields(training.TrainConfig)
                                     if f.name in s})
    runs, pairs = runs_and_pairs(s["flash_block"], s["fp16"])
    path = None
    if out is not None:
        os.makedirs(out, exist_ok=True)
        path = os.path.join(out, f"{NAME}.jsonl")
    log = (lambda line: print(line, flush=True)) if progress else None
    if cluster is not None and cluster.get("executor", "local") != "local":
        drift, loss = training.track_tasks(config, runs, pairs, out=path, device=device, log=log, progress=progress,
                                           workers=workers, **cluster)
    else:
        drift, loss = training.track(config, runs, pairs, out=path, device=device, log=log)
    if out is not None:
        loss.to_csv(os.path.join(out, f"{NAME}_loss.csv"), index=False)
    drift.attrs["loss"], drift.attrs["settings"] = loss, s
    return drift


def llama_runs_and_pairs(device="cpu", native_tiles=("128x64", "64x64"), flash_block=None, control=True, head_dim=64,
                         arms=("all",)):
    """The Llama study's arms and pairs, and {skipped arm: why}: those of :func:`runs_and_pairs` (as
    fadev.training.lm.Arm; emulated flash tiles flash_block x flash_block, None: the presets'), plus one
    native-kernel arm per tiling "BQxBKV" (skipped where it cannot run, e.g. on a CPU or a head dim without
    that tile) paired with the baseline, the two native tilings against each other, and the first native arm
    run twice, a second control: the native backward runs deterministically (fadev.torch_native's default: dQ
    without atomics), so that pair must stay exactly 0. ``arms``: ("all",) or the names to keep (pairs need both of theirs)."""
    Arm, Pair = training.lm.Arm, training.Pair
    tiles = (("block_q", flash_block), ("block_kv", flash_block)) if flash_block else ()
    runs = [Arm("baseline", "baseline", "naive:bf16", "bf16"),
            Arm("flash_paper", "flash", "paper:bf16", "bf16", tiling=tiles),
            Arm("flash_fa2", "flash", "fa2:bf16", "bf16", tiling=tiles),
            Arm("baseline_seed1", "baseline", "naive:bf16", "bf16", init_seed=1),
            Arm("fp32", "baseline", "golden", "fp32")]
    _, pairs = runs_and_pairs(control=False)
    skipped, native = {}, []
    for t in native_tiles:
        bq, _, bkv = str(t).partition("x")
        if not (bq.isdigit() and bkv.isdigit() and int(bq) > 0 and int(bkv) > 0):
            raise ValueError(f"native_tiles: expected tilings like '128x64', got {t!r}")
        name = f"native_{int(bq)}x{int(bkv)}"
        why = training.lm.native_unavailable(device, head_dim, int(bq), int(bkv))
        if why:
            skipped[name] = why
            continue
        native.append(name)
        runs.append(Arm(name, "native", "fa2:bf16", "bf16", tiling={"block_q": int(bq), "block_kv": int(bkv)}))
        pairs.append(Pair(f"flash native {int(bq)}x{int(bkv)} vs baseline", name, "baseline", "flash"))
    if len(native) >= 2:
        pairs.append(Pair(f"{native[1]} vs {native[0]}", native[1], native[0], "other"))
    if native:  # deterministic native backward (no atomic dQ sums): run twice, the bits must not move
        first = next(r for r in runs if r.name == native[0])
        runs.append(dataclasses.replace(first, name=f"{native[0]}_again"))
        pairs.append(Pair(f"{native[0]} run twice (deterministic backward)", f"{native[0]}_again", native[0],
                          "control"))
    if control:
        runs.append(Arm("control", "baseline", "naive:bf16", "bf16"))
        pairs.append(Pair("control (identical runs)", "control", "baseline", "control"))
    if tuple(arms) != ("all",):
        known = [r.name for r in runs] + list(skipped)
        unknown = [a for a in arms if a not in known]
        if unknown:
            raise ValueError(f"arms: unknown arm(s) {', '.join(unknown)}; known here: all, {', '.join(known)}")
        runs = [r for r in runs if r.name in arms]
        pairs = [p for p in pairs if p.a in arms and p.b in arms]
        skipped = {n: why for n, why in skipped.items() if n in arms}
    return runs, pairs, skipped


def _llama_intro(s, config, corpus):
    lm = training.lm
    return (
        f"{PAPER}, Section 5 (Figures 7-8) at scale, in the ecosystem people train in.\n\n"
        f"**Workload.** A byte-level causal language model, Hugging Face transformers' `LlamaForCausalLM` built from "
        f"a `LlamaConfig` with random init ({lm.parameters(config):,} parameters: {config.layers} blocks, width "
        f"{config.hidden}, {config.heads} query / {config.heads_kv} key-value heads, SwiGLU {config.ffn}; vocabulary "
        f"256 bytes + BOS/EOS/pad), trained with Adam (lr {config.lr}) on windows of {config.seq} bytes, "
        f"{config.batch} per update, drawn from `{corpus.source}` ({len(corpus.train_files)} training files, "
        f"{len(corpus.train) / 1e6:.1f} M tokens; {len(corpus.held_out_files)} held-out files, "
        f"{len(corpus.held_out) / 1e6:.2f} M tokens, split by a hash of each file's path; corpus fingerprint "
        f"{corpus.fingerprint}). Every arm shares the data windows (a function of the update and the seed) and, "
        f"except `baseline_seed1`, the initial weights. Each arm trains as its own resumable task "
        f"(fadev.training.lm), checkpointed every {config.checkpoint_every} updates; arms are compared at the logged "
        f"steps. One torch thread, deterministic algorithms: identical settings give identical bits (the control "
        f"pair).\n\n"
        "**Attention.** The model runs its attention through fadev's Hugging Face attention interface "
        "(`fadev.hf`). Emulated arms (`baseline` naive(bf16), `flash_paper`, `flash_fa2`, `fp32` golden) compute "
        "every attention layer's forward and backward with fadev's kernels under their policy "
        "(`fadev.hf.use(policy, kernel=...)`); `native_*` arms run fadev's tensor-core FlashAttention-2 kernel "
        "(real bf16 hardware arithmetic, CUDA only) at two tilings (`fadev.hf.use(kernel=\"native\", ...)`).\n\n"
        "**Mixed precision** (`bf16`): autocast-style, emulated in fp32 tensors on every device -- each `nn.Linear` "
        "rounds its input, weight, bias and output (and their gradients) to bf16 with fp32 accumulation; master "
        "weights, embeddings, RMSNorm, rotary embedding, residual stream, loss and Adam in fp32. `bf16 mixed vs "
        "fp32` compares that run (attention naive(bf16)) with an all-fp32 run (attention golden).\n\n"
        "**Distances** between the weights of two arms (`fadev.weights.compare`): max |Δw| over all tensors, and "
        "the Wasserstein-1 distance of each tensor's value distribution, averaged over tensors weighted by size.")


def run_llama(size="quick", out=None, *, device="cpu", workers=None, progress=False, cluster=None, **overrides):
    """The study on the Llama workload (:data:`LLAMA_SIZES`): arms as resumable tasks (fadev.training.lm_track)
    on this process (``workers`` 1), local worker processes or ``cluster``'s executor; results, arm states and
    checkpoints under ``out`` (None: a temporary folder). ``budget_s`` stops training in time and saves every
    arm; the rows then cover the steps every arm of a pair reached, ``df.attrs["reached"]`` says how far each
    arm got: {arm: (updates, seconds they took)}."""
    check_device(device)
    s = settings(size, "llama", **overrides)
    try:
        lm = training.lm
    except ImportError as e:
        raise ImportError(f"--model llama needs transformers: pip install 'fadev[hf]' ({e})") from None
    config = lm.LMConfig(**{f.name: s[f.name] for f in dataclasses.fields(lm.LMConfig) if f.name in s})
    head_dim = config.hidden // config.heads
    runs, pairs, skipped = real.runs_and_pairs(device, head_dim, s["arms"], s["kernels"]) \
        if s["kernels"] in real.KINDS else \
        llama_runs_and_pairs(device, s["native_tiles"], s["flash_block"], head_dim=head_dim, arms=s["arms"])
    corpus = training.text.load(config.data)
    options = dict(cluster or {})
    options.setdefault("workers", workers)
    log = (lambda line: print(line, flush=True)) if progress else None
    budget = None if math.isinf(s["budget_s"]) else s["budget_s"]
    with tempfile.TemporaryDirectory() if out is None else contextlib.nullcontext(out) as folder:
        os.makedirs(folder, exist_ok=True)
        drift, loss, reached = training.lm_track.track_arms(config, runs, pairs, folder, device=device,
                                                            budget_s=budget, log=log, **options)
        if out is not None:
            loss.to_csv(os.path.join(out, f"{NAME}_loss.csv"), index=False)
            drift.attrs["layers"].to_csv(os.path.join(out, f"{NAME}_layers.csv"), index=False)
    if not len(drift):
        raise RuntimeError(f"budget_s={s['budget_s']}: no arm got through its first logged step; give it more time")
    drift.attrs.update(loss=loss, settings=s, runs=runs, pairs=pairs, reached=reached, skipped=skipped,
                       steps=config.steps, unit="nats per byte",
                       intro=real.intro(s, config, corpus, device) if s["kernels"] in real.KINDS else
                       _llama_intro(s, config, corpus))
    return drift


# ------------------------------------------------------------------ summary numbers

def ratios(drift, metric):
    """{flash pair: {reference role: (geometric-mean ratio over the second half of the logged steps,
    ratio at the last step)}} of flash-vs-baseline drift to each reference pair's drift (for the
    "precision" role, to the first precision pair, bf16 vs fp32), over the logged steps both pairs reached."""
    steps_of = {pair: set(g) for pair, g in drift.groupby("pair", sort=False)["step"]}
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
            steps = sorted(steps_of[pair] & steps_of[ref])
            last = steps[-1]
            late = [s for s in steps if s > 0 and s >= last / 2]
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
    fig, axes = plots.figure(11, 4.8, 1, 2)
    for ax, metric, title in ((axes[0, 0], "max_abs", "max |Δw| over all weights"),
                              (axes[0, 1], "wasserstein", "Wasserstein-1 (size-weighted mean over tensors)")):
        for i, pair in enumerate(dict.fromkeys(drift["pair"])):
            g = drift[drift["pair"] == pair].sort_values("step")
            role = g["role"].iloc[0]
            ls, marker = _STYLE.get(role, _STYLE["other"])
            y = g[metric].to_numpy(dtype=float)
            label = pair + (" (0 at every step)" if role == "control" and not np.any(y) else "")
            ax.plot(g["step"], plots.positive(y) if log_y else y, linestyle=ls, marker=marker, markersize=3.5,
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


def fig_loss(loss, unit="nats per pixel"):
    """Held-out and training loss of every run vs step."""
    fig, axes = plots.figure(11, 4.4, 1, 2)
    for i, run_name in enumerate(dict.fromkeys(loss["run"])):
        g = loss[loss["run"] == run_name].sort_values("step")
        style = {"color": _PAIR_COLORS[i % len(_PAIR_COLORS)], "linestyle": ("-", "--", ":", "-.")[i % 4],
                 "linewidth": 2.2 - 0.25 * i, "label": run_name}
        axes[0, 0].plot(g["step"], g["eval_loss"], **style)
        t = g[g["step"] > 0]
        axes[0, 1].plot(t["step"], t["train_loss"], **style)
    axes[0, 0].set_title(f"held-out loss (cross-entropy per {unit.split()[-1]})")
    axes[0, 1].set_title("training loss (mean since the previous point)")
    for ax in axes[0]:
        ax.set_xlabel("training step")
        ax.set_ylabel(unit)
    handles, labels = axes[0, 0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside lower center", ncol=len(labels), fontsize=8.5)
    return fig


def figures(df, out_dir):
    """Drift (linear and log y) and loss figures, PNG and SVG, and for the real-kernel study the log-log drift
    and the per-layer drift; returns their paths."""
    paths = (plots.save(fig_drift(df, False), os.path.join(out_dir, "train_drift_linear")) +
             plots.save(fig_drift(df, True), os.path.join(out_dir, "train_drift_log")) +
             plots.save(fig_loss(df.attrs["loss"], df.attrs.get("unit", "nats per pixel")),
                        os.path.join(out_dir, "train_drift_loss")))
    if _is_real(df):
        paths += plots.save(real.fig_loglog(df, _PAIR_COLORS), os.path.join(out_dir, "train_drift_loglog"))
        if len(df.attrs.get("layers", ())):
            paths += plots.save(real.fig_layers(df.attrs["layers"], _PAIR_COLORS),
                                os.path.join(out_dir, "train_drift_layers"))
    return paths


def _is_real(df) -> bool:
    return df.attrs.get("settings", {}).get("kernels") in real.KINDS


# ------------------------------------------------------------------ report

def _fmt(v):
    return "0" if v == 0 else f"{v:.3g}" if abs(v) >= 1e-3 else f"{v:.2e}"


def verdicts(drift):
    """[(flash pair, metric, ratio to precision, ratio to init, holds)] -- holds: the late-training ratio
    of flash drift to the bf16-vs-fp32 drift lies in the paper's [1/5, 1/2]."""
    out = []
    if not (drift["role"] == "precision").any():  # nothing to hold flash's drift against
        return out
    for metric in ("max_abs", "wasserstein"):
        for pair, refs in ratios(drift, metric).items():
            prec = refs.get("precision", (math.nan,) * 3)
            init = refs.get("init", (math.nan,) * 3)
            holds = PAPER_RATIO[0] <= prec[0] <= PAPER_RATIO[1]
            out.append((pair, metric, prec, init, holds))
    return out


def _per_step(loss, run_name, s):
    g = loss[(loss["run"] == run_name) & (loss["step"] > 0)].sort_values("step")
    if not len(g):
        return math.nan
    prev = [0] + list(g["step"])[:-1]
    n = np.array(g["step"]) - np.array(prev)
    return float(g["seconds"].sum() / n.sum())


def _conclusion(drift):
    v = verdicts(drift)
    if not v:
        return "**Verdict.** None: no flash pair and low-precision reference pair among the arms run."
    held = [x for x in v if x[4]]
    parts = []
    for pair, metric, prec, init, holds in v:
        parts.append(f"{pair} / {metric}: {prec[0]:.2g}x the low-precision drift, {init[0]:.2g}x the init-seed drift")
    verdict = ("holds for all" if len(held) == len(v) else "holds for none" if not held else
               f"holds for {len(held)} of {len(v)}")
    below = all(x[2][0] < 1 for x in v)
    return (f"**Verdict.** The paper's 1/5..1/2 {verdict} of the (flash pair, metric) combinations; flash's drift is "
            f"{'below' if below else 'not always below'} the low-precision drift. " + "; ".join(parts) + ".")


def findings(df, *, device="cpu") -> list:
    """The paper's ratio for each (flash pair, metric), the conclusion, and the control pair."""
    last = int(df["step"].max())
    partial = _partial(df)  # a verdict on a run stopped early would judge the start of training: none until done
    note = f" -- partial run (step {last} of {df.attrs['steps']}): no verdict yet" if partial else ""
    out = [Finding(f"{pair}, {metric}: flash drift / low-precision (bf16 vs fp32) drift, late training",
                   f"{prec[0]:.3g} ({prec[1]:.3g} at step {last}); / init-seed drift {init[0]:.3g} ({init[1]:.3g})"
                   + note, "1/2..1/5 of low-precision training's drift", None if partial else bool(holds), "golden")
           for pair, metric, prec, init, holds in verdicts(df)]
    out.append(Finding("conclusion", ("Provisional (partial run, step " f"{last} of {df.attrs['steps']}): "
                                      if partial else "") + _conclusion(df)))
    if "reached" in df.attrs:
        out.append(Finding("arms", " ".join(_progress(df))))
    if _is_real(df) and not partial:
        out += real.findings(df)
    for pair, control in df[df["role"] == "control"].groupby("pair", sort=False):
        zero = bool((control["max_abs"] == 0).all() and (control["wasserstein"] == 0).all())
        out.append(Finding(pair, f"drift exactly 0 at every logged step ({len(control)} steps): bit-reproducible"
                           if zero else f"drift **not 0** (up to {control['rel_l2'].max():.3g} relative L2, "
                           f"{control['max_abs'].max():.3g} max |Δw|, over {len(control)} steps): run-to-run noise, "
                           "the floor the ratios are read above"))
    return out


def table(df) -> str:
    """The runs, the drift at selected steps, the ratios to the references, and the losses."""
    loss, s = df.attrs["loss"], df.attrs["settings"]
    runs, pairs = (df.attrs["runs"], df.attrs["pairs"]) if "runs" in df.attrs else \
        runs_and_pairs(s["flash_block"], s["fp16"])
    last = int(df["step"].max())
    lines = ["| run | setting |", "|---|---|"]
    lines += [f"| `{r.name}` | {report.escape(r.label())} |" for r in runs]
    steps = sorted(df["step"].unique())
    shown = sorted({steps[min(len(steps) - 1, round(i * (len(steps) - 1) / 4))] for i in range(5)})
    lines += ["", "Drift at selected steps (max |Δw| / Wasserstein-1):", "",
              "| pair | " + " | ".join(f"step {st}" for st in shown) + " |",
              "|---|" + "---|" * len(shown)]
    by = df.set_index(["pair", "step"])
    for p in pairs:
        cells = [f"{_fmt(by.loc[(p.name, st), 'max_abs'])} / {_fmt(by.loc[(p.name, st), 'wasserstein'])}"
                 if (p.name, st) in by.index else "–" for st in shown]
        lines.append(f"| {report.escape(p.name)} | " + " | ".join(cells) + " |")
    if verdicts(df):
        lines += ["", f"**Ratios** of flash-vs-baseline drift to the references: geometric mean over the logged "
                  f"steps in the second half of training (value at step {last} in brackets). The paper: flash's drift "
                  "is 1/2..1/5 of low-precision training's (a private text-to-image model); a verdict holds when our "
                  "late-training ratio to `bf16 mixed vs fp32` lies in [0.2, 0.5].", "",
                  "| flash pair | metric | / low precision (bf16 vs fp32) | / init seed | paper 1/2..1/5 |",
                  "|---|---|---|---|---|"]
    partial = _partial(df)
    for pair, metric, prec, init, holds in verdicts(df):
        verdict = "none yet (partial run)" if partial else "holds" if holds else "**does not hold**"
        lines.append(f"| {report.escape(pair)} | {metric} | {prec[0]:.3g} ({prec[1]:.3g}) | {init[0]:.3g} "
                     f"({init[1]:.3g}) | {verdict} |")
    if _is_real(df):
        lines.append(real.table(df))
    final = loss[loss["step"] == last].set_index("run")
    lines += ["", f"Held-out loss at step {last} ({df.attrs.get('unit', 'nats per pixel')}; step 0: "
              f"{loss[loss['step'] == 0]['eval_loss'].iloc[0]:.3f}): " +
              ", ".join(f"`{r}` {final.loc[r, 'eval_loss']:.4f}" for r in final.index) + ".",
              "Training time per run (s per update, as logged when the steps ran; 1 torch thread): " +
              ", ".join(f"`{r}` {_per_step(loss, r, s):.3f}" for r in final.index) + ".", ""]
    if "reached" in df.attrs:
        lines += _progress(df) + ["", "Raw rows: `train_drift.jsonl`; arm states and checkpoints `train_drift_arms/` "
                                      "(a rerun with the same settings continues them); tables `train_drift.csv`, "
                                      "`train_drift_loss.csv`."]
    else:
        lines.append("Raw rows: `train_drift.jsonl` (resumable; checkpoint `train_drift.jsonl.ckpt`); tables "
                     "`train_drift.csv`, `train_drift_loss.csv`.")
    return "\n".join(lines)


def _partial(df) -> bool:
    """Whether some arm stopped before the run's last step (a --budget-s stop, to be continued)."""
    return "reached" in df.attrs and any(r < df.attrs["steps"] for r, _ in df.attrs["reached"].values())


def _progress(df):
    """How far each arm got, its latest held-out loss, and the arms skipped with their reason."""
    steps, loss = df.attrs["steps"], df.attrs["loss"]
    cells = []
    for name, (reached, seconds) in df.attrs["reached"].items():
        g = loss[loss["run"] == name].sort_values("step")
        latest = f", held-out {g['eval_loss'].iloc[-1]:.4f} at step {int(g['step'].iloc[-1])}" if len(g) else ""
        rate = f", {seconds / reached:.3g} s/update" if reached else ""
        cells.append(f"`{name}` {reached}/{steps}{rate}{latest}")
    lines = [("**Complete**: " if not _partial(df) else "**Partial run** (continue with the same command): ") +
             "updates done per arm: " + "; ".join(cells) + "."]
    if real.cut_line(df):
        lines.insert(0, real.cut_line(df))
    if df.attrs.get("skipped"):
        lines.append("Skipped arms: " + "; ".join(f"`{n}` ({why})" for n, why in df.attrs["skipped"].items()) + ".")
    return lines


__all__ = ["run", "run_llama", "findings", "table", "figures", "runs_and_pairs", "llama_runs_and_pairs", "settings",
           "check_device", "ratios", "verdicts", "fig_drift", "fig_loss", "SIZES", "LLAMA_SIZES", "WORKLOADS",
           "PAPER_RATIO"]
