"""fadev.hf: a tiny Llama (random init, no download) with attn_implementation="fadev" in float64.

Under use("golden") its logits and gradients equal an independent float64 reference attention's (and
PyTorch SDPA's) to 1e-12, causal, grouped-query, left and right padding; under use("fa2:bf16") every
attention layer's output has the bits of fadev.torch.attention on the same inputs, and the model the bits
of the same model run through transformers' sdpa attention under fadev.torch.patch_sdpa. The kernel
choice (use, nesting, threads, the default), refusals that name their argument, and what can be tested
of the native kernel and the SDPA flash registration without a GPU."""
import threading

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import fadev  # noqa: E402
import fadev.hf as hf  # noqa: E402
import fadev.torch_native as tn  # noqa: E402
from transformers import AttentionInterface, AutoModelForCausalLM, LlamaConfig  # noqa: E402
from fadev.monitor import reference_attention  # noqa: E402
from transformers.masking_utils import AttentionMaskInterface, eager_mask, sdpa_mask  # noqa: E402

N, VOCAB = 12, 300
TOL = 1e-12  # float64: relative to the largest magnitude


def _config(**extra):
    # a fresh config per model: from_config writes the implementation into the config it is given
    return LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, **extra)


def _reference_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """fadev's fp64 reference softmax(q k^T scaling + mask) v (fadev.monitor.reference_attention; eager itself
    rounds the softmax to float32); a query that sees no key gets 0, as SDPA gives."""
    seen = None if attention_mask is None else attention_mask[:, :, :, :key.shape[-2]] == 0
    out = reference_attention(query, key, value, attn_mask=seen, scale=scaling)
    return out.to(query.dtype).transpose(1, 2).contiguous(), None


AttentionInterface.register("fp64_reference", _reference_attention)
AttentionMaskInterface.register("fp64_reference", eager_mask)
RECORDED = []


def _recording(module, query, key, value, attention_mask, **kwargs):
    out = hf.attention_forward(module, query, key, value, attention_mask, **kwargs)
    RECORDED.append((query, key, value, attention_mask, kwargs, out[0]))
    return out


AttentionInterface.register("fadev_recorded", _recording)
AttentionMaskInterface.register("fadev_recorded", sdpa_mask)


def _models(*names, **extra):
    torch.manual_seed(0)
    first = AutoModelForCausalLM.from_config(_config(**extra), attn_implementation=names[0], dtype=torch.float64)
    models = [first]
    for name in names[1:]:
        m = AutoModelForCausalLM.from_config(_config(**extra), attn_implementation=name, dtype=torch.float64)
        m.load_state_dict(first.state_dict())
        models.append(m)
    return models


def _ids(batch=2):
    return torch.randint(0, VOCAB, (batch, N), generator=torch.Generator().manual_seed(1))


def _padding():
    """Row 0 padded on the left (3 tokens), row 1 on the right (3 tokens)."""
    mask = torch.ones(2, N, dtype=torch.long)
    mask[0, :3] = 0
    mask[1, N - 3:] = 0
    return mask


def _run(model, ids, mask=None):
    """Logits and the gradient of every parameter for a loss over the unpadded positions."""
    model.zero_grad()
    logits = model(ids, attention_mask=mask).logits
    keep = torch.ones(ids.shape, dtype=torch.bool) if mask is None else mask.bool()
    (logits[keep] * torch.linspace(-1, 1, VOCAB, dtype=torch.float64)).sum().backward()
    return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _rel(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


def _worst(run_a, run_b, keep):
    """Largest relative difference of logits (at ``keep``) and of any parameter's gradient."""
    (la, ga), (lb, gb) = run_a, run_b
    return max([_rel(la[keep], lb[keep])] + [_rel(ga[n], gb[n]) for n in gb if gb[n].abs().max() > 0])


def test_registered_and_idempotent():
    assert AttentionInterface._global_mapping["fadev"] is hf.attention_forward
    assert AttentionMaskInterface._global_mapping["fadev"] is hf.mask
    hf.register()
    hf.register("fadev")
    assert AttentionInterface._global_mapping["fadev"] is hf.attention_forward
    with pytest.raises(TypeError, match="name"):
        hf.register("")


def test_mask_skips_only_where_transformers_does():
    """hf.mask is transformers' sdpa_mask except that a causal mask without padding is None under torch.compile
    too: None where sdpa_mask gives None in eager, sdpa_mask's own tensor wherever a padding mask, another mask
    function or a sliding window within reach needs one."""
    from transformers.masking_utils import causal_mask_function, sliding_window_causal_mask_function
    assert hf.mask(2, 16, 16) is None and sdpa_mask(2, 16, 16) is None
    assert hf.mask(2, 1, 40, q_offset=39, kv_offset=0) is None
    compiled = torch.compile(lambda: hf.mask(2, 16, 16), backend="eager", fullgraph=True)
    assert compiled() is None
    pad = torch.ones(2, 16, dtype=torch.bool)
    pad[0, :3] = False
    for kw in (dict(attention_mask=pad), dict(mask_function=sliding_window_causal_mask_function(4), local_size=4),
               dict(q_offset=torch.tensor(0))):
        want = sdpa_mask(2, 16, 16, **kw)
        got = hf.mask(2, 16, 16, **kw)
        assert (got is None) == (want is None) and (got is None or torch.equal(got, want)), kw
    assert hf.mask(2, 16, 16, mask_function=causal_mask_function) is None


@pytest.mark.parametrize("padded", [False, True], ids=["causal", "padded"])
def test_golden_equals_fp64_references(padded):
    fadev_model, ref_model, sdpa_model = _models("fadev", "fp64_reference", "sdpa")
    ids, mask = _ids(), (_padding() if padded else None)
    keep = torch.ones(ids.shape, dtype=torch.bool) if mask is None else mask.bool()
    with hf.use("golden"):
        got = _run(fadev_model, ids, mask)
    ref = _run(ref_model, ids, mask)
    assert _worst(got, ref, keep) <= TOL
    # SDPA gives 0 to the padded queries too: equal at every position, not only the kept ones
    assert _worst(got, _run(sdpa_model, ids, mask), torch.ones(ids.shape, dtype=torch.bool)) <= TOL
    # the same comparison fails for a low-precision policy (the test can fail)
    with hf.use("fa2:bf16"):
        low = _run(fadev_model, ids, mask)
    assert _worst(low, ref, keep) > 1e-6


@pytest.mark.parametrize("padded", [False, True], ids=["causal", "padded"])
def test_fa2_layers_have_fadev_torch_bits(padded):
    (model,) = _models("fadev_recorded")
    ids, mask = _ids(), (_padding() if padded else None)
    RECORDED.clear()
    with hf.use("fa2:bf16", block_kv=4):
        model(ids, attention_mask=mask)
    assert len(RECORDED) == 2
    for q, k, v, attention_mask, kwargs, out in RECORDED:
        assert q.shape[1] == 4 and k.shape[1] == 2  # grouped-query heads reach fadev as they are
        if not padded:
            assert attention_mask is None  # causal without padding: the is_causal path
            want = fadev.torch.attention(q, k, v, "fa2:bf16", is_causal=True, scale=kwargs["scaling"],
                                         enable_gqa=True, block_kv=4)
            assert torch.equal(out, want.transpose(1, 2))
            continue
        # padded: row 0 (left padding) is causal on its last 9 tokens, its first 3 queries see no key
        want0 = fadev.torch.attention(q[:1, :, 3:], k[:1, :, 3:], v[:1, :, 3:], "fa2:bf16", is_causal=True,
                                      scale=kwargs["scaling"], enable_gqa=True, block_kv=4)
        assert torch.equal(out[0, 3:], want0[0].transpose(0, 1))
        assert not out[0, :3].any()
        # row 1 (right padding): causal on its first 9 tokens; the padded queries see those 9 keys
        want1 = fadev.torch.attention(q[1:, :, :9], k[1:, :, :9], v[1:, :, :9], "fa2:bf16", is_causal=True,
                                      scale=kwargs["scaling"], enable_gqa=True, block_kv=4)
        rest = fadev.torch.attention(q[1:, :, 9:], k[1:, :, :9], v[1:, :, :9], "fa2:bf16",
                                     scale=kwargs["scaling"], enable_gqa=True, block_kv=4)
        assert torch.equal(out[1], torch.cat([want1[0], rest[0]], dim=1).transpose(0, 1))


def test_fa2_model_equals_sdpa_route_under_patch_sdpa():
    """use("fa2:bf16") and transformers' own sdpa attention routed through fadev.torch.patch_sdpa: the same
    logits and parameter gradients, bit for bit (two routes to fadev.torch.attention)."""
    fadev_model, sdpa_model = _models("fadev", "sdpa")
    ids = _ids()
    with hf.use("fa2:bf16"):
        la, ga = _run(fadev_model, ids)
    with fadev.torch.patch_sdpa("fa2:bf16") as patch:
        lb, gb = _run(sdpa_model, ids)
    assert patch.calls == 2
    assert torch.equal(la, lb) and all(torch.equal(ga[n], gb[n]) for n in ga)


def test_default_is_plain_sdpa():
    """Outside any use block (and under use(kernel="sdpa")) "fadev" is transformers' sdpa attention: the same
    bits as an sdpa model, and SDPA-level patches see the calls."""
    fadev_model, sdpa_model = _models("fadev", "sdpa")
    ids = _ids()
    assert hf.current() == hf.DEFAULT and hf.current().kernel == "sdpa"
    want = sdpa_model(ids).logits
    assert torch.equal(fadev_model(ids).logits, want)
    with hf.use(kernel="sdpa"), fadev.torch.patch_sdpa("golden") as patch:
        fadev_model(ids)
    assert patch.calls == 2


def test_non_causal_and_single_query():
    """A module with is_causal False attends to every key; one query (decoding) sees every key."""
    class Module:
        is_causal = False

    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, h, 5, 8, generator=g, dtype=torch.float64) for h in (4, 2, 2))
    with hf.use("golden"):
        full, _ = hf.attention_forward(Module(), q, k, v, None, scaling=0.3)
        Module.is_causal = True
        causal, _ = hf.attention_forward(Module(), q, k, v, None, scaling=0.3)
        one, _ = hf.attention_forward(Module(), q[:, :, -1:], k, v, None, scaling=0.3)
    for got, c in ((full, False), (causal, True)):
        want, _ = _reference_attention(None, q, k, v, None if not c else
                                       torch.ones(5, 5, dtype=torch.bool).triu(1).double()[None, None], scaling=0.3)
        assert _rel(got, want) <= TOL
    assert _rel(one, full[:, -1:]) <= TOL
    assert _rel(causal[:, :-1], full[:, :-1]) > 1e-3  # causal differs from full except in the last row


def _call(mask=None, dropout=0.0, **kwargs):
    class Module:
        is_causal = True

    g = torch.Generator().manual_seed(5)
    q = torch.randn(2, 4, 6, 8, generator=g, dtype=torch.float64)
    k = torch.randn(2, 2, 6, 8, generator=g, dtype=torch.float64)
    with hf.use("golden"):
        return hf.attention_forward(Module(), q, k, k, mask, dropout=dropout, scaling=0.3, **kwargs)


@pytest.mark.parametrize("mask, match", [
    (sdpa_mask(batch_size=1, q_length=6, kv_length=6, allow_is_causal_skip=False,
               mask_function=transformers.masking_utils.sliding_window_causal_mask_function(2)), "batch row 0"),
    (torch.randn(2, 1, 6, 6, dtype=torch.float64), "additive bias"),
    (torch.ones(2, 4, 6, 6, dtype=torch.bool).tril().logical_or(torch.arange(4)[None, :, None, None] == 1),
     "differs between heads"),
    (torch.ones(2, 1, 6, 6, dtype=torch.int64), "dtype"),
    (torch.ones(2, 1, 5, 6, dtype=torch.bool), "does not broadcast"),
])
def test_masks_fadev_cannot_compute_are_refused(mask, match):
    with pytest.raises(ValueError, match=match) as raised:
        _call(mask)
    assert "attention_mask" in str(raised.value)


def test_all_visible_and_causal_masks_are_computed():
    full, _ = _call(torch.ones(2, 1, 6, 6, dtype=torch.bool))
    causal_bool, _ = _call(torch.ones(6, 6, dtype=torch.bool).tril()[None, None])
    causal_float, _ = _call(torch.zeros(6, 6, dtype=torch.float64).masked_fill(
        torch.ones(6, 6, dtype=torch.bool).triu(1), torch.finfo(torch.float64).min)[None, None])
    assert torch.equal(causal_bool, causal_float)
    assert not torch.equal(full, causal_bool)


def test_dropout_bias_softcap_and_sinks_refused():
    with pytest.raises(ValueError, match="dropout"):
        _call(dropout=0.1)
    for name in ("position_bias", "softcap", "s_aux"):
        with pytest.raises(ValueError, match=name):
            _call(**{name: torch.zeros(1, 4, 6, 6) if name == "position_bias" else 30.0})
    _call(softcap=None)  # what a model without the feature passes
    (model,) = _models("fadev", attention_dropout=0.1)
    with hf.use("golden"):
        with pytest.raises(ValueError, match="dropout"):
            model.train()(_ids())
        model.eval()(_ids())  # no dropout in eval mode


@pytest.mark.parametrize("args, kwargs, error, match", [
    ((), {"kernel": "bogus"}, ValueError, "kernel"),
    ((), {"kernel": "flash"}, ValueError, "policy"),
    (("golden",), {"kernel": "native"}, ValueError, "policy"),
    (("golden",), {"kernel": "sdpa"}, ValueError, "policy"),
    ((), {"kernel": "native", "block_q": "64"}, TypeError, "block_q"),
    ((), {"kernel": "native", "exp": "exp2"}, TypeError, "exp"),
    ((), {"kernel": "native", "deterministic": 1}, TypeError, "deterministic"),
    ((), {"kernel": "sdpa", "block_q": 64}, TypeError, "block_q"),
    (("golden",), {"block_size": 4}, TypeError, "block_size"),
    (("golden",), {"kernel": "baseline", "block_q": 4}, ValueError, "block_q"),
    (("nonsense",), {}, ValueError, "policy"),
])
def test_use_rejects_bad_arguments(args, kwargs, error, match):
    with pytest.raises(error, match=match):
        hf.use(*args, **kwargs)


@pytest.mark.filterwarnings("ignore::fadev.hf.UnusedBlockWarning")  # its blocks run no model, on purpose
def test_use_nests_restores_and_is_per_thread():
    outer, inner = hf.use("golden"), hf.use("fa2:bf16", kernel="baseline")
    seen = []
    with outer as s1:
        assert hf.current() is s1 and s1.kernel == "flash" and s1.policy.name == "golden"
        with inner:
            assert hf.current().kernel == "baseline" and hf.current().policy.name == "fa2(bf16)"
            with outer:  # one object entered twice
                assert hf.current() is s1
            assert hf.current().kernel == "baseline"
            thread = threading.Thread(target=lambda: seen.append(hf.current()))
            thread.start()
            thread.join()
        assert hf.current() is s1
        with pytest.raises(RuntimeError), inner:
            raise RuntimeError
        assert hf.current() is s1
    assert hf.current() is hf.DEFAULT and seen == [hf.DEFAULT]


def test_native_needs_cuda_half_tensors():
    q = torch.randn(1, 2, 4, 64, dtype=torch.float64)
    with pytest.raises(TypeError, match="query.*float16 or bfloat16"):
        tn.native_attention(q, q, q)
    h = q.to(torch.bfloat16)
    with pytest.raises(ValueError, match="query.*CUDA"):
        tn.native_attention(h, h, h)
    with pytest.raises(TypeError, match="key.*Tensor"):
        tn.native_attention(h, [1], h)
    (model,) = _models("fadev")
    with hf.use(kernel="native"), pytest.raises(TypeError, match="query.*float16 or bfloat16"):
        model(_ids())
    with pytest.raises(ValueError, match="mma must be one of sync, wgmma, auto, got 'hopper'"):
        hf.use(kernel="native", mma="hopper")
    assert dict(hf.use(kernel="native", mma="wgmma").setting.tiling) == {"mma": "wgmma"}
    with pytest.raises(ValueError, match="mma must be one of sync, wgmma"):
        tn.native_attention(h, h, h, mma=1)


def test_sdpa_flash_registration_without_gpu():
    if not hf.has_sdpa_flash_registry():
        with pytest.raises(RuntimeError, match="register_flash_attention_impl"):
            hf.register_sdpa_flash()
        return
    assert "fadev" in torch.nn.attention.list_flash_attention_impls()
    with pytest.raises(TypeError, match="block_q"):
        hf.register_sdpa_flash(block_q=64.0)
    with pytest.raises(TypeError, match="name"):
        hf.register_sdpa_flash(None)
    with pytest.raises(TypeError, match="deterministic"):
        hf.register_sdpa_flash(deterministic="no")
    if fadev.cuda_available():
        pytest.skip("a GPU is present: tests/test_cuda_hf.py activates the implementation")
    with pytest.raises(RuntimeError, match="no usable GPU"):
        torch.nn.attention.activate_flash_attention_impl("fadev")
    assert torch.nn.attention.current_flash_attention_impl() is None


def test_cache_shaped_masks():
    """With a KV cache: one new query over padded keys (decoding) is computed, and equals the fp64 reference;
    a chunk of new queries after cached ones (a bottom-right causal chain) is refused by name."""
    class Module:
        is_causal = True

    g = torch.Generator().manual_seed(7)
    q, k = torch.randn(2, 4, 6, 8, generator=g, dtype=torch.float64), torch.randn(2, 2, 9, 8, generator=g,
                                                                                 dtype=torch.float64)
    padding = torch.ones(2, 9, dtype=torch.bool)
    padding[0, :2] = False
    decode = sdpa_mask(batch_size=2, q_length=1, kv_length=9, q_offset=8, attention_mask=padding,
                       allow_is_causal_skip=False)
    with hf.use("golden"):
        got, _ = hf.attention_forward(Module(), q[:, :, -1:], k, k, decode, scaling=0.3)
    want, _ = _reference_attention(None, q[:, :, -1:], k, k, (~decode).double(), scaling=0.3)
    assert _rel(got, want) <= TOL
    chunk = sdpa_mask(batch_size=2, q_length=6, kv_length=9, q_offset=3, allow_is_causal_skip=False)
    with hf.use("golden"), pytest.raises(ValueError, match="attention_mask: batch row 0"):
        hf.attention_forward(Module(), q, k, k, chunk, scaling=0.3)


def test_autocast_casts_like_sdpa():
    """Under torch.autocast (bf16 on the CPU) a Llama hands attention float32 q, k, v (after the bf16 projections
    and the float32 rotary embedding); SDPA is one of autocast's bf16 ops, and "fadev" casts them as PyTorch's
    SDPA (and patch_sdpa) does: under use("golden") (no input rounding of its own) the bits of the sdpa model
    under patch_sdpa("golden"), and the attention output in bf16."""
    torch.manual_seed(0)
    first = AutoModelForCausalLM.from_config(_config(), attn_implementation="fadev", dtype=torch.float32)
    second = AutoModelForCausalLM.from_config(_config(), attn_implementation="sdpa", dtype=torch.float32)
    second.load_state_dict(first.state_dict())
    ids = _ids()
    with torch.autocast("cpu", dtype=torch.bfloat16), hf.use("golden"):
        la = first(ids).logits
    with torch.autocast("cpu", dtype=torch.bfloat16), fadev.torch.patch_sdpa("golden") as patch:
        lb = second(ids).logits
    assert patch.calls == 2 and la.dtype == lb.dtype
    assert torch.equal(la, lb)
