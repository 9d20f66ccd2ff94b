"""Tensors to and from the C-contiguous float64 arrays fadev's emulated kernels read (fadev.torch's copies and casts;
what is copied, and why the copies reuse per-thread scratch buffers: fadev.torch's module docstring)."""
from __future__ import annotations

import math
import threading

import ml_dtypes
import numpy as np
import torch

from .formats import as_format
from .formats import to_bits as _to_bits

_FORMAT_OF = {torch.float64: "fp64", torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}
"""The fadev format of each torch dtype fadev.torch takes."""

def _check_tensor(t, name):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.device.type not in ("cpu", "cuda"):
        raise NotImplementedError(f"{name}: fadev.torch computes on CPU and CUDA tensors only, got a tensor on "
                                  f"{t.device} -- move the inputs with .cpu()")
    if t.dtype not in _FORMAT_OF:
        raise TypeError(f"{name}: dtype must be one of float64, float32, float16, bfloat16, got {t.dtype}")
    if t.is_nested or t.layout != torch.strided:
        raise TypeError(f"{name}: expected a dense (strided) tensor, got layout {t.layout}"
                        f"{' (nested)' if t.is_nested else ''}")


def _zero_copy(t) -> bool:
    return t.dtype == torch.float64 and t.is_contiguous() and not t.is_neg() and not t.is_conj()


POOL_MAX_ELEMENTS = 1 << 22
"""Largest float64 copy (in elements, 32 MiB) made in a reused per-thread scratch buffer; larger ones are
fresh arrays."""

_pool = threading.local()


def _scratch(slot, shape) -> np.ndarray:
    """A float64 array of ``shape`` in this thread's scratch buffer ``slot`` (q, k, v or dout). Fresh
    memory costs a page fault per 4 KiB on first touch -- about 1 ms for the three float64 copies of a
    1 x 4 x 1024 x 64 call, 2.5% of its fa2 forward -- and freed large arrays go back to the OS, so the
    copies reuse warm buffers. A buffer's contents live only until the next call on the thread: the copies
    are read by the kernel and never saved (the forward saves the original tensors)."""
    n = math.prod(shape)
    if n > POOL_MAX_ELEMENTS:
        return np.empty(shape)
    buffers = _pool.__dict__.setdefault("buffers", {})
    buf = buffers.get(slot)
    if buf is None or buf.size < n:
        buf = buffers[slot] = np.empty(n)
    return buf[:n].reshape(shape)


def release_buffers() -> None:
    """Free this thread's scratch buffers (at most 4 x 32 MiB; see :data:`POOL_MAX_ELEMENTS`)."""
    _pool.__dict__.pop("buffers", None)


def _float64(t, slot=None) -> np.ndarray:
    """``t``'s values as a C-contiguous float64 array: ``t``'s own memory when it is a contiguous float64
    tensor, else an exact copy (in scratch buffer ``slot`` when given). Copies are made by NumPy, not by
    torch's thread pool (whose worker wake-ups cost milliseconds on a busy machine and compete with
    fadev's threads)."""
    t = t.detach()
    if _zero_copy(t):
        return t.numpy()
    if t.dtype == torch.bfloat16:  # NumPy has no bfloat16: view the bits as ml_dtypes' (an exact cast)
        src = t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    else:
        src = t.resolve_neg().resolve_conj().numpy()
    out = _scratch(slot, tuple(t.shape)) if slot is not None else np.empty(tuple(t.shape))
    np.copyto(out, src)
    return out


def _kernel_input(t, slot, shape):
    """What the kernels read for ``t``, shaped ``shape``: a CUDA tensor as it is (fadev.cuda converts it
    to float64 on the device), a CPU tensor through :func:`_float64`."""
    if t.device.type == "cuda":
        return t.detach().reshape(shape)
    return _float64(t, slot).reshape(shape)


def _as_tensor(x) -> torch.Tensor:
    return x if isinstance(x, torch.Tensor) else torch.from_numpy(x)


def _cast_on_device(t: torch.Tensor, dtype) -> torch.Tensor:
    """A float64 CUDA tensor as ``dtype``, rounded to nearest-even once (as :func:`_to_dtype`). torch casts
    float64 to float16/bfloat16 through float32 (two roundings); rounding to float32 toward odd first
    makes the second rounding the correct one, since float32 has at least two more bits than either."""
    if dtype in (torch.float64, torch.float32):
        return t.to(dtype)
    f = t.to(torch.float32)
    back = f.to(torch.float64)
    toward_zero = torch.where(back.abs() > t.abs(), torch.nextafter(f, torch.zeros_like(f)), f)
    odd = (toward_zero.view(torch.int32) | 1).view(torch.float32)
    return torch.where(back == t, f, odd).to(dtype)


def values_within(fmt, dtype) -> bool:
    """Whether every value of fadev format ``fmt`` is a value of torch ``dtype`` (float16, bfloat16, float32,
    float64): no more significant bits, no larger finite magnitude, no finer grid at the bottom (its smallest
    subnormal, or its smallest normal without subnormals). Then a float64 tensor of ``fmt`` values converts exactly
    with torch's own cast, which for float16 / bfloat16 goes through float32 (exact too: both hold every such value)."""
    target = as_format(_FORMAT_OF[dtype])
    return (fmt.precision <= target.precision and fmt.largest <= target.largest
            and fmt.smallest_subnormal >= target.smallest_subnormal)


def _to_dtype(arr, dtype, values=None) -> torch.Tensor:
    """A float64 result as a tensor of ``dtype``, rounded to nearest-even once (exact when the values are
    in the dtype already, e.g. an fa2(bf16) output in bfloat16 or float32). float64 shares ``arr``'s
    memory. (torch's own float64 -> float16/bfloat16 cast rounds twice, through float32.) A CUDA result
    (a tensor) is cast on the device: by torch's one cast where ``values``, the format the kernel rounded the
    result to (its policy's stage), has only values of ``dtype`` (:func:`values_within`: the round-to-odd
    sequence of :func:`_cast_on_device` would leave them unchanged; one kernel instead of nine per tensor)."""
    if isinstance(arr, torch.Tensor):
        if values is not None and values_within(values, dtype):
            return arr.to(dtype)
        return _cast_on_device(arr, dtype)
    if dtype == torch.float64:
        return torch.from_numpy(arr)
    if dtype == torch.float32:
        return torch.from_numpy(arr.astype(np.float32))
    bits = _to_bits(arr, _FORMAT_OF[dtype]).view(np.int16)
    return torch.from_numpy(bits).view(dtype)
