"""The native kernels on strided tensors (fadev_native_params.strides, fadev.torch_native.layout): a model's
(B, N, H, D) projections seen as (B, H, N, D), slices of a fused QKV projection, rows padded apart, and the incoming
gradient in the model's layout are read in place, and the output and gradients are written in the inputs' layouts --
with the bits of the same call on contiguous copies, every kernel (mma.sync and, on Hopper, wgmma; forward, the
dK/dV kernels, both dq passes, the atomic dq and the Dvec kernel). Strides the kernels cannot take are refused by
the binding with a message naming them. GPU-only; skipped without a CUDA device.
"""
import pytest

import fadev

torch = pytest.importorskip("torch")

from test_cuda_native import _inputs, needs_gpu  # noqa: E402

pytestmark = [pytest.mark.gpu, needs_gpu]


def _hopper():
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


MMAS = ["sync", "wgmma"] if _hopper() else ["sync"]


def _model(t):
    """t's values as a (B, H, N, D) view of a (B, N, H, D) tensor (how a transformers model hands them over)."""
    return t.transpose(1, 2).contiguous().transpose(1, 2)


def _fused(q, k, v):
    """q, k, v as views of one (B, N, H + 2 Hkv, D) projection (a fused QKV linear layer's output)."""
    h, hkv = q.shape[1], k.shape[1]
    qkv = torch.cat([t.transpose(1, 2) for t in (q, k, v)], dim=2).contiguous()
    return (qkv[:, :, :h].transpose(1, 2), qkv[:, :, h:h + hkv].transpose(1, 2), qkv[:, :, h + hkv:].transpose(1, 2))


def _padded(t):
    """t's values with its rows 8 elements further apart than D (a wider buffer, sliced)."""
    wide = torch.zeros(*t.shape[:3], t.shape[3] + 8, dtype=t.dtype, device=t.device)
    wide[..., :t.shape[3]] = t
    return wide[..., :t.shape[3]]


def _run(q, k, v, dout, **kw):
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    out = fadev.torch_native.native_attention(*leaves, enable_gqa=q.shape[1] != k.shape[1], **kw)
    out.backward(dout)
    return out, [t.grad for t in leaves], leaves


@pytest.mark.parametrize("dim", [64, 128])
@pytest.mark.parametrize("mma", MMAS)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("layout", ["model", "fused", "padded"])
def test_strided_inputs_give_the_contiguous_bits(dim, mma, causal, layout):
    """Forward and deterministic backward on strided q, k, v and dout: the contiguous call's bits; out and the
    gradients in the inputs' layouts (no copy of a dense input: the binding got its own memory)."""
    q, k, v, dout = _inputs((2, 8, 4, 200, 200), dim, torch.bfloat16, "layout", causal)
    kw = dict(is_causal=causal, mma=mma, backward_mma=mma)
    want, want_grads, _ = _run(q, k, v, dout, **kw)
    views = {"model": lambda: [_model(t) for t in (q, k, v)], "fused": lambda: list(_fused(q, k, v)),
             "padded": lambda: [_padded(t) for t in (q, k, v)]}[layout]()
    assert all(fadev.torch_native.layout(t) is not None and not t.is_contiguous() for t in views)
    got, grads, leaves = _run(*views, _model(dout) if layout != "padded" else _padded(dout), **kw)
    assert torch.equal(got, want), f"out bits differ [{layout} D={dim} {mma} causal={causal}]"
    for name, g, w in zip(("dq", "dk", "dv"), grads, want_grads):
        assert torch.equal(g, w), f"{name} bits differ [{layout} D={dim} {mma} causal={causal}]"
    if layout == "model":  # dense: the results follow the inputs' strides, which the model's views then take as is
        assert got.stride() == views[0].stride() and got.transpose(1, 2).is_contiguous()
        assert all(g.stride() == t.stride() for g, t in zip(grads, leaves))


@pytest.mark.parametrize("mma", MMAS)
def test_strided_atomic_dq(mma):
    """The atomic backward (dq from the fp32 workspace through the rounding kernel, into dq's strides): dk and dv
    bits as the contiguous call's. dq's atomic sums land in any order, so its bits move from run to run; measured
    against the deterministic dq (the same sums in key order), the strided call's largest deviation is at most twice
    the contiguous atomic call's, or one bf16 spacing at dq's largest magnitude where that deviation is smaller (the
    most one reordering can move a rounded value there). A dq written to the wrong rows or heads misses that by
    orders of magnitude."""
    q, k, v, dout = _inputs((2, 8, 4, 300, 300), 64, torch.bfloat16, "layout-atomic")
    kw = dict(is_causal=True, mma=mma, backward_mma=mma, deterministic=False)
    _, want_grads, _ = _run(q, k, v, dout, **kw)
    _, grads, leaves = _run(*(_model(t) for t in (q, k, v)), _model(dout), **kw)
    assert torch.equal(grads[1], want_grads[1]) and torch.equal(grads[2], want_grads[2])
    _, exact, _ = _run(q, k, v, dout, **dict(kw, deterministic=True))
    ref = exact[0].float()
    spacing = torch.finfo(torch.bfloat16).eps * 2.0 ** torch.floor(torch.log2(ref.abs().max())).item()
    baseline = (want_grads[0].float() - ref).abs().max().item()
    deviation = (grads[0].float() - ref).abs().max().item()
    assert deviation <= 2 * max(baseline, spacing), f"strided atomic dq {deviation:.3e}, contiguous {baseline:.3e}"
    assert grads[0].stride() == leaves[0].stride()


def test_binding_refuses_unreadable_strides():
    """Strides that are not multiples of 8 elements are an invalid argument (ValueError), strides that reach past
    2^62 elements an overflow (MemoryError), before anything runs; readable ones run."""
    from fadev import _args, _core
    q, k, v, _ = _inputs((1, 2, 2, 64, 64), 64, torch.bfloat16, "layout-refuse")
    out, lse = torch.empty_like(q), torch.empty(q.shape[:3], device="cuda")
    call, shape = _args.Call(None, 0.125, False, 64, 64).c, (1, 2, 2, 64, 64, 64)
    ok = (2 * 64 * 64, 64 * 64, 64)
    ptrs = (q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), lse.data_ptr())
    _core.cuda_native_forward(*ptrs, shape, call, (1, False, 16, 0, 0, ok * 4))
    torch.cuda.synchronize()
    assert torch.equal(out, fadev.torch_native.native_attention(q, k, v))
    with pytest.raises(ValueError, match="invalid argument"):
        _core.cuda_native_forward(*ptrs, shape, call, (1, False, 16, 0, 0, ok * 3 + (2 * 64 * 64, 64 * 64, 68)))
    with pytest.raises(MemoryError):
        _core.cuda_native_forward(*ptrs, (2 ** 20,) + shape[1:], call, (1, False, 16, 0, 0, (2 ** 47, 0, 64) + ok * 3))
