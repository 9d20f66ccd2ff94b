"""Formats and rounding (fadev.round, to_bits, from_bits, Format) against independent references.

References: numpy float16/float32 and ml_dtypes (bfloat16, float8_*, float6/4) decodings and float32 ->
format conversions (single roundings); for float64 sources, whose ml_dtypes conversion goes through
float32 (double rounding), tests/reference_formats.py (exact Fraction arithmetic and a NumPy integer
twin). Every comparison is bit for bit, NaN positions included.
"""
import math
import sys

import ml_dtypes
import numpy as np
import pytest

import fadev
import helpers
import reference_formats as ref
from fadev import _core

BUILTIN = ["fp64", "fp32", "tf32", "fp16", "bf16", "fp8_e4m3", "fp8_e5m2"]
ML_TYPES = {"bf16": ml_dtypes.bfloat16, "fp8_e4m3": ml_dtypes.float8_e4m3fn, "fp8_e5m2": ml_dtypes.float8_e5m2,
            "fp16": np.float16, "fp32": np.float32}
# ml_dtypes formats that are fadev custom formats: (p, emin, emax, has_inf, overflow)
ML_CUSTOM = {
    "float8_e3m4": fadev.custom_format(5, -2, 3),
    "float8_e4m3": fadev.custom_format(4, -6, 7),
    "float6_e2m3fn": fadev.custom_format(4, 0, 2, has_inf=False, overflow="saturate"),
    "float6_e3m2fn": fadev.custom_format(3, -2, 4, has_inf=False, overflow="saturate"),
    "float4_e2m1fn": fadev.custom_format(2, 0, 2, has_inf=False, overflow="saturate"),
}
SMALL = fadev.custom_format(5, -6, 7)  # the custom format of the issue: p=5, emin=-6, emax=7
CUSTOM = [
    SMALL,
    fadev.custom_format(5, -6, 7, subnormals=False),
    fadev.custom_format(5, -6, 7, has_inf=False, overflow="saturate"),
    fadev.custom_format(5, -6, 7, has_inf=False, overflow="nan", largest=224.0),
    fadev.custom_format(5, -6, 7, subnormals=False, overflow="nan"),
    fadev.custom_format(1, -3, 3),
    fadev.custom_format(26, -300, 300),
    fadev.custom_format(52, -1022, 1023),
]


def bits64(a):
    return np.ascontiguousarray(a, dtype=np.float64).view(np.uint64)


def assert_same(actual, expected, context=""):
    """Bit-identical float64 arrays, except that any NaN matches any NaN."""
    helpers.assert_same_bits(actual, expected, "result", context, nan="any",
                             names=("actual", "expected"))


# ---------------------------------------------------------------- test inputs


def specials(fmt):
    """Boundary values of fmt as float64: zeros, inf, NaN, largest and the tie above it, 2^emin, the
    smallest subnormal and the ties around it, each with its float64 neighbours."""
    big, tiny, norm = fmt.largest, fmt.smallest_subnormal, fmt.smallest_normal
    half_ulp_top = math.ldexp(1.0, fmt.emax - fmt.precision)
    v = [0.0, big, big + half_ulp_top, big + 2 * half_ulp_top, 2 * big, norm, norm - tiny, norm * (1 - 2.0 ** -60),
         tiny, tiny / 2, tiny * 1.5, tiny * 2.5, tiny / 4, 1.0, 1.0 + fmt.epsilon / 2, 1.0 + fmt.epsilon * 1.5,
         1e-300, 5e-324, 1.7976931348623157e308, 3.0, 0.1]
    v = np.array([t for t in v if math.isfinite(t)])
    with np.errstate(over="ignore"):
        v = np.concatenate([v, np.nextafter(v, np.inf), np.nextafter(v, 0)])
    v = np.concatenate([v, -v, [np.inf, -np.inf, np.nan, -np.nan]])
    return v


def random_values(rng, n, fmt, source=np.float64):
    """n values of type `source` aimed at fmt: random bit patterns (every exponent), log-uniform over the
    format's range and a little beyond (subnormals, overflow), exact ties between neighbours, values of
    the format, and specials."""
    k = n // 5
    if source == np.float32:
        patterns = rng.integers(0, 2**32, size=k, dtype=np.uint64).astype(np.uint32).view(np.float32)
        lo_exp, hi_exp = max(fmt.emin - fmt.precision - 3, -149), min(fmt.emax + 2, 127)
    else:
        patterns = rng.integers(0, 2**64, size=k, dtype=np.uint64).view(np.float64)
        lo_exp, hi_exp = max(fmt.emin - fmt.precision - 3, -1074), min(fmt.emax + 2, 1023)
    sign = rng.choice([-1.0, 1.0], size=k)
    spread = sign * np.ldexp(rng.uniform(1, 2, size=k), rng.integers(lo_exp, hi_exp + 1, size=k))
    # values of the format (random significand at each exponent) and the midpoints above them
    e = rng.integers(fmt.emin - fmt.precision + 1, fmt.emax + 1, size=k)
    frac = rng.integers(0, 2 ** min(fmt.precision - 1, 52), size=k, dtype=np.int64).astype(np.float64)
    e = np.maximum(e, fmt.emin)
    values = sign * np.ldexp(1 + np.ldexp(frac, -(fmt.precision - 1)), e)
    values = np.where(rng.random(k) < 0.2, sign * np.ldexp(frac, fmt.emin - fmt.precision + 1), values)
    values = np.where(np.abs(values) > fmt.largest, sign * fmt.largest, values)
    ties = values + sign * np.ldexp(1.0, np.maximum(e, fmt.emin) - fmt.precision)
    with np.errstate(over="ignore", invalid="ignore"):
        out = np.concatenate([patterns.astype(np.float64), spread, values, ties,
                              np.nextafter(ties, rng.choice([-np.inf, np.inf], size=k)), specials(fmt)])
        out = out.astype(source)
    rng.shuffle(out)
    return out


# ---------------------------------------------------------------- format properties

PROPERTIES = {  # p, emin, emax, largest, smallest normal, smallest subnormal, unit roundoff, bits
    "fp64": (53, -1022, 1023, sys.float_info.max, 2.0**-1022, 5e-324, 2.0**-53, 64),
    "fp32": (24, -126, 127, 3.4028234663852886e38, 2.0**-126, 2.0**-149, 2.0**-24, 32),
    "tf32": (11, -126, 127, 3.4011621342146535e38, 2.0**-126, 2.0**-136, 2.0**-11, 19),
    "fp16": (11, -14, 15, 65504.0, 2.0**-14, 2.0**-24, 2.0**-11, 16),
    "bf16": (8, -126, 127, 3.3895313892515355e38, 2.0**-126, 2.0**-133, 2.0**-8, 16),
    "fp8_e4m3": (4, -6, 8, 448.0, 2.0**-6, 2.0**-9, 2.0**-4, 8),
    "fp8_e5m2": (3, -14, 15, 57344.0, 2.0**-14, 2.0**-16, 2.0**-3, 8),
}


@pytest.mark.parametrize("name", BUILTIN)
def test_builtin_properties(name):
    f = fadev.formats[name]
    p, emin, emax, largest, normal, subnormal, u, bits = PROPERTIES[name]
    got = (f.precision, f.emin, f.emax, f.largest, f.smallest_normal, f.smallest_subnormal, f.unit_roundoff, f.bits)
    assert got == (p, emin, emax, largest, normal, subnormal, u, bits)
    assert f.epsilon == 2 * u and f.has_nan_code
    if name in ML_TYPES:  # and as numpy / ml_dtypes see them
        fi = ml_dtypes.finfo(ML_TYPES[name]) if name not in ("fp16", "fp32") else np.finfo(ML_TYPES[name])
        assert (float(fi.max), float(fi.smallest_normal), float(fi.smallest_subnormal), float(fi.eps)) == \
            (f.largest, f.smallest_normal, f.smallest_subnormal, f.epsilon)
        assert np.dtype(ML_TYPES[name]).itemsize * 8 == f.bits


def test_aliases_and_custom_names():
    assert fadev.as_format("bfloat16") is fadev.formats["bf16"]
    assert fadev.as_format("E4M3") is fadev.formats["fp8_e4m3"]
    assert fadev.as_format(SMALL) is SMALL
    assert SMALL.name == "p5_e-6_7" and str(SMALL) == SMALL.name and SMALL.bits == 9 and SMALL.largest == 248.0
    assert ML_CUSTOM["float6_e2m3fn"].bits == 6 and not ML_CUSTOM["float6_e2m3fn"].has_nan_code


# ---------------------------------------------------------------- every bit pattern


def _decode_as(t):
    def decode(patterns):
        with np.errstate(invalid="ignore"):
            return patterns.view(t).astype(np.float64)
    return decode


def _decode_tf32(patterns):
    with np.errstate(invalid="ignore"):
        return (patterns << np.uint32(13)).view(np.float32).astype(np.float64)


def _decode_exact(fmt):
    return lambda patterns: np.array([ref.decode_exact(int(b), fmt) for b in patterns])


def _pattern_cases():
    cases = []
    for name in ("fp8_e4m3", "fp8_e5m2", "fp16", "bf16"):
        width = np.uint8 if fadev.formats[name].bits == 8 else np.uint16
        pats = np.arange(2 ** fadev.formats[name].bits, dtype=np.int64).astype(width)
        cases.append(pytest.param(name, fadev.formats[name], pats, _decode_as(ML_TYPES[name]), id=name))
    for name, fmt in ML_CUSTOM.items():
        pats = np.arange(2**fmt.bits, dtype=np.uint8)
        cases.append(pytest.param(name, fmt, pats, _decode_as(getattr(ml_dtypes, name)), id=name))
    tf = np.arange(2**19, dtype=np.uint32)
    cases.append(pytest.param("tf32", fadev.formats["tf32"], tf, _decode_tf32, id="tf32"))
    for i, fmt in enumerate(CUSTOM[:6]):
        pats = np.arange(2**fmt.bits, dtype=np.uint16)
        cases.append(pytest.param(fmt.name, fmt, pats, _decode_exact(fmt), id=f"custom{i}-{fmt.name}"))
    return cases


@pytest.mark.parametrize("name,fmt,patterns,decode", _pattern_cases())
def test_every_pattern_round_trips(name, fmt, patterns, decode):
    values = fadev.from_bits(patterns, fmt)
    assert_same(values, decode(patterns), f"decoding {name}")
    assert_same(fadev.round(values, fmt), values, f"rounding {name} values")
    nan = np.isnan(values)
    finite_rows = ~nan
    if fmt.has_nan_code:
        back = fadev.to_bits(values, fmt).astype(np.uint64)
        assert (back[finite_rows] == patterns[finite_rows]).all()
        sign = np.uint64(1) << np.uint64(fmt.bits - 1)
        canonical = fadev.to_bits(np.array([np.nan]), fmt).astype(np.uint64)[0]
        assert (back[nan] == canonical | (patterns[nan].astype(np.uint64) & sign)).all()
    else:  # OCP MX "fn" formats (every pattern is a number) and p = 1 (the all-ones code is inf)
        assert (fadev.to_bits(values[~nan], fmt).astype(np.uint64) == patterns[~nan]).all()
        with pytest.raises(ValueError, match="NaN"):
            fadev.to_bits([1.0, np.nan], fmt)


def test_canonical_nan_patterns():
    expect = {"fp16": 0x7E00, "bf16": 0x7FC0, "fp8_e4m3": 0x7F, "fp8_e5m2": 0x7E, "fp32": 0x7FC00000,
              "fp64": 0x7FF8000000000000, "tf32": 0x3FE00}
    for name, code in expect.items():
        got = fadev.to_bits(np.array([np.nan, -np.nan]), name).astype(np.uint64)
        assert got[0] == code and got[1] == code | (1 << (fadev.formats[name].bits - 1)), name
    for name in ("fp16", "bf16", "fp8_e4m3", "fp8_e5m2"):  # as numpy / ml_dtypes write NaN
        assert fadev.to_bits([np.nan], name)[0] == np.array([np.nan]).astype(ML_TYPES[name]).view(
            fadev.to_bits([0.0], name).dtype)[0]


def test_wide_patterns(rng):
    pats32 = rng.integers(0, 2**32, size=10**6, dtype=np.uint64).astype(np.uint32)
    with np.errstate(invalid="ignore"):  # signalling NaN patterns
        vals32 = pats32.view(np.float32).astype(np.float64)
    assert_same(fadev.from_bits(pats32, "fp32"), vals32)
    assert_same(fadev.round(vals32, "fp32"), vals32)
    keep = ~np.isnan(vals32)
    assert (fadev.to_bits(vals32, "fp32")[keep] == pats32[keep]).all()
    pats64 = rng.integers(0, 2**64, size=10**6, dtype=np.uint64)
    vals64 = pats64.view(np.float64)
    assert_same(fadev.from_bits(pats64, "fp64"), vals64)
    assert_same(fadev.round(vals64, "fp64"), vals64)
    keep = ~np.isnan(vals64)
    assert (fadev.to_bits(vals64, "fp64")[keep] == pats64[keep]).all()


# ---------------------------------------------------------------- nearest-even against references


@pytest.mark.parametrize("name", ["bf16", "fp8_e4m3", "fp8_e5m2", "fp16", "fp32"])
def test_float32_sources_match_ml_dtypes(name, rng):
    fmt = fadev.formats[name]
    x = random_values(rng, 10**6, fmt, np.float32)
    with np.errstate(over="ignore", invalid="ignore"):
        expected = x.astype(ML_TYPES[name]).astype(np.float64)
    assert_same(fadev.round(x, fmt), expected, f"float32 -> {name}")
    assert_same(fadev.round(x.astype(np.float64), fmt), expected, f"float32 values as float64 -> {name}")
    assert_same(fadev.to_ml_dtypes(x, fmt).astype(np.float64), expected)


@pytest.mark.parametrize("name", list(ML_CUSTOM))
def test_float32_sources_match_ml_dtypes_custom(name, rng):
    fmt = ML_CUSTOM[name]
    x = random_values(rng, 2 * 10**5, fmt, np.float32)
    if not fmt.has_nan_code:  # ml_dtypes turns NaN into -0 for the MX "fn" formats; fadev keeps NaN
        x = x[~np.isnan(x)]
    with np.errstate(over="ignore", invalid="ignore"):
        expected = x.astype(getattr(ml_dtypes, name)).astype(np.float64)
    assert_same(fadev.round(x, fmt), expected, f"float32 -> {name}")


@pytest.mark.parametrize("name", BUILTIN)
def test_float64_sources_match_reference(name, rng):
    fmt = fadev.formats[name]
    x = random_values(rng, 10**6, fmt)
    got = fadev.round(x, fmt)
    assert_same(got, ref.round_ref(x, fmt), f"float64 -> {name}")
    with np.errstate(over="ignore", invalid="ignore"):
        if name == "fp16":  # numpy's float64 -> float16 rounds once
            assert_same(got, x.astype(np.float16).astype(np.float64))
        if name == "fp32":
            assert_same(got, x.astype(np.float32).astype(np.float64))


def test_ml_dtypes_double_rounding_is_not_ours():
    # 1 + 2^-8 + 2^-30: above the bf16 tie 1 + 2^-8, so it rounds up; float32 first makes it the tie
    x = np.array([1 + 2.0**-8 + 2.0**-30])
    assert fadev.round(x, "bf16")[0] == 1 + 2.0**-7
    assert x.astype(ml_dtypes.bfloat16).astype(np.float64)[0] == 1.0


@pytest.mark.parametrize("fmt", [fadev.formats[n] for n in BUILTIN] + CUSTOM, ids=str)
def test_exact_reference(fmt, rng):
    """fadev and the NumPy twin against exact rational arithmetic, both modes, ties included."""
    x = np.concatenate([random_values(rng, 2500, fmt), specials(fmt)])
    for mode in ("rne", "rtz"):
        exact = np.array([ref.round_exact(float(v), fmt, mode) for v in x])
        assert_same(ref.round_ref(x, fmt, mode), exact, f"reference {mode} {fmt}")
        assert_same(fadev.round(x, fmt, mode), exact, f"{mode} {fmt}")


@pytest.mark.parametrize("fmt", CUSTOM, ids=str)
def test_custom_formats_match_reference(fmt, rng):
    x = random_values(rng, 2 * 10**5, fmt)
    for mode in ("rne", "rtz"):
        assert_same(fadev.round(x, fmt, mode), ref.round_ref(x, fmt, mode), f"{mode} {fmt}")


def test_overflow_rules():
    x = np.array([1000.0, -1000.0, np.inf, -np.inf, 250.0, 256.0])  # SMALL: largest 248, tie 252
    base = dict(precision=5, emin=-6, emax=7)
    inf_f = fadev.custom_format(**base)
    nan_f = fadev.custom_format(**base, has_inf=False, overflow="nan")
    sat_f = fadev.custom_format(**base, has_inf=False, overflow="saturate")
    assert_same(fadev.round(x, inf_f), [np.inf, -np.inf, np.inf, -np.inf, 248, np.inf])
    assert_same(fadev.round(x, nan_f), [np.nan, np.nan, np.nan, np.nan, 248, np.nan])
    assert_same(fadev.round(x, sat_f), [248, -248, 248, -248, 248, 248])
    for f in (inf_f, nan_f, sat_f):  # toward zero: a finite value never overflows
        assert_same(fadev.round(x[[0, 1, 4, 5]], f, "rtz"), [248, -248, 248, 248])
    e4m3 = fadev.formats["fp8_e4m3"]  # 448 is the largest, 464 the tie to 480 (not a value): NaN above
    assert_same(fadev.round([464.0, 464.0001, -464.0001], e4m3), [448, np.nan, np.nan])


def test_no_subnormals():
    f = fadev.custom_format(5, -6, 7, subnormals=False)
    n = 2.0**-6
    x = np.array([n, n / 2, n / 2 * (1 + 2.0**-40), n * 0.3, -n * 0.7, 0.0, -0.0])
    assert_same(fadev.round(x, f), [n, 0.0, n, 0.0, -n, 0.0, -0.0])
    assert f.smallest_subnormal == n
    assert_same(fadev.ulp([0.0, n / 3, n, 1.0], f), [n, n, n / 16, 1 / 16])


def test_signed_zero_and_underflow():
    x = np.array([0.0, -0.0, -1e-300, 1e-300, -2.0**-26])
    assert_same(fadev.round(x, "fp16"), [0.0, -0.0, -0.0, 0.0, -0.0])
    assert np.signbit(fadev.round(x, "fp16")[[1, 2, 4]]).all()
    assert np.signbit(fadev.round(x, "bf16", "rtz")[[1, 2, 4]]).all()


# ---------------------------------------------------------------- toward zero by its definition


@pytest.mark.parametrize("name", ["fp16", "bf16", "fp8_e4m3", "fp8_e5m2", "tf32"])
def test_toward_zero_definition(name, rng):
    fmt = fadev.formats[name]
    x = random_values(rng, 2 * 10**5, fmt)
    x = x[np.isfinite(x)]
    r = fadev.round(x, fmt, "rtz")
    inside = np.abs(x) <= fmt.largest
    xi, ri = x[inside], r[inside]
    assert (np.abs(ri) <= np.abs(xi)).all()
    assert ((np.signbit(ri) == np.signbit(xi)) | (ri == 0) & (xi == 0)).all()
    assert_same(ref.round_ref(ri, fmt), ri, "results representable")
    next_up = np.abs(ri) + fadev.ulp(ri, fmt)
    assert (next_up > np.abs(xi)).all()
    nz = ri[ri != 0]
    assert_same(fadev.ulp(nz, fmt), np.abs(ref.neighbours_ref(nz, fmt)[1]) - np.abs(nz))
    assert_same(r[~inside], np.copysign(fmt.largest, x[~inside]))  # overflow clamps to +-largest
    assert_same(fadev.round([np.inf, -np.inf], fmt, "rtz"), [np.inf, -np.inf] if fmt.has_inf else [np.nan] * 2)


# ---------------------------------------------------------------- stochastic rounding


def test_stochastic_only_neighbours(rng):
    for name in ("bf16", "fp8_e4m3", "fp8_e5m2", "fp16"):
        fmt = fadev.formats[name]
        x = random_values(rng, 2 * 10**5, fmt)
        x = x[np.isfinite(x) & (np.abs(x) <= fmt.largest)]
        r = fadev.round(x, fmt, "stochastic", seed=11)
        lo, hi = ref.neighbours_ref(x, fmt)
        assert ((r == lo) | (r == hi)).all(), name
        exact = lo == x
        assert (r[exact] == x[exact]).all()
        assert (np.signbit(r) == np.signbit(x)).all()


def test_stochastic_matches_spec_bit_for_bit(rng):
    import reference  # the slow twin: Philox4x32-10 and the rounding rule in plain Python
    for name in ("bf16", "fp8_e4m3", "fp16"):
        fmt = fadev.formats[name]
        x = random_values(rng, 2000, fmt)
        x = x[~(np.abs(x) > 1e300)]  # the twin's math.ldexp cannot overflow past DBL_MAX
        got = fadev.round(x, fmt, "stochastic", seed=2**40 + 5, stream=3)
        want = [reference.round_value(float(v), fmt, "sr", reference.random53(2**40 + 5, 3, i)) for i, v in enumerate(x)]
        assert_same(got, want, name)
    # element i of a long array draws counter i, across the 32768-element tasks too
    x = rng.standard_normal(200_001)
    got = fadev.round(x, "bf16", "stochastic", seed=99, stream=7)
    idx = np.concatenate([rng.integers(0, x.size, 300), [32767, 32768, 65536, x.size - 1]])
    want = [reference.round_value(float(x[i]), fadev.formats["bf16"], "sr", reference.random53(99, 7, int(i)))
            for i in idx]
    assert_same(got[idx], want, "indices")


@pytest.mark.parametrize("value,name", [(1 + 0.3 * 2.0**-7, "bf16"), (1 + 0.5 * 2.0**-7, "bf16"),
                                        (1 + 2.0**-20, "bf16"), (-3.3, "fp8_e4m3"), (2.0**-20, "fp8_e4m3"),
                                        (0.7 * 2.0**-24, "fp16"), (65500.0, "fp16")])
def test_stochastic_unbiased(value, name):
    """A constant input: the fraction rounded up matches P(up) = (|x| - lo) / (hi - lo) within 6 sigma,
    and neighbouring indices are independent (P(both up) = P^2 within 6 sigma)."""
    fmt = fadev.formats[name]
    n = 10**6
    lo, hi = (float(v[0]) for v in ref.neighbours_ref(np.array([value]), fmt))
    p = (abs(value) - abs(lo)) / (abs(hi) - abs(lo))
    r = fadev.round(np.full(n, value), fmt, "stochastic", seed=1234)
    assert set(np.unique(r)) <= {lo, hi}
    up = r == hi
    sigma = math.sqrt(n * p * (1 - p)) + 1
    assert abs(up.sum() - n * p) <= 6 * sigma, (up.sum(), n * p)
    both = (up[0::2] & up[1::2]).sum()
    m = n // 2
    assert abs(both - m * p * p) <= 6 * (math.sqrt(m * p * p * (1 - p * p)) + 1)
    assert abs(r.mean() - value) <= 6 * (abs(hi) - abs(lo)) * math.sqrt(p * (1 - p) / n) + 1e-300


def test_stochastic_mean_over_random_inputs(rng):
    x = rng.standard_normal(10**6)
    fmt = fadev.formats["fp8_e4m3"]
    r = fadev.round(x, fmt, "stochastic", seed=9)
    lo, hi = ref.neighbours_ref(x, fmt)
    gap = np.abs(hi - lo)
    p = np.abs(x - lo) / gap
    var = (gap**2 * p * (1 - p)).sum()
    assert abs((r - x).sum()) <= 6 * math.sqrt(var)
    assert abs((fadev.round(x, fmt) - x).sum()) > 0  # nearest is biased here; stochastic is not


def test_stochastic_seed_stream_index(rng):
    x = rng.standard_normal(10**5)
    a = fadev.round(x, "bf16", "stochastic", seed=5)
    assert_same(fadev.round(x, "bf16", "stochastic", seed=5), a)
    assert (fadev.round(x, "bf16", "stochastic", seed=6) != a).mean() > 0.2
    assert (fadev.round(x, "bf16", "stochastic", seed=5, stream=1) != a).mean() > 0.2
    # element i draws from counter i: the same values in another order draw other numbers
    assert (fadev.round(x[::-1], "bf16", "stochastic", seed=5)[::-1] != a).mean() > 0.2
    # a float32 input draws the same numbers as its float64 copy
    x32 = x.astype(np.float32)
    assert_same(fadev.round(x32, "bf16", "stochastic", seed=5), fadev.round(x32.astype(np.float64), "bf16",
                                                                             "stochastic", seed=5))


@pytest.mark.parametrize("mode", ["rne", "rtz", "stochastic"])
def test_thread_count_does_not_change_bits(mode, rng):
    x = random_values(rng, 300_001, fadev.formats["bf16"])  # many tasks of 32768, the last one short
    with np.errstate(over="ignore", invalid="ignore"):
        x32 = x.astype(np.float32)
    results = []
    for threads in (1, 2, 3):
        fadev.set_num_threads(threads)
        for name in ("bf16", "fp8_e5m2", "fp16"):
            results.append((threads, name, fadev.round(x, name, mode, seed=77)))
            results.append((threads, name, fadev.round(x32, name, mode, seed=77)))
    n_cases = len(results) // 3
    for i in range(n_cases):
        for threads, name, r in results[i::n_cases]:
            assert_same(r, results[i][2], f"{name} {mode} with {threads} threads")


# ---------------------------------------------------------------- inputs, API and errors


def test_input_kinds_are_converted(rng):
    x = rng.standard_normal((64, 33)) * 100
    want = fadev.round(x, "bf16")
    assert want.shape == x.shape and want.dtype == np.float64
    assert_same(fadev.round(x[:, ::2], "bf16"), want[:, ::2])  # non-contiguous
    assert_same(fadev.round(np.asfortranarray(x), "bf16"), want)
    assert_same(fadev.round(x.astype(">f8"), "bf16"), want)  # byte-swapped
    assert_same(fadev.round(x.astype(np.float32), "bf16"), fadev.round(x.astype(np.float32).astype(np.float64), "bf16"))
    assert_same(fadev.round(x.astype(">f4"), "bf16"), fadev.round(x.astype(np.float32), "bf16"))
    ints = np.array([1, 255, 257, -1000001, 2**40 + 1])
    assert_same(fadev.round(ints, "bf16"), ref.round_ref(ints.astype(np.float64), fadev.formats["bf16"]))
    assert_same(fadev.round(ints.astype(np.int8), "fp8_e4m3"), fadev.round(ints.astype(np.int8).astype(float), "e4m3"))
    assert_same(fadev.round([True, False], "fp8_e4m3"), [1.0, 0.0])
    assert_same(fadev.round(np.float16(3.14159), "fp8_e5m2"), fadev.round(float(np.float16(3.14159)), "fp8_e5m2"))
    assert fadev.round(2.5, "fp16").shape == ()
    assert fadev.round(np.zeros((0, 3)), "fp16").shape == (0, 3)
    b = np.array([1.1, -2.2]).astype(ml_dtypes.bfloat16)  # ml_dtypes arrays are read as their values
    assert_same(fadev.round(b, "bf16"), b.astype(np.float64))


def test_ml_dtypes_round_trip(rng):
    x = rng.standard_normal(1000)
    for name in ("bf16", "fp8_e4m3", "fp8_e5m2", "fp16", "fp32"):
        arr = fadev.to_ml_dtypes(x, name)
        assert arr.dtype == np.dtype(ML_TYPES[name])
        assert_same(fadev.from_ml_dtypes(arr), fadev.round(x, name))
    with pytest.raises(ValueError, match="fmt"):
        fadev.to_ml_dtypes(x, "tf32")
    with pytest.raises(TypeError, match="arr"):
        fadev.from_ml_dtypes(x)


def test_count_representable(rng):
    x = np.concatenate([rng.standard_normal(1000), fadev.round(rng.standard_normal(500), "fp16"), [np.nan]])
    assert _core.count_representable(x, fadev.formats["fp16"]._c) == 501 + (fadev.round(x[:1000], "fp16") == x[:1000]).sum()


def test_ulp_matches_numpy_spacing(rng):
    x = np.abs(random_values(rng, 10**5, fadev.formats["fp16"]))
    x = x[np.isfinite(x) & (x < 65504)]  # numpy's spacing at the largest float16 is inf
    x16 = fadev.round(x, "fp16", "rtz")
    assert_same(fadev.ulp(x16, "fp16"), np.spacing(x16.astype(np.float16)).astype(np.float64))
    y = np.abs(rng.standard_normal(1000)) * 10.0 ** rng.integers(-300, 300, 1000)
    assert_same(fadev.ulp(y, "fp64"), np.spacing(y))
    assert_same(fadev.ulp([0.0, np.inf, np.nan], "fp64"), [5e-324, np.nan, np.nan])


def test_unknown_format_and_mode():
    with pytest.raises(ValueError, match="fmt.*'fp12'"):
        fadev.round([1.0], "fp12")
    with pytest.raises(TypeError, match="fmt"):
        fadev.round([1.0], 16)
    with pytest.raises(ValueError, match="mode.*'nearest_odd'"):
        fadev.round([1.0], "bf16", mode="nearest_odd")
    for bad in (-1, 2**64, 1.5, True):
        with pytest.raises(ValueError, match="seed"):
            fadev.round([1.0], "bf16", "stochastic", seed=bad)
    with pytest.raises(ValueError, match="stream"):
        fadev.round([1.0], "bf16", "stochastic", stream=-3)
    with pytest.raises(ValueError, match="round: invalid rounding mode"):  # the C check behind the binding
        _core.round(np.ones(3), fadev.formats["bf16"]._c, 7, 0, 0, 0)


@pytest.mark.parametrize("kwargs,match", [
    (dict(precision=0, emin=-6, emax=7), "precision"),
    (dict(precision=54, emin=-6, emax=7), "precision"),
    (dict(precision=5, emin=8, emax=7), "emin"),
    (dict(precision=5, emin=-1023, emax=7), "emin"),
    (dict(precision=5, emin=-6, emax=1024), "emax"),
    (dict(precision=5, emin=-6, emax=7, overflow="wrap"), "overflow"),
    (dict(precision=5, emin=-6, emax=7, has_inf=False, overflow="inf"), "has_inf"),
    (dict(precision=5, emin=-6, emax=7, largest=100.0), "largest"),
    (dict(precision=5, emin=-6, emax=7, largest=300.0), "largest"),
    (dict(precision=3, emin=-2, emax=3, largest=13.0), "fmt: invalid format parameters"),  # not a value
])
def test_bad_custom_format(kwargs, match):
    with pytest.raises(ValueError, match=match):
        fadev.custom_format(**kwargs)


def test_bad_format_types():
    with pytest.raises(TypeError, match="precision"):
        fadev.custom_format(5.0, -6, 7)
    with pytest.raises(TypeError, match="emin"):
        fadev.Format("x", 5, "-6", 7)
    with pytest.raises(TypeError, match="fmt must be a"):
        _core.round(np.ones(2), (5, -6), 0, 0, 0, 0)


@pytest.mark.parametrize("bad", [np.array(["1.0"]), np.array([1.0], dtype=object), np.array([1 + 2j]),
                                 np.array([1.0], dtype=np.complex64), "1.0", [None]])
def test_non_numeric_input(bad):
    with pytest.raises(TypeError, match="x: expected a real numeric array"):
        fadev.round(bad, "bf16")
    with pytest.raises(TypeError, match="x"):
        fadev.to_bits(bad, "bf16")


def test_bit_errors():
    with pytest.raises(TypeError, match="bits"):
        fadev.from_bits(np.array([1, 2]), "fp8_e4m3")  # signed
    with pytest.raises(TypeError, match="bits"):
        fadev.from_bits(np.array([1.0]), "fp8_e4m3")
    with pytest.raises(ValueError, match="bits: uint8 is too narrow"):
        fadev.from_bits(np.array([1], dtype=np.uint8), "fp16")
    assert_same(fadev.from_bits(np.array([0x3C00], dtype=np.uint32), "fp16"), [1.0])  # wider is fine
    assert fadev.to_bits([1.0], "tf32").dtype == np.uint32 and fadev.to_bits([1.0], "fp64").dtype == np.uint64
    bf16 = fadev.formats["bf16"]._c
    with pytest.raises(ValueError, match="width must be 1, 2, 4 or 8"):
        _core.to_bits(np.ones(2), bf16, 3)
    with pytest.raises(ValueError, match="to_bits: format has no bit encoding of that width"):
        _core.to_bits(np.ones(2), fadev.formats["fp32"]._c, 2)
    with pytest.raises(ValueError, match="from_bits: format has no bit encoding of that width"):
        _core.from_bits(np.ones(2, dtype=np.uint8), bf16)
    with pytest.raises(TypeError, match="bits must be an unsigned integer array"):
        _core.from_bits(np.ones(2, dtype=np.int16), bf16)
    with pytest.raises(ValueError, match="to_bits: invalid argument"):  # NaN in a format without a NaN code
        _core.to_bits(np.array([np.nan]), ML_CUSTOM["float4_e2m1fn"]._c, 1)
    with pytest.raises(ValueError, match="NaN"):
        fadev.to_bits([np.nan], fadev.custom_format(1, -3, 3))  # p = 1: the all-ones code is inf
