"""The slow twin of the ring forward (csrc/ring.c): layouts, per-step pieces and the LSE merge, written
for clarity in plain NumPy / Python scalars.

Independent of ring.c's piece table: each (rank, step) piece is derived from the global causal mask
restricted to the rank's query positions and the visiting block's key positions (rows and keys with at
least one visible pair), and must be either all-visible or FlashAttention's bottom-right causal mask on
that sub-grid (else the layout could not be run by the public flash kernel, and this raises). Partials come
from the public ``fadev.flash_attention`` on those sub-slices; the merge is ring-flash-attention's
    out <- out - sigmoid(lse_b - lse) * (out - out_b),  lse <- lse - logsigmoid(lse - lse_b)
with every operation rounded (tests/reference.round_value, nearest-even) in its format. The
``allgather`` form is not modelled here (it has no merge).
"""
from __future__ import annotations

import math

import numpy as np

import fadev
from reference import round_value


def positions(N, W, layout, r):
    """Global token positions held by rank r, in local order."""
    if layout == "contiguous":
        n = N // W
        return np.arange(r * n, (r + 1) * n)
    if layout == "zigzag":
        h = N // (2 * W)
        return np.concatenate([np.arange(r * h, (r + 1) * h), np.arange((2 * W - 1 - r) * h, (2 * W - r) * h)])
    if layout == "striped":
        return np.arange(r, N, W)
    raise ValueError(layout)


def piece(qpos, kpos, causal):
    """(query local rows, key local rows, causal flag) of one step, or None when nothing is visible."""
    vis = kpos[None, :] <= qpos[:, None] if causal else np.ones((len(qpos), len(kpos)), bool)
    rows, keys = np.flatnonzero(vis.any(1)), np.flatnonzero(vis.any(0))
    if len(rows) == 0:
        return None
    sub = vis[np.ix_(rows, keys)]
    if sub.all():
        return rows, keys, False
    nq, nk = sub.shape
    tril = np.arange(nk)[None, :] <= np.arange(nq)[:, None] + (nk - nq)
    if not np.array_equal(sub, tril):
        raise AssertionError("a step's mask is neither full nor bottom-right causal")
    return rows, keys, True


def _sigmoid(x):
    if x >= 0:
        return 1.0 / (1.0 + math.exp(-x))
    e = math.exp(x)
    return e / (1.0 + e)


def _logsigmoid(x):
    return -math.log1p(math.exp(-x)) if x >= 0 else x - math.log1p(math.exp(x))


def ring_forward(q, k, v, W, layout, policy, fmts, causal=False, block_q=None, block_kv=None):
    """(out, lse) of the ring forward; q, k, v (H, N, D); ``fmts`` = RingMerge(...).resolve(policy)."""
    pol = fadev.as_policy(policy)
    H, N, D = q.shape
    out = np.zeros_like(q)
    lse = np.full((H, N), -np.inf)
    seen = np.zeros((H, N), bool)
    pol_partial = pol.replace(out=fmts["partial_out"])
    R = round_value
    m, ro, rl = fmts["merge"], fmts["running_out"], fmts["running_lse"]
    for r in range(W):
        qpos = positions(N, W, layout, r)
        for s in range(W):
            src = (r - s) % W
            kpos = positions(N, W, layout, src)
            pc = piece(qpos, kpos, causal)
            if pc is None:
                continue
            rows, keys, pc_causal = pc
            gq, gk = qpos[rows], kpos[keys]
            ob, lb = fadev.flash_attention(q[:, gq], k[:, gk], v[:, gk], pol_partial, block_q=block_q,
                                           block_kv=block_kv, causal=pc_causal, return_lse=True)
            for h in range(H):
                for a, i in enumerate(gq):
                    lbi = R(float(lb[h, a]), fmts["partial_lse"])
                    if not seen[h, i]:
                        out[h, i] = [R(float(x), ro) for x in ob[h, a]]
                        lse[h, i] = R(lbi, rl)
                        seen[h, i] = True
                        continue
                    L = float(lse[h, i])
                    g = R(_sigmoid(R(lbi - L, m)), m)
                    for d in range(D):
                        o = float(out[h, i, d])
                        out[h, i, d] = R(R(o - R(g * R(o - float(ob[h, a, d]), m), m), m), ro)
                    lse[h, i] = R(R(L - R(_logsigmoid(R(L - lbi, m)), m), m), rl)
    final = np.vectorize(lambda x: R(float(x), pol.out))(out)
    return final, lse
