/* Shared machinery of baseline.c and flash.c: validation, rounded inputs, and the two dot-product
 * families of attention (docs/numerics.md, "Common pieces" and step 6):
 *   scores  acc = 0; for t < D: acc = R_score_acc(acc + Q[i,t] * K[j,t]);  s_j = R_score(c * R_score(acc))
 *   P.V     acc = 0; for j ascending: acc = R_pv_acc(acc + P_j * V[j,d])
 * Every sum runs in exactly this order; the kernels only choose how many independent sums (rows x
 * keys, or rows x d) advance side by side in SIMD lanes. Three tiers, the same bits:
 *   scalar     att_round after every add (any format, any rounding mode, stochastic counters);
 *   fp64 SIMD  acc in double: the identity rounding of fp64, or (double)(float)acc after every add for
 *              fp32 under nearest-even (one IEEE rounding of the fp64 sum: exactly R_fp32);
 *   fp32 SIMD  acc in float, product in float: used only when both factors are values of formats
 *              inside fp32 whose precisions add up to <= 24 bits and every nonzero product lies in
 *              [2^-126, 2^128) (checked on the data), so the float product is the exact product, and
 *              the float sum of two fp32 values equals R_fp32 of their fp64 sum (53 >= 2*24 + 2, so
 *              the double rounding is innocuous). NaN/Inf data always take the fp64 or scalar tier.
 * Compiled for AVX2 and a portable default at once (target_clones); -ffp-contract=off keeps every
 * multiply and add separately rounded, as the spec requires. */
#include <float.h>
#include <stdlib.h>
#include <string.h>

#include "attention.h"

#if defined(__GNUC__) && defined(__x86_64__) && defined(__linux__) && !defined(FADEV_NO_CLONES)
#define ATT_CLONES __attribute__((target_clones("avx2", "default")))
#else
#define ATT_CLONES
#endif

typedef double v4d __attribute__((vector_size(32)));
typedef double v4du __attribute__((vector_size(32), aligned(8)));
typedef float v4f __attribute__((vector_size(16)));
typedef float v8f __attribute__((vector_size(32)));
typedef float v8fu __attribute__((vector_size(32), aligned(4)));

#define R32V(a) __builtin_convertvector(__builtin_convertvector((a), v4f), v4d)

/* ------------------------------------------------------------------ validation and set-up */

static int valid_format(const fadev_format *f) {
    fadev_format check;
    if (!(f->largest > 0)) return 0;
    if (fadev_format_make(f->precision, f->emin, f->emax, f->subnormals, f->has_inf, f->overflow, f->largest,
                          &check) != FADEV_OK)
        return 0;
    return check.subnormals == f->subnormals && check.has_inf == f->has_inf;
}

static int mul_ok(size_t *acc, int64_t factor) {
    if (factor < 0) return 0;
    return !__builtin_mul_overflow(*acc, (size_t)factor, acc);
}

/* Element counts of the padded scratch arrays; 0 on overflow. */
static int scratch_sizes(const fadev_attention_params *pr, size_t *nq, size_t *nkt, size_t *nv) {
    int64_t q_rows = pr->seq_q + 3, kt_cols = att_round_up(pr->seq_kv, 16) + 16, d_pad = att_round_up(pr->dim, 16);
    size_t a = 1, b = 1, c = 1, o = 1;
    int ok = mul_ok(&a, pr->batch) && mul_ok(&a, pr->heads) && mul_ok(&a, q_rows) && mul_ok(&a, pr->dim);
    ok = ok && mul_ok(&b, pr->batch) && mul_ok(&b, pr->heads_kv) && mul_ok(&b, pr->dim) && mul_ok(&b, kt_cols);
    ok = ok && mul_ok(&c, pr->batch) && mul_ok(&c, pr->heads_kv) && mul_ok(&c, pr->seq_kv) && mul_ok(&c, d_pad);
    ok = ok && mul_ok(&o, pr->batch) && mul_ok(&o, pr->heads) && mul_ok(&o, pr->seq_q) && mul_ok(&o, pr->dim);
    ok = ok && a < SIZE_MAX / 8 && b < SIZE_MAX / 8 && c < SIZE_MAX / 8;
    *nq = a, *nkt = b, *nv = c;
    return ok;
}

fadev_status att_validate(const double *q, const double *k, const double *v, const double *out,
                          const fadev_attention_params *pr, const fadev_policy *pol, int flash) {
    if (!q || !k || !v || !out || !pr || !pol) return FADEV_ERR_INVALID_ARGUMENT;
    if (pr->batch < 1 || pr->heads < 1 || pr->heads_kv < 1 || pr->seq_q < 1 || pr->seq_kv < 1)
        return FADEV_ERR_INVALID_ARGUMENT;
    if (pr->dim < 1 || pr->dim > 256) return FADEV_ERR_INVALID_ARGUMENT;
    if (pr->heads % pr->heads_kv != 0) return FADEV_ERR_SHAPE;
    if (!isfinite(pr->scale) || (pr->causal != 0 && pr->causal != 1)) return FADEV_ERR_INVALID_ARGUMENT;
    if (flash) {
        if (pr->block_q < 1 || pr->block_kv < 1) return FADEV_ERR_INVALID_ARGUMENT;
        if (pr->loop_order != FADEV_Q_OUTER && pr->loop_order != FADEV_KV_OUTER) return FADEV_ERR_INVALID_ARGUMENT;
        if (pr->normalize != FADEV_DEFERRED && pr->normalize != FADEV_EAGER) return FADEV_ERR_INVALID_ARGUMENT;
        if (pr->exp_form != FADEV_EXP && pr->exp_form != FADEV_EXP2) return FADEV_ERR_INVALID_ARGUMENT;
    }
    if (pol->rounding != FADEV_ROUND_NEAREST_EVEN && pol->rounding != FADEV_ROUND_TOWARD_ZERO &&
        pol->rounding != FADEV_ROUND_STOCHASTIC)
        return FADEV_ERR_INVALID_MODE;
    const fadev_format *fmts[] = {&pol->input, &pol->score_acc, &pol->score, &pol->softmax, &pol->sum_acc,
                                  &pol->stats, &pol->rescale, &pol->p, &pol->pv_acc, &pol->out_acc,
                                  &pol->state_out, &pol->state_stats, &pol->out};
    for (size_t s = 0; s < sizeof fmts / sizeof fmts[0]; s++)
        if (!valid_format(fmts[s])) return FADEV_ERR_INVALID_FORMAT;
    /* the stochastic counter packs (i, u, w) into 21-bit fields */
    if (pol->rounding == FADEV_ROUND_STOCHASTIC && (pr->seq_q >= (1 << 21) || pr->seq_kv >= (1 << 21)))
        return FADEV_ERR_INVALID_ARGUMENT;
    size_t nq, nkt, nv;
    if (!scratch_sizes(pr, &nq, &nkt, &nv)) return FADEV_ERR_OVERFLOW;
    return FADEV_OK;
}

static int is_fp64(const fadev_format *f) {
    return f->precision == 53 && f->emin == -1022 && f->emax == 1023 && f->subnormals && f->has_inf &&
           f->largest == DBL_MAX;
}

static int is_fp32(const fadev_format *f) {
    return f->precision == 24 && f->emin == -126 && f->emax == 127 && f->subnormals && f->has_inf &&
           f->overflow == FADEV_OVERFLOW_INF && f->largest == (double)FLT_MAX;
}

/* Every finite value of f is a float32 value. */
static int inside_fp32(const fadev_format *f) {
    int lowest = f->subnormals ? f->emin - f->precision + 1 : f->emin;
    return f->precision <= 24 && f->emin >= -126 && f->largest <= (double)FLT_MAX && lowest >= -149;
}

double att_round_slow(const att_stage *st, double x, uint64_t stream, uint64_t index) {
    uint64_t bits = st->mode == FADEV_ROUND_STOCHASTIC ? fadev_random53(st->seed, stream, index) : 0;
    return fadev_round_one(x, &st->fmt, st->mode, bits);
}

static att_stage make_stage(const fadev_format *f, const fadev_policy *pol) {
    att_stage st;
    st.fmt = *f;
    st.mode = pol->rounding;
    st.seed = pol->seed;
    int rne = pol->rounding == FADEV_ROUND_NEAREST_EVEN;
    st.kind = is_fp64(f)                          ? ATT_EXACT
              : (is_fp32(f) && rne)                 ? ATT_F32
              : (rne && f->precision < 53)          ? ATT_RNE
                                                    : ATT_GENERAL;
    st.shift = 53 - f->precision;
    st.lo_bits = fadev_bits_of(ldexp(1.0, f->emin));
    st.hi_bits = fadev_bits_of(f->largest);
    st.half_m1 = st.shift ? (1ull << (st.shift - 1)) - 1 : 0;
    st.keep_mask = ~((1ull << st.shift) - 1);
    return st;
}

/* Rounds one head of Q (task < B*H), K or V into the padded scratch, with magnitude statistics. */
typedef struct prep_job {
    att_ctx *cx;
    const double *q, *k, *v;
} prep_job;

static fadev_status prep_task(void *ctxp, size_t task) {
    prep_job *job = (prep_job *)ctxp;
    att_ctx *cx = job->cx;
    const int64_t D = cx->pr.dim, Nq = cx->pr.seq_q, Nk = cx->pr.seq_kv;
    const int64_t nqh = cx->pr.batch * cx->pr.heads, nkh = cx->pr.batch * cx->pr.heads_kv;
    const att_stage *in = &cx->input;
    if ((int64_t)task < nqh) {
        int64_t bh = (int64_t)task;
        const double *src = job->q + bh * Nq * D;
        double *dst = cx->q + bh * cx->q_rows * D;
        float *dstf = cx->qf ? cx->qf + bh * cx->q_rows * D : NULL;
        for (int64_t i = 0; i < Nq; i++)
            for (int64_t d = 0; d < D; d++) {
                double x = att_round(in, src[i * D + d], ATT_STREAM(ATT_IN_Q, bh), ATT_INDEX(i, d, 0));
                dst[i * D + d] = x;
                if (dstf) dstf[i * D + d] = (float)x;
            }
        return FADEV_OK;
    }
    int is_v = (int64_t)task >= nqh + nkh;
    int64_t bh = (int64_t)task - nqh - (is_v ? nkh : 0);
    const double *src = (is_v ? job->v : job->k) + bh * Nk * D;
    double lo = INFINITY, hi = 0;
    int finite = 1;
    for (int64_t j = 0; j < Nk; j++)
        for (int64_t d = 0; d < D; d++) {
            double x = att_round(in, src[j * D + d], ATT_STREAM(is_v ? ATT_IN_V : ATT_IN_K, bh), ATT_INDEX(j, d, 0));
            double a = fabs(x);
            if (!(a <= DBL_MAX)) finite = 0;
            else if (a > 0) {
                lo = a < lo ? a : lo;
                hi = a > hi ? a : hi;
            }
            if (is_v) {
                size_t at = (size_t)((bh * Nk + j) * cx->d_pad + d);
                cx->v[at] = x;
                if (cx->vf) cx->vf[at] = (float)x;
            } else {
                size_t at = (size_t)((bh * D + d) * cx->kt_cols + j);
                cx->kt[at] = x;
                if (cx->ktf) cx->ktf[at] = (float)x;
            }
        }
    if (is_v) cx->v_min[bh] = lo, cx->v_max[bh] = hi, cx->v_finite[bh] = finite;
    else cx->k_min[bh] = lo, cx->k_max[bh] = hi, cx->k_finite[bh] = finite;
    return FADEV_OK;
}

void att_free(att_ctx *cx) {
    free(cx->q), free(cx->kt), free(cx->v), free(cx->qf), free(cx->ktf), free(cx->vf);
    free(cx->k_min), free(cx->k_max), free(cx->v_min), free(cx->v_max), free(cx->k_finite), free(cx->v_finite);
    memset(cx, 0, sizeof *cx);
}

fadev_status att_init(att_ctx *cx, const double *q, const double *k, const double *v,
                      const fadev_attention_params *params, const fadev_policy *pol, int exp2_form) {
    memset(cx, 0, sizeof *cx);
    cx->pr = *params;
    cx->group = params->heads / params->heads_kv;
    cx->input = make_stage(&pol->input, pol);
    cx->score_acc = make_stage(&pol->score_acc, pol);
    cx->score = make_stage(&pol->score, pol);
    cx->softmax = make_stage(&pol->softmax, pol);
    cx->sum_acc = make_stage(&pol->sum_acc, pol);
    cx->stats = make_stage(&pol->stats, pol);
    cx->rescale = make_stage(&pol->rescale, pol);
    cx->p = make_stage(&pol->p, pol);
    cx->pv_acc = make_stage(&pol->pv_acc, pol);
    cx->out_acc = make_stage(&pol->out_acc, pol);
    cx->state_out = make_stage(&pol->state_out, pol);
    cx->state_stats = make_stage(&pol->state_stats, pol);
    cx->out = make_stage(&pol->out, pol);
    cx->exp2 = exp2_form;
    /* constants: rounded once to nearest even (log2 e and ln 2 are the fp64 constants M_LOG2E, M_LN2) */
    double log2e = 0x1.71547652b82fep+0, ln2 = 0x1.62e42fefa39efp-1;
    cx->c = fadev_round_one(exp2_form ? params->scale * log2e : params->scale, &pol->score,
                            FADEV_ROUND_NEAREST_EVEN, 0);
    cx->c2 = fadev_round_one(ln2, &pol->stats, FADEV_ROUND_NEAREST_EVEN, 0);

    const fadev_format *in = &pol->input;
    cx->qk_float = cx->score_acc.kind == ATT_F32 && inside_fp32(in) && 2 * in->precision <= 24;
    cx->pv_float = cx->pv_acc.kind == ATT_F32 && inside_fp32(in) && inside_fp32(&pol->p) &&
                   in->precision + pol->p.precision <= 24;
    cx->q_rows = params->seq_q + 3;
    cx->kt_cols = att_round_up(params->seq_kv, 16) + 16;
    cx->d_pad = att_round_up(params->dim, 16);
    size_t nq, nkt, nv, nkh = (size_t)(params->batch * params->heads_kv);
    if (!scratch_sizes(params, &nq, &nkt, &nv)) return FADEV_ERR_OVERFLOW;
    cx->q = calloc(nq, sizeof(double));
    cx->kt = calloc(nkt, sizeof(double));
    cx->v = calloc(nv, sizeof(double));
    int ok = cx->q && cx->kt && cx->v;
    if (cx->qk_float) {
        cx->qf = calloc(nq, sizeof(float));
        cx->ktf = calloc(nkt, sizeof(float));
        ok = ok && cx->qf && cx->ktf;
    }
    if (cx->pv_float) {
        cx->vf = calloc(nv, sizeof(float));
        ok = ok && cx->vf;
    }
    cx->k_min = malloc(nkh * sizeof(double)), cx->k_max = malloc(nkh * sizeof(double));
    cx->v_min = malloc(nkh * sizeof(double)), cx->v_max = malloc(nkh * sizeof(double));
    cx->k_finite = malloc(nkh * sizeof(int)), cx->v_finite = malloc(nkh * sizeof(int));
    ok = ok && cx->k_min && cx->k_max && cx->v_min && cx->v_max && cx->k_finite && cx->v_finite;
    if (!ok) {
        att_free(cx);
        return FADEV_ERR_NO_MEMORY;
    }
    prep_job job = {cx, q, k, v};
    fadev_status st = fadev_parallel_for((size_t)(params->batch * params->heads) + 2 * nkh, prep_task, &job);
    if (st != FADEV_OK) att_free(cx);
    return st;
}

/* ------------------------------------------------------------------ score kernels */

/* acc[r][j] of 4 query rows (q, row stride ldq) and keys 0..ncols-1 (multiple of 8) of kt (row stride
 * ldk), written to s (row stride lds). R32: round the fp64 sum to fp32 after every add. */
#define QK4_F64(R32)                                                                                      \
    for (int64_t j = 0; j < ncols; j += 8) {                                                              \
        v4d a0 = {0}, b0 = {0}, a1 = {0}, b1 = {0}, a2 = {0}, b2 = {0}, a3 = {0}, b3 = {0};               \
        const double *kp = kt + j;                                                                        \
        for (int64_t t = 0; t < dim; t++, kp += ldk) {                                                    \
            v4d k0 = *(const v4du *)kp, k1 = *(const v4du *)(kp + 4);                                     \
            double x0 = q[t], x1 = q[ldq + t], x2 = q[2 * ldq + t], x3 = q[3 * ldq + t];                  \
            a0 = a0 + x0 * k0, b0 = b0 + x0 * k1, a1 = a1 + x1 * k0, b1 = b1 + x1 * k1;                   \
            a2 = a2 + x2 * k0, b2 = b2 + x2 * k1, a3 = a3 + x3 * k0, b3 = b3 + x3 * k1;                   \
            if (R32) {                                                                                    \
                a0 = R32V(a0), b0 = R32V(b0), a1 = R32V(a1), b1 = R32V(b1);                               \
                a2 = R32V(a2), b2 = R32V(b2), a3 = R32V(a3), b3 = R32V(b3);                               \
            }                                                                                             \
        }                                                                                                 \
        *(v4du *)(s + j) = a0, *(v4du *)(s + j + 4) = b0;                                                 \
        *(v4du *)(s + lds + j) = a1, *(v4du *)(s + lds + j + 4) = b1;                                     \
        *(v4du *)(s + 2 * lds + j) = a2, *(v4du *)(s + 2 * lds + j + 4) = b2;                             \
        *(v4du *)(s + 3 * lds + j) = a3, *(v4du *)(s + 3 * lds + j + 4) = b3;                             \
    }

ATT_CLONES static void qk4_f64(const double *q, int64_t ldq, const double *kt, int64_t ldk, int64_t dim,
                               int64_t ncols, double *s, int64_t lds) {
    QK4_F64(0)
}

ATT_CLONES static void qk4_f64_r32(const double *q, int64_t ldq, const double *kt, int64_t ldk, int64_t dim,
                                   int64_t ncols, double *s, int64_t lds) {
    QK4_F64(1)
}

/* The float tier: 4 rows x 16 keys per step, float products and sums (exact per the guard). */
ATT_CLONES static void qk4_f32(const float *q, int64_t ldq, const float *kt, int64_t ldk, int64_t dim,
                               int64_t ncols, float *s, int64_t lds) {
    for (int64_t j = 0; j < ncols; j += 16) {
        v8f a0 = {0}, b0 = {0}, a1 = {0}, b1 = {0}, a2 = {0}, b2 = {0}, a3 = {0}, b3 = {0};
        const float *kp = kt + j;
        for (int64_t t = 0; t < dim; t++, kp += ldk) {
            v8f k0 = *(const v8fu *)kp, k1 = *(const v8fu *)(kp + 8);
            float x0 = q[t], x1 = q[ldq + t], x2 = q[2 * ldq + t], x3 = q[3 * ldq + t];
            a0 = a0 + x0 * k0, b0 = b0 + x0 * k1, a1 = a1 + x1 * k0, b1 = b1 + x1 * k1;
            a2 = a2 + x2 * k0, b2 = b2 + x2 * k1, a3 = a3 + x3 * k0, b3 = b3 + x3 * k1;
        }
        *(v8fu *)(s + j) = a0, *(v8fu *)(s + j + 8) = b0;
        *(v8fu *)(s + lds + j) = a1, *(v8fu *)(s + lds + j + 8) = b1;
        *(v8fu *)(s + 2 * lds + j) = a2, *(v8fu *)(s + 2 * lds + j + 8) = b2;
        *(v8fu *)(s + 3 * lds + j) = a3, *(v8fu *)(s + 3 * lds + j + 8) = b3;
    }
}

/* 1 if every nonzero product of a value of `a` (n values, or the given range) with one of magnitude
 * in [lo, hi] lies in [2^-126, 2^128), and all of `a` is finite. */
static int products_in_f32(const float *a, int64_t rows, int64_t cols, int64_t ld, const int64_t *counts,
                           double lo, double hi) {
    double amin = INFINITY, amax = 0;
    for (int64_t r = 0; r < rows; r++) {
        int64_t n = counts ? counts[r] : cols;
        for (int64_t c = 0; c < n; c++) {
            double x = fabs((double)a[r * ld + c]);
            if (!(x <= DBL_MAX)) return 0;
            if (x > 0) {
                amin = x < amin ? x : amin;
                amax = x > amax ? x : amax;
            }
        }
    }
    return amin * lo >= 0x1p-126 && amax * hi < 0x1p128;
}

void att_scores(const att_ctx *cx, int64_t bh, int64_t i0, int64_t nr, const int64_t *nvis, int64_t j0,
                double *s, int64_t lds, float *fbuf) {
    const int64_t D = cx->pr.dim;
    const int64_t bhk = (bh / cx->pr.heads) * cx->pr.heads_kv + (bh % cx->pr.heads) / cx->group;
    int64_t ncols = 0;
    for (int64_t r = 0; r < nr; r++) ncols = nvis[r] > ncols ? nvis[r] : ncols;
    if (ncols == 0) return;
    const double *q = cx->q + (bh * cx->q_rows + i0) * D;
    const double *kt = cx->kt + bhk * D * cx->kt_cols + j0;
    int from_float = 0;
    if (cx->score_acc.kind >= ATT_RNE) {
        const uint64_t stream = ATT_STREAM(ATT_SCORE_ACC, bh);
        for (int64_t r = 0; r < nr; r++)
            for (int64_t jj = 0; jj < nvis[r]; jj++) {
                double acc = 0;
                for (int64_t t = 0; t < D; t++)
                    acc = att_round(&cx->score_acc, acc + q[r * D + t] * kt[t * cx->kt_cols + jj], stream,
                                    ATT_INDEX(i0 + r, j0 + jj, t));
                s[r * lds + jj] = acc;
            }
    } else if (cx->qk_float && cx->k_finite[bhk] &&
               products_in_f32(cx->qf + (bh * cx->q_rows + i0) * D, nr, D, D, NULL, cx->k_min[bhk],
                               cx->k_max[bhk])) {
        const float *qf = cx->qf + (bh * cx->q_rows + i0) * D;
        const float *ktf = cx->ktf + bhk * D * cx->kt_cols + j0;
        for (int64_t r = 0; r < nr; r += 4)
            qk4_f32(qf + r * D, D, ktf, cx->kt_cols, D, att_round_up(ncols, 16), fbuf + r * lds, lds);
        from_float = 1;
    } else {
        for (int64_t r = 0; r < nr; r += 4) {
            if (cx->score_acc.kind == ATT_EXACT)
                qk4_f64(q + r * D, D, kt, cx->kt_cols, D, att_round_up(ncols, 8), s + r * lds, lds);
            else
                qk4_f64_r32(q + r * D, D, kt, cx->kt_cols, D, att_round_up(ncols, 8), s + r * lds, lds);
        }
    }
    /* s = R_score(c * R_score(acc)) */
    const double c = cx->c;
    const att_stage *sc = &cx->score;
    for (int64_t r = 0; r < nr; r++) {
        double *row = s + r * lds;
        const float *frow = fbuf + r * lds;
        if (from_float)
            for (int64_t jj = 0; jj < nvis[r]; jj++) row[jj] = (double)frow[jj];
        if (sc->kind == ATT_EXACT) {
            for (int64_t jj = 0; jj < nvis[r]; jj++) row[jj] = c * row[jj];
        } else if (sc->kind == ATT_F32) {
            for (int64_t jj = 0; jj < nvis[r]; jj++) row[jj] = (double)(float)(c * (double)(float)row[jj]);
        } else {
            const uint64_t s4 = ATT_STREAM(ATT_SCORE_DOT, bh), s5 = ATT_STREAM(ATT_SCORE_SCALED, bh);
            for (int64_t jj = 0; jj < nvis[r]; jj++) {
                uint64_t idx = ATT_INDEX(i0 + r, j0 + jj, 0);
                row[jj] = att_round(sc, c * att_round(sc, row[jj], s4, idx), s5, idx);
            }
        }
    }
}

/* ------------------------------------------------------------------ P.V kernels */

/* 4 rows of P (stride ldp) times keys 0..n-1 of V (row stride ldv), all d < dpad (multiple of 16),
 * accumulated onto pv (row stride ldo). */
#define PV4_F64(R32)                                                                                      \
    for (int64_t d = 0; d < dpad; d += 8) {                                                               \
        double *o = pv + d;                                                                               \
        v4d a0 = *(v4du *)o, b0 = *(v4du *)(o + 4), a1 = *(v4du *)(o + ldo), b1 = *(v4du *)(o + ldo + 4); \
        v4d a2 = *(v4du *)(o + 2 * ldo), b2 = *(v4du *)(o + 2 * ldo + 4);                                 \
        v4d a3 = *(v4du *)(o + 3 * ldo), b3 = *(v4du *)(o + 3 * ldo + 4);                                 \
        const double *vp = v + d;                                                                         \
        for (int64_t j = 0; j < n; j++, vp += ldv) {                                                      \
            v4d v0 = *(const v4du *)vp, v1 = *(const v4du *)(vp + 4);                                     \
            double x0 = p[j], x1 = p[ldp + j], x2 = p[2 * ldp + j], x3 = p[3 * ldp + j];                  \
            a0 = a0 + x0 * v0, b0 = b0 + x0 * v1, a1 = a1 + x1 * v0, b1 = b1 + x1 * v1;                   \
            a2 = a2 + x2 * v0, b2 = b2 + x2 * v1, a3 = a3 + x3 * v0, b3 = b3 + x3 * v1;                   \
            if (R32) {                                                                                    \
                a0 = R32V(a0), b0 = R32V(b0), a1 = R32V(a1), b1 = R32V(b1);                               \
                a2 = R32V(a2), b2 = R32V(b2), a3 = R32V(a3), b3 = R32V(b3);                               \
            }                                                                                             \
        }                                                                                                 \
        *(v4du *)o = a0, *(v4du *)(o + 4) = b0, *(v4du *)(o + ldo) = a1, *(v4du *)(o + ldo + 4) = b1;     \
        *(v4du *)(o + 2 * ldo) = a2, *(v4du *)(o + 2 * ldo + 4) = b2;                                     \
        *(v4du *)(o + 3 * ldo) = a3, *(v4du *)(o + 3 * ldo + 4) = b3;                                     \
    }

/* One row: 16 d per step. */
#define PV1_F64(R32)                                                                                      \
    for (int64_t d = 0; d < dpad; d += 16) {                                                              \
        double *o = pv + d;                                                                               \
        v4d a0 = *(v4du *)o, a1 = *(v4du *)(o + 4), a2 = *(v4du *)(o + 8), a3 = *(v4du *)(o + 12);        \
        const double *vp = v + d;                                                                         \
        for (int64_t j = 0; j < n; j++, vp += ldv) {                                                      \
            double x = p[j];                                                                              \
            a0 = a0 + x * *(const v4du *)vp, a1 = a1 + x * *(const v4du *)(vp + 4);                       \
            a2 = a2 + x * *(const v4du *)(vp + 8), a3 = a3 + x * *(const v4du *)(vp + 12);                \
            if (R32) a0 = R32V(a0), a1 = R32V(a1), a2 = R32V(a2), a3 = R32V(a3);                          \
        }                                                                                                 \
        *(v4du *)o = a0, *(v4du *)(o + 4) = a1, *(v4du *)(o + 8) = a2, *(v4du *)(o + 12) = a3;            \
    }

ATT_CLONES static void pv4_f64(const double *p, int64_t ldp, const double *v, int64_t ldv, int64_t n, int64_t dpad,
                               double *pv, int64_t ldo) {
    PV4_F64(0)
}
ATT_CLONES static void pv4_f64_r32(const double *p, int64_t ldp, const double *v, int64_t ldv, int64_t n,
                                   int64_t dpad, double *pv, int64_t ldo) {
    PV4_F64(1)
}
ATT_CLONES static void pv1_f64(const double *p, const double *v, int64_t ldv, int64_t n, int64_t dpad, double *pv) {
    PV1_F64(0)
}
ATT_CLONES static void pv1_f64_r32(const double *p, const double *v, int64_t ldv, int64_t n, int64_t dpad,
                                   double *pv) {
    PV1_F64(1)
}

/* The float tier; pv is kept in double between calls (its values are fp32 values). */
ATT_CLONES static void pv4_f32(const float *p, int64_t ldp, const float *v, int64_t ldv, int64_t n, int64_t dpad,
                               double *pv, int64_t ldo) {
    for (int64_t d = 0; d < dpad; d += 16) {
        float acc[4][16];
        for (int r = 0; r < 4; r++)
            for (int e = 0; e < 16; e++) acc[r][e] = (float)pv[r * ldo + d + e];
        v8f a0 = *(v8fu *)acc[0], b0 = *(v8fu *)(acc[0] + 8), a1 = *(v8fu *)acc[1], b1 = *(v8fu *)(acc[1] + 8);
        v8f a2 = *(v8fu *)acc[2], b2 = *(v8fu *)(acc[2] + 8), a3 = *(v8fu *)acc[3], b3 = *(v8fu *)(acc[3] + 8);
        const float *vp = v + d;
        for (int64_t j = 0; j < n; j++, vp += ldv) {
            v8f v0 = *(const v8fu *)vp, v1 = *(const v8fu *)(vp + 8);
            float x0 = p[j], x1 = p[ldp + j], x2 = p[2 * ldp + j], x3 = p[3 * ldp + j];
            a0 = a0 + x0 * v0, b0 = b0 + x0 * v1, a1 = a1 + x1 * v0, b1 = b1 + x1 * v1;
            a2 = a2 + x2 * v0, b2 = b2 + x2 * v1, a3 = a3 + x3 * v0, b3 = b3 + x3 * v1;
        }
        *(v8fu *)acc[0] = a0, *(v8fu *)(acc[0] + 8) = b0, *(v8fu *)acc[1] = a1, *(v8fu *)(acc[1] + 8) = b1;
        *(v8fu *)acc[2] = a2, *(v8fu *)(acc[2] + 8) = b2, *(v8fu *)acc[3] = a3, *(v8fu *)(acc[3] + 8) = b3;
        for (int r = 0; r < 4; r++)
            for (int e = 0; e < 16; e++) pv[r * ldo + d + e] = (double)acc[r][e];
    }
}

ATT_CLONES static void pv1_f32(const float *p, const float *v, int64_t ldv, int64_t n, int64_t dpad, double *pv) {
    for (int64_t d = 0; d < dpad; d += 16) {
        float acc[16];
        for (int e = 0; e < 16; e++) acc[e] = (float)pv[d + e];
        v8f a0 = *(v8fu *)acc, a1 = *(v8fu *)(acc + 8);
        const float *vp = v + d;
        for (int64_t j = 0; j < n; j++, vp += ldv) {
            float x = p[j];
            a0 = a0 + x * *(const v8fu *)vp, a1 = a1 + x * *(const v8fu *)(vp + 8);
        }
        *(v8fu *)acc = a0, *(v8fu *)(acc + 8) = a1;
        for (int e = 0; e < 16; e++) pv[d + e] = (double)acc[e];
    }
}

void att_pv(const att_ctx *cx, int64_t bh, int64_t i0, int64_t nr, const int64_t *nvis, int64_t j0,
            const double *p, int64_t ldp, double *pv, int64_t ldo, float *pbuf) {
    const int64_t D = cx->pr.dim, dpad = cx->d_pad, Nk = cx->pr.seq_kv;
    const int64_t bhk = (bh / cx->pr.heads) * cx->pr.heads_kv + (bh % cx->pr.heads) / cx->group;
    const double *v = cx->v + (bhk * Nk + j0) * dpad;
    for (int64_t r = 0; r < nr; r++) memset(pv + r * ldo, 0, (size_t)dpad * sizeof(double));
    if (cx->pv_acc.kind >= ATT_RNE) {
        const uint64_t stream = ATT_STREAM(ATT_PV_ACC, bh);
        for (int64_t r = 0; r < nr; r++)
            for (int64_t d = 0; d < D; d++) {
                double acc = 0;
                for (int64_t jj = 0; jj < nvis[r]; jj++)
                    acc = att_round(&cx->pv_acc, acc + p[r * ldp + jj] * v[jj * dpad + d], stream,
                                    ATT_INDEX(i0 + r, j0 + jj, d));
                pv[r * ldo + d] = acc;
            }
        return;
    }
    int use_float = 0;
    if (cx->pv_float && cx->v_finite[bhk]) {
        for (int64_t r = 0; r < nr; r++)
            for (int64_t jj = 0; jj < nvis[r]; jj++) pbuf[r * ldp + jj] = (float)p[r * ldp + jj];
        use_float = products_in_f32(pbuf, nr, 0, ldp, nvis, cx->v_min[bhk], cx->v_max[bhk]);
    }
    const int r32 = cx->pv_acc.kind == ATT_F32;
    const float *vf = use_float ? cx->vf + (bhk * Nk + j0) * dpad : NULL;
    int64_t r = 0;
    for (; r + 4 <= nr; r += 4) {
        int64_t n = nvis[r];
        for (int k = 1; k < 4; k++) n = nvis[r + k] < n ? nvis[r + k] : n;
        if (use_float) pv4_f32(pbuf + r * ldp, ldp, vf, dpad, n, dpad, pv + r * ldo, ldo);
        else if (r32) pv4_f64_r32(p + r * ldp, ldp, v, dpad, n, dpad, pv + r * ldo, ldo);
        else pv4_f64(p + r * ldp, ldp, v, dpad, n, dpad, pv + r * ldo, ldo);
        /* rows that see more keys (causal) continue on their own, in order */
        for (int k = 0; k < 4; k++) {
            int64_t rest = nvis[r + k] - n;
            if (rest <= 0) continue;
            if (use_float) pv1_f32(pbuf + (r + k) * ldp + n, vf + n * dpad, dpad, rest, dpad, pv + (r + k) * ldo);
            else if (r32) pv1_f64_r32(p + (r + k) * ldp + n, v + n * dpad, dpad, rest, dpad, pv + (r + k) * ldo);
            else pv1_f64(p + (r + k) * ldp + n, v + n * dpad, dpad, rest, dpad, pv + (r + k) * ldo);
        }
    }
    for (; r < nr; r++) {
        if (use_float) pv1_f32(pbuf + r * ldp, vf, dpad, nvis[r], dpad, pv + r * ldo);
        else if (r32) pv1_f64_r32(p + r * ldp, v, dpad, nvis[r], dpad, pv + r * ldo);
        else pv1_f64(p + r * ldp, v, dpad, nvis[r], dpad, pv + r * ldo);
    }
}
