/* Flash attention forward (tiled online softmax) under a precision policy (docs/numerics.md, "Flash").
 * For each query block (block_q rows) and each K/V block jb of block_kv keys, ascending, per row i over
 * its visible keys j of the block (blocks with none are skipped for that row):
 *   s_j = R_score(c * R_score(Q_i . K_j))        c = R_score(scale), or R_score(scale log2 e) (exp2 form)
 *   m' = max(m, max_j s_j);  e_j = R_softmax(E(R_softmax(s_j - m')))         E = exp or exp2
 *   alpha = R_rescale(E(R_rescale(m - m')))      (0, unrounded, while m = -inf)
 *   l' = R_stats(R_stats(alpha l) + R_stats(rowsum_j e_j))                   rowsum in sum_acc
 *   pv_d = sum_j R_p(e_j) V[j,d]                 accumulated in pv_acc
 *   deferred (FA2): O = R_out_acc(R_out_acc(alpha O) + R_out_acc(pv));       out = R_out(O / l)
 *   eager (FA1):    O = R_out_acc(R_out_acc(R_out_acc(R_stats(alpha l) O) + R_out_acc(pv)) / l'); out = R_out(O)
 *   kv_outer: after every block O and l pass through memory: O = R_state_out(O), l = R_state_stats(l)
 *   lse = R_stats(m + R_stats(log l)); exp2 form: R_stats(R_stats(m * R_stats(ln 2)) + R_stats(log l)).
 * Every query row is independent: block_q only groups rows. On the CPU each task owns one query block
 * of one head, so both loop orders run the same loops; what kv_outer changes numerically is the round
 * trip of O and l through memory, which is applied after each block. Memory per task: the block's
 * scores and P (block_q x block_kv) and O, l, m for block_q rows, never O(N^2).
 * q: (B, H, Nq, D); k, v: (B, Hkv, Nk, D); out like q; lse (B, H, Nq) or NULL. */
#include <stdlib.h>

#include "attention.h"

typedef struct flash_job {
    const att_ctx *cx;
    double *out, *lse;
    int64_t block_q, block_kv; /* clamped to seq_q, seq_kv (same blocks, same numbers) */
    int64_t tasks_per_head;
} flash_job;

typedef struct flash_scratch {
    double *s, *p, *pv, *o, *m, *l, *factor, *lnew, *mnew, *rowsum, *tmp;
    float *pbuf;
    int64_t *nvis, *seen;
    int p_finite; /* 1: block_softmax_fast saw that every P of the block is finite */
} flash_scratch;

static void scratch_free(flash_scratch *w) {
    free(w->s), free(w->p), free(w->pv), free(w->o), free(w->m), free(w->l);
    free(w->factor), free(w->lnew), free(w->mnew), free(w->rowsum), free(w->tmp), free(w->pbuf), free(w->nvis);
    free(w->seen);
}

/* Steps 4-5 of one row for one block, given its old and new maximum and the row sum of its e_j: new l;
 * returns alpha (or a_l in the eager form, the factor O is multiplied by). */
static double row_stats(const att_ctx *cx, int64_t bh, int64_t i, int64_t jb, double m, double m_new, double rowsum,
                        double *l_io, double *l_new_out) {
    const uint64_t idx = ATT_INDEX(i, jb, 0);
    double alpha = 0;
    if (m != -INFINITY) {
        double diff = att_round(&cx->plan.rescale, m - m_new, ATT_STREAM(ATT_RESCALE_DIFF, bh), idx);
        alpha = att_round(&cx->plan.rescale, att_exp(cx, diff), ATT_STREAM(ATT_RESCALE_ALPHA, bh), idx);
    }
    double a_l = att_round(&cx->plan.stats, alpha * *l_io, ATT_STREAM(ATT_STATS_AL, bh), idx);
    double rs = att_round(&cx->plan.stats, rowsum, ATT_STREAM(ATT_STATS_ROWSUM, bh), idx);
    double l_new = att_round(&cx->plan.stats, a_l + rs, ATT_STREAM(ATT_STATS_LNEW, bh), idx);
    *l_io = l_new;
    *l_new_out = l_new;
    return cx->plan.pr.normalize == FADEV_EAGER ? a_l : alpha;
}

/* Steps 1-5 of one row for one block: scores s (nv of them) -> P_j in p, new m and l; returns row_stats'. */
static double row_softmax(const att_ctx *cx, int64_t bh, int64_t i, int64_t jb, int64_t j0, const double *s,
                          int64_t nv, double *p, double *m_io, double *l_io, double *l_new_out) {
    double m = *m_io, m_new = m;
    for (int64_t jj = 0; jj < nv; jj++) m_new = att_max(m_new, s[jj]);
    const uint64_t s6 = ATT_STREAM(ATT_SOFTMAX_SUB, bh), s7 = ATT_STREAM(ATT_SOFTMAX_EXP, bh);
    const uint64_t s8 = ATT_STREAM(ATT_SUM_ACC, bh), s16 = ATT_STREAM(ATT_P, bh);
    double rowsum = 0;
    for (int64_t jj = 0; jj < nv; jj++) {
        uint64_t idx = ATT_INDEX(i, j0 + jj, 0);
        double x = att_round(&cx->plan.softmax, s[jj] - m_new, s6, idx);
        double e = att_round(&cx->plan.softmax, att_exp(cx, x), s7, idx);
        rowsum = att_round(&cx->plan.sum_acc, rowsum + e, s8, idx);
        p[jj] = att_round(&cx->plan.p, e, s16, idx);
    }
    *m_io = m_new;
    return row_stats(cx, bh, i, jb, m, m_new, rowsum, l_io, l_new_out);
}

/* The same for the block's rows with the vector steps (cx->fast, fast.c): the same events on the same values.
 * The scores in s are overwritten with e_j. */
static void block_softmax_fast(const att_ctx *cx, int64_t bh, int64_t i0, int64_t nr, int64_t jb, flash_scratch *w,
                               int64_t lds) {
    w->p_finite = 1;
    for (int64_t r = 0; r < nr; r++) {
        if (!w->nvis[r]) continue;
        double *s = w->s + r * lds;
        w->mnew[r] = att_max_n(w->m[r], s, w->nvis[r]);
        att_exp_row(cx, cx->plan.exp2, w->mnew[r], s, w->nvis[r]);
        w->p_finite &= att_round_n(&cx->plan.p, s, w->p + r * lds, w->nvis[r]);
    }
    att_row_sums(&cx->plan.sum_acc, att_inside_fp32(&cx->plan.softmax.fmt), w->s, lds, w->nvis, nr, w->rowsum);
    for (int64_t r = 0; r < nr; r++) {
        if (!w->nvis[r]) continue;
        w->factor[r] = row_stats(cx, bh, i0 + r, jb, w->m[r], w->mnew[r], w->rowsum[r], &w->l[r], &w->lnew[r]);
        w->m[r] = w->mnew[r];
    }
}

/* Step 7 (and 9) for one row: O updated in place from pv. */
static void row_update(const att_ctx *cx, int64_t bh, int64_t i, int64_t jb, double factor, double l_new,
                       const double *pv, double *o, double *l_io) {
    const int64_t D = cx->plan.pr.dim;
    const att_stage *oa = &cx->plan.out_acc;
    const uint64_t s18 = ATT_STREAM(ATT_OUT_ACC_AO, bh), s19 = ATT_STREAM(ATT_OUT_ACC_PV, bh);
    const uint64_t s20 = ATT_STREAM(ATT_OUT_ACC_SUM, bh), s24 = ATT_STREAM(ATT_OUT_ACC_DIV, bh);
    for (int64_t d = 0; d < D; d++) {
        uint64_t idx = ATT_INDEX(i, jb, d);
        double scaled = att_round(oa, factor * o[d], s18, idx), part = att_round(oa, pv[d], s19, idx);
        o[d] = att_round(oa, scaled + part, s20, idx);
        if (cx->plan.pr.normalize == FADEV_EAGER) o[d] = att_round(oa, o[d] / l_new, s24, idx);
    }
    if (cx->plan.pr.loop_order == FADEV_KV_OUTER) {
        const uint64_t s21 = ATT_STREAM(ATT_STATE_OUT, bh);
        for (int64_t d = 0; d < D; d++) o[d] = att_round(&cx->plan.state_out, o[d], s21, ATT_INDEX(i, jb, d));
        *l_io = att_round(&cx->plan.state_stats, *l_io, ATT_STREAM(ATT_STATE_STATS, bh), ATT_INDEX(i, jb, 0));
    }
}

/* row_update with the vector steps (cx->fast): the same events; pv is overwritten, tmp holds D doubles. */
static void row_update_fast(const att_ctx *cx, double factor, double l_new, double *pv, double *o, double *tmp,
                            double *l_io) {
    const int64_t D = cx->plan.pr.dim;
    const att_stage *oa = &cx->plan.out_acc;
    if (oa->kind == ATT_F32 && cx->plan.pr.normalize != FADEV_EAGER && cx->plan.pr.loop_order != FADEV_KV_OUTER) {
        att_f32_update_n(o, factor, pv, D); /* the three events below in one pass */
        return;
    }
    att_scale_n(o, factor, tmp, D);
    att_round_n(oa, tmp, tmp, D);
    att_round_n(oa, pv, pv, D);
    att_add_n(tmp, pv, o, D);
    att_round_n(oa, o, o, D);
    if (cx->plan.pr.normalize == FADEV_EAGER) {
        att_div_n(o, l_new, o, D);
        att_round_n(oa, o, o, D);
    }
    if (cx->plan.pr.loop_order == FADEV_KV_OUTER) {
        att_round_n(&cx->plan.state_out, o, o, D);
        *l_io = att_round(&cx->plan.state_stats, *l_io, 0, 0);
    }
}

static fadev_status flash_task(void *ctxp, size_t task) {
    const flash_job *job = (const flash_job *)ctxp;
    const att_ctx *cx = job->cx;
    const fadev_attention_params *pr = &cx->plan.pr;
    const int64_t D = pr->dim, Nq = pr->seq_q, Nk = pr->seq_kv, bq = job->block_q, bkv = job->block_kv;
    const int64_t bh = (int64_t)task / job->tasks_per_head;
    const int64_t i0 = ((int64_t)task % job->tasks_per_head) * bq;
    const int64_t nr = i0 + bq < Nq ? bq : Nq - i0;
    const int64_t rows = att_rows(nr), lds = att_score_ld(bkv), ldo = cx->d_pad;
    flash_scratch w;
    w.s = malloc((size_t)(rows * lds) * sizeof(double));
    w.p = malloc((size_t)(nr * lds) * sizeof(double));
    w.pbuf = malloc((size_t)(nr * lds) * sizeof(float));
    w.pv = malloc((size_t)(nr * ldo) * sizeof(double));
    w.o = calloc((size_t)(nr * D), sizeof(double));
    w.m = malloc((size_t)nr * sizeof(double));
    w.l = malloc((size_t)nr * sizeof(double));
    w.factor = malloc((size_t)nr * sizeof(double));
    w.lnew = malloc((size_t)nr * sizeof(double));
    w.mnew = malloc((size_t)nr * sizeof(double));
    w.rowsum = malloc((size_t)nr * sizeof(double));
    w.tmp = malloc((size_t)D * sizeof(double));
    w.nvis = malloc((size_t)nr * sizeof(int64_t));
    w.seen = calloc((size_t)nr, sizeof(int64_t));
    if (!w.s || !w.p || !w.pbuf || !w.pv || !w.o || !w.m || !w.l || !w.factor || !w.lnew || !w.mnew || !w.rowsum ||
        !w.tmp || !w.nvis || !w.seen) {
        scratch_free(&w);
        return FADEV_ERR_NO_MEMORY;
    }
    for (int64_t r = 0; r < nr; r++) w.m[r] = -INFINITY, w.l[r] = 0;
    w.p_finite = 0;
    const int64_t n_blocks = (Nk + bkv - 1) / bkv;
    for (int64_t jb = 0; jb < n_blocks; jb++) {
        const int64_t j0 = jb * bkv, n = j0 + bkv < Nk ? bkv : Nk - j0;
        int64_t any = 0;
        for (int64_t r = 0; r < nr; r++) {
            w.nvis[r] = att_visible(cx, i0 + r, j0, n);
            any |= w.nvis[r];
        }
        if (!any) {
            if (cx->plan.pr.causal) break; /* later blocks are masked for every row too */
            continue;
        }
        att_scores(cx, bh, i0, nr, w.nvis, j0, w.s, lds);
        if (cx->fast) {
            block_softmax_fast(cx, bh, i0, nr, jb, &w, lds);
        } else {
            for (int64_t r = 0; r < nr; r++)
                if (w.nvis[r])
                    w.factor[r] = row_softmax(cx, bh, i0 + r, jb, j0, w.s + r * lds, w.nvis[r], w.p + r * lds,
                                              &w.m[r], &w.l[r], &w.lnew[r]);
        }
        att_pv(cx, bh, i0, nr, w.nvis, j0, w.p, lds, w.pv, ldo, w.pbuf, w.p_finite);
        for (int64_t r = 0; r < nr; r++) {
            if (!w.nvis[r]) continue;
            w.seen[r] = 1;
            if (cx->fast) row_update_fast(cx, w.factor[r], w.lnew[r], w.pv + r * ldo, w.o + r * D, w.tmp, &w.l[r]);
            else row_update(cx, bh, i0 + r, jb, w.factor[r], w.lnew[r], w.pv + r * ldo, w.o + r * D, &w.l[r]);
        }
    }
    for (int64_t r = 0; r < nr; r++) {
        const int64_t i = i0 + r;
        att_write_row(cx, bh, i, (int)w.seen[r], w.o + r * D, cx->plan.pr.normalize != FADEV_EAGER, w.m[r], w.l[r],
                      job->out + (bh * Nq + i) * D, job->lse ? job->lse + bh * Nq + i : NULL);
    }
    scratch_free(&w);
    return FADEV_OK;
}

fadev_status fadev_flash_attention(const double *q, const double *k, const double *v, double *out, double *lse,
                                   const fadev_attention_params *params, const fadev_policy *policy) {
    fadev_status st = att_validate(q, k, v, out, params, policy, 1);
    if (st != FADEV_OK) return st;
    flash_job job;
    job.out = out;
    job.lse = lse;
    job.block_q = params->block_q < params->seq_q ? params->block_q : params->seq_q;
    job.block_kv = params->block_kv < params->seq_kv ? params->block_kv : params->seq_kv;
    size_t scratch;
    if (__builtin_mul_overflow((size_t)att_rows(job.block_q), (size_t)att_score_ld(job.block_kv), &scratch) ||
        scratch > SIZE_MAX / 16)
        return FADEV_ERR_OVERFLOW;
    att_ctx cx;
    st = att_init(&cx, q, k, v, params, policy, params->exp_form == FADEV_EXP2);
    if (st != FADEV_OK) return st;
    job.cx = &cx;
    job.tasks_per_head = (params->seq_q + job.block_q - 1) / job.block_q;
    st = fadev_parallel_for((size_t)(params->batch * params->heads * job.tasks_per_head), flash_task, &job);
    att_free(&cx);
    return st;
}
