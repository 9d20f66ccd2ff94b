"""Attention backward: golden accuracy (torch autograd, an analytic NumPy derivation, finite
differences), bit parity of the C kernels with the slow twin (tests/reference_backward.py =
docs/numerics.md "Backward"), what tiling may change, determinism, and FlashAttention's error rule.

Parity cases are drawn from seeded generators; each test id and each failure message carry the whole
parameter set (policy with every stage, shapes, tiling, options, data seed, which forward made out/lse).
"""
import dataclasses

import numpy as np
import pytest

import fadev
import helpers
import reference as ref
import reference_backward as rb
from fadev.policy import BACKWARD_STAGES, STAGES, Policy
from helpers import make_inputs, numpy_grads, rel_err, torch_grads

HEAD_LAYOUTS = ((1, 1), (2, 1), (2, 2), (3, 1), (4, 2))  # (H, Hkv): grouped-query when Hkv < H
GRADS = ("dq", "dk", "dv")


# ------------------------------------------------------------ helpers


def assert_same_bits(got, want, what, context):
    """The C kernels against their Python twin: every bit, signed zeros distinguished, any NaN equal to any NaN."""
    return helpers.assert_same_bits(got, want, what, context, nan="any")


@dataclasses.dataclass(frozen=True)
class Case:
    """One backward case; str() is the full parameter set. `forward`: which forward made out and lse,
    "own" (the case's policy, same kernel and tiling) or "golden" (then R_out(out), R_stats(lse) round)."""

    policy: Policy
    B: int
    H: int
    Hkv: int
    Nq: int
    Nk: int
    D: int
    block_q: int
    block_kv: int
    exp: str
    causal: bool
    scale: float | None
    data_seed: int
    spread: float
    forward: str
    magnitude: float = 1.0

    def __str__(self):
        fields = " ".join(f"{f.name}={getattr(self, f.name)}" for f in dataclasses.fields(self) if f.name != "policy")
        stages = " ".join(f"{s}={v}" for s, v in self.policy.stages(backward=True).items())
        return f"policy={self.policy.name} [{stages} rounding={self.policy.rounding} seed={self.policy.seed}] {fields}"

    @property
    def id(self):
        p = self.policy
        return (f"{p.name}-{p.rounding}{p.seed if p.rounding == 'stochastic' else ''}-B{self.B}H{self.H}/{self.Hkv}"
                f"-Nq{self.Nq}Nk{self.Nk}D{self.D}-{self.block_q}x{self.block_kv}-{self.exp}"
                f"{'-causal' if self.causal else ''}-s{self.scale}-d{self.data_seed}x{self.spread}-fwd{self.forward}")

    def inputs(self):
        return make_inputs(self.data_seed, self.B, self.H, self.Hkv, self.Nq, self.Nk, self.D, self.spread,
                           self.magnitude)

    def saved(self, kernel, q, k, v):
        """(out, lse) of the forward named by `forward`, from fadev's C forward (bit-identical to
        tests/reference.py, test_attention.py checks that)."""
        pol = self.policy if self.forward == "own" else Policy.golden()
        if kernel == "baseline":
            return fadev.baseline_attention(q, k, v, pol, causal=self.causal, scale=self.scale, return_lse=True)
        return fadev.flash_attention(q, k, v, pol, block_q=self.block_q, block_kv=self.block_kv, exp=self.exp,
                                     causal=self.causal, scale=self.scale, return_lse=True)

    def run(self, kernel, twin):
        """(dq, dk, dv) of fadev's C kernel or (twin=True) of tests/reference_backward.py."""
        q, k, v, dout = self.inputs()
        out, lse = self.saved(kernel, q, k, v)
        if kernel == "baseline":
            f = rb.baseline_attention_backward if twin else fadev.baseline_attention_backward
            return f(q, k, v, out, lse, dout, self.policy, causal=self.causal, scale=self.scale)
        f = rb.flash_attention_backward if twin else fadev.flash_attention_backward
        return f(q, k, v, out, lse, dout, self.policy, block_q=self.block_q, block_kv=self.block_kv, exp=self.exp,
                 causal=self.causal, scale=self.scale)


def draw_case(rng, policy, max_n=10, **fixed):
    """A random small case: shapes (GQA, Nq != Nk), tiling 1..N + 1 (non-square), options."""
    H, Hkv = HEAD_LAYOUTS[rng.integers(len(HEAD_LAYOUTS))]
    Nq = int(rng.integers(1, max_n + 1))
    Nk = Nq if rng.random() < 0.3 else int(rng.integers(1, max_n + 1))
    case = Case(policy, B=int(rng.integers(1, 3)), H=H, Hkv=Hkv, Nq=Nq, Nk=Nk, D=int(rng.integers(1, 9)),
                block_q=int(rng.integers(1, Nq + 2)), block_kv=int(rng.integers(1, Nk + 2)),
                exp=str(rng.choice(["exp", "exp2"])), causal=bool(rng.random() < 0.5),
                scale=None if rng.random() < 0.7 else float(rng.choice([0.3, 1.0, 2.5])),
                data_seed=int(rng.integers(2**31)), spread=float(rng.choice([1.0, 1.0, 4.0])),
                forward="golden" if rng.random() < 0.3 else "own")
    return dataclasses.replace(case, **fixed)


def parity_policies():
    """(policy, fixed case fields): every preset at bf16, fp16, fp32; one backward stage lowered to bf16
    from golden and from fa2(fp16); one raised to fp64 from naive(bf16) and paper(bf16); stochastic
    rounding in one stage at a time (every backward stage and every forward stage the backward
    recomputes, so each counter is checked, and the scale on dS: event 22); rtz and stochastic on whole presets."""
    pols = [(Policy.golden(), {})]
    pols += [(Policy.preset(p, f), {}) for p in ("paper", "naive", "fa2", "fa1", "efficient", "cudnn", "torch_math")
             for f in ("bf16", "fp16", "fp32")]
    pols += [(Policy.golden().replace(dsoft="bf16", bwd_scale="ds", rounding="stochastic", seed=2**62 + 5), {}),
             (Policy.fa2("fp16").replace(bwd_scale="ds"), {})]
    pols += [(base.replace(**{s: "bf16"}), {}) for base in (Policy.golden(), Policy.fa2("fp16"))
             for s in BACKWARD_STAGES]
    pols += [(base.replace(**{s: "fp64"}), {}) for base in (Policy.naive("bf16"), Policy.paper("bf16"))
             for s in BACKWARD_STAGES]
    for n, s in enumerate(BACKWARD_STAGES + STAGES):
        pol = Policy.golden().replace(**{s: "bf16"}, rounding="stochastic", seed=2**63 + 101 * n)
        # out and lse from the golden forward, so that R_out(out) and R_stats(lse) (events 1, 2) round
        pols.append((pol, {"forward": "golden"}))
        if s == "stats":
            pols.append((pol, {"forward": "golden", "exp": "exp2"}))  # event 3: R_stats(LSE * c3)
    for i, base in enumerate((Policy.fa2("bf16"), Policy.paper("fp16"), Policy.naive("bf16"), Policy.fa1("fp16"),
                              Policy.efficient("bf16"),
                              Policy.golden().replace(dp_acc="bf16", grad_acc="fp16", dq_acc="bf16"))):
        pols.append((base.replace(rounding="rtz"), {}))
        pols.append((base.replace(rounding="stochastic", seed=1000003 * (i + 1) + 2**40), {}))
    return pols


def draw_cases():
    rng = np.random.default_rng(20240607)
    cases = []
    for pol, fixed in parity_policies():
        cases += [draw_case(rng, pol, **fixed) for _ in range(2)]
        if pol.name.startswith(("fa1", "fa2")) or pol.rounding != "rne":
            cases.append(draw_case(rng, pol, **fixed))
    return cases


def medium_cases():
    """Sizes past any SIMD width or unrolling of the C kernels (keys, rows and dims beyond 32, 4 and
    16), one query head pair sharing K/V; data whose products leave fp32's normal range (the kernels'
    fp32 tier must fall back); logical blocks longer than the kernels' 64-row work tiles."""
    rng = np.random.default_rng(78)
    cases = []
    for pol, n, magnitude in ((Policy.golden(), 40, 1.0), (Policy.fa2("bf16"), 36, 1.0),
                              (Policy.naive("fp16"), 34, 1.0), (Policy.paper("bf16"), 33, 1.0), (Policy.fa1("fp16"), 35, 1.0),
                              (Policy.fa2("bf16").replace(rounding="stochastic", seed=3), 19, 1.0),
                              (Policy.fa2("bf16"), 33, 1e-20), (Policy.fa2("fp32"), 33, 1e-20),
                              (Policy.efficient("fp16"), 34, 1.0)):
        Nq, Nk = n + int(rng.integers(0, 5)), n + int(rng.integers(0, 5))
        cases.append(Case(pol, B=1, H=2, Hkv=1, Nq=Nq, Nk=Nk, D=int(rng.integers(17, 21)),
                          block_q=int(rng.integers(5, Nq + 1)), block_kv=int(rng.integers(5, Nk + 1)), exp=pol.exp,
                          causal=bool(rng.random() < 0.5), scale=None, data_seed=int(rng.integers(2**31)),
                          spread=2.0, forward="own", magnitude=magnitude))
    cases.append(Case(Policy.fa2("bf16"), 1, 1, 1, 70, 133, 3, 70, 133, "exp2", True, None, 5, 2.0, "own"))
    cases.append(Case(Policy.naive("fp16").replace(rounding="rtz"), 1, 2, 1, 67, 66, 2, 66, 65, "exp", False, None,
                      6, 2.0, "own"))
    return cases


CASES = draw_cases()
MEDIUM = medium_cases()
BASELINE_CASES = CASES[::2] + MEDIUM


# ------------------------------------------------------------ the twin under golden


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", [(2, 4, 2, 7, 10, 5), (1, 3, 1, 9, 6, 4), (1, 2, 2, 8, 8, 3)])
def test_twin_golden_is_torch_autograd(shape, causal):
    """The twin's golden gradients equal float64 torch autograd (normwise relative <= 1e-12), baseline
    and flash with odd tilings and both exp forms; Nq > Nk causal has rows that see no key."""
    q, k, v, dout = make_inputs(17, *shape, spread=2.0)
    want = torch_grads(q, k, v, dout, causal)
    gold = Policy.golden()
    out, lse = ref.baseline_attention(q, k, v, gold, causal=causal)
    runs = {"baseline": rb.baseline_attention_backward(q, k, v, out, lse, dout, gold, causal=causal)}
    for block_q, block_kv, exp in ((1, 1, "exp"), (3, 4, "exp2"), (5, 2, "exp"), (shape[3] + 1, 3, "exp2")):
        out, lse = ref.flash_attention(q, k, v, gold, block_q, block_kv, "q_outer", "deferred", exp, causal=causal)
        runs[f"flash {block_q}x{block_kv} {exp}"] = rb.flash_attention_backward(q, k, v, out, lse, dout, gold,
                                                                              block_q, block_kv, exp, causal=causal)
    for name, got in runs.items():
        for g, w, what in zip(got, want, GRADS):
            assert rel_err(g, w) <= 1e-12, f"{name} {what} shape={shape} causal={causal}: {rel_err(g, w):.3g}"


@pytest.mark.parametrize("causal", [False, True])
def test_twin_golden_is_numpy_derivation(causal):
    """An independent derivation (NumPy matrix algebra) agrees with the twin and with torch, scale given."""
    q, k, v, dout = make_inputs(18, 2, 4, 2, 6, 9, 4, spread=2.0)
    want = numpy_grads(q, k, v, dout, causal, scale=0.7)
    for g, w, what in zip(torch_grads(q, k, v, dout, causal, scale=0.7), want, GRADS):
        assert rel_err(g, w) <= 1e-13, f"torch vs numpy {what}"
    gold = Policy.golden()
    out, lse = ref.flash_attention(q, k, v, gold, 2, 4, "q_outer", "deferred", "exp2", causal=causal, scale=0.7)
    for got in (rb.baseline_attention_backward(q, k, v, out, lse, dout, gold, causal=causal, scale=0.7),
                rb.flash_attention_backward(q, k, v, out, lse, dout, gold, 4, 3, "exp2", causal=causal, scale=0.7)):
        for g, w, what in zip(got, want, GRADS):
            assert rel_err(g, w) <= 1e-12, f"{what} causal={causal}: {rel_err(g, w):.3g}"


@pytest.mark.parametrize("shape, causal", [((1, 2, 1, 3, 4, 3), False), ((1, 2, 1, 4, 3, 2), True)])
def test_twin_golden_is_finite_differences(shape, causal):
    """Central differences of L = sum(out * dout) with the twin's golden forward, h = 1e-5: truncation
    ~h^2 and cancellation ~eps/h, both ~1e-10, so 1e-8 (normwise) separates right from any wrong term."""
    q, k, v, dout = make_inputs(19, *shape, spread=1.5)
    gold = Policy.golden()

    def loss(q, k, v):
        return float(np.sum(ref.baseline_attention(q, k, v, gold, causal=causal)[0] * dout))

    h = 1e-5
    tensors = [q, k, v]
    fd = []
    for which, t in enumerate(tensors):
        grad = np.zeros_like(t)
        for index in np.ndindex(t.shape):
            plus, minus = [x.copy() for x in tensors], [x.copy() for x in tensors]
            plus[which][index] += h
            minus[which][index] -= h
            grad[index] = (loss(*plus) - loss(*minus)) / (2 * h)
        fd.append(grad)
    out, lse = ref.baseline_attention(q, k, v, gold, causal=causal)
    for got in (rb.baseline_attention_backward(q, k, v, out, lse, dout, gold, causal=causal),
                rb.flash_attention_backward(q, k, v, out, lse, dout, gold, 2, 2, "exp", causal=causal)):
        for g, w, what in zip(got, fd, GRADS):
            assert rel_err(g, w) <= 1e-8, f"{what} shape={shape} causal={causal}: {rel_err(g, w):.3g}"


def test_twin_tiling_dependence():
    """What the spec lets tiling change, on the twin under fa2(bf16): dq depends on block_kv only, dk and
    dv on block_q only (bits), and both do change something."""
    q, k, v, dout = make_inputs(20, 1, 2, 1, 9, 11, 4, spread=3.0)
    pol = Policy.fa2("bf16").replace(dq_acc="bf16", dkv_acc="bf16")
    out, lse = ref.flash_attention(q, k, v, pol, 4, 4, "q_outer", "deferred", "exp2")
    grads = {(bq, bkv): rb.flash_attention_backward(q, k, v, out, lse, dout, pol, bq, bkv, "exp2")
             for bq in (1, 4, 9) for bkv in (1, 4, 11)}
    for (bq, bkv), (dq, dk, dv) in grads.items():
        assert_same_bits(dq, grads[1, bkv][0], "dq vs block_q=1", f"{bq}x{bkv}")
        assert_same_bits(dk, grads[bq, 1][1], "dk vs block_kv=1", f"{bq}x{bkv}")
        assert_same_bits(dv, grads[bq, 1][2], "dv vs block_kv=1", f"{bq}x{bkv}")
    assert not np.array_equal(grads[1, 1][0], grads[1, 4][0])
    assert not np.array_equal(grads[1, 1][1], grads[4, 1][1]) and not np.array_equal(grads[1, 1][2], grads[4, 1][2])


# ------------------------------------------------------------ C kernels under golden


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", [(2, 4, 2, 33, 47, 16), (1, 3, 1, 40, 29, 8), (1, 2, 2, 64, 64, 64)])
def test_golden_is_torch_autograd(shape, causal):
    """fadev's golden gradients equal float64 torch autograd and the NumPy derivation (<= 1e-12)."""
    q, k, v, dout = make_inputs(21, *shape, spread=2.0)
    want = torch_grads(q, k, v, dout, causal)
    for g, w, what in zip(numpy_grads(q, k, v, dout, causal), want, GRADS):
        assert rel_err(g, w) <= 1e-13, f"numpy vs torch {what}"
    gold = Policy.golden()
    out, lse = fadev.baseline_attention(q, k, v, gold, causal=causal, return_lse=True)
    runs = {"baseline": fadev.baseline_attention_backward(q, k, v, out, lse, dout, gold, causal=causal)}
    for block_q, block_kv, exp in ((16, 8, "exp2"), (7, 5, "exp"), (1, 64, "exp2")):
        out, lse = fadev.flash_attention(q, k, v, gold, block_q=block_q, block_kv=block_kv, exp=exp, causal=causal,
                                         return_lse=True)
        runs[f"flash {block_q}x{block_kv} {exp}"] = fadev.flash_attention_backward(
            q, k, v, out, lse, dout, gold, block_q=block_q, block_kv=block_kv, exp=exp, causal=causal)
    for name, got in runs.items():
        for g, w, what in zip(got, want, GRADS):
            assert rel_err(g, w) <= 1e-12, f"{name} {what} shape={shape} causal={causal}: {rel_err(g, w):.3g}"


@pytest.mark.parametrize("causal", [False, True])
def test_golden_flash_equals_baseline(causal):
    """Under golden every tiling (odd, 1, N, beyond N) gives baseline's gradients to 1e-12."""
    N, D = 24, 8
    q, k, v, dout = make_inputs(22, 1, 2, 1, N, N + 3, D, spread=2.0)
    gold = Policy.golden()
    out, lse = fadev.baseline_attention(q, k, v, gold, causal=causal, return_lse=True)
    base = fadev.baseline_attention_backward(q, k, v, out, lse, dout, gold, causal=causal)
    for block_q, block_kv in ((1, 1), (1, N + 3), (N, 1), (3, 5), (7, 2), (N - 1, 13), (40, 40)):
        for exp in ("exp", "exp2"):
            got = fadev.flash_attention_backward(q, k, v, out, lse, dout, gold, block_q=block_q, block_kv=block_kv,
                                                 exp=exp, causal=causal)
            for g, w, what in zip(got, base, GRADS):
                assert rel_err(g, w) <= 1e-12, f"{what} {block_q}x{block_kv} {exp} causal={causal}"


# ------------------------------------------------------------ bit parity C == twin


@pytest.mark.parametrize("case", CASES + MEDIUM, ids=[c.id for c in CASES + MEDIUM])
def test_flash_backward_parity(case):
    for got, want, what in zip(case.run("flash", twin=False), case.run("flash", twin=True), GRADS):
        assert_same_bits(got, want, f"flash {what}", case)


@pytest.mark.parametrize("case", BASELINE_CASES, ids=[c.id for c in BASELINE_CASES])
def test_baseline_backward_parity(case):
    for got, want, what in zip(case.run("baseline", twin=False), case.run("baseline", twin=True), GRADS):
        assert_same_bits(got, want, f"baseline {what}", case)


SWEEP_POLICIES = [Policy.fa2("bf16").replace(dq_acc="bf16", dkv_acc="fp16"), Policy.efficient("fp16"),
                  Policy.paper("fp16").replace(rounding="stochastic", seed=99)]


@pytest.mark.parametrize("policy", SWEEP_POLICIES, ids=[p.name + "-" + p.rounding for p in SWEEP_POLICIES])
def test_flash_backward_parity_every_tiling(policy):
    """Every block_q from 1 to Nq + 1 with every block_kv from 1 to Nk + 1, exp and exp2, causal or not,
    on one GQA input with Nq != Nk."""
    for block_q in range(1, 7):
        for block_kv in range(1, 6):
            for exp in ("exp", "exp2"):
                for causal in (False, True):
                    case = Case(policy, 1, 2, 1, 5, 4, 3, block_q, block_kv, exp, causal, None, 23, 2.0, "own")
                    for got, want, what in zip(case.run("flash", False), case.run("flash", True), GRADS):
                        assert_same_bits(got, want, f"flash {what}", case)


def test_policy_defaults_are_used():
    """None tiling arguments take the policy's (fa2: 128 x 64, exp2)."""
    q, k, v, dout = make_inputs(24, 1, 2, 1, 70, 140, 3)
    # P', dS and the gradients wide enough for exp vs exp2 to show, dQacc in bf16 for block_kv to show
    pol = Policy.fa2("bf16").replace(block_q=32, block_kv=48, bwd_p="fp32", ds="fp32", dq_acc="bf16", grad="fp64")
    out, lse = fadev.flash_attention(q, k, v, pol, return_lse=True)
    got = fadev.flash_attention_backward(q, k, v, out, lse, dout, pol)
    want = fadev.flash_attention_backward(q, k, v, out, lse, dout, pol, block_q=32, block_kv=48, exp="exp2")
    for g, w, what in zip(got, want, GRADS):
        assert_same_bits(g, w, what, f"policy={pol} defaults")
    for other in ({"block_q": 32, "block_kv": 48, "exp": "exp"}, {"block_q": 64, "block_kv": 64, "exp": "exp2"}):
        grads = fadev.flash_attention_backward(q, k, v, out, lse, dout, pol, **other)
        assert not all(np.array_equal(g, o) for g, o in zip(got, grads)), f"{other} gives the defaults' bits"


SPECIAL = [("q", (0, 1, 3, 2), np.nan), ("q", (0, 0, 0, 0), 1e30), ("k", (0, 0, 3, 2), np.inf),
           ("v", (0, 0, 1, 0), -np.inf), ("dout", (0, 1, 2, 1), np.nan), ("dout", (0, 0, 4, 3), np.inf),
           ("lse", (0, 0, 5), -np.inf), ("out", (0, 1, 0, 0), 1e300)]
SPECIAL_POLICIES = [Policy.golden(), Policy.fa2("bf16"), Policy.naive("fp16"), Policy.paper("fp8_e4m3")]


@pytest.mark.parametrize("policy", SPECIAL_POLICIES, ids=lambda p: p.name)
@pytest.mark.parametrize("where, index, value", SPECIAL, ids=[f"{w}{i}={v}" for w, i, v in SPECIAL])
def test_special_values_follow_the_spec(policy, where, index, value):
    """NaN, infinite or overflowing q, k, v, dout, out or lse: what docs/numerics.md gives (IEEE fp64
    arithmetic, then rounding), as the twin computes it, for both kernels, causal or not."""
    q, k, v, dout = make_inputs(28, 1, 2, 1, 6, 7, 4)
    tensors = {"q": q, "k": k, "v": v, "dout": dout}
    if where in tensors:
        tensors[where][index] = value
    for causal in (False, True):
        context = f"policy={policy} {where}{index}={value} causal={causal}"
        saved = {"baseline": fadev.baseline_attention(q, k, v, policy, causal=causal, return_lse=True),
                 "flash": fadev.flash_attention(q, k, v, policy, block_q=4, block_kv=3, causal=causal,
                                                return_lse=True)}
        for kernel, (out, lse) in saved.items():
            if where in ("out", "lse"):
                out, lse = out.copy(), lse.copy()
                {"out": out, "lse": lse}[where][index] = value
            if kernel == "baseline":
                got = fadev.baseline_attention_backward(q, k, v, out, lse, dout, policy, causal=causal)
                want = rb.baseline_attention_backward(q, k, v, out, lse, dout, policy, causal=causal)
            else:
                got = fadev.flash_attention_backward(q, k, v, out, lse, dout, policy, block_q=4, block_kv=3,
                                                     causal=causal)
                want = rb.flash_attention_backward(q, k, v, out, lse, dout, policy, 4, 3, policy.exp, causal=causal)
            for g, w, what in zip(got, want, GRADS):
                assert_same_bits(g, w, f"{kernel} {what}", context)


# ------------------------------------------------------------ what tiling changes, determinism


def test_tiling_dependence():
    """dq depends on block_kv only, dk and dv on block_q only (bits), under fa2(bf16) with bf16 block
    accumulators at sizes past the kernels' vector widths."""
    q, k, v, dout = make_inputs(25, 1, 4, 2, 45, 51, 20, spread=3.0)
    pol = Policy.fa2("bf16").replace(dq_acc="bf16", dkv_acc="bf16")
    out, lse = fadev.flash_attention(q, k, v, pol, return_lse=True)
    grads = {(bq, bkv): fadev.flash_attention_backward(q, k, v, out, lse, dout, pol, block_q=bq, block_kv=bkv,
                                                       causal=True)
             for bq in (1, 16, 45) for bkv in (1, 16, 51)}
    for (bq, bkv), (dq, dk, dv) in grads.items():
        assert_same_bits(dq, grads[1, bkv][0], "dq vs block_q=1", f"{bq}x{bkv}")
        assert_same_bits(dk, grads[bq, 1][1], "dk vs block_kv=1", f"{bq}x{bkv}")
        assert_same_bits(dv, grads[bq, 1][2], "dv vs block_kv=1", f"{bq}x{bkv}")
    assert not np.array_equal(grads[1, 1][0], grads[1, 16][0])
    assert not np.array_equal(grads[1, 1][1], grads[16, 1][1])


def test_deterministic_across_runs_and_threads():
    q, k, v, dout = make_inputs(26, 2, 4, 2, 70, 66, 16)
    pols = (Policy.fa2("bf16"), Policy.paper("fp16").replace(rounding="stochastic", seed=12))
    results = []
    for threads in (1, 2, 2):
        fadev.set_num_threads(threads)
        run = []
        for pol in pols:
            out, lse = fadev.baseline_attention(q, k, v, pol, causal=True, return_lse=True)
            run.append(fadev.baseline_attention_backward(q, k, v, out, lse, dout, pol, causal=True))
            out, lse = fadev.flash_attention(q, k, v, pol, block_q=16, block_kv=32, causal=True, return_lse=True)
            run.append(fadev.flash_attention_backward(q, k, v, out, lse, dout, pol, block_q=16, block_kv=32,
                                                      causal=True))
        results.append(run)
    for threads, run in zip((2, 2), results[1:]):
        for n, (grads, grads0) in enumerate(zip(run, results[0])):
            for g, w, what in zip(grads, grads0, GRADS):
                assert_same_bits(g, w, f"{what} of run {n}, {threads} threads vs 1", "determinism")


def test_rows_without_keys_get_zero_gradients():
    """causal with Nq > Nk: rows i < Nq - Nk see no key; their dq rows are exactly +0. (Row Nq - Nk
    sees one key: P = 1 and dS = dP - D = 0 up to rounding, so only rows past it are checked nonzero.)"""
    q, k, v, dout = make_inputs(27, 1, 2, 1, 9, 4, 5)
    empty, several = np.arange(9) < 5, np.arange(9) > 5
    for pol in (Policy.golden(), Policy.fa2("bf16"), Policy.naive("fp16").replace(rounding="stochastic", seed=5)):
        out, lse = fadev.flash_attention(q, k, v, pol, block_q=2, block_kv=3, causal=True, return_lse=True)
        for dq, dk, dv in (fadev.flash_attention_backward(q, k, v, out, lse, dout, pol, block_q=2, block_kv=3,
                                                          causal=True),
                           fadev.baseline_attention_backward(q, k, v, out, lse, dout, pol, causal=True)):
            assert not np.signbit(dq[:, :, empty]).any() and (dq[:, :, empty] == 0).all(), pol
            assert np.isfinite(dq).all() and (dq[:, :, several] != 0).all(), pol
            assert np.isfinite(dk).all() and np.isfinite(dv).all(), pol


# ------------------------------------------------------------ FlashAttention's error rule


@pytest.mark.parametrize("fmt", ["bf16", "fp16"])
@pytest.mark.parametrize("N, seed, causal", [(128, 1, False), (192, 2, True), (256, 3, False)])
def test_fa2_gradients_within_3x_naive_baseline(fmt, N, seed, causal):
    """FlashAttention's acceptance rule for the backward: under fa2(F) each gradient's max abs error vs
    golden is at most 3x that of standard attention in F (baseline under naive(F)); each policy's
    gradients start from its own forward's out and lse; inputs (and dout) exact in F."""
    q, k, v, dout = (fadev.round(t, fmt) for t in make_inputs(seed, 1, 2, 2, N, N, 64))
    grads = {}
    for name, pol in (("golden", Policy.golden()), ("naive", Policy.naive(fmt))):
        out, lse = fadev.baseline_attention(q, k, v, pol, causal=causal, return_lse=True)
        grads[name] = fadev.baseline_attention_backward(q, k, v, out, lse, dout, pol, causal=causal)
    pol = Policy.fa2(fmt)
    out, lse = fadev.flash_attention(q, k, v, pol, causal=causal, return_lse=True)
    grads["fa2"] = fadev.flash_attention_backward(q, k, v, out, lse, dout, pol, causal=causal)
    for n, what in enumerate(GRADS):
        flash_err = np.max(np.abs(grads["fa2"][n] - grads["golden"][n]))
        naive_err = np.max(np.abs(grads["naive"][n] - grads["golden"][n]))
        assert 0 < flash_err <= 3 * naive_err, f"{what}: fa2({fmt}) {flash_err:.3g} vs naive({fmt}) {naive_err:.3g}"
