/* The emulated forward's warp kernels (emu_forward_warp_tile.cuh's tile code): which row tiles a CTA takes, the
 * kernel and its launch. */
#ifndef FADEV_EMU_FORWARD_WARP_GRID_CUH
#define FADEV_EMU_FORWARD_WARP_GRID_CUH

#include "emu_forward_warp_tile.cuh"

namespace emu_warp {

/* The causal baseline's units (fast_args::pairing; warp_forward chooses): a tile each; the p-th longest and the p-th
 * shortest tile of a head (T + 1 tile-lengths, a tile of index t being t + 1 long); or the longest alone and the
 * (p + 2)-th longest with the p-th shortest (T each), the middle tile alone where T - 1 is odd (T / 2), those last. */
enum { PAIR_NONE = 0, PAIR_ENDS = 1, PAIR_SHIFTED = 2 };

/* Work unit u: row tile u % tiles of query head u / tiles; causal, the u-th longest tile (query head u % heads, tile
 * tiles - 1 - u / heads), so that CTAs that take the units in order take the longest first; the causal baseline's
 * pairs (a.pairing) as above. */
template <int DC, bool LEAN, bool BASE, bool CAUSAL, bool KEEP, int SIG>
__device__ __forceinline__ void warp_unit(const fast_args &a, int64_t u) {
    if constexpr (!CAUSAL) {
        warp_tile<DC, LEAN, BASE, KEEP, false, SIG>(a, u / a.tiles, u % a.tiles);
    } else if constexpr (!BASE) {
        const int64_t heads = a.units / a.tiles; /* query heads of the call, B H */
        warp_tile<DC, LEAN, BASE, KEEP, true, SIG>(a, u % heads, a.tiles - 1 - u / heads);
    } else {
#pragma unroll 1
        for (int k = 0; k < 2; k++) { /* a loop: the tile's code inlined once; its indices recomputed, not kept */
            const int64_t T = a.tiles, heads = a.cx.pr.batch * a.cx.pr.heads;
            int64_t bh, t;
            if (a.pairing == PAIR_ENDS) {
                const int64_t per = (T + 1) / 2, p = u % per, last = T - 1 - p;
                if (k && p == last) break;
                bh = u / per, t = k ? p : last;
            } else if (a.pairing == PAIR_SHIFTED) {
                const int64_t per = 1 + (T - 1) / 2, j = u % per; /* the units of T; past heads * per, the middles */
                if (u >= heads * per) {
                    if (k) break;
                    bh = u - heads * per, t = (T - 2) / 2;
                } else {
                    if (k && j == 0) break;
                    bh = u / per, t = j == 0 ? T - 1 : k ? j - 1 : T - 1 - j;
                }
            } else {
                if (k) break;
                bh = u % heads, t = T - 1 - u / heads;
            }
            if (k) __syncthreads(); /* the first tile's readers of shared memory are done */
            warp_tile<DC, LEAN, BASE, KEEP, true, SIG>(a, bh, t);
        }
    }
}

/* A CTA per unit; with the baseline's score store (a.s_keep: a slot for each resident CTA), a resident CTA per slot.
 * Unmasked, every tile is alike, and the CTAs stride over them. Causal, a CTA takes unit blockIdx.x, then, as it
 * finishes one, the next unit not yet taken (a.cx.ticket): the longest first, each to the first slot that frees.
 * H200, against the end pairs everywhere: single tiles 3% faster at B 1 H 16 N 4096 D 128, 10% at B 2 H 6 N 1000
 * D 72, 18% at B 1 H 4 N 777 D 100, but 1-3% slower at D 64 (the single tiles' tail); there the shifted pairs 2.6%
 * faster. Drawn when a CTA starts a unit (the atomic's latency hidden), the draws fixed every CTA's second unit at
 * once: 24-26% slower. A tile's work and bits do not depend on which CTA computes it. */
template <int DC, bool LEAN, bool BASE, bool CAUSAL, bool KEEP, int SIG>
__global__ void __launch_bounds__(NT, 2) warp_kernel(const __grid_constant__ fast_args a) {
    if constexpr (KEEP && !CAUSAL) {
#pragma unroll 1
        for (int64_t u = blockIdx.x; u < a.units; u += gridDim.x) {
            if (u != blockIdx.x) __syncthreads(); /* the last unit's readers of shared memory are done */
            warp_unit<DC, LEAN, BASE, CAUSAL, KEEP, SIG>(a, u);
        }
    } else if constexpr (KEEP) {
        __shared__ int64_t next[2]; /* the next unit, by parity of the CTA's count of units: read after the barrier
                                     * that ends a unit, written again two units later */
        int it = 0;
#pragma unroll 1
        for (int64_t u = blockIdx.x; u < a.units; it++) {
            warp_unit<DC, LEAN, BASE, CAUSAL, KEEP, SIG>(a, u);
            if (threadIdx.x == 0) next[it & 1] = (int64_t)gridDim.x + atomicAdd(a.cx.ticket, 1u);
            __syncthreads(); /* the unit's readers of shared memory are done; next[it & 1] is written */
            u = next[it & 1];
        }
    } else {
        warp_unit<DC, LEAN, BASE, CAUSAL, KEEP, SIG>(a, blockIdx.x);
    }
}

template <int DC, bool LEAN, bool BASE, bool CAUSAL, bool KEEP = false, int SIG = 0>
fadev_status launch(const fast_args &a, int64_t ctas) {
    const size_t smem = tile<DC>::bytes;
    auto kernel = warp_kernel<DC, LEAN, BASE, CAUSAL, KEEP, SIG>;
    FADEV_TRY(fadev_cuda_smem_attr((const void *)kernel, (int)smem));
    kernel<<<(unsigned)ctas, NT, smem>>>(a);
    CUDA_TRY(cudaGetLastError());
    return FADEV_OK;
}

/* The SIGS entry (1-based) whose stage kinds are the flash policy's (the presets'), else 0: the run-time kinds' kernels
 * (FADEV_EMU_SIG=0 in the environment: always 0, the tests' comparison); and the launch of that entry's kernel
 * (emu_forward_warp_sig.cu). */
int warp_sig(const fast_args &a);
fadev_status launch_sig(const fast_args &a, int64_t ctas, int sig);

/* The baseline's kernel with the stage kinds read at run time (emu_forward_warp_base.cu): with its score store where
 * a.s_keep is set, else recomputing the scores. */
fadev_status launch_base(const fast_args &a, int64_t ctas);

} // namespace emu_warp

#endif /* FADEV_EMU_FORWARD_WARP_GRID_CUH */
