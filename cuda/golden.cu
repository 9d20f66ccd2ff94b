/* Golden attention on the GPU: fp64 throughout, on the fp64 tensor cores.
 *
 * For each (batch b, query head h), query row i and the keys j it sees (causal: j <= i + Nk - Nq):
 *   S = scale * (Q_i . K_j)                      fp64 tensor-core dot products, then the scale
 *   over key tiles of BLOCK_N rows (FlashAttention-2 order), per query row:
 *     m' = max(m, rowmax S);  a = exp(m - m');  P = exp(S - m')     (fp64 exp: CUDA's, as emu_exp_fast)
 *     l = a l + rowsum P;  O = a O + P V                             (fp64 registers)
 *   out = O / l,  lse = m + log(l) (natural log);  a row that sees no key: out = 0, lse = -inf.
 * q (B, H, Nq, D); k, v (B, Hkv, Nk, D), query head h reads K/V head h / (H / Hkv); out like q; lse
 * (B, H, Nq) or NULL; contiguous float64 device arrays, 1 <= D <= 256. The mathematics of the CPU's golden
 * policy (csrc/baseline.c) in another order: within a few fp64 ulps of it, not bit for bit.
 *
 * Tiling: a CTA of W warps (8 where shared memory allows) takes BLOCK_M = 16 W query rows of one head;
 * each warp owns 16 rows and keeps its S tile (16 x BLOCK_N) and O (16 x DV) in registers as m16n8
 * accumulator fragments. Q stays in shared memory, its columns padded with zeros to DQK = 16, 32, 64, 128 or
 * 256. K and V tiles stream through shared memory with cp.async, two buffers each: K_{j+1} and V_j land during
 * iteration j - 1, and one barrier per iteration both makes them visible and frees the buffers of K_j and V_{j-1}
 * for the next copies; a warp's S_{j+1} product ends iteration j. D > 128 splits O into column halves of
 * DV = 128 computed by separate CTAs (S is recomputed). The last query blocks (the most keys under a causal
 * mask) start first. A tile whose every key every row of the warp sees runs without the mask's code.
 *
 * Products: mma.m16n8k16.f64 on sm_90 (one instruction per 16 k-slots: half the instructions of m16n8k8,
 * ncu: the per-instruction operand moves and NOPs were a third of the loop); on sm_80 two m16n8k8 steps of
 * four mma.m8n8k4 each, on the same fragments. A thread's four k-slots t, t+4, t+8, t+12 of a step are
 * dims 4t..4t+3 (for S) and keys 2t, 2t+1, 8+2t, 9+2t (for P V), so that the S product's fragments are whole
 * 16-byte loads into the registers the instruction reads, with no moves: K rows as they are (b = dims
 * 4t..4t+3), Q with rows g and g+8 interleaved (a_i = row g + 8 (i % 2), dim 4t + i / 2); the P fragment of
 * P V is two S accumulators as they stand (written by the exp terms in that order), and V's fragment four
 * 8-byte loads of its rows. The shared-memory strides (Q pairs 2 DQK + 8, K DQK + 2, V DV + 2 doubles) make
 * every fragment load free of bank conflicts. P V runs by 16-key steps, each after its exp terms, so that a
 * step's exp terms run beside the last step's MMAs (ncu at D 64: the fp64 pipe, which DMMA and the vector fp64
 * instructions share, busy 63%; benchmarks/README.md has what bounds it). */
#include <math.h>
#include <stdint.h>

#include <type_traits>

#include "common.cuh"
#include "../csrc/stage.h"
#include "emu.cuh"

namespace {

#ifndef GOLDEN_MAX_WARPS
#define GOLDEN_MAX_WARPS 8 /* warps per CTA where shared memory allows */
#endif
constexpr int MAX_WARPS = GOLDEN_MAX_WARPS;
#ifndef GOLDEN_MIN_BLOCKS
#define GOLDEN_MIN_BLOCKS 1 /* CTAs per SM the register budget is sized for (__launch_bounds__) */
#endif
#ifndef GOLDEN_BLOCK_N_128
#define GOLDEN_BLOCK_N_128 16 /* keys per tile for 64 < D */
#endif
#ifndef GOLDEN_BLOCK_N_64
#define GOLDEN_BLOCK_N_64 64 /* keys per tile for D <= 64 */
#endif

struct golden_args {
    const double *q, *k, *v;
    double *out, *lse;
    int64_t heads, heads_kv, group, seq_q, seq_kv;
    int64_t heads_total; /* batch * heads */
    int64_t m_blocks;    /* query blocks per head */
    double scale;
    int dim, causal, chunks, vec16;
};

/* c += A B for a 16x8 tile and 8 k-slots: a0 (row g, slot t), a1 (g+8, t), a2 (g, t+4), a3 (g+8, t+4);
 * b0 (slot t, col g), b1 (slot t+4, col g); c0, c1 (row g, cols 2t, 2t+1), c2, c3 (row g+8, same cols);
 * g = lane / 4, t = lane % 4. sm_80's form (sm_90 uses mma_16x8x16). */
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ < 900
__device__ __forceinline__ void mma_16x8x8(double (&c)[4], double a0, double a1, double a2, double a3, double b0,
                                           double b1) {
    asm("mma.sync.aligned.m8n8k4.row.col.f64.f64.f64.f64 {%0,%1}, {%2}, {%3}, {%0,%1};"
        : "+d"(c[0]), "+d"(c[1]) : "d"(a0), "d"(b0));
    asm("mma.sync.aligned.m8n8k4.row.col.f64.f64.f64.f64 {%0,%1}, {%2}, {%3}, {%0,%1};"
        : "+d"(c[2]), "+d"(c[3]) : "d"(a1), "d"(b0));
    asm("mma.sync.aligned.m8n8k4.row.col.f64.f64.f64.f64 {%0,%1}, {%2}, {%3}, {%0,%1};"
        : "+d"(c[0]), "+d"(c[1]) : "d"(a2), "d"(b1));
    asm("mma.sync.aligned.m8n8k4.row.col.f64.f64.f64.f64 {%0,%1}, {%2}, {%3}, {%0,%1};"
        : "+d"(c[2]), "+d"(c[3]) : "d"(a3), "d"(b1));
}
#endif

/* c += A B for a 16x8 tile and 16 k-slots: a_i (row g + 8 (i % 2), slot t + 4 (i / 2)), b_j (slot t + 4 j,
 * col g); c as mma_16x8x8's (CUTLASS's SM90_16x8x16_F64F64F64F64_TN layouts). */
__device__ __forceinline__ void mma_16x8x16(double (&c)[4], const double (&a)[8], const double (&b)[4]) {
#if __CUDA_ARCH__ >= 900
    asm("mma.sync.aligned.m16n8k16.row.col.f64.f64.f64.f64 {%0,%1,%2,%3}, {%4,%5,%6,%7,%8,%9,%10,%11}, "
        "{%12,%13,%14,%15}, {%0,%1,%2,%3};"
        : "+d"(c[0]), "+d"(c[1]), "+d"(c[2]), "+d"(c[3])
        : "d"(a[0]), "d"(a[1]), "d"(a[2]), "d"(a[3]), "d"(a[4]), "d"(a[5]), "d"(a[6]), "d"(a[7]), "d"(b[0]),
          "d"(b[1]), "d"(b[2]), "d"(b[3]));
#else
    mma_16x8x8(c, a[0], a[1], a[2], a[3], b[0], b[1]); /* slots 0..7 of the 16 */
    mma_16x8x8(c, a[4], a[5], a[6], a[7], b[2], b[3]); /* slots 8..15 */
#endif
}

/* Two 16-byte shared loads into four consecutive doubles. */
__device__ __forceinline__ void load4(double (&x)[4], const double *p) {
    const double2 lo = *reinterpret_cast<const double2 *>(p), hi = *reinterpret_cast<const double2 *>(p + 2);
    x[0] = lo.x, x[1] = lo.y, x[2] = hi.x, x[3] = hi.y;
}

/* Starts copying a ROWS x COLS tile (shared row stride LDS) from src (row stride ld), W doubles per cp.async (W = 2:
 * src 16-byte aligned, ld and valid_cols even); rows >= valid_rows and columns >= valid_cols are zero-filled
 * (cp.async with source size 0), so no other write pads them. Block sizes and COLS / W are powers of two: where the
 * block has at least COLS / W threads, a thread's column is the same in every row it copies, and a copy costs a
 * few instructions (no division at run time). */
template <int ROWS, int COLS, int LDS, int W>
__device__ __forceinline__ void copy_tile(double *dst, const double *src, int64_t ld, int valid_rows, int valid_cols) {
    constexpr int P = COLS / W;
    if (blockDim.x % P == 0) {
        const int c = (int)(threadIdx.x % P) * W, step = blockDim.x / P;
        const bool col_ok = c < valid_cols;
        int r = threadIdx.x / P;
        double *d = dst + r * LDS + c;
        const double *s = src + r * ld + c;
        for (; r < ROWS; r += step, d += step * LDS, s += step * ld) {
            const bool ok = col_ok && r < valid_rows;
            if (W == 2) cp_async_16(d, ok ? s : src, ok);
            else cp_async_8(d, ok ? s : src, ok);
        }
    } else {
        for (int idx = threadIdx.x; idx < ROWS * P; idx += blockDim.x) {
            const int r = idx / P, c = idx % P * W;
            const bool ok = r < valid_rows && c < valid_cols;
            if (W == 2) cp_async_16(dst + r * LDS + c, ok ? src + r * ld + c : src, ok);
            else cp_async_8(dst + r * LDS + c, ok ? src + r * ld + c : src, ok);
        }
    }
}

template <int ROWS, int COLS, int LDS>
__device__ __forceinline__ void load_tile(double *dst, const double *src, int64_t ld, int valid_rows, int valid_cols,
                                          bool vec16) {
    if (vec16) copy_tile<ROWS, COLS, LDS, 2>(dst, src, ld, valid_rows, valid_cols);
    else copy_tile<ROWS, COLS, LDS, 1>(dst, src, ld, valid_rows, valid_cols);
}

/* Starts copying the CTA's Q rows (block_m of them, valid < block_m real) into the warps' pair layout: row
 * 16 w + g + 8 h, dim 16 kk + 4 t + u at w 8 PS + g PS + 32 kk + 8 u + 2 t + h (PS = 2 DQK + 8), so that a
 * thread's A fragment of step kk (a_{2u+h}) is four 16-byte loads at g PS + 32 kk + 8 u + 2 t. Once per CTA. */
template <int DQK>
__device__ __forceinline__ void load_q(double *dst, const double *src, int D, int block_m, int valid) {
    constexpr int PS = 2 * DQK + 8;
    for (int idx = threadIdx.x; idx < block_m * DQK; idx += blockDim.x) {
        const int r = idx / DQK, d = idx % DQK, w = r >> 4, g = r & 7, h = (r >> 3) & 1;
        const bool ok = r < valid && d < D;
        const int off = (w * 8 + g) * PS + 32 * (d >> 4) + 8 * (d & 3) + 2 * ((d >> 2) & 3) + h;
        cp_async_8(dst + off, ok ? src + (int64_t)r * D + d : src, ok);
    }
}

/* s = Q K^T for one warp's 16 rows and a tile of BLOCK_N keys: qw its Q pairs, kw the tile (at row g, dim 4t). */
template <int DQK, int BLOCK_N>
__device__ __forceinline__ void score_tile(double (&s)[BLOCK_N / 8][4], const double *qw, const double *kw) {
    constexpr int KS = DQK + 2;
#pragma unroll
    for (int nt = 0; nt < BLOCK_N / 8; ++nt) s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.0;
#pragma unroll
    for (int kk = 0; kk < DQK / 16; ++kk) {
        double qf[8];
#pragma unroll
        for (int u = 0; u < 4; ++u) {
            const double2 x = *reinterpret_cast<const double2 *>(qw + 32 * kk + 8 * u);
            qf[2 * u] = x.x, qf[2 * u + 1] = x.y;
        }
#pragma unroll
        for (int nt = 0; nt < BLOCK_N / 8; ++nt) {
            double b[4];
            load4(b, kw + nt * 8 * KS + 16 * kk);
            mma_16x8x16(s[nt], qf, b);
        }
    }
}

/* The index of S accumulator (nt, e) in the P V step's A fragment: step nt / 2, a_i with i = 4 (nt % 2) + (0, 2,
 * 1, 3)[e] (slot t <-> key 2t, t+4 <-> 2t+1, t+8 <-> 8+2t, t+12 <-> 9+2t). */
__device__ __forceinline__ constexpr int p_slot(int nt, int e) { return 4 * (nt & 1) + (e == 1 ? 2 : e == 2 ? 1 : e); }

template <int DQK, int DV, int BLOCK_N>
__global__ void __launch_bounds__(32 * MAX_WARPS, GOLDEN_MIN_BLOCKS) golden_kernel(const golden_args a) {
    constexpr int PS = 2 * DQK + 8, KS = DQK + 2, VS = DV + 2;
    constexpr int NT = BLOCK_N / 8;  /* n-tiles of S */
    constexpr int PT = BLOCK_N / 16; /* k-steps of P V */
    constexpr int DT = DV / 8;       /* n-tiles of O */
    static_assert(BLOCK_N % 16 == 0 && DQK % 16 == 0 && DV % 8 == 0, "golden tile");
    extern __shared__ __align__(16) double smem[];
    const int warps = blockDim.x >> 5, block_m = 16 * warps;
    double *qs = smem, *kbuf = qs + warps * 8 * PS, *vbuf = kbuf + 2 * BLOCK_N * KS; /* K and V: two buffers each */
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;

    const int64_t per_block = a.heads_total * a.chunks;
    const int64_t mb = a.m_blocks - 1 - (int64_t)blockIdx.x / per_block;
    const int64_t rest = (int64_t)blockIdx.x % per_block;
    const int chunk = (int)(rest % a.chunks);
    const int64_t bh = rest / a.chunks;
    const int64_t kvh = bh / a.heads * a.heads_kv + bh % a.heads / a.group;
    const int D = a.dim, c0 = chunk * DV, dv = D - c0 < DV ? D - c0 : DV;
    const int64_t Nq = a.seq_q, Nk = a.seq_kv, m0 = mb * block_m, offset = Nk - Nq;
    const int64_t rows_end = m0 + block_m < Nq ? m0 + block_m : Nq;
    const int64_t kv_end = a.causal && rows_end + offset < Nk ? rows_end + offset : Nk; /* keys [0, kv_end) */
    const int64_t n_tiles = kv_end > 0 ? (kv_end + BLOCK_N - 1) / BLOCK_N : 0;
    const double *kg = a.k + kvh * Nk * D;
    const double *vg = a.v + kvh * Nk * D + c0;
    const bool vec16 = a.vec16;
    const int64_t warp_last = m0 + warp * 16 + 15 + offset; /* the last key the warp's last row sees (causal) */
    auto tile_keys = [&](int64_t jt) { return Nk - jt * BLOCK_N < BLOCK_N ? (int)(Nk - jt * BLOCK_N) : BLOCK_N; };
    auto load_k = [&](int64_t jt) {
        load_tile<BLOCK_N, DQK, KS>(kbuf + (jt & 1) * BLOCK_N * KS, kg + jt * BLOCK_N * D, D, tile_keys(jt), D, vec16);
    };
    auto load_v = [&](int64_t jt) {
        load_tile<BLOCK_N, DV, VS>(vbuf + (jt & 1) * BLOCK_N * VS, vg + jt * BLOCK_N * D, D, tile_keys(jt), dv, vec16);
    };
    const double *qw = qs + (warp * 8 + g) * PS + 2 * t;
    const double *kw = kbuf + g * KS + 4 * t;
    const double *vw = vbuf + 2 * t * VS + g;

    /* Pipeline: K_{j+1} and V_j land during iteration j - 1, one barrier per iteration (the data of the next and
     * the buffers of the last); a warp's S_{j+1} product ends iteration j, into the registers S_j leaves. */
    load_q<DQK>(qs, a.q + (bh * Nq + m0) * D, D, block_m, (int)(rows_end - m0));
    if (n_tiles > 0) load_k(0);
    cp_async_commit();
    cp_async_wait_all();
    __syncthreads();
    double s[NT][4];
    if (n_tiles > 0 && (!a.causal || 0 <= warp_last)) score_tile<DQK, BLOCK_N>(s, qw, kw);
    if (n_tiles > 0) load_v(0);
    if (n_tiles > 1) load_k(1);
    cp_async_commit();

    double o[DT][4];
#pragma unroll
    for (int dt = 0; dt < DT; ++dt) o[dt][0] = o[dt][1] = o[dt][2] = o[dt][3] = 0.0;
    double m_run[2] = {-INFINITY, -INFINITY}, l_run[2] = {0.0, 0.0}; /* rows row0, row0 + 8 */
    const int64_t row0 = m0 + warp * 16 + g;

    /* One tile's softmax and O += P V_j. MASKED: some of the tile's keys are hidden from some of the warp's rows
     * (causal, or past Nk); key c of the tile is seen by the thread's row r where c < lim[r]. */
    auto tile_step = [&](auto masked, const int (&lim)[2], const double *vj) {
        constexpr bool MASKED = decltype(masked)::value;
        double mx[2] = {m_run[0], m_run[1]};
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                double x = s[nt][e] * a.scale;
                if (MASKED && nt * 8 + 2 * t + (e & 1) >= lim[e >> 1]) x = -INFINITY;
                s[nt][e] = x;
                mx[e >> 1] = fmax(mx[e >> 1], x);
            }
        double alpha[2], base[2], sum[2] = {0.0, 0.0};
#pragma unroll
        for (int r = 0; r < 2; ++r) { /* the row's max over the 4 threads holding it */
            mx[r] = fmax(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 1));
            mx[r] = fmax(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 2));
            base[r] = mx[r] == -INFINITY ? 0.0 : mx[r]; /* no key seen yet: every P is exp(-inf) = 0 */
            alpha[r] = m_run[r] == mx[r] ? 1.0 : emu_exp_fast(0, m_run[r] - base[r]);
            m_run[r] = mx[r];
            l_run[r] *= alpha[r];
        }
        if (__any_sync(0xffffffffu, alpha[0] != 1.0 || alpha[1] != 1.0)) { /* rare once the maxima settle */
#pragma unroll
            for (int dt = 0; dt < DT; ++dt)
#pragma unroll
                for (int e = 0; e < 4; ++e) o[dt][e] *= alpha[e >> 1];
        }
        /* P and O += P V_j by k-steps of 16 keys, so that a step's exp terms run beside the last step's MMAs. P in
         * the A order (p_slot). exp is emu_exp_fast (CUDA's bits) by its main path; arguments past its range
         * (P < 2^-1021, or a score that overflowed) and NaN take the full function afterwards, in a branch the warp
         * takes together. B: b_i = V[key of slot t + 4 i][column 8 dt + g], keys 2t, 2t+1, 8+2t, 9+2t of the step. */
#pragma unroll
        for (int pt = 0; pt < PT; ++pt) {
            double p[8];
            bool far = false;
#pragma unroll
            for (int nt = 2 * pt; nt < 2 * pt + 2; ++nt)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const double x = s[nt][e] - base[e >> 1];
                    const bool seen = !MASKED || nt * 8 + 2 * t + (e & 1) < lim[e >> 1];
                    int n;
                    const double y = emu_exp_scaled(emu_exp_poly(0, x, emu_exp_k, n), n);
                    p[p_slot(nt, e)] = seen ? y : 0.0;
                    far |= seen && !emu_exp_in_range(0, x);
                }
            if (__any_sync(0xffffffffu, far)) {
#pragma unroll
                for (int nt = 2 * pt; nt < 2 * pt + 2; ++nt)
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        const double x = s[nt][e] - base[e >> 1];
                        const bool seen = !MASKED || nt * 8 + 2 * t + (e & 1) < lim[e >> 1];
                        if (seen && !emu_exp_in_range(0, x)) p[p_slot(nt, e)] = emu_exp_fast(0, x);
                    }
            }
#pragma unroll
            for (int nt = 2 * pt; nt < 2 * pt + 2; ++nt)
#pragma unroll
                for (int e = 0; e < 4; ++e) sum[e >> 1] += p[p_slot(nt, e)];
#pragma unroll
            for (int dt = 0; dt < DT; ++dt) {
                const double *vp = vj + 16 * pt * VS + 8 * dt;
                const double b[4] = {vp[0], vp[VS], vp[8 * VS], vp[9 * VS]};
                mma_16x8x16(o[dt], p, b);
            }
        }
#pragma unroll
        for (int r = 0; r < 2; ++r) l_run[r] += sum[r]; /* this thread's columns */
    };

    for (int64_t jt = 0; jt < n_tiles; ++jt) {
        const int64_t key0 = jt * BLOCK_N, next = key0 + BLOCK_N;
        cp_async_wait_all(); /* K_{j+1}, V_j */
        __syncthreads();     /* ... visible to all; every warp is done with K_j (S_j) and V_{j-1} */
        if (jt + 2 < n_tiles) load_k(jt + 2);
        if (jt + 1 < n_tiles) load_v(jt + 1);
        cp_async_commit();
        if (!a.causal || key0 <= warp_last) { /* a warp whose rows all precede the tile's keys has nothing to add */
            const int valid = tile_keys(jt);
            const double *vj = vw + (jt & 1) * BLOCK_N * VS;
            int lim[2] = {valid, valid};
            if (a.causal && next - 1 > m0 + offset) { /* causal: key <= row + offset */
#pragma unroll
                for (int r = 0; r < 2; ++r) {
                    const int64_t causal_limit = m0 + warp * 16 + g + 8 * r + offset + 1 - key0;
                    if (causal_limit < valid) lim[r] = (int)causal_limit;
                }
            }
            /* every key of the tile seen by every row of the warp (its first row sees the tile's last key) */
            if (valid == BLOCK_N && (!a.causal || next - 1 <= m0 + warp * 16 + offset))
                tile_step(std::false_type(), lim, vj);
            else
                tile_step(std::true_type(), lim, vj);
        }
        if (jt + 1 < n_tiles && (!a.causal || next <= warp_last)) /* S_{j+1}, if the warp's rows see its keys */
            score_tile<DQK, BLOCK_N>(s, qw, kw + ((jt + 1) & 1) * BLOCK_N * KS);
    }
    asm volatile("cp.async.wait_all;" ::: "memory"); /* no copy outlives the CTA */

#pragma unroll
    for (int r = 0; r < 2; ++r) {
        l_run[r] += __shfl_xor_sync(0xffffffffu, l_run[r], 1);
        l_run[r] += __shfl_xor_sync(0xffffffffu, l_run[r], 2);
        const int64_t row = row0 + 8 * r;
        if (row >= Nq) continue;
        const double l = l_run[r]; /* 0 only for a row that sees no key (else the max contributes exp(0)) */
        double *orow = a.out + (bh * Nq + row) * D + c0;
#pragma unroll
        for (int dt = 0; dt < DT; ++dt)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                const int col = dt * 8 + 2 * t + e;
                if (col < dv) orow[col] = l == 0 ? 0.0 : o[dt][2 * r + e] / l;
            }
        if (a.lse && chunk == 0 && t == 0) a.lse[bh * Nq + row] = l == 0 ? -INFINITY : m_run[r] + log(l);
    }
}

/* Launches golden_kernel with the most warps (8, 4, 2, 1) whose shared memory fits the device. */
template <int DQK, int DV, int BLOCK_N>
fadev_status launch(golden_args a, int max_smem) {
    const size_t per_warp = 8 * (2 * DQK + 8) * sizeof(double);
    const size_t fixed = 2 * BLOCK_N * ((DQK + 2) + (DV + 2)) * sizeof(double); /* K and V, two buffers each */
    int warps = MAX_WARPS;
    while (warps > 1 && fixed + warps * per_warp > (size_t)max_smem) warps /= 2;
    const size_t smem = fixed + warps * per_warp;
    if (smem > (size_t)max_smem)
        return fadev_cuda_fail_msg(FADEV_ERR_CUDA, "fadev_cuda_golden_attention: not enough shared memory per block");
    a.chunks = (a.dim + DV - 1) / DV;
    a.m_blocks = (a.seq_q + 16 * warps - 1) / (16 * warps);
    if (a.m_blocks > INT32_MAX / a.heads_total / a.chunks)
        return fadev_cuda_fail_msg(FADEV_ERR_OVERFLOW, "fadev_cuda_golden_attention: grid too large");
    const unsigned grid = (unsigned)(a.m_blocks * a.heads_total * a.chunks);
    auto kernel = golden_kernel<DQK, DV, BLOCK_N>;
    FADEV_TRY(fadev_cuda_smem_attr((const void *)kernel, (int)smem));
    kernel<<<grid, 32 * warps, smem>>>(a);
    CUDA_TRY(cudaGetLastError());
    return FADEV_OK;
}

bool mul_ok(int64_t *acc, int64_t x) {
    if (x > 0 && *acc > INT64_MAX / x) return false;
    *acc *= x;
    return true;
}

} /* namespace */

extern "C" fadev_status fadev_cuda_golden_attention(const double *q, const double *k, const double *v, double *out,
                                                    double *lse, const fadev_attention_params *params) {
    if (!q || !k || !v || !out) return FADEV_ERR_INVALID_ARGUMENT;
    FADEV_TRY(att_check_params(params, 256, 0, NULL)); /* the CPU kernels' shape checks (csrc/stage.h) */
    const fadev_attention_params *pr = params;
    int64_t n_q = 8, n_kv = 8; /* bytes of q (and out), of k (and v) */
    if (!mul_ok(&n_q, pr->batch) || !mul_ok(&n_q, pr->heads) || !mul_ok(&n_q, pr->seq_q) || !mul_ok(&n_q, pr->dim) ||
        !mul_ok(&n_kv, pr->batch) || !mul_ok(&n_kv, pr->heads_kv) || !mul_ok(&n_kv, pr->seq_kv) ||
        !mul_ok(&n_kv, pr->dim))
        return FADEV_ERR_OVERFLOW;
    FADEV_TRY(fadev_cuda_require_device());
    int major = 0, minor = 0, max_smem = 0;
    FADEV_TRY(fadev_cuda_capability(&major, &minor));
    FADEV_TRY(fadev_cuda_smem_optin(&max_smem));
    if (major < 8)
        return fadev_cuda_fail_msg(FADEV_ERR_CUDA, "fadev_cuda_golden_attention: needs fp64 tensor cores "
                                                   "(compute capability 8.0 or newer)");
    golden_args a;
    a.q = q, a.k = k, a.v = v, a.out = out, a.lse = lse;
    a.heads = pr->heads, a.heads_kv = pr->heads_kv, a.group = pr->heads / pr->heads_kv;
    a.seq_q = pr->seq_q, a.seq_kv = pr->seq_kv;
    a.heads_total = pr->batch * pr->heads;
    a.m_blocks = 0;
    a.scale = pr->scale;
    a.dim = (int)pr->dim, a.causal = pr->causal, a.chunks = 1;
    a.vec16 = pr->dim % 2 == 0 && ((uintptr_t)q | (uintptr_t)k | (uintptr_t)v) % 16 == 0;
    /* (DQK, DV, BLOCK_N): the fastest measured on an H100 (benchmarks/README.md); D 64 at 64 keys spills 56 bytes
     * on sm_90 and is still faster than at 32 (32.5 against 30.4 TFLOP/s); on sm_80 D >= 64 spill a little */
    fadev_status st;
    if (pr->dim <= 16)
        st = launch<16, 16, 32>(a, max_smem);
    else if (pr->dim <= 32)
        st = launch<32, 32, 32>(a, max_smem);
    else if (pr->dim <= 64)
        st = launch<64, 64, GOLDEN_BLOCK_N_64>(a, max_smem);
    else if (pr->dim <= 128)
        st = launch<128, 128, GOLDEN_BLOCK_N_128>(a, max_smem);
    else
        st = launch<256, 128, GOLDEN_BLOCK_N_128>(a, max_smem);
    if (st != FADEV_OK) return st;
    return fadev_cuda_end(pr->asynchronous, "fadev_cuda_golden_attention");
}
