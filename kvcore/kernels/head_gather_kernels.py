"""The head gather's Triton kernels (:mod:`kvcore.kernels.head_gather` launches them): a batch's keys and values
gathered into ``[batch, heads, seq, dim]``, converted on the way, and the same with a step's new rows stored first, in
one launch; and their argument lists (:class:`~kvcore.kernels.launch.KernelArgs`)."""

from __future__ import annotations

import triton
import triton.language as tl

from kvcore.kernels import dtypes
from kvcore.kernels.fp8 import (e4m3fn_bits_to_f32_hw, e5m2_bits_to_f32, f32_to_bf16_bits, f32_to_fp8_bits,
                               f32_to_fp8_bits_hw)  # fmt: skip
from kvcore.kernels.launch import KernelArgs

__all__ = ["GATHER_ARGS", "STORE_GATHER_ARGS"]

_SAME, _F32, _F16, _BF16 = (tl.constexpr(dtypes.SAME), tl.constexpr(dtypes.F32), tl.constexpr(dtypes.F16),
                            tl.constexpr(dtypes.BF16))  # fmt: skip
_E4M3FN, _E5M2 = tl.constexpr(dtypes.E4M3FN), tl.constexpr(dtypes.E5M2)


@triton.jit
def _widen(x, IN: tl.constexpr, HW_CVT: tl.constexpr):
    """Loaded values of code ``IN`` (fp8 as their bytes) -> float32, exactly (bf16 by a bit shift: the
    interpreter's cast mangles bf16 subnormals)."""
    if IN == _BF16:
        xf = (x.to(tl.int16, bitcast=True).to(tl.int32) << 16).to(tl.float32, bitcast=True)
    elif IN == _E4M3FN:
        xf = e4m3fn_bits_to_f32_hw(x, HW_CVT)
    elif IN == _E5M2:
        xf = e5m2_bits_to_f32(x)
    else:
        xf = x.to(tl.float32)
    return xf


@triton.jit
def _narrow(xf, OUT: tl.constexpr, HW_CVT: tl.constexpr):
    """float32 -> the output dtype, rounding to nearest even as torch does (bf16 by bits under the interpreter,
    whose cast truncates)."""
    if OUT == _BF16:
        if HW_CVT:
            y = xf.to(tl.bfloat16)
        else:
            y = f32_to_bf16_bits(xf).to(tl.int16).to(tl.bfloat16, bitcast=True)
    elif OUT == _F16:
        y = xf.to(tl.float16)
    else:
        y = xf
    return y


@triton.jit
def _of_heads(mask, h, HEADS: tl.constexpr, BLOCK_H: tl.constexpr):
    """A tile's ``mask`` (``[BLOCK_T, 1, BLOCK_D]``) at heads ``h`` (``[1, BLOCK_H, 1]``): limited to the heads that
    exist, or left to broadcast when ``BLOCK_H`` divides ``HEADS``."""
    if HEADS % BLOCK_H != 0:
        mask = mask & (h < HEADS)
    return mask


@triton.jit
def _gather_tile(src, out, loc, mask_t, b, t, out_len, page_stride, row_stride, head_stride, scale,
                 HEADS: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_H: tl.constexpr,
                 PAGE: tl.constexpr, IN: tl.constexpr, OUT: tl.constexpr, SCALED: tl.constexpr,
                 HW_CVT: tl.constexpr):  # fmt: skip
    """``BLOCK_H`` heads at a time, row ``b``'s tokens ``t`` (``mask_t``: those that exist) read from the cache at
    ``loc`` and handed on to ``out`` (rows of ``out_len`` tokens, :func:`_hand_on`); tiles ``[tokens, heads, dim]``."""
    d = tl.arange(0, BLOCK_D)[None, None, :]
    t3 = t[:, None, None]
    in_tile = mask_t[:, None, None] & (d < D)
    row = ((loc // PAGE) * page_stride + (loc % PAGE) * row_stride)[:, None, None]
    for h0 in range(0, HEADS, BLOCK_H):
        h = h0 + tl.arange(0, BLOCK_H)[None, :, None]
        mask = _of_heads(in_tile, h, HEADS, BLOCK_H)
        x = tl.load(src + row + h * head_stride + d, mask=mask, other=0)
        _hand_on(x, out, b, h, t3, d, out_len, mask, scale, HEADS, D, IN, OUT, SCALED, HW_CVT)


@triton.jit
def _hand_on(x, out, b, h, t, d, out_len, mask, scale, HEADS: tl.constexpr, D: tl.constexpr, IN: tl.constexpr,
             OUT: tl.constexpr, SCALED: tl.constexpr, HW_CVT: tl.constexpr):  # fmt: skip
    """Heads ``h``'s cache values ``x`` (code ``IN``) of row ``b``'s tokens ``t``, converted to the output dtype
    (times ``scale`` when ``SCALED``) and written to ``out[b, h, t]`` (``out``: ``[batch, HEADS, out_len, D]``,
    contiguous; ``h``, ``t`` and the dims ``d`` broadcast against ``x``)."""
    if IN != OUT:
        xf = _widen(x, IN, HW_CVT)
        if SCALED:
            xf = xf * scale
        x = _narrow(xf, OUT, HW_CVT)
    tl.store(out + ((b * HEADS + h) * out_len + t) * D + d, x, mask=mask)


@triton.jit
def _token_block(loc_ptr, loc_stride, seq, first_block, BLOCK_T: tl.constexpr):
    """This program's token block (grid axis 0, counted from ``first_block``) of batch row ``b`` (axis 1):
    ``(block index, b, positions t, which of them exist (< seq), their locations)``, the row's locations at
    ``loc_ptr + b * loc_stride``."""
    pid_t = tl.program_id(0) + first_block
    b = tl.program_id(1).to(tl.int64)
    t = pid_t.to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    mask_t = t < seq
    loc = tl.load(loc_ptr + b * loc_stride + t, mask=mask_t, other=0).to(tl.int64)
    return pid_t, b, t, mask_t, loc


@triton.jit(do_not_specialize=["seq", "loc_stride", "k_scale", "v_scale"])
def _gather_heads_kernel(
    k_ptr, v_ptr, k_out, v_out, loc_ptr, seq, loc_stride,
    k_page_stride, k_row_stride, k_head_stride, v_page_stride, v_row_stride, v_head_stride, k_scale, v_scale,
    HEADS: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_H: tl.constexpr, PAGE: tl.constexpr, BLOCK_T: tl.constexpr, IN: tl.constexpr, OUT: tl.constexpr,
    SCALED: tl.constexpr, HW_CVT: tl.constexpr,
):  # fmt: skip
    # grid: (token blocks, batch rows, 2: keys then values)
    _, b, t, mask_t, loc = _token_block(loc_ptr, loc_stride, seq, 0, BLOCK_T)
    if tl.program_id(2) == 0:
        _gather_tile(k_ptr, k_out, loc, mask_t, b, t, seq, k_page_stride, k_row_stride, k_head_stride, k_scale,
                     HEADS, DK, BLOCK_DK, BLOCK_H, PAGE, IN, OUT, SCALED, HW_CVT)  # fmt: skip
    else:
        _gather_tile(v_ptr, v_out, loc, mask_t, b, t, seq, v_page_stride, v_row_stride, v_head_stride, v_scale,
                     HEADS, DV, BLOCK_DV, BLOCK_H, PAGE, IN, OUT, SCALED, HW_CVT)  # fmt: skip


@triton.jit
def _encode(xf, CODE: tl.constexpr, SATURATE: tl.constexpr, HW_CVT: tl.constexpr):
    """float32 -> a cache dtype of code ``CODE`` as a store writes it (fp8 as its byte), rounding to nearest even
    as torch's ``.to`` does (bf16 and fp8 by bits under the interpreter, whose casts do not)."""
    if CODE == _F32:
        c = xf
    elif CODE == _F16:
        c = xf.to(tl.float16)
    elif CODE == _BF16:
        c = _narrow(xf, CODE, HW_CVT)
    elif HW_CVT:
        c = f32_to_fp8_bits_hw(xf, CODE, SATURATE).to(tl.uint8)
    else:
        c = f32_to_fp8_bits(xf, CODE, SATURATE).to(tl.uint8)
    return c


@triton.jit
def _store_gather_tile(src, out, new, loc, mask_t, b, t, out_len, prefix, page_stride, row_stride, head_stride, new_sb,
                       new_sh, new_sq, scale, HEADS: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
                       BLOCK_H: tl.constexpr, PAGE: tl.constexpr, IN: tl.constexpr, OUT: tl.constexpr,
                       STORE: tl.constexpr, SATURATE: tl.constexpr, SCALED: tl.constexpr,
                       HW_CVT: tl.constexpr):  # fmt: skip
    """:func:`_gather_tile` of a tile holding new tokens (positions ``prefix ..``): those are read from ``new``
    (``[batch, heads, q, D]``), written to the cache at their locations (converted as a store converts) and handed
    on from there, exactly what a store then a gather would read back."""
    d = tl.arange(0, BLOCK_D)[None, None, :]
    t3 = t[:, None, None]
    in_row = d < D
    fresh_t = mask_t & (t >= prefix)
    fresh = fresh_t[:, None, None]
    old = (mask_t & (t < prefix))[:, None, None] & in_row
    stored = fresh & in_row
    in_tile = mask_t[:, None, None] & in_row
    row = ((loc // PAGE) * page_stride + (loc % PAGE) * row_stride)[:, None, None]
    new_row = (b * new_sb + tl.where(fresh_t, t - prefix, 0) * new_sq)[:, None, None]
    for h0 in range(0, HEADS, BLOCK_H):
        h = h0 + tl.arange(0, BLOCK_H)[None, :, None]
        stored_h = _of_heads(stored, h, HEADS, BLOCK_H)
        at = src + row + h * head_stride + d
        x = tl.load(at, mask=_of_heads(old, h, HEADS, BLOCK_H), other=0)
        y = tl.load(new + new_row + h * new_sh + d, mask=stored_h, other=0)
        if STORE != _SAME:  # the store's conversion: float32, divided by the scale, rounded once
            yf = _widen(y, OUT, HW_CVT)  # the inputs have the output's dtype
            if SCALED:
                yf = tl.math.div_rn(yf, tl.zeros_like(yf) + scale)
            y = _encode(yf, STORE, SATURATE, HW_CVT)
        tl.store(at, y, mask=stored_h)
        _hand_on(tl.where(fresh, y, x), out, b, h, t3, d, out_len, _of_heads(in_tile, h, HEADS, BLOCK_H), scale,
                 HEADS, D, IN, OUT, SCALED, HW_CVT)  # fmt: skip


@triton.jit
def _store_gather_half(src, out, new, loc, mask_t, b, t, out_len, prefix, only_old, page_stride, row_stride,
                       head_stride, new_sb, new_sh, new_sq, scale, HEADS: tl.constexpr, D: tl.constexpr,
                       BLOCK_D: tl.constexpr, BLOCK_H: tl.constexpr, PAGE: tl.constexpr, IN: tl.constexpr,
                       OUT: tl.constexpr, STORE: tl.constexpr, SATURATE: tl.constexpr, SCALED: tl.constexpr,
                       HW_CVT: tl.constexpr):  # fmt: skip
    """One side (keys or values) of a store-and-gather tile: :func:`_gather_tile` when the block holds only older
    tokens (``only_old``), else :func:`_store_gather_tile`."""
    if only_old:
        _gather_tile(src, out, loc, mask_t, b, t, out_len, page_stride, row_stride, head_stride, scale, HEADS, D,
                     BLOCK_D, BLOCK_H, PAGE, IN, OUT, SCALED, HW_CVT)  # fmt: skip
    else:
        _store_gather_tile(src, out, new, loc, mask_t, b, t, out_len, prefix, page_stride, row_stride, head_stride,
                           new_sb, new_sh, new_sq, scale, HEADS, D, BLOCK_D, BLOCK_H, PAGE, IN, OUT, STORE, SATURATE,
                           SCALED, HW_CVT)  # fmt: skip


@triton.jit(do_not_specialize=["seq", "prefix", "loc_stride", "out_len", "first_block", "k_scale", "v_scale"])
def _store_gather_heads_kernel(
    k_ptr, v_ptr, k_out, v_out, loc_ptr, k_new, v_new, seq, prefix, loc_stride, out_len, first_block,
    k_new_sb, k_new_sh, k_new_sq, v_new_sb, v_new_sh, v_new_sq,
    k_page_stride, k_row_stride, k_head_stride, v_page_stride, v_row_stride, v_head_stride, k_scale, v_scale,
    HEADS: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_H: tl.constexpr, PAGE: tl.constexpr, BLOCK_T: tl.constexpr, IN: tl.constexpr, OUT: tl.constexpr,
    STORE: tl.constexpr, SATURATE: tl.constexpr, SCALED: tl.constexpr, HW_CVT: tl.constexpr,
):  # fmt: skip
    # grid: (token blocks from ``first_block`` on, batch rows, 2: keys then values); blocks wholly before ``prefix``
    # only gather.  The outputs are ``[batch, HEADS, out_len, D]``: ``out_len`` is ``seq``, or more for outputs kept
    # from step to step, whose blocks before ``first_block`` hold their tokens already
    pid_t, b, t, mask_t, loc = _token_block(loc_ptr, loc_stride, seq, first_block, BLOCK_T)
    only_old = (pid_t + 1) * BLOCK_T <= prefix
    if tl.program_id(2) == 0:
        _store_gather_half(k_ptr, k_out, k_new, loc, mask_t, b, t, out_len, prefix, only_old, k_page_stride,
                           k_row_stride, k_head_stride, k_new_sb, k_new_sh, k_new_sq, k_scale, HEADS, DK,
                           BLOCK_DK, BLOCK_H, PAGE, IN, OUT, STORE, SATURATE, SCALED, HW_CVT)  # fmt: skip
    else:
        _store_gather_half(v_ptr, v_out, v_new, loc, mask_t, b, t, out_len, prefix, only_old, v_page_stride,
                           v_row_stride, v_head_stride, v_new_sb, v_new_sh, v_new_sq, v_scale, HEADS, DV,
                           BLOCK_DV, BLOCK_H, PAGE, IN, OUT, STORE, SATURATE, SCALED, HW_CVT)  # fmt: skip


#: the gather kernel's argument list (:class:`kvcore.kernels.launch.KernelArgs`):
#: :func:`~kvcore.kernels.head_gather.gather_heads_triton` passes its tensors as tensors,
#: :class:`~kvcore.kernels.head_gather.HeadGather` their addresses
GATHER_ARGS = KernelArgs(
    _gather_heads_kernel,
    "k_ptr v_ptr k_out v_out loc_ptr seq loc_stride k_page_stride k_row_stride k_head_stride v_page_stride "
    "v_row_stride v_head_stride k_scale v_scale",
    "HEADS DK DV BLOCK_DK BLOCK_DV BLOCK_H PAGE BLOCK_T IN OUT SCALED HW_CVT",
    pointers="k_ptr v_ptr k_out v_out loc_ptr",
)


#: the store-and-gather kernel's: what a call reads, then what its plan fixes (the inputs' and the layers' strides,
#: the scales)
STORE_GATHER_ARGS = KernelArgs(
    _store_gather_heads_kernel,
    ("k_ptr v_ptr k_out v_out loc_ptr k_new v_new seq prefix loc_stride out_len first_block",
     "k_new_sb k_new_sh k_new_sq v_new_sb v_new_sh v_new_sq k_page_stride k_row_stride k_head_stride v_page_stride "
     "v_row_stride v_head_stride k_scale v_scale"),
    "HEADS DK DV BLOCK_DK BLOCK_DV BLOCK_H PAGE BLOCK_T IN OUT STORE SATURATE SCALED HW_CVT",
    pointers="k_ptr v_ptr k_out v_out loc_ptr k_new v_new",
)  # fmt: skip
