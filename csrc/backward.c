/* Attention backward under a precision policy, FlashAttention-2 order (docs/numerics.md, "Backward").
 * For query head h (K/V head g = h / (H / Hkv)), query row i and each key j it sees:
 *   s_ij as the forward computes it (same events, same counters);
 *   flash:    P = R_softmax(E(R_softmax(s_ij - L_i))), L_i = R_stats(lse_i), times R_stats(log2 e) in exp2 form;
 *   baseline: P = R_p(R_softmax(exp(R_softmax(s_ij - m_i))) / l_i) with m_i, l_i exactly as its forward;
 *   P' = R_bwd_p(P);  dP = R_dp(dO_i . V_j)                                    the dot product in dp_acc
 *   D_i = R_dsoft(dO_i . O_i) (flash) or R_dsoft(sum_j P'_ij dP_ij) (baseline)  the sum in delta_acc
 *   dS = R_ds(R_dsoft(P' R_dsoft(dP - D_i)))
 *   dQ_i: for each K/V block jb ascending, dQ_i = R_dq_acc(dQ_i + sum_{j in jb} dS_ij K_j)      sums in grad_acc
 *   dV_j: for each query head of the group, each query block qb ascending,
 *         dV_j = R_dkv_acc(dV_j + sum_{i in qb} P'_ij dO_i); dK_j likewise with dS_ij Q_i
 *   dq = R_grad(c dQ), dk = R_grad(c dK), dv = R_grad(dV), c = R_score(scale); no visible pair: exactly 0.
 * The baseline is the same with one query block of Nq rows and one K/V block of Nk keys.
 * q, out, dout, dq: (B, H, Nq, D); k, v, dk, dv: (B, Hkv, Nk, D); lse: (B, H, Nq); contiguous float64.
 *
 * Work split (every per-element operation order above is kept, so any split gives the same bits):
 * the logical blocks (block_q x block_kv) fix the numbers; they are computed in tiles of at most
 * TILE_Q x TILE_KV inside one logical block, the grad_acc sums running on from tile to tile. Either
 *   one pass (FA2's loop): a task per (b, g) walks K/V blocks, heads of the group and query blocks in
 *     order, producing dK/dV of each K/V block and adding that block's part into dQ (kept in dq), or
 *   two passes when there are fewer (b, g) pairs than threads: dK/dV tasks per (b, g, key tile), then
 *     dQ tasks per (b, h, row tile) that recompute P and dS (FA2's deterministic mode).
 * The block products use the forward's tiers (attention.h): scalar rounding, fp64 vectors (fp32
 * accumulators rounded by a float conversion after every add), or float32 vectors when both factors
 * are values of formats whose precisions add up to <= 24 bits and every product lies in the fp32
 * normal range (checked on the data: per head for dO, Q, K, V, per tile for P' and dS). */
#include <float.h>
#include <stdlib.h>
#include <string.h>

#include "attention.h"

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

enum { TILE_Q = 64, TILE_KV = 64 };

/* Backward events (docs/numerics.md, "Backward stochastic counters"): stream 2^48 + id + 32 bh. */
enum bwd_event {
    EV_DOUT = 0, EV_OUT = 1, EV_LSE = 2, EV_LSE_LOG2 = 3, EV_DELTA_ACC = 4, EV_DELTA = 5, EV_BWD_P = 6,
    EV_DP_ACC = 7, EV_DP = 8, EV_DSOFT_SUB = 9, EV_DSOFT_MUL = 10, EV_DS = 11, EV_ACC_DV = 12, EV_ACC_DK = 13,
    EV_ACC_DQ = 14, EV_DKV_DV = 15, EV_DKV_DK = 16, EV_DQ_ACC = 17, EV_GRAD_DQ = 18, EV_GRAD_DK = 19,
    EV_GRAD_DV = 20
};
#define BWD_STREAM(id, bh) ((1ull << 48) + (uint64_t)(id) + 32u * (uint64_t)(bh))

typedef struct bwd_ctx {
    att_ctx cx; /* rounded Q (cx.q) and K^T (cx.kt) for the scores, the forward stages and constants */
    att_stage bwd_p, dp_acc, dp, delta_acc, dsoft, ds, grad_acc, dq_acc, dkv_acc, grad;
    int baseline;
    double c_grad, c3;                 /* R_score(scale), R_stats(log2 e) */
    int64_t block_q, block_kv;         /* logical blocks, clamped to Nq, Nk (baseline: Nq, Nk) */
    int64_t tile_q, tile_kv;           /* tiles: at most TILE_Q x TILE_KV, inside one logical block */
    int64_t ld, vt_cols;               /* row stride of the row-major copies (D padded to 16); of V^T */
    /* Rounded operands of the block products: dO and Q (B*H, Nq, ld), K (B*Hkv, Nk, ld), V^T
     * (B*Hkv, D, vt_cols), zero padded; the float copies exist when a float tier may use them. */
    double *dout, *q, *k, *vt;
    float *doutf, *qf, *kf, *vtf;
    double *do_min, *do_max, *q_min, *q_max; /* per query head: smallest nonzero and largest magnitude */
    int *do_finite, *q_finite;
    double *row_l, *row_m, *row_d; /* per query row: flash L; baseline m and l; D_i */
    int dp_float, dv_float, dk_float, dq_float; /* the float tier is possible for dP, dV, dK, dQ */
    double *dq, *dk, *dv;          /* outputs */
} bwd_ctx;

/* last key query row i sees (causal, bottom-right aligned), Nk - 1 otherwise; < 0: none */
static inline int64_t last_key(const att_ctx *cx, int64_t i) {
    return cx->pr.causal ? i + cx->pr.seq_kv - cx->pr.seq_q : cx->pr.seq_kv - 1;
}

static inline int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }
static inline int64_t max64(int64_t a, int64_t b) { return a > b ? a : b; }

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

/* Every finite value of f is a float32 value. */
static int fits_f32(const fadev_format *f) {
    int lowest = f->subnormals ? f->emin - f->precision + 1 : f->emin;
    return f->precision <= 24 && f->emin >= -126 && f->largest <= (double)FLT_MAX && lowest >= -149;
}

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

/* ------------------------------------------------------------------ one tile */

typedef struct bwd_work {
    int64_t *nvis, *kb, *ke;
    double *s, *dp, *pp, *ds; /* att_rows(tile_q) x att_score_ld(tile_kv): scores, dP sums, P', dS */
    float *fbuf, *af;         /* the same shape in float: att_scores' scratch, dS for the dQ product */
    double *pt, *dst;         /* tile_kv x tile_q: P' and dS transposed (the dV and dK products) */
    float *ptf, *dstf;
    double *dq_part;          /* tile rows x ld: the grad_acc sums of dQ within one K/V block */
    double *dv_part, *dk_part;/* keys x ld: the grad_acc sums of dV, dK within one query block */
    double *dv_acc, *dk_acc;  /* keys x D: dVacc, dKacc */
    double *dq_acc;           /* rows x D: dQacc (two-pass dQ tasks) */
} bwd_work;

static void work_free(bwd_work *w) {
    free(w->nvis), free(w->kb), free(w->ke), free(w->s), free(w->dp), free(w->pp), free(w->ds), free(w->fbuf);
    free(w->af), free(w->pt), free(w->dst), free(w->ptf), free(w->dstf), free(w->dq_part), free(w->dv_part);
    free(w->dk_part), free(w->dv_acc), free(w->dk_acc), free(w->dq_acc);
}

static fadev_status work_alloc(bwd_work *w, const bwd_ctx *bx, int64_t keys, int64_t acc_rows) {
    const size_t tq = (size_t)bx->tile_q, tk = (size_t)bx->tile_kv, ld = (size_t)bx->ld, D = (size_t)bx->cx.pr.dim;
    const size_t tile = (size_t)att_rows(bx->tile_q) * (size_t)att_score_ld(bx->tile_kv), nk = (size_t)keys + 1;
    const size_t n_idx = (tq > tk ? tq : tk) + 4, d = sizeof(double), f = sizeof(float);
    w->nvis = calloc(n_idx, sizeof(int64_t)), w->kb = calloc(n_idx, sizeof(int64_t));
    w->ke = calloc(n_idx, sizeof(int64_t));
    w->s = calloc(tile, d), w->dp = calloc(tile, d), w->pp = calloc(tile, d), w->ds = calloc(tile, d);
    w->fbuf = calloc(tile, f), w->af = calloc(tile, f);
    w->pt = calloc(tk * tq, d), w->dst = calloc(tk * tq, d), w->ptf = calloc(tk * tq, f), w->dstf = calloc(tk * tq, f);
    w->dq_part = calloc((size_t)att_rows(bx->tile_q) * ld, d);
    w->dv_part = calloc(nk * ld, d), w->dk_part = calloc(nk * ld, d);
    w->dv_acc = calloc(nk * D, d), w->dk_acc = calloc(nk * D, d);
    w->dq_acc = calloc(((size_t)acc_rows + 1) * D, d);
    if (w->nvis && w->kb && w->ke && w->s && w->dp && w->pp && w->ds && w->fbuf && w->af && w->pt && w->dst &&
        w->ptf && w->dstf && w->dq_part && w->dv_part && w->dk_part && w->dv_acc && w->dk_acc && w->dq_acc)
        return FADEV_OK;
    work_free(w);
    return FADEV_ERR_NO_MEMORY;
}

static inline int64_t kv_head(const att_ctx *cx, int64_t bh) {
    return (bh / cx->pr.heads) * cx->pr.heads_kv + (bh % cx->pr.heads) / cx->group;
}

/* Step 4's sums (before R_dp) of rows i0.. of query head bh and keys j0 + jj, jj < nvis[r], into dp
 * (row stride lds >= att_score_ld(maxv)); kb, ke: scratch of nr entries. */
static void dp_products(const bwd_ctx *bx, int64_t bh, int64_t i0, int64_t nr, const int64_t *nvis, int64_t j0,
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

/* Steps 1-7 for one tile: query head bh, rows [i0, i0 + nr), keys [j0, j0 + n) of one K/V block and one
 * query block. Adds the tile's terms to the running grad_acc sums of dV and dK of its keys (rows of
 * dv_part, dk_part) and of dQ of its rows (dq_part); a NULL part is not wanted. */
static void bwd_tile(const bwd_ctx *bx, bwd_work *w, int64_t bh, int64_t i0, int64_t nr, int64_t j0, int64_t n,
                     double *dv_part, double *dk_part, double *dq_part) {
    const att_ctx *cx = &bx->cx;
    const int64_t D = cx->pr.dim, Nq = cx->pr.seq_q, Nk = cx->pr.seq_kv, ld = bx->ld, tq = bx->tile_q;
    const int64_t lds = att_score_ld(n), bhk = kv_head(cx, bh);
    int64_t maxv = 0;
    for (int64_t r = 0; r < nr; r++) {
        w->nvis[r] = att_visible(cx, i0 + r, j0, n);
        maxv = max64(maxv, w->nvis[r]);
    }
    if (maxv == 0) return;
    att_scores(cx, bh, i0, nr, w->nvis, j0, w->s, lds, w->fbuf);
    dp_products(bx, bh, i0, nr, w->nvis, j0, maxv, w->dp, lds, w->kb, w->ke);

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

    if (dq_part) { /* dQ[i] += sum_j dS_ij K_j over the visible keys, ascending */
        bwd_mm m = {0};
        m.tier = mm_tier(&bx->grad_acc, bx->dq_float, sm.min, sm.max, sm.finite, cx->k_min[bhk], cx->k_max[bhk],
                         cx->k_finite[bhk]);
        for (int64_t r = 0; r < nr; r++) {
            w->kb[r] = 0, w->ke[r] = w->nvis[r];
            if (m.tier == MM_F32)
                for (int64_t c = 0; c < w->nvis[r]; c++) w->af[r * lds + c] = (float)w->ds[r * lds + c];
        }
        m.layout = LAYOUT_DQ, m.acc = &bx->grad_acc, m.stream = BWD_STREAM(EV_ACC_DQ, bh), m.row0 = i0, m.k0 = j0;
        m.a = w->ds, m.af = w->af, m.lda = lds;
        m.b = bx->k + (bhk * Nk + j0) * ld, m.bf = bx->kf ? bx->kf + (bhk * Nk + j0) * ld : NULL, m.ldb = ld;
        m.c = dq_part, m.ldc = ld;
        mm_run(&m, nr, w->kb, w->ke, NULL, D, ld);
    }
    if (!dv_part) return;
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
}

/* ------------------------------------------------------------------ block sums and results (steps 7, 8) */

/* dQacc = R_dq_acc(dQacc + part) for the rows i0.. of head bh that see a key of K/V block jb (first key k0). */
static void add_dq_block(const bwd_ctx *bx, int64_t bh, int64_t i0, int64_t nr, int64_t jb, int64_t k0,
                         const double *part, double *acc) {
    const int64_t D = bx->cx.pr.dim;
    const uint64_t stream = BWD_STREAM(EV_DQ_ACC, bh);
    for (int64_t r = 0; r < nr; r++) {
        if (last_key(&bx->cx, i0 + r) < k0) continue;
        for (int64_t d = 0; d < D; d++)
            acc[r * D + d] = att_round(&bx->dq_acc, acc[r * D + d] + part[r * bx->ld + d], stream,
                                       ATT_INDEX(i0 + r, jb, d));
    }
}

/* dVacc, dKacc = R_dkv_acc(acc + part) for the keys k0.. that a row of query block qb (last row q_last) of
 * head bh sees. */
static void add_dkv_block(const bwd_ctx *bx, bwd_work *w, int64_t bh, int64_t qb, int64_t q_last, int64_t k0,
                          int64_t nk) {
    const int64_t D = bx->cx.pr.dim, ld = bx->ld, seen = last_key(&bx->cx, q_last) - k0 + 1;
    const uint64_t sv = BWD_STREAM(EV_DKV_DV, bh), sk = BWD_STREAM(EV_DKV_DK, bh);
    for (int64_t c = 0; c < nk && c < seen; c++)
        for (int64_t d = 0; d < D; d++) {
            uint64_t idx = ATT_INDEX(qb, k0 + c, d);
            w->dv_acc[c * D + d] = att_round(&bx->dkv_acc, w->dv_acc[c * D + d] + w->dv_part[c * ld + d], sv, idx);
            w->dk_acc[c * D + d] = att_round(&bx->dkv_acc, w->dk_acc[c * D + d] + w->dk_part[c * ld + d], sk, idx);
        }
}

/* dk = R_grad(c dKacc), dv = R_grad(dVacc) for keys k0.. of K/V head (b, g); keys no query sees: 0. */
static void finish_dkv(const bwd_ctx *bx, const bwd_work *w, int64_t b, int64_t g, int64_t k0, int64_t nk) {
    const att_ctx *cx = &bx->cx;
    const int64_t D = cx->pr.dim, bhk = b * cx->pr.heads_kv + g, seen = last_key(cx, cx->pr.seq_q - 1);
    const uint64_t sk = BWD_STREAM(EV_GRAD_DK, bhk), sv = BWD_STREAM(EV_GRAD_DV, bhk);
    for (int64_t c = 0; c < nk; c++) {
        const int64_t j = k0 + c;
        double *dk = bx->dk + (bhk * cx->pr.seq_kv + j) * D, *dv = bx->dv + (bhk * cx->pr.seq_kv + j) * D;
        if (j > seen) {
            memset(dk, 0, (size_t)D * sizeof(double));
            memset(dv, 0, (size_t)D * sizeof(double));
            continue;
        }
        for (int64_t d = 0; d < D; d++) {
            dk[d] = att_round(&bx->grad, bx->c_grad * w->dk_acc[c * D + d], sk, ATT_INDEX(j, d, 0));
            dv[d] = att_round(&bx->grad, w->dv_acc[c * D + d], sv, ATT_INDEX(j, d, 0));
        }
    }
}

/* dq = R_grad(c dQacc) for rows i0.. of head bh (acc: their dQacc, row stride D; may be dq itself). */
static void finish_dq(const bwd_ctx *bx, int64_t bh, int64_t i0, int64_t nr, const double *acc) {
    const int64_t D = bx->cx.pr.dim;
    const uint64_t stream = BWD_STREAM(EV_GRAD_DQ, bh);
    for (int64_t r = 0; r < nr; r++) {
        double *dq = bx->dq + (bh * bx->cx.pr.seq_q + i0 + r) * D;
        if (last_key(&bx->cx, i0 + r) < 0) {
            memset(dq, 0, (size_t)D * sizeof(double));
            continue;
        }
        for (int64_t d = 0; d < D; d++)
            dq[d] = att_round(&bx->grad, bx->c_grad * acc[r * D + d], stream, ATT_INDEX(i0 + r, d, 0));
    }
}

/* dK, dV sums of keys [k0, k0 + nk) (inside K/V block jb) of K/V head (b, g): the query heads of the group
 * and their query blocks in order, into w->dv_acc, w->dk_acc. with_dq (one pass, [k0, k0 + nk) the whole
 * block): the tiles also add this K/V block's part into dQacc, kept in bx->dq. */
static void kv_sweep(const bwd_ctx *bx, bwd_work *w, int64_t b, int64_t g, int64_t jb, int64_t k0, int64_t nk,
                     int with_dq) {
    const att_ctx *cx = &bx->cx;
    const int64_t D = cx->pr.dim, Nq = cx->pr.seq_q, ld = bx->ld, bq = bx->block_q, tq = bx->tile_q;
    const int64_t tk = bx->tile_kv;
    memset(w->dv_acc, 0, (size_t)(nk * D) * sizeof(double));
    memset(w->dk_acc, 0, (size_t)(nk * D) * sizeof(double));
    for (int64_t h = g * cx->group; h < (g + 1) * cx->group; h++) {
        const int64_t bh = b * cx->pr.heads + h;
        for (int64_t q0 = 0, qb = 0; q0 < Nq; q0 += bq, qb++) {
            const int64_t q_end = min64(q0 + bq, Nq);
            if (last_key(cx, q_end - 1) < k0) continue; /* no row of this block sees these keys */
            memset(w->dv_part, 0, (size_t)(nk * ld) * sizeof(double));
            memset(w->dk_part, 0, (size_t)(nk * ld) * sizeof(double));
            for (int64_t i0 = q0; i0 < q_end; i0 += tq) {
                const int64_t nr = min64(tq, q_end - i0);
                if (last_key(cx, i0 + nr - 1) < k0) continue;
                if (with_dq) memset(w->dq_part, 0, (size_t)(nr * ld) * sizeof(double));
                for (int64_t j0 = k0; j0 < k0 + nk && j0 <= last_key(cx, i0 + nr - 1); j0 += tk)
                    bwd_tile(bx, w, bh, i0, nr, j0, min64(tk, k0 + nk - j0), w->dv_part + (j0 - k0) * ld,
                             w->dk_part + (j0 - k0) * ld, with_dq ? w->dq_part : NULL);
                if (with_dq) add_dq_block(bx, bh, i0, nr, jb, k0, w->dq_part, bx->dq + (bh * Nq + i0) * D);
            }
            add_dkv_block(bx, w, bh, qb, q_end - 1, k0, nk);
        }
    }
}

/* ------------------------------------------------------------------ tasks */

typedef struct bwd_job {
    bwd_ctx *bx;
    const double *out, *lse, *dout;
} bwd_job;

/* Query head task < B*H: dO and the Q copy (with magnitudes), and for flash L_i and D_i (steps 2, 5).
 * K/V head task: the K and V^T copies. */
static fadev_status prep_task(void *ctxp, size_t task) {
    const bwd_job *job = (const bwd_job *)ctxp;
    bwd_ctx *bx = job->bx; /* each task writes its own head's rows */
    const att_ctx *cx = &bx->cx;
    const int64_t D = cx->pr.dim, Nq = cx->pr.seq_q, Nk = cx->pr.seq_kv, ld = bx->ld, nqh = cx->pr.batch * cx->pr.heads;
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
    const uint64_t s0 = BWD_STREAM(EV_DOUT, bh), s1 = BWD_STREAM(EV_OUT, bh), s4 = BWD_STREAM(EV_DELTA_ACC, bh);
    mag dm = MAG_EMPTY, qm = MAG_EMPTY;
    for (int64_t i = 0; i < Nq; i++) {
        const int64_t row = bh * Nq + i;
        double acc = 0;
        for (int64_t d = 0; d < D; d++) {
            double x = att_round(&cx->input, job->dout[row * D + d], s0, ATT_INDEX(i, d, 0));
            double qx = cx->q[(bh * cx->q_rows + i) * D + d];
            bx->dout[row * ld + d] = x, bx->q[row * ld + d] = qx;
            if (bx->doutf) bx->doutf[row * ld + d] = (float)x;
            if (bx->qf) bx->qf[row * ld + d] = (float)qx;
            mag_add(&dm, x), mag_add(&qm, qx);
            if (!bx->baseline) {
                double o = att_round(&cx->out, job->out[row * D + d], s1, ATT_INDEX(i, d, 0));
                acc = att_round(&bx->delta_acc, acc + x * o, s4, ATT_INDEX(i, d, 0));
            }
        }
        if (bx->baseline) continue;
        const uint64_t idx = ATT_INDEX(i, 0, 0);
        bx->row_d[row] = att_round(&bx->dsoft, acc, BWD_STREAM(EV_DELTA, bh), idx);
        double lse = att_round(&cx->stats, job->lse[row], BWD_STREAM(EV_LSE, bh), idx);
        bx->row_l[row] = cx->exp2 ? att_round(&cx->stats, lse * bx->c3, BWD_STREAM(EV_LSE_LOG2, bh), idx) : lse;
    }
    bx->do_min[bh] = dm.min, bx->do_max[bh] = dm.max, bx->do_finite[bh] = dm.finite;
    bx->q_min[bh] = qm.min, bx->q_max[bh] = qm.max, bx->q_finite[bh] = qm.finite;
    return FADEV_OK;
}

enum { STATS_ROWS = 16, STATS_GROUP = 4 };

/* Baseline rows (b, h, STATS_ROWS rows): m and l exactly as the baseline forward, and
 * D_i = R_dsoft(sum_j P'_ij dP_ij) (step 5), all keys of a row at once. */
static fadev_status baseline_stats_task(void *ctxp, size_t task) {
    const bwd_job *job = (const bwd_job *)ctxp;
    bwd_ctx *bx = job->bx;
    const att_ctx *cx = &bx->cx;
    const int64_t Nq = cx->pr.seq_q, Nk = cx->pr.seq_kv, per_head = (Nq + STATS_ROWS - 1) / STATS_ROWS;
    const int64_t bh = (int64_t)task / per_head, first = ((int64_t)task % per_head) * STATS_ROWS;
    const int64_t last = min64(first + STATS_ROWS, Nq), lds = att_score_ld(Nk);
    double *s = malloc((size_t)(STATS_GROUP * lds) * sizeof(double));
    double *dp = malloc((size_t)(STATS_GROUP * lds) * sizeof(double));
    float *fbuf = malloc((size_t)(STATS_GROUP * lds) * sizeof(float));
    if (!s || !dp || !fbuf) {
        free(s), free(dp), free(fbuf);
        return FADEV_ERR_NO_MEMORY;
    }
    const uint64_t s6 = ATT_STREAM(ATT_SOFTMAX_SUB, bh), s7 = ATT_STREAM(ATT_SOFTMAX_EXP, bh);
    const uint64_t s8 = ATT_STREAM(ATT_SUM_ACC, bh), s16 = ATT_STREAM(ATT_P, bh);
    const uint64_t b4 = BWD_STREAM(EV_DELTA_ACC, bh), b6 = BWD_STREAM(EV_BWD_P, bh), b8 = BWD_STREAM(EV_DP, bh);
    for (int64_t i0 = first; i0 < last; i0 += STATS_GROUP) {
        const int64_t nr = min64(STATS_GROUP, last - i0);
        int64_t nvis[STATS_GROUP], kb[STATS_GROUP], ke[STATS_GROUP], maxv = 0;
        for (int64_t r = 0; r < nr; r++) maxv = max64(maxv, nvis[r] = att_visible(cx, i0 + r, 0, Nk));
        if (maxv == 0) continue;
        att_scores(cx, bh, i0, nr, nvis, 0, s, lds, fbuf);
        dp_products(bx, bh, i0, nr, nvis, 0, maxv, dp, lds, kb, ke);
        for (int64_t r = 0; r < nr; r++) {
            const int64_t i = i0 + r, row = bh * Nq + i;
            double *e = s + r * lds, m = -INFINITY, acc = 0;
            for (int64_t j = 0; j < nvis[r]; j++) m = att_max(m, e[j]);
            for (int64_t j = 0; j < nvis[r]; j++) {
                uint64_t idx = ATT_INDEX(i, j, 0);
                e[j] = att_round(&cx->softmax, exp(att_round(&cx->softmax, e[j] - m, s6, idx)), s7, idx);
                acc = att_round(&cx->sum_acc, acc + e[j], s8, idx);
            }
            const double l = att_round(&cx->stats, acc, ATT_STREAM(ATT_STATS_AL, bh), ATT_INDEX(i, 0, 0));
            acc = 0;
            for (int64_t j = 0; j < nvis[r]; j++) {
                uint64_t idx = ATT_INDEX(i, j, 0);
                double pr = att_round(&bx->bwd_p, att_round(&cx->p, e[j] / l, s16, idx), b6, idx);
                acc = att_round(&bx->delta_acc, acc + pr * att_round(&bx->dp, dp[r * lds + j], b8, idx), b4, idx);
            }
            bx->row_m[row] = m, bx->row_l[row] = l;
            bx->row_d[row] = att_round(&bx->dsoft, acc, BWD_STREAM(EV_DELTA, bh), ATT_INDEX(i, 0, 0));
        }
    }
    free(s), free(dp), free(fbuf);
    return FADEV_OK;
}

/* One pass, task (b, g): K/V blocks in order; each block's dK, dV finished, its part added into dQ. */
static fadev_status one_pass_task(void *ctxp, size_t task) {
    const bwd_ctx *bx = ((const bwd_job *)ctxp)->bx;
    const att_ctx *cx = &bx->cx;
    const int64_t b = (int64_t)task / cx->pr.heads_kv, g = (int64_t)task % cx->pr.heads_kv;
    const int64_t Nq = cx->pr.seq_q, Nk = cx->pr.seq_kv, D = cx->pr.dim;
    bwd_work w;
    if (work_alloc(&w, bx, bx->block_kv, 0) != FADEV_OK) return FADEV_ERR_NO_MEMORY;
    const int64_t h0 = b * cx->pr.heads + g * cx->group;
    memset(bx->dq + h0 * Nq * D, 0, (size_t)(cx->group * Nq * D) * sizeof(double));
    for (int64_t k0 = 0, jb = 0; k0 < Nk; k0 += bx->block_kv, jb++) {
        const int64_t nk = min64(bx->block_kv, Nk - k0);
        kv_sweep(bx, &w, b, g, jb, k0, nk, 1);
        finish_dkv(bx, &w, b, g, k0, nk);
    }
    for (int64_t bh = h0; bh < h0 + cx->group; bh++) finish_dq(bx, bh, 0, Nq, bx->dq + bh * Nq * D);
    work_free(&w);
    return FADEV_OK;
}

/* Two passes, first: task (b, g, key tile of a K/V block): dK, dV of those keys. */
static fadev_status kv_task(void *ctxp, size_t task) {
    const bwd_ctx *bx = ((const bwd_job *)ctxp)->bx;
    const att_ctx *cx = &bx->cx;
    const int64_t Nk = cx->pr.seq_kv, bkv = bx->block_kv, tk = bx->tile_kv;
    const int64_t per_block = (bkv + tk - 1) / tk, blocks = (Nk + bkv - 1) / bkv;
    const int64_t bg = (int64_t)task / (blocks * per_block), rest = (int64_t)task % (blocks * per_block);
    const int64_t jb = rest / per_block, k0 = jb * bkv + (rest % per_block) * tk, end = min64(jb * bkv + bkv, Nk);
    if (k0 >= end) return FADEV_OK;
    bwd_work w;
    if (work_alloc(&w, bx, tk, 0) != FADEV_OK) return FADEV_ERR_NO_MEMORY;
    const int64_t b = bg / cx->pr.heads_kv, g = bg % cx->pr.heads_kv, nk = min64(tk, end - k0);
    kv_sweep(bx, &w, b, g, jb, k0, nk, 0);
    finish_dkv(bx, &w, b, g, k0, nk);
    work_free(&w);
    return FADEV_OK;
}

/* Two passes, second: task (b, h, row tile): dQ of those rows, K/V blocks in order (P and dS recomputed). */
static fadev_status q_task(void *ctxp, size_t task) {
    const bwd_ctx *bx = ((const bwd_job *)ctxp)->bx;
    const att_ctx *cx = &bx->cx;
    const int64_t Nq = cx->pr.seq_q, Nk = cx->pr.seq_kv, tq = bx->tile_q, tk = bx->tile_kv, bkv = bx->block_kv;
    const int64_t per_head = (Nq + tq - 1) / tq, bh = (int64_t)task / per_head;
    const int64_t i0 = ((int64_t)task % per_head) * tq, nr = min64(tq, Nq - i0), seen = last_key(cx, i0 + nr - 1);
    bwd_work w;
    if (work_alloc(&w, bx, 0, tq) != FADEV_OK) return FADEV_ERR_NO_MEMORY;
    for (int64_t k0 = 0, jb = 0; k0 < Nk && k0 <= seen; k0 += bkv, jb++) {
        const int64_t end = min64(k0 + bkv, Nk);
        memset(w.dq_part, 0, (size_t)(nr * bx->ld) * sizeof(double));
        for (int64_t j0 = k0; j0 < end && j0 <= seen; j0 += tk)
            bwd_tile(bx, &w, bh, i0, nr, j0, min64(tk, end - j0), NULL, NULL, w.dq_part);
        add_dq_block(bx, bh, i0, nr, jb, k0, w.dq_part, w.dq_acc);
    }
    finish_dq(bx, bh, i0, nr, w.dq_acc);
    work_free(&w);
    return FADEV_OK;
}

/* ------------------------------------------------------------------ set-up and entry points */

/* The backward formats as classified att_stages. att_init classifies (and att_validate checks) the 13
 * format slots of a fadev_policy, so the 10 backward formats are put into those slots of a copy of the
 * policy (same rounding mode and seed) and classified on a 1 x 1 problem. */
static fadev_status backward_stages(bwd_ctx *bx, const fadev_policy *pol, const fadev_policy_backward *pb) {
    fadev_policy view = *pol;
    view.input = pb->bwd_p, view.score_acc = pb->dp_acc, view.score = pb->dp, view.softmax = pb->delta_acc;
    view.sum_acc = pb->dsoft, view.stats = pb->ds, view.rescale = pb->grad_acc, view.p = pb->dq_acc;
    view.pv_acc = pb->dkv_acc, view.out_acc = pb->grad;
    const fadev_attention_params one = {1, 1, 1, 1, 1, 1, 1.0, 0, 1, 1, 0, 0, 0};
    const double zero = 0;
    double out = 0;
    fadev_status st = att_validate(&zero, &zero, &zero, &out, &one, &view, 0);
    att_ctx tmp;
    if (st == FADEV_OK) st = att_init(&tmp, &zero, &zero, &zero, &one, &view, 0);
    if (st != FADEV_OK) return st;
    bx->bwd_p = tmp.input, bx->dp_acc = tmp.score_acc, bx->dp = tmp.score, bx->delta_acc = tmp.softmax;
    bx->dsoft = tmp.sum_acc, bx->ds = tmp.stats, bx->grad_acc = tmp.rescale, bx->dq_acc = tmp.p;
    bx->dkv_acc = tmp.pv_acc, bx->grad = tmp.out_acc;
    att_free(&tmp);
    return FADEV_OK;
}

static void ctx_free(bwd_ctx *bx) {
    att_free(&bx->cx);
    free(bx->dout), free(bx->q), free(bx->k), free(bx->vt), free(bx->doutf), free(bx->qf), free(bx->kf);
    free(bx->vtf), free(bx->do_min), free(bx->do_max), free(bx->q_min), free(bx->q_max), free(bx->do_finite);
    free(bx->q_finite), free(bx->row_l), free(bx->row_m), free(bx->row_d);
}

/* n = a * b * c * d elements (0 on overflow or beyond what a byte count can hold). */
static size_t count4(int64_t a, int64_t b, int64_t c, int64_t d) {
    size_t n = 1;
    const int64_t f[4] = {a, b, c, d};
    for (int x = 0; x < 4; x++)
        if (f[x] < 0 || __builtin_mul_overflow(n, (size_t)f[x], &n)) return 0;
    return n < SIZE_MAX / 16 ? n : 0;
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
    memset(&bx, 0, sizeof bx);
    if ((st = backward_stages(&bx, pol, pb)) != FADEV_OK) return st;
    const int64_t B = pr->batch, H = pr->heads, Hkv = pr->heads_kv, Nq = pr->seq_q, Nk = pr->seq_kv, D = pr->dim;
    const int64_t ld = att_round_up(D, 16);
    const size_t n_rows = count4(B, H, Nq, 1), n_qd = count4(B, H, Nq, ld), n_kd = count4(B, Hkv, Nk, ld);
    const size_t n_vt = count4(B, Hkv, D, att_round_up(Nk, 16) + 16);
    if (!n_rows || !n_qd || !n_kd || !n_vt) return FADEV_ERR_OVERFLOW;
    const int exp2_form = !baseline && pr->exp_form == FADEV_EXP2;
    if ((st = att_init(&bx.cx, q, k, v, pr, pol, exp2_form)) != FADEV_OK) return st;
    bx.baseline = baseline;
    bx.dq = dq, bx.dk = dk, bx.dv = dv;
    bx.block_q = baseline ? Nq : min64(pr->block_q, Nq);
    bx.block_kv = baseline ? Nk : min64(pr->block_kv, Nk);
    bx.tile_q = min64(bx.block_q, TILE_Q), bx.tile_kv = min64(bx.block_kv, TILE_KV);
    bx.ld = ld, bx.vt_cols = bx.cx.kt_cols;
    bx.c_grad = fadev_round_one(pr->scale, &pol->score, FADEV_ROUND_NEAREST_EVEN, 0);
    bx.c3 = fadev_round_one(0x1.71547652b82fep+0, &pol->stats, FADEV_ROUND_NEAREST_EVEN, 0);
    const fadev_format *in = &pol->input;
    int in32 = fits_f32(in);
    bx.dp_float = bx.dp_acc.kind == ATT_F32 && in32 && 2 * in->precision <= 24;
    bx.dv_float = bx.grad_acc.kind == ATT_F32 && in32 && fits_f32(&pb->bwd_p) && in->precision + pb->bwd_p.precision <= 24;
    bx.dq_float = bx.grad_acc.kind == ATT_F32 && in32 && fits_f32(&pb->ds) && in->precision + pb->ds.precision <= 24;
    bx.dk_float = bx.dq_float;
    bx.dout = calloc(n_qd, sizeof(double)), bx.q = calloc(n_qd, sizeof(double));
    bx.k = calloc(n_kd, sizeof(double)), bx.vt = calloc(n_vt, sizeof(double));
    int ok = bx.dout && bx.q && bx.k && bx.vt;
    if (bx.dp_float || bx.dv_float) ok = ok && (bx.doutf = calloc(n_qd, sizeof(float)));
    if (bx.dp_float) ok = ok && (bx.vtf = calloc(n_vt, sizeof(float)));
    if (bx.dk_float) ok = ok && (bx.qf = calloc(n_qd, sizeof(float))) && (bx.kf = calloc(n_kd, sizeof(float)));
    const size_t nh = (size_t)(B * H);
    bx.do_min = malloc(nh * sizeof(double)), bx.do_max = malloc(nh * sizeof(double));
    bx.q_min = malloc(nh * sizeof(double)), bx.q_max = malloc(nh * sizeof(double));
    bx.do_finite = malloc(nh * sizeof(int)), bx.q_finite = malloc(nh * sizeof(int));
    bx.row_l = malloc(n_rows * sizeof(double)), bx.row_d = malloc(n_rows * sizeof(double));
    if (baseline) ok = ok && (bx.row_m = malloc(n_rows * sizeof(double)));
    ok = ok && bx.do_min && bx.do_max && bx.q_min && bx.q_max && bx.do_finite && bx.q_finite && bx.row_l && bx.row_d;
    if (!ok) {
        ctx_free(&bx);
        return FADEV_ERR_NO_MEMORY;
    }
    bwd_job job = {&bx, out, lse, dout};
    st = fadev_parallel_for((size_t)(B * H + B * Hkv), prep_task, &job);
    if (st == FADEV_OK && baseline)
        st = fadev_parallel_for((size_t)(B * H * ((Nq + STATS_ROWS - 1) / STATS_ROWS)), baseline_stats_task, &job);
    /* one pass costs ~5 dot products per pair, two passes ~7 but spread over more tasks */
    const int64_t threads = fadev_get_num_threads(), pairs = B * Hkv;
    if (st == FADEV_OK && 5 * ((pairs + threads - 1) / threads) * threads <= 7 * pairs) {
        st = fadev_parallel_for((size_t)pairs, one_pass_task, &job);
    } else if (st == FADEV_OK) {
        const int64_t kv_tiles = (Nk + bx.block_kv - 1) / bx.block_kv * ((bx.block_kv + bx.tile_kv - 1) / bx.tile_kv);
        st = fadev_parallel_for((size_t)(pairs * kv_tiles), kv_task, &job);
        if (st == FADEV_OK) st = fadev_parallel_for((size_t)(B * H * ((Nq + bx.tile_q - 1) / bx.tile_q)), q_task, &job);
    }
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
