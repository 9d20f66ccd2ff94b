/* Internal interface of the attention backward (backward.c: passes, tasks, entry points; backward_tile.c:
 * one tile's steps 1-7, its products through matmul.c). Not public API; see docs/numerics.md "Backward". */
#ifndef FADEV_BACKWARD_H
#define FADEV_BACKWARD_H

#include <stdatomic.h>

#include "attention.h"

enum { TILE_Q = 64, TILE_KV = 64 };

/* Backward events (docs/numerics.md, "Backward stochastic counters"): stream 2^48 + id + 32 bh. */
enum bwd_event {
    EV_DOUT = 0, EV_OUT = 1, EV_LSE = 2, EV_LSE_LOG2 = 3, EV_DELTA_ACC = 4, EV_DELTA = 5, EV_BWD_P = 6,
    EV_DP_ACC = 7, EV_DP = 8, EV_DSOFT_SUB = 9, EV_DSOFT_MUL = 10, EV_DS = 11, EV_ACC_DV = 12, EV_ACC_DK = 13,
    EV_ACC_DQ = 14, EV_DKV_DV = 15, EV_DKV_DK = 16, EV_DQ_ACC = 17, EV_GRAD_DQ = 18, EV_GRAD_DK = 19,
    EV_GRAD_DV = 20, EV_DSOFT_P = 21, EV_DSOFT_SCALE = 22
};
#define BWD_STREAM(id, bh) ((1ull << 48) + (uint64_t)(id) + 32u * (uint64_t)(bh))

typedef struct bwd_ctx {
    att_ctx cx; /* rounded Q (cx.q) and K^T (cx.kt) for the scores, the forward stages and constants */
    att_stage bwd_p, dsoft_p, dp_acc, dp, delta_acc, dsoft, ds, grad_acc, dq_acc, dkv_acc, grad;
    int baseline;
    double c_grad, c3;                 /* the scale of the dQ, dK sums (R_score(scale), or 1 when ds_scaled); R_stats(log2 e) */
    int ds_scaled;                     /* the scale multiplies each dS before R_ds (c_ds = R_score(scale)) */
    double c_ds;
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
    double *dq, *dk, *dv;          /* outputs; dq holds dQacc until the end */
    double *dq_part;               /* (B*H, Nq, ld): the running grad_acc sums of dQ within a K/V block */
    int64_t key_tiles;             /* key tiles per (b, g): the pipeline's stages */
    _Atomic int64_t *progress;     /* per pipeline task: steps whose dQ terms it has added */
} bwd_ctx;

/* last key query row i sees (causal, bottom-right aligned), Nk - 1 otherwise; < 0: none */
static inline int64_t last_key(const att_ctx *cx, int64_t i) {
    return cx->plan.pr.causal ? i + cx->plan.pr.seq_kv - cx->plan.pr.seq_q : cx->plan.pr.seq_kv - 1;
}

static inline int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }
static inline int64_t max64(int64_t a, int64_t b) { return a > b ? a : b; }

typedef struct bwd_work {
    int64_t *nvis, *kb;
    double *s, *dp, *pp, *ds; /* att_rows(tile_q) x att_score_ld(tile_kv): scores, dP sums, P', dS */
    float *af;                /* the same shape in float: dS for the dQ product */
    double *tmp;              /* 3 x att_score_ld(tile_kv): the vector steps' rows */
    double *pt, *dst;         /* tile_kv x tile_q: P' and dS transposed (the dV and dK products) */
    float *ptf, *dstf;
    double *dv_part, *dk_part;/* keys x ld: the grad_acc sums of dV, dK within one query block */
    double *dv_acc, *dk_acc;  /* keys x D: dVacc, dKacc */
    int dq_tier;              /* how bwd_tile_dq computes the tile's dQ product */
} bwd_work;

/* Scratch of one task: tiles of TILE_Q x TILE_KV at most, dK/dV sums of `keys` keys. */
ATT_INTERNAL fadev_status bwd_work_alloc(bwd_work *w, const bwd_ctx *bx, int64_t keys);
ATT_INTERNAL void bwd_work_free(bwd_work *w);

/* Step 4's sums (before R_dp) of rows i0.. of query head bh and keys j0 + jj, jj < nvis[r], into dp
 * (row stride lds >= att_score_ld(maxv)). */
ATT_INTERNAL void bwd_dp_products(const bwd_ctx *bx, int64_t bh, int64_t i0, int64_t nr, const int64_t *nvis,
                                  int64_t j0, int64_t maxv, double *dp, int64_t lds);

/* Steps 1-7 for one tile: query head bh, rows [i0, i0 + nr), keys [j0, j0 + n) of one K/V block and one
 * query block. Adds the tile's terms to the running grad_acc sums of dV and dK of its keys (rows of
 * dv_part, dk_part, stride ld) and keeps its dS in w for bwd_tile_dq. Returns 0 (and does nothing) when
 * no row of the tile sees a key of it. */
ATT_INTERNAL int bwd_tile(const bwd_ctx *bx, bwd_work *w, int64_t bh, int64_t i0, int64_t nr, int64_t j0, int64_t n,
                          double *dv_part, double *dk_part);

/* The same tile's terms added to the running grad_acc sums of dQ of its rows (dq_part, stride ld), keys
 * ascending; after bwd_tile returned 1 and before w is used again. */
ATT_INTERNAL void bwd_tile_dq(const bwd_ctx *bx, bwd_work *w, int64_t bh, int64_t i0, int64_t nr, int64_t j0,
                              int64_t n, double *dq_part);

#endif /* FADEV_BACKWARD_H */
