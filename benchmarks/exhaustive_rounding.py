"""Exhaustive check of the double-rounding claims the emulated kernels' fp32 forms rest on (docs/numerics.md).

For every pair (a, b) of finite bf16 values (and of fp16 values), and op in {*, /, +}:

    R_F(fp32(a op b)) == R_F(fp64(a op b))

where fp32(.) and fp64(.) are IEEE nearest-even operations (NumPy's float32 and float64 arithmetic) and R_F rounds
to the format F (nearest-even, subnormals, overflow to inf) from the value's exact binary expansion. The right side
is what the generic kernels compute (an fp64 operation, then one rounding event); the left is the lean kernels' fp32
form of the paper preset's O update (scaled = R(factor * o), R(scaled + R(pv)), R(o / l) with o, factor and l values
of F). Products: a op b (a, b > 0; signs are symmetric under nearest-even); quotients: a, b > 0; sums: a > 0, b of
either sign (a + b of two negatives mirrors a positive pair). About 4e9 pairs in all; a few minutes on two cores.

    python benchmarks/exhaustive_rounding.py [--sample N]   # --sample: N random pairs per case instead (the tests)
"""
import argparse
import sys

import numpy as np

FORMATS = {  # name: (significand bits, smallest normal exponent, largest finite value)
    "bf16": (8, -126, float.fromhex("0x1.FEp127")),
    "fp16": (11, -14, 65504.0),
}


def round_to(fmt, x):
    """R_F(x) for float64 x (its exact value): nearest-even to F's precision, F's subnormals, overflow to inf."""
    p, emin, largest = FORMATS[fmt]
    x = np.asarray(x, np.float64)
    u = x.view(np.uint64)
    drop = np.uint64(53 - p)
    one = np.uint64(1)
    half = (one << (drop - one)) - one
    r = ((u + half + ((u >> drop) & one)) >> drop << drop).view(np.float64)  # nearest-even on the encoding
    q = 2.0 ** (emin - p + 1)  # the subnormals' spacing
    sub = np.round(x / q) * q  # exact scaling by a power of two; np.round is nearest-even
    out = np.where(np.abs(x) < 2.0 ** emin, sub, r)
    return np.where(np.abs(out) > largest, np.copysign(np.inf, x), out)


def values(fmt, positive=True):
    """Every finite value of F (positive ones, zero excluded, or of both signs) as float64."""
    p, emin, largest = FORMATS[fmt]
    if fmt == "bf16":
        bits = np.arange(1, 0x7F80, dtype=np.uint32) << np.uint32(16)
        v = bits.view(np.float32).astype(np.float64)
    else:
        v = np.arange(1, 0x7C00, dtype=np.uint16).view(np.float16).astype(np.float64)
    return v if positive else np.concatenate([v, -v])


OPS = {"*": (np.multiply, True), "/": (np.divide, True), "+": (np.add, False)}


def check(fmt, op, a, b):
    """Pairs (a[i], b[j]) where the two sides differ: their count, and one of them."""
    fn, _ = OPS[op]
    bad, first = 0, None
    with np.errstate(over="ignore", under="ignore"):
        for i in range(0, len(a), 64):
            x, y = a[i:i + 64, None], b[None, :]
            lhs = round_to(fmt, fn(x.astype(np.float32), y.astype(np.float32)).astype(np.float64))
            rhs = round_to(fmt, fn(x, y))
            diff = lhs != rhs
            n = int(diff.sum())
            if n and first is None:
                r, c = np.argwhere(diff)[0]
                first = (float(x[r, 0]), float(y[0, c]))
            bad += n
    return bad, first


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sample", type=int, default=0, help="random pairs per case instead of all of them")
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    failed = 0
    for fmt in FORMATS:
        for op, (_, positive) in OPS.items():
            a, b = values(fmt), values(fmt, positive)
            if args.sample:
                a = rng.choice(a, size=max(1, args.sample // 4096))
                b = rng.choice(b, size=4096)
            bad, first = check(fmt, op, a, b)
            print(f"{fmt} {op}: {len(a) * len(b):.3e} pairs, {bad} differ" + (f" (first: {first})" if bad else ""),
                  flush=True)
            failed += bad
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
