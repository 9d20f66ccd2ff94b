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
#endif

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
