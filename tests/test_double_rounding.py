"""The double-rounding claims behind the emulated kernels' fp32 forms (docs/numerics.md), on samples of
benchmarks/exhaustive_rounding.py's pairs (the script checks all of them): for values a, b of bf16 (fp16) and op in
{*, /, +}, rounding fp32(a op b) to the format gives what rounding fp64(a op b) gives. The script's reference rounding
is checked against fadev.round, and its check against a case where double rounding is not innocuous (a 14-bit
format's quotients: 24 < 2 * 14), where it must find differences."""
import importlib.util
import os

import numpy as np
import pytest

import fadev

_path = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "exhaustive_rounding.py")
_spec = importlib.util.spec_from_file_location("exhaustive_rounding", _path)
er = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(er)


@pytest.mark.parametrize("fmt", ["bf16", "fp16"])
def test_reference_rounding_is_fadevs(fmt):
    rng = np.random.default_rng(1)
    x = np.concatenate([rng.standard_normal(20000) * 2.0 ** rng.integers(-160, 130, 20000),
                        er.values(fmt, positive=False) * (1 + 2.0 ** -12), er.values(fmt, positive=False),
                        [0.0, -0.0, 65519.0, 65520.0, 3.4e38, 2.0 ** -25, 2.0 ** -134, 1.5 * 2.0 ** -24]])
    with np.errstate(over="ignore"):
        ours = er.round_to(fmt, x)
    assert np.array_equal(ours.view(np.uint64), fadev.round(x, fmt).view(np.uint64))


@pytest.mark.parametrize("fmt", ["bf16", "fp16"])
@pytest.mark.parametrize("op", ["*", "/", "+"])
def test_fp32_then_format_is_fp64_then_format(fmt, op):
    rng = np.random.default_rng(2)
    a = er.values(fmt)
    a = np.concatenate([a[:8], a[-8:], rng.choice(a, 48)])  # the smallest subnormals, the largest values, others
    bad, first = er.check(fmt, op, a, er.values(fmt, er.OPS[op][1]))
    assert bad == 0, first


def test_check_finds_double_rounding(monkeypatch):
    """A format of 14 bits: fp32 quotients of its values, rounded to it, differ from the fp64 ones for some pairs."""
    monkeypatch.setitem(er.FORMATS, "p14", (14, -126, 2.0 ** 127))
    rng = np.random.default_rng(3)
    a, b = ((rng.integers(2 ** 13, 2 ** 14, n) / 2.0 ** 13).astype(np.float64) for n in (64, 4096))
    bad, first = er.check("p14", "/", a, b)
    assert bad > 0 and first is not None
    x = 1 + 2.0 ** -8 + 2.0 ** -30  # fp32 rounds it to a bf16 midpoint, which then rounds to even
    assert er.round_to("bf16", np.float64(np.float32(x))) != er.round_to("bf16", x)
