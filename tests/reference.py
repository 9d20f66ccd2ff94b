"""The slow twin of fadev's attention kernels: this file is the spec, in executable form.

It follows docs/numerics.md line by line (operation order, one rounding event per operation,
stochastic-rounding counters) with scalar Python arithmetic, so that the C kernels (csrc/baseline.c,
csrc/flash.c) and the CUDA kernels can be compared with it bit for bit. It is written to be read,
not to be fast: one query row at a time, one key at a time, one rounding at a time.

Nothing here calls fadev's C core. Rounding to a format is re-implemented below from its
definition with integer arithmetic on the float64 significand (math.frexp / math.ldexp; what an
overflow becomes is reference_formats.overflow_value, the formats spec), and the
stochastic-rounding generator is Philox4x32-10 re-implemented in Python. fadev.Policy and
fadev.Format are used only as records of format parameters.

Public functions (4-D float64 arrays (B, H, N, D); K/V may have fewer heads, grouped-query):
    baseline_attention(q, k, v, policy, causal=False, scale=None) -> (out, lse)
    flash_attention(q, k, v, policy, block_q, block_kv, loop_order, normalize, exp,
                    causal=False, scale=None) -> (out, lse)
    round_value(x, fmt, mode, random53=0) and round_array(x, fmt, mode, seed, stream): scalar rounding
    philox4x32_10(counter, key), random53(seed, stream, index): the generator
"""
from __future__ import annotations

import math

import numpy as np

from reference_formats import overflow_value

MASK32 = 0xFFFFFFFF
LOG2E = float.fromhex("0x1.71547652b82fep+0")  # log2(e) rounded to fp64 (C's M_LOG2E)
LN2 = float.fromhex("0x1.62e42fefa39efp-1")  # ln 2 rounded to fp64 (C's M_LN2)
MODES = {"rne": "rne", "nearest": "rne", "rtz": "rtz", "toward_zero": "rtz", "stochastic": "sr", "sr": "sr"}

# Stage ids of the stochastic counters (docs/numerics.md, "Stochastic rounding counters").
IN_Q, IN_K, IN_V = 0, 1, 2
SCORE_ACC, SCORE_DOT, SCORE_SCALED = 3, 4, 5
SOFTMAX_SUB, SOFTMAX_EXP, SUM_ACC = 6, 7, 8
STATS_AL, STATS_ROWSUM, STATS_LNEW, STATS_LOG, STATS_LSE = 9, 10, 11, 12, 13
RESCALE_DIFF, RESCALE_ALPHA = 14, 15
P_STAGE, PV_ACC = 16, 17
OUT_ACC_AO, OUT_ACC_PV, OUT_ACC_SUM, STATE_OUT, STATE_STATS, OUT_STAGE, OUT_ACC_DIV = 18, 19, 20, 21, 22, 23, 24


# ---------------------------------------------------------------- Philox4x32-10


def philox4x32_10(counter, key):
    """Philox4x32-10 (Salmon et al., SC'11): four 32-bit counter words, two 32-bit key words."""
    c0, c1, c2, c3 = counter
    k0, k1 = key
    for _ in range(10):
        prod0 = 0xD2511F53 * c0
        prod1 = 0xCD9E8D57 * c2
        hi0, lo0 = prod0 >> 32, prod0 & MASK32
        hi1, lo1 = prod1 >> 32, prod1 & MASK32
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
        k0 = (k0 + 0x9E3779B9) & MASK32
        k1 = (k1 + 0xBB67AE85) & MASK32
    return c0, c1, c2, c3


def random53(seed, stream, index):
    """53 random bits for event `index` of `stream` under `seed`: counter (index lo, index hi, stream lo,
    stream hi), key (seed lo, seed hi), output the top 53 bits of the first two words."""
    counter = (index & MASK32, index >> 32 & MASK32, stream & MASK32, stream >> 32 & MASK32)
    c0, c1, _, _ = philox4x32_10(counter, (seed & MASK32, seed >> 32 & MASK32))
    return ((c0 << 32) | c1) >> 11


# ---------------------------------------------------------------- rounding to a format


def _is_fp64(fmt):
    return (fmt.precision, fmt.emin, fmt.emax, fmt.subnormals, fmt.has_inf) == (53, -1022, 1023, True, True)


def round_value(x: float, fmt, mode: str = "rne", random53_bits: int = 0) -> float:
    """x (a float64) rounded to `fmt` with `mode` ("rne", "rtz" or "sr"/"stochastic").

    Let x = M * 2^ue, M the integer significand of the float64 and ue the exponent of its last bit
    (ue = max(e, -1022) - 52 for |x| in [2^e, 2^(e+1))). The target quantum is 2^q with
    q = max(e, emin) - p + 1 (with subnormals) or, below 2^emin without subnormals, q = emin. The
    low `shift` = q - ue bits of M are dropped (`dropped`) and the kept part rounded:
        nearest-even: up if dropped > half, or dropped == half and the kept part is odd;
        toward zero:  never up;
        stochastic:   up with probability dropped / 2^shift. With r the 53 random bits: if shift <= 53,
                      up iff floor(r / 2^(53 - shift)) + dropped >= 2^shift; else up iff
                      r < floor(dropped / 2^(shift - 53)).
    A result above fmt.largest follows fmt.overflow. NaN stays NaN; inf stays inf when the format
    has infinities, else becomes NaN (or +-largest under "saturate").
    """
    mode = MODES[mode]
    if math.isnan(x):
        return x
    if math.isinf(x):
        if fmt.has_inf:
            return x
        value = fmt.largest if fmt.overflow == "saturate" else math.nan
        return -value if x < 0 else value
    if x == 0.0:
        return x
    negative = x < 0
    a = -x if negative else x
    _, e_frexp = math.frexp(a)  # a = f * 2^e_frexp, 1/2 <= f < 1
    e = e_frexp - 1  # a in [2^e, 2^(e+1))
    ue = max(e, -1022) - 52
    significand = int(math.ldexp(a, -ue))  # exact: a is a whole multiple of 2^ue
    if e >= fmt.emin:
        q = e - fmt.precision + 1
    elif fmt.subnormals:
        q = fmt.emin - fmt.precision + 1
    else:
        q = fmt.emin
    shift = q - ue
    if shift <= 0:
        kept, up = significand, 0  # already a multiple of the quantum (only when the format is wide)
        q = ue
    else:
        kept = significand >> shift
        dropped = significand & ((1 << shift) - 1)
        if mode == "rne":
            half = 1 << (shift - 1)
            up = dropped > half or (dropped == half and kept & 1 == 1)
        elif mode == "rtz":
            up = False
        elif shift <= 53:
            up = (random53_bits >> (53 - shift)) + dropped >= (1 << shift)
        else:
            up = random53_bits < (dropped >> (shift - 53))
    result = math.ldexp(kept + int(up), q)
    if result > fmt.largest:
        return overflow_value(fmt, negative, mode)
    return -result if negative else result


def round_array(x, fmt, mode="rne", seed=0, stream=0):
    """Element-wise round_value over a flattened array; element i draws random53(seed, stream, i),
    as fadev.round does (used to cross-check this file's rounding against the C core)."""
    flat = np.asarray(x, dtype=np.float64).ravel()
    sr = MODES[mode] == "sr"
    out = [round_value(float(v), fmt, mode, random53(seed, stream, i) if sr else 0) for i, v in enumerate(flat)]
    return np.array(out, dtype=np.float64).reshape(np.shape(x))


class _Rounder:
    """Rounding events of one policy. `r(fmt, x, stage, bh, i, u, w)` rounds x to fmt; stochastic
    rounding draws random53(seed, stage + 32 * bh, (i << 42) | (u << 21) | w)."""

    def __init__(self, policy):
        self.mode = MODES[policy.rounding]
        self.seed = policy.seed

    def r(self, fmt, x, stage, bh, i, u, w):
        if _is_fp64(fmt):
            return x  # every float64 is a value of fp64 (a shortcut, not a different rule)
        bits = 0
        if self.mode == "sr":
            bits = random53(self.seed, stage + 32 * bh, (i << 42) | (u << 21) | w)
        return round_value(x, fmt, self.mode, bits)


def round_constant(x, fmt):
    """Constants (scale, scale*log2(e), ln 2) are rounded once, always to nearest even."""
    return round_value(x, fmt, "rne")


# ---------------------------------------------------------------- elementary functions


def _exp(x):
    try:
        return math.exp(x)
    except OverflowError:
        return math.inf


def _exp2(x):
    try:
        return math.exp2(x)
    except OverflowError:
        return math.inf


def _log(x):
    if x == 0.0:
        return -math.inf
    if x < 0.0:
        return math.nan
    return math.log(x)


def _max(a, b):
    """Exact maximum; a NaN on either side gives NaN."""
    if math.isnan(a) or math.isnan(b):
        return math.nan
    return a if a >= b else b


# ---------------------------------------------------------------- shared pieces


def _check(q, k, v):
    q, k, v = (np.asarray(t, dtype=np.float64) for t in (q, k, v))
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        raise ValueError("q, k, v must be 4-D (batch, heads, seq, dim)")
    B, H, _, D = q.shape
    if k.shape != v.shape or k.shape[0] != B or k.shape[3] != D or H % k.shape[1] != 0:
        raise ValueError(f"shapes do not agree: q {q.shape}, k {k.shape}, v {v.shape}")
    return q, k, v


def _round_inputs(t, fmt, rounder, stage):
    """R_input of every element: row i, column d of head bh -> counter (bh, i, u=d, w=0)."""
    B, H, N, D = t.shape
    out = [[[[0.0] * D for _ in range(N)] for _ in range(H)] for _ in range(B)]
    for b in range(B):
        for h in range(H):
            for i in range(N):
                for d in range(D):
                    out[b][h][i][d] = rounder.r(fmt, float(t[b, h, i, d]), stage, b * H + h, i, d, 0)
    return out


def _visible(i, j, nq, nk, causal):
    """Bottom-right aligned causal mask: query i sees key j iff j <= i + (nk - nq)."""
    return not causal or j <= i + (nk - nq)


def _score(Qi, Kj, c, pol, rnd, bh, i, j):
    """s_j = R_score(c * R_score(dot)), the dot product accumulated in score_acc."""
    acc = 0.0
    for t in range(len(Qi)):
        acc = rnd.r(pol.score_acc, acc + Qi[t] * Kj[t], SCORE_ACC, bh, i, j, t)
    dot = rnd.r(pol.score, acc, SCORE_DOT, bh, i, j, 0)
    return rnd.r(pol.score, c * dot, SCORE_SCALED, bh, i, j, 0)


def _prepare(q, k, v, policy, scale):
    q, k, v = _check(q, k, v)
    rnd = _Rounder(policy)
    Q = _round_inputs(q, policy.input, rnd, IN_Q)
    K = _round_inputs(k, policy.input, rnd, IN_K)
    V = _round_inputs(v, policy.input, rnd, IN_V)
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[3])
    return q.shape, k.shape[1], k.shape[2], Q, K, V, rnd, float(scale)


# ---------------------------------------------------------------- baseline


def baseline_row_p(Qi, Kh, keys, c, pol, rnd, bh, i):
    """Steps 1-5 of "Baseline" for query row i: returns ({j: P_j}, m, l)."""
    s = {j: _score(Qi, Kh[j], c, pol, rnd, bh, i, j) for j in keys}
    m = -math.inf
    for j in keys:
        m = _max(m, s[j])
    e = {}
    for j in keys:
        x = rnd.r(pol.softmax, s[j] - m, SOFTMAX_SUB, bh, i, j, 0)
        e[j] = rnd.r(pol.softmax, _exp(x), SOFTMAX_EXP, bh, i, j, 0)
    acc = 0.0
    for j in keys:
        acc = rnd.r(pol.sum_acc, acc + e[j], SUM_ACC, bh, i, j, 0)
    l = rnd.r(pol.stats, acc, STATS_AL, bh, i, 0, 0)
    return {j: rnd.r(pol.p, e[j] / l, P_STAGE, bh, i, j, 0) for j in keys}, m, l


def baseline_attention(q, k, v, policy, causal=False, scale=None):
    """Materialised attention per docs/numerics.md "Baseline": returns (out (B,H,Nq,D), lse (B,H,Nq))."""
    (B, H, Nq, D), Hkv, Nk, Q, K, V, rnd, scale = _prepare(q, k, v, policy, scale)
    pol = policy
    c = round_constant(scale, pol.score)
    out = np.zeros((B, H, Nq, D))
    lse = np.full((B, H, Nq), -math.inf)
    for b in range(B):
        for h in range(H):
            bh, hk = b * H + h, h // (H // Hkv)
            Kh, Vh = K[b][hk], V[b][hk]
            for i in range(Nq):
                keys = [j for j in range(Nk) if _visible(i, j, Nq, Nk, causal)]
                if not keys:
                    continue  # fully masked row: out 0, lse -inf, no rounding events
                P, m, l = baseline_row_p(Q[b][h][i], Kh, keys, c, pol, rnd, bh, i)
                for d in range(D):
                    acc = 0.0
                    for j in keys:
                        acc = rnd.r(pol.pv_acc, acc + P[j] * Vh[j][d], PV_ACC, bh, i, j, d)
                    out[b, h, i, d] = rnd.r(pol.out, acc, OUT_STAGE, bh, i, d, 0)
                log_l = rnd.r(pol.stats, _log(l), STATS_LOG, bh, i, 0, 0)
                lse[b, h, i] = rnd.r(pol.stats, m + log_l, STATS_LSE, bh, i, 0, 0)
    return out, lse


# ---------------------------------------------------------------- flash


def flash_attention(q, k, v, policy, block_q, block_kv, loop_order, normalize, exp, causal=False, scale=None):
    """Tiled online-softmax attention per docs/numerics.md "Flash": returns (out, lse).

    Each query row is computed on its own: `block_q` only groups rows and changes nothing, so it is
    checked and otherwise unused. The loop order matters only through step 9: under kv_outer, O and
    l round-trip through memory in the `state` format after every K/V block."""
    if block_q < 1 or block_kv < 1:
        raise ValueError(f"block_q and block_kv must be >= 1, got {block_q}, {block_kv}")
    if loop_order not in ("q_outer", "kv_outer") or normalize not in ("deferred", "eager") \
            or exp not in ("exp", "exp2"):
        raise ValueError(f"bad loop_order/normalize/exp: {loop_order!r}, {normalize!r}, {exp!r}")
    (B, H, Nq, D), Hkv, Nk, Q, K, V, rnd, scale = _prepare(q, k, v, policy, scale)
    pol = policy
    E = _exp2 if exp == "exp2" else _exp
    c = round_constant(scale * LOG2E if exp == "exp2" else scale, pol.score)
    c2 = round_constant(LN2, pol.stats)
    eager = normalize == "eager"
    out = np.zeros((B, H, Nq, D))
    lse = np.full((B, H, Nq), -math.inf)
    for b in range(B):
        for h in range(H):
            bh, hk = b * H + h, h // (H // Hkv)
            Kh, Vh = K[b][hk], V[b][hk]
            for i in range(Nq):
                if not any(_visible(i, j, Nq, Nk, causal) for j in range(Nk)):
                    continue  # fully masked row: out 0, lse -inf, no rounding events
                m, l, O = -math.inf, 0.0, [0.0] * D
                for jb in range((Nk + block_kv - 1) // block_kv):
                    block = range(jb * block_kv, min((jb + 1) * block_kv, Nk))
                    keys = [j for j in block if _visible(i, j, Nq, Nk, causal)]
                    if not keys:
                        continue  # a block with no visible key is skipped for this row
                    # 1. scores and the new running max
                    s = {j: _score(Q[b][h][i], Kh[j], c, pol, rnd, bh, i, j) for j in keys}
                    m_new = m
                    for j in keys:
                        m_new = _max(m_new, s[j])
                    # 2. exponentials
                    e = {}
                    for j in keys:
                        x = rnd.r(pol.softmax, s[j] - m_new, SOFTMAX_SUB, bh, i, j, 0)
                        e[j] = rnd.r(pol.softmax, E(x), SOFTMAX_EXP, bh, i, j, 0)
                    # 3. the block's row sum
                    rowsum = 0.0
                    for j in keys:
                        rowsum = rnd.r(pol.sum_acc, rowsum + e[j], SUM_ACC, bh, i, j, 0)
                    # 4. rescale factor; none before the first block (m = -inf): alpha = 0, not rounded
                    if m == -math.inf:
                        alpha = 0.0
                    else:
                        diff = rnd.r(pol.rescale, m - m_new, RESCALE_DIFF, bh, i, jb, 0)
                        alpha = rnd.r(pol.rescale, E(diff), RESCALE_ALPHA, bh, i, jb, 0)
                    # 5. running sum
                    a_l = rnd.r(pol.stats, alpha * l, STATS_AL, bh, i, jb, 0)
                    rs = rnd.r(pol.stats, rowsum, STATS_ROWSUM, bh, i, jb, 0)
                    l_new = rnd.r(pol.stats, a_l + rs, STATS_LNEW, bh, i, jb, 0)
                    # 6. P.V of the block
                    P = {j: rnd.r(pol.p, e[j], P_STAGE, bh, i, j, 0) for j in keys}
                    pv = [0.0] * D
                    for d in range(D):
                        acc = 0.0
                        for j in keys:
                            acc = rnd.r(pol.pv_acc, acc + P[j] * Vh[j][d], PV_ACC, bh, i, j, d)
                        pv[d] = acc
                    # 7. running output
                    factor = a_l if eager else alpha
                    for d in range(D):
                        scaled = rnd.r(pol.out_acc, factor * O[d], OUT_ACC_AO, bh, i, jb, d)
                        part = rnd.r(pol.out_acc, pv[d], OUT_ACC_PV, bh, i, jb, d)
                        O[d] = rnd.r(pol.out_acc, scaled + part, OUT_ACC_SUM, bh, i, jb, d)
                        if eager:
                            O[d] = rnd.r(pol.out_acc, O[d] / l_new, OUT_ACC_DIV, bh, i, jb, d)
                    # 8.
                    m, l = m_new, l_new
                    # 9. kv_outer: O and l written to memory in the state format (m is kept exactly)
                    if loop_order == "kv_outer":
                        for d in range(D):
                            O[d] = rnd.r(pol.state_out, O[d], STATE_OUT, bh, i, jb, d)
                        l = rnd.r(pol.state_stats, l, STATE_STATS, bh, i, jb, 0)
                for d in range(D):
                    value = O[d] if eager else O[d] / l
                    out[b, h, i, d] = rnd.r(pol.out, value, OUT_STAGE, bh, i, d, 0)
                log_l = rnd.r(pol.stats, _log(l), STATS_LOG, bh, i, 0, 0)
                if exp == "exp2":
                    m_nat = rnd.r(pol.stats, m * c2, STATS_LSE, bh, i, 0, 1)
                else:
                    m_nat = m
                lse[b, h, i] = rnd.r(pol.stats, m_nat + log_l, STATS_LSE, bh, i, 0, 0)
    return out, lse
