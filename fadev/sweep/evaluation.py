"""Evaluating one sweep point: inputs (cached per process with their golden answer), the test and
reference runs, and the row of metrics (:func:`evaluate`); :func:`point_from_row` gives a row's point back."""
from __future__ import annotations

import collections
import math
import time

import numpy as np

from .. import __version__
from ..attention import baseline_attention, golden_attention, random_qkv, sram_tiles
from ..metrics import compare
from ..policy import Policy, as_policy
from .schema import _INT_PARAMS, _PREFIXES, KERNELS, PARAMS, _build_policy, canonical, point_key

_CACHE_ENTRIES, _CACHE_BYTES = 8, 256 << 20
_cache = collections.OrderedDict()


def _input_fmt(p):
    """The format inputs are rounded to ('fp64': none)."""
    if p["input_fmt"] != "policy":
        return p["input_fmt"]
    return p.get("stage.input") or as_policy(p["policy"]).input.name


def _inputs_and_golden(p, input_fmt, need_golden):
    """(q, k, v, golden_out, golden_lse) for the point's inputs, from a small per-process LRU cache."""
    key = (p["batch"], p["heads"], p["heads_kv"], p["N"], p["N_kv"], p["D"], p["dist"], p["seed"], input_fmt,
           p["causal"], p["scale"], p["device"])
    entry = _cache.pop(key, None)
    if entry is None:
        fmt = None if input_fmt == "fp64" else input_fmt
        entry = list(random_qkv((p["batch"], p["heads"], p["N"], p["D"]), dist=p["dist"], seed=p["seed"], fmt=fmt,
                                heads_kv=p["heads_kv"], seq_kv=p["N_kv"])) + [None, None]
    if need_golden and entry[3] is None and p["device"] == "cuda":
        entry[3], entry[4] = golden_attention(*entry[:3], causal=p["causal"], scale=p["scale"], return_lse=True,
                                              device="cuda")
    elif need_golden and entry[3] is None:
        entry[3], entry[4] = baseline_attention(*entry[:3], Policy.golden(), causal=p["causal"], scale=p["scale"],
                                                return_lse=True)
    for a in entry:
        if a is not None:
            a.setflags(write=False)  # shared by every point on these inputs: no kernel may write them
    _cache[key] = entry
    size = sum(a.nbytes for e in _cache.values() for a in e if a is not None)
    while len(_cache) > 1 and (len(_cache) > _CACHE_ENTRIES or size > _CACHE_BYTES):
        size -= sum(a.nbytes for a in _cache.popitem(last=False)[1] if a is not None)
    return entry


def _tiles(p, pol, pre):
    """Resolved flash parameters (what the kernel is called with), or None for baseline."""
    if p[pre + "kernel"] != "flash":
        return None
    if p[pre + "sram_bytes"] is not None:
        bq, bkv = sram_tiles(p[pre + "sram_bytes"], p["D"])
    else:
        bq = pol.block_q if p[pre + "block_q"] is None else p[pre + "block_q"]
        bkv = pol.block_kv if p[pre + "block_kv"] is None else p[pre + "block_kv"]
    pick = {f: (getattr(pol, f) if p[pre + f] is None else p[pre + f]) for f in ("loop_order", "normalize", "exp")}
    return {"block_q": bq, "block_kv": bkv, **pick}


def _metrics(prefix, test, ref):
    return {f"{prefix}.{name}": value for name, value in compare(test, ref).as_dict().items()}


def evaluate(point) -> dict:
    """Run one point and return its row (a flat dict; see the module docstring for the columns).
    Deterministic: the same point gives the same metrics on any thread count or worker."""
    start = time.perf_counter()
    p = canonical(point)
    extra = {k: v for k, v in p.items() if k.startswith(_PREFIXES)}
    row = {"key": point_key(p), **p}
    runs = {}
    for pre in ("", "ref_"):
        if pre and p["ref_kernel"] is None:
            continue
        pol = _build_policy(p, extra, pre)
        seed = p[pre + "rounding_seed"] if p[pre + "rounding_seed"] is not None else p["seed"]
        if pol.rounding == "stochastic":
            pol = pol.replace(seed=seed)
        runs[pre] = (pol, _tiles(p, pol, pre))
        row[pre + "policy_name"] = pol.name
        for f in ("block_q", "block_kv", "loop_order", "normalize", "exp"):
            row[f"{pre}used.{f}"] = runs[pre][1][f] if runs[pre][1] else None
    q, k, v, g_out, g_lse = _inputs_and_golden(p, _input_fmt(p), p["golden"])
    results = {}
    for pre, (pol, tiles) in runs.items():
        kernel = KERNELS[(p[pre + "kernel"], p["device"])]
        t0 = time.perf_counter()
        results[pre] = kernel(q, k, v, pol, p["causal"], p["scale"], tiles or {})
        if not pre:
            row["test_s"] = time.perf_counter() - t0
    pairs = []
    if p["golden"]:
        pairs.append(("vs_golden", results[""], (g_out, g_lse)))
    if "ref_" in results:
        pairs.append(("vs_ref", results[""], results["ref_"]))
        if p["golden"]:
            pairs.append(("ref_vs_golden", results["ref_"], (g_out, g_lse)))
    for name, (out, lse), (ref_out, ref_lse) in pairs:
        row.update(_metrics(name, out, ref_out))
        if p["lse"]:
            row.update(_metrics("lse_" + name, lse, ref_lse))
    row["fadev_version"] = __version__
    row["wall_s"] = time.perf_counter() - start
    return row


def point_from_row(row) -> dict:
    """The canonical point a row (a dict, or a pandas Series from :func:`load`) was computed from.
    Missing values read back from CSV or a DataFrame (NaN) count as None; integral floats of integer
    parameters (pandas widens int columns holding None) are converted back."""
    items = row.items() if hasattr(row, "items") else dict(row).items()
    point = {}
    for name, value in items:
        if not isinstance(name, str) or not (name in PARAMS or name.startswith(_PREFIXES)):
            continue
        if isinstance(value, np.generic):
            value = value.item()
        if type(value).__name__ == "NAType":  # pandas' missing value of Int64 / boolean columns
            value = None
        if value is None or (isinstance(value, float) and math.isnan(value)):
            if name.startswith(_PREFIXES):
                continue
            value = None
        elif isinstance(value, float) and value.is_integer() and name in _INT_PARAMS:
            value = int(value)
        point[name] = value
    point = canonical(point)
    key = row.get("key") if hasattr(row, "get") else None
    if isinstance(key, str) and key != point_key(point):
        raise ValueError(f"row key {key!r} does not match its parameters (key {point_key(point)!r}): the row lost "
                         f"types on the way (e.g. a CSV tag '1' read back as 1) or was written by another fadev "
                         f"version; parameters read: {point!r}")
    return point
