"""Metrics on the GPU (cuda/metrics.cu) against the C core (csrc/metrics.c), through the public API.

Deviation statistics sum in another order than the CPU: equal within 1e-12 relative (their compensated sums
are accurate to ~1e-16); counts, NaN and infinities exactly. Wasserstein-1 sums the CPU walk's terms in
another order: equal within 1e-12 relative, NaN / inf exactly as the CPU. ULP errors: the same bits,
NaN payloads included. Inputs are NumPy arrays (device="cuda") and PyTorch CUDA float64 tensors.
The GPU tests are skipped without a CUDA device; the argument checks of the C entry points run wherever
fadev was built with nvcc (they fail before any device is touched).
"""
import numpy as np
import pytest

import fadev
from fadev import _core
from helpers import needs_gpu

STATS = ("max_abs", "mean_diff", "std_diff", "mean_abs", "rmse", "rel_l2", "max_rel")
COUNTS = ("n", "n_nan", "n_inf")


def _as_input(x, kind):
    """x (NumPy) as the GPU call's input: NumPy (copied by device="cuda") or a torch CUDA float64 tensor."""
    if kind == "numpy":
        return x
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA device")
    return torch.from_numpy(np.ascontiguousarray(x, dtype=np.float64)).to("cuda")


def _to_numpy(x):
    return x.cpu().numpy() if hasattr(x, "cpu") else np.asarray(x)


def _close(gpu, cpu, rtol=1e-12):
    """Same NaN-ness and infinities; finite values within rtol (relative)."""
    if np.isnan(cpu) or np.isnan(gpu):
        return bool(np.isnan(cpu) and np.isnan(gpu))
    if np.isinf(cpu) or np.isinf(gpu):
        return gpu == cpu
    return abs(gpu - cpu) <= rtol * abs(cpu)


def _deviation_cases(rng):
    n = 10**6 + 7  # several blocks of the GPU's grid, not a multiple of anything
    r = rng.standard_normal(n)
    t = r + 1e-3 * rng.standard_normal(n) + 1e-4
    cases = {"normal": (t, r), "huge (rescaled sums)": (t * 1e300, r * 1e300),
             "tiny (rescaled sums)": (t * 1e-300, r * 1e-300), "ref all zero": (t, np.zeros(n)),
             "equal": (r, r.copy()), "one element": (np.array([3.0]), np.array([1.0])),
             "constant difference": (np.full(n, 1.0 + 2**-30), np.ones(n)),
             "large mean, small spread": (1e9 + rng.standard_normal(n), np.zeros(n)),
             "overflowing difference": (np.array([1e308, -1e308, 1.0]), np.array([-1e308, 1e308, 2.0]))}
    t_nan = t.copy()
    t_nan[5] = np.nan
    t_inf = t.copy()
    t_inf[5] = np.inf
    t_both = t_inf.copy()
    t_both[7] = -np.inf
    r_inf = r.copy()
    r_inf[9] = np.inf
    t_same = t.copy()
    t_same[9] = np.inf
    cases.update({"a NaN": (t_nan, r), "one-sided inf": (t_inf, r), "infs of both signs": (t_both, r),
                  "inf in ref": (t, r_inf), "same inf (inf - inf)": (t_same, r_inf)})
    return cases


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("kind", ["numpy", "torch"])
def test_gpu_compare_matches_cpu(kind):
    rng = np.random.default_rng(5)
    for name, (t, r) in _deviation_cases(rng).items():
        cpu = fadev.compare(t, r)
        gpu = fadev.compare(_as_input(t, kind), _as_input(r, kind), device="cuda")
        for field in STATS + ("wasserstein",):
            g, c = getattr(gpu, field), getattr(cpu, field)
            assert _close(g, c), f"{name} ({kind}): {field} gpu={g!r} cpu={c!r}"
        for field in COUNTS:
            assert getattr(gpu, field) == getattr(cpu, field), f"{name} ({kind}): {field}"


@pytest.mark.gpu
@needs_gpu
def test_gpu_metric_functions_match_compare():
    rng = np.random.default_rng(6)
    t, r = rng.standard_normal(3000), rng.standard_normal(3000)
    gpu = fadev.compare(t, r, device="cuda")
    for field in STATS:
        assert getattr(fadev, field)(t, r, device="cuda") == getattr(gpu, field), field


def _w1_cases(rng):
    z = np.array([0.0, -0.0, 0.0, -0.0, 1.0])
    return {
        "equal sizes": (rng.standard_normal(1000), rng.standard_normal(1000)),
        "coprime sizes": (rng.standard_normal(1000), rng.standard_normal(777)),
        "shared factor": (rng.standard_normal(1200), rng.standard_normal(1800) + 0.5),
        "large, different sizes": (rng.standard_normal(2 * 10**6), rng.standard_normal(1_500_001) * 1.1),
        "ties": (rng.integers(-3, 4, 5001).astype(float), rng.integers(-2, 4, 3000).astype(float)),
        "signed zeros": (z, np.array([-0.0, 0.0, -1.0])),
        "one element each": (np.array([5.0]), np.array([-2.0])),
        "same inf (inf - inf)": (np.array([1.0, np.inf]), np.array([2.0, np.inf])),
        "inf against finite": (np.array([1.0, np.inf]), np.array([2.0, 3.0, 4.0])),
        "opposite infs": (np.array([-np.inf, 1.0]), np.array([np.inf, 3.0])),
        "NaN": (np.array([1.0, np.nan]), np.array([2.0, 3.0])),
        "negative NaN": (np.array([1.0, -np.nan]), np.array([2.0, 3.0])),
        "overflowing differences": (np.array([1.7e308, -1.7e308, 1e308]), np.array([-1.7e308, 1.5e308])),
        "scaled sum": (rng.standard_normal(1000) * 1e305, rng.standard_normal(999) * 1e305),
        "subnormal": (rng.standard_normal(1000) * 1e-310, rng.standard_normal(999) * 1e-310),
    }


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("kind", ["numpy", "torch"])
def test_gpu_wasserstein_matches_cpu(kind):
    rng = np.random.default_rng(7)
    for name, (a, b) in _w1_cases(rng).items():
        cpu = fadev.wasserstein(a, b, method="sort")
        gpu = fadev.wasserstein(_as_input(a, kind), _as_input(b, kind), device="cuda")
        assert _close(gpu, cpu), f"{name} ({kind}): gpu={gpu!r} cpu={cpu!r}"
        assert _close(fadev.wasserstein(_as_input(b, kind), _as_input(a, kind), device="cuda"), cpu), f"{name} swapped"


ULP_FORMATS = [fadev.formats[n] for n in fadev.formats] + [
    fadev.custom_format(1, -3, 3),
    fadev.custom_format(5, -6, 7, subnormals=False, has_inf=False, overflow="saturate"),
    fadev.custom_format(1, -1022, 1023),             # ulp 2^1023 at the top binade: a subnormal factor
    fadev.custom_format(53, -1022, 1023, subnormals=False),
]


def _ulp_inputs(rng, n=50_000):
    """ref: random bit patterns (every exponent, NaN payloads of both signs, infinities), values over the
    whole exponent range, zeros, subnormals; test: near ref, or unrelated, or special."""
    with np.errstate(over="ignore", invalid="ignore"):
        edges = np.array([0.0, -0.0, 5e-324, -5e-324, 2.2250738585072014e-308, 1.7976931348623157e308,
                          np.inf, -np.inf, np.nan, -np.nan, 1.0, 2.0, 3.0])
        payload_nans = np.array([0x7FF0000000000001, 0xFFF4000000000123, 0x7FF8000000000abc],
                                dtype=np.uint64).view(np.float64)
        ref = np.concatenate([rng.integers(0, 2**64, n, dtype=np.uint64).view(np.float64),
                              rng.standard_normal(n) * np.exp2(rng.integers(-1100, 1030, n).astype(float)),
                              edges, payload_nans])
        near = ref + rng.standard_normal(ref.size) * np.where(np.isfinite(ref), np.abs(ref), 1.0) \
            * 10.0 ** rng.integers(-17, 3, ref.size)
        other = rng.permutation(ref)
        test = np.where(rng.random(ref.size) < 0.7, near, other)
    return test, ref


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("kind", ["numpy", "torch"])
@pytest.mark.parametrize("fmt", ULP_FORMATS, ids=str)
def test_gpu_ulp_error_bit_identical(fmt, kind):
    test, ref = _ulp_inputs(np.random.default_rng(8))
    cpu = fadev.ulp_error(test, ref, fmt)
    gpu = _to_numpy(fadev.ulp_error(_as_input(test, kind), _as_input(ref, kind), fmt, device="cuda"))
    assert gpu.shape == cpu.shape
    diff = np.flatnonzero(gpu.view(np.uint64) != cpu.view(np.uint64))
    assert diff.size == 0, (f"{fmt} ({kind}): {diff.size} differ, e.g. test={test[diff[:3]].tolist()} "
                            f"ref={ref[diff[:3]].tolist()} gpu={gpu[diff[:3]].tolist()} cpu={cpu[diff[:3]].tolist()}")


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("kind", ["numpy", "torch"])
@pytest.mark.parametrize("max_ulp", [1, 4, 16])
def test_gpu_ulp_histogram_same_counts(max_ulp, kind):
    test, ref = _ulp_inputs(np.random.default_rng(10))
    cpu = fadev.ulp_histogram(test, ref, "bf16", max_ulp=max_ulp)
    gpu = fadev.ulp_histogram(_as_input(test, kind), _as_input(ref, kind), "bf16", max_ulp=max_ulp, device="cuda")
    assert np.array_equal(gpu.counts, cpu.counts) and (gpu.n_nan, gpu.n) == (cpu.n_nan, cpu.n)


@pytest.mark.gpu
@needs_gpu
def test_gpu_ulp_error_keeps_shape():
    rng = np.random.default_rng(9)
    ref = rng.standard_normal((3, 5, 7))
    test = ref + 1e-3
    gpu = fadev.ulp_error(test, ref, "bf16", device="cuda")
    assert isinstance(gpu, np.ndarray) and gpu.shape == (3, 5, 7)
    assert np.array_equal(gpu, fadev.ulp_error(test, ref, "bf16"))


@pytest.mark.skipif(not _core.cuda_info()["compiled"], reason="fadev was built without CUDA")
def test_cuda_metrics_reject_null_pointers():
    """The C entry points check their arguments before touching the device (runs without a GPU)."""
    fmt = fadev.formats["bf16"]._c
    with pytest.raises(ValueError, match="invalid argument"):
        _core.cuda_deviation(0, 0, 5)
    with pytest.raises(ValueError, match="invalid argument"):
        _core.cuda_wasserstein(0, 3, 0, 4)
    with pytest.raises(ValueError, match="invalid argument"):
        _core.cuda_ulp_error(0, 0, 5, fmt, 0)
