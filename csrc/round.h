/* Scalar rounding of a float64 value to a fadev_format, shared by the C core and the CUDA kernels
 * (same source, so GPU and CPU round bit-identically).
 *
 * A value x = M * 2^(E-1075) (M the 53-bit significand, E the biased float64 exponent) is rounded to
 * a multiple of the target quantum 2^q, q = max(e, emin) - p + 1 (e the unbiased exponent of x), i.e.
 * `shift` = q - (E - 1075) low bits of M are dropped:
 *   nearest-even: add half a quantum minus one plus the kept lsb, clear the dropped bits;
 *   toward zero:  clear the dropped bits;
 *   stochastic:   round the magnitude up with probability (dropped bits) / 2^shift, the random
 *                 number being the top 53 bits of Philox4x32-10(counter, key).
 * In the target's normal range the carry out of the fraction runs into the float64 exponent field,
 * which is exactly the right next binade; below 2^emin the significand is rounded explicitly.
 * Magnitudes that end up above fmt->largest follow fmt->overflow (toward zero: clamp, as IEEE). */
#ifndef FADEV_ROUND_H
#define FADEV_ROUND_H

#include <stdint.h>
#include <string.h>

#include "fadev.h"

#ifdef __CUDACC__
#define FADEV_HD __host__ __device__ __forceinline__
#else
#define FADEV_HD static inline
#endif

FADEV_HD uint64_t fadev_bits_of(double x) {
#ifdef __CUDA_ARCH__
    return (uint64_t)__double_as_longlong(x);
#else
    uint64_t u;
    memcpy(&u, &x, sizeof u);
    return u;
#endif
}

FADEV_HD double fadev_double_of(uint64_t u) {
#ifdef __CUDA_ARCH__
    return __longlong_as_double((long long)u);
#else
    double x;
    memcpy(&x, &u, sizeof x);
    return x;
#endif
}

/* Philox4x32-10 (Salmon et al., SC'11): counter c[4], key k[2] -> 4 random 32-bit words. */
FADEV_HD void fadev_philox4x32(uint32_t c[4], uint32_t k0, uint32_t k1) {
    for (int round = 0; round < 10; round++) {
        uint64_t p0 = (uint64_t)0xD2511F53u * c[0];
        uint64_t p1 = (uint64_t)0xCD9E8D57u * c[2];
        uint32_t n0 = (uint32_t)(p1 >> 32) ^ c[1] ^ k0;
        uint32_t n2 = (uint32_t)(p0 >> 32) ^ c[3] ^ k1;
        c[0] = n0;
        c[1] = (uint32_t)p1;
        c[2] = n2;
        c[3] = (uint32_t)p0;
        k0 += 0x9E3779B9u;
        k1 += 0xBB67AE85u;
    }
}

/* 53 random bits for element `index` of stream `stream` under `seed`, as an integer in [0, 2^53). */
FADEV_HD uint64_t fadev_random53(uint64_t seed, uint64_t stream, uint64_t index) {
    uint32_t c[4] = {(uint32_t)index, (uint32_t)(index >> 32), (uint32_t)stream, (uint32_t)(stream >> 32)};
    fadev_philox4x32(c, (uint32_t)seed, (uint32_t)(seed >> 32));
    return (((uint64_t)c[0] << 32) | c[1]) >> 11;
}

/* What an overflowing magnitude becomes, with the sign bit of the input. */
FADEV_HD double fadev_overflow_value(const fadev_format *f, uint64_t sign, int mode) {
    if (f->overflow == FADEV_OVERFLOW_SATURATE || mode == FADEV_ROUND_TOWARD_ZERO)
        return fadev_double_of(fadev_bits_of(f->largest) | sign);
    if (f->overflow == FADEV_OVERFLOW_NAN)
        return fadev_double_of(0x7FF8000000000000ull | sign);
    return fadev_double_of(0x7FF0000000000000ull | sign);
}

/* 1 if a magnitude whose `shift` dropped bits are `dropped` rounds up under stochastic rounding:
 * P(up) = dropped / 2^shift, resolved to 2^-53 by comparing against 53 random bits. */
FADEV_HD int fadev_stochastic_up(uint64_t dropped, int shift, uint64_t random53) {
    if (shift <= 53) return (random53 >> (53 - shift)) + dropped >= (1ull << shift);
    if (shift - 53 >= 64) return 0;
    return random53 < (dropped >> (shift - 53));
}

/* Round x to format f. `random53` is used only by FADEV_ROUND_STOCHASTIC (a value in [0, 2^53)). */
FADEV_HD double fadev_round_one(double x, const fadev_format *f, int mode, uint64_t random53) {
    uint64_t u = fadev_bits_of(x);
    uint64_t sign = u & 0x8000000000000000ull;
    uint64_t a = u ^ sign;
    if (a >= 0x7FF0000000000000ull) {
        if (a > 0x7FF0000000000000ull || f->has_inf) return x; /* NaN stays NaN; inf stays inf */
        return f->overflow == FADEV_OVERFLOW_SATURATE ? fadev_double_of(fadev_bits_of(f->largest) | sign)
                                                      : fadev_double_of(0x7FF8000000000000ull | sign);
    }
    int biased = (int)(a >> 52);
    int e = (biased ? biased : 1) - 1023;
    uint64_t r;
    if (biased && e >= f->emin) {
        /* normal in the target: drop 53 - p bits of the float64 encoding; a carry out of the
         * fraction runs into the exponent field, which is the correct next binade */
        int shift = 53 - f->precision;
        if (shift == 0) {
            r = a;
        } else {
            uint64_t mask = (1ull << shift) - 1;
            uint64_t dropped = a & mask;
            r = a & ~mask;
            int up = 0;
            if (mode == FADEV_ROUND_NEAREST_EVEN) {
                uint64_t half = 1ull << (shift - 1);
                /* the kept significand's last bit; with p = 1 that is the implicit 1 (odd), not the
                 * exponent's low bit, so a tie goes up, as in the subnormal branch below */
                uint64_t odd = f->precision > 1 ? (r >> shift) & 1 : 1;
                up = dropped > half || (dropped == half && odd);
            } else if (mode == FADEV_ROUND_STOCHASTIC) {
                up = fadev_stochastic_up(dropped, shift, random53);
            }
            r += (uint64_t)up << shift;
        }
    } else {
        /* below the target's smallest normal: quantum 2^(emin - p + 1) with subnormals, 2^emin
         * without; round the explicit significand m (value = m * 2^(e - 52)) to it */
        uint64_t m = biased ? (a & 0x000FFFFFFFFFFFFFull) | 0x0010000000000000ull : a;
        int shift = f->emin - e + (f->subnormals ? 53 - f->precision : 52);
        uint64_t kept = 0;
        int up = 0;
        if (shift == 0) {
            kept = m; /* float64 subnormals into a format as wide as float64 */
        } else if (shift < 64) {
            uint64_t dropped = m & ((1ull << shift) - 1);
            kept = m >> shift;
            if (mode == FADEV_ROUND_NEAREST_EVEN) {
                uint64_t half = 1ull << (shift - 1);
                up = dropped > half || (dropped == half && (kept & 1));
            } else if (mode == FADEV_ROUND_STOCHASTIC) {
                up = fadev_stochastic_up(dropped, shift, random53);
            }
        } else if (mode == FADEV_ROUND_STOCHASTIC) {
            up = fadev_stochastic_up(m, shift, random53);
        }
        kept += (uint64_t)up;
        int q = e - 52 + shift; /* exponent of the quantum; >= -1074 for every valid format */
        double scale = q >= -1022 ? fadev_double_of((uint64_t)(q + 1023) << 52)
                                  : fadev_double_of(1ull << (q + 1074));
        r = fadev_bits_of((double)kept * scale);
    }
    if (fadev_double_of(r) > f->largest) return fadev_overflow_value(f, sign, mode);
    return fadev_double_of(r | sign);
}

#endif /* FADEV_ROUND_H */
