/* Shared machinery of baseline.c and flash.c: validation, rounded inputs, the two dot-product families of
 * attention (docs/numerics.md, "Common pieces" and step 6):
 *   scores  acc = 0; for t < D: acc = R_score_acc(acc + Q[i,t] * K[j,t]);  s_j = R_score(c * R_score(acc))
 *   P.V     acc = 0; for j ascending: acc = R_pv_acc(acc + P_j * V[j,d])
 * and the output row: out = R_out(O / l) or R_out(O), lse = R_stats(m + R_stats(log l)).
 * Every sum runs in exactly this order; the products are att_mm_run's (matmul.c), which only chooses how
 * many independent sums advance side by side in SIMD lanes, in one of its tiers (same bits): scalar
 * rounding, fp64 vectors, or float32 vectors when every product is exact in fp32 (checked on the data:
 * per K/V head for K and V, per call for the query rows of Q and for P). */
#include <float.h>
#include <stdlib.h>
#include <string.h>

#include "attention.h"

/* ------------------------------------------------------------------ validation and set-up */

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
    fadev_status st = att_check_params(pr, 256, flash, NULL);
    if (st == FADEV_OK) st = att_check_policy(pol, pr);
    size_t nq, nkt, nv;
    if (st == FADEV_OK && !scratch_sizes(pr, &nq, &nkt, &nv)) st = FADEV_ERR_OVERFLOW;
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
    const int64_t D = cx->plan.pr.dim, Nq = cx->plan.pr.seq_q, Nk = cx->plan.pr.seq_kv;
    const int64_t nqh = cx->plan.pr.batch * cx->plan.pr.heads, nkh = cx->plan.pr.batch * cx->plan.pr.heads_kv;
    const att_stage *in = &cx->plan.input;
    if ((int64_t)task < nqh) {
        int64_t bh = (int64_t)task;
        const double *src = job->q + bh * Nq * D;
        double *dst = cx->q + bh * cx->q_rows * D;
        float *dstf = cx->qf ? cx->qf + bh * cx->q_rows * D : NULL;
        if (cx->fast) { /* nearest-even: no counters, the vector events */
            att_round_n(in, src, dst, Nq * D);
            if (dstf)
                for (int64_t t = 0; t < Nq * D; t++) dstf[t] = (float)dst[t];
        } else {
            for (int64_t i = 0; i < Nq; i++)
                for (int64_t d = 0; d < D; d++) {
                    double x = att_round(in, src[i * D + d], ATT_STREAM(ATT_IN_Q, bh), ATT_INDEX(i, d, 0));
                    dst[i * D + d] = x;
                    if (dstf) dstf[i * D + d] = (float)x;
                }
        }
        cx->q_finite[bh] = att_finite_d(dst, Nq * D);
        return FADEV_OK;
    }
    int is_v = (int64_t)task >= nqh + nkh;
    int64_t bh = (int64_t)task - nqh - (is_v ? nkh : 0);
    const double *src = (is_v ? job->v : job->k) + bh * Nk * D;
    mag mg = MAG_EMPTY;
    for (int64_t j = 0; cx->fast && j < Nk; j++) { /* the same with the vector events, one row at a time */
        double row[256];
        att_round_n(in, src + j * D, row, D);
        if (cx->fma) mg.finite &= att_finite_d(row, D);
        else for (int64_t d = 0; d < D; d++) mag_add(&mg, row[d]);
        for (int64_t d = 0; d < D; d++) {
            size_t at = is_v ? (size_t)((bh * Nk + j) * cx->d_pad + d) : (size_t)((bh * D + d) * cx->kt_cols + j);
            (is_v ? cx->v : cx->kt)[at] = row[d];
            float *f = is_v ? cx->vf : cx->ktf;
            if (f) f[at] = (float)row[d];
        }
    }
    for (int64_t j = 0; !cx->fast && j < Nk; j++)
        for (int64_t d = 0; d < D; d++) {
            double x = att_round(in, src[j * D + d], ATT_STREAM(is_v ? ATT_IN_V : ATT_IN_K, bh), ATT_INDEX(j, d, 0));
            mag_add(&mg, x);
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
    if (is_v) cx->v_min[bh] = mg.min, cx->v_max[bh] = mg.max, cx->v_finite[bh] = mg.finite;
    else cx->k_min[bh] = mg.min, cx->k_max[bh] = mg.max, cx->k_finite[bh] = mg.finite;
    return FADEV_OK;
}

void *att_calloc_lines(size_t n, size_t size) {
    size_t bytes;
    if (__builtin_mul_overflow(n, size, &bytes) || bytes > SIZE_MAX - 128) return NULL;
    char *raw = calloc(1, bytes + 72);
    if (!raw) return NULL;
    char *p = (char *)(((uintptr_t)raw + 8 + 63) & ~(uintptr_t)63);
    ((void **)p)[-1] = raw;
    return p;
}

void att_free_lines(void *p) {
    if (p) free(((void **)p)[-1]);
}

void att_free(att_ctx *cx) {
    att_free_lines(cx->q), att_free_lines(cx->kt), att_free_lines(cx->v);
    att_free_lines(cx->qf), att_free_lines(cx->ktf), att_free_lines(cx->vf);
    free(cx->k_min), free(cx->k_max), free(cx->v_min), free(cx->v_max), free(cx->k_finite), free(cx->v_finite);
    free(cx->q_finite);
    memset(cx, 0, sizeof *cx);
}

fadev_status att_init(att_ctx *cx, const double *q, const double *k, const double *v,
                      const fadev_attention_params *params, const fadev_policy *pol, int exp2_form) {
    memset(cx, 0, sizeof *cx);
    att_plan_init(&cx->plan, params, pol, exp2_form);
    cx->q_rows = params->seq_q + 3;
    cx->kt_cols = att_round_up(params->seq_kv, 16) + 16;
    cx->d_pad = att_round_up(params->dim, 16);
    size_t nq, nkt, nv, nkh = (size_t)(params->batch * params->heads_kv);
    if (!scratch_sizes(params, &nq, &nkt, &nv)) return FADEV_ERR_OVERFLOW;
    cx->q = att_calloc_lines(nq, sizeof(double));
    cx->kt = att_calloc_lines(nkt, sizeof(double));
    cx->v = att_calloc_lines(nv, sizeof(double));
    int ok = cx->q && cx->kt && cx->v;
    if (cx->plan.qk_float) {
        cx->qf = att_calloc_lines(nq, sizeof(float));
        cx->ktf = att_calloc_lines(nkt, sizeof(float));
        ok = ok && cx->qf && cx->ktf;
    }
    if (cx->plan.pv_float) {
        cx->vf = att_calloc_lines(nv, sizeof(float));
        ok = ok && cx->vf;
    }
    cx->k_min = malloc(nkh * sizeof(double)), cx->k_max = malloc(nkh * sizeof(double));
    cx->v_min = malloc(nkh * sizeof(double)), cx->v_max = malloc(nkh * sizeof(double));
    cx->k_finite = malloc(nkh * sizeof(int)), cx->v_finite = malloc(nkh * sizeof(int));
    cx->q_finite = malloc((size_t)(params->batch * params->heads) * sizeof(int));
    ok = ok && cx->k_min && cx->k_max && cx->v_min && cx->v_max && cx->k_finite && cx->v_finite && cx->q_finite;
    if (!ok) {
        att_free(cx);
        return FADEV_ERR_NO_MEMORY;
    }
    cx->fma = att_fma_ok();
    cx->fast = att_fast_enabled() && pol->rounding == FADEV_ROUND_NEAREST_EVEN;
    att_fast_count(cx->fast, 0);
    prep_job job = {cx, q, k, v};
    fadev_status st = fadev_parallel_for((size_t)(params->batch * params->heads) + 2 * nkh, prep_task, &job);
    if (st != FADEV_OK) att_free(cx);
    return st;
}

/* ------------------------------------------------------------------ the two products */

/* Magnitudes of the first counts[r] (or cols) values of rows 0..rows-1 of a (row stride ld). */
static mag float_magnitudes(const float *a, int64_t rows, int64_t cols, int64_t ld, const int64_t *counts) {
    mag m = MAG_EMPTY;
    for (int64_t r = 0; r < rows; r++) {
        int64_t n = counts ? counts[r] : cols;
        for (int64_t c = 0; c < n; c++) mag_add(&m, (double)a[r * ld + c]);
    }
    return m;
}

void att_scores(const att_ctx *cx, int64_t bh, int64_t i0, int64_t nr, const int64_t *nvis, int64_t j0,
                double *s, int64_t lds) {
    const int64_t D = cx->plan.pr.dim, bhk = att_kv_head(cx, bh);
    int64_t ncols = 0;
    for (int64_t r = 0; r < nr; r++) ncols = nvis[r] > ncols ? nvis[r] : ncols;
    if (ncols == 0) return;
    const int64_t q_at = (bh * cx->q_rows + i0) * D, k_at = bhk * D * cx->kt_cols + j0;
    const int possible = cx->plan.qk_float && cx->k_finite[bhk];
    mag qm = MAG_EMPTY; /* the FMA tier reads only whether Q is finite: known per head */
    if (possible && cx->fma) qm.finite = cx->q_finite[bh];
    else if (possible) qm = float_magnitudes(cx->qf + q_at, nr, D, D, NULL);
    att_mm m = {0};
    m.tier = att_mm_tier(&cx->plan.score_acc, cx->fma, possible, qm.min, qm.max, qm.finite, cx->k_min[bhk],
                         cx->k_max[bhk], 1);
    m.index = ATT_MM_ROW_COL_K, m.zero = 1, m.acc = &cx->plan.score_acc, m.stream = ATT_STREAM(ATT_SCORE_ACC, bh);
    m.row0 = i0, m.col0 = j0;
    m.a = cx->q + q_at, m.af = cx->qf ? cx->qf + q_at : NULL, m.lda = D;
    m.b = cx->kt + k_at, m.bf = cx->ktf ? cx->ktf + k_at : NULL, m.ldb = cx->kt_cols;
    m.c = s, m.ldc = lds;
    /* the vector tiers run whole groups of 4 rows (q and s have the padding rows), so every score comes
     * from the same kernel whatever nr is: even the NaN of a sum of NaNs (whose sign the kernel's operand
     * order picks) does not depend on the tiling */
    att_mm_run(&m, m.tier == ATT_MM_SCALAR ? nr : att_rows(nr), NULL, NULL, D, nvis, ncols);
    /* s = R_score(c * R_score(acc)) */
    const double c = cx->plan.c;
    const att_stage *sc = &cx->plan.score;
    for (int64_t r = 0; r < nr; r++) {
        double *row = s + r * lds;
        if (cx->fast && sc->kind == ATT_RNE) {
            att_round_n(sc, row, row, nvis[r]);
            att_scale_n(row, c, row, nvis[r]);
            att_round_n(sc, row, row, nvis[r]);
        } else if (sc->kind == ATT_EXACT) {
            for (int64_t jj = 0; jj < nvis[r]; jj++) row[jj] = c * row[jj];
        } else if (cx->fast && sc->kind == ATT_F32) {
            att_f32_scale_n(row, c, row, nvis[r]);
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

void att_pv(const att_ctx *cx, int64_t bh, int64_t i0, int64_t nr, const int64_t *nvis, int64_t j0,
            const double *p, int64_t ldp, double *pv, int64_t ldo, float *pbuf, int p_finite) {
    const int64_t D = cx->plan.pr.dim, dpad = cx->d_pad, bhk = att_kv_head(cx, bh);
    const int64_t v_at = (bhk * cx->plan.pr.seq_kv + j0) * dpad;
    const int possible = cx->plan.pv_float && cx->v_finite[bhk];
    mag pm = MAG_EMPTY;
    if (possible && cx->fma) { /* the FMA tier reads only whether P is finite (p_finite: known to be) */
        for (int64_t r = 0; r < nr; r++) {
            if (p_finite) att_to_float_f(p + r * ldp, pbuf + r * ldp, nvis[r]);
            else pm.finite &= att_to_float_n(p + r * ldp, pbuf + r * ldp, nvis[r]);
        }
    } else if (possible) {
        for (int64_t r = 0; r < nr; r++)
            for (int64_t jj = 0; jj < nvis[r]; jj++) pbuf[r * ldp + jj] = (float)p[r * ldp + jj];
        pm = float_magnitudes(pbuf, nr, 0, ldp, nvis);
    }
    att_mm m = {0};
    m.tier = att_mm_tier(&cx->plan.pv_acc, cx->fma, possible, pm.min, pm.max, pm.finite, cx->v_min[bhk],
                         cx->v_max[bhk], 1);
    m.index = ATT_MM_ROW_K_COL, m.zero = 1, m.acc = &cx->plan.pv_acc, m.stream = ATT_STREAM(ATT_PV_ACC, bh);
    m.row0 = i0, m.k0 = j0;
    m.a = p, m.af = pbuf, m.lda = ldp;
    m.b = cx->v + v_at, m.bf = cx->vf ? cx->vf + v_at : NULL, m.ldb = dpad;
    m.c = pv, m.ldc = ldo;
    att_mm_run(&m, nr, NULL, nvis, 0, NULL, D);
}

/* ------------------------------------------------------------------ the output row */

void att_write_row(const att_ctx *cx, int64_t bh, int64_t i, int seen, const double *o, int divide, double m,
                   double l, double *out, double *lse) {
    const int64_t D = cx->plan.pr.dim;
    if (!seen) { /* no visible key: no rounding events */
        memset(out, 0, (size_t)D * sizeof(double));
        if (lse) *lse = -INFINITY;
        return;
    }
    const uint64_t s23 = ATT_STREAM(ATT_OUT, bh);
    if (cx->fast) { /* the same events as vector passes */
        if (divide) att_div_n(o, l, out, D);
        att_round_n(&cx->plan.out, divide ? out : o, out, D);
    } else if (divide)
        for (int64_t d = 0; d < D; d++) out[d] = att_round(&cx->plan.out, o[d] / l, s23, ATT_INDEX(i, d, 0));
    else
        for (int64_t d = 0; d < D; d++) out[d] = att_round(&cx->plan.out, o[d], s23, ATT_INDEX(i, d, 0));
    if (lse) {
        const uint64_t idx = ATT_INDEX(i, 0, 0), s13 = ATT_STREAM(ATT_STATS_LSE, bh);
        double log_l = att_round(&cx->plan.stats, log(l), ATT_STREAM(ATT_STATS_LOG, bh), idx);
        if (cx->plan.exp2) m = att_round(&cx->plan.stats, m * cx->plan.c2, s13, ATT_INDEX(i, 0, 1));
        *lse = att_round(&cx->plan.stats, m + log_l, s13, idx);
    }
}
