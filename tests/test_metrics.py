"""Deviation metrics (fadev/metrics.py, csrc/metrics.c, csrc/sort.c) against a plain-Python twin.

The twin below is the spec: exact rational sums (fractions.Fraction) or math.fsum for the finite case,
NumPy's IEEE arithmetic for NaN/inf, scipy.stats.wasserstein_distance for W1. Tolerances are error
bounds of the algorithms (u = 2^-53), not loose constants.
"""
import math
import struct
from fractions import Fraction

import ml_dtypes
import numpy as np
import pytest
import scipy.stats

import fadev
from fadev import _core

U = 2.0**-53  # unit roundoff of fp64
METRICS = ("max_abs", "mean_diff", "std_diff", "mean_abs", "rmse", "rel_l2", "max_rel")


# ------------------------------------------------------------------ the twin


def twin_finite(t, r):
    """Metrics of finite inputs, from exact rational sums rounded once (plus sqrt's rounding)."""
    d = (t - r).ravel()  # fp64 difference, as the C code forms it
    rr = r.ravel()
    n = d.size
    fd = [Fraction(float(x)) for x in d]
    mean = sum(fd) / n
    m2 = sum((x - mean) ** 2 for x in fd)
    ss = sum(x * x for x in fd)
    rs = sum(Fraction(float(x)) ** 2 for x in rr)
    nz = rr != 0
    return {
        "max_abs": float(np.max(np.abs(d))),
        "mean_diff": float(mean),
        "std_diff": math.sqrt(float(m2 / n)),
        "mean_abs": float(sum(abs(x) for x in fd) / n),
        "rmse": math.sqrt(float(ss / n)),
        "rel_l2": 0.0 if ss == 0 else math.inf if rs == 0 else math.sqrt(float(ss / rs)),
        "max_rel": float(np.max(np.abs(d[nz]) / np.abs(rr[nz]))) if nz.any() else math.nan,
    }


def norm2(x):
    """||x||_2 without overflow of the squares (an infinity in x gives inf)."""
    m = np.max(np.abs(x))
    return m if m == 0 or not np.isfinite(m) else m * np.sqrt(np.sum((x / m) ** 2))


def twin_ieee(t, r):
    """The documented NaN/inf rules: NumPy's IEEE arithmetic on the formulas."""
    with np.errstate(all="ignore"):
        d = (t - r).ravel()
        rr = r.ravel()
        if np.isnan(d).any():
            return dict.fromkeys(METRICS, math.nan)
        nz = rr != 0
        norm_d, norm_r = norm2(d), norm2(rr)
        return {
            "max_abs": float(np.max(np.abs(d))),
            "mean_diff": float(np.mean(d)),
            "std_diff": float(np.std(d)),
            "mean_abs": float(np.mean(np.abs(d))),
            "rmse": float(np.sqrt(np.mean(d * d))),
            "rel_l2": 0.0 if norm_d == 0 else float(norm_d / norm_r),
            "max_rel": float(np.max(np.abs(d[nz]) / np.abs(rr[nz]))) if nz.any() else math.nan,
        }


def w1_exact(a, b):
    """W1 of the empirical distributions exactly (rounded once at the end): integral of |F_a - F_b| as
    integers over the common denominator n_a n_b 2^shift."""
    a, b = np.sort(np.ravel(a)), np.sort(np.ravel(b))
    vals = np.unique(np.concatenate([a, b]))
    ca = np.searchsorted(a, vals, "right").tolist()
    cb = np.searchsorted(b, vals, "right").tolist()
    ratios = [float(v).as_integer_ratio() for v in vals]
    shift = max(den.bit_length() - 1 for _, den in ratios)
    ints = [num << (shift - (den.bit_length() - 1)) for num, den in ratios]
    na, nb = a.size, b.size
    total = sum(abs(x * nb - y * na) * (v1 - v0) for x, y, v0, v1 in zip(ca, cb, ints, ints[1:]))
    return float(Fraction(total, (na * nb) << shift))


def assert_w1(got, a, b):
    """got is within 4u of the exact W1, and agrees with scipy to 1e-12 relative -- or to scipy's own
    error where that is larger (scipy's CDF products lose ~1e-12 on heavy-tailed data)."""
    exact = w1_exact(a, b)
    want = scipy.stats.wasserstein_distance(a, b)
    assert abs(got - exact) <= 4 * U * exact, (got, exact)
    assert abs(got - want) <= 1e-12 * want + abs(want - exact), (got, want, exact)


def bits(x):
    return struct.pack("<d", float(x))


def assert_close_metrics(got, want, rel, context=""):
    for k in METRICS:
        g, w = got[k], want[k]
        assert abs(g - w) <= rel * abs(w), f"{k}: got {g!r}, want {w!r} ({context})"


# ------------------------------------------------------------------ accuracy, finite inputs


@pytest.mark.parametrize("case", ["normal", "offset", "ill_conditioned", "mixed_scale", "ref_zeros"])
def test_metrics_match_exact_sums(rng, case):
    n = 20000  # two chunks of 16384: the chunk combination is exercised
    r = rng.standard_normal(n)
    if case == "normal":
        t = r + rng.standard_normal(n) * 1e-3
    elif case == "offset":
        t = r + 0.5 + rng.standard_normal(n) * 1e-2
    elif case == "ill_conditioned":  # std / |mean| = 1e-9: E[d^2] - E[d]^2 would lose everything
        t = r + 1.0 + rng.standard_normal(n) * 1e-9
    elif case == "mixed_scale":
        t = r * 10.0 ** rng.uniform(-8, 8, n) + rng.standard_normal(n)
    else:
        r = np.where(rng.random(n) < 0.3, 0.0, r)
        t = r + rng.standard_normal(n)
    got = fadev.compare(t, r).as_dict()
    # compensated sums: each result within a few u of the exactly rounded value
    assert_close_metrics(got, twin_finite(t, r), 6 * U, case)
    assert got["max_abs"] == twin_finite(t, r)["max_abs"]


def test_std_is_accurate_where_the_one_pass_formula_fails(rng):
    d = 1e4 + rng.standard_normal(5000) * 1e-6
    r = rng.standard_normal(5000)
    t = r + d
    want = twin_finite(t, r)["std_diff"]
    dd = t - r
    one_pass = math.sqrt(max(np.mean(dd * dd) - np.mean(dd) ** 2, 0.0))
    assert abs(one_pass - want) > 1e-3 * want  # the naive formula is badly wrong here ...
    assert abs(fadev.std_diff(t, r) - want) <= 6 * U * want  # ... fadev is not


def neumaier_bound(x):
    """Error bound of a compensated sum of x (Higham, Accuracy and Stability, 4.3): 2u|S| + 4nu^2 sum|x|,
    plus one rounding for the division by n and one for the reference fsum(x)/n."""
    s = math.fsum(x)
    return 2 * U * abs(s) + 4 * len(x) * U * U * math.fsum(np.abs(x)) + 2 * U * abs(s)


@pytest.mark.parametrize("reps", [1, 1000, 70000])
def test_mean_survives_huge_cancellation(reps):
    x = np.tile([1e16, 1.0, -1e16], reps)
    n = x.size
    exact = math.fsum(x) / n  # = 1/3
    if reps > 1:
        assert abs(np.sum(x) / n - exact) > 0.1 * exact  # plain summation loses it
    for t, r, sign in ((x, np.zeros(n), 1), (np.zeros(n), x, -1)):
        assert abs(fadev.mean_diff(t, r) - sign * exact) <= neumaier_bound(x) / n
        ab = np.abs(x)
        assert abs(fadev.mean_abs(t, r) - math.fsum(ab) / n) <= neumaier_bound(ab) / n
        sq = x * x
        assert abs(fadev.rmse(t, r) - math.sqrt(math.fsum(sq) / n)) <= 4 * U * math.sqrt(math.fsum(sq) / n)


def test_mean_of_random_cancelling_terms(rng):
    big = 10.0 ** rng.uniform(0, 20, 30000) * rng.choice([-1.0, 1.0], 30000)
    x = np.concatenate([big, -big, rng.standard_normal(3000)])
    x = x[rng.permutation(x.size)]
    exact = math.fsum(x) / x.size
    naive_error = abs(np.sum(x) / x.size - exact)
    err = abs(fadev.mean_diff(x, np.zeros_like(x)) - exact)
    assert err <= neumaier_bound(x) / x.size
    assert err < naive_error


def test_large_array_against_fsum_and_thread_count(rng):
    n = 1_500_000
    r = rng.standard_normal(n)
    t = r + 1e-3 * rng.standard_normal(n) + 1e-4
    d = t - r
    mean = math.fsum(d) / n
    fadev.set_num_threads(1)
    one = fadev.compare(t, r)
    assert abs(one.mean_diff - mean) <= neumaier_bound(d) / n
    assert abs(one.mean_abs - math.fsum(np.abs(d)) / n) <= 6 * U * one.mean_abs
    assert abs(one.rmse - math.sqrt(math.fsum(d * d) / n)) <= 6 * U * one.rmse
    assert abs(one.std_diff - math.sqrt(math.fsum((d - mean) ** 2) / n)) <= 1e-12 * one.std_diff
    for threads in (2, 3):
        fadev.set_num_threads(threads)
        other = fadev.compare(t, r)
        for k, v in one.as_dict().items():
            assert bits(other.as_dict()[k]) == bits(v), (k, threads)


@pytest.mark.parametrize("scale", [1e200, 1e-200, 1e300, 2.0**-1070])
def test_extreme_magnitudes_are_rescaled(rng, scale):
    r = rng.standard_normal(3000) * scale
    t = r + rng.standard_normal(3000) * scale * 0.5
    if scale < 1e-300:  # fp64 subnormals: keep values representable
        t, r = np.round(t / scale) * scale, np.round(r / scale) * scale
    got = fadev.compare(t, r).as_dict()
    k = -math.frexp(max(np.max(np.abs(t - r)), np.max(np.abs(r))))[1]
    want = twin_finite(np.ldexp(t, k), np.ldexp(r, k))  # the same numbers scaled exactly by 2^k
    for m in METRICS:
        w = want[m] if m in ("rel_l2", "max_rel") else math.ldexp(want[m], -k)
        assert abs(got[m] - w) <= 6 * U * abs(w), (m, got[m], w)


# ------------------------------------------------------------------ NaN and inf

INF, NAN = math.inf, math.nan
NONFINITE_CASES = {
    "nan_in_test": ([1.0, NAN, 3.0], [1.0, 2.0, 2.0]),
    "nan_in_ref": ([1.0, 2.0, 3.0], [NAN, 2.0, 2.0]),
    "nan_where_ref_is_zero": ([NAN, 2.0], [0.0, 1.0]),
    "same_infinity": ([INF, 1.0], [INF, 1.5]),
    "inf_in_test": ([INF, 1.0, 2.0], [1.0, 1.0, 2.5]),
    "neg_inf_in_test": ([-INF, 1.0], [1.0, 2.0]),
    "inf_in_ref": ([1.0, 1.0], [INF, 2.0]),
    "opposite_infinities": ([INF, -INF, 0.0], [0.0, 0.0, 0.0]),
    "inf_diffs_of_both_signs": ([INF, -INF, 1.0], [1.0, 1.0, 2.0]),
    "inf_where_ref_is_zero": ([INF, 1.1], [0.0, 1.0]),
    "difference_overflows": ([1.7e308, 1.0], [-1.7e308, 1.0]),
    "ref_all_zero": ([1.0, -2.0], [0.0, 0.0]),
    "identical_zeros": ([0.0, 0.0], [0.0, -0.0]),
}


@pytest.mark.parametrize("name", sorted(NONFINITE_CASES))
def test_nonfinite_rules(name):
    t, r = (np.array(v) for v in NONFINITE_CASES[name])
    big_t = np.concatenate([np.linspace(0, 1, 40000), t])  # also the chunked path (careful chunk last)
    big_r = np.concatenate([np.linspace(0, 1, 40000), r])
    for tt, rr in ((t, r), (big_t, big_r)):
        got = fadev.compare(tt, rr)
        want = twin_ieee(tt, rr)
        for k in METRICS:
            g, w = getattr(got, k), want[k]
            if math.isfinite(w) and w != 0:
                assert abs(g - w) <= 1e-15 * abs(w), (k, g, w)  # only finite, unaffected by the inf
            else:
                assert bits(g) == bits(w) or (math.isnan(g) and math.isnan(w)), (k, g, w)
        assert got.n == tt.size
        assert got.n_nan == int(np.sum(np.isnan(tt) | np.isnan(rr)))
        assert got.n_inf == int(np.sum(~np.isnan(tt) & ~np.isnan(rr) & (np.isinf(tt) | np.isinf(rr))))
        with np.errstate(all="ignore"):
            ws = scipy.stats.wasserstein_distance(tt, rr)
        assert got.wasserstein == pytest.approx(ws, rel=1e-12, nan_ok=True)


def test_nonfinite_spot_values():
    c = fadev.compare([1.0, NAN], [1.0, 2.0])
    assert all(math.isnan(getattr(c, k)) for k in METRICS) and c.n_nan == 1 and c.n_inf == 0
    c = fadev.compare([INF, 1.0], [INF, 1.0])
    assert all(math.isnan(getattr(c, k)) for k in METRICS) and c.n_nan == 0 and c.n_inf == 1
    c = fadev.compare([INF, 1.0, 2.0], [1.0, 1.0, 2.5])
    assert (c.max_abs, c.mean_abs, c.rmse, c.mean_diff, c.rel_l2, c.max_rel) == (INF,) * 6
    assert math.isnan(c.std_diff)
    assert fadev.max_rel([INF, 1.1], [0.0, 1.0]) == pytest.approx(0.1, rel=1e-15)
    assert math.isnan(fadev.max_rel([1.0, 2.0], [0.0, 0.0]))
    assert fadev.rel_l2([1.0, 2.0], [0.0, 0.0]) == INF
    assert fadev.rel_l2([0.0, 0.0], [0.0, 0.0]) == 0.0


# ------------------------------------------------------------------ Wasserstein


def w1_inputs(kind, rng):
    if kind == "normal":
        return rng.standard_normal(150000), rng.standard_normal(150000) * 1.1 + 0.05
    if kind == "normal_unequal":
        return rng.standard_normal(150001), rng.standard_normal(70003) + 0.2
    if kind == "heavy_tailed":
        return rng.standard_cauchy(120000), rng.standard_t(1.5, 90000)
    if kind == "duplicate_heavy":
        return rng.integers(0, 5, 100000).astype(float), rng.integers(1, 4, 77777).astype(float)
    if kind == "constant_equal":
        return np.full(5000, 2.5), np.full(3000, 2.5)
    if kind == "constant_different":
        return np.full(5000, 2.5), np.full(3000, -1.25)
    if kind == "one_vs_many":
        return np.array([0.3]), rng.standard_normal(50000)
    if kind == "tiny":
        return np.array([1.0, 3.0]), np.array([2.0])
    if kind == "mixed_sign_zeros":
        return np.array([-0.0, 0.0, 1.0] * 20), np.array([0.0, -0.0] * 7)
    raise AssertionError(kind)


W1_KINDS = ["normal", "normal_unequal", "heavy_tailed", "duplicate_heavy", "constant_equal", "constant_different",
            "one_vs_many", "tiny", "mixed_sign_zeros"]


@pytest.mark.parametrize("kind", W1_KINDS)
def test_wasserstein_sort_path_matches_scipy(rng, kind):
    a, b = w1_inputs(kind, rng)
    got = fadev.wasserstein(a, b, method="sort")
    assert_w1(got, a, b)
    assert abs(fadev.wasserstein(b, a, method="sort") - got) <= 4 * U * got


@pytest.mark.parametrize("fmt", ["bf16", "fp16", "fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("kind", ["normal", "normal_unequal", "heavy_tailed", "duplicate_heavy",
                                  "constant_different", "one_vs_many", "mixed_sign_zeros"])
def test_wasserstein_count_path_matches_scipy_and_sort(rng, kind, fmt):
    a, b = (fadev.round(x, fmt) for x in w1_inputs(kind, rng))
    a, b = np.nan_to_num(a, nan=0.0, posinf=0.0, neginf=0.0), np.nan_to_num(b, nan=0.0, posinf=0.0, neginf=0.0)
    counted = fadev.wasserstein(a, b, method="count")
    assert_w1(counted, a, b)
    assert abs(fadev.wasserstein(a, b, method="sort") - counted) <= 8 * U * counted
    if a.size + b.size >= 65536:
        assert fadev.metrics._wasserstein_method(a, b) == "count"


def test_wasserstein_auto_picks_sort_for_general_data(rng):
    a, b = rng.standard_normal(40000), rng.standard_normal(40000)
    assert fadev.metrics._wasserstein_method(a, b) == "sort"
    bf, fp = fadev.round(a, "bf16"), fadev.round(b, "fp16")
    bf[0], fp[0] = 2.0**20, 1 + 2.0**-10  # beyond fp16's range; finer than bf16's precision
    assert fadev.metrics._wasserstein_method(bf, fp) == "sort"  # neither format holds both
    fp = fadev.round(a, "fp16")
    assert fadev.metrics._wasserstein_method(fp, fadev.round(b, "fp8_e4m3")) == "count"  # fp16 fits both
    assert fadev.metrics._wasserstein_method(fp[:100], fp[:200]) == "sort"  # too few for 2^16 bins
    with pytest.raises(ValueError, match="method='count' needs"):
        fadev.wasserstein(a, b, method="count")
    with pytest.raises(ValueError, match="method='count' needs"):
        fadev.wasserstein(np.array([np.inf, 1.0]), np.array([1.0]), method="count")


@pytest.mark.parametrize("a,b", [
    ([0.0, INF], [0.0, 1.0]), ([0.0, INF], [1.0, INF]), ([INF], [1.0]), ([INF], [-INF]), ([INF, INF], [INF, 5.0]),
    ([-INF, 0.0], [0.0, 0.0]), ([1.0, INF], [INF, INF]), ([1.0, NAN], [1.0, 2.0]), ([1.0, 2.0], [-NAN, 2.0]),
])
def test_wasserstein_nonfinite_as_scipy(a, b):
    with np.errstate(all="ignore"):
        want = scipy.stats.wasserstein_distance(a, b)
    got = fadev.wasserstein(a, b)
    assert bits(got) == bits(want) or (math.isnan(got) and math.isnan(want)), (got, want)


def test_wasserstein_thread_count_does_not_change_bits(rng):
    a, b = rng.standard_cauchy(300001), rng.standard_normal(200000)
    fa, fb = fadev.round(a, "fp16"), fadev.round(b, "fp16")
    fa, fb = np.nan_to_num(fa, posinf=0, neginf=0), np.nan_to_num(fb, posinf=0, neginf=0)

    def all_three():
        return fadev.wasserstein(a, b), fadev.wasserstein(fa, fb, method="count"), fadev.wasserstein(fa, fb, method="sort")

    fadev.set_num_threads(1)
    want = all_three()
    for threads in (2, 3):
        fadev.set_num_threads(threads)
        got = all_three()
        assert [bits(x) for x in got] == [bits(x) for x in want]


def total_order_sort(x):
    """x sorted in IEEE total order (-NaN < -inf < ... < -0 < +0 < ... < +inf < +NaN), through order keys."""
    keys = x.view(np.uint64)
    keys = np.sort(np.where(keys >> 63 == 1, ~keys, keys | np.uint64(1 << 63)))
    return np.where(keys >> 63 == 1, keys ^ np.uint64(1 << 63), ~keys).view(np.float64)


@pytest.mark.parametrize("kind", ["normal", "ints", "specials", "zeros", "small"])
def test_wasserstein_walk_does_not_depend_on_the_sort_order_of_ties(rng, kind):
    """The C walk takes NumPy's sort (NaNs last, -0 and +0 in any order); it gives the bits it gives on the
    IEEE total order (where -NaN comes first and -0 before +0), for equal and unequal sizes."""
    specials = [-INF, INF, NAN, -NAN, 0.0, -0.0, 5e-324, -5e-324, 1.0, -1.0]
    for n_a, n_b in [(2000, 2000), (2000, 1500), (31, 7)]:
        def gen(n):
            if kind == "normal":
                return rng.standard_normal(n) * 10.0 ** rng.uniform(-300, 300, n)
            if kind == "ints":
                return rng.integers(-20, 20, n).astype(float)
            if kind == "specials":
                return rng.choice(specials, n)
            if kind == "zeros":
                return rng.choice([0.0, -0.0, 1.0], n)
            return rng.standard_normal(n)
        a, b = gen(n_a), gen(n_b)
        got = _core.wasserstein(np.sort(a), np.sort(b), 1)
        want = _core.wasserstein(total_order_sort(a), total_order_sort(b), 1)
        assert got[1] == want[1] == 1
        assert bits(got[0]) == bits(want[0]) or (np.isnan(got[0]) and np.isnan(want[0]))
        assert bits(got[0]) == bits(fadev.wasserstein(a, b, method="sort")) or np.isnan(got[0])


# ------------------------------------------------------------------ ULP error


def ulp_formats():
    return ["bf16", "fp16", "fp8_e4m3", "fp8_e5m2", "fp32", "tf32",
            fadev.custom_format(5, -6, 7, subnormals=False, name="nosub")]


@pytest.mark.parametrize("fmt", ulp_formats(), ids=str)
def test_ulp_error_is_difference_over_fadev_ulp(rng, fmt):
    fmt = fadev.as_format(fmt)
    ref = rng.standard_normal(5000) * 2.0 ** rng.integers(fmt.emin - fmt.precision - 3, fmt.emax + 3, 5000)
    ref[:3] = [0.0, -0.0, fmt.smallest_normal]
    test = ref + rng.standard_normal(5000) * fadev.ulp(ref, fmt) * 4
    got = fadev.ulp_error(test, ref, fmt)
    with np.errstate(over="ignore"):
        want = np.abs(test - ref) / fadev.ulp(ref, fmt)
    assert np.array_equal(got, want)
    rounded = fadev.round(ref, fmt)
    finite = np.isfinite(rounded)
    err = fadev.ulp_error(rounded[finite], ref[finite], fmt)
    in_range = np.abs(ref[finite]) <= fmt.largest
    if fmt.subnormals:  # correct rounding: at most half a unit in the last place, where the format reaches
        assert np.all(err[in_range] <= 0.5)
    chopped = fadev.round(ref, fmt, mode="rtz")
    assert np.all(fadev.ulp_error(chopped, ref, fmt)[np.abs(ref) <= fmt.largest] < 1)


def test_ulp_error_nonfinite_and_shape():
    t = np.array([[1.0, NAN, 1.0], [INF, 2.0, INF]])
    r = np.array([[NAN, 1.0, INF], [1.0, -INF, INF]])
    got = fadev.ulp_error(t, r, "fp16")
    assert got.shape == (2, 3)
    assert np.isnan(got[0]).all() and np.isnan(got[1, 1:]).all() and got[1, 0] == INF


@pytest.mark.parametrize("max_ulp", [1, 3, 16, 1000])
def test_ulp_histogram_buckets_floor_of_error(rng, max_ulp):
    ref = rng.standard_normal(100000)
    test = ref + rng.standard_normal(100000) * fadev.ulp(ref, "bf16") * rng.uniform(0, 20, 100000)
    test[:5] = [NAN, INF, 1.0, -INF, 2.0]
    ref[2:5] = [INF, 3.0, NAN]
    err = fadev.ulp_error(test, ref, "bf16")
    h = fadev.ulp_histogram(test, ref, "bf16", max_ulp=max_ulp)
    finite_or_inf = err[~np.isnan(err)]
    want = np.bincount(np.minimum(np.floor(np.minimum(finite_or_inf, 1e9)), max_ulp).astype(np.int64),
                       minlength=max_ulp + 1)
    assert h.counts.dtype == np.int64 and np.array_equal(h.counts, want)
    assert h.n_nan == 3 and h.n == 100000 and h.counts.sum() + h.n_nan == h.n
    assert h.max_ulp == max_ulp and h.fmt == "bf16" and h.as_dict()["counts"] == want.tolist()


def test_ulp_kernels_thread_count_does_not_change_bits(rng):
    ref = rng.standard_normal(300000)
    test = fadev.round(ref, "fp16") + rng.standard_normal(300000) * 1e-4
    fadev.set_num_threads(1)
    e1, h1 = fadev.ulp_error(test, ref, "fp16"), fadev.ulp_histogram(test, ref, "fp16", max_ulp=64)
    fadev.set_num_threads(2)
    e2, h2 = fadev.ulp_error(test, ref, "fp16"), fadev.ulp_histogram(test, ref, "fp16", max_ulp=64)
    assert np.array_equal(e1.view(np.uint64), e2.view(np.uint64)) and np.array_equal(h1.counts, h2.counts)


# ------------------------------------------------------------------ inputs and errors


def test_inputs_are_converted_not_rejected(rng):
    r = rng.standard_normal((40, 50))
    t = r + rng.standard_normal((40, 50)) * 1e-3
    base = fadev.compare(t, r).as_dict()
    variants = [
        (np.asfortranarray(t), r),
        (t.astype(">f8"), r.astype(">f8")),
        (np.repeat(t, 2, axis=1)[:, ::2], r),  # non-contiguous view
        (t.tolist(), r),
    ]
    for tt, rr in variants:
        assert fadev.compare(tt, rr).as_dict() == base
    t32, r32 = t.astype(np.float32), r.astype(np.float32)
    assert fadev.compare(t32, r32).as_dict() == fadev.compare(t32.astype(float), r32.astype(float)).as_dict()
    ti, ri = rng.integers(-50, 50, 1000), rng.integers(-50, 50, 1000)
    assert fadev.compare(ti, ri).as_dict() == fadev.compare(ti.astype(float), ri.astype(float)).as_dict()
    assert fadev.max_abs(np.array([True, False]), np.array([0, 0])) == 1.0
    tb = t.astype(ml_dtypes.bfloat16)
    assert fadev.rmse(tb, r) == fadev.rmse(tb.astype(np.float64), r)
    assert fadev.wasserstein(tb, r) == fadev.wasserstein(tb.astype(float), r)
    assert fadev.wasserstein(t, r) == fadev.wasserstein(t.ravel(), r.T)  # distributions: shape is irrelevant


def test_comparison_object():
    c = fadev.compare([1.0, 2.0, 4.0], [1.0, 1.0, 1.0])
    d = c.as_dict()
    assert list(d) == ["n", "n_nan", "n_inf", *METRICS, "wasserstein"]
    assert (c.n, c.max_abs, c.mean_diff, c.mean_abs, c.max_rel) == (3, 3.0, 4 / 3, 4 / 3, 3.0)
    assert c.rmse == pytest.approx(math.sqrt(10 / 3), rel=2 * U) and c.wasserstein == pytest.approx(4 / 3, rel=2 * U)
    with pytest.raises(Exception):
        c.max_abs = 0.0  # frozen
    for k in METRICS + ("wasserstein",):
        assert getattr(fadev, k)([1.0, 2.0, 4.0], [1.0, 1.0, 1.0]) == d[k]


PAIR_FUNCS = [fadev.compare, fadev.max_abs, fadev.mean_diff, fadev.std_diff, fadev.mean_abs, fadev.rmse,
              fadev.rel_l2, fadev.max_rel, lambda t, r: fadev.ulp_error(t, r, "bf16"),
              lambda t, r: fadev.ulp_histogram(t, r, "bf16")]


@pytest.mark.parametrize("func", PAIR_FUNCS)
def test_pair_errors(func):
    with pytest.raises(ValueError, match=r"test and ref must have the same shape, got test.shape=\(3,\) and "
                                         r"ref.shape=\(2, 2\)"):
        func(np.zeros(3), np.zeros((2, 2)))
    with pytest.raises(ValueError, match=r"test: empty array"):
        func(np.zeros(0), np.zeros(0))
    with pytest.raises(ValueError, match=r"ref: empty array"):
        func(np.zeros(1), np.zeros((1, 0)))
    with pytest.raises(TypeError, match=r"test: expected a real numeric array, got dtype <U1"):
        func(np.array(["a"]), np.zeros(1))
    with pytest.raises(TypeError, match=r"ref: expected a real numeric array, got dtype complex128"):
        func(np.zeros(1), np.zeros(1, complex))
    with pytest.raises(TypeError, match=r"ref: expected a real numeric array, got dtype object"):
        func(np.zeros(1), np.array([None]))


def test_wasserstein_errors():
    assert fadev.wasserstein(np.zeros(3), np.zeros((2, 2))) == 0.0  # sizes may differ
    with pytest.raises(ValueError, match=r"a: empty array"):
        fadev.wasserstein([], [1.0])
    with pytest.raises(ValueError, match=r"b: empty array"):
        fadev.wasserstein([1.0], np.zeros((0, 3)))
    with pytest.raises(TypeError, match=r"a: expected a real numeric array"):
        fadev.wasserstein(np.array([1j]), [1.0])
    with pytest.raises(TypeError, match=r"b: expected a real numeric array"):
        fadev.wasserstein([1.0], ["x"])
    with pytest.raises(ValueError, match="method must be one of auto, sort, count, got 'fast'"):
        fadev.wasserstein([1.0], [2.0], method="fast")


def test_ulp_argument_errors():
    with pytest.raises(ValueError, match=r"max_ulp must be in 1..1048576, got 0"):
        fadev.ulp_histogram([1.0], [1.0], "bf16", max_ulp=0)
    with pytest.raises(ValueError, match=r"max_ulp must be in 1..1048576, got 1048577"):
        fadev.ulp_histogram([1.0], [1.0], "bf16", max_ulp=2**20 + 1)
    for bad in (1.5, True, "3"):
        with pytest.raises(TypeError, match=r"max_ulp must be an integer"):
            fadev.ulp_histogram([1.0], [1.0], "bf16", max_ulp=bad)
    with pytest.raises(ValueError, match=r"unknown format 'bf17'"):
        fadev.ulp_error([1.0], [1.0], "bf17")
    with pytest.raises(TypeError, match=r"expected a fadev.Format or a format name"):
        fadev.ulp_histogram([1.0], [1.0], 16)


def test_binding_guards():
    """The C binding's own checks (the Python layer normally catches these first)."""
    with pytest.raises(ValueError, match=r"test and ref must have the same size, got 3 and 2"):
        _core.deviation(np.zeros(3), np.zeros(2))
    with pytest.raises(ValueError, match=r"test: empty array"):
        _core.deviation(np.zeros(0), np.zeros(0))
    with pytest.raises(TypeError, match=r"test: expected a real numeric array"):
        _core.deviation(["x"], np.zeros(1))
    with pytest.raises(ValueError, match=r"wasserstein: invalid argument"):
        _core.wasserstein(np.zeros(2), np.zeros(2), 7)
    assert _core.wasserstein(np.array([2.0, 1.0]), np.zeros(3), 0) == (None, 1)  # auto: sort them, call again
    assert _core.wasserstein(np.array([1.0, 2.0]), np.zeros(3), 1) == (1.5, 1)
    fmt = fadev.formats["bf16"]._c
    with pytest.raises(ValueError, match=r"max_ulp must be in 1..2\^20, got 0"):
        _core.ulp_histogram(np.zeros(2), np.zeros(2), fmt, 0)
    with pytest.raises(ValueError, match=r"test and ref must have the same size"):
        _core.ulp_error(np.zeros(2), np.zeros(3), fmt)


@pytest.mark.parametrize("max_ulp", [1, 3, 16])
def test_ulp_histogram_bucketing_of_gpu_errors_matches_c(max_ulp, rng):
    """On the GPU the errors come from cuda_ulp_error and are bucketed on the host (metrics._bucket): that
    bucketing, fed the CPU's (identical) errors, gives csrc/metrics.c's counts, NaN, inf and huge errors too."""
    ref = rng.standard_normal(5000)
    test = fadev.round(ref * (1 + 1e-2 * rng.standard_normal(5000)), "bf16")
    test[:4], ref[4:6] = [np.nan, np.inf, -np.inf, 1e30], [np.inf, 0.0]
    want = fadev.ulp_histogram(test, ref, "bf16", max_ulp=max_ulp)
    counts, n_nan = fadev.metrics._bucket(fadev.ulp_error(test, ref, "bf16"), max_ulp)
    assert np.array_equal(counts, want.counts) and n_nan == want.n_nan and n_nan >= 2
