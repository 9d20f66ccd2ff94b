/* Attention backward, one tile (docs/numerics.md "Backward", steps 1-7): for query head h, rows i and
 * keys j of one tile (inside one query block and one K/V block),
 *   s_ij (att_scores, the forward's events), P (flash: from L_i; baseline: from m_i, l_i), P' = R_bwd_p(P)
 *   dP_ij = R_dp(sum_d dO[i,d] V[j,d])                              dp_acc, d ascending
 *   dS_ij = R_ds(R_dsoft(R_dsoft_p(P) R_dsoft(dP - D_i)))  (P' feeds only the dV product, as in FA2;
 *           ds_scaled: R_dsoft(c .) around the product, before R_ds, as xformers' kernel)
 *   dQ[i,d] += sum_j dS_ij K[j,d]     (keys ascending)               grad_acc, running on across tiles
 *   dV[j,d] += sum_i P'_ij dO[i,d], dK[j,d] += sum_i dS_ij Q[i,d]  (rows ascending)
 * Masked pairs take no part: row i's keys are a prefix of the tile, key j's rows a suffix.
 * The products are C[r][col] += sum_k A[r][k] B[k][col], sequential in k: att_mm_run (matmul.c) in one of
 * the forward's tiers, scalar rounding with the backward counters, fp64 vectors, or float32 vectors when
 * both factors are values of formats whose precisions add up to <= 24 bits and every nonzero product
 * lies in [2^-126, 2^128) (checked on the data: per head for dO, Q, K, V, per tile for P' and dS). */
#include <stdlib.h>
#include <string.h>

#include "backward.h"

/* ------------------------------------------------------------------ one tile */

void bwd_work_free(bwd_work *w) {
    free(w->nvis), free(w->kb), free(w->s), free(w->dp), free(w->pp), free(w->ds), free(w->af), free(w->pt);
    free(w->dst), free(w->ptf), free(w->dstf), free(w->tmp), free(w->dv_part), free(w->dk_part), free(w->dv_acc);
    free(w->dk_acc);
}

fadev_status bwd_work_alloc(bwd_work *w, const bwd_ctx *bx, int64_t keys) {
    const size_t tq = (size_t)bx->tile_q, tk = (size_t)bx->tile_kv, ld = (size_t)bx->ld, D = (size_t)bx->cx.plan.pr.dim;
    const size_t tile = (size_t)att_rows(bx->tile_q) * (size_t)att_score_ld(bx->tile_kv), nk = (size_t)keys + 1;
    const size_t n_idx = (tq > tk ? tq : tk) + 4, d = sizeof(double), f = sizeof(float);
    w->nvis = calloc(n_idx, sizeof(int64_t)), w->kb = calloc(n_idx, sizeof(int64_t));
    w->s = calloc(tile, d), w->dp = calloc(tile, d), w->pp = calloc(tile, d), w->ds = calloc(tile, d);
    w->af = calloc(tile, f), w->tmp = calloc(3 * (size_t)att_score_ld(bx->tile_kv), d);
    w->pt = calloc(tk * tq, d), w->dst = calloc(tk * tq, d), w->ptf = calloc(tk * tq, f), w->dstf = calloc(tk * tq, f);
    w->dv_part = calloc(nk * ld, d), w->dk_part = calloc(nk * ld, d);
    w->dv_acc = calloc(nk * D, d), w->dk_acc = calloc(nk * D, d);
    if (w->nvis && w->kb && w->s && w->dp && w->pp && w->ds && w->af && w->tmp && w->pt && w->dst && w->ptf &&
        w->dstf &&
        w->dv_part && w->dk_part && w->dv_acc && w->dk_acc)
        return FADEV_OK;
    bwd_work_free(w);
    return FADEV_ERR_NO_MEMORY;
}

void bwd_dp_products(const bwd_ctx *bx, int64_t bh, int64_t i0, int64_t nr, const int64_t *nvis, int64_t j0,
                     int64_t maxv, double *dp, int64_t lds) {
    const att_ctx *cx = &bx->cx;
    const int64_t D = cx->plan.pr.dim, bhk = att_kv_head(cx, bh);
    att_mm m = {0};
    m.tier = att_mm_tier(&bx->dp_acc, cx->fma, bx->dp_float, bx->do_min[bh], bx->do_max[bh], bx->do_finite[bh],
                         cx->v_min[bhk], cx->v_max[bhk], cx->v_finite[bhk]);
    m.index = ATT_MM_ROW_COL_K, m.zero = 1, m.acc = &bx->dp_acc, m.stream = BWD_STREAM(EV_DP_ACC, bh);
    m.row0 = i0, m.col0 = j0;
    const int64_t a_at = (bh * cx->plan.pr.seq_q + i0) * bx->ld, b_at = bhk * D * bx->vt_cols + j0;
    m.a = bx->dout + a_at, m.af = bx->doutf ? bx->doutf + a_at : NULL, m.lda = bx->ld;
    m.b = bx->vt + b_at, m.bf = bx->vtf ? bx->vtf + b_at : NULL, m.ldb = bx->vt_cols;
    m.c = dp, m.ldc = lds;
    att_mm_run(&m, nr, NULL, NULL, D, nvis, maxv);
}

/* Steps 2, 3, 5, 6 of the tile's rows with the vector steps (cx->fast, fast.c): the same events on the same
 * values as bwd_tile's loop; P' into w->pp, dS into w->ds; pm, sm: the magnitudes the products' tiers read
 * (with the FMA tier only whether they are finite). */
static void tile_steps_fast(const bwd_ctx *bx, bwd_work *w, int64_t bh, int64_t i0, int64_t nr, int64_t lds, mag *pm,
                            mag *sm) {
    const att_ctx *cx = &bx->cx;
    const int64_t Nq = cx->plan.pr.seq_q;
    double *p = w->tmp, *t = w->tmp + lds, *u = w->tmp + 2 * lds;
    /* dP, the softmax backward and its P in fp32: the steps to R_ds in one pass (the same events) */
    const int f32 = bx->dp.kind == ATT_F32 && bx->dsoft.kind == ATT_F32 && bx->dsoft_p.kind == ATT_F32;
    for (int64_t r = 0; r < nr; r++) {
        const int64_t row = bh * Nq + i0 + r, nv = w->nvis[r];
        const double m = bx->baseline ? bx->row_m[row] : bx->row_l[row];
        double *pp = w->pp + r * lds, *ds = w->ds + r * lds;
        att_sub_n(w->s + r * lds, m, p, nv);
        att_round_n(&cx->plan.softmax, p, p, nv);
        att_exp_round_n(&cx->plan.softmax, !bx->baseline && cx->plan.exp2, p, p, nv);
        if (bx->baseline) {
            att_div_n(p, bx->row_l[row], p, nv);
            att_round_n(&cx->plan.p, p, p, nv);
        }
        const int pp_finite = att_round_n(&bx->bwd_p, p, pp, nv);
        if (f32) {
            att_ds_f32_n(p, w->dp + r * lds, bx->row_d[row], bx->ds_scaled, bx->c_ds, u, nv);
        } else {
            att_round_n(&bx->dp, w->dp + r * lds, t, nv);
            att_sub_n(t, bx->row_d[row], t, nv);
            att_round_n(&bx->dsoft, t, t, nv);
            att_round_n(&bx->dsoft_p, p, u, nv);
            att_mul_n(u, t, u, nv);
            att_round_n(&bx->dsoft, u, u, nv);
            if (bx->ds_scaled) {
                att_scale_n(u, bx->c_ds, u, nv);
                att_round_n(&bx->dsoft, u, u, nv);
            }
        }
        const int ds_finite = att_round_n(&bx->ds, u, ds, nv);
        if (cx->fma) {
            pm->finite &= pp_finite || att_finite_d(pp, nv);
            sm->finite &= ds_finite || att_finite_d(ds, nv);
        } else {
            for (int64_t c = 0; c < nv; c++) mag_add(pm, pp[c]), mag_add(sm, ds[c]);
        }
    }
}

int bwd_tile(const bwd_ctx *bx, bwd_work *w, int64_t bh, int64_t i0, int64_t nr, int64_t j0, int64_t n,
             double *dv_part, double *dk_part) {
    const att_ctx *cx = &bx->cx;
    const int64_t D = cx->plan.pr.dim, Nq = cx->plan.pr.seq_q, Nk = cx->plan.pr.seq_kv, ld = bx->ld, tq = bx->tile_q;
    const int64_t lds = att_score_ld(n), bhk = att_kv_head(cx, bh);
    int64_t maxv = 0;
    for (int64_t r = 0; r < nr; r++) {
        w->nvis[r] = att_visible(cx, i0 + r, j0, n);
        maxv = max64(maxv, w->nvis[r]);
    }
    if (maxv == 0) return 0;
    att_scores(cx, bh, i0, nr, w->nvis, j0, w->s, lds);
    bwd_dp_products(bx, bh, i0, nr, w->nvis, j0, maxv, w->dp, lds);

    /* steps 2, 3, 5, 6: P, P' and dS of every visible pair, with their magnitudes for the float tier */
    const uint64_t s6 = ATT_STREAM(ATT_SOFTMAX_SUB, bh), s7 = ATT_STREAM(ATT_SOFTMAX_EXP, bh);
    const uint64_t s16 = ATT_STREAM(ATT_P, bh), b6 = BWD_STREAM(EV_BWD_P, bh), b8 = BWD_STREAM(EV_DP, bh);
    const uint64_t b9 = BWD_STREAM(EV_DSOFT_SUB, bh), b10 = BWD_STREAM(EV_DSOFT_MUL, bh), b11 = BWD_STREAM(EV_DS, bh);
    const uint64_t b21 = BWD_STREAM(EV_DSOFT_P, bh), b22 = BWD_STREAM(EV_DSOFT_SCALE, bh);
    mag pm = MAG_EMPTY, sm = MAG_EMPTY;
    if (cx->fast) {
        tile_steps_fast(bx, w, bh, i0, nr, lds, &pm, &sm);
    } else {
        for (int64_t r = 0; r < nr; r++) {
            const int64_t i = i0 + r, row = bh * Nq + i, nv = w->nvis[r];
            const double *s = w->s + r * lds, *dpa = w->dp + r * lds;
            double *pp = w->pp + r * lds, *ds = w->ds + r * lds;
            const double m = bx->baseline ? bx->row_m[row] : bx->row_l[row], l = bx->row_l[row], Di = bx->row_d[row];
            for (int64_t c = 0; c < nv; c++) {
                const uint64_t idx = ATT_INDEX(i, j0 + c, 0);
                double x = att_round(&cx->plan.softmax, s[c] - m, s6, idx), p;
                if (bx->baseline)
                    p = att_round(&cx->plan.p, att_round(&cx->plan.softmax, exp(x), s7, idx) / l, s16, idx);
                else
                    p = att_round(&cx->plan.softmax, att_exp(cx, x), s7, idx);
                double pr = att_round(&bx->bwd_p, p, b6, idx), dpv = att_round(&bx->dp, dpa[c], b8, idx);
                double t = att_round(&bx->dsoft, dpv - Di, b9, idx), ps = att_round(&bx->dsoft_p, p, b21, idx);
                double u = att_round(&bx->dsoft, ps * t, b10, idx);
                if (bx->ds_scaled) u = att_round(&bx->dsoft, bx->c_ds * u, b22, idx);
                pp[c] = pr;
                ds[c] = att_round(&bx->ds, u, b11, idx);
            }
            if (bx->dv_float)
                for (int64_t c = 0; c < nv; c++) mag_add(&pm, pp[c]);
            if (bx->dq_float)
                for (int64_t c = 0; c < nv; c++) mag_add(&sm, ds[c]);
        }
    }

    /* dS as bwd_tile_dq's product will read it */
    w->dq_tier = att_mm_tier(&bx->grad_acc, cx->fma, bx->dq_float, sm.min, sm.max, sm.finite, cx->k_min[bhk],
                             cx->k_max[bhk], cx->k_finite[bhk]);
    if (att_mm_float(w->dq_tier))
        for (int64_t r = 0; r < nr; r++)
            for (int64_t c = 0; c < w->nvis[r]; c++) w->af[r * lds + c] = (float)w->ds[r * lds + c];
    /* dV[j] += sum_i P'_ij dO_i and dK[j] += sum_i dS_ij Q_i over the rows that see key j (a suffix), ascending */
    for (int64_t c = 0; c < n; c++) {
        int64_t first = cx->plan.pr.causal ? j0 + c - (Nk - Nq) - i0 : 0;
        w->kb[c] = first < 0 ? 0 : first > nr ? nr : first;
    }
    for (int pass = 0; pass < 2; pass++) {
        const int is_v = pass == 0;
        const double *src = is_v ? w->pp : w->ds;
        att_mm m = {0};
        m.tier = is_v ? att_mm_tier(&bx->grad_acc, cx->fma, bx->dv_float, pm.min, pm.max, pm.finite, bx->do_min[bh],
                                    bx->do_max[bh], bx->do_finite[bh])
                      : att_mm_tier(&bx->grad_acc, cx->fma, bx->dk_float, sm.min, sm.max, sm.finite, bx->q_min[bh],
                                    bx->q_max[bh], bx->q_finite[bh]);
        double *t = is_v ? w->pt : w->dst;
        float *tf = is_v ? w->ptf : w->dstf;
        for (int64_t c = 0; c < n; c++)
            for (int64_t r = w->kb[c]; r < nr; r++) {
                if (att_mm_float(m.tier)) tf[c * tq + r] = (float)src[r * lds + c];
                else t[c * tq + r] = src[r * lds + c];
            }
        const double *b = is_v ? bx->dout : bx->q;
        const float *bf = is_v ? bx->doutf : bx->qf;
        m.index = ATT_MM_K_ROW_COL, m.acc = &bx->grad_acc, m.stream = BWD_STREAM(is_v ? EV_ACC_DV : EV_ACC_DK, bh);
        m.row0 = j0, m.k0 = i0;
        m.a = t, m.af = tf, m.lda = tq;
        m.b = b + (bh * Nq + i0) * ld, m.bf = bf ? bf + (bh * Nq + i0) * ld : NULL, m.ldb = ld;
        m.c = is_v ? dv_part : dk_part, m.ldc = ld;
        att_mm_run(&m, n, w->kb, NULL, nr, NULL, D);
    }
    return 1;
}

void bwd_tile_dq(const bwd_ctx *bx, bwd_work *w, int64_t bh, int64_t i0, int64_t nr, int64_t j0, int64_t n,
                 double *dq_part) {
    const att_ctx *cx = &bx->cx;
    const int64_t bhk = att_kv_head(cx, bh);
    att_mm m = {0};
    m.tier = w->dq_tier, m.index = ATT_MM_ROW_K_COL, m.acc = &bx->grad_acc, m.stream = BWD_STREAM(EV_ACC_DQ, bh);
    m.row0 = i0, m.k0 = j0;
    m.a = w->ds, m.af = w->af, m.lda = att_score_ld(n);
    m.b = bx->k + (bhk * cx->plan.pr.seq_kv + j0) * bx->ld, m.ldb = bx->ld;
    m.bf = bx->kf ? bx->kf + (bhk * cx->plan.pr.seq_kv + j0) * bx->ld : NULL;
    m.c = dq_part, m.ldc = bx->ld;
    att_mm_run(&m, nr, NULL, w->nvis, 0, NULL, cx->plan.pr.dim);
}
