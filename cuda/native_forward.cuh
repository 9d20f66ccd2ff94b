/* Native FlashAttention-2 forward on the tensor cores: fp16 / bf16 in and out, fp32 accumulation (host entry
 * points and the D 64 instances: native_forward.cu; D 128's: native_forward_128.cu, so the two compile side by side).
 * One CTA per (batch, head, block_q query rows); warp w owns query rows [16 MI w, 16 MI (w + 1)) of the tile (MI = 1
 * or 2 row blocks) and keeps its Q fragments (where they fit) and its O accumulator in registers. For each K/V tile j of block_kv rows (cp.async into shared
 * memory, two stages: tile j + 1 loads while tile j is used):
 *   S2 = (Q Kj^T) * scale * log2(e)         mma.sync m16n8k16, fp32 accumulators; masked entries -inf
 *   m' = max(m, rowmax S2)                  fp32, quad shuffles (the 4 lanes holding a row)
 *   P = exp2(S2 - m'),  a = exp2(m - m')    ex2.approx
 *   l = a l + rowsum P                      fp32 (per-lane partial sums, reduced over the quad at the end)
 *   O = a O + round(P) Vj                   P rounded to fp16/bf16 in registers, the A operand of the next mma
 * deferred normalisation: out = round(O / l), lse = (m + log2 l) ln 2 (natural log, float32).
 * Masks: keys >= Nk (ragged last tile, zero-filled), and with causal (bottom-right aligned) key j > i + Nk - Nq.
 * A row that sees no key gets out 0 and lse -inf (m stays -inf; exp2 is then taken against 0, so no NaN).
 * Causal K/V tiles past a query tile's last visible key are skipped; query tiles run longest first.
 * q, out: (B, H, Nq, D); k, v: (B, Hkv, Nk, D); lse (B, H, Nq); H % Hkv == 0, query head h reads K/V head
 * h / (H / Hkv). Compiled tiles: NATIVE_FORWARD_TILES (native.cuh), block_q and block_kv in {16, 32, 64, 128};
 * block_q / (16 MI) warps. Shared memory: the Q tile and two stages of K and V (swizzled, see
 * native.cuh); the Q tile is reused to stage the output for 16-byte stores. */
#ifndef FADEV_NATIVE_FORWARD_CUH
#define FADEV_NATIVE_FORWARD_CUH

#include "native.cuh"

struct native_fwd_args {
    const void *q, *k, *v;
    void *out;
    float *lse;
    int heads, group, seq_q, seq_kv, n_qt, causal; /* group = heads / heads_kv; n_qt = query tiles per head */
    float scale_log2;                                /* scale * log2(e) */
    native_strides sq, sk, sv, so;                   /* of q, k, v, out (lse: contiguous) */
    cudaStream_t stream;                             /* fadev_native_params.stream (NULL: the legacy default) */
};

/* The CTA's query tile (both forward kernels): query tile qt of head b * H + h (tiles run longest first), its K/V
 * head (grouped-query: h / (H / Hkv)), the row pointers, and n_kt, the K/V tiles of block_kv keys some row of the
 * tile may see (causal: up to the tile's last row's diagonal, bottom-right aligned: off = Nk - Nq). */
template <typename T, int D, int BQ, int BKV> struct fwd_tile {
    head_rows<const T> Q, K, V;
    head_rows<T> O;
    float *L;
    int q0, off, n_kt;
    __device__ __forceinline__ explicit fwd_tile(const native_fwd_args &a) {
        const int qt = a.n_qt - 1 - (int)(blockIdx.x % a.n_qt);
        const int64_t bh = blockIdx.x / a.n_qt; /* b * H + h */
        const int b = (int)bh / a.heads, h = (int)bh % a.heads;
        Q = head_at<const T>(a.q, a.sq, b, h);
        K = head_at<const T>(a.k, a.sk, b, h / a.group);
        V = head_at<const T>(a.v, a.sv, b, h / a.group);
        O = head_at<T>(a.out, a.so, b, h);
        L = a.lse + bh * a.seq_q;
        q0 = qt * BQ, off = a.seq_kv - a.seq_q;
        int kv_end = a.seq_kv; /* keys [0, kv_end) are visible to some row of this tile */
        if (a.causal) kv_end = min(kv_end, min(q0 + BQ, a.seq_q) + off);
        n_kt = kv_end > 0 ? (kv_end + BKV - 1) / BKV : 0;
    }
    /* n_kt == 0 (causal, Nq > Nk: no row of this tile sees a key): out 0, lse -inf; NT threads */
    template <int NT> __device__ __forceinline__ void write_empty(const native_fwd_args &a, int tid) const {
        constexpr int C = D / 8;
        for (int c = tid; c < BQ * C; c += NT)
            if (q0 + c / C < a.seq_q) *reinterpret_cast<uint4 *>(O.row(q0 + c / C) + c % C * 8) = uint4{0, 0, 0, 0};
        for (int r = tid; r < BQ; r += NT)
            if (q0 + r < a.seq_q) L[q0 + r] = -INFINITY;
    }
};

template <int D, int BQ, int BKV> constexpr int native_fwd_smem() { return (BQ + 4 * BKV) * D * 2; }

/* MI = query rows per warp / 16: each warp runs MI m16 row blocks side by side, so every K / V fragment it reads
 * from shared memory feeds MI mma instructions (FlashAttention-2's forward: 4 warps of 32 rows at D 64) */
template <typename T, int D, int BQ, int BKV, int MI>
__global__ void __launch_bounds__(BQ * 2 / MI) native_forward_kernel(const native_fwd_args a) {
    constexpr int WR = 16 * MI, NT = BQ / WR * 32, C = D / 8;
    /* Q fragments stay in registers when they fit beside S and O, else they are re-read from shared memory for each
     * K/V tile (always in registers for MI = 1) */
    constexpr bool QREG = MI * (D / 4 + BKV / 2 + D / 2) <= 160;
    extern __shared__ __align__(16) unsigned char smem[];
    T *sQ = reinterpret_cast<T *>(smem);
    T *sK = sQ + BQ * D;      /* 2 stages of BKV x D */
    T *sV = sK + 2 * BKV * D; /* 2 stages of BKV x D */
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, t4 = lane & 3, wrow = warp * WR;

    const fwd_tile<T, D, BQ, BKV> tile(a);
    const head_rows<const T> Q = tile.Q, K = tile.K, V = tile.V;
    const head_rows<T> O = tile.O;
    float *L = tile.L;
    const int q0 = tile.q0, off = tile.off, n_kt = tile.n_kt;
    if (n_kt == 0) return tile.template write_empty<NT>(a, tid);

    load_rows<T, BQ, D, NT>(sQ, Q, q0, a.seq_q, tid);
    load_rows<T, BKV, D, NT>(sK, K, 0, a.seq_kv, tid);
    load_rows<T, BKV, D, NT>(sV, V, 0, a.seq_kv, tid);
    cp_async_commit();

    /* this lane's rows in row block mi: q0 + wrow + 16 mi + g (fragment half 0) and + 8 (half 1); the last key
     * each may see */
    int lim[MI][2];
#pragma unroll
    for (int mi = 0; mi < MI; ++mi) {
        const int row = q0 + wrow + 16 * mi + g;
        lim[mi][0] = lim[mi][1] = a.seq_kv - 1;
        if (a.causal) lim[mi][0] = min(lim[mi][0], row + off), lim[mi][1] = min(lim[mi][1], row + 8 + off);
    }

    uint32_t qf[QREG ? MI : 1][QREG ? D / 16 : 1][4];
    float o[MI][D / 8][4], m[MI][2], l[MI][2];
#pragma unroll
    for (int mi = 0; mi < MI; ++mi) {
#pragma unroll
        for (int i = 0; i < D / 8; ++i) o[mi][i][0] = o[mi][i][1] = o[mi][i][2] = o[mi][i][3] = 0.f;
        m[mi][0] = m[mi][1] = -INFINITY, l[mi][0] = l[mi][1] = 0.f;
    }

    for (int j = 0; j < n_kt; ++j) {
        cp_async_wait_all();
        __syncthreads(); /* tile j landed for everyone; everyone is done with tile j - 1's stage */
        if constexpr (QREG) {
            if (j == 0) {
#pragma unroll
                for (int mi = 0; mi < MI; ++mi)
#pragma unroll
                    for (int kk = 0; kk < D / 16; ++kk)
                        ldmatrix_x4(qf[mi][kk], sQ + swz<C>(wrow + 16 * mi + (lane & 15), kk * 2 + (lane >> 4)));
            }
        }
        prefetch_kv<T, BKV, D, NT>(sK, sV, K, V, j, n_kt, a.seq_kv, tid);
        const T *sKj = sK + (j & 1) * BKV * D, *sVj = sV + (j & 1) * BKV * D;

        /* S = Q Kj^T: B[k = d][n = key] = K[key][d], K rows as stored (ldmatrix without .trans) */
        float s[MI][BKV / 8][4];
#pragma unroll
        for (int mi = 0; mi < MI; ++mi)
#pragma unroll
            for (int i = 0; i < BKV / 8; ++i) s[mi][i][0] = s[mi][i][1] = s[mi][i][2] = s[mi][i][3] = 0.f;
#pragma unroll
        for (int kk = 0; kk < D / 16; ++kk) {
            uint32_t qa[MI][4];
#pragma unroll
            for (int mi = 0; mi < MI; ++mi) {
                if constexpr (QREG) {
                    qa[mi][0] = qf[mi][kk][0], qa[mi][1] = qf[mi][kk][1], qa[mi][2] = qf[mi][kk][2], qa[mi][3] = qf[mi][kk][3];
                } else {
                    ldmatrix_x4(qa[mi], sQ + swz<C>(wrow + 16 * mi + (lane & 15), kk * 2 + (lane >> 4)));
                }
            }
#pragma unroll
            for (int np = 0; np < BKV / 16; ++np) {
                uint32_t b[4];
                ldmatrix_x4(b, sKj + swz<C>(np * 16 + (lane & 7) + ((lane >> 4) << 3), kk * 2 + ((lane >> 3) & 1)));
#pragma unroll
                for (int mi = 0; mi < MI; ++mi) {
                    mma_16816<T>(s[mi][2 * np], qa[mi], b[0], b[1]);
                    mma_16816<T>(s[mi][2 * np + 1], qa[mi], b[2], b[3]);
                }
            }
        }

        const int kv0 = j * BKV;
        const bool masked = kv0 + BKV > a.seq_kv || (a.causal && kv0 + BKV - 1 > q0 + off);
        with_mask(masked, [&](auto mask) {
#pragma unroll
            for (int mi = 0; mi < MI; ++mi) {
#pragma unroll
                for (int nb = 0; nb < BKV / 8; ++nb) {
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        s[mi][nb][e] *= a.scale_log2;
                        if (mask.value && kv0 + nb * 8 + 2 * t4 + (e & 1) > lim[mi][e >> 1]) s[mi][nb][e] = -INFINITY;
                    }
                }
            }
        });

        /* online softmax, rows r = 0 (g) and 1 (g + 8) of each row block */
#pragma unroll
        for (int mi = 0; mi < MI; ++mi) {
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                float mx = m[mi][r];
#pragma unroll
                for (int nb = 0; nb < BKV / 8; ++nb) mx = fmaxf(mx, fmaxf(s[mi][nb][2 * r], s[mi][nb][2 * r + 1]));
                mx = quad_max(mx);
                const float ref = mx == -INFINITY ? 0.f : mx; /* all keys so far masked: P = 0, O and l stay 0 */
                const float alpha = fast_exp2(m[mi][r] - ref);
                m[mi][r] = mx;
                float sum = 0.f;
#pragma unroll
                for (int nb = 0; nb < BKV / 8; ++nb) {
                    s[mi][nb][2 * r] = fast_exp2(s[mi][nb][2 * r] - ref);
                    s[mi][nb][2 * r + 1] = fast_exp2(s[mi][nb][2 * r + 1] - ref);
                    sum += s[mi][nb][2 * r] + s[mi][nb][2 * r + 1];
                }
                l[mi][r] = l[mi][r] * alpha + sum;
#pragma unroll
                for (int db = 0; db < D / 8; ++db) {
                    o[mi][db][2 * r] *= alpha;
                    o[mi][db][2 * r + 1] *= alpha;
                }
            }
        }

        /* O += round(P) Vj: P's accumulators of key blocks 2kk, 2kk+1 are the A fragment of key chunk kk;
         * B[k = key][n = d] = V[key][d], V rows as stored, so ldmatrix .trans */
#pragma unroll
        for (int kk = 0; kk < BKV / 16; ++kk) {
            uint32_t pa[MI][4];
#pragma unroll
            for (int mi = 0; mi < MI; ++mi) {
                pa[mi][0] = pack2<T>(s[mi][2 * kk][0], s[mi][2 * kk][1]);
                pa[mi][1] = pack2<T>(s[mi][2 * kk][2], s[mi][2 * kk][3]);
                pa[mi][2] = pack2<T>(s[mi][2 * kk + 1][0], s[mi][2 * kk + 1][1]);
                pa[mi][3] = pack2<T>(s[mi][2 * kk + 1][2], s[mi][2 * kk + 1][3]);
            }
#pragma unroll
            for (int dp = 0; dp < D / 16; ++dp) {
                uint32_t b[4];
                ldmatrix_x4_trans(b, sVj + swz<C>(kk * 16 + (lane & 7) + (lane & 8), dp * 2 + (lane >> 4)));
#pragma unroll
                for (int mi = 0; mi < MI; ++mi) {
                    mma_16816<T>(o[mi][2 * dp], pa[mi], b[0], b[1]);
                    mma_16816<T>(o[mi][2 * dp + 1], pa[mi], b[2], b[3]);
                }
            }
        }
    }

    /* stage this warp's output rows in its own rows of the Q tile (only this warp ever read them), then store
     * whole 16-byte chunks */
    __syncwarp();
#pragma unroll
    for (int mi = 0; mi < MI; ++mi) {
        float inv[2];
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const int row = q0 + wrow + 16 * mi + g + 8 * r;
            l[mi][r] = quad_sum(l[mi][r]);
            inv[r] = l[mi][r] > 0.f ? 1.f / l[mi][r] : 0.f;
            if (t4 == 0 && row < a.seq_q) L[row] = l[mi][r] > 0.f ? m[mi][r] * NATIVE_LN2 + logf(l[mi][r]) : -INFINITY;
        }
#pragma unroll
        for (int db = 0; db < D / 8; ++db) {
            const int r0 = wrow + 16 * mi + g;
            *reinterpret_cast<uint32_t *>(sQ + swz<C>(r0, db) + 2 * t4) = pack2<T>(o[mi][db][0] * inv[0], o[mi][db][1] * inv[0]);
            *reinterpret_cast<uint32_t *>(sQ + swz<C>(r0 + 8, db) + 2 * t4) = pack2<T>(o[mi][db][2] * inv[1], o[mi][db][3] * inv[1]);
        }
    }
    __syncwarp();
#pragma unroll
    for (int c = lane; c < WR * C; c += 32) {
        const int r = c / C, row = q0 + wrow + r;
        if (row < a.seq_q)
            *reinterpret_cast<uint4 *>(O.row(row) + c % C * 8) = *reinterpret_cast<const uint4 *>(sQ + swz<C>(wrow + r, c % C));
    }
}

/* ---------------------------------------------------------------- host entry points */

template <typename T, int D, int BQ, int BKV, int MI>
static inline fadev_status native_forward_launch(const native_fwd_args &a, int64_t ctas) {
    constexpr int smem = native_fwd_smem<D, BQ, BKV>();
    FADEV_TRY(fadev_cuda_smem_attr((const void *)native_forward_kernel<T, D, BQ, BKV, MI>, (int)smem));
    native_forward_kernel<T, D, BQ, BKV, MI><<<(unsigned)ctas, BQ * 2 / MI, smem, a.stream>>>(a);
    CUDA_TRY(cudaGetLastError());
    return FADEV_OK;
}

/* The compiled tiles of head dim DIM (NATIVE_FORWARD_TILES, NATIVE_FORWARD_TILES_32): only DIM's entries are
 * instantiated (if constexpr), so each head dim's kernels can live in their own translation unit. */
template <typename T, int DIM>
static inline fadev_status native_forward_dim(const fadev_native_params *p, const native_fwd_args &a, int64_t ctas) {
    const int bq = p->attn.block_q, bkv = p->attn.block_kv, wide = p->warp_rows == 32;
#define NATIVE_FORWARD_CASE(d, q, kv) \
    if constexpr (d == DIM) { if (!wide && bq == q && bkv == kv) return native_forward_launch<T, d, q, kv, 1>(a, ctas); }
    NATIVE_FORWARD_TILES(NATIVE_FORWARD_CASE)
#undef NATIVE_FORWARD_CASE
#define NATIVE_FORWARD_CASE(d, q, kv) \
    if constexpr (d == DIM) { if (wide && bq == q && bkv == kv) return native_forward_launch<T, d, q, kv, 2>(a, ctas); }
    NATIVE_FORWARD_TILES_32(NATIVE_FORWARD_CASE)
#undef NATIVE_FORWARD_CASE
    return native_bad(FADEV_ERR_INVALID_ARGUMENT, "native attention: tile not compiled");
}

/* The wgmma forward (native_forward_wgmma.cu), any head dim and type; refuses a GPU that is not compute capability 9.0. */
fadev_status native_forward_wgmma(const fadev_native_params *p, const native_fwd_args &a, int64_t ctas);

/* Head dim 128 (native_forward_128.cu). */
fadev_status native_forward_d128(const fadev_native_params *p, const native_fwd_args &a, int64_t ctas);

#endif /* FADEV_NATIVE_FORWARD_CUH */
