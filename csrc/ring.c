/* Ring / context-parallel attention on one device: exactly what W ranks compute, step by step.
 *
 * The sequence (N tokens) is split over W ranks by a layout; rank r holds n = N/W query rows and the
 * matching K/V rows, local index a -> global position
 *   contiguous: r n + a
 *   zigzag:     2W chunks of h = N/(2W); rank r holds chunks r and 2W-1-r (a < h: r h + a, else (2W-1-r) h + a - h)
 *   striped:    a W + r                       (token i on rank i mod W)
 * At step s = 0..W-1 rank r holds the K/V block of rank src = (r - s) mod W and runs the policy's flash
 * attention (fadev_flash_attention, public API) on sub-slices ("pieces") of its queries and that block:
 *   not causal:  every step full.
 *   contiguous:  src == r causal (equal-length diagonal), src < r full, src > r skipped.
 *   zigzag:      src == r causal on the whole local sequence; src < r all queries vs the first half of the
 *                block (chunk src); src > r the second half of the queries (chunk 2W-1-r) vs the whole block.
 *   striped:     src <= r causal (key b visible iff b <= a); src > r the shifted diagonal b < a, run as
 *                causal flash on q[1:] vs k[:-1] (query row 0 skips that step).
 * Every piece's causal flag is FlashAttention's bottom-right mask on equal lengths, so each row sees >= 1 key.
 * Forward merge (ring-flash-attention's _update_out_and_lse), per row, on each piece's (o_b, lse_b):
 *   o_b = flash out rounded to ring.partial_out;  lse_b = R_partial_lse(flash lse)
 *   first piece:  O = R_running_out(o_b), L = R_running_lse(lse_b)
 *   later pieces: g = R_m(sigmoid(R_m(lse_b - L)));  O = R_running_out(R_m(O - R_m(g R_m(O - o_b))))
 *                 L = R_running_lse(R_m(L - R_m(logsigmoid(R_m(L - lse_b)))))            R_m = ring.merge
 *   out = R_policy.out(O); the returned lse is L.
 * allgather (llama3): K/V all-gathered in global order; rank r runs one flash call per query group with
 * the right mask and no merge: contiguous one call (keys [0, (r+1) n), causal), zigzag one per chunk,
 * striped one per query row (keys [0, a W + r], the rows are independent in flash), not causal one call.
 * Backward (ring-flash-attention's ring backward): the same pieces; each runs fadev_flash_attention_backward
 * with the saved global out and lse and grad = ring.partial_grad;
 *   dQ[rows] = R_dq_acc(dQ + dq_b) in step order; the dK, dV of block src travel with it:
 *   dK[keys] = R_dkv_acc(dK + dk_b) on the rank holding it, then every block is sent: dK = R_dkv_transport(dK);
 *   dq = R_grad(dQ), dk = R_grad(dK), dv = R_grad(dV).
 * allgather backward: each rank's pieces -> dq rows; dk, dv summed over the rank's pieces in dkv_acc,
 * reduce-scattered: T = R_transport(T + R_transport(local_r)), ranks ascending; dk = R_grad(T).
 * Merge and accumulation roundings are nearest-even. q, k, v: (B, H, N, D) / (B, Hkv, N, D), float64. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "fadev.h"
#include "round.h"

typedef struct ring_piece {
    int64_t q_lo, q_n; /* query rows: local rows q_lo .. q_lo + q_n - 1 of rank r */
    int64_t src;       /* K/V rows are local rows of rank src, or global positions when src < 0 */
    int64_t k_lo, k_n;
    int32_t causal;    /* bottom-right causal mask inside the piece */
} ring_piece;

typedef struct ring_geo {
    int64_t N, W, n, h;
    int layout;
} ring_geo;

static int64_t ring_pos(const ring_geo *g, int64_t r, int64_t a) {
    if (g->layout == FADEV_RING_CONTIGUOUS) return r * g->n + a;
    if (g->layout == FADEV_RING_STRIPED) return a * g->W + r;
    return a < g->h ? r * g->h + a : (2 * g->W - 1 - r) * g->h + (a - g->h);
}

/* Pieces of rank r at step s (ring) or of rank r (allgather, s ignored); returns their count (<= n). */
static int64_t ring_pieces(const ring_geo *g, int allgather, int causal, int64_t r, int64_t s, ring_piece *p) {
    const int64_t n = g->n, W = g->W, h = g->h;
    if (allgather) {
        if (!causal) {
            p[0] = (ring_piece){0, n, -1, 0, g->N, 0};
            return 1;
        }
        if (g->layout == FADEV_RING_CONTIGUOUS) {
            p[0] = (ring_piece){0, n, -1, 0, (r + 1) * n, 1};
            return 1;
        }
        if (g->layout == FADEV_RING_ZIGZAG) {
            p[0] = (ring_piece){0, h, -1, 0, (r + 1) * h, 1};
            p[1] = (ring_piece){h, h, -1, 0, (2 * W - r) * h, 1};
            return 2;
        }
        for (int64_t a = 0; a < n; a++) p[a] = (ring_piece){a, 1, -1, 0, a * W + r + 1, 0};
        return n;
    }
    const int64_t src = ((r - s) % W + W) % W;
    if (!causal) {
        p[0] = (ring_piece){0, n, src, 0, n, 0};
        return 1;
    }
    if (g->layout == FADEV_RING_CONTIGUOUS) {
        if (src > r) return 0;
        p[0] = (ring_piece){0, n, src, 0, n, src == r};
        return 1;
    }
    if (g->layout == FADEV_RING_ZIGZAG) {
        if (src == r) p[0] = (ring_piece){0, n, src, 0, n, 1};
        else if (src < r) p[0] = (ring_piece){0, n, src, 0, h, 0};
        else p[0] = (ring_piece){h, h, src, 0, n, 0};
        return 1;
    }
    if (src <= r) {
        p[0] = (ring_piece){0, n, src, 0, n, 1};
        return 1;
    }
    if (n < 2) return 0;
    p[0] = (ring_piece){1, n - 1, src, 0, n - 1, 1};
    return 1;
}

static fadev_status ring_check(const fadev_attention_params *pr, const fadev_ring_params *ring, ring_geo *g) {
    if (!pr || !ring) return FADEV_ERR_INVALID_ARGUMENT;
    if (ring->world_size < 1 || ring->layout < 0 || ring->layout > FADEV_RING_STRIPED) return FADEV_ERR_INVALID_ARGUMENT;
    if (ring->allgather != 0 && ring->allgather != 1) return FADEV_ERR_INVALID_ARGUMENT;
    if (pr->seq_q != pr->seq_kv || pr->seq_q < 1 || pr->batch < 1 || pr->heads < 1 || pr->heads_kv < 1 ||
        pr->dim < 1)
        return FADEV_ERR_INVALID_ARGUMENT;
    int64_t parts = ring->layout == FADEV_RING_ZIGZAG ? 2 * (int64_t)ring->world_size : ring->world_size;
    if (pr->seq_q % parts) return FADEV_ERR_INVALID_ARGUMENT;
    g->N = pr->seq_q, g->W = ring->world_size, g->n = g->N / g->W, g->h = g->N / parts, g->layout = ring->layout;
    return FADEV_OK;
}

fadev_status fadev_ring_coverage(int64_t seq, int causal, const fadev_ring_params *ring, int32_t *count) {
    fadev_attention_params pr = {1, 1, 1, seq, seq, 1, 1.0, causal, 1, 1, 0, 0, 0, 0, NULL};
    ring_geo g;
    fadev_status st = ring_check(&pr, ring, &g);
    if (st != FADEV_OK) return st;
    if (!count) return FADEV_ERR_INVALID_ARGUMENT;
    ring_piece *pc = malloc((size_t)g.n * sizeof *pc);
    if (!pc) return FADEV_ERR_NO_MEMORY;
    memset(count, 0, (size_t)(seq * seq) * sizeof *count);
    for (int64_t r = 0; r < g.W; r++)
        for (int64_t s = 0; s < (ring->allgather ? 1 : g.W); s++) {
            int64_t np = ring_pieces(&g, ring->allgather, causal, r, s, pc);
            for (int64_t x = 0; x < np; x++)
                for (int64_t a = 0; a < pc[x].q_n; a++)
                    for (int64_t b = 0; b < pc[x].k_n; b++) {
                        if (pc[x].causal && b > a + pc[x].k_n - pc[x].q_n) continue;
                        int64_t i = ring_pos(&g, r, pc[x].q_lo + a);
                        int64_t j = pc[x].src < 0 ? pc[x].k_lo + b : ring_pos(&g, pc[x].src, pc[x].k_lo + b);
                        count[i * seq + j]++;
                    }
        }
    free(pc);
    return FADEV_OK;
}

/* Global row of piece row `a` on the query side (rank r) or key side. */
static int64_t q_row(const ring_geo *g, int64_t r, const ring_piece *p, int64_t a) {
    return ring_pos(g, r, p->q_lo + a);
}
static int64_t k_row(const ring_geo *g, const ring_piece *p, int64_t b) {
    return p->src < 0 ? p->k_lo + b : ring_pos(g, p->src, p->k_lo + b);
}

/* dst (bh, nrows, width) <- rows[a] of src (bh, N, width); width = D (q, k, v, out) or 1 (lse). */
static void gather_rows(const ring_geo *g, int64_t bh, int64_t width, const double *src, double *dst, int64_t nrows,
                        const int64_t *rows) {
    for (int64_t x = 0; x < bh; x++)
        for (int64_t a = 0; a < nrows; a++)
            memcpy(dst + (x * nrows + a) * width, src + (x * g->N + rows[a]) * width, (size_t)width * sizeof *dst);
}

static double rne(double x, const fadev_format *f) { return fadev_round_one(x, f, FADEV_ROUND_NEAREST_EVEN, 0); }

static double sigmoid(double x) {
    if (x >= 0) return 1.0 / (1.0 + exp(-x));
    double e = exp(x);
    return e / (1.0 + e);
}

static double logsigmoid(double x) { return x >= 0 ? -log1p(exp(-x)) : x - log1p(exp(x)); }

typedef struct ring_buf {
    double *q, *k, *v, *o, *l, *go, *gq, *gk, *gv;
    int64_t *qrows, *krows;
    ring_piece *pc;
} ring_buf;

/* One row of the merge (fadev_ring_merge). */
static void merge_row(double *O, double *L, unsigned char *seen, const double *ob, double lb_piece, int64_t D,
                      const fadev_ring_params *ring) {
    const double lb = rne(lb_piece, &ring->partial_lse);
    if (lb == -INFINITY) return; /* no visible key (cannot happen with the ring's pieces) */
    if (!*seen) {
        for (int64_t d = 0; d < D; d++) O[d] = rne(ob[d], &ring->running_out);
        *L = rne(lb, &ring->running_lse);
        *seen = 1;
        return;
    }
    const fadev_format *m = &ring->merge;
    const double gt = rne(sigmoid(rne(lb - *L, m)), m);
    for (int64_t d = 0; d < D; d++) {
        double diff = rne(O[d] - ob[d], m);
        O[d] = rne(rne(O[d] - rne(gt * diff, m), m), &ring->running_out);
    }
    const double ls = rne(logsigmoid(rne(*L - lb, m)), m);
    *L = rne(rne(*L - ls, m), &ring->running_lse);
}

fadev_status fadev_ring_merge(double *out, double *lse, unsigned char *seen, const double *ob, const double *lb,
                              int64_t rows, int64_t dim, const fadev_ring_params *ring) {
    if (!out || !lse || !seen || !ob || !lb || !ring || dim < 1 || rows < 0) return FADEV_ERR_INVALID_ARGUMENT;
    for (int64_t a = 0; a < rows; a++) merge_row(out + a * dim, &lse[a], &seen[a], ob + a * dim, lb[a], dim, ring);
    return FADEV_OK;
}

static void buf_free(ring_buf *b) {
    free(b->q), free(b->k), free(b->v), free(b->o), free(b->l), free(b->go), free(b->gq), free(b->gk), free(b->gv);
    free(b->qrows), free(b->krows), free(b->pc);
}

static fadev_status buf_alloc(ring_buf *b, const fadev_attention_params *pr, int backward) {
    memset(b, 0, sizeof *b);
    const size_t N = (size_t)pr->seq_q, D = (size_t)pr->dim, BH = (size_t)(pr->batch * pr->heads);
    const size_t BK = (size_t)(pr->batch * pr->heads_kv);
    if (BH > SIZE_MAX / N / D / sizeof(double)) return FADEV_ERR_OVERFLOW;
    b->q = malloc(BH * N * D * sizeof(double)), b->o = malloc(BH * N * D * sizeof(double));
    b->k = malloc(BK * N * D * sizeof(double)), b->v = malloc(BK * N * D * sizeof(double));
    b->l = malloc(BH * N * sizeof(double));
    b->qrows = malloc(N * sizeof(int64_t)), b->krows = malloc(N * sizeof(int64_t)), b->pc = malloc(N * sizeof(ring_piece));
    int ok = b->q && b->o && b->k && b->v && b->l && b->qrows && b->krows && b->pc;
    if (backward) {
        b->go = malloc(BH * N * D * sizeof(double)), b->gq = malloc(BH * N * D * sizeof(double));
        b->gk = malloc(BK * N * D * sizeof(double)), b->gv = malloc(BK * N * D * sizeof(double));
        ok = ok && b->go && b->gq && b->gk && b->gv;
    }
    if (!ok) {
        buf_free(b);
        return FADEV_ERR_NO_MEMORY;
    }
    return FADEV_OK;
}

/* Fill the piece's row lists and gather q (and k, v) into the buffers; returns the piece's params. */
static fadev_attention_params piece_setup(const ring_geo *g, const fadev_attention_params *pr, int64_t r,
                                          const ring_piece *p, ring_buf *b, const double *q, const double *k,
                                          const double *v) {
    for (int64_t a = 0; a < p->q_n; a++) b->qrows[a] = q_row(g, r, p, a);
    for (int64_t x = 0; x < p->k_n; x++) b->krows[x] = k_row(g, p, x);
    gather_rows(g, pr->batch * pr->heads, pr->dim, q, b->q, p->q_n, b->qrows);
    gather_rows(g, pr->batch * pr->heads_kv, pr->dim, k, b->k, p->k_n, b->krows);
    gather_rows(g, pr->batch * pr->heads_kv, pr->dim, v, b->v, p->k_n, b->krows);
    fadev_attention_params pp = *pr;
    pp.seq_q = p->q_n, pp.seq_kv = p->k_n, pp.causal = p->causal;
    return pp;
}

fadev_status fadev_ring_attention(const double *q, const double *k, const double *v, double *out, double *lse,
                                  const fadev_attention_params *params, const fadev_policy *policy,
                                  const fadev_ring_params *ring) {
    ring_geo g;
    fadev_status st = ring_check(params, ring, &g);
    if (st != FADEV_OK) return st;
    if (!q || !k || !v || !out || !policy) return FADEV_ERR_INVALID_ARGUMENT;
    const int64_t BH = params->batch * params->heads, D = params->dim, N = g.N;
    ring_buf b;
    if ((st = buf_alloc(&b, params, 0)) != FADEV_OK) return st;
    double *run_l = malloc((size_t)(BH * N) * sizeof(double));
    unsigned char *seen = calloc((size_t)(BH * N), 1);
    if (!run_l || !seen) {
        st = FADEV_ERR_NO_MEMORY;
        goto done;
    }
    fadev_policy pol = *policy;
    if (!ring->allgather) pol.out = ring->partial_out;
    for (int64_t s = 0; s < (ring->allgather ? 1 : g.W) && st == FADEV_OK; s++)
        for (int64_t r = 0; r < g.W && st == FADEV_OK; r++) {
            int64_t np = ring_pieces(&g, ring->allgather, params->causal, r, s, b.pc);
            for (int64_t x = 0; x < np && st == FADEV_OK; x++) {
                const ring_piece *p = &b.pc[x];
                fadev_attention_params pp = piece_setup(&g, params, r, p, &b, q, k, v);
                if ((st = fadev_flash_attention(b.q, b.k, b.v, b.o, b.l, &pp, &pol)) != FADEV_OK) break;
                for (int64_t bh = 0; bh < BH; bh++)
                    for (int64_t a = 0; a < p->q_n; a++) {
                        const int64_t row = bh * N + b.qrows[a];
                        const double *ob = b.o + (bh * p->q_n + a) * D;
                        double *O = out + row * D;
                        if (ring->allgather) {
                            memcpy(O, ob, (size_t)D * sizeof *O);
                            run_l[row] = b.l[bh * p->q_n + a];
                            seen[row] = 1;
                            continue;
                        }
                        merge_row(O, &run_l[row], &seen[row], ob, b.l[bh * p->q_n + a], D, ring);
                    }
            }
        }
    if (st == FADEV_OK)
        for (int64_t row = 0; row < BH * N; row++) {
            if (!seen[row]) { /* unreachable: step 0 covers every row; kept as flash's convention */
                for (int64_t d = 0; d < D; d++) out[row * D + d] = 0;
                run_l[row] = -INFINITY;
            } else if (!ring->allgather) {
                for (int64_t d = 0; d < D; d++)
                    out[row * D + d] = fadev_round_one(out[row * D + d], &policy->out, FADEV_ROUND_NEAREST_EVEN, 0);
            }
            if (lse) lse[row] = run_l[row];
        }
done:
    free(run_l), free(seen);
    buf_free(&b);
    return st;
}

fadev_status fadev_ring_attention_backward(const double *q, const double *k, const double *v, const double *out,
                                           const double *lse, const double *dout, double *dq, double *dk,
                                           double *dv, const fadev_attention_params *params,
                                           const fadev_policy *policy, const fadev_policy_backward *policy_backward,
                                           const fadev_ring_params *ring) {
    ring_geo g;
    fadev_status st = ring_check(params, ring, &g);
    if (st != FADEV_OK) return st;
    if (!q || !k || !v || !out || !lse || !dout || !dq || !dk || !dv || !policy || !policy_backward)
        return FADEV_ERR_INVALID_ARGUMENT;
    const int64_t BH = params->batch * params->heads, BK = params->batch * params->heads_kv;
    const int64_t D = params->dim, N = g.N;
    ring_buf b;
    if ((st = buf_alloc(&b, params, 1)) != FADEV_OK) return st;
    /* dQ accumulator (like q); dK, dV accumulators (travelling blocks, or the reduce-scatter total) and,
     * for allgather, the rank-local partials. */
    double *aq = calloc((size_t)(BH * N * D), sizeof(double));
    double *ak = calloc((size_t)(BK * N * D), sizeof(double)), *av = calloc((size_t)(BK * N * D), sizeof(double));
    double *lk = NULL, *lv = NULL;
    if (ring->allgather) {
        lk = calloc((size_t)(BK * N * D), sizeof(double)), lv = calloc((size_t)(BK * N * D), sizeof(double));
    }
    if (!aq || !ak || !av || (ring->allgather && (!lk || !lv))) {
        st = FADEV_ERR_NO_MEMORY;
        goto done;
    }
    fadev_policy_backward pb = *policy_backward;
    pb.grad = ring->partial_grad;
    const fadev_format *T = &ring->dkv_transport, *A = &ring->dkv_acc;
    const size_t nkv = (size_t)(BK * N * D);
    for (int64_t s = 0; s < (ring->allgather ? 1 : g.W) && st == FADEV_OK; s++) {
        for (int64_t r = 0; r < g.W && st == FADEV_OK; r++) {
            int64_t np = ring_pieces(&g, ring->allgather, params->causal, r, s, b.pc);
            if (ring->allgather) {
                memset(lk, 0, nkv * sizeof *lk), memset(lv, 0, nkv * sizeof *lv);
            }
            for (int64_t x = 0; x < np && st == FADEV_OK; x++) {
                const ring_piece *p = &b.pc[x];
                fadev_attention_params pp = piece_setup(&g, params, r, p, &b, q, k, v);
                gather_rows(&g, BH, D, out, b.o, p->q_n, b.qrows);
                gather_rows(&g, BH, D, dout, b.go, p->q_n, b.qrows);
                gather_rows(&g, BH, 1, lse, b.l, p->q_n, b.qrows);
                st = fadev_flash_attention_backward(b.q, b.k, b.v, b.o, b.l, b.go, b.gq, b.gk, b.gv, &pp, policy, &pb);
                if (st != FADEV_OK) break;
                for (int64_t bh = 0; bh < BH; bh++)
                    for (int64_t a = 0; a < p->q_n; a++)
                        for (int64_t d = 0; d < D; d++) {
                            double *t = aq + (bh * N + b.qrows[a]) * D + d;
                            *t = rne(*t + b.gq[(bh * p->q_n + a) * D + d], &ring->dq_acc);
                        }
                double *tk = ring->allgather ? lk : ak, *tv = ring->allgather ? lv : av;
                for (int64_t bk = 0; bk < BK; bk++)
                    for (int64_t x2 = 0; x2 < p->k_n; x2++)
                        for (int64_t d = 0; d < D; d++) {
                            const size_t at = (size_t)((bk * N + b.krows[x2]) * D + d);
                            const size_t from = (size_t)((bk * p->k_n + x2) * D + d);
                            tk[at] = rne(tk[at] + b.gk[from], A);
                            tv[at] = rne(tv[at] + b.gv[from], A);
                        }
            }
            if (ring->allgather && st == FADEV_OK) /* this rank's share of the reduce-scatter */
                for (size_t e = 0; e < nkv; e++) {
                    ak[e] = rne(ak[e] + rne(lk[e], T), T);
                    av[e] = rne(av[e] + rne(lv[e], T), T);
                }
        }
        if (!ring->allgather) /* every block (and its dK, dV) moves one hop */
            for (size_t e = 0; e < nkv; e++) ak[e] = rne(ak[e], T), av[e] = rne(av[e], T);
    }
    if (st == FADEV_OK) {
        for (int64_t e = 0; e < BH * N * D; e++) dq[e] = rne(aq[e], &policy_backward->grad);
        for (size_t e = 0; e < nkv; e++) dk[e] = rne(ak[e], &policy_backward->grad), dv[e] = rne(av[e], &policy_backward->grad);
    }
done:
    free(aq), free(ak), free(av), free(lk), free(lv);
    buf_free(&b);
    return st;
}
