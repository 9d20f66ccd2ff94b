/* Stages and rounding events: the bottom layer of the attention kernels, shared by the CPU (attention.h,
 * matmul.h) and the CUDA emulation (cuda/emu.cuh). Not public API; see docs/numerics.md.
 *
 * att_round(stage, x, stream, index) is one rounding event R_X(x): every stage is classified once as
 *   ATT_EXACT   fp64: rounding is the identity (for every mode), nothing is done;
 *   ATT_F32     fp32 under nearest-even: (double)(float)x, which is exactly IEEE's single rounding;
 *   ATT_RNE     other formats under nearest-even: an inline fast path for the normal range;
 *   ATT_GENERAL any other format or mode: fadev_round_one, drawing Philox bits when stochastic.
 * A stochastic event of stage `id` at (i, u, w) of head bh uses stream id + 32 * bh and index
 * ATT_INDEX(i, u, w). att_plan is what one forward call fixes before touching data: shapes, the 13
 * classified stages of its policy and the rounded constants; the CPU context (att_ctx) and the GPU's
 * (emu_ctx) both hold one, built by att_plan_init. Layers: stage <- matmul <- attention. */
#ifndef FADEV_STAGE_H
#define FADEV_STAGE_H

#include <stdint.h>

#include "fadev.h"
#include "round.h"

/* Stage ids of the stochastic-rounding counters (docs/numerics.md). */
enum att_stage_id {
    ATT_IN_Q = 0, ATT_IN_K = 1, ATT_IN_V = 2,
    ATT_SCORE_ACC = 3, ATT_SCORE_DOT = 4, ATT_SCORE_SCALED = 5,
    ATT_SOFTMAX_SUB = 6, ATT_SOFTMAX_EXP = 7, ATT_SUM_ACC = 8,
    ATT_STATS_AL = 9, ATT_STATS_ROWSUM = 10, ATT_STATS_LNEW = 11, ATT_STATS_LOG = 12, ATT_STATS_LSE = 13,
    ATT_RESCALE_DIFF = 14, ATT_RESCALE_ALPHA = 15,
    ATT_P = 16, ATT_PV_ACC = 17,
    ATT_OUT_ACC_AO = 18, ATT_OUT_ACC_PV = 19, ATT_OUT_ACC_SUM = 20, ATT_STATE_OUT = 21, ATT_STATE_STATS = 22,
    ATT_OUT = 23, ATT_OUT_ACC_DIV = 24
};

#define ATT_INDEX(i, u, w) (((uint64_t)(i) << 42) | ((uint64_t)(u) << 21) | (uint64_t)(w))
#define ATT_STREAM(id, bh) ((uint64_t)(id) + 32u * (uint64_t)(bh))

/* the shared helpers are not part of the module's exported C API */
#if defined(__GNUC__)
#define ATT_INTERNAL __attribute__((visibility("hidden")))
#else
#define ATT_INTERNAL
#endif

/* an event's inline part: forced inline on the CPU (the scalar products' inner loop), both sides in CUDA */
#ifdef __CUDACC__
#define ATT_EVENT FADEV_HD
#else
#define ATT_EVENT __attribute__((always_inline)) static inline
#endif

enum att_kind { ATT_EXACT = 0, ATT_F32 = 1, ATT_RNE = 2, ATT_GENERAL = 3 };

typedef struct att_stage {
    fadev_format fmt;
    int kind;      /* att_kind */
    int mode;      /* fadev_rounding */
    uint64_t seed; /* stochastic key */
    /* ATT_RNE (nearest-even, precision < 53): magnitudes whose bits lie in [lo_bits, hi_bits] (the normal
     * range up to `largest`) are rounded here by integer arithmetic on the float64 encoding, exactly as
     * fadev_round_one's normal branch does; everything else goes to fadev_round_one. */
    uint64_t lo_bits, hi_bits, half_m1, keep_mask;
    int shift;
} att_stage;

/* The general rounding event (any format and mode): fadev_round_one, with Philox bits when stochastic. */
ATT_EVENT double att_round_general(const att_stage *st, double x, uint64_t stream, uint64_t index) {
    uint64_t bits = st->mode == FADEV_ROUND_STOCHASTIC ? fadev_random53(st->seed, stream, index) : 0;
    return fadev_round_one(x, &st->fmt, st->mode, bits);
}

/* The classified fast paths of an event: 1 with *y = R(x) when one applies, else 0 (att_round_general's). */
ATT_EVENT int att_round_fast(const att_stage *st, double x, double *y) {
    if (st->kind == ATT_EXACT) {
        *y = x;
        return 1;
    }
    if (st->kind == ATT_F32) {
        *y = (double)(float)x;
        return 1;
    }
    if (st->kind == ATT_RNE) {
        uint64_t u = fadev_bits_of(x), a = u & 0x7FFFFFFFFFFFFFFFull;
        if (a == 0) { /* a zero is itself in every format, its sign kept (fadev_round_one's subnormal branch) */
            *y = x;
            return 1;
        }
        if (a - st->lo_bits <= st->hi_bits - st->lo_bits) {
            uint64_t r = (a + st->half_m1 + ((a >> st->shift) & 1)) & st->keep_mask;
            if (r <= st->hi_bits) {
                *y = fadev_double_of(r | (u ^ a));
                return 1;
            }
        }
    }
    return 0;
}

/* Exact maximum that propagates NaN (numpy.maximum). */
ATT_EVENT double att_max(double a, double b) {
    if (a != a || b != b) return a + b;
    return a >= b ? a : b;
}

/* What one forward call fixes before it reads data (the CPU's att_ctx and the GPU's emu_ctx hold one). */
typedef struct att_plan {
    fadev_attention_params pr;
    int64_t group;  /* heads / heads_kv */
    att_stage input, score_acc, score, softmax, sum_acc, stats, rescale, p, pv_acc, out_acc, state_out,
        state_stats, out;
    double c;       /* R_score(scale), or R_score(scale * log2 e) in the exp2 form */
    double c2;      /* R_stats(ln 2) */
    int exp2;       /* 1: E = exp2 */
    int qk_float;   /* score_acc is fp32 (nearest-even) and input x input products fit in fp32 */
    int pv_float;   /* pv_acc is fp32 (nearest-even) and p x input products fit in fp32 */
} att_plan;

#ifdef __cplusplus
extern "C" {
#endif

/* The same event kept out of line (att_round's slow path on the CPU). */
ATT_INTERNAL double att_round_slow(const att_stage *st, double x, uint64_t stream, uint64_t index);
/* 1 if f is a well-formed format (what fadev_format_make builds from its parameters). */
ATT_INTERNAL int att_valid_format(const fadev_format *f);
/* 1 if every finite value of f is a float32 value. */
ATT_INTERNAL int att_inside_fp32(const fadev_format *f);
/* The stage that rounds to f under the policy's rounding mode and seed, classified (att_kind). */
ATT_INTERNAL att_stage att_make_stage(const fadev_format *f, const fadev_policy *policy);
/* The shape and option checks of every attention entry point (CPU kernels, emulated and golden GPU kernels,
 * native kernels): sizes >= 1, 1 <= dim <= max_dim, heads % heads_kv == 0 (else FADEV_ERR_SHAPE), scale
 * finite, causal 0 or 1; with flash, also block_q, block_kv >= 1 and loop_order, normalize, exp_form in
 * range. FADEV_ERR_INVALID_ARGUMENT otherwise, *why (when why is not NULL) naming the failed check. */
ATT_INTERNAL fadev_status att_check_params(const fadev_attention_params *params, int max_dim, int flash,
                                           const char **why);
/* The policy's rounding mode (FADEV_ERR_INVALID_MODE) and formats (FADEV_ERR_INVALID_FORMAT), and the
 * stochastic counters' range (Nq, Nk < 2^21: FADEV_ERR_INVALID_ARGUMENT). */
ATT_INTERNAL fadev_status att_check_policy(const fadev_policy *policy, const fadev_attention_params *params);
/* Classifies the policy's stages and rounds the constants for `params` (exp2: the exp2 form's). */
ATT_INTERNAL void att_plan_init(att_plan *plan, const fadev_attention_params *params, const fadev_policy *policy,
                                int exp2);

#ifdef __cplusplus
}
#endif

#ifndef __CUDACC__
/* One rounding event on the CPU: the fast paths inline, the rest out of line. */
ATT_EVENT double att_round(const att_stage *st, double x, uint64_t stream, uint64_t index) {
    double y;
    if (att_round_fast(st, x, &y)) return y;
    return att_round_slow(st, x, stream, index);
}
#endif

#endif /* FADEV_STAGE_H */
