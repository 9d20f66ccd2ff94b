"""Pieces every experiment shares: inputs, the golden answer, metric columns, output fingerprints.

Query-row sampling. Every query row of attention is computed independently of the others (the
softmax normalises along the keys of one row), so the deviation statistics of an N x N attention are
those of its rows. The experiments therefore compute ``n_query`` query rows (i.i.d. draws, like every
other row) against all N keys: paper-scale sequence lengths (16k and beyond) then cost
O(n_query * N * D) instead of O(N^2 * D). With ``n_query = N`` this is the full attention.
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import time

import numpy as np

from .. import cuda_available, report, sweep
from ..attention import baseline_attention, random_qkv
from ..metrics import compare
from ..policy import Policy

METRICS = ("max_abs", "mean_diff", "std_diff", "mean_abs", "rmse", "rel_l2")
"""The :class:`fadev.Comparison` fields recorded for each comparison of a custom point (prefix.metric)."""


@functools.lru_cache(maxsize=4)
def inputs(n, n_query, dim, seed, fmt=None, dist="normal", heads=1, batch=1):
    """(q, k, v): q (batch, heads, n_query, dim), k and v (batch, heads, n, dim), drawn by
    :func:`fadev.random_qkv` (seed) and rounded to ``fmt`` (None: left in fp64). Cached (read-only arrays):
    the experiments evaluate several kernels on one input."""
    q, k, v = random_qkv((batch, heads, n_query, dim), dist=dist, seed=seed, fmt=fmt, seq_kv=n)
    for t in (q, k, v):
        t.setflags(write=False)
    return q, k, v


@functools.lru_cache(maxsize=4)
def golden(n, n_query, dim, seed, fmt=None, dist="normal", heads=1, batch=1):
    """The fp64 answer for :func:`inputs` with the same arguments (baseline attention, every stage fp64)."""
    q, k, v = inputs(n, n_query, dim, seed, fmt, dist, heads, batch)
    out = baseline_attention(q, k, v, Policy.golden())
    out.setflags(write=False)
    return out


def metrics(prefix, test, ref) -> dict:
    """{prefix.metric: value} for the METRICS of test against ref (the sweep's column names)."""
    c = compare(test, ref)
    return {f"{prefix}.{m}": float(getattr(c, m)) for m in METRICS}


def fingerprint(arr) -> str:
    """A short hash of an array's float64 bytes: equal fingerprints mean bit-identical outputs."""
    return hashlib.sha1(np.ascontiguousarray(arr, dtype=np.float64).tobytes()).hexdigest()[:16]


PAPER = "Golden et al., \"Is Flash Attention Stable?\", arXiv 2405.02803"

METHOD = (
    "Method. Every arithmetic result is rounded to the format of the stage it belongs to (fadev's precision "
    "policies, docs/design.md); deviations are measured against an fp64 golden run on the same inputs and "
    "averaged over input seeds (± = standard deviation over seeds). Query rows are independent, so each "
    "experiment computes a sample of query rows (`n_query`) against all N keys: the statistics are those of "
    "the full N x N attention at O(n_query N D) cost (fadev/experiments/common.py).")
"""The paragraph that opens a report of the paper experiments."""


def check_size(size, table=("quick", "full")):
    """``size`` if it names one of ``table``'s sizes, else ValueError."""
    if size not in table:
        raise ValueError(f"size must be {' or '.join(map(repr, table))}, got {size!r}")
    return size


# ------------------------------------------------------------------ running and aggregating

FORMAT_ORDER = ("fp8_e5m2", "fp8_e4m3", "bf16", "fp16", "tf32", "fp32", "fp64")
"""Formats by significand bits (fewest first), the x axis of the precision figures."""


def results_path(out, name):
    """out/NAME.jsonl, or None when out is None (nothing written)."""
    if out is None:
        return None
    os.makedirs(out, exist_ok=True)
    return os.path.join(out, f"{name}.jsonl")


def run_points(points, out, name, workers=1, progress=False, cluster=None):
    """Run sweep points through :func:`fadev.sweep.run` (rows appended to out/NAME.jsonl, resumable).
    A point's device 'cuda' becomes 'cpu' where fadev has no CUDA attention kernels (:func:`sweep_device`).
    ``cluster``: sweep.run's executor options ({"executor": "ray", "address": ...}; None: local processes).
    RuntimeError when points failed (after every other point ran; a rerun retries them)."""
    points = [{**p, "device": sweep_device(p.get("device", "cpu"))} for p in points]
    df = sweep.run(points, results_path(out, name), workers=workers, progress=progress, **(cluster or {}))
    _raise_failed(df.to_dict("records"), name, out)
    return df


def point_key(point) -> str:
    """Hash of a custom (non-sweep) point: 16 hex digits of sha256 over its sorted JSON."""
    text = json.dumps(point, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


class _CustomRow:
    """point -> {"key", **point, **evaluate(point), "wall_s"}; a plain class, so it pickles for executors in
    other processes whenever ``evaluate`` (a module-level function) does."""

    def __init__(self, evaluate):
        self.evaluate = evaluate

    def __call__(self, point):
        start = time.perf_counter()
        row = {"key": point_key(point), **point, **self.evaluate(point)}
        row["wall_s"] = time.perf_counter() - start
        return row


def run_custom(points, evaluate, out, name, progress=False, cluster=None, workers=None):
    """Run points that the sweep engine cannot express (fp8 scaling, PyTorch's kernels) with the same file
    contract, through :func:`fadev.sweep.drive`: one JSON line per point appended (flushed, fsynced) to
    out/NAME.jsonl as it finishes, points whose key is already there skipped. ``evaluate(point) -> dict``
    of metric columns, a module-level function; ``cluster``, ``workers``: as :func:`run_points`. Returns a
    DataFrame in the order of ``points``; RuntimeError when points failed."""
    import pandas as pd
    unique = {point_key(p): p for p in points}
    done = sweep.drive(unique, _CustomRow(evaluate), point_key, results_path(out, name), progress=progress,
                       desc=name, workers=workers, **(cluster or {}))
    rows = [done[point_key(p)] for p in points]
    _raise_failed(rows, name, out)
    return pd.DataFrame(rows)


def _raise_failed(rows, name, out):
    failed = [r for r in rows if isinstance(r.get("error"), str)]
    if failed:
        where = f"their rows are in {results_path(out, name)}; " if out is not None else ""
        raise RuntimeError(f"{name}: {len(failed)} of {len(rows)} points failed ({where}a rerun retries them); the "
                           f"first: {failed[0]['error']}")


def mean_std(df, by, metrics):
    """Mean, std (ddof=1) and count over seeds of each metric column, grouped by ``by`` (fadev.sweep.aggregate);
    a metric column that is NaN in a group stays NaN."""
    return sweep.aggregate(df, by=list(by), metrics=list(metrics))


def identical(df, metric_prefix="vs_golden"):
    """Boolean Series: rows whose every recorded metric equals the previous row's bit for bit."""
    cols = [c for c in df.columns if c.startswith(metric_prefix + ".")]
    return (df[cols].shift() == df[cols]).all(axis=1)


@dataclasses.dataclass
class Finding:
    """One claim of the report: what we measured next to what its source says, and whether it holds
    (None: a note, not a claim, or not measurable on this machine). ``source`` names whose claim a verdict
    tests, a key of :data:`fadev.report.SOURCES` ("golden", "fa3", "fadev"); required with a verdict.
    ``partly``: where a claim that does not hold over the whole range measured holds on part of it, that part
    as text ("for N >= 2048"); only with ``holds=False`` (so ``holds`` stays True only for a claim that holds
    everywhere), the verdict reads "partly holds (for N >= 2048)"."""

    claim: str
    ours: str
    paper: str = ""
    holds: bool | None = None
    source: str = ""
    partly: str = ""

    def __post_init__(self):
        if self.holds is not None and self.source not in report.SOURCES:
            raise ValueError(f"Finding {self.claim!r}: a verdict needs source in {', '.join(report.SOURCES)}, "
                             f"got {self.source!r}")
        if self.partly and self.holds is not False:
            raise ValueError(f"Finding {self.claim!r}: partly={self.partly!r} needs holds=False (the claim does "
                             f"not hold on the whole range), got holds={self.holds!r}")

    @property
    def verdict(self) -> str | None:
        """'holds', 'partly holds (for ...)', 'does not hold', or None (no verdict)."""
        if self.holds is None:
            return None
        if self.partly:
            return f"partly holds ({self.partly})"
        return "holds" if self.holds else "does not hold"

    def markdown(self) -> str:
        verdict = f"**{self.verdict}**" if self.holds is not None else "(no verdict)"
        paper = f"; claimed: {self.paper}" if self.paper else ""
        return f"- {self.claim}: {self.ours}{paper} — {verdict}"


def holds_range(xs, ok, *, name="N") -> str:
    """The part of ``xs`` (ascending) where ``ok`` is true, as text: "for N >= 8192", "for N <= 1024",
    "for 8192 <= N <= 16384", "at N = 512 only", "at N = 512, 4096" (scattered), "at every N" or "nowhere"."""
    xs, ok = [int(x) for x in xs], [bool(o) for o in ok]
    if len(xs) != len(ok) or not xs:
        raise ValueError(f"xs and ok must have the same non-zero length, got {len(xs)}, {len(ok)}")
    if all(ok):
        return f"at every {name}"
    if not any(ok):
        return "nowhere"
    first, last = ok.index(True), len(ok) - 1 - ok[::-1].index(True)
    if not all(ok[first:last + 1]):
        return f"at {name} = " + ", ".join(str(x) for x, o in zip(xs, ok) if o)
    if last == len(xs) - 1:
        return f"for {name} >= {xs[first]}"
    if first == 0:
        return f"for {name} <= {xs[last]}"
    if first == last:
        return f"at {name} = {xs[first]} only"
    return f"for {xs[first]} <= {name} <= {xs[last]}"


def where_holds(xs, ok, values, *, name="N", show=None) -> str:
    """Where along ``xs`` (ascending) a claim holds, as text: "holds at every N = 256..65536", "holds for
    N >= 8192; 1.9x at N = 4096", "holds for N <= 1024; 0.84x at N = 4096", "holds for 8192 <= N <= 16384;
    3.4x at N = 4096, 58x at N = 32768", "holds at N = 512, 4096; 3.1x at N = 1024", "does not hold at any
    N = 256..4096 (3.1x at N = 4096)". ``ok``: one bool per x; ``values``: the measured value per x, shown
    by ``show`` (default :func:`fmt_ratio`) at the failing x on each side of a range where it holds (the
    first failing x when it holds at scattered x, the largest x when it holds nowhere)."""
    xs, ok = [int(x) for x in xs], [bool(o) for o in ok]
    if not (len(xs) == len(ok) == len(values)) or not xs:
        raise ValueError(f"xs, ok and values must have the same non-zero length, got {len(xs)}, {len(ok)}, "
                         f"{len(values)}")
    show = show or fmt_ratio
    span = f"{name} = {xs[0]}" + (f"..{xs[-1]}" if len(xs) > 1 else "")
    if all(ok):
        return f"holds at every {span}"
    if not any(ok):
        return f"does not hold at any {span} ({show(values[-1])} at {name} = {xs[-1]})"
    first, last = ok.index(True), len(ok) - 1 - ok[::-1].index(True)
    text = "holds " + holds_range(xs, ok, name=name)
    bad = [ok.index(False)] if not all(ok[first:last + 1]) else [first - 1, last + 1]
    shown = ", ".join(f"{show(values[i])} at {name} = {xs[i]}" for i in bad if 0 <= i < len(xs))
    return f"{text}; {shown}"


def ran_on(device) -> str:
    """Where an experiment's emulation ran when ``device`` was asked for, as report text: 'the CPU', 'the
    GPU', or 'the CPU (asked for cuda: ...)' where :func:`sweep_device` fell back."""
    used = sweep_device(device)
    if used == device:
        return "the GPU" if used == "cuda" else "the CPU"
    why = "fadev has no usable CUDA device here" if not cuda_available() else "fadev's sweep has no CUDA kernels"
    return f"the CPU (asked for `--device {device}`: {why})"


def sizes(table, size, overrides=None):
    """table[size] with ``overrides`` (non-None values) applied; unknown override names are an error."""
    chosen = dict(table[check_size(size, table)])
    for name, value in (overrides or {}).items():
        if name not in chosen:
            raise ValueError(f"unknown size parameter {name!r}; known: {', '.join(chosen)}")
        if value is not None:
            chosen[name] = value
    return chosen


def fmt_ratio(x) -> str:
    return "n/a" if x is None or not np.isfinite(x) else f"{x:.3g}x"


def sweep_device(device):
    """The device the sweep's emulation kernels run on: 'cuda' only when asked for and fadev has CUDA
    attention kernels registered (fadev.sweep.KERNELS) and a usable device; else 'cpu'."""
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")
    if device == "cuda":
        if cuda_available() and all((k, "cuda") in sweep.KERNELS for k in ("flash", "baseline")):
            return "cuda"
    return "cpu"


def torch_available() -> bool:
    """True when PyTorch is importable."""
    try:
        import torch  # noqa: F401
    except ImportError:
        return False
    return True


def torch_cuda() -> bool:
    """True when PyTorch is importable and sees a CUDA device (its SDPA kernels can be measured)."""
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


SIZE_DOCS = {
    "formats": "formats F to run (names: fp64, fp32, tf32, fp16, bf16, fp8_e4m3, fp8_e5m2)",
    "fmt": "the format F",
    "N": "sequence length: keys per query row",
    "Ns": "sequence lengths N (keys)",
    "n_query": "query rows computed per run (rows are independent: a sample of the N x N attention)",
    "D": "head dimension",
    "block_q": "flash query block Br",
    "block_kv": "flash key/value block Bc",
    "seeds": "input seeds 0..SEEDS-1 to average over",
}
"""What each size parameter means (the CLI's --KEY help)."""
