"""fadev.baseline_attention / fadev.flash_attention / fadev.random_qkv: the Python API, its validation,
the C entry points' status codes, thread-count independence, and the golden (fp64) kernels against an
independent NumPy float64 attention. Bit parity with the slow twin lives in test_attention.py."""
import ctypes
import inspect
import math

import numpy as np
import pytest

import fadev
import helpers
from helpers import identical as same_bits
from helpers import CPolicy, Format, Params
from fadev import Policy
from fadev.attention import sram_tiles
from helpers import numpy_attention, rel_err


@pytest.fixture
def qkv():
    return fadev.random_qkv((2, 4, 33, 16), seed=11, heads_kv=2, seq_kv=41)


# ---------------------------------------------------------------- validation (Python layer)

def test_rank_errors(qkv):
    q, k, v = qkv
    with pytest.raises(ValueError, match="q: expected a 2-D"):
        fadev.baseline_attention(q[0, 0, 0], k, v, "golden")
    with pytest.raises(ValueError, match="k: expected a 2-D"):
        fadev.flash_attention(q, k[None], v, "golden")
    with pytest.raises(ValueError, match="same rank.*q 3-D, k 4-D"):
        fadev.baseline_attention(q[0], k, v, "golden")


@pytest.mark.parametrize("fn", [fadev.baseline_attention, fadev.flash_attention])
def test_shape_errors(qkv, fn):
    q, k, v = qkv
    with pytest.raises(ValueError, match="head dim 8 does not match q's head dim 16"):
        fn(q, k[..., :8], v[..., :8], "golden")
    with pytest.raises(ValueError, match=r"k and v must have the same shape.*\(2, 2, 41, 16\).*\(2, 2, 40, 16\)"):
        fn(q, k, v[:, :, :40], "golden")
    with pytest.raises(ValueError, match="4 heads, not a multiple of k/v's 3 heads"):
        fn(q, np.concatenate([k, k[:, :1]], 1), np.concatenate([v, v[:, :1]], 1), "golden")
    with pytest.raises(ValueError, match="k: batch 1 does not match q's batch 2"):
        fn(q, k[:1], v[:1], "golden")
    with pytest.raises(ValueError, match=r"every dimension must be >= 1, got shape \(2, 4, 0, 16\)"):
        fn(q[:, :, :0], k, v, "golden")
    with pytest.raises(ValueError, match=r"v: every dimension must be >= 1"):
        fn(q, k, v[:, :, :0], "golden")
    big = np.zeros((1, 4, 257))
    with pytest.raises(ValueError, match="head dim D must be <= 256, got 257"):
        fn(big, big, big, "golden")


@pytest.mark.parametrize("fn", [fadev.baseline_attention, fadev.flash_attention])
def test_argument_errors(qkv, fn):
    q, k, v = qkv
    with pytest.raises(ValueError, match="scale must be finite, got inf"):
        fn(q, k, v, "golden", scale=math.inf)
    with pytest.raises(ValueError, match="scale must be finite, got nan"):
        fn(q, k, v, "golden", scale=float("nan"))
    with pytest.raises(TypeError, match="scale must be a real number"):
        fn(q, k, v, "golden", scale="0.5")
    with pytest.raises(TypeError, match="causal must be a bool"):
        fn(q, k, v, "golden", causal="yes")
    with pytest.raises(ValueError, match="preset: unknown preset 'gold'"):
        fn(q, k, v, "gold")
    with pytest.raises(ValueError, match="unknown format 'bf17'"):
        fn(q, k, v, "fa2:bf17")
    with pytest.raises(TypeError, match="policy: expected a fadev.Policy"):
        fn(q, k, v, 3)
    with pytest.raises(TypeError, match="q: expected a real numeric array, got dtype <U1"):
        fn(np.full((4, 4), "a"), k, v, "golden")
    with pytest.raises(TypeError, match="v: expected a real numeric array, got dtype complex128"):
        fn(q, k, v.astype(complex), "golden")


def test_flash_option_errors(qkv):
    q, k, v = qkv
    for name, bad in (("block_q", 0), ("block_kv", -3), ("block_q", 2.5), ("block_kv", True), ("block_q", 2**31)):
        with pytest.raises(ValueError, match=f"{name} must be a positive integer.*got {bad!r}"):
            fadev.flash_attention(q, k, v, "golden", **{name: bad})
    for name, bad in (("loop_order", "inner"), ("normalize", "lazy"), ("exp", "exp10")):
        with pytest.raises(ValueError, match=f"{name} must be one of .* got {bad!r}"):
            fadev.flash_attention(q, k, v, "golden", **{name: bad})
    with pytest.raises(ValueError, match="sram_bytes=4096 derives block_q and block_kv"):
        fadev.flash_attention(q, k, v, "golden", sram_bytes=4096, block_kv=16)
    with pytest.raises(ValueError, match="sram_bytes must be a positive integer.*got 0"):
        fadev.flash_attention(q, k, v, "golden", sram_bytes=0)


def test_stochastic_length_limit():
    q = np.zeros((2**21, 1))
    k = np.zeros((3, 1))
    sr = Policy.paper("bf16").replace(rounding="stochastic")
    with pytest.raises(ValueError, match=r"stochastic rounding needs sequence lengths < 2\^21.*seq_q=2097152"):
        fadev.flash_attention(q, k, k, sr)
    with pytest.raises(ValueError, match="seq_kv=2097152"):
        fadev.baseline_attention(k, q, q, sr)


def test_random_qkv_errors():
    with pytest.raises(ValueError, match="dist must be one of normal, uniform, outlier, got 'cauchy'"):
        fadev.random_qkv((4, 8), dist="cauchy")
    with pytest.raises(ValueError, match=r"shape must be \(N, D\).*got \(8,\)"):
        fadev.random_qkv((8,))
    with pytest.raises(ValueError, match="heads_kv must divide q's 4 heads, got 3"):
        fadev.random_qkv((4, 8, 8), heads_kv=3)
    with pytest.raises(ValueError, match="heads_kv needs a heads axis"):
        fadev.random_qkv((8, 8), heads_kv=1)
    with pytest.raises(ValueError, match="seq_kv must be a positive integer"):
        fadev.random_qkv((8, 8), seq_kv=0)
    with pytest.raises(ValueError, match="seed must be a non-negative integer"):
        fadev.random_qkv((8, 8), seed=-1)


# ---------------------------------------------------------------- the binding and the C status codes

def test_binding_errors(qkv):
    q, k, v = qkv
    pol = Policy.golden()._c
    core = fadev._core
    with pytest.raises(ValueError, match="flash_attention: invalid argument"):
        core.flash_attention(q, k, v, (pol, None, None, 0.25, False, 0, 16, 0, 0, 0))
    with pytest.raises(ValueError, match="flash_attention: invalid argument"):
        core.flash_attention(q, k, v, (pol, None, None, 0.25, False, 8, 16, 2, 0, 0))
    with pytest.raises(ValueError, match="baseline_attention: invalid argument"):
        core.baseline_attention(q, k, v, (pol, None, None, math.nan, False, 0, 0, 0, 0, 0))
    with pytest.raises(ValueError, match="baseline_attention: shape mismatch"):
        core.baseline_attention(q[:, :3], k, v, (pol, None, None, 0.25, False, 0, 0, 0, 0, 0))
    with pytest.raises(ValueError, match="baseline_attention: shapes do not agree"):
        core.baseline_attention(q, k[..., :4], v[..., :4], (pol, None, None, 0.25, False, 0, 0, 0, 0, 0))
    with pytest.raises(ValueError, match="must be 4-D"):
        core.baseline_attention(q[0], k[0], v[0], (pol, None, None, 0.25, False, 0, 0, 0, 0, 0))
    with pytest.raises(ValueError, match="invalid rounding mode"):
        core.baseline_attention(q, k, v, (pol[:13] + (9, 0), None, None, 0.25, False, 0, 0, 0, 0, 0))
    with pytest.raises(ValueError, match="fmt: invalid format parameters"):
        bad = ((0, -1, 1, 1, 1, 0, 0.0),) + pol[1:]
        core.baseline_attention(q, k, v, (bad, None, None, 0.25, False, 0, 0, 0, 0, 0))
    with pytest.raises(TypeError, match="policy must be a tuple of 13 format tuples"):
        core.baseline_attention(q, k, v, (pol[:14], None, None, 0.25, False, 0, 0, 0, 0, 0))
    with pytest.raises(TypeError, match="q: expected a real numeric array"):
        core.baseline_attention(object(), k, v, (pol, None, None, 0.25, False, 0, 0, 0, 0, 0))
    with pytest.raises(TypeError, match="baseline_attention: the call spec's policy is None"):
        core.baseline_attention(q, k, v, (None, None, None, 0.25, False, 0, 0, 0, 0, 0))
    with pytest.raises(TypeError, match="flash_attention_backward: the call spec's policy_backward is None"):
        core.flash_attention_backward(q, k, v, q, q[..., 0], q, (pol, None, None, 0.25, False, 8, 8, 0, 0, 0))
    with pytest.raises(TypeError, match="call spec must be a tuple"):
        core.flash_attention(q, k, v, [pol])



def c_status(fn_name, policy=None, **changes):
    """Status of the C entry point on small valid buffers with some params/policy fields changed."""
    lib = ctypes.CDLL(fadev._core.__file__)
    fn = getattr(lib, fn_name)
    fn.restype = ctypes.c_int
    pol = CPolicy(*[Format(*f) for f in (policy or Policy.golden())._c[:13]], *(policy or Policy.golden())._c[13:])
    for name in ("rounding",):
        if name in changes:
            setattr(pol, name, changes.pop(name))
    if "precision" in changes:
        pol.f3.precision = changes.pop("precision")
    pr = Params(1, 2, 1, 4, 5, 8, 0.5, 0, 2, 2, 0, 0, 0)
    buffers = {n: np.zeros(64) for n in ("q", "k", "v", "out", "lse")}
    ptr = {n: b.ctypes.data_as(ctypes.c_void_p) for n, b in buffers.items()}
    for name, value in changes.items():
        if name in ptr:
            ptr[name] = None if value is None else ptr[name]
        else:
            setattr(pr, name, value)
    return fn(ptr["q"], ptr["k"], ptr["v"], ptr["out"], ptr["lse"], ctypes.byref(pr), ctypes.byref(pol))


INVALID_FORMAT, INVALID_MODE, INVALID_ARGUMENT, SHAPE, OVERFLOW, NO_MEMORY = 1, 2, 3, 4, 5, 6


@pytest.mark.parametrize("fn_name", ["fadev_baseline_attention", "fadev_flash_attention"])
def test_c_status_codes(fn_name):
    assert c_status(fn_name) == 0
    assert c_status(fn_name, lse=None) == 0  # lse is optional
    for change in ({"q": None}, {"out": None}, {"dim": 0}, {"dim": 257}, {"batch": 0}, {"seq_kv": 0},
                   {"heads_kv": 0}, {"scale": math.inf}, {"causal": 2}):
        assert c_status(fn_name, **change) == INVALID_ARGUMENT, change
    assert c_status(fn_name, heads_kv=3, heads=2) == SHAPE
    assert c_status(fn_name, rounding=3) == INVALID_MODE
    assert c_status(fn_name, precision=0) == INVALID_FORMAT
    sr = Policy.paper("bf16").replace(rounding="stochastic")
    assert c_status(fn_name, policy=sr, seq_q=2**21) == INVALID_ARGUMENT
    assert c_status(fn_name, batch=2**62, heads=4) == OVERFLOW
    assert c_status(fn_name, batch=2**50) == NO_MEMORY  # 2^61 bytes of rounded Q: larger than any address space


def test_c_flash_only_checks():
    for change in ({"block_q": 0}, {"block_kv": -1}, {"loop_order": 2}, {"normalize": -1}, {"exp_form": 2}):
        assert c_status("fadev_flash_attention", **change) == INVALID_ARGUMENT, change
        assert c_status("fadev_baseline_attention", **change) == 0, change  # baseline has no tiles


# ---------------------------------------------------------------- shapes and defaults

@pytest.mark.parametrize("fn", [fadev.baseline_attention, fadev.flash_attention])
def test_ranks(fn):
    q, k, v = fadev.random_qkv((1, 3, 10, 8), seed=2, seq_kv=7)
    out4, lse4 = fn(q, k, v, "fa2:fp16", return_lse=True)
    assert out4.shape == (1, 3, 10, 8) and lse4.shape == (1, 3, 10)
    out3, lse3 = fn(q[0], k[0], v[0], "fa2:fp16", return_lse=True)
    assert out3.shape == (3, 10, 8) and lse3.shape == (3, 10)
    assert same_bits(out3, out4[0]) and same_bits(lse3, lse4[0])
    out2, lse2 = fn(q[0, 1], k[0, 1], v[0, 1], "fa2:fp16", return_lse=True)
    assert out2.shape == (10, 8) and lse2.shape == (10,)
    assert same_bits(out2, out4[0, 1]) and same_bits(lse2, lse4[0, 1])
    alone = fn(q[0, 1], k[0, 1], v[0, 1], "fa2:fp16")
    assert isinstance(alone, np.ndarray) and same_bits(alone, out2)
    # non-float64 and non-contiguous inputs are converted
    assert same_bits(fn(q[0, 1].astype(np.float32), k[0, 1], v[0, 1], "golden"),
                     fn(q[0, 1].astype(np.float32).astype(np.float64), k[0, 1], v[0, 1], "golden"))
    qt = np.asfortranarray(q[0, 1])
    assert same_bits(fn(qt, k[0, 1], v[0, 1], "golden"), fn(q[0, 1].copy(), k[0, 1], v[0, 1], "golden"))


def test_results_are_values_of_out_and_stats_formats():
    q, k, v = fadev.random_qkv((2, 20, 16), seed=4)
    pol = Policy.paper("fp8_e5m2")
    for fn in (fadev.baseline_attention, fadev.flash_attention):
        out, lse = fn(q, k, v, pol, return_lse=True)
        assert np.array_equal(fadev.round(out, pol.out), out)
        assert np.array_equal(fadev.round(lse, pol.stats), lse)


def test_sram_bytes_rule():
    assert sram_tiles(100 * 1024, 64) == (64, 400)  # Bc = ceil(M / 4d), Br = min(Bc, d)
    assert sram_tiles(1000, 64) == (4, 4)  # ceil(1000 / 256) = 4
    assert sram_tiles(1, 256) == (1, 1)
    q, k, v = fadev.random_qkv((2, 50, 16), seed=5)
    pol = Policy.paper("bf16")
    for m in (200, 1000, 3000):
        br, bc = sram_tiles(m, 16)
        assert same_bits(fadev.flash_attention(q, k, v, pol, sram_bytes=m),
                         fadev.flash_attention(q, k, v, pol, block_q=br, block_kv=bc))


def test_preset_tiling_defaults_are_used():
    q, k, v = fadev.random_qkv((1, 2, 150, 32), seed=6)

    def run(policy, **options):  # out and lse side by side (lse is in the fp32 `stats` format)
        out, lse = fadev.flash_attention(q, k, v, policy, return_lse=True, **options)
        return np.concatenate([out.ravel(), lse.ravel()])

    fa2 = run("fa2:bf16")
    assert same_bits(fa2, run(Policy.fa2("bf16"), block_q=128, block_kv=64, loop_order="q_outer",
                              normalize="deferred", exp="exp2"))
    # and those defaults matter: another block_kv or the exp form changes the bits
    assert not same_bits(fa2, run("fa2:bf16", block_kv=32))
    assert not same_bits(fa2, run("fa2:bf16", exp="exp"))
    fa1 = run("fa1(bf16)")
    assert same_bits(fa1, run(Policy.fa1("bf16"), block_q=128, block_kv=128, loop_order="kv_outer",
                              normalize="eager", exp="exp"))
    assert not same_bits(fa1, run("fa1(bf16)", loop_order="q_outer"))
    assert not same_bits(fa1, run("fa1(bf16)", normalize="deferred"))
    custom = Policy.paper("bf16").replace(block_kv=16, normalize="eager")
    assert same_bits(run(custom), run(Policy.paper("bf16"), block_kv=16, normalize="eager"))
    assert not same_bits(run(custom), run(Policy.paper("bf16")))


def test_masked_rows_and_nonfinite_inputs():
    q, k, v = fadev.random_qkv((1, 12, 8), seed=7, seq_kv=5)
    for fn in (fadev.baseline_attention, fadev.flash_attention):
        out, lse = fn(q, k, v, "fa2:bf16", causal=True, return_lse=True)
        # bottom-right alignment: row i sees keys j <= i - 7; rows 0..6 see none
        assert np.all(out[0, :7] == 0) and np.all(lse[0, :7] == -np.inf)
        assert np.all(np.isfinite(out[0, 7:])) and np.all(np.isfinite(lse[0, 7:]))
        bad = v.copy()
        bad[0, 2, 3] = np.nan
        out = fn(q, k, bad, "golden", causal=True)
        assert np.all(np.isnan(out[0, 9:, 3])) and not np.isnan(out[0, :9]).any()
        assert np.isfinite(np.delete(out[0, 9:], 3, axis=1)).all()


# ---------------------------------------------------------------- determinism and golden accuracy

def test_thread_count_independence():
    q, k, v = fadev.random_qkv((2, 4, 70, 24), seed=8, heads_kv=2, seq_kv=90)
    policies = [Policy.golden(), Policy.fa2("bf16"), Policy.paper("fp16"),
                Policy.paper("bf16").replace(rounding="stochastic", seed=5), Policy.fa1("fp8_e4m3")]
    before = fadev.get_num_threads()
    try:
        results = []
        for threads in (1, 2, 3):
            fadev.set_num_threads(threads)
            row = []
            for pol in policies:
                for causal in (False, True):
                    row.append(fadev.baseline_attention(q, k, v, pol, causal=causal, return_lse=True))
                    row.append(fadev.flash_attention(q, k, v, pol, block_q=16, block_kv=32, causal=causal,
                                                     return_lse=True))
            results.append(row)
    finally:
        fadev.set_num_threads(before)
    for other in results[1:]:
        for (o1, l1), (o2, l2) in zip(results[0], other):
            assert same_bits(o1, o2) and same_bits(l1, l2)


@pytest.mark.parametrize("dist", ["normal", "uniform", "outlier"])
@pytest.mark.parametrize("causal", [False, True])
def test_golden_baseline_matches_numpy_float64(dist, causal):
    q, k, v = fadev.random_qkv((2, 4, 64, 64), dist=dist, seed=9, heads_kv=2, seq_kv=96)
    out, lse = fadev.baseline_attention(q, k, v, "golden", causal=causal, return_lse=True)
    ref_out, ref_lse = numpy_attention(q, k, v, causal=causal)
    assert rel_err(out, ref_out) <= 1e-14
    assert rel_err(lse, ref_lse) <= 1e-14
    out, lse = fadev.baseline_attention(q, k, v, "golden", scale=0.3, return_lse=True)
    ref_out, ref_lse = numpy_attention(q, k, v, scale=0.3)
    assert rel_err(out, ref_out) <= 1e-14 and rel_err(lse, ref_lse) <= 1e-14


def test_golden_flash_matches_golden_baseline_over_tilings():
    q, k, v = fadev.random_qkv((1, 4, 75, 40), dist="outlier", seed=10, heads_kv=1, seq_kv=83)
    for causal in (False, True):
        base, base_lse = fadev.baseline_attention(q, k, v, "golden", causal=causal, return_lse=True)
        for bq, bkv in ((1, 1), (3, 7), (16, 16), (64, 128), (100, 200)):
            for order, norm, exp in (("q_outer", "deferred", "exp"), ("kv_outer", "eager", "exp2"),
                                     ("q_outer", "eager", "exp"), ("kv_outer", "deferred", "exp2")):
                out, lse = fadev.flash_attention(q, k, v, "golden", block_q=bq, block_kv=bkv, loop_order=order,
                                                 normalize=norm, exp=exp, causal=causal, return_lse=True)
                assert rel_err(out, base) <= 1e-13, (causal, bq, bkv, order, norm, exp)
                assert rel_err(lse, base_lse) <= 1e-13, (causal, bq, bkv, order, norm, exp)


# ---------------------------------------------------------------- random_qkv

def test_random_qkv():
    q, k, v = fadev.random_qkv((2, 4, 16, 8), seed=3, heads_kv=2, seq_kv=10)
    assert q.shape == (2, 4, 16, 8) and k.shape == v.shape == (2, 2, 10, 8)
    assert q.dtype == k.dtype == np.float64
    again = fadev.random_qkv((2, 4, 16, 8), seed=3, heads_kv=2, seq_kv=10)
    assert all(same_bits(a, b) for a, b in zip((q, k, v), again))
    other = fadev.random_qkv((2, 4, 16, 8), seed=4, heads_kv=2, seq_kv=10)
    assert not same_bits(q, other[0])
    rng = np.random.Generator(np.random.PCG64(3))
    assert same_bits(q, rng.standard_normal((2, 4, 16, 8)))
    u = fadev.random_qkv((64, 64), dist="uniform", seed=1)[0]
    assert u.min() >= -1 and u.max() < 1 and u.min() < -0.99 and u.max() > 0.99
    b = fadev.random_qkv((64, 64), fmt="bf16", seed=1, dist="outlier")
    assert all(np.array_equal(fadev.round(t, "bf16"), t) for t in b)


def test_random_qkv_outliers():
    q = fadev.random_qkv((1000, 1000), dist="outlier", seed=2)[0]
    # N(0,1) + N(0,100) Bernoulli(0.001): about 1000 outlier entries of std 10; |x| > 6 is (almost) only those
    big = np.count_nonzero(np.abs(q) > 6)
    assert 450 <= big <= 800  # P(|N(0,101)| > 6) ~ 0.55 of the ~1000 hits
    assert 0.95 < q.std() ** 2 / (1 + 100 * 0.001) < 1.05


# ---------------------------------------------------------------- one uniform, keyword-only API

ORDER = ("world_size", "layout", "merge", "causal", "scale", "block_q", "block_kv", "warp_rows", "mma", "sram_bytes",
         "loop_order", "normalize", "exp", "return_lse", "device", "deterministic", "dtype")
KERNELS = {"baseline_attention": ("q", "k", "v", "policy"), "flash_attention": ("q", "k", "v", "policy"),
           "golden_attention": ("q", "k", "v"), "ring_attention": ("q", "k", "v", "policy"),
           "baseline_attention_backward": ("q", "k", "v", "out", "lse", "dout", "policy"),
           "flash_attention_backward": ("q", "k", "v", "out", "lse", "dout", "policy"),
           "ring_attention_backward": ("q", "k", "v", "out", "lse", "dout", "policy"),
           "native_attention": ("q", "k", "v"), "native_attention_backward": ("q", "k", "v", "out", "lse", "dout")}
METRICS = {"compare": ("test", "ref"), "max_abs": ("test", "ref"), "mean_diff": ("test", "ref"),
           "std_diff": ("test", "ref"), "mean_abs": ("test", "ref"), "rmse": ("test", "ref"), "rel_l2": ("test", "ref"),
           "max_rel": ("test", "ref"), "wasserstein": ("a", "b"), "ulp_error": ("test", "ref", "fmt"),
           "ulp_histogram": ("test", "ref", "fmt")}


@pytest.mark.parametrize("name", sorted(KERNELS) + sorted(METRICS))
def test_every_entry_point_has_keyword_only_options_in_one_order(name):
    params = inspect.signature(getattr(fadev, name)).parameters.values()
    positional = tuple(p.name for p in params if p.kind == p.POSITIONAL_OR_KEYWORD)
    keywords = [p.name for p in params if p.kind == p.KEYWORD_ONLY]
    assert positional == {**KERNELS, **METRICS}[name]
    assert not [p for p in params if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD, p.POSITIONAL_ONLY)]
    if name in METRICS:
        assert keywords[-1] == "device", keywords
        return
    assert keywords == [k for k in ORDER if k in keywords], keywords
    assert ("dtype" if name.startswith("native") else "device") in keywords
    assert "causal" in keywords and "scale" in keywords


def test_backends_share_one_call_spec(qkv):
    """fadev.backends: the call spec built once in _args runs the same kernel on the CPU backend and on the GPU
    backend's code path (here over fadev._core, whose methods take what fadev.cuda._Gpu's take); golden is
    the baseline under the golden policy on the CPU, and differs from fa2(bf16)."""
    from fadev import _args, backends
    q, k, v = qkv
    pol = Policy.fa2("bf16")
    call = _args.forward_call(pol, q, False, 0.25, 16, 16)
    out, lse = backends.CPU.forward("flash", q, k, v, call)
    want = fadev.flash_attention(q, k, v, pol, scale=0.25, block_q=16, block_kv=16, return_lse=True)
    assert same_bits(out, want[0]) and same_bits(lse, want[1])
    assert same_bits(backends.Gpu(fadev._core).forward("flash", q, k, v, call)[0], out)
    golden = backends.CPU.forward("golden", q, k, v, call._replace(policy=None))[0]
    assert same_bits(golden, fadev.golden_attention(q, k, v, scale=0.25))
    assert not same_bits(golden, out)
    flash_piece = backends.CPU.pieces(call)[0]
    assert same_bits(flash_piece(q, k, v, pol, False)[0], out)


def test_host_calls_keep_no_plan(qkv):
    """fadev.cuda_plans replays GPU calls only: NumPy arrays and CPU tensors get no plan key, so every such call
    runs the full path (and its checks) each time. (The GPU's replays: tests/test_cuda_plans.py.)"""
    from fadev import cuda_plans
    torch = pytest.importorskip("torch")
    q, k, v = qkv
    cuda_plans.clear()
    for args in ((q, k, v), tuple(torch.from_numpy(x) for x in (q, k, v))):
        assert cuda_plans.replay("cuda_flash_attention", None, "fa2:bf16", (False,), args) == (None, None)
        fadev.flash_attention(*args, "fa2:bf16")
        fadev.baseline_attention(*args, "naive:bf16")
    assert not cuda_plans._PLANS
    with pytest.raises(TypeError, match="causal"):  # the checks still run on the second call of one argument set
        fadev.flash_attention(q, k, v, "fa2:bf16", causal=1)
