"""Emulated-precision attention backward on the GPU (cuda/emu_backward.cu) against the C core, bit for bit.

For one policy and one tiling the GPU must give the CPU's dq, dk, dv bits (docs/numerics.md "Backward"): presets
at bf16, fp16 and fp8_e4m3, each backward stage lowered on its own, rtz and stochastic rounding, tilings (ragged
blocks included), causal with Nq > Nk and Nq < Nk, grouped-query heads, head dims 1 to 100, the fallback from
the fp32 tier, NaN/inf inputs, and the chunked schedule (FADEV_CUDA_SCRATCH_BYTES makes a small problem span
many scratch chunks). out and lse come from the CPU forward; both backward runs read the same ones. NaN
payloads are not compared (the GPU's NaN is canonical). The one documented exception: fp64 stages take CUDA's
exp, which may differ from glibc's in the last bit, so the golden policy is compared to 1e-14 relative and the
fraction of differing elements is reported.

Skipped without a CUDA device (fadev.cuda_available() is False), as in CI, except the CPU-side error test.
"""
import numpy as np
import pytest

import fadev
import helpers
from fadev.policy import BACKWARD_STAGES, Policy
from helpers import make_inputs, needs_gpu


def gpu(test):
    """Marks a test `gpu` and skips it where no CUDA device is usable (CI)."""
    return needs_gpu(pytest.mark.gpu(test))


PRESETS = ("paper", "naive", "fa2", "fa1", "efficient", "cudnn", "torch_math")
FORMATS = ("bf16", "fp16", "fp8_e4m3")
GRADS = ("dq", "dk", "dv")


def differing(a, b):
    """How many elements differ in bits (any NaN equals any NaN: the GPU's NaN is canonical)."""
    return helpers.count_differing(a, b, nan="any")


def run_both(kind, q, k, v, dout, policy, causal=False, scale=None, **tiles):
    """(cpu, gpu) gradient triples of one backward call; out and lse from the CPU forward of the same policy."""
    pol = fadev.policy.as_policy(policy)
    if kind == "flash":
        out, lse = fadev.flash_attention(q, k, v, pol, causal=causal, scale=scale, return_lse=True, **tiles)
        fn = fadev.flash_attention_backward
    else:
        out, lse = fadev.baseline_attention(q, k, v, pol, causal=causal, scale=scale, return_lse=True)
        fn = fadev.baseline_attention_backward
    cpu = fn(q, k, v, out, lse, dout, pol, causal=causal, scale=scale, **tiles)
    gpu = fn(q, k, v, out, lse, dout, pol, causal=causal, scale=scale, device="cuda", **tiles)
    return cpu, gpu


def assert_same(kind, q, k, v, dout, policy, causal=False, **tiles):
    cpu, gpu = run_both(kind, q, k, v, dout, policy, causal=causal, **tiles)
    context = (f"{kind} {fadev.policy.as_policy(policy)} bwd={fadev.policy.as_policy(policy).stages(True)} "
               f"causal={causal} tiles={tiles} q{q.shape} k{k.shape}")
    for name, g, c in zip(GRADS, gpu, cpu):
        assert isinstance(g, np.ndarray) and g.shape == c.shape, f"{name}: {type(g)} {np.shape(g)}\n  {context}"
        helpers.assert_same_bits(g, c, name, context, nan="any", names=("GPU", "CPU"))


@gpu
@pytest.mark.parametrize("kind", ["flash", "baseline"])
@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("causal", [False, True])
def test_presets_match_cpu_bits(kind, preset, fmt, causal):
    q, k, v, dout = make_inputs(1, 1, 2, 2, 90, 110, 32, spread=2.0)
    tiles = {"block_q": 32, "block_kv": 48} if kind == "flash" else {}
    assert_same(kind, q, k, v, dout, Policy.preset(preset, fmt), causal=causal, **tiles)


@gpu
@pytest.mark.parametrize("kind", ["flash", "baseline"])
def test_golden_within_fp64_ulps(kind):
    """fp64 stages take CUDA's exp: equal to glibc's in nearly every element, never far."""
    q, k, v, dout = make_inputs(2, 2, 4, 2, 130, 150, 64)
    tiles = {"block_q": 64, "block_kv": 32} if kind == "flash" else {}
    cpu, gpu = run_both(kind, q, k, v, dout, "golden", causal=True, **tiles)
    for name, g, c in zip(GRADS, gpu, cpu):
        assert np.max(np.abs(g - c)) <= 1e-14 * np.max(np.abs(c)), name
        print(f"golden {kind} {name}: {differing(g, c) / c.size:.2%} of elements differ in bits from the CPU")


@gpu
@pytest.mark.parametrize("stage", BACKWARD_STAGES)
@pytest.mark.parametrize("fmt", ["bf16", "fp8_e5m2"])
def test_one_backward_stage_lowered_matches_cpu_bits(stage, fmt):
    pol = Policy.fa2("fp32").replace(**{stage: fmt})
    q, k, v, dout = make_inputs(3, 1, 2, 1, 97, 131, 32, spread=3.0)
    assert_same("flash", q, k, v, dout, pol, causal=True, block_q=32, block_kv=48)
    assert_same("baseline", q, k, v, dout, pol, causal=True)


@gpu
@pytest.mark.parametrize("scale", [None, 0.3])
def test_scale_on_ds_matches_cpu_bits(scale):
    """bwd_scale "ds" (the efficient preset's): the scale multiplies each dS (event 22, rounded to dsoft) and not
    the sums; with a narrow dsoft every one of those roundings counts, stochastic included."""
    q, k, v, dout = make_inputs(6, 1, 2, 1, 70, 90, 24, spread=2.0)
    for pol in (Policy.efficient("fp16"), Policy.fa2("fp32").replace(dsoft="bf16", bwd_scale="ds"),
                # not golden: fp64 stages take CUDA's exp/log, whose last bits differ from the CPU's (numerics.md)
                Policy.fa2("fp32").replace(dsoft="bf16", bwd_scale="ds", rounding="stochastic", seed=11)):
        for kind, tiles in (("flash", {"block_q": 32, "block_kv": 48}), ("baseline", {})):
            cpu, gpu = run_both(kind, q, k, v, dout, pol, causal=True, scale=scale, **tiles)
            for name, g, c in zip(GRADS, gpu, cpu):
                helpers.assert_same_bits(g, c, name, f"{kind} {pol} scale={scale}", nan="any", names=("GPU", "CPU"))


@gpu
@pytest.mark.parametrize("rounding", ["rtz", "stochastic"])
@pytest.mark.parametrize("preset", ["paper", "fa2", "naive", "efficient"])
def test_rounding_modes_match_cpu_bits(rounding, preset):
    pol = Policy.preset(preset, "bf16").replace(rounding=rounding, seed=2**63 + 17)
    q, k, v, dout = make_inputs(4, 1, 4, 2, 90, 120, 40, spread=2.0)  # D = 40: two slices of the pair kernel
    for causal in (False, True):
        assert_same("flash", q, k, v, dout, pol, causal=causal, block_q=16, block_kv=40)
        assert_same("baseline", q, k, v, dout, pol, causal=causal)


@gpu
@pytest.mark.parametrize("block_q", [1, 16, 64, 128])
@pytest.mark.parametrize("block_kv", [1, 16, 64, 128])
def test_tilings_match_cpu_bits(block_q, block_kv):
    """Ragged last blocks (100 rows, 130 keys), blocks of one row / key, and blocks larger than N."""
    q, k, v, dout = make_inputs(5, 1, 2, 2, 100, 130, 16)
    for causal in (False, True):
        assert_same("flash", q, k, v, dout, Policy.paper("bf16"), causal=causal, block_q=block_q, block_kv=block_kv)


@gpu
@pytest.mark.parametrize("Nq,Nk", [(1, 1), (77, 200), (200, 77), (129, 129)])
@pytest.mark.parametrize("heads", [(4, 2), (3, 1), (2, 2)])
def test_shapes_causal_gqa_match_cpu_bits(Nq, Nk, heads):
    """Causal with Nq > Nk leaves rows that see no key (dq = 0); grouped-query K/V sum over their heads."""
    H, Hkv = heads
    q, k, v, dout = make_inputs(6, 2, H, Hkv, Nq, Nk, 24)
    for kind in ("flash", "baseline"):
        tiles = {"block_q": 32, "block_kv": 16} if kind == "flash" else {}
        assert_same(kind, q, k, v, dout, Policy.naive("bf16"), causal=True, **tiles)
        assert_same(kind, q, k, v, dout, Policy.fa2("fp16"), causal=False, **tiles)


@gpu
@pytest.mark.parametrize("D", [1, 16, 64, 100])
def test_head_dims_match_cpu_bits(D):
    q, k, v, dout = make_inputs(7, 1, 2, 1, 70, 90, D)
    for kind in ("flash", "baseline"):
        tiles = {"block_q": 32, "block_kv": 32} if kind == "flash" else {}
        assert_same(kind, q, k, v, dout, Policy.paper("bf16"), causal=True, **tiles)
        assert_same(kind, q, k, v, dout, Policy.torch_math("fp16"), **tiles)


@gpu
@pytest.mark.parametrize("exp", ["exp", "exp2"])
def test_exp_forms_match_cpu_bits(exp):
    q, k, v, dout = make_inputs(8, 1, 2, 2, 64, 80, 32)
    assert_same("flash", q, k, v, dout, Policy.paper("fp16"), causal=True, block_q=16, block_kv=32, exp=exp)


@gpu
@pytest.mark.parametrize("product", ["scores", "dP"])
def test_float_tier_fallback_matches_cpu_bits(product):
    """Products of about 2^-140, below fp32's normals, are not exact in fp32: the GPU must leave the fp32 tier of
    that dot product (q.k for the scores, dO.v for dP), whose fp32 sums are then subnormals. The policy makes
    their last bits visible: scores times 2^135 in fp64 (and fp32 gradients), or the softmax backward and the
    gradients in fp64."""
    q, k, v, dout = make_inputs(9, 1, 2, 2, 64, 64, 32)
    tiny = 2.0**-70
    if product == "scores":
        pol, scale = Policy.torch_math("bf16").replace(score="fp64", grad="fp32"), 2.0**135
        q, k = q * tiny, k * tiny
    else:
        wide = dict.fromkeys(("dsoft", "ds", "grad_acc", "dq_acc", "dkv_acc", "grad"), "fp64")
        pol, scale = Policy.torch_math("bf16").replace(**wide), None
        v, dout = v * tiny, dout * tiny
    for causal in (False, True):
        assert_same("flash", q, k, v, dout, pol, causal=causal, scale=scale, block_q=16, block_kv=16)
        assert_same("baseline", q, k, v, dout, pol, causal=causal, scale=scale)


@gpu
def test_nan_and_inf_inputs_match_cpu():
    q, k, v, dout = make_inputs(10, 1, 2, 2, 40, 40, 8)
    q[0, 0, 3, 2] = np.nan
    k[0, 1, 5, 1] = np.inf
    v[0, 0, 7, 0] = -np.inf
    dout[0, 1, 9, 4] = np.nan
    for kind in ("flash", "baseline"):
        assert_same(kind, q, k, v, dout, Policy.paper("bf16"))


@gpu
@pytest.mark.parametrize("scratch_rows", [1, 7, 45, 200])
def test_chunked_schedule_matches_cpu_bits(monkeypatch, scratch_rows):
    """A scratch budget of a few (K/V head, query row) pairs: the dK/dV chains and their block sums run on
    across chunks (chunk boundaries inside query blocks and heads), dq rows are finished chunk by chunk."""
    B, H, Hkv, Nq, Nk, D = 2, 4, 2, 45, 50, 8
    monkeypatch.setenv("FADEV_CUDA_SCRATCH_BYTES", str(scratch_rows * Nk * 16))
    q, k, v, dout = make_inputs(11, B, H, Hkv, Nq, Nk, D)
    pol = Policy.paper("bf16").replace(rounding="stochastic", seed=5)
    for causal in (False, True):
        assert_same("flash", q, k, v, dout, pol, causal=causal, block_q=16, block_kv=8)
        assert_same("baseline", q, k, v, dout, pol, causal=causal)


@gpu
def test_gpu_deterministic():
    q, k, v, dout = make_inputs(12, 1, 4, 4, 200, 200, 64)
    out, lse = fadev.flash_attention(q, k, v, "fa2:bf16", return_lse=True)
    a = fadev.flash_attention_backward(q, k, v, out, lse, dout, "fa2:bf16", device="cuda")
    b = fadev.flash_attention_backward(q, k, v, out, lse, dout, "fa2:bf16", device="cuda")
    assert all(differing(x, y) == 0 for x, y in zip(a, b))


@gpu
def test_validation_errors_before_any_device_work():
    """The C entry points validate like the CPU's (ValueError through the binding) before touching memory."""
    from fadev import _core
    from fadev.cuda import DeviceArray
    q, k, v, dout = make_inputs(13, 1, 3, 2, 8, 8, 4)
    pol = Policy.paper("bf16")
    qd, kd, vd, dd = (DeviceArray.from_numpy(x) for x in (q, k, v, dout))
    lse = DeviceArray((1, 3, 8))
    dq, dk, dv = DeviceArray(q.shape), DeviceArray(k.shape), DeviceArray(v.shape)
    shape = (1, 3, 2, 8, 8, 4)  # 3 heads over 2 K/V heads
    call = (pol._c, pol._c_backward, None, 0.5, False, 4, 4, 0, 0, 0)  # fadev._args.Call.c
    args = (qd.ptr, kd.ptr, vd.ptr, qd.ptr, lse.ptr, dd.ptr, dq.ptr, dk.ptr, dv.ptr)
    for kernel in (_core.cuda_baseline_attention_backward, _core.cuda_flash_attention_backward):
        with pytest.raises(ValueError, match="cuda"):
            kernel(*args, shape, call)
    good = (1, 3, 1, 8, 8, 4)
    zero_block_q = call[:5] + (0,) + call[6:]  # block_q = 0: flash refuses, baseline ignores it
    with pytest.raises(ValueError, match="cuda"):
        _core.cuda_flash_attention_backward(*args, good, zero_block_q)
    with pytest.raises(ValueError, match="cuda"):
        _core.cuda_baseline_attention_backward(*args[:6], 0, dk.ptr, dv.ptr, good, zero_block_q)


@pytest.mark.skipif(fadev.cuda_available(), reason="checks the error without a GPU")
def test_backward_on_cuda_without_gpu_raises():
    q, k, v, dout = make_inputs(14, 1, 1, 1, 4, 4, 4)
    out, lse = fadev.flash_attention(q, k, v, "paper:bf16", return_lse=True)
    with pytest.raises(RuntimeError, match="GPU"):
        fadev.flash_attention_backward(q, k, v, out, lse, dout, "paper:bf16", device="cuda")
    with pytest.raises(RuntimeError, match="GPU"):
        fadev.baseline_attention_backward(q, k, v, out, lse, dout, "paper:bf16", device="cuda")
