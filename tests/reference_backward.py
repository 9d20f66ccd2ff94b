"""The slow twin of fadev's attention backward: docs/numerics.md "Backward" in executable form.

Like tests/reference.py (whose rounding, Philox, score and input helpers it imports), it is written
to be read: scalar Python arithmetic, one rounding event per operation, the document's step numbers
in the comments. The C kernels (and later the CUDA ones) must match it bit for bit.

Public functions (4-D float64 arrays; q, out, dout (B, H, Nq, D), lse (B, H, Nq), k, v (B, Hkv, Nk, D),
grouped-query when Hkv < H); both return (dq, dk, dv) shaped like (q, k, v):
    baseline_attention_backward(q, k, v, out, lse, dout, policy, causal=False, scale=None)
    flash_attention_backward(q, k, v, out, lse, dout, policy, block_q, block_kv, exp, causal=False, scale=None)

What the two share is steps 1 and 3 to 8; they differ in how P is recomputed (step 2: flash from the
saved LSE, baseline exactly as its forward) and how D_i is formed (step 5: flash from dO and O,
baseline from R_dsoft_p(P) and dP as autograd's softmax backward), and baseline uses one block of all queries
and one block of all keys. `out` and `lse` are rounded on entry but only flash uses them.
"""
from __future__ import annotations

import math

import numpy as np

import reference as ref

BWD = 2**48  # backward stochastic streams are 2^48 + id + 32 * bh

# Backward event ids (docs/numerics.md, "Backward stochastic counters").
DOUT, OUT_IN, LSE_IN, LSE_LOG2 = 0, 1, 2, 3
DELTA_ACC, DELTA = 4, 5
BWD_P, DP_ACC, DP = 6, 7, 8
DSOFT_SUB, DSOFT_MUL, DS = 9, 10, 11
GRAD_ACC_DV, GRAD_ACC_DK, GRAD_ACC_DQ = 12, 13, 14
DKV_ACC_DV, DKV_ACC_DK, DQ_ACC = 15, 16, 17
GRAD_DQ, GRAD_DK, GRAD_DV = 18, 19, 20
DSOFT_P, DSOFT_SCALE = 21, 22


def _check_saved(q, out, lse, dout):
    out, lse, dout = (np.asarray(t, dtype=np.float64) for t in (out, lse, dout))
    if out.shape != q.shape or dout.shape != q.shape or lse.shape != q.shape[:3]:
        raise ValueError(f"out {out.shape}, dout {dout.shape} must be shaped like q {q.shape}; "
                         f"lse {lse.shape} like q without its last axis")
    return out, lse, dout


def _flash_row_p(Qi, Kh, keys, c, L, E, pol, rnd, bh, i):
    """Step 2, flash: P_ij = R_softmax(E(R_softmax(s_ij - L))) from the saved statistic L (forward
    counters 6, 7)."""
    P = {}
    for j in keys:
        s = ref._score(Qi, Kh[j], c, pol, rnd, bh, i, j)
        x = rnd.r(pol.softmax, s - L, ref.SOFTMAX_SUB, bh, i, j, 0)
        P[j] = rnd.r(pol.softmax, E(x), ref.SOFTMAX_EXP, bh, i, j, 0)
    return P


def _backward(q, k, v, out, lse, dout, policy, block_q, block_kv, exp, causal, scale, baseline):
    pol = policy
    (B, H, Nq, D), Hkv, Nk, Q, K, V, rnd, scale = ref._prepare(q, k, v, pol, scale)  # forward events 0, 1, 2
    out, lse, dout = _check_saved(np.asarray(q), out, lse, dout)
    if baseline:
        block_q, block_kv, exp = Nq, Nk, "exp"
    dO = ref._round_inputs(dout, pol.input, rnd, BWD + DOUT)
    O = ref._round_inputs(out, pol.out, rnd, BWD + OUT_IN)
    E = ref._exp2 if exp == "exp2" else ref._exp
    c_fwd = ref.round_constant(scale * ref.LOG2E if exp == "exp2" else scale, pol.score)
    c3 = ref.round_constant(ref.LOG2E, pol.stats)
    c = ref.round_constant(scale, pol.score)  # the softmax scale of the gradients (steps 6 and 8)
    group = H // Hkv
    visible = [[ref._visible(i, j, Nq, Nk, causal) for j in range(Nk)] for i in range(Nq)]

    # Steps 1-6 for every (b, h, i) and visible j: P'[b][h][i][j], dS[b][h][i][j] (masked pairs absent).
    Pp = [[[{} for _ in range(Nq)] for _ in range(H)] for _ in range(B)]
    dS = [[[{} for _ in range(Nq)] for _ in range(H)] for _ in range(B)]
    for b in range(B):
        for h in range(H):
            bh, hk = b * H + h, h // group
            Kh, Vh = K[b][hk], V[b][hk]
            for i in range(Nq):
                keys = [j for j in range(Nk) if visible[i][j]]
                if not keys:
                    continue  # a row with no visible key: nothing to do, its dq row stays 0
                Qi, dOi, Oi = Q[b][h][i], dO[b][h][i], O[b][h][i]
                # 1-2. scores and P
                if baseline:
                    P = ref.baseline_row_p(Qi, Kh, keys, c_fwd, pol, rnd, bh, i)[0]
                else:
                    LSE = rnd.r(pol.stats, float(lse[b, h, i]), BWD + LSE_IN, bh, i, 0, 0)
                    L = LSE if exp == "exp" else rnd.r(pol.stats, LSE * c3, BWD + LSE_LOG2, bh, i, 0, 0)
                    P = _flash_row_p(Qi, Kh, keys, c_fwd, L, E, pol, rnd, bh, i)
                # 3. P' = R_bwd_p(P) for the dV product, Ps = R_dsoft_p(P) for the softmax backward
                Pr = {j: rnd.r(pol.bwd_p, P[j], BWD + BWD_P, bh, i, j, 0) for j in keys}
                Ps = {j: rnd.r(pol.dsoft_p, P[j], BWD + DSOFT_P, bh, i, j, 0) for j in keys}
                # 4. dP_ij = dO_i . V_j in dp_acc, stored in dp
                dP = {}
                for j in keys:
                    acc = 0.0
                    for d in range(D):
                        acc = rnd.r(pol.dp_acc, acc + dOi[d] * Vh[j][d], BWD + DP_ACC, bh, i, j, d)
                    dP[j] = rnd.r(pol.dp, acc, BWD + DP, bh, i, j, 0)
                # 5. D_i
                acc = 0.0
                if baseline:
                    for j in keys:
                        acc = rnd.r(pol.delta_acc, acc + Ps[j] * dP[j], BWD + DELTA_ACC, bh, i, j, 0)
                else:
                    for d in range(D):
                        acc = rnd.r(pol.delta_acc, acc + dOi[d] * Oi[d], BWD + DELTA_ACC, bh, i, d, 0)
                Di = rnd.r(pol.dsoft, acc, BWD + DELTA, bh, i, 0, 0)
                # 6. dS = R_ds(R_dsoft(Ps * R_dsoft(dP - D))); bwd_scale "ds": R_dsoft(c * that) before R_ds
                for j in keys:
                    t = rnd.r(pol.dsoft, dP[j] - Di, BWD + DSOFT_SUB, bh, i, j, 0)
                    u = rnd.r(pol.dsoft, Ps[j] * t, BWD + DSOFT_MUL, bh, i, j, 0)
                    if pol.bwd_scale == "ds":
                        u = rnd.r(pol.dsoft, c * u, BWD + DSOFT_SCALE, bh, i, j, 0)
                    dS[b][h][i][j] = rnd.r(pol.ds, u, BWD + DS, bh, i, j, 0)
                Pp[b][h][i] = Pr

    c_sums = 1.0 if pol.bwd_scale == "ds" else c  # 8. the scale of the dQ, dK sums (none when dS carries it)
    n_qb, n_kb = -(-Nq // block_q), -(-Nk // block_kv)
    q_blocks = [range(qb * block_q, min((qb + 1) * block_q, Nq)) for qb in range(n_qb)]
    kv_blocks = [range(jb * block_kv, min((jb + 1) * block_kv, Nk)) for jb in range(n_kb)]
    dq = np.zeros((B, H, Nq, D))
    dk = np.zeros((B, Hkv, Nk, D))
    dv = np.zeros((B, Hkv, Nk, D))

    # 7-8. dQ[i, d]: K/V blocks ascending, each block's sum in grad_acc, added into dQacc (dq_acc).
    for b in range(B):
        for h in range(H):
            bh, Kh = b * H + h, K[b][h // group]
            for i in range(Nq):
                row = dS[b][h][i]
                if not row:
                    continue  # no visible key: dq row exactly 0
                for d in range(D):
                    dQacc = 0.0
                    for jb, block in enumerate(kv_blocks):
                        keys = [j for j in block if j in row]
                        if not keys:
                            continue
                        part = 0.0
                        for j in keys:
                            part = rnd.r(pol.grad_acc, part + row[j] * Kh[j][d], BWD + GRAD_ACC_DQ, bh, i, j, d)
                        dQacc = rnd.r(pol.dq_acc, dQacc + part, BWD + DQ_ACC, bh, i, jb, d)
                    dq[b, h, i, d] = rnd.r(pol.grad, c_sums * dQacc, BWD + GRAD_DQ, bh, i, d, 0)

    # 7-8. dV[j, d], dK[j, d] of K/V head g: the group's query heads ascending, query blocks ascending,
    # each block's sum in grad_acc, added into dVacc / dKacc (dkv_acc).
    for b in range(B):
        for g in range(Hkv):
            bg = b * Hkv + g
            for j in range(Nk):
                if not any(visible[i][j] for i in range(Nq)):
                    continue  # a key no query sees: dk, dv rows exactly 0
                for d in range(D):
                    dVacc = dKacc = 0.0
                    for h in range(g * group, (g + 1) * group):
                        bh = b * H + h
                        for qb, block in enumerate(q_blocks):
                            rows = [i for i in block if visible[i][j]]
                            if not rows:
                                continue
                            part_v = part_k = 0.0
                            for i in rows:
                                part_v = rnd.r(pol.grad_acc, part_v + Pp[b][h][i][j] * dO[b][h][i][d],
                                               BWD + GRAD_ACC_DV, bh, i, j, d)
                                part_k = rnd.r(pol.grad_acc, part_k + dS[b][h][i][j] * Q[b][h][i][d],
                                               BWD + GRAD_ACC_DK, bh, i, j, d)
                            dVacc = rnd.r(pol.dkv_acc, dVacc + part_v, BWD + DKV_ACC_DV, bh, qb, j, d)
                            dKacc = rnd.r(pol.dkv_acc, dKacc + part_k, BWD + DKV_ACC_DK, bh, qb, j, d)
                    dk[b, g, j, d] = rnd.r(pol.grad, c_sums * dKacc, BWD + GRAD_DK, bg, j, d, 0)
                    dv[b, g, j, d] = rnd.r(pol.grad, dVacc, BWD + GRAD_DV, bg, j, d, 0)
    return dq, dk, dv


def baseline_attention_backward(q, k, v, out, lse, dout, policy, causal=False, scale=None):
    """Materialised attention backward (docs/numerics.md "Backward", baseline): returns (dq, dk, dv).
    P is recomputed as the baseline forward computes it; `out` and `lse` are checked, not used."""
    return _backward(q, k, v, out, lse, dout, policy, None, None, "exp", causal, scale, baseline=True)


def flash_attention_backward(q, k, v, out, lse, dout, policy, block_q, block_kv, exp, causal=False, scale=None):
    """FlashAttention-2's backward (docs/numerics.md "Backward", flash): returns (dq, dk, dv).
    block_kv groups the keys of each dQ block sum, block_q the queries of each dK/dV block sum."""
    if block_q < 1 or block_kv < 1:
        raise ValueError(f"block_q and block_kv must be >= 1, got {block_q}, {block_kv}")
    if exp not in ("exp", "exp2"):
        raise ValueError(f"exp must be 'exp' or 'exp2', got {exp!r}")
    return _backward(q, k, v, out, lse, dout, policy, block_q, block_kv, exp, causal, scale, baseline=False)
