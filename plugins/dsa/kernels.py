"""Hot-path kernels of the DSA pool: the fp8 latent row (quantize+store, dequantizing gather) and the indexer pages.

Row formats are described in :mod:`kvcore_dsa.layout`.  Every kernel has a torch reference of the same
signature beside it (``*_native``); the pool picks one (see ``kvcore.kernels.kernel_mode``).  All offsets are int64.

Quantization, exactly as the torch references compute it (and so the Triton kernels, bit for bit)::

    amax  = max |x| over the 128 values of a tile, in float32
    scale = max(amax / 448, 2**-126)                       IEEE division; the clamp is the zero-tile guard
    q     = e4m3fn(x / scale)                              IEEE division, round to nearest even
    x'    = float32(q) * scale                             dequantization (then cast to the asked dtype)

The kernels divide exactly as IEEE division does (Triton's ``/`` is an approximate division on GPUs; see
``_divide_rn``) and the references divide by device tensors (torch's CUDA division by a host scalar
multiplies by its reciprocal instead).  fp8 and bf16 encodings go through :mod:`kvcore.kernels.fp8`'s integer
encoders under the interpreter (whose float->fp8 and float->bf16 casts round wrongly) and through the
hardware conversion when compiled.  NaN and infinite inputs are outside the contract (a GPU's max ignores
NaN, torch's amax propagates it), and so are float32 subnormal inputs on a GPU that flushes them (the scale
itself is never subnormal: see the zero-tile guard).

``store_dsa_fp8_triton``
    Grid ``(token blocks,)``: a program loads the nope values of ``BLOCK_N`` tokens as ``[BLOCK_N, tiles,
    128]``, computes each tile's scale, and writes whole rows: the fp8 bytes, the float32 scales and the rope
    converted to bf16.  Inputs may be strided (views of a fused projection).
``gather_dsa_fp8_triton``
    The inverse for the rows ``loc`` only: fp8 * scale and bf16 rope, converted to float32/float16/bfloat16.
    Compiled, fp8 bytes decode through the hardware conversion; it differs from torch's decode only in the
    bits of a NaN, a byte the store never writes.
``set_index_k_triton`` / ``get_index_k_triton``
    Token-granular writes into / sequence-ordered reads out of the page-indexed indexer buffer.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import triton
import triton.language as tl

from kvcore.kernels.fp8 import (
    e4m3fn_bits_to_f32_hw,
    f32_to_bf16_bits,
    f32_to_e4m3fn_bits,
    torch_e4m3fn_saturates,
)
from kvcore.kernels import dtypes
from kvcore.kernels.dtypes import E4M3FN_MAX
from kvcore.kernels.launch import UNPLANNED, Launcher, Plan, remember
from kvcore.kernels.kernel_mode import triton_interpreting
from kvcore.pools import empty_of
from kvcore.kernels.row_move import next_pow2
from kvcore_dsa.layout import (
    INDEX_PAGE_SIZE,
    INDEX_SCALE_BYTES,
    QUANT_BLOCK_SIZE,
    ROPE_STORAGE_DTYPE,
    SCALE_MIN,
    index_page_bytes_of,
    scaled_row_bytes,
)

__all__ = [
    "IndexerPages",
    "ScaledRows",
    "dequantize_rows",
    "gather_dsa_fp8_native",
    "gather_dsa_fp8_triton",
    "get_index_k_native",
    "get_index_k_triton",
    "quantize_concatenated",
    "quantize_parts",
    "set_index_k_native",
    "set_index_k_triton",
    "store_dsa_fp8_native",
    "store_dsa_fp8_triton",
]

_FLOAT_INPUTS = (torch.float32, torch.float16, torch.bfloat16)
_E4M3FN_MAX = tl.constexpr(E4M3FN_MAX)
_F32 = tl.constexpr(dtypes.F32)
_F16 = tl.constexpr(dtypes.F16)
_BF16 = tl.constexpr(dtypes.BF16)

# Tokens per program (powers of two) and warps, per kernel; a store/gather program handles whole rows.
# Measured on an H200 (benchmarks/tune_mla_dsa.py): the store is fastest at about 32 values per thread.
_STORE_BLOCK_N = 2
_STORE_NUM_WARPS = 1
_GATHER_BLOCK_N = 16
_GATHER_NUM_WARPS = 2
_INDEX_BLOCK_N = 32  # x (128 key bytes + 4 scale bytes) per program
_INDEX_NUM_WARPS = 4


# ==========================================================================================================
# torch references: quantize / dequantize
# ==========================================================================================================


def _tile_scales(nope_f32: torch.Tensor) -> torch.Tensor:
    """[N, T, 128] float32 -> [N, T] float32 scales, ``max(amax / 448, 2**-126)``."""
    amax = nope_f32.abs().amax(dim=-1)
    # Divide by a tensor, not a Python number: torch's CUDA division by a host scalar multiplies by the
    # reciprocal, which is not the IEEE quotient.
    scale = amax / torch.full_like(amax, E4M3FN_MAX)
    return torch.maximum(scale, torch.full_like(scale, SCALE_MIN))


def quantize_parts(nope: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
    """Torch reference: ``nope`` [N, R] and ``rope`` [N, Dr] (float32/float16/bfloat16) -> [N, row] uint8 rows."""
    n, r = nope.shape
    if r % QUANT_BLOCK_SIZE:
        raise ValueError(f"the nope width {r} must be a multiple of {QUANT_BLOCK_SIZE}")
    tiles = nope.float().reshape(n, r // QUANT_BLOCK_SIZE, QUANT_BLOCK_SIZE)
    scale = _tile_scales(tiles)
    q = (tiles / scale.unsqueeze(-1)).to(torch.float8_e4m3fn).view(torch.uint8).reshape(n, r)
    rope_bytes = rope.to(ROPE_STORAGE_DTYPE).contiguous().view(torch.uint8).reshape(n, -1)
    return torch.cat([q, scale.contiguous().view(torch.uint8).reshape(n, -1), rope_bytes], dim=1)


def quantize_concatenated(row: torch.Tensor, kv_lora_rank: int = 512) -> torch.Tensor:
    """Torch reference of the DSA fp8 row: quantize concatenated ``[..., kv_lora_rank + rope]`` latent rows.

    :param row: ``[..., kv_lora_rank + qk_rope_head_dim]`` float32/float16/bfloat16 (e.g. ``[N, 1, 576]``).
    :returns: ``[..., row_bytes]`` uint8 (656 bytes for 512 + 64): fp8 nope, float32 tile scales, bf16 rope;
        see the module docstring for the arithmetic.
    """
    lead = row.shape[:-1]
    flat = row.reshape(-1, row.shape[-1])
    out = quantize_parts(flat[:, :kv_lora_rank], flat[:, kv_lora_rank:])
    return out.reshape(*lead, out.shape[-1])


def dequantize_rows(
    rows: torch.Tensor, kv_lora_rank: int, qk_rope_head_dim: int, dst_dtype: torch.dtype = torch.bfloat16
) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch reference of the dequantization: ``[N, row_bytes]`` uint8 -> (nope [N, R], rope [N, Dr]) in ``dst_dtype``."""
    n = rows.shape[0]
    tiles = kv_lora_rank // QUANT_BLOCK_SIZE
    q = rows[:, :kv_lora_rank].contiguous().view(torch.float8_e4m3fn).float().reshape(n, tiles, QUANT_BLOCK_SIZE)
    scale = rows[:, kv_lora_rank : kv_lora_rank + 4 * tiles].contiguous().view(torch.float32)
    nope = (q * scale.unsqueeze(-1)).reshape(n, kv_lora_rank).to(dst_dtype)
    start = kv_lora_rank + 4 * tiles
    rope = rows[:, start : start + 2 * qk_rope_head_dim].contiguous().view(ROPE_STORAGE_DTYPE).to(dst_dtype)
    return nope, rope


# ==========================================================================================================
# quantize + store
# ==========================================================================================================

_LIFT_BELOW = tl.constexpr(2.0**-60)  # scales below this are lifted by _LIFT before dividing (_divide_rn)
_LIFT = tl.constexpr(2.0**64)


@triton.jit
def _tile_scale(amax, SCALE_MIN: tl.constexpr):
    """max(amax / 448, SCALE_MIN), the IEEE quotient (``/`` is approximate on GPUs)."""
    scale = tl.math.div_rn(amax, tl.zeros_like(amax) + _E4M3FN_MAX)
    return tl.maximum(scale, tl.zeros_like(scale) + SCALE_MIN)  # the zero-tile guard


@triton.jit
def _divide_rn(x, scale, HW_CVT: tl.constexpr):
    """``x / scale`` rounded to nearest even, as IEEE division; ``scale`` broadcasts against ``x``.

    Compiled, this costs one reciprocal per tile and a multiply and two fma corrections per value instead of
    a full division per value: with ``r = RN(1 / d)``, ``q0 = RN(x * r)`` is within 1.5 ulp of ``x / d``;
    ``q1 = RN(q0 + RN(x - q0 d) r)`` (the residual is exact in an fma) is then faithful, and the second
    correction gives ``RN(x / d)`` by Markstein's theorem.  The residuals stay exact only while they are
    normal numbers, so a scale below 2**-60 and its tile are first multiplied by 2**64 (exact for both and
    the same quotient).  A zero keeps its sign (the corrections would make -0 into +0).  Checked against
    torch's division on an H200 for every finite bf16 value and for quotients next to every e4m3 rounding
    midpoint (``test_divide_rn_equals_ieee_division``).  Under the interpreter it is plain ``div_rn``."""
    if HW_CVT:
        lift = tl.where(scale < _LIFT_BELOW, _LIFT, 1.0)
        d = scale * lift
        r = tl.math.div_rn(tl.zeros_like(d) + 1.0, d)
        xs = x * lift
        q = xs * r
        q = tl.fma(tl.fma(-q, d, xs), r, q)
        q = tl.fma(tl.fma(-q, d, xs), r, q)
        q = tl.where(xs == 0.0, xs, q)
    else:
        q = tl.math.div_rn(x, tl.zeros_like(x) + scale)
    return q


@triton.jit
def _e4m3_bits(q, SATURATE: tl.constexpr, HW_CVT: tl.constexpr):
    """Finite quotients (|q| < 464) -> float8_e4m3fn bytes as torch rounds them; compiled, the bare hardware
    conversion (torch's overflow and NaN rules never apply to a quotient by the tile's own scale)."""
    if HW_CVT:
        bits = q.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
    else:
        bits = f32_to_e4m3fn_bits(q, SATURATE).to(tl.uint8)
    return bits


@triton.jit
def _row_block(
    loc_ptr, loc_stride, n_tokens, layer, LAYER_BYTES: tl.constexpr, ROW_BYTES: tl.constexpr,
    KV_LORA: tl.constexpr, NUM_TILES: tl.constexpr, TILES_PAD: tl.constexpr, TILE: tl.constexpr,
    BLOCK_N: tl.constexpr,
):  # fmt: skip
    """This program's ``BLOCK_N`` tokens: (token index, token mask, byte offset of each row, nope columns
    ``[0, TILES_PAD * TILE)``, and the mask of real tokens x nope columns)."""
    offs_n = (tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    mask_n = offs_n < n_tokens
    rows = tl.load(loc_ptr + offs_n * loc_stride, mask=mask_n, other=0).to(tl.int64)
    base = layer.to(tl.int64) * LAYER_BYTES + rows * ROW_BYTES
    cols = tl.arange(0, TILES_PAD * TILE)
    if NUM_TILES == TILES_PAD:
        mask = mask_n[:, None]
    else:
        mask = mask_n[:, None] & (cols < KV_LORA)[None, :]
    return offs_n, mask_n, base, cols, mask


@triton.jit(do_not_specialize=["layer", "loc_stride", "n_tokens"])
def _store_dsa_fp8_kernel(
    cache_u8,
    cache_i16,
    cache_f32,
    layer,
    nope_ptr,
    rope_ptr,
    loc_ptr,
    loc_stride,
    n_tokens,
    nope_sn,
    nope_sd,
    rope_sn,
    rope_sd,
    KV_LORA: tl.constexpr,
    ROPE_DIM: tl.constexpr,
    ROPE_PAD: tl.constexpr,
    LAYER_BYTES: tl.constexpr,
    ROW_BYTES: tl.constexpr,
    NUM_TILES: tl.constexpr,
    TILES_PAD: tl.constexpr,
    TILE: tl.constexpr,
    ROPE_BF16: tl.constexpr,
    SCALE_MIN: tl.constexpr,
    SATURATE: tl.constexpr,
    HW_CVT: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """One program writes whole rows of ``BLOCK_N`` tokens: every tile's fp8 bytes and scale, and the rope.
    LAYER_BYTES and ROW_BYTES are in bytes; the int16/float32 views of the same cache are addressed in
    their own elements (offsets divided by 2 / 4: rows, the scales and the rope start stay aligned).  Tiles
    are padded to a power of two (TILES_PAD) and the padding masked."""
    offs_n, mask_n, base, cols, mask = _row_block(
        loc_ptr, loc_stride, n_tokens, layer, LAYER_BYTES, ROW_BYTES, KV_LORA, NUM_TILES, TILES_PAD, TILE, BLOCK_N
    )
    x = tl.load(nope_ptr + offs_n[:, None] * nope_sn + cols[None, :].to(tl.int64) * nope_sd,
                mask=mask, other=0.0).to(tl.float32)  # fmt: skip
    x3 = tl.reshape(x, (BLOCK_N, TILES_PAD, TILE))
    scale = _tile_scale(tl.max(tl.abs(x3), axis=2), SCALE_MIN)
    q = tl.reshape(_divide_rn(x3, scale[:, :, None], HW_CVT), (BLOCK_N, TILES_PAD * TILE))
    tl.store(cache_u8 + base[:, None] + cols[None, :], _e4m3_bits(q, SATURATE, HW_CVT), mask=mask)
    t = tl.arange(0, TILES_PAD)
    tl.store(cache_f32 + ((base + KV_LORA) // 4)[:, None] + t[None, :], scale,
             mask=mask_n[:, None] & (t < NUM_TILES)[None, :])  # fmt: skip
    r_d = tl.arange(0, ROPE_PAD)
    r_mask = mask_n[:, None] & (r_d < ROPE_DIM)[None, :]
    r_x = tl.load(rope_ptr + offs_n[:, None] * rope_sn + r_d[None, :].to(tl.int64) * rope_sd, mask=r_mask, other=0)
    if ROPE_BF16:
        r_bits = r_x.to(tl.int16, bitcast=True)
    else:
        r_xf = r_x.to(tl.float32)
        if HW_CVT:
            r_bits = r_xf.to(tl.bfloat16).to(tl.int16, bitcast=True)
        else:
            r_bits = f32_to_bf16_bits(r_xf).to(tl.int16)
    r_dst = (base + KV_LORA + NUM_TILES * 4) // 2
    tl.store(cache_i16 + r_dst[:, None] + r_d[None, :], r_bits, mask=r_mask)


# ==========================================================================================================
# dequantizing gather
# ==========================================================================================================


@triton.jit
def _store_converted(ptr, xf, mask, OUT: tl.constexpr, HW_CVT: tl.constexpr):
    if OUT == _F32:
        tl.store(ptr, xf, mask=mask)
    elif OUT == _F16:
        tl.store(ptr, xf.to(tl.float16), mask=mask)
    else:
        if HW_CVT:
            tl.store(ptr, xf.to(tl.bfloat16), mask=mask)
        else:
            tl.store(ptr, f32_to_bf16_bits(xf).to(tl.int16).to(tl.bfloat16, bitcast=True), mask=mask)


@triton.jit(do_not_specialize=["layer", "loc_stride", "n_tokens"])
def _gather_dsa_fp8_kernel(
    cache_u8,
    cache_i16,
    cache_f32,
    layer,
    loc_ptr,
    loc_stride,
    n_tokens,
    nope_out,
    rope_out,
    KV_LORA: tl.constexpr,
    ROPE_DIM: tl.constexpr,
    ROPE_PAD: tl.constexpr,
    LAYER_BYTES: tl.constexpr,
    ROW_BYTES: tl.constexpr,
    NUM_TILES: tl.constexpr,
    TILES_PAD: tl.constexpr,
    TILE: tl.constexpr,
    OUT: tl.constexpr,
    HW_CVT: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """One program reads whole rows of ``BLOCK_N`` tokens."""
    offs_n, mask_n, base, cols, mask = _row_block(
        loc_ptr, loc_stride, n_tokens, layer, LAYER_BYTES, ROW_BYTES, KV_LORA, NUM_TILES, TILES_PAD, TILE, BLOCK_N
    )
    b = tl.load(cache_u8 + base[:, None] + cols[None, :], mask=mask, other=0)
    t = tl.arange(0, TILES_PAD)
    s = tl.load(cache_f32 + ((base + KV_LORA) // 4)[:, None] + t[None, :],
                mask=mask_n[:, None] & (t < NUM_TILES)[None, :], other=0.0)  # fmt: skip
    x3 = tl.reshape(e4m3fn_bits_to_f32_hw(b, HW_CVT), (BLOCK_N, TILES_PAD, TILE)) * s[:, :, None]
    xf = tl.reshape(x3, (BLOCK_N, TILES_PAD * TILE))
    _store_converted(nope_out + offs_n[:, None] * KV_LORA + cols[None, :], xf, mask, OUT, HW_CVT)
    r_d = tl.arange(0, ROPE_PAD)
    r_mask = mask_n[:, None] & (r_d < ROPE_DIM)[None, :]
    r_bits = tl.load(cache_i16 + ((base + KV_LORA + NUM_TILES * 4) // 2)[:, None] + r_d[None, :], mask=r_mask, other=0)
    r_dst = rope_out + offs_n[:, None] * ROPE_DIM + r_d[None, :]
    if OUT == _BF16:
        tl.store(r_dst, r_bits.to(tl.bfloat16, bitcast=True), mask=r_mask)
    else:
        r_xf = ((r_bits.to(tl.int32) & 0xFFFF) << 16).to(tl.float32, bitcast=True)
        _store_converted(r_dst, r_xf, r_mask, OUT, HW_CVT)


# ==========================================================================================================
# indexer pages
# ==========================================================================================================


@triton.jit(do_not_specialize=["layer", "loc_stride", "n_tokens"])
def _set_index_k_kernel(
    buf_ptr,
    layer,
    loc_ptr,
    loc_stride,
    n_tokens,
    k_ptr,
    k_sn,
    k_sd,
    s_ptr,
    s_sn,
    s_sd,
    PAGE: tl.constexpr,
    LAYER_BYTES: tl.constexpr,
    PAGE_BYTES: tl.constexpr,
    KEY_BYTES: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    offs_n = (tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    mask_n = offs_n < n_tokens
    loc = tl.load(loc_ptr + offs_n * loc_stride, mask=mask_n, other=0).to(tl.int64)
    page_base = layer.to(tl.int64) * LAYER_BYTES + (loc // PAGE) * PAGE_BYTES
    slot = loc % PAGE
    cols = tl.arange(0, KEY_BYTES)
    k = tl.load(k_ptr + offs_n[:, None] * k_sn + cols[None, :].to(tl.int64) * k_sd, mask=mask_n[:, None])
    tl.store(buf_ptr + (page_base + slot * KEY_BYTES)[:, None] + cols[None, :], k, mask=mask_n[:, None])
    if HAS_SCALE:
        j = tl.arange(0, 4)
        s = tl.load(s_ptr + offs_n[:, None] * s_sn + j[None, :].to(tl.int64) * s_sd, mask=mask_n[:, None])
        dst = page_base + PAGE * KEY_BYTES + slot * 4
        tl.store(buf_ptr + dst[:, None] + j[None, :], s, mask=mask_n[:, None])


@triton.jit(do_not_specialize=["layer", "page_stride", "seq_len"])
def _get_index_k_kernel(
    buf_ptr,
    layer,
    page_ptr,
    page_stride,
    seq_len,
    k_out,
    s_out,
    PAGE: tl.constexpr,
    LAYER_BYTES: tl.constexpr,
    PAGE_BYTES: tl.constexpr,
    KEY_BYTES: tl.constexpr,
    WANT_K: tl.constexpr,
    WANT_S: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    i = (tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    mask_n = i < seq_len
    page = tl.load(page_ptr + (i // PAGE) * page_stride, mask=mask_n, other=0).to(tl.int64)
    page_base = layer.to(tl.int64) * LAYER_BYTES + page * PAGE_BYTES
    slot = i % PAGE
    if WANT_K:
        cols = tl.arange(0, KEY_BYTES)
        k = tl.load(buf_ptr + (page_base + slot * KEY_BYTES)[:, None] + cols[None, :], mask=mask_n[:, None])
        tl.store(k_out + i[:, None] * KEY_BYTES + cols[None, :], k, mask=mask_n[:, None])
    if WANT_S:
        j = tl.arange(0, 4)
        src = page_base + PAGE * KEY_BYTES + slot * 4
        s = tl.load(buf_ptr + src[:, None] + j[None, :], mask=mask_n[:, None])
        tl.store(s_out + i[:, None] * 4 + j[None, :], s, mask=mask_n[:, None])


# ==========================================================================================================
# The pool's view: both caches bound once, the Triton kernels or their torch references
# ==========================================================================================================


def _geometry(x: torch.Tensor, width: int, n: int, what: str) -> tuple[int, int]:
    """(token stride, column stride) of an ``[N, width]`` or ``[N, 1, width]`` tensor, from its shape and strides
    (no view: a view costs a microsecond of host time)."""
    shape, stride = x.shape, x.stride()
    if len(shape) == 3 and shape[1] == 1 and shape[0] == n and shape[2] == width:
        return stride[0], stride[2]
    if len(shape) == 2 and shape[0] == n and shape[1] == width:
        return stride[0], stride[1]
    raise ValueError(f"{what} must be [{n}, {width}] or [{n}, 1, {width}], got {tuple(shape)}")


def _check_loc(loc: torch.Tensor) -> int:
    loc_dtype = loc.dtype
    if loc.dim() != 1 or (loc_dtype is not torch.int32 and loc_dtype is not torch.int64):
        raise ValueError(f"loc must be a 1-D int32/int64 tensor, got {loc_dtype} {tuple(loc.shape)}")
    return loc.shape[0]


def _check_device(device_index: int, device: torch.device, **tensors: torch.Tensor) -> None:
    """Raises unless every tensor is on the device (hot paths pass addresses, which the driver cannot check)."""
    for name, t in tensors.items():
        if t.get_device() != device_index:
            raise ValueError(f"{name} is on {t.device}, the cache on {device}")


class ScaledRows:
    """The quantize-store and dequantize-gather of one pool's scaled fp8 rows (see the module docstring):
    the Triton kernels (``use_triton``) or their torch references, sharing the checks; what is fixed at pool
    creation (views of the cache, constexprs, launchers) is computed once.

    :param kv_cache: contiguous uint8 ``[L, R, 1, scaled_row_bytes(kv_lora_rank, qk_rope_head_dim)]``.
    """

    def __init__(self, kv_cache: torch.Tensor, kv_lora_rank: int, qk_rope_head_dim: int, use_triton: bool = True):
        width = scaled_row_bytes(kv_lora_rank, qk_rope_head_dim)
        if kv_cache.dtype != torch.uint8 or kv_cache.dim() != 4 or kv_cache.shape[2] != 1 or kv_cache.shape[3] != width:
            raise ValueError(f"kv_cache must be uint8 [L, R, 1, {width}], got {kv_cache.dtype} {tuple(kv_cache.shape)}")
        if not kv_cache.is_contiguous():
            raise ValueError("kv_cache must be contiguous")
        if kv_lora_rank % QUANT_BLOCK_SIZE or qk_rope_head_dim % 2:
            raise ValueError(
                f"kv_lora_rank={kv_lora_rank} must be a multiple of {QUANT_BLOCK_SIZE} and qk_rope_head_dim="
                f"{qk_rope_head_dim} even (float32 scales and bf16 rope stay aligned)"
            )
        self.kv_cache, self.kv_lora_rank, self.qk_rope_head_dim = kv_cache, kv_lora_rank, qk_rope_head_dim
        self.use_triton, self.layers = use_triton, kv_cache.shape[0]
        self._views = (kv_cache, kv_cache.view(torch.int16), kv_cache.view(torch.float32))
        tiles = kv_lora_rank // QUANT_BLOCK_SIZE
        # KV_LORA, ROPE_DIM, ROPE_PAD, LAYER_BYTES, ROW_BYTES, NUM_TILES, TILES_PAD, TILE
        self._dims = (kv_lora_rank, qk_rope_head_dim, next_pow2(qk_rope_head_dim), kv_cache.stride(0), width, tiles,
                      next_pow2(tiles), QUANT_BLOCK_SIZE)  # fmt: skip
        self._saturate, self._hw_cvt = torch_e4m3fn_saturates(), not triton_interpreting()
        views = ("cache_u8", "cache_i16", "cache_f32")
        self._store = Launcher(_store_dsa_fp8_kernel, kv_cache.device, (*views, "nope_ptr", "rope_ptr", "loc_ptr"))
        self._gather = Launcher(_gather_dsa_fp8_kernel, kv_cache.device, (*views, "loc_ptr", "nope_out", "rope_out"))
        self._view_ptrs = (kv_cache.data_ptr(),) * 3
        self.device, self._device_index = kv_cache.device, kv_cache.get_device()
        self._store_plans: dict[tuple, Plan | None] = {}
        self._gather_plans: dict[tuple, Plan | None] = {}
        self._new_plans: dict[tuple, Plan | None] = {}
        self._empties: dict[torch.dtype, torch.Tensor] = {}

    def _check_layer(self, layer_index: int) -> None:
        if not 0 <= layer_index < self.layers:
            raise ValueError(f"layer_index {layer_index} out of range for {self.layers} layers")

    def _check_store(self, loc: torch.Tensor, cache_k_nope: torch.Tensor, cache_k_rope: torch.Tensor
                     ) -> tuple[int, tuple[int, int], tuple[int, int]]:  # fmt: skip
        """(rows, nope strides, rope strides) of a store, checked."""
        n = _check_loc(loc)
        nope_s = _geometry(cache_k_nope, self.kv_lora_rank, n, "cache_k_nope")
        rope_s = _geometry(cache_k_rope, self.qk_rope_head_dim, n, "cache_k_rope")
        nope_dtype, rope_dtype = cache_k_nope.dtype, cache_k_rope.dtype
        if nope_dtype not in _FLOAT_INPUTS or rope_dtype not in _FLOAT_INPUTS:
            name, dtype = ("cache_k_nope", nope_dtype) if nope_dtype not in _FLOAT_INPUTS else ("cache_k_rope", rope_dtype)
            raise ValueError(f"{name} must be float32/float16/bfloat16 to be quantized, got {dtype}")
        return n, nope_s, rope_s

    def _check_gather(self, loc: torch.Tensor, nope_out: torch.Tensor, rope_out: torch.Tensor) -> int:
        n = _check_loc(loc)
        for name, t, w in (("nope_out", nope_out, self.kv_lora_rank), ("rope_out", rope_out, self.qk_rope_head_dim)):
            if t.numel() != n * w or not t.is_contiguous():
                raise ValueError(f"{name} must be contiguous with {n} x {w} elements, got {tuple(t.shape)}")
            if t.dtype not in _FLOAT_INPUTS:
                raise ValueError(f"{name} must be float32/float16/bfloat16, got {t.dtype}")
        if nope_out.dtype != rope_out.dtype:
            raise ValueError(f"nope_out and rope_out must share a dtype, got {nope_out.dtype} and {rope_out.dtype}")
        return n

    def store(self, layer_index: int, loc: torch.Tensor, cache_k_nope: torch.Tensor, cache_k_rope: torch.Tensor) -> None:
        """See :func:`store_dsa_fp8_triton`.  Checked and planned once per call signature (:mod:`kvcore.kernels.launch`)."""
        nope, rope = cache_k_nope, cache_k_rope
        if not self.use_triton:
            self._check_layer(layer_index)
            n = self._check_store(loc, nope, rope)[0]
            if n:
                self.kv_cache[layer_index, loc.long(), 0] = quantize_parts(nope.reshape(n, self.kv_lora_rank),
                                                                           rope.reshape(n, -1))  # fmt: skip
            return
        np_, rp, lp, n, ns, rs = nope.data_ptr(), rope.data_ptr(), loc.data_ptr(), loc.numel(), nope.shape, rope.shape
        signature = ((n - 1).bit_length() if n else -1, loc.stride(), loc.dtype, loc.get_device(), lp & 15, ns[1:],
                     nope.stride(), nope.dtype, nope.get_device(), np_ & 15, rs[1:], rope.stride(), rope.dtype,
                     rope.get_device(), rp & 15)  # fmt: skip
        plan = self._store_plans.get(signature, UNPLANNED)
        if plan is UNPLANNED or ns[0] != n or rs[0] != n:  # a first call, or parts of another count (refused)
            plan = remember(self._store_plans, signature, self._plan_store(loc, nope, rope))
        if not 0 <= layer_index < self.layers:
            self._check_layer(layer_index)
        if plan is not None:
            loc_stride, rest = plan.fixed
            plan(n, (*self._view_ptrs, layer_index, np_, rp, lp, loc_stride, n, *rest), (*self._views, nope, rope, loc))

    def _plan_store(self, loc, nope, rope) -> Plan | None:
        n, nope_s, rope_s = self._check_store(loc, nope, rope)
        if n == 0:
            return None
        dev = self._device_index
        if loc.get_device() != dev or nope.get_device() != dev or rope.get_device() != dev:
            _check_device(dev, self.device, loc=loc, cache_k_nope=nope, cache_k_rope=rope)
        block_n = min(_STORE_BLOCK_N, next_pow2(n))
        key = (nope.dtype, rope.dtype, nope_s, rope_s, nope.data_ptr() & 15, rope.data_ptr() & 15, loc.dtype,
               loc.data_ptr() & 15, block_n)  # fmt: skip
        fixed = (loc.stride(0), (*nope_s, *rope_s, *self._dims, rope.dtype == torch.bfloat16, SCALE_MIN,
                                 self._saturate, self._hw_cvt, block_n))  # fmt: skip
        return Plan(self._store, key, block_n, (1, 1), _STORE_NUM_WARPS, fixed)

    def gather(self, layer_index: int, loc: torch.Tensor, nope_out: torch.Tensor, rope_out: torch.Tensor,
               check: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None] | None = None) -> None:  # fmt: skip
        """See :func:`gather_dsa_fp8_triton`.  Checked and planned once per call signature; ``check(loc,
        nope_out, rope_out)``, when given, is a caller's own check of the outputs, run with this one's."""
        a, b = nope_out, rope_out
        if not self.use_triton:
            self._check_layer(layer_index)
            if check is not None:
                check(loc, a, b)
            n = self._check_gather(loc, a, b)
            if n:
                rows = self.kv_cache[layer_index].index_select(0, loc.long())[:, 0]
                nope, rope = dequantize_rows(rows, self.kv_lora_rank, self.qk_rope_head_dim, a.dtype)
                a.view(n, self.kv_lora_rank).copy_(nope)
                b.view(n, self.qk_rope_head_dim).copy_(rope)
            return
        lp, ap, bp, n, as_, bs = loc.data_ptr(), a.data_ptr(), b.data_ptr(), loc.numel(), a.shape, b.shape
        signature = (check, (n - 1).bit_length() if n else -1, loc.stride(), loc.dtype, loc.get_device(), lp & 15,
                     as_[1:], a.stride(), a.dtype, a.get_device(), ap & 15, bs[1:], b.stride(), b.dtype, b.get_device(),
                     bp & 15)  # fmt: skip
        plan = self._gather_plans.get(signature, UNPLANNED)
        if plan is UNPLANNED or as_[0] != n or bs[0] != n:  # a first call, or outputs of another count (refused)
            if check is not None:
                check(loc, a, b)
            n = self._check_gather(loc, a, b)
            _check_device(self._device_index, self.device, loc=loc, nope_out=a, rope_out=b)
            plan = remember(self._gather_plans, signature,
                            self._plan_gather(n, loc.dtype, lp, ap, bp, a.dtype, loc.stride(0)))  # fmt: skip
        self._fire_gather(plan, n, layer_index, lp, ap, bp, loc, a, b)

    def _plan_gather(self, n: int, loc_dtype, lp: int, ap: int, bp: int, dtype, loc_stride: int) -> Plan | None:
        if n == 0:
            return None
        block_n = min(_GATHER_BLOCK_N, next_pow2(n))
        out = dtypes.dtype_code(dtype)
        key = (out, ap & 15, bp & 15, loc_dtype, lp & 15, block_n)
        return Plan(self._gather, key, block_n, (1, 1), _GATHER_NUM_WARPS,
                    (loc_stride, (*self._dims, out, self._hw_cvt, block_n)))  # fmt: skip

    def _fire_gather(self, plan: Plan | None, n: int, layer_index: int, lp: int, ap: int, bp: int, loc, a, b) -> None:
        if not 0 <= layer_index < self.layers:
            self._check_layer(layer_index)
        if plan is not None:
            loc_stride, tail = plan.fixed
            plan(n, (*self._view_ptrs, layer_index, lp, loc_stride, n, ap, bp, *tail), (*self._views, loc, a, b))

    def gather_new(self, layer_index: int, loc: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows ``loc`` dequantized into two new contiguous tensors ``[N, 1, kv_lora_rank]`` and
        ``[N, 1, qk_rope_head_dim]`` of ``dtype`` (float32/float16/bfloat16).  Planned once per signature; new
        outputs are 16-byte aligned (the caching allocator's blocks are), which the plan takes for granted and
        checks."""
        shape = loc.shape
        if len(shape) != 1:
            _check_loc(loc)
        if dtype not in _FLOAT_INPUTS:
            raise ValueError(f"dequantized rows must be float32/float16/bfloat16, got {dtype}")
        n, r, p = shape[0], self.kv_lora_rank, self.qk_rope_head_dim
        empty = self._empties.get(dtype)
        if empty is None:
            empty = empty_of(self._empties, dtype, self.device)
        nope = empty.new_empty_strided((n, 1, r), (r, r, 1))
        rope = empty.new_empty_strided((n, 1, p), (p, p, 1))
        if not self.use_triton:
            self.gather(layer_index, loc, nope, rope)
            return nope, rope
        lp, ap, bp = loc.data_ptr(), nope.data_ptr(), rope.data_ptr()
        signature = ((n - 1).bit_length() if n else -1, loc.stride(), loc.dtype, loc.get_device(), lp & 15, dtype)
        plan = self._new_plans.get(signature, UNPLANNED)
        if plan is UNPLANNED or (ap | bp) & 15:
            _check_loc(loc)
            if loc.get_device() != self._device_index:
                _check_device(self._device_index, self.device, loc=loc)
            plan = self._plan_gather(n, loc.dtype, lp, ap, bp, dtype, loc.stride(0))
            if not (ap | bp) & 15:  # (a plan of unaligned outputs is used once, and forgotten at the next miss)
                remember(self._new_plans, signature, plan)
        self._fire_gather(plan, n, layer_index, lp, ap, bp, loc, nope, rope)
        return nope, rope


def _key_bytes(index_k: torch.Tensor) -> torch.Tensor:
    """[N, D] keys of any dtype -> [N, D * itemsize] uint8 (a view when the last dim is packed)."""
    if index_k.dim() == 3 and index_k.shape[1] == 1:
        index_k = index_k[:, 0]
    if index_k.dim() != 2:
        raise ValueError(f"index_k must be [N, D], got {tuple(index_k.shape)}")
    if index_k.stride(1) != 1:
        index_k = index_k.contiguous()
    return index_k if index_k.dtype == torch.uint8 else index_k.view(torch.uint8)


def _scale_bytes(index_k_scale: torch.Tensor, n: int) -> torch.Tensor:
    """[N] / [N, 1] float32 or [N, 4] uint8 -> [N, 4] uint8 (a view when possible)."""
    s = index_k_scale
    if s.dtype == torch.float32:
        s = s.reshape(n, 1) if s.numel() == n else s
        if s.dim() != 2 or s.shape != (n, 1):
            raise ValueError(f"index_k_scale must hold one float32 per token ({n}), got {tuple(index_k_scale.shape)}")
        s = (s if s.stride(1) == 1 else s.contiguous()).view(torch.uint8)
    elif s.dtype == torch.uint8:
        s = s.reshape(n, INDEX_SCALE_BYTES) if s.numel() == n * INDEX_SCALE_BYTES else s
        if s.shape != (n, INDEX_SCALE_BYTES):
            raise ValueError(f"index_k_scale as bytes must be [{n}, 4] uint8, got {tuple(index_k_scale.shape)}")
    else:
        raise ValueError(f"index_k_scale must be float32 or uint8 bytes, got {s.dtype}")
    return s


#: the plan of an indexer write that the general path takes (keys or scales in another form than the packed one)
_GENERAL = object()


class IndexerPages:
    """Writes and reads of one pool's indexer pages (see the module docstring): the Triton kernels
    (``use_triton``) or their torch references, sharing the checks; fixed geometry computed once.

    :param index_buf: contiguous uint8 ``[L, pages, page_bytes]``; a page is 64 keys of ``key_bytes`` then,
        when ``has_scale``, 64 float32 scales.
    """

    def __init__(self, index_buf: torch.Tensor, key_bytes: int, has_scale: bool, use_triton: bool = True):
        if index_buf.dtype != torch.uint8 or index_buf.dim() != 3 or not index_buf.is_contiguous():
            raise ValueError(
                f"index buffer must be contiguous uint8 [L, pages, page_bytes], got {index_buf.dtype} {tuple(index_buf.shape)}"
            )
        page_bytes = index_page_bytes_of(key_bytes, has_scale)
        if index_buf.shape[2] != page_bytes:
            raise ValueError(f"index pages hold {index_buf.shape[2]} bytes, keys of {key_bytes} bytes need {page_bytes}")
        self.index_buf, self.key_bytes, self.has_scale, self.use_triton = index_buf, key_bytes, has_scale, use_triton
        self.layers, self.page_bytes = index_buf.shape[0], page_bytes
        self._set = Launcher(_set_index_k_kernel, index_buf.device, ("buf_ptr", "loc_ptr", "k_ptr", "s_ptr"))
        self._get = Launcher(_get_index_k_kernel, index_buf.device, ("buf_ptr", "page_ptr", "k_out", "s_out"))
        self._buf_ptr, self._layer_bytes = index_buf.data_ptr(), index_buf.stride(0)
        self.device, self._device_index = index_buf.device, index_buf.get_device()
        self._set_plans: dict[tuple, Plan | None] = {}
        self._get_plans: dict[tuple, Plan | None] = {}
        self._empty_bytes = torch.empty(0, dtype=torch.uint8, device=self.device)  # new outputs: see empty_of

    def _check_layer(self, layer_index: int) -> None:
        if not 0 <= layer_index < self.layers:
            raise ValueError(f"layer_index {layer_index} out of range for {self.layers} layers")

    def _pages(self, layer_index: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(keys ``[pages, 64, key_bytes]``, scales ``[pages, 64, 4]`` or None) of one layer, as views."""
        layer = self.index_buf[layer_index]
        keys = layer[:, : INDEX_PAGE_SIZE * self.key_bytes].view(-1, INDEX_PAGE_SIZE, self.key_bytes)
        scales = layer[:, INDEX_PAGE_SIZE * self.key_bytes :].view(-1, INDEX_PAGE_SIZE, INDEX_SCALE_BYTES)
        return keys, scales if self.has_scale else None

    def set(self, layer_index: int, loc: torch.Tensor, index_k: torch.Tensor, index_k_scale=None) -> None:
        """See :func:`set_index_k_triton`.  The common call (keys ``[N, D]`` with packed columns, scales None or
        packed ``[N]`` float32) is checked and planned once per call signature (:mod:`kvcore.kernels.launch`) and
        launched without views; any other goes through :meth:`_set_general`."""
        if not self.use_triton:
            self._set_general(layer_index, loc, index_k, index_k_scale)
            return
        s = index_k_scale
        lp, kp, n, ks = loc.data_ptr(), index_k.data_ptr(), loc.numel(), index_k.shape
        if s is None:
            sp, scales, s_agrees = kp, None, True
        else:
            sp, ss = s.data_ptr(), s.shape
            scales = (ss[1:], s.stride(), s.dtype, s.get_device(), sp & 15)
            s_agrees = len(ss) == 1 and ss[0] == n
        signature = ((n - 1).bit_length() if n else -1, loc.stride(), loc.dtype, loc.get_device(), lp & 15, ks[1:],
                     index_k.stride(), index_k.dtype, index_k.get_device(), kp & 15, scales)  # fmt: skip
        plan = self._set_plans.get(signature, UNPLANNED)
        if plan is UNPLANNED:
            plan = remember(self._set_plans, signature, self._plan_set(loc, index_k, s, lp, kp, sp))
        elif not (ks and ks[0] == n and s_agrees):  # counts other than the signature's first call's: checked there
            plan = _GENERAL
        if plan is _GENERAL:
            self._set_general(layer_index, loc, index_k, index_k_scale)
            return
        if not 0 <= layer_index < self.layers:
            self._check_layer(layer_index)
        if plan is not None:  # (no closure here: its cells would cost every call)
            loc_stride, k_args, tail = plan.fixed
            plan(n, (self._buf_ptr, layer_index, lp, loc_stride, n, kp, *k_args, sp, *tail),
                 (self.index_buf, loc, index_k, index_k if s is None else s))  # fmt: skip

    @staticmethod
    def _byte_views(buf: torch.Tensor, loc: torch.Tensor, keys: torch.Tensor, scales: torch.Tensor
                    ) -> tuple[torch.Tensor, ...]:  # fmt: skip
        """The tensors behind a write's addresses as the dispatcher sees them: keys and scales as bytes."""
        return buf, loc, keys.view(torch.uint8), scales.view(torch.uint8)

    def _plan_set(self, loc: torch.Tensor, index_k: torch.Tensor, s, lp: int, kp: int, sp: int):
        """The plan of a packed call (None: no rows), or ``_GENERAL`` for a call the general path takes."""
        n = _check_loc(loc)
        shape, ks = index_k.shape, index_k.stride()
        item = index_k.dtype.itemsize
        if n == 0 or len(shape) != 2 or shape[0] != n or shape[1] * item != self.key_bytes or ks[1] != 1:
            return _GENERAL
        if s is None:
            if self.has_scale:
                return _GENERAL
            ss = (0, 0)
        else:
            if (not self.has_scale or s.dtype is not torch.float32 or s.dim() != 1 or s.stride(0) != 1
                    or s.shape[0] != n):  # fmt: skip
                return _GENERAL
            ss = (INDEX_SCALE_BYTES, 1)
        dev = self._device_index
        if loc.get_device() != dev or index_k.get_device() != dev or (s is not None and s.get_device() != dev):
            _check_device(dev, self.device, loc=loc, index_k=index_k, **({} if s is None else {"index_k_scale": s}))
        block_n = min(_INDEX_BLOCK_N, next_pow2(n))
        byte_strides = (ks[0] * item, 1)
        key = (byte_strides, ss, kp & 15, sp & 15, loc.dtype, lp & 15, block_n)
        return Plan(self._set, key, block_n, (1, 1), _INDEX_NUM_WARPS, (loc.stride(0), byte_strides, (
            *ss, INDEX_PAGE_SIZE, self._layer_bytes, self.page_bytes, self.key_bytes, s is not None, block_n)),
            self._byte_views)  # fmt: skip

    def _set_general(self, layer_index: int, loc: torch.Tensor, index_k: torch.Tensor, index_k_scale) -> None:
        """:meth:`set` of any accepted form: keys of any dtype and token stride, scales as float32 or their
        bytes, through views and copies made per call."""
        self._check_layer(layer_index)
        n = _check_loc(loc)
        keys = _key_bytes(index_k)
        if keys.shape[0] != n:
            raise ValueError(f"{n} locations but {keys.shape[0]} index keys")
        if keys.shape[1] != self.key_bytes:
            raise ValueError(f"index keys of {keys.shape[1]} bytes, the pages hold keys of {self.key_bytes} bytes")
        if (index_k_scale is not None) != self.has_scale:
            raise ValueError("scales are given for an indexer without scales" if index_k_scale is not None
                             else "this indexer keeps a scale per key; pass index_k_scale")  # fmt: skip
        fast_scale = (index_k_scale is not None and index_k_scale.dtype == torch.float32 and index_k_scale.dim() == 1
                      and index_k_scale.stride(0) == 1)  # fmt: skip
        if fast_scale and index_k_scale.shape[0] != n:
            raise ValueError(f"index_k_scale must hold one float32 per token ({n}), got {tuple(index_k_scale.shape)}")
        scales = None if index_k_scale is None or (fast_scale and self.use_triton) else _scale_bytes(index_k_scale, n)
        if n == 0:
            return
        if not self.use_triton:
            page_keys, page_scales = self._pages(layer_index)
            loc = loc.long()
            page, slot = loc // INDEX_PAGE_SIZE, loc % INDEX_PAGE_SIZE
            page_keys[page, slot] = keys
            if scales is not None:
                page_scales[page, slot] = scales
            return
        if index_k_scale is None:
            s, ss = keys, (0, 0)
        elif fast_scale:
            # one view instead of _scale_bytes' two: the kernel reads the 4 bytes of token i at byte 4 i
            s, ss = index_k_scale.view(torch.uint8), (4, 1)
        else:
            s, ss = scales, scales.stride()
        self._launch_set(layer_index, loc, n, keys, keys.stride(), s, ss, (self.index_buf, loc, keys, s))

    def _launch_set(self, layer_index, loc, n, keys, ks, s, ss, tensors) -> None:
        """One launch of the set kernel; ``ks`` / ``ss`` are the keys' and scales' byte strides, and ``s is
        keys`` when there are no scales."""
        dev = self._device_index
        if loc.get_device() != dev or keys.get_device() != dev or s.get_device() != dev:
            _check_device(dev, self.device, loc=loc, index_k=keys, index_k_scale=s)
        block_n = min(_INDEX_BLOCK_N, next_pow2(n))
        kp, sp, lp = keys.data_ptr(), s.data_ptr(), loc.data_ptr()
        key = (ks, ss, kp & 15, sp & 15, loc.dtype, lp & 15, block_n)
        self._set(key, -(-n // block_n), 1, (
            self._buf_ptr, layer_index, lp, loc.stride(0), n, kp, ks[0], ks[1], sp, ss[0], ss[1], INDEX_PAGE_SIZE,
            self._layer_bytes, self.page_bytes, self.key_bytes, s is not keys, block_n,
        ), tensors, _INDEX_NUM_WARPS)  # fmt: skip

    def _check_get(self, layer_index: int, seq_len: int, page_indices: torch.Tensor) -> None:
        self._check_layer(layer_index)
        if page_indices.dim() != 1 or page_indices.dtype not in (torch.int32, torch.int64):
            raise ValueError(
                f"page_indices must be a 1-D int32/int64 tensor, got {page_indices.dtype} {tuple(page_indices.shape)}"
            )
        needed = -(-seq_len // INDEX_PAGE_SIZE)
        if seq_len < 0 or page_indices.shape[0] < needed:
            raise ValueError(f"seq_len={seq_len} needs {needed} page indices, got {page_indices.shape[0]}")

    def _check_outputs(self, seq_len: int, k_out: torch.Tensor | None, s_out: torch.Tensor | None) -> None:
        if k_out is not None and (k_out.dtype != torch.uint8 or k_out.shape != (seq_len, self.key_bytes) or not k_out.is_contiguous()):
            raise ValueError(f"k_out must be contiguous uint8 [{seq_len}, {self.key_bytes}], got {k_out.dtype} {tuple(k_out.shape)}")
        if s_out is not None:
            if not self.has_scale:
                raise ValueError("this indexer buffer keeps no scales")
            if s_out.dtype != torch.uint8 or s_out.shape != (seq_len, INDEX_SCALE_BYTES) or not s_out.is_contiguous():
                raise ValueError(f"s_out must be contiguous uint8 [{seq_len}, 4], got {s_out.dtype} {tuple(s_out.shape)}")

    def get_new(self, layer_index: int, seq_len: int, page_indices: torch.Tensor, want_k: bool, want_s: bool
                ) -> tuple[torch.Tensor | None, torch.Tensor | None]:  # fmt: skip
        """A sequence's keys ``[seq_len, key_bytes]`` and/or scales ``[seq_len, 4]`` (uint8) as new contiguous
        tensors (None for what is not wanted); otherwise as :meth:`get`.  Planned once per call signature; new
        outputs are 16-byte aligned (the caching allocator's blocks are), which the plan takes for granted and
        checks."""
        if seq_len < 0:
            self._check_get(layer_index, seq_len, page_indices)
        k_bytes, s_bytes = self.key_bytes, INDEX_SCALE_BYTES
        new = self._empty_bytes.new_empty_strided
        k_out = new((seq_len, k_bytes), (k_bytes, 1)) if want_k else None
        s_out = new((seq_len, s_bytes), (s_bytes, 1)) if want_s else None
        if not self.use_triton:
            self._check_get(layer_index, seq_len, page_indices)
            if want_s and not self.has_scale:
                raise ValueError("this indexer buffer keeps no scales")
            self.get(layer_index, seq_len, page_indices, k_out, s_out)
            return k_out, s_out
        k = k_out if k_out is not None else s_out
        s = s_out if s_out is not None else k
        pp = page_indices.data_ptr()
        kp, sp = (k.data_ptr(), s.data_ptr()) if k is not None else (0, 0)
        signature = ((seq_len - 1).bit_length() if seq_len else -1, page_indices.stride(), page_indices.dtype,
                     page_indices.get_device(), pp & 15, want_k, want_s)  # fmt: skip
        plan = self._get_plans.get(signature, UNPLANNED)
        # a first call, outputs less aligned than plans take them, or too few pages (refused)
        if plan is UNPLANNED or (kp | sp) & 15 or page_indices.numel() * INDEX_PAGE_SIZE < seq_len:
            self._check_get(layer_index, seq_len, page_indices)
            if want_s and not self.has_scale:
                raise ValueError("this indexer buffer keeps no scales")
            if page_indices.get_device() != self._device_index:
                _check_device(self._device_index, self.device, page_indices=page_indices)
            plan = self._plan_get(seq_len, page_indices, kp, sp, pp, want_k, want_s)
            if not (kp | sp) & 15:  # (a plan of unaligned outputs is used once, and forgotten at the next miss)
                remember(self._get_plans, signature, plan)
        self._fire_get(plan, seq_len, layer_index, pp, kp, sp, page_indices, k, s)
        return k_out, s_out

    def get(self, layer_index: int, seq_len: int, page_indices: torch.Tensor, k_out: torch.Tensor | None,
            s_out: torch.Tensor | None, check: Callable[[int, torch.Tensor, torch.Tensor], None] | None = None,
            ) -> None:  # fmt: skip
        """See :func:`get_index_k_triton`.  Checked and planned once per call signature; ``check(seq_len, k_out,
        s_out)``, when given, is a caller's own check of the outputs, run before this one's."""
        if not self.use_triton:
            if check is not None:
                check(seq_len, k_out, s_out)
            self._get_native(layer_index, seq_len, page_indices, k_out, s_out)
            return
        k = k_out if k_out is not None else s_out
        s = s_out if s_out is not None else k
        pp = page_indices.data_ptr()
        if k is None:
            kp = sp = 0
            outputs, counts_agree = None, True
        else:
            kp, sp, k_shape, s_shape = k.data_ptr(), s.data_ptr(), k.shape, s.shape
            outputs = (k_shape[1:], k.stride(), k.dtype, k.get_device(), kp & 15, s_shape[1:], s.stride(), s.dtype,
                       s.get_device(), sp & 15)  # fmt: skip
            counts_agree = bool(k_shape) and k_shape[0] == seq_len and bool(s_shape) and s_shape[0] == seq_len
        signature = (check, (seq_len - 1).bit_length() if seq_len else -1, page_indices.stride(), page_indices.dtype,
                     page_indices.get_device(), pp & 15, k_out is not None, s_out is not None, outputs)  # fmt: skip
        plan = self._get_plans.get(signature, UNPLANNED)
        # a first call, or outputs or pages of other counts than the call's (refused)
        if plan is UNPLANNED or not counts_agree or page_indices.numel() * INDEX_PAGE_SIZE < seq_len:
            if check is not None:
                check(seq_len, k_out, s_out)
            self._check_get(layer_index, seq_len, page_indices)
            self._check_outputs(seq_len, k_out, s_out)
            if k is not None:
                _check_device(self._device_index, self.device, page_indices=page_indices, k_out=k, s_out=s)
            plan = remember(self._get_plans, signature, self._plan_get(
                seq_len, page_indices, kp, sp, pp, k_out is not None, s_out is not None))  # fmt: skip
        self._fire_get(plan, seq_len, layer_index, pp, kp, sp, page_indices, k, s)

    def _get_native(self, layer_index: int, seq_len: int, page_indices: torch.Tensor, k_out, s_out) -> None:
        self._check_get(layer_index, seq_len, page_indices)
        self._check_outputs(seq_len, k_out, s_out)
        if seq_len == 0 or (k_out is None and s_out is None):
            return
        page_keys, page_scales = self._pages(layer_index)
        i = torch.arange(seq_len, device=self.index_buf.device)
        page, slot = page_indices.long()[i // INDEX_PAGE_SIZE], i % INDEX_PAGE_SIZE
        if k_out is not None:
            k_out.copy_(page_keys[page, slot])
        if s_out is not None:
            s_out.copy_(page_scales[page, slot])

    def _plan_get(self, seq_len: int, page_indices: torch.Tensor, kp: int, sp: int, pp: int, want_k: bool,
                  want_s: bool) -> Plan | None:  # fmt: skip
        if seq_len == 0 or not (want_k or want_s):
            return None
        block_n = min(_INDEX_BLOCK_N, next_pow2(seq_len))
        key = (kp & 15, sp & 15, page_indices.dtype, pp & 15, want_k, want_s, block_n)
        tail = (INDEX_PAGE_SIZE, self._layer_bytes, self.page_bytes, self.key_bytes, want_k, want_s, block_n)
        return Plan(self._get, key, block_n, (1, 1), _INDEX_NUM_WARPS, (page_indices.stride(0), tail))

    def _fire_get(self, plan: Plan | None, seq_len: int, layer_index: int, pp: int, kp: int, sp: int, page_indices, k,
                  s) -> None:  # fmt: skip
        if not 0 <= layer_index < self.layers:
            self._check_layer(layer_index)
        if plan is not None:
            page_stride, tail = plan.fixed
            plan(seq_len, (self._buf_ptr, layer_index, pp, page_stride, seq_len, kp, sp, *tail),
                 (self.index_buf, page_indices, k, s))  # fmt: skip


# ==========================================================================================================
# One call each (tests, benchmarks); pools keep a ScaledRows and an IndexerPages
# ==========================================================================================================


def store_dsa_fp8_triton(
    kv_cache: torch.Tensor, layer_index: int, loc: torch.Tensor, cache_k_nope: torch.Tensor,
    cache_k_rope: torch.Tensor, *, kv_lora_rank: int, qk_rope_head_dim: int,
) -> None:  # fmt: skip
    """Quantize and store latent rows: ``kv_cache[layer_index, loc[i], 0] = quantize(nope[i] ++ rope[i])``.

    :param kv_cache: contiguous uint8 ``[L, R, 1, scaled_row_bytes(kv_lora_rank, qk_rope_head_dim)]``.
    :param layer_index: 0-based layer in the stack.
    :param loc: ``[N]`` int32/int64 distinct rows.
    :param cache_k_nope: ``[N, kv_lora_rank]`` or ``[N, 1, kv_lora_rank]`` float32/float16/bfloat16, any
        strides.  Not modified.
    :param cache_k_rope: ``[N, qk_rope_head_dim]`` or ``[N, 1, qk_rope_head_dim]``, likewise.
    :returns: nothing; the rows are byte-identical to :func:`quantize_concatenated` of the concatenation.
        One launch, no allocation, no host sync (CUDA-graph safe).
    """
    ScaledRows(kv_cache, kv_lora_rank, qk_rope_head_dim).store(layer_index, loc, cache_k_nope, cache_k_rope)


def store_dsa_fp8_native(
    kv_cache: torch.Tensor, layer_index: int, loc: torch.Tensor, cache_k_nope: torch.Tensor,
    cache_k_rope: torch.Tensor, *, kv_lora_rank: int, qk_rope_head_dim: int,
) -> None:  # fmt: skip
    """Torch reference of :func:`store_dsa_fp8_triton` (same signature and bytes)."""
    ScaledRows(kv_cache, kv_lora_rank, qk_rope_head_dim, use_triton=False).store(layer_index, loc, cache_k_nope, cache_k_rope)


def gather_dsa_fp8_triton(
    kv_cache: torch.Tensor, layer_index: int, loc: torch.Tensor, nope_out: torch.Tensor, rope_out: torch.Tensor,
    *, kv_lora_rank: int, qk_rope_head_dim: int,
) -> None:  # fmt: skip
    """Dequantize rows ``loc`` of layer ``layer_index`` into ``nope_out`` / ``rope_out``.

    :param kv_cache: contiguous uint8 ``[L, R, 1, row_bytes]`` (see :func:`store_dsa_fp8_triton`).
    :param loc: ``[N]`` int32/int64 rows; only these rows are read.
    :param nope_out: contiguous ``N x kv_lora_rank`` elements (e.g. ``[N, 1, R]``), float32/float16/bfloat16:
        ``float32(fp8) * scale`` converted with round-to-nearest-even.
    :param rope_out: contiguous ``N x qk_rope_head_dim`` elements of the same dtype: the stored bf16 rope.
    """
    ScaledRows(kv_cache, kv_lora_rank, qk_rope_head_dim).gather(layer_index, loc, nope_out, rope_out)


def gather_dsa_fp8_native(
    kv_cache: torch.Tensor, layer_index: int, loc: torch.Tensor, nope_out: torch.Tensor, rope_out: torch.Tensor,
    *, kv_lora_rank: int, qk_rope_head_dim: int,
) -> None:  # fmt: skip
    """Torch reference of :func:`gather_dsa_fp8_triton`: gathers the rows first, then dequantizes only them."""
    ScaledRows(kv_cache, kv_lora_rank, qk_rope_head_dim, use_triton=False).gather(layer_index, loc, nope_out, rope_out)


def _indexer(index_buf: torch.Tensor, key_bytes: int, use_triton: bool) -> IndexerPages:
    """An :class:`IndexerPages` for a buffer whose pages hold keys of ``key_bytes`` (with scales when the page
    size says so)."""
    return IndexerPages(index_buf, key_bytes, index_buf.shape[-1] == index_page_bytes_of(key_bytes, True), use_triton)


def set_index_k_triton(
    index_buf: torch.Tensor, layer_index: int, loc: torch.Tensor, index_k: torch.Tensor, index_k_scale=None
) -> None:
    """Write indexer keys (and scales) of tokens ``loc`` into their pages: token ``loc`` is slot ``loc % 64`` of
    page ``loc // 64``.

    :param index_buf: contiguous uint8 ``[L, pages, page_bytes]``; a page is 64 keys then (fp8) 64 scales.
    :param loc: ``[N]`` int32/int64 token locations.
    :param index_k: ``[N, D]`` keys, copied as raw bytes (fp8 or uint8 for the fp8 indexer, bf16 for the bf16
        one), any token stride.
    :param index_k_scale: fp8 indexer: ``[N]`` float32 (or ``[N, 4]`` uint8 holding them); None for bf16 keys.
    """
    keys = _key_bytes(index_k)
    IndexerPages(index_buf, keys.shape[1], index_k_scale is not None).set(layer_index, loc, index_k, index_k_scale)


def set_index_k_native(
    index_buf: torch.Tensor, layer_index: int, loc: torch.Tensor, index_k: torch.Tensor, index_k_scale=None
) -> None:
    """Torch reference of :func:`set_index_k_triton`."""
    keys = _key_bytes(index_k)
    IndexerPages(index_buf, keys.shape[1], index_k_scale is not None, use_triton=False).set(
        layer_index, loc, index_k, index_k_scale
    )


def get_index_k_triton(
    index_buf: torch.Tensor, layer_index: int, seq_len: int, page_indices: torch.Tensor,
    k_out: torch.Tensor | None, s_out: torch.Tensor | None, *, key_bytes: int,
) -> None:  # fmt: skip
    """Read a sequence's indexer keys and/or scales in token order (one launch for both).

    Token ``i`` of the sequence lives in page ``page_indices[i // 64]`` at slot ``i % 64``.

    :param index_buf: contiguous uint8 ``[L, pages, page_bytes]``.
    :param seq_len: tokens to read.
    :param page_indices: ``[>= ceil(seq_len / 64)]`` int32/int64 pages of the sequence.
    :param k_out: contiguous uint8 ``[seq_len, key_bytes]`` or None.
    :param s_out: contiguous uint8 ``[seq_len, 4]`` (float32 scale bytes) or None.
    :param key_bytes: bytes of one key (128 fp8, 256 bf16).
    """
    _indexer(index_buf, key_bytes, True).get(layer_index, seq_len, page_indices, k_out, s_out)


def get_index_k_native(
    index_buf: torch.Tensor, layer_index: int, seq_len: int, page_indices: torch.Tensor,
    k_out: torch.Tensor | None, s_out: torch.Tensor | None, *, key_bytes: int,
) -> None:  # fmt: skip
    """Torch reference of :func:`get_index_k_triton`."""
    _indexer(index_buf, key_bytes, False).get(layer_index, seq_len, page_indices, k_out, s_out)
