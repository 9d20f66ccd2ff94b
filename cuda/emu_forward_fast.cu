/* The emulated forward's fast path (baseline and flash), bit-identical to emu_forward.cu's generic kernels and so
 * to csrc/baseline.c and csrc/flash.c. emu_forward.cu takes it when emu_fast_forward_ok() holds: the score and
 * P.V accumulators are fp32 under nearest-even and their factors have at most 24 significant bits together
 * (the plan's qk_float and pv_float: bf16, fp16, fp8 inputs and P), every rounded input is finite, the scores,
 * softmax terms, P and the running O are fp32 values (their stages lie inside fp32), and D <= 128.
 *
 * Why the bits are the same (docs/numerics.md, "The fp32 FMA path"). The spec's accumulation step is
 * R32(R64(a + x)), a an fp32 value, x = q k the exact product (at most 24 significant bits). fmaf(q, k, a)
 * is R32(a + x). If a + x is an fp64 value, R64 is the identity. Otherwise the two summands' bits span more than
 * 53 positions: with at most 24 bits each, the smaller one S lies below the larger one L's last bit by more
 * than 6 positions, |S| < ulp(L) / 64, and L is an fp32 value (a, or x, which then lies in fp32's range: a
 * finite fp32 a cannot be smaller than ulp(x) / 64 unless it is 0, and a = 0 is exact). Then a + x and
 * R64(a + x) both lie within ulp32(L) / 64 of L, away from any fp32 midpoint, and both round to L. So one fp32
 * FMA per term gives the spec's bits for every finite a, q, k, subnormal or overflowing products included; the
 * chains keep the spec's order (t ascending for scores, keys ascending for P.V), so no sum is reassociated.
 * Where a stage is fp32 under nearest-even, an operation on two fp32 values (c * acc, s - m, rowsum + e) is done
 * in fp32: R32(R64(a op b)) = R32(a op b) by the double-rounding theorem (53 >= 2 * 24 + 2); every other rounding
 * event is emu_round on the fp64 value, as in the generic kernels, and exp, exp2, log are CUDA's fp64 functions.
 *
 * Schedule (a CTA: 64 query rows of one head, 256 threads, register-blocked):
 *   scores of a subtile of up to 128 keys: warp w owns rows 8w..8w+7, lane L keys L, L+32, L+64, L+96; each thread
 *     runs its 8 x 4 fp32 FMA chains over t ascending, Q resident in shared memory ([D][64]), K staged in slices
 *     of 32 along t; the scores go to shared memory S[key][row] and the row maxima are reduced by warp shuffles;
 *   softmax terms: element-wise over S (all threads), then a thread per row runs the row sum's chain over keys
 *     ascending (flash: and P = R_p(e) in place);
 *   P.V: a thread owns 4 rows x D/16 columns of the block's P.V chains (registers, across subtiles) and the running
 *     O (registers); V is staged in slices of 32 keys, P read as float4 from S;
 *   a flash block of at most 128 keys is one subtile, its scores computed once; a larger block (and the baseline,
 *   whose one block is every key) computes its scores again in each pass (the same events, the same values). */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "emu_forward_fast.cuh"

using namespace emu_fwd;

namespace {

constexpr int BM = 64;       /* query rows per CTA */
constexpr int KT = 128;      /* keys per score subtile */
constexpr int NT = 256;      /* threads per CTA */
constexpr int TS = 32;       /* slice of t staged for the scores */
constexpr int JS = 32;       /* slice of keys staged for P.V */
constexpr int SP = BM + 4;   /* pitch of S[key][row] (float4 reads of 4 rows) */
constexpr int KP = KT + 1;   /* pitch of K[t][key] */
constexpr int MAXD = 128;
constexpr unsigned FULL = 0xFFFFFFFFu;
#ifndef EMU_FWD_MIN_BLOCKS
#define EMU_FWD_MIN_BLOCKS 2 /* CTAs per SM the register budget is cut for: 2 caps it at 128 (spills: ~0.8 KB per
                              * thread at D <= 64); 1 lets it grow (no spills, one CTA's warps per SM). To measure
                              * both: FADEV_NVCC_FLAGS=-DEMU_FWD_MIN_BLOCKS=1 */
#endif

/* Per-row state in shared memory. */
struct rows_view {
    double *m, *mnew, *l, *rsum, *factor, *lnew;
    int *nv, *seen;
};

struct smem_t {
    float *q;  /* [D][BM] */
    float *kv; /* K slice [TS][KP] or V slice [JS][D] */
    float *s;  /* [KT][SP]: scores, then the softmax terms e */
    float *p;  /* [KT][SP]: P */
    rows_view rows;
};

__host__ __device__ size_t smem_bytes(int64_t D) {
    const size_t kv = (size_t)(TS * KP > JS * MAXD ? TS * KP : JS * MAXD);
    return ((size_t)D * BM + kv + 2 * (size_t)KT * SP) * sizeof(float) + (size_t)BM * (6 * sizeof(double) + 2 * sizeof(int));
}

__device__ smem_t carve(int64_t D, char *base) {
    smem_t sm;
    double *rd = (double *)base;
    sm.rows.m = rd, sm.rows.mnew = rd + BM, sm.rows.l = rd + 2 * BM, sm.rows.rsum = rd + 3 * BM;
    sm.rows.factor = rd + 4 * BM, sm.rows.lnew = rd + 5 * BM;
    int *ri = (int *)(rd + 6 * BM);
    sm.rows.nv = ri, sm.rows.seen = ri + BM;
    float *f = (float *)(ri + 2 * BM);
    sm.q = f;
    sm.kv = f + D * BM;
    sm.s = sm.kv + (TS * KP > JS * MAXD ? TS * KP : JS * MAXD);
    sm.p = sm.s + KT * SP;
    return sm;
}

/* Scores of the subtile's keys kb0 .. kb0 + kn - 1 of the block starting at key jb0 (kn <= 32 CN) for the CTA's
 * rows, into S[key][row]; a row's keys beyond its visible count are written but never read. With `track`, the
 * rows' maxima over their visible keys are folded into mnew. Begins with a barrier; ends without one. */
template <int CN, bool LEAN>
__device__ void scores_cn(const fast_args &a, const smem_t &sm, int64_t bh, int64_t bhk, int64_t i0, int64_t jb0,
                          int kb0, int kn, int track) {
    const emu_ctx &cx = a.cx;
    const int64_t D = cx.pr.dim, Nk = cx.pr.seq_kv;
    const int tid = threadIdx.x, w = tid >> 5, lane = tid & 31;
    float acc[8][CN];
#pragma unroll
    for (int r = 0; r < 8; r++)
#pragma unroll
        for (int c = 0; c < CN; c++) acc[r][c] = 0.f;
    const float *kh = cx.kf + (bhk * Nk + jb0 + kb0) * D;
    for (int64_t t0 = 0; t0 < D; t0 += TS) {
        const int tn = (int)(D - t0 < TS ? D - t0 : TS);
        __syncthreads(); /* the previous slice, V slice or S is consumed */
        const int di = (int)D, t0i = (int)t0; /* 32-bit offsets: key * D + t < 128 * 128 */
#pragma unroll 4
        for (int e = tid; e < TS * 32 * CN; e += NT) {
            const int tt = e % TS, key = e / TS;
            sm.kv[tt * KP + key] = tt < tn && key < kn ? kh[key * di + t0i + tt] : 0.f;
        }
        __syncthreads();
        const float *qs = sm.q + t0 * BM + w * 8;
#pragma unroll 4
        for (int tt = 0; tt < tn; tt++) {
            const float4 qa = *(const float4 *)(qs + tt * BM), qb = *(const float4 *)(qs + tt * BM + 4);
            const float qv[8] = {qa.x, qa.y, qa.z, qa.w, qb.x, qb.y, qb.z, qb.w};
            float kv[CN];
#pragma unroll
            for (int c = 0; c < CN; c++) kv[c] = sm.kv[tt * KP + lane + 32 * c];
#pragma unroll
            for (int r = 0; r < 8; r++)
#pragma unroll
                for (int c = 0; c < CN; c++) acc[r][c] = fmaf(qv[r], kv[c], acc[r][c]);
        }
    }
#pragma unroll
    for (int r = 0; r < 8; r++) {
        const int row = w * 8 + r;
        const int vis = sm.rows.nv[row] - kb0;
        float mx = -INFINITY;
        int nan = 0;
#pragma unroll
        for (int c = 0; c < CN; c++) {
            const int key = lane + 32 * c;
            if (key >= kn) continue;
            const float s = score_of<LEAN>(a, acc[r][c], bh, i0 + row, jb0 + kb0 + key);
            sm.s[key * SP + row] = s;
            if (key < vis) nan |= s != s, mx = fmaxf(mx, s);
        }
        /* The spec's running maximum att_max(m, s): any order gives its value and a NaN makes it NaN; only a zero's
         * sign may differ, which no later value depends on (exp(+-0) = 1; lse = m + log l is 0 + log l). */
        if (track) {
#pragma unroll
            for (int off = 16; off; off >>= 1) {
                mx = fmaxf(mx, __shfl_xor_sync(FULL, mx, off));
                nan |= __shfl_xor_sync(FULL, nan, off);
            }
            const double sub = nan ? (double)NAN : (double)mx;
            if (lane == 0) sm.rows.mnew[row] = att_max(sm.rows.mnew[row], sub);
        }
    }
}

template <bool LEAN>
__device__ __forceinline__ void scores(const fast_args &a, const smem_t &sm, int64_t bh, int64_t bhk, int64_t i0,
                                       int64_t jb0, int kb0, int kn, int track) {
    if (kn <= 32) scores_cn<1, LEAN>(a, sm, bh, bhk, i0, jb0, kb0, kn, track);
    else if (kn <= 64) scores_cn<2, LEAN>(a, sm, bh, bhk, i0, jb0, kb0, kn, track);
    else if (kn <= 96) scores_cn<3, LEAN>(a, sm, bh, bhk, i0, jb0, kb0, kn, track);
    else scores_cn<4, LEAN>(a, sm, bh, bhk, i0, jb0, kb0, kn, track);
}

enum terms_mode { TERMS_E = 0, TERMS_E_P = 1, TERMS_P_DIV = 2 };

/* The softmax terms of the subtile, element-wise (a thread keeps one row): e = R_softmax(E(R_softmax(s - m_new)))
 * into S (TERMS_E), and P = R_p(e) into P as well (TERMS_E_P, flash), or only P = R_p(e / l) (TERMS_P_DIV, the
 * baseline's second pass). Begins and ends with a barrier. */
template <bool LEAN>
__device__ void softmax_terms(const fast_args &a, const smem_t &sm, int64_t bh, int64_t i0, int64_t jb0, int kb0,
                              int kn, int mode) {
    __syncthreads(); /* S and mnew are written */
    const int row = threadIdx.x % BM, vis = sm.rows.nv[row] - kb0, n = vis < kn ? vis : kn;
    const double m = sm.rows.mnew[row], l = sm.rows.l[row];
    const float mf = (float)m;
    const int64_t i = i0 + row;
#pragma unroll 2
    for (int key = threadIdx.x / BM; key < n; key += NT / BM) {
        const int64_t j = jb0 + kb0 + key;
        const float e = term_of<LEAN>(a, sm.s[key * SP + row], m, mf, bh, i, j);
        if (mode != TERMS_P_DIV) sm.s[key * SP + row] = e;
        if (mode == TERMS_E_P) sm.p[key * SP + row] = p_of<LEAN>(a, e, bh, i, j);
        if (mode == TERMS_P_DIV)
            sm.p[key * SP + row] = LEAN ? dbl_round(a.p_kind, (double)e / l)
                                        : (float)rnd(a.cx.p, (double)e / l, ATT_STREAM(ATT_P, bh), ATT_INDEX(i, j, 0));
    }
    __syncthreads();
}

/* A thread per row: the row sum's chain rsum = R_sum_acc(rsum + e) over the subtile's visible keys ascending.
 * Ends with a barrier. */
__device__ void row_sums(const fast_args &a, const smem_t &sm, int64_t bh, int64_t i0, int64_t jb0, int kb0, int kn) {
    const emu_ctx &cx = a.cx;
    const int row = threadIdx.x;
    if (row < BM) {
        const int vis = sm.rows.nv[row] - kb0, n = vis < kn ? vis : kn;
        const float *e = sm.s + row;
        if (n > 0 && cx.sum_acc.kind == ATT_F32) { /* fp32 + fp32 rounded once in fp32: the spec's bits */
            float rs = (float)sm.rows.rsum[row];
#pragma unroll 8
            for (int key = 0; key < n; key++) rs = __fadd_rn(rs, e[key * SP]);
            sm.rows.rsum[row] = rs;
        } else if (n > 0) {
            double rs = sm.rows.rsum[row];
            for (int key = 0; key < n; key++) rs = sum_step(a, rs, e[key * SP], bh, i0 + row, jb0 + kb0 + key);
            sm.rows.rsum[row] = rs;
        }
    }
    __syncthreads();
}

/* dst[0 .. len) = src[0 .. have) and zeros after it: the slice's rows are contiguous in global memory (a row of D
 * floats per key), so no division by D (an int64 division per element cost more instructions than the slice's P.V
 * products, and its loads went one at a time); float4 loads where src is 16-byte aligned and the lengths allow
 * (D a multiple of 4; dst, sm.kv, is). Ends without a barrier. */
__device__ __forceinline__ void stage_rows(float *dst, const float *src, int have, int len) {
    const int tid = threadIdx.x;
    if (((have | len) & 3) == 0 && (reinterpret_cast<uintptr_t>(src) & 15) == 0) {
        const float4 *s4 = reinterpret_cast<const float4 *>(src);
        float4 *d4 = reinterpret_cast<float4 *>(dst);
#pragma unroll 4
        for (int e = tid; e < len / 4; e += NT) d4[e] = e < have / 4 ? s4[e] : make_float4(0.f, 0.f, 0.f, 0.f);
        return;
    }
#pragma unroll 4
    for (int e = tid; e < len; e += NT) dst[e] = e < have ? src[e] : 0.f;
}

/* P.V of the subtile added onto the block's chains pv (thread: rows 4g..4g+3, columns tx + 16c), V staged in
 * slices of JS keys; a term enters only where the row sees the key. */
template <int DC>
__device__ void pv_terms(const fast_args &a, const smem_t &sm, int64_t bhk, int64_t jb0, int kb0, int kn,
                         int64_t nvmin, const int nvr[4], float pv[4][DC]) {
    const emu_ctx &cx = a.cx;
    const int64_t D = cx.pr.dim, Nk = cx.pr.seq_kv;
    const int tid = threadIdx.x, g = tid >> 4, tx = tid & 15;
    const float *vh = cx.vf + (bhk * Nk + jb0 + kb0) * D;
    const int full_d = 16 * DC == D;
    for (int js = 0; js < kn; js += JS) {
        const int jn = kn - js < JS ? kn - js : JS;
        __syncthreads(); /* the previous V slice is consumed */
        stage_rows(sm.kv, vh + (int64_t)js * D, jn * (int)D, JS * (int)D);
        __syncthreads();
        const float *pp = sm.p + js * SP + g * 4, *vs = sm.kv + tx;
        if (kb0 + js + jn <= nvmin && full_d) { /* every row sees every key of the slice, every column is real */
#pragma unroll 4
            for (int jj = 0; jj < jn; jj++) {
                const float4 p4 = *(const float4 *)(pp + jj * SP);
                const float pr[4] = {p4.x, p4.y, p4.z, p4.w};
#pragma unroll
                for (int c = 0; c < DC; c++) {
                    const float vv = vs[jj * D + 16 * c];
#pragma unroll
                    for (int r = 0; r < 4; r++) pv[r][c] = fmaf(pr[r], vv, pv[r][c]);
                }
            }
            continue;
        }
        for (int jj = 0; jj < jn; jj++) {
            const float4 p4 = *(const float4 *)(pp + jj * SP);
            const float pr[4] = {p4.x, p4.y, p4.z, p4.w};
            const int kb = kb0 + js + jj;
#pragma unroll
            for (int c = 0; c < DC; c++) {
                if (tx + 16 * c >= D) break;
                const float vv = vs[jj * D + 16 * c];
#pragma unroll
                for (int r = 0; r < 4; r++)
                    if (kb < nvr[r]) pv[r][c] = fmaf(pr[r], vv, pv[r][c]);
            }
        }
    }
}

template <int DC, bool LEAN>
__global__ void __launch_bounds__(NT, EMU_FWD_MIN_BLOCKS) fast_kernel(const __grid_constant__ fast_args a) {
    extern __shared__ __align__(16) char smem[];
    const emu_ctx &cx = a.cx;
    const int tid = threadIdx.x, g = tid >> 4, tx = tid & 15;
    const int64_t cta = blockIdx.x, bh = cta / a.tiles, i0 = (cta % a.tiles) * BM;
    const int64_t D = cx.pr.dim, Nq = cx.pr.seq_q, Nk = cx.pr.seq_kv, bhk = emu_kv_head(cx, bh);
    if (!emu_head_finite(cx, bh, bhk)) return; /* the generic launch computes this head */
    const int here = (int)(Nq - i0 < BM ? Nq - i0 : BM); /* valid rows of the CTA */
    const smem_t sm = carve(D, smem);
    const rows_view &rw = sm.rows;
    for (int e = tid; e < D * BM; e += NT) {
        const int t = (int)(e % D), row = (int)(e / D);
        sm.q[t * BM + row] = row < here ? cx.qf[(bh * Nq + i0 + row) * D + t] : 0.f;
    }
    if (tid < BM) rw.m[tid] = -INFINITY, rw.l[tid] = 0, rw.seen[tid] = 0;
    float o[4][DC], pv[4][DC];
#pragma unroll
    for (int r = 0; r < 4; r++)
#pragma unroll
        for (int c = 0; c < DC; c++) o[r][c] = 0.f;
    const int64_t bkv = a.block_kv;
    for (int64_t jb = 0, jb0 = 0; jb0 < Nk; jb++, jb0 += bkv) {
        const int64_t n = bkv < Nk - jb0 ? bkv : Nk - jb0;
        const int64_t nvmax = emu_visible(cx.pr, i0 + here - 1, jb0, n), nvmin = emu_visible(cx.pr, i0, jb0, n);
        if (nvmax == 0) {
            if (cx.pr.causal) break; /* later blocks are masked too, for every row */
            continue;
        }
        __syncthreads(); /* the previous block's readers of the row state are done */
        if (tid < BM) {
            rw.nv[tid] = tid < here ? (int)emu_visible(cx.pr, i0 + tid, jb0, n) : 0;
            rw.mnew[tid] = rw.m[tid], rw.rsum[tid] = 0;
        }
        __syncthreads();
        int nvr[4];
#pragma unroll
        for (int r = 0; r < 4; r++) nvr[r] = rw.nv[g * 4 + r];
        const int nsub = (int)((nvmax + KT - 1) / KT), once = nsub == 1;
        /* the maxima (and, for a single subtile, the scores kept for what follows) */
        for (int sub = 0; sub < nsub; sub++)
            scores<LEAN>(a, sm, bh, bhk, i0, jb0, sub * KT, (int)(nvmax - sub * KT < KT ? nvmax - sub * KT : KT), 1);
        if (a.baseline) { /* the baseline's row sums and l, before any P */
            for (int sub = 0; sub < nsub; sub++) {
                const int kn = (int)(nvmax - sub * KT < KT ? nvmax - sub * KT : KT);
                if (!once) scores<LEAN>(a, sm, bh, bhk, i0, jb0, sub * KT, kn, 0);
                softmax_terms<LEAN>(a, sm, bh, i0, jb0, sub * KT, kn, TERMS_E);
                row_sums(a, sm, bh, i0, jb0, sub * KT, kn);
            }
            if (tid < BM && rw.nv[tid] > 0)
                rw.l[tid] = rnd(cx.stats, rw.rsum[tid], ATT_STREAM(ATT_STATS_AL, bh), ATT_INDEX(i0 + tid, 0, 0));
        }
#pragma unroll
        for (int r = 0; r < 4; r++)
#pragma unroll
            for (int c = 0; c < DC; c++) pv[r][c] = 0.f;
        for (int sub = 0; sub < nsub; sub++) {
            const int kn = (int)(nvmax - sub * KT < KT ? nvmax - sub * KT : KT);
            if (!once || a.baseline) scores<LEAN>(a, sm, bh, bhk, i0, jb0, sub * KT, kn, 0);
            softmax_terms<LEAN>(a, sm, bh, i0, jb0, sub * KT, kn, a.baseline ? TERMS_P_DIV : TERMS_E_P);
            if (!a.baseline) row_sums(a, sm, bh, i0, jb0, sub * KT, kn);
            pv_terms(a, sm, bhk, jb0, sub * KT, kn, nvmin, nvr, pv);
        }
        if (a.baseline) { /* out = R_out(pv), l and m as the forward's */
#pragma unroll
            for (int r = 0; r < 4; r++)
#pragma unroll
                for (int c = 0; c < DC; c++) o[r][c] = pv[r][c];
            if (tid < BM && rw.nv[tid] > 0) rw.seen[tid] = 1, rw.m[tid] = rw.mnew[tid];
            break;
        }
        /* 4-5: the statistics of the rows that see a key of the block (row_softmax) */
        if (tid < BM && rw.nv[tid] > 0)
            row_stats(a, bh, i0 + tid, jb, rw.m[tid], rw.mnew[tid], rw.l[tid], rw.rsum[tid], rw.lnew[tid], rw.factor[tid]);
        __syncthreads();
        /* 7 (and 9): O from pv (row_update) */
#pragma unroll
        for (int r = 0; r < 4; r++) {
            const int row = g * 4 + r;
            if (nvr[r] == 0) continue;
            const int64_t i = i0 + row;
            const double factor = rw.factor[row], l_new = rw.lnew[row];
#pragma unroll
            for (int c = 0; c < DC; c++) {
                const int d = tx + 16 * c;
                if (d >= D) break;
                o[r][c] = o_step<LEAN>(a, o[r][c], pv[r][c], factor, l_new, bh, i, jb, d);
            }
        }
        if (tid < BM && rw.nv[tid] > 0)
            rw.m[tid] = rw.mnew[tid], rw.l[tid] = l_kept(a, rw.lnew[tid], bh, i0 + tid, jb), rw.seen[tid] = 1;
    }
    __syncthreads();
    /* out and lse (write_row): rows that saw no key get 0 and -inf */
#pragma unroll
    for (int r = 0; r < 4; r++) {
        const int row = g * 4 + r;
        if (row >= here) break;
        double *out = a.out + (bh * Nq + i0 + row) * D;
#pragma unroll
        for (int c = 0; c < DC; c++) {
            const int d = tx + 16 * c;
            if (d >= D) break;
            out[d] = out_of(a, o[r][c], rw.seen[row], rw.l[row], bh, i0 + row, d);
        }
    }
    if (a.lse && tid < here) a.lse[bh * Nq + i0 + tid] = lse_of(a, rw.seen[tid], rw.m[tid], rw.l[tid], bh, i0 + tid);
}

} // namespace

int emu_fast_forward_ok(const emu_ctx &cx, const fadev_policy *pol) {
    const char *generic = getenv("FADEV_EMU_GENERIC"); /* tests: the generic kernels, to compare the two paths */
    if (generic && *generic && strcmp(generic, "0") != 0) return 0;
    const int kv_outer = cx.pr.loop_order == FADEV_KV_OUTER;
    return cx.qk_float && cx.pv_float && cx.pr.dim <= MAXD && att_inside_fp32(&pol->score) &&
           att_inside_fp32(&pol->softmax) && att_inside_fp32(&pol->p) && att_inside_fp32(&pol->out_acc) &&
           (!kv_outer || att_inside_fp32(&pol->state_out));
}

/* The lean kernels (LEAN): where the score, softmax, p, out_acc (and with kv_outer state_out) stages are each fp32,
 * bf16 or fp16 under nearest-even, their per-element events are dbl_round of the fp64 value (emu.cuh), no event
 * index; returns their kinds (flt_kinds_of, LK_ order), or 0. Kernels of their own: a branch inside the general one
 * slowed the other policies (measured on the backward's pairs). */
static int fast_lean(const emu_ctx &cx) {
    const att_stage *stages[LK_N] = {&cx.score, &cx.softmax, &cx.out_acc, &cx.p, &cx.state_out};
    return flt_kinds_of(stages, cx.pr.loop_order == FADEV_KV_OUTER ? LK_N : LK_STATE_OUT);
}

fast_args emu_fwd::fast_args_of(const emu_ctx &cx, double *out, double *lse, int baseline, int rows_per_cta) {
    fast_args a;
    a.cx = cx;
    a.out = out, a.lse = lse;
    a.baseline = baseline;
    a.p_kind = flt_kind_of(cx.p);
    a.so_kind = flt_kind_of(cx.state_out);
    a.lean = fast_lean(cx);
    a.o32 = cx.out_acc.kind == ATT_F32 && att_inside_fp32(&cx.stats.fmt) && att_inside_fp32(&cx.rescale.fmt);
    /* o16: the factor is the stats stage's a_l when eager (l_new is that stage's too), else the rescale stage's alpha
     * (emu_row_stats) */
    const int koa = flt_kind_of(cx.out_acc);
    const att_stage &fac = cx.pr.normalize == FADEV_EAGER ? cx.stats : cx.rescale;
    a.o16 = a.lean && (koa == FLT_BF16 || koa == FLT_F16) && flt_kind_of(fac) == koa ? koa : 0;
    a.tiles = (cx.pr.seq_q + rows_per_cta - 1) / rows_per_cta;
    a.units = 0, a.s_keep = nullptr, a.pairing = 0;
    a.etab = exp_tab{nullptr, 0, 0};
    a.cf = (float)cx.c;
    uint32_t cbits;
    memcpy(&cbits, &a.cf, sizeof cbits);
    a.c12 = a.lean && (double)a.cf == cx.c && fabsf(a.cf) >= 0x1p-126f && fabsf(a.cf) <= FLT_MAX &&
            (cbits & 0x7FFu) == 0; /* the low 11 of 23 fraction bits zero: <= 13 significant bits */
    a.block_kv = baseline || cx.pr.block_kv > cx.pr.seq_kv ? cx.pr.seq_kv : cx.pr.block_kv;
    return a;
}

fadev_status emu_fast_forward(const emu_ctx &cx, double *out, double *lse, int baseline) {
    if (warp_forward_ok(cx, baseline)) return warp_forward(cx, out, lse, baseline);
    const fast_args a = fast_args_of(cx, out, lse, baseline, BM);
    const int64_t ctas = cx.pr.batch * cx.pr.heads * a.tiles;
    if (ctas >= (int64_t)1 << 31) return fadev_cuda_fail_msg(FADEV_ERR_INVALID_ARGUMENT, "emulated attention: grid too large");
    const size_t smem = smem_bytes(cx.pr.dim);
    const int d64 = cx.pr.dim <= 64;
    const void *kernel = a.lean ? (d64 ? (const void *)fast_kernel<4, true> : (const void *)fast_kernel<8, true>)
                                : (d64 ? (const void *)fast_kernel<4, false> : (const void *)fast_kernel<8, false>);
    FADEV_TRY(fadev_cuda_smem_attr(kernel, (int)smem));
    if (a.lean && d64) fast_kernel<4, true><<<(unsigned)ctas, NT, smem>>>(a);
    else if (a.lean) fast_kernel<8, true><<<(unsigned)ctas, NT, smem>>>(a);
    else if (d64) fast_kernel<4, false><<<(unsigned)ctas, NT, smem>>>(a);
    else fast_kernel<8, false><<<(unsigned)ctas, NT, smem>>>(a);
    CUDA_TRY(cudaGetLastError());
    return FADEV_OK;
}
