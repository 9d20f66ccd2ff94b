/* Internal helpers shared by baseline.c and flash.c (not public API; see docs/numerics.md).
 *
 * att_round(stage, x, stream, index) is one rounding event R_X(x): every stage is classified once as
 *   ATT_EXACT   fp64: rounding is the identity (for every mode), nothing is done;
 *   ATT_F32     fp32 under nearest-even: (double)(float)x, which is exactly IEEE's single rounding;
 *   ATT_RNE     other formats under nearest-even: an inline fast path for the normal range;
 *   ATT_GENERAL any other format or mode: fadev_round_one, drawing Philox bits when stochastic.
 * A stochastic event of stage `id` at (i, u, w) of head bh uses stream id + 32 * bh and index
 * ATT_INDEX(i, u, w). att_ctx holds the rounded inputs (padded so the SIMD kernels can read whole
 * tiles) and att_scores / att_pv compute the two dot-product families of attention:
 *   scores  s = R_score(c * R_score(acc)), acc = R_score_acc(acc + Q[i,t] K[j,t]), t = 0..D-1
 *   P.V     acc = R_pv_acc(acc + P[j] V[j,d]), j ascending
 * with three interchangeable tiers that give the same bits: scalar rounding (any policy), fp64 vectors
 * (fp64 accumulators; fp32 accumulators rounded by a float conversion after every add), and float32
 * vectors when the products are provably exact in fp32 (see attention.c). */
#ifndef FADEV_ATTENTION_H
#define FADEV_ATTENTION_H

#include <math.h>
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

/* The general rounding event (any format and mode), kept out of line. */
ATT_INTERNAL double att_round_slow(const att_stage *st, double x, uint64_t stream, uint64_t index);

__attribute__((always_inline)) static inline double att_round(const att_stage *st, double x, uint64_t stream,
                                                              uint64_t index) {
    if (st->kind == ATT_EXACT) return x;
    if (st->kind == ATT_F32) return (double)(float)x;
    if (st->kind == ATT_RNE) {
        uint64_t u = fadev_bits_of(x), a = u & 0x7FFFFFFFFFFFFFFFull;
        if (a - st->lo_bits <= st->hi_bits - st->lo_bits) {
            uint64_t r = (a + st->half_m1 + ((a >> st->shift) & 1)) & st->keep_mask;
            if (r <= st->hi_bits) return fadev_double_of(r | (u ^ a));
        }
    }
    return att_round_slow(st, x, stream, index);
}

/* Exact maximum that propagates NaN (numpy.maximum). */
static inline double att_max(double a, double b) {
    if (a != a || b != b) return a + b;
    return a >= b ? a : b;
}

typedef struct att_ctx {
    fadev_attention_params pr;
    int64_t group;  /* heads / heads_kv */
    att_stage input, score_acc, score, softmax, sum_acc, stats, rescale, p, pv_acc, out_acc, state_out,
        state_stats, out;
    double c;       /* R_score(scale), or R_score(scale * log2 e) in the exp2 form */
    double c2;      /* R_stats(ln 2) */
    int exp2;       /* 1: E = exp2 */
    /* Rounded inputs. q: (B*H, q_rows, D), rows past seq_q are zero. kt: K transposed per head,
     * (B*Hkv, D, kt_cols), columns past seq_kv zero. v: (B*Hkv, seq_kv, d_pad), columns past D zero.
     * qf, ktf, vf: the same as float32, present only when the float tier can be used. */
    int64_t q_rows, kt_cols, d_pad;
    double *q, *kt, *v;
    float *qf, *ktf, *vf;
    /* per K/V head: smallest nonzero and largest magnitude, and 1 if every value is finite */
    double *k_min, *k_max, *v_min, *v_max;
    int *k_finite, *v_finite;
    int qk_float;   /* score_acc is fp32 (nearest-even) and input x input products fit in fp32 */
    int pv_float;   /* pv_acc is fp32 (nearest-even) and p x input products fit in fp32 */
} att_ctx;

/* Checks params and policy (flash: 1 also checks tiles and enums). */
ATT_INTERNAL fadev_status att_validate(const double *q, const double *k, const double *v, const double *out,
                          const fadev_attention_params *params, const fadev_policy *policy, int flash);
/* Classifies stages, computes constants, allocates and fills the rounded inputs. */
ATT_INTERNAL fadev_status att_init(att_ctx *cx, const double *q, const double *k, const double *v,
                      const fadev_attention_params *params, const fadev_policy *policy, int exp2);
ATT_INTERNAL void att_free(att_ctx *cx);

/* Number of keys j0..j0+n-1 that query row i sees (a prefix of the range). */
static inline int64_t att_visible(const att_ctx *cx, int64_t i, int64_t j0, int64_t n) {
    if (!cx->pr.causal) return n;
    int64_t last = i + cx->pr.seq_kv - cx->pr.seq_q; /* largest visible key */
    int64_t count = last - j0 + 1;
    return count < 0 ? 0 : count > n ? n : count;
}

static inline double att_exp(const att_ctx *cx, double x) { return cx->exp2 ? exp2(x) : exp(x); }

/* Round n up to a multiple of m. */
static inline int64_t att_round_up(int64_t n, int64_t m) { return (n + m - 1) / m * m; }

/* Scratch rows needed by att_scores / att_pv for nr query rows, and the score row stride for n keys. */
static inline int64_t att_rows(int64_t nr) { return att_round_up(nr, 4); }
static inline int64_t att_score_ld(int64_t n) { return att_round_up(n, 16); }

/* s[r * lds + jj] = s_j of query row i0 + r (head bh) and key j0 + jj, for jj < nvis[r], r < nr.
 * s needs att_rows(nr) rows of lds >= att_score_ld(max nvis) doubles; fbuf att_rows(nr) * lds floats.
 * Other entries of s are overwritten with unspecified values. */
ATT_INTERNAL void att_scores(const att_ctx *cx, int64_t bh, int64_t i0, int64_t nr, const int64_t *nvis, int64_t j0,
                double *s, int64_t lds, float *fbuf);

/* pv[r * ldo + d] = P.V of row i0 + r over keys j0 .. j0 + nvis[r] - 1 (P[r * ldp + jj], pv_acc), for
 * d < D. pv needs att_rows(nr) rows of ldo >= d_pad doubles; pbuf att_rows(nr) * ldp floats. */
ATT_INTERNAL void att_pv(const att_ctx *cx, int64_t bh, int64_t i0, int64_t nr, const int64_t *nvis, int64_t j0,
            const double *p, int64_t ldp, double *pv, int64_t ldo, float *pbuf);

#endif /* FADEV_ATTENTION_H */
