/* Attention backward, one tile (docs/numerics.md "Backward", steps 1-7): for query head h, rows i and
 * keys j of one tile (inside one query block and one K/V block),
 *   s_ij (att_scores, the forward's events), P (flash: from L_i; baseline: from m_i, l_i), P' = R_bwd_p(P)
 *   dP_ij = R_dp(sum_d dO[i,d] V[j,d])                              dp_acc, d ascending
 *   dS_ij = R_ds(R_dsoft(P' R_dsoft(dP - D_i)))
 *   dQ[i,d] += sum_j dS_ij K[j,d]     (keys ascending)               grad_acc, running on across tiles
 *   dV[j,d] += sum_i P'_ij dO[i,d], dK[j,d] += sum_i dS_ij Q[i,d]  (rows ascending)
 * Masked pairs take no part: row i's keys are a prefix of the tile, key j's rows a suffix.
 * The products are C[r][col] += sum_k A[r][k] B[k][col], sequential in k, in one of the forward's tiers
 * (attention.h): scalar rounding with the backward counters; fp64 vectors (fp32 accumulators rounded by
 * a float conversion after every add); float32 vectors when both factors are values of formats whose
 * precisions add up to <= 24 bits and every nonzero product lies in [2^-126, 2^128) (checked on the
 * data: per head for dO, Q, K, V, per tile for P' and dS), so every float product is exact and every
 * float sum is R_fp32 of the fp64 sum. Four rows of C advance side by side over the k they share. */
#include <stdlib.h>
#include <string.h>

#include "backward.h"

#if defined(__GNUC__) && defined(__x86_64__) && defined(__linux__) && !defined(FADEV_NO_CLONES)
#define BWD_CLONES __attribute__((target_clones("avx2", "default")))
#else
#define BWD_CLONES
#endif

typedef double v4d __attribute__((vector_size(32)));
typedef double v4du __attribute__((vector_size(32), aligned(8)));
typedef float v4f __attribute__((vector_size(16)));
typedef float v8f __attribute__((vector_size(32)));
typedef float v8fu __attribute__((vector_size(32), aligned(4)));
#define R32V(a) __builtin_convertvector(__builtin_convertvector((a), v4f), v4d)

/* ------------------------------------------------------------------ block products
 * c[r][col] = acc over k in [kb, ke) ascending of acc + a[r][k] * b[k][col], continuing from c's value, for
 * col < ncols (a multiple of 16): 4 rows (mm4) or one row (mm1). R32 rounds the fp64 sum to fp32 after
 * every add; the f32 kernels keep the sum in float (exact products, see the top comment). */
#define MM4_F64(R32)                                                                                      \
    for (int64_t col = 0; col < ncols; col += 8) {                                                        \
        double *o = c + col;                                                                              \
        v4d a0 = *(v4du *)o, b0 = *(v4du *)(o + 4), a1 = *(v4du *)(o + ldc), b1 = *(v4du *)(o + ldc + 4); \
        v4d a2 = *(v4du *)(o + 2 * ldc), b2 = *(v4du *)(o + 2 * ldc + 4);                                 \
        v4d a3 = *(v4du *)(o + 3 * ldc), b3 = *(v4du *)(o + 3 * ldc + 4);                                 \
        const double *bp = b + kb * ldb + col;                                                            \
        for (int64_t k = kb; k < ke; k++, bp += ldb) {                                                    \
            v4d v0 = *(const v4du *)bp, v1 = *(const v4du *)(bp + 4);                                     \
            double x0 = a[k], x1 = a[lda + k], x2 = a[2 * lda + k], x3 = a[3 * lda + k];                  \
            a0 = a0 + x0 * v0, b0 = b0 + x0 * v1, a1 = a1 + x1 * v0, b1 = b1 + x1 * v1;                   \
            a2 = a2 + x2 * v0, b2 = b2 + x2 * v1, a3 = a3 + x3 * v0, b3 = b3 + x3 * v1;                   \
            if (R32) {                                                                                    \
                a0 = R32V(a0), b0 = R32V(b0), a1 = R32V(a1), b1 = R32V(b1);                               \
                a2 = R32V(a2), b2 = R32V(b2), a3 = R32V(a3), b3 = R32V(b3);                               \
            }                                                                                             \
        }                                                                                                 \
        *(v4du *)o = a0, *(v4du *)(o + 4) = b0, *(v4du *)(o + ldc) = a1, *(v4du *)(o + ldc + 4) = b1;     \
        *(v4du *)(o + 2 * ldc) = a2, *(v4du *)(o + 2 * ldc + 4) = b2;                                     \
        *(v4du *)(o + 3 * ldc) = a3, *(v4du *)(o + 3 * ldc + 4) = b3;                                     \
    }

#define MM1_F64(R32)                                                                                      \
    for (int64_t col = 0; col < ncols; col += 16) {                                                       \
        double *o = c + col;                                                                              \
        v4d a0 = *(v4du *)o, a1 = *(v4du *)(o + 4), a2 = *(v4du *)(o + 8), a3 = *(v4du *)(o + 12);        \
        const double *bp = b + kb * ldb + col;                                                            \
        for (int64_t k = kb; k < ke; k++, bp += ldb) {                                                    \
            double x = a[k];                                                                              \
            a0 = a0 + x * *(const v4du *)bp, a1 = a1 + x * *(const v4du *)(bp + 4);                       \
            a2 = a2 + x * *(const v4du *)(bp + 8), a3 = a3 + x * *(const v4du *)(bp + 12);                \
            if (R32) a0 = R32V(a0), a1 = R32V(a1), a2 = R32V(a2), a3 = R32V(a3);                          \
        }                                                                                                 \
        *(v4du *)o = a0, *(v4du *)(o + 4) = a1, *(v4du *)(o + 8) = a2, *(v4du *)(o + 12) = a3;            \
    }

#define MM_ARGS(T) const T *a, int64_t lda, const T *b, int64_t ldb, int64_t kb, int64_t ke, int64_t ncols, \
                   double *c, int64_t ldc
BWD_CLONES static void mm4_f64(MM_ARGS(double)) { MM4_F64(0) }
BWD_CLONES static void mm4_f64_r32(MM_ARGS(double)) { MM4_F64(1) }
BWD_CLONES static void mm1_f64(MM_ARGS(double)) { (void)lda, (void)ldc; MM1_F64(0) }
BWD_CLONES static void mm1_f64_r32(MM_ARGS(double)) { (void)lda, (void)ldc; MM1_F64(1) }

BWD_CLONES static void mm4_f32(MM_ARGS(float)) {
    for (int64_t col = 0; col < ncols; col += 16) {
        float acc[4][16];
        for (int r = 0; r < 4; r++)
            for (int e = 0; e < 16; e++) acc[r][e] = (float)c[r * ldc + col + e];
        v8f a0 = *(v8fu *)acc[0], b0 = *(v8fu *)(acc[0] + 8), a1 = *(v8fu *)acc[1], b1 = *(v8fu *)(acc[1] + 8);
        v8f a2 = *(v8fu *)acc[2], b2 = *(v8fu *)(acc[2] + 8), a3 = *(v8fu *)acc[3], b3 = *(v8fu *)(acc[3] + 8);
        const float *bp = b + kb * ldb + col;
        for (int64_t k = kb; k < ke; k++, bp += ldb) {
            v8f v0 = *(const v8fu *)bp, v1 = *(const v8fu *)(bp + 8);
            float x0 = a[k], x1 = a[lda + k], x2 = a[2 * lda + k], x3 = a[3 * lda + k];
            a0 = a0 + x0 * v0, b0 = b0 + x0 * v1, a1 = a1 + x1 * v0, b1 = b1 + x1 * v1;
            a2 = a2 + x2 * v0, b2 = b2 + x2 * v1, a3 = a3 + x3 * v0, b3 = b3 + x3 * v1;
        }
        *(v8fu *)acc[0] = a0, *(v8fu *)(acc[0] + 8) = b0, *(v8fu *)acc[1] = a1, *(v8fu *)(acc[1] + 8) = b1;
        *(v8fu *)acc[2] = a2, *(v8fu *)(acc[2] + 8) = b2, *(v8fu *)acc[3] = a3, *(v8fu *)(acc[3] + 8) = b3;
        for (int r = 0; r < 4; r++)
            for (int e = 0; e < 16; e++) c[r * ldc + col + e] = (double)acc[r][e];
    }
}

BWD_CLONES static void mm1_f32(MM_ARGS(float)) {
    (void)lda, (void)ldc;
    for (int64_t col = 0; col < ncols; col += 16) {
        float acc[16];
        for (int e = 0; e < 16; e++) acc[e] = (float)c[col + e];
        v8f a0 = *(v8fu *)acc, a1 = *(v8fu *)(acc + 8);
        const float *bp = b + kb * ldb + col;
        for (int64_t k = kb; k < ke; k++, bp += ldb) {
            float x = a[k];
            a0 = a0 + x * *(const v8fu *)bp, a1 = a1 + x * *(const v8fu *)(bp + 8);
        }
        *(v8fu *)acc = a0, *(v8fu *)(acc + 8) = a1;
        for (int e = 0; e < 16; e++) c[col + e] = (double)acc[e];
    }
}

enum mm_tier { MM_SCALAR, MM_F64, MM_F64_R32, MM_F32 };
/* how (row, k, col) of a product name the counter's (i, j, d) */
enum mm_layout { LAYOUT_DP, LAYOUT_DKV, LAYOUT_DQ };

typedef struct bwd_mm {
    int tier, layout;
    const att_stage *acc; /* scalar tier: accumulator stage, stream, absolute offsets of row, k, col */
    uint64_t stream;
    int64_t row0, k0, col0;
    const double *a, *b;
    const float *af, *bf;
    int64_t lda, ldb;
    double *c;
    int64_t ldc;
} bwd_mm;

static void mm_scalar(const bwd_mm *m, int64_t r, int64_t kb, int64_t ke, int64_t ncol) {
    for (int64_t col = 0; col < ncol; col++) {
        double acc = m->c[r * m->ldc + col];
        for (int64_t k = kb; k < ke; k++) {
            uint64_t idx = m->layout == LAYOUT_DP    ? ATT_INDEX(m->row0 + r, m->col0 + col, k)
                           : m->layout == LAYOUT_DKV ? ATT_INDEX(m->k0 + k, m->row0 + r, col)
                                                     : ATT_INDEX(m->row0 + r, m->k0 + k, col);
            acc = att_round(m->acc, acc + m->a[r * m->lda + k] * m->b[k * m->ldb + col], m->stream, idx);
        }
        m->c[r * m->ldc + col] = acc;
    }
}

static void mm_one(const bwd_mm *m, int64_t r, int64_t kb, int64_t ke, int64_t ncols) {
    if (kb >= ke) return;
    if (m->tier == MM_F32)
        mm1_f32(m->af + r * m->lda, m->lda, m->bf, m->ldb, kb, ke, ncols, m->c + r * m->ldc, m->ldc);
    else if (m->tier == MM_F64_R32)
        mm1_f64_r32(m->a + r * m->lda, m->lda, m->b, m->ldb, kb, ke, ncols, m->c + r * m->ldc, m->ldc);
    else
        mm1_f64(m->a + r * m->lda, m->lda, m->b, m->ldb, kb, ke, ncols, m->c + r * m->ldc, m->ldc);
}

static void mm_four(const bwd_mm *m, int64_t r, int64_t kb, int64_t ke, int64_t ncols) {
    if (m->tier == MM_F32)
        mm4_f32(m->af + r * m->lda, m->lda, m->bf, m->ldb, kb, ke, ncols, m->c + r * m->ldc, m->ldc);
    else if (m->tier == MM_F64_R32)
        mm4_f64_r32(m->a + r * m->lda, m->lda, m->b, m->ldb, kb, ke, ncols, m->c + r * m->ldc, m->ldc);
    else
        mm4_f64(m->a + r * m->lda, m->lda, m->b, m->ldb, kb, ke, ncols, m->c + r * m->ldc, m->ldc);
}

/* Row r of C accumulates k in [kb[r], ke[r]) ascending; the scalar tier computes ncol[r] (or ncol_all)
 * columns, the vector tiers ncols (a multiple of 16). Four rows advance together over the k they
 * share; what one row has before or after that range it does alone, in order. */
static void mm_run(const bwd_mm *m, int64_t nrows, const int64_t *kb, const int64_t *ke, const int64_t *ncol,
                   int64_t ncol_all, int64_t ncols) {
    if (m->tier == MM_SCALAR) {
        for (int64_t r = 0; r < nrows; r++) mm_scalar(m, r, kb[r], ke[r], ncol ? ncol[r] : ncol_all);
        return;
    }
    int64_t r = 0;
    for (; r + 4 <= nrows; r += 4) {
        int64_t lo = max64(max64(kb[r], kb[r + 1]), max64(kb[r + 2], kb[r + 3]));
        int64_t hi = min64(min64(ke[r], ke[r + 1]), min64(ke[r + 2], ke[r + 3]));
        if (lo >= hi) {
            for (int64_t x = r; x < r + 4; x++) mm_one(m, x, kb[x], ke[x], ncols);
            continue;
        }
        for (int64_t x = r; x < r + 4; x++) mm_one(m, x, kb[x], lo, ncols);
        mm_four(m, r, lo, hi, ncols);
        for (int64_t x = r; x < r + 4; x++) mm_one(m, x, hi, ke[x], ncols);
    }
    for (; r < nrows; r++) mm_one(m, r, kb[r], ke[r], ncols);
}

/* Tier of a product accumulated in `acc` whose float tier is `possible` for these formats, given the
 * magnitudes of its two factors (smallest nonzero, largest, all finite). */
static int mm_tier(const att_stage *acc, int possible, double amin, double amax, int afin, double bmin, double bmax,
                   int bfin) {
    if (acc->kind == ATT_EXACT) return MM_F64;
    if (acc->kind != ATT_F32) return MM_SCALAR;
    int exact = possible && afin && bfin && amin * bmin >= 0x1p-126 && amax * bmax < 0x1p128;
    return exact ? MM_F32 : MM_F64_R32;
}

/* ------------------------------------------------------------------ one tile */

void bwd_work_free(bwd_work *w) {
    free(w->nvis), free(w->kb), free(w->ke), free(w->s), free(w->dp), free(w->pp), free(w->ds), free(w->fbuf);
    free(w->af), free(w->pt), free(w->dst), free(w->ptf), free(w->dstf), free(w->dv_part), free(w->dk_part);
    free(w->dv_acc), free(w->dk_acc);
}

fadev_status bwd_work_alloc(bwd_work *w, const bwd_ctx *bx, int64_t keys) {
    const size_t tq = (size_t)bx->tile_q, tk = (size_t)bx->tile_kv, ld = (size_t)bx->ld, D = (size_t)bx->cx.pr.dim;
    const size_t tile = (size_t)att_rows(bx->tile_q) * (size_t)att_score_ld(bx->tile_kv), nk = (size_t)keys + 1;
    const size_t n_idx = (tq > tk ? tq : tk) + 4, d = sizeof(double), f = sizeof(float);
    w->nvis = calloc(n_idx, sizeof(int64_t)), w->kb = calloc(n_idx, sizeof(int64_t));
    w->ke = calloc(n_idx, sizeof(int64_t));
    w->s = calloc(tile, d), w->dp = calloc(tile, d), w->pp = calloc(tile, d), w->ds = calloc(tile, d);
    w->fbuf = calloc(tile, f), w->af = calloc(tile, f);
    w->pt = calloc(tk * tq, d), w->dst = calloc(tk * tq, d), w->ptf = calloc(tk * tq, f), w->dstf = calloc(tk * tq, f);
    w->dv_part = calloc(nk * ld, d), w->dk_part = calloc(nk * ld, d);
    w->dv_acc = calloc(nk * D, d), w->dk_acc = calloc(nk * D, d);
    if (w->nvis && w->kb && w->ke && w->s && w->dp && w->pp && w->ds && w->fbuf && w->af && w->pt && w->dst &&
        w->ptf && w->dstf && w->dv_part && w->dk_part && w->dv_acc && w->dk_acc)
        return FADEV_OK;
    bwd_work_free(w);
    return FADEV_ERR_NO_MEMORY;
}

void bwd_dp_products(const bwd_ctx *bx, int64_t bh, int64_t i0, int64_t nr, const int64_t *nvis, int64_t j0,
                     int64_t maxv, double *dp, int64_t lds, int64_t *kb, int64_t *ke) {
    const att_ctx *cx = &bx->cx;
    const int64_t D = cx->pr.dim, bhk = kv_head(cx, bh), ncols = att_round_up(maxv, 16);
    for (int64_t r = 0; r < nr; r++) {
        memset(dp + r * lds, 0, (size_t)ncols * sizeof(double));
        kb[r] = 0, ke[r] = D;
    }
    bwd_mm m = {0};
    m.tier = mm_tier(&bx->dp_acc, bx->dp_float, bx->do_min[bh], bx->do_max[bh], bx->do_finite[bh], cx->v_min[bhk],
                     cx->v_max[bhk], cx->v_finite[bhk]);
    m.layout = LAYOUT_DP, m.acc = &bx->dp_acc, m.stream = BWD_STREAM(EV_DP_ACC, bh);
    m.row0 = i0, m.col0 = j0;
    const int64_t a_at = (bh * cx->pr.seq_q + i0) * bx->ld, b_at = bhk * D * bx->vt_cols + j0;
    m.a = bx->dout + a_at, m.af = bx->doutf ? bx->doutf + a_at : NULL, m.lda = bx->ld;
    m.b = bx->vt + b_at, m.bf = bx->vtf ? bx->vtf + b_at : NULL, m.ldb = bx->vt_cols;
    m.c = dp, m.ldc = lds;
    mm_run(&m, nr, kb, ke, nvis, 0, ncols);
}

int bwd_tile(const bwd_ctx *bx, bwd_work *w, int64_t bh, int64_t i0, int64_t nr, int64_t j0, int64_t n,
             double *dv_part, double *dk_part) {
    const att_ctx *cx = &bx->cx;
    const int64_t D = cx->pr.dim, Nq = cx->pr.seq_q, Nk = cx->pr.seq_kv, ld = bx->ld, tq = bx->tile_q;
    const int64_t lds = att_score_ld(n), bhk = kv_head(cx, bh);
    int64_t maxv = 0;
    for (int64_t r = 0; r < nr; r++) {
        w->nvis[r] = att_visible(cx, i0 + r, j0, n);
        maxv = max64(maxv, w->nvis[r]);
    }
    if (maxv == 0) return 0;
    att_scores(cx, bh, i0, nr, w->nvis, j0, w->s, lds, w->fbuf);
    bwd_dp_products(bx, bh, i0, nr, w->nvis, j0, maxv, w->dp, lds, w->kb, w->ke);

    /* steps 2, 3, 5, 6: P, P' and dS of every visible pair, with their magnitudes for the float tier */
    const uint64_t s6 = ATT_STREAM(ATT_SOFTMAX_SUB, bh), s7 = ATT_STREAM(ATT_SOFTMAX_EXP, bh);
    const uint64_t s16 = ATT_STREAM(ATT_P, bh), b6 = BWD_STREAM(EV_BWD_P, bh), b8 = BWD_STREAM(EV_DP, bh);
    const uint64_t b9 = BWD_STREAM(EV_DSOFT_SUB, bh), b10 = BWD_STREAM(EV_DSOFT_MUL, bh), b11 = BWD_STREAM(EV_DS, bh);
    mag pm = MAG_EMPTY, sm = MAG_EMPTY;
    for (int64_t r = 0; r < nr; r++) {
        const int64_t i = i0 + r, row = bh * Nq + i, nv = w->nvis[r];
        const double *s = w->s + r * lds, *dpa = w->dp + r * lds;
        double *pp = w->pp + r * lds, *ds = w->ds + r * lds;
        const double m = bx->baseline ? bx->row_m[row] : bx->row_l[row], l = bx->row_l[row], Di = bx->row_d[row];
        for (int64_t c = 0; c < nv; c++) {
            const uint64_t idx = ATT_INDEX(i, j0 + c, 0);
            double x = att_round(&cx->softmax, s[c] - m, s6, idx), p;
            if (bx->baseline) p = att_round(&cx->p, att_round(&cx->softmax, exp(x), s7, idx) / l, s16, idx);
            else p = att_round(&cx->softmax, att_exp(cx, x), s7, idx);
            double pr = att_round(&bx->bwd_p, p, b6, idx), dpv = att_round(&bx->dp, dpa[c], b8, idx);
            double t = att_round(&bx->dsoft, dpv - Di, b9, idx);
            pp[c] = pr;
            ds[c] = att_round(&bx->ds, att_round(&bx->dsoft, pr * t, b10, idx), b11, idx);
        }
        if (bx->dv_float)
            for (int64_t c = 0; c < nv; c++) mag_add(&pm, pp[c]);
        if (bx->dq_float)
            for (int64_t c = 0; c < nv; c++) mag_add(&sm, ds[c]);
    }

    /* dS as bwd_tile_dq's product will read it */
    w->dq_tier = mm_tier(&bx->grad_acc, bx->dq_float, sm.min, sm.max, sm.finite, cx->k_min[bhk], cx->k_max[bhk],
                         cx->k_finite[bhk]);
    if (w->dq_tier == MM_F32)
        for (int64_t r = 0; r < nr; r++)
            for (int64_t c = 0; c < w->nvis[r]; c++) w->af[r * lds + c] = (float)w->ds[r * lds + c];
    /* dV[j] += sum_i P'_ij dO_i and dK[j] += sum_i dS_ij Q_i over the rows that see key j (a suffix), ascending */
    for (int64_t c = 0; c < n; c++) {
        int64_t first = cx->pr.causal ? j0 + c - (Nk - Nq) - i0 : 0;
        w->kb[c] = first < 0 ? 0 : first > nr ? nr : first, w->ke[c] = nr;
    }
    for (int pass = 0; pass < 2; pass++) {
        const int is_v = pass == 0;
        const double *src = is_v ? w->pp : w->ds;
        bwd_mm m = {0};
        m.tier = is_v ? mm_tier(&bx->grad_acc, bx->dv_float, pm.min, pm.max, pm.finite, bx->do_min[bh],
                                bx->do_max[bh], bx->do_finite[bh])
                      : mm_tier(&bx->grad_acc, bx->dk_float, sm.min, sm.max, sm.finite, bx->q_min[bh], bx->q_max[bh],
                                bx->q_finite[bh]);
        double *t = is_v ? w->pt : w->dst;
        float *tf = is_v ? w->ptf : w->dstf;
        for (int64_t c = 0; c < n; c++)
            for (int64_t r = w->kb[c]; r < nr; r++) {
                if (m.tier == MM_F32) tf[c * tq + r] = (float)src[r * lds + c];
                else t[c * tq + r] = src[r * lds + c];
            }
        const double *b = is_v ? bx->dout : bx->q;
        const float *bf = is_v ? bx->doutf : bx->qf;
        m.layout = LAYOUT_DKV, m.acc = &bx->grad_acc, m.stream = BWD_STREAM(is_v ? EV_ACC_DV : EV_ACC_DK, bh);
        m.row0 = j0, m.k0 = i0;
        m.a = t, m.af = tf, m.lda = tq;
        m.b = b + (bh * Nq + i0) * ld, m.bf = bf ? bf + (bh * Nq + i0) * ld : NULL, m.ldb = ld;
        m.c = is_v ? dv_part : dk_part, m.ldc = ld;
        mm_run(&m, n, w->kb, w->ke, NULL, D, ld);
    }
    return 1;
}

void bwd_tile_dq(const bwd_ctx *bx, bwd_work *w, int64_t bh, int64_t i0, int64_t nr, int64_t j0, int64_t n,
                 double *dq_part) {
    const att_ctx *cx = &bx->cx;
    const int64_t bhk = kv_head(cx, bh);
    for (int64_t r = 0; r < nr; r++) w->kb[r] = 0, w->ke[r] = w->nvis[r];
    bwd_mm m = {0};
    m.tier = w->dq_tier, m.layout = LAYOUT_DQ, m.acc = &bx->grad_acc, m.stream = BWD_STREAM(EV_ACC_DQ, bh);
    m.row0 = i0, m.k0 = j0;
    m.a = w->ds, m.af = w->af, m.lda = att_score_ld(n);
    m.b = bx->k + (bhk * cx->pr.seq_kv + j0) * bx->ld, m.ldb = bx->ld;
    m.bf = bx->kf ? bx->kf + (bhk * cx->pr.seq_kv + j0) * bx->ld : NULL;
    m.c = dq_part, m.ldc = bx->ld;
    mm_run(&m, nr, w->kb, w->ke, NULL, cx->pr.dim, bx->ld);
}
