"""Emulated-precision attention forward on the GPU (cuda/emu_forward.cu) against the C core, bit for bit.

For one policy and one tiling the GPU must give the CPU's bits (docs/numerics.md): presets at several formats,
one-stage-lowered policies, tilings (blocks larger than the kernel's shared-memory chunk too), causal with
Nq != Nk, grouped-query heads, rtz and stochastic rounding, both loop orders, eager normalisation, the exp2
form. NaN payloads are not compared (the GPU's NaN is canonical). The one documented exception: stages in
fp64 take CUDA's exp/log, which may differ from glibc's in the last bit, so the golden policy is compared to
a few fp64 ulps and the fraction of differing elements is reported.

Skipped without a CUDA device (fadev.cuda_available() is False), as in CI.
"""
import numpy as np
import pytest

import fadev
import helpers
from fadev.policy import STAGES, Policy
from helpers import make_qkv, needs_gpu

pytestmark = [pytest.mark.gpu, needs_gpu]

PRESETS = ("paper", "naive", "fa2", "fa1", "torch_math")
FORMATS = ("bf16", "fp16", "fp8_e4m3", "tf32", "fp32")


def differing(a, b):
    """How many elements differ in bits (any NaN equals any NaN: the GPU's NaN is canonical)."""
    return helpers.count_differing(a, b, nan="any")


def run_both(kind, q, k, v, policy, **kw):
    fn = fadev.flash_attention if kind == "flash" else fadev.baseline_attention
    cpu = fn(q, k, v, policy, return_lse=True, **kw)
    gpu = fn(q, k, v, policy, return_lse=True, device="cuda", **kw)
    return cpu, gpu


def assert_same(kind, q, k, v, policy, **kw):
    (co, cl), (go, gl) = run_both(kind, q, k, v, policy, **kw)
    assert isinstance(go, np.ndarray) and go.shape == co.shape and gl.shape == cl.shape
    n_out, n_lse = differing(go, co), differing(gl, cl)
    assert n_out == 0 and n_lse == 0, (f"{kind} {policy} {kw} shapes q{q.shape} k{k.shape}: {n_out} out and "
                                       f"{n_lse} lse elements differ from the CPU")


@pytest.mark.parametrize("kind", ["flash", "baseline"])
@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("fmt", FORMATS)
def test_presets_match_cpu_bits(kind, preset, fmt):
    q, k, v = make_qkv(1, 1, 2, 2, 150, 150, 64, spread=2.0)
    assert_same(kind, q, k, v, Policy.preset(preset, fmt), causal=False)


@pytest.mark.parametrize("stage", [s for s in STAGES if s != "input"])
@pytest.mark.parametrize("fmt", ["bf16", "fp8_e5m2"])
def test_one_stage_lowered_matches_cpu_bits(stage, fmt):
    pol = Policy.fa2("fp32").replace(**{stage: fmt})
    q, k, v = make_qkv(2, 1, 2, 1, 97, 131, 32, spread=3.0)
    assert_same("flash", q, k, v, pol, causal=True, block_q=32, block_kv=48)
    if stage not in ("rescale", "out_acc", "state"):
        assert_same("baseline", q, k, v, pol, causal=True)


@pytest.mark.parametrize("block_kv", [1, 16, 64, 65, 200, 1000])
@pytest.mark.parametrize("causal", [False, True])
def test_tilings_match_cpu_bits(block_kv, causal):
    """Blocks past the kernel's 64-key chunk recompute their scores; same bits either way."""
    q, k, v = make_qkv(3, 2, 2, 2, 130, 300, 40)
    assert_same("flash", q, k, v, Policy.paper("bf16"), causal=causal, block_q=64, block_kv=block_kv)


@pytest.mark.parametrize("Nq,Nk", [(1, 1), (77, 200), (200, 77), (257, 257)])
@pytest.mark.parametrize("heads", [(4, 2), (3, 1), (2, 2)])
def test_shapes_causal_gqa_match_cpu_bits(Nq, Nk, heads):
    H, Hkv = heads
    q, k, v = make_qkv(4, 2, H, Hkv, Nq, Nk, 24)
    for kind in ("flash", "baseline"):
        assert_same(kind, q, k, v, Policy.naive("bf16"), causal=True)
        assert_same(kind, q, k, v, Policy.fa2("fp16"), causal=False)


@pytest.mark.parametrize("rounding", ["rtz", "stochastic"])
@pytest.mark.parametrize("preset", ["paper", "fa1"])
def test_rounding_modes_match_cpu_bits(rounding, preset):
    pol = Policy.preset(preset, "bf16").replace(rounding=rounding, seed=2**63 + 17)
    q, k, v = make_qkv(5, 1, 2, 1, 90, 120, 16, spread=2.0)
    for kind in ("flash", "baseline"):
        assert_same(kind, q, k, v, pol, causal=True)


@pytest.mark.parametrize("options", [dict(loop_order="kv_outer"), dict(normalize="eager"), dict(exp="exp2"),
                                     dict(loop_order="kv_outer", normalize="eager", exp="exp2")])
def test_flash_options_match_cpu_bits(options):
    pol = Policy.paper("fp16").replace(state="fp8_e4m3")
    q, k, v = make_qkv(6, 1, 2, 2, 100, 100, 64)
    assert_same("flash", q, k, v, pol, causal=True, block_q=16, block_kv=32, **options)


@pytest.mark.parametrize("D", [1, 100, 256])
def test_head_dims_match_cpu_bits(D):
    q, k, v = make_qkv(7, 1, 1, 1, 70, 90, D)
    for kind in ("flash", "baseline"):
        assert_same(kind, q, k, v, Policy.paper("bf16"))
        assert_same(kind, q, k, v, Policy.torch_math("fp16"))


def test_float_tier_fallback_matches_cpu_bits():
    """Tiny k makes q.k products fall below fp32's normals: the GPU must leave the float tier."""
    q, k, v = make_qkv(8, 1, 2, 2, 64, 64, 32)
    k = k * 1e-20
    v[0, 1] *= 1e-30
    for kind in ("flash", "baseline"):
        assert_same(kind, q, k, v, Policy.fa2("bf16"))


def test_nan_and_inf_inputs_match_cpu():
    q, k, v = make_qkv(9, 1, 2, 2, 40, 40, 8)
    q[0, 0, 3, 2] = np.nan
    k[0, 1, 5, 1] = np.inf
    v[0, 0, 7, 0] = -np.inf
    for kind in ("flash", "baseline"):
        assert_same(kind, q, k, v, Policy.paper("bf16"))


@pytest.mark.parametrize("kind", ["flash", "baseline"])
def test_golden_within_fp64_ulps(kind):
    """fp64 stages take CUDA's exp/log: equal to glibc's in nearly every element, never far."""
    q, k, v = make_qkv(10, 2, 4, 2, 256, 256, 64)
    (co, cl), (go, gl) = run_both(kind, q, k, v, "golden", causal=True)
    assert np.max(np.abs(go - co)) <= 1e-14 * np.max(np.abs(co))
    assert np.max(np.abs(gl - cl)) <= 1e-14 * np.max(np.abs(cl))
    frac = differing(go, co) / co.size
    print(f"golden {kind}: {frac:.2%} of outputs differ in bits from the CPU (CUDA vs glibc exp/log)")
    assert frac < 0.5


def test_gpu_deterministic():
    q, k, v = make_qkv(11, 1, 4, 4, 200, 200, 64)
    a = fadev.flash_attention(q, k, v, "paper:bf16", device="cuda")
    b = fadev.flash_attention(q, k, v, "paper:bf16", device="cuda")
    assert differing(a, b) == 0


def rounding_hazards(fmt, shape, seed):
    """fp64 inputs at the edges of rounding to ``fmt`` (bf16 or fp16), in random order, signs and binades: its
    nearest-even ties exactly, ties nudged by 2^-40 of the value either way (rounding through fp32 first puts those
    on the tie, and to even: double rounding), the same in the format's subnormals, values past fp32's exponent
    range, and fp64 subnormals. Every value rounds to a finite value in fmt."""
    rng = np.random.default_rng(seed)
    p, emin = {"bf16": (8, -126), "fp16": (11, -14)}[fmt]
    n = int(np.prod(shape))
    frac = rng.integers(0, 2 ** (p - 1), n) * 2.0 ** (1 - p)               # a value of fmt in [1, 2)
    tie = 1 + frac + 2.0 ** -p                                              # half-way to the next one
    nudge = rng.choice([-1.0, 0.0, 1.0], n) * 2.0 ** -40
    x = (tie + nudge) * 2.0 ** rng.integers(-6, 7, n)
    sub = rng.random(n) < 0.15                                              # fmt's subnormals: the same, scaled
    x[sub] = ((rng.integers(0, 64, sub.sum()) + 0.5) * (1 + nudge[sub])) * 2.0 ** (emin - p + 1)
    x[rng.random(n) < 0.03] = 1e-310                                        # fp64 subnormals: 0 in fmt
    if fmt == "bf16":
        x[rng.random(n) < 0.03] = 2.0 ** -160 * 3                           # below fp32's subnormals: 0 too
    return (x * rng.choice([-1.0, 1.0], n)).reshape(shape)


@pytest.mark.parametrize("fmt", ["bf16", "fp16"])
@pytest.mark.parametrize("preset", ["fa2", "paper", "naive"])
def test_inputs_rounding_hazards_match_cpu_bits(fmt, preset):
    """The inputs' rounding (cuda/emu_inputs.cu: bf16 and fp16 inputs by round to odd at fp32 and the format's
    conversion) on values where rounding through fp32 would differ: the outputs (fast path) and the rounded values
    (with one key, out = R(v) for paper, up to a zero's sign: its O chain starts at +0) are the CPU's."""
    shape = (1, 2, 70, 40)
    q, k, v = (rounding_hazards(fmt, shape, seed) for seed in (31, 32, 33))
    through_fp32 = fadev.round(v.astype(np.float32).astype(np.float64), fmt)
    assert differing(fadev.round(v, fmt), through_fp32) > 100, "the inputs must hold double-rounding cases"
    policy = Policy.preset(preset, fmt)
    for kind in ("flash", "baseline"):
        assert_same(kind, q, k, v, policy, causal=True)
    one = v[:, :, :1]
    out = fadev.flash_attention(q, k[:, :, :1], one, Policy.paper(fmt), device="cuda")
    assert np.array_equal(out, np.broadcast_to(fadev.round(one, fmt), out.shape))


def offset_view(x, torch):
    """x as a contiguous float64 CUDA tensor whose data starts 8 bytes into its storage: 8-byte aligned, not 16."""
    base = torch.zeros(x.size + 1, dtype=torch.float64, device="cuda")
    base[1:] = torch.from_numpy(x.reshape(-1)).cuda()
    view = base[1:].view(x.shape)
    assert view.data_ptr() % 16 == 8
    return view


@pytest.mark.parametrize("preset", ["fa2", "naive"])
def test_inputs_in_pairs_and_one_by_one_match_cpu_bits(preset):
    """The inputs' rounding reads two values a load where D is even and the inputs 16-byte aligned, else one
    (cuda/emu_inputs.cu): inputs 8 bytes off (a view into a larger tensor), an odd D, and the aligned even D, with
    non-finite values in one head (its magnitudes) and rounding hazards, all give the CPU's bits."""
    torch = pytest.importorskip("torch")
    for D in (40, 33):
        q, k, v = (rounding_hazards("bf16", (1, 3, 70, D), seed) for seed in (41, 42, 43))
        v[0, 2, 5, 3] = np.inf
        policy = Policy.preset(preset, "bf16")
        fn = fadev.flash_attention if preset == "fa2" else fadev.baseline_attention
        co, cl = fn(q, k, v, policy, causal=True, return_lse=True)
        for place in ("aligned", "offset"):
            if place == "aligned":
                tq, tk, tv = (torch.from_numpy(x).cuda() for x in (q, k, v))
            else:
                tq, tk, tv = (offset_view(x, torch) for x in (q, k, v))
            go, gl = fn(tq, tk, tv, policy, causal=True, return_lse=True)
            n_out, n_lse = differing(go.cpu().numpy(), co), differing(gl.cpu().numpy(), cl)
            assert n_out == 0 and n_lse == 0, f"{preset} D {D} {place}: {n_out} out, {n_lse} lse elements differ"


def test_many_heads_magnitudes_match_cpu_bits():
    """The magnitudes' records are folded by each head's last block, with per-device counters that every call
    leaves at 0 (cuda/emu_inputs.cu): more heads than the counters first hold (they grow), then fewer, then the
    first shape again with an infinite V value at a key rows 0 and 1 do not see. Its head must go to the generic
    launch: the fast path's +0 products (P of a masked key) times inf would make those rows NaN, so records left
    from the first call (all finite) would change the outputs. Every output the CPU's."""
    q, k, v = make_qkv(51, 1, 1500, 1500, 3, 5, 4)
    small = make_qkv(52, 2, 4, 2, 60, 60, 16)
    w = v.copy()
    w[0, 7, 4, 0] = np.inf  # causal, bottom-right: row i sees keys 0 .. i + 2
    for qq, kk, vv in ((q, k, v), small, (q, k, w)):
        for kind in ("flash", "baseline"):
            assert_same(kind, qq, kk, vv, Policy.fa2("bf16"), causal=True)
    out = fadev.flash_attention(q, k, w, "fa2:bf16", causal=True, device="cuda")
    assert np.isfinite(out[0, 7, :2, 0]).all() and not np.isfinite(out[0, 7, 2, 0]), "the inf must be where it matters"


@pytest.mark.parametrize("D", [64, 100])
@pytest.mark.parametrize("fmt", ["bf16", "fp16"])
@pytest.mark.parametrize("preset", ["fa2", "paper", "naive"])
def test_non_finite_q_in_one_row_tile_matches_cpu_bits(D, fmt, preset):
    """Heads of several row tiles (128 rows at D 64, 64 at D 100; odd row counts) whose Q has a NaN in one row, a value
    that overflows the format (fp16: 7e4) in another, an infinite K value, and heads with none, causal and not: the
    fast launch computes the finite heads and the generic launch the others (emu_head_finite), and every output is
    the CPU's; the rows without a non-finite value are finite."""
    q, k, v = make_qkv(61, 1, 4, 2, 333, 301, D)
    q[0, 0, 150, 3] = np.nan          # one row tile of head 0
    q[0, 1, 20, 0] = 7e4 if fmt == "fp16" else 1e39  # overflows the format: inf once rounded
    k[0, 1, 7, 2] = np.inf            # heads 2 and 3 (K/V head 1)
    policy = Policy.preset(preset, fmt)
    for causal in (False, True):
        for kind in ("flash", "baseline"):
            assert_same(kind, q, k, v, policy, causal=causal)
        fn = fadev.baseline_attention if preset == "naive" else fadev.flash_attention
        out = fn(q, k, v, policy, causal=causal, device="cuda")
        clean = np.ones(out.shape[:3], bool)
        clean[0, 0, 150] = clean[0, 1, 20] = False
        assert np.isfinite(out[0, :2][clean[0, :2]]).all(), f"{preset} {fmt} D {D} causal={causal}"
