"""The native kernel as an autograd op (fadev.torch_native), as transformers' "fadev" attention
(fadev.hf.use(kernel="native")) and as PyTorch's SDPA flash implementation (fadev.hf.sdpa_flash).

The autograd op's output and gradients have the bits of fadev.native_attention / native_attention_backward,
and their errors against the fp64 golden are within 2x (forward) and 3x (gradients) of PyTorch's own flash
kernel's (SDPA, flash backend). With the SDPA flash implementation active, SDPA's flash backend returns the
native kernel's bits forward and backward, and PyTorch's own bits again after it is restored; a tiny Llama
gives the same logits and gradients through use(kernel="native") and through transformers' sdpa attention
on the activated implementation. GPU-only: skipped where fadev or torch has no CUDA device.
"""
import math
import types

import pytest

import fadev

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import fadev.hf as hf  # noqa: E402
import fadev.torch_native as tn  # noqa: E402
from fadev.monitor import reference_attention  # noqa: E402
from test_cuda_native import _assert_within, _errors, _golden, _inputs, needs_gpu  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402
from transformers import AutoModelForCausalLM, LlamaConfig  # noqa: E402

F = torch.nn.functional
pytestmark = [pytest.mark.gpu, needs_gpu]
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
SHAPES = [(2, 4, 4, 256, 256), (1, 4, 2, 300, 300), (1, 4, 1, 200, 333)]  # (batch, heads, heads_kv, seq_q, seq_kv)


def _leaves(*tensors):
    return [t.detach().clone().requires_grad_() for t in tensors]


def _torch_flash(q, k, v, dout, causal):
    """PyTorch's flash kernel (K/V heads repeated, so every torch version takes it): out and (dq, dk, dv)."""
    if torch.nn.attention.current_flash_attention_impl() is not None:
        torch.nn.attention.restore_flash_attention_impl()
    ql, kl, vl = _leaves(q, k, v)
    group = q.shape[1] // k.shape[1]
    try:
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            out = F.scaled_dot_product_attention(ql, kl.repeat_interleave(group, 1), vl.repeat_interleave(group, 1),
                                                 is_causal=causal)
    except RuntimeError as e:  # no flash kernel for this device / build
        pytest.skip(f"SDPA flash backend unavailable: {e}")
    out.backward(dout)
    return out.detach(), (ql.grad, kl.grad, vl.grad)


@pytest.mark.parametrize("dim", [64, 128])
@pytest.mark.parametrize("dtype_name", list(DTYPES))
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_native_op_bits_and_flash_rule(dim, dtype_name, causal, shape):
    b, h, hkv, nq, nk = shape
    if causal and nq != nk:
        pytest.skip("SDPA's is_causal is top-left aligned; the native kernel's bottom-right")
    info = f"D={dim} dtype={dtype_name} causal={causal} shape={shape}"
    q, k, v, dout = _inputs(shape, dim, DTYPES[dtype_name], "hf", causal)
    ql, kl, vl = _leaves(q, k, v)
    out = tn.native_attention(ql, kl, vl, is_causal=causal, enable_gqa=h != hkv)
    out.backward(dout)
    grads = (ql.grad, kl.grad, vl.grad)

    want, lse = fadev.native_attention(q, k, v, causal=causal, return_lse=True)
    want_grads = fadev.native_attention_backward(q, k, v, want, lse, dout, causal=causal, deterministic=True)
    assert torch.equal(out, want), f"out differs from fadev.native_attention [{info}]"
    for name, g, w in zip(("dq", "dk", "dv"), grads, want_grads):
        assert torch.equal(g, w), f"{name} differs from fadev.native_attention_backward [{info}]"

    flash_out, flash_grads = _torch_flash(q, k, v, dout, causal)
    gold_out, _, gold_grads = _golden(q, k, v, dout, causal, 1.0 / math.sqrt(dim))
    _assert_within(f"out [{info}]", _errors(out, gold_out), _errors(flash_out, gold_out), 2, "torch flash")
    for name, g, f, ref in zip(("dq", "dk", "dv"), grads, flash_grads, gold_grads):
        _assert_within(f"{name} [{info}]", _errors(g, ref), _errors(f, ref), 3, "torch flash")


def _grads(q, k, v, dout, **options):
    ql, kl, vl = _leaves(q, k, v)
    out = tn.native_attention(ql, kl, vl, is_causal=True, **options)
    out.backward(dout)
    return out.detach(), (ql.grad, kl.grad, vl.grad)


@pytest.mark.parametrize("dim", [64, 128])
def test_native_op_tiles(dim):
    """Every forward tile; the backward on the forward's tile where its own list has it, else on its default,
    or on the backward tile asked for; deterministic backward: the same bits twice."""
    q, k, v, dout = _inputs((1, 2, 2, 200, 200), dim, torch.bfloat16, "tiles")
    backward_tiles = fadev.native_tiles(dim, backward=True, mma=fadev.native.auto_mma(dim, backward=True))
    for bq, bkv in fadev.native_tiles(dim):
        out, grads = _grads(q, k, v, dout, block_q=bq, block_kv=bkv)
        want, lse = fadev.native_attention(q, k, v, causal=True, block_q=bq, block_kv=bkv, return_lse=True)
        assert torch.equal(out, want)
        bbq, bbkv = (bq, bkv) if (bq, bkv) in backward_tiles else backward_tiles[0]
        want_grads = fadev.native_attention_backward(q, k, v, want, lse, dout, causal=True, block_q=bbq,
                                                     block_kv=bbkv, deterministic=True)
        assert all(torch.equal(g, w) for g, w in zip(grads, want_grads)), f"tile {bq}x{bkv}, backward {bbq}x{bbkv}"
    bbq, bbkv = backward_tiles[-1]
    _, grads = _grads(q, k, v, dout, backward_block_q=bbq, backward_block_kv=bbkv)
    out, lse = fadev.native_attention(q, k, v, causal=True, return_lse=True)
    want_grads = fadev.native_attention_backward(q, k, v, out, lse, dout, causal=True, block_q=bbq, block_kv=bbkv,
                                                 deterministic=True)
    assert all(torch.equal(g, w) for g, w in zip(grads, want_grads))
    again = _grads(q, k, v, dout, backward_block_q=bbq, backward_block_kv=bbkv)[1]
    assert all(torch.equal(g, w) for g, w in zip(grads, again))


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
                    reason="mma='wgmma' needs compute capability 9.0")
@pytest.mark.parametrize("dim", [64, 128])
def test_native_op_wgmma_forward(dim):
    """mma='wgmma': every Hopper forward tile gives fadev.native_attention(..., mma='wgmma')'s bits and the mma.sync
    backward's gradients on the tile asked for; where the mma.sync forward has the tile too, the same bits as
    mma='sync' for out and every gradient (a training step does not change with the instruction)."""
    q, k, v, dout = _inputs((1, 2, 2, 200, 200), dim, torch.bfloat16, "wgmma")
    backward_tiles = fadev.native_tiles(dim, backward=True)
    for bq, bkv in fadev.native_tiles(dim, mma="wgmma"):
        out, grads = _grads(q, k, v, dout, block_q=bq, block_kv=bkv, mma="wgmma")
        want, lse = fadev.native_attention(q, k, v, causal=True, block_q=bq, block_kv=bkv, mma="wgmma",
                                           return_lse=True)
        assert torch.equal(out, want), f"tile {bq}x{bkv}"
        bbq, bbkv = (bq, bkv) if (bq, bkv) in backward_tiles else backward_tiles[0]
        want_grads = fadev.native_attention_backward(q, k, v, want, lse, dout, causal=True, block_q=bbq,
                                                     block_kv=bbkv, deterministic=True, mma="sync")
        assert all(torch.equal(g, w) for g, w in zip(grads, want_grads)), f"tile {bq}x{bkv}"
        if (bq, bkv) in fadev.native_tiles(dim):
            out_s, grads_s = _grads(q, k, v, dout, block_q=bq, block_kv=bkv, mma="sync")
            assert torch.equal(out, out_s) and all(torch.equal(g, w) for g, w in zip(grads, grads_s)), \
                f"wgmma vs sync, tile {bq}x{bkv}"
    with pytest.raises(ValueError, match=r"block_q, block_kv: \(16, 16\) is not a native forward \(mma='wgmma'\)"):
        tn.native_attention(q, k, v, block_q=16, block_kv=16, mma="wgmma")


def test_native_op_errors():
    q, k, v, dout = _inputs((1, 2, 2, 200, 200), 64, torch.bfloat16, "errors")
    with pytest.raises(ValueError, match="backward_block_q"):
        tn.native_attention(q, k, v, backward_block_q=128, backward_block_kv=256)
    with pytest.raises(ValueError, match="block_q"):
        tn.native_attention(q, k, v, block_q=256, block_kv=256)
    with pytest.raises(TypeError, match="query.*float16 or bfloat16"):
        tn.native_attention(q.float(), k.float(), v.float())
    q96 = torch.zeros(1, 2, 8, 96, device="cuda", dtype=torch.float16)
    with pytest.raises(ValueError, match="query.*head dim 96"):
        tn.native_attention(q96, q96, q96)
    with pytest.raises(ValueError, match="enable_gqa"):
        tn.native_attention(q, k[:, :1], v[:, :1])
    with pytest.raises(ValueError, match="is_causal"):
        tn.native_attention(q, k[:, :, :100], v[:, :, :100], is_causal=True)


@pytest.mark.parametrize("dim", [64, 128])
@pytest.mark.parametrize("heads_kv", [4, 2], ids=["mha", "gqa"])
def test_sdpa_flash_impl_is_native(dim, heads_kv):
    shape = (2, 4, heads_kv, 256, 256)
    q, k, v, dout = _inputs(shape, dim, torch.bfloat16, "sdpa-flash")
    gqa = {"enable_gqa": True} if heads_kv != 4 else {}

    def sdpa():
        ql, kl, vl = _leaves(q, k, v)
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            out = F.scaled_dot_product_attention(ql, kl, vl, is_causal=True, **gqa)
        out.backward(dout.transpose(1, 2))
        return out.detach(), (ql.grad, kl.grad, vl.grad)

    try:
        before = sdpa()
    except RuntimeError as e:
        pytest.skip(f"PyTorch's flash backend does not take this call (enable_gqa?): {e}")
    with hf.sdpa_flash():
        assert torch.nn.attention.current_flash_attention_impl() == "fadev"
        out, grads = sdpa()
    assert torch.nn.attention.current_flash_attention_impl() is None
    want, lse = fadev.native_attention(q, k, v, causal=True, return_lse=True)
    assert torch.equal(out, want)
    for g, w in zip(grads, fadev.native_attention_backward(q, k, v, want, lse, dout, causal=True, deterministic=True)):
        assert torch.equal(g, w)
    after = sdpa()
    # PyTorch's own kernel again after restoring, and a different computation from the native one
    assert torch.equal(after[0], before[0]) and all(torch.equal(a, b) for a, b in zip(after[1], before[1]))
    assert not torch.equal(before[0], out)


def test_sdpa_flash_impl_refuses_what_native_cannot():
    q = torch.randn(1, 2, 64, 96, device="cuda", dtype=torch.float16)
    with hf.sdpa_flash(), sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        with pytest.raises(RuntimeError, match="head dim 96"):
            F.scaled_dot_product_attention(q, q, q)
        q64 = torch.randn(1, 2, 64, 64, device="cuda", dtype=torch.float16)
        with pytest.raises(RuntimeError, match="dropout_p"):
            F.scaled_dot_product_attention(q64, q64, q64, dropout_p=0.5)
    assert torch.nn.attention.current_flash_attention_impl() is None


def _llama(heads_kv):
    cfg = LlamaConfig(vocab_size=300, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=heads_kv, max_position_embeddings=512)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg, attn_implementation="fadev", dtype=torch.bfloat16).cuda()


def _step(model, ids):
    model.zero_grad()
    logits = model(ids).logits
    logits.float().square().mean().backward()
    return logits.detach(), [p.grad.clone() for p in model.parameters()]


def test_llama_native_equals_sdpa_on_the_flash_impl():
    """use(kernel="native") and transformers' sdpa attention on the activated SDPA flash implementation: the
    same logits and gradients, bit for bit (head dim 64, causal prefill)."""
    model = _llama(4)
    ids = torch.randint(0, 300, (2, 256), device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    with hf.use(kernel="native"):
        la, ga = _step(model, ids)
    with hf.use(kernel="sdpa"), hf.sdpa_flash(), sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        lb, gb = _step(model, ids)
    assert torch.equal(la, lb) and all(torch.equal(a, b) for a, b in zip(ga, gb))
    lc, _ = _step(model, ids)  # PyTorch's own kernels: a different computation
    assert not torch.equal(la, lc)


def test_native_padding_mask_flash_rule():
    """A padding mask (row 0 left-padded, row 1 right-padded, grouped-query heads) through
    use(kernel="native"): queries that see no key give 0; the others are within 2x of the error of the naive
    bfloat16 attention on the same mask, both against float64."""
    b, h, hkv, n, d = 2, 4, 2, 192, 64
    q, k, v, _ = _inputs((b, h, hkv, n, n), d, torch.bfloat16, "padding")
    valid = torch.ones(b, n, dtype=torch.bool, device="cuda")
    valid[0, :40] = False
    valid[1, 150:] = False
    mask = (torch.ones(n, n, dtype=torch.bool, device="cuda").tril()[None] & valid[:, None, :])[:, None]

    class Module:
        is_causal = True

    with hf.use(kernel="native"):
        out, _ = hf.attention_forward(Module(), q, k, v, mask, scaling=d ** -0.5)
    out = out.transpose(1, 2)
    kr, vr = k.repeat_interleave(h // hkv, 1), v.repeat_interleave(h // hkv, 1)
    gold = reference_attention(q.double(), k.double(), v.double(), attn_mask=mask, scale=d ** -0.5)
    naive = torch.softmax((q @ kr.transpose(-1, -2) * d ** -0.5).masked_fill(~mask, -math.inf), -1) @ vr  # bf16
    seeing = mask.any(-1).expand(b, h, n)
    assert not out[~seeing].any()
    _assert_within("padded out", _errors(out[seeing], gold[seeing]), _errors(naive[seeing], gold[seeing]), 2,
                   "naive")
    model = _llama(2)  # and a whole model: grouped-query heads, a padded batch, finite logits
    ids = torch.randint(0, 300, (2, 128), device="cuda", generator=torch.Generator("cuda").manual_seed(2))
    pad = torch.ones_like(ids)
    pad[0, :16] = 0
    with hf.use(kernel="native"):
        assert torch.isfinite(model(ids, attention_mask=pad).logits[pad.bool()]).all()


def test_native_defaults_are_the_auto_table():
    """With default arguments the op runs what fadev.native.auto_mma picks (wgmma forward and backward on an H100 or
    H200) on the default tiles (fadev.native.DEFAULT_TILES, else the list's first), and its bits are those
    kernels' own."""
    for dim in (64, 128):
        q, k, v, dout = _inputs((1, 2, 2, 256, 256), dim, torch.bfloat16, "auto")
        p = tn.plan(q, k, v, True)
        hopper = torch.cuda.get_device_capability() == (9, 0)
        assert p.mma == (("wgmma", "wgmma") if hopper else ("sync", "sync")), p.mma
        out, grads = _grads(q, k, v, dout)
        (bq, bkv), (bbq, bbkv) = p.tiles
        want, lse = fadev.native_attention(q, k, v, causal=True, block_q=bq, block_kv=bkv, mma=p.mma[0],
                                           return_lse=True)
        want_grads = fadev.native_attention_backward(q, k, v, want, lse, dout, causal=True, block_q=bbq,
                                                     block_kv=bbkv, mma=p.mma[1], deterministic=True)
        assert torch.equal(out, want) and all(torch.equal(g, w) for g, w in zip(grads, want_grads)), dim


def test_native_op_on_a_side_stream():
    """The kernels are queued on PyTorch's current stream, without a device synchronisation: the op on a side
    stream, whose inputs were written on it, gives the default stream's bits once that stream is waited for."""
    q, k, v, dout = _inputs((2, 4, 2, 512, 512), 64, torch.bfloat16, "stream")
    out, grads = _grads(q, k, v, dout, enable_gqa=True)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        q2, k2, v2, dout2 = (t * 1 for t in (q, k, v, dout))  # written on the side stream
        out2, grads2 = _grads(q2, k2, v2, dout2, enable_gqa=True)
    torch.cuda.current_stream().wait_stream(side)
    assert torch.equal(out, out2) and all(torch.equal(a, b) for a, b in zip(grads, grads2))


def test_native_ops_opcheck():
    """fadev::native_attention(_backward) pass torch.library.opcheck (schema, fake tensors, autograd registration)."""
    q, k, v, dout = _inputs((1, 4, 2, 128, 128), 64, torch.bfloat16, "opcheck")
    options = (True, None, True, None, None, None, None, True, "auto", None)
    torch.library.opcheck(tn._op_forward, (*_leaves(q, k, v), *options))
    out, lse = tn._op_forward(q, k, v, *options)
    torch.library.opcheck(tn._op_backward, (dout, q, k, v, out, lse, *options))


def test_native_attention_compiled_gives_eager_bits():
    """The attention call itself under torch.compile (fullgraph, aot_eager and inductor): the same output and
    gradients as eager, bit for bit -- the compiled graph calls the same kernels."""
    q, k, v, dout = _inputs((2, 4, 2, 256, 256), 64, torch.bfloat16, "compiled")

    layer = types.SimpleNamespace(is_causal=True, num_key_value_groups=2, training=True)

    def attention(q, k, v):
        return hf.attention_forward(layer, q, k, v, None, scaling=0.125, is_causal=True)[0]

    def run(fn):
        ql, kl, vl = _leaves(q, k, v)
        out = fn(ql, kl, vl)
        out.backward(dout.transpose(1, 2))
        return out.detach(), [t.grad for t in (ql, kl, vl)]

    with hf.use(kernel="native"):
        want, want_grads = run(attention)
        explained = torch._dynamo.explain(attention)(q, k, v)  # the graph holds fadev's op, not PyTorch's SDPA
        targets = [str(n.target) for g in explained.graphs for n in g.graph.nodes if n.op == "call_function"]
        assert any("fadev.native_attention" in t for t in targets), targets
        for backend in ("aot_eager", "inductor"):
            torch._dynamo.reset()
            got, grads = run(torch.compile(attention, backend=backend, fullgraph=True))
            assert torch.equal(got, want) and all(torch.equal(a, b) for a, b in zip(grads, want_grads)), backend
    torch._dynamo.reset()


def _compiled_llama_run():
    model = _llama(2)
    ids = torch.randint(0, 300, (2, 256), device="cuda", generator=torch.Generator("cuda").manual_seed(3))
    torch._dynamo.reset()
    with hf.use(kernel="native"):
        logits, _ = _step(model, ids)
        explained = torch._dynamo.explain(model)(ids)
        torch._dynamo.reset()
        clogits, _ = _step(torch.compile(model, backend="aot_eager"), ids)
    torch._dynamo.reset()
    return logits, clogits, explained


def test_compiled_llama_runs_fadev_attention():
    """A Llama with use(kernel="native") under torch.compile: its graphs hold fadev's op (not PyTorch's SDPA) and
    its logits are eager's to bf16 rounding (aot_eager decomposes the model's other bf16 ops its own way; the
    attention's bits are test_native_attention_compiled_gives_eager_bits')."""
    logits, clogits, explained = _compiled_llama_run()
    targets = [str(n.target) for g in explained.graphs for n in g.graph.nodes if n.op == "call_function"]
    assert any("fadev.native_attention" in t for t in targets), targets
    assert torch.isfinite(clogits).all()
    err = (clogits.float() - logits.float()).abs().max().item()
    assert err <= 0.05 * logits.float().abs().max().item(), err


def test_compiled_llama_has_no_graph_break():
    """No graph break: fadev's mask builder (hf.mask) leaves a causal mask without padding to is_causal under
    torch.compile, so nothing in the attention path reads tensor values on the host."""
    _, _, explained = _compiled_llama_run()
    assert explained.graph_break_count == 0, explained.break_reasons