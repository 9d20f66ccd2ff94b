/* Exhaustive check of the CPU kernels' exp path (csrc/fast.c, att_exp_round_n) against libm: for every fp32 x in
 * [-160, 0] (exp2) and [-112, 0] (exp), R_fmt(the vector path) must equal R_fmt(libm's exp2 / exp) for fmt = fp32
 * and bf16 (nearest-even), the stages the fa2, paper and naive presets run it for. The softmax's x are values of
 * those formats; wider ranges only reach results below the formats' normal range, which the path hands to libm.
 * Prints the count of differing results (0 expected) and the largest distance, in fp64 ulps, between the
 * approximation and libm (docs/numerics.md bounds it by 2^11; the path's margin is 2^16).
 *
 *   gcc -O2 -ffp-contract=off -Icsrc benchmarks/exhaustive_exp.c csrc/stage.c csrc/format.c csrc/matmul.c \
 *       csrc/parallel.c -lm -lpthread -o /tmp/exhaustive_exp && /tmp/exhaustive_exp
 *
 * (about a minute per line on one core). */
#include <stdio.h>
#include <stdlib.h>

#include "../csrc/fast.c"

static void check(int exp2_form, int precision) {
    fadev_format f;
    double largest = precision == 24 ? 0x1.fffffep127 : 0x1.fep127;
    if (fadev_format_make(precision, -126, 127, 1, 1, FADEV_OVERFLOW_INF, largest, &f) != FADEV_OK) exit(2);
    fadev_policy pol;
    memset(&pol, 0, sizeof pol);
    pol.rounding = FADEV_ROUND_NEAREST_EVEN;
    const att_stage st = att_make_stage(&f, &pol);
    const float lo = exp2_form ? -160.0f : -112.0f;
    uint32_t end;
    memcpy(&end, &lo, 4);
    enum { B = 4096 };
    static double x[B], y[B];
    unsigned long long n = 0, bad = 0, worst = 0;
    for (uint64_t b = 0x80000000u; b <= end; b += B) {
        int m = 0;
        for (; m < B && b + m <= end; m++) {
            uint32_t bits = (uint32_t)(b + m);
            float v;
            memcpy(&v, &bits, 4);
            x[m] = v;
        }
        att_exp_round_n(&st, exp2_form, x, y, m);
        for (int t = 0; t < m; t += 4) {
            v4d v = {x[t], x[t + 1 < m ? t + 1 : t], x[t + 2 < m ? t + 2 : t], x[t + 3 < m ? t + 3 : t]}, a;
            exp_approx(exp2_form, &v, &a);
            for (int l = 0; l < 4 && t + l < m; l++) {
                double ref = exp2_form ? exp2(v[l]) : exp(v[l]);
                long long d = (long long)fadev_bits_of(a[l]) - (long long)fadev_bits_of(ref);
                unsigned long long ad = (unsigned long long)(d < 0 ? -d : d);
                if (ref >= 0x1p-1022 && ad > worst) worst = ad;
            }
        }
        for (int t = 0; t < m; t++) {
            double want = att_round(&st, exp2_form ? exp2(x[t]) : exp(x[t]), 0, 0);
            if (fadev_bits_of(want) != fadev_bits_of(y[t]) && bad++ < 5)
                printf("  x %a: vector path %a, libm %a\n", x[t], y[t], want);
        }
        n += (unsigned long long)m;
    }
    printf("%s into %s (AVX-512 path %s): %llu fp32 inputs in [%g, 0], %llu differ; approximation within %llu ulps\n",
           exp2_form ? "exp2" : "exp", precision == 24 ? "fp32" : "bf16", att_cpu_avx512() ? "on" : "off", n, lo, bad,
           worst);
}

int main(void) {
    check(1, 24), check(0, 24), check(1, 8), check(0, 8);
    return 0;
}
