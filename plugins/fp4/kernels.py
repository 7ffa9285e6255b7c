"""Triton kernels of the block-scaled MHA pool: quantize-and-store rows at their locations, and gather-and-
dequantize rows by location; bit-exact with the torch references of :mod:`kvcore_fp4.formats` on the
interpreter and on GPUs.

Hopper has no e2m1 conversion, so codes are made with float operations in chosen rounding modes
(:func:`_e2m1_floor_bits`) and bit operations: exponents are read from float32 bits (``ceil``/``floor`` of
``log2`` exact, no division), powers of two are built from bits (the subnormal 2**-127 of scale byte 0
included), sign bits are moved, not computed, e2m1 values are decoded from bits with their sign bit (code 8
is -0.0: Triton 3.6 compiles a float ``-x`` as ``0 - x``, which makes +0.0 of +0.0; triton-lang/triton#10270),
e4m3 bytes are encoded from values clamped to [-448, 448] on both sides (so the bytes do not depend on
``SATURATE``) by :func:`kvcore.kernels.fp8.finite_f32_to_e4m3fn_bytes` (compiled, the GPU's own conversion;
interpreted, an integer encoder: the interpreter's own float -> fp8 cast rounds wrongly), and are decoded by the
GPU's conversion (compiled)
or :func:`kvcore.kernels.fp8.e4m3fn_bits_to_f32`.

Every float32 product and quotient is one IEEE operation, as in the torch references: compiled for CUDA
(``PTX``) they are inline ``mul.rn.f32`` / ``div.rn.f32``, which neither flush subnormals to zero (some
Triton releases lower ``div_rn`` to ``div.rn.ftz.f32``; triton-lang/triton#8557) nor fuse into an FMA, whatever
the Triton release; interpreted they are numpy's.

One launch stores (or reads) K and V of ``N`` tokens: grid ``(token blocks, 2 x heads / HEADS)``, one program
per block of tokens and ``HEADS`` heads of K or V: one head at decode sizes, every head (whole cache rows: the
codes and scales of a token's K or V contiguous) from ``LARGE_FROM`` tokens on.  A program holds its tokens'
blocks of those heads whole: ``[BLOCK_N, HEADS x blocks, values per block]``.  NaN and infinite inputs are
outside the contract.
"""

from __future__ import annotations

import struct
from functools import partial
from collections.abc import Callable

import attrs
import torch
import triton
import triton.language as tl

from kvcore.kernels.addresses import KeepsAddresses
from kvcore.kernels.fp8 import (e4m3fn_bits_to_f32, e4m3fn_bits_to_f32_hw, f32_to_bf16_bits,
                               finite_f32_to_e4m3fn_bytes)  # fmt: skip
from kvcore.kernels.kernel_mode import triton_interpreting
from kvcore.kernels.launch import UNPLANNED, KernelArgs, Launcher, Plan, remember
from kvcore.pools import empty_of
from kvcore.kernels.row_move import next_pow2
from kvcore_fp4.formats import E2M1_MAX, E4M3_EMAX, E4M3_MAX, UE8M0_BIAS, Recipe

__all__ = ["BlockRows", "Parts"]

_E2M1_MAX = tl.constexpr(E2M1_MAX)
_E4M3_MAX = tl.constexpr(E4M3_MAX)
_EMAX = tl.constexpr(E4M3_EMAX)
_BIAS = tl.constexpr(UE8M0_BIAS)
_TWO_126 = tl.constexpr(2.0**126)
_F32_MAX = tl.constexpr(torch.finfo(torch.float32).max)
#: tokens per program: few at decode sizes, one head a program, where more programs spread a handful of rows
#: over more SMs; from ``LARGE_FROM`` tokens on, ``LARGE_TILES[(recipe name, gather)]`` = (tokens, warps, whole
#: rows: every head of the tokens in one program).  From sweeps on an H200 at 32k Llama-3-8B rows
#: (benchmarks/RESULTS.md, seventh session): whole rows read and write a token's codes (512 bytes) and scales
#: (64) at once instead of 64 and 8 bytes a program; 2 tokens on 2 warps stored in 0.91-0.96 of the best
#: one-head tile's time and gathered 4-bit rows in 0.81 of it; the MXFP8 gather takes 4 tokens (63.7 against
#: 68.9 us).
BLOCK_N, LARGE_FROM = 4, 512
LARGE_TILES = {
    ("fp4_e2m1", False): (2, 2, True), ("fp4_e2m1", True): (2, 2, True),
    ("nvfp4", False): (2, 2, True), ("nvfp4", True): (2, 2, True),
    ("mxfp8", False): (2, 2, True), ("mxfp8", True): (4, 2, True),
}  # fmt: skip


@triton.jit
def _pow2(k):
    """2**k as float32 for integer ``k`` in [-149, 128], built from its bits (exact; ``k < -126`` subnormal, 128
    inf), like :func:`kvcore_fp4.formats.pow2`."""
    normal = tl.maximum(k + 127, 1) << 23
    subnormal = tl.full(k.shape, 1, tl.int32) << tl.minimum(tl.maximum(k + 149, 0), 22)
    return tl.where(k >= -126, normal, subnormal).to(tl.float32, bitcast=True)


@triton.jit
def _mul_rn(a, b, PTX: tl.constexpr):
    """``a * b`` in float32, rounded once to nearest even, subnormals kept (never fused into an FMA)."""
    if PTX:
        r = tl.inline_asm_elementwise("mul.rn.f32 $0, $1, $2;", "=f,f,f", [a, b], dtype=tl.float32, is_pure=True,
                                      pack=1)  # fmt: skip
    else:
        r = a * b
    return r


@triton.jit
def _div_rn(a, b, PTX: tl.constexpr):
    """``a / b`` in float32, IEEE (rounded once to nearest even), subnormals kept."""
    if PTX:
        r = tl.inline_asm_elementwise("div.rn.f32 $0, $1, $2;", "=f,f,f", [a, b], dtype=tl.float32, is_pure=True,
                                      pack=1)  # fmt: skip
    else:
        r = tl.math.div_rn(a, b)
    return r


@triton.jit
def _block_exponent(amax, VALUE_BITS: tl.constexpr):
    """The UE8M0 exponent of blocks with largest magnitude ``amax`` (finite, >= 0): ``ceil(log2(amax / 6))`` for
    e2m1 values (the quotient rounded to float32, as the reference divides), ``floor(log2(amax)) - 8`` for
    e4m3 values; -127 for a zero block (and anything that would go below).

    For e2m1, from ``amax``'s bits without dividing: with ``amax = m x 2**k`` (``m`` in [1, 2)) the rounded
    quotient is at most ``2**(k - 2)`` exactly when ``m <= 1.5`` (a quotient above that power of two by less than
    half its ulp rounds down to it; ``m`` just above 1.5 is too far), so the exponent is ``k - 2`` or ``k - 1``;
    at ``k = -125`` the quotient's ulp is a subnormal's and ``m = 1.5 + 2**-23`` rounds down too; below that
    everything is -127.  Checked against the division on every non-negative finite float32
    (``benchmarks/check_fp4_codes.py``)."""
    bits = amax.to(tl.int32, bitcast=True)
    field = bits >> 23
    if VALUE_BITS == 4:
        mant = bits & 0x7FFFFF
        e = field - 129 + (mant > tl.where(field == 2, 0x400001, 0x400000)).to(tl.int32)
        e = tl.where(field < 2, -127, e)
    else:
        e = tl.maximum(field - 127 - _EMAX, -127)
    return e


def _e2m1_floor_asm() -> str:
    """PTX of :func:`_e2m1_floor_bits`: the three lines, each rounded toward minus infinity, their minimum, then
    the floor by a magic addition (``rm``)."""

    def f32(v: float) -> str:
        return "0f%08X" % struct.unpack("<I", struct.pack("<f", v))[0]

    return (
        "{ .reg .f32 a, t, u; "
        f"abs.f32 a, $1; min.f32 a, a, {f32(E2M1_MAX)}; "
        f"fma.rm.f32 t, a, {f32(2.0)}, {f32(0.5)}; "
        f"add.rm.f32 u, a, {f32(2.5)}; min.f32 t, t, u; "
        f"fma.rm.f32 u, a, {f32(0.5)}, {f32(4.5)}; min.f32 t, t, u; "
        f"add.rm.f32 $0, t, {f32(2.0**23)}; }}"
    )


_E2M1_FLOOR_ASM = tl.constexpr(_e2m1_floor_asm())


@triton.jit
def _e2m1_floor_bits(x, PTX: tl.constexpr):
    """The e2m1 magnitude code ``k`` of float32 ``x`` (already scaled) in bits 0-2 of an int32 whose bits 3-7
    are clear (the bits above them are not).

    With ``a = min(|x|, 6)``, ``k = floor(min(2a + 0.5, a + 2.5, 0.5a + 4.5))``: the lines map e2m1's grid
    (steps of 0.5 below 2, 1 below 4, 2 above) onto the integers 0..7, each piece where it is the least, so
    the floor is the nearest grid value, ties away from zero (the bounds of ``E2M1_BOUNDS``, where the lines
    cross integers).  Compiled, each line is one operation rounded toward minus infinity, which keeps its floor
    exact (a float at or under the value and at or over every integer under it), and adding 2**23 the same way
    leaves ``k`` as the float's low bits: float instructions only, checked against the bound count on every
    non-negative float32 (``benchmarks/check_fp4_codes.py``).  Interpreted, the lines are exact in float64."""
    if PTX:
        r = tl.inline_asm_elementwise(_E2M1_FLOOR_ASM, "=r,f", [x], dtype=tl.int32, is_pure=True, pack=1)
    else:
        a = tl.minimum(tl.abs(x), _E2M1_MAX).to(tl.float64)
        r = tl.floor(tl.minimum(tl.minimum(a * 2.0 + 0.5, a + 2.5), a * 0.5 + 4.5)).to(tl.int32)
    return r


@triton.jit
def _e2m1_bytes(xe, xo, signs, PTX: tl.constexpr):
    """Bytes of e2m1 code pairs: ``xe``'s code in the low nibble, ``xo``'s in the high one (float32 values
    already scaled; :func:`_e2m1_floor_bits`), with the sign bits ``signs`` (bits 3 and 7: the values' own,
    so ``-0.0`` is code 8), in the low byte of an int32."""
    return (_e2m1_floor_bits(xe, PTX) ^ (_e2m1_floor_bits(xo, PTX) << 4)) | signs


@triton.jit
def _e2m1_values(code, PTX: tl.constexpr):
    """e2m1 codes -> float32, exactly, from bits: the code's exponent and mantissa bits (``c & 7``) placed at the
    bottom of a float32's exponent field make the float ``2**-126`` times the e2m1 value (exponent 0, the codes
    0 and 1, land in float32's subnormals just as they are e2m1's: 0 and 0.5), so one exact product by
    ``2**126`` gives the value; bit 3 becomes the float's sign bit (code 8 is -0.0)."""
    c = code.to(tl.int32)
    bits = ((c & 7) << 22) | ((c & 8) << 28)
    return _mul_rn(bits.to(tl.float32, bitcast=True), tl.full(c.shape, _TWO_126, tl.float32), PTX)


@triton.jit
def _load_pair_magnitudes(base, pair, mask):
    """Values ``2 * pair`` and ``2 * pair + 1`` after ``base`` (a float32 / float16 / bfloat16 pointer whose
    pairs are aligned to twice the value's size) as float32 magnitudes and signs ``(|even|, |odd|, signs)``:
    one load of a word of twice the value's width each, split by bit operations (little-endian: the even
    value is the low half); ``signs`` the two sign bits at bits 3 and 7 of an int32 (:func:`_sign_bits`; bits
    above 7 unspecified)."""
    if base.dtype.element_ty == tl.float32:
        w = tl.load(base.to(tl.pointer_type(tl.int64)) + pair[None, :, :], mask=mask, other=0)
        even = w.to(tl.int32).to(tl.float32, bitcast=True)  # the low half
        odd = (w >> 32).to(tl.int32).to(tl.float32, bitcast=True)
        signs = _sign_bits(even, odd)
        odd = tl.abs(odd)
    else:
        w = tl.load(base.to(tl.pointer_type(tl.int32)) + pair[None, :, :], mask=mask, other=0)
        if base.dtype.element_ty == tl.bfloat16:
            even = (w << 16).to(tl.float32, bitcast=True)
            odd = (w & 0x7FFF0000).to(tl.float32, bitcast=True)  # its magnitude: the sign bit is in signs
        else:
            even = (w & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
            odd = ((w >> 16) & 0x7FFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        # bits 15 and 31 (the two signs) to bits 3 and 7 in one product's high word: 2**15 x 2**20 = 2**(32 + 3),
        # 2**31 x 2**8 = 2**(32 + 7); the other two products land in bit 23 of the low word and bit 19
        signs = tl.umulhi((w & -2147450880).to(tl.uint32, bitcast=True), 0x00100100).to(tl.int32, bitcast=True)
    return tl.abs(even), odd, signs


@triton.jit
def _sign_bits(even, odd):
    """The sign bits of float32 ``even`` and ``odd`` at bits 3 and 7 of an int32 (its other low bits clear)."""
    return ((even.to(tl.int32, bitcast=True) >> 28) & 8) | ((odd.to(tl.int32, bitcast=True) >> 24) & 0x80)


@triton.jit
def _store_pairs(base, pair, even, odd, mask, OUT: tl.constexpr, HW_CVT: tl.constexpr):
    """Float32 ``even`` / ``odd`` converted to ``OUT`` (as :func:`_store_out`) and stored as values ``2 * pair``
    and ``2 * pair + 1`` after ``base`` (aligned as :func:`_load_pair_magnitudes` reads them), one word per
    pair."""
    if OUT == 0:
        low = even.to(tl.int32, bitcast=True).to(tl.uint32).to(tl.int64)  # zero-extended: the high half stays clear
        w = (odd.to(tl.int32, bitcast=True).to(tl.int64) << 32) | low
        tl.store(base.to(tl.pointer_type(tl.int64)) + pair[None, :, :], w, mask=mask)
    else:
        w = (_half_bits(even, OUT, HW_CVT) & 0xFFFF) | (_half_bits(odd, OUT, HW_CVT) << 16)
        tl.store(base.to(tl.pointer_type(tl.int32)) + pair[None, :, :], w, mask=mask)


@triton.jit
def _half_bits(x, OUT: tl.constexpr, HW_CVT: tl.constexpr):
    """float32 -> the bits of a float16 (``OUT`` 1) or bfloat16 (2), in an int32 (high half unspecified)."""
    if OUT == 1:
        r = x.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32)
    elif HW_CVT:
        r = x.to(tl.bfloat16).to(tl.int16, bitcast=True).to(tl.int32)
    else:
        r = f32_to_bf16_bits(x)
    return r


@triton.jit
def _quantize_heads(src, sn, sh, sd, data, scale, rows, tok, mask_n, g,
                    NB: tl.constexpr, NBT: tl.constexpr, NBT_PAD: tl.constexpr, BLOCK: tl.constexpr,
                    VALUE_BITS: tl.constexpr, E4M3_SCALE: tl.constexpr, SATURATE: tl.constexpr,
                    DATA_ROW: tl.constexpr, SCALE_ROW: tl.constexpr, HW_CVT: tl.constexpr, PAIRS: tl.constexpr,
                    PTX: tl.constexpr):  # fmt: skip
    """``NBT / NB`` consecutive heads (``NB`` blocks each) of ``BLOCK_N`` tokens: ``src`` points at the first
    head of token 0 (tokens ``sn`` apart, heads ``sh``, values ``sd``); ``data`` / ``scale`` at that head in
    cache row 0 (rows ``DATA_ROW`` / ``SCALE_ROW`` bytes apart; a row's heads are contiguous there).
    ``PAIRS``: the values are contiguous (``sd == 1``) and every head's pairs aligned
    (:func:`_load_pair_magnitudes`)."""
    blk = tl.arange(0, NBT_PAD)
    mask_b = mask_n[:, None] & (blk < NBT)[None, :]
    PER: tl.constexpr = BLOCK // (8 // VALUE_BITS)
    i = tl.arange(0, PER)
    mask = mask_b[:, :, None]
    base = src + tok[:, None, None] * sn
    first = (blk // NB).to(tl.int64) * sh + (blk % NB) * (BLOCK * sd)  # each block's first value, from src
    if VALUE_BITS == 4:  # a block's even and odd elements apart: they fill a byte's low and high nibble
        # magnitudes and sign bits apart: the signs go straight to the codes
        if PAIRS:  # each even/odd pair read as one word (contiguous, vectorized loads) and split by bit operations
            xe, xo, signs = _load_pair_magnitudes(base, (first // 2)[:, None] + i[None, :], mask)
        else:
            at = base + (first[:, None] + 2 * sd * i[None, :])[None, :, :]
            xe = tl.load(at, mask=mask, other=0.0).to(tl.float32)
            xo = tl.load(at + sd, mask=mask, other=0.0).to(tl.float32)
            signs = _sign_bits(xe, xo)
            xe, xo = tl.abs(xe), tl.abs(xo)
        amax = tl.maximum(tl.max(xe, axis=2), tl.max(xo, axis=2))
    else:
        xe = tl.load(base + (first[:, None] + sd * i[None, :])[None, :, :], mask=mask, other=0.0).to(tl.float32)
        xo = xe
        amax = tl.max(tl.abs(xe), axis=2)
    if E4M3_SCALE:  # nvfp4: an e4m3 block scale of amax / 6 under the global scale g
        gs = tl.broadcast_to(g, amax.shape)  # not 0 + g, which makes +0.0 of -0.0
        s = _div_rn(_div_rn(amax, tl.full(amax.shape, _E2M1_MAX, tl.float32), PTX), gs, PTX)
        # clamped on both sides, as the reference: a negative g makes s negative, and torch <= 2.11's encoding
        # (SATURATE False) would make NaN of anything past -448
        scale_byte = finite_f32_to_e4m3fn_bytes(tl.minimum(tl.maximum(s, -_E4M3_MAX), _E4M3_MAX), SATURATE, HW_CVT).to(tl.int32)
        step = _mul_rn(e4m3fn_bits_to_f32_hw(scale_byte, HW_CVT), gs, PTX)
        # the magnitudes times the step's reciprocal (kvcore_fp4.formats.reciprocal_step): one division a block.
        # step = e4m3(s) x g is never below +0 (s has g's sign, or is 0 of g's sign), so neither is inv, and the
        # inputs' sign bits (signs) are the scaled values' own
        zero = step == 0
        inv = _div_rn(tl.full(step.shape, 1.0, tl.float32), tl.where(zero, 1.0, step), PTX)
        inv = tl.where(zero, 0.0, tl.minimum(tl.maximum(inv, -_F32_MAX), _F32_MAX))[:, :, None]
        xe = _mul_rn(xe, inv, PTX)
        xo = _mul_rn(xo, inv, PTX)
    else:
        e = _block_exponent(amax, VALUE_BITS)
        up = _pow2(-e)[:, :, None]
        xe = _mul_rn(xe, up, PTX)
        xo = _mul_rn(xo, up, PTX)
        scale_byte = e + _BIAS
    tl.store(scale + rows[:, None] * SCALE_ROW + blk[None, :], scale_byte.to(tl.uint8), mask=mask_b)
    if VALUE_BITS == 4:
        byte = _e2m1_bytes(xe, xo, signs, PTX)
        k = blk[:, None] * PER + i[None, :]
        tl.store(data + rows[:, None, None] * DATA_ROW + k[None, :, :], byte.to(tl.uint8), mask=mask)
    else:
        byte = finite_f32_to_e4m3fn_bytes(tl.minimum(tl.maximum(xe, -_E4M3_MAX), _E4M3_MAX), SATURATE, HW_CVT)
        j = blk[:, None] * BLOCK + i[None, :]
        tl.store(data + rows[:, None, None] * DATA_ROW + j[None, :, :], byte.to(tl.uint8), mask=mask)


@triton.jit
def _dequantize_heads(dst, dn, dh, dd, data, scale, rows, tok, mask_n, g,
                      NB: tl.constexpr, NBT: tl.constexpr, NBT_PAD: tl.constexpr, BLOCK: tl.constexpr,
                      VALUE_BITS: tl.constexpr, E4M3_SCALE: tl.constexpr, OUT: tl.constexpr, HW_CVT: tl.constexpr,
                      DATA_ROW: tl.constexpr, SCALE_ROW: tl.constexpr, PAIRS: tl.constexpr, PTX: tl.constexpr):  # fmt: skip
    """:func:`_quantize_heads`' inverse into ``dst`` (heads ``dh`` apart; ``OUT``: 0 float32, 1 float16, 2
    bfloat16; ``PAIRS`` as there)."""
    blk = tl.arange(0, NBT_PAD)
    mask_b = mask_n[:, None] & (blk < NBT)[None, :]
    PER: tl.constexpr = BLOCK // (8 // VALUE_BITS)
    i = tl.arange(0, PER)
    mask = mask_b[:, :, None]
    sb = tl.load(scale + rows[:, None] * SCALE_ROW + blk[None, :], mask=mask_b, other=0).to(tl.int32)
    if E4M3_SCALE:
        step = _mul_rn(e4m3fn_bits_to_f32(sb), tl.broadcast_to(g, sb.shape), PTX)
    else:
        step = _pow2(sb - _BIAS)  # byte 0 is 2**-127, a subnormal
    step = step[:, :, None]
    base = dst + tok[:, None, None] * dn
    first = (blk // NB).to(tl.int64) * dh + (blk % NB) * (BLOCK * dd)  # each block's first value, from dst
    if VALUE_BITS == 4:
        k = blk[:, None] * PER + i[None, :]
        byte = tl.load(data + rows[:, None, None] * DATA_ROW + k[None, :, :], mask=mask, other=0).to(tl.int32)
        lo = _mul_rn(_e2m1_values(byte & 15, PTX), step, PTX)
        hi = _mul_rn(_e2m1_values(byte >> 4, PTX), step, PTX)
        if PAIRS:  # one word per even/odd pair (contiguous, vectorized stores)
            _store_pairs(base, (first // 2)[:, None] + i[None, :], lo, hi, mask, OUT, HW_CVT)
        else:  # the even and odd values interleaved in registers, then stored whole
            x = tl.reshape(tl.join(lo, hi), [lo.shape[0], NBT_PAD, BLOCK])
            at = first[:, None] + dd * tl.arange(0, BLOCK)[None, :]
            _store_out(base + at[None, :, :], x, mask, OUT, HW_CVT)
    else:
        j = blk[:, None] * BLOCK + i[None, :]
        byte = tl.load(data + rows[:, None, None] * DATA_ROW + j[None, :, :], mask=mask, other=0)
        at = first[:, None] + dd * i[None, :]
        _store_out(base + at[None, :, :], _mul_rn(e4m3fn_bits_to_f32(byte), step, PTX), mask, OUT, HW_CVT)


@triton.jit
def _store_out(ptr, x, mask, OUT: tl.constexpr, HW_CVT: tl.constexpr):
    if OUT == 0:
        tl.store(ptr, x, mask=mask)
    elif OUT == 1:
        tl.store(ptr, x.to(tl.float16), mask=mask)
    elif HW_CVT:
        tl.store(ptr, x.to(tl.bfloat16), mask=mask)
    else:
        tl.store(ptr, f32_to_bf16_bits(x).to(tl.int16).to(tl.bfloat16, bitcast=True), mask=mask)


@triton.jit(do_not_specialize=["layer", "n_tokens", "loc_stride"])
def _rows_kernel(
    k_data, k_scale, v_data, v_scale, g_ptr, layer, loc_ptr, loc_stride, n_tokens,
    k_ptr, k_sn, k_sh, k_sd, v_ptr, v_sn, v_sh, v_sd,
    H: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, NBK: tl.constexpr, NBV: tl.constexpr,
    BLOCK: tl.constexpr, VALUE_BITS: tl.constexpr,
    E4M3_SCALE: tl.constexpr, SATURATE: tl.constexpr, KD_LAYER: tl.constexpr, KS_LAYER: tl.constexpr,
    VD_LAYER: tl.constexpr, VS_LAYER: tl.constexpr, KD_ROW: tl.constexpr, KS_ROW: tl.constexpr,
    VD_ROW: tl.constexpr, VS_ROW: tl.constexpr, GATHER: tl.constexpr, OUT: tl.constexpr,
    HW_CVT: tl.constexpr, PAIRS: tl.constexpr, PTX: tl.constexpr, BLOCK_N: tl.constexpr, HEADS: tl.constexpr,
    NBKT_PAD: tl.constexpr, NBVT_PAD: tl.constexpr,
):  # fmt: skip
    """Store (``GATHER`` False: ``k_ptr`` / ``v_ptr`` are the inputs) or gather (the outputs) ``n_tokens``
    rows at ``loc``; grid ``(token blocks, 2 H / HEADS)``: a program takes ``HEADS`` heads (1, or all ``H``:
    whole rows) of K or V, ``NB*T_PAD`` their blocks padded to a power of two.  The two parts (K and V of MHA;
    nope and rope of an MLA latent row, H = 1) start at ``k_data`` / ``v_data`` (and their scales), rows
    ``*_ROW`` bytes apart, heads one head's bytes apart."""
    tok = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = tok < n_tokens
    rows = tl.load(loc_ptr + tok.to(tl.int64) * loc_stride, mask=mask_n, other=0).to(tl.int64)
    tok = tok.to(tl.int64)
    hp = tl.program_id(1)
    lay = layer.to(tl.int64)
    KB: tl.constexpr = DK * VALUE_BITS // 8
    VB: tl.constexpr = DV * VALUE_BITS // 8
    GROUPS: tl.constexpr = H // HEADS
    if hp < GROUPS:
        h = hp * HEADS
        g = 1.0
        if E4M3_SCALE:
            g = tl.load(g_ptr + lay * 2)
        data, scale = k_data + lay * KD_LAYER + h * KB, k_scale + lay * KS_LAYER + h * NBK
        if GATHER:
            _dequantize_heads(k_ptr + h * k_sh, k_sn, k_sh, k_sd, data, scale, rows, tok, mask_n, g, NBK,
                              HEADS * NBK, NBKT_PAD, BLOCK, VALUE_BITS, E4M3_SCALE, OUT, HW_CVT, KD_ROW, KS_ROW,
                              PAIRS, PTX)  # fmt: skip
        else:
            _quantize_heads(k_ptr + h * k_sh, k_sn, k_sh, k_sd, data, scale, rows, tok, mask_n, g, NBK,
                            HEADS * NBK, NBKT_PAD, BLOCK, VALUE_BITS, E4M3_SCALE, SATURATE, KD_ROW, KS_ROW, HW_CVT,
                            PAIRS, PTX)  # fmt: skip
    else:
        h = (hp - GROUPS) * HEADS
        g = 1.0
        if E4M3_SCALE:
            g = tl.load(g_ptr + lay * 2 + 1)
        data, scale = v_data + lay * VD_LAYER + h * VB, v_scale + lay * VS_LAYER + h * NBV
        if GATHER:
            _dequantize_heads(v_ptr + h * v_sh, v_sn, v_sh, v_sd, data, scale, rows, tok, mask_n, g, NBV,
                              HEADS * NBV, NBVT_PAD, BLOCK, VALUE_BITS, E4M3_SCALE, OUT, HW_CVT, VD_ROW, VS_ROW,
                              PAIRS, PTX)  # fmt: skip
        else:
            _quantize_heads(v_ptr + h * v_sh, v_sn, v_sh, v_sd, data, scale, rows, tok, mask_n, g, NBV,
                            HEADS * NBV, NBVT_PAD, BLOCK, VALUE_BITS, E4M3_SCALE, SATURATE, VD_ROW, VS_ROW, HW_CVT,
                            PAIRS, PTX)  # fmt: skip


_OUT = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}


@attrs.frozen(eq=False)
class Parts:
    """Where one pool keeps its two parts: per part the codes and scales (stacked ``[L, R, ...]`` uint8
    tensors, or views of one at a byte offset) and the part's width; ``heads`` heads per part, each ``width``
    values; ``global_scale`` a float32 ``[L, 1, 2]`` (nvfp4) or None.  Build one :class:`BlockRows` from it."""

    recipe: Recipe
    heads: int
    k_data: torch.Tensor
    k_scale: torch.Tensor
    k_width: int
    v_data: torch.Tensor
    v_scale: torch.Tensor
    v_width: int
    global_scale: torch.Tensor | None = None


#: the kernel's argument list (:class:`kvcore.kernels.launch.KernelArgs`; pointers passed as addresses): a plan holds
#: the runtime arguments, a call fills in its layer, count and addresses (:meth:`BlockRows._fire`)
_ROWS_ARGS = KernelArgs(
    _rows_kernel,
    runtime=("k_data k_scale v_data v_scale g_ptr", "layer loc_ptr loc_stride n_tokens",
             "k_ptr k_sn k_sh k_sd v_ptr v_sn v_sh v_sd"),
    constexprs="H DK DV NBK NBV BLOCK VALUE_BITS E4M3_SCALE SATURATE KD_LAYER KS_LAYER VD_LAYER VS_LAYER KD_ROW KS_ROW "
               "VD_ROW VS_ROW GATHER OUT HW_CVT PAIRS PTX BLOCK_N HEADS NBKT_PAD NBVT_PAD",
    pointers="k_data k_scale v_data v_scale g_ptr loc_ptr k_ptr v_ptr",
)  # fmt: skip
#: the plan memo's answer for a signature its caller's ``check`` declined (the caller's general path takes it)
_DECLINED = object()
_LOC_DTYPES = (torch.int32, torch.int64)
#: where the values a call passes (its local layer, the address of loc, its token count, the addresses of k and v)
#: go in the kernel's runtime arguments
_LAYER_ARG, _LOC_ARG, _N_ARG, _K_ARG, _V_ARG = map(_ROWS_ARGS.index, "layer loc_ptr n_tokens k_ptr v_ptr".split())
#: a pool's own test of a call, ``check(block_rows, loc, a, b) -> bool`` (:class:`BlockRows`)
Check = Callable[..., bool]


def _row_parts(parts: Parts, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows holding both parts, ``[N, 1, k_width + v_width]`` or ``[N, k_width + v_width]`` (one head a part),
    as the views ``[N, 1, k_width]`` / ``[N, 1, v_width]`` of their first ``k_width`` and next ``v_width``
    values (the views the MLA pool's general path makes of them)."""
    p = parts
    width = p.k_width + p.v_width
    n = rows.shape[0] if rows.dim() else -1
    if p.heads != 1 or rows.shape not in ((n, 1, width), (n, width)):
        raise ValueError(f"rows must be [N, 1, {width}] or [N, {width}] of one-head parts, got {tuple(rows.shape)}")
    flat = rows.reshape(n, width)
    return flat[:, : p.k_width].reshape(n, 1, p.k_width), flat[:, p.k_width :].reshape(n, 1, p.v_width)


def _behind_rows(parts: Parts, buffers: tuple, loc: torch.Tensor, rows: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """:meth:`BlockRows._behind` of a :meth:`BlockRows.store_rows` call: its rows' two parts as views."""
    return (*buffers, loc, *_row_parts(parts, rows))


class BlockRows(KeepsAddresses):
    """The quantize-store and dequantize-gather of one pool's two parts, bound at pool creation.

    What the parts fix (widths, strides, constexprs, the buffers' addresses) is computed once; what a call's
    signature fixes (its tensors' shapes, strides, dtypes, devices and address alignments, and the caller's
    ``check``) is checked and planned on the signature's first call (:class:`kvcore.kernels.launch.Plan`); a later call
    reads its signature, finds its plan and launches: one launch a call (:mod:`kvcore.kernels.launch`).

    ``check``, which every operation takes: a pool's own test of a call, ``check(block_rows, loc, a, b)`` with
    ``block_rows`` this object and ``a`` / ``b`` the operation's two tensors (:meth:`store_rows`: its one), run
    once per call signature before the operation's own checks, so it may read only what the signature holds:
    metadata, never values or whole addresses.  It returns True when the pool takes the call as given, False to
    decline it: the operation then launches nothing and answers False (:meth:`gather_new`: None), and the pool
    takes its general path (its reshapes, its errors).

    Each operation reads its signature, looks its plan up and launches it (:meth:`_fire`; no closure: its cells
    would cost every call; the tensors for the dispatcher are the plan's ``views`` of the call's own).
    """

    def __init__(self, parts: Parts):
        from kvcore.kernels.fp8 import torch_e4m3fn_saturates

        self.parts, r = parts, parts.recipe
        kd, ks, vd, vs = parts.k_data, parts.k_scale, parts.v_data, parts.v_scale
        g = parts.global_scale if parts.global_scale is not None else ks  # never read without a global scale
        self._buffers = (kd, ks, vd, vs, g)
        self.device, self._device_index, self._layers = kd.device, kd.get_device(), kd.shape[0]
        heads, kw, vw = parts.heads, parts.k_width, parts.v_width
        nbk, nbv = kw // r.block, vw // r.block
        # the constexprs the parts fix: their shapes and format, and the layer and row strides of the four buffers
        self._fixed = dict(H=heads, DK=kw, DV=vw, NBK=nbk, NBV=nbv, BLOCK=r.block, VALUE_BITS=r.value_bits,
                           E4M3_SCALE=r.scale_kind == "e4m3", SATURATE=torch_e4m3fn_saturates(), KD_LAYER=kd.stride(0),
                           KS_LAYER=ks.stride(0), VD_LAYER=vd.stride(0), VS_LAYER=vs.stride(0), KD_ROW=kd.stride(1),
                           KS_ROW=ks.stride(1), VD_ROW=vd.stride(1), VS_ROW=vs.stride(1))  # fmt: skip
        # heads a program takes -> (that, K's blocks padded, V's blocks padded): one head, or whole rows
        self._heads = {h: (h, next_pow2(h * nbk), next_pow2(h * nbv)) for h in (1, heads)}
        self._hw_cvt = not triton_interpreting()
        # IEEE float32 products and quotients as inline PTX: compiled kernels on NVIDIA GPUs only
        self._ptx = self._hw_cvt and kd.device.type == "cuda" and torch.version.hip is None
        self.launch = Launcher(_ROWS_ARGS, kd.device)
        self._large = {gather: LARGE_TILES[r.name, gather] for gather in (False, True)}
        self._new_strides = ((heads * kw, kw, 1), (heads * vw, vw, 1))  # of contiguous [N, heads, width] outputs
        self._empties: dict[torch.dtype, torch.Tensor] = {}  # kvcore.pools.empty_of
        self._bind_addresses()

    def _bind_addresses(self) -> None:
        """The buffers' addresses; the plans, which keep them, start empty."""
        self._addresses = tuple(t.data_ptr() for t in self._buffers)
        self._plans: dict[tuple, Plan | object | None] = {}

    # -- plans and the one launch ----------------------------------------------------------------------------

    def _plan(self, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gather: bool, v_offset: int = 0,
              views: Callable[..., tuple[torch.Tensor, ...]] | None = None) -> Plan | None:  # fmt: skip
        """The plan of a call's signature (:mod:`kvcore.kernels.launch`), after the full checks of the call; None when
        the call has no rows.  ``v_offset``: bytes from the address a call passes for ``v`` to ``v``'s first
        value; ``views``: the tensors behind a launch from those the call passes (default :meth:`_behind`); both
        for :meth:`store_rows`, whose call passes one tensor for both parts."""
        if gather:
            if k.dtype != v.dtype or k.dtype not in _OUT:
                raise ValueError(f"outputs must share a float32/float16/bfloat16 dtype, got {k.dtype} and {v.dtype}")
        elif k.dtype not in _OUT or v.dtype not in _OUT:
            raise ValueError(f"k and v rows must be float32/float16/bfloat16 to be quantized, got {k.dtype}, {v.dtype}")
        if loc.dim() != 1 or loc.dtype not in _LOC_DTYPES:
            raise ValueError(f"loc must be a 1-D int32/int64 tensor, got {loc.dtype} {tuple(loc.shape)}")
        n, p = loc.shape[0], self.parts
        if k.shape != (n, p.heads, p.k_width) or v.shape != (n, p.heads, p.v_width):
            raise ValueError(f"k and v must be [N, heads, width] = {(n, p.heads, p.k_width)} and "
                             f"{(n, p.heads, p.v_width)}, got {tuple(k.shape)} and {tuple(v.shape)}")  # fmt: skip
        if n == 0:
            return None
        dev = self._device_index
        if loc.get_device() != dev or k.get_device() != dev or v.get_device() != dev:
            raise ValueError(f"loc and the rows must be on {self.device}, got {loc.device}, {k.device}, {v.device}")
        kss, vss = k.stride(), v.stride()
        block_n, warps, whole_rows = self._large[gather] if n >= LARGE_FROM else (BLOCK_N, 4, False)
        heads = self._heads[p.heads if whole_rows else 1]
        key = (gather, k.dtype, v.dtype, kss, vss, k.data_ptr() & 15, v.data_ptr() & 15, loc.dtype,
               loc.data_ptr() & 15, block_n, warps, heads[0])  # fmt: skip
        # the runtime arguments; a call fills in its layer and addresses (_LAYER_ARG ...), v's added to its slot's
        args = [*self._addresses, None, None, loc.stride(0), None, None, *kss, v_offset, *vss]
        constexprs = _ROWS_ARGS.constexprs(**self._fixed, GATHER=gather, OUT=_OUT[k.dtype] if gather else 0,
                                           HW_CVT=self._hw_cvt, PAIRS=self._pairs_of(k, v), PTX=self._ptx,
                                           BLOCK_N=block_n, HEADS=heads[0], NBKT_PAD=heads[1], NBVT_PAD=heads[2])
        grid_y = 2 * p.heads // heads[0]
        return Plan(self.launch, key, block_n, (grid_y, 1), warps, args, views or self._behind, constexprs)

    def _first_plan(self, signature: tuple, first: bool, check: Check | None, check_args: tuple,
                    make_plan: Callable[[], Plan | None]) -> Plan | object | None:  # fmt: skip
        """The plan of a call that found none, or whose counts differ from its signature's first call's: its
        caller's ``check``, then ``make_plan()`` (:meth:`_plan`'s checks), which decline or refuse a call of
        mismatched counts; remembered for the signature when ``first``."""
        plan = _DECLINED if check is not None and not check(self, *check_args) else make_plan()
        return remember(self._plans, signature, plan) if first else plan

    def _plan_rows(self, loc: torch.Tensor, rows: torch.Tensor) -> Plan | None:
        """:meth:`_plan` of a store of whole latent rows: its two parts are views at offsets from ``rows``' address
        that the signature fixes."""
        k, v = _row_parts(self.parts, rows)
        return self._plan(loc, k, v, False, v.data_ptr() - rows.data_ptr(), partial(_behind_rows, self.parts))

    def _fire(self, plan, n: int, layer: int, lp: int, kp: int, vp: int, tensors: tuple[torch.Tensor, ...]) -> bool:
        """Launch ``plan`` for ``n`` tokens of one local layer and the call's addresses of loc, K and V (V's added
        to the offset its slot holds); None: nothing to launch.  False, launching nothing, for a declined call's
        plan."""
        if plan is _DECLINED:
            return False
        if not 0 <= layer < self._layers:
            raise ValueError(f"layer {layer} out of range for {self._layers} layers")
        if plan is not None:  # the runtime arguments: the plan's, and the call's layer, addresses and count
            args = plan.fixed.copy()
            args[_LAYER_ARG], args[_LOC_ARG], args[_N_ARG], args[_K_ARG] = layer, lp, n, kp
            args[_V_ARG] += vp
            plan(n, args, (self._buffers, *tensors))
        return True

    @staticmethod
    def _behind(buffers: tuple, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The tensors behind a launch's pointer arguments, in the kernel's order, from the pool's buffers and the
        call's own (a plan's ``views``: made only for launches through the dispatcher; a function, not a method:
        kept in this object's plans, a method would tie it, and the buffers, into a reference cycle)."""
        return (*buffers, loc, k, v)

    def _pairs_of(self, k: torch.Tensor, v: torch.Tensor) -> bool:
        """Whether a store may read (a gather write) each even/odd pair of values of ``k`` / ``v`` as one word:
        4-bit codes, contiguous values, and every head's pairs aligned to twice the value's size (what the
        launch key fixes: strides, dtypes and the addresses' low four bits)."""
        if self.parts.recipe.value_bits != 4:
            return False
        return all(
            t.stride(2) == 1 and t.stride(0) % 2 == 0 and t.stride(1) % 2 == 0
            and t.data_ptr() % (2 * t.element_size()) == 0
            for t in (k, v)
        )  # fmt: skip

    # -- the operations --------------------------------------------------------------------------------------

    def store(self, layer: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor, check: Check | None = None
              ) -> bool:  # fmt: skip
        """Quantize ``k`` ``[N, heads, k_width]`` and ``v`` ``[N, heads, v_width]`` (any strides, float32 /
        float16 / bfloat16) into rows ``loc`` (``[N]`` int32/int64) of local layer ``layer``: one launch, the
        bytes of :func:`kvcore_fp4.formats.quantize` of each part.  ``check(block_rows, loc, k, v)``: see the class;
        False when it declined the call (nothing stored), True otherwise."""
        lp, kp, vp, n, ks, vs = loc.data_ptr(), k.data_ptr(), v.data_ptr(), loc.numel(), k.shape, v.shape
        signature = (0, check, (n - 1).bit_length() if n else -1, loc.stride(), loc.dtype, loc.get_device(), lp & 15,
                     ks[1:], k.stride(), k.dtype, k.get_device(), kp & 15, vs[1:], v.stride(), v.dtype, v.get_device(),
                     vp & 15)  # fmt: skip
        plan = self._plans.get(signature, UNPLANNED)
        if plan is _DECLINED:
            return False
        if plan is UNPLANNED or ks[0] != n or vs[0] != n:  # a first call, or parts of another count
            plan = self._first_plan(signature, plan is UNPLANNED, check, (loc, k, v),
                                    lambda: self._plan(loc, k, v, gather=False))  # fmt: skip
        return self._fire(plan, n, layer, lp, kp, vp, (loc, k, v))

    def store_rows(self, layer: int, loc: torch.Tensor, rows: torch.Tensor, check: Check | None = None) -> bool:
        """:meth:`store` of the two parts of latent ``rows`` (one head a part): ``[N, 1, k_width + v_width]`` or
        ``[N, k_width + v_width]``, part K their first ``k_width`` values and V the next ``v_width``, as
        ``[N, 1, width]`` views (:func:`_row_parts`); a planned call makes no views (their addresses are at
        offsets from ``rows``' that its signature fixes).  ``check(block_rows, loc, rows)``: see the class; False
        when it declined the call, True otherwise."""
        lp, rp, n, shape = loc.data_ptr(), rows.data_ptr(), loc.numel(), rows.shape
        signature = (1, check, (n - 1).bit_length() if n else -1, loc.stride(), loc.dtype, loc.get_device(), lp & 15,
                     shape[1:], rows.stride(), rows.dtype, rows.get_device(), rp & 15)  # fmt: skip
        plan = self._plans.get(signature, UNPLANNED)
        if plan is _DECLINED:
            return False
        if plan is UNPLANNED or shape[0] != n:  # a first call, or rows of another count
            plan = self._first_plan(signature, plan is UNPLANNED, check, (loc, rows),
                                    lambda: self._plan_rows(loc, rows))  # fmt: skip
        return self._fire(plan, n, layer, lp, rp, rp, (loc, rows))

    def gather(self, layer: int, loc: torch.Tensor, out_k: torch.Tensor, out_v: torch.Tensor,
               check: Check | None = None) -> bool:
        """Rows ``loc`` of local layer ``layer`` dequantized into ``out_k`` / ``out_v`` (float32/float16/
        bfloat16, one dtype, any strides): one launch, the values of :func:`kvcore_fp4.formats.dequantize`.
        ``check(block_rows, loc, out_k, out_v)``: see the class; False when it declined the call (also, given a
        ``check``, for outputs that are not tensors: a pool's own checks name what is wrong), True otherwise."""
        try:
            lp, kp, vp = loc.data_ptr(), out_k.data_ptr(), out_v.data_ptr()
        except AttributeError:
            if check is None:
                raise
            return False
        n, ks, vs = loc.numel(), out_k.shape, out_v.shape
        signature = (2, check, (n - 1).bit_length() if n else -1, loc.stride(), loc.dtype, loc.get_device(), lp & 15,
                     ks[1:], out_k.stride(), out_k.dtype, out_k.get_device(), kp & 15, vs[1:], out_v.stride(),
                     out_v.dtype, out_v.get_device(), vp & 15)  # fmt: skip
        plan = self._plans.get(signature, UNPLANNED)
        if plan is _DECLINED:
            return False
        if plan is UNPLANNED or ks[0] != n or vs[0] != n:  # a first call, or outputs of another count
            plan = self._first_plan(signature, plan is UNPLANNED, check, (loc, out_k, out_v),
                                    lambda: self._plan(loc, out_k, out_v, gather=True))  # fmt: skip
        return self._fire(plan, n, layer, lp, kp, vp, (loc, out_k, out_v))

    def gather_new(self, layer: int, loc: torch.Tensor, dtype: torch.dtype, check: Check | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor] | None:  # fmt: skip
        """:meth:`gather` into two new contiguous tensors ``[N, heads, k_width]`` / ``[N, heads, v_width]`` of
        ``dtype``, returned; None (nothing allocated or read that the caller sees) when ``loc`` is not 1-D or
        ``check`` declined the call.

        (Two allocations, :func:`kvcore.pools.empty_of`: on an H200 they cost less host time than one allocation
        carved into two views.)  New outputs are 16-byte aligned (the caching allocator's blocks are), which the
        plan of a call signature takes for granted and checks on every call."""
        shape = loc.shape
        if len(shape) != 1:
            return None
        n, (ks, vs), p = shape[0], self._new_strides, self.parts
        empty = self._empties.get(dtype)
        if empty is None:
            empty = empty_of(self._empties, dtype, self.device)
        out_k = empty.new_empty_strided((n, p.heads, p.k_width), ks)
        out_v = empty.new_empty_strided((n, p.heads, p.v_width), vs)
        lp, kp, vp = loc.data_ptr(), out_k.data_ptr(), out_v.data_ptr()
        signature = (3, check, (n - 1).bit_length() if n else -1, loc.stride(), loc.dtype, loc.get_device(), lp & 15,
                     dtype)  # fmt: skip
        plan = self._plans.get(signature, UNPLANNED)
        if plan is UNPLANNED or (kp | vp) & 15:  # a first call, or outputs less aligned than plans take them
            # (a plan of unaligned outputs is used once)
            plan = self._first_plan(signature, not (kp | vp) & 15, check, (loc, out_k, out_v),
                                    lambda: self._plan(loc, out_k, out_v, gather=True))  # fmt: skip
        return (out_k, out_v) if self._fire(plan, n, layer, lp, kp, vp, (loc, out_k, out_v)) else None
