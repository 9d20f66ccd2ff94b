"""Deviation metrics: how far a result ``test`` is from a reference ``ref``.

:func:`compare` returns every metric at once as a :class:`Comparison`; each metric is also its own
function. All arithmetic happens in C (csrc/metrics.c, csrc/sort.c) with the GIL released: sums are
fp64 and Neumaier-compensated over fixed chunks combined in a fixed order, so results are accurate for
10^9 elements and bit-identical for any ``fadev.set_num_threads``.

Inputs are anything NumPy turns into a real numeric array (float32, integers, bool, non-contiguous or
byte-swapped arrays, ml_dtypes arrays): they are converted to float64, never rejected.

Non-finite values, in one place (each function repeats what applies to it). With d = test - ref
computed in IEEE fp64:

* a NaN d -- a NaN in either input, or the same infinity in both (inf - inf) -- makes every
  difference metric NaN;
* otherwise an infinite d (an infinity on one side only, opposite infinities, or test - ref
  overflowing fp64) makes ``max_abs``, ``mean_abs``, ``rmse`` inf, ``mean_diff`` +-inf (NaN if both
  signs occur), ``std_diff`` NaN, ``rel_l2`` inf (NaN if ref holds an infinity: inf/inf) and
  ``max_rel`` inf where ref != 0 (NaN if ref holds an infinity);
* :class:`Comparison` carries ``n_nan`` and ``n_inf`` (elements where an input is NaN, resp. infinite)
  so a NaN or inf result can be traced back.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from . import _args
from . import _core
from . import cuda as _cuda
from .formats import _numeric, as_float, as_format

_W1_METHODS = {"auto": 0, "sort": 1, "count": 2}
_W1_METHOD_NAMES = {1: "sort", 2: "count"}
MAX_ULP_LIMIT = 1 << 20


def _as_float64(x, name: str, gpu=None) -> np.ndarray:
    """x as a C-contiguous native float64 array (a device array with ``gpu``: fadev.cuda); TypeError for
    non-numeric dtypes, ValueError if empty."""
    if gpu is not None:
        arr = gpu.operand(x, name)
        if arr.size == 0:
            raise ValueError(f"{name}: empty array (shape {arr.shape})")
        return arr
    arr = _numeric(x, name)
    if arr.size == 0:
        raise ValueError(f"{name}: empty array (shape {arr.shape})")
    return as_float(arr, name, contiguous=True)


def _pair(test, ref, gpu=None):
    t = _as_float64(test, "test", gpu)
    r = _as_float64(ref, "ref", gpu)
    if t.shape != r.shape:
        raise ValueError(f"test and ref must have the same shape, got test.shape={t.shape} and "
                         f"ref.shape={r.shape}")
    return t, r


@dataclasses.dataclass(frozen=True)
class Comparison:
    """Every deviation metric of ``test`` against ``ref`` (see :func:`compare`).

    ``n``: elements; ``n_nan``: elements where test or ref is NaN; ``n_inf``: elements where neither
    is NaN and test or ref is infinite. The metrics are documented on their functions:
    :func:`max_abs`, :func:`mean_diff`, :func:`std_diff`, :func:`mean_abs`, :func:`rmse`,
    :func:`rel_l2`, :func:`max_rel`, :func:`wasserstein`.
    """

    n: int
    n_nan: int
    n_inf: int
    max_abs: float
    mean_diff: float
    std_diff: float
    mean_abs: float
    rmse: float
    rel_l2: float
    max_rel: float
    wasserstein: float

    def as_dict(self) -> dict:
        """The fields as a plain dict (ints and floats), e.g. for a DataFrame row or JSON."""
        return dataclasses.asdict(self)


def _deviation(test, ref, device) -> dict:
    gpu = _cuda.route(device, test=test, ref=ref)
    t, r = _pair(test, ref, gpu)
    return (gpu or _core).deviation(t, r)


def compare(test, ref, *, device=None) -> Comparison:
    """All deviation metrics of ``test`` against ``ref`` (same shape) as a :class:`Comparison`.

    d = test - ref element-wise in fp64; ``wasserstein`` compares the two value distributions
    (flattened). NaN: a NaN in either input (or the same infinity in both) makes every difference
    metric NaN; infinities follow IEEE arithmetic (module docstring); ``n_nan`` and ``n_inf`` count
    the elements involved. Raises ValueError for differing shapes or empty arrays, TypeError for
    non-numeric dtypes.

    ``device`` (every metric has it): None computes on the GPU when an input is a CUDA array, else on
    the CPU; "cpu" or "cuda" choose (:mod:`fadev.cuda`). The GPU's statistics equal the CPU's within
    rounding (sums in another order), its Wasserstein distance and ULP errors are the same exact values.
    """
    gpu = _cuda.route(device, test=test, ref=ref)
    t, r = _pair(test, ref, gpu)
    core = gpu or _core
    stats = core.deviation(t, r)
    w, _ = _w1(t, r, "auto", device)
    return Comparison(wasserstein=w, **stats)


def max_abs(test, ref, *, device=None) -> float:
    """max |test - ref| (same shapes). NaN if any NaN in either input or test and ref hold the same
    infinity at some element (inf - inf); inf if some difference is infinite."""
    return _deviation(test, ref, device)["max_abs"]


def mean_diff(test, ref, *, device=None) -> float:
    """Mean of the signed difference test - ref (bias), compensated sum. NaN if any NaN in either
    input or inf - inf; +-inf if infinite differences of one sign occur, NaN if of both signs."""
    return _deviation(test, ref, device)["mean_diff"]


def std_diff(test, ref, *, device=None) -> float:
    """Population standard deviation (ddof=0) of test - ref, from per-chunk two-pass sums.
    NaN if any NaN in either input or any difference is infinite (inf - mean is undefined)."""
    return _deviation(test, ref, device)["std_diff"]


def mean_abs(test, ref, *, device=None) -> float:
    """Mean of |test - ref|. NaN if any NaN in either input or inf - inf; inf if some difference is
    infinite."""
    return _deviation(test, ref, device)["mean_abs"]


def rmse(test, ref, *, device=None) -> float:
    """sqrt(mean((test - ref)^2)), overflow-safe (squares are rescaled by powers of two when needed).
    NaN if any NaN in either input or inf - inf; inf if some difference is infinite."""
    return _deviation(test, ref, device)["rmse"]


def rel_l2(test, ref, *, device=None) -> float:
    """||test - ref||_2 / ||ref||_2. 0 when test == ref everywhere, inf when ref is all zero and
    test is not. NaN if any NaN in either input or inf - inf; inf if some difference is infinite,
    NaN if additionally ref holds an infinity (inf / inf)."""
    return _deviation(test, ref, device)["rel_l2"]


def max_rel(test, ref, *, device=None) -> float:
    """max |test_i - ref_i| / |ref_i| over the elements with ref_i != 0 (zeros of ref are skipped:
    their relative error is undefined); NaN when every ref_i is 0. NaN if any NaN in either input,
    inf - inf, or an infinite ref_i (inf / inf); inf if test_i is infinite where ref_i is finite
    and nonzero."""
    return _deviation(test, ref, device)["max_rel"]


def _w1(a, b, method, device=None):
    _args.choice("method", method, tuple(_W1_METHODS))
    gpu = _cuda.route(device, a=a, b=b)
    x = _as_float64(a, "a", gpu).reshape(-1)
    y = _as_float64(b, "b", gpu).reshape(-1)
    if gpu:
        return gpu.wasserstein(x, y, _W1_METHODS[method])
    # method "auto" answers (None, sort) when counting does not apply; the sort is NumPy's (NaNs last), the
    # O(n) quantile walk the C core's
    w1, used = (None, _W1_METHODS["sort"]) if method == "sort" else _core.wasserstein(x, y, _W1_METHODS[method])
    if w1 is None:
        w1, used = _core.wasserstein(np.sort(x), np.sort(y), _W1_METHODS["sort"])
    return w1, used


def wasserstein(a, b, *, method: str = "auto", device=None) -> float:
    """Exact Wasserstein-1 distance between the value distributions of ``a`` and ``b``.

    W1 = integral of |F_a(x) - F_b(x)| dx over the empirical CDFs of the flattened inputs; sizes and
    shapes may differ. Equals ``scipy.stats.wasserstein_distance(a.ravel(), b.ravel())``.
    ``method``: "sort" (NumPy's sort, then the quantile integral
    sum |a_(i) - b_(j)| * overlap of their quantile intervals, with exact integer interval lengths),
    "count" (O(n + 2^16): histograms by 16-bit pattern; every value of both inputs must be a finite
    bf16 number, or every value a finite fp16 number -- fp8 data qualifies -- else ValueError), or
    "auto" (count when possible and there are at least 65536 values in all, else sort).
    NaN if either input holds a NaN; an infinity paired (in quantile) with the same infinity gives
    NaN (inf - inf), with anything else inf -- as scipy. ``device`` as :func:`compare`'s; the GPU
    always sorts (on the device), whatever ``method``: the same exact value.
    """
    return _w1(a, b, method, device)[0]


def _wasserstein_method(a, b, method: str = "auto") -> str:
    """Which path :func:`wasserstein` takes for these inputs ("sort" or "count"); for tests."""
    return _W1_METHOD_NAMES[_w1(a, b, method)[1]]


def ulp_error(test, ref, fmt, *, device=None):
    """|test - ref| / ulp(ref) element-wise, as a float64 array of the inputs' shape.

    ulp(ref) is the spacing of format ``fmt`` (a :class:`~fadev.Format` or a name) at ref:
    2^(max(e, emin) - p + 1) with 2^e <= |ref| < 2^(e+1) (ref = 0 counts as below 2^emin, so its ulp
    is the subnormal spacing, or 2^emin in a format without subnormals; the binade rule also extends
    past the format's largest value) -- the same as :func:`fadev.ulp`. Dividing by a power of two is
    exact, so the only rounding is fp64's test - ref.
    NaN where test or ref is NaN or ref is infinite (the ulp of an infinity is undefined); inf where
    test is infinite and ref finite. ``device`` as :func:`compare`'s (the result in the inputs' kind).
    """
    fmt = as_format(fmt)
    gpu = _cuda.route(device, test=test, ref=ref)
    t, r = _pair(test, ref, gpu)
    return (gpu or _core).ulp_error(t, r, fmt._c)


@dataclasses.dataclass(frozen=True, eq=False)
class UlpHistogram:
    """ULP errors of ``test`` against ``ref`` in format ``fmt``, bucketed (see :func:`ulp_histogram`).

    ``counts[k]`` (int64, length ``max_ulp + 1``): elements with error in [k, k+1) for k < max_ulp,
    ``counts[max_ulp]``: error >= max_ulp (infinite errors included). ``n_nan``: elements whose error
    is NaN (not in ``counts``). ``n = counts.sum() + n_nan``.
    """

    counts: np.ndarray
    n_nan: int
    n: int
    max_ulp: int
    fmt: str

    def as_dict(self) -> dict:
        return {"counts": self.counts.tolist(), "n_nan": self.n_nan, "n": self.n, "max_ulp": self.max_ulp,
                "fmt": self.fmt}


def _bucket(err: np.ndarray, max_ulp: int):
    """(counts, n_nan) of ULP errors, bucketed as csrc/metrics.c's fadev_ulp_histogram does."""
    err = err.reshape(-1)
    nan = np.isnan(err)
    err = err[~nan]
    bucket = np.where(err >= max_ulp, max_ulp, np.trunc(np.minimum(err, max_ulp))).astype(np.int64)
    return np.bincount(bucket, minlength=max_ulp + 1), int(nan.sum())


def ulp_histogram(test, ref, fmt, *, max_ulp: int = 16, device=None) -> UlpHistogram:
    """Histogram of :func:`ulp_error` by integer ULP bucket: 0, 1, ..., max_ulp - 1, and >= max_ulp.

    Bucket k holds errors in [k, k+1) (so a correctly rounded result lands in bucket 0). Errors that
    are NaN (a NaN in test or ref, or an infinite ref) are counted in ``n_nan``, not in a bucket;
    infinite errors land in the last bucket. ``max_ulp``: integer in 1..2^20. ``device`` as
    :func:`compare`'s: on the GPU the errors are computed there (the same exact values) and counted on
    the host, so the counts are the CPU's.
    """
    fmt = as_format(fmt)
    if isinstance(max_ulp, bool) or not isinstance(max_ulp, (int, np.integer)):
        raise TypeError(f"max_ulp must be an integer, got {max_ulp!r}")
    if not 1 <= max_ulp <= MAX_ULP_LIMIT:
        raise ValueError(f"max_ulp must be in 1..{MAX_ULP_LIMIT}, got {max_ulp}")
    gpu = _cuda.route(device, test=test, ref=ref)
    t, r = _pair(test, ref, gpu)
    if gpu is None:
        counts, n_nan = _core.ulp_histogram(t, r, fmt._c, int(max_ulp))
    else:
        counts, n_nan = _bucket(gpu.ulp_error(t, r, fmt._c, host=True), int(max_ulp))
    return UlpHistogram(counts.astype(np.int64), int(n_nan), int(t.size), int(max_ulp), fmt.name)


__all__ = ["Comparison", "compare", "max_abs", "mean_diff", "std_diff", "mean_abs", "rmse", "rel_l2", "max_rel",
           "wasserstein", "ulp_error", "ulp_histogram", "UlpHistogram"]
