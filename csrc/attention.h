/* Internal helpers shared by baseline.c, flash.c and the backward (not public API; see docs/numerics.md).
 * Layers: stage.h (stages, rounding events) <- matmul.h (block products) <- this file.
 *
 * att_ctx holds the plan of one call (att_plan: shapes, classified stages, constants) and the rounded
 * inputs (padded so the SIMD kernels can read whole tiles); att_scores / att_pv compute the two
 * dot-product families of attention:
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

#include "matmul.h"

typedef struct att_ctx {
    att_plan plan;  /* shapes, stages, constants (stage.h) */
    /* Rounded inputs. q: (B*H, q_rows, D), rows past seq_q are zero. kt: K transposed per head,
     * (B*Hkv, D, kt_cols), columns past seq_kv zero. v: (B*Hkv, seq_kv, d_pad), columns past D zero.
     * qf, ktf, vf: the same as float32, present only when the float tier can be used. */
    int64_t q_rows, kt_cols, d_pad;
    int fma;        /* att_fma_ok() when the call began: the products' FMA tier applies */
    int fast;       /* the vector element-wise steps (fast.c) apply: nearest-even policy, fast paths on */
    double *q, *kt, *v;
    float *qf, *ktf, *vf;
    /* per K/V head: smallest nonzero and largest magnitude, and 1 if every value is finite */
    double *k_min, *k_max, *v_min, *v_max;
    int *k_finite, *v_finite;
    int *q_finite;  /* per query head: 1 if every rounded Q value is finite */
} att_ctx;

/* Checks params and policy (flash: 1 also checks tiles and enums). */
ATT_INTERNAL fadev_status att_validate(const double *q, const double *k, const double *v, const double *out,
                          const fadev_attention_params *params, const fadev_policy *policy, int flash);
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
    if (!cx->plan.pr.causal) return n;
    int64_t last = i + cx->plan.pr.seq_kv - cx->plan.pr.seq_q; /* largest visible key */
    int64_t count = last - j0 + 1;
    return count < 0 ? 0 : count > n ? n : count;
}

/* K/V head (b * heads_kv + g) that query head bh = b * heads + h reads. */
static inline int64_t att_kv_head(const att_ctx *cx, int64_t bh) {
    return (bh / cx->plan.pr.heads) * cx->plan.pr.heads_kv + (bh % cx->plan.pr.heads) / cx->plan.group;
}

static inline double att_exp(const att_ctx *cx, double x) { return cx->plan.exp2 ? exp2(x) : exp(x); }

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

/* ------------------------------------------------------------------ attention pieces */

/* s[r * lds + jj] = s_j of query row i0 + r (head bh) and key j0 + jj, for jj < nvis[r], r < nr.
 * s needs att_rows(nr) rows of lds >= att_score_ld(max nvis) doubles; its other entries are overwritten
 * with unspecified values. */
ATT_INTERNAL void att_scores(const att_ctx *cx, int64_t bh, int64_t i0, int64_t nr, const int64_t *nvis, int64_t j0,
                double *s, int64_t lds);

/* pv[r * ldo + d] = P.V of row i0 + r over keys j0 .. j0 + nvis[r] - 1 (P[r * ldp + jj], pv_acc), for
 * d < D. pv needs nr rows of ldo >= d_pad doubles; pbuf nr * ldp floats. p_finite: 1 when the caller knows
 * every P is finite (0: not known). */
ATT_INTERNAL void att_pv(const att_ctx *cx, int64_t bh, int64_t i0, int64_t nr, const int64_t *nvis, int64_t j0,
            const double *p, int64_t ldp, double *pv, int64_t ldo, float *pbuf, int p_finite);

/* The baseline's softmax of row i of head bh (baseline.c): s (nv scores) -> P in p (p may be s), with
 * m = max s and l = R_stats(sum e) (docs/numerics.md, "Baseline"). */
ATT_INTERNAL void att_softmax_row(const att_ctx *cx, int64_t bh, int64_t i, double *s, int64_t nv, double *p,
                                  double *m_out, double *l_out);

/* att_softmax_row of rows i0 .. i0 + nr - 1 (nvis[r] scores each, row stride lds; rows with none untouched);
 * the vector steps when cx->fast (p may be s). */
ATT_INTERNAL void att_softmax_rows(const att_ctx *cx, int64_t bh, int64_t i0, int64_t nr, const int64_t *nvis,
                                   double *s, int64_t lds, double *p, double *m, double *l);

/* Row i of head bh written from its O (D values), m and l: out = R_out(O / l) (divide) or R_out(O);
 * lse = R_stats(m' + R_stats(log l)), m' = m, or R_stats(m R_stats(ln 2)) in the exp2 form; lse may be
 * NULL. A row that saw no key (seen = 0) gets out = 0 and lse = -inf, with no rounding events. */
ATT_INTERNAL void att_write_row(const att_ctx *cx, int64_t bh, int64_t i, int seen, const double *o, int divide,
                                double m, double l, double *out, double *lse);

/* ------------------------------------------------------------------ vector element-wise steps (fast.c) */

/* y[i] = R_st(x[i]) for i < n (y may be x); nearest-even or toward-zero stages only (no counters). Returns 1 when
 * it saw that every y[i] is finite (0: not known). */
ATT_INTERNAL int att_round_n(const att_stage *st, const double *x, double *y, int64_t n);
/* u[i] = R_fp32(R_fp32(p[i]) R_fp32(R_fp32(dp[i]) - d)), then R_fp32(c u[i]) when `scaled` (fp32 nearest-even). */
ATT_INTERNAL void att_ds_f32_n(const double *p, const double *dp, double d, int scaled, double c, double *u,
                               int64_t n);
/* y[i] = x[i] - m, x[i] * m, x[i] / m in fp64 (y may be x). */
ATT_INTERNAL void att_sub_n(const double *x, double m, double *y, int64_t n);
ATT_INTERNAL void att_scale_n(const double *x, double m, double *y, int64_t n);
ATT_INTERNAL void att_div_n(const double *x, double m, double *y, int64_t n);
/* y[i] = R_fp32(c R_fp32(x[i])) (fp32 nearest-even). */
ATT_INTERNAL void att_f32_scale_n(const double *x, double c, double *y, int64_t n);
/* o[i] = R_fp32(R_fp32(f o[i]) + R_fp32(pv[i])) (fp32 nearest-even). */
ATT_INTERNAL void att_f32_update_n(double *o, double f, const double *pv, int64_t n);
/* y[i] = (float)x[i]; returns 1 if every x[i] is finite (att_to_float_f: without the check). */
ATT_INTERNAL void att_to_float_f(const double *x, float *y, int64_t n);
ATT_INTERNAL int att_to_float_n(const double *x, float *y, int64_t n);
/* acc[i] = R_st(acc[i] + x[i]) (nearest-even or toward-zero stages). */
ATT_INTERNAL void att_add_round_n(const att_stage *st, double *acc, const double *x, int64_t n);
/* z[i] = x[i] + y[i] in fp64. */
ATT_INTERNAL void att_add_n(const double *x, const double *y, double *z, int64_t n);
/* z[i] = x[i] * y[i] in fp64. */
ATT_INTERNAL void att_mul_n(const double *x, const double *y, double *z, int64_t n);
/* 1 if all n doubles are finite. */
ATT_INTERNAL int att_finite_d(const double *x, int64_t n);
/* att_max(...att_max(att_max(m, s[0]), s[1])..., s[n-1]), the same value and sign. */
ATT_INTERNAL double att_max_n(double m, const double *s, int64_t n);
/* sum[r] = the row sum acc = R_acc(acc + e[r][j]), j < nv[r] ascending, from 0 (terms_f32: every term is an fp32
 * value); nearest-even stages only. */
ATT_INTERNAL void att_row_sums(const att_stage *acc, int terms_f32, const double *e, int64_t lde, const int64_t *nv,
                               int64_t nr, double *sum);
/* out[r] = the chain acc = R_acc(acc + a[r][j] b[r][j]), j < nv[r] ascending, from 0 (row stride ld); nearest-even
 * or toward-zero stages. */
ATT_INTERNAL void att_row_dots(const att_stage *acc, const double *a, const double *b, int64_t ld, const int64_t *nv,
                               int64_t nr, double *out);
/* y[i] = R_st(E(x[i])), E = exp2 (exp2_form) or exp, libm's bits without libm where they cannot differ (fast.c). */
ATT_INTERNAL void att_exp_round_n(const att_stage *st, int exp2_form, const double *x, double *y, int64_t n);
/* s[j] = R_softmax(E(R_softmax(s[j] - m))), j < n, in place; E = exp2 (exp2_form) or exp. */
ATT_INTERNAL void att_exp_row(const att_ctx *cx, int exp2_form, double m, double *s, int64_t n);

#endif /* FADEV_ATTENTION_H */
