"""CUDA rounding (cuda/device.cu) against the C core, bit for bit, and the CPU-only error path.

The GPU tests run where fadev was built with nvcc (FADEV_CUDA=1) and a CUDA device is present; elsewhere
they are skipped (fadev.cuda_available() is False). The CPU-side tests run everywhere without a device.
"""
import numpy as np
import pytest

import fadev
import helpers
from helpers import identical as _same_bits
from fadev import _core
from helpers import needs_gpu


FORMATS = [fadev.formats[n] for n in fadev.formats] + [
    fadev.custom_format(5, -6, 7),
    fadev.custom_format(5, -6, 7, subnormals=False, has_inf=False, overflow="saturate"),
    fadev.custom_format(1, -3, 3),
    fadev.custom_format(2, 0, 2, has_inf=False, overflow="saturate"),
]
MODES = {"rne": 0, "rtz": 1, "stochastic": 2}


def _inputs(n=10**6, seed=0):
    """Random bit patterns (every exponent, NaN payloads, infinities), normals over many binades,
    values near each format's boundaries, ties, and signed zeros."""
    rng = np.random.default_rng(seed)
    parts = [rng.integers(0, 2**64, n // 4, dtype=np.uint64).view(np.float64),
             rng.standard_normal(n // 4) * np.exp2(rng.integers(-160, 140, n // 4))]
    for f in FORMATS:
        edges = np.array([0.0, f.largest, f.smallest_normal, f.smallest_subnormal, f.smallest_subnormal / 2,
                          f.largest + f.largest * f.unit_roundoff, 1 + f.unit_roundoff, np.inf, np.nan])
        with np.errstate(over="ignore"):
            parts += [edges, -edges, np.nextafter(edges, np.inf), np.nextafter(edges, 0)]
    m = n - sum(len(p) for p in parts)
    parts.append(rng.uniform(-3, 3, m))
    x = np.concatenate(parts)
    rng.shuffle(x)
    return x


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("fmt", FORMATS, ids=str)
@pytest.mark.parametrize("mode", list(MODES))
def test_gpu_rounding_matches_cpu(fmt, mode):
    x = _inputs()
    for seed, stream, offset in ((0, 0, 0), (2**63 + 12345, 7, 3 * 2**32 + 11)):
        gpu = _core.cuda_round(x, fmt._c, MODES[mode], seed, stream, offset)
        cpu = _core.round(x, fmt._c, MODES[mode], seed, stream, offset)
        diff = np.flatnonzero(gpu.view(np.uint64) != cpu.view(np.uint64))
        assert diff.size == 0, (f"{fmt} {mode} seed={seed} stream={stream} offset={offset}: {diff.size} differ, "
                                f"e.g. x={x[diff[:3]].tolist()} gpu={gpu[diff[:3]].tolist()} cpu={cpu[diff[:3]].tolist()}")
        if offset == 0:  # and the public API
            assert _same_bits(gpu, fadev.round(x, fmt, mode, seed=seed, stream=stream))


@pytest.mark.gpu
@needs_gpu
def test_gpu_device_info_and_edge_sizes():
    info = fadev.cuda_info()
    assert info["compiled"] and info["devices"]
    dev = info["devices"][0]
    assert dev["index"] == 0 and dev["name"] and dev["capability"][0] >= 5 and dev["total_memory"] > 0
    bf16 = fadev.formats["bf16"]._c
    assert _core.cuda_round(np.zeros(0), bf16, 0, 0, 0, 0).shape == (0,)
    x = np.random.default_rng(1).standard_normal((3, 5, 7))  # any shape, odd sizes
    assert _same_bits(_core.cuda_round(x, bf16, 2, 9, 0, 0), _core.round(x, bf16, 2, 9, 0, 0))
    with pytest.raises(ValueError, match="cuda round: invalid rounding mode"):
        _core.cuda_round(x, bf16, 5, 0, 0, 0)


@pytest.mark.skipif(fadev.cuda_available(), reason="checks the path taken when no CUDA device is usable")
def test_no_cuda_device_path():
    info = fadev.cuda_info()
    assert fadev.cuda_available() is False
    assert info["devices"] == []
    with pytest.raises(RuntimeError, match=r"cuda round: CUDA not available \((fadev was built without CUDA|"
                                           r"fadev was built with CUDA, but no CUDA device was found \(cudaGetDeviceCount: [^)]+\))\)"):
        _core.cuda_round(np.ones(4), fadev.formats["bf16"]._c, 0, 0, 0, 0)
    assert fadev.round(np.ones(4), "bf16").tolist() == [1.0] * 4  # the CPU path is unaffected


def test_cpu_only_build_reports_no_cuda():
    """The in-place / pip-installed build of this test run is CPU-only unless FADEV_CUDA=1 built it."""
    info = fadev.cuda_info()
    assert set(info) == {"compiled", "devices"} and isinstance(info["compiled"], bool)
    if not info["compiled"]:
        assert info["devices"] == [] and fadev.cuda_available() is False
        with pytest.raises(RuntimeError, match=r"cuda round: CUDA not available \(fadev was built without CUDA\)"):
            _core.cuda_round(np.ones(2), fadev.formats["fp16"]._c, 0, 0, 0, 0)
