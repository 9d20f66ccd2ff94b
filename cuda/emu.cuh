/* The emulated-precision machinery shared by emu_forward.cu and emu_backward.cu: the GPU twin of
 * csrc/attention.h. One rounding event R_X(x) on the device is emu_round(stage, x, stream, index): the same
 * classification as att_round (exact fp64 / fp32 under nearest-even / the inline normal-range bit trick /
 * fadev_round_one with Philox bits) with the same fadev_round_one (csrc/round.h, compiled for both), so
 * every event rounds exactly as on the CPU. Arithmetic is fp64 unfused (nvcc --fmad=false); the fp32 tier
 * of the dot products (products exact in fp32, accumulator fp32 nearest-even) gives the same bits as the
 * fp64-then-round spec by the double-rounding theorem (53 >= 2*24 + 2), as the CPU's float tier.
 * exp, exp2 and log are CUDA's fp64 functions (libdevice), which may differ from glibc's in the last fp64
 * bit; the value is then rounded to the stage's format, so results differ from the CPU only when that
 * last bit decides the rounding, or when the stage is fp64 (docs/numerics.md, "GPU"). */
#ifndef FADEV_EMU_CUH
#define FADEV_EMU_CUH

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "common.cuh"

extern "C" {
#include "../csrc/attention.h"
}

/* Per K/V head magnitudes of the rounded inputs (as att_ctx's k_min ... v_finite): smallest nonzero and
 * largest magnitude as fp64 bit patterns (ordered like the values), and 1 if every value is finite. */
struct emu_mag {
    unsigned long long min_bits, max_bits;
    int finite;
};

/* Everything a kernel needs, passed by value: the plan (stage.h: shapes, stages, constants, built by
 * att_plan_init exactly as the CPU's att_init builds it) and the rounded inputs in device memory: q (B, H, Nq, D),
 * k and v (B, Hkv, Nk, D) as fp64, and as fp32 copies (qf, kf, vf) when the policy allows the float tier. */
struct emu_ctx : att_plan {
    const double *q, *k, *v;
    const float *qf, *kf, *vf;
    const emu_mag *qmag;        /* per query head */
    const emu_mag *kmag, *vmag; /* per K/V head */
    unsigned *ticket; /* the call's work counter, 0 once emu_prepare's rounding kernel ran: a persistent kernel's CTAs
                       * draw their next unit from it (emu_forward_warp_grid.cuh) */
};

/* The general rounding (other formats, stochastic rounding, values off the fast paths' range) out of line. */
static __device__ __noinline__ double emu_round_general(const att_stage *st, double x, uint64_t stream, uint64_t index) {
    return att_round_general(st, x, stream, index);
}

/* One rounding event, bit-identical to att_round (the same fast paths and fadev_round_one, stage.h). LEAN keeps the
 * general path out of line: a kernel whose loops are rounding events (the baseline's rows kernel: 128 registers and
 * spills with it inlined, 64 without) then does not pay fadev_round_one's registers in every loop; where a kernel
 * keeps many values live across the events (the generic pair and forward kernels), the call's saved registers cost
 * more, so it is a choice per kernel. */
template <bool LEAN = false>
__device__ __forceinline__ double emu_rnd(const att_stage &st, double x, uint64_t stream, uint64_t index) {
    double y;
    if (att_round_fast(&st, x, &y)) return y;
    return LEAN ? emu_round_general(&st, x, stream, index) : att_round_general(&st, x, stream, index);
}

__device__ __forceinline__ double emu_round(const att_stage &st, double x, uint64_t stream, uint64_t index) {
    return emu_rnd<false>(st, x, stream, index);
}

__device__ __forceinline__ double emu_exp(int exp2_form, double x) { return exp2_form ? exp2(x) : exp(x); }

/* CUDA's fp64 exp and exp2 (libdevice as nvcc 13.0 inlines them: the PTX of exp(x) and exp2(x)), transcribed operation
 * for operation, so every result has the same bits as emu_exp's (fadev_cuda_exp_check compares the two for every fp32
 * input, the values the fast kernels' softmax terms take). What differs is where the constants live: libdevice's are
 * immediates, which ptxas moves into uniform registers at every call (22 UMOVs of 51 instructions in the fast forward's
 * term loop, ncu); here they are in constant memory, which DFMA reads as an operand. Reduction: exp2 x = n + f
 * (n = rint x by the 1.5 * 2^52 trick), r = f ln2 in two parts; exp: n = rint(x log2 e), r = x - n ln2 in two parts;
 * then e^r by a degree-12 polynomial (Horner), scaled by 2^n in the exponent field; |x| near or past the range
 * (the high word, read as a float, at least 0x1.1fep+2 (exp2) or 0x1.0c4656p+2 (exp)) as libdevice's own path.
 * k: the constants, emu_exp_k. */
static __constant__ double emu_exp_k[16] = {
    0x1.8p52, -0x1.8p52, 0x1.62e42fefa39efp-1, 0x1.abc9e3b39803fp-56, 0x1.71547652b82fep+0, 0x1.ade1569ce2bdfp-26,
    0x1.28af3fca213eap-22, 0x1.71dee62401315p-19, 0x1.a01997c89eb71p-16, 0x1.a01a014761f65p-13,
    0x1.6c16c1852b7afp-10, 0x1.1111111122322p-7, 0x1.55555555502a1p-5, 0x1.5555555555511p-3,
    0x1.000000000000bp-1, 0x1.0000000000000p+0};

/* emu_exp_fast's reduction and polynomial: e^r (or 2^f) before the scaling by 2^n, and n. Where
 * emu_exp_in_range(exp2_form, x) holds, emu_exp_fast(x) is emu_exp_scaled(p, n); a loop that tests the range once
 * for many values calls these two, without a branch each. */
__device__ __forceinline__ double emu_exp_poly(int exp2_form, double x, const double *k, int &n) {
    double r, nd;
    if (exp2_form) {
        const double t = __dadd_rn(x, k[0]);
        n = __double2loint(t);
        nd = __dadd_rn(t, k[1]);
        const double f = __dsub_rn(x, nd);
        r = __fma_rn(f, k[2], __dmul_rn(f, k[3]));
    } else {
        const double t = __fma_rn(x, k[4], k[0]);
        n = __double2loint(t);
        nd = __dadd_rn(t, k[1]);
        r = __fma_rn(nd, -k[2], x);
        r = __fma_rn(nd, -k[3], r);
    }
    double p = __fma_rn(k[5], r, k[6]);
#pragma unroll
    for (int c = 7; c <= 15; c++) p = __fma_rn(p, r, k[c]);
    return __fma_rn(p, r, k[15]);
}

/* True where emu_exp_fast(x) is emu_exp_scaled of emu_exp_poly's (the high word, read as a float, below the bound);
 * false near or past the range and for NaN. */
__device__ __forceinline__ bool emu_exp_in_range(int exp2_form, double x) {
    return fabsf(__int_as_float(__double2hiint(x))) < (exp2_form ? 0x1.1fep+2f : 0x1.0c4656p+2f);
}

__device__ __forceinline__ double emu_exp_scaled(double p, int n) {
    return __hiloint2double(__double2hiint(p) + (n << 20), __double2loint(p));
}

__device__ __forceinline__ double emu_exp_fast(int exp2_form, double x, const double *k = emu_exp_k) {
    int n;
    const double p = emu_exp_poly(exp2_form, x, k, n);
    const int lo = __double2loint(p), hi = __double2hiint(p), xhi = __double2hiint(x);
    double y = __hiloint2double(hi + (n << 20), lo);
    const float ax = fabsf(__int_as_float(xhi));
    if (!emu_exp_in_range(exp2_form, x)) {
        if (exp2_form) y = fabs(x) > INFINITY || x != x ? __dadd_rn(x, x) : xhi < 0 ? 0.0 : INFINITY;
        else y = x < 0 ? 0.0 : __dadd_rn(x, INFINITY);
        if (ax < (exp2_form ? 0x1.2198p+2f : 0x1.0e9p+2f)) {
            const int h = (n + (int)((unsigned)n >> 31)) >> 1;
            const double a = __hiloint2double(hi + (h << 20), lo), b = __hiloint2double(((n - h) << 20) + 0x3FF00000, 0);
            y = __dmul_rn(a, b);
        }
    }
    return y;
}

/* 4-5 of a flash block jb for row i (row_softmax): from the row's m, l, its new maximum m_new and the block's row
 * sum, the new l (lnew) and the factor the O update multiplies O by (alpha, or alpha l when eager). LEAN as
 * emu_rnd's. */
template <bool LEAN>
__device__ __forceinline__ void emu_row_stats(const att_plan &cx, int64_t bh, int64_t i, int64_t jb, double m,
                                              double m_new, double l, double rsum, double &lnew, double &factor) {
    const uint64_t idx = ATT_INDEX(i, jb, 0);
    double alpha = 0;
    if (m != -INFINITY) {
        const double diff = emu_rnd<LEAN>(cx.rescale, m - m_new, ATT_STREAM(ATT_RESCALE_DIFF, bh), idx);
        alpha = emu_rnd<LEAN>(cx.rescale, emu_exp(cx.exp2, diff), ATT_STREAM(ATT_RESCALE_ALPHA, bh), idx);
    }
    const double a_l = emu_rnd<LEAN>(cx.stats, alpha * l, ATT_STREAM(ATT_STATS_AL, bh), idx);
    const double rs = emu_rnd<LEAN>(cx.stats, rsum, ATT_STREAM(ATT_STATS_ROWSUM, bh), idx);
    lnew = emu_rnd<LEAN>(cx.stats, a_l + rs, ATT_STREAM(ATT_STATS_LNEW, bh), idx);
    factor = cx.pr.normalize == FADEV_EAGER ? a_l : alpha;
}

/* Number of keys j0..j0+n-1 that query row i sees (a prefix of the range), as att_visible. */
__device__ __forceinline__ int64_t emu_visible(const fadev_attention_params &pr, int64_t i, int64_t j0, int64_t n) {
    if (!pr.causal) return n;
    int64_t count = i + pr.seq_kv - pr.seq_q - j0 + 1;
    return count < 0 ? 0 : count > n ? n : count;
}

/* K/V head (b * heads_kv + g) that query head bh = b * heads + h reads. */
__device__ __forceinline__ int64_t emu_kv_head(const emu_ctx &cx, int64_t bh) {
    return (bh / cx.pr.heads) * cx.pr.heads_kv + (bh % cx.pr.heads) / cx.group;
}

/* 1 if every product of two factors with these magnitudes (smallest nonzero, largest) is exact in fp32:
 * no underflow below 2^-126, no overflow (att_mm_tier's test). */
__device__ __forceinline__ int emu_products_fit_f32(double amin, double amax, double bmin, double bmax) {
    return amin * bmin >= 0x1p-126 && amax * bmax < 0x1p128;
}

__device__ __forceinline__ double emu_mag_min(const emu_mag &m) { return fadev_double_of(m.min_bits); }
__device__ __forceinline__ double emu_mag_max(const emu_mag &m) { return fadev_double_of(m.max_bits); }

/* The records' starting values (no value seen yet), set on the device (no host copy, no synchronisation): the
 * backward's records of Q and dO (emu_mag_flush's atomics; the inputs' rounding needs none, emu_inputs.cu). */
static __global__ void emu_mag_reset_kernel(emu_mag *m, int64_t n) {
    for (int64_t x = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; x < n; x += (int64_t)gridDim.x * blockDim.x)
        m[x] = emu_mag{0x7FF0000000000000ull, 0, 1};
}

/* Folds one value into a thread's running magnitudes (mag_add's rules on the fp64 bits). */
__device__ __forceinline__ void emu_mag_put(unsigned long long &lo, unsigned long long &hi, int &finite, double x) {
    const unsigned long long m = fadev_bits_of(x) & 0x7FFFFFFFFFFFFFFFull;
    if (m >= 0x7FF0000000000000ull) finite = 0;
    else if (m) lo = m < lo ? m : lo, hi = m > hi ? m : hi;
}

/* The warp's magnitudes reduced by shuffles: every lane ends with the warp's. Every lane of the warp calls it. */
__device__ __forceinline__ void emu_mag_reduce_warp(unsigned long long &lo, unsigned long long &hi, int &finite) {
    for (int o = 16; o > 0; o >>= 1) {
        const unsigned long long lo2 = __shfl_xor_sync(0xFFFFFFFFu, lo, o), hi2 = __shfl_xor_sync(0xFFFFFFFFu, hi, o);
        lo = lo2 < lo ? lo2 : lo, hi = hi2 > hi ? hi2 : hi;
    }
    finite = __all_sync(0xFFFFFFFFu, finite);
}

/* The block's magnitudes reduced: each warp's, then shared memory; thread 0 ends with the block's, the others with
 * their warp's. Every thread of the block calls it (it synchronises the block). */
__device__ __forceinline__ void emu_mag_reduce_block(unsigned long long &lo, unsigned long long &hi, int &finite) {
    __shared__ unsigned long long lo_w[32], hi_w[32];
    __shared__ int finite_w[32];
    emu_mag_reduce_warp(lo, hi, finite);
    const unsigned warp = threadIdx.x / 32, warps = (blockDim.x + 31) / 32;
    __syncthreads(); /* an earlier call's reads of lo_w ... are done */
    if (threadIdx.x % 32 == 0) lo_w[warp] = lo, hi_w[warp] = hi, finite_w[warp] = finite;
    __syncthreads();
    if (threadIdx.x) return;
    for (unsigned w = 1; w < warps; w++) {
        lo = lo_w[w] < lo ? lo_w[w] : lo, hi = hi_w[w] > hi ? hi_w[w] : hi;
        finite &= finite_w[w];
    }
}

/* The block's magnitudes into *rec (emu_mag_reset_kernel's starting values): one atomic per block. One atomic per
 * thread, or per warp, is what it replaces: the records of all heads share a few L2 lines, and their atomics
 * serialised there (0.76 ms a call at B 8, H 8, N 1024, D 64 on an H200, a third of the emulated Llama step;
 * torch.profiler, benchmarks/README.md). */
__device__ __forceinline__ void emu_mag_flush(emu_mag *rec, unsigned long long lo, unsigned long long hi, int finite) {
    emu_mag_reduce_block(lo, hi, finite);
    if (threadIdx.x) return;
    atomicMin(&rec->min_bits, lo);
    atomicMax(&rec->max_bits, hi);
    if (!finite) atomicAnd(&rec->finite, 0);
}

/* One accumulation step acc = R_acc(acc + a * b) of a dot product whose accumulator stage is not ATT_EXACT or
 * ATT_F32 (those have their own loops), with the event's counter. */
__device__ __forceinline__ double emu_mac(const att_stage &acc_stage, double acc, double a, double b,
                                         uint64_t stream, uint64_t index) {
    return emu_round(acc_stage, acc + a * b, stream, index);
}

/* Host side (emu_inputs.cu): builds the context (stages classified by the CPU's att_make_stage, constants as
 * att_init) and rounds the inputs on the device (events 0, 1, 2 with the CPU's counters), with per-K/V-head
 * magnitudes. `exp2` selects the exp2 form's constants. `fp64`: write the fp64 rounded copies (cx->q, k, v) always;
 * 0 (the forward): only where the fast forward cannot take the call (emu_fast_forward_ok), else they are null and
 * the generic forward, which then computes only the heads the fast kernels leave, reads the fp32 copies (the same
 * values: the fast path's inputs are fp32 values). Validation is the caller's (att_validate first). The buffers
 * live in `store` until it is destroyed. */
struct emu_inputs {
    device_arena mem; /* q, k, v, their fp32 copies and the magnitudes */
};
fadev_status emu_prepare(emu_ctx *cx, emu_inputs *store, const double *q, const double *k, const double *v,
                         const fadev_attention_params *params, const fadev_policy *policy, int exp2, int fp64);

/* Grid of `n` items in blocks of `threads`, capped to what a 1-D grid holds (kernels stride over the rest). */
static inline unsigned emu_blocks(size_t n, unsigned threads) {
    size_t b = (n + threads - 1) / threads;
    return (unsigned)(b > 1u << 30 ? 1u << 30 : (b ? b : 1));
}

/* 1 if query head bh and its K/V head bhk hold only finite rounded inputs (the magnitudes emu_prepare recorded).
 * The forward's fast path needs finite inputs; each CTA of either path reads this on the device, so the choice
 * costs the host no read-back (no synchronisation): a head is computed by exactly one of the two launches. */
__device__ __forceinline__ int emu_head_finite(const emu_ctx &cx, int64_t bh, int64_t bhk) {
    return cx.qmag[bh].finite && cx.kmag[bhk].finite && cx.vmag[bhk].finite;
}

/* How a stage rounds a value that is an fp32 value (the fast kernels' stages between fp32 operations): the event on
 * its fp64 value, the identity (an fp32 stage), or IEEE bf16 / fp16 nearest-even done on the fp32 encoding (the same
 * value: the same format, subnormals, ties and overflow). */
enum flt_kind { FLT_EVENT = 0, FLT_F32 = 1, FLT_BF16 = 2, FLT_F16 = 3 };

/* The flt_kind of a stage (host side). */
static inline int flt_kind_of(const att_stage &st) {
    if (st.kind == ATT_F32) return FLT_F32;
    const fadev_format &f = st.fmt;
    const int ieee = st.kind == ATT_RNE && f.subnormals && f.has_inf && f.overflow == FADEV_OVERFLOW_INF;
    if (ieee && f.precision == 8 && f.emin == -126 && f.emax == 127 && f.largest == 0x1.FEp127) return FLT_BF16;
    if (ieee && f.precision == 11 && f.emin == -14 && f.emax == 15 && f.largest == 65504.0) return FLT_F16;
    return FLT_EVENT;
}

/* The lean kernels' kinds: 1 | the flt_kind of stage k in two bits from bit 2 + 2k, or 0 when one has none
 * (n <= 14). */
static inline int flt_kinds_of(const att_stage *const *st, int n) {
    int kinds = 1;
    for (int k = 0; k < n; k++) {
        const int fk = flt_kind_of(*st[k]);
        if (fk == FLT_EVENT) return 0;
        kinds |= fk << (2 + 2 * k);
    }
    return kinds;
}

/* The kind of stage k in flt_kinds_of's packing. */
__host__ __device__ __forceinline__ int flt_kind_at(int kinds, int k) { return kinds >> (2 + 2 * k) & 3; }

/* R(x) of an fp32 value x for a stage of kind fk other than FLT_EVENT (a NaN x: a NaN, its payload not part of the
 * spec). bf16 and fp16: the hardware's nearest-even conversions (subnormals, ties and overflow to inf as the formats'
 * own rounding; fadev_cuda_round_check compares them with the rule on the encoding for every fp32 input): bf16's the
 * packed cvt.rn.bf16x2.f32 (F2FP; the single conversion is F2F, the slower pipe) and a shift, two instructions where
 * the rule, (u + 0x7FFF + lsb) & 0xFFFF0000 behind a NaN test, took six. Both computed and one selected: with a
 * branch on a kind read at run time, ptxas duplicated whole unrolled blocks per kind (fa2's backward pair kernel
 * 3,656 -> 18,496 instructions); so, every kernel is smaller than with the rule (sm_90 SASS). */
__device__ __forceinline__ float flt_round(int fk, float x) {
    const float b = __low2float(__floats2bfloat162_rn(x, 0.f)), h = __half2float(__float2half_rn(x));
    return fk == FLT_F32 ? x : fk == FLT_BF16 ? b : h;
}

/* R(x) of an fp64 value x for a stage of kind fk other than FLT_EVENT, as one event at that stage gives it: an fp32
 * stage converts; bf16 and fp16 round x to odd at fp32 first (truncate, then set the last bit if inexact), whose
 * nearest-even rounding to a format of p <= 22 bits with fp32's or a narrower exponent range is x's own (round to
 * odd with 24 >= p + 2 bits; subnormals, ties and overflow to inf included), then round that fp32 value. */
__device__ __forceinline__ float dbl_round(int fk, double x) {
    if (fk == FLT_F32) return __double2float_rn(x);
    float f = __double2float_rz(x);
    if ((double)f != x && f == f) f = __uint_as_float(__float_as_uint(f) | 1u);
    return flt_round(fk, f);
}

/* The forward's fast path (emu_forward_fast.cu): whether it applies to this plan and policy (fp32 FMA chains exact,
 * the intermediate values fp32 values; FADEV_EMU_GENERIC=1 in the environment turns it off), and the launch, whose
 * CTAs compute the heads whose inputs are finite (emu_head_finite; the generic launch the others). Same bits as the
 * generic kernels. */
int emu_fast_forward_ok(const emu_ctx &cx, const fadev_policy *pol);
fadev_status emu_fast_forward(const emu_ctx &cx, double *out, double *lse, int baseline);

#endif /* FADEV_EMU_CUH */
