"""torch.compile over fadev's attention (issue 25): the emulated kernels (fadev::attention) and the native one
(fadev::native_attention) as torch.library custom ops with register_fake and register_autograd. A compiled call
or model keeps the op in one graph (fullgraph=True, torch._dynamo.explain: no break) and gives eager's bits,
forward and gradients; the registrations pass torch.library.opcheck; a compiled Hugging Face model follows
fadev.hf.use's setting (dynamo guards on it). The native op's kernels need a GPU (test_cuda_hf.py); here its
graph and its calls to the binding are checked with the launches recorded (torch_native._dry_run).
"""
import warnings

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import fadev.hf as hf  # noqa: E402
import fadev.torch as ft  # noqa: E402
import fadev.torch_native as tn  # noqa: E402
from transformers import AutoModelForCausalLM, LlamaConfig  # noqa: E402


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _qkv(dtype=torch.float32, hkv=2, d=8, grad=True):
    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, 4, 16, d, generator=g).to(dtype).requires_grad_(grad)
    k, v = (torch.randn(2, hkv, 16, d, generator=g).to(dtype).requires_grad_(grad) for _ in range(2))
    return q, k, v


def _run(fn, q, k, v):
    out = fn(q, k, v)
    return out.detach(), torch.autograd.grad(out, (q, k, v), torch.ones_like(out) / out.numel())


def _same(a, b):
    return a.dtype == b.dtype and torch.equal(a.view(-1).view(torch.uint8), b.view(-1).view(torch.uint8))


@pytest.mark.parametrize("backend", ["inductor", "aot_eager"])
def test_emulated_op_compiles_to_eager_bits(backend):
    q, k, v = _qkv(torch.bfloat16)

    def f(q, k, v):
        return ft.attention(q, k, v, "fa2:bf16", is_causal=True, enable_gqa=True, block_q=4, block_kv=8) * 2

    out, grads = _run(f, q, k, v)
    cout, cgrads = _run(torch.compile(f, backend=backend, fullgraph=True), q, k, v)
    assert _same(out, cout) and all(_same(a, b) for a, b in zip(grads, cgrads))
    other, _ = _run(lambda q, k, v: ft.attention(q, k, v, "fa2:bf16", is_causal=False, enable_gqa=True) * 2, q, k, v)
    assert not torch.equal(other, cout)  # the comparison can fail: another mask gives other bits


def test_emulated_ops_pass_opcheck():
    q, k, v = _qkv(torch.float64)
    handle = ft._handle(ft.as_policy("fa2:bf16"), "flash", ())
    torch.library.opcheck(ft._op_forward, (q, k, v, handle, True, None, True))
    out, out64, lse = ft._op_forward(q, k, v, handle, True, None, True)
    assert out64.data_ptr() != out.data_ptr()  # float64: the op's outputs do not alias each other
    saved = [t.detach() for t in (q, k, v, out64, lse)]  # the backward op is once-differentiable
    torch.library.opcheck(ft._op_backward, (torch.ones_like(out).detach(), *saved, handle, True, None))


def _model(implementation="fadev", hidden=64):
    config = LlamaConfig(vocab_size=300, hidden_size=hidden, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, attn_implementation=implementation, dtype=torch.float32)


def _step(model, ids):
    model.zero_grad(set_to_none=True)
    out = model(ids, labels=ids)
    out.loss.backward()
    return out.logits.detach(), [p.grad.clone() for p in model.parameters()]


def test_hf_model_compiles_without_breaks_to_eager_bits():
    model = _model()
    ids = torch.randint(0, 300, (2, 12), generator=torch.Generator().manual_seed(1))
    with hf.use("fa2:bf16"):
        logits, grads = _step(model, ids)
        explained = torch._dynamo.explain(model)(ids, labels=ids)
        assert explained.graph_break_count == 0 and explained.graph_count == 1, explained.break_reasons
        torch._dynamo.reset()
        compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
        clogits, cgrads = _step(compiled, ids)
    assert torch.equal(logits, clogits) and all(torch.equal(a, b) for a, b in zip(grads, cgrads))
    with hf.use("golden"):  # another setting: dynamo's guard on it recompiles, so the compiled model follows it
        golden, _ = _step(model, ids)
        assert torch.equal(_step(compiled, ids)[0], golden) and not torch.equal(golden, logits)
    assert torch.equal(_step(compiled, ids)[0], _step(_model("sdpa"), ids)[0])  # outside use: transformers' sdpa


def test_hf_settings_carry_their_kernel_handle():
    """A use() block's setting names its emulated kernel by handle when it is made, outside any compiled region (the
    compiled attention passes that int: torch 2.11's dynamo cannot make the Policy, a frozen dataclass, the constant
    the handle is looked up with -- the two tests above failed there before); the handle is the kernel fadev.torch
    runs for the same policy, and the native and sdpa settings have none."""
    from fadev.policy import Policy
    setting = hf._setting("fa2:bf16", "flash", {})  # what use("fa2:bf16") holds
    assert isinstance(setting.handle, int) and setting.policy == Policy.fa2("bf16")
    assert ft._KERNELS[setting.handle] == ft._Kernel.make(Policy.fa2("bf16"), "flash", {})
    assert setting.handle == ft._handle(Policy.fa2("bf16"), "flash", ())
    other = hf._setting("paper:bf16", "flash", {"block_q": 32})
    assert other.handle == ft._handle(Policy.paper("bf16"), "flash", (("block_q", 32),)) != setting.handle
    assert hf.DEFAULT.handle is None and hf._setting(None, "native", {}).handle is None


def test_hf_use_block_counts_compiled_calls():
    model = torch.compile(_model(), backend="aot_eager", fullgraph=True)
    ids = torch.randint(0, 300, (1, 8), generator=torch.Generator().manual_seed(2))
    with warnings.catch_warnings():
        warnings.simplefilter("error", hf.UnusedBlockWarning)
        for _ in range(2):  # traced, then replayed: neither warns that no attention ran
            with hf.use("fa2:bf16"):
                model(ids)
    with pytest.warns(hf.UnusedBlockWarning):  # the warning can fire: a block without a fadev model
        with hf.use("fa2:bf16"):
            torch.compile(_model("sdpa"), backend="aot_eager")(ids)


def test_native_op_graph_and_binding_calls():
    """No graph break around fadev::native_attention, its fake shapes, and the binding called as in eager."""
    q, k, v = _qkv(torch.bfloat16, d=64)

    def f(q, k, v):
        return tn.native_attention(q, k, v, is_causal=True, enable_gqa=True) + 1

    eager, compiled = [], []
    with tn._dry_run(eager):
        out = f(q, k, v)
        out.backward(torch.ones_like(out))
    with tn._dry_run(compiled):
        explained = torch._dynamo.explain(f)(q, k, v)
        assert explained.graph_break_count == 0 and explained.graph_count == 1, explained.break_reasons
        torch._dynamo.reset()
        cout = torch.compile(f, backend="aot_eager", fullgraph=True)(q, k, v)
        cout.backward(torch.ones_like(cout))
    assert cout.shape == out.shape and cout.dtype == out.dtype
    strip = [tuple(a for a in call if not isinstance(a, int)) for call in compiled[-2:]]  # pointers differ
    assert strip == [tuple(a for a in call if not isinstance(a, int)) for call in eager]
    assert compiled[-2][5] == compiled[-1][10] == (2, 4, 2, 16, 16, 64)


def test_hf_native_model_has_no_graph_break():
    """A bf16 Llama with use(kernel="native") traces to one graph (the launches recorded, so no values to compare:
    test_cuda_hf.py compares them on the GPU), and the compiled model calls the binding as the eager one does."""
    model = _model(hidden=256).to(torch.bfloat16)  # head dim 64
    ids = torch.randint(0, 300, (2, 12), generator=torch.Generator().manual_seed(4))
    eager, compiled = [], []
    with hf.use(kernel="native"):
        with tn._dry_run(eager):
            model(ids)
        with tn._dry_run(compiled):
            explained = torch._dynamo.explain(model)(ids)
            assert explained.graph_break_count == 0 and explained.graph_count == 1, explained.break_reasons
            torch._dynamo.reset()
            torch.compile(model, backend="aot_eager", fullgraph=True)(ids)
    assert len(eager) == 2 and len(compiled) >= 2  # one call per layer
    # the same shapes, call specs and options; the layouts differ: eager reads the model's (B, N, H, D) projections
    # in place, the compiled op takes contiguous tensors (its fake kernel says so)
    assert [c[5:7] + (c[7][:5],) for c in compiled[-2:]] == [c[5:7] + (c[7][:5],) for c in eager]
    assert eager[0][5] == (2, 4, 2, 12, 12, 64) and eager[0][6][4] is True  # grouped-query heads, causal
    assert eager[0][7][5][:3] == (12 * 4 * 64, 64, 4 * 64) and compiled[-2][7][5][:3] == (4 * 12 * 64, 12 * 64, 64)
