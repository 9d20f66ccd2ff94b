/* The emulated backward's fast pair kernel: s and dP of a 64 x 64 tile of (virtual row, key) pairs as register-blocked
 * fp32 FMA chains (pair_kernel's float tier, emu_backward.cu), then pair_kernel's element-wise steps with the same
 * events (every event a conversion where the stages allow: the lean kernels, emu.cuh's dbl_round), written to the
 * fp32 scratch the sums (emu_backward_fast.cu) or the baseline's rows kernels (emu_backward_rows.cu) read. */
#include "emu_backward.cuh"

namespace {

using namespace emu_bwd_tiles;

/* The pair kernel's lean stages (pair_lean), their indices in flt_kinds_of's packing. */
enum { PK_SCORE, PK_DP, PK_SOFTMAX, PK_BWD_P, PK_DSOFT_P, PK_DSOFT, PK_DS, PK_N };

/* pair_lean()'s kinds of fa2's class: score, dp, softmax, dsoft_p and dsoft fp32 (LEAN_FA2 under LEAN_FA2_MASK),
 * bwd_p and ds any kind */
constexpr int fa2_fields(int v) {
    return 1 | v << (2 + 2 * PK_SCORE) | v << (2 + 2 * PK_DP) | v << (2 + 2 * PK_SOFTMAX) | v << (2 + 2 * PK_DSOFT_P) |
           v << (2 + 2 * PK_DSOFT);
}
constexpr int LEAN_FA2_MASK = fa2_fields(3), LEAN_FA2 = fa2_fields(FLT_F32);
/* pair_lean()'s kinds, every field given */
constexpr int pk_kinds(int score, int dp, int softmax, int bwd_p, int dsoft_p, int dsoft, int ds) {
    return 1 | score << (2 + 2 * PK_SCORE) | dp << (2 + 2 * PK_DP) | softmax << (2 + 2 * PK_SOFTMAX) |
           bwd_p << (2 + 2 * PK_BWD_P) | dsoft_p << (2 + 2 * PK_DSOFT_P) | dsoft << (2 + 2 * PK_DSOFT) |
           ds << (2 + 2 * PK_DS);
}
/* paper(F): every stage F; naive(F): softmax, dsoft_p and dsoft in the accumulator's fp32, the rest F (policy.py) */
constexpr int paper_kinds(int f) { return pk_kinds(f, f, f, f, f, f, f); }
constexpr int naive_kinds(int f) { return pk_kinds(f, f, FLT_F32, f, FLT_F32, FLT_F32, f); }

/* The backward's pairs of one CTA: virtual rows rl0.. (blockIdx.y) x keys j0.. (blockIdx.x) of K/V head
 * g0 + blockIdx.z; a thread owns 4 rows x 4 keys (rows 4g.., keys tx + 16c) and runs their s and dP chains over t
 * ascending as fp32 FMAs (pair_kernel's float tier, register-blocked), then the pair_kernel's element-wise steps
 * (the same events), and writes to the fp32 scratch P' and dS (flash) or s and dP (the baseline, whose rows kernel
 * goes on from them). */
/* LEAN: 0 every event through emu_rnd; 1 the lean steps of fa2's class (LEAN_FA2: the fp32 kinds known at compile
 * time); 2 the lean steps with the kinds of `lean`, or of KINDS where it is given (every kind known at compile time:
 * paper's and naive's, whose branches on a kind per event were a third of their pairs' time) */
template <int LEAN, int KINDS = 0>
__global__ void __launch_bounds__(NT) pair_fast_kernel(const __grid_constant__ bwd_args a, const int lean) {
    constexpr int BP = TN + 1; /* pitch of the staged keys [t][key] */
    __shared__ __align__(16) float qs[TK * AP], dos[TK * AP];
    __shared__ float ks[TK * BP], vs[TK * BP];
    __shared__ long long row_at[TM]; /* bh * Nq + i of each row, -1 when out of range */
    __shared__ long long row_off[TM]; /* row_at * D, -1 when out of range */
    __shared__ int row_last[TM];     /* the last key each row sees (-1: none) */
    __shared__ int any;
    const emu_ctx &cx = a.cx;
    const int64_t D = cx.pr.dim, Nq = cx.pr.seq_q, Nk = cx.pr.seq_kv;
    const int64_t gl = blockIdx.z, bg = a.g0 + gl, j0 = (int64_t)blockIdx.x * TN, rl0 = (int64_t)blockIdx.y * TM;
    const int tid = threadIdx.x, g = tid >> 4, tx = tid & 15;
    if (tid == 0) any = 0;
    __syncthreads();
    if (tid < TM) {
        long long at = -1;
        int last = -1;
        if (rl0 + tid < a.rn) {
            const vrow w = vrow_of(a, bg, a.r0 + rl0 + tid);
            const int64_t lk = last_key(cx.pr, w.i);
            at = w.bh * Nq + w.i;
            last = (int)(lk < Nk - 1 ? lk : Nk - 1);
            if (last >= j0) atomicOr(&any, 1);
        }
        row_at[tid] = at, row_off[tid] = at < 0 ? -1 : at * D, row_last[tid] = last;
    }
    __syncthreads();
    if (!any) return; /* every pair of the tile is masked (uniform) */
    float sacc[4][4], pacc[4][4];
#pragma unroll
    for (int r = 0; r < 4; r++)
#pragma unroll
        for (int c = 0; c < 4; c++) sacc[r][c] = 0.f, pacc[r][c] = 0.f;
    const float *kh = cx.kf + bg * Nk * D, *vh = cx.vf + bg * Nk * D;
    const int di = (int)D;
    for (int64_t t0 = 0; t0 < D; t0 += TK) {
        const int tn = (int)(D - t0 < TK ? D - t0 : TK);
        __syncthreads();
        /* NT is a multiple of TK: a thread stages one t (t1 = tid % TK) of rows / keys tid / TK + 8k; offsets from
         * the row's element offset (row_at * D, computed once) and, for K and V, 32-bit (Nk D < 2^31) */
        const int t1 = tid % TK, tok = t1 < tn, ti = (int)t0 + t1;
#pragma unroll 4
        for (int m = tid / TK; m < TM; m += NT / TK) {
            const long long off = row_off[m];
            const int ok = tok && off >= 0;
            qs[t1 * AP + m] = ok ? cx.qf[off + ti] : 0.f;
            dos[t1 * AP + m] = ok ? a.doutf[off + ti] : 0.f;
        }
#pragma unroll 4
        for (int n = tid / TK; n < TN; n += NT / TK) {
            const int ok = tok && j0 + n < Nk;
            ks[t1 * BP + n] = ok ? kh[(int)(j0 + n) * di + ti] : 0.f;
            vs[t1 * BP + n] = ok ? vh[(int)(j0 + n) * di + ti] : 0.f;
        }
        __syncthreads();
#pragma unroll 4
        for (int tt = 0; tt < tn; tt++) {
            const float4 q4 = *(const float4 *)(qs + tt * AP + g * 4), d4 = *(const float4 *)(dos + tt * AP + g * 4);
            const float qv[4] = {q4.x, q4.y, q4.z, q4.w}, dv[4] = {d4.x, d4.y, d4.z, d4.w};
            float kv[4], vv[4];
#pragma unroll
            for (int c = 0; c < 4; c++) kv[c] = ks[tt * BP + tx + 16 * c], vv[c] = vs[tt * BP + tx + 16 * c];
#pragma unroll
            for (int r = 0; r < 4; r++)
#pragma unroll
                for (int c = 0; c < 4; c++) {
                    sacc[r][c] = fmaf(qv[r], kv[c], sacc[r][c]);
                    pacc[r][c] = fmaf(dv[r], vv[c], pacc[r][c]);
                }
        }
    }
    /* the pair kernel's element-wise steps; the baseline's rows' maxima over the tile's visible s (row_max) */
    unsigned mk[4] = {0, 0, 0, 0};
#pragma unroll
    for (int r = 0; r < 4; r++) {
        const int m = g * 4 + r;
        const long long row = row_at[m];
        if (row < 0) continue;
        const int64_t bh = row / Nq, i = row % Nq;
        const double L = a.baseline ? 0.0 : a.row_l[row], Di = a.baseline ? 0.0 : a.row_d[row];
        float *pa = a.saf + (gl * a.chunk_rows + rl0 + m) * Nk, *pb = a.sbf + (gl * a.chunk_rows + rl0 + m) * Nk;
#pragma unroll
        for (int c = 0; c < 4; c++) {
            const int64_t j = j0 + tx + 16 * c;
            if (j > row_last[m]) continue;
            if (LEAN) { /* pair_lean's stages: each event a conversion (dbl_round; flt_round of an fp32 value) */
                const int lk = KINDS ? KINDS : LEAN == 1 ? (lean & ~LEAN_FA2_MASK) | LEAN_FA2 : lean;
                const int ks = flt_kind_at(lk, PK_SCORE), ksm = flt_kind_at(lk, PK_SOFTMAX);
                const double s = dbl_round(ks, cx.c * (double)flt_round(ks, sacc[r][c]));
                const double dpv = flt_round(flt_kind_at(lk, PK_DP), pacc[r][c]);
                if (a.baseline) { /* s and dP for the rows kernel */
                    pa[j] = (float)s, pb[j] = (float)dpv;
                    mk[r] = max(mk[r], max_key((float)s));
                    continue;
                }
                /* x is an fp32 value (dbl_round): emu_exp_fast gives CUDA's exp bits (emu.cuh) */
                const float p = dbl_round(ksm, emu_exp_fast(cx.exp2, (double)dbl_round(ksm, s - L)));
                pa[j] = flt_round(flt_kind_at(lk, PK_BWD_P), p);
                pb[j] = ds_lean(a, flt_kind_at(lk, PK_DSOFT_P), flt_kind_at(lk, PK_DSOFT), flt_kind_at(lk, PK_DS), p,
                                dpv, Di);
                continue;
            }
            const uint64_t idx = ATT_INDEX(i, j, 0);
            /* emu_rnd<true>: the general rounding out of line. Inlined, the 16 unrolled elements' 10 events made
             * the kernel ~59k instructions, and instruction-cache misses its largest stall (ncu) */
            const double s = emu_rnd<true>(cx.score, cx.c * emu_rnd<true>(cx.score, (double)sacc[r][c],
                                           ATT_STREAM(ATT_SCORE_DOT, bh), idx), ATT_STREAM(ATT_SCORE_SCALED, bh), idx);
            const double dpv = emu_rnd<true>(a.dp, (double)pacc[r][c], bwd_stream(EV_DP, bh), idx);
            if (a.baseline) { /* s and dP for the rows kernel (fp32 values: emu_bwd_fast_pairs_ok) */
                pa[j] = (float)s, pb[j] = (float)dpv;
                mk[r] = max(mk[r], max_key((float)s));
                continue;
            }
            const double x = emu_rnd<true>(cx.softmax, s - L, ATT_STREAM(ATT_SOFTMAX_SUB, bh), idx);
            const double p = emu_rnd<true>(cx.softmax, emu_exp(cx.exp2, x), ATT_STREAM(ATT_SOFTMAX_EXP, bh), idx);
            pa[j] = (float)emu_rnd<true>(a.bwd_p, p, bwd_stream(EV_BWD_P, bh), idx);
            pb[j] = (float)ds_of<true>(a, p, dpv, Di, bh, idx);
        }
    }
    if (a.row_max) { /* a row's 16 threads are a half warp (tid = 16 g + tx): their maximum key, one atomic a row */
#pragma unroll
        for (int r = 0; r < 4; r++) {
            for (int o = 8; o; o >>= 1) mk[r] = max(mk[r], __shfl_xor_sync(0xFFFFFFFFu, mk[r], o));
            if (tx == 0 && mk[r]) atomicMax(a.row_max + row_at[g * 4 + r], mk[r]);
        }
    }
}

} // namespace

int emu_bwd_fast_pairs_ok(const bwd_args &a) {
    /* the baseline's scratch holds s and dP, then the rows kernel's e, P, dS and P' in their place: all fp32 values */
    const int stored = !a.baseline || (att_inside_fp32(&a.cx.score.fmt) && att_inside_fp32(&a.dp.fmt) &&
                                       att_inside_fp32(&a.cx.softmax.fmt) && att_inside_fp32(&a.cx.p.fmt) &&
                                       att_inside_fp32(&a.ds.fmt) && att_inside_fp32(&a.bwd_p.fmt));
    return stored && a.cx.qk_float && a.cx.pv_float && a.dp_float && a.dp_acc.kind == ATT_F32;
}

/* The pair kernel's lean element-wise steps: where the score, dP, softmax, bwd_p, dsoft_p, dsoft and ds stages are
 * each fp32, bf16 or fp16 under nearest-even (fa2's, paper's, naive's), every event on the way is dbl_round of its
 * fp64 value (emu.cuh: the value the event gives, whatever the value) and no event needs an index. Returns their
 * kinds (flt_kinds_of, PK_ order), or 0 (every event through emu_rnd). */
static int pair_lean(const bwd_args &a) {
    const att_stage *stages[PK_N] = {&a.cx.score, &a.dp, &a.cx.softmax, &a.bwd_p, &a.dsoft_p, &a.dsoft, &a.ds};
    return flt_kinds_of(stages, PK_N);
}

fadev_status emu_bwd_fast_pairs(const bwd_args &a, int64_t gn) {
    const int64_t Nk = a.cx.pr.seq_kv;
    const dim3 grid((unsigned)((Nk + TN - 1) / TN), (unsigned)((a.rn + TM - 1) / TM), (unsigned)gn);
    const int lean = pair_lean(a);
    /* two kernels: the lean branch inside the general one made its other presets' pairs 1.5x slower */
    if ((lean & LEAN_FA2_MASK) == LEAN_FA2) pair_fast_kernel<1><<<grid, NT>>>(a, lean);
    else if (lean == paper_kinds(FLT_BF16)) pair_fast_kernel<2, paper_kinds(FLT_BF16)><<<grid, NT>>>(a, lean);
    else if (lean == paper_kinds(FLT_F16)) pair_fast_kernel<2, paper_kinds(FLT_F16)><<<grid, NT>>>(a, lean);
    else if (lean == naive_kinds(FLT_BF16)) pair_fast_kernel<2, naive_kinds(FLT_BF16)><<<grid, NT>>>(a, lean);
    else if (lean == naive_kinds(FLT_F16)) pair_fast_kernel<2, naive_kinds(FLT_F16)><<<grid, NT>>>(a, lean);
    else if (lean) pair_fast_kernel<2><<<grid, NT>>>(a, lean);
    else pair_fast_kernel<0><<<grid, NT>>>(a, 0);
    CUDA_TRY(cudaGetLastError());
    return FADEV_OK;
}
