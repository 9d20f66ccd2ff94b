"""``train-drift --model llama --kernels real``: the paper's training-drift question asked of the kernels people
train with -- PyTorch's SDPA flash kernel and fadev's native kernel against materialised attention, under real
``torch.autocast`` bf16 -- and read as curves, not as one number at the last step.

Arms (fadev.training.lm.Arm; one model, one data order, Adam; init seed 0 unless stated):

==================  ==============  ================  ===============================================
arm                 kernel          precision         what it is
==================  ==============  ================  ===============================================
``baseline``        eager           bf16 autocast     transformers' materialised attention, as a user gets it
``flash``           sdpa_flash      bf16 autocast     PyTorch's SDPA flash kernel (forced, deterministic)
``native``          native          bf16 autocast     fadev's tensor-core kernel (CUDA; deterministic)
``fp32``            eager           fp32              no autocast: the low-precision reference
``baseline_seed1``  eager           bf16 autocast     init seed 1: two unrelated models
``control``         eager           bf16 autocast     the baseline again: must stay exactly 0
==================  ==============  ================  ===============================================

Named arms ``flash_again`` and ``native_again`` (``--arms all,flash_again,native_again``) run those kernels twice:
their pairs prove each kernel bit-reproducible.

Why eager is the paper's baseline: Golden et al.'s baseline is attention that materialises S = QK^T and
P = softmax(S) in the training format; transformers' ``eager`` does exactly that under autocast (S and PV as
bf16 matmuls with fp32 accumulation, the softmax in fp32 rounded to bf16). SDPA's math backend upcasts bf16
to fp32 unless told otherwise, which would make the baseline an fp32 one.

Growth, not just size. A perturbation grows during training until the two models are as far apart as two
unrelated ones; a ratio read once both have saturated says nothing about the kernels. So: a pair is
*saturated* at step t when its distance reaches :data:`SATURATED` x the init-seed pair's at t; it is *above
noise* when the control pair is exactly 0, or when it exceeds :data:`NOISE` x the control's distance. The
verdicts are read per logged step, and over the *apart regime*: the steps where both pairs compared are above
noise and neither is saturated. Growth rate: the slope of log(distance) against log(step) (a power law's
exponent) over each pair's own apart steps.
"""
from __future__ import annotations

import math

import numpy as np

from .. import plots
from .common import Finding, holds_range, where_holds

SATURATED = 0.5
"""A pair is saturated once its distance is this fraction of the init-seed pair's (unrelated models)."""
NOISE = 2.0
"""A pair is above noise once its distance is this many times the control pair's (when that is not 0)."""
PAPER_BAND = (0.2, 0.5)
"""Golden et al.: flash's weight drift is 1/5..1/2 of low-precision training's."""
ORDER = 0.1
"""Golden et al.: flash's drift is an order of magnitude below another initialisation's."""
ALIKE = (0.5, 2.0)
"""Two flash kernels drift alike when their distances from the baseline are within a factor 2 of each other."""
METRIC = "rel_l2"
"""The distance the verdicts read (relative L2 of the whole model's weights); max |Δw| and W1 are shown too."""

SIZES = {
    "quick": {"hidden": 64, "layers": 2, "heads": 4, "heads_kv": 2, "ffn": 172, "seq": 64, "batch": 4, "lr": 1e-3,
              "steps": 24, "log_every": 12, "log_points": 5, "checkpoint_every": 24, "eval_windows": 4},
    "full": {"hidden": 512, "layers": 8, "heads": 8, "heads_kv": 4, "ffn": 1376, "seq": 1024, "batch": 8, "lr": 3e-4,
             "steps": 5000, "log_every": 500, "log_points": 25, "checkpoint_every": 5000, "eval_windows": 32},
}
"""The sizes ``--kernels real`` uses where the command line does not set them: quick is a toy for the CPU (CI),
full the issue's 23.5M-parameter Llama (GQA 8 / 4 heads) for 5,000 updates, every arm in one round."""
EXTRA = ("flash_again", "native_again")


KINDS = ("real", "emulated_real")
"""The arm sets: ``real`` (the table above) and ``emulated_real``: fadev's emulated kernels under real autocast
-- ``baseline_emulated`` naive(bf16), ``flash_fa2`` fa2(bf16), ``flash_paper`` paper(bf16) (the presets' tiles),
``control_emulated`` -- beside the real ``baseline`` and ``flash``: is the emulation's flash the real flash in
training, and does the paper's all-bf16 flash drift more?"""
VALIDATION = [("native vs baseline", "flash (SDPA) vs baseline", "two flash kernels drift alike"),
              ("flash fa2(bf16) vs emulated baseline", "flash (SDPA) vs baseline",
               "the emulated FA2 drifts from its baseline as the real flash kernel drifts from the real baseline")]
"""(pair, pair, claim): pairs whose drifts should be alike (within :data:`ALIKE`)."""
PAPER_SETTING = ("flash paper(bf16) vs emulated baseline", "flash fa2(bf16) vs emulated baseline", 2.0)
"""paper(bf16)'s per-call deviation reaches the weights when its drift is at least this many times fa2(bf16)'s."""


def _arms(kernels):
    from .. import training
    Arm, Pair = training.lm.Arm, training.Pair
    amp = "bf16_autocast"
    runs = [Arm("baseline", "eager", "naive:bf16", amp), Arm("flash", "sdpa_flash", "fa2:bf16", amp)]
    if kernels == "emulated_real":
        runs += [Arm("baseline_emulated", "baseline", "naive:bf16", amp), Arm("flash_fa2", "flash", "fa2:bf16", amp),
                 Arm("flash_paper", "flash", "paper:bf16", amp), Arm("control_emulated", "baseline", "naive:bf16", amp)]
        return runs, [Pair("flash (SDPA) vs baseline", "flash", "baseline", "flash"),
                      Pair("flash fa2(bf16) vs emulated baseline", "flash_fa2", "baseline_emulated", "flash"),
                      Pair("flash paper(bf16) vs emulated baseline", "flash_paper", "baseline_emulated", "flash"),
                      Pair("control (identical runs)", "control_emulated", "baseline_emulated", "control"),
                      Pair("emulated baseline vs baseline", "baseline_emulated", "baseline", "other"),
                      Pair("flash fa2(bf16) vs flash (SDPA)", "flash_fa2", "flash", "other")]
    runs += [Arm("native", "native", "fa2:bf16", amp),
             Arm("fp32", "eager", "naive:fp32", "fp32"),
             Arm("baseline_seed1", "eager", "naive:bf16", amp, init_seed=1),
             Arm("control", "eager", "naive:bf16", amp),
             Arm("flash_again", "sdpa_flash", "fa2:bf16", amp),
             Arm("native_again", "native", "fa2:bf16", amp)]
    return runs, [Pair("flash (SDPA) vs baseline", "flash", "baseline", "flash"),
                  Pair("native vs baseline", "native", "baseline", "flash"),
                  Pair("init seed 1 vs seed 0", "baseline_seed1", "baseline", "init"),
                  Pair("bf16 autocast vs fp32", "baseline", "fp32", "precision"),
                  Pair("control (identical runs)", "control", "baseline", "control"),
                  Pair("native vs flash (SDPA)", "native", "flash", "other"),
                  Pair("flash run twice", "flash_again", "flash", "control"),
                  Pair("native run twice", "native_again", "native", "control")]


def runs_and_pairs(device="cpu", head_dim=64, arms=("all",), kernels="real"):
    """(arms, pairs, {skipped arm: why}) of the arm set ``kernels`` (:data:`KINDS`; module docstring); ``arms``:
    ("all",) and/or names (``EXTRA`` only when named)."""
    if kernels not in KINDS:
        raise ValueError(f"kernels must be one of {', '.join(KINDS)}, got {kernels!r}")
    runs, pairs = _arms(kernels)
    names = [r.name for r in runs]
    arms = tuple(arms)
    unknown = [a for a in arms if a != "all" and a not in names]
    if unknown:
        raise ValueError(f"arms: unknown arm(s) {', '.join(unknown)}; known: all, {', '.join(names)}")
    wanted = {n for n in names if n not in EXTRA} if "all" in arms else set()
    wanted |= {a for a in arms if a != "all"}
    skipped = {}
    if device != "cuda":
        why = "the native kernel runs on CUDA only (--device cuda)"
        skipped = {n: why for n in ("native", "native_again") if n in wanted}
    elif head_dim not in (64, 128):
        why = f"the native kernel takes head dim 64 or 128, not {head_dim}"
        skipped = {n: why for n in ("native", "native_again") if n in wanted}
    wanted -= set(skipped)
    runs = [r for r in runs if r.name in wanted]
    pairs = [p for p in pairs if p.a in wanted and p.b in wanted]
    return runs, pairs, skipped


def intro(s, config, corpus, device="cpu"):
    """The report's prose for the real-kernel study (its sizes, corpus and arms from the run, ``device`` where the
    arms trained)."""
    from .. import training
    from .common import PAPER
    return (
        f"{PAPER}, Section 5 (Figures 7-8), asked of the kernels people train with.\n\n"
        f"**Workload.** A byte-level causal language model, Hugging Face transformers' `LlamaForCausalLM` built from "
        f"a `LlamaConfig` with random init ({training.lm.parameters(config):,} parameters: {config.layers} blocks, "
        f"width {config.hidden}, {config.heads} query / {config.heads_kv} key-value heads, SwiGLU {config.ffn}; "
        f"vocabulary 256 bytes + BOS/EOS/pad), trained with Adam (lr {config.lr}, no schedule) on windows of "
        f"{config.seq} bytes, {config.batch} per update, drawn from `{corpus.source}` ({len(corpus.train_files)} "
        f"training files, {len(corpus.train) / 1e6:.1f} M tokens; {len(corpus.held_out_files)} held-out files, "
        f"corpus fingerprint {corpus.fingerprint}). Every arm shares the data windows and, except `baseline_seed1`, "
        f"the initial weights; each arm trains as its own resumable task "
        f"({'a process per arm, spread over the GPUs' if device == 'cuda' else 'on the CPU'}), and the "
        f"driver compares the arms' fp32 master weights at {len(config.logged_steps())} logged steps (log-spaced "
        f"from update 1, and every {config.log_every}).\n\n"
        "**Kernels and precision.** The real arms run the hardware's arithmetic: `baseline` is transformers' `eager` "
        "attention "
        "(S = QK^T and P V as bf16 matmuls, softmax in fp32 rounded to bf16: materialised attention in bf16, the "
        "paper's baseline); `flash` is PyTorch's SDPA flash kernel, forced; `native` is fadev's tensor-core kernel "
        "(`fadev.hf.use(kernel=\"native\")`, defaults, deterministic backward). All three under "
        "`torch.autocast(dtype=torch.bfloat16)` with fp32 master weights; `fp32` is the baseline without autocast "
        "(TF32 off). `torch.use_deterministic_algorithms(True)` and cuBLAS' deterministic workspace in every arm: "
        "the control pairs say whether identical arms stay identical.\n\n" + (
            "**Emulated arms** (`--kernels emulated_real`): the same real autocast model with its attention "
            "through fadev's emulated kernels (`fadev.hf.use(policy)`, the presets' tiles): `baseline_emulated` "
            "naive(bf16), `flash_fa2` fa2(bf16), `flash_paper` paper(bf16), `control_emulated`. Does the emulated "
            "FA2 drift from its baseline as the real flash kernel drifts from the real one, and does paper(bf16)'s "
            "larger per-call deviation reach the weights?\n\n" if s["kernels"] == "emulated_real" else "") +
        "**Distances** (`fadev.weights.compare`, on the GPU where the arms ran there): relative L2 of the whole "
        "model's weights (the verdicts' metric), max |Δw| and the size-weighted Wasserstein-1, per model and per "
        "layer. **Regimes**: a pair is *saturated* once its distance reaches "
        f"{SATURATED:g}x the init-seed pair's (the two models are then as unrelated as two initialisations) and "
        f"*apart* while it is above noise and not saturated; each verdict reads its ratio over the steps where "
        "both pairs are apart, and says where along training it holds.")


# ------------------------------------------------------------------ the analysis

def curves(drift, metric=METRIC):
    """{pair: {step: distance}} over the logged steps after 0."""
    out = {}
    for pair, g in drift[drift["step"] > 0].groupby("pair", sort=False):
        out[pair] = dict(zip(g["step"].astype(int), g[metric].astype(float)))
    return out


def _one(drift, role, name=None):
    names = list(dict.fromkeys(drift.loc[drift["role"] == role, "pair"]))
    if name is not None:
        names = [n for n in names if n == name]
    return names[0] if names else None


def references(drift):
    """(init pair, precision pair, control pair) names (None where the run has none)."""
    control = [p for p in dict.fromkeys(drift.loc[drift["role"] == "control", "pair"]) if "identical" in p]
    return _one(drift, "init"), _one(drift, "precision"), (control[0] if control else _one(drift, "control"))


def state(drift, metric=METRIC):
    """{pair: {step: "noise" | "apart" | "saturated"}}: each pair's regime at each logged step (module docstring).
    Without an init pair nothing is saturated; without a control pair (or with one at exactly 0) nothing
    but a distance of 0 is noise."""
    c = curves(drift, metric)
    init, _, control = references(drift)
    out = {}
    for pair, d in c.items():
        out[pair] = {}
        for step, v in d.items():
            floor = NOISE * c[control].get(step, 0.0) if control else 0.0
            sat = SATURATED * c[init][step] if init and step in c[init] and pair != init else math.inf
            out[pair][step] = "noise" if not v > floor else "saturated" if v >= sat else "apart"
    return out


def growth(drift, metric=METRIC):
    """[{pair, role, exponent, first, last, saturated_at, steps}] per pair: the power-law exponent of the distance
    over the pair's apart steps (NaN with fewer than 2), the first and last logged distances, the first step at
    which it is saturated (None: never), and how many apart steps the fit used."""
    c, regime = curves(drift, metric), state(drift, metric)
    roles = dict(zip(drift["pair"], drift["role"]))
    out = []
    for pair, d in c.items():
        steps = [s for s in sorted(d) if regime[pair][s] == "apart" and d[s] > 0]
        exponent = float(np.polyfit(np.log(steps), np.log([d[s] for s in steps]), 1)[0]) if len(steps) >= 2 \
            else math.nan
        sat = [s for s in sorted(d) if regime[pair][s] == "saturated"]
        out.append({"pair": pair, "role": roles[pair], "exponent": exponent, "first": d[min(d)], "last": d[max(d)],
                    "saturated_at": sat[0] if sat else None, "steps": len(steps)})
    return out


def ratio(drift, num, den, metric=METRIC):
    """{"steps", "ratios", "apart"}: num's distance over den's at every logged step both have (> 0), and which of
    those steps are in the apart regime of both pairs."""
    c, regime = curves(drift, metric), state(drift, metric)
    steps = [s for s in sorted(c[num]) if s in c[den] and c[den][s] > 0]
    return {"steps": steps, "ratios": [c[num][s] / c[den][s] for s in steps],
            "apart": [regime[num][s] == "apart" and regime[den][s] == "apart" for s in steps]}


def _gmean(values):
    v = np.array([x for x in values if x > 0 and math.isfinite(x)], dtype=float)
    return float(np.exp(np.mean(np.log(v)))) if len(v) else math.nan


def verdict(drift, num, den, lo, hi, metric=METRIC):
    """(holds, text, partly): whether num/den lies in [lo, hi] over the apart regime of the two pairs (its
    geometric mean; None: no apart step, so no verdict), with the regime's mean and range and where along the
    logged steps it holds; ``partly`` names the apart steps where it holds when the regime as a whole fails
    ("" otherwise)."""
    r = ratio(drift, num, den, metric)
    if not r["steps"]:
        return None, "no logged step where both pairs have a distance", ""
    ok = [lo <= x <= hi for x in r["ratios"]]
    where = where_holds(r["steps"], ok, r["ratios"], name="step")
    apart = [x for x, a in zip(r["ratios"], r["apart"]) if a]
    if not apart:
        return None, f"no step where both pairs are apart (above noise, below saturation); over all steps: {where}", ""
    steps = [s for s, a in zip(r["steps"], r["apart"]) if a]
    inside = [lo <= x <= hi for x in apart]
    text = (f"{_gmean(apart):.3g} (geometric mean over the {len(apart)} apart steps {steps[0]}..{steps[-1]}; "
            f"range {min(apart):.3g}..{max(apart):.3g}; {sum(inside)} of {len(apart)} inside [{lo:g}, {hi:g}]); "
            f"along all logged steps: {where}")
    holds = lo <= _gmean(apart) <= hi
    partly = holds_range(steps, inside, name="step") if not holds and any(inside) else ""
    return holds, text, partly


CUT = "**Cut at update {until} of {steps}**"
"""How a cut run's report says so (:func:`cut`); the re-rendering reads it back (fadev.experiments.rerender)."""


def cut(df, until):
    """The llama run ``df`` (its rows, ``df.attrs`` as run_llama or the re-rendering fill them) read up to update
    ``until``: the rows, losses and per-layer rows at logged steps <= ``until``, every arm counted as having reached
    it (its s/update kept), and ``df.attrs["cut"] = (until, the run's steps, {arm: updates it reached})``. For a run
    whose lease ended before every arm was done: its verdicts then read the updates every arm reached, and the
    report says what was cut. ValueError naming ``until`` unless every arm reached it and every pair has a row there
    (a logged step)."""
    reached = df.attrs.get("reached")
    if not reached:
        raise ValueError("until: only a train-drift --model llama run (its arms' progress recorded) can be cut")
    if isinstance(until, bool) or not isinstance(until, (int, np.integer)) or until < 1:
        raise ValueError(f"until must be a positive integer (an update), got {until!r}")
    short = {n: r for n, (r, _) in reached.items() if r < until}
    if short:
        raise ValueError(f"until={until}: arm(s) {', '.join(f'{n} (reached {r})' for n, r in short.items())} did not "
                         f"reach it; cut at most at {min(r for r, _ in reached.values())}")
    missing = sorted(set(df["pair"]) - set(df.loc[df["step"] == until, "pair"]))
    if missing:
        logged = sorted(int(s) for s in df["step"].unique() if s <= min(r for r, _ in reached.values()))
        raise ValueError(f"until={until} is not a logged step of pair(s) {', '.join(missing)}; the logged steps every "
                         f"arm reached: {', '.join(map(str, logged[-5:]))}")
    out = df[df["step"] <= until].copy()
    out.attrs = dict(df.attrs)
    for key in ("loss", "layers"):
        if key in df.attrs:
            table = df.attrs[key]
            out.attrs[key] = table[table["step"] <= until].reset_index(drop=True)
    out.attrs["reached"] = {n: (until, s * until / r if r else s) for n, (r, s) in reached.items()}
    out.attrs["cut"] = (int(until), int(df.attrs["steps"]), {n: int(r) for n, (r, _) in reached.items()})
    out.attrs["steps"] = int(until)
    return out


def cut_line(df):
    """The report's sentence on a cut run (:func:`cut`), or None."""
    if "cut" not in df.attrs:
        return None
    until, steps, reached = df.attrs["cut"]
    stopped = any(r < steps for r in reached.values())
    return (CUT.format(until=until, steps=steps) + f" (`python -m fadev report DIR --until {until}`): " +
            ("the run stopped before every arm was done" if stopped else "every arm finished") +
            "; the arms' last logged updates " + ", ".join(f"`{n}` {r}" for n, r in reached.items()) +
            f" of {steps}; everything below reads the updates up to {until}, which every arm reached.")


def _finding(claim, judged, paper, source):
    holds, text, partly = judged
    return Finding(claim, text, paper, holds, source if holds is not None else "", partly=partly)


def findings(drift):
    """The real study's verdicts (module docstring), each computed from the rows."""
    init, precision, control = references(drift)
    flash = list(dict.fromkeys(drift.loc[drift["role"] == "flash", "pair"]))
    out = []
    for pair in flash:
        if precision:
            out.append(_finding(f"{pair}: drift / bf16-vs-fp32 drift ({METRIC}), apart regime",
                                verdict(drift, pair, precision, *PAPER_BAND),
                                "1/2..1/5 of low-precision training's drift", "golden"))
        if init:
            out.append(_finding(f"{pair}: drift / init-seed drift ({METRIC}), apart regime",
                                verdict(drift, pair, init, 0.0, ORDER),
                                "an order of magnitude below another initialisation's", "golden"))
    have = set(drift["pair"])
    for num, den, claim in VALIDATION:
        if num in have and den in have:
            out.append(_finding(f"{num} / {den} ({METRIC}): {claim}", verdict(drift, num, den, *ALIKE),
                                f"within a factor {ALIKE[1]:g} of each other", "fadev"))
    num, den, factor = PAPER_SETTING
    if num in have and den in have:
        out.append(_finding(f"{num} / {den} ({METRIC}): the paper's all-bf16 flash, whose per-call deviation is "
                            "larger, drifts further in training", verdict(drift, num, den, factor, math.inf),
                            f"at least {factor:g}x fa2(bf16)'s drift", "fadev"))
    for g in growth(drift):
        if g["role"] in ("flash", "precision", "init"):
            sat = f"saturated from step {g['saturated_at']}" if g["saturated_at"] is not None else "never saturated"
            fit = f"distance ~ step^{g['exponent']:.2f} over {g['steps']} apart steps" \
                if not math.isnan(g["exponent"]) else f"{g['steps']} apart step(s): no growth rate fitted"
            out.append(Finding(f"growth of {g['pair']}", f"{fit}; {g['first']:.3g} at the first logged step, "
                                                         f"{g['last']:.3g} at the last; {sat}"))
    return out


def table(drift):
    """Markdown: the growth table and the per-step ratios of each flash pair to the references."""
    init, precision, _ = references(drift)
    lines = ["", f"**Growth** ({METRIC}; a pair is saturated at {SATURATED:g}x the init-seed pair's distance, "
                 f"noise below {NOISE:g}x the control's):", "",
             "| pair | first logged | last logged | exponent (apart steps) | saturated from |", "|---|---|---|---|---|"]
    for g in growth(drift):
        exponent = "–" if math.isnan(g["exponent"]) else f"{g['exponent']:.2f}"
        lines.append(f"| {g['pair']} | {g['first']:.3g} | {g['last']:.3g} | {exponent} ({g['steps']}) | "
                     f"{g['saturated_at'] if g['saturated_at'] is not None else 'never'} |")
    refs = [r for r in (precision, init) if r]
    for pair in dict.fromkeys(drift.loc[drift["role"] == "flash", "pair"]):
        for ref in refs:
            r = ratio(drift, pair, ref)
            if not r["steps"]:
                continue
            lines += ["", f"{pair} / {ref} per logged step (* = apart regime):", "",
                      "| " + " | ".join(str(s) + ("*" if a else "") for s, a in zip(r["steps"], r["apart"])) + " |",
                      "|" + "---|" * len(r["steps"]),
                      "| " + " | ".join(f"{x:.3g}" for x in r["ratios"]) + " |"]
    return "\n".join(lines)


# ------------------------------------------------------------------ figures

def fig_loglog(drift, colors):
    """Distance vs update on log-log axes, every pair, three metrics."""
    fig, axes = plots.figure(15, 4.8, 1, 3)
    for ax, metric, title in ((axes[0, 0], "rel_l2", "relative L2 of the weights"),
                              (axes[0, 1], "max_abs", "max |Δw|"), (axes[0, 2], "wasserstein", "Wasserstein-1")):
        for i, (pair, d) in enumerate(curves(drift, metric).items()):
            steps = [s for s in sorted(d) if d[s] > 0]
            if steps:
                ax.plot(steps, [d[s] for s in steps], marker="o", markersize=3, color=colors[i % len(colors)],
                        label=pair)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("training step (optimizer updates)")
        ax.set_title(title)
    handles, labels = axes[0, 0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside lower center", ncol=4, fontsize=8.5)
    fig.suptitle("Weight drift between arms, log-log (pairs at exactly 0 are not drawn)", fontsize=10.5)
    return fig


def fig_layers(layers, colors):
    """Per-layer relative L2 at the last logged step, one bar group per layer, one bar per pair."""
    last = layers[layers["step"] == layers["step"].max()]
    groups = list(dict.fromkeys(last["group"]))
    pairs = [p for p in dict.fromkeys(last["pair"]) if (last.loc[last["pair"] == p, "rel_l2"] > 0).any()]
    fig, axes = plots.figure(max(8, 0.8 * len(groups)), 4.6)
    ax, width = axes[0, 0], 0.8 / max(1, len(pairs))
    for i, pair in enumerate(pairs):
        g = last[last["pair"] == pair].set_index("group")
        ax.bar(np.arange(len(groups)) + i * width, [g.loc[n, "rel_l2"] for n in groups], width,
               color=colors[i % len(colors)], label=pair)
    ax.set_xticks(np.arange(len(groups)) + 0.4 - width / 2, groups, rotation=45, ha="right")
    ax.set_yscale("log")
    ax.set_ylabel("relative L2 of the layer's weights")
    ax.set_title(f"Per-layer drift at step {int(last['step'].max())}")
    fig.legend(loc="outside lower center", ncol=3, fontsize=8.5)
    return fig


__all__ = ["runs_and_pairs", "intro", "KINDS", "VALIDATION", "PAPER_SETTING", "curves", "references", "state", "growth", "ratio", "verdict", "findings", "table",
           "fig_loglog", "fig_layers", "SIZES", "EXTRA", "SATURATED", "NOISE", "PAPER_BAND", "ORDER", "ALIKE",
           "METRIC"]
