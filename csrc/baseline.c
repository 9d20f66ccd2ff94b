/* Baseline (materialised) attention forward under a precision policy (docs/numerics.md, "Baseline").
 * For each query row i of head (b, h), over its visible keys j (causal: j <= i + Nk - Nq):
 *   s_j = R_score(c * R_score(Q_i . K_j))            c = R_score(scale), dot accumulated in score_acc
 *   m = max_j s_j;  x_j = R_softmax(s_j - m);  e_j = R_softmax(exp(x_j))
 *   l = R_stats(sum_j e_j)                            the sum accumulated in sum_acc, j ascending
 *   P_j = R_p(e_j / l);  out[i,d] = R_out(sum_j P_j V[j,d])   the sum accumulated in pv_acc
 *   lse = R_stats(m + R_stats(log l))
 * q: (B, H, Nq, D); k, v: (B, Hkv, Nk, D), query head h reads K/V head h / (H / Hkv); out like q;
 * lse: (B, H, Nq) or NULL. A row with no visible key gives out = 0, lse = -inf.
 * Tasks are (b, h, 16 query rows); each materialises the scores of 4 rows at a time (O(Nk) memory),
 * so results do not depend on the number of threads. */
#include <stdlib.h>

#include "attention.h"

enum { TASK_ROWS = 16, GROUP = 4 };

typedef struct baseline_job {
    const att_ctx *cx;
    double *out, *lse;
    int64_t tasks_per_head;
} baseline_job;

/* Steps m, e, l, P of one row (attention.h); the baseline backward recomputes P with it. */
void att_softmax_row(const att_ctx *cx, int64_t bh, int64_t i, double *s, int64_t nv, double *p, double *m_out,
                     double *l_out) {
    double m = -INFINITY;
    for (int64_t j = 0; j < nv; j++) m = att_max(m, s[j]);
    const uint64_t s6 = ATT_STREAM(ATT_SOFTMAX_SUB, bh), s7 = ATT_STREAM(ATT_SOFTMAX_EXP, bh);
    const uint64_t s8 = ATT_STREAM(ATT_SUM_ACC, bh), s16 = ATT_STREAM(ATT_P, bh);
    for (int64_t j = 0; j < nv; j++) {
        uint64_t idx = ATT_INDEX(i, j, 0);
        double x = att_round(&cx->plan.softmax, s[j] - m, s6, idx);
        s[j] = att_round(&cx->plan.softmax, exp(x), s7, idx);
    }
    double acc = 0;
    for (int64_t j = 0; j < nv; j++) acc = att_round(&cx->plan.sum_acc, acc + s[j], s8, ATT_INDEX(i, j, 0));
    double l = att_round(&cx->plan.stats, acc, ATT_STREAM(ATT_STATS_AL, bh), ATT_INDEX(i, 0, 0));
    for (int64_t j = 0; j < nv; j++) p[j] = att_round(&cx->plan.p, s[j] / l, s16, ATT_INDEX(i, j, 0));
    *m_out = m;
    *l_out = l;
}

void att_softmax_rows(const att_ctx *cx, int64_t bh, int64_t i0, int64_t nr, const int64_t *nvis, double *s,
                      int64_t lds, double *p, double *m, double *l) {
    if (!cx->fast) {
        for (int64_t r = 0; r < nr; r++)
            att_softmax_row(cx, bh, i0 + r, s + r * lds, nvis[r], p + r * lds, &m[r], &l[r]);
        return;
    }
    /* the vector steps (fast.c): the same events, the rows' sums side by side */
    for (int64_t r = 0; r < nr; r++) {
        m[r] = -INFINITY, l[r] = 0; /* att_softmax_row's answer for a row without keys */
        if (nvis[r] <= 0) continue;
        m[r] = att_max_n(-INFINITY, s + r * lds, nvis[r]);
        att_exp_row(cx, 0, m[r], s + r * lds, nvis[r]);
    }
    att_row_sums(&cx->plan.sum_acc, att_inside_fp32(&cx->plan.softmax.fmt), s, lds, nvis, nr, l);
    for (int64_t r = 0; r < nr; r++) {
        if (nvis[r] <= 0) continue;
        l[r] = att_round(&cx->plan.stats, l[r], 0, 0);
        att_div_n(s + r * lds, l[r], p + r * lds, nvis[r]);
        att_round_n(&cx->plan.p, p + r * lds, p + r * lds, nvis[r]);
    }
}

static fadev_status baseline_task(void *ctxp, size_t task) {
    const baseline_job *job = (const baseline_job *)ctxp;
    const att_ctx *cx = job->cx;
    const int64_t D = cx->plan.pr.dim, Nq = cx->plan.pr.seq_q, Nk = cx->plan.pr.seq_kv;
    const int64_t bh = (int64_t)task / job->tasks_per_head;
    const int64_t first = ((int64_t)task % job->tasks_per_head) * TASK_ROWS;
    const int64_t last = first + TASK_ROWS < Nq ? first + TASK_ROWS : Nq;
    const int64_t lds = att_score_ld(Nk), ldo = cx->d_pad;
    double *s = malloc((size_t)(GROUP * lds) * sizeof(double));
    double *p = malloc((size_t)(GROUP * lds) * sizeof(double));
    float *pbuf = malloc((size_t)(GROUP * lds) * sizeof(float));
    double *pv = malloc((size_t)(GROUP * ldo) * sizeof(double));
    if (!s || !p || !pbuf || !pv) {
        free(s), free(p), free(pbuf), free(pv);
        return FADEV_ERR_NO_MEMORY;
    }
    for (int64_t i0 = first; i0 < last; i0 += GROUP) {
        int64_t nr = last - i0 < GROUP ? last - i0 : GROUP;
        int64_t nvis[GROUP];
        double m[GROUP] = {0}, l[GROUP] = {0};
        for (int64_t r = 0; r < nr; r++) nvis[r] = att_visible(cx, i0 + r, 0, Nk);
        att_scores(cx, bh, i0, nr, nvis, 0, s, lds);
        att_softmax_rows(cx, bh, i0, nr, nvis, s, lds, p, m, l);
        att_pv(cx, bh, i0, nr, nvis, 0, p, lds, pv, ldo, pbuf, 0);
        for (int64_t r = 0; r < nr; r++) {
            const int64_t i = i0 + r;
            att_write_row(cx, bh, i, nvis[r] > 0, pv + r * ldo, 0, m[r], l[r], job->out + (bh * Nq + i) * D,
                          job->lse ? job->lse + bh * Nq + i : NULL);
        }
    }
    free(s), free(p), free(pbuf), free(pv);
    return FADEV_OK;
}

fadev_status fadev_baseline_attention(const double *q, const double *k, const double *v, double *out, double *lse,
                                      const fadev_attention_params *params, const fadev_policy *policy) {
    fadev_status st = att_validate(q, k, v, out, params, policy, 0);
    if (st != FADEV_OK) return st;
    att_ctx cx;
    st = att_init(&cx, q, k, v, params, policy, 0);
    if (st != FADEV_OK) return st;
    baseline_job job = {&cx, out, lse, (params->seq_q + TASK_ROWS - 1) / TASK_ROWS};
    st = fadev_parallel_for((size_t)(params->batch * params->heads * job.tasks_per_head), baseline_task, &job);
    att_free(&cx);
    return st;
}
