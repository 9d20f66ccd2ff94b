"""fadev.ring_attention / ring_attention_backward (csrc/ring.c): W = 1 is plain flash bit for bit; the
all-gather forward is plain flash bit for bit for every W; under golden every layout and merge equals golden
attention (forward and backward) for W in {1, 2, 3, 4, 8}; the merge matches the slow twin
(tests/reference_ring.py) bit for bit under 16-bit policies; every layout's pieces cover each (query, key)
pair exactly once and respect causality; argument errors name the parameter; the CLI runs on tiny sizes."""
import os

import numpy as np
import pytest

import fadev
from fadev import ring_steps
from fadev.ring import LAYOUTS, MERGES, RingMerge

import helpers
from helpers import identical as same_bits
import reference_ring


def _qkv(N=48, D=8, H=2, seed=0, dist="normal"):
    return fadev.random_qkv((H, N, D), dist=dist, seed=seed)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("policy", ["fa2:bf16", "paper:fp16"])
def test_world_size_one_is_plain_flash_bit_for_bit(policy, causal, rng):
    q, k, v = _qkv(N=40, seed=1, dist="outlier")
    dout = rng.standard_normal(q.shape)
    o1, l1 = fadev.flash_attention(q, k, v, policy, block_kv=16, causal=causal, return_lse=True)
    g1 = fadev.flash_attention_backward(q, k, v, o1, l1, dout, policy, block_kv=16, causal=causal)
    for layout in LAYOUTS:
        for merge in ("lowp_partials", "allgather"):
            o, l = fadev.ring_attention(q, k, v, policy, world_size=1, layout=layout, merge=merge, causal=causal,
                                        block_kv=16, return_lse=True)
            assert same_bits(o, o1) and same_bits(l, l1), (layout, merge)
            if merge == "allgather" and layout != "contiguous" and causal:
                continue  # several calls per rank (zigzag: 2 chunks, striped: rows): dk/dv summed across them
            g = fadev.ring_attention_backward(q, k, v, o, l, dout, policy, world_size=1, layout=layout, merge=merge,
                                              causal=causal, block_kv=16)
            assert all(same_bits(a, b) for a, b in zip(g, g1)), (layout, merge)
        # fp32 partials: the only change is the one fp32 rounding of O / l before the final 16-bit one
        pol32 = fadev.as_policy(policy).replace(out="fp32")
        o32 = fadev.flash_attention(q, k, v, pol32, block_kv=16, causal=causal)
        o = fadev.ring_attention(q, k, v, policy, world_size=1, layout=layout, merge="fp32_partials", causal=causal,
                                 block_kv=16)
        assert same_bits(o, fadev.round(o32, fadev.as_policy(policy).out))


@pytest.mark.parametrize("causal", [False, True])
def test_allgather_forward_is_plain_flash_for_every_world_size(causal):
    q, k, v = _qkv(N=48, seed=2)
    o1, l1 = fadev.flash_attention(q, k, v, "fa2:bf16", block_kv=8, causal=causal, return_lse=True)
    for layout in LAYOUTS:
        for W in (2, 3, 4, 8):
            if layout == "zigzag" and 48 % (2 * W):
                continue
            o, l = fadev.ring_attention(q, k, v, "fa2:bf16", world_size=W, layout=layout, merge="allgather",
                                        causal=causal, block_kv=8, return_lse=True)
            assert same_bits(o, o1) and same_bits(l, l1), (layout, W)


@pytest.mark.parametrize("causal", [False, True])
def test_golden_every_layout_merge_and_world_size(causal, rng):
    q, k, v = _qkv(N=48, seed=3)  # 48 = 2 * 3 * 8: every W in {1, 2, 3, 4, 8} for zigzag too
    dout = rng.standard_normal(q.shape)
    ref, ref_lse = fadev.baseline_attention(q, k, v, "golden", causal=causal, return_lse=True)
    gref = fadev.baseline_attention_backward(q, k, v, ref, ref_lse, dout, "golden", causal=causal)
    for layout in LAYOUTS:
        for merge in MERGES:
            for W in (1, 2, 3, 4, 8):
                o, l = fadev.ring_attention(q, k, v, "golden", world_size=W, layout=layout, merge=merge, causal=causal,
                                            block_kv=5, return_lse=True)
                g = fadev.ring_attention_backward(q, k, v, o, l, dout, "golden", world_size=W, layout=layout,
                                                  merge=merge, causal=causal, block_kv=5)
                errs = [np.abs(o - ref).max(), np.abs(l - ref_lse).max()]
                errs += [np.abs(a - b).max() for a, b in zip(g, gref)]
                assert max(errs) < 1e-12, (layout, merge, W, errs)


@pytest.mark.parametrize("policy", ["fa2:bf16", "paper:fp16"])
@pytest.mark.parametrize("merge", ["lowp_partials", "fp32_partials", "lowp_running"])
def test_merge_matches_numpy_twin_bit_for_bit(policy, merge):
    q, k, v = fadev.random_qkv((2, 24, 8), seed=3, dist="outlier")
    fmts = RingMerge.preset(merge).resolve(fadev.as_policy(policy))
    for layout in LAYOUTS:
        for W in (2, 3):
            for causal in (False, True):
                o, l = fadev.ring_attention(q, k, v, policy, world_size=W, layout=layout, merge=merge, causal=causal,
                                            block_kv=3, return_lse=True)
                o2, l2 = reference_ring.ring_forward(q, k, v, W, layout, policy, fmts, causal, block_kv=3)
                assert same_bits(o, o2) and same_bits(l, l2), (layout, W, causal)


def test_twin_detects_a_wrong_merge():
    """The twin is sensitive: a merge in bf16 instead of fp32 changes bits."""
    q, k, v = fadev.random_qkv((1, 24, 8), seed=4)
    fmts = RingMerge.preset("lowp_partials").resolve(fadev.as_policy("fa2:bf16"))
    o = fadev.ring_attention(q, k, v, "fa2:bf16", world_size=3, merge=RingMerge(merge="bf16"))
    o2, _ = reference_ring.ring_forward(q, k, v, 3, "contiguous", "fa2:bf16", fmts)
    assert not same_bits(o, o2)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("allgather", [False, True])
def test_pieces_cover_each_pair_once_and_respect_causality(layout, allgather):
    for N, W in ((16, 1), (16, 2), (24, 3), (32, 4), (64, 8), (64, 16)):
        if layout == "zigzag" and N % (2 * W):
            continue
        for causal in (False, True):
            want = np.tril(np.ones((N, N), np.int32)) if causal else np.ones((N, N), np.int32)
            got = fadev.ring_coverage(N, world_size=W, layout=layout, causal=causal, allgather=allgather)
            assert np.array_equal(got, want), (N, W, causal)
    # the twin derives each step's piece from the mask; it must find a flash-expressible mask every time
    for causal in (False, True):
        for r in range(4):
            for src in range(4):
                reference_ring.piece(reference_ring.positions(32, 4, layout, r),
                                     reference_ring.positions(32, 4, layout, src), causal)


def test_low_precision_ring_error_is_bounded_by_plain_flash():
    """A 16-bit ring is no worse than a few times plain 16-bit flash (both against golden)."""
    q, k, v = _qkv(N=64, D=16, seed=5)
    ref = fadev.baseline_attention(q, k, v, "golden")
    base = fadev.rmse(fadev.flash_attention(q, k, v, "fa2:bf16"), ref)
    for merge in MERGES:
        ring = fadev.rmse(fadev.ring_attention(q, k, v, "fa2:bf16", world_size=8, merge=merge,
                                               layout="zigzag" if merge != "allgather" else "contiguous"), ref)
        assert 0 < ring <= 2.5 * base, (merge, ring, base)


def test_errors_name_the_parameter():
    q, k, v = _qkv(N=12)
    dout = np.ones_like(q)
    lse = np.zeros(q.shape[:-1])
    P = "fa2:bf16"
    with pytest.raises(ValueError, match="world_size"):
        fadev.ring_attention(q, k, v, P, world_size=0)
    with pytest.raises(ValueError, match="world_size"):
        fadev.ring_attention(q, k, v, P, world_size=True)
    with pytest.raises(ValueError, match="world_size"):
        fadev.ring_attention(q, k, v, P, world_size=5)
    with pytest.raises(ValueError, match="world_size.*zigzag"):
        fadev.ring_attention(q, k, v, P, world_size=4, layout="zigzag")  # 12 % 8 != 0
    with pytest.raises(ValueError, match="layout"):
        fadev.ring_attention(q, k, v, P, world_size=2, layout="spiral")
    with pytest.raises(ValueError, match="merge"):
        fadev.ring_attention(q, k, v, P, world_size=2, merge="fp8_partials")
    with pytest.raises(TypeError, match="merge"):
        fadev.ring_attention(q, k, v, P, world_size=2, merge=3)
    with pytest.raises(ValueError, match="seq_kv"):
        fadev.ring_attention(q, k[:, :6], v[:, :6], P, world_size=2)
    with pytest.raises(ValueError, match="partial_out"):
        RingMerge(partial_out="fp12")
    with pytest.raises(ValueError, match="world_size"):
        fadev.ring_attention_backward(q, k, v, q, lse, dout, P, world_size=0)
    with pytest.raises(ValueError, match="layout"):
        fadev.ring_attention_backward(q, k, v, q, lse, dout, P, world_size=2, layout="spiral")
    with pytest.raises(ValueError, match="lse"):
        fadev.ring_attention_backward(q, k, v, q, lse[:, :3], dout, P, world_size=2)
    with pytest.raises(ValueError, match="seq"):
        fadev.ring_coverage(0, world_size=2)
    # the C entry points reject what the Python layer would (binding called directly)
    pol = fadev.as_policy("golden")
    bad = RingMerge()._c(pol, 5, "contiguous")
    with pytest.raises(ValueError, match="ring_attention"):
        fadev._core.ring_attention(q[None], k[None], v[None], (pol._c, None, bad, 1.0, False, 4, 4, 0, 0, 0))
    with pytest.raises(ValueError, match="ring_coverage"):
        fadev._core.ring_coverage(12, False, bad)
    with pytest.raises(ValueError, match="ring_attention_backward"):
        fadev._core.ring_attention_backward(q[None], k[None], v[None], q[None], lse[None], dout[None],
                                            (pol._c, pol._c_backward, bad, 1.0, False, 4, 4, 0, 0, 0))
    fmts = tuple(fadev.formats["fp32"]._c for _ in range(4))
    with pytest.raises(ValueError, match="ring_merge: out and ob must be"):  # ring.c's merge, bound for ring_steps
        fadev._core.ring_merge(np.zeros((2, 4)), np.zeros(3), np.zeros(2), np.zeros((2, 4)), np.zeros(2), fmts)
    with pytest.raises(TypeError, match="formats must be"):
        fadev._core.ring_merge(np.zeros((2, 4)), np.zeros(2), np.zeros(2), np.zeros((2, 4)), np.zeros(2), fmts[:3])
    with pytest.raises(TypeError, match="ring"):  # a ring kernel without its ring
        fadev._core.ring_attention(q[None], k[None], v[None], (pol._c, None, None, 1.0, False, 4, 4, 0, 0, 0))


def test_cli_smoke(tmp_path):
    from fadev.__main__ import main
    assert main(["ring", "--tiny", "--out", str(tmp_path)]) == 0
    text = (tmp_path / "ring.md").read_text()
    assert "per doubling" in text and "lowp_partials" in text
    for stem in ("ring_error_vs_W",):
        for ext in ("png", "svg"):
            path = tmp_path / f"{stem}.{ext}"
            assert path.exists() and os.path.getsize(path) > 2000


@pytest.mark.parametrize("merge", MERGES)
@pytest.mark.parametrize("causal", [False, True])
def test_step_composition_reproduces_ring_c_bit_for_bit(merge, causal, rng):
    """fadev.ring_steps (how the GPU runs a ring: one flash call per piece, the merge and sums on the host)
    with the CPU's flash kernel gives csrc/ring.c's bits, forward and backward, for every layout and W."""
    q, k, v = fadev.random_qkv((1, 2, 24, 8), dist="outlier", seed=7, heads_kv=1)
    dout = rng.standard_normal(q.shape)
    policy = "fa2:bf16" if merge != "fp32_partials" else "paper:fp16"
    pol = fadev.as_policy(policy)
    mg = RingMerge.preset(merge)
    exp_form = ("exp", "exp2").index(pol.exp)
    scale, tiles, choices = 1 / np.sqrt(8), (4, 3), (0, 0, exp_form)
    for layout in LAYOUTS:
        for W in (1, 2, 3, 4):
            if 24 % (2 * W if layout == "zigzag" else W):
                continue
            ring = {"world_size": W, "layout": layout, "merge": merge, "causal": causal}
            o, l = fadev.ring_attention(q, k, v, pol, block_q=4, block_kv=3, return_lse=True, **ring)
            grads = fadev.ring_attention_backward(q, k, v, o, l, dout, pol, block_q=4, block_kv=3, **ring)
            o2, l2 = ring_steps.forward(q, k, v, pol, mg.resolve(pol), W, layout, mg.allgather, causal,
                                        ring_steps.cpu_flash(scale, tiles, choices))
            assert same_bits(o, o2) and same_bits(l, l2), (layout, W)
            grads2 = ring_steps.backward(q, k, v, o, l, dout, pol, mg.resolve(pol), W, layout, mg.allgather, causal,
                                         ring_steps.cpu_flash_backward(scale, tiles, exp_form))
            assert all(same_bits(a, b) for a, b in zip(grads, grads2)), (layout, W)


def test_step_composition_detects_a_wrong_merge():
    """The composition is sensitive: rounding the merge in bf16 instead of fp32 changes its bits."""
    q, k, v = fadev.random_qkv((1, 1, 24, 8), seed=4)
    pol = fadev.as_policy("fa2:bf16")
    o = fadev.ring_attention(q, k, v, pol, world_size=3)
    wrong = RingMerge(merge="bf16").resolve(pol)
    o2, _ = ring_steps.forward(q, k, v, pol, wrong, 3, "contiguous", False, False,
                               ring_steps.cpu_flash(1 / np.sqrt(8), (128, 64), (0, 0, 1)))
    assert not same_bits(o, o2)


class _HostGpu:
    """Stands in for fadev.cuda._Gpu with host arrays (the CPU kernels take the same arguments)."""

    def operand(self, x, name, dtype=np.float64):
        return np.ascontiguousarray(x, dtype=dtype)

    def to_host(self, arr):
        return arr

    def from_host(self, arr):
        return arr


def test_ring_gpu_glue_with_the_cpu_kernels(monkeypatch, rng):
    """ring_attention(device="cuda") end to end with the GPU calls replaced by the CPU's (no GPU here): the
    routing, the ring parameters handed to fadev.ring_steps and the per-piece kernel calls give ring.c's bits."""
    q, k, v = fadev.random_qkv((1, 2, 24, 8), dist="outlier", seed=11, heads_kv=1)
    dout = rng.standard_normal(q.shape)
    ring = {"world_size": 3, "layout": "zigzag", "causal": True, "block_kv": 5}
    want = [fadev.ring_attention(q, k, v, "fa1:fp16", merge=m, return_lse=True, **ring) for m in MERGES]
    grads = [fadev.ring_attention_backward(q, k, v, *o, dout, "fa1:fp16", merge=m, **ring)
             for m, o in zip(MERGES, want)]
    monkeypatch.setattr(fadev.ring._cuda, "route", lambda device, **named: _HostGpu() if device == "cuda" else None)
    monkeypatch.setattr(ring_steps, "route", lambda device: fadev._core)
    monkeypatch.setattr(ring_steps, "_upload", lambda *arrays: [np.ascontiguousarray(a) for a in arrays])
    for m, (o, l), g in zip(MERGES, want, grads):
        o2, l2 = fadev.ring_attention(q, k, v, "fa1:fp16", merge=m, return_lse=True, device="cuda", **ring)
        assert same_bits(o, o2) and same_bits(l, l2), m
        g2 = fadev.ring_attention_backward(q, k, v, o, l, dout, "fa1:fp16", merge=m, device="cuda", **ring)
        assert all(same_bits(a, b) for a, b in zip(g, g2)), m


@pytest.mark.gpu
@helpers.needs_gpu
@pytest.mark.parametrize("merge", MERGES)
def test_ring_on_the_gpu_gives_the_cpu_bits(merge, rng):
    q, k, v = fadev.random_qkv((2, 32, 16), dist="outlier", seed=9)
    dout = rng.standard_normal(q.shape)
    for layout in LAYOUTS:
        for causal in (False, True):
            ring = {"world_size": 4, "layout": layout, "merge": merge, "causal": causal, "block_kv": 16}
            o, l = fadev.ring_attention(q, k, v, "fa2:bf16", return_lse=True, **ring)
            og, lg = fadev.ring_attention(q, k, v, "fa2:bf16", return_lse=True, device="cuda", **ring)
            assert same_bits(o, og) and same_bits(l, lg), (layout, causal)
            g = fadev.ring_attention_backward(q, k, v, o, l, dout, "fa2:bf16", **ring)
            gg = fadev.ring_attention_backward(q, k, v, o, l, dout, "fa2:bf16", device="cuda", **ring)
            assert all(same_bits(a, b) for a, b in zip(g, gg)), (layout, causal)
