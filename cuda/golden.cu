/* Golden attention on the GPU: fp64 throughout, on the fp64 tensor cores.
 *
 * For each (batch b, query head h), query row i and the keys j it sees (causal: j <= i + Nk - Nq):
 *   S = scale * (Q_i . K_j)                      fp64 tensor-core dot products, then the scale
 *   over key tiles of BLOCK_N rows (FlashAttention-2 order), per query row:
 *     m' = max(m, rowmax S);  a = exp(m - m');  P = exp(S - m')     (fp64 exp)
 *     l = a l + rowsum P;  O = a O + P V                             (fp64 registers)
 *   out = O / l,  lse = m + log(l) (natural log);  a row that sees no key: out = 0, lse = -inf.
 * q (B, H, Nq, D); k, v (B, Hkv, Nk, D), query head h reads K/V head h / (H / Hkv); out like q; lse
 * (B, H, Nq) or NULL; contiguous float64 device arrays, 1 <= D <= 256. The mathematics of the CPU's golden
 * policy (csrc/baseline.c) in another order: within a few fp64 ulps of it, not bit for bit.
 *
 * Tiling: a CTA of W warps (8 where shared memory allows) takes BLOCK_M = 16 W query rows of one head;
 * each warp owns 16 rows and keeps its S tile (16 x BLOCK_N) and O (16 x DV) in registers as m16n8
 * accumulator fragments. Q stays in shared memory for the whole CTA, its columns padded with zeros to
 * DQK = 16, 32, 64, 128 or 256. K and V tiles (BLOCK_N = 32 keys, 16 for D > 64) stream through shared
 * memory with cp.async, each loaded while the other is in use (V_j during S = Q K_j^T; K_{j+1} during the
 * softmax and P V_j), two barriers per tile, as FlashAttention-2. D > 128 splits O into column halves of
 * DV = 128 computed by separate CTAs (S is recomputed). The last query blocks (the most keys under a
 * causal mask) start first. Tile sizes are the largest that compile without register spills.
 * Products: mma.m16n8k8.f64 on sm_90; on sm_80 four mma.m8n8k4.f64 per m16n8k8 step, on the same
 * fragments. The 8 k-slots of one step hold dims (for S) or keys (for P V) in the order 0,2,4,6,1,3,5,7,
 * so a thread's two k-values are adjacent in memory (one 16-byte load of Q and of K) and the P fragment
 * of P V is the S accumulator as it stands. Row strides DQK + 8 (Q, K) and DV + 2 (V) make every
 * fragment load free of bank conflicts. */
#include <math.h>
#include <stdint.h>

#include "common.cuh"
#include "../csrc/stage.h"

namespace {

constexpr int MAX_WARPS = 8;
#ifndef GOLDEN_MIN_BLOCKS
#define GOLDEN_MIN_BLOCKS 1 /* CTAs per SM the register budget is sized for (__launch_bounds__) */
#endif
#ifndef GOLDEN_BLOCK_N_64
#define GOLDEN_BLOCK_N_64 32 /* keys per tile for D <= 64 */
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
 * g = lane / 4, t = lane % 4. */
__device__ __forceinline__ void mma_16x8x8(double (&c)[4], double a0, double a1, double a2, double a3, double b0,
                                           double b1) {
#if __CUDA_ARCH__ >= 900
    asm("mma.sync.aligned.m16n8k8.row.col.f64.f64.f64.f64 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
        : "+d"(c[0]), "+d"(c[1]), "+d"(c[2]), "+d"(c[3])
        : "d"(a0), "d"(a1), "d"(a2), "d"(a3), "d"(b0), "d"(b1));
#else
    asm("mma.sync.aligned.m8n8k4.row.col.f64.f64.f64.f64 {%0,%1}, {%2}, {%3}, {%0,%1};"
        : "+d"(c[0]), "+d"(c[1]) : "d"(a0), "d"(b0));
    asm("mma.sync.aligned.m8n8k4.row.col.f64.f64.f64.f64 {%0,%1}, {%2}, {%3}, {%0,%1};"
        : "+d"(c[2]), "+d"(c[3]) : "d"(a1), "d"(b0));
    asm("mma.sync.aligned.m8n8k4.row.col.f64.f64.f64.f64 {%0,%1}, {%2}, {%3}, {%0,%1};"
        : "+d"(c[0]), "+d"(c[1]) : "d"(a2), "d"(b1));
    asm("mma.sync.aligned.m8n8k4.row.col.f64.f64.f64.f64 {%0,%1}, {%2}, {%3}, {%0,%1};"
        : "+d"(c[2]), "+d"(c[3]) : "d"(a3), "d"(b1));
#endif
}

__device__ __forceinline__ void cp_async_16(double *dst, const double *src, bool valid) {
    unsigned s = (unsigned)__cvta_generic_to_shared(dst);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(s), "l"(src), "r"(valid ? 16 : 0) : "memory");
}

__device__ __forceinline__ void cp_async_8(double *dst, const double *src, bool valid) {
    unsigned s = (unsigned)__cvta_generic_to_shared(dst);
    asm volatile("cp.async.ca.shared.global [%0], [%1], 8, %2;" ::"r"(s), "l"(src), "r"(valid ? 8 : 0) : "memory");
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }

__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_group 0;" ::: "memory"); }

/* Starts copying rows x cols doubles from src (row stride ld) to dst (row stride lds); rows >= valid_rows
 * are zero-filled (cp.async with source size 0). vec16: 16-byte copies (cols, ld even, src 16-byte aligned). */
__device__ __forceinline__ void load_tile(double *dst, int lds, const double *src, int64_t ld, int rows,
                                          int valid_rows, int cols, bool vec16) {
    if (vec16) {
        const int pieces = cols >> 1;
        for (int idx = threadIdx.x; idx < rows * pieces; idx += blockDim.x) {
            const int r = idx / pieces, c = 2 * (idx - r * pieces);
            const bool ok = r < valid_rows;
            cp_async_16(dst + r * lds + c, ok ? src + r * ld + c : src, ok);
        }
    } else {
        for (int idx = threadIdx.x; idx < rows * cols; idx += blockDim.x) {
            const int r = idx / cols, c = idx - r * cols;
            const bool ok = r < valid_rows;
            cp_async_8(dst + r * lds + c, ok ? src + r * ld + c : src, ok);
        }
    }
}

/* Zeros columns [from, to) of rows x (row stride lds): the padding that no copy writes. */
__device__ __forceinline__ void zero_columns(double *dst, int lds, int rows, int from, int to) {
    const int width = to - from;
    if (width <= 0) return;
    for (int idx = threadIdx.x; idx < rows * width; idx += blockDim.x) {
        const int r = idx / width;
        dst[r * lds + from + idx - r * width] = 0.0;
    }
}

template <int DQK, int DV, int BLOCK_N>
__global__ void __launch_bounds__(32 * MAX_WARPS, GOLDEN_MIN_BLOCKS) golden_kernel(const golden_args a) {
    constexpr int QS = DQK + 8, VS = DV + 2;
    constexpr int NT = BLOCK_N / 8; /* n-tiles of S = k-steps of P V */
    constexpr int KT = DQK / 8;     /* k-steps of S */
    constexpr int DT = DV / 8;      /* n-tiles of O */
    extern __shared__ __align__(16) double smem[];
    const int warps = blockDim.x >> 5, block_m = 16 * warps;
    double *qs = smem, *ks = qs + block_m * QS, *vs = ks + BLOCK_N * QS;
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
    const double *qg = a.q + (bh * Nq + m0) * D;
    const double *kg = a.k + kvh * Nk * D;
    const double *vg = a.v + kvh * Nk * D + c0;
    const bool vec16 = a.vec16;

    zero_columns(qs, QS, block_m, D, DQK);
    zero_columns(ks, QS, BLOCK_N, D, DQK);
    zero_columns(vs, VS, BLOCK_N, dv, DV);
    load_tile(qs, QS, qg, D, block_m, (int)(rows_end - m0), D, vec16);
    if (n_tiles > 0) load_tile(ks, QS, kg, D, BLOCK_N, Nk < BLOCK_N ? (int)Nk : BLOCK_N, D, vec16);
    cp_async_commit();

    double o[DT][4];
#pragma unroll
    for (int dt = 0; dt < DT; ++dt) o[dt][0] = o[dt][1] = o[dt][2] = o[dt][3] = 0.0;
    double m_run[2] = {-INFINITY, -INFINITY}, l_run[2] = {0.0, 0.0}; /* rows row0, row0 + 8 */
    const int64_t row0 = m0 + warp * 16 + g;
    const double *qw = qs + (warp * 16 + g) * QS + 2 * t;
    const double *kw = ks + g * QS + 2 * t;
    const double *vw = vs + 2 * t * VS + g;

    for (int64_t jt = 0; jt < n_tiles; ++jt) {
        const int64_t key0 = jt * BLOCK_N, next = key0 + BLOCK_N;
        /* a warp whose rows all precede the tile's keys (causal) has nothing to add */
        const bool active = !a.causal || key0 <= m0 + warp * 16 + 15 + offset;
        const int valid = Nk - key0 < BLOCK_N ? (int)(Nk - key0) : BLOCK_N; /* keys of the tile < Nk */
        /* visible keys of this thread's rows: key0 + c for c < lim[r] (causal: key <= row + offset) */
        int lim[2] = {valid, valid};
        if (a.causal && next - 1 > m0 + offset) {
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                const int64_t causal_limit = m0 + warp * 16 + g + 8 * r + offset + 1 - key0;
                if (causal_limit < valid) lim[r] = (int)causal_limit;
            }
        }
        double s[NT][4];
        cp_async_wait_all(); /* Q and K_j */
        __syncthreads();     /* ... visible to all; every warp is done with V_{j-1} */
        load_tile(vs, VS, vg + key0 * D, D, BLOCK_N, valid, dv, vec16); /* V_j: lands during S */
        cp_async_commit();
        if (active) {
#pragma unroll
            for (int nt = 0; nt < NT; ++nt) s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.0;
#pragma unroll
            for (int kt = 0; kt < KT; ++kt) {
                const double2 a_lo = *reinterpret_cast<const double2 *>(qw + kt * 8);
                const double2 a_hi = *reinterpret_cast<const double2 *>(qw + 8 * QS + kt * 8);
#pragma unroll
                for (int nt = 0; nt < NT; ++nt) {
                    const double2 b = *reinterpret_cast<const double2 *>(kw + nt * 8 * QS + kt * 8);
                    mma_16x8x8(s[nt], a_lo.x, a_hi.x, a_lo.y, a_hi.y, b.x, b.y);
                }
            }
        }
        cp_async_wait_all(); /* V_j */
        __syncthreads();     /* ... visible to all; every warp is done with K_j */
        if (jt + 1 < n_tiles) /* K_{j+1}: lands during the softmax and P V_j */
            load_tile(ks, QS, kg + next * D, D, BLOCK_N, Nk - next < BLOCK_N ? (int)(Nk - next) : BLOCK_N, D, vec16);
        cp_async_commit();
        if (active) {
            double mx[2] = {m_run[0], m_run[1]};
#pragma unroll
            for (int nt = 0; nt < NT; ++nt)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const double x = nt * 8 + 2 * t + (e & 1) < lim[e >> 1] ? s[nt][e] * a.scale : -INFINITY;
                    s[nt][e] = x;
                    mx[e >> 1] = fmax(mx[e >> 1], x);
                }
            double alpha[2], base[2], sum[2] = {0.0, 0.0};
#pragma unroll
            for (int r = 0; r < 2; ++r) { /* the row's max over the 4 threads holding it */
                mx[r] = fmax(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 1));
                mx[r] = fmax(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 2));
                base[r] = mx[r] == -INFINITY ? 0.0 : mx[r]; /* no key seen yet: every P is exp(-inf) = 0 */
                alpha[r] = m_run[r] == mx[r] ? 1.0 : exp(m_run[r] - base[r]);
                m_run[r] = mx[r];
            }
#pragma unroll
            for (int nt = 0; nt < NT; ++nt)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const double p = exp(s[nt][e] - base[e >> 1]);
                    s[nt][e] = p;
                    sum[e >> 1] += p;
                }
#pragma unroll
            for (int r = 0; r < 2; ++r) l_run[r] = alpha[r] * l_run[r] + sum[r]; /* this thread's columns */
            if (__any_sync(0xffffffffu, alpha[0] != 1.0 || alpha[1] != 1.0)) { /* rare once the maxima settle */
#pragma unroll
                for (int dt = 0; dt < DT; ++dt)
#pragma unroll
                    for (int e = 0; e < 4; ++e) o[dt][e] *= alpha[e >> 1];
            }
#pragma unroll
            for (int nt = 0; nt < NT; ++nt)
#pragma unroll
                for (int dt = 0; dt < DT; ++dt)
                    mma_16x8x8(o[dt], s[nt][0], s[nt][2], s[nt][1], s[nt][3], vw[nt * 8 * VS + dt * 8],
                               vw[nt * 8 * VS + VS + dt * 8]);
        }
    }
    asm volatile("cp.async.wait_all;" ::: "memory"); /* no copy outlives the CTA (the Q copy when it sees no key) */

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
    const size_t per_warp = 16 * (DQK + 8) * sizeof(double);
    const size_t fixed = BLOCK_N * ((DQK + 8) + (DV + 2)) * sizeof(double);
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
    CUDA_TRY(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
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
    int device = 0, major = 0, max_smem = 0;
    CUDA_TRY(cudaGetDevice(&device));
    CUDA_TRY(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
    CUDA_TRY(cudaDeviceGetAttribute(&max_smem, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
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
    /* (DQK, DV, BLOCK_N): the largest tiles that compile without register spills on sm_80 and sm_90 */
    fadev_status st;
    if (pr->dim <= 16)
        st = launch<16, 16, 32>(a, max_smem);
    else if (pr->dim <= 32)
        st = launch<32, 32, 32>(a, max_smem);
    else if (pr->dim <= 64)
        st = launch<64, 64, GOLDEN_BLOCK_N_64>(a, max_smem);
    else if (pr->dim <= 128)
        st = launch<128, 128, 16>(a, max_smem);
    else
        st = launch<256, 128, 16>(a, max_smem);
    if (st != FADEV_OK) return st;
    return fadev_cuda_finish("fadev_cuda_golden_attention");
}
