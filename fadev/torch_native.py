"""fadev's native tensor-core kernel as a differentiable PyTorch op.

:func:`native_attention` computes ``torch.nn.functional.scaled_dot_product_attention``'s result for CUDA
float16 / bfloat16 tensors (B, H, N, D) by :func:`fadev.native_attention` (cuda/native_forward.cu:
FlashAttention-2's order, fp32 accumulation, P rounded to the input dtype) and its gradients by
:func:`fadev.native_attention_backward` (cuda/native_backward.cu), as a ``torch.autograd.Function``. The
output and the gradients are the very tensors those two functions return, so they have their bits.

Head dims: those :func:`fadev.native_tiles` lists tiles for (64 and 128). ``import fadev`` never imports
this module (it needs PyTorch); ``fadev.torch_native`` imports it on first use.
"""
from __future__ import annotations

import numbers

import torch

from .cuda import device_count, no_gpu
from .formats import boolean
from . import _args
from .native import MMA, fit_tile, native_tiles
from .native import native_attention as _forward, native_attention_backward as _backward

DTYPES = (torch.float16, torch.bfloat16)


class _NativeFunction(torch.autograd.Function):
    """The native forward, saving (q, k, v, out, lse); the native backward from them."""

    @staticmethod
    def forward(ctx, q, k, v, causal, scale, tiles, deterministic, mma):
        (block_q, block_kv), (ctx.block_q, ctx.block_kv) = tiles
        out, lse = _forward(q, k, v, causal=causal, scale=scale, block_q=block_q, block_kv=block_kv, mma=mma,
                            return_lse=True)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.causal, ctx.scale, ctx.deterministic = causal, scale, deterministic
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = _backward(q, k, v, out, lse, dout, causal=ctx.causal, scale=ctx.scale, block_q=ctx.block_q,
                               block_kv=ctx.block_kv, deterministic=ctx.deterministic)
        return dq, dk, dv, None, None, None, None, None


def check(q, k, v, is_causal, scale, enable_gqa, block_q=None, block_kv=None, backward_block_q=None,
          backward_block_kv=None, mma="sync"):
    """Every check :func:`native_attention` makes before calling the kernel; the forward's and the
    backward's tiles ((block_q, block_kv), (block_q, block_kv)) it will use. Errors name the argument."""
    _args.choice("mma", mma, MMA)
    named = (("query", q), ("key", k), ("value", v))
    for name, t in named:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    for name, t in named:
        if t.dtype not in DTYPES:
            raise TypeError(f"{name}: the native kernel reads float16 or bfloat16, got {t.dtype}")
        if t.device.type != "cuda":
            raise ValueError(f"{name}: the native kernel runs on CUDA tensors, got a tensor on {t.device} (use "
                             f"fadev.torch.attention with a policy for CPU tensors)")
        if t.dim() != 4:
            raise ValueError(f"{name}: expected a 4-D (batch, heads, seq, head_dim) tensor, got shape "
                             f"{tuple(t.shape)}")
    if not q.dtype == k.dtype == v.dtype:
        raise TypeError(f"query, key and value must have one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not q.device == k.device == v.device:
        raise ValueError(f"query, key and value must be on one device, got {q.device}, {k.device}, {v.device}")
    _args.sdpa_shapes(q.shape, k.shape, v.shape, is_causal, enable_gqa)
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, numbers.Real)):
        raise TypeError(f"scale must be a real number or None, got {scale!r}")
    if not device_count():
        raise no_gpu("fadev.torch_native.native_attention")
    dim = int(q.shape[3])
    if not native_tiles(dim):
        raise ValueError(f"query: the native kernel has no tiles for head dim {dim} (supported: those "
                         f"fadev.native_tiles lists, 64 and 128)")
    forward = fit_tile(dim, block_q, block_kv, mma=mma)
    if backward_block_q is None and backward_block_kv is None and forward in native_tiles(dim, backward=True):
        return forward, forward
    return forward, fit_tile(dim, backward_block_q, backward_block_kv, backward=True,
                             names="backward_block_q, backward_block_kv")


def native_attention(q, k, v, *, is_causal=False, scale=None, enable_gqa=False, block_q=None, block_kv=None,
                     backward_block_q=None, backward_block_kv=None, deterministic=True, mma="sync"):
    """softmax(scale q k^T) v by fadev's native FlashAttention-2-style kernel, differentiable.

    ``torch.nn.functional.scaled_dot_product_attention``'s conventions: q (B, H, N, D), k and v
    (B, H_kv, N_kv, D) CUDA tensors of one dtype, float16 or bfloat16; ``scale`` defaults to 1/sqrt(D);
    ``is_causal`` masks key j > query i (needs N == N_kv); ``enable_gqa`` lets H be a multiple of H_kv
    (query head h reads K/V head h // (H / H_kv)). D is 64 or 128. The forward's tile (``block_q``,
    ``block_kv``) is one of ``fadev.native_tiles(D)`` (default: its first); the backward has its own list,
    ``fadev.native_tiles(D, backward=True)``, and uses (``backward_block_q``, ``backward_block_kv``) when
    given, else the forward's tile where that list has it, else its own default. ``deterministic``: dq
    by the backward's separate pass in key order (the same bits on every run, so a training run repeats
    exactly); False: by atomic adds, as FlashAttention-2. The output has q's dtype; the output and the
    gradients are the tensors :func:`fadev.native_attention` and :func:`fadev.native_attention_backward`
    return. ``mma="wgmma"``: the forward on Hopper's warpgroup MMA (its own tiles, ``fadev.native_tiles(D,
    mma="wgmma")``; the same bits as the mma.sync forward where both have the tile); the backward is mma.sync's.
    No dropout, no attn_mask.
    """
    tiles = check(q, k, v, is_causal, scale, enable_gqa, block_q, block_kv, backward_block_q, backward_block_kv, mma)
    return _NativeFunction.apply(q, k, v, bool(is_causal), None if scale is None else float(scale), tiles,
                                 boolean(deterministic, "deterministic"), mma)


__all__ = ["native_attention", "DTYPES"]
