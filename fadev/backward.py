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

from . import _args
from . import backends
from . import cuda as _cuda
from . import cuda_plans as _plans


def baseline_attention_backward(q, k, v, out, lse, dout, policy, *, causal=False, scale=None, device=None):
    """Gradients (dq, dk, dv) of materialised attention, as autograd differentiates it: P recomputed
    exactly as :func:`fadev.baseline_attention` computes it, D_i = sum_j P_ij dP_ij, one block of all
    queries and one of all keys. ``out`` and ``lse`` are checked for shape but not read. ``policy``,
    ``causal``, ``scale`` and ``device`` as the forward's."""
    key, done = _plans.replay("cuda_baseline_attention_backward", device, policy, (causal, scale),
                              (q, k, v, out, lse, dout))
    if done is not None:
        return done
    gpu = _cuda.route(device, q=q, k=k, v=v, out=out, lse=lse, dout=dout)
    q4, k4, v4, pol, causal, scale, rank = _args.prepare(q, k, v, policy, causal, scale, gpu)
    out4, lse3, dout4 = _args.saved(q4, out, lse, dout, rank, gpu)
    call = _args.Call(pol, scale, causal)
    grads = backends.of(gpu).backward("baseline", q4, k4, v4, out4, lse3, dout4, call)
    return _plans.keep(key, gpu, policy, call, q4, k4, _args.unshape_grads(grads, rank))


def flash_attention_backward(q, k, v, out, lse, dout, policy, *, causal=False, scale=None, block_q=None,
                             block_kv=None, sram_bytes=None, exp=None, device=None):
    """Gradients (dq, dk, dv) by FlashAttention-2's backward: P recomputed from the saved ``lse``,
    D_i = rowsum(dO * O), dQ summed over K/V blocks of ``block_kv`` keys, dK and dV over query blocks of
    ``block_q`` rows (or both from ``sram_bytes``, as the forward's). ``exp`` ("exp" or "exp2") must be
    the forward's. None takes the policy's value (the presets carry their kernel's, e.g. fa2: 128 x 64,
    exp2). ``device`` as the forward's."""
    key, done = _plans.replay("cuda_flash_attention_backward", device, policy,
                              (causal, scale, block_q, block_kv, sram_bytes, exp), (q, k, v, out, lse, dout))
    if done is not None:
        return done
    gpu = _cuda.route(device, q=q, k=k, v=v, out=out, lse=lse, dout=dout)
    q4, k4, v4, pol, causal, scale, rank = _args.prepare(q, k, v, policy, causal, scale, gpu)
    out4, lse3, dout4 = _args.saved(q4, out, lse, dout, rank, gpu)
    call = _args.backward_call(pol, q4, causal, scale, block_q, block_kv, sram_bytes, exp)
    grads = backends.of(gpu).backward("flash", q4, k4, v4, out4, lse3, dout4, call)
    return _plans.keep(key, gpu, policy, call, q4, k4, _args.unshape_grads(grads, rank))


__all__ = ["baseline_attention_backward", "flash_attention_backward"]
