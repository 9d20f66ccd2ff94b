/* The deterministic native backward's dQ pass (native_backward.cu runs it in place of the atomic dQ sums):
 * one CTA per (batch, head, NATIVE_DQ_BLOCK_Q query rows); warp w owns query rows [16w, 16w + 16) with their Q
 * and dO fragments and their dQ accumulator in registers, and loops over the K/V tiles (BKV keys, cp.async, two
 * stages) in key order:
 *   S2  = (Q Kj^T) * scale * log2(e),  dP = dO Vj^T      mma.sync m16n8k16, fp32
 *   P   = exp2(S2 - lse_i log2(e))                        0 where masked (keys >= Nk, causal)
 *   dS  = P (dP - Dvec_i)                                 fp32, as the dK/dV kernel forms it
 *   dQ += round(dS) Kj                                    dS's accumulators, rounded, are the A operand
 * then dq = round(scale * dQ). Every sum has a fixed order and no atomics: the same bits on every run. The
 * tile is an implementation choice, not a numerical one: dQ accumulates in fp32 registers across the K/V tiles
 * whatever their size. Masks, shapes and grouped-query heads as the forward (native_forward.cu). */
#include "native.cuh"

template <typename T, int D, int BQ, int BKV> constexpr int native_dq_smem() { return (2 * BQ + 4 * BKV) * D * 2; }

template <typename T, int D, int BQ, int BKV>
__global__ void __launch_bounds__(BQ * 2) native_dq_pass_kernel(const native_bwd_args a) {
    constexpr int NT = BQ * 2, C = D / 8;
    extern __shared__ __align__(16) unsigned char smem[];
    const auto [sQ, sdO, sK, sV] = dq_tile<T, D, BQ, BKV>::carve(reinterpret_cast<T *>(smem));
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, t4 = lane & 3;

    const dq_tile<T, D, BQ, BKV> tile(a, warp, g);
    const head_rows<const T> K = tile.K, V = tile.V;
    const int n_kt = tile.n_kt;

    tile.template load_first<NT, false>(a, sQ, sdO, sK, sV, tid);

    uint32_t qf[D / 16][4], of[D / 16][4];
    float dq[D / 8][4];
#pragma unroll
    for (int i = 0; i < D / 8; ++i) dq[i][0] = dq[i][1] = dq[i][2] = dq[i][3] = 0.f;

    for (int j = 0; j < n_kt; ++j) {
        cp_async_wait_all();
        __syncthreads(); /* tile j landed for everyone; everyone is done with tile j - 1's stage */
        if (j == 0) {
#pragma unroll
            for (int kk = 0; kk < D / 16; ++kk) {
                ldmatrix_x4(qf[kk], sQ + swz<C>(warp * 16 + (lane & 15), kk * 2 + (lane >> 4)));
                ldmatrix_x4(of[kk], sdO + swz<C>(warp * 16 + (lane & 15), kk * 2 + (lane >> 4)));
            }
        }
        prefetch_kv<T, BKV, D, NT>(sK, sV, K, V, j, n_kt, a.seq_kv, tid);
        const T *sKj = sK + (j & 1) * BKV * D, *sVj = sV + (j & 1) * BKV * D;

        /* S = Q Kj^T and dP = dO Vj^T: B[k = d][n = key] = K[key][d] (V[key][d]), rows as stored */
        float s[BKV / 8][4], dp[BKV / 8][4];
#pragma unroll
        for (int i = 0; i < BKV / 8; ++i) {
            s[i][0] = s[i][1] = s[i][2] = s[i][3] = 0.f;
            dp[i][0] = dp[i][1] = dp[i][2] = dp[i][3] = 0.f;
        }
#pragma unroll
        for (int kk = 0; kk < D / 16; ++kk) {
#pragma unroll
            for (int np = 0; np < BKV / 16; ++np) {
                const int row = np * 16 + (lane & 7) + ((lane >> 4) << 3), ch = kk * 2 + ((lane >> 3) & 1);
                uint32_t bk[4], bv[4];
                ldmatrix_x4(bk, sKj + swz<C>(row, ch));
                ldmatrix_x4(bv, sVj + swz<C>(row, ch));
                mma_16816<T>(s[2 * np], qf[kk], bk[0], bk[1]);
                mma_16816<T>(s[2 * np + 1], qf[kk], bk[2], bk[3]);
                mma_16816<T>(dp[2 * np], of[kk], bv[0], bv[1]);
                mma_16816<T>(dp[2 * np + 1], of[kk], bv[2], bv[3]);
            }
        }

        tile.ds_tile(a, &s[0][0], &dp[0][0], j, t4); /* dS = P (dP - Dvec) in place of S */

        /* dQ += round(dS) Kj: dS's accumulators of key blocks 2kk, 2kk+1 are the A fragment of key chunk kk;
         * B[k = key][n = d] = K[key][d], rows as stored, so ldmatrix .trans */
#pragma unroll
        for (int kk = 0; kk < BKV / 16; ++kk) {
            const uint32_t da[4] = {pack2<T>(s[2 * kk][0], s[2 * kk][1]), pack2<T>(s[2 * kk][2], s[2 * kk][3]),
                                    pack2<T>(s[2 * kk + 1][0], s[2 * kk + 1][1]),
                                    pack2<T>(s[2 * kk + 1][2], s[2 * kk + 1][3])};
#pragma unroll
            for (int dd = 0; dd < D / 16; ++dd) {
                uint32_t b[4];
                ldmatrix_x4_trans(b, sKj + swz<C>(kk * 16 + (lane & 7) + (lane & 8), dd * 2 + (lane >> 4)));
                mma_16816<T>(dq[2 * dd], da, b[0], b[1]);
                mma_16816<T>(dq[2 * dd + 1], da, b[2], b[3]);
            }
        }
    }
    cp_async_wait_all(); /* no copy outlives the CTA */

#pragma unroll
    for (int db = 0; db < D / 8; ++db)
#pragma unroll
        for (int r = 0; r < 2; ++r) tile.store(a, r, db * 8 + 2 * t4, dq[db][2 * r], dq[db][2 * r + 1]);
}

template <typename T, int D, int BKV> static fadev_status native_dq_pass_launch(const fadev_native_params *p, native_bwd_args a) {
    constexpr int BQ = NATIVE_DQ_BLOCK_Q, smem = native_dq_smem<T, D, BQ, BKV>();
    a.n_qt = (int)((p->attn.seq_q + BQ - 1) / BQ);
    return native_bwd_launch(native_dq_pass_kernel<T, D, BQ, BKV>, p->attn.batch * p->attn.heads * a.n_qt, BQ * 2, smem, a);
}

fadev_status native_dq_pass(const fadev_native_params *p, native_bwd_args a) {
    return native_dq_dispatch(p, [&](auto t, auto d) { return native_dq_pass_launch<decltype(t), d.value, 64>(p, a); });
}
