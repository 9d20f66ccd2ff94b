/* Emulated-precision attention backward on the GPU: baseline and flash (FlashAttention-2 order), bit-identical to
 * csrc/backward.c + backward_tile.c (docs/numerics.md "Backward" gives every operation and its counter; this file
 * only schedules them differently). q, out, dout, dq: (B, H, Nq, D); k, v, dk, dv: (B, Hkv, Nk, D); lse (B, H, Nq);
 * device pointers, contiguous float64. For query head h (K/V head g = h / (H / Hkv)), row i, visible key j:
 *   s_ij = R_score(c R_score(sum_t Q[i,t] K[j,t]))     chain in score_acc        (pair kernel)
 *   dP_ij = R_dp(sum_d dO[i,d] V[j,d])                  chain in dp_acc           (pair kernel)
 *   flash:    P = R_softmax(E(R_softmax(s - L_i))), L_i, D_i = R_dsoft(sum_d dO O) (flash_rows kernel)
 *   baseline: m_i, l_i and P = R_p(e / l_i) as its forward, D_i = R_dsoft(sum_j R_dsoft_p(P) dP)  (baseline_rows)
 *   P' = R_bwd_p(P) (the dV product's);  dS = R_ds(R_dsoft(R_dsoft_p(P) R_dsoft(dP - D_i)))
 *   ds_scaled (xformers): dS = R_ds(R_dsoft(c R_dsoft(R_dsoft_p(P) R_dsoft(dP - D_i)))), c' = 1 below
 *   dQ[i,d] = chain over K/V blocks jb of R_dq_acc(dQ + sum_{j in jb} dS K[j,d])       (dq kernel, a thread each)
 *   dV[j,d], dK[j,d] = chain over (h of the group, query block qb) of R_dkv_acc(acc + sum_{i in qb} P' dO[i,d])
 *                      (resp. dS Q[i,d])                                               (dkv kernel, a thread each)
 *   dq = R_grad(c' dQ), dk = R_grad(c' dK), dv = R_grad(dV), c' = c = R_score(scale); rows seeing no key: dq = 0.
 * Baseline: one query block of Nq rows and one K/V block of Nk keys.
 * Schedule: the "virtual rows" of a K/V head (b, g) are its group's query rows, head-major (h ascending, then i):
 * the order of the dK/dV chains. They are processed in chunks of consecutive virtual rows (for a range of K/V
 * heads at once): the pair kernel materialises P' and dS of the chunk in device scratch ([g][row][j], fp64;
 * baseline: s and R_dp(dP) first, turned into P' and dS in place by the rows kernel), the dq kernel finishes
 * the chunk's dq rows, and the dkv kernel carries every (j, d) chain on through the chunk's rows; its running
 * block sum (part) and dKacc/dVacc stay in device memory between chunks (dKacc, dVacc in dk, dv themselves).
 * Tiers: fp64 accumulators are plain fp64, fp32 nearest-even ones the fp64 product and sum rounded to fp32
 * (emu_round), other formats emu_round per term; the pair kernel's scores and dP use fp32 arithmetic where every
 * product is exact in fp32 (policy and per-(b, g) magnitudes of Q, dO, K, V: the CPU's float tier).
 * Scratch: about 2 GiB, or a third of the free device memory; the environment variable FADEV_CUDA_SCRATCH_BYTES
 * sets a smaller budget (the tests use it to run the chunked schedule on small problems). */
#include <stdlib.h>

#include "emu_backward.cuh"

namespace {

constexpr int THREADS = 256;
constexpr int PAIR_KEYS = 32, PAIR_ROWS = 8, PAIR_T = 32; /* pair kernel: 32 keys x 8 rows, D in slices of 32 */
constexpr int ROW_WARPS = THREADS / 32;                    /* baseline rows kernel: a warp per row */
constexpr unsigned FULL = 0xFFFFFFFFu;

__device__ __forceinline__ int products_exact(const emu_mag &x, const emu_mag &y) {
    return x.finite && y.finite && emu_products_fit_f32(emu_mag_min(x), emu_mag_max(x), emu_mag_min(y), emu_mag_max(y));
}

/* ------------------------------------------------------------------ set-up kernels */

/* dO = R_input(dout) with the backward's event 0, and the magnitudes of Q and dO per K/V head (for the float
 * tier of the scores and dP). blockIdx.y: query head head0 + y; blockDim.x = THREADS. */
__global__ void __launch_bounds__(THREADS) round_dout_kernel(const __grid_constant__ bwd_args a, int64_t head0) {
    const emu_ctx &cx = a.cx;
    const int64_t bh = head0 + blockIdx.y, D = cx.pr.dim, per_head = cx.pr.seq_q * D, bg = emu_kv_head(cx, bh);
    const uint64_t stream = bwd_stream(EV_DOUT, bh);
    unsigned long long dlo = 0x7FF0000000000000ull, dhi = 0, qlo = 0x7FF0000000000000ull, qhi = 0;
    int dfin = 1, qfin = 1;
    for (int64_t e = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; e < per_head; e += (int64_t)gridDim.x * blockDim.x) {
        const int64_t at = bh * per_head + e;
        const double x = emu_round(cx.input, a.dout_in[at], stream, ATT_INDEX(e / D, e % D, 0));
        a.dout[at] = x;
        if (a.doutf) a.doutf[at] = (float)x;
        emu_mag_put(dlo, dhi, dfin, x);
        emu_mag_put(qlo, qhi, qfin, cx.q[at]);
    }
    emu_mag_flush(a.domag + bg, dlo, dhi, dfin);
    emu_mag_flush(a.qmag + bg, qlo, qhi, qfin);
}

/* Flash, per query row: D_i = R_dsoft(sum_d dO O) with O = R_out(out) (step 5), L_i = R_stats(lse), or
 * R_stats(L c3) in the exp2 form (step 2). */
__global__ void __launch_bounds__(THREADS) flash_rows_kernel(const __grid_constant__ bwd_args a) {
    const emu_ctx &cx = a.cx;
    const int64_t D = cx.pr.dim, Nq = cx.pr.seq_q, n = cx.pr.batch * cx.pr.heads * Nq;
    for (int64_t row = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; row < n; row += (int64_t)gridDim.x * blockDim.x) {
        const int64_t bh = row / Nq, i = row % Nq;
        const uint64_t s1 = bwd_stream(EV_OUT, bh), s4 = bwd_stream(EV_DELTA_ACC, bh), idx = ATT_INDEX(i, 0, 0);
        double acc = 0;
        for (int64_t d = 0; d < D; d++) {
            const double o = emu_round(cx.out, a.out_in[row * D + d], s1, ATT_INDEX(i, d, 0));
            acc = emu_round(a.delta_acc, acc + a.dout[row * D + d] * o, s4, ATT_INDEX(i, d, 0));
        }
        a.row_d[row] = emu_round(a.dsoft, acc, bwd_stream(EV_DELTA, bh), idx);
        const double lse = emu_round(cx.stats, a.lse_in[row], bwd_stream(EV_LSE, bh), idx);
        a.row_l[row] = cx.exp2 ? emu_round(cx.stats, lse * a.c3, bwd_stream(EV_LSE_LOG2, bh), idx) : lse;
    }
}

/* ------------------------------------------------------------------ per pair: s, dP, P', dS */

/* A CTA is 32 keys (threadIdx.x) x 8 virtual rows (threadIdx.y) of K/V head g0 + blockIdx.z; a thread owns the
 * pair (row, key) and runs its two chains over t and d ascending. Q, dO (rows) and K, V (keys) pass through
 * shared memory in slices of 32 along D, as fp64, or as fp32 when the chain takes the float tier (block-uniform:
 * the tier is decided per K/V head). Writes P' and dS (flash) or s and R_dp(dP) (baseline) to the scratch. */
__global__ void __launch_bounds__(PAIR_KEYS * PAIR_ROWS) pair_kernel(const __grid_constant__ bwd_args a) {
    __shared__ double qs[PAIR_ROWS][PAIR_T], dos[PAIR_ROWS][PAIR_T];
    __shared__ double ks[PAIR_T][PAIR_KEYS + 1], vs[PAIR_T][PAIR_KEYS + 1];
    __shared__ float qsf[PAIR_ROWS][PAIR_T], dosf[PAIR_ROWS][PAIR_T];
    __shared__ float ksf[PAIR_T][PAIR_KEYS + 1], vsf[PAIR_T][PAIR_KEYS + 1];
    const emu_ctx &cx = a.cx;
    const int tx = threadIdx.x, ty = threadIdx.y;
    const int64_t D = cx.pr.dim, Nq = cx.pr.seq_q, Nk = cx.pr.seq_kv;
    const int64_t gl = blockIdx.z, bg = a.g0 + gl, key0 = (int64_t)blockIdx.x * PAIR_KEYS;
    const int64_t rl = (int64_t)blockIdx.y * PAIR_ROWS + ty, j = key0 + tx;
    const int row_ok = rl < a.rn;
    const vrow w = vrow_of(a, bg, a.r0 + (row_ok ? rl : 0));
    const int vis = row_ok && j < Nk && j <= last_key(cx.pr, w.i);
    if (!__syncthreads_or(vis)) return; /* the whole tile is masked */

    const int qk32 = cx.qk_float && products_exact(a.qmag[bg], cx.kmag[bg]);
    const int dp32 = a.dp_float && products_exact(a.domag[bg], cx.vmag[bg]);
    const double *qrow = cx.q + (w.bh * Nq + w.i) * D, *dorow = a.dout + (w.bh * Nq + w.i) * D;
    const double *kh = cx.k + bg * Nk * D, *vh = cx.v + bg * Nk * D;
    const uint64_t s3 = ATT_STREAM(ATT_SCORE_ACC, w.bh), s7 = bwd_stream(EV_DP_ACC, w.bh);
    double sacc = 0, pacc = 0;
    float saccf = 0, paccf = 0;
    for (int64_t t0 = 0; t0 < D; t0 += PAIR_T) {
        const int tn = (int)(D - t0 < PAIR_T ? D - t0 : PAIR_T);
        const int t_ok = tx < tn;
        const double qx = row_ok && t_ok ? qrow[t0 + tx] : 0.0, dx = row_ok && t_ok ? dorow[t0 + tx] : 0.0;
        if (qk32) qsf[ty][tx] = (float)qx;
        else qs[ty][tx] = qx;
        if (dp32) dosf[ty][tx] = (float)dx;
        else dos[ty][tx] = dx;
        for (int kk = ty; kk < PAIR_KEYS; kk += PAIR_ROWS) {
            const int ok = key0 + kk < Nk && t_ok;
            const double kx = ok ? kh[(key0 + kk) * D + t0 + tx] : 0.0, vx = ok ? vh[(key0 + kk) * D + t0 + tx] : 0.0;
            if (qk32) ksf[tx][kk] = (float)kx;
            else ks[tx][kk] = kx;
            if (dp32) vsf[tx][kk] = (float)vx;
            else vs[tx][kk] = vx;
        }
        __syncthreads();
        if (vis) {
            if (qk32) {
                for (int t = 0; t < tn; t++) saccf = __fadd_rn(saccf, __fmul_rn(qsf[ty][t], ksf[t][tx]));
            } else {
                for (int t = 0; t < tn; t++)
                    sacc = emu_mac(cx.score_acc, sacc, qs[ty][t], ks[t][tx], s3, ATT_INDEX(w.i, j, t0 + t));
            }
            if (dp32) {
                for (int t = 0; t < tn; t++) paccf = __fadd_rn(paccf, __fmul_rn(dosf[ty][t], vsf[t][tx]));
            } else {
                for (int t = 0; t < tn; t++)
                    pacc = emu_mac(a.dp_acc, pacc, dos[ty][t], vs[t][tx], s7, ATT_INDEX(w.i, j, t0 + t));
            }
        }
        __syncthreads();
    }
    if (!vis) return;
    if (qk32) sacc = saccf;
    if (dp32) pacc = paccf;
    const int64_t bh = w.bh, i = w.i, at = (gl * a.chunk_rows + rl) * Nk + j;
    const uint64_t idx = ATT_INDEX(i, j, 0);
    const double s = emu_round(cx.score, cx.c * emu_round(cx.score, sacc, ATT_STREAM(ATT_SCORE_DOT, bh), idx),
                               ATT_STREAM(ATT_SCORE_SCALED, bh), idx);
    const double dpv = emu_round(a.dp, pacc, bwd_stream(EV_DP, bh), idx);
    if (a.baseline) {
        a.sa[at] = s;
        a.sb[at] = dpv;
        return;
    }
    const int64_t row = bh * Nq + i;
    const double x = emu_round(cx.softmax, s - a.row_l[row], ATT_STREAM(ATT_SOFTMAX_SUB, bh), idx);
    const double p = emu_round(cx.softmax, emu_exp(cx.exp2, x), ATT_STREAM(ATT_SOFTMAX_EXP, bh), idx);
    const double pr = emu_round(a.bwd_p, p, bwd_stream(EV_BWD_P, bh), idx);
    a.sa[at] = pr;
    a.sb[at] = ds_of(a, p, dpv, a.row_d[row], bh, idx);
}

/* 32 more steps of a row's chain acc = R(acc + term_j), j = j0 .. j0 + cnt - 1 ascending, the terms one per lane:
 * lane 0 runs the chain on the terms passed through shared memory (a serial chain needs one thread; the other
 * lanes computing it too would only wait on each other's shuffles). acc is lane 0's. */
template <bool LEAN = false>
__device__ __forceinline__ double chain_step(const att_stage &st, double acc, double term, double *terms, int lane,
                                             int cnt, uint64_t stream, int64_t i, int64_t j0) {
    terms[lane] = term;
    __syncwarp();
    if (lane == 0)
        for (int c = 0; c < cnt; c++) acc = emu_rnd<LEAN>(st, acc + terms[c], stream, ATT_INDEX(i, j0 + c, 0));
    __syncwarp();
    return acc;
}

/* Baseline, a warp per virtual row: m = max_j s_j, e_j (in place of s_j) and l = R_stats(sum e_j) exactly as
 * att_softmax_row; P_j = R_p(e_j / l) (in place of e_j), D_i = R_dsoft(sum_j R_dsoft_p(P_j) dP); then dS in place of
 * dP and P' = R_bwd_p(P_j) in place of P_j.
 * Lane L handles keys j = L mod 32; the sums are chains over j ascending, run by lane 0 (chain_step). The scratch
 * holds T: fp64 (the generic pair kernel's), or fp32 (the fast one's, when every value stored there, s, dP, e, P,
 * dS and P', is an fp32 value: emu_bwd_fast_pairs_ok). */
template <typename T>
__global__ void __launch_bounds__(THREADS) baseline_rows_kernel(const __grid_constant__ bwd_args a, T *sa, T *sb) {
    const emu_ctx &cx = a.cx;
    const int lane = threadIdx.x & 31;
    const int64_t gl = blockIdx.y, bg = a.g0 + gl, rl = (int64_t)blockIdx.x * ROW_WARPS + (threadIdx.x >> 5);
    if (rl >= a.rn) return; /* warp-uniform */
    const int64_t Nk = cx.pr.seq_kv;
    const vrow w = vrow_of(a, bg, a.r0 + rl);
    const int64_t bh = w.bh, i = w.i, nv = emu_visible(cx.pr, i, 0, Nk);
    if (nv == 0) return; /* no pair: nothing reads this row */
    T *s = sa + (gl * a.chunk_rows + rl) * Nk, *dp = sb + (gl * a.chunk_rows + rl) * Nk;
    __shared__ double terms_all[ROW_WARPS][32];
    double *terms = terms_all[threadIdx.x >> 5];
    /* max is exact: any order gives m (a zero's sign aside, which no later value depends on: exp(+-0) = 1) */
    double m = -INFINITY;
    for (int64_t j = lane; j < nv; j += 32) m = att_max(m, s[j]);
    for (int off = 16; off; off >>= 1) m = att_max(m, __shfl_xor_sync(FULL, m, off));
    const uint64_t s6 = ATT_STREAM(ATT_SOFTMAX_SUB, bh), s7 = ATT_STREAM(ATT_SOFTMAX_EXP, bh);
    const uint64_t s8 = ATT_STREAM(ATT_SUM_ACC, bh), s16 = ATT_STREAM(ATT_P, bh);
    const uint64_t b4 = bwd_stream(EV_DELTA_ACC, bh), b6 = bwd_stream(EV_BWD_P, bh);
    double acc = 0;
    for (int64_t j0 = 0; j0 < nv; j0 += 32) {
        const int64_t j = j0 + lane;
        double e = 0;
        if (j < nv) {
            const uint64_t idx = ATT_INDEX(i, j, 0);
            e = emu_rnd<true>(cx.softmax, exp(emu_rnd<true>(cx.softmax, s[j] - m, s6, idx)), s7, idx);
            s[j] = e;
        }
        const int cnt = (int)(nv - j0 < 32 ? nv - j0 : 32);
        acc = chain_step<true>(cx.sum_acc, acc, e, terms, lane, cnt, s8, i, j0);
    }
    acc = __shfl_sync(FULL, acc, 0);
    const double l = emu_rnd<true>(cx.stats, acc, ATT_STREAM(ATT_STATS_AL, bh), ATT_INDEX(i, 0, 0));
    acc = 0;
    for (int64_t j0 = 0; j0 < nv; j0 += 32) {
        const int64_t j = j0 + lane;
        double term = 0;
        if (j < nv) {
            const uint64_t idx = ATT_INDEX(i, j, 0);
            const double p = emu_rnd<true>(cx.p, s[j] / l, s16, idx);
            s[j] = p;
            term = ps_of<true>(a, p, bh, idx) * dp[j];
        }
        const int cnt = (int)(nv - j0 < 32 ? nv - j0 : 32);
        acc = chain_step<true>(a.delta_acc, acc, term, terms, lane, cnt, b4, i, j0);
    }
    acc = __shfl_sync(FULL, acc, 0);
    const double di = emu_rnd<true>(a.dsoft, acc, bwd_stream(EV_DELTA, bh), ATT_INDEX(i, 0, 0));
    for (int64_t j = lane; j < nv; j += 32) {
        const uint64_t idx = ATT_INDEX(i, j, 0);
        dp[j] = ds_of<true>(a, s[j], dp[j], di, bh, idx);
        s[j] = emu_rnd<true>(a.bwd_p, s[j], b6, idx);
    }
}

/* ------------------------------------------------------------------ the sums (step 7) and the results (step 8) */

/* A thread per (virtual row, d) of the chunk: dQ[i,d] over the K/V blocks, then dq = R_grad(c' dQacc). */
__global__ void __launch_bounds__(THREADS) dq_kernel(const __grid_constant__ bwd_args a) {
    const emu_ctx &cx = a.cx;
    const int64_t D = cx.pr.dim, Nq = cx.pr.seq_q, Nk = cx.pr.seq_kv, bk = a.block_kv;
    const int64_t gl = blockIdx.y, bg = a.g0 + gl, e = (int64_t)blockIdx.x * THREADS + threadIdx.x;
    const int64_t rl = e / D, d = e % D;
    if (rl >= a.rn) return;
    const vrow w = vrow_of(a, bg, a.r0 + rl);
    const int64_t bh = w.bh, i = w.i, last = last_key(cx.pr, i);
    double *out = a.dq + (bh * Nq + i) * D + d;
    if (last < 0) { /* no visible key: exactly 0, no events */
        *out = 0;
        return;
    }
    const int64_t nv = last + 1 < Nk ? last + 1 : Nk;
    const double *ds = a.sb + (gl * a.chunk_rows + rl) * Nk, *k = cx.k + bg * Nk * D + d;
    const uint64_t s14 = bwd_stream(EV_ACC_DQ, bh), s17 = bwd_stream(EV_DQ_ACC, bh);
    double acc = 0;
    for (int64_t j0 = 0, jb = 0; j0 < nv; j0 += bk, jb++) {
        const int64_t j1 = j0 + bk < nv ? j0 + bk : nv;
        double part = 0;
        for (int64_t j = j0; j < j1; j++) part = emu_mac(a.grad_acc, part, ds[j], k[j * D], s14, ATT_INDEX(i, j, d));
        acc = emu_round(a.dq_acc, acc + part, s17, ATT_INDEX(i, jb, d));
    }
    *out = emu_round(a.grad, a.c_grad * acc, bwd_stream(EV_GRAD_DQ, bh), ATT_INDEX(i, d, 0));
}

/* A thread per (key j, d) of K/V head bg: the dV chain (IS_K = 0: P' dO) or the dK chain (IS_K = 1: dS Q) through
 * the chunk's virtual rows that see j, a block sum (part) per query block, added into dVacc / dKacc at the
 * block's last row; the state is read from and written back to device memory around the chunk, and the last
 * chunk writes dv = R_grad(dVacc) / dk = R_grad(c' dKacc). */
template <int IS_K> __global__ void __launch_bounds__(THREADS) dkv_kernel(const __grid_constant__ bwd_args a, int last_chunk) {
    const emu_ctx &cx = a.cx;
    const int64_t D = cx.pr.dim, Nq = cx.pr.seq_q, Nk = cx.pr.seq_kv, bq = a.block_q;
    const int64_t gl = blockIdx.y, bg = a.g0 + gl, e = (int64_t)blockIdx.x * THREADS + threadIdx.x;
    const int64_t j = e / D, d = e % D;
    if (j >= Nk) return;
    const int64_t at = (bg * Nk + j) * D + d;
    double *part_mem = IS_K ? a.dk_part : a.dv_part, *acc_mem = IS_K ? a.dk : a.dv;
    double part = part_mem[at], acc = acc_mem[at];
    const int64_t first = cx.pr.causal && j > Nk - Nq ? j - (Nk - Nq) : 0; /* the rows that see j: i >= first */
    const int64_t r_end = a.r0 + a.rn;
    for (int64_t r = a.r0; r < r_end;) {
        const vrow w = vrow_of(a, bg, r); /* this head's rows in the chunk: [w.i, i_end) */
        const int64_t i_end = w.i + (Nq - w.i < r_end - r ? Nq - w.i : r_end - r), bh = w.bh;
        const double *x = IS_K ? a.sb : a.sa, *y = (IS_K ? cx.q : a.dout) + bh * Nq * D + d;
        const int64_t x0 = (gl * a.chunk_rows + (r - a.r0) - w.i) * Nk + j; /* row i at x[x0 + i Nk] */
        const uint64_t s_acc = bwd_stream(IS_K ? EV_ACC_DK : EV_ACC_DV, bh);
        const uint64_t s_dkv = bwd_stream(IS_K ? EV_DKV_DK : EV_DKV_DV, bh);
        for (int64_t i = w.i > first ? w.i : first; i < i_end; i++) {
            part = emu_mac(a.grad_acc, part, x[x0 + i * Nk], y[i * D], s_acc, ATT_INDEX(i, j, d));
            if ((i + 1) % bq == 0 || i + 1 == Nq) { /* the block's last row, which sees j: the block contributes */
                acc = emu_round(a.dkv_acc, acc + part, s_dkv, ATT_INDEX(i / bq, j, d));
                part = 0;
            }
        }
        r += i_end - w.i;
    }
    if (last_chunk) {
        const uint64_t idx = ATT_INDEX(j, d, 0);
        acc_mem[at] = IS_K ? emu_round(a.grad, a.c_grad * acc, bwd_stream(EV_GRAD_DK, bg), idx)
                           : emu_round(a.grad, acc, bwd_stream(EV_GRAD_DV, bg), idx);
        return;
    }
    part_mem[at] = part, acc_mem[at] = acc;
}

/* ------------------------------------------------------------------ host */

/* n = a * b * c * d elements, 0 on overflow (backward.c's count4: the same FADEV_ERR_OVERFLOW cases). */
size_t count4(int64_t a, int64_t b, int64_t c, int64_t d) {
    size_t n = 1;
    const int64_t f[4] = {a, b, c, d};
    for (int x = 0; x < 4; x++)
        if (f[x] < 0 || __builtin_mul_overflow(n, (size_t)f[x], &n)) return 0;
    return n < SIZE_MAX / 16 ? n : 0;
}

unsigned grid_of(int64_t n, int64_t per_block) { return (unsigned)((n + per_block - 1) / per_block); }

fadev_status run_backward(const double *q, const double *k, const double *v, const double *out, const double *lse,
                          const double *dout, double *dq, double *dk, double *dv, const fadev_attention_params *pr,
                          const fadev_policy *pol, const fadev_policy_backward *pb, int baseline) {
    /* validation exactly as backward.c's backward(), ctx_init() */
    if (!lse || !dout || !dq || !dk || !dv || !pb) return FADEV_ERR_INVALID_ARGUMENT;
    FADEV_TRY(att_validate(q, k, v, out, pr, pol, 0));
    if (!baseline && (pr->block_q < 1 || pr->block_kv < 1 || (pr->exp_form != FADEV_EXP && pr->exp_form != FADEV_EXP2)))
        return FADEV_ERR_INVALID_ARGUMENT;
    bwd_args args;
    memset(&args, 0, sizeof args);
    {
        const fadev_format *fmts[] = {&pb->bwd_p, &pb->dsoft_p, &pb->dp_acc, &pb->dp, &pb->delta_acc, &pb->dsoft,
                                      &pb->ds, &pb->grad_acc, &pb->dq_acc, &pb->dkv_acc, &pb->grad};
        att_stage *stages[] = {&args.bwd_p, &args.dsoft_p, &args.dp_acc, &args.dp, &args.delta_acc, &args.dsoft,
                               &args.ds, &args.grad_acc, &args.dq_acc, &args.dkv_acc, &args.grad};
        for (size_t x = 0; x < sizeof fmts / sizeof fmts[0]; x++) {
            if (!att_valid_format(fmts[x])) return FADEV_ERR_INVALID_FORMAT;
            *stages[x] = att_make_stage(fmts[x], pol);
        }
    }
    const int64_t B = pr->batch, H = pr->heads, Hkv = pr->heads_kv, Nq = pr->seq_q, Nk = pr->seq_kv, D = pr->dim;
    const int64_t ld = (D + 15) / 16 * 16;
    if (!count4(B, H, Nq, 1) || !count4(B, H, Nq, ld) || !count4(B, Hkv, Nk, ld) ||
        !count4(B, Hkv, D, (Nk + 15) / 16 * 16 + 16))
        return FADEV_ERR_OVERFLOW;
    FADEV_TRY(fadev_cuda_require_device());

    emu_inputs store;
    FADEV_TRY(emu_prepare(&args.cx, &store, q, k, v, pr, pol, !baseline && pr->exp_form == FADEV_EXP2, 1));
    const emu_ctx &cx = args.cx;
    args.baseline = baseline;
    args.c_ds = fadev_round_one(pr->scale, &pol->score, FADEV_ROUND_NEAREST_EVEN, 0);
    args.ds_scaled = pb->ds_scaled != 0;
    args.c_grad = args.ds_scaled ? 1.0 : args.c_ds;
    args.c3 = fadev_round_one(0x1.71547652b82fep+0, &pol->stats, FADEV_ROUND_NEAREST_EVEN, 0);
    const fadev_format *in = &pol->input;
    args.dp_float = args.dp_acc.kind == ATT_F32 && att_inside_fp32(in) && 2 * in->precision <= 24;
    args.block_q = baseline || pr->block_q > Nq ? Nq : pr->block_q;
    args.block_kv = baseline || pr->block_kv > Nk ? Nk : pr->block_kv;
    const int64_t G = B * Hkv, R = cx.group * Nq;
    args.out_in = out, args.lse_in = lse, args.dout_in = dout;
    args.dq = dq, args.dk = dk, args.dv = dv;

    /* chunks: as many (K/V head, virtual row) pairs as about 2 GiB of scratch (or a third of free memory) hold */
    size_t budget = 0;
    FADEV_TRY(fadev_cuda_scratch_budget(&budget));
    const int fast = emu_bwd_fast_ok(args, pol, pb); /* the register-blocked fp32 sums (emu_backward_fast.cu) */
    const int fast_pairs = fast && emu_bwd_fast_pairs_ok(args); /* fp32 scratch: twice the rows per chunk */
    const size_t row_bytes = (size_t)Nk * 2 * (fast_pairs ? sizeof(float) : sizeof(double));
    const int64_t pairs = budget / row_bytes > 0 ? (int64_t)(budget / row_bytes) : 1;
    int64_t C = pairs >= R ? R : pairs, Gc = pairs >= R ? pairs / R : 1;
    C = C < (int64_t)65535 * PAIR_ROWS ? C : (int64_t)65535 * PAIR_ROWS;
    Gc = Gc < G ? Gc : G;
    Gc = Gc < 32767 ? Gc : 32767; /* gridDim.z <= 65535: the fast dK and dV share a launch of 2 gn */
    args.chunk_rows = C;

    const size_t n_q = (size_t)(B * H * Nq * D), n_kv = (size_t)(G * Nk * D), n_rows = (size_t)(B * H * Nq);
    const size_t scratch = fast_pairs ? (size_t)(Gc * C * Nk + 1) / 2 : (size_t)(Gc * C * Nk); /* in doubles */
    const int rows_max = baseline && fast_pairs; /* room for the fast rows' maxima (emu_bwd_fast_rows_ok needs saf) */
    /* one allocation for the scratch (dK and dV sums, then the row maxima, adjacent: one memset) */
    device_arena m;
    const size_t o_dk = m.add(n_kv * 8), o_dv = m.add(n_kv * 8), o_max = m.add(rows_max ? n_rows * sizeof(unsigned) : 0),
                 o_do = m.add(n_q * 8), o_dof = m.add(fast ? n_q * 4 : 0), o_mag = m.add(2 * G * sizeof(emu_mag)),
                 o_l = m.add(n_rows * 8), o_d = m.add(n_rows * 8), o_sa = m.add(scratch * 8), o_sb = m.add(scratch * 8);
    FADEV_TRY(m.alloc("emulated attention backward: scratch"));
    args.doutf = m.at<float>(o_dof);
    args.dout = m.at<double>(o_do), args.row_l = m.at<double>(o_l), args.row_d = m.at<double>(o_d);
    emu_mag *mags = m.at<emu_mag>(o_mag);
    args.qmag = mags, args.domag = mags + G;
    args.sa = m.at<double>(o_sa), args.sb = m.at<double>(o_sb), args.dk_part = m.at<double>(o_dk),
    args.dv_part = m.at<double>(o_dv);
    if (fast_pairs) /* fp32 scratch in the same buffers */
        args.saf = (float *)args.sa, args.sbf = (float *)args.sb;
    if (baseline && emu_bwd_fast_rows_ok(args)) args.row_max = m.at<unsigned>(o_max); /* from the fast pair kernel */
    /* on the legacy default stream, as every kernel here */
    CUDA_TRY(cudaMemsetAsync(m.mem.ptr + o_dk, 0, (rows_max ? o_max + n_rows * sizeof(unsigned) : o_dv + n_kv * 8) - o_dk, 0));
    CUDA_TRY(cudaMemsetAsync(dk, 0, n_kv * sizeof(double), 0));
    CUDA_TRY(cudaMemsetAsync(dv, 0, n_kv * sizeof(double), 0));

    emu_mag_reset_kernel<<<grid_of(2 * G, THREADS) < 1024 ? grid_of(2 * G, THREADS) : 1024, THREADS>>>(mags, 2 * G);
    CUDA_TRY(cudaGetLastError());
    unsigned per_head = emu_blocks((size_t)(Nq * D), THREADS);
    per_head = per_head > 64 ? 64 : per_head;
    for (int64_t h0 = 0; h0 < B * H; h0 += 65535) { /* gridDim.y is at most 65535 */
        const int64_t hn = B * H - h0 < 65535 ? B * H - h0 : 65535;
        round_dout_kernel<<<dim3(per_head, (unsigned)hn), THREADS>>>(args, h0);
        CUDA_TRY(cudaGetLastError());
    }
    if (!baseline) {
        flash_rows_kernel<<<emu_blocks(n_rows, THREADS), THREADS>>>(args);
        CUDA_TRY(cudaGetLastError());
    }
    for (int64_t g0 = 0; g0 < G; g0 += Gc) {
        const int64_t gn = G - g0 < Gc ? G - g0 : Gc;
        for (int64_t r0 = 0; r0 < R; r0 += C) {
            args.g0 = g0, args.r0 = r0, args.rn = R - r0 < C ? R - r0 : C;
            if (args.saf) {
                FADEV_TRY(emu_bwd_fast_pairs(args, gn));
            } else {
                pair_kernel<<<dim3(grid_of(Nk, PAIR_KEYS), grid_of(args.rn, PAIR_ROWS), (unsigned)gn),
                              dim3(PAIR_KEYS, PAIR_ROWS)>>>(args);
                CUDA_TRY(cudaGetLastError());
            }
            if (baseline && emu_bwd_fast_rows_ok(args)) {
                FADEV_TRY(emu_bwd_fast_rows(args, gn));
            } else if (baseline) {
                const dim3 grid(grid_of(args.rn, ROW_WARPS), (unsigned)gn);
                if (args.saf) baseline_rows_kernel<float><<<grid, THREADS>>>(args, args.saf, args.sbf);
                else baseline_rows_kernel<double><<<grid, THREADS>>>(args, args.sa, args.sb);
                CUDA_TRY(cudaGetLastError());
            }
            if (fast) {
                FADEV_TRY(emu_bwd_fast_sums(args, gn, r0 + args.rn == R));
                continue;
            }
            dq_kernel<<<dim3(grid_of(args.rn * D, THREADS), (unsigned)gn), THREADS>>>(args);
            CUDA_TRY(cudaGetLastError());
            const dim3 kv_grid(grid_of(Nk * D, THREADS), (unsigned)gn);
            dkv_kernel<0><<<kv_grid, THREADS>>>(args, r0 + args.rn == R);
            CUDA_TRY(cudaGetLastError());
            dkv_kernel<1><<<kv_grid, THREADS>>>(args, r0 + args.rn == R);
            CUDA_TRY(cudaGetLastError());
        }
    }
    return fadev_cuda_end(pr->asynchronous, baseline ? "emulated baseline attention backward"
                                                     : "emulated flash attention backward");
}

} // namespace

extern "C" fadev_status fadev_cuda_baseline_attention_backward(const double *q, const double *k, const double *v,
                                                               const double *out, const double *lse, const double *dout,
                                                               double *dq, double *dk, double *dv,
                                                               const fadev_attention_params *params,
                                                               const fadev_policy *policy,
                                                               const fadev_policy_backward *policy_backward) {
    return run_backward(q, k, v, out, lse, dout, dq, dk, dv, params, policy, policy_backward, 1);
}

extern "C" fadev_status fadev_cuda_flash_attention_backward(const double *q, const double *k, const double *v,
                                                            const double *out, const double *lse, const double *dout,
                                                            double *dq, double *dk, double *dv,
                                                            const fadev_attention_params *params,
                                                            const fadev_policy *policy,
                                                            const fadev_policy_backward *policy_backward) {
    return run_backward(q, k, v, out, lse, dout, dq, dk, dv, params, policy, policy_backward, 0);
}
