/* Block products of attention, forward and backward (docs/numerics.md, "Common pieces" and "Backward"):
 *   C[r][col] = acc over k in [kb_r, ke_r) ascending of  acc = R_acc(acc + A[r][k] * B[k][col]),
 * acc starting from C's value, or from 0 for a fresh product (att_mm.zero). The forward's scores
 * (A = Q, B = K^T) and P.V (A = P, B = V), the backward's dP, dV, dK and dQ are all of this form; every
 * sum runs in exactly this order, the kernels only choose how many independent sums advance side by
 * side in SIMD lanes (four rows of C over the k they share, 8 or 16 columns). Four tiers (att_mm_tier),
 * the same bits:
 *   scalar     att_round after every add (any format, any rounding mode, stochastic counters: the
 *              term (row, k, col) is event ATT_INDEX of those three in the order att_mm.index names);
 *   fp64 SIMD  acc in double: the identity rounding of fp64 (ATT_MM_F64), or (double)(float)acc after
 *              every add for fp32 under nearest-even (ATT_MM_F64_R32: one IEEE rounding of the fp64 sum,
 *              exactly R_fp32);
 *   fp32 SIMD  acc in float, product in float (ATT_MM_F32): only when both factors are values of formats
 *              inside fp32 whose precisions add up to <= 24 bits and every nonzero product lies in
 *              [2^-126, 2^128) (att_mm_tier, on the data), so the float product is the exact product and
 *              the float sum of two fp32 values equals R_fp32 of their fp64 sum (53 >= 2*24 + 2, so the
 *              double rounding is innocuous). NaN/Inf data always take the fp64 or scalar tier.
 *   FMA        acc in float, acc = fmaf(a, b, acc) (ATT_MM_FMA, x86-64 with AVX2 + FMA, chosen at run time):
 *              the same condition on the formats, finite data, and no magnitude test. Why the bits are the
 *              spec's R32(R64(acc + R64(a b))) (R32, R64: nearest-even to fp32, fp64), for fp32 acc:
 *              (1) a b is exact in fp64: its significand has <= 24 bits and |a b| >= 2^-298 (a, b >= 2^-149
 *              when nonzero), far inside fp64's range, so R64(a b) = a b. (2) R32(R64(z)) = R32(z) for
 *              z = acc + a b: if z is an fp64 number there is nothing to show. Otherwise let L be the larger of
 *              acc, a b in magnitude, S the other, e_L, e_S their exponents. Both are multiples of their
 *              lowest significant bit (>= 2^(e - 23)); if e_S >= e_L - 28, z is a multiple of 2^(e_L - 51)
 *              below 2^(e_L + 2), i.e. an fp64 number; so e_S <= e_L - 29 and |S| < 2^(e_L - 28).
 *              If L is an fp32 number (acc always is; a b when in fp32's range), its fp32 rounding midpoints
 *              lie at least 2^(e_L - 25) away (2^-150 in the subnormal range, where e_L <= -127), while z
 *              and, by monotonicity, R64(z) lie within 2^(e_L - 28) of L: both round to L. If L = a b is not
 *              an fp32 number, either |a b| >= 2^128: then |z|, |R64(z)| >= 2^128 - 2^100, beyond the
 *              overflow threshold 2^128 - 2^103, both give the same infinity; or |a b| < 2^-126: then
 *              |acc| < 2^-154, so acc = 0 and z = a b is an fp64 number. Signed zeros: both are IEEE
 *              roundings of the same exact value, so an exact zero sum gets +0 (or -0 + -0 = -0) either way,
 *              and a nonzero z that underflows keeps its sign. An infinite acc stays that infinity in both.
 *              (3) fmaf computes R32(acc + a b) in one rounding. Hence fmaf(a, b, acc) is the spec's value
 *              for every finite a, b of such formats (bf16, fp16, fp8 x bf16, fp16, fp8 ...) and every acc:
 *              the chain over k runs in the spec's order, one fmaf per term, lanes = independent outputs.
 *              Where the CPU has no FMA the float tier (when the magnitude test passes) or the fp64 tier
 *              gives the same bits.
 * Compiled for AVX2 and a portable default at once (target_clones); -ffp-contract=off keeps every
 * multiply and add separately rounded, as the spec requires; the FMA kernels fuse only by intrinsics. */
#include <stdlib.h>
#include <string.h>

#include "matmul.h"

#if defined(__GNUC__) && defined(__x86_64__) && !defined(FADEV_NO_FMA)
#include <immintrin.h>
#define MM_FMA 1
#else
#define MM_FMA 0
#endif

static int fast_on = 1;
static unsigned long long fast_calls, fma_products; /* what the tests read (att_fast_counts) */

int att_fast_enabled(void) {
    /* FADEV_EMU_GENERIC=1 forces the generic paths on the CPU as on the GPU (cuda/emu_forward_fast.cu) */
    const char *generic = getenv("FADEV_EMU_GENERIC");
    return __atomic_load_n(&fast_on, __ATOMIC_RELAXED) && !(generic && strcmp(generic, "1") == 0);
}

void att_fast_count(int call, int fma) {
    if (call) __atomic_fetch_add(&fast_calls, 1, __ATOMIC_RELAXED);
    if (fma) __atomic_fetch_add(&fma_products, 1, __ATOMIC_RELAXED);
}

void att_fast_counts(unsigned long long *calls, unsigned long long *products) {
    *calls = __atomic_load_n(&fast_calls, __ATOMIC_RELAXED);
    *products = __atomic_load_n(&fma_products, __ATOMIC_RELAXED);
}

static int avx512_on = 1;

int att_set_fast(int on, int avx512) {
    __atomic_store_n(&avx512_on, avx512 ? 1 : 0, __ATOMIC_RELAXED);
    return __atomic_exchange_n(&fast_on, on ? 1 : 0, __ATOMIC_RELAXED);
}

int att_cpu_fma(void) {
#if MM_FMA
    static int cpu = -1; /* -1: not asked yet; the answer never changes, so a race only asks twice */
    int have = __atomic_load_n(&cpu, __ATOMIC_RELAXED);
    if (have < 0) {
        __builtin_cpu_init();
        have = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
        __atomic_store_n(&cpu, have, __ATOMIC_RELAXED);
    }
    return have;
#else
    return 0;
#endif
}

int att_fma_ok(void) { return att_cpu_fma() && att_fast_enabled(); }

#if defined(__GNUC__) && defined(__x86_64__) && defined(__linux__) && !defined(FADEV_NO_CLONES)
#define MM_CLONES __attribute__((target_clones("avx2", "default")))
#else
#define MM_CLONES
#endif

typedef double v4d __attribute__((vector_size(32)));
typedef double v4du __attribute__((vector_size(32), aligned(8)));
typedef float v4f __attribute__((vector_size(16)));
typedef float v8f __attribute__((vector_size(32)));
typedef float v8fu __attribute__((vector_size(32), aligned(4)));

#define R32V(a) __builtin_convertvector(__builtin_convertvector((a), v4f), v4d)

/* c[r][col] = acc over k in [kb, ke) ascending of acc + a[r][k] * b[k][col], continuing from c's value (or
 * from 0 when `zero`: c is not read), for col < ncols (a multiple of 16): 4 rows (mm4) or one row (mm1).
 * R32 rounds the fp64 sum to fp32 after every add; the f32 kernels keep the sum in float (exact
 * products, see the top comment). */
#define LOAD4(p) (zero ? (v4d){0} : *(const v4du *)(p))
#define MM4_F64(R32)                                                                                      \
    for (int64_t col = 0; col < ncols; col += 8) {                                                        \
        double *o = c + col;                                                                              \
        v4d a0 = LOAD4(o), b0 = LOAD4(o + 4), a1 = LOAD4(o + ldc), b1 = LOAD4(o + ldc + 4);               \
        v4d a2 = LOAD4(o + 2 * ldc), b2 = LOAD4(o + 2 * ldc + 4);                                         \
        v4d a3 = LOAD4(o + 3 * ldc), b3 = LOAD4(o + 3 * ldc + 4);                                         \
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
        v4d a0 = LOAD4(o), a1 = LOAD4(o + 4), a2 = LOAD4(o + 8), a3 = LOAD4(o + 12);                      \
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
                   double *c, int64_t ldc, int zero
MM_CLONES static void mm4_f64(MM_ARGS(double)) { MM4_F64(0) }
MM_CLONES static void mm4_f64_r32(MM_ARGS(double)) { MM4_F64(1) }
MM_CLONES static void mm1_f64(MM_ARGS(double)) { (void)lda, (void)ldc; MM1_F64(0) }
MM_CLONES static void mm1_f64_r32(MM_ARGS(double)) { (void)lda, (void)ldc; MM1_F64(1) }

/* The float tier; c is kept in double between calls (its values are fp32 values, so both conversions
 * are exact). */
#define LOAD8(p)                                                                                        \
    (zero ? (v8f){0}                                                                                    \
          : __builtin_shufflevector(__builtin_convertvector(*(const v4du *)(p), v4f),                   \
                                    __builtin_convertvector(*(const v4du *)((p) + 4), v4f), 0, 1, 2, 3, 4, 5, 6, 7))
#define STORE8(p, x)                                                                                    \
    (*(v4du *)(p) = __builtin_convertvector(__builtin_shufflevector((x), (x), 0, 1, 2, 3), v4d),         \
     *(v4du *)((p) + 4) = __builtin_convertvector(__builtin_shufflevector((x), (x), 4, 5, 6, 7), v4d))

MM_CLONES static void mm4_f32(MM_ARGS(float)) {
    for (int64_t col = 0; col < ncols; col += 16) {
        double *o = c + col;
        v8f a0 = LOAD8(o), b0 = LOAD8(o + 8), a1 = LOAD8(o + ldc), b1 = LOAD8(o + ldc + 8);
        v8f a2 = LOAD8(o + 2 * ldc), b2 = LOAD8(o + 2 * ldc + 8);
        v8f a3 = LOAD8(o + 3 * ldc), b3 = LOAD8(o + 3 * ldc + 8);
        const float *bp = b + kb * ldb + col;
        for (int64_t k = kb; k < ke; k++, bp += ldb) {
            v8f v0 = *(const v8fu *)bp, v1 = *(const v8fu *)(bp + 8);
            float x0 = a[k], x1 = a[lda + k], x2 = a[2 * lda + k], x3 = a[3 * lda + k];
            a0 = a0 + x0 * v0, b0 = b0 + x0 * v1, a1 = a1 + x1 * v0, b1 = b1 + x1 * v1;
            a2 = a2 + x2 * v0, b2 = b2 + x2 * v1, a3 = a3 + x3 * v0, b3 = b3 + x3 * v1;
        }
        STORE8(o, a0), STORE8(o + 8, b0), STORE8(o + ldc, a1), STORE8(o + ldc + 8, b1);
        STORE8(o + 2 * ldc, a2), STORE8(o + 2 * ldc + 8, b2), STORE8(o + 3 * ldc, a3), STORE8(o + 3 * ldc + 8, b3);
    }
}

MM_CLONES static void mm1_f32(MM_ARGS(float)) {
    (void)lda, (void)ldc;
    for (int64_t col = 0; col < ncols; col += 16) {
        v8f a0 = LOAD8(c + col), a1 = LOAD8(c + col + 8);
        const float *bp = b + kb * ldb + col;
        for (int64_t k = kb; k < ke; k++, bp += ldb) {
            float x = a[k];
            a0 = a0 + x * *(const v8fu *)bp, a1 = a1 + x * *(const v8fu *)(bp + 8);
        }
        STORE8(c + col, a0), STORE8(c + col + 8, a1);
    }
}

#if MM_FMA
/* The FMA tier (top comment): 4 rows (or 1) x 16 columns per step, acc = fmaf(a[r][k], b[k][col], acc). */
#define FMA_T __attribute__((target("avx2,fma")))
FMA_T static inline __m256 fma_load(const double *p, int zero) {
    if (zero) return _mm256_setzero_ps();
    return _mm256_insertf128_ps(_mm256_castps128_ps256(_mm256_cvtpd_ps(_mm256_loadu_pd(p))),
                                _mm256_cvtpd_ps(_mm256_loadu_pd(p + 4)), 1);
}
FMA_T static inline void fma_store(double *p, __m256 x) {
    _mm256_storeu_pd(p, _mm256_cvtps_pd(_mm256_castps256_ps128(x)));
    _mm256_storeu_pd(p + 4, _mm256_cvtps_pd(_mm256_extractf128_ps(x, 1)));
}

/* The 4-row x 2-vector step at column `col` of mm4_fma (AVX2: V __m256, W 8 lanes) and mm4_fma512 (AVX-512: __m512,
 * 16): one loop for both instruction sets, 8 independent fmaf chains over k ascending. */
#define MM4_TILE(V, W, LOAD, STORE, LOADU, SET1, FMADD)                                                        \
    do {                                                                                                      \
        double *o = c + col;                                                                                  \
        V a0 = LOAD(o, zero), b0 = LOAD(o + W, zero), a1 = LOAD(o + ldc, zero), b1 = LOAD(o + ldc + W, zero); \
        V a2 = LOAD(o + 2 * ldc, zero), b2 = LOAD(o + 2 * ldc + W, zero);                                     \
        V a3 = LOAD(o + 3 * ldc, zero), b3 = LOAD(o + 3 * ldc + W, zero);                                     \
        const float *bp = b + kb * ldb + col;                                                                 \
        for (int64_t k = kb; k < ke; k++, bp += ldb) {                                                        \
            V v0 = LOADU(bp), v1 = LOADU(bp + W);                                                             \
            V x0 = SET1(a[k]), x1 = SET1(a[lda + k]), x2 = SET1(a[2 * lda + k]), x3 = SET1(a[3 * lda + k]);   \
            a0 = FMADD(x0, v0, a0), b0 = FMADD(x0, v1, b0), a1 = FMADD(x1, v0, a1), b1 = FMADD(x1, v1, b1);   \
            a2 = FMADD(x2, v0, a2), b2 = FMADD(x2, v1, b2), a3 = FMADD(x3, v0, a3), b3 = FMADD(x3, v1, b3);   \
        }                                                                                                     \
        STORE(o, a0), STORE(o + W, b0), STORE(o + ldc, a1), STORE(o + ldc + W, b1);                           \
        STORE(o + 2 * ldc, a2), STORE(o + 2 * ldc + W, b2), STORE(o + 3 * ldc, a3), STORE(o + 3 * ldc + W, b3); \
    } while (0)

FMA_T static void mm4_fma(MM_ARGS(float)) {
    for (int64_t col = 0; col < ncols; col += 16)
        MM4_TILE(__m256, 8, fma_load, fma_store, _mm256_loadu_ps, _mm256_set1_ps, _mm256_fmadd_ps);
}

FMA_T static void mm1_fma(MM_ARGS(float)) {
    (void)lda, (void)ldc;
    for (int64_t col = 0; col < ncols; col += 16) {
        __m256 a0 = fma_load(c + col, zero), a1 = fma_load(c + col + 8, zero);
        const float *bp = b + kb * ldb + col;
        for (int64_t k = kb; k < ke; k++, bp += ldb) {
            __m256 x = _mm256_set1_ps(a[k]);
            a0 = _mm256_fmadd_ps(x, _mm256_loadu_ps(bp), a0), a1 = _mm256_fmadd_ps(x, _mm256_loadu_ps(bp + 8), a1);
        }
        fma_store(c + col, a0), fma_store(c + col + 8, a1);
    }
}

/* The same with AVX-512F (chosen where the CPU has it): 4 rows x 32 columns per step (8 independent chains),
 * then 4 x 16; fmaf of every lane, so the bits are mm4_fma's. */
#define FMA512_T __attribute__((target("avx512f")))
FMA512_T static inline __m512 fma512_load(const double *p, int zero) {
    if (zero) return _mm512_setzero_ps();
    __m256 lo = _mm512_cvtpd_ps(_mm512_loadu_pd(p)), hi = _mm512_cvtpd_ps(_mm512_loadu_pd(p + 8));
    return _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castps_pd(_mm512_castps256_ps512(lo)), _mm256_castps_pd(hi), 1));
}
FMA512_T static inline void fma512_store(double *p, __m512 x) {
    _mm512_storeu_pd(p, _mm512_cvtps_pd(_mm512_castps512_ps256(x)));
    _mm512_storeu_pd(p + 8, _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(x), 1))));
}

FMA512_T static void mm4_fma512(MM_ARGS(float)) {
    int64_t col = 0;
    for (; col + 32 <= ncols; col += 32)
        MM4_TILE(__m512, 16, fma512_load, fma512_store, _mm512_loadu_ps, _mm512_set1_ps, _mm512_fmadd_ps);
    if (col < ncols) mm4_fma(a, lda, b + col, ldb, kb, ke, ncols - col, c + col, ldc, zero);
}

int att_cpu_avx512(void) {
    static int cpu = -1;
    int have = __atomic_load_n(&cpu, __ATOMIC_RELAXED);
    if (have < 0) {
        __builtin_cpu_init();
        have = __builtin_cpu_supports("avx512f");
        __atomic_store_n(&cpu, have, __ATOMIC_RELAXED);
    }
    return have && __atomic_load_n(&avx512_on, __ATOMIC_RELAXED);
}
#else
#define mm4_fma mm4_f32 /* never chosen: att_fma_ok() is 0 */
#define mm1_fma mm1_f32
#define mm4_fma512 mm4_f32
int att_cpu_avx512(void) { return 0; }
#endif

/* Row r, columns 0..ncol-1, k in [kb, ke), rounding after every add. The event of the term (row, k, col)
 * is ATT_INDEX(i, u, w) = i << 42 | u << 21 | w with (i, u, w) the three in the order m->index names:
 * row, k and col are shifted by sr, sk and sc. `general`: the stage is ATT_GENERAL and its event is
 * inlined here (a stochastic policy makes nearly all its events in these loops). All four are constants
 * in each instance below, each a function of its own, so that the compiler keeps the Philox state in
 * registers: the instances are as fast as the loops they replace. */
__attribute__((always_inline)) static inline void mm_scalar_at(const att_mm *m, int64_t r, int64_t kb, int64_t ke,
                                                                int64_t ncol, int sr, int sk, int sc, int general) {
    const att_stage *acc_stage = m->acc;
    const uint64_t stream = m->stream, row_bits = (uint64_t)(m->row0 + r) << sr;
    const double *a = m->a + r * m->lda, *b = m->b;
    const int64_t ldb = m->ldb, k0 = m->k0, col0 = m->col0;
    double *c = m->c + r * m->ldc;
    for (int64_t col = 0; col < ncol; col++) {
        const uint64_t col_bits = row_bits | (uint64_t)(col0 + col) << sc;
        double acc = m->zero ? 0 : c[col];
        for (int64_t k = kb; k < ke; k++) {
            const double x = acc + a[k] * b[k * ldb + col];
            const uint64_t idx = col_bits | (uint64_t)(k0 + k) << sk;
            acc = general ? att_round_general(acc_stage, x, stream, idx) : att_round(acc_stage, x, stream, idx);
        }
        c[col] = acc;
    }
}

#define MM_SCALAR(name, sr, sk, sc, general)                                                            \
    __attribute__((noinline)) static void name(const att_mm *m, int64_t r, int64_t kb, int64_t ke,      \
                                               int64_t ncol) {                                          \
        mm_scalar_at(m, r, kb, ke, ncol, sr, sk, sc, general);                                          \
    }
MM_SCALAR(mm_scalar_rck, 42, 0, 21, 0)
MM_SCALAR(mm_scalar_rck_general, 42, 0, 21, 1)
MM_SCALAR(mm_scalar_krc, 21, 42, 0, 0)
MM_SCALAR(mm_scalar_krc_general, 21, 42, 0, 1)
MM_SCALAR(mm_scalar_rkc, 42, 21, 0, 0)
MM_SCALAR(mm_scalar_rkc_general, 42, 21, 0, 1)

static void mm_scalar(const att_mm *m, int64_t r, int64_t kb, int64_t ke, int64_t ncol) {
    const int general = m->acc->kind == ATT_GENERAL;
    if (m->index == ATT_MM_ROW_COL_K) (general ? mm_scalar_rck_general : mm_scalar_rck)(m, r, kb, ke, ncol);
    else if (m->index == ATT_MM_K_ROW_COL) (general ? mm_scalar_krc_general : mm_scalar_krc)(m, r, kb, ke, ncol);
    else (general ? mm_scalar_rkc_general : mm_scalar_rkc)(m, r, kb, ke, ncol);
}

/* Rows r.. (four of them, or one) over k in [kb, ke), in one of the vector tiers, starting from 0 when
 * `zero` (an empty range then writes 0). */
static void mm_rows(const att_mm *m, int four, int64_t r, int64_t kb, int64_t ke, int64_t ncols, int zero) {
    double *c = m->c + r * m->ldc;
    if (kb >= ke) {
        if (zero) memset(c, 0, (size_t)ncols * sizeof(double));
        return;
    }
    if (m->tier == ATT_MM_FMA) {
        void (*kernel)(MM_ARGS(float)) = four ? (att_cpu_avx512() ? mm4_fma512 : mm4_fma) : mm1_fma;
        kernel(m->af + r * m->lda, m->lda, m->bf, m->ldb, kb, ke, ncols, c, m->ldc, zero);
        return;
    }
    if (m->tier == ATT_MM_F32) {
        (four ? mm4_f32 : mm1_f32)(m->af + r * m->lda, m->lda, m->bf, m->ldb, kb, ke, ncols, c, m->ldc, zero);
        return;
    }
    void (*kernel)(MM_ARGS(double)) = m->tier == ATT_MM_F64_R32 ? (four ? mm4_f64_r32 : mm1_f64_r32)
                                                                : (four ? mm4_f64 : mm1_f64);
    kernel(m->a + r * m->lda, m->lda, m->b, m->ldb, kb, ke, ncols, c, m->ldc, zero);
}

void att_mm_run(const att_mm *m, int64_t nrows, const int64_t *kb, const int64_t *ke, int64_t k_end,
                const int64_t *ncol, int64_t ncols) {
    if (m->tier == ATT_MM_FMA) att_fast_count(0, 1);
#define KB(x) (kb ? kb[x] : 0)
#define KE(x) (ke ? ke[x] : k_end)
    if (m->tier == ATT_MM_SCALAR) {
        for (int64_t r = 0; r < nrows; r++) mm_scalar(m, r, KB(r), KE(r), ncol ? ncol[r] : ncols);
        return;
    }
    ncols = att_round_up(ncols, 16);
    int64_t r = 0;
    for (; r + 4 <= nrows; r += 4) {
        int64_t lo = KB(r), hi = KE(r);
        for (int64_t x = r + 1; x < r + 4; x++) {
            lo = KB(x) > lo ? KB(x) : lo;
            hi = KE(x) < hi ? KE(x) : hi;
        }
        if (lo >= hi) {
            for (int64_t x = r; x < r + 4; x++) mm_rows(m, 0, x, KB(x), KE(x), ncols, m->zero);
            continue;
        }
        /* what one row has before or after the shared range it does alone, in order (zero: kb is NULL,
         * so nothing comes before) */
        for (int64_t x = r; x < r + 4; x++) mm_rows(m, 0, x, KB(x), lo, ncols, 0);
        mm_rows(m, 1, r, lo, hi, ncols, m->zero);
        for (int64_t x = r; x < r + 4; x++) mm_rows(m, 0, x, hi, KE(x), ncols, 0);
    }
    for (; r < nrows; r++) mm_rows(m, 0, r, KB(r), KE(r), ncols, m->zero);
#undef KB
#undef KE
}
