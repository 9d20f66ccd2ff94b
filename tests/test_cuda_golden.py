"""Golden attention on the GPU (cuda/golden.cu) against the CPU's golden policy (csrc/baseline.c).

Both compute softmax(scale Q K^T) V in fp64, in different operation orders, so they agree within a few fp64
rounding errors of the problem's scale: with eps = 2^-52, S = |scale| max_ij sum_d |q_id| |k_jd| (the
largest score the rounding of a dot product can see), V = max |v| and Nk keys (the sums of P V and of l
round about sqrt(Nk) times), every output differs by at most 16 eps V (1 + S + sqrt(Nk)) and every LSE
by 16 eps (1 + S + sqrt(Nk) + max |lse|) -- bounds that a wrong mask, tile edge or normalisation misses
by orders of magnitude. Rows that see no key are exactly 0 with LSE -inf.
Shapes cover D from 1 to 256 (the padded, the fast and the split paths), causal and not, Nq < Nk and
Nq > Nk, grouped-query heads, lengths that are no multiple of any tile, NumPy and PyTorch inputs,
and misaligned tensors (the 8-byte copy path). The argument checks of the C entry point run wherever
fadev was built with nvcc (they fail before any device is touched).
"""
import math

import numpy as np
import pytest

import fadev
from fadev import _core
from helpers import needs_gpu

EPS = 2.0**-52

# (B, H, Hkv, Nq, Nk, D, causal)
SHAPES = [
    (1, 2, 1, 37, 50, 1, False),
    (1, 2, 1, 37, 50, 7, True),
    (2, 4, 2, 45, 81, 64, True),
    (1, 2, 2, 300, 517, 64, False),
    (2, 4, 1, 300, 517, 64, True),
    (1, 1, 1, 130, 70, 64, True),     # Nq > Nk: the first 60 rows see no key
    (1, 3, 3, 60, 61, 100, True),
    (1, 2, 1, 200, 333, 128, False),
    (1, 2, 1, 333, 200, 128, True),
    (1, 1, 1, 70, 95, 200, True),     # D > 128: output columns in two halves
    (2, 2, 2, 40, 37, 256, False),
    (1, 2, 2, 1, 1, 64, True),
]


def _qkv(shape, seed):
    b, h, hkv, nq, nk, d, _ = shape
    rng = np.random.default_rng(seed)
    return rng.standard_normal((b, h, nq, d)), rng.standard_normal((b, hkv, nk, d)), rng.standard_normal((b, hkv, nk, d))


def _check(q, k, v, causal, scale, out, lse, label):
    """out, lse (NumPy) against the CPU's golden policy, within the bounds of the module docstring."""
    ref, ref_lse = fadev.baseline_attention(q, k, v, "golden", causal=causal, scale=scale, return_lse=True)
    group = q.shape[1] // k.shape[1]
    kk = np.repeat(np.abs(k), group, axis=1)
    s_max = abs(scale) * float(np.max(np.abs(q) @ kk.transpose(0, 1, 3, 2)))
    v_max = float(np.max(np.abs(v)))
    assert out.shape == ref.shape and lse.shape == ref_lse.shape, label
    unseen = np.isneginf(ref_lse)  # rows that see no key
    assert np.array_equal(np.isneginf(lse), unseen), f"{label}: rows with lse = -inf differ"
    assert np.all(out[unseen] == 0.0), f"{label}: a row that sees no key is not 0"
    err = float(np.max(np.abs(out - ref)))
    spread = 1 + s_max + math.sqrt(k.shape[2])
    tol = 16 * EPS * v_max * spread
    assert err <= tol, f"{label}: max |out - cpu golden| = {err:.3g} > {tol:.3g}"
    seen = ~unseen
    if seen.any():
        lse_err = float(np.max(np.abs(lse[seen] - ref_lse[seen])))
        lse_tol = 16 * EPS * (spread + float(np.max(np.abs(ref_lse[seen]))))
        assert lse_err <= lse_tol, f"{label}: max |lse - cpu golden| = {lse_err:.3g} > {lse_tol:.3g}"


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "B{}-H{}-Hkv{}-Nq{}-Nk{}-D{}-{}".format(
    *s[:6], "causal" if s[6] else "full"))
def test_gpu_golden_matches_cpu(shape):
    q, k, v = _qkv(shape, seed=sum(shape))
    causal = shape[6]
    out, lse = fadev.golden_attention(q, k, v, causal=causal, return_lse=True, device="cuda")
    assert isinstance(out, np.ndarray) and isinstance(lse, np.ndarray)
    _check(q, k, v, causal, 1 / math.sqrt(q.shape[-1]), out, lse, str(shape))
    alone = fadev.golden_attention(q, k, v, causal=causal, device="cuda")  # lse not asked for: same output
    assert np.array_equal(alone, out)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_golden_many_tiles(d, causal):
    """The fast paths over many query blocks and key tiles (N = 1024)."""
    shape = (1, 2, 1, 1024, 1024, d, causal)
    q, k, v = _qkv(shape, seed=d)
    out, lse = fadev.golden_attention(q, k, v, causal=causal, return_lse=True, device="cuda")
    _check(q, k, v, causal, 1 / math.sqrt(d), out, lse, str(shape))


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("scale", [0.3, -0.2, 0.0])
def test_gpu_golden_scale(scale):
    q, k, v = _qkv((1, 2, 2, 50, 70, 64, True), seed=3)
    out, lse = fadev.golden_attention(q, k, v, causal=True, scale=scale, return_lse=True, device="cuda")
    _check(q, k, v, True, scale, out, lse, f"scale={scale}")


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("offset", [0, 1])
@pytest.mark.parametrize("d", [64, 7])
def test_gpu_golden_torch(d, offset):
    """PyTorch CUDA tensors in, PyTorch CUDA tensors out; offset 1 makes the tensors 8-byte aligned only."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA device")
    shape = (2, 4, 2, 90, 130, d, True)
    q, k, v = _qkv(shape, seed=d + offset)

    def on_gpu(x):
        flat = torch.zeros(x.size + offset, dtype=torch.float64, device="cuda")
        flat[offset:] = torch.from_numpy(x.ravel()).to("cuda")
        return flat[offset:].view(x.shape)

    tq, tk, tv = on_gpu(q), on_gpu(k), on_gpu(v)
    assert (tq.data_ptr() % 16 == 0) == (offset == 0)
    out, lse = fadev.golden_attention(tq, tk, tv, causal=True, return_lse=True)  # device follows the inputs
    assert isinstance(out, torch.Tensor) and out.device.type == "cuda" and out.dtype == torch.float64
    assert out.shape == tq.shape and lse.shape == tq.shape[:3]
    _check(q, k, v, True, 1 / math.sqrt(d), out.cpu().numpy(), lse.cpu().numpy(), f"torch d={d} offset={offset}")


def _params(b=1, h=2, hkv=1, nq=8, nk=8, d=64, scale=0.125, causal=False):
    """(shape, call spec) of a golden device call (fadev._args.Call.c; golden reads no policy)."""
    return (b, h, hkv, nq, nk, d), (None, None, None, scale, causal, 0, 0, 0, 0, 0)


@pytest.mark.skipif(not _core.cuda_info()["compiled"], reason="fadev was built without CUDA")
def test_cuda_golden_rejects_bad_arguments():
    """fadev_cuda_golden_attention validates as the CPU kernels do, before touching the device (the
    pointers below are never dereferenced)."""
    p = 256  # a non-NULL address
    bad = {
        "heads % heads_kv": (ValueError, "shape mismatch", _params(h=3, hkv=2)),
        "dim 0": (ValueError, "invalid argument", _params(d=0)),
        "dim 257": (ValueError, "invalid argument", _params(d=257)),
        "batch 0": (ValueError, "invalid argument", _params(b=0)),
        "seq_kv 0": (ValueError, "invalid argument", _params(nk=0)),
        "scale inf": (ValueError, "invalid argument", _params(scale=math.inf)),
        "scale nan": (ValueError, "invalid argument", _params(scale=math.nan)),
        "size overflow": (MemoryError, "size overflow", _params(b=2**40, nq=2**20)),
    }
    for name, (error, message, params) in bad.items():
        with pytest.raises(error, match=message):
            _core.cuda_golden_attention(p, p, p, p, 0, *params)
    with pytest.raises(ValueError, match="invalid argument"):  # NULL q
        _core.cuda_golden_attention(0, p, p, p, 0, *_params())
