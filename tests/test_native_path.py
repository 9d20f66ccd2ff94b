"""The native kernel's call path on the host (fadev.torch_native, issue 25), without a GPU: torch_native._dry_run
replaces the binding's two native calls by a recorder and lets CPU tensors pass the device checks, so what reaches
the binding -- pointers, shape tuple, call spec, native options, stream -- and what is computed once per key are
tested here; the kernels' results are tested on the GPU (test_cuda_hf.py). And the table mma="auto" reads.
"""
import contextlib
import math

import pytest

torch = pytest.importorskip("torch")

import fadev.native as native  # noqa: E402
import fadev.torch_native as tn  # noqa: E402
from test_cuda_native import compiled_tiles  # noqa: E402  (cuda/native.cuh's X-lists, parsed)


def _build_tiles():
    """The build's tile lists in the dry run's form: {(dim, backward, warp_rows, mma code): [tiles]}."""
    lists = {(False, 16, 0): "NATIVE_FORWARD_TILES", (False, 32, 0): "NATIVE_FORWARD_TILES_32",
             (True, 16, 0): "NATIVE_BACKWARD_TILES", (True, 32, 0): "NATIVE_BACKWARD_TILES_32",
             (False, 16, 1): "NATIVE_FORWARD_TILES_WGMMA", (True, 16, 1): "NATIVE_BACKWARD_TILES_WGMMA"}
    table = {}
    for (backward, rows, code), macro in lists.items():
        for dim, tiles in compiled_tiles(macro).items():
            table[(dim, backward, rows, code)] = tiles
            if code:
                table[(dim, backward, 32, code)] = tiles  # wgmma does not read warp_rows
    return table


TILES = _build_tiles()


def _qkv(b=2, h=8, hkv=4, n=128, d=64, grad=True):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(b, h, n, d, generator=g).to(torch.bfloat16).requires_grad_(grad)
    k, v = (torch.randn(b, hkv, n, d, generator=g).to(torch.bfloat16).requires_grad_(grad) for _ in range(2))
    return q, k, v


def test_choose_mma_table():
    wgmma = [(128, 128), (64, 64)]
    assert native.choose_mma((9, 0), wgmma) == "wgmma"
    for capability in ((8, 0), (8, 9), (10, 0), (12, 0)):
        assert native.choose_mma(capability, wgmma) == "sync", capability  # wgmma is sm_90a's only
    assert native.choose_mma((9, 0), []) == "sync"  # no wgmma kernel for this head dim / direction
    assert native.choose_mma((9, 0), wgmma, warp_rows=32) == "sync"  # 32 rows per warp: mma.sync's
    assert native.choose_mma((9, 0), wgmma, block_q=64) == "wgmma"
    assert native.choose_mma((9, 0), wgmma, block_q=64, block_kv=128) == "sync"  # no such wgmma tile
    assert native.choose_mma((9, 0), wgmma, block_q=16, block_kv=16) == "sync"


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("capability, dim, want", [((9, 0), 64, ("wgmma", "wgmma")), ((9, 0), 128, ("wgmma", "wgmma")),
                                                   ((8, 0), 64, ("sync", "sync")), ((8, 0), 128, ("sync", "sync"))])
def test_auto_defaults_per_gpu_and_head_dim(capability, dim, want, causal):
    """With every default: the forward and the backward on wgmma where the GPU and build have them (D 64 and 128),
    else mma.sync, deterministic; tiles: native.DEFAULT_TILES' (the measured table) where it has
    one for the instruction, head dim and causal, else the first of the list; the backward on the forward's tile where
    its list has it, else on the table's or the list's first."""
    q, k, v = _qkv(d=dim)
    with tn._dry_run(tiles=TILES, capability=capability):
        p = tn.plan(q, k, v, causal, None, True)
    assert p.mma == want
    table = native.DEFAULT_TILES.get((want[0], False, dim, causal))
    forward = table or TILES[(dim, False, 16, want[0] == "wgmma")][0]
    backward_list = TILES[(dim, True, 16, want[1] == "wgmma")]
    backward = native.DEFAULT_TILES.get((want[1], True, dim, causal)) or backward_list[0]
    assert p.tiles == (forward, forward if forward in backward_list else backward)
    assert p.forward[1] == (1, False, 16, int(want[0] == "wgmma"))  # bf16, (not read), 16 rows, instruction
    assert p.backward[1] == (1, True, 16, int(want[1] == "wgmma"))  # deterministic dq


def test_default_tile_table():
    """The table's defaults (benchmarks/README.md, "Default tiles"), and what it does not touch: a given tile entry
    (the first matching tile, as before), the backward, mma.sync, head dims without an entry."""
    wgmma = lambda dim: TILES[(dim, False, 16, 1)]  # noqa: E731
    with tn._dry_run(tiles=TILES, capability=(9, 0)):
        for dim in (64, 128):
            assert native.fit_tile(dim, mma="wgmma") == native.fit_tile(dim, mma="wgmma", causal=True) == (128, 128)
        assert native.fit_tile(64, mma="wgmma", backward=True) == (64, 64)
        assert native.fit_tile(128, mma="wgmma", backward=True) == (64, 128)
        # LONG_TILES: from its length on, D 64's backward takes (64, 128); below it, and for an explicit entry, not
        for causal, n in ((True, 4096), (False, 16384)):
            assert native.fit_tile(64, mma="wgmma", backward=True, causal=causal, seq_q=n) == (64, 128)
            assert native.fit_tile(64, mma="wgmma", backward=True, causal=causal, seq_q=n - 1) == (64, 64)
            assert native.fit_tile(64, None, 64, mma="wgmma", backward=True, causal=causal, seq_q=n) == (64, 64)
        assert native.fit_tile(128, mma="wgmma", backward=True, seq_q=1 << 20) == (64, 128)  # no entry at D 128
        for n, tile in ((1024, (64, 64)), (4096, (64, 128))):  # plan passes the query length
            q, k, v = _qkv(b=1, h=1, hkv=1, n=n, d=64)
            assert tn.plan(q, k, v, True, None, True).tiles == ((128, 128), tile)
        assert native.fit_tile(128, mma="sync", backward=True) == TILES[(128, True, 16, 0)][0]  # no entry: first
        assert native.fit_tile(64, 128, mma="wgmma") == next(t for t in wgmma(64) if t[0] == 128)  # an entry given
        assert native.fit_tile(64, None, 64, mma="wgmma", causal=True) == next(t for t in wgmma(64) if t[1] == 64)
        assert native.fit_tile(64) == TILES[(64, False, 16, 0)][0]  # mma.sync: the list's first
        q, k, v = _qkv(d=128)
        assert tn.plan(q, k, v, True, None, True).tiles[0] == (128, 128)
        assert tn.plan(q, k, v, False, None, True).tiles[0] == (128, 128)
    for (mma, backward, dim, _), tile in native.DEFAULT_TILES.items():  # every entry is a tile the build has
        assert tile in TILES[(dim, backward, 16, native.MMA.index(mma))]
    for (mma, backward, dim, _), (_, tile) in native.LONG_TILES.items():
        assert tile in TILES[(dim, backward, 16, native.MMA.index(mma))]


def test_explicit_choices_kept():
    q, k, v = _qkv(hkv=8)
    with tn._dry_run(tiles=TILES, capability=(9, 0)):
        assert tn.plan(q, k, v, mma="sync").mma == ("sync", "sync")
        assert tn.plan(q, k, v, mma="wgmma").mma == ("wgmma", "sync")  # the backward as before issue 25
        assert tn.plan(q, k, v, mma="wgmma", backward_mma="wgmma").mma == ("wgmma", "wgmma")
        assert tn.plan(q, k, v, block_q=16, block_kv=16).mma[0] == "sync"  # no such wgmma tile: mma.sync runs it
        assert tn.plan(q, k, v, backward_block_q=16, backward_block_kv=16).tiles[1] == (16, 16)
        assert tn.plan(q, k, v, deterministic=False).backward[1][1] is False
        with pytest.raises(ValueError, match="mma must be one of sync, wgmma, auto, got 'tma'"):
            tn.plan(q, k, v, mma="tma")
        with pytest.raises(ValueError, match="backward_mma must be one of"):
            tn.plan(q, k, v, backward_mma="x")
        with pytest.raises(ValueError, match=r"block_q, block_kv: \(16, 16\) is not a native forward \(mma='wgmma'\)"):
            tn.plan(q, k, v, block_q=16, block_kv=16, mma="wgmma")
        with pytest.raises(TypeError, match="deterministic must be a bool"):
            tn.plan(q, k, v, deterministic=None)


def test_binding_gets_pointers_shapes_and_stream():
    """Forward and backward hand the binding the tensors' own memory (grouped-query K/V not expanded, contiguous
    inputs not copied), the shape tuple, the call spec with the scale, and the options with the stream and the
    tensors' strides (contiguous here) last."""
    q, k, v = _qkv()
    calls = []
    with tn._dry_run(calls, tiles=TILES):
        out = tn.native_attention(q, k, v, is_causal=True, enable_gqa=True, scale=0.2)
        out.backward(torch.ones_like(out))
    (fwd, bwd) = calls
    assert fwd[:3] == (q.data_ptr(), k.data_ptr(), v.data_ptr()) and fwd[3] == out.data_ptr()
    assert fwd[5] == (2, 8, 4, 128, 128, 64) and fwd[6][3:5] == (0.2, True) and fwd[7][4] == 0
    q_like, kv_like = (8 * 128 * 64, 128 * 64, 64), (4 * 128 * 64, 128 * 64, 64)
    assert fwd[7][5] == q_like + kv_like + kv_like + q_like
    assert bwd[:4] == (q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr())
    assert (bwd[6], bwd[7], bwd[8]) == (q.grad.data_ptr(), k.grad.data_ptr(), v.grad.data_ptr())
    assert bwd[10] == fwd[5] and bwd[12][1] is True and bwd[12][4] == 0
    assert bwd[12][5] == q_like + kv_like + kv_like + q_like + q_like + q_like + kv_like + kv_like
    assert q.grad.shape == q.shape and k.grad.shape == k.shape and q.grad.dtype == torch.bfloat16


def test_plan_computed_once_per_key(monkeypatch):
    q, k, v = _qkv()
    built = []
    real = tn._build
    monkeypatch.setattr(tn, "_build", lambda *a: built.append(a) or real(*a))
    with tn._dry_run():
        for _ in range(3):
            tn.native_attention(q, k, v, is_causal=True, enable_gqa=True).sum().backward()
        assert len(built) == 1
        tn.native_attention(q, k, v, is_causal=False, enable_gqa=True)
        tn.native_attention(q[:, :, :64], k[:, :, :64], v[:, :, :64], is_causal=True, enable_gqa=True)
        assert len(built) == 3  # another flag, another shape: their own plans
        with pytest.raises(ValueError, match="enable_gqa"):
            tn.native_attention(q, k, v)  # a bad call is never cached
        with pytest.raises(ValueError, match="enable_gqa"):
            tn.native_attention(q, k, v)


def _model_view(t):
    """(B, H, N, D) view of a (B, N, H, D) tensor with t's values, as a transformers model passes q, k, v."""
    return t.detach().transpose(1, 2).contiguous().transpose(1, 2).requires_grad_(t.requires_grad)


def test_model_layouts_are_read_in_place():
    """A model's (B, N, H, D) projections seen as (B, H, N, D) reach the binding as they lie, with their strides; the
    output and the gradients come back in the inputs' layouts (so the model's own views of them copy nothing), and
    the incoming gradient is read in place too. What the kernels cannot read -- rows not contiguous, a stride not a
    multiple of 8 elements, data not 16-byte aligned -- is copied to a contiguous tensor first; a dimension of size 1
    reports stride 0."""
    q, k, v = (_model_view(t) for t in _qkv())
    calls = []
    with tn._dry_run(calls):
        out = tn.native_attention(q, k, v, enable_gqa=True)
        grad = torch.ones(out.transpose(1, 2).shape, dtype=out.dtype)  # the model's (B, N, H, D) gradient
        out.transpose(1, 2).backward(grad)
    (fwd, bwd) = calls
    n, h, hk, d = 128, 8, 4, 64
    q_model, kv_model = (n * h * d, d, h * d), (n * hk * d, d, hk * d)
    assert fwd[:4] == (q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr())
    assert fwd[7][5] == q_model + kv_model + kv_model + q_model and out.transpose(1, 2).is_contiguous()
    assert bwd[5] == grad.data_ptr()
    assert bwd[12][5] == q_model + kv_model + kv_model + q_model + q_model + q_model + kv_model + kv_model
    assert all(t.grad.stride() == t.stride() for t in (q, k, v))
    x = torch.zeros(2, 8, 128, 68, dtype=torch.bfloat16)
    for bad in (x[..., :64], x.view(-1)[4:4 + 2 * 8 * 128 * 64].view(2, 8, 128, 64),
                torch.zeros(2, 8, 64, 128, dtype=torch.bfloat16).transpose(2, 3)):
        assert tn.layout(bad) is None and tn.readable(bad).is_contiguous()
    good = torch.zeros(2, 8, 128, 72, dtype=torch.bfloat16)[..., :64]  # rows 72 elements apart: readable
    assert tn.readable(good) is good and tn.layout(good) == (8 * 128 * 72, 128 * 72, 72)
    assert tn.layout(good[:1, :1]) == (0, 0, 72)


def _bench_step():
    import importlib.util
    import os
    path = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "bench_step.py")
    spec = importlib.util.spec_from_file_location("bench_step", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench


def test_step_rounds_alternate_and_ratios_are_per_round(capsys):
    """bench_step's timing: every round runs each arm's steps in turn (a, a, b, b, then a, a, b, b), on the batches
    after the two validation updates, and the table's per-round ratio divides medians of the same round."""
    bench = _bench_step()
    order = []
    steps = {arm: (lambda x, y, arm=arm: order.append((arm, x))) for arm in ("sdpa", "native")}
    data = [(i, i) for i in range(8)]
    times = bench.time_arms(steps, data, 2, 2, "cpu")
    assert [a for a, _ in order] == ["sdpa", "sdpa", "native", "native"] * 2
    assert [x for _, x in order] == [2, 3, 2, 3, 4, 5, 4, 5]
    assert {a: len(r) for a, r in times.items()} == {"sdpa": 2, "native": 2}
    assert all(len(r) == 1 for rounds in times.values() for r in rounds)  # each round's first step dropped
    bench.print_steps({"sdpa": 1.0, "native": 1.0}, {"sdpa": [[1.0], [2.0]], "native": [[3.0], [2.0]]})
    row = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| native")][0]
    assert row == "| native | 2500.0 | 1.67 | 2.00 (1.00-3.00) | 1.0000 |"


def test_host_time_per_call_is_measured():
    """benchmarks/bench_step.py's CPU mode: fadev's host time per forward + backward, and torch's own autograd cost
    beside it, both positive and finite (the numbers themselves are the benchmark's, not a test's)."""
    bench = _bench_step()
    result = bench.host_only(calls=20)
    assert set(result) >= {"fadev native (hf)", "fadev native (torch_native)", "autograd.Function, no work"}
    assert all(math.isfinite(x) and x > 0 for x in result.values()), result


def test_binding_parses_the_stream():
    """The native options take a stream as an optional fifth item (the binding then runs the call asynchronously on
    it); anything else is refused by name. Without a GPU the call itself reports that; with one, the binding's
    checks refuse the NULL tensors."""
    import fadev._core as core
    from fadev import _args
    call = _args.Call(None, 0.125, True, 64, 64).c
    shape = (1, 2, 2, 64, 64, 64)
    gpu = bool(core.cuda_info()["devices"])
    error, match = (ValueError, "NULL|invalid argument") if gpu else (RuntimeError, "GPU|CUDA")
    for options in ((1, True, 16, 0), (1, True, 16, 0, 0), (1, True, 16, 0, 2**47), (1, True, 16, 0, 0, None),
                    (1, True, 16, 0, 0, (8,) * 12)):
        with pytest.raises(error, match=match):
            core.cuda_native_forward(0, 0, 0, 0, 0, shape, call, options)
    with pytest.raises(TypeError, match=r"native options must be \(dtype, deterministic, warp_rows, mma\[, stream"):
        core.cuda_native_forward(0, 0, 0, 0, 0, shape, call, (1, True, 16, 0, 0, None, 0))
    for strides in (0, (8,) * 11, [8] * 12):
        with pytest.raises(TypeError, match="strides must be a tuple of 12"):
            core.cuda_native_forward(0, 0, 0, 0, 0, shape, call, (1, True, 16, 0, 0, strides))


def test_autocast_cast_keeps_the_layout():
    """Under autocast, q and k reach attention as float32 views of a model's (B, N, H, D) projections: the bf16 cast
    keeps that layout, which the native kernel reads in place (and writes its output in), so the native path makes
    no second copy; a tensor already of the autocast dtype passes as it is (no copy), and the values are the plain
    cast's."""
    from fadev.torch import autocast_inputs
    g = torch.Generator().manual_seed(0)
    q32 = torch.randn(2, 16, 4, 8, generator=g).transpose(1, 2)  # (B, H, N, D) view of (B, N, H, D)
    v16 = torch.randn(2, 16, 4, 8, generator=g).to(torch.bfloat16).transpose(1, 2)
    assert not q32.is_contiguous()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        q, k, v = autocast_inputs(q32, q32, v16)
    assert q.dtype == torch.bfloat16 and q.stride() == q32.stride() and torch.equal(q, q32.to(torch.bfloat16))
    assert v is v16
    assert autocast_inputs(q32, q32, v16)[0] is q32  # autocast off: nothing changes


def _step_casts(implementation, context):
    """{op: count} of the dtype casts (aten._to_copy) in one bf16-autocast training step of a one-layer Llama
    (fadev.training.lm), forward and backward, with the first step done before counting."""
    import collections

    from torch.utils._python_dispatch import TorchDispatchMode

    from fadev.training import lm

    class Casts(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.seen = collections.Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func is torch.ops.aten._to_copy.default:
                self.seen[(args[0].dtype, kwargs.get("dtype"))] += 1
            return func(*args, **kwargs)

    config = lm.LMConfig(hidden=128, heads=2, heads_kv=1, ffn=96, layers=1, seq=32, batch=2, lr=3e-4)  # D 64
    model = lm.build(config, 0, "fp32", "cpu", implementation)
    x = torch.randint(0, 255, (2, 32), generator=torch.Generator().manual_seed(0))
    casts = Casts()
    with context:
        for mode in (contextlib.nullcontext(), casts):
            with mode:
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    loss = model(input_ids=x, labels=x).loss
                loss.backward()
    return casts.seen


def test_native_step_casts_as_sdpa():
    """Under bf16 autocast a Llama layer on fadev's native kernel (the drift study's attention, fadev.training.lm)
    casts exactly as on PyTorch's SDPA: q and k to bf16 once, the output left in bf16 -- not cast to float32 and back
    around every layer (two casts a layer more, and their backward, before issue 25's last session)."""
    from fadev import hf
    from fadev.training import lm

    sdpa = _step_casts("sdpa", hf.use(kernel="sdpa"))
    with tn._dry_run(tiles=TILES):
        native = _step_casts(lm.ATTENTION, hf.use(kernel="native"))
    assert sum(sdpa.values()) > 0
    assert native == sdpa
