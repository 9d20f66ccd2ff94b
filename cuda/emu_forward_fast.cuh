/* The emulated forward's fast kernels (emu_forward_fast.cu: the baseline, and flash blocks of more than 64 keys;
 * emu_forward_warp.cu: flash blocks of up to 64 keys) share their arguments and every per-element and per-row
 * step of the spec here, so the two schedules cannot drift apart: a score's rounding, a softmax term, P, the
 * row statistics, the O update and the written output. Why each step gives the generic kernels' bits: the
 * comment at the top of emu_forward_fast.cu and docs/numerics.md ("The fp32 FMA path"). */
#ifndef FADEV_EMU_FORWARD_FAST_CUH
#define FADEV_EMU_FORWARD_FAST_CUH

#include <type_traits>

#include "emu.cuh"

namespace emu_fwd {

/* The lean kernels' stages (fast_lean), their indices in flt_kinds_of's packing; state_out only with kv_outer. */
enum { LK_SCORE, LK_SOFTMAX, LK_OUT_ACC, LK_P, LK_STATE_OUT, LK_N };

/* The lean kernels' softmax terms of bf16 or fp16 x <= 0 by x's magnitude bits, clamped to [lo, hi] (tab_term;
 * emu_exp_table.cu builds it); t NULL: computed. */
struct exp_tab {
    const unsigned short *t;
    int lo, hi;
};

/* The table for softmax kind fk (flt_kind) and exp form, built on this device at its first use; t NULL for other kinds
 * and with FADEV_EMU_EXP_TABLE=0 in the environment. */
fadev_status exp_table_of(int fk, int exp2_form, exp_tab &out);

/* The softmax term R_K(E(x)) of a value x <= 0 of format K (FLT_BF16 or FLT_F16) from the table: the same bits as
 * term_e of emu_exp_fast (emu_exp_table.cu). */
template <int K> __device__ __forceinline__ float tab_term(const exp_tab &tb, float x) {
    const int m = K == FLT_BF16 ? (int)(__float_as_uint(x) >> 16) & 0x7FFF
                                : (int)__half_as_ushort(__float2half_rn(x)) & 0x7FFF;
    const unsigned short h = __ldg(tb.t + min(max(m, tb.lo), tb.hi));
    return K == FLT_BF16 ? __uint_as_float((unsigned)h << 16) : __half2float(__ushort_as_half(h));
}

struct fast_args {
    emu_ctx cx;
    double *out, *lse;
    int64_t block_kv; /* flash: clamped to seq_kv; baseline: seq_kv */
    int64_t tiles;    /* CTAs per head */
    int64_t units;    /* the warp kernel's CTA work units (a CTA each, or grid-strided: s_keep) */
    float *s_keep;    /* the warp kernel's baseline: each resident CTA's scores of pass 0, read by passes 1 and 2
                       * (emu_forward_warp.cu); NULL: every pass computes them */
    int baseline;
    int pairing;      /* the causal baseline's warp kernel's units (emu_forward_warp_grid.cuh): PAIR_ constants */
    int p_kind;       /* how R_p rounds an fp32 value (flt_kind) */
    int so_kind;      /* flt_kind of state_out */
    int lean;         /* the lean kernel's stage kinds (fast_lean; flt_kinds_of's packing, LK_ order) */
    int o32;          /* out_acc is fp32 nearest-even and the stats and rescale stages' values are fp32 values: the
                       * O update's operations are on fp32 values and round once in fp32 (double rounding is
                       * innocuous for *, +, /) */
    /* The lean kernels' scaled score in fp32 (score_of with C32; docs/numerics.md): c12, c = cf has at most 13
     * significant bits and is an fp32 normal, so c times a bf16 or fp16 score (<= 11 bits: <= 24 together) is exact
     * in fp32 where the product is an fp32 normal, and R_score of the fp32 product is R_score of the fp64 one */
    float cf;
    int c12;
    exp_tab etab;     /* the warp kernel's softmax terms from a table (lean, softmax bf16 or fp16), else t NULL */
    int o16;          /* the lean kernels: out_acc is bf16 or fp16 (flt_kind) and the O update's factor and l are
                       * values of the same format: its operations in fp32, each rounded once more to that format
                       * (o_step); else 0 */
};

/* The arguments for a plan (host side). */
fast_args fast_args_of(const emu_ctx &cx, double *out, double *lse, int baseline, int rows_per_cta);

/* One rounding event with the general path out of line (emu_rnd<true>): the kernels' register blocks must not pay
 * for fadev_round_one's registers. */
__device__ __forceinline__ double rnd(const att_stage &st, double x, uint64_t stream, uint64_t idx) {
    return emu_rnd<true>(st, x, stream, idx);
}

/* R(x) of an fp32 value x for a stage of kind fk (flt_kind). */
__device__ __forceinline__ float r_flt(const att_stage &st, int fk, float x, uint64_t stream, uint64_t idx) {
    return fk == FLT_EVENT && x == x ? (float)rnd(st, (double)x, stream, idx) : flt_round(fk, x);
}

/* R(x) of an fp64 value for a stage whose values are fp32 values. */
__device__ __forceinline__ float r_dbl(const att_stage &st, double x, uint64_t stream, uint64_t idx) {
    if (st.kind == ATT_F32) return __double2float_rn(x);
    return (float)rnd(st, x, stream, idx);
}

/* s = R_score(c R_score(acc)) of score (i, j) from its fp32 chain acc: acc is an fp32 value, so for an fp32 stage
 * the inner rounding is the identity and the product c * acc is rounded once in fp32. K >= 0: the lean kernels'
 * score kind, known at compile time (the kernel dispatched on it); -1: read from the arguments. C32: the product in
 * fp32 where a.c12 allows (the baseline's warp kernels: naive's forward 2-4% faster, H100; in the flash kernels, which
 * fa2 and paper share, the code cost fa2 registers and 2-3%) */
__device__ __forceinline__ bool score_c32(const fast_args &a, int ks, float acc, float &s) { /* true: s is the value */
    const float p = __fmul_rn(a.cf, flt_round(ks, acc)); /* c r exact in fp32 where normal (a.c12) */
    s = flt_round(ks, p);
    return fabsf(p) >= 0x1p-126f; /* an overflow is inf in both; NaN: false */
}
template <bool LEAN, int K = -1, bool C32 = false>
__device__ __forceinline__ float score_of(const fast_args &a, float acc, int64_t bh, int64_t i, int64_t j) {
    const emu_ctx &cx = a.cx;
    if (K >= 0 ? K == FLT_F32 : cx.score.kind == ATT_F32) return __fmul_rn((float)cx.c, acc);
    if (LEAN) {
        const int ks = K >= 0 ? K : flt_kind_at(a.lean, LK_SCORE);
        float s;
        if (C32 && K != FLT_F32 && a.c12 && score_c32(a, ks, acc, s)) return s;
        return dbl_round(ks, cx.c * (double)flt_round(ks, acc)); /* acc is an fp32 value: dbl_round(ks, acc)'s */
    }
    const uint64_t idx = ATT_INDEX(i, j, 0);
    return (float)rnd(cx.score, cx.c * rnd(cx.score, (double)acc, ATT_STREAM(ATT_SCORE_DOT, bh), idx),
                      ATT_STREAM(ATT_SCORE_SCALED, bh), idx);
}

/* The softmax term's first event, x = R_softmax(s - m), an fp32 value (term_of). X32: a bf16 difference in fp32 where
 * the kernel measured faster so (the warp kernels at D <= 64, H100: paper bf16's causal forward 1.8% faster; at D 128 1-2%
 * slower, and an fp16 difference, whose rounding is two conversions, 1-3% slower) */
template <bool LEAN, int K = -1, bool X32 = false>
__device__ __forceinline__ float term_x(const fast_args &a, float s, double m, float mf, int64_t bh, int64_t i,
                                        int64_t j) {
    const emu_ctx &cx = a.cx;
    if (LEAN) { /* every event a conversion (dbl_round), no index */
        const int ksm = K >= 0 ? K : flt_kind_at(a.lean, LK_SOFTMAX);
        if constexpr (X32 && K == FLT_BF16) /* s and m values of K too (s: K the score stage's kind; m: a maximum of
                                             * such s, unless a kv_outer state rounded it): the fp32 difference
                                             * rounded to K is R_K(s - m), as the fp64 one (docs/numerics.md;
                                             * benchmarks/exhaustive_rounding.py's sums) */
            if (flt_kind_at(a.lean, LK_SCORE) == K && flt_round(K, mf) == mf) return flt_round(K, __fsub_rn(s, mf));
        return ksm == FLT_F32 ? __fsub_rn(s, mf) : dbl_round(ksm, (double)s - m);
    }
    /* s - m of two fp32 values: one fp32 rounding when the stage is fp32 (double rounding is innocuous) */
    return cx.softmax.kind == ATT_F32 ? __fsub_rn(s, mf)
                                      : (float)rnd(cx.softmax, (double)s - m, ATT_STREAM(ATT_SOFTMAX_SUB, bh),
                                                   ATT_INDEX(i, j, 0));
}

/* The term's second event, R_softmax(y) of y = E(x). */
template <bool LEAN, int K = -1>
__device__ __forceinline__ float term_e(const fast_args &a, double y, int64_t bh, int64_t i, int64_t j) {
    if (LEAN) return dbl_round(K >= 0 ? K : flt_kind_at(a.lean, LK_SOFTMAX), y);
    return r_dbl(a.cx.softmax, y, ATT_STREAM(ATT_SOFTMAX_EXP, bh), ATT_INDEX(i, j, 0));
}

/* The softmax term e = R_softmax(E(R_softmax(s - m))) of score (i, j); m (an fp32 value, or NaN / -inf) also as
 * the float mf. K: the lean kernels' softmax kind, as score_of's; E: 1 exp2, 0 exp, -1 cx.exp2. x is an fp32 value:
 * emu_exp_fast (CUDA's exp, the same bits for every fp32 input) with its constants from kk. */
template <bool LEAN, int K = -1, int E = -1>
__device__ __forceinline__ float term_of(const fast_args &a, float s, double m, float mf, int64_t bh, int64_t i,
                                         int64_t j, const double *kk = emu_exp_k) {
    const int e2 = E >= 0 ? E : a.cx.exp2;
    const float x = term_x<LEAN, K>(a, s, m, mf, bh, i, j);
    return term_e<LEAN, K>(a, emu_exp_fast(e2, (double)x, kk), bh, i, j);
}

/* dbl_round(fk, (double)e / l) of fp32 values e and l, for fk other than FLT_EVENT (the baseline's P = R_p(e / l)),
 * mostly in fp32: q = RN32(e / l) and its rounding to fk, unless q is a midpoint between two values of fk (then the
 * exact quotient, on one side of q, may round the other way) or |q| > 1 (past it, fk's overflow threshold would need
 * the same care; a softmax quotient is at most 1): then the fp64 division. Why it is the same value: every midpoint
 * of bf16 and fp16 is an fp32 value, and RN32 is monotone, so q and the exact quotient lie on the same side of every
 * midpoint that q is not; for fp32, fp64's 53 >= 2 * 24 + 2 bits make the double rounding innocuous. */
__device__ __forceinline__ float quot_round(int fk, float e, float l) {
    const float q = __fdiv_rn(e, l);
    if (fk == FLT_F32) return q;
    if (fabsf(q) <= 1.f) {
        if (fk == FLT_BF16) {
            if ((__float_as_uint(q) & 0xFFFFu) != 0x8000u) return flt_round(fk, q);
        } else { /* fp16: its neighbours below and above |q|, whose sum (12 bits) is exact in fp32 */
            const unsigned short h = __half_as_ushort(__float2half_rz(q));
            const float lo = __half2float(__ushort_as_half(h)), hi = __half2float(__ushort_as_half((unsigned short)(h + 1)));
            if (lo == q || lo + hi != 2.f * q) return flt_round(fk, q);
        }
    }
    return dbl_round(fk, (double)e / (double)l);
}

/* R_K(e / l) for K bf16 or fp16 (compile time), l an fp32 value and rl = RN32(1 / l) (__frcp_rn, once a row): the same
 * value as quot_round's, most often without a division. q0 = RN32(e rl) is two fp32 roundings from e / l, neither
 * underflowing where q0 >= 2^-125 (rl <= 1 / l's RN32 of a normal value), so |q0 - e / l| <= (2^-23 + 2^-48) e / l and
 * the exact quotient lies in [q0 (1 - 2^-21), q0 (1 + 2^-21)], whose bounds are rounded outwards. R_K (flt_round, nearest
 * even) is monotone: where it maps both bounds to one value, that value is R_K(e / l). Else (the quotient within
 * about 2^-20 of a midpoint of K: about one in 2^11 for bf16, 2^8 for fp16; or q0 tiny) quot_round. */
template <int K>
__device__ __forceinline__ bool quot_rcp_fast(float e, float rl, float &p) { /* true: p is the value; else quot_round */
    const float q0 = __fmul_rn(e, rl);
    const float lo = flt_round(K, __fmul_rd(q0, 1.f - 0x1p-21f)), hi = flt_round(K, __fmul_ru(q0, 1.f + 0x1p-21f));
    const bool zero = q0 == 0.f && e == 0.f; /* +0 / l: quot_round's +0 */
    p = zero ? 0.f : lo;
    return zero || (q0 >= 0x1p-125f && q0 <= 1.f && lo == hi);
}
template <int K>
__device__ __forceinline__ float quot_round_rcp(float e, float l, float rl) {
    float p;
    return quot_rcp_fast<K>(e, rl, p) ? p : quot_round(K, e, l);
}

/* f(std::integral_constant<int, 1>{}) for the exp2 form, else f(...<int, 0>{}): a loop's exp fixed at compile time. */
template <class F> __device__ __forceinline__ void with_exp(int exp2_form, F &&f) {
    if (exp2_form) f(std::integral_constant<int, 1>{});
    else f(std::integral_constant<int, 0>{});
}

/* P = R_p(e) of term (i, j). K: P's flt_kind known at compile time (a kind other than FLT_EVENT), or -1. */
template <bool LEAN, int K = -1>
__device__ __forceinline__ float p_of(const fast_args &a, float e, int64_t bh, int64_t i, int64_t j) {
    if (K >= 0) return flt_round(K, e);
    if (LEAN) return flt_round(a.p_kind, e);
    return r_flt(a.cx.p, a.p_kind, e, ATT_STREAM(ATT_P, bh), ATT_INDEX(i, j, 0));
}

/* f(std::integral_constant<int, K>{}) with K the flt_kind k when it is fp32, bf16 or fp16, else K = -1: a loop
 * written once runs with its stage's kind fixed at compile time (no per-element branches on it). */
template <class F> __device__ __forceinline__ void with_kind(int k, F &&f) {
    if (k == FLT_F32) f(std::integral_constant<int, FLT_F32>{});
    else if (k == FLT_BF16) f(std::integral_constant<int, FLT_BF16>{});
    else if (k == FLT_F16) f(std::integral_constant<int, FLT_F16>{});
    else f(std::integral_constant<int, -1>{});
}

/* One step of the row sum's chain, rsum = R_sum_acc(rsum + e), for a stage other than fp32 (an fp32 stage adds the
 * two fp32 values with __fadd_rn: one fp32 rounding, the spec's bits). */
__device__ __forceinline__ double sum_step(const fast_args &a, double rs, float e, int64_t bh, int64_t i, int64_t j) {
    return rnd(a.cx.sum_acc, rs + (double)e, ATT_STREAM(ATT_SUM_ACC, bh), ATT_INDEX(i, j, 0));
}

/* 4-5 of a block jb for row i (row_softmax), the general rounding out of line: emu.cuh's emu_row_stats. */
__device__ __forceinline__ void row_stats(const fast_args &a, int64_t bh, int64_t i, int64_t jb, double m,
                                          double m_new, double l, double rsum, double &lnew, double &factor) {
    emu_row_stats<true>(a.cx, bh, i, jb, m, m_new, l, rsum, lnew, factor);
}

/* The row's l kept after block jb (kv_outer rounds the state to state_stats between blocks). */
__device__ __forceinline__ double l_kept(const fast_args &a, double lnew, int64_t bh, int64_t i, int64_t jb) {
    if (a.cx.pr.loop_order != FADEV_KV_OUTER) return lnew;
    return rnd(a.cx.state_stats, lnew, ATT_STREAM(ATT_STATE_STATS, bh), ATT_INDEX(i, jb, 0));
}

/* The O update's form known at compile time: O_F32 for a.o32 (fp32 operations), O_N16 + k for a.o16 = k in the lean
 * kernels (bf16 or fp16 out_acc, its operations in fp32: o_step), or -1 (the kinds read at run time). */
constexpr int O_F32 = -2, O_N16 = 4;

/* f(std::integral_constant<int, K>{}) with K the O update's form (above): an unrolled O update compiled once per
 * form, without a per-element branch on it (paper's out_acc events, 2 R DC copies of them, were a tenth of its
 * forward's instructions and, branching on the kind, its instruction-cache misses). Forms no policy of the kernel
 * needs are not compiled into it: each form's 2 R DC copies lengthen the kernel (fa2's forward measured 2-4% slower
 * with paper's double-precision forms beside its own). */
template <bool LEAN, class F> __device__ __forceinline__ void with_o_form(const fast_args &a, F &&f) {
    if (a.o32) f(std::integral_constant<int, O_F32>{});
    else if constexpr (!LEAN) f(std::integral_constant<int, -1>{});
    else if (a.o16 == FLT_BF16) f(std::integral_constant<int, O_N16 + FLT_BF16>{});
    else if (a.o16 == FLT_F16) f(std::integral_constant<int, O_N16 + FLT_F16>{});
    else f(std::integral_constant<int, -1>{});
}

/* 7 (and 9) of block jb for element (i, d) (row_update): O from O, the block's P.V chain pv, the row's factor and
 * l_new. K: the O update's form (with_o_form), or -1. PLAIN: the caller has checked that the normalisation is
 * deferred and the loop order q_outer (fa2's and paper's), so the update has no branch on either. */
template <bool LEAN, int K = -1, bool PLAIN = false>
__device__ __forceinline__ float o_step(const fast_args &a, float o, float pv, double factor, double l_new,
                                        int64_t bh, int64_t i, int64_t jb, int d) {
    const emu_ctx &cx = a.cx;
    const int eager = !PLAIN && cx.pr.normalize == FADEV_EAGER, kv_outer = !PLAIN && cx.pr.loop_order == FADEV_KV_OUTER;
    if (K == O_F32 || (K == -1 && a.o32)) {
        float o_new = __fadd_rn(__fmul_rn((float)factor, o), pv);
        if (eager) o_new = __fdiv_rn(o_new, (float)l_new);
        if (kv_outer) o_new = r_flt(cx.state_out, a.so_kind, o_new, ATT_STREAM(ATT_STATE_OUT, bh), ATT_INDEX(i, jb, d));
        return o_new;
    }
    if constexpr (K >= O_N16) { /* the lean events below with o, factor and l_new values of the format k (a.o16):
                                 * a product or sum of two such values, or their quotient, rounded to fp32 and then
                                 * to k is its rounding to k (fp32's 24 bits >= 2 p + 2 for p <= 11: double rounding
                                 * is innocuous; benchmarks/exhaustive_rounding.py checks every pair), and the fp64
                                 * operations below round them to fp64 and then to k: the same values */
        constexpr int k = K - O_N16;
        const float scaled = flt_round(k, __fmul_rn((float)factor, o));
        float o_new = flt_round(k, __fadd_rn(scaled, flt_round(k, pv)));
        if (eager) o_new = flt_round(k, __fdiv_rn(o_new, (float)l_new));
        if (kv_outer) o_new = flt_round(flt_kind_at(a.lean, LK_STATE_OUT), o_new);
        return o_new;
    }
    if (LEAN) { /* the events below as conversions */
        const int koa = K >= 0 ? K : flt_kind_at(a.lean, LK_OUT_ACC);
        const double scaled = dbl_round(koa, factor * (double)o);
        double o_new = dbl_round(koa, scaled + (double)dbl_round(koa, (double)pv));
        if (eager) o_new = dbl_round(koa, o_new / l_new);
        if (kv_outer) o_new = dbl_round(flt_kind_at(a.lean, LK_STATE_OUT), o_new);
        return (float)o_new;
    }
    const att_stage &oa = cx.out_acc;
    const uint64_t idx = ATT_INDEX(i, jb, d);
    const double scaled = rnd(oa, factor * (double)o, ATT_STREAM(ATT_OUT_ACC_AO, bh), idx);
    const double part = rnd(oa, (double)pv, ATT_STREAM(ATT_OUT_ACC_PV, bh), idx);
    double o_new = rnd(oa, scaled + part, ATT_STREAM(ATT_OUT_ACC_SUM, bh), idx);
    if (eager) o_new = rnd(oa, o_new / l_new, ATT_STREAM(ATT_OUT_ACC_DIV, bh), idx);
    if (kv_outer) o_new = rnd(cx.state_out, o_new, ATT_STREAM(ATT_STATE_OUT, bh), idx);
    return (float)o_new;
}

/* The written output of element (i, d) (write_row): rows that saw no key get 0. */
__device__ __forceinline__ double out_of(const fast_args &a, float o, int seen, double l, int64_t bh, int64_t i, int d) {
    if (!seen) return 0.0;
    const int divide = !a.baseline && a.cx.pr.normalize != FADEV_EAGER;
    const double x = o;
    return rnd(a.cx.out, divide ? x / l : x, ATT_STREAM(ATT_OUT, bh), ATT_INDEX(i, d, 0));
}

/* lse of row i: m + log l in the stats stage (m scaled to natural log in the exp2 form), -inf for a row that saw
 * no key. */
__device__ __forceinline__ double lse_of(const fast_args &a, int seen, double m, double l, int64_t bh, int64_t i) {
    if (!seen) return -INFINITY;
    const emu_ctx &cx = a.cx;
    const uint64_t idx = ATT_INDEX(i, 0, 0), s13 = ATT_STREAM(ATT_STATS_LSE, bh);
    const double log_l = rnd(cx.stats, log(l), ATT_STREAM(ATT_STATS_LOG, bh), idx);
    if (cx.exp2) m = rnd(cx.stats, m * cx.c2, s13, ATT_INDEX(i, 0, 1));
    return rnd(cx.stats, m + log_l, s13, idx);
}

/* The forward with a warp per 8 or 16 query rows (emu_forward_warp.cu): whether it applies (the baseline, or flash
 * blocks of at most 64 keys), and its launch. */
int warp_forward_ok(const emu_ctx &cx, int baseline);
fadev_status warp_forward(const emu_ctx &cx, double *out, double *lse, int baseline);

} // namespace emu_fwd

#endif /* FADEV_EMU_FORWARD_FAST_CUH */
