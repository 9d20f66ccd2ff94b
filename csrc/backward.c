/* Attention backward under a precision policy, FlashAttention-2 order (docs/numerics.md, "Backward").
 * For query head h (K/V head g = h / (H / Hkv)), query row i and each key j it sees:
 *   s_ij as the forward computes it (same events, same counters);
 *   flash:    P = R_softmax(E(R_softmax(s_ij - L_i))), L_i = R_stats(lse_i), times R_stats(log2 e) in exp2 form;
 *   baseline: P = R_p(R_softmax(exp(R_softmax(s_ij - m_i))) / l_i) with m_i, l_i exactly as its forward;
 *   P' = R_bwd_p(P);  dP = R_dp(dO_i . V_j)                                    the dot product in dp_acc
 *   D_i = R_dsoft(dO_i . O_i) (flash) or R_dsoft(sum_j R_dsoft_p(P_ij) dP_ij) (baseline) the sum in delta_acc
 *   dS = R_ds(R_dsoft(R_dsoft_p(P) R_dsoft(dP - D_i)))    (P' feeds only the dV product)
 *        ds_scaled (xformers): dS = R_ds(R_dsoft(c R_dsoft(R_dsoft_p(P) R_dsoft(dP - D_i)))), and c' = 1 below
 *   dQ_i: for each K/V block jb ascending, dQ_i = R_dq_acc(dQ_i + sum_{j in jb} dS_ij K_j)      sums in grad_acc
 *   dV_j: for each query head of the group, each query block qb ascending,
 *         dV_j = R_dkv_acc(dV_j + sum_{i in qb} P'_ij dO_i); dK_j likewise with dS_ij Q_i
 *   dq = R_grad(c' dQ), dk = R_grad(c' dK), dv = R_grad(dV), c' = c = R_score(scale); no visible pair: exactly 0.
 * The baseline is the same with one query block of Nq rows and one K/V block of Nk keys.
 * q, out, dout, dq: (B, H, Nq, D); k, v, dk, dv: (B, Hkv, Nk, D); lse: (B, H, Nq); contiguous float64.
 *
 * Work split (every per-element operation order above is kept, so the bits do not depend on it): the
 * logical blocks (block_q x block_kv) fix the numbers; they are computed in tiles of at most TILE_Q x
 * TILE_KV inside one logical block, the grad_acc sums running on from tile to tile. FA2's loop, K/V
 * tiles outer: a task per (b, g, key tile) owns dK, dV of its keys (query heads of the group, query
 * blocks, row tiles in order) and hands each row tile's dQ terms on to the next key tile's task in
 * key order (progress counters), like FA2's dQ accumulation made deterministic: nothing is recomputed
 * and every (b, g, key tile) runs in parallel, in a pipeline along the keys. The tiles are in
 * backward_tile.c, their block products in matmul.c (the forward's). Memory: O(N D) (rounded operand
 * copies, dQ's running sums, per-row statistics) plus per task a tile's scratch. */
#define _POSIX_C_SOURCE 200809L /* sched_yield */
#include <sched.h>
#include <stdlib.h>
#include <string.h>

#include "backward.h"

/* ------------------------------------------------------------------ block sums and results (steps 7, 8) */

/* dQacc = R_dq_acc(dQacc + part) for the rows i0.. of head bh that see a key of K/V block jb (first key k0). */
static void add_dq_block(const bwd_ctx *bx, int64_t bh, int64_t i0, int64_t nr, int64_t jb, int64_t k0,
                         const double *part, double *acc) {
    const int64_t D = bx->cx.plan.pr.dim;
    const uint64_t stream = BWD_STREAM(EV_DQ_ACC, bh);
    for (int64_t r = 0; r < nr; r++) {
        if (last_key(&bx->cx, i0 + r) < k0) continue;
        if (bx->cx.fast) { /* the same events as vector passes (nearest-even: no counters) */
            att_add_round_n(&bx->dq_acc, acc + r * D, part + r * bx->ld, D);
            continue;
        }
        for (int64_t d = 0; d < D; d++)
            acc[r * D + d] = att_round(&bx->dq_acc, acc[r * D + d] + part[r * bx->ld + d], stream,
                                       ATT_INDEX(i0 + r, jb, d));
    }
}

/* dVacc, dKacc = R_dkv_acc(acc + part) for the keys k0.. that a row of query block qb (last row q_last) of
 * head bh sees. */
static void add_dkv_block(const bwd_ctx *bx, bwd_work *w, int64_t bh, int64_t qb, int64_t q_last, int64_t k0,
                          int64_t nk) {
    const int64_t D = bx->cx.plan.pr.dim, ld = bx->ld, seen = last_key(&bx->cx, q_last) - k0 + 1;
    const uint64_t sv = BWD_STREAM(EV_DKV_DV, bh), sk = BWD_STREAM(EV_DKV_DK, bh);
    for (int64_t c = 0; bx->cx.fast && c < nk && c < seen; c++) {
        att_add_round_n(&bx->dkv_acc, w->dv_acc + c * D, w->dv_part + c * ld, D);
        att_add_round_n(&bx->dkv_acc, w->dk_acc + c * D, w->dk_part + c * ld, D);
    }
    for (int64_t c = 0; !bx->cx.fast && c < nk && c < seen; c++)
        for (int64_t d = 0; d < D; d++) {
            uint64_t idx = ATT_INDEX(qb, k0 + c, d);
            w->dv_acc[c * D + d] = att_round(&bx->dkv_acc, w->dv_acc[c * D + d] + w->dv_part[c * ld + d], sv, idx);
            w->dk_acc[c * D + d] = att_round(&bx->dkv_acc, w->dk_acc[c * D + d] + w->dk_part[c * ld + d], sk, idx);
        }
}

/* dk = R_grad(c dKacc), dv = R_grad(dVacc) for keys k0.. of K/V head (b, g). (Every key has a visible pair:
 * the bottom-right causal mask shows the last query row every key.) */
static void finish_dkv(const bwd_ctx *bx, const bwd_work *w, int64_t b, int64_t g, int64_t k0, int64_t nk) {
    const att_ctx *cx = &bx->cx;
    const int64_t D = cx->plan.pr.dim, bhk = b * cx->plan.pr.heads_kv + g;
    const uint64_t sk = BWD_STREAM(EV_GRAD_DK, bhk), sv = BWD_STREAM(EV_GRAD_DV, bhk);
    for (int64_t c = 0; c < nk; c++) {
        const int64_t j = k0 + c;
        double *dk = bx->dk + (bhk * cx->plan.pr.seq_kv + j) * D, *dv = bx->dv + (bhk * cx->plan.pr.seq_kv + j) * D;
        for (int64_t d = 0; d < D; d++) {
            dk[d] = att_round(&bx->grad, bx->c_grad * w->dk_acc[c * D + d], sk, ATT_INDEX(j, d, 0));
            dv[d] = att_round(&bx->grad, w->dv_acc[c * D + d], sv, ATT_INDEX(j, d, 0));
        }
    }
}

/* dq = R_grad(c dQacc) for rows i0.. of head bh (acc: their dQacc, row stride D; may be dq itself). */
static void finish_dq(const bwd_ctx *bx, int64_t bh, int64_t i0, int64_t nr, const double *acc) {
    const int64_t D = bx->cx.plan.pr.dim;
    const uint64_t stream = BWD_STREAM(EV_GRAD_DQ, bh);
    for (int64_t r = 0; r < nr; r++) {
        double *dq = bx->dq + (bh * bx->cx.plan.pr.seq_q + i0 + r) * D;
        if (last_key(&bx->cx, i0 + r) < 0) {
            memset(dq, 0, (size_t)D * sizeof(double));
            continue;
        }
        for (int64_t d = 0; d < D; d++)
            dq[d] = att_round(&bx->grad, bx->c_grad * acc[r * D + d], stream, ATT_INDEX(i0 + r, d, 0));
    }
}

/* ------------------------------------------------------------------ tasks */

typedef struct bwd_job {
    bwd_ctx *bx;
    const double *out, *lse, *dout;
} bwd_job;

/* prep_task's work on row i of query head bh with the vector events (cx->fast): the copies of dO and Q, their
 * magnitudes (only whether they are finite under the FMA tier), and for flash the sum of D_i before R_dsoft. */
static double prep_row_fast(bwd_ctx *bx, const bwd_job *job, int64_t bh, int64_t i, mag *dm, mag *qm) {
    const att_ctx *cx = &bx->cx;
    const int64_t D = cx->plan.pr.dim, row = bh * cx->plan.pr.seq_q + i, ld = bx->ld;
    double x[256], o[256], acc = 0;
    const double *qx = cx->q + (bh * cx->q_rows + i) * D;
    att_round_n(&cx->plan.input, job->dout + row * D, x, D);
    memcpy(bx->dout + row * ld, x, (size_t)D * sizeof(double));
    memcpy(bx->q + row * ld, qx, (size_t)D * sizeof(double));
    if (bx->doutf) (void)att_to_float_n(x, bx->doutf + row * ld, D);
    if (bx->qf) (void)att_to_float_n(qx, bx->qf + row * ld, D);
    if (cx->fma) {
        dm->finite &= att_finite_d(x, D), qm->finite &= att_finite_d(qx, D);
    } else {
        for (int64_t t = 0; t < D; t++) mag_add(dm, x[t]), mag_add(qm, qx[t]);
    }
    if (bx->baseline) return 0;
    att_round_n(&cx->plan.out, job->out + row * D, o, D);
    for (int64_t t = 0; t < D; t++) acc = att_round(&bx->delta_acc, acc + x[t] * o[t], 0, 0);
    return acc;
}

/* Query head task < B*H: dO and the Q copy (with magnitudes), and for flash L_i and D_i (steps 2, 5).
 * K/V head task: the K and V^T copies. */
static fadev_status prep_task(void *ctxp, size_t task) {
    const bwd_job *job = (const bwd_job *)ctxp;
    bwd_ctx *bx = job->bx; /* each task writes its own head's rows */
    const att_ctx *cx = &bx->cx;
    const fadev_attention_params *pr = &cx->plan.pr;
    const int64_t D = pr->dim, Nq = pr->seq_q, Nk = pr->seq_kv, ld = bx->ld, nqh = pr->batch * pr->heads;
    if ((int64_t)task >= nqh) {
        const int64_t bhk = (int64_t)task - nqh;
        for (int64_t j = 0; j < Nk; j++)
            for (int64_t d = 0; d < D; d++) {
                double kx = cx->kt[(bhk * D + d) * cx->kt_cols + j], vx = cx->v[(bhk * Nk + j) * cx->d_pad + d];
                size_t at_k = (size_t)((bhk * Nk + j) * ld + d), at_v = (size_t)((bhk * D + d) * bx->vt_cols + j);
                bx->k[at_k] = kx, bx->vt[at_v] = vx;
                if (bx->kf) bx->kf[at_k] = (float)kx;
                if (bx->vtf) bx->vtf[at_v] = (float)vx;
            }
        return FADEV_OK;
    }
    const int64_t bh = (int64_t)task;
    memset(bx->dq + bh * Nq * D, 0, (size_t)(Nq * D) * sizeof(double)); /* dQacc starts at 0 */
    const uint64_t s0 = BWD_STREAM(EV_DOUT, bh), s1 = BWD_STREAM(EV_OUT, bh), s4 = BWD_STREAM(EV_DELTA_ACC, bh);
    mag dm = MAG_EMPTY, qm = MAG_EMPTY;
    for (int64_t i = 0; i < Nq; i++) {
        const int64_t row = bh * Nq + i;
        double acc = 0;
        if (cx->fast) acc = prep_row_fast(bx, job, bh, i, &dm, &qm);
        for (int64_t d = 0; !cx->fast && d < D; d++) {
            double x = att_round(&cx->plan.input, job->dout[row * D + d], s0, ATT_INDEX(i, d, 0));
            double qx = cx->q[(bh * cx->q_rows + i) * D + d];
            bx->dout[row * ld + d] = x, bx->q[row * ld + d] = qx;
            if (bx->doutf) bx->doutf[row * ld + d] = (float)x;
            if (bx->qf) bx->qf[row * ld + d] = (float)qx;
            mag_add(&dm, x), mag_add(&qm, qx);
            if (!bx->baseline) {
                double o = att_round(&cx->plan.out, job->out[row * D + d], s1, ATT_INDEX(i, d, 0));
                acc = att_round(&bx->delta_acc, acc + x * o, s4, ATT_INDEX(i, d, 0));
            }
        }
        if (bx->baseline) continue;
        const uint64_t idx = ATT_INDEX(i, 0, 0);
        bx->row_d[row] = att_round(&bx->dsoft, acc, BWD_STREAM(EV_DELTA, bh), idx);
        double lse = att_round(&cx->plan.stats, job->lse[row], BWD_STREAM(EV_LSE, bh), idx);
        bx->row_l[row] =
            cx->plan.exp2 ? att_round(&cx->plan.stats, lse * bx->c3, BWD_STREAM(EV_LSE_LOG2, bh), idx) : lse;
    }
    bx->do_min[bh] = dm.min, bx->do_max[bh] = dm.max, bx->do_finite[bh] = dm.finite;
    bx->q_min[bh] = qm.min, bx->q_max[bh] = qm.max, bx->q_finite[bh] = qm.finite;
    return FADEV_OK;
}

enum { STATS_ROWS = 16, STATS_GROUP = 4 };

/* Baseline rows (b, h, STATS_ROWS rows): m, l and P by the baseline forward's att_softmax_row, and
 * D_i = R_dsoft(sum_j R_dsoft_p(P_ij) dP_ij) (step 5), all keys of a row at once. */
static fadev_status baseline_stats_task(void *ctxp, size_t task) {
    const bwd_job *job = (const bwd_job *)ctxp;
    bwd_ctx *bx = job->bx;
    const att_ctx *cx = &bx->cx;
    const int64_t Nq = cx->plan.pr.seq_q, Nk = cx->plan.pr.seq_kv, per_head = (Nq + STATS_ROWS - 1) / STATS_ROWS;
    const int64_t bh = (int64_t)task / per_head, first = ((int64_t)task % per_head) * STATS_ROWS;
    const int64_t last = min64(first + STATS_ROWS, Nq), lds = att_score_ld(Nk);
    double *s = malloc((size_t)(STATS_GROUP * lds) * sizeof(double));
    double *dp = malloc((size_t)(STATS_GROUP * lds) * sizeof(double));
    if (!s || !dp) {
        free(s), free(dp);
        return FADEV_ERR_NO_MEMORY;
    }
    const uint64_t b4 = BWD_STREAM(EV_DELTA_ACC, bh), b21 = BWD_STREAM(EV_DSOFT_P, bh), b8 = BWD_STREAM(EV_DP, bh);
    for (int64_t i0 = first; i0 < last; i0 += STATS_GROUP) {
        const int64_t nr = min64(STATS_GROUP, last - i0);
        int64_t nvis[STATS_GROUP], maxv = 0;
        for (int64_t r = 0; r < nr; r++) maxv = max64(maxv, nvis[r] = att_visible(cx, i0 + r, 0, Nk));
        if (maxv == 0) continue;
        att_scores(cx, bh, i0, nr, nvis, 0, s, lds);
        bwd_dp_products(bx, bh, i0, nr, nvis, 0, maxv, dp, lds);
        double mr[STATS_GROUP], lr[STATS_GROUP];
        att_softmax_rows(cx, bh, i0, nr, nvis, s, lds, s, mr, lr); /* P in place of the scores */
        double dots[STATS_GROUP];
        if (cx->fast) { /* the same events as vector passes, the rows' sums side by side */
            for (int64_t r = 0; r < nr; r++) {
                att_round_n(&bx->dsoft_p, s + r * lds, s + r * lds, nvis[r]);
                att_round_n(&bx->dp, dp + r * lds, dp + r * lds, nvis[r]);
            }
            att_row_dots(&bx->delta_acc, s, dp, lds, nvis, nr, dots);
        }
        for (int64_t r = 0; r < nr; r++) {
            const int64_t i = i0 + r, row = bh * Nq + i;
            double *p = s + r * lds, m = mr[r], l = lr[r], acc = cx->fast ? dots[r] : 0;
            for (int64_t j = 0; !cx->fast && j < nvis[r]; j++) {
                uint64_t idx = ATT_INDEX(i, j, 0);
                double ps = att_round(&bx->dsoft_p, p[j], b21, idx);
                acc = att_round(&bx->delta_acc, acc + ps * att_round(&bx->dp, dp[r * lds + j], b8, idx), b4, idx);
            }
            bx->row_m[row] = m, bx->row_l[row] = l;
            bx->row_d[row] = att_round(&bx->dsoft, acc, BWD_STREAM(EV_DELTA, bh), ATT_INDEX(i, 0, 0));
        }
    }
    free(s), free(dp);
    return FADEV_OK;
}

/* Key tile kt of a (b, g) pair: keys [k0, k0 + nk) of K/V block jb; returns 1 for the block's last tile. */
static int key_tile(const bwd_ctx *bx, int64_t kt, int64_t *jb, int64_t *k0, int64_t *nk) {
    const int64_t per_block = (bx->block_kv + bx->tile_kv - 1) / bx->tile_kv;
    *jb = kt / per_block;
    const int64_t end = min64((*jb + 1) * bx->block_kv, bx->cx.plan.pr.seq_kv);
    *k0 = *jb * bx->block_kv + (kt % per_block) * bx->tile_kv;
    *nk = min64(bx->tile_kv, end - *k0);
    return *k0 + *nk == end;
}

/* Task (b, g, key tile kt): dK and dV of the tile's keys, walking the group's query heads, their query
 * blocks and row tiles in order (the steps). At each step the tile's dQ terms join the running dQ sums
 * of those rows (bx->dq_part) once key tile kt - 1 has added its own: the task waits for its
 * predecessor's progress counter, so every dQ sum runs over the keys in ascending order whatever thread
 * runs which tile. The last tile of a K/V block adds the block's sum into dQacc (kept in dq). Tasks are
 * handed out in order, so a task only waits for one that is running or done. */
static fadev_status pipeline_task(void *ctxp, size_t task) {
    const bwd_ctx *bx = ((const bwd_job *)ctxp)->bx;
    const att_ctx *cx = &bx->cx;
    const int64_t D = cx->plan.pr.dim, Nq = cx->plan.pr.seq_q, ld = bx->ld, bq = bx->block_q, tq = bx->tile_q;
    const int64_t bg = (int64_t)task / bx->key_tiles, kt = (int64_t)task % bx->key_tiles;
    const int64_t b = bg / cx->plan.pr.heads_kv, g = bg % cx->plan.pr.heads_kv;
    int64_t jb, k0, nk;
    const int last = key_tile(bx, kt, &jb, &k0, &nk);
    _Atomic int64_t *done = bx->progress + task, *before = kt > 0 ? done - 1 : NULL;
    bwd_work w;
    if (bwd_work_alloc(&w, bx, nk) != FADEV_OK) {
        atomic_store_explicit(done, INT64_MAX, memory_order_release); /* the successor must not wait forever */
        return FADEV_ERR_NO_MEMORY;
    }
    int64_t step = 0;
    for (int64_t h = g * cx->plan.group; h < (g + 1) * cx->plan.group; h++) {
        const int64_t bh = b * cx->plan.pr.heads + h;
        for (int64_t q0 = 0, qb = 0; q0 < Nq; q0 += bq, qb++) {
            const int64_t q_end = min64(q0 + bq, Nq);
            memset(w.dv_part, 0, (size_t)(nk * ld) * sizeof(double));
            memset(w.dk_part, 0, (size_t)(nk * ld) * sizeof(double));
            for (int64_t i0 = q0; i0 < q_end; i0 += tq, step++) {
                const int64_t nr = min64(tq, q_end - i0);
                const int seen = bwd_tile(bx, &w, bh, i0, nr, k0, nk, w.dv_part, w.dk_part);
                if (before)
                    while (atomic_load_explicit(before, memory_order_acquire) <= step) sched_yield();
                double *part = bx->dq_part + (bh * Nq + i0) * ld;
                if (seen) bwd_tile_dq(bx, &w, bh, i0, nr, k0, nk, part);
                if (last) {
                    add_dq_block(bx, bh, i0, nr, jb, jb * bx->block_kv, part, bx->dq + (bh * Nq + i0) * D);
                    memset(part, 0, (size_t)(nr * ld) * sizeof(double));
                }
                atomic_store_explicit(done, step + 1, memory_order_release);
            }
            add_dkv_block(bx, &w, bh, qb, q_end - 1, k0, nk);
        }
    }
    finish_dkv(bx, &w, b, g, k0, nk);
    bwd_work_free(&w);
    return FADEV_OK;
}

/* Task bh: dq of the head's rows from their dQacc (in place). */
static fadev_status finish_task(void *ctxp, size_t task) {
    const bwd_ctx *bx = ((const bwd_job *)ctxp)->bx;
    const int64_t Nq = bx->cx.plan.pr.seq_q, bh = (int64_t)task;
    finish_dq(bx, bh, 0, Nq, bx->dq + bh * Nq * bx->cx.plan.pr.dim);
    return FADEV_OK;
}

/* ------------------------------------------------------------------ set-up and entry points */

/* The backward formats as classified att_stages (same rounding mode and seed as the forward's). */
static fadev_status backward_stages(bwd_ctx *bx, const fadev_policy *pol, const fadev_policy_backward *pb) {
    const fadev_format *fmts[] = {&pb->bwd_p, &pb->dsoft_p, &pb->dp_acc, &pb->dp, &pb->delta_acc, &pb->dsoft,
                                  &pb->ds, &pb->grad_acc, &pb->dq_acc, &pb->dkv_acc, &pb->grad};
    att_stage *stages[] = {&bx->bwd_p, &bx->dsoft_p, &bx->dp_acc, &bx->dp, &bx->delta_acc, &bx->dsoft,
                           &bx->ds, &bx->grad_acc, &bx->dq_acc, &bx->dkv_acc, &bx->grad};
    for (size_t x = 0; x < sizeof fmts / sizeof fmts[0]; x++) {
        if (!att_valid_format(fmts[x])) return FADEV_ERR_INVALID_FORMAT;
        *stages[x] = att_make_stage(fmts[x], pol);
    }
    return FADEV_OK;
}

static void ctx_free(bwd_ctx *bx) {
    att_free(&bx->cx);
    att_free_lines(bx->dout), att_free_lines(bx->q), att_free_lines(bx->k), att_free_lines(bx->vt);
    att_free_lines(bx->doutf), att_free_lines(bx->qf), att_free_lines(bx->kf), att_free_lines(bx->vtf);
    free(bx->do_min), free(bx->do_max), free(bx->q_min), free(bx->q_max), free(bx->do_finite);
    free(bx->q_finite), free(bx->row_l), free(bx->row_m), free(bx->row_d), free(bx->dq_part), free(bx->progress);
}

/* n = a * b * c * d elements (0 on overflow or beyond what a byte count can hold). */
static size_t count4(int64_t a, int64_t b, int64_t c, int64_t d) {
    size_t n = 1;
    const int64_t f[4] = {a, b, c, d};
    for (int x = 0; x < 4; x++)
        if (f[x] < 0 || __builtin_mul_overflow(n, (size_t)f[x], &n)) return 0;
    return n < SIZE_MAX / 16 ? n : 0;
}

/* Everything but the passes: stages, constants, the rounded operand copies, per-row arrays. */
static fadev_status ctx_init(bwd_ctx *bx, const double *q, const double *k, const double *v,
                             const fadev_attention_params *pr, const fadev_policy *pol,
                             const fadev_policy_backward *pb, int baseline) {
    memset(bx, 0, sizeof *bx);
    fadev_status st = backward_stages(bx, pol, pb);
    if (st != FADEV_OK) return st;
    const int64_t B = pr->batch, H = pr->heads, Hkv = pr->heads_kv, Nq = pr->seq_q, Nk = pr->seq_kv, D = pr->dim;
    const int64_t ld = att_round_up(D, 16);
    const size_t n_rows = count4(B, H, Nq, 1), n_qd = count4(B, H, Nq, ld), n_kd = count4(B, Hkv, Nk, ld);
    const size_t n_vt = count4(B, Hkv, D, att_round_up(Nk, 16) + 16), nh = (size_t)(B * H);
    if (!n_rows || !n_qd || !n_kd || !n_vt) return FADEV_ERR_OVERFLOW;
    if ((st = att_init(&bx->cx, q, k, v, pr, pol, !baseline && pr->exp_form == FADEV_EXP2)) != FADEV_OK) return st;
    bx->baseline = baseline;
    bx->block_q = baseline ? Nq : min64(pr->block_q, Nq);
    bx->block_kv = baseline ? Nk : min64(pr->block_kv, Nk);
    bx->tile_q = min64(bx->block_q, TILE_Q), bx->tile_kv = min64(bx->block_kv, TILE_KV);
    bx->ld = ld, bx->vt_cols = bx->cx.kt_cols;
    const double c = fadev_round_one(pr->scale, &pol->score, FADEV_ROUND_NEAREST_EVEN, 0);
    bx->ds_scaled = pb->ds_scaled != 0, bx->c_grad = bx->ds_scaled ? 1.0 : c, bx->c_ds = c;
    bx->c3 = fadev_round_one(0x1.71547652b82fep+0, &pol->stats, FADEV_ROUND_NEAREST_EVEN, 0);
    const fadev_format *in = &pol->input;
    const int in32 = att_inside_fp32(in), grad32 = bx->grad_acc.kind == ATT_F32;
    bx->dp_float = bx->dp_acc.kind == ATT_F32 && in32 && 2 * in->precision <= 24;
    bx->dv_float = grad32 && in32 && att_inside_fp32(&pb->bwd_p) && in->precision + pb->bwd_p.precision <= 24;
    bx->dq_float = grad32 && in32 && att_inside_fp32(&pb->ds) && in->precision + pb->ds.precision <= 24;
    bx->dk_float = bx->dq_float;
    bx->dout = att_calloc_lines(n_qd, sizeof(double)), bx->q = att_calloc_lines(n_qd, sizeof(double));
    bx->k = att_calloc_lines(n_kd, sizeof(double)), bx->vt = att_calloc_lines(n_vt, sizeof(double));
    int ok = bx->dout && bx->q && bx->k && bx->vt;
    if (bx->dp_float || bx->dv_float) ok = ok && (bx->doutf = att_calloc_lines(n_qd, sizeof(float)));
    if (bx->dp_float) ok = ok && (bx->vtf = att_calloc_lines(n_vt, sizeof(float)));
    if (bx->dk_float) ok = ok && (bx->qf = att_calloc_lines(n_qd, sizeof(float))) &&
                       (bx->kf = att_calloc_lines(n_kd, sizeof(float)));
    bx->do_min = malloc(nh * sizeof(double)), bx->do_max = malloc(nh * sizeof(double));
    bx->q_min = malloc(nh * sizeof(double)), bx->q_max = malloc(nh * sizeof(double));
    bx->do_finite = malloc(nh * sizeof(int)), bx->q_finite = malloc(nh * sizeof(int));
    bx->row_l = malloc(n_rows * sizeof(double)), bx->row_d = malloc(n_rows * sizeof(double));
    if (baseline) ok = ok && (bx->row_m = malloc(n_rows * sizeof(double)));
    bx->key_tiles = (Nk - 1) / bx->block_kv * ((bx->block_kv + bx->tile_kv - 1) / bx->tile_kv) +
                    ((Nk - 1) % bx->block_kv + bx->tile_kv) / bx->tile_kv;
    const size_t n_tasks = (size_t)(B * Hkv * bx->key_tiles);
    bx->dq_part = calloc(n_qd, sizeof(double));
    if ((bx->progress = malloc(n_tasks * sizeof(_Atomic int64_t))))
        for (size_t t = 0; t < n_tasks; t++) atomic_init(&bx->progress[t], 0);
    ok = ok && bx->dq_part && bx->progress;
    ok = ok && bx->do_min && bx->do_max && bx->q_min && bx->q_max && bx->do_finite && bx->q_finite && bx->row_l &&
         bx->row_d;
    if (ok) return FADEV_OK;
    ctx_free(bx);
    return FADEV_ERR_NO_MEMORY;
}

static fadev_status backward(const double *q, const double *k, const double *v, const double *out, const double *lse,
                             const double *dout, double *dq, double *dk, double *dv, const fadev_attention_params *pr,
                             const fadev_policy *pol, const fadev_policy_backward *pb, int baseline) {
    if (!lse || !dout || !dq || !dk || !dv || !pb) return FADEV_ERR_INVALID_ARGUMENT;
    fadev_status st = att_validate(q, k, v, out, pr, pol, 0);
    if (st != FADEV_OK) return st;
    if (!baseline && (pr->block_q < 1 || pr->block_kv < 1 || (pr->exp_form != FADEV_EXP && pr->exp_form != FADEV_EXP2)))
        return FADEV_ERR_INVALID_ARGUMENT;
    bwd_ctx bx;
    if ((st = ctx_init(&bx, q, k, v, pr, pol, pb, baseline)) != FADEV_OK) return st;
    bx.dq = dq, bx.dk = dk, bx.dv = dv;
    const int64_t B = pr->batch, H = pr->heads, Hkv = pr->heads_kv, Nq = pr->seq_q;
    bwd_job job = {&bx, out, lse, dout};
    st = fadev_parallel_for((size_t)(B * H + B * Hkv), prep_task, &job);
    if (st == FADEV_OK && baseline)
        st = fadev_parallel_for((size_t)(B * H * ((Nq + STATS_ROWS - 1) / STATS_ROWS)), baseline_stats_task, &job);
    if (st == FADEV_OK) st = fadev_parallel_for((size_t)(B * Hkv * bx.key_tiles), pipeline_task, &job);
    if (st == FADEV_OK) st = fadev_parallel_for((size_t)(B * H), finish_task, &job);
    ctx_free(&bx);
    return st;
}

fadev_status fadev_baseline_attention_backward(const double *q, const double *k, const double *v, const double *out,
                                               const double *lse, const double *dout, double *dq, double *dk,
                                               double *dv, const fadev_attention_params *params,
                                               const fadev_policy *policy,
                                               const fadev_policy_backward *policy_backward) {
    return backward(q, k, v, out, lse, dout, dq, dk, dv, params, policy, policy_backward, 1);
}

fadev_status fadev_flash_attention_backward(const double *q, const double *k, const double *v, const double *out,
                                            const double *lse, const double *dout, double *dq, double *dk, double *dv,
                                            const fadev_attention_params *params, const fadev_policy *policy,
                                            const fadev_policy_backward *policy_backward) {
    return backward(q, k, v, out, lse, dout, dq, dk, dv, params, policy, policy_backward, 0);
}
