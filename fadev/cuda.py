"""fadev on the GPU: device arrays, interop with PyTorch, CuPy and DLPack, and the one place that routes
fadev's API calls to the CUDA kernels (cuda/*.cu, through fadev._core's cuda_* methods).

Where a call runs. Every API function with a ``device`` keyword (:func:`fadev.flash_attention`,
:func:`fadev.compare`, ...) resolves it with :func:`resolve_device`: ``None`` computes on the GPU when
an input is a CUDA array and on the CPU otherwise; ``"cuda"`` / ``"cuda:0"`` on the GPU (NumPy inputs
are copied there, results copied back); ``"cpu"`` on the CPU (CUDA arrays are then an error, never
silently copied). The GPU is the calling thread's current CUDA device (device 0 unless a framework selected
another: ``torch.cuda.set_device(i)`` or ``with torch.cuda.device(i)``, as one process per GPU does), where
fadev allocates and launches; ``"cuda:N"`` names it, and CUDA inputs must be on it.

Inputs. CUDA arrays are anything with ``__cuda_array_interface__`` (PyTorch CUDA tensors, CuPy arrays,
:class:`DeviceArray`, Numba) or a CUDA ``__dlpack__`` (read through ``torch.from_dlpack``). The kernels
read C-contiguous float64: a contiguous float64 CUDA array is read in place (no copy); PyTorch tensors
and CuPy arrays of another dtype or layout are converted on the device by their own library; other
CUDA arrays must already be contiguous float64 (TypeError / ValueError naming the parameter).

Outputs follow the first CUDA input: PyTorch in, PyTorch out (on the input's device); CuPy in, CuPy
out; a DeviceArray or any other CUDA array in, DeviceArray out; NumPy in (``device="cuda"``), NumPy out.

Streams. The kernels run on the legacy default stream and the device is synchronised before each call
that reads another library's memory and after every call, so arrays written on any stream are complete
when fadev reads them and fadev's results are complete when it returns. Work that another library
queues on a stream *during* a fadev call (another thread) is not ordered with it; synchronise such
streams yourself (``torch.cuda.current_stream().synchronize()``). One exception, for training loops: the
emulated kernels (flash and baseline, forward and backward) and the golden fp64 forward called with PyTorch
tensors while PyTorch's current stream is the legacy default stream (its default) are queued there like
PyTorch's own operations: no synchronisation before or after, and the results are ready for whatever PyTorch
runs next on that stream (and for the host after the synchronisation any read of them to the host makes). A
device synchronisation per call was most of fadev's host time in a training step (issue 24: each one stalls the
host until the GPU drains). The native kernels (fadev.native_attention and its backward) called with PyTorch
tensors are queued on PyTorch's current stream, whichever it is, as fadev.torch_native runs them: no
synchronisation before or after (a synchronisation per call left the GPU idle for each call's host work: at B 16,
H 16, N 1024, D 64 the forward's timed calls took 0.31-0.41 ms with it, 0.21 ms without; benchmarks/README.md).
"""
from __future__ import annotations

import functools
import math
import numbers
import re
import sys

import ml_dtypes
import numpy as np

from . import _args
from . import _core
from .formats import as_float, check_bytes, real_dtype

_BUILD_HINT = ("fadev's GPU kernels need a build with nvcc -- FADEV_CUDA=1 pip install -e . (or FADEV_CUDA=1 "
               "python setup.py build_ext --inplace) -- and a visible CUDA device")
_CUDA_DLPACK = (2, 13)  # kDLCUDA, kDLCUDAManaged
_F64 = np.dtype(np.float64)


# ---------------------------------------------------------------- availability

def no_gpu(what: str) -> RuntimeError:
    info = _core.cuda_info()
    why = ("fadev was built without CUDA" if not info["compiled"]
           else "fadev was built with CUDA, but no CUDA device is visible (check nvidia-smi and CUDA_VISIBLE_DEVICES)")
    return RuntimeError(f"{what}: fadev has no usable GPU: {why}. {_BUILD_HINT}")


_DEVICE_COUNT = None


def device_count() -> int:
    """CUDA devices fadev can use (0 if built without CUDA); asked once per process."""
    global _DEVICE_COUNT
    if _DEVICE_COUNT is None:
        info = _core.cuda_info()
        _DEVICE_COUNT = len(info["devices"]) if info["compiled"] else 0
    return _DEVICE_COUNT


# ---------------------------------------------------------------- device arrays

def _shape_of(shape) -> tuple:
    return _args.shape_of(shape, "shape", minimum=0)


class DeviceArray:
    """A C-contiguous array in CUDA device memory, allocated by fadev (``fadev_cuda_malloc``) and freed by
    :meth:`close` or when the last reference goes. Exposes ``__cuda_array_interface__`` (version 3), so
    ``torch.as_tensor(x, device="cuda")`` and ``cupy.asarray(x)`` read it without a copy (and keep it
    alive). ``DeviceArray(shape, dtype)`` allocates uninitialised memory; :meth:`from_numpy` copies a host
    array; :meth:`numpy` copies back. A view (:meth:`reshape`, or one wrapping another library's memory)
    keeps its owner alive and frees nothing itself."""

    def __init__(self, shape, dtype=np.float64):
        self._ptr, self._base = 0, None  # so __del__ is harmless if the allocation fails
        shape, dtype = _shape_of(shape), np.dtype(dtype)
        if not real_dtype(dtype):
            raise TypeError(f"dtype must be a real numeric dtype, got {dtype}")
        if not device_count():
            raise no_gpu("DeviceArray")
        self._shape, self._dtype = shape, dtype
        self._ptr = _core.cuda_malloc(math.prod(shape) * dtype.itemsize)

    @classmethod
    def _view(cls, ptr: int, shape: tuple, dtype, base) -> "DeviceArray":
        """A DeviceArray over memory someone else owns; ``base`` (kept alive) is that owner."""
        view = cls.__new__(cls)
        view._ptr, view._shape, view._dtype, view._base = int(ptr), tuple(shape), np.dtype(dtype), base
        return view

    @classmethod
    def from_numpy(cls, arr) -> "DeviceArray":
        """A device copy of a host array (anything NumPy turns into a numeric array; its dtype is kept)."""
        arr = np.asarray(arr)
        check_bytes("arr", arr.nbytes, f"a contiguous copy of shape {arr.shape}")
        arr = np.require(arr, requirements="C")  # keeps 0-d arrays 0-d (ascontiguousarray would not)
        dev = cls(arr.shape, arr.dtype)
        if arr.size:
            _core.cuda_upload(dev.ptr, arr.reshape(-1).view(np.uint8))
        return dev

    @property
    def ptr(self) -> int:
        """The device address of element 0."""
        if not self._ptr and self._base is None:
            raise ValueError("this DeviceArray is closed")
        return self._ptr

    shape = property(lambda self: self._shape, doc="the shape (C order)")
    dtype = property(lambda self: self._dtype, doc="the NumPy dtype of the elements")
    ndim = property(lambda self: len(self._shape))
    size = property(lambda self: math.prod(self._shape))
    nbytes = property(lambda self: self.size * self._dtype.itemsize)
    base = property(lambda self: self._base, doc="the owner of a view's memory (None for an owning array)")

    @property
    def __cuda_array_interface__(self) -> dict:
        # stream None: fadev synchronises before returning, so nothing is pending on this memory
        return {"shape": self._shape, "typestr": self._dtype.str, "data": (self.ptr, False), "strides": None,
                "version": 3, "stream": None}

    def numpy(self) -> np.ndarray:
        """A host copy (NumPy array of the same shape and dtype)."""
        ptr, out = self.ptr, np.empty(self._shape, self._dtype)
        if out.size:
            _core.cuda_download(out.reshape(-1).view(np.uint8), ptr)
        return out

    def reshape(self, *shape) -> "DeviceArray":
        """A view with another shape of the same size (one entry may be -1)."""
        if len(shape) == 1 and (type(shape[0]) is tuple or not isinstance(shape[0], numbers.Integral)):
            shape = shape[0]
        shape = tuple(int(s) for s in shape)
        if shape.count(-1) == 1:
            known = math.prod(s for s in shape if s != -1)
            shape = tuple(self.size // known if s == -1 and known else s for s in shape)
        if math.prod(_shape_of(shape)) != self.size:
            raise ValueError(f"cannot reshape a DeviceArray of shape {self._shape} into {shape}")
        return DeviceArray._view(self.ptr, shape, self._dtype, self if self._base is None else self._base)

    def close(self) -> None:
        """Free the memory now (an owning array; views of it become invalid). Idempotent."""
        ptr, self._ptr = self._ptr, 0
        if ptr and self._base is None:
            _core.cuda_free(ptr)
        self._base = None

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001 (interpreter shutdown, or a device already lost: nothing to do)
            pass

    def __repr__(self):
        state = f"ptr=0x{self._ptr:x}" if self._ptr else "closed"
        return f"DeviceArray(shape={self._shape}, dtype={self._dtype}, {state})"


# ---------------------------------------------------------------- recognising CUDA arrays

def torch_stream(index) -> int:
    """PyTorch's current CUDA stream on device ``index`` as an int (0: the legacy default stream)."""
    import torch
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    return raw(index) if raw is not None else torch.cuda.current_stream(index).cuda_stream


def _torch_tensor(x):
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(x, torch.Tensor)


def _cupy_array(x):
    cupy = sys.modules.get("cupy")
    return cupy is not None and isinstance(x, cupy.ndarray)


def _interface(x):
    try:
        return getattr(x, "__cuda_array_interface__", None)
    except Exception:  # noqa: BLE001 (a property that refuses, e.g. a tensor that requires grad)
        return None


def _dlpack_cuda(x) -> bool:
    dev = getattr(x, "__dlpack_device__", None)
    if dev is None:
        return False
    try:
        return int(dev()[0]) in _CUDA_DLPACK
    except Exception:  # noqa: BLE001
        return False


def is_cuda_array(x) -> bool:
    """True for arrays in CUDA memory: DeviceArray, CUDA tensors, CuPy, __cuda_array_interface__, CUDA DLPack."""
    if isinstance(x, DeviceArray):
        return True
    if isinstance(x, np.ndarray):
        return False
    if _torch_tensor(x):
        return x.device.type == "cuda"
    return _interface(x) is not None or _dlpack_cuda(x)


# ---------------------------------------------------------------- where a call runs

_DEVICE_FORMS = "None, 'cpu', 'cuda' or 'cuda:N'"


def _parse_device(device):
    """None, 'cpu' or a device index."""
    if device is None:
        return None
    if not isinstance(device, str):
        if type(device).__name__ == "device" and hasattr(device, "type"):  # torch.device
            device = str(device)
        else:
            raise TypeError(f"device must be {_DEVICE_FORMS}, got {device!r}")
    m = re.fullmatch(r"cpu|cuda(?::(\d+))?", device)
    if not m:
        raise ValueError(f"device must be {_DEVICE_FORMS}, got {device!r}")
    return "cpu" if device == "cpu" else int(m[1]) if m[1] else "cuda"


def _resolve(device, named: dict):
    """'cpu' or the CUDA device index of a call with inputs ``named`` (parameter name -> array)."""
    where = _parse_device(device)
    on_gpu = [name for name, x in named.items() if is_cuda_array(x)]
    if where is None:
        where = "cuda" if on_gpu else "cpu"
    if where == "cpu":
        if on_gpu:
            verb = "is a CUDA array" if len(on_gpu) == 1 else "are CUDA arrays"
            raise ValueError(f"device='cpu', but {', '.join(on_gpu)} {verb}; pass device=None or 'cuda' to compute on "
                             f"the GPU, or copy to the host first")
        return "cpu"
    what = f"device={device!r}" if device is not None else f"{on_gpu[0]} is a CUDA array (device=None)"
    count = device_count()
    if not count:
        raise no_gpu(what)
    current = _core.cuda_current_device()
    if where == "cuda":
        return current
    if where >= count:
        raise ValueError(f"device={device!r}: fadev sees {count} CUDA device(s)")
    if where != current:
        raise ValueError(f"device={device!r}: fadev's kernels run on the current CUDA device, cuda:{current}; "
                         f"make cuda:{where} current first (torch.cuda.set_device({where}) or with "
                         f"torch.cuda.device({where}))")
    return where


def resolve_device(device, *arrays) -> str:
    """'cpu' or 'cuda:N': where a fadev call with ``device`` and these inputs computes. ``device`` is
    None (the GPU if an input is a CUDA array, else the CPU), 'cpu', 'cuda' or 'cuda:N' (or a
    torch.device). ValueError for a bad device string or CUDA arrays with device='cpu'; RuntimeError
    when the GPU is asked for and fadev has none (built without CUDA, or no device)."""
    where = _resolve(device, {f"arrays[{i}]": a for i, a in enumerate(arrays)})
    return "cpu" if where == "cpu" else f"cuda:{where}"


def route(device, **named):
    """None when the call computes on the CPU, else a :class:`_Gpu` for it (the first CUDA input sets the
    kind of the results). ``named``: parameter name -> input, for the messages."""
    where = _resolve(device, named)
    if where == "cpu":
        return None
    first = next((x for x in named.values() if is_cuda_array(x)), None)
    return _Gpu(where, first)


# ---------------------------------------------------------------- one GPU call

@functools.cache
def _torch_dtype(dtype):
    import torch
    table = {np.dtype(np.float64): torch.float64, np.dtype(np.float32): torch.float32,
             np.dtype(np.float16): torch.float16, np.dtype(ml_dtypes.bfloat16): torch.bfloat16}
    return table[np.dtype(dtype)]


def _contiguous(shape, strides, itemsize) -> bool:
    expect = itemsize
    for size, stride in zip(reversed(shape), reversed(strides)):
        if size > 1 and stride != expect:
            return False
        expect *= size
    return True


def _shape(q, k) -> tuple:
    """A device call's shape tuple (batch, heads, heads_kv, seq_q, seq_kv, dim) from 4-D q and k."""
    (b, h, nq, d), (_, hkv, nk, _) = q.shape, k.shape
    return (b, h, hkv, nq, nk, d)


class _Gpu:
    """One call on CUDA device ``index``: inputs become device operands (:meth:`operand`), results are
    allocated like the first CUDA input (:meth:`empty`) and handed back in its kind (:meth:`result`).
    Its attention methods take what fadev._core's CPU methods of the same name take -- the arrays, then the
    call spec (:attr:`fadev._args.Call.c`) -- so :mod:`fadev.backends` runs either the same way."""

    def __init__(self, index, first):
        self.index = index
        if first is None:
            self.kind = "numpy"
        elif _torch_tensor(first):
            self.kind, self._torch_device = "torch", first.device
        elif _cupy_array(first):
            self.kind = "cupy"
        else:
            self.kind = "device"
        self._foreign = False  # another library's memory is involved: synchronise before the kernel
        # PyTorch's current stream is the legacy default stream: the emulated kernels queue there (module docstring)
        self._queued = self.kind == "torch" and torch_stream(index) == 0

    # -------------------------------------------------------------- operands and results

    def operand(self, x, name, dtype=_F64) -> DeviceArray:
        """``x`` as a C-contiguous DeviceArray (a view where possible) of ``dtype`` on this device. Only
        float64 is converted to; other dtypes (the native kernels') must match."""
        dtype = np.dtype(dtype)
        if isinstance(x, DeviceArray):
            if x.dtype != dtype:
                raise TypeError(f"{name}: a DeviceArray of dtype {x.dtype}; this call reads {dtype} (convert on the "
                                f"host: DeviceArray.from_numpy(a.astype(...)))")
            arr = x
        elif _torch_tensor(x) and x.device.type == "cuda":
            arr = self._from_torch(x, name, dtype)
        elif _cupy_array(x):
            if dtype != _F64 and x.dtype != dtype:
                raise TypeError(f"{name}: a CuPy array of dtype {x.dtype}; this call reads {dtype}")
            arr = self._from_interface(sys.modules["cupy"].ascontiguousarray(x, dtype=dtype), name, dtype)
        elif _interface(x) is not None:
            arr = self._from_interface(x, name, dtype)
        elif _dlpack_cuda(x):
            try:
                import torch
            except ImportError:
                raise TypeError(f"{name}: a DLPack CUDA array is read through torch.from_dlpack, and torch is not "
                                f"installed; pass an array with __cuda_array_interface__") from None
            arr = self._from_torch(torch.from_dlpack(x), name, dtype)
        else:
            host = as_float(x, name, dtype, contiguous=True)
            return DeviceArray.from_numpy(host)
        if arr.size:
            owner = _core.cuda_pointer_device(arr.ptr)
            if owner != self.index:
                where = "host memory" if owner < 0 else f"memory of cuda:{owner}"
                hint = "" if owner < 0 else (f" (the current CUDA device; torch.cuda.set_device({owner}) or with "
                                             f"torch.cuda.device({owner}) makes cuda:{owner} current)")
                raise ValueError(f"{name}: the array is in {where}, but the call runs on cuda:{self.index}{hint}")
        return arr

    def _from_torch(self, t, name, dtype):
        self._foreign = True
        if t.dtype == _torch_dtype(dtype) and t.is_contiguous() and not (t.is_neg() or t.is_conj()):
            return DeviceArray._view(t.data_ptr(), tuple(t.shape), dtype, t)  # in place: the common case
        t = t.detach()
        if t.is_complex():
            raise TypeError(f"{name}: expected a real tensor, got dtype {t.dtype}")
        want = _torch_dtype(dtype)
        if t.dtype != want:
            if dtype != _F64:
                raise TypeError(f"{name}: a tensor of dtype {t.dtype}; this call reads {want}")
            t = t.to(want)
        t = t.resolve_neg().resolve_conj().contiguous()
        return DeviceArray._view(t.data_ptr(), tuple(t.shape), dtype, t)

    def _from_interface(self, x, name, dtype):
        cai = x.__cuda_array_interface__
        shape, typestr = tuple(int(s) for s in cai["shape"]), cai["typestr"]
        if np.dtype(typestr) != dtype:
            raise TypeError(f"{name}: a CUDA array of type {typestr!r}; this call reads {dtype.str!r} ({dtype}): "
                            f"convert it with its own library first")
        if cai.get("mask") is not None:
            raise ValueError(f"{name}: masked CUDA arrays are not supported")
        strides = cai.get("strides")
        if strides is not None and not _contiguous(shape, strides, dtype.itemsize):
            raise ValueError(f"{name}: a non-contiguous CUDA array (shape {shape}, strides {tuple(strides)}); make it "
                             f"C-contiguous with its own library first")
        if not isinstance(x, DeviceArray):
            self._foreign = True
        return DeviceArray._view(int(cai["data"][0]), shape, dtype, x)

    def empty(self, shape, dtype=_F64) -> DeviceArray:
        """Uninitialised device memory for a result, owned by the caller's library."""
        shape = tuple(int(s) for s in shape)
        if self.kind == "torch":
            import torch
            t = torch.empty(shape, dtype=_torch_dtype(dtype), device=self._torch_device)
            self._foreign = True
            return DeviceArray._view(t.data_ptr(), shape, dtype, t)
        if self.kind == "cupy":
            a = sys.modules["cupy"].empty(shape, dtype=dtype)
            self._foreign = True
            return DeviceArray._view(a.data.ptr, shape, dtype, a)
        return DeviceArray(shape, dtype)

    def result(self, arr: DeviceArray, widen=False):
        """A result in the caller's kind: the torch tensor / CuPy array behind it, the DeviceArray, or a
        NumPy copy (float64 with ``widen``)."""
        if self.kind in ("torch", "cupy"):
            return arr.base
        if self.kind == "device":
            return arr
        host = arr.numpy()
        return host.astype(np.float64) if widen else host

    def to_host(self, arr: DeviceArray) -> np.ndarray:
        """A NumPy copy of an operand, after other libraries' work on it is complete."""
        self._before()
        return arr.numpy()

    def from_host(self, host: np.ndarray):
        """A host (float64) result in the caller's kind: the NumPy array itself, or a device copy."""
        if self.kind == "numpy":
            return host
        dev = self.empty(host.shape)
        if host.size:
            _core.cuda_upload(dev.ptr, np.ascontiguousarray(host, dtype=np.float64).reshape(-1).view(np.uint8))
        return self.result(dev)

    def _before(self):
        """Order the kernel after other libraries' work on any stream (a device-wide barrier)."""
        if self._foreign:
            _core.cuda_synchronize()

    # -------------------------------------------------------------- emulated and golden attention

    def _queue(self) -> tuple:
        """The binding's trailing stream argument: (0,) to queue an emulated or golden kernel on the legacy default
        stream (module docstring), else () after the device-wide barrier."""
        if self._queued:
            return (0,)
        self._before()
        return ()

    def _forward(self, kernel, q, k, v, call):
        out, lse = self.empty(q.shape), self.empty(q.shape[:3])
        getattr(_core, f"cuda_{kernel}_attention")(q.ptr, k.ptr, v.ptr, out.ptr, lse.ptr, _shape(q, k), call,
                                                   *self._queue())
        return self.result(out), self.result(lse)

    def baseline_attention(self, q, k, v, call):
        return self._forward("baseline", q, k, v, call)

    def flash_attention(self, q, k, v, call):
        return self._forward("flash", q, k, v, call)

    def golden_attention(self, q, k, v, call):
        return self._forward("golden", q, k, v, call)

    def _backward(self, kernel, q, k, v, out, lse, dout, call):
        dq, dk, dv = self.empty(q.shape), self.empty(k.shape), self.empty(v.shape)
        getattr(_core, f"cuda_{kernel}_attention_backward")(q.ptr, k.ptr, v.ptr, out.ptr, lse.ptr, dout.ptr, dq.ptr,
                                                            dk.ptr, dv.ptr, _shape(q, k), call, *self._queue())
        return self.result(dq), self.result(dk), self.result(dv)

    def baseline_attention_backward(self, q, k, v, out, lse, dout, call):
        return self._backward("baseline", q, k, v, out, lse, dout, call)

    def flash_attention_backward(self, q, k, v, out, lse, dout, call):
        return self._backward("flash", q, k, v, out, lse, dout, call)

    # -------------------------------------------------------------- metrics

    def deviation(self, test, ref) -> dict:
        self._before()
        return _core.cuda_deviation(test.ptr, ref.ptr, test.size)

    def wasserstein(self, a, b, method):
        """(W1, 1): the GPU always sorts ("sort"); the value is the same exact W1 whatever ``method``."""
        self._before()
        return _core.cuda_wasserstein(a.ptr, a.size, b.ptr, b.size), 1

    def ulp_error(self, test, ref, fmt_c, host=False):
        """The ULP errors in the caller's kind, or with ``host`` as a NumPy array."""
        out = DeviceArray(test.shape) if host else self.empty(test.shape)
        self._before()
        _core.cuda_ulp_error(test.ptr, ref.ptr, test.size, fmt_c, out.ptr)
        return out.numpy() if host else self.result(out)

    # -------------------------------------------------------------- native kernels

    def _native_stream(self) -> tuple:
        """The native options' stream: PyTorch's current stream for PyTorch tensors (queued there, no
        synchronisation: fadev.torch_native's way; module docstring), else () after the device-wide barrier."""
        if self.kind == "torch":
            return (torch_stream(self.index),)
        self._before()
        return ()

    def native_forward(self, q, k, v, call, native):
        out, lse = self.empty(q.shape, q.dtype), self.empty(q.shape[:3], np.float32)
        _core.cuda_native_forward(q.ptr, k.ptr, v.ptr, out.ptr, lse.ptr, _shape(q, k), call,
                                  native + self._native_stream())
        return self.result(out, widen=True), self.result(lse, widen=True)

    def native_backward(self, q, k, v, out, lse, dout, call, native):
        dq, dk, dv = self.empty(q.shape, q.dtype), self.empty(k.shape, k.dtype), self.empty(v.shape, v.dtype)
        shape = _shape(q, k)
        workspace = self.empty((max(1, -(-_core.cuda_native_workspace(shape, call, native) // 4)),), np.float32)
        _core.cuda_native_backward(q.ptr, k.ptr, v.ptr, out.ptr, lse.ptr, dout.ptr, dq.ptr, dk.ptr, dv.ptr,
                                   workspace.ptr, shape, call, native + self._native_stream())
        return tuple(self.result(g, widen=True) for g in (dq, dk, dv))


def element_type(x) -> str:
    """The element type name of an array of any kind ("float16", "bfloat16", ...), without copying it."""
    if _torch_tensor(x):
        return str(x.dtype).replace("torch.", "")
    if isinstance(x, DeviceArray):
        return x.dtype.name
    cai = _interface(x)
    if cai is not None:
        return np.dtype(cai["typestr"]).name
    return np.asarray(x).dtype.name


__all__ = ["DeviceArray", "is_cuda_array", "resolve_device"]
