"""The emulated kernels and the golden forward queued on PyTorch's default stream (fadev.cuda's module docstring,
"Streams"): with PyTorch CUDA tensors on the legacy default stream, fadev's calls neither synchronise before nor
after; the results are the synchronous path's bits (NumPy inputs, device="cuda"), also when PyTorch's work on the
inputs and on the results is still queued around them, and also on a side stream (which takes the synchronous path).
The native kernels queue on PyTorch's current stream, side streams included, with the same checks.

Skipped without a CUDA device, as in CI.
"""
import pytest

import fadev
import helpers
from fadev.policy import Policy
from helpers import make_qkv, needs_gpu

torch = pytest.importorskip("torch")
pytestmark = [pytest.mark.gpu, needs_gpu]


def synchronous(kind, q, k, v, dout, pol, causal):
    fwd = fadev.flash_attention if kind == "flash" else fadev.baseline_attention
    bwd = fadev.flash_attention_backward if kind == "flash" else fadev.baseline_attention_backward
    out, lse = fwd(q, k, v, pol, causal=causal, return_lse=True, device="cuda")
    return (out, lse) + tuple(bwd(q, k, v, out, lse, dout, pol, causal=causal, device="cuda"))


def queued(kind, q, k, v, dout, pol, causal):
    """The same calls on CUDA tensors, each input made by a queued PyTorch kernel just before (a long matmul first,
    so the GPU is still busy when fadev's launches are queued) and each result read after PyTorch work on it."""
    fwd = fadev.flash_attention if kind == "flash" else fadev.baseline_attention
    bwd = fadev.flash_attention_backward if kind == "flash" else fadev.baseline_attention_backward
    busy = torch.randn(4096, 4096, device="cuda")
    for _ in range(4):
        busy = busy @ busy / 64.0
    tq, tk, tv, td = (torch.from_numpy(x).cuda() * (busy[0, 0] * 0 + 1) for x in (q, k, v, dout))
    out, lse = fwd(tq, tk, tv, pol, causal=causal, return_lse=True)
    grads = bwd(tq, tk, tv, out, lse, td, pol, causal=causal)
    return tuple((t + 0.0).cpu().numpy() for t in (out, lse) + tuple(grads))


@pytest.mark.parametrize("kind", ["flash", "baseline"])
@pytest.mark.parametrize("preset", ["fa2", "paper", "naive"])
def test_queued_is_synchronous(kind, preset):
    q, k, v = make_qkv(41, 2, 4, 2, 130, 130, 64, spread=2.0)
    dout = make_qkv(42, 2, 4, 4, 130, 130, 64)[0]
    pol = Policy.preset(preset, "bf16")
    want = synchronous(kind, q, k, v, dout, pol, True)
    got = queued(kind, q, k, v, dout, pol, True)
    for name, g, w in zip(("out", "lse", "dq", "dk", "dv"), got, want):
        helpers.assert_same_bits(g, w, name, f"{kind} {preset}", nan="any", names=("queued", "synchronous"))


def test_side_stream_is_synchronous():
    q, k, v = make_qkv(43, 1, 2, 2, 96, 96, 32)
    dout = make_qkv(44, 1, 2, 2, 96, 96, 32)[0]
    pol = Policy.fa2("bf16")
    want = synchronous("flash", q, k, v, dout, pol, False)
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        got = queued("flash", q, k, v, dout, pol, False)
    for name, g, w in zip(("out", "lse", "dq", "dk", "dv"), got, want):
        helpers.assert_same_bits(g, w, name, "side stream", nan="any", names=("side stream", "synchronous"))


def test_binding_stream_must_be_legacy():
    q = torch.zeros(1, 1, 4, 8, dtype=torch.float64, device="cuda")
    out, lse = torch.empty_like(q), torch.empty(1, 1, 4, dtype=torch.float64, device="cuda")
    call = fadev._args.Call(Policy.fa2("bf16"), 0.125, False, 4, 4)
    ptrs = (q.data_ptr(), q.data_ptr(), q.data_ptr(), out.data_ptr(), lse.data_ptr())
    with pytest.raises(ValueError, match="stream must be 0"):
        fadev._core.cuda_flash_attention(*ptrs, (1, 1, 1, 4, 4, 8), call.c, 12345)
    fadev._core.cuda_flash_attention(*ptrs, (1, 1, 1, 4, 4, 8), call.c, 0)  # queued: no error
    torch.cuda.synchronize()
    assert torch.equal(out, torch.zeros_like(out))  # zero queries, keys, values: zero output


@pytest.mark.parametrize("causal", [False, True])
def test_golden_queued_is_synchronous(causal):
    """The golden fp64 forward queues too: its results on tensors made by queued PyTorch work, read after more, are the
    bits of the synchronous call (NumPy inputs, device="cuda")."""
    q, k, v = make_qkv(45, 2, 4, 2, 130, 130, 64, spread=2.0)
    want = fadev.golden_attention(q, k, v, causal=causal, return_lse=True, device="cuda")
    busy = torch.randn(4096, 4096, device="cuda")
    for _ in range(4):
        busy = busy @ busy / 64.0
    tq, tk, tv = (torch.from_numpy(x).cuda() * (busy[0, 0] * 0 + 1) for x in (q, k, v))
    got = fadev.golden_attention(tq, tk, tv, causal=causal, return_lse=True)
    for name, g, w in zip(("out", "lse"), got, want):
        helpers.assert_same_bits((g + 0.0).cpu().numpy(), w, name, f"golden causal={causal}", nan="any",
                                 names=("queued", "synchronous"))


@pytest.mark.parametrize("side", [False, True], ids=["default stream", "side stream"])
def test_native_queued_is_synchronous(side):
    """fadev.native_attention and its backward on PyTorch tensors queue on PyTorch's current stream: the call returns
    while the GPU is still busy with the matmuls queued before it (a synchronising call could not), and its results,
    read after more queued work, are the bits of the synchronous path (NumPy inputs, bf16), GQA and causal."""
    bf16 = [torch.from_numpy(x).to(torch.bfloat16) for x in make_qkv(46, 2, 4, 2, 300, 300, 64)]
    bf16.append(torch.from_numpy(make_qkv(47, 2, 4, 4, 300, 300, 64)[0]).to(torch.bfloat16))
    q, k, v, dout = (x.double().numpy() for x in bf16)  # bf16 values, exactly, for both paths
    kw = dict(causal=True, dtype="bf16")
    want_out, want_lse = fadev.native_attention(q, k, v, return_lse=True, **kw)
    want = (want_out, want_lse) + tuple(fadev.native_attention_backward(q, k, v, want_out, want_lse, dout, **kw))
    stream = torch.cuda.Stream() if side else torch.cuda.current_stream()
    with torch.cuda.stream(stream):
        tq, tk, tv, td = (x.cuda() for x in bf16)
        busy = torch.randn(4096, 4096, device="cuda")
        for _ in range(4):
            busy = busy @ busy / 64.0
        tq = tq * (busy[0, 0] * 0 + 1).to(torch.bfloat16)
        out, lse = fadev.native_attention(tq, tk, tv, causal=True, return_lse=True)
        after_forward = stream.query()
        grads = fadev.native_attention_backward(tq, tk, tv, out, lse, td, causal=True)
        after_backward = stream.query()
        got = tuple((t.double() + 0.0).cpu().numpy() for t in (out, lse) + tuple(grads))
    assert not after_forward and not after_backward, "a native call waited for the GPU"
    for name, g, w in zip(("out", "lse", "dq", "dk", "dv"), got, want):
        helpers.assert_same_bits(g, w, name, f"native side={side}", nan="any", names=("queued", "synchronous"))
