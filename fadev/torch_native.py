"""fadev's native tensor-core kernel as a differentiable PyTorch op, for training steps and torch.compile.

:func:`native_attention` computes ``torch.nn.functional.scaled_dot_product_attention``'s result for CUDA
float16 / bfloat16 tensors (B, H, N, D) by the native forward (cuda/native_forward*.cu: FlashAttention-2's
order, fp32 accumulation, P rounded to the input dtype) and its gradients by the native backward
(cuda/native_backward*.cu). The output and the gradients have the bits of :func:`fadev.native_attention` and
:func:`fadev.native_attention_backward` with the same tiles and instruction.

The call path is built for a training step (issue 25: fadev's host time per call, not the kernel, made a step
slower than SDPA's). Everything that depends only on (device, dtypes, shapes, options) -- the argument checks,
the tiles, the instruction ``mma="auto"`` picks, the call spec and native options the binding parses, the
backward's workspace size -- is a :class:`Plan`, built once per such key and looked up in a dict afterwards.
A call reads its inputs where they lie when their rows are contiguous and 16-byte aligned (:func:`layout`: a
model's (B, N, H, D) projections seen as (B, H, N, D) included; else a contiguous copy), allocates the results with
``torch.empty_like`` in the inputs' layout through PyTorch's caching allocator (so the model's views of the output
and of the gradients need no copy either), and hands the binding the tensors' ``data_ptr()``s, their strides and
PyTorch's current CUDA stream: the kernels are queued on that stream and the call returns at once (no device
synchronisation, no DLPack or ``__cuda_array_interface__`` conversion; grouped-query heads are read in place).
Under ``torch.compile`` the custom ops take contiguous tensors (their fake kernels say so).

Two entries share that path. In eager mode a ``torch.autograd.Function`` (a few microseconds of dispatch);
under ``torch.compile`` the ``torch.library.custom_op``\\ s ``fadev::native_attention`` and
``fadev::native_attention_backward``, with ``register_fake`` and ``register_autograd`` (FlashAttention-3's
hopper/flash_attn_interface.py is the model), so a compiled model keeps the op in its graph without a break.
(A custom op costs ~20 us more per call in eager dispatch than an autograd.Function, measured on this CPU;
``torch.compiler.is_compiling()`` picks the entry.)

``import fadev`` never imports this module (it needs PyTorch); ``fadev.torch_native`` imports it on first use.
"""
from __future__ import annotations

import contextlib
import dataclasses
import numbers
import sys
from typing import Optional

import torch

from . import _args
from . import _core
from . import native as _native
from .cuda import device_count, no_gpu, torch_stream
from .formats import boolean
from .native import MMA, MMA_CHOICES, fit_tile, native_tiles, resolve_mma

DTYPES = (torch.float16, torch.bfloat16)
_CODE = {torch.float16: 0, torch.bfloat16: 1}  # the binding's dtype code (fadev.native.DTYPES order)


@dataclasses.dataclass(frozen=True)
class Plan:
    """What one key of (device, dtypes, shapes, options) needs, computed once: the forward's and backward's tiles and
    instructions, the binding's shape tuple, call specs and native options (without the stream), and the float32
    elements of the backward's workspace."""

    tiles: tuple          # ((block_q, block_kv), (backward block_q, backward block_kv))
    mma: tuple            # (forward instruction, backward instruction)
    shape: tuple          # (batch, heads, heads_kv, seq_q, seq_kv, dim)
    forward: tuple        # (call spec, native options)
    backward: tuple
    workspace: int


_PLANS = {}
MAX_PLANS = 4096
"""Plans kept at most; past it the cache starts afresh (decoding with a growing key length makes a key per step)."""


def _check_tensors(q, k, v):
    """Every check of the tensors' kinds, dtypes, devices and ranks; errors name the argument."""
    named = (("query", q), ("key", k), ("value", v))
    for name, t in named:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    for name, t in named:
        if t.dtype not in DTYPES:
            raise TypeError(f"{name}: the native kernel reads float16 or bfloat16, got {t.dtype}")
        _check_device(t, name)
        if t.dim() != 4:
            raise ValueError(f"{name}: expected a 4-D (batch, heads, seq, head_dim) tensor, got shape "
                             f"{tuple(t.shape)}")
    if not q.dtype == k.dtype == v.dtype:
        raise TypeError(f"query, key and value must have one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not q.device == k.device == v.device:
        raise ValueError(f"query, key and value must be on one device, got {q.device}, {k.device}, {v.device}")


def _check_device(t, name):
    if t.device.type != "cuda":
        raise ValueError(f"{name}: the native kernel runs on CUDA tensors, got a tensor on {t.device} (use "
                         f"fadev.torch.attention with a policy for CPU tensors)")


def _device_index(device) -> int:
    if not device_count():
        raise no_gpu("fadev.torch_native.native_attention")
    return device.index if device.index is not None else torch.cuda.current_device()


def _choose_tiles(dim, index, options, causal, seq_q=None):
    """((forward tile, backward tile), (forward mma, backward mma)) of the native options (seq_q: the query length,
    for fadev.native.LONG_TILES)."""
    block_q, block_kv, backward_block_q, backward_block_kv, _, mma, backward_mma = options
    if not native_tiles(dim):
        raise ValueError(f"query: the native kernel has no tiles for head dim {dim} (supported: those "
                         f"fadev.native_tiles lists, 64 and 128)")
    fmma = resolve_mma(mma, dim, block_q=block_q, block_kv=block_kv, device=index)
    forward = fit_tile(dim, block_q, block_kv, mma=fmma, causal=causal, seq_q=seq_q)
    if backward_mma is None:  # explicit instructions are the forward's; the backward then runs mma.sync, as before
        backward_mma = "auto" if mma == "auto" else "sync"
    explicit = backward_block_q is not None or backward_block_kv is not None
    bmma = resolve_mma(backward_mma, dim, backward=True, block_q=backward_block_q, block_kv=backward_block_kv,
                       device=index)
    if not explicit and forward in native_tiles(dim, backward=True, mma=bmma):
        return (forward, forward), (fmma, bmma)
    backward = fit_tile(dim, backward_block_q, backward_block_kv, backward=True, mma=bmma, causal=causal,
                        seq_q=seq_q, names="backward_block_q, backward_block_kv")
    return (forward, backward), (fmma, bmma)


def _build(q, k, v, is_causal, scale, enable_gqa, options) -> Plan:
    block_q, block_kv, backward_block_q, backward_block_kv, deterministic, mma, backward_mma = options
    boolean(deterministic, "deterministic")
    _args.choice("mma", mma, MMA_CHOICES)
    if backward_mma is not None:
        _args.choice("backward_mma", backward_mma, MMA_CHOICES)
    _check_tensors(q, k, v)
    _args.sdpa_shapes(q.shape, k.shape, v.shape, is_causal, enable_gqa)
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, numbers.Real)):
        raise TypeError(f"scale must be a real number or None, got {scale!r}")
    index = _device_index(q.device)
    (b, h, nq, dim), (_, hkv, nk, _) = q.shape, k.shape
    tiles, mma_pair = _choose_tiles(dim, index, options, bool(is_causal), nq)
    shape = (b, h, hkv, nq, nk, dim)
    scale, causal, code = _args.scale_of(scale, dim), bool(is_causal), _CODE[q.dtype]
    calls = tuple((_args.Call(None, scale, causal, *tile).c, (code, bool(deterministic) and i == 1, 16, MMA.index(m)))
                  for i, (tile, m) in enumerate(zip(tiles, mma_pair)))
    workspace = -(-_workspace_bytes(shape, *calls[1]) // 4)
    return Plan(tiles, mma_pair, shape, calls[0], calls[1], max(1, workspace))


def _workspace_bytes(shape, call, native):
    return _core.cuda_native_workspace(shape, call, native)


def plan(q, k, v, is_causal=False, scale=None, enable_gqa=False, block_q=None, block_kv=None, backward_block_q=None,
         backward_block_kv=None, deterministic=True, mma="auto", backward_mma=None) -> Plan:
    """The :class:`Plan` of a call with these arguments (built and checked on the first call with its key, then
    looked up). Errors name the argument."""
    options = (block_q, block_kv, backward_block_q, backward_block_kv, deterministic, mma, backward_mma)
    try:
        key = (q.dtype, k.dtype, v.dtype, q.device, k.device, v.device, q.shape, k.shape, v.shape, is_causal, scale,
               enable_gqa, options)
        return _PLANS[key]
    except (KeyError, AttributeError, TypeError):  # new key, or arguments the checks will name
        built = _build(q, k, v, is_causal, scale, enable_gqa, options)
        if len(_PLANS) >= MAX_PLANS:
            _PLANS.clear()
        _PLANS[key] = built
        return built


# ---------------------------------------------------------------- the launches (raw pointers, PyTorch's stream)

def _stream(device) -> int:
    """PyTorch's current CUDA stream on ``device`` as an int; ValueError unless ``device`` is the current device
    (where the runtime launches)."""
    current = torch.cuda.current_device()
    if device.index != current:
        raise ValueError(f"query: a tensor on {device}, but the current CUDA device is cuda:{current}; make it "
                         f"current first (torch.cuda.set_device({device.index}) or with torch.cuda.device(...))")
    return torch_stream(current)


def layout(t):
    """The (batch, head, row) element strides of a (B, H, N, D) tensor the native kernels read in place -- every row
    contiguous, each stride a multiple of 8 elements and the data 16-byte aligned (cp.async's and the stores'
    16-byte accesses) -- or None (then :func:`readable` copies it). A dimension of size 1 has stride 0 (any is
    valid there)."""
    s, n = t.stride(), t.shape
    if s[3] != 1 and n[3] != 1 or t.data_ptr() % 16:
        return None
    strides = (s[0] if n[0] != 1 else 0, s[1] if n[1] != 1 else 0, s[2] if n[2] != 1 else 0)
    return strides if not (strides[0] % 8 or strides[1] % 8 or strides[2] % 8) and min(strides) >= 0 else None


def _readable(t):
    """(:func:`readable` (t), its :func:`layout`)."""
    strides = layout(t)
    if strides is not None:
        return t, strides
    t = t.contiguous()
    return t, layout(t)


def readable(t):
    """``t`` itself when :func:`layout` reads it in place, else a contiguous copy."""
    return _readable(t)[0]


def _layout_like(t, src, src_layout):
    """layout(t) of t = torch.empty_like(src): src's where t has src's strides (empty_like keeps a dense tensor's;
    PyTorch's allocations are 16-byte aligned), without computing it again (a host microsecond a tensor)."""
    return src_layout if src_layout is not None and t.stride() == src.stride() and not t.data_ptr() % 16 else layout(t)


def _forward(p: Plan, q, k, v, lq, lk, lv):
    """(out, lse, layout(out)) of the plan's forward; lq, lk, lv: the inputs' layouts (:func:`_readable`)."""
    out = torch.empty_like(q)  # q's strides where q is dense (a model's transposed view), else contiguous
    lse = torch.empty(q.shape[:3], dtype=torch.float32, device=q.device)
    lo = _layout_like(out, q, lq)
    call, native = p.forward
    _core.cuda_native_forward(q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), lse.data_ptr(), p.shape,
                              call, native + (_stream(q.device), lq + lk + lv + lo))
    return out, lse, lo


def _backward(p: Plan, q, k, v, out, lse, dout, lq, lk, lv, lo):
    """(dq, dk, dv) of the plan's backward, each in its input's layout; lq .. lo the forward's layouts."""
    dout, ld = _readable(dout)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    workspace = torch.empty(p.workspace, dtype=torch.float32, device=q.device)
    call, native = p.backward
    strides = (lq + lk + lv + lo + ld + _layout_like(dq, q, lq) + _layout_like(dk, k, lk) + _layout_like(dv, v, lv))
    _core.cuda_native_backward(q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), lse.data_ptr(),
                               dout.data_ptr(), dq.data_ptr(), dk.data_ptr(), dv.data_ptr(), workspace.data_ptr(),
                               p.shape, call, native + (_stream(q.device), strides))
    return dq, dk, dv


def run_forward(p: Plan, q, k, v):
    """(out, lse) of the plan's forward on q, k, v as :func:`readable` left them; out in q's layout."""
    return _forward(p, q, k, v, layout(q), layout(k), layout(v))[:2]


def run_backward(p: Plan, q, k, v, out, lse, dout):
    """(dq, dk, dv) of the plan's backward (q, k, v, out, lse as the forward had them), each gradient in its input's
    layout."""
    return _backward(p, q, k, v, out, lse, dout, layout(q), layout(k), layout(v), layout(out))


@contextlib.contextmanager
def _dry_run(calls=None, tiles=None, capability=(8, 0)):
    """The path without a GPU: CPU tensors pass the device checks, the stream is 0, the binding's two native calls
    append their arguments to ``calls`` (a list) instead of launching, the build's tile lists are ``tiles`` ({(dim,
    backward, warp_rows, mma code): [(block_q, block_kv), ...]}; default: (64, 64) for D 64 and 128, mma.sync only)
    and every device has compute capability ``capability``. For measuring fadev's host time per call on a CPU
    (benchmarks/bench_step.py --host-only) and testing the plumbing there; not thread-safe."""
    table = tiles if tiles is not None else {(d, b, 16, 0): [(64, 64)] for d in (64, 128) for b in (False, True)}
    record = (lambda *a: calls.append(a)) if calls is not None else (lambda *a: None)
    here = dict(_check_device=lambda t, name: None, _device_index=lambda device: 0, _stream=lambda device: 0,
                _workspace_bytes=lambda shape, call, native: 4 * shape[0] * shape[1] * shape[3] * (shape[5] + 1))
    there = dict(_tiles=lambda dim, backward, rows, code: tuple(table.get((dim, backward, rows, code), ())),
                 _capability=lambda index: tuple(capability))
    binding = dict(cuda_native_forward=record, cuda_native_backward=record)
    saved = [(module, {name: getattr(module, name) for name in patch})
             for module, patch in ((sys.modules[__name__], here), (_native, there), (_core, binding))]
    _PLANS.clear()
    for module, patch in ((sys.modules[__name__], here), (_native, there), (_core, binding)):
        for name, value in patch.items():
            setattr(module, name, value)
    try:
        yield calls
    finally:
        for module, values in saved:
            for name, value in values.items():
                setattr(module, name, value)
        _PLANS.clear()


# ---------------------------------------------------------------- eager: an autograd.Function

class _NativeFunction(torch.autograd.Function):
    """The native forward, saving (q, k, v, out, lse); the native backward from them."""

    @staticmethod
    def forward(ctx, q, k, v, p, layouts):
        out, lse, lo = _forward(p, q, k, v, *layouts)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.plan, ctx.layouts = p, layouts + (lo,)
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout):
        return _backward(ctx.plan, *ctx.saved_tensors, dout, *ctx.layouts) + (None, None)


# ---------------------------------------------------------------- torch.compile: custom ops

@torch.library.custom_op("fadev::native_attention", mutates_args=())
def _op_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool, scale: Optional[float],
                enable_gqa: bool, block_q: Optional[int], block_kv: Optional[int], backward_block_q: Optional[int],
                backward_block_kv: Optional[int], deterministic: bool, mma: str,
                backward_mma: Optional[str]) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) of :func:`native_attention` (q, k, v contiguous); lse is not differentiable."""
    p = plan(q, k, v, is_causal, scale, enable_gqa, block_q, block_kv, backward_block_q, backward_block_kv,
             deterministic, mma, backward_mma)
    return run_forward(p, q, k, v)


@_op_forward.register_fake
def _(q, k, v, *options):
    return torch.empty_like(q, memory_format=torch.contiguous_format), q.new_empty(q.shape[:3], dtype=torch.float32)


@torch.library.custom_op("fadev::native_attention_backward", mutates_args=())
def _op_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                 lse: torch.Tensor, is_causal: bool, scale: Optional[float], enable_gqa: bool, block_q: Optional[int],
                 block_kv: Optional[int], backward_block_q: Optional[int], backward_block_kv: Optional[int],
                 deterministic: bool, mma: str,
                 backward_mma: Optional[str]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) of :func:`native_attention`'s backward."""
    p = plan(q, k, v, is_causal, scale, enable_gqa, block_q, block_kv, backward_block_q, backward_block_kv,
             deterministic, mma, backward_mma)
    return run_backward(p, q, k, v, out, lse, dout)


@_op_backward.register_fake
def _(dout, q, k, v, *rest):
    return tuple(torch.empty_like(t, memory_format=torch.contiguous_format) for t in (q, k, v))


def _setup(ctx, inputs, output):
    q, k, v, *ctx.options = inputs
    ctx.save_for_backward(q, k, v, *output)


def _op_grads(ctx, dout, dlse):
    q, k, v, out, lse = ctx.saved_tensors
    return _op_backward(dout, q, k, v, out, lse, *ctx.options) + (None,) * len(ctx.options)


_op_forward.register_autograd(_op_grads, setup_context=_setup)


# ---------------------------------------------------------------- the public op

def native_attention(q, k, v, *, is_causal=False, scale=None, enable_gqa=False, block_q=None, block_kv=None,
                     backward_block_q=None, backward_block_kv=None, deterministic=True, mma="auto", backward_mma=None):
    """softmax(scale q k^T) v by fadev's native FlashAttention-2-style kernel, differentiable.

    ``torch.nn.functional.scaled_dot_product_attention``'s conventions: q (B, H, N, D), k and v
    (B, H_kv, N_kv, D) CUDA tensors of one dtype, float16 or bfloat16; ``scale`` defaults to 1/sqrt(D);
    ``is_causal`` masks key j > query i (needs N == N_kv); ``enable_gqa`` lets H be a multiple of H_kv
    (query head h reads K/V head h // (H / H_kv)). D is 64 or 128. ``mma``: the forward's instruction,
    "auto" (the default: :func:`fadev.native.auto_mma`, Hopper's wgmma on an H100, else mma.sync), "sync" or
    "wgmma"; ``backward_mma`` the backward's (default: "auto" when ``mma`` is, else "sync"). The forward's tile
    (``block_q``, ``block_kv``) is one of ``fadev.native_tiles(D, mma=...)`` for its instruction (default:
    :func:`fadev.native.fit_tile`'s, the measured ``DEFAULT_TILES`` entry for D and ``is_causal``, else the list's
    first); the backward has its own lists and uses (``backward_block_q``, ``backward_block_kv``) when
    given, else the forward's tile where its list has it, else its own default. ``deterministic``: dq by the
    backward's separate pass in key order (the same bits on every run, so a training run repeats exactly);
    False: by atomic adds, as FlashAttention-2. The output has q's dtype and the bits of
    :func:`fadev.native_attention`, the gradients those of :func:`fadev.native_attention_backward`, with the same
    tiles and instructions. Kernels run on PyTorch's current CUDA stream, asynchronously. Under
    ``torch.compile`` the op ``fadev::native_attention`` (module docstring). No dropout, no attn_mask.
    """
    if torch.compiler.is_compiling():  # checked when the op runs (its plan); the graph holds the op
        return _op_forward(q.contiguous(), k.contiguous(), v.contiguous(), bool(is_causal),
                           None if scale is None else float(scale), bool(enable_gqa), block_q, block_kv,
                           backward_block_q, backward_block_kv, bool(deterministic), mma, backward_mma)[0]
    p = plan(q, k, v, is_causal, scale, enable_gqa, block_q, block_kv, backward_block_q, backward_block_kv,
             deterministic, mma, backward_mma)
    (q, lq), (k, lk), (v, lv) = _readable(q), _readable(k), _readable(v)
    return _NativeFunction.apply(q, k, v, p, (lq, lk, lv))

__all__ = ["native_attention", "plan", "run_forward", "run_backward", "layout", "readable", "Plan", "DTYPES",
           "MAX_PLANS"]
