"""fadev.monitor through fadev.torch.shadow(sample_every=...): the float64 reference reads SDPA's arguments as
SDPA does (masks, causal, grouped heads, scale, ranks), the logged deviation is exact for a float64 model and
shows a wrong kernel (a known perturbation, an fp8 candidate policy), the model's outputs and gradients are
bit-identical with and without the monitor, the sampling schedule, layer names, CSV and TensorBoard logs, no
references kept, every documented error; and on a CUDA device, the same without host synchronisation."""
import contextlib
import csv
import gc
import math
import weakref

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fadev
import fadev.monitor
import fadev.torch as ft
import helpers
from fadev.monitor import COLUMNS, METRICS, Monitor, _sampled_rows, reference_rows

F64 = torch.float64
EPS = float(np.finfo(np.float64).eps)
FP32_U = 2.0 ** -24
needs_torch_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device for torch")


def randn(*shape, seed, dtype=F64, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=F64).to(device=device, dtype=dtype)


class Attention(nn.Module):
    """A self-attention layer calling SDPA on (B, L, dim) input with ``sdpa`` keyword arguments."""

    def __init__(self, dim=16, heads=4, kv_heads=4, **sdpa):
        super().__init__()
        self.heads, self.kv_heads, self.sdpa = heads, kv_heads, sdpa
        self.head_dim = dim // heads
        self.q = nn.Linear(dim, dim, dtype=F64)
        self.kv = nn.Linear(dim, 2 * kv_heads * self.head_dim, dtype=F64)
        self.o = nn.Linear(dim, dim, dtype=F64)

    def forward(self, x):
        b, n, _ = x.shape
        q = self.q(x).view(b, n, self.heads, self.head_dim).transpose(1, 2)
        k, v = self.kv(x).view(b, n, 2 * self.kv_heads, self.head_dim).transpose(1, 2).chunk(2, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, **self.sdpa)
        return x + self.o(out.transpose(1, 2).reshape(b, n, -1))


def stack(layers=2, **sdpa):
    torch.manual_seed(5)
    return nn.Sequential(*[Attention(**sdpa) for _ in range(layers)])


def train(model, ctx, steps=3, seed=6, length=10):
    """(losses, parameters, gradients) after ``steps`` SGD steps of ``model`` inside ``ctx``."""
    x, y = randn(2, length, 16, seed=seed), randn(2, length, 16, seed=seed + 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    losses = []
    with ctx:
        for _ in range(steps):
            opt.zero_grad()
            loss = ((model(x) - y) ** 2).mean()
            loss.backward()
            opt.step()
            losses.append(loss.detach())
    return (torch.stack(losses), {n: p.detach().clone() for n, p in model.named_parameters()},
            {n: p.grad.clone() for n, p in model.named_parameters()})


def all_equal(a, b):
    return all(torch.equal(a[n], b[n]) for n in a) and a.keys() == b.keys()


@contextlib.contextmanager
def perturbed_sdpa(delta):
    """SDPA whose output is off by exactly ``delta`` everywhere (a deliberately wrong kernel)."""
    original = F.scaled_dot_product_attention
    F.scaled_dot_product_attention = lambda *args, **kwargs: original(*args, **kwargs) + delta
    try:
        yield
    finally:
        F.scaled_dot_product_attention = original


# ---------------------------------------------------------------- the reference

def _bool_mask(shape, seed):
    mask = torch.rand(*shape, generator=torch.Generator().manual_seed(seed)) < 0.6
    if shape[-2] > 1:
        mask[..., 1, :] = False  # a row that sees no key: SDPA gives 0
    return mask


def _float_mask(shape, seed):
    mask = randn(*shape, seed=seed)
    return mask.masked_fill(torch.rand(*shape, generator=torch.Generator().manual_seed(seed)) < 0.3, -math.inf)


CASES = {  # name: (q shape, k shape, v shape, sdpa kwargs)
    "plain": ((2, 3, 7, 5), (2, 3, 9, 5), (2, 3, 9, 5), {}),
    "causal": ((1, 2, 8, 4), (1, 2, 8, 4), (1, 2, 8, 4), {"is_causal": True}),
    "causal_fewer_queries": ((1, 2, 5, 4), (1, 2, 9, 4), (1, 2, 9, 4), {"is_causal": True}),
    "causal_more_queries": ((1, 2, 9, 4), (1, 2, 5, 4), (1, 2, 5, 4), {"is_causal": True}),
    "bool_mask": ((2, 2, 7, 4), (2, 2, 9, 4), (2, 2, 9, 4), {"attn_mask": _bool_mask((7, 9), 1)}),
    "padding_mask": ((2, 2, 7, 4), (2, 2, 7, 4), (2, 2, 7, 4), {"attn_mask": _bool_mask((2, 1, 1, 7), 2)}),
    "float_mask": ((2, 2, 7, 4), (2, 2, 9, 4), (2, 2, 9, 4), {"attn_mask": _float_mask((2, 2, 7, 9), 3)}),
    "hf_min_mask": ((1, 2, 6, 4), (1, 2, 6, 4), (1, 2, 6, 4),
                    {"attn_mask": torch.full((6, 6), torch.finfo(F64).min, dtype=F64).triu(1)[None, None]}),
    "gqa_causal": ((2, 6, 7, 4), (2, 2, 7, 4), (2, 2, 7, 4), {"is_causal": True, "enable_gqa": True}),
    "gqa_head_mask": ((2, 6, 7, 4), (2, 3, 7, 4), (2, 3, 7, 4),
                      {"attn_mask": _float_mask((6, 7, 7), 5), "enable_gqa": True}),
    "one_kv_head_broadcast": ((1, 4, 6, 4), (1, 1, 6, 4), (1, 1, 6, 4), {}),
    "scale_and_value_dim": ((1, 2, 6, 4), (1, 2, 8, 4), (1, 2, 8, 3), {"scale": 0.3}),
    "rank2": ((7, 4), (9, 4), (9, 4), {"is_causal": True}),
    "rank5": ((2, 2, 3, 6, 4), (2, 2, 3, 6, 4), (2, 2, 3, 6, 4), {"attn_mask": _bool_mask((6, 6), 4)}),
}


@pytest.mark.parametrize("chunked", [False, True], ids=["whole", "head_by_head"])
@pytest.mark.parametrize("case", CASES)
def test_reference_rows_is_sdpa_in_float64(case, chunked, monkeypatch):
    if chunked:  # one key/value head at a time, as for a long context
        monkeypatch.setattr(fadev.monitor, "CHUNK_BYTES", 1)
    qs, ks, vs, kwargs = CASES[case]
    q, k, v = randn(*qs, seed=10), randn(*ks, seed=11), randn(*vs, seed=12)
    out = F.scaled_dot_product_attention(q, k, v, **kwargs)
    kwargs = {n: x for n, x in kwargs.items() if n != "enable_gqa"}  # the reference groups heads by itself
    seen = set()
    for sample in range(3):
        rows, n, stride = _sampled_rows(qs[-2], 3, sample)
        assert n == len(range(qs[-2])[rows]) <= 3 and stride == math.ceil(qs[-2] / 3)
        seen |= set(range(qs[-2])[rows])
        ref = reference_rows(q, k, v, rows, **kwargs)
        assert ref.shape == out[..., rows, :].shape and ref.dtype == F64
        assert (ref - out[..., rows, :]).abs().max() <= 16 * EPS * max(1.0, out.abs().max()), case
        if "attn_mask" in kwargs or "is_causal" in kwargs:  # the case does exercise the mask
            unmasked = reference_rows(q, k, v, rows, scale=kwargs.get("scale"))
            assert (unmasked - out[..., rows, :]).abs().max() > 1e-3, case
    assert seen == set(range(qs[-2]))  # three samples cover every row


# ---------------------------------------------------------------- the verdict: exact, or shows the wrong kernel

def test_float64_model_is_exact_and_a_perturbed_kernel_shows():
    model = stack(is_causal=True)
    with ft.shadow(sample_every=1, rows=4) as exact:
        train(model, contextlib.nullcontext(), steps=2)
    assert len(exact.records) == 4 and exact.calls == 4
    for rec in exact.records:
        assert rec["max_abs"] <= 16 * EPS and 0 <= rec["rel_rms"] <= 16 * EPS and rec["nonfinite"] == 0, rec
    delta = 2.0 ** -20  # far below what anyone would see in a loss curve, far above float64's rounding
    model = stack(is_causal=True)
    with perturbed_sdpa(delta), ft.shadow(sample_every=1, rows=4) as wrong:  # the model's kernel is wrong
        train(model, contextlib.nullcontext(), steps=2)
    for rec in wrong.records:  # every element is off by delta, and the float64 kernel contributes ~1e-16
        assert abs(rec["max_abs"] - delta) <= 16 * EPS and abs(rec["mean_abs"] - delta) <= 16 * EPS, rec
        assert rec["rel_rms"] > 1e6 * max(r["rel_rms"] for r in exact.records)


def test_nonfinite_output_is_counted():
    q, k, v = randn(1, 2, 6, 4, seed=1), randn(1, 2, 6, 4, seed=2), randn(1, 2, 6, 4, seed=3)
    with perturbed_sdpa(math.nan), ft.shadow(sample_every=1, rows=6) as mon:
        F.scaled_dot_product_attention(q, k, v)
    (rec,) = mon.records
    assert rec["nonfinite"] == rec["n"] == 2 * 6 * 4 and math.isnan(rec["max_abs"]) and math.isnan(rec["rel_rms"])


def test_candidate_policy_deviation_is_the_kernels_against_golden():
    q, k, v = (randn(1, 2, 12, 8, seed=s) for s in (20, 21, 22))
    layer = Attention()  # only its name matters: SDPA is called inside its forward
    with ft.shadow(candidate="fa2:fp8_e4m3", sample_every=2, rows=5, model=nn.ModuleDict({"attn": layer})) as mon:
        layer.forward = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True)
        outs = [layer() for _ in range(3)]
    got = fadev.flash_attention(q.numpy(), k.numpy(), v.numpy(), "fa2:fp8_e4m3", causal=True)
    gold = fadev.golden_attention(q.numpy(), k.numpy(), v.numpy(), causal=True)
    assert all(np.array_equal(o.numpy(), got) for o in outs)  # the model ran the candidate
    assert [(r["call"], r["layer"], r["attention"]) for r in mon.records] == [(0, "attn", "fa2(fp8_e4m3) flash"),
                                                                              (2, "attn", "fa2(fp8_e4m3) flash")]
    for rec, offset in zip(mon.records, (0, 1)):
        d, g = got[..., offset::3, :] - gold[..., offset::3, :], gold[..., offset::3, :]
        assert (rec["row_offset"], rec["row_stride"], rec["rows"]) == (offset, 3, 4)
        want = (np.abs(d).max(), np.abs(d).mean(), np.sqrt((d ** 2).sum() / (g ** 2).sum()))
        assert np.allclose([rec["max_abs"], rec["mean_abs"], rec["rel_rms"]], want, rtol=1e-12, atol=0), rec
        assert rec["rel_rms"] > 2.0 ** -6  # fp8 E4M3 (3 mantissa bits): plainly not fp64


# ---------------------------------------------------------------- the monitor changes nothing

@pytest.mark.parametrize("sdpa", [{"is_causal": True}, {"kv_heads": 2, "enable_gqa": True}])
def test_outputs_and_gradients_are_bit_identical(sdpa):
    plain = train(stack(**sdpa), contextlib.nullcontext())
    for every in (1, 2):
        with ft.shadow(sample_every=every, rows=3) as mon:
            watched = train(stack(**sdpa), contextlib.nullcontext())
        assert torch.equal(plain[0], watched[0]) and all_equal(plain[1], watched[1]) and all_equal(plain[2], watched[2])
        assert len(mon.records) == 2 * (3 if every == 1 else 2)
    x = randn(2, 10, 16, seed=9)
    model = stack(**sdpa).eval()
    with torch.no_grad():
        want = model(x)
        with ft.shadow(sample_every=1) as mon:
            got = model(x)
    assert torch.equal(want, got) and len(mon.records) == 2


def test_hugging_face_llama_training_is_unchanged_and_layers_named():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))

    def run(ctx):
        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM._from_config(cfg, attn_implementation="sdpa")
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        losses = []
        with ctx:
            for _ in range(3):
                opt.zero_grad()
                loss = model(input_ids=ids, labels=ids).loss
                loss.backward()
                opt.step()
                losses.append(loss.detach())
        return torch.stack(losses), {n: p.detach().clone() for n, p in model.named_parameters()}

    losses, params = run(contextlib.nullcontext())
    with ft.shadow(sample_every=2, rows=4) as mon:
        losses_m, params_m = run(contextlib.nullcontext())
    assert torch.equal(losses, losses_m) and all_equal(params, params_m)
    df = mon.to_dataframe()
    assert list(df["layer"]) == ["model.layers.0.self_attn", "model.layers.1.self_attn"] * 2
    assert set(df["module_type"]) == {"LlamaAttention"} and list(df["step"]) == [0, 0, 2, 2]
    assert set(df["q_shape"]) == {(2, 4, 16, 8)} and set(df["k_shape"]) == {(2, 2, 16, 8)}
    # float32 attention against float64: a few float32 roundings, never zero, never float64-exact
    assert (df["rel_rms"] < 64 * FP32_U).all() and (df["rel_rms"] > 1e-3 * FP32_U).all()


# ---------------------------------------------------------------- schedule, names, logs, memory

def test_schedule_steps_rows_and_names():
    model = stack(is_causal=True)
    x = randn(2, 10, 16, seed=3)
    with ft.shadow(sample_every=3, rows=4, model=model) as mon:
        for i in range(7):
            if i == 6:
                mon.step = 42
            model(x)
        F.scaled_dot_product_attention(x[:, None], x[:, None], x[:, None])  # outside any module
    assert mon.calls == 15
    recs = mon.records
    assert [(r["layer"], r["call"], r["step"]) for r in recs[:-1]] == [
        ("0", 0, 0), ("1", 0, 0), ("0", 3, 3), ("1", 3, 3), ("0", 6, 42), ("1", 6, 42)]
    assert [(r["row_offset"], r["rows"], r["row_stride"], r["n"]) for r in recs[:-1:2]] == [
        (0, 4, 3, 2 * 4 * 4 * 4), (1, 3, 3, 2 * 4 * 3 * 4), (2, 3, 3, 2 * 4 * 3 * 4)]
    assert recs[-1]["layer"].startswith("test_schedule_steps_rows_and_names (test_monitor.py:")
    assert recs[-1]["module_type"] is None and recs[-1]["call"] == 0
    summary = mon.summary()
    assert list(summary.index) == ["0", "1", recs[-1]["layer"]] and list(summary["checks"]) == [3, 3, 1]
    assert summary.loc["0", "max_abs"] == max(r["max_abs"] for r in recs if r["layer"] == "0")
    import pandas as pd
    with pd.option_context("display.max_columns", 3, "display.max_rows", 2, "display.width", 60):
        shown = [repr(summary), str(summary)]
    for text in shown:  # whole in a terminal, whatever pandas' display limits: no "..." cuts
        assert "..." not in text and all(c in text for c in summary.columns) and recs[-1]["layer"] in text
        assert len(text.splitlines()) == 1 + len(summary) + 1  # header, index name, one line per layer
    with pd.option_context("display.max_columns", 3):
        assert "..." in repr(pd.DataFrame(summary))  # the plain frame is cut: the check above can fail


def test_csv_and_tensorboard_logs(tmp_path):
    path, logs = tmp_path / "attention.csv", tmp_path / "tb"
    for run in range(2):  # the second run appends, without a second header
        with ft.shadow(sample_every=2, rows=3, csv=path, log_dir=logs) as mon:
            train(stack(), contextlib.nullcontext(), steps=3)
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 2 * len(mon.records) == 2 * 4 and list(rows[0]) == list(COLUMNS)
    for row, rec in zip(rows[4:], mon.records):
        assert row["layer"] == rec["layer"] and int(row["step"]) == rec["step"] and row["q_shape"] == "2x4x10x4"
        assert [float(row[m]) for m in METRICS] == [rec[m] for m in METRICS]
    event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    acc = event_accumulator.EventAccumulator(str(logs), size_guidance={"scalars": 0})
    acc.Reload()
    assert set(acc.Tags()["scalars"]) == {f"attention/{layer}/{m}" for layer in ("0", "1") for m in METRICS}
    # both runs wrote into the directory; each logged steps 0 and 2
    events = acc.Scalars("attention/1/rel_rms")
    assert sorted(e.step for e in events) == [0, 0, 2, 2]
    assert {e.value for e in events} == {np.float32(r["rel_rms"]) for r in mon.records if r["layer"] == "1"}


def test_no_reference_to_the_model_or_its_tensors_is_kept():
    with ft.shadow(sample_every=1, rows=2) as mon:
        model = stack(kv_heads=2, enable_gqa=True)
        x = randn(2, 10, 16, seed=4).requires_grad_()
        out = model(x)
        out.sum().backward()
        refs = [weakref.ref(t) for t in (model, x, out, model[0].q.weight)]
        del model, x, out
        gc.collect()
        assert all(r() is None for r in refs)
    assert len(mon.records) == 2
    assert not [o for o in gc.get_referents(*vars(mon).values()) if isinstance(o, torch.Tensor)]


def test_skips_and_errors(monkeypatch):
    q, k, v = randn(1, 2, 6, 4, seed=1), randn(1, 2, 6, 4, seed=2), randn(1, 2, 6, 4, seed=3)
    with ft.shadow(sample_every=1) as mon:
        F.scaled_dot_product_attention(q, k, v, dropout_p=0.5)
        F.scaled_dot_product_attention(q[:, :, :0], k, v)
    assert mon.records == [] and mon.skipped == {"dropout": 1, "empty tensors": 1} and mon.calls == 2

    def out_of_memory(*args):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2 GiB\nmore")

    want = F.scaled_dot_product_attention(q, k, v)
    monkeypatch.setattr(fadev.monitor, "reference_rows", out_of_memory)
    with pytest.warns(RuntimeWarning, match="check of .* failed and is skipped .*OutOfMemoryError: CUDA out of"):
        with ft.shadow(sample_every=1) as mon:
            got = [F.scaled_dot_product_attention(q, k, v) for _ in range(2)]
    assert all(torch.equal(g, want) for g in got) and mon.records == []
    assert mon.skipped == {"OutOfMemoryError: CUDA out of memory. Tried to allocate 2 GiB": 2}
    monkeypatch.undo()
    original = F.scaled_dot_product_attention
    with pytest.raises(RuntimeError, match="size"):
        with ft.shadow(sample_every=1):
            F.scaled_dot_product_attention(q, k[..., :3], v)  # PyTorch's own error, unchanged
    assert F.scaled_dot_product_attention is original
    mon = ft.shadow(sample_every=10)
    with mon, pytest.raises(RuntimeError, match="already active"):
        with mon:
            pass
    assert F.scaled_dot_product_attention is original and isinstance(mon, Monitor)
    with pytest.raises(ValueError, match="sample_every must be >= 1, got 0"):
        ft.shadow(sample_every=0)
    with pytest.raises(TypeError, match="rows must be an integer"):
        ft.shadow(sample_every=1, rows=2.5)
    with pytest.raises(ValueError, match="rows must be >= 1, got 0"):
        ft.shadow(sample_every=1, rows=0)
    with pytest.raises(TypeError, match="csv must be a path .* got int"):
        ft.shadow(sample_every=1, csv=3)
    with pytest.raises(TypeError, match="log_dir must be a path .* got list"):
        ft.shadow(sample_every=1, log_dir=[])
    with pytest.raises(TypeError, match="model must be a torch.nn.Module or None, got dict"):
        ft.shadow(sample_every=1, model={})
    with pytest.raises(ValueError, match="takes a candidate only, got reference='golden'"):
        ft.shadow("golden", "fa2:bf16", sample_every=1)
    with pytest.raises(ValueError, match="golden=True"):
        ft.shadow(sample_every=1, golden=True)
    with pytest.raises(ValueError, match="monitoring options: pass sample_every"):
        ft.shadow("golden", "fa2:bf16", rows=4)
    with pytest.raises(ValueError, match="pass candidate="):
        ft.shadow(sample_every=1, kernel="baseline")
    with pytest.raises(ValueError, match="unknown preset 'gold'"):
        ft.shadow(sample_every=1, candidate="gold")
    with pytest.raises(ft.UnsupportedSDPA, match="patch_sdpa: unsupported .* dropout_p"):
        with ft.shadow(sample_every=1, candidate="fa2:bf16"):
            F.scaled_dot_product_attention(q, k, v, dropout_p=0.5)
    assert F.scaled_dot_product_attention is original


# ---------------------------------------------------------------- CUDA

@pytest.mark.gpu
@needs_torch_cuda
def test_on_cuda_exact_bf16_and_unchanged():
    from torch.nn.attention import SDPBackend, sdpa_kernel
    q, k, v = (randn(2, 8, 256, 64, seed=s, device="cuda") for s in (1, 2, 3))
    kv = (k[:, :2], v[:, :2])
    with ft.shadow(sample_every=1, rows=16) as exact:
        F.scaled_dot_product_attention(q, *kv, is_causal=True, enable_gqa=True)
        assert len(exact._pending) == 1  # the statistics wait on the device, the host did not
    (rec,) = exact.records
    assert not exact._pending and rec["n"] == 2 * 8 * 16 * 64 and rec["rel_rms"] <= 16 * EPS
    qb, kb, vb = (t.bfloat16().requires_grad_() for t in (q, *kv))
    with torch.no_grad():
        want = F.scaled_dot_product_attention(qb, kb, vb, is_causal=True, enable_gqa=True)
    with ft.shadow(sample_every=1, rows=16) as mon:
        with torch.no_grad():
            got = F.scaled_dot_product_attention(qb, kb, vb, is_causal=True, enable_gqa=True)
        with sdpa_kernel([SDPBackend.MATH]):  # deterministic backward, to compare gradients bit for bit
            grads = [torch.autograd.grad(F.scaled_dot_product_attention(qb, kb, vb, is_causal=True,
                                                                        enable_gqa=True).sum(), (qb, kb, vb))
                     for _ in range(2)]
    with sdpa_kernel([SDPBackend.MATH]):
        plain = torch.autograd.grad(F.scaled_dot_product_attention(qb, kb, vb, is_causal=True,
                                                                   enable_gqa=True).sum(), (qb, kb, vb))
    assert torch.equal(want, got) and all(torch.equal(a, b) for g in grads for a, b in zip(g, plain))
    recs = mon.records
    assert len(recs) == 3 and all(r["dtype"] == "bfloat16" for r in recs)
    # bf16 attention against float64: bf16's rounding (u = 2^-8), far from float64's
    assert all(2.0 ** -16 < r["rel_rms"] < 2.0 ** -6 for r in recs), recs


def test_reference_attention_is_plain_fp64_attention(rng):
    """fadev.monitor.reference_attention against the tests' independent NumPy reference (bottom-right causal,
    grouped-query, fewer queries than keys) and torch's fp64 autograd gradients; top-left alignment differs
    from bottom-right when N_q < N_kv (so the alignment is really applied), a boolean mask drops keys."""
    from fadev.monitor import reference_attention
    q, k, v = (rng.standard_normal(s) for s in ((1, 4, 5, 8), (1, 2, 9, 8), (1, 2, 9, 8)))
    tq, tk, tv = (torch.tensor(x, requires_grad=True) for x in (q, k, v))
    for causal in (False, True):
        want, _ = helpers.numpy_attention(q, k, v, causal=causal)
        got = reference_attention(tq, tk, tv, is_causal=causal, align="bottom_right")
        assert np.allclose(got.detach().numpy(), want, rtol=1e-13, atol=1e-14)
    dout = rng.standard_normal(q.shape)
    got.backward(torch.tensor(dout))
    for g, w in zip((tq.grad, tk.grad, tv.grad), helpers.numpy_grads(q, k, v, dout, causal=True)):
        assert np.allclose(g.numpy(), w, rtol=1e-12, atol=1e-13)
    top = reference_attention(tq, tk, tv, is_causal=True).detach().numpy()
    assert not np.allclose(top, want)
    seen = torch.ones(5, 9, dtype=torch.bool)
    seen[:, 4:] = False
    masked = reference_attention(tq, tk, tv, attn_mask=seen).detach().numpy()
    assert np.allclose(masked, helpers.numpy_attention(q, k[:, :, :4], v[:, :, :4])[0], rtol=1e-13, atol=1e-14)
    with pytest.raises(ValueError, match="align"):
        reference_attention(tq, tk, tv, align="centre")
