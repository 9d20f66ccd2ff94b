"""Distances between the weights of two models: one row per tensor, plus a model-level row.

``fadev.weights.compare(a, b)`` (in ``fadev.compare(test, ref)``'s order: ``a`` is the weights under test, ``b`` the
reference the relative metrics divide by) takes two ``torch.nn.Module`` objects (their ``state_dict()``) or two
mappings name -> tensor (torch tensors of any floating, integer or bool dtype on any device, or NumPy
arrays, ml_dtypes' bfloat16 included) and returns a pandas DataFrame, one row per tensor in ``a``'s key
order, then one final row named ``"__model__"``:

=============  ==================================================================================
column         per tensor (d = a - b element-wise, in float64; every input value is exact in float64)
=============  ==================================================================================
``name``       the state-dict key
``numel``      number of elements
``max_abs``    max |d|                                    (fadev.max_abs)
``wasserstein`` exact Wasserstein-1 distance between the two tensors' value distributions
               (fadev.wasserstein; equals scipy.stats.wasserstein_distance of the flattened values)
``rmse``       sqrt(mean(d^2))                            (fadev.rmse)
``rel_l2``     ||d||_2 / ||b||_2                          (fadev.rel_l2; inf when b is all zero, a is not)
=============  ==================================================================================

The ``"__model__"`` row aggregates the tensors (all of them, with their sizes as weights):
``numel`` = total elements, ``max_abs`` = max over tensors (the largest element difference anywhere),
``wasserstein`` = size-weighted mean of the per-tensor W1 (each tensor's distribution compared with
its own counterpart: pooling all weights into one distribution would let a change in one layer
cancel against another's), ``rmse`` = sqrt(sum ||d||^2 / total numel) and ``rel_l2`` =
sqrt(sum ||d||^2) / sqrt(sum ||b||^2) -- the RMSE and relative L2 of the whole flattened model,
exactly. The same values are in ``df.attrs["model"]`` (a dict) and ``df.attrs["max_abs_tensor"]``
names the tensor where the largest difference is. NaN in a tensor makes its metrics and the model's
NaN (the max too).

``groups`` (a function name -> group label) adds ``df.attrs["groups"]``: one dict per group (in first-seen
order) with the same aggregates over that group's tensors -- e.g. one per transformer layer.

Where both tensors of a name are CUDA tensors, their metrics are computed on the GPU (fadev's GPU metrics:
the same exact Wasserstein distance and max, the sums within rounding of the CPU's), with no copy to the host.

Empty tensors (numel 0) get 0 for every metric. ValueError names the tensor for keys present in only
one of the two, or differing shapes; TypeError for inputs that are not modules or mappings of arrays.
"""
from __future__ import annotations

import math
from collections.abc import Mapping

import numpy as np

from .formats import _numeric
from .metrics import compare as _compare

COLUMNS = ("name", "numel", "max_abs", "wasserstein", "rmse", "rel_l2")
MODEL_ROW = "__model__"


def _state(x, which):
    """A mapping name -> tensor/array from a module, a state dict, or any mapping."""
    if hasattr(x, "state_dict") and callable(x.state_dict):
        return x.state_dict()
    if isinstance(x, Mapping):
        return x
    raise TypeError(f"{which}: expected a torch.nn.Module or a mapping name -> tensor/array (a state_dict), "
                    f"got {type(x).__name__}")


def _array(t, which, name) -> np.ndarray:
    """A tensor's or array's values as a float64 NumPy array (exact: every torch / ml_dtypes float, int
    up to 2^53 and bool is a float64 value)."""
    if type(t).__module__.startswith("torch"):
        t = t.detach()
        if t.device.type != "cpu":
            t = t.cpu()
        if t.is_complex():
            raise TypeError(f"{which}[{name!r}]: complex tensors are not compared, got {t.dtype}")
        if t.is_floating_point() and t.dtype != np.float64:
            t = t.double()  # bfloat16 has no NumPy dtype; float -> float64 is exact
        return t.numpy()
    try:
        arr = np.asarray(t)
    except Exception:
        raise TypeError(f"{which}[{name!r}]: expected a tensor or array, got {type(t).__name__}") from None
    return _numeric(arr, f"{which}[{name!r}]")  # ml_dtypes floats as float32; TypeError for other dtypes


def _check_keys(sa, sb):
    only_a = [k for k in sa if k not in sb]
    only_b = [k for k in sb if k not in sa]
    if only_a or only_b:
        parts = []
        if only_a:
            parts.append(f"only in a: {', '.join(map(repr, only_a[:5]))}{' ...' if len(only_a) > 5 else ''}")
        if only_b:
            parts.append(f"only in b: {', '.join(map(repr, only_b[:5]))}{' ...' if len(only_b) > 5 else ''}")
        raise ValueError(f"a and b hold different tensors ({'; '.join(parts)})")


def _on_gpu(t) -> bool:
    return type(t).__module__.startswith("torch") and t.is_cuda and not t.is_complex()


def _pair(ta, tb, name):
    """(a's values, b's values, ||b||^2) in float64: CUDA tensors stay on their GPU, the rest as NumPy."""
    if _on_gpu(ta) and _on_gpu(tb):
        x, y = ta.detach().double(), tb.detach().double()
        return x, y, float((y.reshape(-1) @ y.reshape(-1)).item()) if y.numel() else 0.0
    x, y = _array(ta, "a", name), _array(tb, "b", name)
    y64 = np.asarray(y, dtype=np.float64)
    return x, y, float(np.dot(y64.ravel(), y64.ravel()))


def _aggregate(rows, sq_diff, sq_ref, name):
    """The aggregate row (module docstring) of ``rows`` with their squared differences and reference norms."""
    numel = np.array([r["numel"] for r in rows], dtype=np.float64)
    total = float(numel.sum())
    max_abs = np.array([r["max_abs"] for r in rows])
    w1 = np.array([r["wasserstein"] for r in rows])
    diff, ref = math.fsum(sq_diff), math.fsum(sq_ref)
    return {"name": name, "numel": int(total),
            "max_abs": float(np.max(max_abs)),  # np.max propagates NaN
            "wasserstein": float(np.dot(numel, w1) / total) if total else 0.0,
            "rmse": math.sqrt(diff / total) if total else 0.0,
            "rel_l2": (math.sqrt(diff) / math.sqrt(ref) if ref else (0.0 if diff == 0 else math.inf))
            if not math.isnan(diff) else math.nan}


def compare(a, b, *, groups=None):
    """Per-tensor and model-level distances of the weights ``a`` from the reference ``b`` (``fadev.compare(test,
    ref)``'s order; module docstring):
    a DataFrame with columns name, numel, max_abs, wasserstein, rmse, rel_l2, one row per tensor and a
    final ``"__model__"`` row; ``df.attrs["model"]`` holds that row as a dict, ``df.attrs["groups"]`` the
    aggregates of each group of ``groups(name)`` (a callable; None: no groups)."""
    import pandas as pd
    if groups is not None and not callable(groups):
        raise TypeError(f"groups: expected a function name -> group label or None, got {type(groups).__name__}")
    sa, sb = _state(a, "a"), _state(b, "b")
    _check_keys(sa, sb)
    if not sa:
        raise ValueError("a and b hold no tensors")
    rows, sq_diff, sq_ref = [], [], []
    for name in sa:
        x, y, ref_sq = _pair(sa[name], sb[name], name)
        if x.shape != y.shape:
            raise ValueError(f"tensor {name!r}: a has shape {tuple(x.shape)}, b has shape {tuple(y.shape)}")
        n = int(x.numel() if callable(x.size) else x.size)
        if n == 0:
            rows.append({"name": name, "numel": 0, "max_abs": 0.0, "wasserstein": 0.0, "rmse": 0.0, "rel_l2": 0.0})
            sq_diff.append(0.0)
            sq_ref.append(0.0)
            continue
        c = _compare(x, y)
        rows.append({"name": name, "numel": n, "max_abs": c.max_abs, "wasserstein": c.wasserstein, "rmse": c.rmse,
                     "rel_l2": c.rel_l2})
        sq_diff.append(c.rmse * c.rmse * n)
        sq_ref.append(ref_sq)
    model = _aggregate(rows, sq_diff, sq_ref, MODEL_ROW)
    max_abs = np.array([r["max_abs"] for r in rows])
    df = pd.DataFrame(rows + [model], columns=list(COLUMNS))
    df.attrs["model"] = dict(model)
    if groups is not None:
        members = {}
        for i, r in enumerate(rows):
            members.setdefault(groups(r["name"]), []).append(i)
        df.attrs["groups"] = [_aggregate([rows[i] for i in idx], [sq_diff[i] for i in idx], [sq_ref[i] for i in idx],
                                         label) for label, idx in members.items() if label is not None]
    df.attrs["max_abs_tensor"] = rows[int(np.nanargmax(max_abs))]["name"] if not np.all(np.isnan(max_abs)) else None
    return df


def model_distance(a, b) -> dict:
    """The ``"__model__"`` row of :func:`compare` as a dict, plus ``max_abs_tensor``."""
    df = compare(a, b)
    return dict(df.attrs["model"], max_abs_tensor=df.attrs["max_abs_tensor"])


__all__ = ["compare", "model_distance", "COLUMNS", "MODEL_ROW"]
