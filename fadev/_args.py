"""Argument and shape checks shared by every kernel entry point, and the reshape helpers around them.

No kernels here: :mod:`fadev.attention`, :mod:`fadev.backward`, :mod:`fadev.ring`, :mod:`fadev.native` and
:mod:`fadev.metrics` validate their arguments with these functions, then call fadev._core (CPU) or a
:class:`fadev.cuda._Gpu` (GPU). Inputs are (N, D), (H, N, D) or (B, H, N, D); the kernels see 4-D
(B, H, N, D) arrays, and results are reshaped back to the caller's rank.
"""
from __future__ import annotations

import math
import numbers
from typing import NamedTuple

import numpy as np

from .formats import ROUNDING_MODES, _numeric, as_float, boolean, check_bytes
from .policy import EXP_FORMS, LOOP_ORDERS, NORMALIZE, Policy, as_policy

MAX_DIM = 256
INT32_MAX = 2**31 - 1


def choice(name, value, allowed, default=None) -> int:
    """The index of ``value`` (``default`` when None) in the tuple ``allowed``; ValueError naming
    ``name`` and the choices otherwise. The one checker of every string option."""
    value = default if value is None else value
    if not isinstance(value, str) or value not in allowed:
        raise ValueError(f"{name} must be one of {', '.join(allowed)}, got {value!r}")
    return allowed.index(value)


def shape_of(shape, name="shape", minimum=1) -> tuple:
    """``shape`` (an integer or a sequence of integers, NumPy integers included) as a tuple of ints, each
    >= ``minimum``; TypeError naming ``name`` for any entry that is not an integer (2.5, True, "4"),
    ValueError for one below ``minimum``."""
    if type(shape) is tuple and all(type(s) is int and s >= minimum for s in shape):  # the common case, no ABC checks
        return shape
    if isinstance(shape, (str, bytes)) or not (isinstance(shape, numbers.Integral) or hasattr(shape, "__iter__")):
        raise TypeError(f"{name} must be an int or a tuple of ints, got {shape!r}")
    entries = (shape,) if isinstance(shape, numbers.Integral) else tuple(shape)
    for s in entries:
        if isinstance(s, (bool, np.bool_)) or not isinstance(s, numbers.Integral):
            raise TypeError(f"{name} must be a tuple of ints, got {shape!r} (entry {s!r})")
        if s < minimum:
            raise ValueError(f"{name} must have sizes >= {minimum}, got {shape!r}")
    return tuple(int(s) for s in entries)


def positive_int(value, name, limit=INT32_MAX) -> int:
    """``value`` as an int in 1..limit (bools refused); ValueError otherwise."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or not 1 <= int(value) <= limit:
        raise ValueError(f"{name} must be a positive integer (at most {'2^31 - 1' if limit == INT32_MAX else limit}), "
                         f"got {value!r}")
    return int(value)


def _rank_of(shape, name):
    if len(shape) not in (2, 3, 4):
        raise ValueError(f"{name}: expected a 2-D (N, D), 3-D (H, N, D) or 4-D (B, H, N, D) array, "
                         f"got shape {tuple(shape)}")
    if 0 in shape:
        raise ValueError(f"{name}: every dimension must be >= 1, got shape {tuple(shape)}")


def _unconverted(x, name, gpu, dtype):
    arr = gpu.operand(x, name, dtype) if gpu else _numeric(x, name)
    _rank_of(arr.shape, name)
    return arr


def shapes(q_shape, k_shape, v_shape) -> tuple:
    """The one shape checker of fadev's (q, k, v) convention, on shapes alone (no array is read or copied):
    each 2-, 3- or 4-D with no empty axis, one rank, k and v one shape, q's head dim (<= MAX_DIM) and batch,
    q's heads a multiple of k's (grouped-query). Returns the three shapes as 4-D (B, H, N, D) tuples."""
    for shape, name in ((q_shape, "q"), (k_shape, "k"), (v_shape, "v")):
        _rank_of(tuple(shape), name)
    q, k, v = tuple(q_shape), tuple(k_shape), tuple(v_shape)
    if not len(q) == len(k) == len(v):
        raise ValueError(f"q, k, v must have the same rank, got q {len(q)}-D, k {len(k)}-D, v {len(v)}-D")
    if k != v:
        raise ValueError(f"k and v must have the same shape, got k {k} and v {v}")
    q4, k4 = ((1,) * (4 - len(q)) + q, (1,) * (4 - len(k)) + k)
    B, H, _, D = q4
    if k4[3] != D:
        raise ValueError(f"k: head dim {k4[3]} does not match q's head dim {D}")
    if D > MAX_DIM:
        raise ValueError(f"q: head dim D must be <= {MAX_DIM}, got {D}")
    if k4[0] != B:
        raise ValueError(f"k: batch {k4[0]} does not match q's batch {B}")
    if H % k4[1] != 0:
        raise ValueError(f"q has {H} heads, not a multiple of k/v's {k4[1]} heads (grouped-query needs "
                         f"heads % heads_kv == 0)")
    return q4, k4, k4


def operand(x, name, gpu=None, dtype=np.float64):
    """x as a C-contiguous float64 NumPy array, or with ``gpu`` (a fadev.cuda._Gpu) a contiguous ``dtype``
    device array; 2-, 3- or 4-D with no empty axis; its size checked before any copy."""
    arr = _unconverted(x, name, gpu, dtype)
    return arr if gpu else as_float(arr, name, contiguous=True)


def qkv(q, k, v, gpu=None, dtype=np.float64):
    """Validated 4-D q, k, v (float64 NumPy, or device arrays of ``dtype`` with ``gpu``) and q's
    original rank. K/V may have fewer heads (grouped-query) and another length. On the host the memory
    the call needs (the kernel's copies of q, k, v, out and lse) is checked before anything is copied."""
    q, k, v = (_unconverted(x, n, gpu, dtype) for x, n in ((q, "q"), (k, "k"), (v, "v")))
    rank = q.ndim
    q4, k4, v4 = (t.reshape(s) for t, s in zip((q, k, v), shapes(q.shape, k.shape, v.shape)))
    D = q4.shape[3]
    if gpu is None:
        check_bytes("q, k, v", 8 * (3 * (q.size + k.size + v.size) + q.size + q.size // D),
                    f"q {q.shape}, k {k.shape}, v {v.shape} as float64 with the kernel's copies and results")
        q4, k4, v4 = (as_float(t, n, contiguous=True) for t, n in ((q4, "q"), (k4, "k"), (v4, "v")))
    return q4, k4, v4, rank


def sdpa_shapes(q_shape, k_shape, v_shape, is_causal, enable_gqa) -> None:
    """The one shape checker of ``scaled_dot_product_attention``'s convention (query, key, value; the torch
    bridges fadev.torch and fadev.torch_native): one rank >= 2, key and value one shape, query's head dim
    and batch dims, grouped-query heads only with ``enable_gqa``, ``is_causal`` only with equal lengths
    (SDPA aligns the mask top-left, fadev bottom-right)."""
    q, k, v = tuple(q_shape), tuple(k_shape), tuple(v_shape)
    if len(q) < 2 or not len(q) == len(k) == len(v):
        raise ValueError(f"query, key and value must have the same rank >= 2 ((N, D), (H, N, D) or (..., H, N, D)),"
                         f" got shapes {q}, {k}, {v}")
    if k != v:
        raise ValueError(f"key and value must have the same shape (fadev needs value's head dim = key's), got "
                         f"{k} and {v}")
    if q[-1] != k[-1]:
        raise ValueError(f"query's head dim {q[-1]} does not match key's {k[-1]}")
    if q[:-3] != k[:-3]:
        raise ValueError(f"query's batch dims {q[:-3]} differ from key's {k[:-3]} (fadev does not broadcast them)")
    enable_gqa = boolean(enable_gqa, "enable_gqa")
    if len(q) >= 3 and q[-3] != k[-3]:
        if not enable_gqa:
            raise ValueError(f"query has {q[-3]} heads but key/value have {k[-3]}; pass enable_gqa=True for "
                             f"grouped-query attention")
        if q[-3] % k[-3]:
            raise ValueError(f"grouped-query attention needs query heads ({q[-3]}) to be a multiple of key/value "
                             f"heads ({k[-3]})")
    if boolean(is_causal, "is_causal") and q[-2] != k[-2]:
        raise ValueError(f"is_causal with {q[-2]} queries and {k[-2]} keys: SDPA's causal mask is aligned top-left, "
                         f"fadev's bottom-right; they agree only for equal lengths")


def scale_of(scale, dim) -> float:
    """``scale`` as a float; None gives 1/sqrt(dim)."""
    if scale is None:
        return 1.0 / math.sqrt(dim)
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
        raise TypeError(f"scale must be a real number or None, got {scale!r}")
    if not math.isfinite(float(scale)):
        raise ValueError(f"scale must be finite, got {scale!r}")
    return float(scale)


def causal_of(causal) -> bool:
    return boolean(causal, "causal")


def check_policy(pol: Policy, q4, k4) -> None:
    """What a policy asks of the shapes: stochastic rounding packs row indices in 21 bits."""
    if ROUNDING_MODES[pol.rounding] == ROUNDING_MODES["stochastic"] and max(q4.shape[2], k4.shape[2]) >= 2**21:
        raise ValueError(f"stochastic rounding needs sequence lengths < 2^21 (the counter packs them in 21 bits), "
                         f"got seq_q={q4.shape[2]}, seq_kv={k4.shape[2]}")


class Call(NamedTuple):
    """Everything an attention kernel reads besides its arrays, built once here by the API functions and handed
    to a :mod:`fadev.backends` backend. :attr:`c` is the one tuple both bindings parse (module_args.c's
    parse_call, for host arrays in module.c and device pointers in module_cuda.c alike): (policy,
    policy_backward, ring, scale, causal, block_q, block_kv, loop_order, normalize, exp_form), None where a
    kernel reads no policy (golden, native) or no ring. The tiling fields are 0 where a kernel reads none
    (baseline)."""

    policy: Policy | None
    scale: float
    causal: bool
    block_q: int = 0
    block_kv: int = 0
    loop_order: int = 0
    normalize: int = 0
    exp_form: int = 0
    ring: object = None
    """The ring kernels' ring (a fadev.ring.Ring: its ``c(policy)`` is the binding's tuple)."""

    @property
    def c(self) -> tuple:
        pol = self.policy
        return (None if pol is None else pol._c, None if pol is None else pol._c_backward,
                None if self.ring is None else self.ring.c(pol),
                float(self.scale), bool(self.causal), int(self.block_q), int(self.block_kv), int(self.loop_order),
                int(self.normalize), int(self.exp_form))


def forward_call(pol, q4, causal, scale, block_q=None, block_kv=None, sram_bytes=None, loop_order=None,
                 normalize=None, exp=None, ring=None) -> Call:
    """The Call of a flash forward (tiles and choices checked; None takes the policy's)."""
    block_q, block_kv = tiles(pol, q4.shape[3], block_q, block_kv, sram_bytes)
    return Call(pol, scale, causal, block_q, block_kv, choice("loop_order", loop_order, LOOP_ORDERS, pol.loop_order),
                choice("normalize", normalize, NORMALIZE, pol.normalize), choice("exp", exp, EXP_FORMS, pol.exp),
                ring)


def backward_call(pol, q4, causal, scale, block_q=None, block_kv=None, sram_bytes=None, exp=None, ring=None) -> Call:
    """The Call of a flash backward (it reads no loop order or normalisation)."""
    block_q, block_kv = tiles(pol, q4.shape[3], block_q, block_kv, sram_bytes)
    return Call(pol, scale, causal, block_q, block_kv, exp_form=choice("exp", exp, EXP_FORMS, pol.exp), ring=ring)


def prepare(q, k, v, policy, causal, scale, gpu=None, return_lse=False):
    """A policy kernel's arguments checked: 4-D q, k, v, the Policy, causal, the scale and q's rank
    (``return_lse`` checked too, so that a bad flag is refused before the kernel runs)."""
    boolean(return_lse, "return_lse")
    pol = as_policy(policy, "policy")
    q4, k4, v4, rank = qkv(q, k, v, gpu)
    check_policy(pol, q4, k4)
    return q4, k4, v4, pol, causal_of(causal), scale_of(scale, q4.shape[3]), rank


def saved(q4, out, lse, dout, rank, gpu=None, dtype=np.float64, lse_dtype=np.float64):
    """A backward's out, dout (4-D) and lse (3-D) (device arrays of ``dtype`` / ``lse_dtype`` with
    ``gpu``), their shapes checked against q's original rank."""
    out, dout = operand(out, "out", gpu, dtype), operand(dout, "dout", gpu, dtype)
    lse = gpu.operand(lse, "lse", lse_dtype) if gpu else as_float(lse, "lse", contiguous=True)
    shape = q4.shape[4 - rank:]
    for name, arr, want in (("out", out, shape), ("dout", dout, shape), ("lse", lse, shape[:-1])):
        if arr.shape != want:
            what = "q's shape without its last axis" if name == "lse" else "q's shape"
            raise ValueError(f"{name}: expected {what} {want}, got {arr.shape}")
    return out.reshape(q4.shape), lse.reshape(q4.shape[:3]), dout.reshape(q4.shape)


def sram_tiles(sram_bytes, dim):
    """FlashAttention-1's tile rule for on-chip memory of M bytes: Bc = ceil(M / (4 d)), Br = min(Bc, d).
    Returns (block_q, block_kv) = (Br, Bc)."""
    m = positive_int(sram_bytes, "sram_bytes")
    dim = positive_int(dim, "dim")
    bc = -(-m // (4 * dim))
    return min(bc, dim), bc


def tiles(pol: Policy, dim, block_q=None, block_kv=None, sram_bytes=None):
    """(block_q, block_kv): the caller's, FlashAttention-1's rule for ``sram_bytes``, or the policy's."""
    if sram_bytes is not None:
        if block_q is not None or block_kv is not None:
            raise ValueError(f"sram_bytes={sram_bytes!r} derives block_q and block_kv; do not pass them too "
                             f"(got block_q={block_q!r}, block_kv={block_kv!r})")
        block_q, block_kv = sram_tiles(sram_bytes, dim)
    return (positive_int(pol.block_q if block_q is None else block_q, "block_q"),
            positive_int(pol.block_kv if block_kv is None else block_kv, "block_kv"))


def check_tiling(block_q=None, block_kv=None, sram_bytes=None, loop_order=None, normalize=None, exp=None):
    """The values of a flash tiling (``**tiling`` of fadev.torch.attention and fadev.hf.use) checked before
    any head dim is known: tiles and ``sram_bytes`` positive integers or None (``sram_bytes`` not with
    explicit tiles), the string options one of their choices or None. ValueError naming the argument."""
    for name, value in (("block_q", block_q), ("block_kv", block_kv), ("sram_bytes", sram_bytes)):
        if value is not None:
            positive_int(value, name)
    if sram_bytes is not None and (block_q is not None or block_kv is not None):
        raise ValueError(f"sram_bytes={sram_bytes!r} derives block_q and block_kv; do not pass them too "
                         f"(got block_q={block_q!r}, block_kv={block_kv!r})")
    for name, value, allowed in (("loop_order", loop_order, LOOP_ORDERS), ("normalize", normalize, NORMALIZE),
                                 ("exp", exp, EXP_FORMS)):
        if value is not None:
            choice(name, value, allowed)


def unshape_forward(out, lse, rank, return_lse):
    """A forward's (out, lse) from 4-D / 3-D back to the caller's rank: ``out`` or ``(out, lse)``."""
    out = out.reshape(out.shape[4 - rank:])
    if not boolean(return_lse, "return_lse"):
        return out
    return out, lse.reshape(lse.shape[4 - rank:])


def unshape_grads(grads, rank):
    """A backward's (dq, dk, dv) from 4-D back to the caller's rank."""
    return tuple(g.reshape(g.shape[4 - rank:]) for g in grads)
