"""Attention backward under a precision policy: baseline (materialised, as autograd) and flash
(FlashAttention-2's order).

Both follow docs/numerics.md "Backward" operation by operation, so one policy and one tiling give one
bit pattern on any thread count. They take the forward's inputs and results (``out`` and ``lse`` as
returned by :func:`fadev.baseline_attention` / :func:`fadev.flash_attention` with ``return_lse=True``)
and the output gradient ``dout``, and return ``(dq, dk, dv)``: float64 arrays shaped like q, k, v whose
values are exact in the policy's ``grad`` format. The forward stages of the policy govern the
recomputation of the scores and P, its backward stages (``bwd_p`` ... ``grad``) everything else.
Grouped-query K/V get dk, dv summed over the query heads of each group; keys no query sees get 0, and
so do query rows that see no key.
"""
from __future__ import annotations

import numpy as np

from . import _core
from . import cuda as _cuda
from .attention import _array, _prepare, _tile
from .formats import _numeric
from .policy import EXP_FORMS


def _saved(q, out, lse, dout, rank, gpu=None, dtype=np.float64, lse_dtype=np.float64):
    """out, dout (4-D) and lse (3-D) as float64 arrays (device arrays of ``dtype`` and ``lse_dtype`` with
    ``gpu``), their shapes checked against q's original rank."""
    out, dout = _array(out, "out", gpu, dtype), _array(dout, "dout", gpu, dtype)
    lse = gpu.operand(lse, "lse", lse_dtype) if gpu else _numeric(lse, "lse").astype(np.float64, copy=False)
    shape = q.shape[4 - rank:]
    for name, arr, want in (("out", out, shape), ("dout", dout, shape), ("lse", lse, shape[:-1])):
        if arr.shape != want:
            what = "q's shape without its last axis" if name == "lse" else "q's shape"
            raise ValueError(f"{name}: expected {what} {want}, got {arr.shape}")
    return (out.reshape(q.shape), lse.reshape(q.shape[:3]), dout.reshape(q.shape))


def _finish(grads, rank):
    return tuple(g.reshape(g.shape[4 - rank:]) for g in grads)


def baseline_attention_backward(q, k, v, out, lse, dout, policy, causal=False, scale=None, device=None):
    """Gradients (dq, dk, dv) of materialised attention, as autograd differentiates it: P recomputed
    exactly as :func:`fadev.baseline_attention` computes it, D_i = sum_j P_ij dP_ij, one block of all
    queries and one of all keys. ``out`` and ``lse`` are checked for shape but not read. ``policy``,
    ``causal``, ``scale`` and ``device`` as the forward's."""
    gpu = _cuda.route(device, q=q, k=k, v=v, out=out, lse=lse, dout=dout)
    q4, k4, v4, pol, scale, rank = _prepare(q, k, v, policy, scale, causal, gpu)
    out4, lse3, dout4 = _saved(q4, out, lse, dout, rank, gpu)
    grads = (gpu or _core).baseline_attention_backward(q4, k4, v4, out4, lse3, dout4, pol._c, pol._c_backward, scale,
                                              bool(causal))
    return _finish(grads, rank)


def flash_attention_backward(q, k, v, out, lse, dout, policy, block_q=None, block_kv=None, exp=None, causal=False,
                             scale=None, device=None):
    """Gradients (dq, dk, dv) by FlashAttention-2's backward: P recomputed from the saved ``lse``,
    D_i = rowsum(dO * O), dQ summed over K/V blocks of ``block_kv`` keys, dK and dV over query blocks of
    ``block_q`` rows. ``exp`` ("exp" or "exp2") must be the forward's. None takes the policy's value (the
    presets carry their kernel's, e.g. fa2: 128 x 64, exp2). ``device`` as the forward's."""
    gpu = _cuda.route(device, q=q, k=k, v=v, out=out, lse=lse, dout=dout)
    q4, k4, v4, pol, scale, rank = _prepare(q, k, v, policy, scale, causal, gpu)
    out4, lse3, dout4 = _saved(q4, out, lse, dout, rank, gpu)
    block_q = _tile(pol.block_q if block_q is None else block_q, "block_q")
    block_kv = _tile(pol.block_kv if block_kv is None else block_kv, "block_kv")
    exp = pol.exp if exp is None else exp
    if exp not in EXP_FORMS:
        raise ValueError(f"exp must be one of {', '.join(EXP_FORMS)}, got {exp!r}")
    grads = (gpu or _core).flash_attention_backward(q4, k4, v4, out4, lse3, dout4, pol._c, pol._c_backward, scale,
                                                    bool(causal), block_q, block_kv, EXP_FORMS.index(exp))
    return _finish(grads, rank)


__all__ = ["baseline_attention_backward", "flash_attention_backward"]
