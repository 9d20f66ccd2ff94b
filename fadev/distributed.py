"""Ring attention over real ranks: one process per rank, real tensors exchanged through torch.distributed.

Each rank holds its shard of the sequence (axis -2, split by :func:`shard` exactly as the simulation's
layouts) and runs csrc/ring.c's pieces of that rank (ring.c's top comment is the specification; the piece
list and the merge are :mod:`fadev.ring_steps`'s):

  forward, ring merges: at step s the K/V block of rank (r - s) mod W is here; the next one comes from rank
    r - 1 by batch_isend_irecv while this step's pieces run; every piece's (out, lse) is merged in ring.c's
    rounding (ring_steps.merge_piece).
  forward, allgather (llama3): K/V all-gathered in global order, one flash call per query group.
  backward, ring: K/V travel again; after each step this rank's dK/dV of the block it holds (summed in
    dkv_acc) is rounded to dkv_transport and sent to rank r + 1 with the block; after W steps every block's
    dK/dV is home. dQ stays, summed in dq_acc in step order (ring-flash-attention's backward).
  backward, allgather: local dk/dv in dkv_acc; the reduce-scatter is an all_to_all of each owner's rows,
    rounded to dkv_transport, summed by the owner ranks ascending in dkv_transport (the order the
    simulation fixes; a collective's own sum has no fixed order).

What travels is the caller's K/V tensors as they are, and the merge's dK/dV rounded to dkv_transport (sent
as that torch dtype when one matches: fp64, fp32, fp16, bf16). With ``kernel="emulated"`` every rank's
output, LSE and gradients are fadev.ring_attention / ring_attention_backward's on the full tensors, restricted
to the rank's shard, bit for bit. ``kernel="native"``: fadev's tensor-core kernel per piece (CUDA);
``kernel="sdpa"``: PyTorch's flash kernel (torch.ops.aten._scaled_dot_product_flash_attention and its
backward, which return the LSE; CPU or CUDA) per piece, in the policy's input dtype.
"""
from __future__ import annotations

import contextlib
import dataclasses
import datetime
import logging
import math
import numbers
import os
import pickle
import socket

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from . import _args, native
from .backends import subset
from . import ring_steps as _steps
from .formats import boolean, round as _round
from .policy import EXP_FORMS, LOOP_ORDERS, NORMALIZE, as_policy
from .ring import LAYOUTS, as_merge

KERNELS = subset("emulated", "native", "sdpa")
_WIRE = {"fp64": torch.float64, "fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
DTYPES = tuple(_WIRE.values())
"""The tensor dtypes ring_attention takes (as fadev.torch.attention)."""


def _positions(n, world_size, rank, layout):
    return _steps.positions(n * world_size, world_size, layout, rank, np.arange(n))


def shard(x, world_size, rank, *, layout="contiguous"):
    """Rank ``rank``'s rows of the sequence axis (-2) of ``x`` (torch tensor or NumPy array) under
    ``layout`` ("contiguous", the default as in fadev.ring_attention; "zigzag": N divisible by 2W; "striped")."""
    world_size = _args.positive_int(world_size, "world_size")
    _args.choice("layout", layout, LAYOUTS)
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
        raise ValueError(f"rank must be an int in 0..{world_size - 1}, got {rank!r}")
    if x.ndim < 2:
        raise ValueError(f"x: expected at least 2 axes (..., N, D), got shape {tuple(x.shape)}")
    parts = 2 * world_size if layout == "zigzag" else world_size
    N = x.shape[-2]
    if N % parts:
        raise ValueError(f"x: layout {layout!r} needs N divisible by {parts}, got N={N}")
    rows = _positions(N // world_size, world_size, rank, layout)
    if isinstance(x, torch.Tensor):
        return x.index_select(-2, torch.as_tensor(rows, device=x.device))
    return np.take(x, rows, axis=-2)


def unshard(parts, *, layout="contiguous"):
    """The full sequence from every rank's shard (``parts`` in rank order), inverse of :func:`shard`."""
    _args.choice("layout", layout, LAYOUTS)
    W = len(parts)
    if W < 1 or any(tuple(p.shape) != tuple(parts[0].shape) for p in parts):
        raise ValueError(f"parts: expected one shard per rank, all of one shape, got shapes "
                         f"{[tuple(p.shape) for p in parts]}")
    n = parts[0].shape[-2]
    if layout == "zigzag" and n % 2:
        raise ValueError(f"parts: zigzag shards hold an even number of rows, got {n}")
    rows = np.concatenate([_positions(n, W, r, layout) for r in range(W)])
    order = np.argsort(rows)
    if isinstance(parts[0], torch.Tensor):
        return torch.cat(list(parts), dim=-2).index_select(-2, torch.as_tensor(order, device=parts[0].device))
    return np.take(np.concatenate(parts, axis=-2), order, axis=-2)


# ---------------------------------------------------------------- communication

class _Comm:
    """This rank's view of the process group: ring exchanges, all_gather and all_to_all on torch tensors."""

    def __init__(self, group, device):
        self.group, self.device = group, device
        self.rank, self.size = dist.get_rank(group), dist.get_world_size(group)

    def _peer(self, r):
        return dist.get_global_rank(self.group, r) if self.group is not None else r

    def ring(self, tensors):
        """Send ``tensors`` to rank r + 1, receive their like from r - 1; returns wait() -> received."""
        if self.size == 1:
            return lambda: tensors
        tensors = [t.contiguous() for t in tensors]
        got = [torch.empty_like(t) for t in tensors]
        ops = [dist.P2POp(dist.isend, t, self._peer((self.rank + 1) % self.size), self.group) for t in tensors]
        ops += [dist.P2POp(dist.irecv, g, self._peer((self.rank - 1) % self.size), self.group) for g in got]
        reqs = dist.batch_isend_irecv(ops)

        def wait():
            for req in reqs:
                req.wait()
            return got
        return wait

    def all_gather(self, t):
        t = t.contiguous()
        out = [torch.empty_like(t) for _ in range(self.size)]
        dist.all_gather(out, t, group=self.group)
        return out

    def all_to_all(self, stacked):
        """(W, ...) in, (W, ...) out: row j goes to rank j; row j received comes from rank j."""
        stacked = stacked.contiguous()
        out = torch.empty_like(stacked)
        dist.all_to_all_single(out, stacked, group=self.group)
        return out

    def check_same(self, values, what):
        """Every rank passed the same ``values`` (ints), or every rank raises naming ``what``."""
        mine = torch.tensor(values, dtype=torch.int64, device=self.device)
        everyone = self.all_gather(mine)
        if any(not torch.equal(mine, e) for e in everyone):
            raise ValueError(f"{what} differ across ranks: " + ", ".join(
                f"rank {r}: {tuple(e.tolist())}" for r, e in enumerate(everyone)))


class TorchOps:
    """ring_steps.NumpyOps' operations on fp64 torch tensors on the rank's device, for the real kernels
    (sdpa, native) whose pieces stay there: rounding to fp32 / fp16 / bf16 is the dtype cast (nearest-even,
    as fadev.formats.round), other formats go through the host; sigmoid and log-sigmoid by ring.c's formulas
    with torch's exp / log1p (not the C library's: last-bit differences in fp64 are possible, so these
    rings promise the formats' rounding, not ring.c's bits)."""

    @staticmethod
    def round(x, fmt):
        if fmt.name in _WIRE:
            return x.to(_WIRE[fmt.name]).to(torch.float64)
        return torch.from_numpy(_round(_host(x), fmt)).to(x.device)

    where, stack = staticmethod(torch.where), staticmethod(torch.stack)

    @staticmethod
    def sigmoid(x):
        e = torch.exp(-x.abs())
        return torch.where(x >= 0, 1.0 / (1.0 + e), e / (1.0 + e))

    @staticmethod
    def logsigmoid(x):
        t = torch.log1p(torch.exp(-x.abs()))
        return torch.where(x >= 0, -t, x - t)

    @staticmethod
    def quiet():
        return contextlib.nullcontext()

    @staticmethod
    def zeros(shape, dtype=None, like=None):
        return torch.zeros(shape, dtype=torch.bool if dtype is bool else torch.float64, device=like.device)

    @staticmethod
    def load(t):
        return t.detach().to(torch.float64)

    @staticmethod
    def result(x, device):
        return x


class _HostOps(_steps.NumpyOps):
    """The host path (kernel emulated): fp64 NumPy arrays, ring.c's bits."""

    stack = staticmethod(np.stack)
    load = staticmethod(lambda t: _host(t))
    result = staticmethod(lambda x, device: torch.from_numpy(x).to(device))


def _wire(x, fmt, device, ops):
    """fp64 ``x`` rounded to ``fmt`` as the tensor that travels (that dtype when torch has it)."""
    return ops.result(ops.round(x, fmt), device).to(dtype=_WIRE.get(fmt.name, torch.float64))


def _host(t):
    return t.detach().to("cpu", torch.float64).numpy()


# ---------------------------------------------------------------- the pieces' kernels

@dataclasses.dataclass
class _Config:
    pol: object
    fmts: dict
    layout: str
    allgather: bool
    causal: bool
    flash: object
    flash_backward: object
    ops: object


def _sdpa_dtype(pol):
    name = pol.input.name
    if name not in ("bf16", "fp16", "fp32"):
        raise ValueError(f"policy: kernel='sdpa' runs in the policy's input format, one of bf16, fp16, fp32; "
                         f"got {name}")
    return _WIRE[name]


def _sdpa_pieces(scale, dtype, device):
    """PyTorch's flash kernel per piece (the CPU's _for_cpu ops on the CPU), on fp64 tensors of the rank's
    device holding the input format's values. Bottom-right causal with more keys than queries (allgather)
    runs as top-left causal on queries padded at the front with zero rows; K/V heads are repeated for
    grouped-query and their gradients summed back."""
    ops, cpu = torch.ops.aten, device.type == "cpu"

    def padded(x, pad, dt=dtype):
        x = x.to(dt)
        return torch.cat([x.new_zeros(x.shape[:2] + (pad,) + x.shape[3:]), x], dim=2) if pad else x.contiguous()

    def prep(q, k, v, causal):
        pad, rep = (k.shape[2] - q.shape[2] if causal else 0), q.shape[1] // k.shape[1]
        tk, tv = (t.to(dtype).repeat_interleave(rep, 1) for t in (k, v))
        return padded(q, pad), tk, tv, pad, rep

    def flash(q, k, v, policy, causal):
        tq, tk, tv, pad, _ = prep(q, k, v, causal)
        if cpu:
            out, lse = ops._scaled_dot_product_flash_attention_for_cpu(tq, tk, tv, 0.0, causal, scale=scale)
        else:
            out, lse = ops._scaled_dot_product_flash_attention(tq, tk, tv, 0.0, causal, False, scale=scale)[:2]
        return out[:, :, pad:].to(torch.float64), lse[:, :, pad:].to(torch.float64)

    def flash_backward(q, k, v, out, lse, dout, policy, causal):
        tq, tk, tv, pad, rep = prep(q, k, v, causal)
        to, tdo, tl = padded(out, pad), padded(dout, pad), padded(lse[..., None], pad, torch.float32)[..., 0]
        if cpu:
            dq, dk, dv = ops._scaled_dot_product_flash_attention_for_cpu_backward(tdo, tq, tk, tv, to, tl, 0.0,
                                                                                  causal, scale=scale)
        else:
            # the backward takes the forward's cum_seq (undefined tensors outside varlen: an empty tensor would
            # select the varlen path) and philox state, which Python can only get from the forward itself
            fwd = ops._scaled_dot_product_flash_attention(tq, tk, tv, 0.0, causal, False, scale=scale)
            dq, dk, dv = ops._scaled_dot_product_flash_attention_backward(
                tdo, tq, tk, tv, to, tl, fwd[2], fwd[3], fwd[4], fwd[5], 0.0, causal, fwd[6], fwd[7], scale=scale)
        dk, dv = (g.reshape(g.shape[0], -1, rep, *g.shape[2:]).to(torch.float64).sum(2) for g in (dk, dv))
        return dq[:, :, pad:].to(torch.float64), dk, dv
    return flash, flash_backward


def _native_pieces(scale, dtype):
    """fadev's native tensor-core kernel per piece, on the rank's CUDA tensors (fp64 in and out)."""
    torch_dtype = _WIRE[dtype]

    def cast(*ts):
        return [t.to(torch_dtype).contiguous() for t in ts]

    def flash(q, k, v, policy, causal):
        out, lse = native.native_attention(*cast(q, k, v), causal=causal, scale=scale, return_lse=True)
        return out.to(torch.float64), lse.to(torch.float64)

    def flash_backward(q, k, v, out, lse, dout, policy, causal):
        grads = native.native_attention_backward(*cast(q, k, v, out), lse.to(torch.float32).contiguous(),
                                                 *cast(dout), causal=causal, scale=scale, deterministic=False)
        return tuple(g.to(torch.float64) for g in grads)
    return flash, flash_backward


def _kernels(kernel, pol, scale, tiles, choices, exp_form, device):
    """(flash, flash_backward, ops) of the pieces: the real kernels on the device's tensors (TorchOps), the
    emulated one on host arrays (ring.c's bits; the GPU's emulated kernel where the tensors are on a GPU)."""
    if kernel == "sdpa":
        return _sdpa_pieces(scale, _sdpa_dtype(pol), device) + (TorchOps,)
    if kernel == "native":
        if device.type != "cuda":
            raise ValueError("kernel: 'native' runs on CUDA tensors; this rank's are on the CPU")
        if pol.input.name not in ("bf16", "fp16"):
            raise ValueError(f"policy: kernel='native' runs bf16 or fp16 inputs, got {pol.input.name}")
        return _native_pieces(scale, pol.input.name) + (TorchOps,)
    if device.type == "cuda":
        return _steps.gpu_flash(scale, tiles, choices), _steps.gpu_flash_backward(scale, tiles, exp_form), _HostOps
    return _steps.cpu_flash(scale, tiles, choices), _steps.cpu_flash_backward(scale, tiles, exp_form), _HostOps


# ---------------------------------------------------------------- one rank's forward and backward

def _local_pieces(cfg, comm, n, s):
    """(query rows, key rows, causal) of this rank at step s, as slices: local rows, or global rows
    (allgather)."""
    N = n * comm.size
    for q_lo, q_n, _, k_lo, k_n, c in _steps.pieces(N, comm.size, cfg.layout, cfg.allgather, cfg.causal, comm.rank,
                                                    s):
        yield slice(q_lo, q_lo + q_n), slice(k_lo, k_lo + k_n), c


def _gathered(comm, cfg, *tensors):
    """The full K/V (global order, fp64 working arrays) from every rank's shard."""
    return [cfg.ops.load(unshard(comm.all_gather(t), layout=cfg.layout)) for t in tensors]


def _forward(q, k, v, cfg, comm):
    """(out, lse) of this rank as fp64 working arrays (cfg.ops); q, k, v: this rank's torch shards (4-D)."""
    ops = cfg.ops
    qh, n = ops.load(q), q.shape[2]
    state = _steps.new_state(qh.shape, ops, like=q)
    if cfg.allgather:
        kh, vh = _gathered(comm, cfg, k, v)
        for qr, kr, c in _local_pieces(cfg, comm, n, 0):
            ob, lb = cfg.flash(qh[:, :, qr], kh[:, :, kr], vh[:, :, kr], cfg.pol, c)
            state[0][:, :, qr], state[1][:, :, qr], state[2][:, :, qr] = ob, lb, True
        return _steps.finish(state, cfg.pol, True, ops)
    piece_pol = cfg.pol.replace(out=cfg.fmts["partial_out"])
    kv = [k, v]
    for s in range(comm.size):
        incoming = comm.ring(kv) if s < comm.size - 1 else None
        kh, vh = ops.load(kv[0]), ops.load(kv[1])
        for qr, kr, c in _local_pieces(cfg, comm, n, s):
            ob, lb = cfg.flash(qh[:, :, qr], kh[:, :, kr], vh[:, :, kr], piece_pol, c)
            _steps.merge_piece(state, qr, ob, lb, cfg.fmts, ops)
        if incoming:
            kv = incoming()
    return _steps.finish(state, cfg.pol, False, ops)


def _backward(q, k, v, out, lse, dout, cfg, comm):
    """(dq, dk, dv) fp64 working arrays of this rank; out, lse, dout: this rank's rows, likewise."""
    f, n, dev, ops = cfg.fmts, q.shape[2], q.device, cfg.ops
    T = f["dkv_transport"]
    qh = ops.load(q)
    piece_pol = cfg.pol.replace(grad=f["partial_grad"])
    aq = ops.zeros(qh.shape, like=q)

    def run(s, kh, vh, ak, av):
        for qr, kr, c in _local_pieces(cfg, comm, n, s):
            grads = cfg.flash_backward(qh[:, :, qr], kh[:, :, kr], vh[:, :, kr], out[:, :, qr], lse[:, :, qr],
                                       dout[:, :, qr], piece_pol, c)
            _steps.accumulate_piece((aq, ak, av), qr, kr, grads, f, ops)

    if cfg.allgather:
        kh, vh = _gathered(comm, cfg, k, v)
        lk, lv = ops.zeros(kh.shape, like=q), ops.zeros(vh.shape, like=q)
        run(0, kh, vh, lk, lv)
        sums = []
        for local in (lk, lv):
            mine = ops.stack([shard(local, comm.size, j, layout=cfg.layout) for j in range(comm.size)])
            got = ops.load(comm.all_to_all(_wire(mine, T, dev, ops)))
            total = ops.zeros(got.shape[1:], like=q)
            for j in range(comm.size):  # from +0, ranks ascending, as the simulation sums (-0 + +0 is +0)
                total = ops.round(total + got[j], T)
            sums.append(total)
        ak, av = sums
    else:
        kv, dkv = [k, v], None
        for s in range(comm.size):
            incoming = comm.ring(kv) if s < comm.size - 1 else None
            ak, av = (ops.zeros(k.shape, like=q), ops.zeros(v.shape, like=q)) if dkv is None else dkv
            run(s, ops.load(kv[0]), ops.load(kv[1]), ak, av)
            dkv = [ops.load(t) for t in comm.ring([_wire(ak, T, dev, ops), _wire(av, T, dev, ops)])()]
            if incoming:
                kv = incoming()
        ak, av = dkv
    g = cfg.pol.grad
    return ops.round(aq, g), ops.round(ak, g), ops.round(av, g)


class _RingFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, cfg, comm):
        out, lse = _forward(q, k, v, cfg, comm)
        ctx.save_for_backward(q, k, v)
        ctx.cfg, ctx.comm, ctx.saved_out, ctx.saved_lse = cfg, comm, out, lse
        lse_t = cfg.ops.result(lse, q.device)
        ctx.mark_non_differentiable(lse_t)
        return cfg.ops.result(out, q.device).to(q.dtype), lse_t

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v = ctx.saved_tensors
        grads = _backward(q, k, v, ctx.saved_out, ctx.saved_lse, ctx.cfg.ops.load(dout), ctx.cfg, ctx.comm)
        return tuple(ctx.cfg.ops.result(g, t.device).to(t.dtype) for g, t in zip(grads, (q, k, v))) + (None, None)


def ring_attention(q, k, v, policy, *, layout="contiguous", merge="lowp_partials", causal=False, scale=None,
                   kernel="emulated", group=None, block_q=None, block_kv=None, loop_order=None, normalize=None,
                   exp=None, return_lse=False):
    """This rank's output of ring attention over the ranks of ``group`` (default: the whole world).

    q, k, v: torch tensors (B, H, n, D) / (B, Hkv, n, D) (or 3-D, 2-D) holding this rank's shard
    (:func:`shard`); ``layout``, ``merge``, ``causal``, ``scale`` and the tiling options as
    :func:`fadev.ring_attention`'s; ``kernel``: "emulated", "native" or "sdpa" (module doc). Differentiable
    in q, k, v; the output has q's dtype and device; ``return_lse`` adds this rank's LSE (float64, not
    differentiable). Every rank must call it with the same shapes and options."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("fadev.distributed.ring_attention needs torch.distributed initialised "
                           "(torch.distributed.init_process_group), e.g. under torchrun")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor (this rank's shard), got {type(t).__name__}")
        if t.dtype not in DTYPES:
            raise TypeError(f"{name}: dtype must be one of float64, float32, float16, bfloat16, got {t.dtype}")
    _args.choice("kernel", kernel, KERNELS)
    _args.choice("layout", layout, LAYOUTS)
    return_lse = boolean(return_lse, "return_lse")
    pol, mg = as_policy(policy, "policy"), as_merge(merge)
    comm = _Comm(group, q.device)
    rank = q.dim()
    q4, k4, v4 = _args.shapes(q.shape, k.shape, v.shape)  # the 4-D shapes, checked (no copy)
    q4t, k4t, v4t = (t.reshape(s) for t, s in ((q, q4), (k, k4), (v, v4)))
    n = q4[2]
    if k4[2] != n:
        raise ValueError(f"k: ring attention needs this rank's seq_kv == seq_q, got {k4[2]} and {n}")
    if layout == "zigzag" and n % 2:
        raise ValueError(f"q: layout 'zigzag' needs an even number of rows per rank, got {n}")
    causal = _args.causal_of(causal)
    comm.check_same(q4 + k4 + (LAYOUTS.index(layout), int(causal), int(mg.allgather)),
                    "shapes (q, k) or options (layout, causal, allgather)")
    tiles = _args.tiles(pol, q4[3], block_q, block_kv)
    choices = (_args.choice("loop_order", loop_order, LOOP_ORDERS, pol.loop_order),
               _args.choice("normalize", normalize, NORMALIZE, pol.normalize),
               _args.choice("exp", exp, EXP_FORMS, pol.exp))
    scale = _args.scale_of(scale, q4[3])
    flash, flash_backward, ops = _kernels(kernel, pol, scale, tiles, choices, choices[2], q.device)
    cfg = _Config(pol, mg.resolve(pol), layout, bool(mg.allgather), causal, flash, flash_backward, ops)
    out, lse = _RingFunction.apply(q4t, k4t, v4t, cfg, comm)
    out = out.reshape(out.shape[4 - rank:])
    return (out, lse.reshape(lse.shape[4 - rank:])) if return_lse else out


# ---------------------------------------------------------------- launching W local ranks

def timeout_seconds(timeout, name="timeout"):
    """``timeout`` as float seconds (a finite number > 0); ValueError naming ``name`` otherwise."""
    if isinstance(timeout, bool) or not isinstance(timeout, numbers.Real) or not 0 < timeout < math.inf:
        raise ValueError(f"{name} must be a number of seconds > 0, got {timeout!r}")
    return float(timeout)


def init(backend=None, timeout=60.0):
    """Join the process group from torchrun's environment (env://): gloo on CPU, nccl with CUDA; every
    collective times out after ``timeout`` seconds, so a dead, stalled or failing rank ends the others."""
    timeout = timeout_seconds(timeout)
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout))
    return dist.get_rank(), dist.get_world_size()


def _entry(rank, fn, world_size, port, backend, timeout, args):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    init(backend, timeout)
    fn(rank, world_size, *args)  # on an error, exit at once: a clean teardown would wait for the others
    dist.destroy_process_group()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RankError(RuntimeError):
    """A rank of :func:`spawn` raised or died. ``str()`` is one line (the rank and its error, or how it
    died); ``rank`` is its number, ``details`` the rank's whole traceback (or the exit status)."""

    def __init__(self, message, rank, details):
        super().__init__(message)
        self.rank, self.details = rank, details


def _error_line(trace):
    """The exception of a formatted traceback as one line ("Type: message")."""
    lines = trace.rstrip().splitlines()
    frames = [i for i, line in enumerate(lines) if line.startswith(" ")]
    tail = lines[frames[-1] + 1:] if frames and frames[-1] + 1 < len(lines) else lines[-1:]
    return " ".join(line.strip() for line in tail if line.strip())


_KNOCK_ON = ("connection closed by peer", "connection reset by peer", "timed out", "timeout")


def _raised(ctx):
    """[(knock-on, when, rank, traceback)] of the ranks that raised (torch's error file of each): knock-on
    when the error is one a rank gets because another failed (a closed connection, a collective timed out)."""
    found = []
    for rank, path in enumerate(ctx.error_files):
        try:
            when = os.stat(path).st_mtime_ns
            with open(path, "rb") as fh:
                trace = pickle.load(fh)
        except (OSError, EOFError, pickle.UnpicklingError):
            continue
        line = _error_line(trace).lower()
        found.append((any(w in line for w in _KNOCK_ON), when, rank, trace))
    return found


def _rank_error(e, ctx, timeout):
    """The RankError of torch's exception: a rank that died, or the rank that raised first among those that
    raised for a reason of their own (else the first of all: torch reports whichever it noticed first)."""
    if isinstance(e, mp.ProcessExitedException):
        how = f"signal {e.signal_name}" if e.signal_name else f"exit code {e.exit_code}"
        return RankError(f"rank {e.error_index} died ({how}); the other ranks were stopped", e.error_index, str(e))
    _, _, rank, trace = min(_raised(ctx) or [(False, 0, e.error_index, str(e))])
    line = _error_line(trace)
    if any(w in line.lower() for w in _KNOCK_ON[2:]):
        line += (f" (a collective waited more than the {timeout:g} s timeout: another rank stalled or died; "
                 f"raise the timeout if a rank legitimately works that long)")
    return RankError(f"rank {rank} failed: {line}", rank, trace)


def spawn(fn, world_size, *args, backend="gloo", timeout=60.0, grace=3.0):
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` new local processes joined in a process
    group on 127.0.0.1 (``fn`` must be importable: a module-level function). Every collective times out
    after ``timeout`` seconds. If any rank raises or dies, the others get ``grace`` seconds to end, then
    SIGTERM, ``grace`` more, then SIGKILL (a stopped or stuck rank too), and :class:`RankError` says in one
    line which rank and why (its traceback in ``details``). Interrupted (Ctrl-C), every rank is killed."""
    world_size = _args.positive_int(world_size, "world_size", limit=256)
    timeout, grace = timeout_seconds(timeout), timeout_seconds(grace, "grace")
    ctx = mp.start_processes(_entry, args=(fn, world_size, free_port(), backend, timeout, args), nprocs=world_size,
                             join=False, start_method="spawn")
    log = logging.getLogger("torch.multiprocessing.spawn")
    level = log.level
    log.setLevel(logging.ERROR)  # not its warnings as it ends the other ranks: RankError says what happened
    try:
        while not ctx.join(grace_period=grace):
            pass
    except (mp.ProcessRaisedException, mp.ProcessExitedException) as e:
        raise _rank_error(e, ctx, timeout) from e
    except BaseException:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
            p.join()
        raise
    finally:
        log.setLevel(level)


__all__ = ["ring_attention", "shard", "unshard", "init", "spawn", "free_port", "RankError", "KERNELS", "DTYPES",
           "TorchOps"]
