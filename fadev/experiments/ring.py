"""Ring attention (beyond the paper): how its error grows with the number of ranks W, and what causes it.

Seed 002 (ring-flash-attention issue #42) reports backward errors growing with ring size. This experiment
measures, against the fp64 golden answer (fadev.compare's relative L2 error):
  1. the single-layer sweep: W x layouts x merges x causal x inputs ("normal", "outlier"), errors of out,
     lse, dq, dk, dv, and the growth per doubling of W (least-squares slope of log2 error on log2 W, W >= 2);
  2. isolated candidates, each one number: composition through depth (L residual attention layers,
     forward and backward), attention-sink scores, the LSE format between hops, 16-bit dk/dv transport,
     fp16 inputs whose gradients are cast to bf16, and the causal layouts / outlier inputs of (1).
Always on the CPU; the sweep's raw rows are resumable.
"""
from __future__ import annotations

import functools
import math
import os

import numpy as np

from .. import plots, report
from ..attention import flash_attention, random_qkv
from ..backward import flash_attention_backward
from ..metrics import compare
from ..policy import Policy
from ..ring import LAYOUTS, MERGES, RingMerge, ring_attention, ring_attention_backward
from . import common
from .common import Finding

NAME = "ring"
TITLE = "Ring attention: error vs ring size W (beyond the paper)"
FIGURES = ("ring_error_vs_W",)
REPRODUCE = False
"""Not part of ``python -m fadev reproduce``'s default set (``--only ring`` adds it)."""
OPTIONS = ("cluster",)
"""The shared options its command takes: its simulation runs on the CPU whatever --device says; --cluster spreads
its points."""

POLICY = "fa2:bf16"
QUANTITIES = ("out", "lse", "dq", "dk", "dv")
MERGE_COLORS = {"lowp_partials": "#d62728", "fp32_partials": "#1f77b4", "lowp_running": "#ff7f0e",
                "allgather": "#2ca02c"}

INTRO = (
    f"Ring attention (fadev.ring_attention and its backward) under policy {POLICY} (every flash call) on W "
    "simulated ranks, for each layout (contiguous, zigzag, striped) and merge of the partial results "
    "(lowp_partials: each rank's partial out rounded to 16 bits before an fp32 merge; fp32_partials; "
    "lowp_running: a 16-bit running merge; allgather: keys and values gathered, one flash call), causal or "
    "not, on normal and outlier inputs. Error = relative L2 error vs the fp64 golden answer "
    "(fadev.compare). Operation order: csrc/ring.c (top comment). The table first gives the growth of the "
    "error per doubling of W (least-squares slope of log2 error on log2 W over W >= 2; 1.00 = no growth), "
    "then candidate causes, each in isolation, ranked by the factor it multiplies the error by.")
"""The report's prose before the figures."""

SIZES = {
    "tiny": {"N": 64, "H": 1, "D": 16, "Ws": (1, 2, 4, 8), "L": 2, "depth_Ws": (1, 4)},
    "quick": {"N": 256, "H": 2, "D": 32, "Ws": (1, 2, 4, 8, 16, 32, 64), "L": 8, "depth_Ws": (1, 8, 32)},
    "full": {"N": 1024, "H": 4, "D": 64, "Ws": (1, 2, 4, 8, 16, 32, 64), "L": 16, "depth_Ws": (1, 8, 64)},
}
SIZE_DOCS = {"N": "sequence length", "H": "heads", "D": "head dimension", "Ws": "ring sizes W (ranks)",
             "L": "layers of the depth candidate", "depth_Ws": "ring sizes of the depth candidate (the first is "
             "the reference)"}


def _err(test, ref):
    return compare(test, ref).rel_l2


def _golden(q, k, v, dout, causal):
    o, l = flash_attention(q, k, v, "golden", causal=causal, return_lse=True)
    return (o, l) + flash_attention_backward(q, k, v, o, l, dout, "golden", causal=causal)


def _ring(q, k, v, dout, W, layout, merge, causal, policy=POLICY):
    o, l = ring_attention(q, k, v, policy=policy, world_size=W, layout=layout, merge=merge, causal=causal,
                          return_lse=True)
    return (o, l) + ring_attention_backward(q, k, v, o, l, dout, policy=policy, world_size=W, layout=layout,
                                            merge=merge, causal=causal)


def _errors(res, gold):
    return {name: _err(a, b) for name, a, b in zip(QUANTITIES, res, gold)}


def _inputs(kind, N, H, D, seed=0):
    shape = (H, N, D)
    if kind in ("normal", "outlier"):
        q, k, v = random_qkv(shape, dist=kind, seed=seed)
    else:  # "sink": 4 keys (position 0 and 3 random ones) score ~ +12 above the rest for every query
        q, k, v = random_qkv(shape, seed=seed)
        rng = np.random.default_rng(seed + 1)
        u = rng.standard_normal(D)
        u /= np.linalg.norm(u)
        q = q + 2.0 * u
        sinks = np.concatenate([[0], rng.choice(np.arange(1, N), 3, replace=False)])
        k[:, sinks] += 6.0 * math.sqrt(D) * u
    dout = np.random.default_rng(seed + 2).standard_normal(q.shape)
    return q, k, v, dout


@functools.lru_cache(maxsize=2)
def _case(kind, N, H, D, causal):
    """Inputs and the golden (out, lse, dq, dk, dv) of one input kind and mask, shared by the sweep's points."""
    q, k, v, dout = _inputs(kind, N, H, D)
    return (q, k, v, dout), _golden(q, k, v, dout, causal)


def _evaluate(point):
    (q, k, v, dout), gold = _case(point["input"], point["N"], point["H"], point["D"], point["causal"])
    return _errors(_ring(q, k, v, dout, point["W"], point["layout"], point["merge"], point["causal"]), gold)


def growth_per_doubling(Ws, errs):
    """2^slope of log2(err) on log2(W) over W >= 2 (NaN with fewer than two usable points)."""
    pts = [(math.log2(w), math.log2(e)) for w, e in zip(Ws, errs) if w >= 2 and e > 0 and math.isfinite(e)]
    if len(pts) < 2:
        return float("nan")
    x, y = np.array(pts).T
    return float(2.0 ** np.polyfit(x, y, 1)[0])


def run(size="quick", out=None, *, device="cpu", workers=1, progress=False, cluster=None,
        **overrides):
    """One row per (input, causal, layout, merge, W) with W dividing N (2W for zigzag): the relative L2 errors
    of out, lse, dq, dk, dv. Results in out/ring.jsonl (resumable). The candidate causes (:func:`candidates`)
    are in ``df.attrs["candidates"]`` (a list of dicts). Always on the CPU (``device`` is accepted for the common
    interface); ``workers`` and ``cluster`` spread the points as in :func:`fadev.experiments.common.run_custom`."""
    s = common.sizes(SIZES, size, overrides)
    points = [{"input": inp, "causal": causal, "layout": layout, "merge": merge, "W": W, "N": s["N"], "H": s["H"],
               "D": s["D"]}
              for inp in ("normal", "outlier") for causal in (False, True) for layout in LAYOUTS for merge in MERGES
              for W in s["Ws"] if s["N"] % (2 * W if layout == "zigzag" else W) == 0]
    df = common.run_custom(points, _evaluate, out, NAME, progress, cluster, workers)
    cands = candidates(s, [{**r, "causal": bool(r["causal"])} for r in df.to_dict("records")])
    df.attrs["candidates"] = [dict(zip(("candidate", "detail", "before", "after", "factor"), c)) for c in cands]
    return df


def _depth(cfg, W, merge, policy, seed=0):
    """L residual layers x <- x + ring_attention(x A_l, x B_l, x C_l); returns rel errors of x_L and of dx_0
    (loss gradient dout at the top) against the same network under golden."""
    N, H, D, L = cfg["N"], cfg["H"], cfg["D"], cfg["L"]
    rng = np.random.default_rng(seed)
    mats = rng.standard_normal((L, 3, D, D)) / math.sqrt(D)
    x0 = rng.standard_normal((H, N, D))
    dtop = rng.standard_normal((H, N, D))

    def run(pol, mg, W):
        xs, saved = [x0], []
        for layer in range(L):
            x = xs[-1] / math.sqrt(layer + 1)  # keeps scores O(1) as the residual stream grows (var ~ l + 1)
            q, k, v = (x @ mats[layer, t] for t in range(3))
            if mg is None:
                o, lse = flash_attention(q, k, v, pol, causal=True, return_lse=True)
            else:
                o, lse = ring_attention(q, k, v, policy=pol, world_size=W, layout="zigzag", merge=mg, causal=True,
                                        return_lse=True)
            saved.append((q, k, v, o, lse))
            xs.append(x + o)
        dx = dtop
        for layer in reversed(range(L)):
            q, k, v, o, lse = saved[layer]
            if mg is None:
                dq, dk, dv = flash_attention_backward(q, k, v, o, lse, dx, pol, causal=True)
            else:
                dq, dk, dv = ring_attention_backward(q, k, v, o, lse, dx, policy=pol, world_size=W, layout="zigzag",
                                                     merge=mg, causal=True)
            dx = dx + (dq @ mats[layer, 0].T + dk @ mats[layer, 1].T + dv @ mats[layer, 2].T) / math.sqrt(layer + 1)
        return xs[-1], dx

    gx, gdx = run("golden", None, 1)
    x, dx = run(policy, merge, W)
    return _err(x, gx), _err(dx, gdx)


def candidates(cfg, rows):
    """[(candidate, detail, value at W=1 or baseline, value at W_big or variant, ratio)] for sizes ``cfg`` and the
    sweep's ``rows`` (dicts); ratio = the number that ranks the candidate (how much it multiplies the error)."""
    Wb = 8 if 8 in cfg["Ws"] else max(cfg["Ws"])
    out = []

    def pick(**kw):
        return [r for r in rows if all(r[key] == val for key, val in kw.items())]

    def at(W, q, **kw):
        return next(r[q] for r in pick(W=W, **kw))

    base = dict(input="normal", causal=True, layout="zigzag", merge="lowp_partials")
    Wmax = max(w for w in cfg["Ws"] if cfg["N"] % (2 * w) == 0)
    for q in ("out", "dq", "dk"):
        e1, e2 = at(1, q, **base), at(Wmax, q, **base)
        out.append(("single layer, W growth", f"{q}, W=1 -> W={Wmax} (zigzag causal, lowp_partials)", e1, e2, e2 / e1))
    # depth composition
    for W in cfg["depth_Ws"][1:]:
        x1, d1 = _depth(cfg, 1, "lowp_partials", POLICY)
        xw, dw = _depth(cfg, W, "lowp_partials", POLICY)
        out.append((f"depth L={cfg['L']}", f"dx_0 error, W=1 -> W={W}", d1, dw, dw / d1))
        out.append((f"depth L={cfg['L']}", f"x_L error, W=1 -> W={W}", x1, xw, xw / x1))
    # causal layouts vs non-causal at Wb
    for layout in LAYOUTS:
        e_nc, e_c = at(Wb, "dq", input="normal", causal=False, layout=layout, merge="lowp_partials"), \
            at(Wb, "dq", input="normal", causal=True, layout=layout, merge="lowp_partials")
        out.append(("causal layout", f"dq at W={Wb}, {layout}: non-causal -> causal", e_nc, e_c, e_c / e_nc))
    # outlier inputs: growth W=1 -> Wmax compared with normal inputs
    for q in ("out", "dq"):
        e1, e2 = at(1, q, **{**base, "input": "outlier"}), at(Wmax, q, **{**base, "input": "outlier"})
        out.append(("outlier inputs", f"{q}, W=1 -> W={Wmax} (zigzag causal)", e1, e2, e2 / e1))
    # attention sinks
    q, k, v, dout = _inputs("sink", cfg["N"], cfg["H"], cfg["D"])
    gold = _golden(q, k, v, dout, True)
    for name in ("out", "dq"):
        i = QUANTITIES.index(name)
        e1 = _err(_ring(q, k, v, dout, 1, "zigzag", "lowp_partials", True)[i], gold[i])
        e2 = _err(_ring(q, k, v, dout, Wmax, "zigzag", "lowp_partials", True)[i], gold[i])
        out.append(("attention sinks", f"{name}, W=1 -> W={Wmax} (4 keys +12 in score)", e1, e2, e2 / e1))
    # LSE format between hops, dk/dv transport, fp16 -> bf16 grads: variant vs default at Wb
    q, k, v, dout = _inputs("normal", cfg["N"], cfg["H"], cfg["D"])
    gold = _golden(q, k, v, dout, True)
    variants = [
        ("LSE format between hops", "out", RingMerge(partial_lse="bf16", running_lse="bf16"), POLICY),
        ("LSE format between hops", "dq", RingMerge(partial_lse="bf16", running_lse="bf16"), POLICY),
        ("16-bit dk/dv transport", "dk", RingMerge(dkv_transport="bf16"), POLICY),
        ("16-bit dk/dv transport", "dv", RingMerge(dkv_transport="bf16"), POLICY),
        ("fp16 inputs, grads cast to bf16", "dq", RingMerge(),
         Policy.fa2("fp16").replace(grad="bf16")),
    ]
    for cand, name, mg, pol in variants:
        i = QUANTITIES.index(name)
        ref_pol = POLICY if "fp16" not in cand else "fa2:fp16"
        e_def = _err(_ring(q, k, v, dout, Wb, "zigzag", "lowp_partials", True, ref_pol)[i], gold[i])
        e_var = _err(_ring(q, k, v, dout, Wb, "zigzag", mg, True, pol)[i], gold[i])
        detail = f"{name} at W={Wb}: default -> variant" + (" (fa2:fp16 -> grad=bf16)" if "fp16" in cand else "")
        out.append((cand, detail, e_def, e_var, e_var / e_def))
    return out


def figures(df, out_dir):
    """Error vs W per quantity and merge (zigzag, causal), and dq per layout; returns the PNG and SVG paths."""
    rows = df.to_dict("records")
    fig, axes = plots.figure(13, 7, 2, 3)
    for ax, q in zip(axes.ravel(), QUANTITIES):
        for merge in MERGES:
            for inp, style in (("normal", "-"), ("outlier", ":")):
                sel = [r for r in rows if r["merge"] == merge and r["input"] == inp and r["causal"]
                       and r["layout"] == "zigzag"]
                if not sel:
                    continue
                ax.plot([r["W"] for r in sel], plots.positive([r[q] for r in sel]), style, marker="o", ms=3,
                        color=MERGE_COLORS[merge], label=f"{merge} ({inp})")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("ring size W (ranks)")
        ax.set_ylabel(f"rel. L2 error of {q} vs golden")
        ax.set_title(f"{q}: zigzag, causal, {POLICY}")
    ax = axes.ravel()[-1]
    for layout, style in zip(LAYOUTS, ("-", "--", ":")):
        sel = [r for r in rows if r["merge"] == "lowp_partials" and r["input"] == "normal" and r["causal"]
               and r["layout"] == layout]
        ax.plot([r["W"] for r in sel], plots.positive([r["dq"] for r in sel]), style, marker="o", ms=3, label=layout)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("ring size W (ranks)")
    ax.set_ylabel("rel. L2 error of dq vs golden")
    ax.set_title("dq by layout (lowp_partials, causal)")
    ax.legend(fontsize=7)
    axes.ravel()[0].legend(fontsize=6.5, ncol=1)
    return plots.save(fig, os.path.join(out_dir, "ring_error_vs_W"))


def _configs(rows):
    """{(input, causal, layout, merge): [rows in W order]} in sweep order."""
    out = {}
    for r in rows:
        out.setdefault((r["input"], bool(r["causal"]), r["layout"], r["merge"]), []).append(r)
    return out


def growth(df):
    """{(merge, quantity): median over inputs, causal and layouts of the growth per doubling of W}."""
    configs = _configs(df.to_dict("records"))
    summary = {}
    for merge in MERGES:
        for q in QUANTITIES:
            vals = [growth_per_doubling([r["W"] for r in sel], [r[q] for r in sel])
                    for (_, _, _, m), sel in configs.items() if m == merge]
            summary[merge, q] = float(np.nanmedian(vals))
    return summary


def findings(df, *, device="cpu") -> list:
    summary = growth(df)
    out = [Finding(f"{merge}: median growth of the error per doubling of W",
                   ", ".join(f"{q} x{summary[merge, q]:.2f}" for q in QUANTITIES)) for merge in MERGES]
    worst = max(summary["lowp_partials", q] for q in QUANTITIES)
    if worst < 1.05:
        out.append(Finding(
            "a single layer's error under lowp_partials",
            f"does not grow much with W (at most x{worst:.2f} per doubling): rounding each partial out to 16 bits "
            "adds one 16-bit rounding per hop to a value that is rounded to 16 bits at the end anyway, and the fp32 "
            "merge averages these errors rather than compounding them. fp32 partials and allgather therefore have "
            "little to remove in one layer; the candidates below are ranked instead"))
    else:
        out.append(Finding("a single layer's error under lowp_partials", f"grows up to x{worst:.2f} per doubling of W"))
    cands = sorted(df.attrs.get("candidates", []), key=lambda c: -c["factor"])
    if cands:
        top = cands[0]
        out.append(Finding("the candidate that multiplies the error most",
                           f"{top['candidate']}: {top['detail']}, {top['before']:.3e} -> {top['after']:.3e} "
                           f"(x{top['factor']:.2f})"))
    return out


def table(df) -> str:
    """Growth per doubling of W for every configuration, then the candidate causes, ranked."""
    lines = ["Growth per doubling of W (factor; 1.00 = no growth; W >= 2 fit):", "",
             "| input | causal | layout | merge | " + " | ".join(QUANTITIES) + " | dq W=1 | dq W=max |",
             "|---|---|---|---|" + "---|" * (len(QUANTITIES) + 2)]
    for (inp, causal, layout, merge), sel in _configs(df.to_dict("records")).items():
        g = [growth_per_doubling([r["W"] for r in sel], [r[q] for r in sel]) for q in QUANTITIES]
        lines.append(f"| {inp} | {causal} | {layout} | {merge} | " + " | ".join(f"{x:.2f}" for x in g) +
                     f" | {sel[0]['dq']:.2e} | {sel[-1]['dq']:.2e} |")
    summary = growth(df)
    lines += ["", "Median growth per doubling over inputs, causal, layouts:", "",
              "| merge | " + " | ".join(QUANTITIES) + " |", "|---|" + "---|" * len(QUANTITIES)]
    for merge in MERGES:
        lines.append(f"| {merge} | " + " | ".join(f"{summary[merge, q]:.2f}" for q in QUANTITIES) + " |")
    cands = sorted(df.attrs.get("candidates", []), key=lambda c: -c["factor"])
    if cands:
        lines += ["", "Candidate causes, each in isolation (ranked by the factor it multiplies the error by):", "",
                  "| rank | candidate | what | before | after | factor |", "|---|---|---|---|---|---|"]
        for n, c in enumerate(cands, 1):
            lines.append(f"| {n} | {report.escape(c['candidate'])} | {report.escape(c['detail'])} | "
                         f"{c['before']:.3e} | {c['after']:.3e} | {c['factor']:.2f} |")
    return "\n".join(lines)
