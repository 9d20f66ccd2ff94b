"""The CPU kernels' fast paths (csrc/fast.c, the FMA tier of csrc/matmul.c) against their generic paths, bit for bit.

For nearest-even policies the CPU runs the element-wise steps as vector passes, the products of 16-bit operands
with fp32 accumulators as fmaf chains (no magnitude test), and exp/exp2 by a vector approximation where libm's
last bits cannot change the stage's rounding (docs/numerics.md, "How the CPU runs it"). ``_core._set_fast_paths(0)``
makes every call take the generic paths that existed before; every result must be the same bits (NaN payloads
included), forward and backward, flash and baseline, on shapes and data chosen to reach the paths' edges: odd N
and D, causal with Nq != Nk, grouped-query heads, every tile from 16 to 256, subnormal products, overflowing
scores, NaN and inf in the inputs. And the vector exp against libm itself (Python's math module) on inputs
crowded near the rounding boundaries, and the vector rounding pass against fadev.round on every range of a format."""
import math

import numpy as np
import pytest

import fadev
from fadev import _core
from helpers import assert_same_bits, identical

PRESETS = ("fa2", "paper", "naive")
FORMATS = ("bf16", "fp16")


def both_paths(fn):
    """(fn() with the fast paths, fn() with the generic paths), after checking that the fast paths' AVX2 kernels
    give fn()'s bits too where the CPU would run their AVX-512 ones; the setting is restored after."""
    old = _core._set_fast_paths(True)
    try:
        fast = fn()
        _core._set_fast_paths(True, False)
        avx2 = fn()
        _core._set_fast_paths(False)
        generic = fn()
    finally:
        _core._set_fast_paths(old)
    for a, b in zip(fast if isinstance(fast, tuple) else (fast,), avx2 if isinstance(avx2, tuple) else (avx2,)):
        assert_same_bits(a, b, "result", "AVX-512 vs AVX2 kernels", nan="exact", names=("AVX-512", "AVX2"))
    return fast, generic


def forward_backward(preset, fmt, q, k, v, dout, causal, blocks=None):
    """out, lse, dq, dk, dv of the preset's kernel (naive: the baseline; else flash with ``blocks``)."""
    pol = f"{preset}:{fmt}"
    if preset == "naive":
        out, lse = fadev.baseline_attention(q, k, v, pol, causal=causal, return_lse=True)
        grads = fadev.baseline_attention_backward(q, k, v, out, lse, dout, pol, causal=causal)
    else:
        kw = {} if blocks is None else {"block_q": blocks[0], "block_kv": blocks[1]}
        out, lse = fadev.flash_attention(q, k, v, pol, causal=causal, return_lse=True, **kw)
        grads = fadev.flash_attention_backward(q, k, v, out, lse, dout, pol, causal=causal, **kw)
    return (out, lse) + tuple(grads)


def check_same(preset, fmt, q, k, v, dout, causal, blocks=None, what=""):
    fast, generic = both_paths(lambda: forward_backward(preset, fmt, q, k, v, dout, causal, blocks))
    context = f"{preset}:{fmt} causal={causal} blocks={blocks} q{q.shape} k{k.shape} {what}"
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), fast, generic):
        assert_same_bits(a, b, name, context, nan="exact", names=("fast path", "generic path"))
    return fast


def inputs(rng, B, H, Hkv, Nq, Nk, D, q_scale=1.0, k_scale=1.0, v_scale=1.0):
    q = rng.standard_normal((B, H, Nq, D)) * q_scale
    k = rng.standard_normal((B, Hkv, Nk, D)) * k_scale
    v = rng.standard_normal((B, Hkv, Nk, D)) * v_scale
    return q, k, v, rng.standard_normal((B, H, Nq, D))


def fast_runs(fn):
    """How many calls took the vector steps and how many products the FMA tier while fn() ran."""
    calls, products, _ = _core._fast_path_counts()
    fn()
    after = _core._fast_path_counts()
    return after[0] - calls, after[1] - products


def test_the_switch_and_the_comparison_work():
    """_set_fast_paths returns the previous setting and decides which paths run (the counters say so: the
    comparisons below compare two different computations); the bit comparison this file relies on fails on one
    ulp."""
    assert _core._set_fast_paths(True) is True
    assert _core._set_fast_paths(False) is True
    assert _core._set_fast_paths(True) is False
    q, k, v, dout = inputs(np.random.default_rng(1), 1, 1, 1, 20, 20, 8)
    run = lambda: forward_backward("fa2", "bf16", q, k, v, dout, True, (16, 16))  # noqa: E731
    calls, products = fast_runs(run)
    assert calls == 2  # the forward and the backward
    assert products > 0 or not _core._fast_path_counts()[2]  # where the CPU has AVX2 + FMA
    rtz = fadev.Policy.fa2("bf16").replace(rounding="rtz")
    assert fast_runs(lambda: fadev.flash_attention(q, k, v, rtz)) == (0, 0)
    _core._set_fast_paths(False)
    try:
        assert fast_runs(run) == (0, 0)
    finally:
        _core._set_fast_paths(True)


def test_the_environment_switch(monkeypatch):
    """FADEV_EMU_GENERIC=1 (the GPU kernels' switch) forces the CPU's generic paths too, per call."""
    q, k, v, dout = inputs(np.random.default_rng(2), 1, 1, 1, 20, 20, 8)
    monkeypatch.setenv("FADEV_EMU_GENERIC", "1")
    assert fast_runs(lambda: fadev.flash_attention(q, k, v, "fa2:bf16")) == (0, 0)
    monkeypatch.setenv("FADEV_EMU_GENERIC", "0")
    assert fast_runs(lambda: fadev.flash_attention(q, k, v, "fa2:bf16"))[0] == 1
    out = fadev.flash_attention(q, k, v, "fa2:bf16")
    nudged = out.copy()
    nudged[0, 0, 3, 2] = np.nextafter(nudged[0, 0, 3, 2], np.inf)
    assert not identical(out, nudged)
    with pytest.raises(pytest.fail.Exception, match="differs"):
        assert_same_bits(nudged, out, "out", "a nudged copy", nan="exact")


@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("shape", [(1, 4, 2, 37, 53, 19, True), (2, 2, 2, 64, 64, 64, False),
                                   (1, 3, 1, 33, 17, 5, True), (1, 2, 1, 70, 70, 40, False)])
def test_fast_equals_generic_on_normal_data(preset, fmt, shape, rng):
    B, H, Hkv, Nq, Nk, D, causal = shape
    q, k, v, dout = inputs(rng, B, H, Hkv, Nq, Nk, D)
    out = check_same(preset, fmt, q, k, v, dout, causal, (16, 32) if preset != "naive" else None)
    assert np.isfinite(out[0]).all()


@pytest.mark.parametrize("blocks", [(16, 16), (16, 256), (64, 48), (128, 64), (256, 16), (100, 37)])
@pytest.mark.parametrize("preset", ["fa2", "paper"])
def test_every_tile(preset, blocks, rng):
    q, k, v, dout = inputs(rng, 1, 2, 1, 131, 150, 24)
    check_same(preset, "bf16", q, k, v, dout, True, blocks)
    check_same(preset, "fp16", q, k, v, dout, False, blocks)


# data that takes the paths to their edges: products below fp32's normals (the float tier's magnitude test fails,
# the FMA tier takes them), scores that overflow the format, exp results in the subnormal range, huge values
EDGES = {
    "subnormal products": dict(q_scale=1e-22, k_scale=1e-20, v_scale=1e-30),
    "overflowing scores": dict(q_scale=3e18, k_scale=1e18, v_scale=1e30),
    "wide softmax": dict(q_scale=40.0, k_scale=3.0),
    "tiny values": dict(q_scale=1e-40, k_scale=1e-3, v_scale=1e-41),
}


@pytest.mark.parametrize("edge", list(EDGES))
@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("fmt", FORMATS)
def test_fast_equals_generic_at_the_edges(preset, fmt, edge, rng):
    q, k, v, dout = inputs(rng, 1, 2, 2, 45, 45, 33, **EDGES[edge])
    check_same(preset, fmt, q, k, v, dout, edge == "wide softmax", (16, 16) if preset != "naive" else None, edge)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("where", ["q", "k", "v", "dout"])
@pytest.mark.parametrize("preset", PRESETS)
def test_fast_equals_generic_with_nan_and_inf(preset, where, bad, rng):
    q, k, v, dout = inputs(rng, 1, 2, 1, 30, 30, 16)
    arrays = {"q": q, "k": k, "v": v, "dout": dout}
    arrays[where][0, 0, 7, 3] = bad
    check_same(preset, "bf16", q, k, v, dout, True, (16, 16) if preset != "naive" else None, f"{where}={bad}")


@pytest.mark.parametrize("preset", ["fa1", "efficient", "cudnn", "torch_math"])
def test_other_presets(preset, rng):
    """The presets beside fa2/paper/naive reach the other branches: kv_outer and eager (fa1), dS scaled
    (efficient, cudnn), fp32 P (torch_math)."""
    q, k, v, dout = inputs(rng, 1, 2, 1, 40, 56, 20)
    for fmt in FORMATS:
        pol = fadev.Policy.preset(preset, fmt)
        for fn in (lambda: fadev.flash_attention(q, k, v, pol, causal=True, block_q=16, block_kv=32, return_lse=True),
                   lambda: fadev.baseline_attention(q, k, v, pol, causal=True, return_lse=True)):
            fast, generic = both_paths(fn)
            for a, b in zip(fast, generic):
                assert identical(a, b), (preset, fmt)
        out, lse = fadev.flash_attention(q, k, v, pol, causal=True, block_q=16, block_kv=32, return_lse=True)
        fast, generic = both_paths(lambda: fadev.flash_attention_backward(q, k, v, out, lse, dout, pol, causal=True,
                                                                          block_q=16, block_kv=32))
        for a, b in zip(fast, generic):
            assert identical(a, b), (preset, fmt)


def test_stochastic_and_toward_zero_policies_are_untouched(rng):
    """Policies the fast paths do not take (their counters, or toward zero) give the same bits either way."""
    q, k, v, dout = inputs(rng, 1, 2, 1, 24, 24, 8)
    for rounding in ("stochastic", "toward_zero"):
        pol = fadev.Policy.fa2("bf16").replace(rounding=rounding, seed=3)
        fast, generic = both_paths(lambda: fadev.flash_attention(q, k, v, pol, block_q=16, block_kv=16))
        assert identical(fast, generic), rounding


# ------------------------------------------------------------------ the vector exp against libm


def libm_rounded(x, fmt, exp2):
    """R_fmt of libm's exp2 or exp (Python's math module calls the C library's)."""
    f = math.exp2 if exp2 else math.exp

    def one(t):
        try:
            return f(t)
        except OverflowError:
            return math.inf
    return fadev.round(np.array([one(t) for t in x.tolist()]), fmt)


def near_boundaries(rng, fmt, exp2, n):
    """Inputs x whose E(x) lies within a few fp64 ulps of the fmt's rounding midpoints (the lanes that must fall
    back to libm), beside uniform ones over the softmax's range."""
    p = fadev.formats[fmt].precision
    y = np.exp2(rng.uniform(-30, 0, n))
    lo = fadev.round(y, fmt)
    mid = lo + np.ldexp(np.ones(n), np.frexp(lo)[1] - p - 1) * np.sign(y - lo + 1e-300)
    target = mid * (1 + rng.integers(-40, 40, n) * 2.0 ** -53)
    x = np.log2(target) if exp2 else np.log(target)
    # and fp32 values, as the softmax stage's are
    return np.concatenate([x, fadev.round(np.concatenate([rng.uniform(-200, 5, n), -rng.exponential(3, n)]), "fp32")])


@pytest.mark.parametrize("fmt", ["fp32", "bf16", "fp16", "fp8_e4m3", "tf32"])
@pytest.mark.parametrize("exp2", [True, False])
def test_vector_exp_equals_libm(fmt, exp2, rng):
    x = near_boundaries(rng, fmt, exp2, 20000)
    x = np.concatenate([x, [0.0, -0.0, -1e-300, -126.0, -149.5, -150.0, -1000.0, 1000.0, 88.7, np.nan, -np.inf,
                            np.inf, 5e-324]])
    want = libm_rounded(x, fmt, exp2)
    for avx512 in (True, False):
        _core._set_fast_paths(True, avx512)
        try:
            got = _core._fast_round(x, fadev.formats[fmt]._c, 1 if exp2 else 2)
        finally:
            _core._set_fast_paths(True)
        assert_same_bits(got, want, f"R_{fmt}({'exp2' if exp2 else 'exp'}(x))", f"avx512={avx512}", nan="any",
                         names=("vector path", "libm"))


# ------------------------------------------------------------------ the vector rounding pass against fadev.round


@pytest.mark.parametrize("fmt", ["bf16", "fp16", "fp8_e4m3", "fp8_e5m2", "tf32", "fp32", "fp64",
                                 fadev.custom_format(5, -6, 7, subnormals=False, name="no-subnormals")])
def test_vector_rounding_equals_fadev_round(fmt, rng):
    """Normal range, subnormal range (the FPU shifter trick), ties at the subnormal quantum, zeros of both signs,
    overflow, inf and NaN, in runs long enough for the vector lanes and chunks of every kind."""
    f = fadev.formats[fmt] if isinstance(fmt, str) else fmt
    e = rng.integers(f.emin - f.precision - 3, f.emax + 2, 5000)
    x = rng.uniform(1, 2, 5000) * np.exp2(e.astype(float)) * rng.choice([-1.0, 1.0], 5000)
    quantum = 2.0 ** (f.emin - f.precision + 1)
    ties = (rng.integers(0, 2 ** min(f.precision, 20), 2000) + 0.5) * quantum
    special = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, f.largest, -f.largest, 5e-324, -5e-324, 2.0 ** f.emin])
    x = np.concatenate([x, ties, -ties, special, rng.standard_normal(3000)])
    for perm, avx512 in ((x, True), (rng.permutation(x), True), (x, False)):
        _core._set_fast_paths(True, avx512)
        try:
            got = _core._fast_round(perm, f._c, 0)
        finally:
            _core._set_fast_paths(True)
        assert_same_bits(got, fadev.round(perm, f), f"R_{f.name}", f"vector pass, avx512={avx512}", nan="any",
                         names=("vector pass", "fadev.round"))
