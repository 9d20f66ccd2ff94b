/* The emulated baseline backward's fast rows kernels (naive's class of policies): baseline_rows_kernel's work
 * (emu_backward.cu) with the same events in the same order, taken where the fast pair kernel wrote the fp32 scratch
 * and every stage of the rows is fp32, bf16 or fp16 nearest-even (emu_bwd_fast_rows_ok). */
#include "emu_backward.cuh"

namespace {

/* The fast baseline rows (naive's class of policies): baseline_rows_kernel's work (emu_backward.cu; the same events
 * in the same order), each event a conversion (dbl_round, or flt_round of an fp32 value), in three launches over the
 * scratch: the softmax (e in place of s, and l; m is the pair kernel's row_max), P in place of e and D_i, then dS in
 * place of dP and P' in place of P. The first two keep each row's serial sum on one thread: a warp owns GR
 * consecutive rows, whose 32-key blocks stream through two shared-memory slots (cp.async: block b + 1's copies in
 * flight while block b is used); on each block the lanes compute the element-wise values a key a lane (coalesced,
 * every lane busy), then GR lanes run their rows' chains over the slot. (A warp of 32 rows loading a block into
 * registers, 140 of them, ran at 15% occupancy; a lane running everything of its own row left a causal call's
 * longest rows on one warp: 32 rows x 4096 keys of exps in series.) Per-row values: l in row_l, D_i in row_d, at
 * the row's query index. */
constexpr unsigned FULL = 0xFFFFFFFFu;
constexpr int RT = 256;  /* dS, P': the threads of a CTA per row */
/* rows a warp in the chains' kernels. H100, naive bf16 GQA 16/4 causal D 64: D_i's kernel 0.92 ms at 16, 1.02-1.09
 * at 8 (its chains take fewer idle lanes a term); the softmax's measured 1.11-1.16 ms at 16, 1.01-1.08 at 8 (with its
 * maxima still a pass of its own) */
constexpr int GR_SOFT = 8, GR_DELTA = 16;
constexpr int GW = 4;    /* warps a CTA there */
constexpr int GP = 33;   /* pitch of a staged row's 32 keys (lane q reads row q's key c: bank q + c) */

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

/* A warp's GR consecutive rows of one chunk: row q at the scratch's base + q Nk; lane q < rows holds row q (me);
 * every lane holds each row's visible keys (nvs; 0 past the chunk). */
template <int GR> struct row_group {
    row_at me;
    int64_t base, nk;
    int rows, nmax; /* rows inside the chunk; their most visible keys */
    int nvs[GR];
};

template <int GR>
__device__ __forceinline__ row_group<GR> group_of(const bwd_args &a, int64_t gl, int64_t rl0, int lane) {
    row_group<GR> g;
    g.rows = a.rn - rl0 < GR ? (int)(a.rn - rl0) : GR;
    g.me = lane < g.rows ? row_of(a, gl, rl0 + lane) : row_at{0, 0, 0};
    g.nk = a.cx.pr.seq_kv;
    g.base = (gl * a.chunk_rows + rl0) * g.nk;
    g.nmax = 0;
#pragma unroll
    for (int q = 0; q < GR; q++) {
        g.nvs[q] = __shfl_sync(FULL, (int)g.me.nv, q);
        g.nmax = max(g.nmax, g.nvs[q]);
    }
    return g;
}

/* Keys of block j0 that lane q's row sees, not clamped (< 0: none; >= 32: the whole block) */
template <int GR> __device__ __forceinline__ int block_keys(const row_group<GR> &g, int j0) {
    return (int)g.me.nv - j0;
}

/* Block j0 of the rows' NA arrays (src[k] + base) into slot[k][q * GP + c] with cp.async, lane c key j0 + c
 * (coalesced); a row's keys past its visible ones are neither read nor used (zeros). */
template <int NA, int GR>
__device__ __forceinline__ void stage_block(float *slot, float *const (&src)[NA], const row_group<GR> &g, int j0,
                                            int lane) {
    const int64_t j = j0 + lane;
#pragma unroll
    for (int q = 0; q < GR; q++) {
        if (q >= g.rows) break; /* warp-uniform */
        const bool in = j < g.nvs[q];
#pragma unroll
        for (int k = 0; k < NA; k++)
            cp_async_4(slot + (k * GR + q) * GP + lane, in ? src[k] + g.base + q * g.nk + j : src[k], in);
    }
}

/* The rows' blocks in key order through two slots: block b + 1's copies are issued before block b is used
 * (use(slot, j0) on every lane; it may rewrite the slot, which is not refilled before every lane has left it). */
template <int NA, int GR, typename F>
__device__ __forceinline__ void stream_blocks(float *slots, float *const (&src)[NA], const row_group<GR> &g, int lane,
                                              F &&use) {
    constexpr int SLOT = NA * GR * GP;
    const int nblk = (g.nmax + 31) / 32;
    __syncwarp(); /* a stream before this one has left the slots */
    if (nblk) stage_block(slots, src, g, 0, lane);
    cp_async_commit();
    for (int b = 0; b < nblk; b++) {
        cp_async_wait_all();
        __syncwarp();
        if (b + 1 < nblk) stage_block(slots + ((b + 1) & 1) * SLOT, src, g, (b + 1) * 32, lane);
        cp_async_commit();
        use(slots + (b & 1) * SLOT, b * 32);
    }
}

/* acc = step(acc, row[c], c) for c < n, in order: a full block's 32 unrolled, so its shared
 * loads run ahead of the chain, which then waits only on its own operations. n is block_keys's, not clamped: with
 * min(max(n, 0), 32) == 32 as the test, ptxas's fused min/max sent lanes of n <= 0 down the unrolled path
 * (compute-sanitizer: lanes past the group's rows read past the slots). */
template <typename F> __device__ __forceinline__ float chain_over(const float *row, int n, float acc, F &&step) {
    if (n >= 32) {
#pragma unroll
        for (int c = 0; c < 32; c++) acc = step(acc, row[c], c);
    } else {
        for (int c = 0; c < n; c++) acc = step(acc, row[c], c);
    }
    return acc;
}

/* The softmax of each row: m = max_j s_j (the pair kernel's row_max: max is exact in any order, as att_max's, a
 * zero's sign aside, which no later value depends on: exp(+-0) = 1), e_j = R_softmax(exp(R_softmax(s_j - m))) in
 * place of s_j and l = R_stats(chain of R_sum_acc(acc + e_j)) into row_l. exp of an fp32 value: emu_exp_fast
 * (CUDA's bits, emu.cuh). */
template <int KINDS = 0>
__global__ void __launch_bounds__(GW * 32) rows_soft_kernel(const __grid_constant__ bwd_args a, const int kinds_arg) {
    const int kinds = KINDS ? KINDS : kinds_arg;
    constexpr int GR = GR_SOFT;
    __shared__ float slots_all[GW][2 * GR * GP];
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    const int64_t rl0 = ((int64_t)blockIdx.x * GW + w) * GR;
    if (rl0 >= a.rn) return; /* warp-uniform */
    const row_group<GR> g = group_of<GR>(a, blockIdx.y, rl0, lane);
    float *slots = slots_all[w];
    float *const src[1] = {a.saf};
    const unsigned my_key = g.me.nv ? a.row_max[g.me.q] : 0;
    float m[GR]; /* every row's maximum on every lane */
#pragma unroll
    for (int q = 0; q < GR; q++) m[q] = max_of_key(__shfl_sync(FULL, my_key, q));
    const int ksm = flt_kind_at(kinds, RL_SOFTMAX), ksum = flt_kind_at(kinds, RL_SUM_ACC);
    float acc = 0;
    stream_blocks(slots, src, g, lane, [&](float *slot, int j0) {
        const int64_t j = j0 + lane;
#pragma unroll
        for (int q = 0; q < GR; q++) {
            if (j < g.nvs[q]) {
                const double x = (double)dbl_round(ksm, (double)slot[q * GP + lane] - (double)m[q]);
                const float e = dbl_round(ksm, emu_exp_fast(0, x));
                slot[q * GP + lane] = e;
                a.saf[g.base + q * g.nk + j] = e;
            }
        }
        __syncwarp();
        const float *row = slot + lane * GP;
        if (ksum == FLT_F32) /* R_f32(R_f64(acc + e)) = R_f32(acc + e) for fp32 acc and e: 53 >= 2 * 24 + 2 */
            acc = chain_over(row, block_keys(g, j0), acc, [](float x, float t, int) { return __fadd_rn(x, t); });
        else
            acc = chain_over(row, block_keys(g, j0), acc,
                             [&](float x, float t, int) { return dbl_round(ksum, (double)x + (double)t); });
    });
    if (lane < g.rows && g.me.nv) a.row_l[g.me.q] = dbl_round(flt_kind_at(kinds, RL_STATS), (double)acc);
}

/* P_j = R_p(e_j / l) in place of e_j, D_i = R_dsoft(chain of R_delta_acc(acc + R_dsoft_p(P_j) dP_j)) into row_d. */
template <int KINDS = 0>
__global__ void __launch_bounds__(GW * 32) rows_delta_kernel(const __grid_constant__ bwd_args a, const int kinds_arg) {
    const int kinds = KINDS ? KINDS : kinds_arg;
    constexpr int GR = GR_DELTA;
    __shared__ float slots_all[GW][2 * 2 * GR * GP];
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    const int64_t rl0 = ((int64_t)blockIdx.x * GW + w) * GR;
    if (rl0 >= a.rn) return; /* warp-uniform */
    const row_group<GR> g = group_of<GR>(a, blockIdx.y, rl0, lane);
    const double my_l = g.me.nv ? a.row_l[g.me.q] : 1.0;
    double l[GR];
#pragma unroll
    for (int q = 0; q < GR; q++) l[q] = __shfl_sync(FULL, my_l, q);
    const int kp = flt_kind_at(kinds, RL_P), kdsp = flt_kind_at(kinds, RL_DSOFT_P);
    const int kdel = flt_kind_at(kinds, RL_DELTA_ACC);
    float *const src[2] = {a.saf, a.sbf};
    float acc = 0;
    stream_blocks(slots_all[w], src, g, lane, [&](float *slot, int j0) {
        const int64_t j = j0 + lane;
#pragma unroll
        for (int q = 0; q < GR; q++) {
            if (j < g.nvs[q]) {
                const float p = dbl_round(kp, (double)slot[q * GP + lane] / l[q]);
                a.saf[g.base + q * g.nk + j] = p;
                slot[q * GP + lane] = flt_round(kdsp, p);
            }
        }
        __syncwarp();
        const float *ps = slot + lane * GP, *dp = slot + (GR + lane) * GP;
        acc = chain_over(ps, block_keys(g, j0), acc, [&](float x, float t, int c) {
            return dbl_round(kdel, (double)x + (double)t * (double)dp[c]); /* the product exact in fp64 */
        });
    });
    if (lane < g.rows && g.me.nv) a.row_d[g.me.q] = dbl_round(flt_kind_at(kinds, RL_DSOFT), (double)acc);
}

/* A CTA per row (a warp per row measured slower): dS in place of dP, P' = R_bwd_p(P) in place of P. */
template <int KINDS = 0>
__global__ void __launch_bounds__(RT) rows_ds_kernel(const __grid_constant__ bwd_args a, const int kinds_arg) {
    const int kinds = KINDS ? KINDS : kinds_arg;
    const row_at r = row_of(a, blockIdx.y, blockIdx.x);
    if (!r.nv) return;
    float *s = a.saf + r.off, *dp = a.sbf + r.off;
    const double di = a.row_d[r.q];
    const int kdsp = flt_kind_at(kinds, RL_DSOFT_P), kdso = flt_kind_at(kinds, RL_DSOFT);
    const int kds = flt_kind_at(kinds, RL_DS), kbp = flt_kind_at(kinds, RL_BWD_P);
#pragma unroll 4
    for (int64_t j = threadIdx.x; j < r.nv; j += RT) {
        const float p = s[j];
        dp[j] = ds_lean(a, kdsp, kdso, kds, p, (double)dp[j], di);
        s[j] = flt_round(kbp, p);
    }
}

template <int KINDS> void rows_launch(const bwd_args &a, int kinds, int64_t gn) {
    const auto groups = [&](int rows) { return dim3((unsigned)((a.rn + GW * rows - 1) / (GW * rows)), (unsigned)gn); };
    rows_soft_kernel<KINDS><<<groups(GR_SOFT), GW * 32>>>(a, kinds);
    rows_delta_kernel<KINDS><<<groups(GR_DELTA), GW * 32>>>(a, kinds);
    rows_ds_kernel<KINDS><<<dim3((unsigned)a.rn, (unsigned)gn), RT>>>(a, kinds);
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
    if (kinds == naive_rows_kinds(FLT_BF16)) rows_launch<naive_rows_kinds(FLT_BF16)>(a, kinds, gn);
    else if (kinds == naive_rows_kinds(FLT_F16)) rows_launch<naive_rows_kinds(FLT_F16)>(a, kinds, gn);
    else rows_launch<0>(a, kinds, gn);
    CUDA_TRY(cudaGetLastError());
    return FADEV_OK;
}
