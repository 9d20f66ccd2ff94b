/* Emulated-precision attention forward on the GPU: baseline and flash, bit-identical to csrc/baseline.c and
 * csrc/flash.c (docs/numerics.md gives the operation order; this file only schedules it differently).
 * One thread owns one query row i of head bh, exactly the CPU's per-row recurrences:
 *   s_j  = R_score(c * R_score(sum_t Q[i,t] K[j,t]))          the sum a chain in score_acc, t ascending
 *   flash, per K/V block jb of block_kv keys with a visible key:
 *     m' = max(m, max_j s_j); e_j = R_softmax(E(R_softmax(s_j - m'))); rowsum in sum_acc; P_j = R_p(e_j)
 *     alpha, l' (rescale, stats); pv_d = sum_j P_j V[j,d] in pv_acc; O = R(R(alpha O) + R(pv)) in out_acc
 *   baseline: m = max_j s_j; e_j; l = R_stats(sum_j e_j); P_j = R_p(e_j / l); out = R_out(sum_j P_j V[j,d])
 * Rows are independent, so a CTA is ROWS consecutive rows of one head with no barrier after set-up. Scores
 * and P of up to CHUNK keys live in shared memory (a column per thread: conflict-free); a block with more
 * visible keys recomputes its scores (same events, same values), so any tiling fits. The running O and the
 * P.V partial sums of a row live in device scratch laid out [cta][d][row] (coalesced). K and V are read
 * from global memory by all threads of a warp at the same address (a broadcast).
 * Dot-product tiers, chosen per row (scores) and per chunk (P.V), all giving the spec's bits:
 *   fp64 accumulator: fp64;  fp32 nearest-even: fp32 arithmetic if every product is exact in fp32 (the
 *   magnitudes say so), else the fp64 product and sum rounded to fp32;  any other: emu_round per term. */
#include "emu.cuh"

namespace {

constexpr int ROWS = 64;   /* query rows (threads) per CTA */
constexpr int MAX_CHUNK = 64; /* keys whose scores / P a thread keeps in shared memory (less if it does not fit) */

enum tier { TIER_F64, TIER_F32, TIER_F64_R32, TIER_SCALAR };

struct fwd_args {
    emu_ctx cx;
    double *out, *lse;
    double *o_scratch, *pv_scratch; /* [cta][D][ROWS] */
    int64_t block_kv;               /* flash: clamped to seq_kv; baseline: unused */
    int64_t tiles;                  /* CTAs per head */
    int chunk;                      /* keys per shared-memory chunk */
    int narrow;                     /* scores, e and P are all fp32 values: the chunk is kept in fp32 */
    int fast_heads;                 /* 1: the fast path was launched first, and computes the heads whose inputs are
                                     * finite (emu_head_finite): this launch leaves them */
};

/* Shared memory of a CTA: q (fp32 when the policy allows the float tier: every input is then an fp32 value,
 * else fp64) and the chunk of scores / P (fp64, and fp32 for the float tier). */
struct smem_view {
    double *q;  /* [D][ROWS], or null */
    float *qf;  /* [D][ROWS], or null */
    double *s;  /* [chunk][ROWS] scores, e or P (null when narrow) */
    float *sf;  /* the same in fp32 when narrow (every value is an fp32 value), else null */
    float *pf;  /* P in fp32 for the float tier of P.V: sf when narrow, its own array, or null */
};

__device__ __forceinline__ double s_get(const smem_view &sm, int64_t at) { return sm.s ? sm.s[at] : (double)sm.sf[at]; }
__device__ __forceinline__ void s_set(const smem_view &sm, int64_t at, double x) {
    if (sm.s) sm.s[at] = x;
    else sm.sf[at] = (float)x;
}

/* Element `at` of the rounded q, k or v: the fp64 copy, or where emu_prepare wrote none (the fast path takes the call,
 * and this kernel only the heads it leaves: their inputs are fp32 values) the fp32 copy, the same value. */
__device__ __forceinline__ double in_at(const double *d, const float *f, int64_t at) {
    return d ? d[at] : (double)f[at];
}

__device__ __forceinline__ double q_at(const smem_view &sm, int64_t t, int col) {
    return sm.q ? sm.q[t * ROWS + col] : (double)sm.qf[t * ROWS + col];
}

__device__ __forceinline__ int acc_tier(const att_stage &acc, int float_ok) {
    if (acc.kind == ATT_EXACT) return TIER_F64;
    if (acc.kind != ATT_F32) return TIER_SCALAR;
    return float_ok ? TIER_F32 : TIER_F64_R32;
}

/* s_j of row i (column `col` of the CTA's shared q) and key j of K/V head bhk. */
__device__ double score(const emu_ctx &cx, const smem_view &sm, int col, int qk_tier, int64_t bh, int64_t bhk,
                        int64_t i, int64_t j) {
    const int64_t D = cx.pr.dim;
    const int64_t at = (bhk * cx.pr.seq_kv + j) * D;
    double acc;
    if (qk_tier == TIER_F32) {
        const float *k = cx.kf + at;
        float a = 0;
        for (int64_t t = 0; t < D; t++) a = a + sm.qf[t * ROWS + col] * k[t];
        acc = a;
    } else {
        double a = 0;
        if (qk_tier == TIER_F64) {
            for (int64_t t = 0; t < D; t++) a = a + q_at(sm, t, col) * in_at(cx.k, cx.kf, at + t);
        } else if (qk_tier == TIER_F64_R32) {
            for (int64_t t = 0; t < D; t++)
                a = (double)__double2float_rn(a + q_at(sm, t, col) * in_at(cx.k, cx.kf, at + t));
        } else {
            const uint64_t stream = ATT_STREAM(ATT_SCORE_ACC, bh);
            for (int64_t t = 0; t < D; t++)
                a = emu_mac(cx.score_acc, a, q_at(sm, t, col), in_at(cx.k, cx.kf, at + t), stream, ATT_INDEX(i, j, t));
        }
        acc = a;
    }
    const uint64_t idx = ATT_INDEX(i, j, 0);
    return emu_round(cx.score, cx.c * emu_round(cx.score, acc, ATT_STREAM(ATT_SCORE_DOT, bh), idx),
                     ATT_STREAM(ATT_SCORE_SCALED, bh), idx);
}

/* The chunk's P.V terms (keys j0 + c0 .. j0 + c0 + nc - 1, P in shared memory) added onto acc, for one d. */
__device__ __forceinline__ double pv_chunk(const emu_ctx &cx, const smem_view &sm, int col, int pv_tier, int64_t bh,
                                           int64_t bhk, int64_t i, int64_t j_first, int nc, int64_t d, double acc) {
    const int64_t D = cx.pr.dim, at = (bhk * cx.pr.seq_kv + j_first) * D + d;
    if (pv_tier == TIER_F32) {
        float a = (float)acc;
        for (int jj = 0; jj < nc; jj++) a = a + sm.pf[jj * ROWS + col] * cx.vf[at + jj * D];
        return a;
    }
    if (pv_tier == TIER_F64) {
        for (int jj = 0; jj < nc; jj++) acc = acc + s_get(sm, jj * ROWS + col) * in_at(cx.v, cx.vf, at + jj * D);
    } else if (pv_tier == TIER_F64_R32) {
        for (int jj = 0; jj < nc; jj++)
            acc = (double)__double2float_rn(acc + s_get(sm, jj * ROWS + col) * in_at(cx.v, cx.vf, at + jj * D));
    } else {
        const uint64_t stream = ATT_STREAM(ATT_PV_ACC, bh);
        for (int jj = 0; jj < nc; jj++)
            acc = emu_mac(cx.pv_acc, acc, s_get(sm, jj * ROWS + col), in_at(cx.v, cx.vf, at + jj * D), stream,
                          ATT_INDEX(i, j_first + jj, d));
    }
    return acc;
}

/* Tier of a chunk's P.V product, from the magnitudes of its P (as the CPU's att_pv). */
__device__ __forceinline__ int pv_tier_of(const emu_ctx &cx, int64_t bhk, double pmin, double pmax, int pfinite) {
    const emu_mag &vm = cx.vmag[bhk];
    int ok = cx.pv_float && vm.finite && pfinite && emu_products_fit_f32(pmin, pmax, emu_mag_min(vm), emu_mag_max(vm));
    return acc_tier(cx.pv_acc, ok);
}

/* Loads row i of q into the CTA's shared memory (column `col`) and returns the score tier of the row. */
__device__ int load_row(const emu_ctx &cx, const smem_view &sm, int col, int64_t bh, int64_t bhk, int64_t i) {
    const int64_t D = cx.pr.dim;
    const int64_t at = (bh * cx.pr.seq_q + i) * D;
    double lo = INFINITY, hi = 0;
    int finite = 1;
    for (int64_t t = 0; t < D; t++) {
        const double x = in_at(cx.q, cx.qf, at + t), a = fabs(x);
        if (sm.q) sm.q[t * ROWS + col] = x;
        else sm.qf[t * ROWS + col] = (float)x;
        if (!(a <= 1.7976931348623157e308)) finite = 0;
        else if (a > 0) lo = a < lo ? a : lo, hi = a > hi ? a : hi;
    }
    const emu_mag &km = cx.kmag[bhk];
    int ok = cx.qk_float && km.finite && finite && emu_products_fit_f32(lo, hi, emu_mag_min(km), emu_mag_max(km));
    return acc_tier(cx.score_acc, ok);
}

/* Shared-memory bytes of a CTA (carve's layout). */
__host__ __device__ size_t smem_bytes(int64_t dim, int qk_float, int pv_float, int narrow, int chunk) {
    const size_t per_key = narrow ? sizeof(float) : sizeof(double) + (pv_float ? sizeof(float) : 0);
    return (size_t)chunk * ROWS * per_key + (size_t)dim * ROWS * (qk_float ? sizeof(float) : sizeof(double));
}

__device__ smem_view carve(const emu_ctx &cx, int chunk, int narrow, char *base) {
    smem_view sm;
    char *after = base;
    sm.s = narrow ? nullptr : (double *)base;
    sm.sf = narrow ? (float *)base : nullptr;
    after += chunk * ROWS * (narrow ? sizeof(float) : sizeof(double));
    sm.pf = narrow ? sm.sf : cx.pv_float ? (float *)after : nullptr;
    if (!narrow && cx.pv_float) after += chunk * ROWS * sizeof(float);
    sm.q = cx.qk_float ? nullptr : (double *)after;
    sm.qf = cx.qk_float ? (float *)after : nullptr;
    return sm;
}

/* out and lse of a finished row (att_write_row). */
__device__ void write_row(const emu_ctx &cx, const fwd_args &a, int64_t bh, int64_t i, int seen, const double *o,
                          int64_t o_stride, int divide, double m, double l) {
    const int64_t D = cx.pr.dim;
    double *out = a.out + (bh * cx.pr.seq_q + i) * D;
    if (!seen) {
        for (int64_t d = 0; d < D; d++) out[d] = 0;
        if (a.lse) a.lse[bh * cx.pr.seq_q + i] = -INFINITY;
        return;
    }
    const uint64_t s23 = ATT_STREAM(ATT_OUT, bh);
    for (int64_t d = 0; d < D; d++) {
        const double x = o[d * o_stride];
        out[d] = emu_round(cx.out, divide ? x / l : x, s23, ATT_INDEX(i, d, 0));
    }
    if (a.lse) {
        const uint64_t idx = ATT_INDEX(i, 0, 0), s13 = ATT_STREAM(ATT_STATS_LSE, bh);
        const double log_l = emu_round(cx.stats, log(l), ATT_STREAM(ATT_STATS_LOG, bh), idx);
        if (cx.exp2) m = emu_round(cx.stats, m * cx.c2, s13, ATT_INDEX(i, 0, 1));
        a.lse[bh * cx.pr.seq_q + i] = emu_round(cx.stats, m + log_l, s13, idx);
    }
}

__global__ void __launch_bounds__(ROWS) flash_kernel(const fwd_args a) {
    extern __shared__ __align__(16) char smem[];
    const emu_ctx &cx = a.cx;
    const int col = threadIdx.x;
    const int64_t cta = blockIdx.x, bh = cta / a.tiles, i = (cta % a.tiles) * ROWS + col;
    const int64_t D = cx.pr.dim, Nk = cx.pr.seq_kv, bkv = a.block_kv, bhk = emu_kv_head(cx, bh);
    if (i >= cx.pr.seq_q || (a.fast_heads && emu_head_finite(cx, bh, bhk))) return; /* no barrier follows */
    const smem_view sm = carve(cx, a.chunk, a.narrow, smem);
    const int CHUNK = a.chunk;
    const int qk_tier = load_row(cx, sm, col, bh, bhk, i);
    double *o = a.o_scratch + cta * D * ROWS + col, *pvs = a.pv_scratch + cta * D * ROWS + col;
    const int eager = cx.pr.normalize == FADEV_EAGER, kv_outer = cx.pr.loop_order == FADEV_KV_OUTER;
    double m = -INFINITY, l = 0;
    int seen = 0;
    for (int64_t jb = 0, j0 = 0; j0 < Nk; jb++, j0 += bkv) {
        const int64_t nv = emu_visible(cx.pr, i, j0, j0 + bkv < Nk ? bkv : Nk - j0);
        if (nv == 0) {
            if (cx.pr.causal) break; /* the visible keys are a prefix: later blocks are masked too */
            continue;
        }
        /* 1. scores and the new maximum (kept when the block fits the chunk) */
        const int stored = nv <= CHUNK;
        double m_new = m;
        for (int64_t jj = 0; jj < nv; jj++) {
            const double s = score(cx, sm, col, qk_tier, bh, bhk, i, j0 + jj);
            if (stored) s_set(sm, jj * ROWS + col, s);
            m_new = att_max(m_new, s);
        }
        /* 2-7 chunk by chunk: softmax terms and P into shared memory, then the P.V chains */
        double rowsum = 0, factor = 0, l_new = 0;
        const uint64_t s6 = ATT_STREAM(ATT_SOFTMAX_SUB, bh), s7 = ATT_STREAM(ATT_SOFTMAX_EXP, bh);
        const uint64_t s8 = ATT_STREAM(ATT_SUM_ACC, bh), s16 = ATT_STREAM(ATT_P, bh);
        for (int64_t c0 = 0; c0 < nv; c0 += CHUNK) {
            const int nc = (int)(nv - c0 < CHUNK ? nv - c0 : CHUNK);
            const int last = c0 + nc == nv;
            double pmin = INFINITY, pmax = 0;
            int pfinite = 1;
            for (int jj = 0; jj < nc; jj++) {
                const int64_t j = j0 + c0 + jj;
                const uint64_t idx = ATT_INDEX(i, j, 0);
                const double s = stored ? s_get(sm, jj * ROWS + col) : score(cx, sm, col, qk_tier, bh, bhk, i, j);
                const double x = emu_round(cx.softmax, s - m_new, s6, idx);
                const double e = emu_round(cx.softmax, emu_exp(cx.exp2, x), s7, idx);
                rowsum = emu_round(cx.sum_acc, rowsum + e, s8, idx);
                const double p = emu_round(cx.p, e, s16, idx);
                s_set(sm, jj * ROWS + col, p);
                if (sm.pf && sm.s) sm.pf[jj * ROWS + col] = (float)p;
                const double ap = fabs(p);
                if (!(ap <= 1.7976931348623157e308)) pfinite = 0;
                else if (ap > 0) pmin = ap < pmin ? ap : pmin, pmax = ap > pmax ? ap : pmax;
            }
            if (last) /* 4-5: the statistics, once the row sum is complete (row_softmax) */
                emu_row_stats<false>(cx, bh, i, jb, m, m_new, l, rowsum, l_new, factor);
            const int pv_tier = pv_tier_of(cx, bhk, pmin, pmax, pfinite);
            for (int64_t d = 0; d < D; d++) {
                const double acc = pv_chunk(cx, sm, col, pv_tier, bh, bhk, i, j0 + c0, nc, d,
                                            c0 == 0 ? 0.0 : pvs[d * ROWS]);
                if (!last) {
                    pvs[d * ROWS] = acc;
                    continue;
                }
                /* 7 (and 9): O updated from pv (row_update) */
                const uint64_t idx = ATT_INDEX(i, jb, d);
                const att_stage &oa = cx.out_acc;
                const double o_old = seen ? o[d * ROWS] : 0.0;
                const double scaled = emu_round(oa, factor * o_old, ATT_STREAM(ATT_OUT_ACC_AO, bh), idx);
                const double part = emu_round(oa, acc, ATT_STREAM(ATT_OUT_ACC_PV, bh), idx);
                double o_new = emu_round(oa, scaled + part, ATT_STREAM(ATT_OUT_ACC_SUM, bh), idx);
                if (eager) o_new = emu_round(oa, o_new / l_new, ATT_STREAM(ATT_OUT_ACC_DIV, bh), idx);
                if (kv_outer) o_new = emu_round(cx.state_out, o_new, ATT_STREAM(ATT_STATE_OUT, bh), idx);
                o[d * ROWS] = o_new;
            }
        }
        m = m_new;
        l = l_new;
        if (kv_outer) l = emu_round(cx.state_stats, l, ATT_STREAM(ATT_STATE_STATS, bh), ATT_INDEX(i, jb, 0));
        seen = 1;
    }
    write_row(cx, a, bh, i, seen, o, ROWS, !eager, m, l);
}

__global__ void __launch_bounds__(ROWS) baseline_kernel(const fwd_args a) {
    extern __shared__ __align__(16) char smem[];
    const emu_ctx &cx = a.cx;
    const int col = threadIdx.x;
    const int64_t cta = blockIdx.x, bh = cta / a.tiles, i = (cta % a.tiles) * ROWS + col;
    const int64_t D = cx.pr.dim, bhk = emu_kv_head(cx, bh);
    if (i >= cx.pr.seq_q || (a.fast_heads && emu_head_finite(cx, bh, bhk))) return;
    const smem_view sm = carve(cx, a.chunk, a.narrow, smem);
    const int CHUNK = a.chunk;
    const int qk_tier = load_row(cx, sm, col, bh, bhk, i);
    double *pvs = a.pv_scratch + cta * D * ROWS + col;
    const int64_t nv = emu_visible(cx.pr, i, 0, cx.pr.seq_kv);
    if (nv == 0) {
        write_row(cx, a, bh, i, 0, pvs, ROWS, 0, 0, 0);
        return;
    }
    /* 1-2: scores (kept when they fit the chunk) and their maximum */
    const int stored = nv <= CHUNK;
    double m = -INFINITY;
    for (int64_t j = 0; j < nv; j++) {
        const double s = score(cx, sm, col, qk_tier, bh, bhk, i, j);
        if (stored) s_set(sm, j * ROWS + col, s);
        m = att_max(m, s);
    }
    /* 3-4: e_j (kept in place of s_j when stored) and l */
    const uint64_t s6 = ATT_STREAM(ATT_SOFTMAX_SUB, bh), s7 = ATT_STREAM(ATT_SOFTMAX_EXP, bh);
    const uint64_t s8 = ATT_STREAM(ATT_SUM_ACC, bh), s16 = ATT_STREAM(ATT_P, bh);
    double acc = 0;
    for (int64_t j = 0; j < nv; j++) {
        const uint64_t idx = ATT_INDEX(i, j, 0);
        const double s = stored ? s_get(sm, j * ROWS + col) : score(cx, sm, col, qk_tier, bh, bhk, i, j);
        const double e = emu_round(cx.softmax, exp(emu_round(cx.softmax, s - m, s6, idx)), s7, idx);
        if (stored) s_set(sm, j * ROWS + col, e);
        acc = emu_round(cx.sum_acc, acc + e, s8, idx);
    }
    const double l = emu_round(cx.stats, acc, ATT_STREAM(ATT_STATS_AL, bh), ATT_INDEX(i, 0, 0));
    /* 5-6: P chunk by chunk, and the P.V chains */
    for (int64_t c0 = 0; c0 < nv; c0 += CHUNK) {
        const int nc = (int)(nv - c0 < CHUNK ? nv - c0 : CHUNK);
        double pmin = INFINITY, pmax = 0;
        int pfinite = 1;
        for (int jj = 0; jj < nc; jj++) {
            const int64_t j = c0 + jj;
            const uint64_t idx = ATT_INDEX(i, j, 0);
            double e;
            if (stored) {
                e = s_get(sm, jj * ROWS + col);
            } else {
                const double s = score(cx, sm, col, qk_tier, bh, bhk, i, j);
                e = emu_round(cx.softmax, exp(emu_round(cx.softmax, s - m, s6, idx)), s7, idx);
            }
            const double p = emu_round(cx.p, e / l, s16, idx);
            s_set(sm, jj * ROWS + col, p);
            if (sm.pf && sm.s) sm.pf[jj * ROWS + col] = (float)p;
            const double ap = fabs(p);
            if (!(ap <= 1.7976931348623157e308)) pfinite = 0;
            else if (ap > 0) pmin = ap < pmin ? ap : pmin, pmax = ap > pmax ? ap : pmax;
        }
        const int pv_tier = pv_tier_of(cx, bhk, pmin, pmax, pfinite);
        for (int64_t d = 0; d < D; d++)
            pvs[d * ROWS] = pv_chunk(cx, sm, col, pv_tier, bh, bhk, i, c0, nc, d, c0 == 0 ? 0.0 : pvs[d * ROWS]);
    }
    write_row(cx, a, bh, i, 1, pvs, ROWS, 0, m, l);
}

fadev_status run_forward(const double *q, const double *k, const double *v, double *out, double *lse,
                         const fadev_attention_params *params, const fadev_policy *policy, int flash) {
    const fadev_late_outputs *late = params ? params->late : nullptr;
    if (late && (out || lse || !late->fill)) return FADEV_ERR_INVALID_ARGUMENT;
    FADEV_TRY(att_validate(q, k, v, late ? q : out, params, policy, flash)); /* late: out is checked once filled */
    FADEV_TRY(fadev_cuda_require_device());
    emu_ctx cx;
    emu_inputs store;
    FADEV_TRY(emu_prepare(&cx, &store, q, k, v, params, policy, flash && params->exp_form == FADEV_EXP2, 0));
    if (late) { /* the rounding is queued: now the caller's outputs */
        void *ptrs[2] = {nullptr, nullptr};
        FADEV_TRY(late->fill(late->ctx, ptrs));
        out = (double *)ptrs[0], lse = (double *)ptrs[1];
        if (!out) return FADEV_ERR_INVALID_ARGUMENT;
    }
    fwd_args a;
    a.cx = cx;
    /* the fast path (emu_forward_fast.cu) where the policy allows it: its launch computes the heads with finite
     * inputs, the generic launch below the others (each CTA reads its head's magnitudes on the device) */
    a.fast_heads = emu_fast_forward_ok(cx, policy);
    if (a.fast_heads) FADEV_TRY(emu_fast_forward(cx, out, lse, !flash));
    a.out = out;
    a.lse = lse;
    a.tiles = (params->seq_q + ROWS - 1) / ROWS;
    a.block_kv = params->block_kv < params->seq_kv ? params->block_kv : params->seq_kv;
    const int64_t ctas = params->batch * params->heads * a.tiles;
    if (ctas > (int64_t)1 << 31) return fadev_cuda_fail_msg(FADEV_ERR_INVALID_ARGUMENT, "emulated attention: grid too large");
    const size_t scratch = (size_t)(ctas * params->dim * ROWS);
    device_arena m; /* O (flash) and the P.V partial sums */
    const size_t o_o = m.add(flash ? scratch * 8 : 0), o_pv = m.add(scratch * 8);
    FADEV_TRY(m.alloc("emulated attention: O and P.V partial sums"));
    a.o_scratch = m.at<double>(o_o);
    a.pv_scratch = m.at<double>(o_pv);
    int smem_max = 0;
    FADEV_TRY(fadev_cuda_smem_optin(&smem_max));
    a.chunk = MAX_CHUNK;
    a.narrow = att_inside_fp32(&policy->score) && att_inside_fp32(&policy->softmax) && att_inside_fp32(&policy->p);
    while (a.chunk > 8 && smem_bytes(params->dim, cx.qk_float, cx.pv_float, a.narrow, a.chunk) > (size_t)smem_max)
        a.chunk /= 2;
    const size_t smem = smem_bytes(params->dim, cx.qk_float, cx.pv_float, a.narrow, a.chunk);
    const void *kernel = flash ? (const void *)flash_kernel : (const void *)baseline_kernel;
    FADEV_TRY(fadev_cuda_smem_attr(kernel, (int)smem));
    if (flash) flash_kernel<<<(unsigned)ctas, ROWS, smem>>>(a);
    else baseline_kernel<<<(unsigned)ctas, ROWS, smem>>>(a);
    return fadev_cuda_end(params->asynchronous, flash ? "emulated flash attention" : "emulated baseline attention");
}

} // namespace

extern "C" fadev_status fadev_cuda_baseline_attention(const double *q, const double *k, const double *v, double *out,
                                                      double *lse, const fadev_attention_params *params,
                                                      const fadev_policy *policy) {
    return run_forward(q, k, v, out, lse, params, policy, 0);
}

extern "C" fadev_status fadev_cuda_flash_attention(const double *q, const double *k, const double *v, double *out,
                                                   double *lse, const fadev_attention_params *params,
                                                   const fadev_policy *policy) {
    return run_forward(q, k, v, out, lse, params, policy, 1);
}
