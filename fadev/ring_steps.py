"""Ring attention composed step by step: csrc/ring.c's pieces, merge and gradient sums, from Python.

csrc/ring.c runs a whole ring on the CPU in one C call. To run a ring's steps on another kernel (the
GPU's emulated flash kernels), :func:`forward` and :func:`backward` walk the same (step, rank, piece)
list in the same order (ring.c's top comment is the specification) and call a given flash function per
piece; the merge is ring.c's own (fadev._core.ring_merge), every accumulation is done in fp64 and rounded
nearest-even to its format, as ring.c does. With
the CPU's flash kernel they reproduce ring.c bit for bit (tests/test_ring.py); the GPU's emulated flash
kernels give the CPU's bits, so the ring on the GPU does too.
"""
from __future__ import annotations

import numpy as np

from . import _core
from ._args import Call
from .cuda import DeviceArray, route
from .formats import round as _round


def positions(N, W, layout, r, local):
    """Global rows of rank ``r``'s local rows ``local`` (ring.c's ring_pos)."""
    if layout == "contiguous":
        return r * (N // W) + local
    if layout == "striped":
        return local * W + r
    h = N // (2 * W)
    return np.where(local < h, r * h + local, (2 * W - 1 - r) * h + local - h)


def pieces(N, W, layout, allgather, causal, r, s):
    """(q_lo, q_n, src, k_lo, k_n, causal) of rank ``r`` at step ``s`` (ring.c's ring_pieces): query rows
    q_lo.. of rank r against rows k_lo.. of rank src's block (global rows when src < 0)."""
    n, h = N // W, N // (2 * W) if layout == "zigzag" else 0
    if allgather:
        if not causal:
            return [(0, n, -1, 0, N, False)]
        if layout == "contiguous":
            return [(0, n, -1, 0, (r + 1) * n, True)]
        if layout == "zigzag":
            return [(0, h, -1, 0, (r + 1) * h, True), (h, h, -1, 0, (2 * W - r) * h, True)]
        return [(a, 1, -1, 0, a * W + r + 1, False) for a in range(n)]
    src = (r - s) % W
    if not causal:
        return [(0, n, src, 0, n, False)]
    if layout == "contiguous":
        return [] if src > r else [(0, n, src, 0, n, src == r)]
    if layout == "zigzag":
        return [(0, n, src, 0, n, True) if src == r else (0, n, src, 0, h, False) if src < r else
                (h, h, src, 0, n, False)]
    if src <= r:
        return [(0, n, src, 0, n, True)]
    return [(1, n - 1, src, 0, n - 1, True)] if n >= 2 else []


def _rows(N, W, layout, r, piece):
    q_lo, q_n, src, k_lo, k_n, _ = piece
    qrows = positions(N, W, layout, r, np.arange(q_lo, q_lo + q_n))
    krows = np.arange(k_lo, k_lo + k_n) if src < 0 else positions(N, W, layout, src, np.arange(k_lo, k_lo + k_n))
    return qrows, krows


def _steps(N, W, layout, allgather, causal):
    """(rank, step, pieces) in ring.c's order: steps outer, ranks inner (allgather: one step)."""
    for s in range(1 if allgather else W):
        for r in range(W):
            yield r, s, pieces(N, W, layout, allgather, causal, r, s)


class NumpyOps:
    """The array operations of a rank's merge and sums on host fp64 NumPy arrays: the merge is ring.c's own
    (fadev._core.ring_merge, the C core's one ring engine), the sums fadev.formats.round's. fadev.distributed
    has a torch twin for device-resident pieces (its ``TorchOps``), which runs :func:`merge_formula`."""

    round = staticmethod(_round)
    where = staticmethod(np.where)

    @staticmethod
    def merge(out, lse, seen, ob, lb, fmts):
        """ring.c's merge of a piece into copies of running rows: (out, lse, seen)."""
        o, l, s = _core.ring_merge(out, lse, seen, ob, lb, tuple(fmts[f]._c for f in _MERGE_FORMATS))
        return o.reshape(out.shape), l.reshape(lse.shape), s.reshape(seen.shape).astype(bool)

    @staticmethod
    def zeros(shape, dtype=None, like=None):
        return np.zeros(shape, dtype=dtype or np.float64)


_MERGE_FORMATS = ("partial_lse", "merge", "running_out", "running_lse")


def merge_formula(O, L, was, ob, lb, fmts, ops):
    """ring.c's merge written over an array-operations object ``ops`` (round, where, sigmoid, logsigmoid,
    quiet): the twin that fadev.distributed's TorchOps runs on the device (tests/test_distributed.py holds it
    to ring.c's bits on random merges). Returns the new (out, lse, seen) of the rows."""
    m = fmts["merge"]
    lb = ops.round(lb, fmts["partial_lse"])
    live = lb != -np.inf  # a row with no visible key (cannot happen with these pieces)
    new_O, new_L = ops.round(ob, fmts["running_out"]), ops.round(lb, fmts["running_lse"])
    both = live & was
    if both.any():
        with ops.quiet():  # rows not merged may hold anything
            gt = ops.round(ops.sigmoid(ops.round(lb - L, m)), m)
            merged_O = ops.round(ops.round(O - ops.round(gt[..., None] * ops.round(O - ob, m), m), m),
                                 fmts["running_out"])
            ls = ops.round(ops.logsigmoid(ops.round(L - lb, m)), m)
            merged_L = ops.round(ops.round(L - ls, m), fmts["running_lse"])
        new_O, new_L = ops.where(was[..., None], merged_O, new_O), ops.where(was, merged_L, new_L)
    return ops.where(live[..., None], new_O, O), ops.where(live, new_L, L), was | live


def merge_piece(state, rows, ob, lb, fmts, ops=NumpyOps):
    """Merge one piece's (out, lse) into a rank's running ``state`` = [out, lse, seen] (arrays, rows on axis
    2; ``rows`` indexes them) as ring.c does: the piece's lse rounded to partial_lse, the first piece of a
    row stored, later ones merged by the sigmoid / log-sigmoid update in ``merge``. ``ops``: the arrays'
    operations (:class:`NumpyOps`: ring.c's merge itself; fadev.distributed's torch ones: :func:`merge_formula`)."""
    out, run_l, seen = state
    merge = getattr(ops, "merge", None)
    args = (out[:, :, rows], run_l[:, :, rows], seen[:, :, rows], ob, lb, fmts)
    out[:, :, rows], run_l[:, :, rows], seen[:, :, rows] = merge(*args) if merge else merge_formula(*args, ops)


def new_state(q_shape, ops=NumpyOps, like=None):
    """A rank's empty running state [out, lse, seen] for queries of shape ``q_shape``."""
    return [ops.zeros(q_shape, like=like), ops.zeros(q_shape[:3], like=like),
            ops.zeros(q_shape[:3], dtype=bool, like=like)]


def finish(state, pol, allgather, ops=NumpyOps):
    """(out, lse) from a running state: rows never seen get 0 / -inf; ring out rounded to ``pol.out``."""
    out, run_l, seen = state
    out[~seen], run_l[~seen] = 0.0, -np.inf
    if not allgather:
        out = ops.where(seen[..., None], ops.round(out, pol.out), out)
    return out, run_l


def accumulate_piece(sums, qrows, krows, grads, fmts, ops=NumpyOps):
    """A piece's gradients (dq, dk, dv) added into a rank's running ``sums`` (dq, dk, dv; rows on axis 2) as
    ring.c adds them: dq rows ``qrows`` in ``dq_acc``, dk and dv rows ``krows`` in ``dkv_acc`` (fp64 sum, one
    nearest-even rounding each). ``ops`` as :func:`merge_piece`'s."""
    for acc, rows, g, fmt in zip(sums, (qrows, krows, krows), grads, (fmts["dq_acc"], fmts["dkv_acc"],
                                                                       fmts["dkv_acc"])):
        acc[:, :, rows] = ops.round(acc[:, :, rows] + g, fmt)


def forward(q, k, v, pol, fmts, world_size, layout, allgather, causal, flash):
    """(out, lse) of the ring forward on 4-D float64 q, k, v; ``flash(q, k, v, policy, causal)`` -> (out,
    lse) runs one piece; ``fmts``: RingMerge.resolve(pol)."""
    N, W = q.shape[2], world_size
    state = new_state(q.shape)
    piece_pol = pol if allgather else pol.replace(out=fmts["partial_out"])
    for r, _, pcs in _steps(N, W, layout, allgather, causal):
        for pc in pcs:
            qrows, krows = _rows(N, W, layout, r, pc)
            ob, lb = flash(q[:, :, qrows], k[:, :, krows], v[:, :, krows], piece_pol, pc[5])
            if allgather:
                state[0][:, :, qrows], state[1][:, :, qrows], state[2][:, :, qrows] = ob, lb, True
            else:
                merge_piece(state, qrows, ob, lb, fmts)
    return finish(state, pol, allgather)


def backward(q, k, v, out, lse, dout, pol, fmts, world_size, layout, allgather, causal, flash_backward):
    """(dq, dk, dv) of the ring backward; ``flash_backward(q, k, v, out, lse, dout, policy, causal)`` ->
    (dq, dk, dv) runs one piece."""
    N, W = q.shape[2], world_size
    T = fmts["dkv_transport"]
    aq, ak, av = np.zeros(q.shape), np.zeros(k.shape), np.zeros(v.shape)
    piece_pol = pol.replace(grad=fmts["partial_grad"])
    for r, s, pcs in _steps(N, W, layout, allgather, causal):
        lk, lv = (np.zeros(k.shape), np.zeros(v.shape)) if allgather else (ak, av)
        for pc in pcs:
            qrows, krows = _rows(N, W, layout, r, pc)
            grads = flash_backward(q[:, :, qrows], k[:, :, krows], v[:, :, krows], out[:, :, qrows],
                                   lse[:, :, qrows], dout[:, :, qrows], piece_pol, pc[5])
            accumulate_piece((aq, lk, lv), qrows, krows, grads, fmts)
        if allgather:  # this rank's share of the reduce-scatter
            ak[...] = _round(ak + _round(lk, T), T)
            av[...] = _round(av + _round(lv, T), T)
        elif r == W - 1:  # every block (and its dK, dV) moves one hop
            ak[...], av[...] = _round(ak, T), _round(av, T)
    return _round(aq, pol.grad), _round(ak, pol.grad), _round(av, pol.grad)


# ---------------------------------------------------------------- the pieces' kernels

def _upload(*arrays):
    return [DeviceArray.from_numpy(np.ascontiguousarray(a)) for a in arrays]


def _pieces(kernel, load, call):
    """(flash, flash_backward) as :func:`forward` and :func:`backward` take them: ``kernel``'s flash_attention and
    flash_attention_backward (fadev._core's, or a fadev.cuda._Gpu's: the arrays, then the call spec) on the
    piece's arrays (through ``load``), with ``call`` (a fadev._args.Call) given the piece's policy and causal."""
    def flash(q, k, v, policy, causal):
        return kernel.flash_attention(*load(q, k, v), call._replace(policy=policy, causal=causal).c)

    def flash_backward(q, k, v, out, lse, dout, policy, causal):
        return kernel.flash_attention_backward(*load(q, k, v, out, lse, dout),
                                               call._replace(policy=policy, causal=causal).c)
    return flash, flash_backward


def cpu_pieces(call):
    """The CPU's flash kernels per piece (what ring.c calls)."""
    return _pieces(_core, lambda *arrays: arrays, call)


def gpu_pieces(call):
    """The GPU's emulated flash kernels per piece: NumPy in, NumPy out (the merge runs on the host)."""
    return _pieces(route("cuda"), _upload, call)


def _call(scale, tiles, choices=(0, 0, 0), exp_form=None):
    return Call(None, scale, False, *tiles, *choices[:2], choices[2] if exp_form is None else exp_form)


def gpu_flash(scale, tiles, choices):
    """:func:`gpu_pieces`' forward from the scale, (block_q, block_kv) and (loop_order, normalize, exp_form)."""
    return gpu_pieces(_call(scale, tiles, choices))[0]


def gpu_flash_backward(scale, tiles, exp_form):
    """:func:`gpu_pieces`' backward (as :func:`gpu_flash`)."""
    return gpu_pieces(_call(scale, tiles, exp_form=exp_form))[1]


def cpu_flash(scale, tiles, choices):
    """:func:`cpu_pieces`' forward (as :func:`gpu_flash`)."""
    return cpu_pieces(_call(scale, tiles, choices))[0]


def cpu_flash_backward(scale, tiles, exp_form):
    """:func:`cpu_pieces`' backward (as :func:`gpu_flash`)."""
    return cpu_pieces(_call(scale, tiles, exp_form=exp_form))[1]
