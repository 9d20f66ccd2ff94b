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
    double c_grad;                     /* R_score(scale) */
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
