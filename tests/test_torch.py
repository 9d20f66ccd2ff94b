"""fadev.torch: the autograd op (bits equal to the NumPy API, gradcheck, dtypes, zero copies), the SDPA
patch (routing through nn.MultiheadAttention, nn.TransformerEncoderLayer and Hugging Face-style code,
golden == PyTorch in float64, training steps), shadow runs, every documented error, and that
``import fadev`` does not import torch."""
import contextlib
import math
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd import gradcheck
from torch.nn.modules import module as torch_module

import fadev
import fadev.torch as ft
import helpers
from helpers import identical as same_bits
from fadev import Policy

F64 = torch.float64
EPS = np.finfo(np.float64).eps
FMT = {torch.float64: "fp64", torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}


def tensors(shape, heads_kv=None, seq_kv=None, seed=0, dtype=F64, requires_grad=False):
    """q, k, v from fadev.random_qkv as torch tensors of ``dtype`` (values rounded to it once)."""
    if len(shape) > 4:  # no heads_kv / seq_kv: draw (B*H, N, D) and view it as ``shape``
        arrays = [a.reshape(shape) for a in fadev.random_qkv((math.prod(shape[:-2]),) + shape[-2:], seed=seed)]
    else:
        arrays = fadev.random_qkv(shape, seed=seed, heads_kv=heads_kv, seq_kv=seq_kv)
    return tuple(torch.from_numpy(a).to(dtype).requires_grad_(requires_grad) for a in arrays)


def np64(t):
    return t.detach().to(F64).numpy()


def direct(kernel, q, k, v, policy, causal=False, **tiling):
    """(out, lse) of the NumPy API on the same values, 4-D."""
    fn = fadev.flash_attention if kernel == "flash" else fadev.baseline_attention
    return fn(np64(q), np64(k), np64(v), policy, causal=causal, return_lse=True, **tiling)


def direct_backward(kernel, q, k, v, out, lse, dout, policy, causal=False, **tiling):
    if kernel == "flash":
        return fadev.flash_attention_backward(np64(q), np64(k), np64(v), out, lse, np64(dout), policy,
                                              causal=causal, **tiling)
    return fadev.baseline_attention_backward(np64(q), np64(k), np64(v), out, lse, np64(dout), policy, causal=causal)


def grads_of(model):
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def max_diff(a, b):
    if isinstance(a, dict):
        return max(max_diff(a[n], b[n]) for n in a)
    return (a.detach() - b.detach()).abs().max().item()


# ---------------------------------------------------------------- import isolation

def test_import_fadev_does_not_import_torch():
    code = ("import sys, fadev; assert 'torch' not in sys.modules, 'import fadev imported torch'; "
            "import fadev.torch; assert 'torch' in sys.modules")
    root = Path(__file__).resolve().parents[1]
    res = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr


# ---------------------------------------------------------------- the autograd op

CASES = [  # kernel, tiling, q shape, heads_kv, causal
    ("flash", dict(block_q=2, block_kv=3), (2, 4, 7, 5), 2, True),
    ("flash", dict(block_kv=4, loop_order="kv_outer", normalize="eager", exp="exp2"), (3, 6, 4), None, False),
    ("flash", dict(sram_bytes=48), (6, 3), None, True),
    ("baseline", {}, (2, 4, 7, 5), 1, True),
    ("baseline", {}, (2, 2, 3, 6, 4), None, False),  # 5-D: leading dims fold into the batch
]


@pytest.mark.parametrize("kernel,tiling,shape,heads_kv,causal", CASES)
def test_forward_and_backward_bits_equal_numpy_api(kernel, tiling, shape, heads_kv, causal):
    q, k, v = tensors(shape, heads_kv=heads_kv, seed=1, requires_grad=True)
    pol = Policy.fa2("bf16")
    out = ft.attention(q, k, v, pol, kernel=kernel, is_causal=causal, enable_gqa=heads_kv is not None, **tiling)
    dout = torch.from_numpy(np.random.default_rng(2).standard_normal(q.shape))
    out.backward(dout)
    q4, k4, v4 = (t.detach().reshape(ft._shape4(t.shape)) for t in (q, k, v))
    ref, lse = direct(kernel, q4, k4, v4, pol, causal, **tiling)
    assert same_bits(out.detach().numpy(), ref.reshape(shape)), vars()
    if "sram_bytes" in tiling:
        tiling = dict(zip(("block_q", "block_kv"), fadev.attention.sram_tiles(tiling["sram_bytes"], shape[-1])))
    tiling = {n: tiling[n] for n in ("block_q", "block_kv", "exp") if n in tiling}
    grads = direct_backward(kernel, q4, k4, v4, ref, lse, dout.reshape(q4.shape), pol, causal, **tiling)
    for t, g in zip((q, k, v), grads):
        assert same_bits(t.grad.numpy(), g.reshape(t.shape))


def test_float64_is_zero_copy_and_inputs_are_saved_as_they_are():
    q, k, v = tensors((1, 2, 8, 4), requires_grad=True)
    out = ft.attention(q, k, v, "golden")
    saved = out.grad_fn.saved_tensors
    assert [s.data_ptr() for s in saved[:4]] == [q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr()]
    q32, k32, v32 = (t.detach().float().requires_grad_() for t in (q, k, v))
    out32 = ft.attention(q32, k32, v32, "golden")
    saved = out32.grad_fn.saved_tensors  # the inputs as they are, the output as the kernel wrote it
    assert [s.data_ptr() for s in saved[:3]] == [q32.data_ptr(), k32.data_ptr(), v32.data_ptr()]
    assert saved[3].dtype == F64 and saved[3].data_ptr() != out32.data_ptr()
    # a non-contiguous float64 input (as nn.MultiheadAttention's transposed views) is copied, not misread
    qt = q.detach().transpose(-1, -2).contiguous().transpose(-1, -2)
    assert not qt.is_contiguous()
    assert same_bits(ft.attention(qt, k, v, "golden").detach(), out.detach())


def test_scratch_buffers_are_never_read_stale(monkeypatch):
    """float32 copies reuse per-thread buffers: a later call overwrites them before an earlier call's backward,
    another thread has its own, and copies too large for the pool are fresh arrays; results never change."""
    pol = Policy.fa2("bf16")

    def fresh(seed):  # (out, grads) with empty buffers
        ft.release_buffers()
        q, k, v = tensors((1, 2, 16, 8), seed=seed, dtype=torch.float32, requires_grad=True)
        out = ft.attention(q, k, v, pol, block_kv=4)
        out.backward(torch.ones_like(out))
        return out.detach(), [t.grad for t in (q, k, v)]

    want = {seed: fresh(seed) for seed in (20, 21)}
    qa, ka, va = tensors((1, 2, 16, 8), seed=20, dtype=torch.float32, requires_grad=True)
    out_a = ft.attention(qa, ka, va, pol, block_kv=4)
    qb, kb, vb = tensors((1, 2, 16, 8), seed=21, dtype=torch.float32, requires_grad=True)
    out_b = ft.attention(qb, kb, vb, pol, block_kv=4)  # overwrites the buffers out_a's forward used
    out_a.backward(torch.ones_like(out_a))
    out_b.backward(torch.ones_like(out_b))
    for (out, grads), ts in ((want[20], (out_a, qa, ka, va)), (want[21], (out_b, qb, kb, vb))):
        assert torch.equal(ts[0].detach(), out) and all(torch.equal(t.grad, g) for t, g in zip(ts[1:], grads))
    results = {}
    threads = [threading.Thread(target=lambda s=s: results.__setitem__(s, fresh(s))) for s in (20, 21)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    monkeypatch.setattr(ft, "POOL_MAX_ELEMENTS", 10)
    results["big"] = fresh(20)
    for key, seed in ((20, 20), (21, 21), ("big", 20)):
        assert torch.equal(results[key][0], want[seed][0])
        assert all(torch.equal(a, b) for a, b in zip(results[key][1], want[seed][1]))


@pytest.mark.parametrize("kernel", ft.KERNELS)
def test_golden_matches_torch_sdpa_in_float64(kernel):
    q, k, v = tensors((2, 4, 9, 8), heads_kv=2, seed=3, requires_grad=True)
    for causal in (False, True):
        out = ft.attention(q, k, v, "golden", kernel=kernel, is_causal=causal, enable_gqa=True, scale=0.3)
        ref = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True, scale=0.3)
        dout = torch.randn_like(out)
        g = torch.autograd.grad(out, (q, k, v), dout)
        g_ref = torch.autograd.grad(ref, (q, k, v), dout)
        # two fp64 computations of the same sums: a few ulps times the reduction length
        bound = 16 * 9 * EPS
        assert max_diff(out, ref) <= bound
        assert max(max_diff(a, b) for a, b in zip(g, g_ref)) <= 4 * bound


GRADCHECK = [  # kernel, tiling, q shape, heads_kv, causal
    ("flash", dict(block_q=2, block_kv=2), (1, 2, 5, 3), None, False),
    ("flash", dict(block_q=2, block_kv=2), (1, 4, 5, 3), 2, True),
    ("flash", dict(block_kv=3, exp="exp2"), (4, 3), None, True),
    ("baseline", {}, (1, 2, 5, 3), None, False),
    ("baseline", {}, (1, 4, 5, 3), 1, True),
]


@pytest.mark.parametrize("kernel,tiling,shape,heads_kv,causal", GRADCHECK)
def test_gradcheck_golden(kernel, tiling, shape, heads_kv, causal):
    q, k, v = tensors(shape, heads_kv=heads_kv, seed=4, requires_grad=True)

    def fn(q, k, v):
        return ft.attention(q, k, v, Policy.golden(), kernel=kernel, is_causal=causal,
                            enable_gqa=heads_kv is not None, **tiling)

    assert gradcheck(fn, (q, k, v))


@pytest.mark.parametrize("dtype,policy", [(torch.float32, "golden"), (torch.float32, "fa2:bf16"),
                                          (torch.float16, "golden"), (torch.float16, "fa2:fp16"),
                                          (torch.bfloat16, "golden"), (torch.bfloat16, "paper:bf16")])
def test_dtypes_round_trip(dtype, policy):
    """Output and gradients come back in the input dtype: the fp64 result rounded to it once (exact when the
    policy's out/grad format fits, e.g. fa2(bf16) in float32)."""
    q, k, v = tensors((1, 2, 12, 8), seed=5, dtype=dtype, requires_grad=True)
    out = ft.attention(q, k, v, policy, block_kv=5)
    dout = torch.from_numpy(np.random.default_rng(6).standard_normal(q.shape)).to(dtype)
    out.backward(dout)
    assert out.dtype == dtype and all(t.grad.dtype == dtype for t in (q, k, v))
    ref, lse = direct("flash", q, k, v, policy, block_kv=5)
    assert same_bits(np64(out), fadev.round(ref, FMT[dtype]))
    grads = direct_backward("flash", q, k, v, ref, lse, dout, policy, block_kv=5)
    for t, g in zip((q, k, v), grads):
        assert same_bits(np64(t.grad), fadev.round(g, FMT[dtype]))
    if policy != "golden":  # the policy's formats fit: nothing was rounded on the way out
        assert same_bits(np64(out), ref)


def test_results_are_rounded_once_to_the_dtype():
    # torch's float64 -> bfloat16/float16 casts go through float32 and round these two values down
    x = np.array([1 + 2.0**-8 + 2.0**-30, 1 + 2.0**-11 + 2.0**-40])
    assert ft._to_dtype(x, torch.bfloat16).double().tolist()[0] == 1 + 2.0**-7
    assert ft._to_dtype(x, torch.float16).double().tolist()[1] == 1 + 2.0**-10
    assert ft._to_dtype(x, torch.float32).tolist() == np.float32(x).tolist()


def test_attention_errors():
    q, k, v = tensors((1, 4, 6, 8), heads_kv=2)
    with pytest.raises(TypeError, match="query: expected a torch.Tensor, got ndarray"):
        ft.attention(q.numpy(), k, v, "golden")
    with pytest.raises(TypeError, match="key: dtype must be one of float64, float32, float16, bfloat16, got torch.int"):
        ft.attention(q, k.int(), v, "golden")
    with pytest.raises(TypeError, match="same dtype, got torch.float64, torch.float64, torch.float32"):
        ft.attention(q, k, v.float(), "golden")
    with pytest.raises(ValueError, match="same rank >= 2"):
        ft.attention(q[0, 0, 0], k[0, 0, 0], v[0, 0, 0], "golden")
    with pytest.raises(ValueError, match="same rank >= 2"):
        ft.attention(q[0], k, v, "golden")
    with pytest.raises(ValueError, match="key and value must have the same shape"):
        ft.attention(q, k, v[..., :4], "golden")
    with pytest.raises(ValueError, match="query's head dim 8 does not match key's 4"):
        ft.attention(q, k[..., :4], v[..., :4], "golden")
    with pytest.raises(ValueError, match=r"batch dims \(1,\) differ from key's \(2,\)"):
        ft.attention(q, torch.cat([k, k]), torch.cat([v, v]), "golden", enable_gqa=True)
    with pytest.raises(ValueError, match="query has 4 heads but key/value have 2; pass enable_gqa=True"):
        ft.attention(q, k, v, "golden")
    with pytest.raises(ValueError, match=r"query heads \(4\) to be a multiple of key/value heads \(3\)"):
        ft.attention(q, *tensors((1, 3, 6, 8))[1:], "golden", enable_gqa=True)
    with pytest.raises(TypeError, match="is_causal must be a bool, got 1"):
        ft.attention(q, k, v, "golden", enable_gqa=True, is_causal=1)
    with pytest.raises(ValueError, match="is_causal with 6 queries and 5 keys"):
        ft.attention(q, k[..., :5, :], v[..., :5, :], "golden", enable_gqa=True, is_causal=True)
    with pytest.raises(ValueError, match="kernel must be one of flash, baseline, got 'ring'"):
        ft.attention(q, k, v, "golden", kernel="ring")
    with pytest.raises(TypeError, match="unknown tiling argument.*block_size"):
        ft.attention(q, k, v, "golden", block_size=4)
    with pytest.raises(ValueError, match="kernel='baseline' has no tiling, got block_kv"):
        ft.attention(q, k, v, "golden", kernel="baseline", block_kv=4)
    with pytest.raises(TypeError, match="policy: expected a fadev.Policy or a preset name"):
        ft.attention(q, k, v, 3)
    with pytest.raises(ValueError, match="block_kv must be a positive integer"):
        ft.attention(q, k, v, "golden", enable_gqa=True, block_kv=0)


def test_other_devices_are_not_implemented():
    """CUDA tensors run on fadev's GPU kernels (tests/test_cuda_interop.py); other devices are refused."""
    q, k, v = tensors((1, 2, 4, 8))
    for device in ["meta"]:
        qd, kd, vd = (t.to(device) for t in (q, k, v))
        with pytest.raises(NotImplementedError, match=f"query: fadev.torch computes on CPU and CUDA tensors only, "
                                                      f"got a tensor on {device}"):
            ft.attention(qd, kd, vd, "golden")
        with pytest.raises(ft.UnsupportedSDPA, match=f"tensors on {device}"):
            with ft.patch_sdpa("golden"):
                F.scaled_dot_product_attention(qd, kd, vd)
        with ft.patch_sdpa("golden", fallback=True) as patch:
            out = F.scaled_dot_product_attention(qd, kd, vd)
        assert out.device.type == device and (patch.calls, patch.fallbacks) == (0, 1)


# ---------------------------------------------------------------- patch_sdpa

def encoder_layer(seed=0, **kw):
    torch.manual_seed(seed)
    return nn.TransformerEncoderLayer(d_model=16, nhead=2, dim_feedforward=32, dropout=0.0, batch_first=True,
                                      dtype=F64, **kw)


def forward_backward(model, x, ctx, **kw):
    model.zero_grad()
    with ctx:
        out = model(x, **kw)
        out.backward(torch.from_numpy(np.random.default_rng(7).standard_normal(out.shape)))
    return out.detach(), grads_of(model)


def test_patch_routes_transformer_encoder_layer():
    layer = encoder_layer().train()
    x = torch.from_numpy(np.random.default_rng(8).standard_normal((3, 10, 16)))
    original = F.scaled_dot_product_attention
    out_ref, g_ref = forward_backward(layer, x, contextlib.nullcontext())
    with ft.patch_sdpa(Policy.golden()) as golden:
        assert F.scaled_dot_product_attention is not original
        out, g = forward_backward(layer, x, contextlib.nullcontext())
    assert F.scaled_dot_product_attention is original
    assert golden.calls == 1 and golden.fallbacks == 0
    assert max_diff(out, out_ref) <= 1e-10 and max_diff(g, g_ref) <= 1e-10
    # a causal layer takes the is_causal path
    mask = nn.Transformer.generate_square_subsequent_mask(10, dtype=F64)
    out_ref, g_ref = forward_backward(layer, x, contextlib.nullcontext(), src_mask=mask, is_causal=True)
    out, g = forward_backward(layer, x, ft.patch_sdpa("golden"), src_mask=mask, is_causal=True)
    assert max_diff(out, out_ref) <= 1e-10 and max_diff(g, g_ref) <= 1e-10
    # proof of routing: bf16 arithmetic moves the result far beyond fp64 noise
    with ft.patch_sdpa(Policy.paper("bf16")) as low:
        out_low, g_low = forward_backward(layer, x, contextlib.nullcontext())
    assert low.calls == 1
    assert max_diff(out_low, out_ref) > 1e-4 and max_diff(g_low, g_ref) > 1e-4


def test_patch_routes_eval_fast_path_and_multihead_attention():
    layer = encoder_layer(seed=1).eval()
    x = torch.from_numpy(np.random.default_rng(9).standard_normal((2, 6, 16)))
    assert torch.backends.mha.get_fastpath_enabled()
    with torch.no_grad():
        ref = layer(x)
        with ft.patch_sdpa("golden") as patch:
            assert not torch.backends.mha.get_fastpath_enabled()
            out = layer(x)
        mha = layer.self_attn
        ref_mha = mha(x, x, x, need_weights=False)[0]
        with ft.patch_sdpa("golden") as patch_mha:
            out_mha = mha(x, x, x, need_weights=False)[0]
    assert torch.backends.mha.get_fastpath_enabled()
    assert patch.calls == 1 and patch_mha.calls == 1
    assert max_diff(out, ref) <= 1e-10 and max_diff(out_mha, ref_mha) <= 1e-10


class HFStyleAttention(nn.Module):
    """The shape of Hugging Face's sdpa attention: projections, (B, H, N, D) views, grouped K/V heads, a 4-D
    float causal mask with the dtype's minimum, a call through torch.nn.functional."""

    def __init__(self, hidden=16, heads=4, kv_heads=2):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, hidden // heads
        self.q_proj = nn.Linear(hidden, hidden, dtype=F64)
        self.k_proj = nn.Linear(hidden, kv_heads * self.head_dim, dtype=F64)
        self.v_proj = nn.Linear(hidden, kv_heads * self.head_dim, dtype=F64)
        self.o_proj = nn.Linear(hidden, hidden, dtype=F64)

    def forward(self, x, mask=None, is_causal=False):
        B, N, _ = x.shape
        q = self.q_proj(x).view(B, N, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(B, N, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(B, N, self.kv_heads, self.head_dim).transpose(1, 2)
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=0.0,
                                                               scale=self.head_dim**-0.5, is_causal=is_causal,
                                                               enable_gqa=True)
        return self.o_proj(out.transpose(1, 2).reshape(B, N, -1))


def test_patch_routes_hugging_face_style_attention():
    torch.manual_seed(2)
    attn = HFStyleAttention()
    B, N = 2, 7
    x = torch.from_numpy(np.random.default_rng(10).standard_normal((B, N, 16)))
    causal = torch.ones(N, N, dtype=torch.bool).tril()
    float_mask = torch.zeros(B, 1, N, N, dtype=F64).masked_fill(~causal, torch.finfo(F64).min)
    for kw in (dict(mask=float_mask), dict(mask=causal), dict(is_causal=True), dict(mask=torch.ones(N, N) == 1),
               dict(mask=torch.zeros(1, N, N, dtype=F64)), {}):
        out_ref, g_ref = forward_backward(attn, x, contextlib.nullcontext(), **kw)
        with ft.patch_sdpa("golden") as patch:
            out, g = forward_backward(attn, x, contextlib.nullcontext(), **kw)
        assert patch.calls == 1, kw
        assert max_diff(out, out_ref) <= 1e-10 and max_diff(g, g_ref) <= 1e-10, kw


def test_patch_casts_like_sdpa_under_autocast():
    """Under torch.autocast PyTorch's SDPA casts q, k, v to the autocast dtype (a Hugging Face model hands it
    float32 q, k after the rotary embedding and a bf16 v); the patched function does the same."""
    g = torch.Generator().manual_seed(3)
    q, k = (torch.randn(1, 2, 8, 16, generator=g) for _ in range(2))
    v = torch.randn(1, 2, 8, 16, generator=g).bfloat16()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        real = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        with ft.patch_sdpa("naive:bf16", kernel="baseline") as patch:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert real.dtype == out.dtype == torch.bfloat16 and patch.calls == 1
    expect = ft.attention(q.bfloat16(), k.bfloat16(), v, "naive:bf16", kernel="baseline", is_causal=True)
    assert torch.equal(out, expect)
    with ft.patch_sdpa("naive:bf16", kernel="baseline"), pytest.raises(TypeError, match="same dtype"):
        F.scaled_dot_product_attention(q, k, v)  # no autocast: mixed dtypes are refused as before


def test_patch_passes_kernel_and_tiling():
    q, k, v = tensors((1, 2, 9, 4), seed=11)
    with ft.patch_sdpa("paper:bf16", block_kv=2, exp="exp2") as patch:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert same_bits(out, direct("flash", q, k, v, "paper:bf16", True, block_kv=2, exp="exp2")[0])
    with ft.patch_sdpa("naive:bf16", kernel="baseline"):
        out = F.scaled_dot_product_attention(q, k, v, scale=0.25)
    assert same_bits(out, fadev.baseline_attention(np64(q), np64(k), np64(v), "naive:bf16", scale=0.25))
    assert patch.policy == Policy.paper("bf16")


def training_model():
    torch.manual_seed(3)
    enc = nn.TransformerEncoder(encoder_layer(seed=3), num_layers=2, enable_nested_tensor=False)
    return nn.Sequential(nn.Linear(4, 16, dtype=F64), enc, nn.Linear(16, 1, dtype=F64))


def train(ctx, steps=3):
    """(losses, parameters, outputs of the last forward) after ``steps`` SGD steps on fixed data."""
    model = training_model().train()
    rng = np.random.default_rng(12)
    x, y = torch.from_numpy(rng.standard_normal((2, 6, 4))), torch.from_numpy(rng.standard_normal((2, 6, 1)))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    with ctx:
        for _ in range(steps):
            opt.zero_grad()
            pred = model(x)
            loss = ((pred - y) ** 2).mean()
            loss.backward()
            opt.step()
            losses.append(loss.item())
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}, pred.detach()


def test_training_steps_match_pytorch_under_golden_policy():
    losses_ref, params_ref, _ = train(contextlib.nullcontext())
    with ft.patch_sdpa("golden") as patch:
        losses, params, _ = train(contextlib.nullcontext())
    assert patch.calls == 2 * 3
    assert np.max(np.abs(np.subtract(losses, losses_ref))) <= 1e-9
    assert max_diff(params, params_ref) <= 1e-9
    assert max_diff(params, training_model().state_dict()) > 1e-3  # the steps did move the weights


def test_patch_unsupported_calls_raise_or_fall_back():
    q, k, v = tensors((1, 2, 6, 4), seed=13)
    rng_mask = torch.from_numpy(np.random.default_rng(14).random((6, 6)) < 0.7)
    calls = [
        (dict(dropout_p=0.1), "dropout_p=0.1: fadev attention has no dropout"),
        (dict(attn_mask=rng_mask), r"attn_mask of shape \(6, 6\) and dtype torch.bool is neither all-visible nor "
                                   r"the causal mask"),
        (dict(attn_mask=torch.ones(6, 6).tril()), "attn_mask of shape .* dtype torch.float32"),
        (dict(attn_mask=torch.ones(6, 6, dtype=torch.bool), is_causal=True), "attn_mask together with is_causal"),
    ]
    for kw, message in calls:
        with pytest.raises(ft.UnsupportedSDPA, match="patch_sdpa: unsupported scaled_dot_product_attention call: "
                                                     + message):
            with ft.patch_sdpa("golden"):
                F.scaled_dot_product_attention(q, k, v, **kw)
        assert F.scaled_dot_product_attention is torch._C._nn.scaled_dot_product_attention
    shapes = [((1, 2, 6, 4), (1, 2, 5, 4), dict(is_causal=True), "is_causal with 6 queries and 5 keys"),
              ((1, 2, 6, 4), (1, 2, 6, 4), dict(value_dim=3), "value head dim 3 != key head dim 4"),
              ((1, 2, 3, 300), (1, 2, 3, 300), {}, "head dim 300 > 256"),
              ((2, 2, 6, 4), (1, 2, 6, 4), {}, r"batch dims \(2,\), \(1,\), \(1,\) differ")]
    for q_shape, k_shape, kw, message in shapes:
        q, k = torch.randn(q_shape, dtype=F64), torch.randn(k_shape, dtype=F64)
        v = torch.randn(k_shape[:-1] + (kw.pop("value_dim", k_shape[-1]),), dtype=F64)
        with pytest.raises(ft.UnsupportedSDPA, match=message):
            with ft.patch_sdpa("golden"):
                F.scaled_dot_product_attention(q, k, v, **kw)
    # fallback=True hands exactly these calls to PyTorch, and counts them
    q, k, v = tensors((1, 2, 6, 4), seed=13)
    with ft.patch_sdpa("golden", fallback=True) as patch:
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=rng_mask)
        F.scaled_dot_product_attention(q, k, v)
    assert torch.equal(out, F.scaled_dot_product_attention(q, k, v, attn_mask=rng_mask))
    assert (patch.calls, patch.fallbacks) == (1, 1)


def test_patch_rejects_dropout_inside_a_training_model():
    layer = encoder_layer()
    layer.self_attn.dropout = 0.1
    x = torch.randn(2, 5, 16, dtype=F64)
    with pytest.raises(ft.UnsupportedSDPA, match="dropout_p=0.1"):
        with ft.patch_sdpa("golden"):
            layer.train()(x)
    with ft.patch_sdpa("golden") as patch:
        layer.eval()(x)  # MultiheadAttention passes dropout_p=0 in eval mode
    assert patch.calls == 1


def test_patch_restores_on_exception_and_validates():
    original = F.scaled_dot_product_attention
    with pytest.raises(RuntimeError, match="boom"):
        with ft.patch_sdpa("golden"):
            raise RuntimeError("boom")
    assert F.scaled_dot_product_attention is original and torch.backends.mha.get_fastpath_enabled()
    patch = ft.patch_sdpa("golden")
    with patch:
        with pytest.raises(RuntimeError, match="patch_sdpa is already active"):
            patch.__enter__()
    assert F.scaled_dot_product_attention is original
    with pytest.raises(TypeError, match="fallback must be a bool, got 'yes'"):
        ft.patch_sdpa("golden", fallback="yes")
    with pytest.raises(ValueError, match="kernel must be one of flash, baseline"):
        ft.patch_sdpa("golden", kernel="sdpa")
    with pytest.raises(TypeError, match="unknown tiling argument"):
        ft.patch_sdpa("golden", blockkv=4)
    with pytest.raises(ValueError, match="unknown preset 'gold'"):
        ft.patch_sdpa("gold")
    q, k, v = tensors((1, 4, 6, 8), heads_kv=2)
    with pytest.raises(ValueError, match="pass enable_gqa=True"):  # an invalid call is an error, never a fallback
        with ft.patch_sdpa("golden", fallback=True):
            F.scaled_dot_product_attention(q, k, v)
    with pytest.raises(ValueError, match="same rank >= 2"):
        with ft.patch_sdpa("golden", fallback=True):
            F.scaled_dot_product_attention(q[0, 0, 0], k[0, 0, 0], v[0, 0, 0])


# ---------------------------------------------------------------- shadow

class SDPA(nn.Module):
    def __init__(self, causal=False):
        super().__init__()
        self.causal = causal

    def forward(self, q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)


class TwoCalls(nn.Module):
    def __init__(self):
        super().__init__()
        self.first, self.second = SDPA(), SDPA(causal=True)

    def forward(self, q, k, v):
        return self.second(self.first(q, k, v), k, v)


def test_shadow_records_compare_metrics_of_each_call():
    q, k, v = tensors((2, 2, 8, 4), seed=15)
    ref_pol, cand_pol = Policy.fa2("bf16"), Policy.paper("bf16")
    with ft.shadow(reference=ref_pol, candidate=cand_pol, golden=True, block_kv=3) as log:
        out = TwoCalls()(q, k, v)
        F.scaled_dot_product_attention(q, k, v)  # outside any module
    assert [r["call"] for r in log.records] == [0, 1, 2] and log.calls == 3
    assert [r["module"] for r in log.records] == ["first", "second", None]
    assert [r["module_type"] for r in log.records] == ["SDPA", "SDPA", None]
    # recompute: the model continued with the reference, so the second call saw the reference's output
    inputs = [(q, False), (torch.from_numpy(direct("flash", q, k, v, ref_pol, block_kv=3)[0]), True), (q, False)]
    for rec, (qi, causal) in zip(log.records, inputs):
        r, c, g = (direct("flash", qi, k, v, p, causal, block_kv=3)[0] for p in (ref_pol, cand_pol, "golden"))
        assert rec["q_shape"] == rec["k_shape"] == rec["v_shape"] == (2, 2, 8, 4) and rec["is_causal"] == causal
        assert (rec["reference"], rec["candidate"], rec["use"], rec["dtype"]) == ("fa2(bf16)", "paper(bf16)",
                                                                                    "reference", "float64")
        assert {m: rec[m] for m in ft.METRICS} == fadev.compare(c, r).as_dict()
        assert {m: rec[f"reference_vs_golden_{m}"] for m in ft.METRICS} == fadev.compare(r, g).as_dict()
        assert {m: rec[f"candidate_vs_golden_{m}"] for m in ft.METRICS} == fadev.compare(c, g).as_dict()
        assert rec["max_abs"] > 0
    assert same_bits(out, direct("flash", inputs[1][0], k, v, ref_pol, True, block_kv=3)[0])
    df = log.to_dataframe()
    assert df.shape[0] == 3 and list(df["rel_l2"]) == [r["rel_l2"] for r in log.records]


def test_shadow_training_uses_one_branch_and_names_layers():
    ref_pol, cand_pol = "golden", "paper:bf16"
    with ft.shadow(reference=ref_pol, candidate=cand_pol, use="reference") as log:
        losses, params, pred = train(contextlib.nullcontext())
    with ft.shadow(reference=ref_pol, candidate=cand_pol, use="candidate", kernel=("flash", "baseline")) as log_c:
        losses_c, params_c, pred_c = train(contextlib.nullcontext())
    assert len(log.records) == 2 * 3 and len(log_c.records) == 2 * 3
    names = ["1.layers.0.self_attn", "1.layers.1.self_attn"] * 3
    assert [r["module"] for r in log.records] == names == [r["module"] for r in log_c.records]
    assert {r["module_type"] for r in log.records} == {"MultiheadAttention"}
    assert all(r["q_shape"] == (2, 2, 6, 8) and r["rel_l2"] > 1e-4 for r in log.records)
    # the model (and its gradients, hence the SGD steps) followed exactly the used branch
    with ft.patch_sdpa(ref_pol):
        losses_p, params_p, pred_p = train(contextlib.nullcontext())
    with ft.patch_sdpa(cand_pol, kernel="baseline"):
        losses_pc, params_pc, pred_pc = train(contextlib.nullcontext())
    assert losses == losses_p and all(torch.equal(params[n], params_p[n]) for n in params)
    assert losses_c == losses_pc and all(torch.equal(params_c[n], params_pc[n]) for n in params)
    assert torch.equal(pred, pred_p) and torch.equal(pred_c, pred_pc) and max_diff(pred, pred_c) > 1e-4
    # names from a given model
    model = TwoCalls()
    q, k, v = tensors((1, 1, 4, 4))
    with ft.shadow("golden", "fa2:bf16", model=nn.ModuleDict({"outer": model})) as log_m:
        model(q, k, v)
    assert [r["module"] for r in log_m.records] == ["outer.first", "outer.second"]


def test_shadow_errors_and_cleanup():
    hooks = (len(torch_module._global_forward_pre_hooks), len(torch_module._global_forward_hooks))
    q, k, v = tensors((1, 2, 6, 4))
    with pytest.raises(ft.UnsupportedSDPA, match="shadow: unsupported .* dropout_p=0.5"):
        with ft.shadow("golden", "fa2:bf16"):
            SDPA()(q, k, v)
            F.scaled_dot_product_attention(q, k, v, dropout_p=0.5)
    assert (len(torch_module._global_forward_pre_hooks), len(torch_module._global_forward_hooks)) == hooks
    assert F.scaled_dot_product_attention is torch._C._nn.scaled_dot_product_attention
    with pytest.raises(ValueError, match="use must be 'reference' or 'candidate', got 'both'"):
        ft.shadow("golden", "fa2:bf16", use="both")
    with pytest.raises(TypeError, match="golden must be a bool, got 1"):
        ft.shadow("golden", "fa2:bf16", golden=1)
    with pytest.raises(ValueError, match=r"kernel must be .* pair, got \('flash',\)"):
        ft.shadow("golden", "fa2:bf16", kernel=("flash",))
    with pytest.raises(ValueError, match=r"tiling \(block_kv\) needs a flash kernel, got kernel='baseline'"):
        ft.shadow("golden", "fa2:bf16", kernel="baseline", block_kv=4)
    with pytest.raises(TypeError, match="unknown tiling argument"):
        ft.shadow("golden", "fa2:bf16", kernel=("baseline", "flash"), bq=4)
    with pytest.raises(TypeError, match="model must be a torch.nn.Module or None, got dict"):
        ft.shadow("golden", "fa2:bf16", model={})
    with pytest.raises(TypeError, match="candidate: expected a fadev.Policy"):
        ft.shadow("golden", None)
