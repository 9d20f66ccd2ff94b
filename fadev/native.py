"""fadev's native tensor-core kernels: FlashAttention-2-style forward and backward in fp16 / bf16 with
fp32 accumulation (cuda/native_forward.cu, cuda/native_backward.cu), for timing and for comparing real
hardware arithmetic with the emulated policies. GPU only; they take no policy (their arithmetic is
fixed), so their options start at ``causal``.
"""
from __future__ import annotations

import functools
import numbers

import ml_dtypes
import numpy as np

from . import _args
from . import _core
from . import backends
from .cuda import element_type, is_cuda_array, no_gpu, route
from .formats import _numeric, round as _round

DTYPES = ("fp16", "bf16")
_NP_DTYPES = (np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16))  # by DTYPES index (the kernels' dtype code)


WARP_ROWS = (16, 32)
MMA = ("sync", "wgmma")
"""The native kernels' tensor-core instructions: ``"sync"`` mma.sync.m16n8k16 issued per warp (every GPU from sm_80),
``"wgmma"`` Hopper's warpgroup MMA (wgmma.m64nNk16, compute capability 9.0 only; cuda/native_forward_wgmma.cu,
cuda/native_backward_wgmma.cu and its deterministic dq pass cuda/native_backward_dq_wgmma.cu)."""
MMA_CHOICES = MMA + ("auto",)
"""What ``mma=`` takes: an instruction, or ``"auto"`` (the default): :func:`auto_mma`'s choice."""


def choose_mma(capability, wgmma_tiles, block_q=None, block_kv=None, warp_rows=16) -> str:
    """The instruction ``mma="auto"`` runs, as a table (issue 25; benchmarks/README.md, ratio to SDPA flash with each
    kernel's default tile: wgmma forward 0.74-1.23 vs mma.sync 0.60-0.89 over D 64 / 128, N 4k / 16k, causal or not,
    H100; wgmma backward, deterministic, 1.03-1.21 at D 64 and 128 vs mma.sync 0.72-0.86, H200): ``"wgmma"`` where
    the GPU has compute capability (9, 0), the build has a wgmma kernel for the head dim and direction
    (``wgmma_tiles``, :func:`native_tiles` with ``mma="wgmma"``) fitting the requested tile entries (None: any) and
    ``warp_rows`` is 16 (32 rows per warp exist for mma.sync only); else ``"sync"``. The backward's dq is the
    deterministic pass unless asked otherwise (``deterministic`` defaults to True)."""
    if tuple(capability) != (9, 0) or warp_rows != 16:
        return "sync"
    fits = any(block_q in (None, bq) and block_kv in (None, bkv) for bq, bkv in wgmma_tiles)
    return "wgmma" if fits else "sync"


@functools.lru_cache(maxsize=None)
def _capability(index) -> tuple:
    """Compute capability (major, minor) of CUDA device ``index`` (asked once per device)."""
    for device in _core.cuda_info()["devices"]:
        if device["index"] == index:
            return tuple(device["capability"])
    raise no_gpu(f"cuda:{index}")


def auto_mma(dim, *, backward=False, block_q=None, block_kv=None, warp_rows=16, device=None) -> str:
    """The instruction ``mma="auto"`` runs on CUDA device ``device`` (an index; None: the current device) for head
    dim ``dim`` in one direction with the requested tile entries: :func:`choose_mma` of the device's compute
    capability and the build's wgmma tiles."""
    index = _core.cuda_current_device() if device is None else int(device)
    wgmma = native_tiles(dim, backward=backward, mma="wgmma")
    return choose_mma(_capability(index), wgmma, block_q, block_kv, warp_rows)


def resolve_mma(mma, dim, *, backward=False, block_q=None, block_kv=None, warp_rows=16, device=None) -> str:
    """``mma`` ("sync", "wgmma" or "auto", checked) as the instruction a call runs (:func:`auto_mma` for "auto")."""
    _args.choice("mma", mma, MMA_CHOICES)
    if mma != "auto":
        return mma
    return auto_mma(dim, backward=backward, block_q=block_q, block_kv=block_kv, warp_rows=warp_rows, device=device)


def _warp_rows(warp_rows):
    if isinstance(warp_rows, bool) or not isinstance(warp_rows, numbers.Integral) or warp_rows not in WARP_ROWS:
        raise ValueError(f"warp_rows must be 16 or 32, got {warp_rows!r}")
    return int(warp_rows)


def native_tiles(dim, *, backward=False, warp_rows=16, mma="sync") -> list:
    """The (block_q, block_kv) tiles the native forward (``backward=False``) or backward kernel supports for head
    dim ``dim`` (the first is the default unless :data:`DEFAULT_TILES` names another); an empty list for a head dim
    they do not support. The two lists differ: the backward holds dK and dV in registers besides the score tile, so
    its query tiles are smaller. ``warp_rows``: the tile rows a warp owns, 16 or 32 (query rows in the forward, key
    rows in the backward; 32 runs two row blocks side by side, half the shared-memory reads per product; the same
    arithmetic, so the same bits), each with its own list (the backward's 32 only at D 64). ``mma="wgmma"``: the
    tiles of the Hopper kernels (forward: block_q / 64 warpgroups; backward: block_kv / 64, block_q 64 at D 64 and 32
    at D 128; ``warp_rows`` not read)."""
    if isinstance(dim, bool) or not isinstance(dim, numbers.Integral) or dim < 1:
        raise ValueError(f"dim must be a positive integer, got {dim!r}")
    tiles = _tiles(int(dim), bool(_args.boolean(backward, "backward")), _warp_rows(warp_rows),
                   _args.choice("mma", mma, MMA))
    if tiles is None:
        raise no_gpu("native_tiles")
    return list(tiles)


@functools.lru_cache(maxsize=None)
def _tiles(dim, backward, rows, code):
    """The build's tile list (a constant of the compiled kernels), asked of the binding once per argument set
    (issue 25: what is constant is computed once, not per call). A native forward + backward looked it up five
    times; measured on an H100 (benchmarks/README.md) that cost little -- ``_core.cuda_info()`` takes ~6 us --
    so the native call's host time lies elsewhere. None: built without CUDA."""
    if not _core.cuda_info()["compiled"]:
        return None
    try:
        return tuple(tuple(t) for t in _core.cuda_native_tiles(dim, backward, rows, code))
    except ValueError:  # FADEV_ERR_INVALID_ARGUMENT: a head dim without tiles
        return ()


def _dtype_code(dtype, q) -> int:
    """The index in DTYPES of ``dtype``, or of q's element type when None."""
    if dtype is not None:
        return _args.choice("dtype", dtype, DTYPES)
    name = element_type(q)
    for code, np_dtype in enumerate(_NP_DTYPES):
        if name == np_dtype.name:
            return code
    raise TypeError(f"q: the native kernels read float16 or bfloat16, got {name}; pass dtype='bf16' or 'fp16' to "
                    f"round NumPy inputs to one of them")


def _host(x, name, code):
    """A host input rounded (nearest-even) to the native dtype ``code``; CUDA arrays unchanged."""
    if is_cuda_array(x):
        return x
    return _round(_numeric(x, name), DTYPES[code]).astype(_NP_DTYPES[code])


DEFAULT_TILES = {
    ("wgmma", False, 64, False): (128, 128), ("wgmma", False, 64, True): (128, 128),
    ("wgmma", False, 128, False): (128, 128), ("wgmma", False, 128, True): (128, 128),
    ("wgmma", True, 64, False): (64, 64), ("wgmma", True, 64, True): (64, 64),
    ("wgmma", True, 128, False): (64, 128), ("wgmma", True, 128, True): (64, 128),
}
"""The tile a call with no tile argument runs, per (instruction, backward, head dim, causal); keys it lacks take the
first of :func:`native_tiles`. Measured (benchmarks/README.md, "The measured tile table" and "The forward with a
producer warpgroup"): the forward's 128-query-row tiles run the tensor-memory-accelerator kernel (a producer
warpgroup, two consumers in ping-pong), 1.2-1.5x the other tiles at D 64 and 128, N 1k-16k, causal or not, on an
H100; the backward's (64, 128) tiles run, deterministic, the producer / consumer kernel
(cuda/native_backward_tma_wgmma.cu: 1.02-1.21x the cp.async kernel at D 128 on an H100, the same bits), the D 128
entries' tile; D 64 keeps (64, 64) up to the lengths :data:`LONG_TILES` names. A table, not an autotuner: a tile changes the bits, and a default must give the same bits on every run and every
machine with the instruction."""


LONG_TILES = {
    ("wgmma", True, 64, False): (16384, (64, 128)), ("wgmma", True, 64, True): (4096, (64, 128)),
}
"""From ``seq_q`` >= the length given, the tile a call with no tile argument runs instead of :data:`DEFAULT_TILES`'
(same keys). Measured (benchmarks/README.md, "The backward's dK/dV kernel on a producer warpgroup"; H100, bf16,
deterministic): at D 64 the producer / consumer kernel of the (64, 128) tile pays its set-up (K and V, three
warpgroups, one CTA an SM) over a CTA's query tiles, so it beats (64, 64) at length: causal 1.08-1.11x at N 4k,
1.04-1.12x at 16k, and 0.95-0.99x at 1k; without a mask 1.09-1.14x at 16k, 0.94-0.99x at 4k, 0.81-0.94x at 1k."""


def fit_tile(dim, block_q=None, block_kv=None, *, backward=False, warp_rows=16, mma="sync", causal=False,
             seq_q=None, names="block_q, block_kv") -> tuple:
    """The one tile fitter of the native kernels: the (block_q, block_kv) they run for head dim ``dim``: with no
    tile entry given, :data:`LONG_TILES`' tile for (``mma``, ``backward``, ``dim``, ``causal``) where it has one and
    ``seq_q`` (the query length; None: short) reaches its length, else :data:`DEFAULT_TILES`' where it has one,
    else the first of :func:`native_tiles` matching the given entries (None matches any). ValueError naming
    ``names`` and the supported tiles when none does (``mma`` or ``warp_rows`` when they leave no tile at that head
    dim)."""
    tiles = native_tiles(dim, backward=backward, warp_rows=warp_rows, mma=mma)
    if not tiles and mma == "wgmma" and native_tiles(dim, backward=backward):
        raise ValueError(f"mma: the wgmma {'backward' if backward else 'forward'} has no tile at head dim {dim}")
    if not tiles and native_tiles(dim, backward=backward):
        raise ValueError(f"warp_rows: no native {'backward' if backward else 'forward'} tile has {warp_rows} rows per "
                         f"warp at head dim {dim}")
    if not tiles:
        raise ValueError(f"q: the native kernels do not support head dim {dim}")
    if block_q is None and block_kv is None:
        key = (mma, bool(backward), int(dim), bool(causal))
        long = LONG_TILES.get(key)
        if long and seq_q is not None and seq_q >= long[0] and long[1] in tiles:
            return long[1]
        table = DEFAULT_TILES.get(key)
        if table in tiles:
            return table
    fits = [t for t in tiles if block_q in (None, t[0]) and block_kv in (None, t[1])]
    if not fits:
        direction = ("backward" if backward else "forward") + ("" if warp_rows == 16 or mma == "wgmma" else
                                                               " (warp_rows=32)")
        direction += " (mma='wgmma')" if mma == "wgmma" else ""
        raise ValueError(f"{names}: ({block_q!r}, {block_kv!r}) is not a native {direction} tile for head dim {dim}; "
                         f"supported: {tiles}")
    return fits[0]


def _params(q4, causal, scale, block_q, block_kv, code, gpu, backward=False, deterministic=False, warp_rows=16,
            mma="auto"):
    """The call spec and the native options (dtype code, deterministic, warp_rows, mma code) of a native call."""
    dim = q4.shape[3]
    mma = resolve_mma(mma, dim, backward=backward, block_q=block_q, block_kv=block_kv, warp_rows=warp_rows,
                      device=gpu.index)
    causal = _args.causal_of(causal)
    tile = fit_tile(dim, block_q, block_kv, backward=backward, warp_rows=warp_rows, mma=mma, causal=causal,
                    seq_q=q4.shape[2])
    call = _args.Call(None, _args.scale_of(scale, dim), causal, *tile)
    return call, (code, deterministic, warp_rows, MMA.index(mma))


def native_attention(q, k, v, *, causal=False, scale=None, block_q=None, block_kv=None, warp_rows=16, mma="auto",
                     return_lse=False, dtype=None):
    """FlashAttention-2-style forward on the tensor cores (cuda/native_forward.cu): fp16 or bf16 inputs and output,
    fp32 accumulation and online softmax (exp2). Shapes, ``causal`` and ``scale`` as :func:`fadev.flash_attention`;
    head dim 64 or 128; (``block_q``, ``block_kv``) one of :func:`native_tiles` for ``warp_rows`` (16 or 32 query
    rows per warp: the same bits, another speed; default: :func:`fit_tile`'s, the measured :data:`DEFAULT_TILES`
    entry or the list's first). ``mma="wgmma"`` runs the Hopper kernel (cuda/native_forward_wgmma.cu: the same
    algorithm and rounding steps, products by warpgroup MMA; its own tiles, ``native_tiles(D, mma="wgmma")``;
    compute capability 9.0 only); ``"sync"`` the mma.sync kernel; ``"auto"`` (the default) the faster of the two for
    this GPU, head dim and tile request (:func:`auto_mma`). PyTorch CUDA tensors of float16 / bfloat16 give tensors
    (``lse`` float32, natural log), the kernels queued on PyTorch's current stream without a device
    synchronisation (the backward's too); NumPy (or ml_dtypes) arrays are rounded to ``dtype`` ("bf16" or "fp16";
    inferred from a float16 / bfloat16 array), copied to the GPU, and come back as float64 NumPy arrays holding the
    fp16 / bf16 (lse: fp32) values. Not differentiable: see :func:`native_attention_backward`."""
    _args.boolean(return_lse, "return_lse")
    rows = _warp_rows(warp_rows)
    _args.choice("mma", mma, MMA_CHOICES)
    code = _dtype_code(dtype, q)
    gpu = route("cuda", q=q, k=k, v=v)
    q, k, v = (_host(x, n, code) for x, n in ((q, "q"), (k, "k"), (v, "v")))
    q4, k4, v4, rank = _args.qkv(q, k, v, gpu, _NP_DTYPES[code])
    call, options = _params(q4, causal, scale, block_q, block_kv, code, gpu, warp_rows=rows, mma=mma)
    out, lse = backends.Native(gpu, options).forward("native", q4, k4, v4, call)
    return _args.unshape_forward(out, lse, rank, return_lse)


def native_attention_backward(q, k, v, out, lse, dout, *, causal=False, scale=None, block_q=None, block_kv=None,
                              warp_rows=16, mma="auto", deterministic=True, dtype=None):
    """Gradients (dq, dk, dv) by the native FlashAttention-2-style backward (cuda/native_backward.cu): P
    recomputed from the forward's ``lse`` (float32), dq accumulated in fp32: with ``deterministic=True`` (the
    default, as :func:`fadev.torch_native.native_attention`'s) by a separate pass over the K/V tiles in key order
    (cuda/native_backward_dq.cu; no atomics, the same bits on every run), with False by atomic adds from the key
    tiles (FlashAttention-2's way). (``block_q``, ``block_kv``) is
    one of ``native_tiles(D, backward=True, warp_rows=warp_rows)`` (default: its first), the backward's own
    lists; ``warp_rows`` 32 gives each warp 32 keys (the same bits as 16, another speed). ``out`` and
    ``lse`` as :func:`native_attention` returned them; arguments and result kinds as that function's.
    ``mma="wgmma"``: the dK/dV kernel on Hopper's warpgroup MMA (cuda/native_backward_wgmma.cu; its tiles
    ``native_tiles(D, backward=True, mma="wgmma")``) and, with ``deterministic``, the dq pass on it too
    (cuda/native_backward_dq_wgmma.cu): the same dK and dV bits as mma.sync with the tile, and the same dq with
    ``deterministic``; atomic dq sums in another grouping. ``"auto"`` (the default): :func:`auto_mma`'s choice
    (wgmma on an H100 or H200, else mma.sync)."""
    _args.boolean(deterministic, "deterministic")
    rows = _warp_rows(warp_rows)
    _args.choice("mma", mma, MMA_CHOICES)
    code = _dtype_code(dtype, q)
    gpu = route("cuda", q=q, k=k, v=v, out=out, lse=lse, dout=dout)
    q, k, v, out, dout = (_host(x, n, code) for x, n in ((q, "q"), (k, "k"), (v, "v"), (out, "out"),
                                                         (dout, "dout")))
    q4, k4, v4, rank = _args.qkv(q, k, v, gpu, _NP_DTYPES[code])
    out4, lse3, dout4 = _args.saved(q4, out, lse, dout, rank, gpu, _NP_DTYPES[code], np.float32)
    call, options = _params(q4, causal, scale, block_q, block_kv, code, gpu, backward=True,
                            deterministic=deterministic, warp_rows=rows, mma=mma)
    grads = backends.Native(gpu, options).backward("native", q4, k4, v4, out4, lse3, dout4, call)
    return _args.unshape_grads(grads, rank)


__all__ = ["native_attention", "native_attention_backward", "native_tiles", "auto_mma", "choose_mma", "resolve_mma",
           "DTYPES", "MMA", "MMA_CHOICES"]
