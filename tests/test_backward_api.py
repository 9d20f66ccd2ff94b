"""fadev.baseline_attention_backward / fadev.flash_attention_backward: the Python API and its validation,
the binding and the C entry points' status codes, ranks, thread-count independence (the dQ pipeline
along the key tiles), masking and NaN propagation, and the golden (fp64) kernels against torch float64
autograd and against each other. Bit parity with the slow twin lives in test_backward.py."""
import ctypes
import math

import numpy as np
import pytest

import fadev
import helpers
from helpers import identical as same_bits
from helpers import CPolicy, CPolicyBackward, Format, Params
from fadev import Policy
from helpers import rel_err, torch_grads as torch_attention_grads

BACKWARDS = [fadev.baseline_attention_backward, fadev.flash_attention_backward]


def problem(shape, heads_kv=None, seq_kv=None, policy="golden", causal=False, seed=0, dist="normal", **forward):
    """q, k, v, the forward's out and lse under `policy`, and a random dout."""
    q, k, v = fadev.random_qkv(shape, dist=dist, seed=seed, heads_kv=heads_kv, seq_kv=seq_kv)
    fwd = fadev.flash_attention if forward else fadev.baseline_attention
    out, lse = fwd(q, k, v, policy, causal=causal, return_lse=True, **forward)
    dout = np.random.default_rng(seed + 1).standard_normal(q.shape)
    return q, k, v, out, lse, dout


@pytest.fixture
def case():
    return problem((2, 4, 9, 8), heads_kv=2, seq_kv=11)


# ---------------------------------------------------------------- validation (Python layer)

@pytest.mark.parametrize("fn", BACKWARDS)
def test_saved_tensor_errors(case, fn):
    q, k, v, out, lse, dout = case
    with pytest.raises(ValueError, match=r"out: expected q's shape \(2, 4, 9, 8\), got \(2, 4, 8, 8\)"):
        fn(q, k, v, out[:, :, :8], lse, dout, "golden")
    with pytest.raises(ValueError, match=r"dout: expected q's shape \(2, 4, 9, 8\), got \(2, 4, 9, 7\)"):
        fn(q, k, v, out, lse, dout[..., :7], "golden")
    with pytest.raises(ValueError, match=r"lse: expected q's shape without its last axis \(2, 4, 9\), got "
                                         r"\(2, 4, 9, 1\)"):
        fn(q, k, v, out, lse[..., None], dout, "golden")
    with pytest.raises(ValueError, match="dout: expected a 2-D"):
        fn(q, k, v, out, lse, dout[0, 0, 0], "golden")
    with pytest.raises(TypeError, match="lse: expected a real numeric array, got dtype <U1"):
        fn(q, k, v, out, np.full(lse.shape, "a"), dout, "golden")
    with pytest.raises(TypeError, match="out: expected a real numeric array, got dtype complex128"):
        fn(q, k, v, out.astype(complex), lse, dout, "golden")
    # the forward's checks of q, k, v and the options apply too
    with pytest.raises(ValueError, match="same rank.*q 3-D, k 4-D"):
        fn(q[0], k, v, out[0], lse[0], dout[0], "golden")
    with pytest.raises(ValueError, match="4 heads, not a multiple of k/v's 3 heads"):
        fn(q, np.concatenate([k, k[:, :1]], 1), np.concatenate([v, v[:, :1]], 1), out, lse, dout, "golden")
    with pytest.raises(ValueError, match="scale must be finite, got nan"):
        fn(q, k, v, out, lse, dout, "golden", scale=math.nan)
    with pytest.raises(TypeError, match="causal must be a bool"):
        fn(q, k, v, out, lse, dout, "golden", causal=1)
    with pytest.raises(TypeError, match="policy: expected a fadev.Policy"):
        fn(q, k, v, out, lse, dout, None)


def test_flash_option_errors(case):
    q, k, v, out, lse, dout = case
    for name, bad in (("block_q", 0), ("block_kv", -3), ("block_q", 2.5), ("block_kv", True), ("block_q", 2**31)):
        with pytest.raises(ValueError, match=f"{name} must be a positive integer.*got {bad!r}"):
            fadev.flash_attention_backward(q, k, v, out, lse, dout, "golden", **{name: bad})
    with pytest.raises(ValueError, match="exp must be one of exp, exp2, got 'exp10'"):
        fadev.flash_attention_backward(q, k, v, out, lse, dout, "golden", exp="exp10")


def test_stochastic_length_limit():
    q, k = np.zeros((2**21, 1)), np.zeros((3, 1))
    sr = Policy.paper("bf16").replace(rounding="stochastic")
    with pytest.raises(ValueError, match=r"stochastic rounding needs sequence lengths < 2\^21.*seq_q=2097152"):
        fadev.flash_attention_backward(q, k, k, q, q[:, 0], q, sr)


# ---------------------------------------------------------------- the binding and the C status codes

def test_binding_errors(case):
    q, k, v, out, lse, dout = case
    pol = Policy.golden()
    fc, bc = pol._c, pol._c_backward
    core = fadev._core

    def spec(policy, policy_backward, *tiling):  # fadev._args.Call.c
        return (policy, policy_backward, None, 0.25, False) + tiling

    args = (q, k, v, out, lse, dout)
    with pytest.raises(TypeError, match="policy_backward must be a tuple of 11 format tuples and a flag"):
        core.baseline_attention_backward(*args, spec(fc, bc[:11], 0, 0, 0, 0, 0))
    with pytest.raises(ValueError, match="fmt: invalid format parameters"):
        core.baseline_attention_backward(*args, spec(fc, ((0, -1, 1, 1, 1, 0, 0.0),) + bc[1:], 0, 0, 0, 0, 0))
    with pytest.raises(TypeError, match="policy must be a tuple of 13 format tuples"):
        core.flash_attention_backward(*args, spec(bc, bc, 4, 4, 0, 0, 0))
    with pytest.raises(ValueError, match="baseline_attention_backward: lse must be 3-D, got 4-D"):
        core.baseline_attention_backward(q, k, v, out, out, dout, spec(fc, bc, 0, 0, 0, 0, 0))
    with pytest.raises(ValueError, match="flash_attention_backward: shapes do not agree.*lse \\(2, 4, 8\\)"):
        core.flash_attention_backward(q, k, v, out, lse[..., :8], dout, spec(fc, bc, 4, 4, 0, 0, 0))
    with pytest.raises(ValueError, match="baseline_attention_backward: shapes do not agree"):
        core.baseline_attention_backward(q, k, v, out, lse, dout[:1], spec(fc, bc, 0, 0, 0, 0, 0))
    with pytest.raises(ValueError, match="flash_attention_backward: invalid argument"):
        core.flash_attention_backward(*args, spec(fc, bc, 0, 4, 0, 0, 0))
    with pytest.raises(ValueError, match="flash_attention_backward: invalid argument"):
        core.flash_attention_backward(*args, spec(fc, bc, 4, 4, 0, 0, 2))
    with pytest.raises(ValueError, match="baseline_attention_backward: shape mismatch"):
        core.baseline_attention_backward(q[:, :3], k, v, out[:, :3], lse[:, :3], dout[:, :3],
                                         spec(fc, bc, 0, 0, 0, 0, 0))
    with pytest.raises(ValueError, match="invalid rounding mode"):
        core.baseline_attention_backward(*args, spec(fc[:13] + (9, 0), bc, 0, 0, 0, 0, 0))
    with pytest.raises(TypeError, match="dout: expected a real numeric array"):
        core.baseline_attention_backward(q, k, v, out, lse, object(), spec(fc, bc, 0, 0, 0, 0, 0))



def c_status(fn_name, policy=None, backward_precision=None, **changes):
    """Status of the C entry point on small valid buffers with some params/policy fields changed
    (a name of a buffer set to None passes NULL)."""
    lib = ctypes.CDLL(fadev._core.__file__)
    fn = getattr(lib, fn_name)
    fn.restype = ctypes.c_int
    policy = policy or Policy.golden()
    pol = CPolicy(*[Format(*f) for f in policy._c[:13]], *policy._c[13:])
    pb = CPolicyBackward(*[Format(*f) for f in policy._c_backward[:11]], policy._c_backward[11])
    if "rounding" in changes:
        pol.rounding = changes.pop("rounding")
    if backward_precision is not None:
        pb.f5.precision = backward_precision
    pr = Params(1, 2, 1, 4, 5, 8, 0.5, 0, 2, 2, 0, 0, 0)
    names = ("q", "k", "v", "out", "lse", "dout", "dq", "dk", "dv")
    buffers = {n: np.zeros(64) for n in names}
    ptr = {n: b.ctypes.data_as(ctypes.c_void_p) for n, b in buffers.items()}
    pb_ptr = ctypes.byref(pb)
    for name, value in changes.items():
        if name in ptr:
            ptr[name] = None
        elif name == "policy_backward":
            pb_ptr = None
        else:
            setattr(pr, name, value)
    return fn(*[ptr[n] for n in names], ctypes.byref(pr), ctypes.byref(pol), pb_ptr)


INVALID_FORMAT, INVALID_MODE, INVALID_ARGUMENT, SHAPE, OVERFLOW, NO_MEMORY = 1, 2, 3, 4, 5, 6


@pytest.mark.parametrize("fn_name", ["fadev_baseline_attention_backward", "fadev_flash_attention_backward"])
def test_c_status_codes(fn_name):
    assert c_status(fn_name) == 0
    for name in ("q", "out", "lse", "dout", "dq", "dk", "dv", "policy_backward"):
        assert c_status(fn_name, **{name: None}) == INVALID_ARGUMENT, name
    for change in ({"dim": 0}, {"dim": 257}, {"batch": 0}, {"seq_kv": 0}, {"heads_kv": 0}, {"scale": math.inf},
                   {"causal": 2}):
        assert c_status(fn_name, **change) == INVALID_ARGUMENT, change
    assert c_status(fn_name, heads_kv=3, heads=2) == SHAPE
    assert c_status(fn_name, rounding=3) == INVALID_MODE
    assert c_status(fn_name, backward_precision=0) == INVALID_FORMAT  # the dsoft stage
    sr = Policy.paper("bf16").replace(rounding="stochastic")
    assert c_status(fn_name, policy=sr, seq_kv=2**21) == INVALID_ARGUMENT
    assert c_status(fn_name, batch=2**62, heads=4) == OVERFLOW
    assert c_status(fn_name, batch=2**50) == NO_MEMORY  # 2^61 bytes of rounded Q: larger than any address space


def test_c_flash_only_checks():
    for change in ({"block_q": 0}, {"block_kv": -1}, {"exp_form": 2}):
        assert c_status("fadev_flash_attention_backward", **change) == INVALID_ARGUMENT, change
        assert c_status("fadev_baseline_attention_backward", **change) == 0, change  # baseline has no tiles
    for change in ({"loop_order": 2}, {"normalize": -1}):  # the backward has one loop order and no normalisation
        assert c_status("fadev_flash_attention_backward", **change) == 0, change


# ---------------------------------------------------------------- shapes, formats, masking

@pytest.mark.parametrize("fn", BACKWARDS)
def test_ranks(fn):
    q, k, v, out, lse, dout = problem((1, 3, 10, 8), seq_kv=7, policy="fa2:fp16")
    g4 = fn(q, k, v, out, lse, dout, "fa2:fp16")
    assert [g.shape for g in g4] == [(1, 3, 10, 8), (1, 3, 7, 8), (1, 3, 7, 8)]
    g3 = fn(q[0], k[0], v[0], out[0], lse[0], dout[0], "fa2:fp16")
    assert [g.shape for g in g3] == [(3, 10, 8), (3, 7, 8), (3, 7, 8)]
    assert all(same_bits(a, b[0]) for a, b in zip(g3, g4))
    g2 = fn(q[0, 1], k[0, 1], v[0, 1], out[0, 1], lse[0, 1], dout[0, 1], "fa2:fp16")
    assert [g.shape for g in g2] == [(10, 8), (7, 8), (7, 8)]
    assert all(same_bits(a, b[0, 1]) for a, b in zip(g2, g4))
    assert all(isinstance(g, np.ndarray) and g.dtype == np.float64 for g in g2)
    # non-float64 and non-contiguous inputs are converted
    d32 = dout[0, 1].astype(np.float32)
    assert all(same_bits(a, b) for a, b in zip(fn(q[0, 1], k[0, 1], v[0, 1], out[0, 1], lse[0, 1], d32, "golden"),
                                               fn(q[0, 1], k[0, 1], v[0, 1], out[0, 1], lse[0, 1],
                                                  d32.astype(np.float64), "golden")))
    qt = np.asfortranarray(q[0, 1])
    assert all(same_bits(a, b) for a, b in zip(fn(qt, k[0, 1], v[0, 1], out[0, 1], lse[0, 1], dout[0, 1], "golden"),
                                               fn(q[0, 1].copy(), k[0, 1], v[0, 1], out[0, 1], lse[0, 1],
                                                  dout[0, 1], "golden")))


def test_results_are_values_of_the_grad_format():
    pol = Policy.paper("bf16").replace(grad="fp8_e5m2")
    q, k, v, out, lse, dout = problem((2, 20, 16), policy=pol)
    for fn in BACKWARDS:
        for g in fn(q, k, v, out, lse, dout, pol):
            assert np.array_equal(fadev.round(g, "fp8_e5m2"), g) and np.isfinite(g).all()


def test_masked_rows_and_nan_propagation():
    # causal with Nq > Nk: rows 0..6 see no key and get dq = 0; what they hold must reach nothing. (With
    # bottom-right alignment the last row sees every key, so no key goes unseen.)
    q, k, v, out, lse, dout = problem((1, 12, 8), seq_kv=5, causal=True, policy="fa2:bf16")
    bad_q, bad_dout = q.copy(), dout.copy()
    bad_q[0, 2], bad_dout[0, 3] = np.nan, np.inf
    for fn in BACKWARDS:
        dq, dk, dv = fn(bad_q, k, v, out, lse, bad_dout, "fa2:bf16", causal=True)
        assert np.all(dq[0, :7] == 0) and np.isfinite(dq[0, 7:]).all() and (dq[0, 7:] != 0).any()
        ref = fn(q, k, v, out, lse, dout, "fa2:bf16", causal=True)
        assert same_bits(dk, ref[1]) and same_bits(dv, ref[2]) and same_bits(dq, ref[0])
    # a NaN in V[4, 2] makes dP_i4 NaN for every row: dS_i4, all of dq and dk[4]; dv never reads V. The
    # baseline's D_i = sum_j P'_ij dP_ij is NaN too, so there every dS and all of dk are NaN.
    q, k, v, out, lse, dout = problem((1, 5, 8), seq_kv=12)
    v[0, 4, 2] = np.nan
    for fn in BACKWARDS:
        dq, dk, dv = fn(q, k, v, out, lse, dout, "golden")
        assert np.isnan(dq).all() and np.isnan(dk[0, 4]).all() and np.isfinite(dv).all()
        if fn is fadev.baseline_attention_backward:
            assert np.isnan(dk).all()
        else:
            assert np.isfinite(np.delete(dk[0], 4, axis=0)).all()


# ---------------------------------------------------------------- determinism and golden accuracy

def test_thread_count_independence():
    # tasks are (b, g, key tile); each hands its dQ terms to the next key tile's task: with 2 or 3 threads
    # they run side by side (3 threads on this 2-core box: some wait descheduled), with 1 one after another
    policies = [Policy.golden(), Policy.fa2("bf16"), Policy.paper("bf16").replace(rounding="stochastic", seed=5),
                Policy.fa1("fp8_e4m3"), Policy.naive("fp16").replace(grad_acc="bf16", rounding="rtz")]
    shapes = [((1, 2, 70, 24), 1, 90), ((2, 2, 40, 16), 1, 33)]
    results = []
    for threads in (1, 2, 3):
        fadev.set_num_threads(threads)
        row = []
        for shape, hkv, nk in shapes:
            for pol in policies:
                q, k, v, out, lse, dout = problem(shape, heads_kv=hkv, seq_kv=nk, policy=pol, causal=True)
                row.append(fadev.baseline_attention_backward(q, k, v, out, lse, dout, pol, causal=True))
                row.append(fadev.flash_attention_backward(q, k, v, out, lse, dout, pol, block_q=16, block_kv=32,
                                                          causal=True))
                row.append(fadev.flash_attention_backward(q, k, v, out, lse, dout, pol, block_q=100, block_kv=70))
        results.append(row)
    for other in results[1:]:
        for a, b in zip(results[0], other):
            assert all(same_bits(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("dist", ["normal", "outlier"])
@pytest.mark.parametrize("causal", [False, True])
def test_golden_baseline_matches_torch_autograd(dist, causal):
    q, k, v, out, lse, dout = problem((2, 4, 40, 32), heads_kv=2, seq_kv=56, causal=causal, dist=dist, seed=3)
    got = fadev.baseline_attention_backward(q, k, v, out, lse, dout, "golden", causal=causal)
    for g, w in zip(got, torch_attention_grads(q, k, v, dout, causal=causal)):
        assert rel_err(g, w) <= 1e-12
    out, lse = fadev.baseline_attention(q, k, v, "golden", causal=causal, scale=0.3, return_lse=True)
    got = fadev.baseline_attention_backward(q, k, v, out, lse, dout, "golden", causal=causal, scale=0.3)
    for g, w in zip(got, torch_attention_grads(q, k, v, dout, causal=causal, scale=0.3)):
        assert rel_err(g, w) <= 1e-12


def test_golden_flash_matches_golden_baseline_over_tilings():
    q, k, v, _, _, dout = problem((1, 4, 75, 40), heads_kv=1, seq_kv=83, dist="outlier", seed=10)
    for causal in (False, True):
        out, lse = fadev.baseline_attention(q, k, v, "golden", causal=causal, return_lse=True)
        base = fadev.baseline_attention_backward(q, k, v, out, lse, dout, "golden", causal=causal)
        for bq, bkv in ((1, 1), (3, 7), (16, 16), (64, 128), (100, 200), (65, 13)):
            for exp in ("exp", "exp2"):
                out, lse = fadev.flash_attention(q, k, v, "golden", block_q=bq, block_kv=bkv, exp=exp, causal=causal,
                                                 return_lse=True)
                got = fadev.flash_attention_backward(q, k, v, out, lse, dout, "golden", block_q=bq, block_kv=bkv,
                                                     exp=exp, causal=causal)
                for g, b in zip(got, base):
                    assert rel_err(g, b) <= 1e-12, (causal, bq, bkv, exp)


def test_exported():
    assert {"baseline_attention_backward", "flash_attention_backward"} <= set(fadev.__all__)
