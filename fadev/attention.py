"""Attention forward under a precision policy: baseline (materialised) and flash (tiled online softmax).

Both follow docs/numerics.md operation by operation, so one policy and one tiling give one bit
pattern on any thread count. Arrays are (N, D), (H, N, D) or (B, H, N, D); K/V may have fewer heads
than Q (grouped-query: query head h reads K/V head h // (H / H_kv)) and another length (Nk != Nq;
causal masking is bottom-right aligned, as FlashAttention's). Results are float64 arrays whose values
are exact in the policy's ``out`` format (``lse`` in its ``stats`` format).
"""
from __future__ import annotations

import math
import numbers

import numpy as np

from . import _core
from . import cuda as _cuda
from .formats import ROUNDING_MODES, _numeric, as_format, round as _round
from .policy import EXP_FORMS, LOOP_ORDERS, NORMALIZE, as_policy

MAX_DIM = 256
_INT32_MAX = 2**31 - 1


def _array(x, name, gpu=None, dtype=np.float64):
    """x as a float64 NumPy array, or with ``gpu`` (fadev.cuda) a contiguous ``dtype`` device array."""
    arr = gpu.operand(x, name, dtype) if gpu else _numeric(x, name)
    if arr.ndim not in (2, 3, 4):
        raise ValueError(f"{name}: expected a 2-D (N, D), 3-D (H, N, D) or 4-D (B, H, N, D) array, "
                         f"got shape {arr.shape}")
    if 0 in arr.shape:
        raise ValueError(f"{name}: every dimension must be >= 1, got shape {arr.shape}")
    return arr if gpu else arr.astype(np.float64, copy=False)


def _prepare(q, k, v, policy, scale, causal, gpu=None, dtype=np.float64):
    """Validated 4-D float64 q, k, v (device arrays of ``dtype`` with ``gpu``), the Policy, the scale and
    the original rank."""
    pol = as_policy(policy, "policy")
    q, k, v = _array(q, "q", gpu, dtype), _array(k, "k", gpu, dtype), _array(v, "v", gpu, dtype)
    if not q.ndim == k.ndim == v.ndim:
        raise ValueError(f"q, k, v must have the same rank, got q {q.ndim}-D, k {k.ndim}-D, v {v.ndim}-D")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got k {k.shape} and v {v.shape}")
    rank = q.ndim
    q4, k4, v4 = (t.reshape((1,) * (4 - rank) + t.shape) for t in (q, k, v))
    B, H, _, D = q4.shape
    if k4.shape[3] != D:
        raise ValueError(f"k: head dim {k4.shape[3]} does not match q's head dim {D}")
    if D > MAX_DIM:
        raise ValueError(f"q: head dim D must be <= {MAX_DIM}, got {D}")
    if k4.shape[0] != B:
        raise ValueError(f"k: batch {k4.shape[0]} does not match q's batch {B}")
    if H % k4.shape[1] != 0:
        raise ValueError(f"q has {H} heads, not a multiple of k/v's {k4.shape[1]} heads (grouped-query needs "
                         f"heads % heads_kv == 0)")
    if ROUNDING_MODES[pol.rounding] == ROUNDING_MODES["stochastic"] and max(q4.shape[2], k4.shape[2]) >= 2**21:
        raise ValueError(f"stochastic rounding needs sequence lengths < 2^21 (the counter packs them in 21 bits), "
                         f"got seq_q={q4.shape[2]}, seq_kv={k4.shape[2]}")
    if scale is None:
        scale = 1.0 / math.sqrt(D)
    elif isinstance(scale, bool) or not isinstance(scale, numbers.Real):
        raise TypeError(f"scale must be a real number or None, got {scale!r}")
    elif not math.isfinite(float(scale)):
        raise ValueError(f"scale must be finite, got {scale!r}")
    if not isinstance(causal, (bool, np.bool_)):
        raise TypeError(f"causal must be a bool, got {causal!r}")
    return q4, k4, v4, pol, float(scale), rank


def _finish(out, lse, rank, return_lse):
    out = out.reshape(out.shape[4 - rank:])
    if not return_lse:
        return out
    return out, lse.reshape(lse.shape[4 - rank:])


def baseline_attention(q, k, v, policy, causal=False, scale=None, return_lse=False, device=None):
    """Materialised attention softmax(scale Q K^T) V with every intermediate rounded per ``policy``.

    ``policy``: a :class:`fadev.Policy` or a preset string ("golden", "naive:bf16", "fa2(fp16)").
    ``scale`` defaults to 1/sqrt(D). Returns ``out`` (shaped like q), or ``(out, lse)`` with lse the
    log-sum-exp of each row's scaled scores (shape of q without D). A causal row that sees no key
    (Nq > Nk) gives out = 0 and lse = -inf. ``device``: None (the GPU when an input is a CUDA array),
    "cpu" or "cuda"; the GPU kernel gives the same bits (inputs and results as :mod:`fadev.cuda` says).
    """
    gpu = _cuda.route(device, q=q, k=k, v=v)
    q4, k4, v4, pol, scale, rank = _prepare(q, k, v, policy, scale, causal, gpu)
    out, lse = (gpu or _core).baseline_attention(q4, k4, v4, pol._c, scale, bool(causal))
    return _finish(out, lse, rank, return_lse)


def golden_attention(q, k, v, causal=False, scale=None, return_lse=False, device=None):
    """The fp64 reference answer: on the CPU :func:`baseline_attention` under the golden policy (every
    operation fp64, in docs/numerics.md's order); on the GPU fadev's fp64 tensor-core kernel (the same
    mathematics in another operation order, within a few fp64 ulps of the CPU's). Arguments and results
    as :func:`baseline_attention`'s."""
    gpu = _cuda.route(device, q=q, k=k, v=v)
    if gpu is None:
        return baseline_attention(q, k, v, "golden", causal, scale, return_lse)
    q4, k4, v4, _, scale, rank = _prepare(q, k, v, "golden", scale, causal, gpu)
    out, lse = gpu.golden_attention(q4, k4, v4, scale, bool(causal))
    return _finish(out, lse, rank, return_lse)


def _tile(value, name):
    if isinstance(value, bool) or not isinstance(value, (numbers.Integral,)) or not 1 <= int(value) <= _INT32_MAX:
        raise ValueError(f"{name} must be a positive integer (at most 2^31 - 1), got {value!r}")
    return int(value)


def sram_tiles(sram_bytes, dim):
    """FlashAttention-1's tile rule for on-chip memory of M bytes: Bc = ceil(M / (4 d)), Br = min(Bc, d).
    Returns (block_q, block_kv) = (Br, Bc)."""
    m = _tile(sram_bytes, "sram_bytes")
    bc = -(-m // (4 * dim))
    return min(bc, dim), bc


def flash_attention(q, k, v, policy, block_q=None, block_kv=None, sram_bytes=None, loop_order=None, normalize=None,
                    exp=None, causal=False, scale=None, return_lse=False, device=None):
    """FlashAttention's tiled online-softmax forward with every intermediate rounded per ``policy``.

    ``block_q`` (Br) and ``block_kv`` (Bc) are the tile sizes, or ``sram_bytes`` M gives them by
    FlashAttention-1's rule Bc = ceil(M / 4d), Br = min(Bc, d) (not together with block_q/block_kv).
    ``loop_order`` "q_outer" (FA2) or "kv_outer" (FA1: O and l round-trip through memory in the
    policy's ``state`` format), ``normalize`` "deferred" (FA2) or "eager" (FA1), ``exp`` "exp" or "exp2"
    (log2 e folded into the scale). None takes the policy's value (presets carry their kernel's
    defaults, e.g. fa2: 128 x 64, q_outer, deferred, exp2). Returns like :func:`baseline_attention`;
    ``device`` as there.
    """
    gpu = _cuda.route(device, q=q, k=k, v=v)
    q4, k4, v4, pol, scale, rank = _prepare(q, k, v, policy, scale, causal, gpu)
    if sram_bytes is not None:
        if block_q is not None or block_kv is not None:
            raise ValueError(f"sram_bytes={sram_bytes!r} derives block_q and block_kv; do not pass them too "
                             f"(got block_q={block_q!r}, block_kv={block_kv!r})")
        block_q, block_kv = sram_tiles(sram_bytes, q4.shape[3])
    block_q = _tile(pol.block_q if block_q is None else block_q, "block_q")
    block_kv = _tile(pol.block_kv if block_kv is None else block_kv, "block_kv")
    choices = []
    for name, value, default, allowed in (("loop_order", loop_order, pol.loop_order, LOOP_ORDERS),
                                          ("normalize", normalize, pol.normalize, NORMALIZE),
                                          ("exp", exp, pol.exp, EXP_FORMS)):
        value = default if value is None else value
        if value not in allowed:
            raise ValueError(f"{name} must be one of {', '.join(allowed)}, got {value!r}")
        choices.append(allowed.index(value))
    out, lse = (gpu or _core).flash_attention(q4, k4, v4, pol._c, scale, bool(causal), block_q, block_kv, *choices)
    return _finish(out, lse, rank, return_lse)


DISTRIBUTIONS = ("normal", "uniform", "outlier")


def random_qkv(shape, dist="normal", seed=0, fmt=None, heads_kv=None, seq_kv=None):
    """Reproducible random (q, k, v) float64 arrays; q has ``shape`` ((N, D), (H, N, D) or (B, H, N, D)).

    k and v have ``heads_kv`` heads (default: q's; needs a heads axis) and ``seq_kv`` rows (default: q's).
    ``dist``: "normal" N(0, 1); "uniform" U[-1, 1); "outlier" FlashAttention-3's N(0, 1) + N(0, 100) *
    Bernoulli(0.001): one entry in a thousand gets an extra normal term of variance 100, i.e. standard
    deviation 10 (FA3 §4.3). Drawn from numpy's Generator(PCG64(seed)) in the order q, k, v; each
    outlier tensor draws its base normals, then the Bernoulli uniforms, then the outlier normals. With
    ``fmt`` the values are rounded (nearest even) to that format.
    """
    if dist not in DISTRIBUTIONS:
        raise ValueError(f"dist must be one of {', '.join(DISTRIBUTIONS)}, got {dist!r}")
    try:
        shape = tuple(int(s) for s in shape)
    except TypeError:
        raise TypeError(f"shape must be a tuple of ints, got {shape!r}") from None
    if len(shape) not in (2, 3, 4) or min(shape) < 1:
        raise ValueError(f"shape must be (N, D), (H, N, D) or (B, H, N, D) with sizes >= 1, got {shape}")
    kv_shape = list(shape)
    if heads_kv is not None:
        if len(shape) < 3:
            raise ValueError(f"heads_kv needs a heads axis in shape, got {shape}")
        heads_kv = _tile(heads_kv, "heads_kv")
        if shape[-3] % heads_kv:
            raise ValueError(f"heads_kv must divide q's {shape[-3]} heads, got {heads_kv}")
        kv_shape[-3] = heads_kv
    if seq_kv is not None:
        kv_shape[-2] = _tile(seq_kv, "seq_kv")
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral) or seed < 0:
        raise ValueError(f"seed must be a non-negative integer, got {seed!r}")
    fmt = as_format(fmt) if fmt is not None else None
    rng = np.random.Generator(np.random.PCG64(int(seed)))

    def draw(sh):
        if dist == "normal":
            x = rng.standard_normal(sh)
        elif dist == "uniform":
            x = rng.uniform(-1.0, 1.0, sh)
        else:
            x = rng.standard_normal(sh)
            hit = rng.random(sh) < 0.001
            x = x + np.where(hit, 10.0 * rng.standard_normal(sh), 0.0)
        return _round(x, fmt) if fmt is not None else x

    return draw(shape), draw(tuple(kv_shape)), draw(tuple(kv_shape))


__all__ = ["baseline_attention", "flash_attention", "golden_attention", "random_qkv", "sram_tiles"]
