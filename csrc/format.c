/* Formats: construction, bit layouts, and array rounding (the scalar rule lives in round.h, shared
 * with the CUDA kernels). Arrays are split into fixed 32768-element tasks so any thread count gives
 * the same bits; the stochastic generator is keyed by the element's global index, not the task. */
#include <math.h>

#include "fadev.h"
#include "round.h"

enum { ROUND_TASK = 32768 };

static const char *const status_strings[FADEV_STATUS_COUNT] = {
    "ok",
    "invalid format parameters",
    "invalid rounding mode",
    "invalid argument",
    "shape mismatch",
    "size overflow",
    "out of memory",
    "could not start a worker thread",
    "format has no bit encoding of that width",
    "CUDA runtime error",
    "CUDA not available",
};

const char *fadev_status_string(fadev_status status) {
    if ((int)status < 0 || status >= FADEV_STATUS_COUNT) return "unknown status";
    return status_strings[status];
}

fadev_status fadev_format_make(int precision, int emin, int emax, int subnormals, int has_inf,
                               int overflow, double largest, fadev_format *fmt) {
    if (precision < 1 || precision > 53) return FADEV_ERR_INVALID_FORMAT;
    if (emin > emax || emin < -1022 || emax > 1023) return FADEV_ERR_INVALID_FORMAT;
    if (emin - precision + 1 < -1074) return FADEV_ERR_INVALID_FORMAT;
    if (overflow < FADEV_OVERFLOW_INF || overflow > FADEV_OVERFLOW_SATURATE) return FADEV_ERR_INVALID_FORMAT;
    if (overflow == FADEV_OVERFLOW_INF && !has_inf) return FADEV_ERR_INVALID_FORMAT;
    double full = ldexp(2.0 - ldexp(1.0, 1 - precision), emax);
    if (!(largest > 0)) largest = full;
    if (largest > full || largest < ldexp(1.0, emax) || isinf(largest)) return FADEV_ERR_INVALID_FORMAT;
    fmt->precision = precision;
    fmt->emin = emin;
    fmt->emax = emax;
    fmt->subnormals = subnormals ? 1 : 0;
    fmt->has_inf = has_inf ? 1 : 0;
    fmt->overflow = overflow;
    fmt->largest = largest;
    /* `largest` must itself be a value of the format */
    if (fadev_round_one(largest, fmt, FADEV_ROUND_NEAREST_EVEN, 0) != largest) return FADEV_ERR_INVALID_FORMAT;
    return FADEV_OK;
}

fadev_status fadev_format_layout(const fadev_format *fmt, int *exponent_bits, int *total_bits) {
    int bias = 1 - fmt->emin;
    long top_field = (long)fmt->emax + bias + (fmt->has_inf ? 1 : 0); /* inf/NaN take their own field */
    int k = 1;
    while ((1L << k) - 1 < top_field) k++;
    *exponent_bits = k;
    *total_bits = 1 + k + fmt->precision - 1;
    return FADEV_OK;
}

static int valid_mode(int mode) {
    return mode == FADEV_ROUND_NEAREST_EVEN || mode == FADEV_ROUND_TOWARD_ZERO || mode == FADEV_ROUND_STOCHASTIC;
}

typedef struct round_job {
    const double *x64;
    const float *x32;
    double *out;
    size_t n;
    const fadev_format *fmt;
    int mode;
    uint64_t seed, stream, index_offset;
} round_job;

static fadev_status round_task(void *ctx, size_t task) {
    const round_job *job = (const round_job *)ctx;
    size_t begin = task * ROUND_TASK;
    size_t end = begin + ROUND_TASK < job->n ? begin + ROUND_TASK : job->n;
    const fadev_format fmt = *job->fmt;
    const int mode = job->mode;
    if (mode == FADEV_ROUND_STOCHASTIC) {
        for (size_t i = begin; i < end; i++) {
            double x = job->x64 ? job->x64[i] : (double)job->x32[i];
            uint64_t r = fadev_random53(job->seed, job->stream, job->index_offset + i);
            job->out[i] = fadev_round_one(x, &fmt, mode, r);
        }
    } else if (job->x64) {
        for (size_t i = begin; i < end; i++) job->out[i] = fadev_round_one(job->x64[i], &fmt, mode, 0);
    } else {
        for (size_t i = begin; i < end; i++) job->out[i] = fadev_round_one((double)job->x32[i], &fmt, mode, 0);
    }
    return FADEV_OK;
}

static fadev_status round_any(const double *x64, const float *x32, double *out, size_t n, const fadev_format *fmt,
                              int mode, uint64_t seed, uint64_t stream, uint64_t index_offset) {
    if (!valid_mode(mode)) return FADEV_ERR_INVALID_MODE;
    round_job job = {x64, x32, out, n, fmt, mode, seed, stream, index_offset};
    return fadev_parallel_for((n + ROUND_TASK - 1) / ROUND_TASK, round_task, &job);
}

fadev_status fadev_round_f64(const double *x, double *out, size_t n, const fadev_format *fmt, int mode,
                             uint64_t seed, uint64_t stream, uint64_t index_offset) {
    return round_any(x, NULL, out, n, fmt, mode, seed, stream, index_offset);
}

fadev_status fadev_round_f32(const float *x, double *out, size_t n, const fadev_format *fmt, int mode,
                             uint64_t seed, uint64_t stream, uint64_t index_offset) {
    return round_any(NULL, x, out, n, fmt, mode, seed, stream, index_offset);
}

/* --- bit patterns: sign | exponent field (bias 1 - emin) | precision - 1 fraction bits --- */

static uint64_t encode_one(double v, const fadev_format *f, int exponent_bits) {
    int frac_bits = f->precision - 1;
    uint64_t u = fadev_bits_of(v);
    uint64_t sign = (u >> 63) << (exponent_bits + frac_bits);
    uint64_t all_ones_field = ((1ull << exponent_bits) - 1) << frac_bits;
    if (isnan(v)) {
        /* quiet NaN: top fraction bit (IEEE formats); all ones (formats without inf, e.g. E4M3FN) */
        uint64_t frac = f->has_inf ? (frac_bits ? 1ull << (frac_bits - 1) : 0) : (1ull << frac_bits) - 1;
        return sign | all_ones_field | frac;
    }
    if (isinf(v)) return sign | all_ones_field;
    double a = fabs(v);
    if (a == 0) return sign;
    int e;
    double m = frexp(a, &e); /* a = m * 2^e, 0.5 <= m < 1 */
    e -= 1;
    if (e < f->emin) { /* subnormal: fraction = a / 2^(emin - p + 1) */
        return sign | (uint64_t)ldexp(a, frac_bits - f->emin);
    }
    uint64_t field = (uint64_t)(e + 1 - f->emin);
    uint64_t frac = (uint64_t)ldexp(2.0 * m - 1.0, frac_bits);
    return sign | (field << frac_bits) | frac;
}

static double decode_one(uint64_t b, const fadev_format *f, int exponent_bits) {
    int frac_bits = f->precision - 1;
    uint64_t frac = b & ((1ull << frac_bits) - 1);
    uint64_t field = (b >> frac_bits) & ((1ull << exponent_bits) - 1);
    int negative = (int)((b >> (frac_bits + exponent_bits)) & 1);
    double v;
    if (f->has_inf && field == (1ull << exponent_bits) - 1) {
        v = frac ? NAN : INFINITY;
    } else if (field == 0) {
        v = f->subnormals ? ldexp((double)frac, f->emin - frac_bits) : (frac ? NAN : 0.0);
    } else {
        v = ldexp(1.0 + ldexp((double)frac, -frac_bits), (int)field - 1 + f->emin);
        if (v > f->largest) v = NAN; /* codes above the largest finite (E4M3FN's S.1111.111) */
    }
    return negative ? -v : v;
}

static fadev_status check_width(const fadev_format *fmt, int width, int *exponent_bits) {
    int total;
    if (width != 1 && width != 2 && width != 4 && width != 8) return FADEV_ERR_INVALID_ARGUMENT;
    fadev_format_layout(fmt, exponent_bits, &total);
    if (total > 8 * width) return FADEV_ERR_NOT_REPRESENTABLE;
    return FADEV_OK;
}

fadev_status fadev_to_bits(const double *x, void *bits, int width, size_t n, const fadev_format *fmt) {
    int k;
    fadev_status st = check_width(fmt, width, &k);
    if (st != FADEV_OK) return st;
    for (size_t i = 0; i < n; i++) {
        uint64_t b = encode_one(fadev_round_one(x[i], fmt, FADEV_ROUND_NEAREST_EVEN, 0), fmt, k);
        switch (width) {
        case 1: ((uint8_t *)bits)[i] = (uint8_t)b; break;
        case 2: ((uint16_t *)bits)[i] = (uint16_t)b; break;
        case 4: ((uint32_t *)bits)[i] = (uint32_t)b; break;
        default: ((uint64_t *)bits)[i] = b; break;
        }
    }
    return FADEV_OK;
}

fadev_status fadev_from_bits(const void *bits, int width, double *out, size_t n, const fadev_format *fmt) {
    int k;
    fadev_status st = check_width(fmt, width, &k);
    if (st != FADEV_OK) return st;
    for (size_t i = 0; i < n; i++) {
        uint64_t b;
        switch (width) {
        case 1: b = ((const uint8_t *)bits)[i]; break;
        case 2: b = ((const uint16_t *)bits)[i]; break;
        case 4: b = ((const uint32_t *)bits)[i]; break;
        default: b = ((const uint64_t *)bits)[i]; break;
        }
        out[i] = decode_one(b, fmt, k);
    }
    return FADEV_OK;
}

fadev_status fadev_count_representable(const double *x, size_t n, const fadev_format *fmt, size_t *count) {
    size_t c = 0;
    for (size_t i = 0; i < n; i++) {
        double r = fadev_round_one(x[i], fmt, FADEV_ROUND_NEAREST_EVEN, 0);
        c += (r == x[i]) || (isnan(r) && isnan(x[i]));
    }
    *count = c;
    return FADEV_OK;
}
