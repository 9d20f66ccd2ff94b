/* The emulated flash forward's fast path for K/V blocks of at most 64 keys (fa2's and the paper's tiles): the same
 * steps and bits as emu_forward_fast.cu's kernel (every per-element and per-row step is emu_forward_fast.cuh's),
 * scheduled so that a warp owns its query rows outright.
 *
 * Why another schedule: emu_forward_fast.cu's CTA shares its 64 rows among all its threads, so every phase of a block
 * (scores, maxima, softmax terms, the row sums' chains, statistics, P.V, the O update) ends at a CTA barrier, and the
 * row sums and statistics run on 64 of the CTA's 256 threads while the rest wait (ncu: 25% occupancy, 0.6 eligible
 * warps per scheduler, 8.5 cycles per issued instruction). Here the K and V of a block are staged once per block
 * (two CTA barriers) and everything else is the warp's own:
 *   scores: a lane's tile of keys x the warp's R rows (R = 16 at D <= 64, 8 at D <= 128; tile<>), the fp32 FMA
 *     chains over t ascending, Q^T and K^T from shared memory (broadcast float4 loads of Q);
 *   the chains' values go to the warp's E[key][row]; then lane L works on row L % R, keys L / R + (32 / R) k: the
 *     scores' roundings and the row's maximum (the lanes of a row combined by shuffles), then the softmax terms
 *     (a key the row does not see: 0), each a rolled loop (the fp64 exp inlined once, not 2 R times);
 *   lane r < R runs row r's sum chain over the visible keys ascending and rewrites each e as P = R_p(e) behind it,
 *     then the row's statistics (row_stats); the row's m, l live in that lane's registers;
 *   P.V: a lane's tile of columns x rows (tile<>), P from E, V from shared memory, keys ascending up to the
 *     warp's last visible key; a key a row does not see has P = +0, whose product with a finite V value adds +-0 to
 *     a chain that is never -0 (it starts at +0, and an exact cancellation in nearest-even gives +0), so the chain
 *     is the one that skips the key; zero-padded t (D not a multiple of 4) likewise adds fmaf(0, 0, acc) = acc;
 *   the O update in registers (o_step), the output and lse at the end.
 * The fast path needs finite inputs (emu_head_finite), which the +0 products rely on. */
#ifndef FADEV_EMU_FORWARD_WARP_TILE_CUH
#define FADEV_EMU_FORWARD_WARP_TILE_CUH

#include "emu_forward_warp.cuh"

namespace emu_warp {

/* Row tile tq (BQ query rows) of query head bh; CAUSAL is the call's mask (a template argument, so that the kernel
 * without a mask has no clamps of the rows' visible keys: fewer registers, fewer spills). */
template <int DC, bool LEAN, bool BASE, bool KEEP, bool CAUSAL, int SIG>
__device__ __forceinline__ void warp_tile(const fast_args &a, int64_t bh, int64_t tq) {
    using T = tile<DC>;
    constexpr int R = T::R, BQ = T::BQ, DP = T::DP, EP = T::EP, KP = T::KP, SPREAD = 32 / R;
    constexpr int KL = T::KL, KS = T::KS, SR = T::SR, CL = T::CL, CS = T::CS, RL = T::RL;
    static_assert(KB / SPREAD <= 32, "a lane's keys of a block: a 32-bit mask");
    /* softmax terms whose exps interleave (terms): 4, but 2 in the baseline's kernels other than the presets' with
     * the store (their terms a pass of their own), where 4 spilled (H100: naive 5-20% slower at 4) */
    constexpr int TG = BASE && !(KEEP && SIG) ? 2 : 4;
    constexpr bool FR = BASE || CAUSAL; /* stage_tid<FR> */
    extern __shared__ __align__(16) char smem[];
    float *sq = (float *)smem, *sk = sq + DP * BQ, *sv = T::SPLIT ? sk + DP * KP : sk;
    float *se = sk + DP * KP + (T::SPLIT ? KB * DP : 0);
    double *sfac = (double *)(se + W * KB * EP), *slnew = sfac + W * R;
    const emu_ctx &cx = a.cx;
    const int tid = threadIdx.x, w = tid >> 5, lane = tid & 31;
    const int64_t Nq = cx.pr.seq_q, Nk = cx.pr.seq_kv;
    const int D = (int)cx.pr.dim;
    constexpr int causal = CAUSAL;
    const int64_t i0 = tq * BQ, bhk = emu_kv_head(cx, bh);
    if (!emu_head_finite(cx, bh, bhk)) return; /* the generic launch computes this head */
    const int here = (int)(Nq - i0 < BQ ? Nq - i0 : BQ);
    const int hw = here - w * R < 0 ? 0 : here - w * R < R ? here - w * R : R; /* the warp's rows */
    const int64_t iw = i0 + w * R;
    stage<DP, BQ, FR>(sq, BQ, 1, cx.qf + (bh * Nq + i0) * D, D, here); /* Q^T [t][row] */
    float *ew = se + w * KB * EP;
    /* the element-wise passes' lane: row r = lane % R, keys lane / R + SPREAD k of a block */
    const int r = lane % R;
    const int64_t i = iw + r;
    float *er = ew + r;

    /* K of keys jb0 .. + ncta - 1 into shared memory (V too with `need_v`, where it has a buffer); barriers around */
    auto stage_kv = [&](int64_t jb0, int ncta, bool need_v) {
        __syncthreads(); /* the previous block's readers of K, V and E are done */
        if constexpr (T::QUAD) stage_kt<DP, KP, FR>(sk, cx.kf + (bhk * Nk + jb0) * D, D, ncta);
        else stage<DP, KB, FR>(sk, KP, 1, cx.kf + (bhk * Nk + jb0) * D, D, ncta); /* K^T [t][key] */
        if (T::SPLIT && need_v) stage<DP, KB, FR>(sv, 1, DP, cx.vf + (bhk * Nk + jb0) * D, D, ncta);
        __syncthreads();
    };
    /* V of the keys jb0 .. jb0 + ncta - 1 into its buffer (K's where it has none), between two CTA barriers */
    auto stage_v = [&](int64_t jb0, int ncta) {
        __syncthreads();
        stage<DP, KB, FR>(sv, 1, DP, cx.vf + (bhk * Nk + jb0) * D, D, ncta);
        __syncthreads();
    };
    /* V where K was (no buffer of its own), once every warp's scores are done; every thread calls it */
    auto stage_v_late = [&](int64_t jb0, int ncta) {
        if (!T::SPLIT) stage_v(jb0, ncta);
    };
    /* the warp's score chains over t ascending (lane L: keys key0 + KS j of rows srow0 .. + SR - 1) into E; ends with
     * __syncwarp */
    const int key0 = T::key0(lane), srow0 = T::srow0(lane);
    auto scores = [&]() {
        float acc[SR][KL];
#pragma unroll
        for (int rr = 0; rr < SR; rr++)
#pragma unroll
            for (int j = 0; j < KL; j++) acc[rr][j] = 0.f;
        const float *qs = sq + w * R + srow0, *ks = sk + key0;
        const int D4 = (D + 3) & ~3;
        float qv[SR], kv[KL];
        step_operands<SR, KL, KS>(qv, kv, qs, ks);
        for (int t0 = 0; t0 < D4; t0 += 4) {
#pragma unroll
            for (int t = t0; t < t0 + 4; t++) /* row D4 of Q^T or K^T, read at the last step and not used, lies inside
                                               * the CTA's shared memory: K^T's buffer, or V's or E's */
                fma_step<SR, KL, KS>(acc, qv, kv, qs + (t + 1) * BQ, ks + (t + 1) * KP);
        }
#pragma unroll
        for (int j = 0; j < KL; j++)
#pragma unroll
            for (int r4 = 0; r4 < SR / 4; r4++)
                *(float4 *)(ew + (key0 + KS * j) * EP + srow0 + 4 * r4) =
                    make_float4(acc[4 * r4][j], acc[4 * r4 + 1][j], acc[4 * r4 + 2][j], acc[4 * r4 + 3][j]);
        __syncwarp();
    };
    /* s of the lane's visible keys (nr of them) in E, folded into its maximum (mx, nan). The spec's running maximum
     * att_max(m, s): any order gives its value and a NaN makes it NaN; only a zero's sign may differ, which no later
     * value depends on (exp(+-0) = 1; lse = m + log l is 0 + log l). */
    auto round_scores = [&](int64_t jb0, int nr, float &mx, int &nan) {
        sig_kind<SIG, SG_SCORE, LEAN>(flt_kind_at(a.lean, LK_SCORE), [&](auto KS) {
            constexpr int K = decltype(KS)::value;
            if constexpr (LEAN && (BASE || SIG) && (K == FLT_BF16 || K == FLT_F16))
                if (a.c12) { /* score_of's fp32 product; the few it cannot settle (zeros, subnormals, NaNs) after the
                              * loop, from a mask of the lane's keys, so that the loop has no branch */
                    unsigned slow = 0;
#pragma unroll 4
                    for (int key = lane / R, b = 0; key < nr; key += SPREAD, b++) {
                        float s;
                        if (score_c32(a, K, er[key * EP], s)) er[key * EP] = s, mx = fmaxf(mx, s); /* not a NaN */
                        else slow |= 1u << b;
                    }
                    for (; slow; slow &= slow - 1) {
                        const int key = lane / R + SPREAD * (__ffs(slow) - 1);
                        const float s = score_of<LEAN, K, true>(a, er[key * EP], bh, i, jb0 + key);
                        er[key * EP] = s;
                        nan |= s != s, mx = fmaxf(mx, s);
                    }
                    return;
                }
#pragma unroll 2
            for (int key = lane / R; key < nr; key += SPREAD) {
                const float s = score_of<LEAN, decltype(KS)::value, BASE || SIG>(a, er[key * EP], bh, i, jb0 + key);
                er[key * EP] = s;
                nan |= s != s, mx = fmaxf(mx, s);
            }
        });
    };
    /* the softmax terms of the lane's keys below kw in E (0 past nr); with `div`, P = R_p(e / lr) instead (the
     * baseline's last pass); ends with __syncwarp */
    auto p_div = [&](float e, double lr, int64_t j) { /* P = R_p(e / l); l an fp32 value: quot_round's */
        if (LEAN) return (double)(float)lr == lr ? quot_round(a.p_kind, e, (float)lr) : dbl_round(a.p_kind, (double)e / lr);
        return (float)rnd(cx.p, (double)e / lr, ATT_STREAM(ATT_P, bh), ATT_INDEX(i, j, 0));
    };
    /* P = R_p(e / l) of the lane's keys below nr in E, in place: with p's kind known at compile time, bf16 or fp16,
     * and l an fp32 value, from l's reciprocal rl (quot_round_rcp). The division's loop was 19% of naive's forward
     * (ncu source counters, H100, D 64); with the reciprocal the forward is 5% faster (H200, D 64 and causal). The
     * few quotients the reciprocal cannot settle (about one in 2^11 for bf16, 2^8 for fp16) are divided after the
     * loop, from a mask of the lane's keys, so that the loop has no branch */
    auto p_quotients = [&](int64_t jb0, int nr, double lr, float rl) {
        bool done = false;
        if constexpr (LEAN)
            if ((double)(float)lr == lr)
                sig_kind<SIG, SG_P, true>(a.p_kind, [&](auto PK) {
                    constexpr int K = decltype(PK)::value;
                    if constexpr (K == FLT_BF16 || K == FLT_F16) {
                        unsigned slow = 0; /* bit b: key lane / R + SPREAD b needs the division (KB / SPREAD <= 32) */
#pragma unroll 4
                        for (int key = lane / R, b = 0; key < nr; key += SPREAD, b++) {
                            float p;
                            if (quot_rcp_fast<K>(er[key * EP], rl, p)) er[key * EP] = p;
                            else slow |= 1u << b;
                        }
                        for (; slow; slow &= slow - 1) {
                            const int key = lane / R + SPREAD * (__ffs(slow) - 1);
                            er[key * EP] = quot_round(K, er[key * EP], (float)lr);
                        }
                        done = true;
                    }
                });
        if (!done)
            for (int key = lane / R; key < nr; key += SPREAD) er[key * EP] = p_div(er[key * EP], lr, jb0 + key);
    };
    auto terms = [&](int64_t jb0, int nr, int kw, float mf, auto div, double lr) {
        sig_kind<SIG, SG_SOFT, LEAN>(flt_kind_at(a.lean, LK_SOFTMAX), [&](auto KS) {
            sig_exp<SIG>(cx.exp2, [&](auto E2) {
                constexpr int K = decltype(KS)::value, X2 = decltype(E2)::value;
                /* the exp's constants from constant memory, a DFMA operand: copied into registers (from global
                 * memory, once) they held 32 of the kernel's 128, and the kernels spilled more (H200, D 128: the
                 * forwards 1-3% faster without; 8 exps interleaved instead of 4, which the freed registers allow,
                 * no faster) */
                const double *kk = emu_exp_k;
                auto x_of = [&](int key) {
                    return term_x<LEAN, K, DC == 2>(a, er[key * EP], (double)mf, mf, bh, i, jb0 + key);
                };
                auto put_e = [&](int key, float e) { /* past nr: computed, not kept */
                    if constexpr (decltype(div)::value) e = p_div(e, lr, jb0 + key);
                    er[key * EP] = key < nr ? e : 0.f;
                };
                auto put = [&](int key, double y) { put_e(key, term_e<LEAN, K>(a, y, bh, i, jb0 + key)); };
                int key = lane / R;
                if constexpr (LEAN && !BASE && (K == FLT_BF16 || K == FLT_F16)) {
                    if (a.etab.t) { /* a 16-bit x <= 0: its term from the table (emu_exp_table.cu), TT loads in flight;
                                     * else (NaN, x > 0) computed. Not in the baseline's kernels (its presets' terms
                                     * are fp32; the code cost their registers) */
                        constexpr int TT = 4;
#pragma unroll 1
                        for (; key + (TT - 1) * SPREAD < kw; key += TT * SPREAD) {
                            float x[TT];
                            bool in = true;
#pragma unroll
                            for (int g = 0; g < TT; g++) x[g] = x_of(key + g * SPREAD), in = in && x[g] <= 0.f;
                            if (in) {
#pragma unroll
                                for (int g = 0; g < TT; g++) put_e(key + g * SPREAD, tab_term<K>(a.etab, x[g]));
                            } else {
#pragma unroll 1
                                for (int g = 0; g < TT; g++) put(key + g * SPREAD, emu_exp_fast(X2, x[g], kk));
                            }
                        }
                        for (; key < kw; key += SPREAD) {
                            const float x = x_of(key);
                            if (x <= 0.f) put_e(key, tab_term<K>(a.etab, x));
                            else put(key, emu_exp_fast(X2, x, kk));
                        }
                        return;
                    }
                }
                /* TG keys at a time: their exps' reductions and polynomials without a branch (emu_exp_poly), so that
                 * the TG dependent DFMA chains interleave (emu_exp_fast's range test is a branch, across which ptxas
                 * did not move the next key's chain: one chain at a time, the terms' time spent waiting); where a
                 * key is near or past the range, emu_exp_fast for all TG (in range it is emu_exp_scaled of
                 * emu_exp_poly's: the same bits) */
#pragma unroll 1
                for (; key + (TG - 1) * SPREAD < kw; key += TG * SPREAD) {
                    double x[TG], p[TG];
                    int n[TG];
                    bool in = true;
#pragma unroll
                    for (int g = 0; g < TG; g++) x[g] = x_of(key + g * SPREAD), in = in && emu_exp_in_range(X2, x[g]);
#pragma unroll
                    for (int g = 0; g < TG; g++) p[g] = emu_exp_poly(X2, x[g], kk, n[g]);
                    if (in) {
#pragma unroll
                        for (int g = 0; g < TG; g++) put(key + g * SPREAD, emu_exp_scaled(p[g], n[g]));
                    } else {
#pragma unroll
                        for (int g = 0; g < TG; g++) put(key + g * SPREAD, emu_exp_fast(X2, x[g], kk));
                    }
                }
                for (; key < kw; key += SPREAD) put(key, emu_exp_fast(X2, x_of(key), kk));
            });
        });
        __syncwarp();
    };
    /* pv += P.V over the block's keys below kw, P from E, V from shared memory: lane L columns col0 + CS c of rows
     * orow0 .. + RL - 1 */
    const int col0 = T::col0(lane), orow0 = T::orow0(lane);
    auto pv_add = [&](float (&pv)[RL][CL], int kw) {
        const float *vs = sv + col0, *ps = ew + orow0;
        float p[RL], vv[CL];
        step_operands<RL, CL, CS>(p, vv, ps, vs);
#pragma unroll 4
        for (int key = 0; key < kw; key++) /* key + 1 = KB: inside the CTA's shared memory, not used */
            fma_step<RL, CL, CS>(pv, p, vv, ps + (key + 1) * EP, vs + (key + 1) * DP);
    };
    /* row `lane`'s chain of the row sum over its visible keys (nown) ascending, from rs; with `write_p`, each e
     * rewritten as P = R_p(e) behind it */
    auto row_sum = [&](int64_t jb0, int nown, double rs_in, bool write_p) {
        double rsum = rs_in;
        sig_kind<SIG, SG_P, true>(a.p_kind, [&](auto PK) {
            constexpr int K = decltype(PK)::value;
            if (SIG || cx.sum_acc.kind == ATT_F32) { /* fp32 + fp32 rounded once in fp32: the spec's bits */
                float rs = (float)rs_in;
#pragma unroll 4
                for (int key = 0; key < nown; key++) {
                    const float e = er[key * EP];
                    rs = __fadd_rn(rs, e);
                    if (write_p) er[key * EP] = p_of<LEAN, K>(a, e, bh, i, jb0 + key);
                }
                rsum = rs;
            } else {
                double rs = rs_in;
                for (int key = 0; key < nown; key++) {
                    const float e = er[key * EP];
                    rs = sum_step(a, rs, e, bh, i, jb0 + key);
                    if (write_p) er[key * EP] = p_of<LEAN, K>(a, e, bh, i, jb0 + key);
                }
                rsum = rs;
            }
        });
        return rsum;
    };
    /* the written output from the rows' O (o) and their state in lanes r < R */
    auto write_out = [&](const float (&o)[RL][CL], double m, double l, int seen) {
#pragma unroll
        for (int rr = 0; rr < RL; rr++) {
            const int row = orow0 + rr;
            const double lr = __shfl_sync(FULL, l, row);
            const int sr = __shfl_sync(FULL, seen, row);
            if (row >= hw) continue;
            double *out = a.out + (bh * Nq + iw + row) * D;
#pragma unroll
            for (int c = 0; c < CL; c++) {
                const int d = col0 + CS * c;
                if (d < D) out[d] = out_of(a, o[rr][c], sr, lr, bh, iw + row, d);
            }
        }
        if (a.lse && lane < hw) a.lse[bh * Nq + iw + lane] = lse_of(a, seen, m, l, bh, iw + lane);
    };

    double m = -INFINITY, l = 0; /* row `lane`'s state (lanes < R) */
    int seen = 0;
    float o[RL][CL];
    auto zero_o = [&]() {
#pragma unroll
        for (int rr = 0; rr < RL; rr++)
#pragma unroll
            for (int c = 0; c < CL; c++) o[rr][c] = 0.f;
    };

    if constexpr (BASE) {
        /* the baseline: one block of every key, in slices of KB keys, three passes: the maxima; the row sums' chains
         * and l; P = R_p(e / l) and P.V. With a.s_keep the first pass stores the rounded scores (lane L's s of row
         * r at [slice][key][r] of its warp's rows: coalesced), the second reads them back and stores e in their
         * place, the third reads e (one exp an element, not two); without, every pass computes the scores again,
         * the third the terms too (the same events, the same values) */
        float *keep = KEEP ? a.s_keep + ((int64_t)blockIdx.x * W + w) * ((Nk + KB - 1) / KB) * KB * R : nullptr;
        /* D <= 64 with the store: the first pass's K and the last pass's V as cp.async copies (stage_kv's and
         * stage_v's values and places) landing while the CTA computes; two CTA barriers a slice, as before. Their
         * synchronous staging held ~20% of naive's D 64 forward's samples (ncu source counters, H100) */
        constexpr bool BASYNC = KEEP && T::SPLIT;
        auto bprefetch = [&](int64_t jb0, bool v) { /* K (or V) of the slice from jb0, where any row sees it */
            if constexpr (BASYNC) {
                const int nc = jb0 < Nk ? (int)emu_visible(cx.pr, i0 + here - 1, jb0, KB < Nk - jb0 ? KB : Nk - jb0) : 0;
                if (nc && v) stage_rows_async<DP, KB, FR>(sv, cx.vf + (bhk * Nk + jb0) * D, D, nc);
                if (nc && !v) stage_kt_async<DP, KP, FR>(sk, cx.kf + (bhk * Nk + jb0) * D, D, nc);
                cp_async_commit();
            }
        };
        float mx = -INFINITY;
        int nan = 0, nown_all = 0;
        double rs = 0;
        /* with the store, each pass compiled on its own: O's registers live in the last one only (one loop, they
         * were live in all three, and the kernel spilled) */
#pragma unroll(KEEP ? 3 : 1)
        for (int pass = 0; pass < 3; pass++) {
            if (pass == 2) zero_o();
            const float mf = __shfl_sync(FULL, (float)m, r);
            const double lr = __shfl_sync(FULL, l, r);
            const float rl = __frcp_rn((float)lr); /* quot_round_rcp's, where l is an fp32 value */
            const bool fresh = pass == 0 || !KEEP; /* this pass computes the scores */
            if (BASYNC && pass != 1) bprefetch(0, pass == 2);
            for (int64_t jb0 = 0; jb0 < Nk; jb0 += KB) {
                const int n = (int)(KB < Nk - jb0 ? KB : Nk - jb0);
                const int ncta = (int)emu_visible(cx.pr, i0 + here - 1, jb0, n);
                if (ncta == 0) break; /* causal: later slices are masked for every row */
                const vis nv{causal, n, hw, iw + Nk - Nq - jb0 + 1};
                const int kw = hw ? nv.of(hw - 1) : 0, nr = nv.of(r), nown = lane < R ? nv.of(lane) : 0;
                float *ks = KEEP ? keep + jb0 * R + r : nullptr; /* the slice's scores of row r */
                if (!fresh && kw) { /* the lane's own entries of E (past nr 0: their terms are dropped), read before
                                     * V's staging so that both loads' latencies overlap */
                    __syncwarp(); /* the last slice's readers of E are done */
                    constexpr int LB = 16; /* loads in flight a lane (unrolled by 4, the loop waited for the L2
                                            * every 4 keys: a tenth of naive's forward, H100) */
                    for (int k0 = lane / R; k0 < kw; k0 += LB * SPREAD) {
                        float t[LB];
#pragma unroll
                        for (int g = 0; g < LB; g++) t[g] = k0 + g * SPREAD < nr ? ks[(k0 + g * SPREAD) * R] : 0.f;
#pragma unroll
                        for (int g = 0; g < LB; g++)
                            if (k0 + g * SPREAD < kw) er[(k0 + g * SPREAD) * EP] = t[g];
                    }
                }
                if (BASYNC && fresh) { /* the slice's K landed; then every warp's scores done: K's buffer is free */
                    cp_async_wait_all(), __syncthreads();
                    if (kw) scores();
                    __syncthreads(), bprefetch(jb0 + KB, false);
                } else if (fresh) {
                    stage_kv(jb0, ncta, pass == 2);
                    if (kw) scores();
                } else if (pass == 2 && !BASYNC) stage_v(jb0, ncta);
                if (kw) {
                    if (fresh) {
                        float unused = -INFINITY;
                        int unused_nan = 0;
                        round_scores(jb0, nr, pass == 0 ? mx : unused, pass == 0 ? nan : unused_nan);
                        if (KEEP && pass == 0)
                            for (int key = lane / R; key < nr; key += SPREAD) ks[key * R] = er[key * EP];
                    }
                    if (pass == 0) {
                        nown_all += nown;
                    } else if (pass == 2 && KEEP) { /* E holds e (0 past nr) */
                        p_quotients(jb0, nr, lr, rl);
                        __syncwarp();
                    } else {
                        if (pass == 2) terms(jb0, nr, kw, mf, std::true_type{}, lr);
                        else terms(jb0, nr, kw, mf, std::false_type{}, lr);
                        if (pass == 1 && nown) rs = row_sum(jb0, nown, rs, false);
                        if (KEEP && pass == 1) /* e in place of s for the last pass: the lane's own entries */
                            for (int key = lane / R; key < nr; key += SPREAD) ks[key * R] = er[key * EP];
                        __syncwarp();
                    }
                }
                if (pass < 2) continue;
                if (fresh) stage_v_late(jb0, ncta);
                if constexpr (BASYNC) cp_async_wait_all(), __syncthreads(); /* the slice's V landed */
                if (kw) pv_add(o, kw);
                if constexpr (BASYNC) __syncthreads(), bprefetch(jb0 + KB, true); /* every warp's P.V done */
            }
            if (pass == 0) {
#pragma unroll
                for (int off = R; off < 32; off <<= 1) {
                    mx = fmaxf(mx, __shfl_xor_sync(FULL, mx, off));
                    nan |= __shfl_xor_sync(FULL, nan, off);
                }
                if (nown_all) m = nan ? (double)NAN : (double)mx, seen = 1; /* att_max(-inf, .) */
            } else if (pass == 1 && nown_all) {
                l = rnd(cx.stats, rs, ATT_STREAM(ATT_STATS_AL, bh), ATT_INDEX(iw + lane, 0, 0));
            }
        }
        write_out(o, m, l, seen);
        return;
    } else {
        zero_o();
        const int64_t bkv = a.block_kv;
        const bool plain = cx.pr.normalize != FADEV_EAGER && cx.pr.loop_order != FADEV_KV_OUTER;
        auto ncta_of = [&](int64_t jb0) { /* keys any row of the CTA sees in the block from jb0 */
            return (int)emu_visible(cx.pr, i0 + here - 1, jb0, bkv < Nk - jb0 ? bkv : Nk - jb0);
        };
        /* With K and V in buffers of their own (SPLIT, D <= 64), their copies run while the CTA computes (cp.async,
         * stage_kt_async / stage_rows_async: the same values in the same places as stage_kv's): K of the next
         * block the loop computes during this block's P.V, V of this block during its scores and softmax terms;
         * still two CTA barriers a block, each after a wait for the thread's own copies. Why: the warps waited on
         * the staging's global loads for ~5% of fa2's D 64 forward and ~10% causal, where both CTAs of an SM stage at
         * once (ncu source counters, H100); H200: fa2 6% faster, causal 11%, paper 3% and 10% (benchmarks/README) */
        constexpr bool ASYNC = T::SPLIT;
        auto prefetch_k = [&](int64_t jb0) { /* K of the next block the loop computes from the one at jb0 */
            for (int64_t j0 = jb0; j0 < Nk; j0 += bkv) {
                const int nc = ncta_of(j0);
                if (nc) {
                    if constexpr (ASYNC) stage_kt_async<DP, KP, FR>(sk, cx.kf + (bhk * Nk + j0) * D, D, nc);
                    cp_async_commit();
                    return;
                }
                if (causal) return; /* the loop breaks there */
            }
        };
        if constexpr (ASYNC) prefetch_k(0);
        for (int64_t jb = 0, jb0 = 0; jb0 < Nk; jb++, jb0 += bkv) {
            const int n = (int)(bkv < Nk - jb0 ? bkv : Nk - jb0);
            const int ncta = ncta_of(jb0);
            if (ncta == 0) {
                if (causal) break; /* later blocks are masked too, for every row */
                continue;
            }
            if constexpr (ASYNC) { /* K landed; every warp's P.V of the last block done, so V's buffer is free */
                cp_async_wait_all();
                __syncthreads();
                stage_rows_async<DP, KB, FR>(sv, cx.vf + (bhk * Nk + jb0) * D, D, ncta);
                cp_async_commit();
            } else {
                stage_kv(jb0, ncta, true);
            }
            /* keys the warp's rows see (the last row sees the most). Causal, the rows' other counts are taken after
             * the scores, and the row state is updated as soon as the statistics are known (not after P.V): what is
             * live across the product loops decides whether ptxas keeps their next operands' loads a step ahead.
             * With the counts, m_new and l_new live across them, the causal kernel loaded each operand just before
             * its FMA (ncu, H100, Nq 128 Nk 4096: its short-scoreboard stalls twice the unmasked kernel's, 9%
             * slower; after, with stage_tid's fresh index too, 2.4% on an H200). The unmasked kernel measured 1.2-1.7%
             * slower so (H200): it keeps its order */
            const int kw = hw ? vis{causal, n, hw, iw + Nk - Nq - jb0 + 1}.of(hw - 1) : 0;
            double mnew = m, lnew = 0, factor = 0;
            if (CAUSAL && kw) scores();
            const vis nv{causal, n, hw, iw + Nk - Nq - jb0 + 1};
            const int nown = lane < R ? nv.of(lane) : 0, nr = nv.of(r);
            if (kw) {
                if (!CAUSAL) scores();
                float mx = -INFINITY;
                int nan = 0;
                round_scores(jb0, nr, mx, nan);
    #pragma unroll
                for (int off = R; off < 32; off <<= 1) {
                    mx = fmaxf(mx, __shfl_xor_sync(FULL, mx, off));
                    nan |= __shfl_xor_sync(FULL, nan, off);
                }
                if (nown) mnew = att_max(m, nan ? (double)NAN : (double)mx); /* lane r < R: row r */
                terms(jb0, nr, kw, __shfl_sync(FULL, (float)mnew, r), std::false_type{}, 0.0);
                /* row `lane`'s sum chain with P written behind it, its statistics */
                if (nown) {
                    row_stats(a, bh, iw + lane, jb, m, mnew, l, row_sum(jb0, nown, 0.0, true), lnew, factor);
                    sfac[w * R + lane] = factor, slnew[w * R + lane] = lnew;
                    if (CAUSAL) m = mnew, l = l_kept(a, lnew, bh, iw + lane, jb), seen = 1;
                }
                __syncwarp();
            }
            if constexpr (ASYNC) { /* V landed; every warp's scores done, so K's buffer is free */
                cp_async_wait_all();
                __syncthreads();
                prefetch_k(jb0 + bkv);
            } else {
                stage_v_late(jb0, ncta);
            }
            if (!kw) continue;
            float pv[RL][CL];
    #pragma unroll
            for (int rr = 0; rr < RL; rr++)
    #pragma unroll
                for (int c = 0; c < CL; c++) pv[rr][c] = 0.f;
            pv_add(pv, kw);
            /* 7 (and 9): O from pv (row_update), for the rows that see a key of the block. PLAIN (fa2's and paper's
             * deferred normalisation in q_outer order, o_step): no branch an element, and the padded columns
             * (t >= D: V's zeros, so pv = 0 and o stays 0; never written) updated too */
            auto o_update = [&](auto OF, auto PLAIN) {
    #pragma unroll
                for (int rr = 0; rr < RL; rr++) {
                    const int row = orow0 + rr;
                    if (!nv.of(row)) continue;
                    const double f = sfac[w * R + row], ln = slnew[w * R + row];
    #pragma unroll
                    for (int c = 0; c < CL; c++) {
                        const int d = col0 + CS * c;
                        if (decltype(PLAIN)::value || d < D)
                            o[rr][c] = o_step<LEAN, decltype(OF)::value, decltype(PLAIN)::value>(
                                a, o[rr][c], pv[rr][c], f, ln, bh, iw + row, jb, d);
                    }
                }
            };
            if constexpr (SIG > 0) o_update(std::integral_constant<int, sig_at<SIG, SG_OFORM>()>{}, std::true_type{});
            else with_o_form<LEAN>(a, [&](auto OF) {
                if constexpr (decltype(OF)::value == O_F32 || decltype(OF)::value >= O_N16)
                    if (plain) return o_update(OF, std::true_type{});
                o_update(OF, std::false_type{});
            });
            if (!CAUSAL && nown) m = mnew, l = l_kept(a, lnew, bh, iw + lane, jb), seen = 1;
        }
        write_out(o, m, l, seen);
    }
}

} // namespace emu_warp

#endif /* FADEV_EMU_FORWARD_WARP_TILE_CUH */
