/* The emulated forward's warp kernel (emu_forward_warp.cu): its CTA shape and register tiles, the rows' visibility,
 * the staging of Q, K and V into shared memory, and the product loops' steps. Included by emu_forward_warp.cu only. */
#ifndef FADEV_EMU_FORWARD_WARP_CUH
#define FADEV_EMU_FORWARD_WARP_CUH

#include "emu_forward_fast.cuh"

namespace emu_warp {

using namespace emu_fwd;

constexpr int W = 8;        /* warps per CTA */
constexpr int NT = 32 * W;  /* threads per CTA */
constexpr int KB = 64;      /* keys per block, at most */
constexpr unsigned FULL = 0xFFFFFFFFu;


/* The tile of a kernel for D <= 32 DC. A lane's register tiles: scores, KL keys (key0 + KS j) x SR rows; O and P.V,
 * CL columns (col0 + CS c) x RL rows. At D 64 (QUAD) 4 contiguous keys or columns x half the warp's rows, so that
 * each FMA block of a step reads one float4 of K or V and SR / 4 or RL / 4 broadcast float4 of Q or P: 3 shared loads
 * for 32 FMAs (a key or column every 32 lanes x all R rows took 6, and the shared pipe's queue was the product
 * loops' largest stall; H100, fa2 bf16 forward 16.6-16.9 -> 17.4-17.8 TFLOP/s). At D 128 the 4-wide tiles measured
 * 3-9% slower (same run), so it keeps a key or column every 32 lanes. */
template <int DC> struct tile {
    static constexpr int DP = 32 * DC;         /* the head dimension, padded with zeros */
    static constexpr int R = DC == 2 ? 16 : 8; /* query rows per warp: o, pv take 2 R DC registers */
    static constexpr int BQ = W * R;           /* query rows per CTA */
    static constexpr bool QUAD = DC == 2;
    static constexpr int KL = QUAD ? 4 : 2, KS = QUAD ? 1 : 32, SR = QUAD ? R / 2 : R;
    static constexpr int CL = QUAD ? 4 : DC, CS = QUAD ? 1 : 32, RL = QUAD ? R * DC / 4 : R;
    static_assert(RL * CL == R * DC && KL * SR * 32 == KB * R && KB == 64, "the lanes' tiles cover the warp's");
    __device__ static int key0(int lane) { return QUAD ? 4 * (lane & 15) : lane; }
    __device__ static int srow0(int lane) { return QUAD ? (lane >> 4) * SR : 0; }
    __device__ static int col0(int lane) { return QUAD ? 4 * (lane % (DP / 4)) : lane; }
    __device__ static int orow0(int lane) { return QUAD ? lane / (DP / 4) * RL : 0; }
    static constexpr int EP = R + 4;           /* pitch of a warp's E[key][row]: conflict-free float4 stores */
    static constexpr int KP = QUAD ? KB + 4 : KB + 1; /* pitch of K^T [t][key]: float4 reads of four keys (QUAD,
                                                       * staged by stage_kt), or conflict-free transposing stores */
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

/* The warp kernels' stage kinds fixed at compile time for the presets' policies (SIG > 0: sig_at<SIG>, the SG_
 * entries of SIGS[SIG - 1]; warp_sig picks it), or read from the arguments at run time (SIG 0). A kernel compiled
 * for one policy holds one loop of each kind instead of one for every kind (with_kind), and its registers are that
 * path's. The host picks a SIG only where the policy has these kinds and an fp32 row sum (the flash kernels: also
 * deferred normalisation and the q_outer order; the baseline's: its score store). SG_BASE: the baseline's (its
 * SG_OFORM unused). */
enum { SG_BASE, SG_SCORE, SG_SOFT, SG_P, SG_OFORM, SG_EXP2, SG_N };
constexpr int N_SIGS = 6;
constexpr int SIGS[N_SIGS][SG_N] = {
    {0, FLT_F32, FLT_F32, FLT_BF16, O_F32, 1},              /* fa2 bf16 */
    {0, FLT_F32, FLT_F32, FLT_F16, O_F32, 1},               /* fa2 fp16 */
    {0, FLT_BF16, FLT_BF16, FLT_BF16, O_N16 + FLT_BF16, 0}, /* paper bf16 */
    {0, FLT_F16, FLT_F16, FLT_F16, O_N16 + FLT_F16, 0},     /* paper fp16 */
    {1, FLT_BF16, FLT_F32, FLT_BF16, 0, 0},                 /* naive bf16 (the baseline) */
    {1, FLT_F16, FLT_F32, FLT_F16, 0, 0},                   /* naive fp16 */
};
template <int SIG, int G> __host__ __device__ constexpr int sig_at() { return SIGS[SIG - 1][G]; }

/* f(K) with K the kind of stage G: SIG's, else with_kind(k, f) in the lean kernels and f(-1) (the kinds read at run
 * time) in the others. */
template <int SIG, int G, bool LEAN, class F> __device__ __forceinline__ void sig_kind(int k, F &&f) {
    if constexpr (SIG > 0) f(std::integral_constant<int, sig_at<SIG, G>()>{});
    else if constexpr (LEAN) with_kind(k, f);
    else f(std::integral_constant<int, -1>{});
}

/* f(E2) with E2 the exp's form: SIG's, else with_exp's. */
template <int SIG, class F> __device__ __forceinline__ void sig_exp(int exp2_form, F &&f) {
    if constexpr (SIG > 0) f(std::integral_constant<int, sig_at<SIG, SG_EXP2>()>{});
    else with_exp(exp2_form, f);
}

/* The staging's thread index. FRESH: read where it is used (a volatile read, which the compiler cannot hoist), so
 * that each staging computes its copies' indices again. From threadIdx.x the compiler hoisted every copy's indices
 * and bounds to the kernel's start, where they stayed live through every loop: the baseline's kernel held ~60
 * registers across its first pass's product loop (whose own are 44), spilled 160 / 412 bytes, and ptxas loaded the
 * product loops' operands just before their FMAs; FRESH, none spilled and every loop keeps its loads a step ahead.
 * H200: naive's forward 6% faster at D 64, 14-15% causal; the causal flash kernels 0.7-1.7%; the unmasked flash kernels
 * 1.7% slower (fa2, paper; D 64), which keep threadIdx.x (FRESH false, warp_tile). */
template <bool FRESH> __device__ __forceinline__ int stage_tid() {
    if constexpr (!FRESH) return threadIdx.x;
    int t;
    asm volatile("mov.u32 %0, %%tid.x;" : "=r"(t));
    return t;
}

/* Rows [0, have) of src (row pitch D: keys, or query rows) into dst[row * pitch_r + t * pitch_t], zeros for t >= D
 * and rows >= have, for t < DP and rows < ROWS; consecutive threads read consecutive t (coalesced), and every load of
 * a thread is in flight at once. Ends without a barrier. */
template <int DP, int ROWS, bool FRESH>
__device__ __forceinline__ void stage(float *dst, int pitch_t, int pitch_r, const float *src, int D, int have) {
    const int tid = stage_tid<FRESH>();
    static_assert(DP * ROWS % (4 * NT) == 0, "whole passes");
    if (D == DP) { /* rows of DP floats, contiguous: float4 loads (16-byte aligned: the buffers' rows are 256 or 512 B) */
        const float4 *s4 = (const float4 *)src;
#pragma unroll
        for (int it = 0; it < DP * ROWS / (4 * NT); it++) {
            const int e = it * NT + tid, t = e % (DP / 4) * 4, row = e / (DP / 4);
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
        const int e = it * NT + tid, t = e % DP, row = e / DP;
        dst[row * pitch_r + t * pitch_t] = t < D && row < have ? src[row * D + t] : 0.f;
    }
}

/* K^T [t][key] (pitch KP) of keys [0, have) of src (row pitch D), zeros for t >= D and keys >= have, t < DP: lanes
 * across keys, so the transposing stores are conflict-free at a pitch of four keys' multiple; a thread's loads are in
 * flight at once. Ends without a barrier. */
template <int DP, int KP, bool FRESH>
__device__ __forceinline__ void stage_kt(float *dst, const float *src, int D, int have) {
    const int tid = stage_tid<FRESH>();
    static_assert(DP * KB % (4 * NT) == 0, "whole passes");
    if (D == DP) { /* float4 along t (16-byte aligned: rows of DP floats) */
#pragma unroll
        for (int it = 0; it < DP * KB / (4 * NT); it++) {
            const int e = it * NT + tid, key = e % KB, t = e / KB * 4;
            const float4 x = key < have ? *(const float4 *)(src + (int64_t)key * D + t) : make_float4(0.f, 0.f, 0.f, 0.f);
            float *d = dst + t * KP + key;
            d[0] = x.x, d[KP] = x.y, d[2 * KP] = x.z, d[3 * KP] = x.w;
        }
        return;
    }
#pragma unroll 16
    for (int it = 0; it < DP * KB / NT; it++) {
        const int e = it * NT + tid, key = e % KB, t = e / KB;
        dst[t * KP + key] = t < D && key < have ? src[(int64_t)key * D + t] : 0.f;
    }
}

/* stage<DP, ROWS>(dst, 1, DP, ...) and stage_kt<DP, KP> as cp.async copies (common.cuh; zeros where `valid` is false):
 * the same values in the same places, landing while the CTA computes. The caller commits, waits and syncs. */
template <int DP, int ROWS, bool FRESH>
__device__ __forceinline__ void stage_rows_async(float *dst, const float *src, int D, int have) {
    const int tid = stage_tid<FRESH>();
    if (D == DP) { /* 16-byte copies (aligned as stage's float4 loads) */
#pragma unroll
        for (int it = 0; it < DP * ROWS / (4 * NT); it++) {
            const int e = it * NT + tid, t = e % (DP / 4) * 4, row = e / (DP / 4);
            cp_async_16(dst + row * DP + t, row < have ? src + (int64_t)row * D + t : src, row < have);
        }
        return;
    }
#pragma unroll 4
    for (int it = 0; it < DP * ROWS / NT; it++) {
        const int e = it * NT + tid, t = e % DP, row = e / DP;
        const bool ok = t < D && row < have;
        cp_async_4(dst + row * DP + t, ok ? src + (int64_t)row * D + t : src, ok);
    }
}
template <int DP, int KP, bool FRESH>
__device__ __forceinline__ void stage_kt_async(float *dst, const float *src, int D, int have) {
    const int tid = stage_tid<FRESH>();
    static_assert(KP % 32 == 4 && DP % 8 == 0 && KB == 64, "a warp's copies: 4 keys x 8 t, one bank each");
#pragma unroll 4
    for (int it = 0; it < DP * KB / NT; it++) { /* a warp: 8 consecutive t (a 32-byte sector) of 4 keys, whose
                                                * places t KP + key fall in 32 distinct banks (a warp of 32 keys
                                                * at one t, stage_kt's order, read 32 sectors a copy: the forward
                                                * 6% slower than with stage_kt, H200) */
        const int e = it * NT + tid, key = (e >> 3) & (KB - 1), t = (e >> 9) * 8 + (e & 7);
        const bool ok = t < D && key < have;
        cp_async_4(dst + t * KP + key, ok ? src + (int64_t)key * D + t : src, ok);
    }
}

/* The operands of one step of a product loop (the scores' over t, P.V's over keys): NA values at a (float4 loads,
 * 16-byte aligned) and NB at b, BS apart (one float4 where BS = 1 and NB = 4). */
template <int NA, int NB, int BS>
__device__ __forceinline__ void step_operands(float (&av)[NA], float (&bv)[NB], const float *a, const float *b) {
#pragma unroll
    for (int r4 = 0; r4 < NA / 4; r4++) {
        const float4 x = *(const float4 *)(a + 4 * r4);
        av[4 * r4] = x.x, av[4 * r4 + 1] = x.y, av[4 * r4 + 2] = x.z, av[4 * r4 + 3] = x.w;
    }
    if constexpr (BS == 1 && NB == 4) {
        const float4 x = *(const float4 *)b;
        bv[0] = x.x, bv[1] = x.y, bv[2] = x.z, bv[3] = x.w;
    } else {
#pragma unroll
        for (int j = 0; j < NB; j++) bv[j] = b[BS * j];
    }
}

/* One step, acc[r][j] = fmaf(av[r], bv[j], acc[r][j]), with the next step's operands (at an, bn) loaded first into
 * av, bv: in flight during the FMAs. */
template <int NA, int NB, int BS>
__device__ __forceinline__ void fma_step(float (&acc)[NA][NB], float (&av)[NA], float (&bv)[NB], const float *an,
                                         const float *bn) {
    float a2[NA], b2[NB];
    step_operands<NA, NB, BS>(a2, b2, an, bn);
#pragma unroll
    for (int r = 0; r < NA; r++)
#pragma unroll
        for (int j = 0; j < NB; j++) acc[r][j] = fmaf(av[r], bv[j], acc[r][j]);
#pragma unroll
    for (int r = 0; r < NA; r++) av[r] = a2[r];
#pragma unroll
    for (int j = 0; j < NB; j++) bv[j] = b2[j];
}

} // namespace emu_warp

#endif /* FADEV_EMU_FORWARD_WARP_CUH */
