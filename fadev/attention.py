"""Attention forward under a precision policy: baseline (materialised) and flash (tiled online softmax).

Both follow docs/numerics.md operation by operation, so one policy and one tiling give one bit
pattern on any thread count. Arrays are (N, D), (H, N, D) or (B, H, N, D); K/V may have fewer heads
than Q (grouped-query: query head h reads K/V head h // (H / H_kv)) and another length (Nk != Nq;
causal masking is bottom-right aligned, as FlashAttention's). Results are float64 arrays whose values
are exact in the policy's ``out`` format (``lse`` in its ``stats`` format).
"""
from __future__ import annotations

import numbers

import numpy as np

from . import _args
from . import backends
from . import cuda as _cuda
from . import cuda_plans as _plans
from ._args import MAX_DIM, sram_tiles
from .formats import as_format, check_bytes, round as _round


def baseline_attention(q, k, v, policy, *, causal=False, scale=None, return_lse=False, device=None):
    """Materialised attention softmax(scale Q K^T) V with every intermediate rounded per ``policy``.

    ``policy``: a :class:`fadev.Policy` or a preset string ("golden", "naive:bf16", "fa2(fp16)").
    ``scale`` defaults to 1/sqrt(D). Returns ``out`` (shaped like q), or ``(out, lse)`` with lse the
    log-sum-exp of each row's scaled scores (shape of q without D). A causal row that sees no key
    (Nq > Nk) gives out = 0 and lse = -inf. ``device``: None (the GPU when an input is a CUDA array),
    "cpu" or "cuda"; the GPU kernel gives the same bits (inputs and results as :mod:`fadev.cuda` says).
    """
    key, done = _plans.replay("cuda_baseline_attention", device, policy, (causal, scale, return_lse), (q, k, v))
    if done is not None:
        return done
    gpu = _cuda.route(device, q=q, k=k, v=v)
    q4, k4, v4, pol, causal, scale, rank = _args.prepare(q, k, v, policy, causal, scale, gpu, return_lse)
    call = _args.Call(pol, scale, causal)
    out, lse = backends.of(gpu).forward("baseline", q4, k4, v4, call)
    return _plans.keep(key, gpu, policy, call, q4, k4, _args.unshape_forward(out, lse, rank, return_lse))


def golden_attention(q, k, v, *, causal=False, scale=None, return_lse=False, device=None):
    """The fp64 reference answer: on the CPU :func:`baseline_attention` under the golden policy (every
    operation fp64, in docs/numerics.md's order); on the GPU fadev's fp64 tensor-core kernel (the same
    mathematics in another operation order, within a few fp64 ulps of the CPU's). Arguments and results
    as :func:`baseline_attention`'s (it has no policy argument: the policy is golden)."""
    key, done = _plans.replay("cuda_golden_attention", device, None, (causal, scale, return_lse), (q, k, v))
    if done is not None:
        return done
    gpu = _cuda.route(device, q=q, k=k, v=v)
    if gpu is None:
        return baseline_attention(q, k, v, "golden", causal=causal, scale=scale, return_lse=return_lse)
    q4, k4, v4, rank = _args.qkv(q, k, v, gpu)
    _args.boolean(return_lse, "return_lse")
    call = _args.Call(None, _args.scale_of(scale, q4.shape[3]), _args.causal_of(causal))
    out, lse = backends.of(gpu).forward("golden", q4, k4, v4, call)
    return _plans.keep(key, gpu, None, call, q4, k4, _args.unshape_forward(out, lse, rank, return_lse))


def flash_attention(q, k, v, policy, *, causal=False, scale=None, block_q=None, block_kv=None, sram_bytes=None,
                    loop_order=None, normalize=None, exp=None, return_lse=False, device=None):
    """FlashAttention's tiled online-softmax forward with every intermediate rounded per ``policy``.

    ``block_q`` (Br) and ``block_kv`` (Bc) are the tile sizes, or ``sram_bytes`` M gives them by
    FlashAttention-1's rule Bc = ceil(M / 4d), Br = min(Bc, d) (not together with block_q/block_kv).
    ``loop_order`` "q_outer" (FA2) or "kv_outer" (FA1: O and l round-trip through memory in the
    policy's ``state`` format), ``normalize`` "deferred" (FA2) or "eager" (FA1), ``exp`` "exp" or "exp2"
    (log2 e folded into the scale). None takes the policy's value (presets carry their kernel's
    defaults, e.g. fa2: 128 x 64, q_outer, deferred, exp2). Returns like :func:`baseline_attention`;
    ``device`` as there.
    """
    options = (causal, scale, block_q, block_kv, sram_bytes, loop_order, normalize, exp, return_lse)
    key, done = _plans.replay("cuda_flash_attention", device, policy, options, (q, k, v))
    if done is not None:
        return done
    gpu = _cuda.route(device, q=q, k=k, v=v)
    q4, k4, v4, pol, causal, scale, rank = _args.prepare(q, k, v, policy, causal, scale, gpu, return_lse)
    call = _args.forward_call(pol, q4, causal, scale, block_q, block_kv, sram_bytes, loop_order, normalize, exp)
    out, lse = backends.of(gpu).forward("flash", q4, k4, v4, call)
    return _plans.keep(key, gpu, policy, call, q4, k4, _args.unshape_forward(out, lse, rank, return_lse))


DISTRIBUTIONS = ("normal", "uniform", "outlier")


def random_qkv(shape, *, dist="normal", seed=0, fmt=None, heads_kv=None, seq_kv=None):
    """Reproducible random (q, k, v) float64 arrays; q has ``shape`` ((N, D), (H, N, D) or (B, H, N, D)).

    k and v have ``heads_kv`` heads (default: q's; needs a heads axis) and ``seq_kv`` rows (default: q's).
    ``dist``: "normal" N(0, 1); "uniform" U[-1, 1); "outlier" FlashAttention-3's N(0, 1) + N(0, 100) *
    Bernoulli(0.001): one entry in a thousand gets an extra normal term of variance 100, i.e. standard
    deviation 10 (FA3 §4.3). Drawn from numpy's Generator(PCG64(seed)) in the order q, k, v; each
    outlier tensor draws its base normals, then the Bernoulli uniforms, then the outlier normals. With
    ``fmt`` the values are rounded (nearest even) to that format.
    """
    _args.choice("dist", dist, DISTRIBUTIONS)
    shape = _args.shape_of(shape, "shape")
    if len(shape) not in (2, 3, 4):
        raise ValueError(f"shape must be (N, D), (H, N, D) or (B, H, N, D) with sizes >= 1, got {shape}")
    kv_shape = list(shape)
    if heads_kv is not None:
        if len(shape) < 3:
            raise ValueError(f"heads_kv needs a heads axis in shape, got {shape}")
        heads_kv = _args.positive_int(heads_kv, "heads_kv")
        if shape[-3] % heads_kv:
            raise ValueError(f"heads_kv must divide q's {shape[-3]} heads, got {heads_kv}")
        kv_shape[-3] = heads_kv
    if seq_kv is not None:
        kv_shape[-2] = _args.positive_int(seq_kv, "seq_kv")
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral) or seed < 0:
        raise ValueError(f"seed must be a non-negative integer, got {seed!r}")
    fmt = as_format(fmt) if fmt is not None else None
    sizes = (np.prod(shape, dtype=object), 2 * np.prod(kv_shape, dtype=object))
    check_bytes("shape", 8 * (sum(sizes) + max(sizes)), f"q {shape} and k, v {tuple(kv_shape)} as float64")
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


__all__ = ["baseline_attention", "flash_attention", "golden_attention", "random_qkv", "sram_tiles", "MAX_DIM"]
