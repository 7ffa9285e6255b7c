"""Exhaustive checks, on the CPU, of the two shortcuts the fp4 store kernels take (``kvcore_fp4.kernels``) over
every non-negative finite float32 (2**31 values, 0 mismatches expected; a few minutes on two cores):

1. the e2m1 code of a scaled value ``x`` is ``floor(min(2a + 0.5, a + 2.5, 0.5a + 4.5))`` with ``a = min(x, 6)``,
   each line rounded toward minus infinity as the kernel's ``fma.rm`` / ``add.rm`` round it, and the floor
   read from the low bits of ``t + 2**23`` rounded the same way: the count of ``E2M1_BOUNDS`` at or below x,
   the reference's rule (:func:`kvcore_fp4.formats.e2m1_encode`);
2. the fp4_e2m1 block exponent read from ``amax``'s bits without dividing equals the reference's
   ``ceil(log2(amax / 6))`` of the float32 quotient, clamped to [-127, 127], -127 for a zero quotient.

Rounding toward minus infinity is modelled exactly: each value is computed in float64 (exact here: products by
powers of two, sums of a few dozen bits) and rounded down to float32.

    python benchmarks/check_fp4_codes.py
"""

from __future__ import annotations

import sys
import time

import numpy as np

from kvcore_fp4.formats import E2M1_BOUNDS

CHUNK = 1 << 25
END = 0x7F800000  # +inf's bits: every finite non-negative float32 below


def round_down(v: np.ndarray) -> np.ndarray:
    """float64 values -> float32, rounded toward minus infinity."""
    f = v.astype(np.float32)
    over = f.astype(np.float64) > v
    f[over] = np.nextafter(f[over], np.float32(-np.inf))
    return f.astype(np.float64)


def encoder_mismatches(x: np.ndarray) -> int:
    a = np.minimum(x, np.float32(6.0)).astype(np.float64)
    t = np.minimum(np.minimum(round_down(a * 2 + 0.5), round_down(a + 2.5)), round_down(a * 0.5 + 4.5))
    code = (round_down(t + 2.0**23) - 2.0**23).astype(np.int64)
    want = np.searchsorted(np.array(E2M1_BOUNDS, np.float32), x, side="right")
    return int((code != want).sum())


def exponent_mismatches(bits: np.ndarray) -> int:
    amax = bits.view(np.float32)
    q = amax / np.float32(6.0)  # IEEE float32 division, as the reference's
    m, k = np.frexp(q)
    want = np.clip(np.where(m == 0.5, k - 1, k), -127, 127)
    want = np.where(q == 0, -127, want)
    field, mant = (bits >> 23).astype(np.int64), (bits & 0x7FFFFF).astype(np.int64)
    got = field - 129 + (mant > np.where(field == 2, 0x400001, 0x400000))
    got = np.where(field < 2, -127, got)
    return int((got != want).sum())


def main() -> int:
    start, bad_codes, bad_exponents = time.time(), 0, 0
    for first in range(0, END, CHUNK):
        bits = np.arange(first, min(first + CHUNK, END), dtype=np.uint32)
        bad_codes += encoder_mismatches(bits.view(np.float32))
        bad_exponents += exponent_mismatches(bits)
        done = min(first + CHUNK, END) / END
        print(f"\r{done:6.1%} of float32 checked, {time.time() - start:5.0f} s", end="", file=sys.stderr, flush=True)
    print(file=sys.stderr)
    print(f"e2m1 codes: {bad_codes} mismatches; block exponents: {bad_exponents} mismatches "
          f"({END} values each, {time.time() - start:.0f} s)")  # fmt: skip
    return 1 if bad_codes or bad_exponents else 0


if __name__ == "__main__":
    sys.exit(main())
