"""The native FlashAttention-2-style kernel (cuda/native_forward.cu, cuda/native_backward.cu) against golden
attention in float64, by FlashAttention's rule: the native error (max and mean |error| against the fp64 golden)
is at most 2x the error of the same-precision naive baseline (softmax(q k^T * scale) v with every matmul and
the softmax in fp16/bf16), gradients at most 3x; and at most 2x the error of PyTorch's own flash kernel
(SDPA, flash backend) where that kernel applies. lse is checked against the golden logsumexp.

Every compiled tile of each direction (cuda/native.cuh's X-lists, read here so a tile added there is
tested; the binding must report the same lists), both dtypes, D 64 and 128, causal (bottom-right aligned) or
not, Nq != Nk, ragged lengths, grouped-query and multi-query heads, and rows that see no key (causal with
Nq > Nk: out 0, lse -inf, zero gradient); the backward with atomic dq sums and deterministic (no atomics:
the same bits run to run, and dk, dv the atomic mode's bits). Every call names mma="sync": this file tests the
mma.sync kernels (mma="auto", the default, runs wgmma on an H100 where it has the tile; test_cuda_native_wgmma.py).
GPU-only: skipped where fadev has no CUDA device.
"""
import math
import os
import re
import zlib

import pytest

import fadev

torch = pytest.importorskip("torch")

needs_gpu = pytest.mark.skipif(not (fadev.cuda_available() and torch.cuda.is_available()),
                               reason="no CUDA device (fadev.cuda_available() or torch.cuda.is_available() is False)")
pytestmark = [pytest.mark.gpu, needs_gpu]



def compiled_tiles(macro):
    """{D: [(block_q, block_kv), ...]} of one X-list of cuda/native.cuh (NATIVE_FORWARD_TILES, ...)."""
    with open(os.path.join(os.path.dirname(__file__), "..", "cuda", "native.cuh")) as f:
        text = f.read()
    body = re.search(rf"#define {macro}\(X\)((?:.*\\\n)*.*)", text).group(1)
    tiles = {}
    for d, bq, bkv in re.findall(r"X\((\d+), (\d+), (\d+)\)", body):
        tiles.setdefault(int(d), []).append((int(bq), int(bkv)))
    assert tiles, f"no {macro} list in cuda/native.cuh"
    return tiles


TILES = compiled_tiles("NATIVE_FORWARD_TILES")
TILES_32 = compiled_tiles("NATIVE_FORWARD_TILES_32")  # 32 query rows per warp
BACKWARD_TILES = compiled_tiles("NATIVE_BACKWARD_TILES")
BACKWARD_TILES_32 = compiled_tiles("NATIVE_BACKWARD_TILES_32")  # 32 keys per warp
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
# (batch, heads, heads_kv, seq_q, seq_kv)
SHAPES = [(2, 4, 4, 128, 128), (1, 4, 2, 1000, 257), (1, 4, 1, 257, 1000), (1, 2, 2, 1, 77), (2, 2, 1, 333, 333)]
CASES = [(d, bq, bkv) for d in TILES for bq, bkv in TILES[d]]
BACKWARD_CASES = [(d, bq, bkv) for d in BACKWARD_TILES for bq, bkv in BACKWARD_TILES[d]]
TINY = 1e-6  # absolute floor, used only where the baseline's error is exactly 0


def _inputs(shape, dim, dtype, *key):
    """q, k, v, dout: standard normals rounded to dtype, seeded from `key` (stable across runs)."""
    b, h, hkv, nq, nk = shape
    gen = torch.Generator(device="cuda").manual_seed(zlib.crc32(repr((shape, dim, dtype) + key).encode()))
    q = torch.randn(b, h, nq, dim, device="cuda", generator=gen).to(dtype)
    k = torch.randn(b, hkv, nk, dim, device="cuda", generator=gen).to(dtype)
    v = torch.randn(b, hkv, nk, dim, device="cuda", generator=gen).to(dtype)
    dout = torch.randn(b, h, nq, dim, device="cuda", generator=gen).to(dtype)
    return q, k, v, dout


def _mask(nq, nk, causal, device):
    """True where query i sees key j: bottom-right aligned, j <= i + nk - nq."""
    if not causal:
        return torch.ones(nq, nk, dtype=torch.bool, device=device)
    i = torch.arange(nq, device=device)[:, None]
    j = torch.arange(nk, device=device)[None, :]
    return j <= i + (nk - nq)


def _attention(q, k, v, causal, scale):
    """softmax(q k^T * scale) v in q's dtype (every op rounds to it); K/V heads repeated for grouped-query.
    Rows that see no key get probabilities 0 (out 0) without NaN. Returns (out, scores)."""
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    mask = _mask(q.shape[2], k.shape[2], causal, q.device)
    s = torch.matmul(q, k.transpose(-1, -2)) * scale
    s = s.masked_fill(~mask, -math.inf).masked_fill(~mask.any(-1, keepdim=True), 0.0)
    p = torch.softmax(s, dim=-1).masked_fill(~mask, 0.0)
    return torch.matmul(p, v), s.masked_fill(~mask, -math.inf)


def _golden(q, k, v, dout, causal, scale):
    """fp64 out, lse and (dq, dk, dv) by autograd."""
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    out, s = _attention(q64, k64, v64, causal, scale)
    out.backward(dout.double())
    return out.detach(), torch.logsumexp(s.detach(), dim=-1), (q64.grad, k64.grad, v64.grad)


def _naive(q, k, v, dout, causal, scale):
    """The same-precision naive baseline: out and gradients by autograd in q's dtype."""
    ql, kl, vl = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out, _ = _attention(ql, kl, vl, causal, scale)
    out.backward(dout)
    return out.detach(), (ql.grad, kl.grad, vl.grad)


def _errors(x, ref):
    e = (x.double() - ref).abs()
    return e.max().item(), e.mean().item()


def _assert_within(name, got, base, factor, what):
    """FlashAttention's rule on (max, mean) |error|: got <= factor * base (plus TINY where base is exactly 0)."""
    for stat, g, b in zip(("max", "mean"), got, base):
        bound = factor * b + (TINY if b == 0 else 0.0)
        assert g <= bound, f"{name}: {stat} |error| {g:.3e} > {factor} x {what} {b:.3e}"


class _tf32_off:
    """Context manager: TF32 off for matmuls (for torch versions without backends.cuda.matmul.flags)."""

    def __enter__(self):
        self.saved = torch.backends.cuda.matmul.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = False

    def __exit__(self, *exc):
        torch.backends.cuda.matmul.allow_tf32 = self.saved


def check_forward(q, k, v, dout, causal, scale, out, lse, info):
    """A native forward's (out, lse) by FlashAttention's rule: out within 2x the same-precision naive baseline's max
    and mean |error| against fp64; rows that see no key exactly 0 with lse -inf; lse within 2x the error of
    logsumexp of the fp32 scores (TF32 off), plus 8 fp32 ulps of |lse|."""
    assert out.dtype == q.dtype and out.shape == q.shape and lse.dtype == torch.float32 and lse.shape == q.shape[:3]
    gold_out, gold_lse, _ = _golden(q, k, v, dout, causal, scale)
    naive_out, _ = _naive(q, k, v, dout, causal, scale)
    _assert_within(f"out [{info}]", _errors(out, gold_out), _errors(naive_out, gold_out), 2, "naive")
    empty = torch.isinf(gold_lse)
    assert torch.equal(torch.isneginf(lse), empty), f"lse -inf rows differ [{info}]"
    assert not out[empty].any(), f"rows that see no key are not 0 [{info}]"
    with _tf32_off():
        _, s32 = _attention(q.float(), k.float(), v.float(), causal, scale)
    lse32 = torch.logsumexp(s32, dim=-1)
    fin = ~empty
    if fin.any():
        err = (lse[fin].double() - gold_lse[fin]).abs().max().item()
        base = (lse32[fin].double() - gold_lse[fin]).abs().max().item()
        bound = 2 * base + 8 * 2.0**-23 * gold_lse[fin].abs().max().item()
        assert err <= bound, f"lse |error| {err:.3e} > {bound:.3e} (fp32 baseline {base:.3e}) [{info}]"


def check_backward(q, k, v, dout, causal, scale, grads, info):
    """A native backward's (dq, dk, dv) by FlashAttention's rule for gradients: within 3x the same-precision naive
    baseline's max and mean |error| against fp64; dq of rows that see no key exactly 0."""
    _, gold_lse, gold = _golden(q, k, v, dout, causal, scale)
    _, naive = _naive(q, k, v, dout, causal, scale)
    for name, g, ref, base, t in zip(("dq", "dk", "dv"), grads, gold, naive, (q, k, v)):
        assert g.dtype == q.dtype and g.shape == t.shape, f"{name} dtype/shape [{info}]"
        _assert_within(f"{name} [{info}]", _errors(g, ref), _errors(base, ref), 3, "naive")
    assert not grads[0][torch.isinf(gold_lse)].any(), f"dq of rows that see no key is not 0 [{info}]"


def _params(case, shape, dtype_name, causal):
    d, bq, bkv = case
    return f"D={d} block_q={bq} block_kv={bkv} shape={shape} dtype={dtype_name} causal={causal}"


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"D{c[0]}-{c[1]}x{c[2]}")
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype_name", list(DTYPES))
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_native_forward_flash_rule(case, shape, dtype_name, causal):
    d, bq, bkv = case
    dtype, scale = DTYPES[dtype_name], 1.0 / math.sqrt(d)
    q, k, v, dout = _inputs(shape, d, dtype, case, causal)
    info = _params(case, shape, dtype_name, causal)
    out, lse = fadev.native_attention(q, k, v, mma="sync", causal=causal, block_q=bq, block_kv=bkv, return_lse=True)
    check_forward(q, k, v, dout, causal, scale, out, lse, info)


@pytest.mark.parametrize("case", BACKWARD_CASES, ids=lambda c: f"D{c[0]}-{c[1]}x{c[2]}")
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype_name", list(DTYPES))
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "deterministic"])
def test_native_backward_flash_rule(case, shape, dtype_name, causal, deterministic):
    d, bq, bkv = case
    dtype, scale = DTYPES[dtype_name], 1.0 / math.sqrt(d)
    q, k, v, dout = _inputs(shape, d, dtype, case, causal, "bwd")
    info = _params(case, shape, dtype_name, causal) + f" deterministic={deterministic}"
    out, lse = fadev.native_attention(q, k, v, mma="sync", causal=causal, return_lse=True)  # the forward's default tile
    grads = fadev.native_attention_backward(q, k, v, out, lse, dout, mma="sync", causal=causal, block_q=bq,
                                            block_kv=bkv, deterministic=deterministic)
    check_backward(q, k, v, dout, causal, scale, grads, info)


def _bits(t):
    return t.view(torch.int16) if t.element_size() == 2 else t.view(torch.int32)


@pytest.mark.parametrize("case", [(d, bq, bkv) for d in TILES_32 for bq, bkv in TILES_32[d]],
                         ids=lambda c: f"D{c[0]}-{c[1]}x{c[2]}")
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_native_forward_32_rows_per_warp_same_bits(case, shape, causal):
    """warp_rows=32 runs the same operations per row in the same order as warp_rows=16 (tested above under
    FlashAttention's rule), so out and lse are the same bits, both dtypes."""
    d, bq, bkv = case
    assert (bq, bkv) in TILES[d], "every 32-row tile also has a 16-row kernel to compare with"
    for dtype_name, dtype in DTYPES.items():
        q, k, v, _ = _inputs(shape, d, dtype, case, causal, "rows32")
        kw = dict(causal=causal, block_q=bq, block_kv=bkv, return_lse=True)
        out16, lse16 = fadev.native_attention(q, k, v, mma="sync", **kw)
        out32, lse32 = fadev.native_attention(q, k, v, mma="sync", warp_rows=32, **kw)
        info = _params(case, shape, dtype_name, causal)
        assert torch.equal(_bits(out32), _bits(out16)), f"out differs between 16 and 32 rows per warp [{info}]"
        assert torch.equal(_bits(lse32), _bits(lse16)), f"lse differs between 16 and 32 rows per warp [{info}]"


@pytest.mark.parametrize("case", [(d, bq, bkv) for d in BACKWARD_TILES_32 for bq, bkv in BACKWARD_TILES_32[d]],
                         ids=lambda c: f"D{c[0]}-{c[1]}x{c[2]}")
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_native_backward_32_keys_per_warp_same_bits(case, shape, causal):
    """warp_rows=32 (32 keys per warp) runs the same operations per gradient element in the same order as
    warp_rows=16, so with deterministic dq all three gradients are the same bits, both dtypes; with atomic dq,
    dk and dv are."""
    d, bq, bkv = case
    assert (bq, bkv) in BACKWARD_TILES[d], "every 32-key tile also has a 16-key kernel to compare with"
    for dtype_name, dtype in DTYPES.items():
        q, k, v, dout = _inputs(shape, d, dtype, case, causal, "keys32")
        out, lse = fadev.native_attention(q, k, v, mma="sync", causal=causal, return_lse=True)
        info = _params(case, shape, dtype_name, causal)
        for deterministic in (True, False):
            kw = dict(causal=causal, block_q=bq, block_kv=bkv, deterministic=deterministic)
            g16 = fadev.native_attention_backward(q, k, v, out, lse, dout, mma="sync", **kw)
            g32 = fadev.native_attention_backward(q, k, v, out, lse, dout, mma="sync", warp_rows=32, **kw)
            for name, a, b in list(zip(("dq", "dk", "dv"), g32, g16))[0 if deterministic else 1:]:
                assert torch.equal(_bits(a), _bits(b)), (f"{name} differs between 16 and 32 keys per warp "
                                                         f"[{info} deterministic={deterministic}]")


@pytest.mark.parametrize("case", BACKWARD_CASES, ids=lambda c: f"D{c[0]}-{c[1]}x{c[2]}")
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_native_backward_deterministic_bits(case, causal):
    """deterministic=True: two runs give the same bits (many key tiles add into each dq row, which the atomic
    mode sums in arrival order); dk and dv are the atomic mode's bits (the same dK/dV kernel, only dq differs);
    dq agrees with the atomic mode's to a few bf16 ulps (the fp32 sums in another order)."""
    d, bq, bkv = case
    shape = (2, 8, 2, 1100, 1500)
    q, k, v, dout = _inputs(shape, d, torch.bfloat16, case, causal, "det")
    out, lse = fadev.native_attention(q, k, v, mma="sync", causal=causal, return_lse=True)
    kw = dict(causal=causal, block_q=bq, block_kv=bkv)
    first = fadev.native_attention_backward(q, k, v, out, lse, dout, mma="sync", deterministic=True, **kw)
    second = fadev.native_attention_backward(q, k, v, out, lse, dout, mma="sync", deterministic=True, **kw)
    atomic = fadev.native_attention_backward(q, k, v, out, lse, dout, mma="sync", deterministic=False, **kw)
    for name, a, b in zip(("dq", "dk", "dv"), first, second):
        assert torch.equal(_bits(a), _bits(b)), f"{name}: deterministic runs differ [{case} causal={causal}]"
    for name, a, b in zip(("dk", "dv"), first[1:], atomic[1:]):
        assert torch.equal(_bits(a), _bits(b)), f"{name}: deterministic differs from atomic [{case} causal={causal}]"
    rel = ((first[0].double() - atomic[0].double()).abs().max() / atomic[0].double().abs().max()).item()
    assert rel <= 2.0**-6, f"dq: deterministic vs atomic max relative difference {rel:.2e} [{case} causal={causal}]"


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"D{c[0]}-{c[1]}x{c[2]}")
@pytest.mark.parametrize("dtype_name", list(DTYPES))
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape", [(2, 4, 4, 512, 512), (1, 4, 2, 1000, 1000), (1, 2, 2, 257, 1000)],
                         ids=lambda s: "x".join(map(str, s)))
def test_native_forward_vs_torch_flash(case, dtype_name, causal, shape):
    """Within 2x of the error of PyTorch's flash kernel (SDPA's flash backend, top-left causal, so causal only
    where Nq == Nk), both against the fp64 golden; and that kernel itself obeys the 2x-of-naive rule."""
    d, bq, bkv = case
    b, h, hkv, nq, nk = shape
    if causal and nq != nk:
        pytest.skip("SDPA's is_causal is top-left aligned; the native kernel's bottom-right (equal only for Nq == Nk)")
    from torch.nn.attention import SDPBackend, sdpa_kernel
    dtype, scale = DTYPES[dtype_name], 1.0 / math.sqrt(d)
    q, k, v, dout = _inputs(shape, d, dtype, case, causal, "sdpa")
    info = _params(case, shape, dtype_name, causal)
    group = h // hkv
    try:
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            ref = torch.nn.functional.scaled_dot_product_attention(
                q, k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1), is_causal=causal, scale=scale)
    except RuntimeError as e:  # no flash kernel for this device / build
        pytest.skip(f"SDPA flash backend unavailable: {e}")
    out = fadev.native_attention(q, k, v, mma="sync", causal=causal, block_q=bq, block_kv=bkv)
    gold_out, _, _ = _golden(q, k, v, dout, causal, scale)
    naive_out, _ = _naive(q, k, v, dout, causal, scale)
    flash_err = _errors(ref, gold_out)
    _assert_within(f"torch flash out [{info}]", flash_err, _errors(naive_out, gold_out), 2, "naive")
    _assert_within(f"out [{info}]", _errors(out, gold_out), flash_err, 2, "torch flash")


def test_native_tiles_reported():
    """The binding reports the compiled tiles of each direction (the lists this file parametrizes over), and the
    backward's tiles are its own: a forward-only tile is refused by the backward, naming the arguments."""
    for d, tiles in TILES.items():
        assert [tuple(t) for t in fadev.native_tiles(d)] == tiles
        assert [tuple(t) for t in fadev.native_tiles(d, warp_rows=32)] == TILES_32[d]
        assert [tuple(t) for t in fadev.native_tiles(d, backward=True)] == BACKWARD_TILES[d]
        assert [tuple(t) for t in fadev.native_tiles(d, backward=True, warp_rows=32)] == BACKWARD_TILES_32.get(d, [])
    q, k, v, dout = _inputs((1, 2, 2, 64, 64), 128, torch.bfloat16, "tiles")
    out, lse = fadev.native_attention(q, k, v, mma="sync", block_q=128, block_kv=64, return_lse=True)
    assert (128, 64) not in BACKWARD_TILES[128]
    with pytest.raises(ValueError, match=r"block_q, block_kv: \(128, 64\) is not a native backward tile for head dim 128"):
        fadev.native_attention_backward(q, k, v, out, lse, dout, mma="sync", block_q=128, block_kv=64)
    with pytest.raises(TypeError, match="deterministic must be a bool"):
        fadev.native_attention_backward(q, k, v, out, lse, dout, mma="sync", deterministic=1)
    with pytest.raises(ValueError, match="warp_rows: no native backward tile has 32 rows per warp at head dim 128"):
        fadev.native_attention_backward(q, k, v, out, lse, dout, mma="sync", warp_rows=32)
    with pytest.raises(ValueError, match="warp_rows must be 16 or 32, got 8"):
        fadev.native_attention(q, k, v, mma="sync", warp_rows=8)


def test_native_defaults_and_scale():
    """Default tiles and an explicit scale: the same rule against golden with that scale."""
    q, k, v, dout = _inputs((1, 2, 1, 300, 200), 64, torch.bfloat16, "defaults")
    for scale in (None, 0.3, -0.2):
        s = 1.0 / math.sqrt(64) if scale is None else scale
        out = fadev.native_attention(q, k, v, mma="sync", causal=True, scale=scale)
        gold_out, _, _ = _golden(q, k, v, dout, True, s)
        naive_out, _ = _naive(q, k, v, dout, True, s)
        _assert_within(f"out scale={scale}", _errors(out, gold_out), _errors(naive_out, gold_out), 2, "naive")


@pytest.mark.parametrize("kwargs, shapes", [
    ({"block_q": 256, "block_kv": 64}, ((1, 2, 64, 64), (1, 2, 64, 64))),    # not a compiled tile
    ({"block_q": 64, "block_kv": 128}, ((1, 2, 64, 128), (1, 2, 64, 128))),  # not compiled for D 128
    ({}, ((1, 2, 64, 96), (1, 2, 64, 96))),                                  # head dim 96
    ({}, ((1, 3, 64, 64), (1, 2, 64, 64))),                                  # heads % heads_kv != 0
])
def test_native_invalid_arguments(kwargs, shapes):
    qs, ks = shapes
    q = torch.randn(*qs, device="cuda", dtype=torch.float16)
    k = torch.randn(*ks, device="cuda", dtype=torch.float16)
    with pytest.raises(ValueError):
        fadev.native_attention(q, k, k, mma="sync", **kwargs)


def test_tile_lists_are_asked_of_the_build_once(monkeypatch):
    """The tile lists are constants of the build: asked of the binding once per argument set (a native call
    fits its tiles several times), and a caller that edits the list it got does not edit the next caller's."""
    import fadev.native as native
    native._tiles.cache_clear()
    calls = []
    real = native._core.cuda_native_tiles
    monkeypatch.setattr(native._core, "cuda_native_tiles", lambda *a: calls.append(a) or real(*a))
    first = fadev.native_tiles(64)
    first.clear()
    assert fadev.native_tiles(64) and fadev.native_tiles(64, backward=True) and len(calls) == 2
    q = torch.randn(1, 2, 128, 64, device="cuda", dtype=torch.bfloat16)
    import fadev.torch_native as tn
    tn.native_attention(q, q, q, is_causal=True).float().sum()
    asked = len(calls)
    assert asked <= 4  # mma="auto" may ask for the wgmma lists besides, once
    tn.native_attention(q[:, :, :64], q[:, :, :64], q[:, :, :64], is_causal=True).float().sum()
    assert len(calls) == asked  # another plan, its tiles fitted from the cache
    native._tiles.cache_clear()
