"""Bit-exact float encodings shared by every pool family's kernels: fp8 (e4m3fn, e5m2) and bf16.

Why integer bit operations instead of ``x.to(tl.float8e4nv)``: Triton's CPU interpreter rounds float -> fp8
(and float -> bf16) casts wrongly (triton-lang/triton#8322: 126.2 becomes 64; bf16 is truncated), while
the GPU rounds correctly.  Encoding from the float32 bits with integer arithmetic gives the same bytes on the
interpreter and on every GPU, and lets the tests compare a kernel bit-exactly against torch.

Torch semantics matched (``tensor.to(torch.float8_e4m3fn)`` / ``.to(torch.float8_e5m2)``, CPU and CUDA share
the same c10 conversion):

* Rounding is round-to-nearest-even on the float32 value, including into the subnormal range
  (e4m3fn subnormals are multiples of 2**-9, e5m2 subnormals multiples of 2**-16); float32 subnormals become 0.
* The sign is always kept: -0.0 -> 0x80, tiny negatives -> 0x80.
* NaN (any payload, either sign) -> 0x7F | sign.
* e5m2 has infinities: |x| >= 61440 (half-way above the largest finite 57344) and +-inf -> 0x7C | sign.
* e4m3fn has no infinity, and torch changed its overflow behaviour between releases:

  - torch <= 2.11 (the ``non-saturating`` encoding): |x| > 464 (anything that rounds above 448) and +-inf
    become NaN (0x7F | sign); 464 itself is a tie and rounds to even, 448.
  - newer torch (the ``saturating`` encoding, seen in torch 2.13): every finite overflow and +-inf
    saturates to +-448 (0x7E | sign); only NaN stays NaN.

  :func:`torch_e4m3fn_saturates` probes the installed torch once; kernels pass the answer as the
  ``SATURATE`` constexpr so they match whatever torch the process runs with.

Decoders (``*_bits_to_f32``) are exact (every fp8 value is a float32) and reproduce torch's float32 bits,
NaN payloads included (e4m3fn NaN -> 0x7FF00000 | sign, e5m2 NaN -> quiet NaN with the mantissa kept).

All helpers take and return int32 tensors of bits (only the low 8 / 16 bits are meaningful for encoders'
results; store them through a ``.to(tl.uint8)`` / ``.to(tl.int16)`` into a uint8 / int16 view of the cache)
and use only Triton features available since 3.0.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from kvcore.kernels import dtypes

# The fp8 kind constexpr the encoders and decoders dispatch on is the dtype's code of :mod:`kvcore.kernels.dtypes`.
_E4M3FN = tl.constexpr(dtypes.E4M3FN)

@functools.lru_cache(maxsize=None)
def torch_e4m3fn_saturates() -> bool:
    """Whether the installed torch saturates float32 -> float8_e4m3fn overflow (inf -> 448) instead of
    producing NaN.  Probed once on the CPU (the CUDA conversion uses the same c10 code)."""
    probe = torch.tensor([float("inf")], dtype=torch.float32).to(torch.float8_e4m3fn).view(torch.uint8)
    return int(probe.item()) == 0x7E


# ----------------------------------------------------------------------------------------------------------
# Encoders: float32 -> bits
# ----------------------------------------------------------------------------------------------------------


@triton.jit
def _rne_shift_right(m, s):
    """Round-to-nearest-even of ``m / 2**s`` for non-negative int32 ``m`` < 2**24 and 1 <= s <= 30."""
    q = m >> s
    rem = m & ((1 << s) - 1)
    half = 1 << (s - 1)
    up = (rem > half) | ((rem == half) & ((q & 1) == 1))
    return q + up.to(tl.int32)


@triton.jit
def f32_to_e4m3fn_bits(x, SATURATE: tl.constexpr):
    """float32 tensor -> int32 tensor holding float8_e4m3fn bits (0..255), bit-exact with torch.

    ``SATURATE``: True for torch's saturating overflow (finite overflow and inf -> +-448), False for the
    older NaN-on-overflow behaviour; pass ``torch_e4m3fn_saturates()``.
    """
    bits = x.to(tl.float32).to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    a = bits & 0x7FFFFFFF
    # Normal range (|x| >= 2**-6): rebias the exponent (127 -> 7) and round the mantissa to 3 bits, half to
    # even, in one add; |x| is clamped to 480 first so the add cannot overflow (the result is replaced below).
    ac = tl.minimum(a, 0x43F00000)
    normal = (ac - (120 << 23) + 0x7FFFF + ((ac >> 20) & 1)) >> 20
    # Subnormal range: value / 2**-9 rounded half to even.  m * 2**(e - 150) * 2**9 = m >> (141 - e).
    e = a >> 23
    m = (a & 0x7FFFFF) | 0x800000
    s = tl.minimum(141 - e, 30)
    sub = _rne_shift_right(m, s)
    r = tl.where(a < (121 << 23), sub, normal)
    if SATURATE:
        r = tl.where((a >= 0x43F00000) | (r == 0x7F), 0x7E, r)
        r = tl.where(a > 0x7F800000, 0x7F, r)
    else:
        r = tl.where(a >= 0x43F00000, 0x7F, r)
    return r | sign


@triton.jit
def f32_to_e5m2_bits(x):
    """float32 tensor -> int32 tensor holding float8_e5m2 bits (0..255), bit-exact with torch
    (overflow rounds to +-inf, NaN -> 0x7F | sign)."""
    bits = x.to(tl.float32).to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    a = bits & 0x7FFFFFFF
    ac = tl.minimum(a, (143 << 23) - 1)
    normal = (ac - (112 << 23) + 0xFFFFF + ((ac >> 21) & 1)) >> 21
    e = a >> 23
    m = (a & 0x7FFFFF) | 0x800000
    s = tl.minimum(134 - e, 30)
    sub = _rne_shift_right(m, s)
    r = tl.where(a < (113 << 23), sub, normal)
    r = tl.where(a >= (143 << 23), 0x7C, r)
    r = tl.where(a > 0x7F800000, 0x7F, r)
    return r | sign


@triton.jit
def f32_to_fp8_bits(x, KIND: tl.constexpr, SATURATE: tl.constexpr):
    """Dispatch on the fp8 kind constexpr: ``kvcore.kernels.dtypes.E4M3FN`` or ``kvcore.kernels.dtypes.E5M2``."""
    if KIND == _E4M3FN:
        r = f32_to_e4m3fn_bits(x, SATURATE)
    else:
        r = f32_to_e5m2_bits(x)
    return r


@triton.jit
def f32_to_fp8_bits_hw(x, KIND: tl.constexpr, SATURATE: tl.constexpr):
    """Like :func:`f32_to_fp8_bits`, with e4m3fn through the GPU's own conversion (``cvt.rn.satfinite``),
    which rounds to nearest even exactly as torch does; only overflow, inf and NaN need torch's encoding
    patched in.  Compiled kernels only: the interpreter's float->fp8 cast rounds wrongly
    (triton-lang/triton#8322)."""
    sign = ((x.to(tl.int32, bitcast=True) >> 24) & 0x80).to(tl.int32)
    if KIND == _E4M3FN:
        r = x.to(tl.float8e4nv).to(tl.uint8, bitcast=True).to(tl.int32)
        # One compare and one select an element: these patches, not memory traffic, bound a store's time.  The
        # sign comes from the float32 bits, not the source's: on an H200 a float16 NaN widened to float32 may
        # change sign, and torch's own conversion sees the widened value (a compiled test, 2026-12-03).
        if SATURATE:
            keep = x == x  # the conversion saturates overflow and inf as torch does; NaN takes its sign
        else:
            keep = tl.abs(x) <= 464.0  # older torch: past 464 (ties at 464 go down to 448), inf and NaN are NaN
        r = tl.where(keep, r, sign | 0x7F)
    else:
        # e5m2 keeps the integer encoder, exact by construction: on an H200 (triton 3.6, 2026-11-29) the
        # compiled MLA gather into e5m2 disagreed with torch for some random bf16/fp16 bit patterns while this
        # path used the hardware conversion; the cause was not isolated and the switch is not yet re-checked
        # on the GPU.  e5m2 caches are rare, so the extra integer work costs little.
        r = tl.where(x != x, sign | 0x7F, f32_to_e5m2_bits(x))
    return r


@triton.jit
def finite_f32_to_e4m3fn_bytes(x, SATURATE: tl.constexpr, HW_CVT: tl.constexpr):
    """float32 values that stay finite in float8_e4m3fn (``|x| < 464``: quotients by a block's own scale, or values
    clamped to +-448) -> their e4m3fn bytes (uint8), rounded to nearest even as torch rounds them: compiled
    (``HW_CVT``), the GPU's own conversion, which needs none of :func:`f32_to_fp8_bits_hw`'s overflow and NaN
    patches for such values; interpreted, the integer encoder (the interpreter's cast rounds wrongly).  The same
    bytes either way."""
    if HW_CVT:
        bits = x.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
    else:
        bits = f32_to_e4m3fn_bits(x, SATURATE).to(tl.uint8)
    return bits


@triton.jit
def f32_to_bf16_bits(x):
    """float32 tensor -> int32 tensor holding bfloat16 bits (low 16 bits), round-to-nearest-even like torch
    and the GPU's cvt.rn.bf16.f32 (the interpreter's ``.to(tl.bfloat16)`` truncates).  NaN -> 0x7FC0 | sign
    (torch's own NaN bits differ between its CPU paths and CUDA; only NaN-ness is meaningful)."""
    bits = x.to(tl.float32).to(tl.int32, bitcast=True)
    sign = (bits >> 16) & 0x8000
    a = bits & 0x7FFFFFFF
    r = (a + 0x7FFF + ((a >> 16) & 1)) >> 16
    r = tl.where(a > 0x7F800000, 0x7FC0, r)
    return r | sign


# ----------------------------------------------------------------------------------------------------------
# Decoders: bits -> float32
# ----------------------------------------------------------------------------------------------------------


@triton.jit
def e4m3fn_bits_to_f32(b):
    """Integer tensor of float8_e4m3fn bytes (e.g. loaded from a uint8 cache) -> float32, exact;
    bits identical to torch's ``.float()`` (NaN -> 0x7FF00000 | sign)."""
    b = b.to(tl.int32) & 0xFF
    mag = b & 0x7F
    normal = (mag + (120 << 3)) << 20
    sub = ((mag & 7).to(tl.float32) * 0.001953125).to(tl.int32, bitcast=True)
    r = tl.where(mag < 8, sub, normal)
    r = tl.where(mag == 0x7F, 0x7FF00000, r)
    r = r | ((b & 0x80) << 24)
    return r.to(tl.float32, bitcast=True)


@triton.jit
def e4m3fn_bits_to_f32_hw(b, HW_CVT: tl.constexpr):
    """Like :func:`e4m3fn_bits_to_f32`, through the GPU's own conversion when ``HW_CVT`` (compiled kernels; it
    differs from the integer decoder only in a NaN's bits), the integer decoder otherwise (the interpreter)."""
    if HW_CVT:
        r = b.to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float32)
    else:
        r = e4m3fn_bits_to_f32(b)
    return r


@triton.jit
def e5m2_bits_to_f32(b):
    """Integer tensor of float8_e5m2 bytes -> float32, exact; bits identical to torch's ``.float()``
    (inf kept, NaN -> quiet NaN 0x7FC00000 | mantissa << 21 | sign)."""
    b = b.to(tl.int32) & 0xFF
    mag = b & 0x7F
    normal = (mag + (112 << 2)) << 21
    sub = ((mag & 3).to(tl.float32) * 0.0000152587890625).to(tl.int32, bitcast=True)
    special = 0x7F800000 | ((mag & 3) << 21) | tl.where((mag & 3) != 0, 0x400000, 0)
    r = tl.where(mag < 4, sub, normal)
    r = tl.where(mag >= 0x7C, special, r)
    r = r | ((b & 0x80) << 24)
    return r.to(tl.float32, bitcast=True)


@triton.jit
def fp8_bits_to_f32(b, KIND: tl.constexpr):
    """Dispatch on the fp8 kind constexpr: ``kvcore.kernels.dtypes.E4M3FN`` or ``kvcore.kernels.dtypes.E5M2``."""
    if KIND == _E4M3FN:
        r = e4m3fn_bits_to_f32(b)
    else:
        r = e5m2_bits_to_f32(b)
    return r


__all__ = [
    "e4m3fn_bits_to_f32",
    "e4m3fn_bits_to_f32_hw",
    "e5m2_bits_to_f32",
    "f32_to_bf16_bits",
    "f32_to_e4m3fn_bits",
    "f32_to_e5m2_bits",
    "f32_to_fp8_bits",
    "f32_to_fp8_bits_hw",
    "finite_f32_to_e4m3fn_bytes",
    "fp8_bits_to_f32",
    "torch_e4m3fn_saturates",
]
