"""PyTorch bridge: fadev's attention kernels as a differentiable torch op, an SDPA patch, and shadow runs.

``import fadev.torch`` needs PyTorch; ``import fadev`` never imports it.

* :func:`attention` -- ``torch.nn.functional.scaled_dot_product_attention``'s conventions, computed by
  fadev's C kernels (forward and backward) under a precision policy, as a ``torch.autograd.Function``.
* :func:`patch_sdpa` -- a context manager that routes every ``F.scaled_dot_product_attention`` call
  (``nn.MultiheadAttention``, ``nn.TransformerEncoderLayer``, Hugging Face-style attention) through fadev.
* :func:`shadow` -- at every SDPA call compute a reference and a candidate policy on the same inputs,
  continue the model with one and log the other's deviation; or, with ``sample_every``, monitor (fadev.monitor).

Under ``torch.compile`` :func:`attention` is the ``torch.library`` custom op ``fadev::attention`` (fake and autograd
registrations; its backward ``fadev::attention_backward``), so a compiled model keeps it in one graph and gets
eager's bits: the op runs the same forward and backward as the eager ``autograd.Function``.

What is copied. The kernels read C-contiguous float64 memory. A contiguous float64 CPU tensor is handed
to them as ``tensor.numpy()`` (no copy), and their float64 results become tensors through
``torch.from_numpy`` (no copy): in float64 nothing is copied on the way in or out. Any other input
(float32, float16, bfloat16 -- read through its bit patterns --, or non-contiguous) is converted into
a contiguous float64 copy, exactly (every value of these dtypes is a float64), by the forward and again
by the backward; results are converted once into the input dtype (exact when the policy's ``out`` /
``grad`` format fits in the dtype, e.g. fa2(bf16) into bfloat16 or float32; otherwise rounded to
nearest-even once, not twice through float32 as torch's cast does). NumPy and fadev make these copies,
not torch's thread pool; the float64 input copies go into per-thread scratch buffers reused from call
to call (fresh memory's page faults cost more than the copy; see :func:`release_buffers`). For the
backward the forward saves the input tensors themselves (no float64 copies), the float64 output and the
row log-sum-exp; the backward recomputes nothing else.

CUDA tensors are computed by fadev's GPU kernels (the same policy kernels, the same bits as on the CPU)
with no host copies: fadev.cuda reads float64 contiguous tensors in place and converts others on the
device; results are float64 CUDA tensors, cast to the input dtype on the device with one rounding
(round-to-odd through float32, then nearest-even), or by torch's one cast where the policy's ``out`` /
``grad`` format holds only values of the dtype (nothing rounds: fadev.torch_tensors.values_within). Streams: see
:mod:`fadev.cuda`. Other devices
raise NotImplementedError (or fall back with ``fallback=True``).
"""
from __future__ import annotations

import dataclasses
import math
import sys
from typing import Optional

import torch
import torch.nn.functional as F

from . import _args
from .backends import subset
from ._args import MAX_DIM
from .attention import baseline_attention, flash_attention
from .backward import baseline_attention_backward, flash_attention_backward
from .cuda import device_count as _cuda_devices
from .formats import boolean
from .metrics import compare
from .monitor import LayerNames, Monitor
from .policy import Policy, as_policy
from .torch_tensors import (POOL_MAX_ELEMENTS, _FORMAT_OF, _as_tensor, _cast_on_device, _check_tensor,  # noqa: F401
                            _float64, _kernel_input, _to_dtype, release_buffers)

KERNELS = subset("flash", "baseline")
FLASH_TILING = ("block_q", "block_kv", "sram_bytes", "loop_order", "normalize", "exp")
"""Keyword arguments ``**tiling`` may hold (flash only): those of :func:`fadev.flash_attention`."""

DTYPES = tuple(_FORMAT_OF)


class UnsupportedSDPA(NotImplementedError):
    """An SDPA call fadev cannot compute exactly as PyTorch would (dropout, a general attn_mask, ...).
    :func:`patch_sdpa` raises it unless ``fallback=True``."""


# ---------------------------------------------------------------- one attention configuration

def _check_kernel(kernel, tiling):
    _args.choice("kernel", kernel, KERNELS)
    unknown = sorted(set(tiling) - set(FLASH_TILING))
    if unknown:
        raise TypeError(f"unknown tiling argument(s) {', '.join(unknown)}; flash takes {', '.join(FLASH_TILING)}")
    if kernel == "baseline" and tiling:
        raise ValueError(f"kernel='baseline' has no tiling, got {', '.join(sorted(tiling))}")
    _args.check_tiling(**tiling)


@dataclasses.dataclass(frozen=True)
class _Kernel:
    """A policy, a kernel and its tiling: computes forward and backward on 4-D float64 arrays."""

    policy: Policy
    kernel: str
    tiling: tuple  # sorted (name, value) pairs

    @classmethod
    def make(cls, policy, kernel, tiling, name="policy"):
        _check_kernel(kernel, tiling)
        return cls(as_policy(policy, name), kernel, tuple(sorted(tiling.items())))

    def forward(self, q, k, v, causal, scale):
        if self.kernel == "flash":
            return flash_attention(q, k, v, self.policy, causal=causal, scale=scale, return_lse=True,
                                   **dict(self.tiling))
        return baseline_attention(q, k, v, self.policy, causal=causal, scale=scale, return_lse=True)

    def backward(self, q, k, v, out, lse, dout, causal, scale):
        if self.kernel == "baseline":
            return baseline_attention_backward(q, k, v, out, lse, dout, self.policy, causal=causal, scale=scale)
        tiling = dict(self.tiling)
        return flash_attention_backward(q, k, v, out, lse, dout, self.policy, causal=causal, scale=scale,
                                        block_q=tiling.get("block_q"), block_kv=tiling.get("block_kv"),
                                        sram_bytes=tiling.get("sram_bytes"), exp=tiling.get("exp"))


def _shape4(shape):
    """(B, H, N, D) of an SDPA shape (..., H, N, D); every leading dim folds into B."""
    if len(shape) == 2:
        return (1, 1) + tuple(shape)
    return (math.prod(shape[:-3]),) + tuple(shape[-3:])


def _run_forward(kern, q, k, v, causal, scale, sink=None):
    """(result in q's dtype, the float64 output, the float64 lse) of ``kern`` on q, k, v."""
    qs, ks = _shape4(q.shape), _shape4(k.shape)
    out, lse = kern.forward(_kernel_input(q, "q", qs), _kernel_input(k, "k", ks), _kernel_input(v, "v", ks), causal,
                            scale)
    out = out.reshape(q.shape)
    if sink is not None:
        sink.append(out)
    result = _to_dtype(out, q.dtype, kern.policy.out)
    return result, (result if q.dtype == torch.float64 else _as_tensor(out)), _as_tensor(lse)


def _run_backward(kern, causal, scale, q, k, v, out, lse, dout):
    """(dq, dk, dv) in q's dtype of ``kern``'s backward from the forward's inputs, float64 output and lse."""
    qs, ks = _shape4(q.shape), _shape4(k.shape)
    arrays = [_kernel_input(t, slot, s) for t, slot, s in ((q, "q", qs), (k, "k", ks), (v, "v", ks),
                                                           (out, None, qs), (dout, "dout", qs),
                                                           (lse, None, tuple(lse.shape)))]
    dq, dk, dv = kern.backward(*arrays[:4], arrays[5], arrays[4], causal, scale)
    grad = kern.policy.grad  # the stage every gradient is rounded to last
    return (_to_dtype(dq.reshape(q.shape), q.dtype, grad), _to_dtype(dk.reshape(k.shape), q.dtype, grad),
            _to_dtype(dv.reshape(v.shape), q.dtype, grad))


class _AttentionFunction(torch.autograd.Function):
    """fadev attention as an autograd op (eager mode). Inputs are validated by :func:`_validate`."""

    @staticmethod
    def forward(ctx, q, k, v, kern, causal, scale, sink):
        result, out64, lse = _run_forward(kern, q, k, v, causal, scale, sink)
        # the inputs themselves, not their float64 copies: autograd then notices in-place changes, the graph
        # holds no second copy, and the backward's fresh copies reuse warm memory (keeping these alive costs
        # more in page faults than converting twice)
        ctx.save_for_backward(q, k, v, out64, lse)
        ctx.kern, ctx.causal, ctx.scale = kern, causal, scale
        return result

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout):
        return _run_backward(ctx.kern, ctx.causal, ctx.scale, *ctx.saved_tensors, dout) + (None,) * 4


# ---------------------------------------------------------------- torch.compile: the same as custom ops

_KERNELS, _HANDLES = [], {}


@torch.compiler.assume_constant_result
def _handle(policy, kernel, tiling) -> int:
    """The int naming the checked (policy, kernel, tiling) in the custom ops' calls (they take no objects);
    under torch.compile it is computed once, at trace time, and baked into the graph."""
    kern = _Kernel.make(policy, kernel, dict(tiling))
    if kern not in _HANDLES:
        _HANDLES[kern] = len(_KERNELS)
        _KERNELS.append(kern)
    return _HANDLES[kern]


def _compiled(q, k, v, handle, is_causal, scale, enable_gqa):
    """:func:`attention` under torch.compile: the custom op with the kernel of ``handle`` (:func:`_handle`). Callers
    that hold a Policy object across compiled calls compute the handle before compiling (fadev.hf's settings do):
    torch 2.11's dynamo cannot make a frozen dataclass the constant `_handle` is called with (torch 2.13's can)."""
    return _op_forward(q, k, v, handle, bool(is_causal), None if scale is None else float(scale), bool(enable_gqa))[0]


@torch.library.custom_op("fadev::attention", mutates_args=())
def _op_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kern: int, is_causal: bool,
                scale: Optional[float], enable_gqa: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(result, float64 output, lse) of :func:`attention` with the kernel of handle ``kern``; only the result is
    differentiable."""
    _validate(q, k, v, is_causal, enable_gqa)
    result, out64, lse = _run_forward(_KERNELS[kern], q, k, v, is_causal, scale)
    return result, (out64.clone() if out64 is result else out64), lse


@_op_forward.register_fake
def _(q, k, v, kern, is_causal, scale, enable_gqa):
    lse = q.new_empty(_shape4(q.shape)[:3], dtype=torch.float64)
    return torch.empty_like(q, memory_format=torch.contiguous_format), q.new_empty(q.shape, dtype=torch.float64), lse


@torch.library.custom_op("fadev::attention_backward", mutates_args=())
def _op_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                 lse: torch.Tensor, kern: int, is_causal: bool,
                 scale: Optional[float]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _run_backward(_KERNELS[kern], is_causal, scale, q, k, v, out, lse, dout)


@_op_backward.register_fake
def _(dout, q, k, v, *rest):
    return tuple(torch.empty_like(t, memory_format=torch.contiguous_format) for t in (q, k, v))


def _setup(ctx, inputs, output):
    q, k, v, ctx.kern, ctx.causal, ctx.scale, _ = inputs
    ctx.save_for_backward(q, k, v, output[1], output[2])


def _op_grads(ctx, dout, dout64, dlse):
    q, k, v, out, lse = ctx.saved_tensors
    return _op_backward(dout, q, k, v, out, lse, ctx.kern, ctx.causal, ctx.scale) + (None,) * 4


_op_forward.register_autograd(_op_grads, setup_context=_setup)


def _validate(q, k, v, is_causal, enable_gqa):
    for name, t in (("query", q), ("key", k), ("value", v)):
        _check_tensor(t, name)
    if not q.dtype == k.dtype == v.dtype:
        raise TypeError(f"query, key and value must have the same dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not q.device == k.device == v.device:
        raise ValueError(f"query, key and value must be on one device, got {q.device}, {k.device}, {v.device}")
    _args.sdpa_shapes(q.shape, k.shape, v.shape, is_causal, enable_gqa)


def attention(q, k, v, policy, *, kernel="flash", is_causal=False, scale=None, enable_gqa=False, **tiling):
    """softmax(scale q k^T) v by fadev's C kernels under ``policy``, differentiable (torch.autograd).

    Shapes and arguments follow ``torch.nn.functional.scaled_dot_product_attention``: q (..., H, N, D)
    or (N, D), k and v (..., H_kv, N_kv, D); ``scale`` defaults to 1/sqrt(D); ``is_causal`` masks key
    j > query i (needs N == N_kv); ``enable_gqa`` lets H be a multiple of H_kv (query head h reads
    K/V head h // (H / H_kv)). ``kernel``: "flash" (``**tiling``: block_q, block_kv, sram_bytes,
    loop_order, normalize, exp, as :func:`fadev.flash_attention`; the backward uses block_q, block_kv
    and exp) or "baseline". dtypes float64, float32, float16, bfloat16 (all three the same); the
    output and the gradients have the input dtype. What is copied: see the module docstring.
    The backward runs fadev's backward kernel under the same policy (its backward stages). Under torch.compile
    with torch 2.11 pass ``policy`` as a preset name ("fa2:bf16"): that version's dynamo cannot make a Policy object
    the constant the kernel is looked up with (2.13's can; fadev.hf's ``use`` blocks resolve it before compiling).
    """
    if torch.compiler.is_compiling():  # the custom op (checks when it runs; the graph holds it)
        return _compiled(q, k, v, _handle(policy, kernel, tuple(sorted(tiling.items()))), is_causal, scale,
                         enable_gqa)
    kern = _Kernel.make(policy, kernel, tiling)
    _validate(q, k, v, is_causal, enable_gqa)
    return _AttentionFunction.apply(q, k, v, kern, bool(is_causal), scale, None)


# ---------------------------------------------------------------- routing SDPA calls

def _mask_kind(mask, L, S):
    """'none' if ``mask`` lets every query see every key, 'causal' if it is SDPA's causal mask (query i
    sees key j <= i), else None. Boolean masks: True = attend; float masks: 0 = attend, -inf or the
    dtype's most negative finite value (Hugging Face's choice) = masked."""
    if not isinstance(mask, torch.Tensor) or mask.dim() < 2 or mask.device.type not in ("cpu", "cuda") \
            or mask.is_nested:
        return None
    if mask.shape[-2] not in (1, L) or mask.shape[-1] not in (1, S):
        return None
    mask = mask.broadcast_to(mask.shape[:-2] + (L, S))
    if mask.dtype == torch.bool:
        allowed = mask
    elif mask.is_floating_point():
        blocked = (mask == -math.inf) | (mask == torch.finfo(mask.dtype).min)
        if not bool(((mask == 0) | blocked).all()):
            return None
        allowed = mask == 0
    else:
        return None
    if bool(allowed.all()):
        return "none"
    if L == S and bool((allowed == torch.ones(L, S, dtype=torch.bool, device=mask.device).tril()).all()):
        return "causal"
    return None


def _unsupported(q, k, v, attn_mask, dropout_p, is_causal):
    """(reason or None, is_causal) for one SDPA call; a causal-equivalent mask becomes is_causal."""
    tensors = (q, k, v)
    if not all(isinstance(t, torch.Tensor) for t in tensors):
        return "query, key and value must be tensors", is_causal
    if any(t.device.type not in ("cpu", "cuda") for t in tensors):
        return f"tensors on {q.device}: fadev computes on CPU and CUDA tensors", is_causal
    if len({t.device for t in tensors}) > 1:
        return f"tensors on different devices ({q.device}, {k.device}, {v.device})", is_causal
    if q.device.type == "cuda" and not _cuda_devices():
        return f"tensors on {q.device}, but fadev has no usable GPU (built without CUDA, or no device)", is_causal
    if any(t.dtype not in _FORMAT_OF for t in tensors):
        return f"dtype {q.dtype} (fadev takes float64, float32, float16, bfloat16)", is_causal
    if any(t.is_nested for t in tensors):
        return "nested tensors", is_causal
    if dropout_p != 0.0:
        return (f"dropout_p={dropout_p}: fadev attention has no dropout (set the model's attention dropout to 0, "
                f"or call model.eval())"), is_causal
    if min(q.dim(), k.dim(), v.dim()) < 2:
        return None, is_causal  # invalid for PyTorch too: _validate says why
    if v.shape[-1] != k.shape[-1]:
        return f"value head dim {v.shape[-1]} != key head dim {k.shape[-1]}", is_causal
    if q.shape[-1] > MAX_DIM:
        return f"head dim {q.shape[-1]} > {MAX_DIM}", is_causal
    if q.dim() == k.dim() == v.dim() and not q.shape[:-3] == k.shape[:-3] == v.shape[:-3]:
        return (f"batch dims {tuple(q.shape[:-3])}, {tuple(k.shape[:-3])}, {tuple(v.shape[:-3])} differ (fadev "
                f"does not broadcast them)"), is_causal
    if attn_mask is not None:
        if is_causal:
            return "attn_mask together with is_causal=True", is_causal
        kind = _mask_kind(attn_mask, q.shape[-2], k.shape[-2])
        if kind is None:
            return (f"attn_mask of shape {tuple(attn_mask.shape)} and dtype {attn_mask.dtype} is neither all-"
                    f"visible nor the causal mask (fadev supports attn_mask=None and is_causal=True)"), is_causal
        is_causal = kind == "causal"
    if is_causal and q.shape[-2] != k.shape[-2]:
        return (f"is_causal with {q.shape[-2]} queries and {k.shape[-2]} keys (SDPA aligns the mask top-left, fadev "
                f"bottom-right)"), is_causal
    return None, is_causal


class _SdpaRoute:
    """Replaces ``torch.nn.functional.scaled_dot_product_attention`` while active (and turns off the
    MultiheadAttention / TransformerEncoderLayer inference fast path, which bypasses SDPA)."""

    def __init__(self, fallback):
        self.fallback = boolean(fallback, "fallback")
        self.calls = 0
        """SDPA calls computed by fadev."""
        self.fallbacks = 0
        """SDPA calls handed to PyTorch (only with fallback=True)."""
        self._original = None

    def __enter__(self):
        if self._original is not None:
            raise RuntimeError(f"{type(self).__name__} is already active (it cannot be entered twice)")
        self._original = F.scaled_dot_product_attention
        mha = getattr(torch.backends, "mha", None)  # torch >= 2.2
        self._fastpath = mha.get_fastpath_enabled() if mha is not None else None
        if mha is not None:
            mha.set_fastpath_enabled(False)
        F.scaled_dot_product_attention = self._sdpa
        return self

    def __exit__(self, *exc):
        F.scaled_dot_product_attention = self._original
        if self._fastpath is not None:
            torch.backends.mha.set_fastpath_enabled(self._fastpath)
        self._original = None
        return False

    def _sdpa(self, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
              enable_gqa=False):
        reason, causal = _unsupported(query, key, value, attn_mask, dropout_p, is_causal)
        if reason is not None:
            if not self.fallback:
                raise UnsupportedSDPA(f"fadev.torch.{self._what}: unsupported scaled_dot_product_attention call: "
                                      f"{reason}; pass fallback=True to hand such calls to PyTorch")
            self.fallbacks += 1
            extra = {"enable_gqa": True} if enable_gqa else {}  # torch < 2.5 has no enable_gqa
            return self._original(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                                  scale=scale, **extra)
        query, key, value = autocast_inputs(query, key, value)
        _validate(query, key, value, causal, enable_gqa)
        self.calls += 1
        return self._attend(query, key, value, causal, scale)


def autocast_dtype(t):
    """The dtype ``torch.autocast`` casts lower-precision ops to on ``t``'s device (CPU or CUDA), or None where
    autocast is off there (or ``t`` is not a tensor on one of those devices)."""
    kind = t.device.type if isinstance(t, torch.Tensor) else "cpu"
    if kind not in ("cpu", "cuda"):
        return None
    try:
        on, dtype = torch.is_autocast_enabled(kind), torch.get_autocast_dtype(kind)
    except (TypeError, AttributeError):  # torch < 2.4: one function per device
        on = torch.is_autocast_cpu_enabled() if kind == "cpu" else torch.is_autocast_enabled()
        dtype = torch.get_autocast_cpu_dtype() if kind == "cpu" else torch.get_autocast_gpu_dtype()
    return dtype if on else None


def autocast_inputs(q, k, v):
    """q, k, v as PyTorch's own SDPA sees them under ``torch.autocast``: cast to the autocast dtype (SDPA is
    one of autocast's lower-precision ops on CPU and CUDA), which the replaced function would otherwise skip --
    under autocast a Hugging Face model hands SDPA fp32 q, k (after the rotary embedding) with a bf16 v."""
    dtype = autocast_dtype(q)
    if dtype is None:
        return q, k, v
    # the cast keeps a model's layout (its (B, N, H, D) memory seen as (B, H, N, D)): the native kernel reads those
    # strides in place and writes its output and gradients in the same layout, which the model's views then take
    # without a copy (the emulated kernels read any layout)
    cast = (lambda t: isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != dtype)  # noqa: E731
    return tuple(t.to(dtype) if cast(t) else t for t in (q, k, v))


class patch_sdpa(_SdpaRoute):  # noqa: N801 (used as a context manager, like torch's own)
    """``with fadev.torch.patch_sdpa(policy, kernel="flash", fallback=False, **tiling) as patch:``

    Inside the block every ``torch.nn.functional.scaled_dot_product_attention(...)`` call -- made by
    user code, ``nn.MultiheadAttention(need_weights=False)``, ``nn.TransformerEncoderLayer`` /
    ``nn.TransformerDecoderLayer`` (train and eval: the inference fast path is turned off meanwhile),
    Hugging Face's sdpa attention -- is computed by :func:`attention` under ``policy``. Supported:
    ``attn_mask`` None, all-visible, or the causal mask (bool, or float with 0 / -inf / dtype min),
    ``is_causal``, ``scale``, ``enable_gqa``, ``dropout_p == 0``; under ``torch.autocast`` q, k and v are
    first cast to the autocast dtype, as PyTorch's SDPA casts them. Anything else raises
    :class:`UnsupportedSDPA`, or with ``fallback=True`` runs PyTorch's original. ``patch.calls``
    counts calls fadev computed, ``patch.fallbacks`` those handed to PyTorch. The original function
    is restored on exit, also after an exception.

    Not routed: ``nn.MultiheadAttention`` with ``need_weights=True`` (its default; it computes attention
    by bmm and softmax, not SDPA), and code that bound the function at import time (``from
    torch.nn.functional import scaled_dot_product_attention``).
    """

    _what = "patch_sdpa"

    def __init__(self, policy, kernel="flash", fallback=False, **tiling):
        super().__init__(fallback)
        self._kern = _Kernel.make(policy, kernel, tiling)
        self.policy, self.kernel = self._kern.policy, kernel

    def _attend(self, q, k, v, causal, scale):
        return _AttentionFunction.apply(q, k, v, self._kern, causal, scale, None)


# ---------------------------------------------------------------- shadow runs

METRICS = ("n", "n_nan", "n_inf", "max_abs", "mean_diff", "std_diff", "mean_abs", "rmse", "rel_l2", "max_rel",
           "wasserstein")


class shadow(_SdpaRoute):  # noqa: N801 (a context manager)
    """``with fadev.torch.shadow(reference=pol_a, candidate=pol_b, use="reference") as log:``

    Routes SDPA calls as :class:`patch_sdpa` does (fallback=False), but computes each call under both
    policies on identical inputs, continues the model with the ``use`` one ("reference" or "candidate";
    gradients flow through it, the other is computed without autograd) and appends to ``log.records``
    one dict per call: ``call`` (0, 1, ...), ``module`` (qualified name of the innermost running module,
    e.g. "layers.0.self_attn", or None outside modules; names come from ``model`` when given),
    ``module_type``, ``q_shape``, ``k_shape``, ``v_shape``, ``dtype``, ``is_causal``, ``reference``,
    ``candidate``, ``use``, and the :func:`fadev.compare` metrics (n, max_abs, rmse, rel_l2, wasserstein,
    ...) of the candidate's float64 output against the reference's. With ``golden=True`` also
    ``reference_vs_golden_<metric>`` and ``candidate_vs_golden_<metric>`` against the golden policy
    (computed with the reference's kernel). ``kernel`` is "flash", "baseline" or a pair
    (reference kernel, candidate kernel); ``**tiling`` applies to the flash ones.
    ``log.to_dataframe()`` gives the records as a pandas DataFrame.

    ``shadow(sample_every=k, rows=16, log_dir=None, csv=None, model=None, candidate=None, kernel="flash",
    **tiling)`` returns a :class:`fadev.monitor.Monitor` instead: the model runs its own attention (SDPA, or
    ``candidate`` as :class:`patch_sdpa` runs it) and every k-th call of each layer is checked against float64
    attention at ``rows`` query rows (max_abs, mean_abs, rel_rms per layer; TensorBoard ``log_dir``, ``csv``).
    """

    _what = "shadow"

    def __new__(cls, reference=None, candidate=None, use="reference", kernel="flash", golden=False, model=None,
                sample_every=None, rows=None, log_dir=None, csv=None, **tiling):
        if sample_every is None and (rows, log_dir, csv) != (None, None, None):
            raise ValueError("rows, log_dir and csv are monitoring options: pass sample_every= too")
        if sample_every is None:
            return super().__new__(cls)
        if reference is not None or use != "reference" or golden is not False:
            raise ValueError(f"monitoring (sample_every) checks against float64 attention and takes a candidate only, "
                             f"got reference={reference!r}, use={use!r}, golden={golden!r}")
        if candidate is None and (kernel != "flash" or tiling):
            raise ValueError("kernel and tiling choose how the candidate runs: pass candidate= (a policy) too")
        inner = None if candidate is None else patch_sdpa(candidate, kernel, **tiling)
        return Monitor(sample_every, 16 if rows is None else rows, log_dir, csv, model, inner,
                       "sdpa" if inner is None else f"{inner.policy.name} {inner.kernel}")

    def __init__(self, reference, candidate, use="reference", kernel="flash", golden=False, model=None,
                 sample_every=None, rows=None, log_dir=None, csv=None, **tiling):
        super().__init__(False)
        if use not in ("reference", "candidate"):
            raise ValueError(f"use must be 'reference' or 'candidate', got {use!r}")
        boolean(golden, "golden")
        kernels = (kernel, kernel) if isinstance(kernel, str) else tuple(kernel) if isinstance(kernel, tuple) else ()
        if len(kernels) != 2:
            raise ValueError(f"kernel must be 'flash', 'baseline' or a (reference, candidate) pair, got {kernel!r}")
        if tiling:
            _check_kernel("flash", tiling)
            if "flash" not in kernels:
                raise ValueError(f"tiling ({', '.join(sorted(tiling))}) needs a flash kernel, got kernel={kernel!r}")
        self._reference = _Kernel.make(reference, kernels[0], tiling if kernels[0] == "flash" else {}, "reference")
        self._candidate = _Kernel.make(candidate, kernels[1], tiling if kernels[1] == "flash" else {}, "candidate")
        self._golden = (_Kernel.make(Policy.golden(), kernels[0], tiling if kernels[0] == "flash" else {})
                       if golden else None)
        self.use = use
        self.records = []
        self._layer_names = LayerNames(model)

    def _attend(self, q, k, v, causal, scale):
        used, other = ((self._reference, self._candidate) if self.use == "reference"
                       else (self._candidate, self._reference))
        sink = []
        result = _AttentionFunction.apply(q, k, v, used, causal, scale, sink)
        q64, k64, v64 = (_kernel_input(t, slot, _shape4(t.shape)) for t, slot in zip((q, k, v), "qkv"))
        outs = {self.use: sink[0], ("candidate" if self.use == "reference" else "reference"):
                other.forward(q64, k64, v64, causal, scale)[0].reshape(q.shape)}
        module, module_type = self._layer_names(sys._getframe())
        rec = {"call": len(self.records), "module": module, "module_type": module_type, "q_shape": tuple(q.shape),
               "k_shape": tuple(k.shape), "v_shape": tuple(v.shape), "dtype": str(q.dtype).replace("torch.", ""),
               "is_causal": causal, "reference": self._reference.policy.name,
               "candidate": self._candidate.policy.name, "use": self.use}
        rec.update(compare(outs["candidate"], outs["reference"]).as_dict())
        if self._golden is not None:
            gold = self._golden.forward(q64, k64, v64, causal, scale)[0].reshape(q.shape)
            for side in ("reference", "candidate"):
                for key, value in compare(outs[side], gold).as_dict().items():
                    rec[f"{side}_vs_golden_{key}"] = value
        self.records.append(rec)
        return result

    def to_dataframe(self):
        """``records`` as a pandas DataFrame (one row per SDPA call)."""
        import pandas as pd
        return pd.DataFrame.from_records(self.records)


__all__ = ["attention", "patch_sdpa", "autocast_inputs", "autocast_dtype", "shadow", "UnsupportedSDPA", "release_buffers", "POOL_MAX_ELEMENTS", "KERNELS",
           "FLASH_TILING", "DTYPES", "METRICS"]
