/* The steps of a query tile in the wgmma backward's dK/dV kernels (native_backward_wgmma.cu's cp.async kernel and
 * native_backward_tma_wgmma.cu's producer / consumer kernel): both run these functions in the same order on the same
 * fragments, so they give the same bits. A warpgroup owns 64 keys of the CTA's BKV; this lane's keys are key0
 * (fragment half 0) and key0 + 8 (half 1). */
#ifndef FADEV_NATIVE_BACKWARD_WGMMA_CUH
#define FADEV_NATIVE_BACKWARD_WGMMA_CUH

#include "native.cuh"
#include "wgmma.cuh"

/* P^T, then dS^T = P^T (dP^T - Dvec) in place of dP^T, from S^T (sp) and dP^T (dp) of query rows q0 .. q0 + BQ
 * (lse cL, Dvec cDv of those rows in shared memory); element (nb, e): key key0 + 8 (e >> 1), query
 * q0 + 8 nb + 2 t4 + (e & 1); off = seq_kv - seq_q (a key j sees query i where j <= i + off, causal) */
template <int BQ, int BKV>
__device__ __forceinline__ void bwd_ds_tile(const native_bwd_args &a, float (&sp)[BQ / 2], float (&dp)[BQ / 2],
                                            const float *cL, const float *cDv, int q0, int k0, int off, int key0,
                                            int t4) {
    const bool masked = q0 + BQ > a.seq_q || k0 + BKV > a.seq_kv || (a.causal && k0 + BKV - 1 > q0 + off);
    with_mask(masked, [&](auto mask) {
#pragma unroll
        for (int nb = 0; nb < BQ / 8; ++nb) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int i = nb * 8 + 2 * t4 + (e & 1), key = key0 + 8 * (e >> 1);
                float p = fast_exp2(sp[4 * nb + e] * a.scale_log2 - cL[i] * (float)NATIVE_LOG2E);
                if (mask.value && (q0 + i >= a.seq_q || key >= a.seq_kv || (a.causal && key > q0 + i + off))) p = 0.f;
                sp[4 * nb + e] = p;
                dp[4 * nb + e] = p * (dp[4 * nb + e] - cDv[i]);
            }
        }
    });
}

#if FADEV_WGMMA
/* dV += round(P^T) dO, dK += round(dS^T) Q: A from registers (pa, sa: query chunk kk = accumulator blocks 2kk,
 * 2kk + 1), B = dO / Q rows kk * 16 .. + 16, MN-major; one wgmma group, not waited for */
template <typename T, int D, int BQ>
__device__ __forceinline__ void bwd_issue_dkdv(float (&dk)[D / 2], float (&dv)[D / 2], const uint32_t (&pa)[BQ / 16][4],
                                               const uint32_t (&sa)[BQ / 16][4], uint32_t aQ, uint32_t adO) {
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < BQ / 16; ++kk) wgmma_rs<T, D, 1>(dv, pa[kk], wgmma_desc(adO + kk * 2048, BQ * 128, 1024), 1);
#pragma unroll
    for (int kk = 0; kk < BQ / 16; ++kk) wgmma_rs<T, D, 1>(dk, sa[kk], wgmma_desc(aQ + kk * 2048, BQ * 128, 1024), 1);
    wgmma_commit();
}

/* The atomic mode's dQ steps. bwd_store_ds: this warpgroup's dS^T (its 64 keys from tile row wkey x BQ queries; sa
 * as packed for the dK product) to its rows of the tile's dS^T (BKV x 64, one panel). At block_q 64, bwd_issue_dq:
 * dQ[q0 .. q0 + 64][col0 .. col0 + DN] += dS K over the tile's BKV keys, the head dim split over the BKV / 64
 * warpgroups (col0 = DN wg): A = dS^T (keys x queries), B = K (keys x d) from column col0 (its panel, byte 2 (col0 %
 * 64) of the 128-byte rows), both MN-major, keys kk * 16 .. + 16 at byte 2048 kk; one wgmma group, not waited for.
 * bwd_add_dq: the product added to the fp32 workspace (two adjacent columns at once: sm_90's float2 atomicAdd). */
template <typename T, int BKV, int BQ>
__device__ __forceinline__ void bwd_store_ds(T *ds, const uint32_t (&sa)[BQ / 16][4], int wkey, int g, int t4) {
#pragma unroll
    for (int nb = 0; nb < BQ / 8; ++nb) {
        const int r0 = wkey + g;
        *reinterpret_cast<uint32_t *>(ds + wswz<BKV>(r0, nb) + 2 * t4) = sa[nb >> 1][(nb & 1) * 2];
        *reinterpret_cast<uint32_t *>(ds + wswz<BKV>(r0 + 8, nb) + 2 * t4) = sa[nb >> 1][(nb & 1) * 2 + 1];
    }
}
template <typename T, int DN, int BKV>
__device__ __forceinline__ void bwd_issue_dq(float (&dq)[DN / 2], uint32_t sdS, uint32_t sK, int col0) {
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < BKV / 16; ++kk)
        wgmma_ss_tt<T, DN>(dq, wgmma_desc(sdS + kk * 2048, BKV * 128, 1024),
                           wgmma_desc(sK + kk * 2048 + col0 / 64 * BKV * 128 + col0 % 64 * 2, BKV * 128, 1024), kk > 0);
    wgmma_commit();
}
#endif
template <int D, int DN>
__device__ __forceinline__ void bwd_add_dq(const native_bwd_args &a, const float (&dq)[DN / 2], int64_t bh, int q0,
                                           int col0, int warp4, int g, int t4) {
    float *dQ = a.dq_acc + bh * a.seq_q * D;
#pragma unroll
    for (int nb = 0; nb < DN / 8; ++nb) {
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const int row = q0 + warp4 * 16 + g + 8 * r, col = col0 + nb * 8 + 2 * t4;
            if (row < a.seq_q)
                atomicAdd(reinterpret_cast<float2 *>(dQ + (int64_t)row * D + col),
                          make_float2(dq[4 * nb + 2 * r], dq[4 * nb + 2 * r + 1]));
        }
    }
}

/* dK = scale dK and dV of this lane's keys, written once at the end */
template <typename T, int D>
__device__ __forceinline__ void bwd_store_dkdv(const native_bwd_args &a, int64_t b, int64_t hk, int key0, int t4,
                                               const float (&dk)[D / 2], const float (&dv)[D / 2]) {
    const head_rows<T> dK = head_at<T>(a.dk, a.sdk, b, hk), dV = head_at<T>(a.dv, a.sdv, b, hk);
#pragma unroll
    for (int db = 0; db < D / 8; ++db) {
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const int key = key0 + 8 * r;
            if (key < a.seq_kv) {
                const int col = db * 8 + 2 * t4;
                *reinterpret_cast<uint32_t *>(dK.row(key) + col) =
                    pack2<T>(dk[4 * db + 2 * r] * a.scale, dk[4 * db + 2 * r + 1] * a.scale);
                *reinterpret_cast<uint32_t *>(dV.row(key) + col) = pack2<T>(dv[4 * db + 2 * r], dv[4 * db + 2 * r + 1]);
            }
        }
    }
}

#endif /* FADEV_NATIVE_BACKWARD_WGMMA_CUH */
