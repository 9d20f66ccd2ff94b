/* The emulated flash forward's fast path for K/V blocks of at most 64 keys (fa2's and the paper's tiles): the same
 * steps and bits as emu_forward_fast.cu's kernel (every per-element and per-row step is emu_forward_fast.cuh's),
 * scheduled so that a warp owns its query rows outright.
 *
 * Why another schedule: emu_forward_fast.cu's CTA shares its 64 rows among all its threads, so every phase of a block
 * (scores, maxima, softmax terms, the row sums' chains, statistics, P.V, the O update) ends at a CTA barrier, and the
 * row sums and statistics run on 64 of the CTA's 256 threads while the rest wait (ncu: 25% occupancy, 0.6 eligible
 * warps per scheduler, 8.5 cycles per issued instruction). Here the K and V of a block are staged once per block
 * (two CTA barriers) and everything else is the warp's own:
 *   scores: lane L keys L and L + 32 of the warp's R rows (R = 16 at D <= 64, 8 at D <= 128), the fp32 FMA chains
 *     over t ascending, Q^T and K^T from shared memory (R/4 broadcast float4 loads and 2 loads per R x 2 FMAs);
 *   the chains' values go to the warp's E[key][row]; then lane L works on row L % R, keys L / R + (32 / R) k: the
 *     scores' roundings and the row's maximum (the lanes of a row combined by shuffles), then the softmax terms
 *     (a key the row does not see: 0), each a rolled loop (the fp64 exp inlined once, not 2 R times);
 *   lane r < R runs row r's sum chain over the visible keys ascending and rewrites each e as P = R_p(e) behind it,
 *     then the row's statistics (row_stats); the row's m, l live in that lane's registers;
 *   P.V: lane L columns L + 32c of the R rows, P broadcast from E, V from shared memory, keys ascending up to the
 *     warp's last visible key; a key a row does not see has P = +0, whose product with a finite V value adds +-0 to
 *     a chain that is never -0 (it starts at +0, and an exact cancellation in nearest-even gives +0), so the chain
 *     is the one that skips the key; zero-padded t (D not a multiple of 4) likewise adds fmaf(0, 0, acc) = acc;
 *   the O update in registers (o_step), the output and lse at the end.
 * The fast path needs finite inputs (emu_head_finite), which the +0 products rely on. */
#include <stdlib.h>
#include <string.h>

#include "emu_forward_fast.cuh"

using namespace emu_fwd;

namespace {

constexpr int W = 8;        /* warps per CTA */
constexpr int NT = 32 * W;  /* threads per CTA */
constexpr int KB = 64;      /* keys per block, at most */
constexpr int KP = KB + 1;  /* pitch of K^T [t][key] (conflict-free transposing stores) */
constexpr unsigned FULL = 0xFFFFFFFFu;

/* The tile of a kernel whose lanes hold DC columns of O each (D <= 32 DC). */
template <int DC> struct tile {
    static constexpr int DP = 32 * DC;         /* the head dimension, padded with zeros */
    static constexpr int R = DC == 2 ? 16 : 8; /* query rows per warp: o, pv take 2 R DC registers */
    static constexpr int BQ = W * R;           /* query rows per CTA */
    static constexpr int EP = R + 4;           /* pitch of a warp's E[key][row]: conflict-free float4 stores */
    static constexpr bool SPLIT = DC == 2;     /* K and V in buffers of their own; at D 128 V overwrites K (then
                                                * the CTA's shared memory allows 2 CTAs per SM) */
    static constexpr size_t floats = (size_t)DP * BQ + (size_t)DP * KP + (SPLIT ? (size_t)KB * DP : 0) + (size_t)W * KB * EP;
    static constexpr size_t bytes = floats * sizeof(float) + 2 * (size_t)W * R * sizeof(double);
};

/* Rows r of the warp see keys [0, nv(r)) of the block: n keys when not causal, else the causal prefix from `base`
 * (base + r keys, clamped); rows past the last query row (r >= hw) see none. */
struct vis {
    int causal, n, hw;
    int64_t base;
    __device__ __forceinline__ int of(int r) const {
        if (r >= hw) return 0;
        if (!causal) return n;
        const int64_t c = base + r;
        return c < 0 ? 0 : c > n ? n : (int)c;
    }
};

/* with_kind(k, f) in the lean kernels; f(-1) (the kinds read at run time) in the others. */
template <bool LEAN, class F> __device__ __forceinline__ void lean_kind(int k, F &&f) {
    if constexpr (LEAN) with_kind(k, f);
    else f(std::integral_constant<int, -1>{});
}

/* Rows [0, have) of src (row pitch D: keys, or query rows) into dst[row * pitch_r + t * pitch_t], zeros for t >= D
 * and rows >= have, for t < DP and rows < ROWS; consecutive threads read consecutive t (coalesced), and every load of
 * a thread is in flight at once. Ends without a barrier. */
template <int DP, int ROWS>
__device__ __forceinline__ void stage(float *dst, int pitch_t, int pitch_r, const float *src, int D, int have) {
    static_assert(DP * ROWS % (4 * NT) == 0, "whole passes");
    if (D == DP) { /* rows of DP floats, contiguous: float4 loads (16-byte aligned: the buffers' rows are 256 or 512 B) */
        const float4 *s4 = (const float4 *)src;
#pragma unroll
        for (int it = 0; it < DP * ROWS / (4 * NT); it++) {
            const int e = it * NT + threadIdx.x, t = e % (DP / 4) * 4, row = e / (DP / 4);
            const float4 x = row < have ? s4[e] : make_float4(0.f, 0.f, 0.f, 0.f);
            float *d = dst + row * pitch_r + t * pitch_t;
            if (pitch_t == 1) {
                *(float4 *)d = x;
            } else {
                d[0] = x.x, d[pitch_t] = x.y, d[2 * pitch_t] = x.z, d[3 * pitch_t] = x.w;
            }
        }
        return;
    }
#pragma unroll 16
    for (int it = 0; it < DP * ROWS / NT; it++) {
        const int e = it * NT + threadIdx.x, t = e % DP, row = e / DP;
        dst[row * pitch_r + t * pitch_t] = t < D && row < have ? src[row * D + t] : 0.f;
    }
}

template <int DC, bool LEAN>
__global__ void __launch_bounds__(NT, 2) warp_kernel(const __grid_constant__ fast_args a) {
    using T = tile<DC>;
    constexpr int R = T::R, BQ = T::BQ, DP = T::DP, EP = T::EP, SPREAD = 32 / R;
    extern __shared__ __align__(16) char smem[];
    float *sq = (float *)smem, *sk = sq + DP * BQ, *sv = T::SPLIT ? sk + DP * KP : sk;
    float *se = sk + DP * KP + (T::SPLIT ? KB * DP : 0);
    double *sfac = (double *)(se + W * KB * EP), *slnew = sfac + W * R;
    const emu_ctx &cx = a.cx;
    const int tid = threadIdx.x, w = tid >> 5, lane = tid & 31;
    const int64_t Nq = cx.pr.seq_q, Nk = cx.pr.seq_kv;
    const int D = (int)cx.pr.dim, causal = cx.pr.causal;
    const int64_t bh = blockIdx.x / a.tiles;
    int64_t tq = blockIdx.x % a.tiles;
    if (causal) tq = a.tiles - 1 - tq; /* the longest rows first: the last wave is the short ones */
    const int64_t i0 = tq * BQ, bhk = emu_kv_head(cx, bh);
    if (!emu_head_finite(cx, bh, bhk)) return; /* the generic launch computes this head */
    const int here = (int)(Nq - i0 < BQ ? Nq - i0 : BQ);
    const int hw = here - w * R < 0 ? 0 : here - w * R < R ? here - w * R : R; /* the warp's rows */
    const int64_t iw = i0 + w * R;
    stage<DP, BQ>(sq, BQ, 1, cx.qf + (bh * Nq + i0) * D, D, here); /* Q^T [t][row] */
    float *ew = se + w * KB * EP;
    double m = -INFINITY, l = 0; /* row `lane`'s state (lanes < R) */
    int seen = 0;
    float o[R][DC];
#pragma unroll
    for (int r = 0; r < R; r++)
#pragma unroll
        for (int c = 0; c < DC; c++) o[r][c] = 0.f;
    const int64_t bkv = a.block_kv;
    for (int64_t jb = 0, jb0 = 0; jb0 < Nk; jb++, jb0 += bkv) {
        const int n = (int)(bkv < Nk - jb0 ? bkv : Nk - jb0);
        const int ncta = (int)emu_visible(cx.pr, i0 + here - 1, jb0, n); /* keys any row of the CTA sees */
        if (ncta == 0) {
            if (causal) break; /* later blocks are masked too, for every row */
            continue;
        }
        const float *kh = cx.kf + (bhk * Nk + jb0) * D, *vh = cx.vf + (bhk * Nk + jb0) * D;
        __syncthreads(); /* the previous block's readers of K, V and E are done */
        stage<DP, KB>(sk, KP, 1, kh, D, ncta); /* K^T [t][key] */
        if (T::SPLIT) stage<DP, KB>(sv, 1, DP, vh, D, ncta);
        __syncthreads();
        const vis nv{causal, n, hw, iw + Nk - Nq - jb0 + 1};
        const int kw = hw ? nv.of(hw - 1) : 0; /* keys the warp's rows see (the last row sees the most) */
        const int nown = lane < R ? nv.of(lane) : 0;
        double mnew = m, lnew = 0, factor = 0;
        if (kw) {
            /* scores */
            float acc[R][2];
#pragma unroll
            for (int r = 0; r < R; r++) acc[r][0] = acc[r][1] = 0.f;
            const float *qs = sq + w * R, *ks = sk + lane;
            const int D4 = (D + 3) & ~3;
            for (int t0 = 0; t0 < D4; t0 += 4) {
#pragma unroll
                for (int t = t0; t < t0 + 4; t++) {
                    float qv[R];
#pragma unroll
                    for (int r4 = 0; r4 < R / 4; r4++) {
                        const float4 x = *(const float4 *)(qs + t * BQ + 4 * r4);
                        qv[4 * r4] = x.x, qv[4 * r4 + 1] = x.y, qv[4 * r4 + 2] = x.z, qv[4 * r4 + 3] = x.w;
                    }
                    const float k0 = ks[t * KP], k1 = ks[t * KP + 32];
#pragma unroll
                    for (int r = 0; r < R; r++) {
                        acc[r][0] = fmaf(qv[r], k0, acc[r][0]);
                        acc[r][1] = fmaf(qv[r], k1, acc[r][1]);
                    }
                }
            }
            /* the chains' values into E; from here on lane L works on row r = L % R, keys L / R + SPREAD k (rolled
             * loops: the per-element steps inline once, not 2 R times) */
#pragma unroll
            for (int c = 0; c < 2; c++)
#pragma unroll
                for (int r4 = 0; r4 < R / 4; r4++)
                    *(float4 *)(ew + (lane + 32 * c) * EP + 4 * r4) =
                        make_float4(acc[4 * r4][c], acc[4 * r4 + 1][c], acc[4 * r4 + 2][c], acc[4 * r4 + 3][c]);
            __syncwarp();
            const int r = lane % R, nr = nv.of(r);
            const int64_t i = iw + r;
            float *er = ew + r;
            /* s of the visible keys and their maximum. The spec's running maximum att_max(m, s): any order gives its
             * value and a NaN makes it NaN; only a zero's sign may differ, which no later value depends on
             * (exp(+-0) = 1; lse = m + log l is 0 + log l). */
            float mx = -INFINITY;
            int nan = 0;
            lean_kind<LEAN>(flt_kind_at(a.lean, LK_SCORE), [&](auto KS) {
#pragma unroll 2
                for (int key = lane / R; key < nr; key += SPREAD) {
                    const float s = score_of<LEAN, decltype(KS)::value>(a, er[key * EP], bh, i, jb0 + key);
                    er[key * EP] = s;
                    nan |= s != s, mx = fmaxf(mx, s);
                }
            });
#pragma unroll
            for (int off = R; off < 32; off <<= 1) {
                mx = fmaxf(mx, __shfl_xor_sync(FULL, mx, off));
                nan |= __shfl_xor_sync(FULL, nan, off);
            }
            if (nown) mnew = att_max(m, nan ? (double)NAN : (double)mx); /* lane r < R: row r */
            /* the softmax terms (0 where the row does not see the key, up to the warp's last visible key) */
            const float mf = __shfl_sync(FULL, (float)mnew, r);
            lean_kind<LEAN>(flt_kind_at(a.lean, LK_SOFTMAX), [&](auto KS) {
                with_exp(cx.exp2, [&](auto E2) {
                    double kk[16]; /* the exp's constants in registers for the loop */
#pragma unroll
                    for (int c = 0; c < 16; c++) kk[c] = emu_exp_kg[c];
#pragma unroll 2
                    for (int key = lane / R; key < kw; key += SPREAD) { /* past nr: computed, not kept */
                        const float e = term_of<LEAN, decltype(KS)::value, decltype(E2)::value>(
                            a, er[key * EP], (double)mf, mf, bh, i, jb0 + key, kk);
                        er[key * EP] = key < nr ? e : 0.f;
                    }
                });
            });
            __syncwarp();
            /* row `lane`'s sum chain over its visible keys ascending, P = R_p(e) written behind it, its statistics */
            if (nown) { /* lane < R: r == lane */
                double rsum;
                with_kind(a.p_kind, [&](auto PK) {
                    constexpr int K = decltype(PK)::value;
                    if (cx.sum_acc.kind == ATT_F32) { /* fp32 + fp32 rounded once in fp32: the spec's bits */
                        float rs = 0.f;
#pragma unroll 4
                        for (int key = 0; key < nown; key++) {
                            const float e = er[key * EP];
                            rs = __fadd_rn(rs, e);
                            er[key * EP] = p_of<LEAN, K>(a, e, bh, i, jb0 + key);
                        }
                        rsum = rs;
                    } else {
                        double rs = 0;
                        for (int key = 0; key < nown; key++) {
                            const float e = er[key * EP];
                            rs = sum_step(a, rs, e, bh, i, jb0 + key);
                            er[key * EP] = p_of<LEAN, K>(a, e, bh, i, jb0 + key);
                        }
                        rsum = rs;
                    }
                });
                row_stats(a, bh, i, jb, m, mnew, l, rsum, lnew, factor);
                sfac[w * R + lane] = factor, slnew[w * R + lane] = lnew;
            }
            __syncwarp();
        }
        if (!T::SPLIT) { /* V where K was */
            __syncthreads();
            stage<DP, KB>(sv, 1, DP, vh, D, ncta);
            __syncthreads();
        }
        if (!kw) continue;
        /* P.V of the block */
        float pv[R][DC];
#pragma unroll
        for (int r = 0; r < R; r++)
#pragma unroll
            for (int c = 0; c < DC; c++) pv[r][c] = 0.f;
        const float *vs = sv + lane;
#pragma unroll 2
        for (int key = 0; key < kw; key++) {
            float p[R], vv[DC];
#pragma unroll
            for (int r4 = 0; r4 < R / 4; r4++) {
                const float4 x = *(const float4 *)(ew + key * EP + 4 * r4);
                p[4 * r4] = x.x, p[4 * r4 + 1] = x.y, p[4 * r4 + 2] = x.z, p[4 * r4 + 3] = x.w;
            }
#pragma unroll
            for (int c = 0; c < DC; c++) vv[c] = vs[key * DP + 32 * c];
#pragma unroll
            for (int r = 0; r < R; r++)
#pragma unroll
                for (int c = 0; c < DC; c++) pv[r][c] = fmaf(p[r], vv[c], pv[r][c]);
        }
        /* 7 (and 9): O from pv (row_update), for the rows that see a key of the block */
#pragma unroll
        for (int r = 0; r < R; r++) {
            if (!nv.of(r)) continue;
            const double f = sfac[w * R + r], ln = slnew[w * R + r];
#pragma unroll
            for (int c = 0; c < DC; c++) {
                const int d = lane + 32 * c;
                if (d < D) o[r][c] = o_step<LEAN>(a, o[r][c], pv[r][c], f, ln, bh, iw + r, jb, d);
            }
        }
        if (nown) m = mnew, l = l_kept(a, lnew, bh, iw + lane, jb), seen = 1;
    }
    /* out and lse (write_row): rows that saw no key get 0 and -inf */
#pragma unroll
    for (int r = 0; r < R; r++) {
        const double lr = __shfl_sync(FULL, l, r);
        const int sr = __shfl_sync(FULL, seen, r);
        if (r >= hw) continue;
        double *out = a.out + (bh * Nq + iw + r) * D;
#pragma unroll
        for (int c = 0; c < DC; c++) {
            const int d = lane + 32 * c;
            if (d < D) out[d] = out_of(a, o[r][c], sr, lr, bh, iw + r, d);
        }
    }
    if (a.lse && lane < hw) a.lse[bh * Nq + iw + lane] = lse_of(a, seen, m, l, bh, iw + lane);
}

template <int DC, bool LEAN>
fadev_status launch(const fast_args &a, int64_t ctas) {
    const size_t smem = tile<DC>::bytes;
    CUDA_TRY(cudaFuncSetAttribute(warp_kernel<DC, LEAN>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
    warp_kernel<DC, LEAN><<<(unsigned)ctas, NT, smem>>>(a);
    CUDA_TRY(cudaGetLastError());
    return FADEV_OK;
}

} // namespace

int emu_fwd::warp_forward_ok(const emu_ctx &cx, int baseline) {
    const char *off = getenv("FADEV_EMU_WARP"); /* tests and benchmarks: 0 runs emu_forward_fast.cu's kernel */
    if (off && strcmp(off, "0") == 0) return 0;
    const int64_t bkv = cx.pr.block_kv < cx.pr.seq_kv ? cx.pr.block_kv : cx.pr.seq_kv;
    return !baseline && bkv <= KB && cx.pr.dim <= 128;
}

fadev_status emu_fwd::warp_forward(const emu_ctx &cx, double *out, double *lse) {
    const int d64 = cx.pr.dim <= 64;
    const fast_args a = fast_args_of(cx, out, lse, 0, d64 ? tile<2>::BQ : tile<4>::BQ);
    const int64_t ctas = cx.pr.batch * cx.pr.heads * a.tiles;
    if (ctas >= (int64_t)1 << 31) return fadev_cuda_fail_msg(FADEV_ERR_INVALID_ARGUMENT, "emulated attention: grid too large");
    if (d64) return a.lean ? launch<2, true>(a, ctas) : launch<2, false>(a, ctas);
    return a.lean ? launch<4, true>(a, ctas) : launch<4, false>(a, ctas);
}
