/* The wgmma forward's per-warpgroup math, shared by its two kernels (native_forward_wgmma.cu: every thread loads with
 * cp.async; native_forward_tma_wgmma.cu: a producer warp loads with the tensor memory accelerator): the products of
 * one K/V tile, the softmax of one score tile, O's rescale and the output's store. Both kernels run these in the same
 * order on the same fragments, so they give the same bits (and the mma.sync kernel's, tests/test_cuda_native_wgmma.py). */
#ifndef FADEV_NATIVE_FORWARD_WGMMA_CUH
#define FADEV_NATIVE_FORWARD_WGMMA_CUH

#include "native_forward.cuh"
#include "wgmma.cuh"

/* Q's A operand in registers (loaded once, D / 4 registers a thread; the scores' products then read only Kj from
 * shared memory) or read by descriptor from shared memory for every tile. Default (FADEV_WGMMA_QREG 1): registers at
 * D 64 with up to 2 warpgroups, where the m64nNk16 products of a 64-wide head are short and shared-memory bandwidth
 * is the tighter limit; shared memory at D 128, whose registers hold O, and with 3 warpgroups (168 registers a
 * thread: ptxas serialises the wgmma, warning C7512). FADEV_WGMMA_QREG (setup.py's FADEV_NVCC_FLAGS) 0: never, 2:
 * wherever D 64 -- the same bits either way, for timing the choice. */
#ifndef FADEV_WGMMA_QREG
#define FADEV_WGMMA_QREG 1
#endif
template <int D, int BQ>
constexpr bool wgmma_qreg = D == 64 && (FADEV_WGMMA_QREG == 2 || (FADEV_WGMMA_QREG == 1 && BQ <= 128));

/* The products of one K/V tile, issued by this warpgroup and committed as one wgmma group (not waited for).
 * S = Q Kj^T: A = this warpgroup's 64 Q rows (registers qf, or by descriptor), B = Kj, both K-major; k16 slice kk in
 * panel kk / 4 at byte 32 (kk % 4). */
template <typename T, int D, int BQ, int BKV, int QN>
__device__ __forceinline__ void issue_scores(float (&s)[BKV / 2], const uint32_t (&qf)[QN][4], uint32_t aQ, uint32_t aK) {
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
        const uint64_t dk = wgmma_kslice(aK, BKV, kk);
        if constexpr (wgmma_qreg<D, BQ>)
            wgmma_rs<T, BKV, 0>(s, qf[kk], dk, kk > 0);
        else
            wgmma_ss<T, BKV>(s, wgmma_kslice(aQ, BQ, kk), dk, kk > 0);
    }
    wgmma_commit();
}
/* O += round(P) Vj: A = P from registers (key chunk kk), B = Vj MN-major: keys kk*16.. at byte 2048 kk, the 64-column
 * panels BKV * 128 bytes apart. */
template <typename T, int D, int BKV>
__device__ __forceinline__ void issue_pv(float (&o)[D / 2], const uint32_t (&pa)[BKV / 16][4], uint32_t aV) {
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < BKV / 16; ++kk) wgmma_rs<T, D, 1>(o, pa[kk], wgmma_desc(aV + kk * 2048, BKV * 128, 1024), 1);
    wgmma_commit();
}

/* The softmax of one score tile, in place: scale, mask (keys past lim[r] of rows g, g + 8), new row maxima m, P =
 * exp2(S - m) in s; alpha = exp2(m_old - m) and the rows' partial sums of P for the caller to apply to O and l once
 * the previous tile's P V is done. The same operations in the same order as native_forward.cuh's kernel. */
template <int BKV>
__device__ __forceinline__ void tile_softmax(float (&s)[BKV / 2], float (&m)[2], float (&alpha)[2], float (&sum)[2],
                                             float scale_log2, bool masked, int kv0, int t4, const int (&lim)[2]) {
    with_mask(masked, [&](auto mask) {
#pragma unroll
        for (int nb = 0; nb < BKV / 8; ++nb)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                s[4 * nb + e] *= scale_log2;
                if (mask.value && kv0 + nb * 8 + 2 * t4 + (e & 1) > lim[e >> 1]) s[4 * nb + e] = -INFINITY;
            }
    });
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        float mx = m[r];
#pragma unroll
        for (int nb = 0; nb < BKV / 8; ++nb) mx = fmaxf(mx, fmaxf(s[4 * nb + 2 * r], s[4 * nb + 2 * r + 1]));
        mx = quad_max(mx);
        const float ref = mx == -INFINITY ? 0.f : mx; /* all keys so far masked: P = 0, O and l stay 0 */
        alpha[r] = fast_exp2(m[r] - ref);
        m[r] = mx;
        sum[r] = 0.f;
#pragma unroll
        for (int nb = 0; nb < BKV / 8; ++nb) {
            s[4 * nb + 2 * r] = fast_exp2(s[4 * nb + 2 * r] - ref);
            s[4 * nb + 2 * r + 1] = fast_exp2(s[4 * nb + 2 * r + 1] - ref);
            sum[r] += s[4 * nb + 2 * r] + s[4 * nb + 2 * r + 1];
        }
    }
}

/* The masks of this warp's rows q0 + wrow + g and + 8 (off = Nk - Nq): lim, the last key each may see; masked(j),
 * whether K/V tile j needs masks at all (ragged end, or keys past the tile's first row's diagonal). */
template <int BKV> struct row_limits {
    int lim[2], seq_kv, causal, diag;
    __device__ __forceinline__ row_limits(const native_fwd_args &a, int q0, int off, int wrow, int g)
        : seq_kv(a.seq_kv), causal(a.causal), diag(q0 + off) {
        lim[0] = lim[1] = a.seq_kv - 1;
        if (a.causal) lim[0] = min(lim[0], q0 + wrow + g + off), lim[1] = min(lim[1], q0 + wrow + g + 8 + off);
    }
    __device__ __forceinline__ bool masked(int j) const {
        return (j + 1) * BKV > seq_kv || (causal && (j + 1) * BKV - 1 > diag);
    }
};

/* Once P_j V_j is done: l = alpha l + sum, O = alpha O (rows g and g + 8 of this warp). */
template <int D>
__device__ __forceinline__ void rescale_o(float (&o)[D / 2], float (&l)[2], const float (&alpha)[2], const float (&sum)[2]) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        l[r] = l[r] * alpha[r] + sum[r];
#pragma unroll
        for (int db = 0; db < D / 8; ++db) o[4 * db + 2 * r] *= alpha[r], o[4 * db + 2 * r + 1] *= alpha[r];
    }
}

/* The output of this warp's 16 rows (wrow.. of the tile at q0): lse, and O / l rounded, staged in the warp's own rows
 * of the Q tile sQ (every product of its warpgroup done: the caller's barrier), then stored as whole 16-byte chunks. */
template <typename T, int D, int BQ>
__device__ __forceinline__ void store_out(const float (&o)[D / 2], const float (&m)[2], float (&l)[2], T *sQ,
                                          const head_rows<T> &O, float *L, int q0, int wrow, int lane, int seq_q) {
    constexpr int C = D / 8;
    const int g = lane >> 2, t4 = lane & 3;
    float inv[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int row = q0 + wrow + g + 8 * r;
        l[r] = quad_sum(l[r]);
        inv[r] = l[r] > 0.f ? 1.f / l[r] : 0.f;
        if (t4 == 0 && row < seq_q) L[row] = l[r] > 0.f ? m[r] * NATIVE_LN2 + logf(l[r]) : -INFINITY;
    }
#pragma unroll
    for (int db = 0; db < D / 8; ++db) {
        *reinterpret_cast<uint32_t *>(sQ + wswz<BQ>(wrow + g, db) + 2 * t4) = pack2<T>(o[4 * db] * inv[0], o[4 * db + 1] * inv[0]);
        *reinterpret_cast<uint32_t *>(sQ + wswz<BQ>(wrow + g + 8, db) + 2 * t4) =
            pack2<T>(o[4 * db + 2] * inv[1], o[4 * db + 3] * inv[1]);
    }
    __syncwarp();
#pragma unroll
    for (int c = lane; c < 16 * C; c += 32) {
        const int r = c / C, row = q0 + wrow + r;
        if (row < seq_q)
            *reinterpret_cast<uint4 *>(O.row(row) + c % C * 8) = *reinterpret_cast<const uint4 *>(sQ + wswz<BQ>(wrow + r, c % C));
    }
}

/* The forward with a producer warpgroup and tensor-memory-accelerator loads (native_forward_tma_wgmma.cu) where the
 * call's tile has one (block_q 128) and its layout can be described to the copy engine: *ran says whether it ran. */
fadev_status native_forward_tma(const fadev_native_params *p, const native_fwd_args &a, int64_t ctas, bool *ran);

#endif /* FADEV_NATIVE_FORWARD_WGMMA_CUH */
