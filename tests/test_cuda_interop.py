"""fadev.cuda: device selection and its errors, DeviceArray, interop with PyTorch (and CuPy, DLPack), the
GPU paths of the attention, metric and torch-bridge APIs against the CPU, and CUDA errors as exceptions.

CPU-side tests (errors without a GPU, device strings, interface checks, the on-device dtype cast run on CPU
tensors) run everywhere. GPU tests are marked ``gpu`` and run only where fadev was built with nvcc and a
device is present (fadev.cuda_available()); their references are fadev's CPU kernels on the same values:
bit for bit for the emulated kernels and ULP errors, 1e-12 relative for the deviation statistics and W1
(sums in another order), 1e-13 normwise for the fp64 golden kernel (another operation order)."""
import numpy as np
import pytest

import fadev
import fadev.cuda as fc
import helpers
from helpers import identical_but_nan as same_bits
from fadev import Policy
from helpers import needs_gpu

try:
    import torch
except ImportError:  # the CPU-side tests need no torch
    torch = None

no_gpu = pytest.mark.skipif(fadev.cuda_available(), reason="checks the path taken when fadev has no usable GPU")
needs_torch = pytest.mark.skipif(torch is None, reason="needs torch")
needs_torch_cuda = pytest.mark.skipif(torch is None or not torch.cuda.is_available(), reason="needs torch with CUDA")

NO_GPU = r"fadev has no usable GPU: fadev was built with(out CUDA|\ CUDA, but no CUDA device is visible)"


def host(x):
    """A result of any kind as a float64 NumPy array."""
    if torch is not None and isinstance(x, torch.Tensor):
        return x.detach().cpu().to(torch.float64).numpy()
    if isinstance(x, fadev.DeviceArray):
        return x.numpy().astype(np.float64)
    return np.asarray(x, dtype=np.float64)


class FakeCudaArray:
    """An object that says it is a CUDA array (no memory behind it): enough for everything before a pointer
    is read."""

    def __init__(self, shape=(2, 3, 4), typestr="<f8", strides=None, ptr=0x7000_0000_0000):
        self.__cuda_array_interface__ = {"shape": shape, "typestr": typestr, "data": (ptr, False),
                                         "strides": strides, "version": 3}


# ---------------------------------------------------------------- device selection (everywhere)

def test_device_strings():
    q, k, v = fadev.random_qkv((2, 5, 8))
    assert fc.resolve_device(None, q, k) == "cpu" and fc.resolve_device("cpu", q) == "cpu"
    for bad in ("gpu", "cuda:", "cuda:x", "cpu:0", "CUDA", "", "cuda:-1"):
        with pytest.raises(ValueError, match=f"device must be None, 'cpu', 'cuda' or 'cuda:N', got '{bad}'"):
            fadev.flash_attention(q, k, v, "golden", device=bad)
        with pytest.raises(ValueError, match="device must be"):
            fadev.compare(q, k, device=bad)
    for bad in (0, 1.0, ["cuda"]):
        with pytest.raises(TypeError, match=r"device must be None, 'cpu', 'cuda' or 'cuda:N', got"):
            fc.resolve_device(bad, q)
    # the CPU path is unchanged by device="cpu"
    assert same_bits(fadev.flash_attention(q, k, v, "fa2:bf16", device="cpu"),
                     fadev.flash_attention(q, k, v, "fa2:bf16"))


def test_cuda_arrays_are_not_taken_to_the_cpu():
    q = FakeCudaArray()
    k, v = np.zeros((2, 3, 4)), np.zeros((2, 3, 4))
    assert fc.is_cuda_array(q) and not fc.is_cuda_array(k)
    with pytest.raises(ValueError, match="device='cpu', but q is a CUDA array"):
        fadev.baseline_attention(q, k, v, "golden", device="cpu")
    with pytest.raises(ValueError, match="device='cpu', but test, ref are CUDA arrays"):
        fadev.max_abs(q, FakeCudaArray(), device="cpu")
    with pytest.raises(ValueError, match=r"device='cpu', but arrays\[1\] is a CUDA array"):
        fc.resolve_device("cpu", k, q)


@no_gpu
def test_gpu_requested_without_gpu():
    q, k, v = fadev.random_qkv((1, 2, 5, 8))
    out, lse = fadev.baseline_attention(q, k, v, "golden", return_lse=True)
    calls = {
        "baseline_attention": lambda d: fadev.baseline_attention(q, k, v, "golden", device=d),
        "flash_attention": lambda d: fadev.flash_attention(q, k, v, "fa2:bf16", device=d),
        "golden_attention": lambda d: fadev.golden_attention(q, k, v, device=d),
        "baseline_attention_backward": lambda d: fadev.baseline_attention_backward(q, k, v, out, lse, out, "golden",
                                                                                   device=d),
        "flash_attention_backward": lambda d: fadev.flash_attention_backward(q, k, v, out, lse, out, "golden",
                                                                             device=d),
        "compare": lambda d: fadev.compare(q, q, device=d),
        "rmse": lambda d: fadev.rmse(q, q, device=d),
        "wasserstein": lambda d: fadev.wasserstein(q, k, device=d),
        "ulp_error": lambda d: fadev.ulp_error(q, q, "bf16", device=d),
    }
    for name, call in calls.items():
        for device in ("cuda", "cuda:0"):
            with pytest.raises(RuntimeError, match=f"device='{device}': {NO_GPU}.*FADEV_CUDA=1"):
                call(device)
    with pytest.raises(RuntimeError, match=f"q is a CUDA array \\(device=None\\): {NO_GPU}"):
        fadev.flash_attention(FakeCudaArray(), k, v, "golden")
    with pytest.raises(RuntimeError, match=f"DeviceArray: {NO_GPU}"):
        fadev.DeviceArray((4, 4))
    with pytest.raises(RuntimeError, match=f"device='cuda': {NO_GPU}"):
        fadev.native_attention(q, k, v, dtype="bf16")
    if not fadev.cuda_info()["compiled"]:
        with pytest.raises(RuntimeError, match=f"native_tiles: {NO_GPU}"):
            fadev.native_tiles(64)
        with pytest.raises(RuntimeError, match=r"cuda_malloc: CUDA not available \(fadev was built without CUDA\)"):
            fadev._core.cuda_malloc(8)


def test_native_argument_errors():
    q, k, v = fadev.random_qkv((1, 2, 8, 64))
    with pytest.raises(TypeError, match="q: the native kernels read float16 or bfloat16, got float64; pass dtype="):
        fadev.native_attention(q, k, v)
    with pytest.raises(ValueError, match="dtype must be one of fp16, bf16, got 'fp8'"):
        fadev.native_attention(q, k, v, dtype="fp8")
    with pytest.raises(ValueError, match="dim must be a positive integer, got 0"):
        fadev.native_tiles(0)


def test_interface_checks():
    """What fadev.cuda refuses in a __cuda_array_interface__, before it reads any memory."""
    gpu = fc._Gpu(0, None)
    with pytest.raises(TypeError, match="q: a CUDA array of type '<f4'; this call reads '<f8'"):
        gpu.operand(FakeCudaArray(typestr="<f4"), "q")
    with pytest.raises(ValueError, match=r"k: a non-contiguous CUDA array \(shape \(2, 3, 4\), strides \(8, 64, 16\)"):
        gpu.operand(FakeCudaArray(strides=(8, 64, 16)), "k")
    assert fc._contiguous((2, 3, 4), (96, 32, 8), 8) and fc._contiguous((2, 1, 4), (32, 0, 8), 8)
    assert not fc._contiguous((2, 3, 4), (8, 16, 48), 8)


@needs_torch
def test_device_cast_rounds_once():
    """fadev.torch casts CUDA results to float16/bfloat16 through float32 rounded toward odd: the same bits as
    the CPU bridge's single rounding. The cast is plain torch, so it is checked here on CPU tensors, on values
    just off the ties of each dtype (where rounding twice through float32 goes wrong) and at its edges."""
    import fadev.torch as ft
    rng = np.random.default_rng(7)
    for dtype, fmt in ((torch.bfloat16, "bf16"), (torch.float16, "fp16")):
        f = fadev.formats[fmt]
        x = fadev.round(rng.standard_normal(20000) * np.exp2(rng.integers(-30, 20, 20000)), fmt)
        x = x[np.isfinite(x)]
        half = np.abs(x) * f.unit_roundoff  # half an ulp above x: a tie between x and its neighbour
        nudge = np.abs(x) * 2.0**-40  # far below float32's resolution
        values = np.concatenate([x + half + nudge, x + half - nudge, x + half, x - half + nudge,
                                 rng.standard_normal(20000),
                                 [0.0, -0.0, np.inf, -np.inf, np.nan, f.largest * (1 + f.unit_roundoff),
                                  f.largest * (1 + f.unit_roundoff) * (1 - 2.0**-40), 2.0**-140, -2.0**-30, 1e300]])
        got = ft._cast_on_device(torch.from_numpy(values), dtype)
        want = ft._to_dtype(values, dtype)
        assert same_bits(host(got), host(want)), fmt
        assert not same_bits(host(torch.from_numpy(values).to(dtype)), host(want))  # torch's cast rounds twice


def test_device_cast_of_values_already_in_the_dtype():
    """A CUDA result whose policy stage has only values of the target dtype (fa2(bf16)'s output and gradients into
    bfloat16) is cast by torch's one cast: the same bits as the round-to-odd sequence, because nothing rounds. A
    stage with values outside the dtype takes the sequence. Checked on CPU tensors, as above."""
    import fadev.torch as ft
    from fadev.torch_tensors import values_within
    fmts = fadev.formats
    assert values_within(fmts["bf16"], torch.bfloat16) and values_within(fmts["bf16"], torch.float32)
    assert values_within(fmts["fp16"], torch.float32) and values_within(fmts["fp8_e4m3"], torch.bfloat16)
    assert values_within(fmts["fp8_e4m3"], torch.float16) and values_within(fmts["fp32"], torch.float64)
    assert not values_within(fmts["bf16"], torch.float16)  # range: 2^127 is no float16
    assert not values_within(fmts["fp16"], torch.bfloat16)  # 11 bits; and 2^-24 is a bfloat16, 1 + 2^-10 is not
    assert not values_within(fmts["fp32"], torch.bfloat16) and not values_within(fmts["fp64"], torch.float32)
    rng = np.random.default_rng(8)
    for dtype, fmt in ((torch.bfloat16, "bf16"), (torch.float16, "fp16"), (torch.bfloat16, "fp8_e4m3")):
        f = fmts[fmt]
        x = fadev.round(rng.standard_normal(20000) * np.exp2(rng.integers(-40, 20, 20000)), fmt)
        x = np.concatenate([x, [0.0, -0.0, np.inf, -np.inf, np.nan, f.largest, -f.smallest_subnormal]])
        got = ft._to_dtype(torch.from_numpy(x), dtype, f)
        assert same_bits(host(got), host(ft._cast_on_device(torch.from_numpy(x), dtype))), fmt
    # fp64 values just off bfloat16's ties, where torch's cast (through float32) rounds twice: the stage (fp64) says
    # they may not be bfloat16 values, so the round-to-odd sequence must be taken
    x = fadev.round(rng.standard_normal(1000), "bf16")
    wide = x + np.abs(x) * fmts["bf16"].unit_roundoff * (1 + 2.0**-30)
    want = ft._to_dtype(wide, torch.bfloat16)
    assert same_bits(host(ft._to_dtype(torch.from_numpy(wide), torch.bfloat16, fmts["fp64"])), host(want))
    assert not same_bits(host(torch.from_numpy(wide).to(torch.bfloat16)), host(want))  # the one cast would be wrong


# ---------------------------------------------------------------- DeviceArray and interop (GPU)

@pytest.mark.gpu
@needs_gpu
def test_device_array_round_trip():
    import ml_dtypes
    rng = np.random.default_rng(1)
    for arr in (rng.standard_normal((3, 5, 7)), rng.standard_normal(11).astype(np.float32),
                rng.integers(0, 255, (4, 4), dtype=np.uint8), np.float64(2.5) * np.ones(()),
                rng.standard_normal((6, 2)).astype(ml_dtypes.bfloat16), np.zeros((0, 3))):
        dev = fadev.DeviceArray.from_numpy(arr)
        assert dev.shape == arr.shape and dev.dtype == arr.dtype and dev.nbytes == arr.nbytes
        back = dev.numpy()
        assert back.dtype == arr.dtype and back.shape == arr.shape
        assert np.array_equal(back.reshape(-1).view(np.uint8), arr.reshape(-1).view(np.uint8))
        cai = dev.__cuda_array_interface__
        assert cai["version"] == 3 and cai["data"] == (dev.ptr, False) and cai["typestr"] == arr.dtype.str
        dev.close()
        dev.close()
        with pytest.raises(ValueError, match="closed"):
            dev.numpy()
    dev = fadev.DeviceArray.from_numpy(np.arange(24.0))
    view = dev.reshape(2, -1, 4)
    del dev  # the view keeps the memory alive
    assert view.shape == (2, 3, 4) and np.array_equal(view.numpy(), np.arange(24.0).reshape(2, 3, 4))
    with pytest.raises(ValueError, match="cannot reshape"):
        view.reshape(5, 5)
    assert fadev._core.cuda_pointer_device(view.ptr) == 0


@pytest.mark.gpu
@needs_gpu
def test_out_of_memory_is_a_memory_error():
    with pytest.raises(MemoryError, match="out of memory"):
        fadev.DeviceArray((1 << 47,), np.float64)  # 2^50 bytes
    x = np.arange(10.0)  # the process and the device carry on
    assert np.array_equal(fadev.DeviceArray.from_numpy(x).numpy(), x)
    assert fadev.max_abs(x, x + 1, device="cuda") == 1.0


@pytest.mark.gpu
@needs_gpu
def test_host_memory_is_not_taken_for_device_memory():
    q, k, v = fadev.random_qkv((1, 2, 4, 8))
    fake = FakeCudaArray(shape=q.shape, ptr=q.ctypes.data)
    with pytest.raises(ValueError, match="q: the array is in host memory, but the call runs on cuda:0"):
        fadev.flash_attention(fake, k, v, "golden")
    with pytest.raises(ValueError, match="fadev sees 1 CUDA device|make cuda:1 current first"):
        fadev.flash_attention(q, k, v, "golden", device="cuda:1")
    # a NULL pointer reaches the C entry point, which refuses it: its status becomes a ValueError
    shape = (1, 1, 1, 2, 2, 4)  # B, H, Hkv, Nq, Nk, D
    call = (Policy.golden()._c, None, None, 0.5, False, 0, 0, 0, 0, 0)  # fadev._args.Call.c
    with pytest.raises(ValueError, match=r"baseline_attention \(cuda\): invalid argument"):
        fadev._core.cuda_baseline_attention(0, 0, 0, 0, 0, shape, call)


@pytest.mark.gpu
@needs_gpu
@needs_torch_cuda
def test_cuda_array_interface_is_consumed_by_torch():
    x = np.random.default_rng(2).standard_normal((4, 6))
    dev = fadev.DeviceArray.from_numpy(x)
    t = torch.as_tensor(dev, device="cuda")
    assert t.data_ptr() == dev.ptr and t.dtype == torch.float64 and tuple(t.shape) == x.shape
    t.mul_(2)  # the same memory
    torch.cuda.synchronize()
    assert np.array_equal(dev.numpy(), 2 * x)
    del dev  # torch keeps the DeviceArray alive
    assert np.array_equal(t.cpu().numpy(), 2 * x)


# ---------------------------------------------------------------- the API on the GPU against the CPU

SHAPE, HEADS_KV, SEQ_KV = (2, 4, 37, 16), 2, 45
FORWARDS = [  # kernel, policy, tiling, causal (golden's fp64 exp/log: tests/test_cuda_emulated.py, to ulps)
    ("baseline", "naive:fp16", {}, False),
    ("baseline", "naive:bf16", {}, True),
    ("flash", "fa2:bf16", {}, True),
    ("flash", "fa2:fp16", dict(block_q=5, block_kv=7, exp="exp"), False),
    ("flash", "fa1:bf16", dict(block_q=8, block_kv=4, loop_order="kv_outer", normalize="eager"), True),
    ("flash", Policy.fa2("bf16").replace(rounding="stochastic", seed=5), dict(block_q=16, block_kv=8), False),
]


def qkv(seed=3):
    return fadev.random_qkv(SHAPE, seed=seed, heads_kv=HEADS_KV, seq_kv=SEQ_KV)


def run_forward(kernel, policy, tiling, causal, q, k, v, **kw):
    if kernel == "flash":
        return fadev.flash_attention(q, k, v, policy, causal=causal, return_lse=True, **tiling, **kw)
    return fadev.baseline_attention(q, k, v, policy, causal=causal, return_lse=True, **kw)


def run_backward(kernel, policy, tiling, causal, q, k, v, out, lse, dout, **kw):
    if kernel == "flash":
        tiling = {n: tiling[n] for n in ("block_q", "block_kv", "exp") if n in tiling}
        return fadev.flash_attention_backward(q, k, v, out, lse, dout, policy, causal=causal, **tiling, **kw)
    return fadev.baseline_attention_backward(q, k, v, out, lse, dout, policy, causal=causal, **kw)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("kernel,policy,tiling,causal", FORWARDS)
def test_numpy_in_numpy_out_bits_equal_cpu(kernel, policy, tiling, causal):
    q, k, v = qkv()
    dout = np.random.default_rng(4).standard_normal(q.shape)
    out, lse = run_forward(kernel, policy, tiling, causal, q, k, v)
    gout, glse = run_forward(kernel, policy, tiling, causal, q, k, v, device="cuda")
    assert isinstance(gout, np.ndarray) and same_bits(gout, out) and same_bits(glse, lse), vars()
    grads = run_backward(kernel, policy, tiling, causal, q, k, v, out, lse, dout)
    ggrads = run_backward(kernel, policy, tiling, causal, q, k, v, out, lse, dout, device="cuda")
    for name, g, gg in zip("qkv", grads, ggrads):
        assert isinstance(gg, np.ndarray) and same_bits(gg, g), (name, vars())
    # 2-D and 3-D inputs keep their rank
    q3, k3, v3 = q[0], k[0], v[0]
    assert same_bits(run_forward(kernel, policy, tiling, causal, q3, k3, v3, device="cuda")[0],
                     run_forward(kernel, policy, tiling, causal, q3, k3, v3)[0])


@pytest.mark.gpu
@needs_gpu
def test_device_array_in_device_array_out():
    q, k, v = qkv(5)
    dq, dk, dv = (fadev.DeviceArray.from_numpy(x) for x in (q, k, v))
    out, lse = fadev.flash_attention(dq, dk, dv, "fa2:bf16", return_lse=True)
    assert isinstance(out, fadev.DeviceArray) and out.shape == q.shape and lse.shape == q.shape[:3]
    ref, ref_lse = fadev.flash_attention(q, k, v, "fa2:bf16", return_lse=True)
    assert same_bits(out.numpy(), ref) and same_bits(lse.numpy(), ref_lse)
    with pytest.raises(TypeError, match="q: a DeviceArray of dtype float32; this call reads float64"):
        fadev.flash_attention(fadev.DeviceArray.from_numpy(q.astype(np.float32)), dk, dv, "golden")


@pytest.mark.gpu
@needs_gpu
@needs_torch_cuda
@pytest.mark.parametrize("kernel,policy,tiling,causal", FORWARDS[:4])
def test_torch_in_torch_out_bits_equal_cpu(kernel, policy, tiling, causal):
    q, k, v = qkv(6)
    dout = np.random.default_rng(7).standard_normal(q.shape)
    out, lse = run_forward(kernel, policy, tiling, causal, q, k, v)
    grads = run_backward(kernel, policy, tiling, causal, q, k, v, out, lse, dout)
    tq, tk, tv, tdout = (torch.from_numpy(x).cuda() for x in (q, k, v, dout))
    tk = tk.transpose(2, 3).contiguous().transpose(2, 3)  # non-contiguous: converted by torch on the device
    gout, glse = run_forward(kernel, policy, tiling, causal, tq, tk, tv)
    assert isinstance(gout, torch.Tensor) and gout.device == tq.device and gout.dtype == torch.float64
    assert same_bits(host(gout), out) and same_bits(host(glse), lse)
    ggrads = run_backward(kernel, policy, tiling, causal, tq, tk, tv, gout, glse, tdout)
    assert all(isinstance(g, torch.Tensor) and g.is_cuda for g in ggrads)
    assert all(same_bits(host(gg), g) for gg, g in zip(ggrads, grads))
    # float32 inputs are converted to float64 on the device: the CPU result of the float32 values
    q32 = tq.float()
    assert same_bits(host(run_forward(kernel, policy, tiling, causal, q32, tk, tv)[0]),
                     run_forward(kernel, policy, tiling, causal, q.astype(np.float32), k, v)[0])


@pytest.mark.gpu
@needs_gpu
@needs_torch_cuda
def test_dlpack_and_side_streams():
    class DLPackOnly:  # a CUDA array seen through DLPack alone
        def __init__(self, t):
            self.t = t

        def __dlpack__(self, **kw):
            return self.t.__dlpack__(**kw)

        def __dlpack_device__(self):
            return self.t.__dlpack_device__()

    q, k, v = qkv(8)
    ref = fadev.flash_attention(q, k, v, "fa2:bf16")
    tq, tk, tv = (torch.from_numpy(x).cuda() for x in (q, k, v))
    out = fadev.flash_attention(DLPackOnly(tq), DLPackOnly(tk), DLPackOnly(tv), "fa2:bf16")
    assert isinstance(out, fadev.DeviceArray) and same_bits(out.numpy(), ref)
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):  # inputs written on another stream, converted there: fadev waits for them
        sq = (tq.float() * 1).to(torch.float64)
        out = fadev.flash_attention(sq, tk, tv, "fa2:bf16")
    side.synchronize()
    assert same_bits(host(out), ref)


@pytest.mark.gpu
@needs_gpu
def test_cupy_in_cupy_out():
    cupy = pytest.importorskip("cupy")
    q, k, v = qkv(8)
    ref = fadev.flash_attention(q, k, v, "fa2:bf16")
    out = fadev.flash_attention(cupy.asarray(q), cupy.asarray(k), cupy.asarray(v).astype(cupy.float32), "fa2:bf16")
    assert isinstance(out, cupy.ndarray) and same_bits(cupy.asnumpy(out), fadev.flash_attention(
        q, k, v.astype(np.float32), "fa2:bf16"))  # the float32 array converted by CuPy on the device
    assert same_bits(cupy.asnumpy(fadev.flash_attention(*map(cupy.asarray, (q, k, v)), "fa2:bf16")), ref)


@pytest.mark.gpu
@needs_gpu
def test_golden_attention_gpu_within_fp64_of_cpu():
    for causal in (False, True):
        q, k, v = fadev.random_qkv((2, 4, 70, 64), seed=9, heads_kv=2, seq_kv=90, dist="outlier")
        out, lse = fadev.golden_attention(q, k, v, causal=causal, return_lse=True)
        ref, ref_lse = fadev.baseline_attention(q, k, v, "golden", causal=causal, return_lse=True)
        assert same_bits(out, ref) and same_bits(lse, ref_lse)  # the CPU golden is the golden policy
        gout, glse = fadev.golden_attention(q, k, v, causal=causal, return_lse=True, device="cuda")
        assert np.max(np.abs(gout - ref)) <= 1e-13 * np.max(np.abs(ref))
        assert np.max(np.abs(glse - ref_lse)) <= 1e-13 * np.max(np.abs(ref_lse))


def close(a, b, rel=1e-12, scale=None):
    if np.isnan(a) or np.isnan(b):
        return np.isnan(a) and np.isnan(b)
    if np.isinf(a) or np.isinf(b):
        return a == b
    return abs(a - b) <= rel * (abs(b) if scale is None else scale)


@pytest.mark.gpu
@needs_gpu
def test_metrics_on_device_equal_cpu():
    rng = np.random.default_rng(10)
    ref = rng.standard_normal((3, 70001))
    test = fadev.round(ref, "bf16")
    odd = test.copy()
    odd[0, :3], odd[1, 5], ref_odd = np.nan, np.inf, ref.copy()
    ref_odd[2, 7] = 0.0
    for t, r in ((test, ref), (odd, ref_odd), (test[:, :50], ref[:, :50])):
        cpu, gpu = fadev.compare(t, r), fadev.compare(t, r, device="cuda")
        assert (gpu.n, gpu.n_nan, gpu.n_inf) == (cpu.n, cpu.n_nan, cpu.n_inf)
        for name in ("max_abs", "std_diff", "mean_abs", "rmse", "rel_l2", "max_rel", "wasserstein"):
            assert close(getattr(gpu, name), getattr(cpu, name)), (name, getattr(gpu, name), getattr(cpu, name))
        assert close(gpu.mean_diff, cpu.mean_diff, scale=cpu.mean_abs), (gpu.mean_diff, cpu.mean_diff)
        assert close(fadev.rmse(t, r, device="cuda"), cpu.rmse)
        assert same_bits(fadev.ulp_error(t, r, "bf16", device="cuda"), fadev.ulp_error(t, r, "bf16"))
    a, b = rng.standard_normal(1001), rng.standard_normal((7, 13)) * 2  # sizes and shapes may differ
    assert close(fadev.wasserstein(a, b, device="cuda"), fadev.wasserstein(a, b))
    with pytest.raises(ValueError, match="test and ref must have the same shape"):
        fadev.compare(a, a[:5], device="cuda")


@pytest.mark.gpu
@needs_gpu
@needs_torch_cuda
def test_metrics_take_torch_tensors():
    rng = np.random.default_rng(11)
    ref = rng.standard_normal((4, 999))
    test = fadev.round(ref, "fp16")
    t, r = torch.from_numpy(test).cuda().float(), torch.from_numpy(ref).cuda()  # float32: converted on the device
    ulp = fadev.ulp_error(t, r, "fp16")
    assert isinstance(ulp, torch.Tensor) and ulp.is_cuda
    assert same_bits(host(ulp), fadev.ulp_error(test.astype(np.float32), ref, "fp16"))
    assert close(fadev.max_rel(t, r), fadev.max_rel(test, ref))


# ---------------------------------------------------------------- fadev.torch on CUDA tensors

@pytest.mark.gpu
@needs_gpu
@needs_torch_cuda
@pytest.mark.parametrize("dtype,policy", [("float64", "fa2:bf16"), ("float32", "golden"), ("bfloat16", "golden"),
                                          ("float16", "fa2:fp16")])
def test_torch_bridge_on_cuda_equals_cpu_bridge(dtype, policy):
    import torch.nn.functional as F

    import fadev.torch as ft
    dtype = getattr(torch, dtype)
    arrays = fadev.random_qkv((2, 4, 24, 16), seed=12, heads_kv=2)
    dout = torch.from_numpy(np.random.default_rng(13).standard_normal((2, 4, 24, 16))).to(dtype)
    results = {}
    for device in ("cpu", "cuda"):
        q, k, v = (torch.from_numpy(a).to(dtype).to(device).requires_grad_() for a in arrays)
        out = ft.attention(q, k, v, policy, is_causal=True, enable_gqa=True, block_q=8, block_kv=4)
        out.backward(dout.to(device))
        with ft.patch_sdpa(policy, kernel="baseline") as patch:
            q2 = q.detach().requires_grad_()
            sdpa = F.scaled_dot_product_attention(q2, k.detach(), v.detach(), enable_gqa=True)
            sdpa.backward(dout.to(device))
        assert patch.calls == 1 and out.device.type == device and out.dtype == dtype
        results[device] = [host(x) for x in (out, q.grad, k.grad, v.grad, sdpa, q2.grad)]
    for name, a, b in zip(("out", "dq", "dk", "dv", "sdpa", "sdpa dq"), results["cuda"], results["cpu"]):
        assert same_bits(a, b), name


@pytest.mark.gpu
@needs_gpu
@needs_torch_cuda
def test_shadow_on_cuda():
    import torch.nn.functional as F

    import fadev.torch as ft
    arrays = fadev.random_qkv((1, 2, 20, 8), seed=14)
    records = {}
    for device in ("cpu", "cuda"):
        q, k, v = (torch.from_numpy(a).to(device) for a in arrays)
        with ft.shadow("golden", "fa2:bf16", golden=True) as log:
            F.scaled_dot_product_attention(q, k, v, is_causal=True)
        records[device] = log.records[0]
    cpu, gpu = records["cpu"], records["cuda"]
    assert gpu.keys() == cpu.keys() and gpu["n"] == cpu["n"]
    for key in ("max_abs", "rmse", "wasserstein", "candidate_vs_golden_max_abs"):
        assert close(gpu[key], cpu[key]), key


# ---------------------------------------------------------------- native kernels' interop

@pytest.mark.gpu
@needs_gpu
def test_native_numpy_and_torch_agree():
    tiles = fadev.native_tiles(64)
    assert tiles and all(len(t) == 2 for t in tiles) and fadev.native_tiles(48) == []
    q, k, v = fadev.random_qkv((1, 2, 128, 64), seed=15, fmt="bf16")
    dout = fadev.round(np.random.default_rng(16).standard_normal(q.shape), "bf16")
    out, lse = fadev.native_attention(q, k, v, causal=True, return_lse=True, dtype="bf16")
    assert out.dtype == np.float64 and lse.dtype == np.float64 and same_bits(out, fadev.round(out, "bf16"))
    grads = fadev.native_attention_backward(q, k, v, out, lse, dout, causal=True, dtype="bf16")
    assert [g.shape for g in grads] == [q.shape, k.shape, v.shape]
    with pytest.raises(ValueError, match=r"block_q, block_kv: \(3, None\) is not a native forward tile for head dim 64; supported"):
        fadev.native_attention(q, k, v, block_q=3, dtype="bf16")
    with pytest.raises(ValueError, match="the native kernels do not support head dim 48"):
        fadev.native_attention(q[..., :48], k[..., :48], v[..., :48], dtype="bf16")
    if torch is None or not torch.cuda.is_available():
        return
    tq, tk, tv, tdout = (torch.from_numpy(x).to(torch.bfloat16).cuda() for x in (q, k, v, dout))
    tout, tlse = fadev.native_attention(tq, tk, tv, causal=True, return_lse=True)
    assert tout.dtype == torch.bfloat16 and tlse.dtype == torch.float32 and tout.is_cuda
    assert same_bits(host(tout), out) and same_bits(host(tlse), lse)
    tgrads = fadev.native_attention_backward(tq, tk, tv, tout, tlse, tdout, causal=True)
    assert all(same_bits(host(a), b) for a, b in zip(tgrads, grads))
    with pytest.raises(TypeError, match="k: a tensor of dtype torch.float16; this call reads torch.bfloat16"):
        fadev.native_attention(tq, tk.half(), tv)


@pytest.mark.gpu
@needs_gpu
def test_the_current_device_is_where_fadev_runs():
    """With two GPUs: tensors on cuda:1 under torch.cuda.device(1) run there (one process per GPU does this)
    and give cuda:0's bits; cuda:1 tensors while cuda:0 is current are refused with the way out named."""
    torch = pytest.importorskip("torch")
    if torch.cuda.device_count() < 2:
        pytest.skip(f"needs 2 GPUs, PyTorch sees {torch.cuda.device_count()}")
    q, k, v = fadev.random_qkv((1, 2, 64, 64), seed=4)
    want = fadev.flash_attention(*(torch.tensor(x, device="cuda:0") for x in (q, k, v)), "fa2:bf16")
    on1 = [torch.tensor(x, device="cuda:1") for x in (q, k, v)]
    with pytest.raises(ValueError, match=r"q: the array is in memory of cuda:1, .*torch.cuda.set_device\(1\)"):
        fadev.flash_attention(*on1, "fa2:bf16")
    with torch.cuda.device(1):
        got = fadev.flash_attention(*on1, "fa2:bf16")
        assert fadev.cuda.resolve_device(None, on1[0]) == "cuda:1"
        x = fadev.native_attention(*(t.to(torch.bfloat16) for t in on1))
    assert got.device == torch.device("cuda:1") and x.device == torch.device("cuda:1")
    assert torch.equal(got.cpu(), want.cpu())
