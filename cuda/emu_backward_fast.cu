/* The emulated backward's fast sums: dQ = dS K, dK = dS^T Q, dV = P'^T dO as register-blocked fp32 FMA chains,
 * bit-identical to emu_backward.cu's dq_kernel and dkv_kernel (and so to csrc/backward.c). Taken when
 * emu_bwd_fast_ok() holds: grad_acc is fp32 under nearest-even, P' (bwd_p) and dS (ds) have at most
 * 24 - p(input) significant bits and lie inside fp32 (so every product is exact, in fp32 and in fp64), and the
 * running sums dq_acc, dkv_acc lie inside fp32.
 * Why one fmaf per term gives the spec's R32(R64(acc + x * y)): emu_forward_fast.cu's argument (and
 * docs/numerics.md, "The fp32 FMA path"); infinities and NaN follow IEEE arithmetic in both, and overflow is the
 * exact sum's rounding in both. The block sums are added into the running sums exactly as the generic kernels
 * do: R_dq_acc(acc + part) (one fp32 addition when that stage is fp32: double rounding is innocuous), and the
 * chains keep the spec's order (keys ascending for dQ; the K/V head's virtual rows ascending for dK, dV).
 *
 * A CTA computes a tile of outputs (dQ: virtual rows x columns; dK, dV: keys x columns) with 256 threads, each
 * R x C (rows or keys R g..R g + R - 1, columns tx + 16c): R = 4 (64 x 64 tiles), or R = 8 (128 x 64: twice the FMAs
 * a shared load) where the grid still fills the GPU (cut_of; dQ only at D <= 64); C = 4, or for dK, dV at R = 4 2
 * (64 x 32 tiles, twice the CTAs) where their grid is short of a wave; causal, a CTA takes two tiles, the p-th with
 * the most rows (keys) to see and the p-th with the fewest (cut_of), over the reduction in slices of 32 that stream
 * through two shared-memory stages: the scratch operand as [k][m] (float4 reads of four m) and the other operand as
 * [k][n]. A term enters only where the row sees the key; block sums are flushed where the generic kernels flush
 * them.
 * The fast pair kernel (s and dP as fp32 FMA chains, then the element-wise steps) is in emu_backward_pairs.cu, the
 * baseline's fast rows kernels in emu_backward_rows.cu. */
#include <limits.h>
#include <stdlib.h>
#include <string.h>

#include <type_traits>

#include "emu_backward.cuh"

namespace {

using namespace emu_bwd_tiles;

/* R(acc + part) of two fp32 values for a running-sum stage (dq_acc, dkv_acc) of flt_kind fk: one fp32 addition, a
 * conversion (dbl_round: paper's bf16 and fp16 sums), or the event. */
__device__ __forceinline__ float add_round(const att_stage &st, int fk, float acc, float part, uint64_t stream,
                                           uint64_t idx) {
    if (st.kind == ATT_F32) return __fadd_rn(acc, part);
    if (fk != FLT_EVENT) return dbl_round(fk, (double)acc + (double)part);
    return (float)emu_rnd<true>(st, (double)acc + (double)part, stream, idx);
}

/* One rank-1 step of a thread's R x C tile: part[r][c] += a[kk][R g + r] b[kk][tx + 16c] (one fmaf each) for the rows
 * r whose bit is set in `rows` (all R set: a constant there compiles to the plain FMA block); a [k][m] of pitch P,
 * b [k][n] of pitch 16 C. */
template <int R = 4, int P = AP, int C = 4>
__device__ __forceinline__ void rank1(const float *as, const float *bs, int kk, int g, int tx, unsigned rows,
                                      float part[R][C]) {
    float av[R];
#pragma unroll
    for (int h = 0; h < R / 4; h++) {
        const float4 a4 = *(const float4 *)(as + kk * P + g * R + 4 * h);
        av[4 * h] = a4.x, av[4 * h + 1] = a4.y, av[4 * h + 2] = a4.z, av[4 * h + 3] = a4.w;
    }
    float bv[C];
#pragma unroll
    for (int c = 0; c < C; c++) bv[c] = bs[kk * 16 * C + tx + 16 * c];
#pragma unroll
    for (int r = 0; r < R; r++)
        if (rows >> r & 1u)
#pragma unroll
            for (int c = 0; c < C; c++) part[r][c] = fmaf(av[r], bv[c], part[r][c]);
}

/* The tile of pass `pass` (0, 1) of this CTA: blockIdx.x in pass 0 when `paired` is 0; else (causal: a tile's work
 * falls with its index) tiles p = blockIdx.x and paired - 1 - p of `paired`, so that every CTA has about the same
 * work (the forward's pairing). False: no tile in this pass. */
__device__ __forceinline__ bool pair_tile(int paired, int pass, int64_t &tile) {
    const int64_t p = blockIdx.x;
    tile = pass ? paired - 1 - p : p;
    return !pass || (paired && tile != p);
}

/* The dynamic shared memory of dq_fast_kernel and dkv_fast_kernel at R: two stages of a slice's operands (the
 * scratch's [k][m] of pitch 16 R + 4, the other's [k][n]). Above 48 KB at R = 8: the launches opt in. */
template <int R, int C = 4> constexpr size_t sums_smem_bytes() {
    return 2 * (size_t)TK * (16 * R + 4 + 16 * C) * sizeof(float);
}

/* Slice operand copies into shared memory: cp.async from the fp32 scratch (zeros where `ok` is false, nothing read
 * there), loads and a conversion from the fp64 one (the generic pair kernels'). */
template <typename T> __device__ __forceinline__ void stage_one(float *dst, const T *src, const T *base, bool ok) {
    if constexpr (std::is_same<T, float>::value) cp_async_4(dst, ok ? src : base, ok);
    else *dst = ok ? (float)*src : 0.f;
}

/* One CTA of dq: virtual rows rl0.. of the chunk's K/V head g0 + blockIdx.z, columns d0...; the scratch holds
 * T (fp64 from the generic pair kernels, fp32 from the fast one: the same values). The key slices stream through two
 * stages (sums_smem_bytes): slice s + 1's copies are in flight while slice s's terms are summed. */
/* R rows a thread (4 or 8: a CTA's tile 16 R rows x 64 columns; at 8, 128 registers for 2 CTAs an SM) */
template <typename T, int R, bool PAIRED>
__global__ void __launch_bounds__(NT, R == 8 ? 2 : 1) dq_fast_kernel(const __grid_constant__ bwd_args a, const T *sb,
                                                                     int paired) {
    constexpr int TMQ = 16 * R, APQ = TMQ + 4; /* the CTA's rows; the staged pitch */
    constexpr int STAGE = TK * (APQ + TN);   /* floats a stage: as [k][m] of pitch APQ, then bs [k][n] */
    extern __shared__ __align__(16) float dq_stages[];
    __shared__ int nv_s[TMQ];
    __shared__ long long row_bh[TMQ], row_i[TMQ]; /* each row's (bh, i): read at the flushes and the end */
    __shared__ int range[2];
    const emu_ctx &cx = a.cx;
    const int64_t D = cx.pr.dim, Nq = cx.pr.seq_q, Nk = cx.pr.seq_kv;
    const int bk = (int)a.block_kv; /* <= Nk < 2^21 (the counters' range) */
    const int tid = threadIdx.x, g = tid >> 4, tx = tid & 15;
#pragma unroll 1
    for (int pass = 0; pass < (PAIRED ? 2 : 1); pass++) { /* PAIRED: row tiles p and tiles - 1 - p (pair_tile) */
        int64_t tile;
        if (!pair_tile(PAIRED ? paired : 0, pass, tile)) break;
        if (pass) __syncthreads(); /* the first tile's readers of nv_s, row_bh, row_i are done */
        const int64_t gl = blockIdx.z, bg = a.g0 + gl, rl0 = tile * TMQ, d0 = (int64_t)blockIdx.y * TN;
        if (tid == 0) range[0] = INT_MAX, range[1] = 0;
        __syncthreads();
        if (tid < TMQ) {
            int nv = 0;
            const vrow w = vrow_of(a, bg, a.r0 + (rl0 + tid < a.rn ? rl0 + tid : 0));
            row_bh[tid] = w.bh, row_i[tid] = w.i;
            if (rl0 + tid < a.rn) {
                const int64_t last = last_key(cx.pr, w.i);
                nv = last < 0 ? 0 : (int)(last + 1 < Nk ? last + 1 : Nk);
                if (nv > 0) atomicMin(&range[0], nv);
            }
            nv_s[tid] = nv;
            atomicMax(&range[1], nv);
        }
        __syncthreads();
        const int nvmin = range[0], nvmax = range[1];
        int nv[R];
    #pragma unroll
        for (int r = 0; r < R; r++) nv[r] = nv_s[g * R + r];
        float part[R][4], acc[R][4];
    #pragma unroll
        for (int r = 0; r < R; r++)
    #pragma unroll
            for (int c = 0; c < 4; c++) part[r][c] = 0.f, acc[r][c] = 0.f;
        const T *ds = sb + (gl * a.chunk_rows + rl0) * Nk;
        const float *kf = cx.kf + bg * Nk * D + d0;
        int next_end = bk; /* one past the current key block's last key */
        /* slice k0's operands into stage b: a thread stages one key kk of rows tid / TK + 8k and one column n of
         * keys tid / TN + 4k, walking pointers (no int64 multiply per element) */
        auto stage = [&](int k0, int b) {
            float *as = dq_stages + b * STAGE, *bs = as + TK * APQ;
            const int kn = nvmax - k0 < TK ? nvmax - k0 : TK;
            const int kk = tid % TK, n = tid % TN;
            const T *p = ds + (int64_t)(tid / TK) * Nk + k0 + kk;
    #pragma unroll 4
            for (int m = tid / TK; m < TMQ; m += NT / TK, p += (NT / TK) * Nk)
                /* keys a row does not see hold no value in the scratch: not read */
                stage_one(as + kk * APQ + m, p, sb, kk < kn && rl0 + m < a.rn && k0 + kk < nv_s[m]);
            const float *q = kf + (k0 + tid / TN) * D + n;
            const int nok = d0 + n < D;
    #pragma unroll 4
            for (int kb = tid / TN; kb < TK; kb += NT / TN, q += (NT / TN) * D)
                stage_one(bs + kb * TN + n, q, cx.kf, kb < kn && nok);
        };
        if (nvmax > 0) stage(0, 0);
        cp_async_commit();
        for (int k0 = 0; k0 < nvmax; k0 += TK) {
            const int kn = nvmax - k0 < TK ? nvmax - k0 : TK, b = (k0 / TK) & 1;
            cp_async_wait_all();
            __syncthreads(); /* slice k0 staged; every reader of stage b ^ 1 (the slice before) done */
            if (k0 + TK < nvmax) stage(k0 + TK, b ^ 1);
            cp_async_commit();
            const float *as = dq_stages + b * STAGE, *bs = as + TK * APQ;
            /* Pure segments: keys before the next block end and below nvmin (every row with a key sees them, so no
             * test is needed: rows without keys only gather zeros they never write); a key at a block end or from
             * nvmin - 1 on is a careful step (visibility per row, flushes). */
            for (int kk = 0; kk < kn;) {
                int stop = kn;
                if (next_end - 1 - k0 < stop) stop = next_end - 1 - k0;
                if (nvmin - 1 - k0 < stop) stop = nvmin - 1 - k0;
    #pragma unroll 4
                for (; kk < stop; kk++) rank1<R, APQ>(as, bs, kk, g, tx, (1u << R) - 1, part);
                if (kk >= kn) break;
                const int k = k0 + kk;
                unsigned rows = 0;
    #pragma unroll
                for (int r = 0; r < R; r++) rows |= (unsigned)(k < nv[r]) << r;
                rank1<R, APQ>(as, bs, kk, g, tx, rows, part);
                const int blk_end = k + 1 == next_end;
    #pragma unroll
                for (int r = 0; r < R; r++) {
                    if (!(k < nv[r] && (blk_end || k + 1 == nv[r]))) continue;
                    const uint64_t s17 = bwd_stream(EV_DQ_ACC, row_bh[g * R + r]);
    #pragma unroll
                    for (int c = 0; c < 4; c++) {
                        acc[r][c] = add_round(a.dq_acc, a.dq_acc_kind, acc[r][c], part[r][c], s17,
                                              ATT_INDEX(row_i[g * R + r], k / bk, d0 + tx + 16 * c));
                        part[r][c] = 0.f;
                    }
                }
                if (blk_end) next_end += bk;
                kk++;
            }
        }
    #pragma unroll
        for (int r = 0; r < R; r++) {
            if (rl0 + g * R + r >= a.rn) continue;
            const int64_t bh = row_bh[g * R + r], i = row_i[g * R + r];
    #pragma unroll
            for (int c = 0; c < 4; c++) {
                const int64_t d = d0 + tx + 16 * c;
                if (d >= D) continue;
                a.dq[(bh * Nq + i) * D + d] = nv[r] == 0 ? 0.0 /* no visible key: exactly 0, no events */
                    : emu_rnd<true>(a.grad, a.c_grad * (double)acc[r][c], bwd_stream(EV_GRAD_DQ, bh),
                                    ATT_INDEX(i, d, 0));
            }
        }
    }
}

/* One CTA of dK (IS_K) or dV: keys j0.. of K/V head g0 + gl, columns d0..; the chains go on through the
 * chunk's virtual rows from the state in memory and leave it there, or write the result after the last chunk.
 * A slice of rows none of which sees a key of the tile (causal: every row before the tile's first key's first
 * row) adds no term and flushes no sum: it is skipped whole (half the causal work; the same events).
 * The row slices stream through two stages (sums_smem_bytes): slice s + 1's copies are in flight while slice s's
 * terms are summed. Staged once per slice and summed after, as before, the global loads' latency was the kernel's
 * largest stall (ncu on an H200, fa2 bf16 D 64 causal: long scoreboard 44% of the samples, barriers 10-14%, issue
 * slots 18-31% busy). */
/* R keys a thread (4 or 8: a CTA's tile 16 R keys x 16 C columns; at 8, 128 registers for 2 CTAs an SM), C columns
 * (4, or 2 where the grid is short of a wave: twice the CTAs).
 * dV (blockIdx.z < gn: P' in sa) and dK (the rest: dS in sb) in one launch: they share no data, and the grid of
 * one alone is short of a wave where there are few K/V heads (4 of 16 under a causal mask: half a wave paired); as
 * two launches, the second waited for the first's last CTA. Which one is a value, not a template argument: the two
 * bodies in one kernel took 159 registers where one takes 105. */
template <typename T, int R, bool PAIRED, int C>
__global__ void __launch_bounds__(NT, R == 8 ? 2 : 1)
dkv_fast_kernel(const __grid_constant__ bwd_args a, const T *sa, const T *sb, int last_chunk, int paired, int gn) {
    const bool IS_K = (int)blockIdx.z >= gn;
    const T *xs = IS_K ? sb : sa;
    const int64_t gl = IS_K ? blockIdx.z - gn : blockIdx.z;
    constexpr int TMK = 16 * R, APK = TMK + 4; /* the CTA's keys; the staged pitch */
    constexpr int TNC = 16 * C;             /* the CTA's columns */
    constexpr int STAGE = TK * (APK + TNC);  /* floats a stage: as [k][m] of pitch APK, then bs [k][n] */
    extern __shared__ __align__(16) float dkv_stages[];
    __shared__ long long row_i[2][TK], row_bh[2][TK], row_off[2][TK]; /* per stage; row_off: (bh * Nq + i) * D */
    __shared__ unsigned slice_mask[2][3]; /* per stage: bit kk: the row ends its query block (its sum joins the
                                           * running sum); bit kk: the row sees every key of the tile; and a row sees
                                           * some key */
    const emu_ctx &cx = a.cx;
    const int64_t D = cx.pr.dim, Nq = cx.pr.seq_q, Nk = cx.pr.seq_kv, bq = a.block_q;
    const int tid = threadIdx.x, g = tid >> 4, tx = tid & 15;
#pragma unroll 1
    for (int pass = 0; pass < (PAIRED ? 2 : 1); pass++) { /* PAIRED: key tiles p and tiles - 1 - p (pair_tile) */
        int64_t tile;
        if (!pair_tile(PAIRED ? paired : 0, pass, tile)) break;
        const int64_t bg = a.g0 + gl, j0 = tile * TMK, d0 = (int64_t)blockIdx.y * TNC;
        const float *ys = IS_K ? cx.qf : a.doutf;
        double *part_mem = IS_K ? a.dk_part : a.dv_part, *acc_mem = IS_K ? a.dk : a.dv;
        /* the rows that see key j = j0 + g R + r: i >= first_j = max(0, j - (Nk - Nq)) (causal), every row (not), that
         * is i - fbase >= r (i >= 0), with one fbase for the thread's R keys */
        const int64_t fbase = cx.pr.causal ? j0 + g * R - (Nk - Nq) : INT64_MIN / 2;
        float part[R][C], acc[R][C];
        int64_t first_max = 0;
        for (int r = 0; r < R; r++) {
            const int64_t j = j0 + g * R + r;
            for (int c = 0; c < C; c++) {
                const int64_t d = d0 + tx + 16 * c, at = (bg * Nk + j) * D + d;
                const int ok = j < Nk && d < D;
                part[r][c] = ok ? (float)part_mem[at] : 0.f;
                acc[r][c] = ok ? (float)acc_mem[at] : 0.f;
            }
        }
        const int64_t first_min = cx.pr.causal && j0 > Nk - Nq ? j0 - (Nk - Nq) : 0; /* the tile's first key's */
        {
            const int64_t jl = (j0 + TMK - 1 < Nk ? j0 + TMK - 1 : Nk - 1);
            first_max = cx.pr.causal && jl > Nk - Nq ? jl - (Nk - Nq) : 0;
        }
        const int64_t slices = (a.rn + TK - 1) / TK;
        /* slice s's rows (warp 0) into stage b's row_* and slice_mask */
        auto meta = [&](int64_t s, int b) {
            if (tid >= TK) return;
            const int64_t k0 = s * TK;
            const int kn = (int)(a.rn - k0 < TK ? a.rn - k0 : TK);
            const vrow w = vrow_of(a, bg, a.r0 + k0 + (tid < kn ? tid : 0));
            row_i[b][tid] = w.i, row_bh[b][tid] = w.bh, row_off[b][tid] = (w.bh * Nq + w.i) * D;
            const unsigned ends = __ballot_sync(0xFFFFFFFFu, tid < kn && ((w.i + 1) % bq == 0 || w.i + 1 == Nq));
            const unsigned seen = __ballot_sync(0xFFFFFFFFu, tid >= kn || w.i >= first_max);
            const unsigned some = __ballot_sync(0xFFFFFFFFu, tid < kn && w.i >= first_min);
            if (tid == 0) slice_mask[b][0] = ends, slice_mask[b][1] = seen, slice_mask[b][2] = some;
        };
        /* slice s's operands into stage b (none where no row of it sees a key of the tile): NT is a multiple of TMK
         * and TNC: a thread stages one key m (one column n) of rows tid / TMK + k NT / TMK; the scratch column is
         * walked by a pointer, the rows of Q / dO start at row_off (stage_one) */
        auto stage = [&](int64_t s, int b) {
            if (!slice_mask[b][2]) return;
            float *as = dkv_stages + b * STAGE, *bs = as + TK * APK;
            const int64_t k0 = s * TK;
            const int kn = (int)(a.rn - k0 < TK ? a.rn - k0 : TK);
            const int m = tid % TMK, n = tid % TNC;
            const int64_t j = j0 + m, fj = cx.pr.causal && j > Nk - Nq ? j - (Nk - Nq) : 0;
            const int jok = j < Nk, nok = d0 + n < D;
            const T *col = xs + (gl * a.chunk_rows + k0 + tid / TMK) * Nk + j;
    #pragma unroll 4
            for (int kk = tid / TMK; kk < TK; kk += NT / TMK, col += (NT / TMK) * Nk)
                stage_one(as + kk * APK + m, col, xs, jok && kk < kn && row_i[b][kk] >= fj);
    #pragma unroll 4
            for (int kk = tid / TNC; kk < TK; kk += NT / TNC)
                stage_one(bs + kk * TNC + n, ys + row_off[b][kk] + d0 + n, ys, kk < kn && nok);
        };
        __syncthreads(); /* PAIRED: the first tile's readers of the stages are done */
        meta(0, 0);
        __syncthreads();
        stage(0, 0);
        cp_async_commit();
        for (int64_t s = 0; s < slices; s++) {
            const int b = (int)(s & 1);
            cp_async_wait_all();
            __syncthreads(); /* slice s staged; every reader of stage b ^ 1 (slice s - 1) done */
            if (s + 1 < slices) meta(s + 1, b ^ 1);
            __syncthreads();
            if (s + 1 < slices) stage(s + 1, b ^ 1);
            cp_async_commit();
            if (!slice_mask[b][2]) continue; /* no row of the slice sees a key of the tile (uniform) */
            const float *as = dkv_stages + b * STAGE, *bs = as + TK * APK;
            const long long *ri = row_i[b], *rbh = row_bh[b];
            const int kn = (int)(a.rn - s * TK < TK ? a.rn - s * TK : TK);
            /* segments up to the next row that ends its query block; without a test where every row of the slice
             * sees every key of the tile */
            unsigned ends = slice_mask[b][0];
            const int all_see = slice_mask[b][1] == 0xFFFFFFFFu;
            for (int kk = 0; kk < kn;) {
                const int last = ends ? __ffs(ends) - 1 : kn - 1; /* the segment's last row */
                if (all_see) {
    #pragma unroll 4
                    for (; kk <= last; kk++) rank1<R, APK, C>(as, bs, kk, g, tx, (1u << R) - 1, part);
                } else {
                    for (; kk <= last; kk++) {
                        const int64_t di = ri[kk] - fbase; /* key r seen where di >= r */
                        const unsigned rows = di >= R - 1 ? (1u << R) - 1 : di < 0 ? 0u : (2u << di) - 1;
                        rank1<R, APK, C>(as, bs, kk, g, tx, rows, part);
                    }
                }
                if (ends & (1u << last)) { /* the query block's last row: its sum joins the running sum */
                    const int64_t i = ri[last];
                    const uint64_t s_dkv = bwd_stream(IS_K ? EV_DKV_DK : EV_DKV_DV, rbh[last]);
    #pragma unroll
                    for (int r = 0; r < R; r++) {
                        if (i - fbase < r) continue; /* row i does not see key r */
    #pragma unroll
                        for (int c = 0; c < C; c++) {
                            acc[r][c] = add_round(a.dkv_acc, a.dkv_acc_kind, acc[r][c], part[r][c], s_dkv,
                                                  ATT_INDEX(i / bq, j0 + g * R + r, d0 + tx + 16 * c));
                            part[r][c] = 0.f;
                        }
                    }
                    ends &= ends - 1; /* the lowest set bit is this row's */
                }
            }
        }
    #pragma unroll
        for (int r = 0; r < R; r++) {
            const int64_t j = j0 + g * R + r;
            if (j >= Nk) continue;
    #pragma unroll
            for (int c = 0; c < C; c++) {
                const int64_t d = d0 + tx + 16 * c, at = (bg * Nk + j) * D + d;
                if (d >= D) continue;
                if (!last_chunk) {
                    part_mem[at] = part[r][c], acc_mem[at] = acc[r][c];
                    continue;
                }
                const uint64_t idx = ATT_INDEX(j, d, 0);
                acc_mem[at] = IS_K
                    ? emu_rnd<true>(a.grad, a.c_grad * (double)acc[r][c], bwd_stream(EV_GRAD_DK, bg), idx)
                    : emu_rnd<true>(a.grad, (double)acc[r][c], bwd_stream(EV_GRAD_DV, bg), idx);
            }
        }
    }
}

/* Significant bits of a format's values, when they all lie inside fp32 (else 99: never exact). */
int bits_in_fp32(const fadev_format *f) { return att_inside_fp32(f) ? f->precision : 99; }

} // namespace

int emu_bwd_fast_ok(const bwd_args &a, const fadev_policy *pol, const fadev_policy_backward *pb) {
    const char *generic = getenv("FADEV_EMU_GENERIC"); /* tests: the generic kernels, to compare the two paths */
    if (generic && *generic && strcmp(generic, "0") != 0) return 0;
    const int in = bits_in_fp32(&pol->input);
    return a.grad_acc.kind == ATT_F32 && a.cx.qk_float && in + bits_in_fp32(&pb->ds) <= 24 &&
           in + bits_in_fp32(&pb->bwd_p) <= 24 && att_inside_fp32(&pb->dq_acc) && att_inside_fp32(&pb->dkv_acc);
}

/* How dQ's rows or dK's, dV's keys are cut: 8 a thread (a CTA of 128) or 4 (64), and, causal, a CTA per two tiles
 * (pair_tile): the 128-wide tiles where that grid still fills a wave of 2 CTAs an SM, the 64-wide ones where it has a
 * CTA for half the SMs (a grouped-query call's dK, dV at 16 / 4 heads, half a wave paired: with the streamed slices
 * pairing measured faster there, H100 fa2 bf16 D 64 backward 11.3 -> 12.1 TFLOP/s, paper 9.4 -> 10.0, naive 8.2 ->
 * 8.7; before them, 4% slower). 8 where its grid fills the GPU: 3 CTAs an SM unpaired, a wave paired. H100, B 1,
 * H 16, N 4096, bf16, backward TFLOP/s at 8 / 4 keys of dK, dV: fa2 D 64 11.8 / 10.4, D 128 12.6 / 11.1; causal
 * (before the pairing) 8.0 / 8.2; grouped-query (16 / 4 heads) 8.3 / 10.8 (a quarter of the CTAs). dK, dV at 4 keys
 * take 2 columns a thread (twice the CTAs) where their grid is short of a wave. FADEV_EMU_WIDE=1 / 0 forces 8 / 4,
 * FADEV_EMU_PAIR=1 / 0 the pairing, FADEV_EMU_COLS=2 / 4 the columns (tests, benchmarks). */
struct sums_cut {
    int wide, paired; /* paired: the tiles' count (a CTA per two), or 0 */
    int cols;         /* columns a thread: 4, or 2 (dK, dV of grids short of a wave) */
    dim3 grid;
};
static sums_cut cut_of(int64_t rows, int64_t D, int64_t gn, int causal, bool wide_ok, bool narrow_ok, int sms) {
    const char *force = getenv("FADEV_EMU_WIDE"), *cols_force = getenv("FADEV_EMU_COLS");
    const int64_t wave = 2 * (int64_t)sms * 19 / 20; /* paired CTAs enough for a wave, rounding allowed */
    auto units = [&](int tile, bool pair) { /* CTAs along the rows */
        const int64_t tiles = (rows + tile - 1) / tile;
        return pair ? (tiles + 1) / 2 : tiles;
    };
    const int64_t dt4 = (D + TN - 1) / TN; /* column tiles at 4 columns a thread */
    auto ctas = [&](int tile, bool pair) { return units(tile, pair) * dt4 * gn; };
    const bool pair8 = causal && ctas(128, true) >= wave, pair4 = causal && 2 * ctas(64, true) >= sms;
    bool wide = wide_ok && (causal ? pair8 : ctas(128, false) >= 3 * (int64_t)sms);
    if (force && *force) wide = wide_ok && strcmp(force, "0") != 0;
    const int tile = wide ? 128 : 64;
    bool pair = wide ? pair8 : pair4;
    const char *pair_force = getenv("FADEV_EMU_PAIR"); /* tests: 1 a CTA per two tiles always (any mask), 0 never */
    if (pair_force && *pair_force) pair = strcmp(pair_force, "0") != 0;
    /* 2 columns a thread (twice the CTAs) where dK's and dV's grid (2 gn K/V heads: one launch) would be short of a
     * wave. With dK and dV in one launch, 4 K/V heads of 16 under a mask fill a wave at 4 columns, which then measured
     * faster (H100, D 64 bf16 backward TFLOP/s, 2 columns -> 4: fa2 11.4 / 12.2 -> 14.6 / 13.8, naive 9.7 -> 11.0) */
    bool narrow = narrow_ok && !wide && D > 32 && 2 * ctas(tile, pair) < wave;
    if (cols_force && *cols_force) narrow = narrow_ok && !wide && strcmp(cols_force, "2") == 0; /* tests */
    sums_cut c;
    c.wide = wide, c.cols = narrow ? 2 : 4;
    c.paired = pair ? (int)((rows + tile - 1) / tile) : 0;
    c.grid = dim3((unsigned)units(tile, pair), (unsigned)((D + 16 * c.cols - 1) / (16 * c.cols)), (unsigned)gn);
    return c;
}

template <typename T, int R, bool PAIRED, int C>
fadev_status sums_dkv_launch(const bwd_args &a, const T *sa, const T *sb, const sums_cut &c, int last_chunk) {
    constexpr size_t smem = sums_smem_bytes<R, C>(); /* above 48 KB at R = 8: opted in */
    FADEV_TRY(fadev_cuda_smem_attr((const void *)dkv_fast_kernel<T, R, PAIRED, C>, (int)smem));
    const dim3 both(c.grid.x, c.grid.y, 2 * c.grid.z);
    dkv_fast_kernel<T, R, PAIRED, C><<<both, NT, smem>>>(a, sa, sb, last_chunk, c.paired, (int)c.grid.z);
    return FADEV_OK;
}

/* 8 keys a thread (4 columns), or 4 keys by 4 or 2 columns */
template <typename T>
fadev_status sums_dkv(const bwd_args &a, const T *sa, const T *sb, const sums_cut &c, int last_chunk) {
    if (c.wide) return c.paired ? sums_dkv_launch<T, 8, true, 4>(a, sa, sb, c, last_chunk)
                                : sums_dkv_launch<T, 8, false, 4>(a, sa, sb, c, last_chunk);
    if (c.cols == 2) return c.paired ? sums_dkv_launch<T, 4, true, 2>(a, sa, sb, c, last_chunk)
                                     : sums_dkv_launch<T, 4, false, 2>(a, sa, sb, c, last_chunk);
    return c.paired ? sums_dkv_launch<T, 4, true, 4>(a, sa, sb, c, last_chunk)
                    : sums_dkv_launch<T, 4, false, 4>(a, sa, sb, c, last_chunk);
}

template <typename T, int R, bool PAIRED>
fadev_status sums_dq_launch(const bwd_args &a, const T *sb, const sums_cut &c) {
    constexpr size_t smem = sums_smem_bytes<R>();
    FADEV_TRY(fadev_cuda_smem_attr((const void *)dq_fast_kernel<T, R, PAIRED>, (int)smem));
    dq_fast_kernel<T, R, PAIRED><<<c.grid, NT, smem>>>(a, sb, c.paired);
    return FADEV_OK;
}

template <typename T, int R> fadev_status sums_dq(const bwd_args &a, const T *sb, const sums_cut &c) {
    return c.paired ? sums_dq_launch<T, R, true>(a, sb, c) : sums_dq_launch<T, R, false>(a, sb, c);
}

template <typename T> fadev_status sums(const bwd_args &args, const T *sa, const T *sb, int64_t gn, int last_chunk) {
    bwd_args a = args;
    a.dq_acc_kind = flt_kind_of(a.dq_acc), a.dkv_acc_kind = flt_kind_of(a.dkv_acc);
    const int64_t D = a.cx.pr.dim, Nk = a.cx.pr.seq_kv;
    const int causal = a.cx.pr.causal;
    /* dq: 8 rows a thread at D <= 64 (H100, D 64: 3.42 -> 3.15 ms, fa2), 4 above (no gain measured at D 128) */
    int sms = 0;
    FADEV_TRY(fadev_cuda_sm_count(&sms));
    const sums_cut cq = cut_of(a.rn, D, gn, causal, D <= 64, false, sms);
    const sums_cut ckv = cut_of(Nk, D, gn, causal, true, true, sms);
    FADEV_TRY((cq.wide ? sums_dq<T, 8>(a, sb, cq) : sums_dq<T, 4>(a, sb, cq)));
    CUDA_TRY(cudaGetLastError());
    FADEV_TRY(sums_dkv<T>(a, sa, sb, ckv, last_chunk));
    CUDA_TRY(cudaGetLastError());
    return FADEV_OK;
}

fadev_status emu_bwd_fast_sums(const bwd_args &a, int64_t gn, int last_chunk) {
    return a.saf ? sums<float>(a, a.saf, a.sbf, gn, last_chunk) : sums<double>(a, a.sa, a.sb, gn, last_chunk);
}
