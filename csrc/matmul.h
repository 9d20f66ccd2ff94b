/* Block products of attention, forward and backward: C += A B with every partial sum rounded as its
 * accumulator stage says (matmul.c, top comment: the order and the four tiers). Not public API.
 * Layers: stage.h <- this file <- attention.h. */
#ifndef FADEV_MATMUL_H
#define FADEV_MATMUL_H

#include <stdint.h>

#include "stage.h"

/* Round n up to a multiple of m. */
static inline int64_t att_round_up(int64_t n, int64_t m) { return (n + m - 1) / m * m; }

enum att_mm_tier { ATT_MM_SCALAR, ATT_MM_F64, ATT_MM_F64_R32, ATT_MM_F32, ATT_MM_FMA };
/* how the term (row, k, col) of a product names its stochastic counter ATT_INDEX(i, u, w) */
enum att_mm_index { ATT_MM_ROW_COL_K, ATT_MM_K_ROW_COL, ATT_MM_ROW_K_COL };

/* C[r][col] += sum_k A[r][k] B[k][col], k ascending, accumulated in `acc`. */
typedef struct att_mm {
    int tier, index;      /* att_mm_tier, att_mm_index */
    int zero;             /* 1: C starts at 0 (its values are not read; needs kb == NULL in att_mm_run) */
    const att_stage *acc; /* scalar tier: accumulator stage, stream, absolute offsets of row, k, col */
    uint64_t stream;
    int64_t row0, k0, col0;
    const double *a, *b;  /* fp64 and scalar tiers */
    const float *af, *bf; /* float tier: the same values as float32 (same strides) */
    int64_t lda, ldb;
    double *c;
    int64_t ldc;
} att_mm;

/* 1 when the fast paths may be used (the default): the FMA tier of the products (att_mm_tier) and the vector
 * element-wise steps (fast.c). 0 forces the generic paths that they must equal bit for bit (the tests compare
 * the two; _core._set_fast_paths). */
ATT_INTERNAL int att_fast_enabled(void);
ATT_INTERNAL int att_set_fast(int on, int avx512); /* returns the previous `on`; avx512 0: the AVX2 kernels */
/* Counters of what took the fast paths since the module loaded: calls that ran the vector element-wise steps
 * (att_fast_count(1, 0), from att_init) and products that ran the FMA tier; for the tests. */
ATT_INTERNAL void att_fast_count(int call, int fma);
ATT_INTERNAL void att_fast_counts(unsigned long long *calls, unsigned long long *products);
/* 1 when att_fast_enabled() and this CPU runs the FMA kernels (x86-64 with AVX2 and FMA); a call asks once
 * (att_ctx.fma) and passes the answer to att_mm_tier. */
ATT_INTERNAL int att_fma_ok(void);
/* 1 if this CPU runs the FMA kernels (x86-64 with AVX2 and FMA), whatever att_set_fast says. */
ATT_INTERNAL int att_cpu_fma(void);
/* 1 if this CPU has AVX-512F (x86-64 builds; where the FMA kernels run it picks their 16-lane versions) and
 * att_set_fast did not turn them off. */
ATT_INTERNAL int att_cpu_avx512(void);

/* Tier of a product accumulated in `acc` whose float tier is `possible` for these formats (both factors are
 * values of formats inside fp32 whose precisions add up to <= 24 bits), given the magnitudes of its two
 * factors (smallest nonzero, largest, all finite; with `fma`, only `finite` is read). With finite factors and
 * `fma` (att_fma_ok()) the FMA tier needs no magnitude test
 * (matmul.c, top comment: fmaf(a, b, acc) is R_fp32(R_fp64(acc + a b)) for every such a, b and fp32 acc);
 * the plain float tier needs every nonzero product in [2^-126, 2^128). */
static inline int att_mm_tier(const att_stage *acc, int fma, int possible, double amin, double amax, int afin,
                              double bmin, double bmax, int bfin) {
    if (acc->kind == ATT_EXACT) return ATT_MM_F64;
    if (acc->kind != ATT_F32) return ATT_MM_SCALAR;
    if (possible && afin && bfin && fma) return ATT_MM_FMA;
    int exact = possible && afin && bfin && amin * bmin >= 0x1p-126 && amax * bmax < 0x1p128;
    return exact ? ATT_MM_F32 : ATT_MM_F64_R32;
}

/* 1 if the tier reads the float copies (att_mm.af, .bf). */
static inline int att_mm_float(int tier) { return tier == ATT_MM_F32 || tier == ATT_MM_FMA; }

/* Row r < nrows of C sums k in [kb ? kb[r] : 0, ke ? ke[r] : k_end) ascending onto its current value (or 0).
 * The scalar tier computes ncol ? ncol[r] : ncols columns; the vector tiers att_round_up(ncols, 16) for
 * every row (C and B must hold them). Four rows advance together over the k they share. */
ATT_INTERNAL void att_mm_run(const att_mm *m, int64_t nrows, const int64_t *kb, const int64_t *ke, int64_t k_end,
                             const int64_t *ncol, int64_t ncols);

#endif /* FADEV_MATMUL_H */
