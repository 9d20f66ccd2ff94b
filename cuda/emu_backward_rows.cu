/* The emulated baseline backward's fast rows kernels (naive's class of policies): baseline_rows_kernel's work
 * (emu_backward.cu) with the same events in the same order, taken where the fast pair kernel wrote the fp32 scratch
 * and every stage of the rows is fp32, bf16 or fp16 nearest-even (emu_bwd_fast_rows_ok). */
#include "emu_backward.cuh"

namespace {

/* The fast baseline rows (naive's class of policies): baseline_rows_kernel's work (emu_backward.cu; the same events
 * in the same order), each event a conversion (dbl_round, or flt_round of an fp32 value), in four launches: the
 * element-wise steps (the maxima and e a warp per row, dS and P' a CTA per row), the two serial sums (l and D_i) with a
 * thread per row. A warp per
 * row running its chains on one lane took 12 ms at naive(bf16), B 1 H 16 N 4096 D 64 (H200); a thread per row for
 * everything left too few warps to hide the memory's latency (18 ms). Per-row values (m, then l; D_i) live in
 * row_l and row_d at the row's query index. */
constexpr int RT = 256;

/* The rows kernels' stages, in emu_bwd_fast_rows_ok's order (their indices in flt_kinds_of's packing). */
enum { RL_SOFTMAX, RL_SUM_ACC, RL_STATS, RL_P, RL_DELTA_ACC, RL_DSOFT_P, RL_DSOFT, RL_DS, RL_BWD_P, RL_N };

/* naive(F)'s kinds (policy.py: p, ds and bwd_p in F, the rest in the accumulator's fp32): the kernels' KINDS, every
 * kind a compile-time constant (no branch on a kind per event; 0: the `kinds` argument's) */
constexpr int naive_rows_kinds(int f) {
    return 1 | FLT_F32 << (2 + 2 * RL_SOFTMAX) | FLT_F32 << (2 + 2 * RL_SUM_ACC) | FLT_F32 << (2 + 2 * RL_STATS) |
           f << (2 + 2 * RL_P) | FLT_F32 << (2 + 2 * RL_DELTA_ACC) | FLT_F32 << (2 + 2 * RL_DSOFT_P) |
           FLT_F32 << (2 + 2 * RL_DSOFT) | f << (2 + 2 * RL_DS) | f << (2 + 2 * RL_BWD_P);
}

struct row_at {
    int64_t q;  /* bh * Nq + i */
    int64_t nv; /* keys the row sees */
    int64_t off; /* the row's offset in the scratch */
};

__device__ __forceinline__ row_at row_of(const bwd_args &a, int64_t gl, int64_t rl) {
    const vrow w = vrow_of(a, a.g0 + gl, a.r0 + rl);
    const int64_t Nk = a.cx.pr.seq_kv;
    return {w.bh * a.cx.pr.seq_q + w.i, emu_visible(a.cx.pr, w.i, 0, Nk), (gl * a.chunk_rows + rl) * Nk};
}

/* The element-wise steps: STEP 0, a warp per row, m = max_j s_j into row_l (exact in any order: emu_backward.cu),
 * then e_j = R_softmax(exp(R_softmax(s_j - m))) in place of s_j (the row's second read from the cache; the maxima
 * were a kernel of their own, and e a CTA per row); STEP 1, a CTA per row (a warp per row measured slower there), dS
 * in place of dP and P' = R_bwd_p(P) in place of P. exp of an fp32 value: emu_exp_fast (CUDA's bits, emu.cuh). */
template <int STEP, int KINDS = 0>
__global__ void __launch_bounds__(RT) rows_elem_kernel(const __grid_constant__ bwd_args a, const int kinds_arg) {
    const int kinds = KINDS ? KINDS : kinds_arg;
    constexpr int STRIDE = STEP == 0 ? 32 : RT; /* the threads along a row */
    const int lane = STEP == 0 ? threadIdx.x & 31 : threadIdx.x;
    const int64_t gl = blockIdx.y, rl = STEP == 0 ? (int64_t)blockIdx.x * (RT / 32) + (threadIdx.x >> 5) : blockIdx.x;
    if (rl >= a.rn) return; /* warp-uniform */
    const row_at r = row_of(a, gl, rl);
    float *s = a.saf + r.off, *dp = a.sbf + r.off;
    double v;
    if (STEP == 0) {
        double m = -INFINITY;
#pragma unroll 4
        for (int64_t j = lane; j < r.nv; j += 32) m = att_max(m, (double)s[j]);
        for (int o = 16; o; o >>= 1) m = att_max(m, __shfl_xor_sync(0xFFFFFFFFu, m, o));
        if (lane == 0 && r.nv) a.row_l[r.q] = m;
        v = m;
    } else {
        v = r.nv ? a.row_d[r.q] : 0.0;
    }
    const int ksm = flt_kind_at(kinds, RL_SOFTMAX), kdsp = flt_kind_at(kinds, RL_DSOFT_P);
    const int kdso = flt_kind_at(kinds, RL_DSOFT), kds = flt_kind_at(kinds, RL_DS), kbp = flt_kind_at(kinds, RL_BWD_P);
#pragma unroll 4
    for (int64_t j = lane; j < r.nv; j += STRIDE) {
        if (STEP == 0) {
            s[j] = dbl_round(ksm, emu_exp_fast(0, (double)dbl_round(ksm, (double)s[j] - v)));
        } else {
            const float p = s[j];
            dp[j] = ds_lean(a, kdsp, kdso, kds, p, (double)dp[j], v);
            s[j] = flt_round(kbp, p);
        }
    }
}

constexpr int CW = 4, TP = 33; /* the chains: warps per CTA, pitch of a warp's 32 x 32 tile of terms */

/* The serial sums, a thread per row, keys ascending: STEP 0 l = R_stats(chain of R_sum_acc(acc + e_j)) into row_l;
 * STEP 1 P_j = R_p(e_j / l) in place of e_j and D_i = R_dsoft(chain of R_delta_acc(acc + R_dsoft_p(P_j) dP_j)) into
 * row_d. A warp owns 32 rows; per 32 keys its lanes compute the terms along each row (coalesced) into a tile in
 * shared memory, then each lane runs its own row's chain over the tile (a thread reading its row from memory made
 * every load touch 32 lines: 4.4 ms for STEP 1). */
template <int STEP, int KINDS = 0>
__global__ void __launch_bounds__(CW * 32) rows_chain_kernel(const __grid_constant__ bwd_args a, const int kinds_arg) {
    const int kinds = KINDS ? KINDS : kinds_arg;
    __shared__ double tiles[CW][32 * TP];
    __shared__ long long offs[CW][32];
    __shared__ int nvs[CW][32];
    __shared__ double ls[CW][32];
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    const int64_t gl = blockIdx.y, rl = ((int64_t)blockIdx.x * CW + w) * 32 + lane;
    row_at r = {0, 0, 0};
    if (rl < a.rn) r = row_of(a, gl, rl);
    offs[w][lane] = r.off, nvs[w][lane] = (int)r.nv;
    ls[w][lane] = STEP == 1 && r.nv ? a.row_l[r.q] : 0;
    int nmax = (int)r.nv;
    for (int o = 16; o; o >>= 1) nmax = max(nmax, __shfl_xor_sync(0xFFFFFFFFu, nmax, o));
    __syncwarp();
    double *tile = tiles[w];
    const int kp = flt_kind_at(kinds, RL_P), kdsp = flt_kind_at(kinds, RL_DSOFT_P);
    const int k = flt_kind_at(kinds, STEP == 0 ? RL_SUM_ACC : RL_DELTA_ACC);
    double acc = 0;
    for (int j0 = 0; j0 < nmax; j0 += 32) {
        const int j = j0 + lane;
        float e[32], d[32]; /* the 32 rows' values at key j: every load issued before any is used */
#pragma unroll
        for (int q = 0; q < 32; q++) {
            const bool in = j < nvs[w][q];
            e[q] = in ? a.saf[offs[w][q] + j] : 0.0f;
            if (STEP == 1) d[q] = in ? a.sbf[offs[w][q] + j] : 0.0f;
        }
#pragma unroll
        for (int q = 0; q < 32; q++) {
            if (STEP == 0) {
                tile[q * TP + lane] = e[q];
            } else {
                const float p = dbl_round(kp, (double)e[q] / ls[w][q]);
                tile[q * TP + lane] = (double)flt_round(kdsp, p) * (double)d[q];
                e[q] = p;
            }
        }
        if (STEP == 1) {
#pragma unroll
            for (int q = 0; q < 32; q++)
                if (j < nvs[w][q]) a.saf[offs[w][q] + j] = e[q];
        }
        __syncwarp();
        const int cnt = (int)r.nv - j0 < 32 ? (int)r.nv - j0 : 32;
        for (int c = 0; c < cnt; c++) acc = dbl_round(k, acc + tile[lane * TP + c]);
        __syncwarp();
    }
    if (!r.nv) return; /* no pair: nothing reads this row */
    if (STEP == 0) a.row_l[r.q] = dbl_round(flt_kind_at(kinds, RL_STATS), acc);
    else a.row_d[r.q] = dbl_round(flt_kind_at(kinds, RL_DSOFT), acc);
}

template <int KINDS> void rows_launch(const bwd_args &a, int kinds, dim3 per_warp, dim3 per_cta, dim3 chain) {
    rows_elem_kernel<0, KINDS><<<per_warp, RT>>>(a, kinds);
    rows_chain_kernel<0, KINDS><<<chain, CW * 32>>>(a, kinds);
    rows_chain_kernel<1, KINDS><<<chain, CW * 32>>>(a, kinds);
    rows_elem_kernel<1, KINDS><<<per_cta, RT>>>(a, kinds);
}

} // namespace

/* The fast rows kernels' kinds (RL_ order) when the fast pair kernel wrote the fp32 scratch and every stage of the
 * rows kernels is fp32, bf16 or fp16 nearest-even, else 0. */
int emu_bwd_fast_rows_ok(const bwd_args &a) {
    const att_stage *stages[RL_N] = {&a.cx.softmax, &a.cx.sum_acc, &a.cx.stats, &a.cx.p, &a.delta_acc,
                                     &a.dsoft_p, &a.dsoft, &a.ds, &a.bwd_p};
    return a.saf ? flt_kinds_of(stages, RL_N) : 0;
}

fadev_status emu_bwd_fast_rows(const bwd_args &a, int64_t gn) {
    const int kinds = emu_bwd_fast_rows_ok(a);
    const dim3 per_warp((unsigned)((a.rn + RT / 32 - 1) / (RT / 32)), (unsigned)gn);
    const dim3 per_cta((unsigned)a.rn, (unsigned)gn);
    const dim3 chain((unsigned)((a.rn + CW * 32 - 1) / (CW * 32)), (unsigned)gn);
    if (kinds == naive_rows_kinds(FLT_BF16)) rows_launch<naive_rows_kinds(FLT_BF16)>(a, kinds, per_warp, per_cta, chain);
    else if (kinds == naive_rows_kinds(FLT_F16)) rows_launch<naive_rows_kinds(FLT_F16)>(a, kinds, per_warp, per_cta, chain);
    else rows_launch<0>(a, kinds, per_warp, per_cta, chain);
    CUDA_TRY(cudaGetLastError());
    return FADEV_OK;
}
