"""The public API's boundary, fuzzed with hypothesis: every entry point, valid and invalid arguments.

Valid input must give a result of the right shape and leave every input array unchanged (bit for bit);
invalid input (wrong types, non-real dtypes such as timedelta, bad shapes, non-bool flags, malformed
strings, absurd sizes built with np.broadcast_to so nothing real is allocated) must raise TypeError,
ValueError or MemoryError whose message names the argument -- never crash, hang or be accepted.
Kernel results are also checked bit-identical across thread counts.

The scale paths are fuzzed the same way: fadev.distributed (ring_attention on a one-rank gloo group, shard,
unshard), fadev.hf (use, attention_forward) and the sweep executors (their options; chunks on an executor
that loses futures and points that raise: every point gets exactly one row, failed where it must be).

Bounded in time: few examples per test, no deadline (CI runs this under ASan/UBSan too), derandomized
and without an example database so that every run tries the same examples. FADEV_FUZZ_EXAMPLES=n runs n
examples per test instead (a longer local run); FADEV_FUZZ_REPORT=1 prints the calls made per surface and
their outcomes (returned, or the exception type) at the end of the module (with pytest -s).
"""
from __future__ import annotations

import collections
import concurrent.futures
import os
import re

import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import fadev
from fadev.attention import sram_tiles

EXAMPLES = int(os.environ.get("FADEV_FUZZ_EXAMPLES", 0))
FUZZ = settings(max_examples=EXAMPLES or 100, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                       HealthCheck.function_scoped_fixture])
SCALE = settings(FUZZ, max_examples=EXAMPLES or 25)  # the scale paths: each call costs more (torch, threads)
ERRORS = (TypeError, ValueError, MemoryError)
FORMATS = tuple(fadev.formats)
PRESETS = tuple(p for p in fadev.PRESETS if p != "golden")  # the presets that take a format
HUGE = (1, 1, 2**40, 64)  # 2^46 elements: 512 TiB as float64; only ever a broadcast view


def names(message, name) -> bool:
    return re.search(rf"(?<!\w){re.escape(name)}(?!\w)", message) is not None


OUTCOMES = collections.Counter()
"""(surface, outcome) -> calls: outcome "returned" or the exception's type (FADEV_FUZZ_REPORT)."""


def surface(fn) -> str:
    module = getattr(fn, "__module__", None) or ""
    return next((m for m in ("fadev.distributed", "fadev.hf", "fadev.sweep") if module.startswith(m)), "kernels")


def called(fn, n=1):
    OUTCOMES[surface(fn), "returned"] += n


@pytest.fixture(scope="module", autouse=True)
def _outcome_report():
    yield
    if os.environ.get("FADEV_FUZZ_REPORT"):
        for (where, outcome), n in sorted(OUTCOMES.items()):
            print(f"fuzz: {where:18} {outcome:22} {n}")


def rejects(arg, fn, /, *args, **kwargs):
    """fn(*args, **kwargs) raises TypeError/ValueError/MemoryError whose message names ``arg``."""
    with pytest.raises(ERRORS) as info:
        fn(*args, **kwargs)
    OUTCOMES[surface(fn), type(info.value).__name__] += 1
    assert names(str(info.value), arg), f"{arg!r} not named in {type(info.value).__name__}: {info.value}"


class Unchanged:
    """Snapshots of arrays' bytes; ``check()`` asserts none was written to."""

    def __init__(self, *arrays):
        self.pairs = [(a, a.tobytes()) for a in arrays if isinstance(a, np.ndarray)]

    def check(self):
        for a, before in self.pairs:
            assert a.tobytes() == before, "an input array was modified"


# ---------------------------------------------------------------- strategies

DTYPES = (np.float64, np.float32, np.float16, ml_dtypes.bfloat16, np.int32, np.int8, np.uint16, np.bool_)
SPECIALS = (np.nan, np.inf, -np.inf, 0.0, -0.0, 1e300, 5e-324)


@st.composite
def arrays(draw, shape):
    """A real numeric array of ``shape``: any of DTYPES, normal values with NaN/inf/extremes mixed in,
    C-ordered, Fortran-ordered or a strided (non-contiguous) view."""
    dtype = draw(st.sampled_from(DTYPES))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    x = rng.standard_normal(shape)
    if draw(st.booleans()):
        x.reshape(-1)[rng.integers(0, x.size)] = draw(st.sampled_from(SPECIALS))
    with np.errstate(all="ignore"):
        x = x.astype(dtype)
    layout = draw(st.sampled_from(("C", "F", "strided")))
    if layout == "F":
        return np.asfortranarray(x)
    if layout == "strided":
        wide = np.repeat(x, 2, axis=-1)
        return wide[..., ::2]
    return x


BAD_ARRAYS = st.sampled_from([
    np.array([[1, 2], [3, 4]], dtype="timedelta64[s]"), np.array([[1, 2], [3, 4]], dtype="datetime64[D]"),
    np.ones((2, 2), dtype=np.complex128), np.array([["a", "b"], ["c", "d"]]), np.array([[object()] * 2] * 2),
    np.zeros((2, 2), dtype="V4"), "abc", None, {"a": 1}])
NON_BOOLS = st.sampled_from(["no", "yes", "", 0, 1, 2.0, None, np.int64(1), [True], np.array([True])])
NON_INTS = st.sampled_from([2.5, True, np.bool_(True), "4", None, [4], np.float64(4.0)])
HUGE_ARRAY = np.broadcast_to(np.float32(1.0), HUGE)


@st.composite
def attention_inputs(draw, gqa=True, same_len=False):
    """(q, k, v) with q 2-, 3- or 4-D, grouped-query K/V heads and another K/V length."""
    rank = draw(st.integers(2, 4))
    b, hkv, n, d = draw(st.integers(1, 2)), draw(st.integers(1, 2)), draw(st.integers(1, 6)), draw(st.integers(1, 8))
    h = hkv * (draw(st.integers(1, 2)) if gqa and rank >= 3 else 1)
    nk = n if same_len else draw(st.integers(1, 6))
    q_shape, kv_shape = (b, h, n, d)[4 - rank:], (b, hkv, nk, d)[4 - rank:]
    return draw(arrays(q_shape)), draw(arrays(kv_shape)), draw(arrays(kv_shape))


POLICIES = st.one_of(st.just("golden"), st.builds(lambda p, f: f"{p}:{f}", st.sampled_from(PRESETS),
                                                   st.sampled_from(("bf16", "fp16", "fp8_e4m3", "fp32"))))


# ---------------------------------------------------------------- formats


@FUZZ
@given(st.data())
def test_rounding_functions_valid_and_invalid(data):
    x = data.draw(arrays(data.draw(st.sampled_from(((), (3,), (2, 3), (2, 1, 4))))))
    fmt = data.draw(st.sampled_from(FORMATS))
    keep = Unchanged(x)
    for mode in ("rne", "rtz", "stochastic"):
        assert fadev.round(x, fmt, mode, seed=data.draw(st.integers(0, 2**64 - 1))).shape == x.shape
    assert fadev.ulp(x, fmt).shape == x.shape
    if fadev.formats[fmt].has_nan_code or not np.isnan(np.asarray(x, dtype=np.float64)).any():
        bits = fadev.to_bits(x, fmt)
        assert bits.shape == x.shape and fadev.from_bits(bits, fmt).shape == x.shape
    keep.check()
    bad = data.draw(BAD_ARRAYS)
    for fn in (fadev.round, fadev.to_bits, fadev.ulp):
        rejects("x", fn, bad, fmt)
        rejects("x", fn, np.broadcast_to(np.float32(1.0), (2**62 // 8,)), fmt)
    rejects("mode", fadev.round, x, fmt, data.draw(st.sampled_from(["up", "", None, ["rne"], 0])))
    rejects("seed", fadev.round, x, fmt, "stochastic", seed=data.draw(st.sampled_from([-1, 2**64, 1.5, True])))
    rejects("fmt", fadev.round, x, data.draw(st.sampled_from(["bf17", "", 16, None, "golden"])))


@FUZZ
@given(st.integers(2, 24), st.integers(-60, -1), st.integers(1, 60), st.sampled_from((int, np.int64, np.int32)),
       st.booleans(), st.data())
def test_custom_format(precision, emin, emax, kind, subnormals, data):
    fmt = fadev.custom_format(kind(precision), kind(emin), kind(emax), subnormals=subnormals)
    assert (fmt.precision, fmt.emin, fmt.emax, fmt.subnormals) == (precision, emin, emax, subnormals)
    assert fadev.round(np.array([1.0, 3.0]), fmt).shape == (2,)
    field = data.draw(st.sampled_from(("precision", "emin", "emax")))
    args = {"precision": precision, "emin": emin, "emax": emax, field: data.draw(NON_INTS)}
    rejects(field, fadev.custom_format, args["precision"], args["emin"], args["emax"])
    flag = data.draw(st.sampled_from(("subnormals", "has_inf")))
    rejects(flag, fadev.custom_format, precision, emin, emax, **{flag: data.draw(NON_BOOLS)})
    field, bad = data.draw(st.sampled_from([("overflow", ["inf"]), ("overflow", "up"), ("largest", "1e4"),
                                            ("largest", True), ("name", 5)]))
    rejects(field, fadev.custom_format, precision, emin, emax, **{field: bad})


# ---------------------------------------------------------------- policy strings

OPENERS = {":": "", "(": ")"}


@FUZZ
@given(st.sampled_from(PRESETS + ("golden", "fa3", "")), st.sampled_from(FORMATS + ("bf17", "")),
       st.sampled_from(("", ":", "(", "::", ":(")), st.sampled_from(("", ")", "))", ")x", " ")))
def test_policy_strings(preset, fmt, opener, closer):
    """A policy string parses iff it is 'preset', 'preset:fmt' or 'preset(fmt)' with a known preset,
    a known format, and a format exactly when the preset takes one (golden takes none)."""
    text = preset + opener + (fmt if opener else "") + closer
    has_fmt = opener != "" and fmt != ""
    well_formed = (closer.strip() == OPENERS.get(opener, "?") if opener else closer.strip() == "") and \
        (has_fmt or opener == "")
    valid = well_formed and preset not in ("", "fa3") and (preset == "golden") != has_fmt and \
        not (has_fmt and fmt == "bf17")
    if valid:
        got = fadev.as_policy(text)
        want = fadev.Policy.preset(preset, fmt) if has_fmt else fadev.Policy.golden()
        assert got == want and got.name == want.name
    else:
        with pytest.raises(ValueError) as info:
            fadev.as_policy(text)
        assert any(names(str(info.value), n) for n in ("policy", "preset", "fmt")), str(info.value)


def test_policy_preset_arguments():
    rejects("fmt", fadev.Policy.preset, "golden", "bf16")
    rejects("preset", fadev.Policy.preset, "fa2")
    rejects("preset", fadev.Policy.preset, ["fa2"], "bf16")
    rejects("policy", fadev.as_policy, 3)
    rejects("block_q", fadev.Policy.fa2("bf16").replace, block_q=2.5)
    rejects("allgather", fadev.ring.RingMerge, allgather="no")


# ---------------------------------------------------------------- kernels

def _forward(kind, q, k, v, policy, **kw):
    if kind == "baseline":
        return fadev.baseline_attention(q, k, v, policy, **kw)
    if kind == "flash":
        return fadev.flash_attention(q, k, v, policy, block_q=3, block_kv=2, **kw)
    return fadev.golden_attention(q, k, v, **kw)


@FUZZ
@given(attention_inputs(), POLICIES, st.sampled_from(("baseline", "flash", "golden")), st.booleans(), st.data())
def test_forward_and_backward_valid(qkv, policy, kind, causal, data):
    q, k, v = qkv
    keep = Unchanged(q, k, v)
    out, lse = _forward(kind, q, k, v, policy, causal=causal, return_lse=True)
    assert out.shape == q.shape and lse.shape == q.shape[:-1]
    assert _forward(kind, q, k, v, policy, causal=causal).shape == q.shape
    dout = data.draw(arrays(q.shape))
    keep = Unchanged(q, k, v, out, lse, dout)
    backward = fadev.flash_attention_backward if kind == "flash" else fadev.baseline_attention_backward
    pol = "golden" if kind == "golden" else policy
    grads = backward(q, k, v, out, lse, dout, pol, causal=causal)
    assert [g.shape for g in grads] == [q.shape, k.shape, v.shape]
    keep.check()
    threads = fadev.get_num_threads()
    try:  # one policy and tiling give one bit pattern on any thread count
        fadev.set_num_threads(1)
        one = _forward(kind, q, k, v, policy, causal=causal)
        fadev.set_num_threads(3)
        three = _forward(kind, q, k, v, policy, causal=causal)
    finally:
        fadev.set_num_threads(threads)
    assert one.tobytes() == three.tobytes() == out.tobytes()
    plain = [np.array(x, dtype=np.float64, order="C") for x in (q, k, v)]  # exact for every drawn dtype
    assert _forward(kind, *plain, policy, causal=causal).tobytes() == out.tobytes()  # layout and dtype: same bits


KERNEL_ARGS = {  # argument -> strategy of invalid values for it
    "q": st.one_of(BAD_ARRAYS, st.just(HUGE_ARRAY), st.just(np.ones((2, 3, 4, 5, 6))), st.just(np.ones((0, 4)))),
    "k": st.one_of(BAD_ARRAYS, st.just(np.ones((4, 5)))), "v": st.one_of(BAD_ARRAYS, st.just(np.ones((2,)))),
    "policy": st.sampled_from(["paper(bf16", "golden:bf16", "fa2:", "fa2", "fa2:bf16)", "nope", 3, None]),
    "causal": NON_BOOLS, "return_lse": NON_BOOLS,
    "scale": st.sampled_from(["1", np.nan, np.inf, True, [1.0]]),
    "block_q": st.sampled_from([0, -1, 2.5, True, "4", 2**40]), "block_kv": NON_INTS.filter(lambda b: b is not None),
    "loop_order": st.sampled_from(["rows", "", 1]), "exp": st.sampled_from(["exp10", 2, ""]),
}


@FUZZ
@given(st.sampled_from(("baseline", "flash", "ring")), st.sampled_from(sorted(KERNEL_ARGS)), st.data())
def test_forward_invalid(kind, arg, data):
    q = np.random.default_rng(0).standard_normal((4, 4))
    args = {"q": q, "k": q, "v": q, "policy": "fa2:bf16", "causal": False, "return_lse": False, "scale": None}
    tiling = {"block_q": None, "block_kv": None, "loop_order": None, "exp": None}
    if kind != "baseline":
        args.update(tiling)
    if arg not in args:
        return
    args[arg] = data.draw(KERNEL_ARGS[arg])
    if kind == "ring":
        rejects(arg, fadev.ring_attention, *(args.pop(n) for n in ("q", "k", "v", "policy")), world_size=2, **args)
    else:
        rejects(arg, fadev.baseline_attention if kind == "baseline" else fadev.flash_attention,
                *(args.pop(n) for n in ("q", "k", "v", "policy")), **args)


@FUZZ
@given(st.sampled_from(("q", "out", "lse", "dout", "causal", "policy", "world_size")), st.data())
def test_backward_invalid(arg, data):
    q, k, v = fadev.random_qkv((2, 4, 4), seed=1)
    out, lse = fadev.flash_attention(q, k, v, "golden", return_lse=True)
    args = {"q": q, "k": k, "v": v, "out": out, "lse": lse, "dout": out, "policy": "golden", "causal": False,
            "world_size": 2}
    bad = {"q": BAD_ARRAYS, "out": st.one_of(BAD_ARRAYS, st.just(out[..., :1])), "lse": st.just(out),
           "dout": st.just(np.broadcast_to(np.float32(0.0), (2, 2**40, 4))), "causal": NON_BOOLS,
           "policy": KERNEL_ARGS["policy"], "world_size": NON_INTS}
    args[arg] = data.draw(bad[arg])
    world_size = args.pop("world_size")
    positional = [args.pop(n) for n in ("q", "k", "v", "out", "lse", "dout", "policy")]
    rejects(arg, fadev.ring_attention_backward, *positional, world_size=world_size, **args)
    if arg != "world_size":
        rejects(arg, fadev.flash_attention_backward, *positional, **args)
        rejects(arg, fadev.baseline_attention_backward, *positional, **args)


@FUZZ
@given(attention_inputs(gqa=False, same_len=True), st.sampled_from((1, 2)), st.sampled_from(fadev.ring.LAYOUTS),
       st.sampled_from(fadev.ring.MERGES), st.booleans())
def test_ring_valid(qkv, world_size, layout, merge, causal):
    q, k, v = (np.concatenate([x] * 4, axis=-2) for x in qkv)  # N divisible by 2 * world_size
    keep = Unchanged(q, k, v)
    out, lse = fadev.ring_attention(q, k, v, "fa2:bf16", world_size=world_size, layout=layout, merge=merge,
                                    causal=causal, return_lse=True)
    assert out.shape == q.shape and lse.shape == q.shape[:-1]
    grads = fadev.ring_attention_backward(q, k, v, out, lse, out, "fa2:bf16", world_size=world_size, layout=layout,
                                          merge=merge, causal=causal)
    assert [g.shape for g in grads] == [q.shape, k.shape, v.shape]
    keep.check()
    seq = q.shape[-2]
    assert fadev.ring_coverage(seq, world_size=world_size, layout=layout, causal=causal).shape == (seq, seq)
    rejects("causal", fadev.ring_coverage, seq, world_size=world_size, causal="yes")
    rejects("allgather", fadev.ring_coverage, seq, world_size=world_size, allgather=1)


def test_native_raises_cleanly_without_a_gpu():
    if fadev.cuda_available():
        pytest.skip("a CUDA device is present: the native kernels run (tests/test_cuda_native.py)")
    q = np.ones((4, 64), dtype=np.float16)
    calls = {"native_attention": lambda: fadev.native_attention(q, q, q),
             "native_attention_backward": lambda: fadev.native_attention_backward(q, q, q, q, q[:, 0], q),
             "native_attention(dtype='fp8')": lambda: fadev.native_attention(q, q, q, dtype="fp8")}
    if fadev.cuda_info()["compiled"]:
        # a CUDA build knows its tile table without a device (.ci/run's CUDA step has no GPU)
        assert all(len(t) == 2 for t in fadev.native_tiles(64)) and fadev.native_tiles(64)
    else:
        calls["native_tiles"] = lambda: fadev.native_tiles(64)
    for name, call in calls.items():
        with pytest.raises((RuntimeError, TypeError, ValueError)):
            call()
            pytest.fail(f"{name} returned without a GPU")
    rejects("dim", fadev.native_tiles, 2.5)
    rejects("q", fadev.native_attention, np.ones((4, 64), dtype=np.float64), q, q)


# ---------------------------------------------------------------- metrics, weights, small helpers


@FUZZ
@given(st.sampled_from(((5,), (2, 3), (1, 2, 2))), st.data())
def test_metrics(shape, data):
    test, ref = data.draw(arrays(shape)), data.draw(arrays(shape))
    keep = Unchanged(test, ref)
    comparison = fadev.compare(test, ref)
    assert comparison.n == test.size
    assert fadev.ulp_error(test, ref, "bf16").shape == shape
    assert sum(fadev.ulp_histogram(test, ref, "bf16").counts) + fadev.ulp_histogram(test, ref, "bf16").n_nan == test.size
    fadev.wasserstein(test, ref)
    keep.check()
    bad = data.draw(st.one_of(BAD_ARRAYS, st.just(np.broadcast_to(np.float32(0.0), (2**40,)))))
    which = data.draw(st.sampled_from(("test", "ref")))
    args = {"test": test, "ref": ref, which: bad}
    for fn in (fadev.compare, fadev.rmse, fadev.max_abs):
        rejects(which, fn, args["test"], args["ref"])
    rejects(which, fadev.ulp_error, args["test"], args["ref"], "bf16")
    rejects("a" if which == "test" else "b", fadev.wasserstein, *((bad, ref) if which == "test" else (test, bad)))
    rejects("max_ulp", fadev.ulp_histogram, test, ref, "bf16", max_ulp=data.draw(NON_INTS))


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # 1e300 squared: rel_l2 is then 0
@FUZZ
@given(st.sampled_from(((3,), (2, 2))), st.data())
def test_weights(shape, data):
    a = {"w": data.draw(arrays(shape)), "b": data.draw(arrays((2,)))}
    b = {"w": data.draw(arrays(shape)), "b": data.draw(arrays((2,)))}
    keep = Unchanged(*a.values(), *b.values())
    df = fadev.weights.compare(a, b)
    assert list(df["name"]) == ["w", "b", fadev.weights.MODEL_ROW]
    keep.check()
    rejects("a['w']", fadev.weights.compare, dict(a, w=data.draw(BAD_ARRAYS.filter(lambda x: x is not None))), b)
    rejects("a", fadev.weights.compare, data.draw(st.sampled_from([3, "w", None])), b)


@FUZZ
@given(st.lists(st.integers(1, 3), min_size=2, max_size=4), st.sampled_from(fadev.attention.DISTRIBUTIONS),
       st.integers(0, 2**32), st.data())
def test_random_qkv_and_helpers(shape, dist, seed, data):
    kind = data.draw(st.sampled_from((int, np.int64, np.uint8)))
    q, k, v = fadev.random_qkv(tuple(kind(s) for s in shape), dist=dist, seed=seed)
    assert q.shape == k.shape == v.shape == tuple(shape)
    bad = list(shape)
    bad[data.draw(st.integers(0, len(shape) - 1))] = data.draw(NON_INTS)
    rejects("shape", fadev.random_qkv, tuple(bad))
    rejects("shape", fadev.random_qkv, (2**30, 2**20))
    rejects("seed", fadev.random_qkv, shape, seed=data.draw(st.sampled_from([-1, 1.5, True, "0"])))
    block_q, block_kv = sram_tiles(data.draw(st.integers(1, 2**20)), data.draw(st.integers(1, 256)))
    assert 1 <= block_q <= block_kv
    rejects("dim", sram_tiles, 1024, data.draw(st.sampled_from([0, -4, 2.5, True, "64"])))
    rejects("sram_bytes", sram_tiles, data.draw(st.sampled_from([0, -1, 2.5, False])), 64)
    threads = fadev.get_num_threads()
    try:
        fadev.set_num_threads(data.draw(st.sampled_from((int, np.int64, np.int8)))(2))
        assert fadev.get_num_threads() == 2
        rejects("n", fadev.set_num_threads, data.draw(st.sampled_from([0, 257, -1, 2.5, True, "2", None])))
    finally:
        fadev.set_num_threads(threads)
    rejects("shape", fadev.DeviceArray, data.draw(st.sampled_from([(2.5,), (True,), ("4",), (-1,)])))
    rejects("dtype", fadev.DeviceArray, (2,), data.draw(st.sampled_from(["m8[s]", "M8[D]", "c16", "U3", "O"])))


# ---------------------------------------------------------------- fadev.torch


@FUZZ
@given(attention_inputs(same_len=True), st.sampled_from(("flash", "baseline")), st.booleans(), st.data())
def test_torch_attention(qkv, kernel, causal, data):
    torch = pytest.importorskip("torch")
    import fadev.torch as ft
    q, k, v = (torch.tensor(np.asarray(x, dtype=np.float64), requires_grad=True) for x in qkv)
    gqa = q.dim() >= 3 and q.shape[-3] != k.shape[-3]
    before = [t.detach().clone() for t in (q, k, v)]
    out = ft.attention(q, k, v, "fa2:bf16", kernel=kernel, is_causal=causal, enable_gqa=gqa)
    assert out.shape == q.shape and out.dtype == q.dtype
    out.sum().backward()
    assert [t.grad.shape for t in (q, k, v)] == [q.shape, k.shape, v.shape]
    assert all(a.numpy().tobytes() == b.detach().numpy().tobytes() for a, b in zip(before, (q, k, v)))
    arg = data.draw(st.sampled_from(("is_causal", "enable_gqa", "query", "policy", "kernel")))
    bad = {"is_causal": NON_BOOLS, "enable_gqa": NON_BOOLS, "policy": KERNEL_ARGS["policy"],
           "query": st.sampled_from([q.detach().numpy(), q.detach().to(torch.int32), q.detach().to(torch.complex128)]),
           "kernel": st.sampled_from(["fast", None, 3])}
    args = {"query": q, "policy": "fa2:bf16", "kernel": kernel, "is_causal": causal, "enable_gqa": gqa}
    args[arg] = data.draw(bad[arg])
    rejects(arg, ft.attention, args.pop("query"), k, v, args.pop("policy"), **args)


def test_binding_reports_a_failed_copy_as_memory_error():
    """The binding copies a non-contiguous input to a contiguous array; when that cannot be allocated
    (2^46 float64s: beyond any address space) it is a MemoryError naming the argument, not a TypeError."""
    fmt = fadev.formats["bf16"]._c
    with pytest.raises(MemoryError, match=r"^x: cannot allocate 562949953421312 bytes"):
        fadev._core.round(np.broadcast_to(np.float64(1.0), (2**46,)), fmt, 0, 0, 0, 0)
