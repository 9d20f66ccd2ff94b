/* The element-wise steps of attention as array passes, for policies that round to nearest even (att_ctx.fast;
 * docs/numerics.md, "How the CPU runs it"). Every rounding event of the spec is still made, on the same fp64
 * value, with the same rule: only the loops change shape so that the compiler can run them in SIMD lanes
 * (an AVX2 clone chosen at run time, target_clones), and the row sums of several rows advance side by side
 * (each sum keeps its order). The generic loops (flash.c, baseline.c, backward_tile.c) remain for every
 * other policy and under _core._set_fast_paths(0), and must give the same bits (tests/test_fast_paths.py).
 *
 * att_round_n(st, x, y, n) is n events R_st(x[i]) (nearest-even, so no counters are needed):
 *   ATT_EXACT  the identity;  ATT_F32  (double)(float)x, one IEEE rounding;
 *   ATT_RNE    the bit-pattern rule of att_round_fast on every lane, and where a lane of a chunk is outside
 *              the format's normal range (zero, subnormal, overflow, inf, NaN) the whole chunk is redone by
 *              att_round (the scalar rule), so the bits are att_round's;
 *   ATT_GENERAL (toward zero) fadev_round_one, one by one. */
#include <string.h>

#include "attention.h"

#if defined(__GNUC__) && defined(__x86_64__) && defined(__linux__) && !defined(FADEV_NO_CLONES)
/* FAST_CLONES for loops with compares (GCC 12 scalarises vector compares under AVX-512's mask registers),
 * ARITH_CLONES for plain arithmetic */
#define FAST_CLONES __attribute__((target_clones("avx2", "default")))
#define ARITH_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define FAST_CLONES
#define ARITH_CLONES
#endif

enum { CHUNK = 64 };

#if defined(__GNUC__) && defined(__x86_64__) && !defined(FADEV_NO_FMA)
#include <immintrin.h>
#define X86 1
#else
#define X86 0
#endif

/* y = the fast rule of an ATT_RNE stage on n <= CHUNK values (rne_chunk512, rne_chunk); 1 if some value is
 * outside its range: above the largest finite value, inf, NaN, or below the normal range without subnormals.
 * Below the format's normal range (zeros included) with subnormals, nearest-even to a multiple of the quantum
 * q = 2^(emin - p + 1) is the FPU's own rounding of |x| + S, S = 1.5 * 2^52 q, an fp64 number whose last place
 * is q (|x| < 2^emin is far below S): ((|x| + S) - S) is |x| rounded to q, ties to even, exactly what
 * fadev_round_one's subnormal branch computes; the sign is put back. Formats without subnormals go to att_round. */
static double subnormal_shifter(const att_stage *st) {
    return st->fmt.subnormals ? ldexp(1.5, st->fmt.emin - st->fmt.precision + 1 + 52) : 0.0;
}

__attribute__((always_inline)) static inline double rne_one(const att_stage *st, double shifter, double x, int *bad) {
    uint64_t u = fadev_bits_of(x), a = u & 0x7FFFFFFFFFFFFFFFull;
    uint64_t r = (a + st->half_m1 + ((a >> st->shift) & 1)) & st->keep_mask;
    uint64_t below = fadev_bits_of((fadev_double_of(a) + shifter) - shifter);
    int is_below = a < st->lo_bits;
    *bad |= is_below ? shifter == 0.0 : (a - st->lo_bits > st->hi_bits - st->lo_bits) | (r > st->hi_bits);
    return fadev_double_of((is_below ? below : r) | (u ^ a));
}

#if X86
__attribute__((target("avx512f"))) static int rne_chunk512(const att_stage *st, const double *x, double *y, int64_t n) {
    const __m512i abs = _mm512_set1_epi64(0x7FFFFFFFFFFFFFFFll), lo = _mm512_set1_epi64((long long)st->lo_bits);
    const __m512i span = _mm512_set1_epi64((long long)(st->hi_bits - st->lo_bits));
    const __m512i hi = _mm512_set1_epi64((long long)st->hi_bits), half = _mm512_set1_epi64((long long)st->half_m1);
    const __m512i keep = _mm512_set1_epi64((long long)st->keep_mask), one = _mm512_set1_epi64(1);
    const __m128i shift = _mm_cvtsi32_si128(st->shift);
    const double shifter = subnormal_shifter(st);
    const __m512d sh = _mm512_set1_pd(shifter);
    const __mmask8 no_sub = shifter == 0.0 ? 0xFF : 0;
    __mmask8 bad = 0;
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m512i u = _mm512_loadu_si512(x + i), a = _mm512_and_si512(u, abs);
        __m512i r = _mm512_add_epi64(_mm512_add_epi64(a, half), _mm512_and_si512(_mm512_srl_epi64(a, shift), one));
        r = _mm512_and_si512(r, keep);
        __m512i below = _mm512_castpd_si512(_mm512_sub_pd(_mm512_add_pd(_mm512_castsi512_pd(a), sh), sh));
        __mmask8 is_below = _mm512_cmplt_epu64_mask(a, lo);
        bad |= (is_below & no_sub) |
               (~is_below & (_mm512_cmpgt_epu64_mask(_mm512_sub_epi64(a, lo), span) | _mm512_cmpgt_epu64_mask(r, hi)));
        r = _mm512_mask_mov_epi64(r, is_below, below);
        _mm512_storeu_si512(y + i, _mm512_or_si512(r, _mm512_andnot_si512(abs, u)));
    }
    int tail = 0;
    for (; i < n; i++) y[i] = rne_one(st, shifter, x[i], &tail);
    return bad != 0 || tail;
}

/* rne_chunk512's rule with AVX2, four lanes (GCC 12 compiles rne_chunk's loop to scalar code for AVX2: its unsigned
 * 64-bit compares have no AVX2 instruction). The compares here are signed, which gives the unsigned answers: a (an
 * absolute value), lo, hi and span are below 2^63; a - lo is below 2^63 wherever a >= lo, the lanes where it is
 * read; r is below 2^63 wherever a <= hi, and a lane with a > hi is out of range whatever r is. */
__attribute__((target("avx2"))) static int rne_chunk256(const att_stage *st, const double *x, double *y, int64_t n) {
    const __m256i abs = _mm256_set1_epi64x(0x7FFFFFFFFFFFFFFFll), lo = _mm256_set1_epi64x((long long)st->lo_bits);
    const __m256i span = _mm256_set1_epi64x((long long)(st->hi_bits - st->lo_bits));
    const __m256i hi = _mm256_set1_epi64x((long long)st->hi_bits), half = _mm256_set1_epi64x((long long)st->half_m1);
    const __m256i keep = _mm256_set1_epi64x((long long)st->keep_mask), one = _mm256_set1_epi64x(1);
    const __m128i shift = _mm_cvtsi32_si128(st->shift);
    const double shifter = subnormal_shifter(st);
    const __m256d sh = _mm256_set1_pd(shifter);
    const __m256i no_sub = _mm256_set1_epi64x(shifter == 0.0 ? -1 : 0);
    __m256i bad = _mm256_setzero_si256();
    int64_t i = 0;
    for (; i + 4 <= n; i += 4) {
        __m256i u = _mm256_loadu_si256((const __m256i *)(x + i)), a = _mm256_and_si256(u, abs);
        __m256i r = _mm256_add_epi64(_mm256_add_epi64(a, half), _mm256_and_si256(_mm256_srl_epi64(a, shift), one));
        r = _mm256_and_si256(r, keep);
        __m256i below = _mm256_castpd_si256(_mm256_sub_pd(_mm256_add_pd(_mm256_castsi256_pd(a), sh), sh));
        __m256i is_below = _mm256_cmpgt_epi64(lo, a);
        __m256i out = _mm256_or_si256(_mm256_cmpgt_epi64(_mm256_sub_epi64(a, lo), span), _mm256_cmpgt_epi64(r, hi));
        bad = _mm256_or_si256(bad, _mm256_or_si256(_mm256_and_si256(is_below, no_sub), _mm256_andnot_si256(is_below, out)));
        r = _mm256_castpd_si256(_mm256_blendv_pd(_mm256_castsi256_pd(r), _mm256_castsi256_pd(below),
                                                 _mm256_castsi256_pd(is_below)));
        _mm256_storeu_si256((__m256i *)(y + i), _mm256_or_si256(r, _mm256_andnot_si256(abs, u)));
    }
    int tail = 0;
    for (; i < n; i++) y[i] = rne_one(st, shifter, x[i], &tail);
    return !_mm256_testz_si256(bad, bad) || tail;
}
#endif

FAST_CLONES static int rne_chunk(const att_stage *st, const double *x, double *y, int64_t n) {
    const double shifter = subnormal_shifter(st);
    int bad = 0;
    for (int64_t i = 0; i < n; i++) y[i] = rne_one(st, shifter, x[i], &bad);
    return bad;
}

ARITH_CLONES static void f32_sub_n(const double *x, double m, double *y, int64_t n) {
    for (int64_t i = 0; i < n; i++) y[i] = (double)(float)(x[i] - m);
}

ARITH_CLONES static void f32_n(const double *x, double *y, int64_t n) {
    for (int64_t i = 0; i < n; i++) y[i] = (double)(float)x[i];
}

int att_round_n(const att_stage *st, const double *x, double *y, int64_t n) {
    int finite = 0;
    if (st->kind == ATT_EXACT) {
        if (x != y) memmove(y, x, (size_t)n * sizeof(double));
    } else if (st->kind == ATT_F32) {
        f32_n(x, y, n);
    } else if (st->kind == ATT_RNE) {
        double tmp[CHUNK];
        finite = 1; /* no chunk outside the range the vector rule covers: every result finite */
        for (int64_t i = 0; i < n; i += CHUNK) {
            const int64_t m = n - i < CHUNK ? n - i : CHUNK;
            double *out = x == y ? tmp : y + i; /* in place: through tmp, x is read again below */
#if X86
            const int bad = att_cpu_avx512() ? rne_chunk512(st, x + i, out, m)
                            : att_cpu_fma()  ? rne_chunk256(st, x + i, out, m)
                                             : rne_chunk(st, x + i, out, m);
#else
            const int bad = rne_chunk(st, x + i, out, m);
#endif
            if (bad)
                for (int64_t t = 0; t < m; t++) out[t] = att_round(st, x[i + t], 0, 0);
            finite &= !bad;
            if (out == tmp) memcpy(y + i, tmp, (size_t)m * sizeof(double));
        }
    } else {
        for (int64_t i = 0; i < n; i++) y[i] = att_round_general(st, x[i], 0, 0);
    }
    return finite;
}

/* y[i] = x[i] - m, x[i] * m, x[i] / m; z = x + y (fp64, no rounding; att_round_n follows). */
ARITH_CLONES void att_sub_n(const double *x, double m, double *y, int64_t n) {
    for (int64_t i = 0; i < n; i++) y[i] = x[i] - m;
}
ARITH_CLONES void att_scale_n(const double *x, double m, double *y, int64_t n) {
    for (int64_t i = 0; i < n; i++) y[i] = x[i] * m;
}
ARITH_CLONES void att_div_n(const double *x, double m, double *y, int64_t n) {
    for (int64_t i = 0; i < n; i++) y[i] = x[i] / m;
}

/* y[i] = R_fp32(c R_fp32(x[i])): the scores' scaling where the score stage is fp32 (nearest-even). */
ARITH_CLONES void att_f32_scale_n(const double *x, double c, double *y, int64_t n) {
    for (int64_t i = 0; i < n; i++) y[i] = (double)(float)(c * (double)(float)x[i]);
}

/* o[i] = R_fp32(R_fp32(f o[i]) + R_fp32(pv[i])): flash's O update where out_acc is fp32 (nearest-even). */
ARITH_CLONES void att_f32_update_n(double *o, double f, const double *pv, int64_t n) {
    for (int64_t i = 0; i < n; i++) o[i] = (double)(float)((double)(float)(f * o[i]) + (double)(float)pv[i]);
}

ARITH_CLONES static void f32_add_n(double *acc, const double *x, int64_t n) {
    for (int64_t i = 0; i < n; i++) acc[i] = (double)(float)(acc[i] + x[i]);
}

/* acc[i] = R_st(acc[i] + x[i]) (nearest-even or toward zero: no counters). */
void att_add_round_n(const att_stage *st, double *acc, const double *x, int64_t n) {
    if (st->kind == ATT_F32) {
        f32_add_n(acc, x, n);
    } else {
        att_add_n(acc, x, acc, n);
        att_round_n(st, acc, acc, n);
    }
}

/* u[i] = R_fp32(R_fp32(p[i]) R_fp32(R_fp32(dp[i]) - d)), then R_fp32(c u[i]) when `scaled`: the backward's dS
 * before R_ds where dp, dsoft and dsoft_p are fp32 (nearest-even), in one pass. */
ARITH_CLONES void att_ds_f32_n(const double *p, const double *dp, double d, int scaled, double c, double *u,
                               int64_t n) {
    for (int64_t i = 0; i < n; i++)
        u[i] = (double)(float)((double)(float)p[i] * (double)(float)((double)(float)dp[i] - d));
    if (scaled)
        for (int64_t i = 0; i < n; i++) u[i] = (double)(float)(c * u[i]);
}

ARITH_CLONES void att_to_float_f(const double *x, float *y, int64_t n) {
    for (int64_t i = 0; i < n; i++) y[i] = (float)x[i];
}

/* y[i] = (float)x[i]; 1 if all are finite. */
FAST_CLONES int att_to_float_n(const double *x, float *y, int64_t n) {
    int ok = 1;
    for (int64_t i = 0; i < n; i++) {
        y[i] = (float)x[i];
        ok &= __builtin_fabs(x[i]) <= 1.7976931348623157e308;
    }
    return ok;
}

ARITH_CLONES void att_add_n(const double *x, const double *y, double *z, int64_t n) {
    for (int64_t i = 0; i < n; i++) z[i] = x[i] + y[i];
}

ARITH_CLONES void att_mul_n(const double *x, const double *y, double *z, int64_t n) {
    for (int64_t i = 0; i < n; i++) z[i] = x[i] * y[i];
}

FAST_CLONES int att_finite_d(const double *x, int64_t n) {
    int ok = 1;
    for (int64_t i = 0; i < n; i++) ok &= __builtin_fabs(x[i]) <= 1.7976931348623157e308;
    return ok;
}

/* The running maximum m = att_max(m, s[j]) over j ascending (NaN propagates; of equal values the first
 * is kept, which only matters for the sign of a zero): a vector maximum where no NaN is seen and the
 * maximum is not zero (then the value is the answer whatever the order), else the sequential loop. */
typedef double v4d __attribute__((vector_size(32)));
typedef double v4du __attribute__((vector_size(32), aligned(8)));
typedef long long v4l __attribute__((vector_size(32)));
typedef unsigned long long v4u __attribute__((vector_size(32)));
typedef float v4f __attribute__((vector_size(16)));

FAST_CLONES static double vec_max(const double *s, int64_t n, int *nan) {
    const double ninf = -__builtin_inf();
    v4d m0 = {ninf, ninf, ninf, ninf}, m1 = m0;
    v4l bad = {0, 0, 0, 0};
    int64_t j = 0;
    for (; j + 8 <= n; j += 8) { /* two chains: the blend's latency is not the bound */
        v4d x = *(const v4du *)(s + j), y = *(const v4du *)(s + j + 4);
        v4l gx = x > m0, gy = y > m1;
        bad |= (x != x) | (y != y);
        m0 = (v4d)(((v4l)x & gx) | ((v4l)m0 & ~gx));
        m1 = (v4d)(((v4l)y & gy) | ((v4l)m1 & ~gy));
    }
    double m = ninf;
    int b = (bad[0] | bad[1] | bad[2] | bad[3]) != 0;
    for (int t = 0; t < 4; t++) m = m0[t] > m ? m0[t] : m, m = m1[t] > m ? m1[t] : m;
    for (; j < n; j++) {
        b |= s[j] != s[j];
        m = s[j] > m ? s[j] : m;
    }
    *nan = b;
    return m;
}

#if X86
__attribute__((target("avx512f"))) static double vec_max512(const double *s, int64_t n, int *nan) {
    __m512d m0 = _mm512_set1_pd(-__builtin_inf()), m1 = m0;
    __mmask8 bad = 0;
    int64_t j = 0;
    for (; j + 16 <= n; j += 16) {
        __m512d x = _mm512_loadu_pd(s + j), y = _mm512_loadu_pd(s + j + 8);
        bad |= _mm512_cmp_pd_mask(x, y, _CMP_UNORD_Q);
        m0 = _mm512_max_pd(m0, x), m1 = _mm512_max_pd(m1, y);
    }
    double m = _mm512_reduce_max_pd(_mm512_max_pd(m0, m1));
    int b = bad != 0;
    for (; j < n; j++) {
        b |= s[j] != s[j];
        m = s[j] > m ? s[j] : m;
    }
    *nan = b;
    return m;
}
#endif

double att_max_n(double m, const double *s, int64_t n) {
    int nan;
#if X86
    double mx = att_cpu_avx512() ? vec_max512(s, n, &nan) : vec_max(s, n, &nan);
#else
    double mx = vec_max(s, n, &nan);
#endif
    if (!nan && m == m && mx != 0) return m >= mx ? m : mx;
    for (int64_t j = 0; j < n; j++) m = att_max(m, s[j]);
    return m;
}

/* Row sums acc = R_sum(acc + e[j]), j ascending, of rows r < nr (nv[r] terms, row stride lde), into sum[r].
 * With an fp32 accumulator and terms that are fp32 values, the fp32 sum of two fp32 values is R_fp32 of
 * their fp64 sum (53 >= 2 * 24 + 2: the double rounding is innocuous), so the sums run in float, four rows
 * at a time over the keys they share. */
void att_row_sums(const att_stage *acc_st, int terms_f32, const double *e, int64_t lde, const int64_t *nv,
                  int64_t nr, double *sum) {
    int64_t r = 0;
    if (acc_st->kind == ATT_F32 && terms_f32) {
        for (; r + 8 <= nr; r += 8) { /* eight independent chains: the adds' latency is not the bound */
            int64_t common = nv[r];
            for (int x = 1; x < 8; x++) common = nv[r + x] < common ? nv[r + x] : common;
            float a[8] = {0, 0, 0, 0, 0, 0, 0, 0};
            const double *e0 = e + r * lde;
            for (int64_t j = 0; j < common; j++)
                for (int x = 0; x < 8; x++) a[x] += (float)e0[x * lde + j];
            for (int x = 0; x < 8; x++) {
                for (int64_t j = common; j < nv[r + x]; j++) a[x] += (float)e0[x * lde + j];
                sum[r + x] = a[x];
            }
        }
        for (; r < nr; r++) {
            float a = 0;
            for (int64_t j = 0; j < nv[r]; j++) a += (float)e[r * lde + j];
            sum[r] = a;
        }
        return;
    }
    for (; r < nr; r++) {
        double a = 0;
        for (int64_t j = 0; j < nv[r]; j++) a = att_round(acc_st, a + e[r * lde + j], 0, 0);
        sum[r] = a;
    }
}

/* The same for dot products: acc = R_acc(acc + a[r][j] b[r][j]), j < nv[r] ascending, from 0. With an fp32
 * accumulator: the fp64 product is exact when the factors' precisions add up to <= 53 bits and it does not
 * underflow (true for values of formats inside fp32), so (double)(float)(acc + a b) is the spec's event,
 * computed for four rows side by side; otherwise the events one by one. */
void att_row_dots(const att_stage *acc_st, const double *a, const double *b, int64_t ld, const int64_t *nv,
                  int64_t nr, double *out) {
    int64_t r = 0;
    if (acc_st->kind == ATT_F32) {
        for (; r + 4 <= nr; r += 4) {
            const double *a0 = a + r * ld, *b0 = b + r * ld;
            int64_t common = nv[r];
            for (int x = 1; x < 4; x++) common = nv[r + x] < common ? nv[r + x] : common;
            /* lanes = rows, in explicit vectors: GCC 12 was seen to drop the float conversion when it combined
             * four scalar chains of this kind into one vector by itself */
            v4d acc = {0, 0, 0, 0};
            for (int64_t j = 0; j < common; j++) {
                v4d x = {a0[j], a0[ld + j], a0[2 * ld + j], a0[3 * ld + j]};
                v4d y = {b0[j], b0[ld + j], b0[2 * ld + j], b0[3 * ld + j]};
                acc = __builtin_convertvector(__builtin_convertvector(acc + x * y, v4f), v4d);
            }
            double s0 = acc[0], s1 = acc[1], s2 = acc[2], s3 = acc[3];
            double sums[4] = {s0, s1, s2, s3};
            for (int x = 0; x < 4; x++) {
                for (int64_t j = common; j < nv[r + x]; j++)
                    sums[x] = (double)(float)(sums[x] + a0[x * ld + j] * b0[x * ld + j]);
                out[r + x] = sums[x];
            }
        }
    }
    for (; r < nr; r++) {
        double acc = 0;
        for (int64_t j = 0; j < nv[r]; j++) acc = att_round(acc_st, acc + a[r * ld + j] * b[r * ld + j], 0, 0);
        out[r] = acc;
    }
}

/* e[j] = R_softmax(E(R_softmax(s[j] - m))) for j < n, in place (E = exp2 or exp). */
void att_exp_row(const att_ctx *cx, int exp2_form, double m, double *s, int64_t n) {
    const att_stage *sm = &cx->plan.softmax;
    if (sm->kind == ATT_F32) {
        f32_sub_n(s, m, s, n);
    } else {
        att_sub_n(s, m, s, n);
        att_round_n(sm, s, s, n);
    }
    att_exp_round_n(sm, exp2_form, s, s, n);
}

/* ------------------------------------------------------------------ R(E(x)) without libm where it cannot matter
 *
 * y = R_st(E(x)), E = exp or exp2 (libm's, the spec's), for a nearest-even stage of precision p <= 24 (ATT_F32,
 * ATT_RNE). A vector approximation a of E(x) is computed first: E(x) = 2^n e^t, n an integer, |t| <= ln2/2
 * (exp2: n = rint(x), t = (x - n) ln 2; exp: n = rint(x log2 e), t = (x - n ln2_hi) - n ln2_lo, Cody-Waite with
 * ln2_hi's 32 significant bits making n ln2_hi exact), e^t by its Taylor polynomial of degree 10 (truncation
 * |t|^11 / 11! < 2^-42 for |t| <= 0.347, i.e. under 2^11 units of the last place of fp64, "ulps"; the
 * polynomial's rounding adds a few), 2^n put into the exponent. Measured against glibc over every fp32 x of
 * [-150, 0] (exp2) and [-104, 0] (exp), exhaustively: at most 1901 ulps for each (docs/numerics.md). libm's E is
 * within 1 ulp of the exact value. So where the 53 - p bits that R_st drops from a lie more than EXP_MARGIN =
 * 2^16 ulps from the halfway point (and a is in the format's normal range, after rounding too), a, the exact
 * E(x) and libm's E(x) all lie strictly on the same side of the same rounding midpoint, between the same two
 * neighbours: R_st(libm E(x)) = R_st(a), which is what is returned. Every other lane (2^-12 of them at fp32,
 * 2^-28 at bf16, for spread-out inputs; x outside [-700, 700], NaN, results below the normal range or
 * overflowing) calls libm and att_round: the spec's own path. */

enum { EXP_MARGIN = 1 << 16 };

/* The approximation of E(v), |v| <= 700 (top comment), four lanes at a time. */
__attribute__((always_inline)) static inline void exp_approx(int exp2_form, const v4d *vp, v4d *out) {
    const v4d v = *vp;
    const double shifter = 0x1.8p52, log2e = 0x1.71547652b82fep+0, ln2 = 0x1.62e42fefa39efp-1;
    const double ln2_hi = 0x1.62e42feep-1, ln2_lo = 0x1.a39ef35793c76p-33;
    v4d nf = ((exp2_form ? v : v * log2e) + shifter) - shifter;
    v4d t = exp2_form ? (v - nf) * ln2 : (v - nf * ln2_hi) - nf * ln2_lo;
    v4d p = t * 0x1.27e4fb7789f5cp-22 + 0x1.71de3a556c734p-19;
    p = p * t + 0x1.a01a01a01a01ap-16;
    p = p * t + 0x1.a01a01a01a01ap-13;
    p = p * t + 0x1.6c16c16c16c17p-10;
    p = p * t + 0x1.1111111111111p-7;
    p = p * t + 0x1.5555555555555p-5;
    p = p * t + 0x1.5555555555555p-3;
    p = p * t + 0x1.0p-1;
    p = p * t + 1.0;
    p = p * t + 1.0;
    /* 2^n: n = the integer in the low bits of nf + shifter; |n| <= 1010, so 1023 + n is a normal exponent */
    v4u nbits = (v4u)(nf + shifter) - fadev_bits_of(shifter);
    *out = p * (v4d)((nbits + 1023ull) << 52);
}

/* y[i] = R_st(exp_approx(x[i])) and ok[i] != 0 where that is R_st(libm's E(x[i])) for sure; n a multiple of 4. */
__attribute__((always_inline)) static inline void exp_chunk(const att_stage *st, int exp2_form, const double *x,
                                                            double *y, long long *ok, int64_t n) {
    const long long mask = (1ll << st->shift) - 1, halfway = 1ll << (st->shift - 1);
    const long long lo = (long long)st->lo_bits, hi = (long long)st->hi_bits, half_m1 = (long long)st->half_m1;
    const long long keep = (long long)st->keep_mask;
    const int shift = st->shift;
    for (int64_t i = 0; i < n; i += 4) {
        /* every integer compared below is below 2^63, so the signed compares (which AVX2 has) are exact */
        v4d v = *(const v4du *)(x + i);
        v4l inside = (v4l)((v4u)v & 0x7FFFFFFFFFFFFFFFull) <= (long long)fadev_bits_of(700.0); /* |v| <= 700 */
        v = (v4d)((v4l)v & inside);
        v4d approx;
        exp_approx(exp2_form, &v, &approx);
        v4l u = (v4l)approx, d = u & mask;
        v4l dist = d - halfway;
        dist = (dist ^ (dist >> 63)) - (dist >> 63); /* |d - halfway| */
        v4l r = (u + half_m1 + ((u >> shift) & 1)) & keep;
        v4l good = inside & (dist > EXP_MARGIN) & (u >= lo) & (u <= hi) & (r <= hi);
        *(v4l *)(ok + i) = good;
        *(v4du *)(y + i) = (v4d)r;
    }
}

FAST_CLONES static void exp2_chunk(const att_stage *st, const double *x, double *y, long long *ok, int64_t n) {
    exp_chunk(st, 1, x, y, ok, n);
}
FAST_CLONES static void expe_chunk(const att_stage *st, const double *x, double *y, long long *ok, int64_t n) {
    exp_chunk(st, 0, x, y, ok, n);
}

#if X86
/* exp_chunk with AVX-512F, eight lanes (where att_cpu_avx512()); the polynomial fused (FMA is only more
 * accurate; any approximation within the bound gives the same answers, see the top comment). */
__attribute__((target("avx512f"))) static void exp_chunk512(const att_stage *st, int exp2_form, const double *x,
                                                            double *y, long long *ok, int64_t n) {
    static const double c[] = {0x1.27e4fb7789f5cp-22, 0x1.71de3a556c734p-19, 0x1.a01a01a01a01ap-16,
                                0x1.a01a01a01a01ap-13, 0x1.6c16c16c16c17p-10, 0x1.1111111111111p-7,
                                0x1.5555555555555p-5,  0x1.5555555555555p-3,  0x1.0p-1, 1.0, 1.0};
    const __m512i abs = _mm512_set1_epi64(0x7FFFFFFFFFFFFFFFll);
    const __m512i lim = _mm512_set1_epi64((long long)fadev_bits_of(700.0));
    const __m512d shifter = _mm512_set1_pd(0x1.8p52);
    const __m512i mask = _mm512_set1_epi64((1ll << st->shift) - 1), halfway = _mm512_set1_epi64(1ll << (st->shift - 1));
    const __m512i lo = _mm512_set1_epi64((long long)st->lo_bits), hi = _mm512_set1_epi64((long long)st->hi_bits);
    const __m512i half_m1 = _mm512_set1_epi64((long long)st->half_m1);
    const __m512i keep = _mm512_set1_epi64((long long)st->keep_mask);
    const __m512i one = _mm512_set1_epi64(1), margin = _mm512_set1_epi64(EXP_MARGIN);
    const __m128i shift = _mm_cvtsi32_si128(st->shift);
    for (int64_t i = 0; i < n; i += 8) {
        __m512d v = _mm512_loadu_pd(x + i);
        __mmask8 inside = _mm512_cmple_epi64_mask(_mm512_and_si512(_mm512_castpd_si512(v), abs), lim);
        v = _mm512_maskz_mov_pd(inside, v);
        __m512d w = exp2_form ? v : _mm512_mul_pd(v, _mm512_set1_pd(0x1.71547652b82fep+0));
        __m512d nf = _mm512_sub_pd(_mm512_add_pd(w, shifter), shifter), t;
        if (exp2_form) {
            t = _mm512_mul_pd(_mm512_sub_pd(v, nf), _mm512_set1_pd(0x1.62e42fefa39efp-1));
        } else {
            t = _mm512_sub_pd(v, _mm512_mul_pd(nf, _mm512_set1_pd(0x1.62e42feep-1)));
            t = _mm512_sub_pd(t, _mm512_mul_pd(nf, _mm512_set1_pd(0x1.a39ef35793c76p-33)));
        }
        __m512d p = _mm512_set1_pd(c[0]);
        for (int k = 1; k < 11; k++) p = _mm512_fmadd_pd(p, t, _mm512_set1_pd(c[k]));
        __m512i nbits = _mm512_sub_epi64(_mm512_castpd_si512(_mm512_add_pd(nf, shifter)), _mm512_castpd_si512(shifter));
        __m512i scale = _mm512_slli_epi64(_mm512_add_epi64(nbits, _mm512_set1_epi64(1023)), 52);
        __m512i u = _mm512_castpd_si512(_mm512_mul_pd(p, _mm512_castsi512_pd(scale)));
        __m512i dist = _mm512_abs_epi64(_mm512_sub_epi64(_mm512_and_si512(u, mask), halfway));
        __m512i r = _mm512_add_epi64(_mm512_add_epi64(u, half_m1), _mm512_and_si512(_mm512_srl_epi64(u, shift), one));
        r = _mm512_and_si512(r, keep);
        __mmask8 good = inside & _mm512_cmpgt_epi64_mask(dist, margin) & _mm512_cmpge_epi64_mask(u, lo) &
                        _mm512_cmple_epi64_mask(u, hi) & _mm512_cmple_epi64_mask(r, hi);
        _mm512_storeu_si512(ok + i, _mm512_maskz_mov_epi64(good, _mm512_set1_epi64(-1)));
        _mm512_storeu_si512(y + i, r);
    }
}
#endif

void att_exp_round_n(const att_stage *st, int exp2_form, const double *x, double *y, int64_t n) {
    if ((st->kind != ATT_F32 && st->kind != ATT_RNE) || st->shift < 29) {
        for (int64_t i = 0; i < n; i++) y[i] = exp2_form ? exp2(x[i]) : exp(x[i]);
        att_round_n(st, y, y, n);
        return;
    }
    double tmp[CHUNK], in[CHUNK];
    const int avx512 = att_cpu_avx512();
    long long ok[CHUNK] __attribute__((aligned(64)));
    for (int64_t i = 0; i < n; i += CHUNK) {
        const int64_t m = n - i < CHUNK ? n - i : CHUNK, m4 = (m + 7) & ~(int64_t)7;
        const double *src = x + i;
        if (m4 != m) { /* a last partial group of lanes: from a copy padded with zeros */
            memcpy(in, src, (size_t)m * sizeof(double));
            memset(in + m, 0, (size_t)(m4 - m) * sizeof(double));
            src = in;
        }
#if X86
        if (avx512) exp_chunk512(st, exp2_form, src, tmp, ok, m4);
        else
#endif
            (exp2_form ? exp2_chunk : expe_chunk)(st, src, tmp, ok, m4);
        long long all = -1;
        for (int64_t t = 0; t < m; t++) all &= ok[t];
        if (!all) /* rare: some lane needs libm */
            for (int64_t t = 0; t < m; t++)
                if (!ok[t]) tmp[t] = att_round(st, exp2_form ? exp2(x[i + t]) : exp(x[i + t]), 0, 0);
        memcpy(y + i, tmp, (size_t)m * sizeof(double));
    }
}
