"""The emulated kernels' fast paths on the GPU (fp32 FMA chains, register-blocked: cuda/emu_forward_warp.cu,
cuda/emu_forward_fast.cu and the backward's) against the generic GPU kernels (FADEV_EMU_GENERIC=1) and the C core,
bit for bit; the forward's two fast kernels against each other (FADEV_EMU_WARP=0); the fast kernels' exp against
CUDA's for every fp32 input.

The fast path is taken where the policy allows it (fp32 nearest-even accumulators, factors of <= 12 bits) and
every rounded input is finite. The shapes here stress what the fast path does differently: odd N and D (partial
register tiles and slices), causal masks that cut through tiles, Nq != Nk, grouped-query heads, every tile from
16 to 256 (one subtile, several, and recomputed scores), D up to 128 (both column widths), products that
underflow fp32's normals or overflow fp32 (inputs large in bf16 range: inf and NaN scores), and non-finite
inputs (which must leave the fast path: same bits either way). NaN payloads are not compared.

Skipped without a CUDA device, as in CI.
"""
import numpy as np
import pytest

import fadev
import helpers
from fadev.policy import Policy
from helpers import make_inputs, make_qkv, needs_gpu

pytestmark = [pytest.mark.gpu, needs_gpu]


def differing(a, b):
    return helpers.count_differing(a, b, nan="any")


def forward(kind, q, k, v, policy, monkeypatch, generic, **kw):
    fn = fadev.flash_attention if kind == "flash" else fadev.baseline_attention
    monkeypatch.setenv("FADEV_EMU_GENERIC", "1" if generic else "0")
    return fn(q, k, v, policy, return_lse=True, device="cuda", **kw)


def assert_fast_is_generic(kind, q, k, v, policy, monkeypatch, cpu=False, **kw):
    fo, fl = forward(kind, q, k, v, policy, monkeypatch, False, **kw)
    go, gl = forward(kind, q, k, v, policy, monkeypatch, True, **kw)
    where = f"{kind} {policy} {kw} q{q.shape} k{k.shape}"
    assert differing(fo, go) == 0 and differing(fl, gl) == 0, f"{where}: the fast path differs from the generic"
    if cpu:
        fn = fadev.flash_attention if kind == "flash" else fadev.baseline_attention
        co, cl = fn(q, k, v, policy, return_lse=True, **kw)
        assert differing(fo, co) == 0 and differing(fl, cl) == 0, f"{where}: the fast path differs from the CPU"


@pytest.mark.parametrize("kind", ["flash", "baseline"])
@pytest.mark.parametrize("preset", ["fa2", "paper", "naive"])
@pytest.mark.parametrize("fmt", ["bf16", "fp16"])
def test_presets_fast_is_generic_and_cpu(kind, preset, fmt, monkeypatch):
    q, k, v = make_qkv(21, 1, 2, 2, 131, 173, 64, spread=2.0)
    assert_fast_is_generic(kind, q, k, v, Policy.preset(preset, fmt), monkeypatch, cpu=True, causal=True)


@pytest.mark.parametrize("block_kv", [16, 32, 63, 64, 128, 129, 200, 256])
@pytest.mark.parametrize("causal", [False, True])
def test_tiles_fast_is_generic(block_kv, causal, monkeypatch):
    q, k, v = make_qkv(22, 1, 2, 1, 150, 411, 40)
    assert_fast_is_generic("flash", q, k, v, Policy.fa2("bf16"), monkeypatch, causal=causal, block_kv=block_kv)


@pytest.mark.parametrize("D", [1, 17, 33, 64, 65, 100, 128])
def test_head_dims_fast_is_generic(D, monkeypatch):
    q, k, v = make_qkv(23, 1, 1, 1, 70, 90, D)
    for kind in ("flash", "baseline"):
        assert_fast_is_generic(kind, q, k, v, Policy.paper("bf16"), monkeypatch, causal=True)
        assert_fast_is_generic(kind, q, k, v, Policy.fa2("fp16"), monkeypatch, causal=False)


@pytest.mark.parametrize("Nq,Nk", [(1, 1), (65, 1), (1, 300), (77, 200), (200, 77), (257, 130)])
@pytest.mark.parametrize("heads", [(4, 2), (3, 1)])
def test_shapes_causal_gqa_fast_is_generic(Nq, Nk, heads, monkeypatch):
    q, k, v = make_qkv(24, 2, heads[0], heads[1], Nq, Nk, 24)
    assert_fast_is_generic("flash", q, k, v, Policy.naive("bf16"), monkeypatch, causal=True, block_kv=64)
    assert_fast_is_generic("baseline", q, k, v, Policy.naive("bf16"), monkeypatch, causal=True)


@pytest.mark.parametrize("case", ["underflow", "overflow", "nonfinite", "subnormal_inputs", "wide_scores"])
def test_extreme_values_fast_is_generic(case, monkeypatch):
    """Products below fp32's normals (the generic kernels' float tier does not apply there: the fast path's FMA
    must still give the fp64-then-round bits), scores past fp32's range (inf - inf: NaN rows), non-finite
    inputs (the fast path steps aside), subnormal inputs, and finite scores so far apart that s - m leaves the
    exp's reduced range (below -708 / -1022: libdevice's other path, which the warp kernel's grouped softmax terms
    take for a whole group when one of its keys needs it) while a row's largest scores stay in it."""
    q, k, v = make_qkv(25, 1, 2, 2, 96, 96, 32)
    if case == "underflow":
        k = k * 1e-20
        v[0, 1] *= 1e-30
    elif case == "overflow":
        q[0, 0, :8] *= 1e30
        k[0, 0, :8] *= 1e15
    elif case == "nonfinite":
        q[0, 0, 3, 2] = np.nan
        v[0, 1, 7, 0] = np.inf
    elif case == "wide_scores":
        q[0, 0] *= 400
        q[0, 1, ::2] *= 150
    else:
        q[0, 1] *= 1e-40
        v[0, 0, ::3] *= 1e-39
    for kind in ("flash", "baseline"):
        for policy in (Policy.fa2("bf16"), Policy.paper("bf16"), Policy.fa2("fp16"), Policy.paper("fp16")):
            assert_fast_is_generic(kind, q, k, v, policy, monkeypatch, cpu=True, causal=False)


@pytest.mark.parametrize("where", ["q", "k", "v"])
def test_one_nonfinite_head_fast_is_generic(where, monkeypatch):
    """The fast and generic forward launches split the heads on the device (each CTA reads its head's input
    magnitudes): one head with a NaN or an infinity goes generic, the others fast, and every head has the CPU's
    bits."""
    q, k, v = make_qkv(28, 2, 4, 2, 80, 72, 48)
    if where == "q":
        q[1, 1, 5, 3] = np.nan           # query head 1 of batch 1 only
    elif where == "k":
        k[0, 1, 9, 0] = np.inf           # K/V head 1 of batch 0: its query heads 2 and 3
    else:
        v[1, 0, 70, 7] = -np.inf
    for kind in ("flash", "baseline"):
        assert_fast_is_generic(kind, q, k, v, Policy.fa2("bf16"), monkeypatch, cpu=True, causal=True)


@pytest.mark.parametrize("D", [1, 31, 64, 65, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_warp_kernel_is_tiled_kernel(D, causal, monkeypatch):
    """Flash blocks of <= 64 keys and the baseline run emu_forward_warp.cu (a warp per 16 or 8 query rows);
    FADEV_EMU_WARP=0 runs emu_forward_fast.cu's kernel on the same call. Several CTAs per head (128 or 64 rows each), ragged last tiles,
    grouped-query heads, Nq != Nk, blocks that do not divide N, the presets' policies and the flash options: the
    two fast kernels, the generic kernels and the CPU all give the same bits."""
    q, k, v = make_qkv(29, 1, 4, 2, 300, 229, D, spread=2.0)
    cases = [(Policy.fa2("bf16"), {}), (Policy.paper("fp16"), dict(block_kv=48)),
             (Policy.naive("bf16"), dict(block_kv=64)), (Policy.fa2("fp16"), dict(block_kv=17, normalize="eager")),
             (Policy.fa1("bf16"), dict(block_kv=64)), (Policy.fa2("bf16"), dict(block_kv=33, loop_order="kv_outer"))]
    cases += [(Policy.naive("bf16"), "baseline"), (Policy.paper("fp16"), "baseline")]
    for policy, kw in cases:
        kind, kw = ("baseline", {}) if kw == "baseline" else ("flash", kw)
        monkeypatch.setenv("FADEV_EMU_WARP", "0")
        to, tl = forward(kind, q, k, v, policy, monkeypatch, False, causal=causal, **kw)
        monkeypatch.setenv("FADEV_EMU_WARP", "1")
        assert_fast_is_generic(kind, q, k, v, policy, monkeypatch, cpu=D in (31, 128), causal=causal, **kw)
        wo, wl = forward(kind, q, k, v, policy, monkeypatch, False, causal=causal, **kw)
        assert differing(wo, to) == 0 and differing(wl, tl) == 0, f"{kind} {policy} {kw}: warp kernel != tiled kernel"


@pytest.mark.parametrize("D", [40, 64, 100, 128])
def test_preset_kernels_are_run_time_kinds_kernel(D, monkeypatch):
    """fa2's and paper's flash forwards run warp kernels compiled for their stage kinds (cuda/emu_forward_warp_sig.cu)
    where those measured faster (causal, or D > 64), and naive's baseline forward too (with its score store);
    FADEV_EMU_SIG=0 runs the one that reads the kinds at run time.
    Both formats, causal and not, grouped-query heads, a short last block, scores wide enough that the softmax terms
    run from 1 through underflow: the same bits, and the generic kernels' (D 100: the CPU's too). The kernel that ran
    is named by the profiler: a dispatch that fell back to the run-time kinds would fail here."""
    q, k, v = make_qkv(41, 1, 4, 2, 150, 203, D, spread=5.0)
    presets = [("flash", sig, Policy.preset(name, fmt)) for sig, (name, fmt) in
               enumerate([("fa2", "bf16"), ("fa2", "fp16"), ("paper", "bf16"), ("paper", "fp16")], 1)]
    presets += [("baseline", 5, Policy.naive("bf16")), ("baseline", 6, Policy.naive("fp16"))]
    for kind, sig, policy in presets:
        for causal in (False, True):
            monkeypatch.setenv("FADEV_EMU_SIG", "0")
            ro, rl = forward(kind, q, k, v, policy, monkeypatch, False, causal=causal)
            monkeypatch.delenv("FADEV_EMU_SIG")
            assert_fast_is_generic(kind, q, k, v, policy, monkeypatch, cpu=D == 100, causal=causal)
            so, sl = forward(kind, q, k, v, policy, monkeypatch, False, causal=causal)
            assert differing(so, ro) == 0 and differing(sl, rl) == 0, f"{kind} {policy} D {D} causal {causal}"
        # the kernel's template arguments: DC 2, LEAN, BASE, CAUSAL, KEEP (the baseline's score store), SIG
        base = "true, true" if kind == "baseline" else "false, true"
        keep = "true" if kind == "baseline" else "false"
        names = kernels_run(kind, policy, monkeypatch, generic=False, causal=True)
        assert f"warp_kernel<2, true, {base}, {keep}, {sig}>" in names, names
        monkeypatch.setenv("FADEV_EMU_SIG", "0")
        names = kernels_run(kind, policy, monkeypatch, generic=False, causal=True)
        monkeypatch.delenv("FADEV_EMU_SIG")
        assert f"warp_kernel<2, true, {base}, {keep}, 0>" in names, names


@pytest.mark.parametrize("D", [33, 40, 64])
@pytest.mark.parametrize("Nq,Nk", [(300, 70), (70, 300), (129, 129)])
def test_warp_kernel_async_staging_is_generic(D, Nq, Nk, monkeypatch):
    """The warp forward's flash kernels at 32 < D <= 64 copy K and V into shared memory asynchronously (the next
    block's K during this block's P.V): blocks of 16, 48 and 64 keys, the last one short (zeros past the keys), D not
    a multiple of 4 (4-byte copies) or 64 (16-byte), causal with more queries than keys (row tiles whose rows see no
    key: nothing is copied, nothing awaited) and fewer, a CTA with two row tiles, grouped-query heads; the same bits
    as the generic kernel, and (D 40) as the CPU."""
    q, k, v = make_qkv(31, 1, 4, 2, Nq, Nk, D, spread=2.0)
    for policy, block_kv in ((Policy.fa2("bf16"), 64), (Policy.paper("fp16"), 48), (Policy.fa2("fp16"), 16)):
        for causal in (False, True):
            assert_fast_is_generic("flash", q, k, v, policy, monkeypatch, cpu=D == 40 and causal, causal=causal,
                                   block_kv=block_kv)


@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_baseline_score_store_is_recomputation(D, causal, monkeypatch):
    """The warp kernel's baseline stores its first pass's scores for the other two where they fit (a slot per
    resident CTA, the CTAs striding over the work units); FADEV_EMU_KEEP=0, or a scratch budget too small for the
    slots, computes them in every pass. More units than resident CTAs (64 heads x 5 or 9 row tiles), ragged tiles,
    Nq != Nk, grouped-query heads: the same bits either way, the generic kernels' and the CPU's."""
    q, k, v = make_qkv(37, 1, 64, 16, 520, 229, D, spread=2.0)
    for policy in (Policy.naive("bf16"), Policy.paper("fp16")):
        assert_fast_is_generic("baseline", q, k, v, policy, monkeypatch, cpu=policy.name == "naive(bf16)",
                               causal=causal)
        kept = forward("baseline", q, k, v, policy, monkeypatch, False, causal=causal)
        for env, value in (("FADEV_EMU_KEEP", "0"), ("FADEV_CUDA_SCRATCH_BYTES", "4096")):
            monkeypatch.setenv(env, value)
            again = forward("baseline", q, k, v, policy, monkeypatch, False, causal=causal)
            monkeypatch.delenv(env)
            assert differing(kept[0], again[0]) == 0 and differing(kept[1], again[1]) == 0, f"{policy} {env}"


@pytest.mark.parametrize("D", [64, 128])
def test_causal_baseline_units_are_pairs_or_tiles(D, monkeypatch):
    """The causal baseline's store kernel takes its units as its CTAs free (a counter each call zeroes), units that
    warp_forward chooses from the resident slots (2 CTAs an SM): a head's longest tile alone and its other tiles in
    pairs of T tile-lengths, with the middle tile alone where T - 1 is odd (shifted); the p-th longest with the p-th
    shortest (ends); or single tiles. Ragged row tiles, Nk > Nq, head counts from this GPU's SM count s: 3 tiles and
    s heads (shifted, no middle), 4 tiles and 3 s / 4 heads (shifted with middles), 8 tiles and s / 2 heads (ends),
    3 tiles and s / 2 heads (single, fewer units than slots) or 3 s heads (single, more units than slots: the CTAs
    draw again). The same bits as the generic kernels."""
    torch = pytest.importorskip("torch")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows = 128 if D == 64 else 64  # the warp kernel's row tile at this D
    for tiles, heads in ((3, sms), (4, 3 * sms // 4), (8, sms // 2), (3, sms // 2), (3, 3 * sms)):
        q, k, v = make_qkv(41, 1, heads, heads, (tiles - 1) * rows + 37, (tiles - 1) * rows + 60, D, spread=2.0)
        assert_fast_is_generic("baseline", q, k, v, Policy.naive("bf16"), monkeypatch, causal=True)


def test_baseline_score_store_switches(monkeypatch):
    """The store's kernel runs by default, and FADEV_EMU_KEEP=0 (or too small a budget) runs the recomputing one."""
    names = kernels_run("baseline", Policy.naive("bf16"), monkeypatch, generic=False)
    assert "warp_kernel<2, true, true, false, true, 5>" in names, names
    for env, value in (("FADEV_EMU_KEEP", "0"), ("FADEV_CUDA_SCRATCH_BYTES", "4096")):
        monkeypatch.setenv(env, value)
        names = kernels_run("baseline", Policy.naive("bf16"), monkeypatch, generic=False)
        monkeypatch.delenv(env)
        assert "warp_kernel<2, true, true, false, false, 0>" in names, (env, names)
        assert "warp_kernel<2, true, true, false, true" not in names, (env, names)


@pytest.mark.parametrize("exp2", [False, True])
def test_exp_transcription_is_cudas_for_every_fp32_input(exp2):
    """The fast kernels' exp and exp2 (emu_exp_fast: CUDA's, transcribed, constants in constant memory) give CUDA's own
    fp64 bits for all 2^32 fp32 inputs (the softmax terms' x are fp32 values); the same check against the other
    function finds differences (it can fail)."""
    from fadev import _core
    assert _core.cuda_exp_check(exp2, 0, 2 ** 32) == 0
    assert _core.cuda_exp_check(exp2, 0x3F000000, 1 << 16, not exp2) > 60000
    with pytest.raises(ValueError, match="start"):
        _core.cuda_exp_check(exp2, 2 ** 32, 1)


@pytest.mark.parametrize("options", [dict(loop_order="kv_outer"), dict(normalize="eager"), dict(exp="exp2")])
def test_flash_options_fast_is_generic(options, monkeypatch):
    q, k, v = make_qkv(26, 1, 2, 2, 100, 100, 64)
    assert_fast_is_generic("flash", q, k, v, Policy.fa2("bf16"), monkeypatch, causal=True, block_kv=32, **options)


def test_stochastic_elementwise_stages_fast_is_generic(monkeypatch):
    """Stochastic rounding makes every stage general: the fast path must not apply (same bits either way)."""
    q, k, v = make_qkv(27, 1, 2, 2, 64, 64, 32)
    pol = Policy.fa2("bf16").replace(rounding="stochastic", seed=5)
    assert_fast_is_generic("flash", q, k, v, pol, monkeypatch, cpu=True)



# ---------------------------------------------------------------- backward


def backward(kind, q, k, v, dout, policy, monkeypatch, generic, causal=False, **tiles):
    pol = fadev.policy.as_policy(policy)
    monkeypatch.setenv("FADEV_EMU_GENERIC", "1")  # one forward for both backward runs
    if kind == "flash":
        out, lse = fadev.flash_attention(q, k, v, pol, causal=causal, return_lse=True, device="cuda", **tiles)
        fn = fadev.flash_attention_backward
    else:
        out, lse = fadev.baseline_attention(q, k, v, pol, causal=causal, return_lse=True, device="cuda")
        fn = fadev.baseline_attention_backward
    monkeypatch.setenv("FADEV_EMU_GENERIC", "1" if generic else "0")
    return (out, lse), fn(q, k, v, out, lse, dout, pol, causal=causal, device="cuda", **tiles)


def assert_backward_fast_is_generic(kind, q, k, v, dout, policy, monkeypatch, cpu=False, causal=False, **tiles):
    """The fast backward with the sums' tiles it chooses (at these sizes 4 rows or keys a thread, a CTA per tile, dK
    and dV 2 columns a thread), with 4 columns (FADEV_EMU_COLS=4: what grids of a wave take), with 8 a thread
    (FADEV_EMU_WIDE=1: what large grids take), and with a CTA per two tiles at each (FADEV_EMU_PAIR=1: what large
    causal grids take) against the generic kernels, bit for bit; and the CPU."""
    (out, lse), fast = backward(kind, q, k, v, dout, policy, monkeypatch, False, causal=causal, **tiles)
    variants = {}
    for env in ({"FADEV_EMU_COLS": "4"}, {"FADEV_EMU_WIDE": "1"}, {"FADEV_EMU_PAIR": "1"},
                {"FADEV_EMU_COLS": "4", "FADEV_EMU_PAIR": "1"}, {"FADEV_EMU_WIDE": "1", "FADEV_EMU_PAIR": "1"}):
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        variants[" ".join(f"{n}={v}" for n, v in env.items())] = backward(kind, q, k, v, dout, policy, monkeypatch,
                                                                           False, causal=causal, **tiles)[1]
        for name in env:
            monkeypatch.delenv(name)
    _, generic = backward(kind, q, k, v, dout, policy, monkeypatch, True, causal=causal, **tiles)
    where = f"{kind} {policy} causal={causal} {tiles} q{q.shape} k{k.shape}"
    for i, (name, g) in enumerate(zip(("dq", "dk", "dv"), generic)):
        helpers.assert_same_bits(fast[i], g, name, where, nan="any", names=("fast", "generic"))
        for label, grads in variants.items():
            helpers.assert_same_bits(grads[i], g, name, f"{where} {label}", nan="any", names=("fast", "generic"))
    if cpu:
        fn = fadev.flash_attention_backward if kind == "flash" else fadev.baseline_attention_backward
        ref = fn(q, k, v, out, lse, dout, fadev.policy.as_policy(policy), causal=causal, **tiles)
        for name, f, c in zip(("dq", "dk", "dv"), fast, ref):
            helpers.assert_same_bits(f, c, name, where, nan="any", names=("fast", "CPU"))


@pytest.mark.parametrize("kind", ["flash", "baseline"])
@pytest.mark.parametrize("preset", ["fa2", "paper", "naive"])
@pytest.mark.parametrize("fmt", ["bf16", "fp16"])
def test_backward_presets_fast_is_generic_and_cpu(kind, preset, fmt, monkeypatch):
    q, k, v, do = make_inputs(31, 1, 2, 2, 131, 173, 64, spread=2.0)
    assert_backward_fast_is_generic(kind, q, k, v, do, Policy.preset(preset, fmt), monkeypatch, cpu=True,
                                    causal=True)


@pytest.mark.parametrize("block_q,block_kv", [(16, 16), (64, 32), (128, 64), (63, 129), (256, 200), (1, 7)])
@pytest.mark.parametrize("causal", [False, True])
def test_backward_tiles_fast_is_generic(block_q, block_kv, causal, monkeypatch):
    q, k, v, do = make_inputs(32, 1, 2, 1, 150, 211, 40)
    assert_backward_fast_is_generic("flash", q, k, v, do, Policy.fa2("bf16"), monkeypatch, causal=causal,
                                    block_q=block_q, block_kv=block_kv)


@pytest.mark.parametrize("D", [1, 17, 64, 65, 128])
@pytest.mark.parametrize("Nq,Nk", [(1, 1), (77, 200), (200, 77)])
def test_backward_shapes_gqa_fast_is_generic(D, Nq, Nk, monkeypatch):
    q, k, v, do = make_inputs(33, 2, 4, 2, Nq, Nk, D)
    for kind in ("flash", "baseline"):
        assert_backward_fast_is_generic(kind, q, k, v, do, Policy.paper("bf16"), monkeypatch, causal=True)


@pytest.mark.parametrize("case", ["underflow", "overflow", "nonfinite"])
def test_backward_extreme_values_fast_is_generic(case, monkeypatch):
    q, k, v, do = make_inputs(34, 1, 2, 2, 96, 96, 32)
    if case == "underflow":
        k, v, do = k * 1e-20, v * 1e-20, do * 1e-25
    elif case == "overflow":
        q[0, 0, :8] *= 1e30
        do[0, 1, :8] *= 1e35
    else:
        q[0, 0, 3, 2] = np.nan
        do[0, 1, 7, 0] = np.inf
    for kind in ("flash", "baseline"):
        for policy in (Policy.fa2("bf16"), Policy.paper("bf16"), Policy.naive("fp16")):
            assert_backward_fast_is_generic(kind, q, k, v, do, policy, monkeypatch, cpu=True)


@pytest.mark.parametrize("preset", ["fa2", "naive"])
@pytest.mark.parametrize("scratch_rows", [1, 7, 45])
def test_backward_chunked_fast_is_generic(monkeypatch, scratch_rows, preset):
    """Small scratch budgets split the rows into many chunks (fp32 scratch: twice the rows of the fp64 one): the
    fast sums carry their state across them, and the baseline's fast rows (naive) see chunks of every size."""
    q, k, v, do = make_inputs(35, 1, 4, 2, 100, 90, 24)
    monkeypatch.setenv("FADEV_CUDA_SCRATCH_BYTES", str(scratch_rows * 90 * 16))
    for kind in ("flash", "baseline"):
        assert_backward_fast_is_generic(kind, q, k, v, do, getattr(Policy, preset)("bf16"), monkeypatch,
                                        causal=True, **({"block_q": 16, "block_kv": 32} if kind == "flash" else {}))


@pytest.mark.parametrize("fmt", ["bf16", "fp16"])
@pytest.mark.parametrize("exp2", [False, True])
def test_exp_table_is_the_computation(fmt, exp2):
    """The warp forward's table of softmax terms (cuda/emu_exp_table.cu: R(E(x)) of 16-bit x <= 0, clamped) equals the
    computation for every 16-bit encoding of a value <= 0, -0 and -inf included; the same check against the other
    exp form finds differences (it can fail). The clamp keeps the table small (bf16: what L1 holds beside the
    kernel's shared memory)."""
    from fadev import _core
    bad, lo, hi = _core.cuda_exp_table_check(fmt, exp2)
    assert bad == 0 and 0 < lo < hi
    assert hi - lo < (3000 if fmt == "bf16" else 20000), (lo, hi)
    assert _core.cuda_exp_table_check(fmt, exp2, not exp2)[0] > 500
    with pytest.raises(ValueError, match="fmt"):
        _core.cuda_exp_table_check("fp32", exp2)


@pytest.mark.parametrize("fmt", ["bf16", "fp16"])
def test_quotient_from_reciprocal_is_the_division(fmt):
    """The baseline's P = R_p(e / l) from l's reciprocal (quot_round_rcp) equals the division's for every e in [0, 1]
    of the format and 53,248 values of l; the reciprocal's product rounded without the bounds' test differs (the data
    reaches quotients near P's midpoints: the check can fail)."""
    from fadev import _core
    bad, pairs = _core.cuda_quot_check(fmt)
    assert bad == 0 and pairs > 8 * 10 ** 8
    assert _core.cuda_quot_check(fmt, True)[0] > 10
    with pytest.raises(ValueError, match="fmt"):
        _core.cuda_quot_check("fp32")


@pytest.mark.parametrize("fmt", ["bf16", "fp16"])
def test_rounding_by_conversion_is_the_rule(fmt):
    """The kernels round fp32 values to bf16 and fp16 with the hardware's conversions (flt_round): the rule on the
    encoding's value for all 2^32 fp32 inputs (a NaN for a NaN; fp16's rule an integer one, f16_rule, not the
    conversion it checks); truncation differs (the check can fail)."""
    from fadev import _core
    assert _core.cuda_round_check(fmt) == 0
    assert _core.cuda_round_check(fmt, True) > 10 ** 9
    with pytest.raises(ValueError, match="fmt"):
        _core.cuda_round_check("fp8")


@pytest.mark.parametrize("fmt", ["bf16", "fp16"])
@pytest.mark.parametrize("exp", ["exp", "exp2"])
def test_exp_table_forward_is_computed_forward(fmt, exp, monkeypatch):
    """paper's forward with its softmax terms from the table == without it (FADEV_EMU_EXP_TABLE=0) == the generic
    kernels == the C core, on scores wide enough that the terms run from 1 through underflow (spread 6: s - m down
    to hundreds), causal and not, grouped-query heads, a short last block; and with the score stage in the other
    16-bit format."""
    q, k, v = make_qkv(37, 1, 4, 2, 150, 203, 48, spread=6.0)
    policy = Policy.paper(fmt).replace(exp=exp)
    # the scores in the other 16-bit format: the table's x = R_softmax(s - m) is still a value of the softmax's
    mixed = policy.replace(score="fp16" if fmt == "bf16" else "bf16")
    assert_fast_is_generic("flash", q, k, v, mixed, monkeypatch, cpu=True, causal=True)
    for causal in (False, True):
        monkeypatch.delenv("FADEV_EMU_EXP_TABLE", raising=False)
        to, tl = forward("flash", q, k, v, policy, monkeypatch, False, causal=causal)
        monkeypatch.setenv("FADEV_EMU_EXP_TABLE", "0")
        co, cl = forward("flash", q, k, v, policy, monkeypatch, False, causal=causal)
        monkeypatch.delenv("FADEV_EMU_EXP_TABLE")
        assert differing(to, co) == 0 and differing(tl, cl) == 0, (fmt, exp, causal)
        assert_fast_is_generic("flash", q, k, v, policy, monkeypatch, cpu=True, causal=causal)


# ---------------------------------------------------------------- which kernels run


def kernels_run(kind, policy, monkeypatch, generic, causal=False):
    """Names of the CUDA kernels one forward + backward launches (torch.profiler), for a 1 x 2 x 80 x 64 problem."""
    torch = pytest.importorskip("torch")
    from torch.profiler import ProfilerActivity, profile
    q, k, v, do = make_inputs(36, 1, 2, 2, 80, 80, 64)
    fwd, bwd = ((fadev.flash_attention, fadev.flash_attention_backward) if kind == "flash"
                else (fadev.baseline_attention, fadev.baseline_attention_backward))
    monkeypatch.setenv("FADEV_EMU_GENERIC", "1" if generic else "0")
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        out, lse = fwd(q, k, v, policy, return_lse=True, device="cuda", causal=causal)
        bwd(q, k, v, out, lse, do, policy, device="cuda", causal=causal)
        torch.cuda.synchronize()
    return " | ".join(e.key for e in prof.key_averages())


def test_backward_sums_cut_short_grids_finer(monkeypatch):
    """dK, dV of a grid short of a wave (every test-sized one) take 2 columns a thread (twice the CTAs); the switch
    gives back the 4-column kernel; the bits of both are the generic kernels' (assert_backward_fast_is_generic)."""
    names = kernels_run("flash", Policy.fa2("bf16"), monkeypatch, generic=False)
    assert "dkv_fast_kernel<float, 4, false, 2>" in names and "false, 4>" not in names, names
    monkeypatch.setenv("FADEV_EMU_COLS", "4")
    names = kernels_run("flash", Policy.fa2("bf16"), monkeypatch, generic=False)
    assert "dkv_fast_kernel<float, 4, false, 4>" in names and "false, 2>" not in names, names


def pair_kinds(*kinds):
    """emu_backward_fast.cu's pk_kinds: 1 | the flt_kind (fp32 1, bf16 2, fp16 3) of score, dp, softmax, bwd_p, dsoft_p,
    dsoft and ds in two bits each from bit 2 -- the pair kernel's compile-time kinds for paper's and naive's stages."""
    return 1 | sum(k << (2 + 2 * i) for i, k in enumerate(kinds))


BF, F32 = 2, 1
PAPER_BF16, NAIVE_BF16 = pair_kinds(*[BF] * 7), pair_kinds(BF, BF, F32, BF, F32, F32, BF)
# emu_backward_rows.cu's naive_rows_kinds(bf16): softmax, sum_acc, stats fp32, p bf16, delta_acc, dsoft_p, dsoft fp32,
# ds and bwd_p bf16 (pair_kinds' packing)
NAIVE_ROWS_BF16 = pair_kinds(F32, F32, F32, BF, F32, F32, F32, BF, BF)


@pytest.mark.parametrize("kind,preset,expected", [
    ("flash", "fa2", ["warp_kernel<2, true, false, false, false, 0>", "pair_fast_kernel<1, 0>", "dkv_fast_kernel",
                      "dq_fast_kernel"]),
    ("flash", "paper", ["warp_kernel<2, true, false, false, false, 0>", f"pair_fast_kernel<2, {PAPER_BF16}>",
                        "dkv_fast_kernel", "dq_fast_kernel"]),
    ("baseline", "naive", ["warp_kernel<2, true, true, false, true, 5>", f"pair_fast_kernel<2, {NAIVE_BF16}>",
                           *(f"rows_{k}_kernel<{NAIVE_ROWS_BF16}>" for k in ("soft", "delta", "ds"))]),
])
def test_presets_take_the_lean_kernels(kind, preset, expected, monkeypatch):
    """The bit tests above pass whichever path runs; this one says the presets run the lean kernels (and that the
    generic switch turns them off), so a dispatch that silently fell back to the generic code would fail here."""
    names = kernels_run(kind, getattr(Policy, preset)("bf16"), monkeypatch, generic=False)
    for kernel in expected:
        assert kernel in names, f"{kind} {preset}: {kernel} did not run; ran: {names}"
    generic = kernels_run(kind, getattr(Policy, preset)("bf16"), monkeypatch, generic=True)
    for kernel in expected:
        assert kernel not in generic, f"{kind} {preset} with FADEV_EMU_GENERIC=1: {kernel} ran"
