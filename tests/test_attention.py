"""Attention kernels: bit parity with the slow twin (tests/reference.py = docs/numerics.md), golden
accuracy, what tiling may and may not change, determinism, NaN/Inf, masking, and FlashAttention's
2x error rule.

Parity cases are drawn from seeded generators; each test id and each failure message carries the
whole parameter set (policy, shapes, tiling, options, data seed), so a failure can be rerun alone.
"""
import dataclasses

import numpy as np
import pytest

import fadev
import helpers
import reference as ref
from fadev.policy import STAGES, Policy
from helpers import make_qkv, numpy_attention, rel_err

FORMATS = ("bf16", "fp16", "fp8_e4m3", "fp32", "tf32")
PRESETS = tuple(p for p in fadev.PRESETS if p != "golden")  # the presets that take a format
HEAD_LAYOUTS = ((1, 1), (2, 1), (2, 2), (3, 1), (4, 2))  # (H, Hkv): grouped-query when Hkv < H


# ------------------------------------------------------------ helpers

# The C kernels against their Python twin: every bit, but any NaN equals any NaN (payloads are not specified).


def bits_mismatch(a, b):
    """Index of the first element where a and b differ in bits, or None."""
    return helpers.first_difference(a, b, nan="any")


def assert_same_bits(got, want, what, context):
    """Fails with the first differing element, both values in hex, and the case."""
    return helpers.assert_same_bits(got, want, what, context, nan="any")


@dataclasses.dataclass(frozen=True)
class Case:
    """One parity case; str() is the full parameter set."""

    policy: Policy
    B: int
    H: int
    Hkv: int
    Nq: int
    Nk: int
    D: int
    block_q: int
    block_kv: int
    loop_order: str
    normalize: str
    exp: str
    causal: bool
    scale: float | None
    data_seed: int
    spread: float
    k_spread: float = 1.0

    def __str__(self):
        fields = " ".join(f"{f.name}={getattr(self, f.name)}" for f in dataclasses.fields(self) if f.name != "policy")
        return f"policy={self.policy} {fields}"

    @property
    def id(self):
        p = self.policy
        return (f"{p.name}-{p.rounding}{p.seed if p.rounding == 'stochastic' else ''}-B{self.B}H{self.H}/{self.Hkv}"
                f"-Nq{self.Nq}Nk{self.Nk}D{self.D}-{self.block_q}x{self.block_kv}-{self.loop_order}-{self.normalize}"
                f"-{self.exp}{'-causal' if self.causal else ''}-s{self.scale}-d{self.data_seed}x{self.spread}"
                f"{'k' + str(self.k_spread) if self.k_spread != 1.0 else ''}")

    def inputs(self):
        return make_qkv(self.data_seed, self.B, self.H, self.Hkv, self.Nq, self.Nk, self.D, self.spread,
                        self.k_spread)

    def tiling(self):
        return dict(block_q=self.block_q, block_kv=self.block_kv, loop_order=self.loop_order,
                    normalize=self.normalize, exp=self.exp)


def draw_case(rng, policy, max_n=12):
    """A random small case: shapes (GQA, Nq != Nk), tiling 1..N (non-square), options."""
    H, Hkv = HEAD_LAYOUTS[rng.integers(len(HEAD_LAYOUTS))]
    Nq = int(rng.integers(1, max_n + 1))
    Nk = Nq if rng.random() < 0.3 else int(rng.integers(1, max_n + 1))
    return Case(policy, B=int(rng.integers(1, 3)), H=H, Hkv=Hkv, Nq=Nq, Nk=Nk, D=int(rng.integers(1, 9)),
                block_q=int(rng.integers(1, Nq + 1)), block_kv=int(rng.integers(1, Nk + 1)),
                loop_order=str(rng.choice(["q_outer", "kv_outer"])), normalize=str(rng.choice(["deferred", "eager"])),
                exp=str(rng.choice(["exp", "exp2"])), causal=bool(rng.random() < 0.5),
                scale=None if rng.random() < 0.7 else float(rng.choice([0.3, 1.0, 2.5])),
                data_seed=int(rng.integers(2**31)), spread=float(rng.choice([1.0, 1.0, 4.0])))


def parity_policies():
    """Every preset at every format; one stage lowered to bf16 from golden and from fa2(fp16);
    one stage raised to fp64 from paper(bf16); rtz and stochastic rounding on a few presets."""
    pols = [Policy.golden()] + [Policy.preset(p, f) for p in PRESETS for f in FORMATS]
    pols += [Policy.golden().replace(**{s: "bf16"}) for s in STAGES]
    pols += [Policy.fa2("fp16").replace(**{s: "bf16"}) for s in STAGES]
    pols += [Policy.paper("bf16").replace(**{s: "fp64"}) for s in STAGES]
    # stochastic rounding in one stage at a time: each stage's counters (stream, index) are checked
    pols += [Policy.golden().replace(**{s: "bf16"}, rounding="stochastic", seed=2**63 + 17 * n)
             for n, s in enumerate(STAGES)]
    for i, base in enumerate((Policy.fa2("bf16"), Policy.paper("fp16"), Policy.naive("fp8_e4m3"),
                              Policy.fa1("bf16"), Policy.golden().replace(score_acc="bf16", pv_acc="fp16"))):
        pols.append(base.replace(rounding="rtz"))
        pols.append(base.replace(rounding="stochastic", seed=1000003 * (i + 1) + 2**40))
    return pols


def draw_cases():
    rng = np.random.default_rng(20240511)
    cases = []
    for pol in parity_policies():
        cases.append(draw_case(rng, pol))
        if pol.name.startswith(("fa1", "fa2")) or pol.rounding != "rne":
            cases.append(draw_case(rng, pol))
    return cases


def medium_cases():
    """Sizes past the C kernels' SIMD widths (16 keys, 4 rows, 16 dims) for the policies that take
    each tier (fp64 vectors, fp64 vectors rounded to fp32, fp32 vectors; scalar), also with data that
    fails the fp32 tier's exactness guard (products below 2^-126)."""
    rng = np.random.default_rng(77)
    cases = []
    for pol, spread, k_spread in ((Policy.golden(), 1.0, 1.0), (Policy.fa2("bf16"), 1.0, 1.0),
                                  (Policy.fa2("bf16"), 1e-20, 1e-20), (Policy.naive("fp16"), 3.0, 1.0),
                                  (Policy.paper("bf16"), 1.0, 1.0), (Policy.torch_math("bf16"), 1.0, 1.0),
                                  (Policy.fa2("fp32"), 1e-20, 1e-20), (Policy.paper("fp8_e4m3"), 1.0, 1.0),
                                  (Policy.fa1("fp16"), 1.0, 1.0),
                                  (Policy.fa2("bf16").replace(rounding="stochastic", seed=3), 1.0, 1.0)):
        Nq, Nk = int(rng.integers(33, 45)), int(rng.integers(33, 45))
        cases.append(Case(pol, B=1, H=2, Hkv=1, Nq=Nq, Nk=Nk, D=int(rng.integers(17, 23)),
                          block_q=int(rng.integers(5, Nq + 1)), block_kv=int(rng.integers(17, Nk + 1)),
                          loop_order=pol.loop_order, normalize=pol.normalize, exp=pol.exp,
                          causal=bool(rng.random() < 0.5),
                          scale=None, data_seed=int(rng.integers(2**31)), spread=spread, k_spread=k_spread))
    return cases


CASES = draw_cases() + medium_cases()


def run_flash(case, q, k, v):
    return fadev.flash_attention(q, k, v, case.policy, causal=case.causal, scale=case.scale, return_lse=True,
                                 **case.tiling())


def twin_flash(case, q, k, v):
    return ref.flash_attention(q, k, v, case.policy, causal=case.causal, scale=case.scale, **case.tiling())


# ------------------------------------------------------------ the twin itself


def test_twin_rounding_matches_fadev_round():
    """The twin's own rounding (integer arithmetic + Python Philox) against the C core's."""
    rng = np.random.default_rng(7)
    x = np.concatenate([rng.standard_normal(400) * np.exp2(rng.integers(-150, 150, 400)),
                        rng.standard_normal(50) * 1e-310,
                        [0.0, -0.0, np.inf, -np.inf, np.nan, 448, 464, 465, 65504, 65520, 1e300, 5e-324]])
    fmts = list(fadev.formats.values()) + [fadev.custom_format(5, -10, 10, subnormals=False),
                                           fadev.custom_format(4, -6, 8, has_inf=False, overflow="saturate"),
                                           fadev.custom_format(1, -3, 3),
                                           fadev.custom_format(2, -5, 5, subnormals=False)]
    for fmt in fmts:
        for mode in ("rne", "rtz", "stochastic"):
            want = fadev.round(x, fmt, mode, seed=2**33 + 5, stream=2**32 + 77)
            got = ref.round_array(x, fmt, mode, seed=2**33 + 5, stream=2**32 + 77)
            assert bits_mismatch(got, want) is None, f"fmt={fmt} mode={mode} at {bits_mismatch(got, want)}"


def test_twin_philox_known_answers():
    """Random123's known-answer vectors for Philox4x32-10."""
    assert ref.philox4x32_10((0, 0, 0, 0), (0, 0)) == (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)
    assert ref.philox4x32_10((2**32 - 1,) * 4, (2**32 - 1,) * 2) == (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)
    assert ref.philox4x32_10((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0)) == \
        (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)


@pytest.mark.parametrize("causal", [False, True])
def test_twin_golden_is_float64_attention(causal):
    """The twin under golden is ordinary attention (normwise relative error <= 1e-14), flash like baseline."""
    q, k, v = make_qkv(3, 1, 2, 1, 9, 11, 6)
    want_out, want_lse = numpy_attention(q, k, v, causal)
    out, lse = ref.baseline_attention(q, k, v, Policy.golden(), causal=causal)
    assert rel_err(out, want_out) <= 1e-14 and rel_err(lse, want_lse) <= 1e-14
    for loop_order in ("q_outer", "kv_outer"):
        for normalize in ("deferred", "eager"):
            for exp in ("exp", "exp2"):
                f_out, f_lse = ref.flash_attention(q, k, v, Policy.golden(), 2, 3, loop_order, normalize, exp,
                                                   causal=causal)
                assert rel_err(f_out, out) <= 1e-13 and rel_err(f_lse, lse) <= 1e-13, (loop_order, normalize, exp)


# ------------------------------------------------------------ bit parity C == twin


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_flash_parity(case):
    q, k, v = case.inputs()
    out, lse = run_flash(case, q, k, v)
    want_out, want_lse = twin_flash(case, q, k, v)
    assert_same_bits(out, want_out, "flash out", case)
    assert_same_bits(lse, want_lse, "flash lse", case)


BASELINE_CASES = [c for c in CASES if c.loop_order == "q_outer" or c.policy.rounding != "rne"]


@pytest.mark.parametrize("case", BASELINE_CASES, ids=[c.id for c in BASELINE_CASES])
def test_baseline_parity(case):
    q, k, v = case.inputs()
    out, lse = fadev.baseline_attention(q, k, v, case.policy, causal=case.causal, scale=case.scale, return_lse=True)
    want_out, want_lse = ref.baseline_attention(q, k, v, case.policy, causal=case.causal, scale=case.scale)
    assert_same_bits(out, want_out, "baseline out", case)
    assert_same_bits(lse, want_lse, "baseline lse", case)


SWEEP_POLICIES = [Policy.fa2("bf16").replace(state="bf16"), Policy.paper("fp16"),
                  Policy.fa1("fp8_e4m3").replace(rounding="stochastic", seed=99)]


@pytest.mark.parametrize("policy", SWEEP_POLICIES, ids=[p.name + "-" + p.rounding for p in SWEEP_POLICIES])
def test_flash_parity_every_tiling(policy):
    """Every block_kv from 1 to N + 1 (block_q drawn), both loop orders and normalisations, exp and
    exp2, causal or not, on one GQA input with Nq != Nk."""
    B, H, Hkv, Nq, Nk, D = 1, 2, 1, 7, 9, 4
    q, k, v = make_qkv(11, B, H, Hkv, Nq, Nk, D, spread=2.0)
    rng = np.random.default_rng(5)
    for block_kv in range(1, Nk + 2):
        for loop_order in ("q_outer", "kv_outer"):
            for normalize in ("deferred", "eager"):
                for exp in ("exp", "exp2"):
                    for causal in (False, True):
                        case = Case(policy, B, H, Hkv, Nq, Nk, D, int(rng.integers(1, Nq + 1)), block_kv, loop_order,
                                    normalize, exp, causal, None, 11, 2.0)
                        out, lse = run_flash(case, q, k, v)
                        want_out, want_lse = twin_flash(case, q, k, v)
                        assert_same_bits(out, want_out, "flash out", case)
                        assert_same_bits(lse, want_lse, "flash lse", case)


def test_policy_defaults_are_used():
    """None tiling arguments take the policy's (fa1: kv_outer, eager, exp, block_q 128)."""
    q, k, v = make_qkv(4, 1, 2, 2, 20, 70, 3)
    pol = Policy.fa1("bf16").replace(block_kv=32)
    out, lse = fadev.flash_attention(q, k, v, pol, return_lse=True)
    want_out, want_lse = ref.flash_attention(q, k, v, pol, pol.block_q, pol.block_kv, pol.loop_order, pol.normalize,
                                             pol.exp)
    assert_same_bits(out, want_out, "flash out", f"policy={pol} defaults")
    assert_same_bits(lse, want_lse, "flash lse", f"policy={pol} defaults")


def test_sram_bytes_rule():
    """sram_bytes M gives FlashAttention-1's tiles: Bc = ceil(M / 4d), Br = min(Bc, d)."""
    q, k, v = make_qkv(8, 1, 1, 1, 20, 40, 4)
    pol = Policy.fa1("bf16")
    for M in (16, 100, 160, 1000):
        bc = -(-M // (4 * 4))
        got = fadev.flash_attention(q, k, v, pol, sram_bytes=M, return_lse=True)
        want = fadev.flash_attention(q, k, v, pol, block_q=min(bc, 4), block_kv=bc, return_lse=True)
        for g, w in zip(got, want):
            assert bits_mismatch(g, w) is None, f"sram_bytes={M} Bc={bc}"


# ------------------------------------------------------------ golden accuracy (C kernels)


@pytest.mark.parametrize("causal", [False, True])
def test_golden_flash_equals_baseline(causal):
    """Under golden, every tiling gives baseline's answer to 1e-13 (normwise relative)."""
    N, D = 24, 16
    q, k, v = make_qkv(21, 1, 2, 1, N, N, D, spread=2.0)
    gold = Policy.golden()
    base_out, base_lse = fadev.baseline_attention(q, k, v, gold, causal=causal, return_lse=True)
    for block_q, block_kv in ((1, 1), (1, N), (N, 1), (N, N), (3, 5), (8, 8), (7, 2), (N - 1, 13), (16, 24)):
        for loop_order in ("q_outer", "kv_outer"):
            for normalize in ("deferred", "eager"):
                for exp in ("exp", "exp2"):
                    out, lse = fadev.flash_attention(q, k, v, gold, block_q=block_q, block_kv=block_kv,
                                                     loop_order=loop_order, normalize=normalize, exp=exp,
                                                     causal=causal, return_lse=True)
                    context = f"{block_q}x{block_kv} {loop_order} {normalize} {exp} causal={causal}"
                    assert rel_err(out, base_out) <= 1e-13, context
                    assert rel_err(lse, base_lse) <= 1e-13, context


@pytest.mark.parametrize("shape", [(2, 4, 2, 33, 33, 64), (1, 3, 1, 40, 57, 16), (1, 2, 2, 64, 31, 8)])
@pytest.mark.parametrize("causal", [False, True])
def test_golden_baseline_is_float64_attention(shape, causal):
    """Golden baseline = softmax(Q K^T scale) V computed by NumPy, normwise relative error <= 1e-14."""
    q, k, v = make_qkv(5, *shape, spread=2.0)
    out, lse = fadev.baseline_attention(q, k, v, Policy.golden(), causal=causal, return_lse=True)
    want_out, want_lse = numpy_attention(q, k, v, causal)
    masked = np.isneginf(want_lse)  # causal rows with no key (Nq > Nk): out 0, lse -inf
    assert np.array_equal(np.isneginf(lse), masked) and not out[masked].any()
    assert rel_err(out, want_out) <= 1e-14
    assert rel_err(lse[~masked], want_lse[~masked]) <= 1e-14


# ------------------------------------------------------------ what tiling changes


def test_rows_are_independent_without_state():
    """state None: block_q and the loop order change no bit (only block_kv can)."""
    q, k, v = make_qkv(31, 2, 2, 1, 37, 29, 8, spread=3.0)
    for pol in (Policy.fa2("bf16"), Policy.paper("fp16"), Policy.fa2("bf16").replace(rounding="stochastic", seed=4)):
        for normalize in ("deferred", "eager"):
            first = None
            for block_q in (1, 5, 16, 37, 64):
                for loop_order in ("q_outer", "kv_outer"):
                    got = fadev.flash_attention(q, k, v, pol, block_q=block_q, block_kv=8, loop_order=loop_order,
                                                normalize=normalize, causal=True, return_lse=True)
                    if first is None:
                        first = got
                    for g, w in zip(got, first):
                        assert bits_mismatch(g, w) is None, f"{pol} {normalize} block_q={block_q} {loop_order}"


def test_state_format_makes_kv_outer_differ():
    """state = bf16 under fa2 stages: kv_outer rounds O and l to bf16 between K/V blocks, so it differs
    from q_outer; block_q still changes nothing within one loop order."""
    pol = Policy.fa2("bf16").replace(state="bf16")
    q, k, v = make_qkv(32, 1, 2, 2, 16, 48, 8)
    q_outer = fadev.flash_attention(q, k, v, pol, block_q=4, block_kv=8, loop_order="q_outer", return_lse=True)
    kv_outer = fadev.flash_attention(q, k, v, pol, block_q=4, block_kv=8, loop_order="kv_outer", return_lse=True)
    assert bits_mismatch(q_outer[0], kv_outer[0]) is not None
    assert bits_mismatch(q_outer[1], kv_outer[1]) is not None
    for block_q in (1, 3, 16):
        again = fadev.flash_attention(q, k, v, pol, block_q=block_q, block_kv=8, loop_order="kv_outer",
                                      return_lse=True)
        assert bits_mismatch(again[0], kv_outer[0]) is None and bits_mismatch(again[1], kv_outer[1]) is None
    # with state None the same policy gives q_outer's bits in both orders
    plain = pol.replace(state=None)
    a = fadev.flash_attention(q, k, v, plain, block_q=4, block_kv=8, loop_order="q_outer", return_lse=True)
    b = fadev.flash_attention(q, k, v, plain, block_q=4, block_kv=8, loop_order="kv_outer", return_lse=True)
    assert bits_mismatch(a[0], b[0]) is None and bits_mismatch(a[1], b[1]) is None
    assert bits_mismatch(a[0], q_outer[0]) is None


# ------------------------------------------------------------ determinism


def test_deterministic_across_runs_and_threads():
    q, k, v = make_qkv(41, 2, 4, 2, 70, 66, 16)
    pols = (Policy.fa2("bf16"), Policy.paper("fp8_e4m3").replace(rounding="stochastic", seed=12))
    saved = fadev.get_num_threads()
    try:
        results = []
        for threads in (1, 2, 2):
            fadev.set_num_threads(threads)
            run = []
            for pol in pols:
                run.append(fadev.baseline_attention(q, k, v, pol, causal=True, return_lse=True))
                for loop_order in ("q_outer", "kv_outer"):
                    run.append(fadev.flash_attention(q, k, v, pol, block_q=16, block_kv=32, loop_order=loop_order,
                                                     causal=True, return_lse=True))
            results.append(run)
    finally:
        fadev.set_num_threads(saved)
    for run in results[1:]:
        for (out, lse), (out0, lse0) in zip(run, results[0]):
            assert bits_mismatch(out, out0) is None and bits_mismatch(lse, lse0) is None


# ------------------------------------------------------------ NaN, Inf, masking

NAN_POLICIES = [Policy.golden(), Policy.paper("bf16"), Policy.fa2("fp8_e4m3")]


@pytest.mark.parametrize("policy", NAN_POLICIES, ids=[p.name for p in NAN_POLICIES])
def test_nan_in_q_row_poisons_that_row_only(policy):
    q, k, v = make_qkv(51, 1, 2, 1, 6, 10, 4)
    q[0, 1, 3, 2] = np.nan
    for kernel in ("baseline", "flash"):
        if kernel == "baseline":
            out, lse = fadev.baseline_attention(q, k, v, policy, return_lse=True)
            want = ref.baseline_attention(q, k, v, policy)
        else:
            out, lse = fadev.flash_attention(q, k, v, policy, block_q=2, block_kv=3, return_lse=True)
            want = ref.flash_attention(q, k, v, policy, 2, 3, policy.loop_order, policy.normalize, policy.exp)
        nan_rows = np.zeros(out.shape[:3], dtype=bool)
        nan_rows[0, 1, 3] = True
        assert np.isnan(out[nan_rows]).all() and np.isnan(lse[nan_rows]).all(), kernel
        assert np.isfinite(out[~nan_rows]).all() and np.isfinite(lse[~nan_rows]).all(), kernel
        assert_same_bits(out, want[0], f"{kernel} out", f"policy={policy}")
        assert_same_bits(lse, want[1], f"{kernel} lse", f"policy={policy}")


def test_nan_in_k_poisons_rows_that_see_it():
    q, k, v = make_qkv(52, 1, 1, 1, 8, 8, 4)
    k[0, 0, 5, 0] = np.nan
    out, lse = fadev.flash_attention(q, k, v, Policy.fa2("bf16"), block_kv=3, causal=True, return_lse=True)
    sees = np.arange(8) >= 5
    assert np.isnan(out[0, 0, sees]).all() and np.isnan(lse[0, 0, sees]).all()
    assert np.isfinite(out[0, 0, ~sees]).all() and np.isfinite(lse[0, 0, ~sees]).all()


INF_CASES = [("q", (0, 0, 2, 1), np.inf), ("q", (0, 1, 4, 0), -np.inf), ("k", (0, 0, 3, 2), np.inf),
             ("k", (0, 0, 0, 1), -np.inf), ("v", (0, 0, 6, 3), np.inf), ("v", (0, 0, 1, 0), -np.inf),
             ("q", (0, 0, 0, 0), 1e30)]


@pytest.mark.parametrize("policy", NAN_POLICIES + [Policy.naive("fp16")], ids=lambda p: p.name)
@pytest.mark.parametrize("where, index, value", INF_CASES, ids=[f"{w}{i}={v}" for w, i, v in INF_CASES])
def test_inf_inputs_follow_the_spec(policy, where, index, value):
    """Infinite (or overflowing) inputs: what docs/numerics.md gives, as the twin computes it."""
    q, k, v = make_qkv(53, 1, 2, 1, 7, 9, 4)
    {"q": q, "k": k, "v": v}[where][index] = value
    for causal in (False, True):
        context = f"policy={policy} {where}{index}={value} causal={causal}"
        got = fadev.baseline_attention(q, k, v, policy, causal=causal, return_lse=True)
        want = ref.baseline_attention(q, k, v, policy, causal=causal)
        assert_same_bits(got[0], want[0], "baseline out", context)
        assert_same_bits(got[1], want[1], "baseline lse", context)
        for normalize in ("deferred", "eager"):
            got = fadev.flash_attention(q, k, v, policy, block_q=3, block_kv=4, normalize=normalize, causal=causal,
                                        return_lse=True)
            want = ref.flash_attention(q, k, v, policy, 3, 4, policy.loop_order, normalize, policy.exp, causal=causal)
            assert_same_bits(got[0], want[0], f"flash out ({normalize})", context)
            assert_same_bits(got[1], want[1], f"flash lse ({normalize})", context)


@pytest.mark.parametrize("policy", [Policy.golden(), Policy.fa1("bf16"), Policy.paper("fp8_e4m3")],
                         ids=lambda p: p.name)
def test_fully_masked_rows(policy):
    """causal with Nq > Nk: rows i < Nq - Nk see no key and give out 0, lse -inf."""
    Nq, Nk = 9, 4
    q, k, v = make_qkv(61, 1, 2, 1, Nq, Nk, 5)
    empty = np.arange(Nq) < Nq - Nk
    runs = [fadev.baseline_attention(q, k, v, policy, causal=True, return_lse=True)]
    for loop_order in ("q_outer", "kv_outer"):
        runs.append(fadev.flash_attention(q, k, v, policy, block_q=2, block_kv=3, loop_order=loop_order, causal=True,
                                          return_lse=True))
    for out, lse in runs:
        assert (out[:, :, empty] == 0).all() and np.isneginf(lse[:, :, empty]).all()
        assert np.isfinite(out[:, :, ~empty]).all() and np.isfinite(lse[:, :, ~empty]).all()


# ------------------------------------------------------------ FlashAttention's 2x rule


@pytest.mark.parametrize("fmt", ["bf16", "fp16"])
@pytest.mark.parametrize("N, seed", [(256, 1), (384, 2), (512, 3)])
def test_fa2_error_within_twice_naive_baseline(fmt, N, seed):
    """FlashAttention's own acceptance rule: flash under fa2(F) is at most 2x as far from golden as
    standard attention in F (baseline under naive(F)), max abs error, on inputs exact in F."""
    q, k, v = (fadev.round(t, fmt) for t in make_qkv(seed, 1, 2, 2, N, N, 64))
    gold = fadev.baseline_attention(q, k, v, Policy.golden())
    flash = fadev.flash_attention(q, k, v, Policy.fa2(fmt), causal=False)
    naive = fadev.baseline_attention(q, k, v, Policy.naive(fmt))
    flash_err, naive_err = np.max(np.abs(flash - gold)), np.max(np.abs(naive - gold))
    assert 0 < flash_err <= 2 * naive_err, f"fa2({fmt}) {flash_err:.3g} vs naive({fmt}) {naive_err:.3g}"
