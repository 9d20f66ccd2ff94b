"""Ring / context-parallel attention simulated on one device: what W ranks compute, hop by hop.

``ring_attention`` splits the sequence over ``world_size`` ranks by a ``layout`` ("contiguous", "zigzag",
"striped"), runs the policy's flash attention for every (rank, ring step) piece and merges the partial
outputs with their LSE as ring-flash-attention does (csrc/ring.c, top comment, is the exact operation
order; the masks per step are listed there). ``ring_attention_backward`` runs the ring backward: flash
backward per piece with the saved global out and LSE, dq accumulated across steps, dk/dv travelling the
ring (or reduce-scattered for the all-gather form).

The formats of the merge are a :class:`RingMerge`; presets (``merge=`` strings):

==================  =====================================================================================
``lowp_partials``   each step's partial out returned in the policy's ``out`` format (16-bit), LSE in
                    ``stats``; running out/LSE and the merge in fp32; final out rounded once
                    (ring-flash-attention today). Backward: partial grads 16-bit, dq/dk/dv accumulated
                    and sent in fp32.
``fp32_partials``   the partial outputs (and partial grads) kept in fp32 (a flash kernel returning raw fp32).
``lowp_running``    only max/LSE in fp32; the running output stored in the input format between hops
                    (ring-attention-pytorch's Triton path), partial outputs fp32 (in registers).
``allgather``       K/V all-gathered, one flash call per query group, no merge (llama3 context parallel);
                    backward: rank-local grads in fp32, dk/dv reduce-scattered in the 16-bit ``grad`` format.
==================  =====================================================================================

Format fields take a format name or one of the policy-relative tokens: "acc" (fp32, or the policy's
``out`` format when that is wider, so under "golden" everything is fp64), "out", "grad", "input", "stats"
(that stage of the policy).
"""
from __future__ import annotations

import dataclasses
from typing import NamedTuple

import numpy as np

from . import _args
from . import _core
from . import backends
from . import cuda as _cuda
from .formats import as_format, boolean, formats
from .policy import Policy

LAYOUTS = ("contiguous", "zigzag", "striped")
MERGES = ("lowp_partials", "fp32_partials", "lowp_running", "allgather")
_FORMAT_FIELDS = ("partial_out", "partial_lse", "merge", "running_out", "running_lse", "partial_grad", "dq_acc",
                  "dkv_acc", "dkv_transport")
_TOKENS = ("acc", "out", "grad", "input", "stats")


@dataclasses.dataclass(frozen=True)
class RingMerge:
    """Formats of a ring's merge and gradient traffic (fields in csrc/fadev.h's fadev_ring_params).

    Each format field is a format name / :class:`fadev.Format` or a token of ``_TOKENS`` resolved against
    the policy at call time. ``allgather`` switches to the llama3 form (no forward merge)."""

    partial_out: object = "out"
    partial_lse: object = "stats"
    merge: object = "acc"
    running_out: object = "acc"
    running_lse: object = "acc"
    partial_grad: object = "grad"
    dq_acc: object = "acc"
    dkv_acc: object = "acc"
    dkv_transport: object = "acc"
    allgather: bool = False
    name: str = dataclasses.field(default="custom", compare=False)

    def __post_init__(self):
        for f in _FORMAT_FIELDS:
            value = getattr(self, f)
            if not (isinstance(value, str) and value in _TOKENS):
                object.__setattr__(self, f, as_format(value, name=f))
        object.__setattr__(self, "allgather", boolean(self.allgather, "allgather"))

    @classmethod
    def preset(cls, name: str) -> "RingMerge":
        presets = {
            "lowp_partials": {},
            "fp32_partials": {"partial_out": "acc", "partial_grad": "acc"},
            "lowp_running": {"partial_out": "acc", "running_out": "input"},
            "allgather": {"allgather": True, "partial_grad": "acc", "dkv_transport": "grad"},
        }
        _args.choice("merge", name, MERGES)
        return cls(**presets[name], name=name)

    def replace(self, **changes) -> "RingMerge":
        if "name" not in changes:
            changes["name"] = f"{self.name}+" + ",".join(f"{k}={changes[k]}" for k in sorted(changes))
        return dataclasses.replace(self, **changes)

    def resolve(self, policy: Policy) -> dict:
        """{field: Format} under ``policy``."""
        wide = policy.out if policy.out.precision > 24 else formats["fp32"]
        stage = {"acc": wide, "out": policy.out, "grad": policy.grad, "input": policy.input, "stats": policy.stats}
        return {f: stage[v] if isinstance(v, str) else v for f in _FORMAT_FIELDS for v in (getattr(self, f),)}

    def _c(self, policy: Policy, world_size: int, layout: str):
        fmts = self.resolve(policy)
        return (world_size, LAYOUTS.index(layout), int(bool(self.allgather))) + tuple(fmts[f]._c for f in _FORMAT_FIELDS)


def as_merge(merge) -> RingMerge:
    if isinstance(merge, RingMerge):
        return merge
    if isinstance(merge, str):
        return RingMerge.preset(merge)
    raise TypeError(f"merge: expected one of {', '.join(MERGES)} or a RingMerge, got {type(merge).__name__}")


def _ring_args(q4, k4, world_size, layout, merge):
    world_size = _args.positive_int(world_size, "world_size")
    _args.choice("layout", layout, LAYOUTS)
    merge = as_merge(merge)
    N = q4.shape[2]
    if k4.shape[2] != N:
        raise ValueError(f"k: ring attention needs seq_kv == seq_q, got seq_kv={k4.shape[2]}, seq_q={N}")
    parts = 2 * world_size if layout == "zigzag" else world_size
    if N % parts:
        raise ValueError(f"world_size: layout {layout!r} needs N divisible by {'2 * ' if layout == 'zigzag' else ''}"
                         f"world_size = {parts}, got N={N}, world_size={world_size}")
    return world_size, layout, merge


class Ring(NamedTuple):
    """A ring as a kernel call reads it (:class:`fadev._args.Call`'s ``ring``)."""

    world_size: int
    layout: str
    merge: RingMerge

    def c(self, policy: Policy) -> tuple:
        """The binding's ring tuple (csrc/fadev.h's fadev_ring_params) under ``policy``."""
        return self.merge._c(policy, self.world_size, self.layout)

    def host(self, policy: Policy) -> tuple:
        """(formats, world_size, layout, allgather): what :mod:`fadev.ring_steps` takes."""
        return self.merge.resolve(policy), self.world_size, self.layout, self.merge.allgather


def ring_attention(q, k, v, policy, *, world_size, layout="contiguous", merge="lowp_partials", causal=False,
                   scale=None, block_q=None, block_kv=None, loop_order=None, normalize=None, exp=None,
                   return_lse=False, device=None):
    """Attention computed by a ring of ``world_size`` ranks (one device, exact per-rank arithmetic).

    ``layout``: "contiguous", "zigzag" (N divisible by 2W) or "striped"; ``merge``: a preset name
    (see the module doc) or a :class:`RingMerge`; ``policy`` governs every flash call; tiling options as
    :func:`fadev.flash_attention` (per call). Returns ``out`` or ``(out, lse)``; lse is the running LSE
    in the merge's ``running_lse`` format (allgather: the flash call's, in ``stats``). ``device`` as
    :func:`fadev.flash_attention`'s: on the GPU every ring step's flash call runs on the GPU's emulated
    flash kernel and the merge on the host (:mod:`fadev.ring_steps`), the same bits as the CPU."""
    gpu = _cuda.route(device, q=q, k=k, v=v)
    q4, k4, v4, pol, causal, scale, rank = _args.prepare(q, k, v, policy, causal, scale, gpu, return_lse)
    ring = Ring(*_ring_args(q4, k4, world_size, layout, merge))
    call = _args.forward_call(pol, q4, causal, scale, block_q, block_kv, None, loop_order, normalize, exp, ring)
    out, lse = backends.of(gpu).forward("ring", q4, k4, v4, call)
    return _args.unshape_forward(out, lse, rank, return_lse)


def ring_attention_backward(q, k, v, out, lse, dout, policy, *, world_size, layout="contiguous", merge="lowp_partials",
                            causal=False, scale=None, block_q=None, block_kv=None, exp=None, device=None):
    """(dq, dk, dv) of the ring backward: every piece's flash backward with the saved global ``out`` and
    ``lse`` (as :func:`ring_attention` returned them), dq summed across steps in ``dq_acc``, dk/dv carried
    around the ring (``dkv_acc`` adds, ``dkv_transport`` per hop) or reduce-scattered (allgather).
    ``device`` as :func:`ring_attention`'s (the pieces' flash backward on the GPU, the sums on the host)."""
    gpu = _cuda.route(device, q=q, k=k, v=v, out=out, lse=lse, dout=dout)
    q4, k4, v4, pol, causal, scale, rank = _args.prepare(q, k, v, policy, causal, scale, gpu)
    ring = Ring(*_ring_args(q4, k4, world_size, layout, merge))
    out4, lse3, dout4 = _args.saved(q4, out, lse, dout, rank, gpu)
    call = _args.backward_call(pol, q4, causal, scale, block_q, block_kv, None, exp, ring)
    grads = backends.of(gpu).backward("ring", q4, k4, v4, out4, lse3, dout4, call)
    return _args.unshape_grads(grads, rank)


def ring_coverage(seq, *, world_size, layout="contiguous", causal=False, allgather=False):
    """(seq, seq) int32 counts: how many of the ring's flash pieces compute each (query, key) pair, from
    the same piece list the kernels use (the full causal mask, tril, or all ones, when correct)."""
    seq = _args.positive_int(seq, "seq", limit=8192)
    q4 = np.zeros((1, 1, int(seq), 1))
    merge = "allgather" if boolean(allgather, "allgather") else "lowp_partials"
    ring = Ring(*_ring_args(q4, q4, world_size, layout, merge))
    return _core.ring_coverage(seq, _args.causal_of(causal), ring.c(Policy.golden()))


__all__ = ["ring_attention", "ring_attention_backward", "ring_coverage", "RingMerge", "LAYOUTS", "MERGES"]
