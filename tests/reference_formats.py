"""Rounding to a format from its definition, without fadev's C core: the spec of csrc/round.h for arrays.

Two independent references:
  round_exact(x, fmt, mode)  exact rational arithmetic (fractions.Fraction), one Python float at a time;
                             slow, the plainest statement of the rule, for a few thousand values.
  round_ref(x, fmt, mode)    the same rule vectorised with NumPy: |x| = M * 2^(e-53) from np.frexp with an
                             integer significand M, rounded to a multiple of the quantum 2^q with int64
                             arithmetic; for 10^6 values.
  decode_exact(bits, fmt)    value of a bit pattern (sign | exponent field, bias 1 - emin | p-1 fraction bits).
fmt is anything with precision, emin, emax, subnormals, has_inf, overflow, largest (a fadev.Format
is used only as such a record). The rule: q = max(e, emin) - p + 1 for 2^e <= |x| < 2^(e+1) (below 2^emin
without subnormals: q = emin); nearest-even or toward zero to a multiple of 2^q; a magnitude above
`largest` overflows to inf / NaN / largest ("inf" / "nan" / "saturate"; toward zero always to largest);
NaN stays NaN; inf stays inf if the format has inf, else becomes NaN (largest under "saturate").
"""
from __future__ import annotations

import math
from fractions import Fraction

import numpy as np


def overflow_value(fmt, negative, mode):
    """What a magnitude rounded above fmt.largest becomes (toward zero always clamps, as IEEE)."""
    if fmt.overflow == "saturate" or mode == "rtz":
        v = fmt.largest
    elif fmt.overflow == "nan":
        v = math.nan
    else:
        v = math.inf
    return -v if negative else v


def _binade(a: Fraction) -> int:
    """e with 2^e <= a < 2^(e+1), a > 0."""
    e = a.numerator.bit_length() - a.denominator.bit_length()
    while Fraction(2) ** e > a:
        e -= 1
    while Fraction(2) ** (e + 1) <= a:
        e += 1
    return e


def quantum_exponent(a: Fraction, fmt) -> int:
    """q such that the format's values around a > 0 are the multiples of 2^q."""
    e = _binade(a)
    if e >= fmt.emin:
        return e - fmt.precision + 1
    return fmt.emin - fmt.precision + 1 if fmt.subnormals else fmt.emin


def round_exact(x: float, fmt, mode: str = "rne") -> float:
    """x rounded to fmt ("rne" or "rtz"), by exact rational arithmetic."""
    if math.isnan(x):
        return x
    if math.isinf(x):
        if fmt.has_inf:
            return x
        v = fmt.largest if fmt.overflow == "saturate" else math.nan
        return math.copysign(v, x)
    if x == 0:
        return x
    a = abs(Fraction(x))
    quantum = Fraction(2) ** quantum_exponent(a, fmt)
    k = a // quantum
    rest = a - k * quantum
    if mode == "rne" and (2 * rest > quantum or (2 * rest == quantum and k % 2 == 1)):
        k += 1
    r = k * quantum
    if r > Fraction(fmt.largest):
        return overflow_value(fmt, x < 0, mode)
    return math.copysign(float(r), x)


def neighbours_exact(x: float, fmt):
    """(lo, hi): the format's values of the same sign with |lo| <= |x| < |hi| (finite, in range x)."""
    a = abs(Fraction(x))
    quantum = Fraction(2) ** quantum_exponent(a, fmt) if a else Fraction(2) ** (
        fmt.emin - fmt.precision + 1 if fmt.subnormals else fmt.emin)
    k = a // quantum
    lo, hi = float(k * quantum), float((k + 1) * quantum)
    return math.copysign(lo, x), math.copysign(hi, x)


def _split(x):
    """|x| = M * 2^ue with M an int64 significand (< 2^53), exponent e of the binade, and masks."""
    a = np.abs(x)
    with np.errstate(invalid="ignore"):  # inf and NaN give garbage here; callers mask them
        m, e2 = np.frexp(a)  # a = m * 2^e2, 0.5 <= m < 1 (m = 0 for a = 0)
        significand = np.ldexp(m, 53).astype(np.int64)  # exact: 53 bits
    e = e2.astype(np.int64) - 1  # 2^e <= a < 2^(e+1)
    ue = e2.astype(np.int64) - 53
    return a, significand, e, ue


def _quantum(e, fmt):
    if fmt.subnormals:
        return np.maximum(e, fmt.emin) - fmt.precision + 1
    return np.where(e >= fmt.emin, e - fmt.precision + 1, fmt.emin)


def round_ref(x, fmt, mode: str = "rne"):
    """Vectorised twin of round_exact for a float64 array (int64 arithmetic on the significand)."""
    x = np.asarray(x, dtype=np.float64)
    a, significand, e, ue = _split(x)
    q = _quantum(e, fmt)
    shift = q - ue  # >= 0: the quantum is never finer than the float64 spacing (emin - p + 1 >= -1074)
    assert (shift[np.isfinite(x) & (x != 0)] >= 0).all()
    s = np.clip(shift, 0, 62)  # M < 2^53: dropping 62 bits or more leaves 0 with remainder M < half
    kept = significand >> s
    dropped = significand - (kept << s)
    if mode == "rne":
        half = np.where(s > 0, np.left_shift(np.int64(1), np.maximum(s - 1, 0)), 1)
        up = (s > 0) & ((dropped > half) | ((dropped == half) & (kept % 2 == 1)))
        kept = kept + up
    elif mode != "rtz":
        raise ValueError(mode)
    with np.errstate(over="ignore"):
        r = np.ldexp(kept.astype(np.float64), q)  # exact: kept <= 2^53
    negative = np.signbit(x)
    over = np.isfinite(x) & (r > fmt.largest)
    r = np.where(negative, -r, r)
    r = np.where(over, np.where(negative, -1.0, 1.0) * abs(overflow_value(fmt, False, mode)), r)
    r = np.where(x == 0, x, r)
    if fmt.has_inf:
        special = x
    else:
        special = np.copysign(fmt.largest if fmt.overflow == "saturate" else np.nan, x)
    r = np.where(np.isinf(x), special, r)
    return np.where(np.isnan(x), x, r)


def neighbours_ref(x, fmt):
    """(lo, hi) arrays: the format's values with |lo| <= |x| < |hi|, sign of x (finite x, no overflow)."""
    x = np.asarray(x, dtype=np.float64)
    lo = round_ref(x, fmt, "rtz")
    _, _, e, _ = _split(lo)
    q = _quantum(np.where(lo == 0, fmt.emin - 1, e), fmt)
    if not fmt.subnormals:
        q = np.where(lo == 0, fmt.emin, q)
    hi = np.abs(lo) + np.ldexp(1.0, q)
    return lo, np.copysign(hi, x)


def decode_exact(bits: int, fmt) -> float:
    """Value of one bit pattern in fmt's IEEE-style layout (exponent_bits from fmt.exponent_bits)."""
    k, f = fmt.exponent_bits, fmt.precision - 1
    negative = (bits >> (k + f)) & 1
    field = (bits >> f) & ((1 << k) - 1)
    frac = bits & ((1 << f) - 1)
    if fmt.has_inf and field == (1 << k) - 1:
        v = math.nan if frac else math.inf
    elif field == 0:
        v = float(Fraction(frac) * Fraction(2) ** (fmt.emin - f)) if fmt.subnormals else (math.nan if frac else 0.0)
    else:
        v = Fraction((1 << f) + frac) * Fraction(2) ** (field - 1 + fmt.emin - f)
        v = math.nan if v > Fraction(fmt.largest) else float(v)
    return -v if negative else v
