/* Internal helpers shared by baseline.c, flash.c and the backward (not public API; see docs/numerics.md).
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
 * through att_mm_run (matmul.c), the block product C += A B that the backward's products use too, with
 * four interchangeable tiers that give the same bits: scalar rounding (any policy), fp64 vectors (fp64
 * accumulators; fp32 accumulators rounded by a float conversion after every add), and float32 vectors
 * when the products are provably exact in fp32 (att_mm_tier). */
#ifndef FADEV_ATTENTION_H
#define FADEV_ATTENTION_H

#include <float.h>
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

/* The general rounding event (any format and mode): fadev_round_one, with Philox bits when stochastic. */
__attribute__((always_inline)) static inline double att_round_general(const att_stage *st, double x,
                                                                       uint64_t stream, uint64_t index) {
    uint64_t bits = st->mode == FADEV_ROUND_STOCHASTIC ? fadev_random53(st->seed, stream, index) : 0;
    return fadev_round_one(x, &st->fmt, st->mode, bits);
}

/* The same, kept out of line (att_round's slow path). */
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
/* 1 if f is a well-formed format (what fadev_format_make builds from its parameters). */
ATT_INTERNAL int att_valid_format(const fadev_format *f);
/* 1 if every finite value of f is a float32 value. */
ATT_INTERNAL int att_inside_fp32(const fadev_format *f);
/* The stage that rounds to f under the policy's rounding mode and seed, classified (att_kind). */
ATT_INTERNAL att_stage att_make_stage(const fadev_format *f, const fadev_policy *policy);
/* Classifies stages, computes constants, allocates and fills the rounded inputs. */
ATT_INTERNAL fadev_status att_init(att_ctx *cx, const double *q, const double *k, const double *v,
                      const fadev_attention_params *params, const fadev_policy *policy, int exp2);
ATT_INTERNAL void att_free(att_ctx *cx);
/* calloc for the SIMD kernels' operands: the block starts on a 64-byte boundary (a cache line), so where
 * it lies in the heap cannot make every other vector load straddle two lines. Freed by att_free_lines. */
ATT_INTERNAL void *att_calloc_lines(size_t n, size_t size);
ATT_INTERNAL void att_free_lines(void *p);

/* Number of keys j0..j0+n-1 that query row i sees (a prefix of the range). */
static inline int64_t att_visible(const att_ctx *cx, int64_t i, int64_t j0, int64_t n) {
    if (!cx->pr.causal) return n;
    int64_t last = i + cx->pr.seq_kv - cx->pr.seq_q; /* largest visible key */
    int64_t count = last - j0 + 1;
    return count < 0 ? 0 : count > n ? n : count;
}

/* K/V head (b * heads_kv + g) that query head bh = b * heads + h reads. */
static inline int64_t att_kv_head(const att_ctx *cx, int64_t bh) {
    return (bh / cx->pr.heads) * cx->pr.heads_kv + (bh % cx->pr.heads) / cx->group;
}

static inline double att_exp(const att_ctx *cx, double x) { return cx->exp2 ? exp2(x) : exp(x); }

/* Round n up to a multiple of m. */
static inline int64_t att_round_up(int64_t n, int64_t m) { return (n + m - 1) / m * m; }

/* Scratch rows needed by att_scores for nr query rows, and the score row stride for n keys. */
static inline int64_t att_rows(int64_t nr) { return att_round_up(nr, 4); }
static inline int64_t att_score_ld(int64_t n) { return att_round_up(n, 16); }

/* Magnitude statistics of a set of values: smallest nonzero, largest, all finite. */
typedef struct mag { double min, max; int finite; } mag;
static inline void mag_add(mag *s, double x) {
    double a = fabs(x);
    if (!(a <= DBL_MAX)) s->finite = 0;
    else if (a > 0) {
        s->min = a < s->min ? a : s->min;
        s->max = a > s->max ? a : s->max;
    }
}
#define MAG_EMPTY ((mag){INFINITY, 0, 1})

/* ------------------------------------------------------------------ block products (matmul.c) */

enum att_mm_tier { ATT_MM_SCALAR, ATT_MM_F64, ATT_MM_F64_R32, ATT_MM_F32 };
/* how the term (row, k, col) of a product names its stochastic counter ATT_INDEX(i, u, w) */
enum att_mm_index { ATT_MM_ROW_COL_K, ATT_MM_K_ROW_COL, ATT_MM_ROW_K_COL };

/* C[r][col] += sum_k A[r][k] B[k][col], k ascending, accumulated in `acc`. */
typedef struct att_mm {
    int tier, index;      /* att_mm_tier, att_mm_index */
    int zero;             /* 1: C starts at 0 (its values are not read; needs kb == NULL in att_mm_run) */
    const att_stage *acc; /* scalar tier: accumulator stage, stream, absolute offsets of row, k, col */
    uint64_t stream;
    int64_t row0, k0, col0;
    const double *a, *b;  /* fp64 and scalar tiers */
    const float *af, *bf; /* float tier: the same values as float32 (same strides) */
    int64_t lda, ldb;
    double *c;
    int64_t ldc;
} att_mm;

/* Tier of a product accumulated in `acc` whose float tier is `possible` for these formats, given the
 * magnitudes of its two factors (smallest nonzero, largest, all finite). */
static inline int att_mm_tier(const att_stage *acc, int possible, double amin, double amax, int afin, double bmin,
                              double bmax, int bfin) {
    if (acc->kind == ATT_EXACT) return ATT_MM_F64;
    if (acc->kind != ATT_F32) return ATT_MM_SCALAR;
    int exact = possible && afin && bfin && amin * bmin >= 0x1p-126 && amax * bmax < 0x1p128;
    return exact ? ATT_MM_F32 : ATT_MM_F64_R32;
}

/* Row r < nrows of C sums k in [kb ? kb[r] : 0, ke ? ke[r] : k_end) ascending onto its current value (or 0).
 * The scalar tier computes ncol ? ncol[r] : ncols columns; the vector tiers att_round_up(ncols, 16) for
 * every row (C and B must hold them). Four rows advance together over the k they share. */
ATT_INTERNAL void att_mm_run(const att_mm *m, int64_t nrows, const int64_t *kb, const int64_t *ke, int64_t k_end,
                             const int64_t *ncol, int64_t ncols);

/* ------------------------------------------------------------------ attention pieces */

/* s[r * lds + jj] = s_j of query row i0 + r (head bh) and key j0 + jj, for jj < nvis[r], r < nr.
 * s needs att_rows(nr) rows of lds >= att_score_ld(max nvis) doubles; its other entries are overwritten
 * with unspecified values. */
ATT_INTERNAL void att_scores(const att_ctx *cx, int64_t bh, int64_t i0, int64_t nr, const int64_t *nvis, int64_t j0,
                double *s, int64_t lds);

/* pv[r * ldo + d] = P.V of row i0 + r over keys j0 .. j0 + nvis[r] - 1 (P[r * ldp + jj], pv_acc), for
 * d < D. pv needs nr rows of ldo >= d_pad doubles; pbuf nr * ldp floats. */
ATT_INTERNAL void att_pv(const att_ctx *cx, int64_t bh, int64_t i0, int64_t nr, const int64_t *nvis, int64_t j0,
            const double *p, int64_t ldp, double *pv, int64_t ldo, float *pbuf);

/* The baseline's softmax of row i of head bh (baseline.c): s (nv scores) -> P in p (p may be s), with
 * m = max s and l = R_stats(sum e) (docs/numerics.md, "Baseline"). */
ATT_INTERNAL void att_softmax_row(const att_ctx *cx, int64_t bh, int64_t i, double *s, int64_t nv, double *p,
                                  double *m_out, double *l_out);

/* Row i of head bh written from its O (D values), m and l: out = R_out(O / l) (divide) or R_out(O);
 * lse = R_stats(m' + R_stats(log l)), m' = m, or R_stats(m R_stats(ln 2)) in the exp2 form; lse may be
 * NULL. A row that saw no key (seen = 0) gets out = 0 and lse = -inf, with no rounding events. */
ATT_INTERNAL void att_write_row(const att_ctx *cx, int64_t bh, int64_t i, int seen, const double *o, int divide,
                                double m, double l, double *out, double *lse);

#endif /* FADEV_ATTENTION_H */
