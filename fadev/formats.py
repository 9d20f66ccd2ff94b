"""Floating-point formats and rounding.

A :class:`Format` is a binary floating-point format described by its significand precision ``p``
(implicit bit included), exponent range ``[emin, emax]``, subnormal support, infinities and an
overflow rule. Values "in" a format are carried as float64 numbers exactly representable in it.
Anywhere a format is expected, its name (``"bf16"``) works too.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import numbers
import os

import numpy as np

from . import _core

OVERFLOW_RULES = {"inf": 0, "nan": 1, "saturate": 2}
ROUNDING_MODES = {"rne": 0, "nearest": 0, "rtz": 1, "toward_zero": 1, "stochastic": 2, "sr": 2}


def integer(value, name) -> int:
    """``value`` (any numbers.Integral, NumPy integers included, bools refused) as an int; TypeError
    naming ``name`` otherwise. The one integer checker of fadev's arguments."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an integer, got {value!r}")
    return int(value)


def boolean(value, name) -> bool:
    """``value`` (a bool or NumPy bool) as a bool; TypeError naming ``name`` for anything else, so that
    ``"no"`` or ``0`` is never read by its truthiness. The one flag checker of fadev's arguments."""
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be a bool, got {value!r}")
    return bool(value)


@dataclasses.dataclass(frozen=True)
class Format:
    """A binary floating-point format.

    Attributes: ``name``; ``precision`` p (significand bits incl. the implicit one); ``emin``, ``emax``
    (exponents of the smallest normal and of the largest binade); ``subnormals``; ``has_inf``;
    ``overflow`` ("inf", "nan" or "saturate": what a magnitude rounded above ``largest`` becomes under
    nearest-even and stochastic rounding; toward-zero rounding always clamps, as IEEE does);
    ``largest`` (largest finite magnitude).
    """

    name: str
    precision: int
    emin: int
    emax: int
    subnormals: bool = True
    has_inf: bool = True
    overflow: str = "inf"
    largest: float = 0.0

    def __post_init__(self):
        if not isinstance(self.overflow, str) or self.overflow not in OVERFLOW_RULES:
            raise ValueError(f"overflow must be one of {sorted(OVERFLOW_RULES)}, got {self.overflow!r}")
        if not isinstance(self.name, str):
            raise TypeError(f"name must be a str, got {self.name!r}")
        for field in ("precision", "emin", "emax"):
            object.__setattr__(self, field, integer(getattr(self, field), field))
        for field in ("subnormals", "has_inf"):
            object.__setattr__(self, field, boolean(getattr(self, field), field))
        if isinstance(self.largest, (bool, np.bool_)) or not isinstance(self.largest, numbers.Real):
            raise TypeError(f"largest must be a real number, got {self.largest!r}")
        if not 1 <= self.precision <= 53:
            raise ValueError(f"precision must be in 1..53, got {self.precision}")
        if not -1022 <= self.emin <= self.emax <= 1023:
            raise ValueError(f"need -1022 <= emin <= emax <= 1023, got emin={self.emin}, emax={self.emax}")
        if self.overflow == "inf" and not self.has_inf:
            raise ValueError("overflow='inf' needs has_inf=True (use 'nan' or 'saturate')")
        full = math.ldexp(2.0 - math.ldexp(1.0, 1 - self.precision), self.emax)
        largest = float(self.largest) if self.largest else full
        if not math.ldexp(1.0, self.emax) <= largest <= full:
            raise ValueError(f"largest must lie in the top binade [2^emax, {full}], got {self.largest!r}")
        object.__setattr__(self, "largest", largest)
        _core.format_layout(self._c)  # C-side validation (largest must be a value of the format)

    @property
    def _c(self):
        return (int(self.precision), int(self.emin), int(self.emax), int(self.subnormals), int(self.has_inf),
                OVERFLOW_RULES[self.overflow], float(self.largest))

    @property
    def smallest_normal(self) -> float:
        return math.ldexp(1.0, self.emin)

    @property
    def smallest_subnormal(self) -> float:
        """Smallest positive value (the smallest normal when subnormals are off)."""
        return math.ldexp(1.0, self.emin - self.precision + 1) if self.subnormals else self.smallest_normal

    @property
    def unit_roundoff(self) -> float:
        """u = 2^-p: the relative error bound of round-to-nearest."""
        return math.ldexp(1.0, -self.precision)

    @property
    def epsilon(self) -> float:
        """Machine epsilon 2^(1-p): the gap between 1 and the next value."""
        return math.ldexp(1.0, 1 - self.precision)

    @property
    def exponent_bits(self) -> int:
        return _core.format_layout(self._c)[0]

    @property
    def bits(self) -> int:
        """Width of the format's IEEE-style encoding (sign, exponent, precision-1 fraction bits)."""
        return _core.format_layout(self._c)[1]

    @property
    def has_nan_code(self) -> bool:
        """Whether the bit encoding has a NaN pattern. IEEE-style formats (``has_inf``) use the all-ones
        exponent field with a nonzero fraction; formats without inf use the all-ones pattern when it lies
        above ``largest`` (E4M3FN's S.1111.111). OCP MX float6/float4 "fn" formats have none: NaN can
        still be a value in fadev, but :func:`to_bits` refuses to encode it."""
        if self.has_inf:
            return self.precision > 1
        all_ones_field = 2 ** self.exponent_bits - 1
        full = math.ldexp(2.0 - math.ldexp(1.0, 1 - self.precision), self.emax)
        return all_ones_field > self.emax + 1 - self.emin or self.largest < full

    def __str__(self):
        return self.name


def _builtin():
    return {
        "fp64": Format("fp64", 53, -1022, 1023),
        "fp32": Format("fp32", 24, -126, 127),
        "tf32": Format("tf32", 11, -126, 127),
        "fp16": Format("fp16", 11, -14, 15),
        "bf16": Format("bf16", 8, -126, 127),
        "fp8_e4m3": Format("fp8_e4m3", 4, -6, 8, has_inf=False, overflow="nan", largest=448.0),
        "fp8_e5m2": Format("fp8_e5m2", 3, -14, 15),
    }


formats = _builtin()
"""The built-in formats by name: fp64, fp32, tf32, fp16, bf16, fp8_e4m3 (OCP E4M3FN), fp8_e5m2."""

_ALIASES = {"float64": "fp64", "double": "fp64", "float32": "fp32", "float": "fp32", "float16": "fp16",
            "half": "fp16", "bfloat16": "bf16", "e4m3": "fp8_e4m3", "float8_e4m3fn": "fp8_e4m3",
            "e5m2": "fp8_e5m2", "float8_e5m2": "fp8_e5m2"}


def as_format(fmt, name: str = "fmt") -> Format:
    """A Format from a Format or a name ("bf16", "fp8_e4m3", aliases such as "bfloat16")."""
    if isinstance(fmt, Format):
        return fmt
    if isinstance(fmt, str):
        key = _ALIASES.get(fmt.lower(), fmt.lower())
        if key in formats:
            return formats[key]
        raise ValueError(f"{name}: unknown format {fmt!r}; known: {', '.join(formats)}")
    raise TypeError(f"{name}: expected a fadev.Format or a format name, got {type(fmt).__name__}")


def custom_format(precision, emin, emax, *, subnormals=True, has_inf=True, overflow=None, largest=None, name=None):
    """A format from its parameters, e.g. ``custom_format(5, -30, 31)``."""
    if overflow is None:
        overflow = "inf" if boolean(has_inf, "has_inf") else "nan"
    name = name or f"p{precision}_e{emin}_{emax}"
    return Format(name, precision, emin, emax, subnormals, has_inf, overflow, 0.0 if largest is None else largest)


def _mode(mode) -> int:
    if isinstance(mode, str) and mode in ROUNDING_MODES:
        return ROUNDING_MODES[mode]
    raise ValueError(f"mode must be one of 'rne', 'rtz', 'stochastic', got {mode!r}")


@functools.cache  # the machine's memory does not change; os.sysconf was a system call per check
def _memory_bytes() -> int:
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):  # not POSIX: only numpy's own allocation check remains
        return 2**62


def check_bytes(name, nbytes, what="the call") -> int:
    """``nbytes``, or MemoryError naming ``name`` and the bytes when they exceed this machine's memory:
    checked before anything is allocated, so that an absurd size (a broadcast view, a typo'd shape) is
    refused cleanly instead of failing halfway or swapping."""
    have = _memory_bytes()
    if nbytes > have:
        raise MemoryError(f"{name}: {what} would need {nbytes} bytes ({nbytes / 2**30:.4g} GiB), more than this "
                          f"machine's {have} bytes of memory")
    return nbytes


def _copy_bytes(name, arr, itemsize) -> int:
    return check_bytes(name, arr.size * itemsize, f"a {itemsize}-byte-per-element copy of shape {arr.shape}")


def _numeric(x, name="x"):
    """x as a NumPy array of a real numeric dtype (bool, integer, float; ml_dtypes' 1- and 2-byte floats
    as float32); TypeError naming ``name`` for complex, object, string, datetime and timedelta arrays."""
    arr = np.asarray(x)
    if not real_dtype(arr.dtype):
        raise TypeError(f"{name}: expected a real numeric array, got dtype {arr.dtype}")
    if arr.dtype.kind == "V":
        _copy_bytes(name, arr, 4)
        return arr.astype(np.float32)
    return arr


def real_dtype(dtype) -> bool:
    """Whether ``dtype`` holds real numbers: bool, integer, float, or an ml_dtypes 1- or 2-byte float."""
    if dtype.kind == "V":
        return dtype.itemsize in (1, 2) and dtype.type.__module__.startswith("ml_dtypes")
    return dtype.kind in "biuf"


def as_float(x, name="x", dtype=np.float64, contiguous=False):
    """x as a real numeric array of ``dtype`` (C-contiguous with ``contiguous``), its size checked
    against memory first (:func:`check_bytes`); MemoryError naming ``name`` and the bytes when the copy
    cannot be allocated."""
    arr = _numeric(x, name)
    itemsize = np.dtype(dtype).itemsize
    _copy_bytes(name, arr, itemsize)
    try:
        return np.asarray(arr, dtype=dtype, order="C" if contiguous else None)
    except MemoryError:
        raise MemoryError(f"{name}: cannot allocate {arr.size * itemsize} bytes for a {np.dtype(dtype)} copy of "
                          f"shape {arr.shape}") from None


def round(x, fmt, mode: str = "rne", *, seed: int = 0, stream: int = 0):  # noqa: A001 (numeric rounding)
    """Round ``x`` to ``fmt``; returns a float64 array of values exactly representable in ``fmt``.

    ``mode``: "rne" (nearest, ties to even), "rtz" (toward zero), "stochastic" (up with probability
    equal to the distance to the lower neighbour over the gap; element i draws Philox4x32-10 bits keyed
    by ``seed`` at counter (i, ``stream``), so results are reproducible and thread-independent).
    float32 input is read as float32 (exact), anything else is converted to float64 first.
    """
    fmt = as_format(fmt)
    m = _mode(mode)
    arr = _numeric(x)
    arr = as_float(arr, "x", np.float32 if arr.dtype == np.float32 else np.float64, contiguous=True)
    return _core.round(arr, fmt._c, m, _u64(seed, "seed"), _u64(stream, "stream"), 0)


def _u64(v, name):
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or not 0 <= int(v) < 2**64:
        raise ValueError(f"{name} must be an integer in [0, 2^64), got {v!r}")
    return int(v)


def _width(fmt: Format) -> int:
    bits = fmt.bits
    for w in (1, 2, 4, 8):
        if bits <= 8 * w:
            return w
    raise ValueError(f"format {fmt} has no encoding up to 64 bits")


def to_bits(x, fmt):
    """Bit patterns of ``x`` (rounded to nearest even first) in ``fmt``'s IEEE-style encoding, as the
    narrowest unsigned integer array that holds them (uint8 for fp8, uint16 for fp16/bf16, ...)."""
    fmt = as_format(fmt)
    arr = as_float(x, "x", contiguous=True)
    if not fmt.has_nan_code and np.isnan(arr).any():
        raise ValueError(f"x: contains NaN, which format {fmt} has no bit pattern for")
    return _core.to_bits(arr, fmt._c, _width(fmt))


def ulp(x, fmt):
    """Spacing of ``fmt`` at ``x``: the gap between ``|round(x, fmt, "rtz")|`` and the next larger value
    of the format, 2^(max(e, emin) - p + 1) for 2^e <= |x| < 2^(e+1) (2^emin - wide steps below 2^emin
    when the format has no subnormals; above the range, the spacing the binade of x would have). NaN for
    NaN and inf. Returns a float64 array."""
    fmt = as_format(fmt)
    a = np.abs(as_float(x, "x"))
    _, e = np.frexp(a)  # a = m * 2^e with 0.5 <= m < 1, so the binade exponent is e - 1
    e = np.where(a == 0, fmt.emin, np.maximum(e.astype(np.int64) - 1, fmt.emin))
    q = e - fmt.precision + 1
    if not fmt.subnormals:
        q = np.where(a < fmt.smallest_normal, fmt.emin, q)
    out = np.ldexp(1.0, q)
    return np.where(np.isfinite(a), out, np.nan)


def from_bits(bits, fmt):
    """float64 values of the bit patterns ``bits`` (an unsigned integer array) in ``fmt``."""
    fmt = as_format(fmt)
    bits = np.asarray(bits)
    if bits.dtype.kind != "u":
        raise TypeError(f"bits: expected an unsigned integer array, got dtype {bits.dtype}")
    if bits.dtype.itemsize * 8 < fmt.bits and fmt.bits <= 64:
        raise ValueError(f"bits: {bits.dtype} is too narrow for {fmt} ({fmt.bits} bits)")
    check_bytes("bits", bits.size * (bits.dtype.itemsize + 8), f"shape {bits.shape} and its float64 values")
    return _core.from_bits(bits, fmt._c)


_ML_DTYPES = {"bf16": "bfloat16", "fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2"}


def to_ml_dtypes(x, fmt):
    """``x`` rounded to ``fmt`` as an array of the matching ml_dtypes/numpy dtype (bf16, fp8_e4m3,
    fp8_e5m2 -> ml_dtypes; fp16 -> numpy float16; fp32 -> float32), built from bit patterns."""
    fmt = as_format(fmt)
    if fmt.name == "fp16":
        return to_bits(x, fmt).view(np.float16)
    if fmt.name == "fp32":
        return to_bits(x, fmt).view(np.float32)
    if fmt.name not in _ML_DTYPES:
        raise ValueError(f"fmt: no ml_dtypes type for {fmt.name!r}; use one of bf16, fp16, fp32, fp8_e4m3, fp8_e5m2")
    import ml_dtypes
    return to_bits(x, fmt).view(getattr(ml_dtypes, _ML_DTYPES[fmt.name]))


def from_ml_dtypes(arr):
    """float64 values of an ml_dtypes (bfloat16, float8_e4m3fn, float8_e5m2) or float16/float32 array."""
    arr = np.asarray(arr)
    names = {"bfloat16": "bf16", "float8_e4m3fn": "fp8_e4m3", "float8_e5m2": "fp8_e5m2", "float16": "fp16",
             "float32": "fp32"}
    if arr.dtype.name not in names:
        raise TypeError(f"arr: expected bfloat16, float8_e4m3fn, float8_e5m2, float16 or float32, got {arr.dtype}")
    fmt = formats[names[arr.dtype.name]]
    uint = {1: np.uint8, 2: np.uint16, 4: np.uint32}[arr.dtype.itemsize]
    return from_bits(np.ascontiguousarray(arr).view(uint), fmt)
