"""The DSA pool's scaled fp8 latent rows on the device: the quantize-and-store and the dequantizing gather
(:class:`ScaledRows`, bound to one pool's cache), their Triton kernels and the one-call functions.

Row formats are described in :mod:`kvcore_dsa.layout`, the arithmetic in :mod:`kvcore_dsa.quantize`, whose torch
references the kernels match bit for bit.  All offsets are int64.  The kernels divide exactly as IEEE division
does (Triton's ``/`` is an approximate division on GPUs; see ``_divide_rn``).  fp8 and bf16 encodings go through
:mod:`kvcore.kernels.fp8`'s integer encoders under the interpreter (whose float->fp8 and float->bf16 casts round
wrongly) and through the hardware conversion when compiled.

``store_dsa_fp8_triton``
    Grid ``(token blocks,)``: a program loads the nope values of ``BLOCK_N`` tokens as ``[BLOCK_N, tiles,
    128]``, computes each tile's scale, and writes whole rows: the fp8 bytes, the float32 scales and the rope
    converted to bf16.  Inputs may be strided (views of a fused projection).
``gather_dsa_fp8_triton``
    The inverse for the rows ``loc`` only: fp8 * scale and bf16 rope, converted to float32/float16/bfloat16.
    Compiled, fp8 bytes decode through the hardware conversion; it differs from torch's decode only in the
    bits of a NaN, a byte the store never writes.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import triton
import triton.language as tl

from kvcore.kernels import dtypes
from kvcore.kernels.addresses import KeepsAddresses
from kvcore.kernels.dtypes import E4M3FN_MAX
from kvcore.kernels.fp8 import (e4m3fn_bits_to_f32_hw, f32_to_bf16_bits, finite_f32_to_e4m3fn_bytes,
                               torch_e4m3fn_saturates)  # fmt: skip
from kvcore.kernels.kernel_mode import triton_interpreting
from kvcore.kernels.launch import UNPLANNED, KernelArgs, Launcher, Plan, remember
from kvcore.kernels.row_move import next_pow2
from kvcore.pools import empty_of
from kvcore_dsa.checks import check_device, check_loc
from kvcore_dsa.layout import QUANT_BLOCK_SIZE, SCALE_MIN, scaled_row_bytes
from kvcore_dsa.quantize import dequantize_rows, quantize_parts

__all__ = ["ScaledRows", "gather_dsa_fp8_native", "gather_dsa_fp8_triton", "store_dsa_fp8_native",
           "store_dsa_fp8_triton"]  # fmt: skip

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
    tl.store(cache_u8 + base[:, None] + cols[None, :], finite_f32_to_e4m3fn_bytes(q, SATURATE, HW_CVT), mask=mask)
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


#: the argument lists of the two kernels (:class:`kvcore.kernels.launch.KernelArgs`): per call the cache's three
#: views (one address), the layer and the call's addresses and count; the plan's strides.  Pointers as addresses.
_STORE_ARGS = KernelArgs(
    _store_dsa_fp8_kernel,
    runtime=("cache_u8 cache_i16 cache_f32 layer nope_ptr rope_ptr loc_ptr loc_stride n_tokens",
             "nope_sn nope_sd rope_sn rope_sd"),
    constexprs="KV_LORA ROPE_DIM ROPE_PAD LAYER_BYTES ROW_BYTES NUM_TILES TILES_PAD TILE ROPE_BF16 SCALE_MIN SATURATE "
               "HW_CVT BLOCK_N",
    pointers="cache_u8 cache_i16 cache_f32 nope_ptr rope_ptr loc_ptr",
)  # fmt: skip
_GATHER_ARGS = KernelArgs(
    _gather_dsa_fp8_kernel,
    runtime="cache_u8 cache_i16 cache_f32 layer loc_ptr loc_stride n_tokens nope_out rope_out",
    constexprs="KV_LORA ROPE_DIM ROPE_PAD LAYER_BYTES ROW_BYTES NUM_TILES TILES_PAD TILE OUT HW_CVT BLOCK_N",
    pointers="cache_u8 cache_i16 cache_f32 loc_ptr nope_out rope_out",
)


# ==========================================================================================================
# The pool's view: the cache bound once, the Triton kernels or their torch references
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


class ScaledRows(KeepsAddresses):
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
        # the constexprs both kernels take: the row's geometry
        self._dims = dict(KV_LORA=kv_lora_rank, ROPE_DIM=qk_rope_head_dim, ROPE_PAD=next_pow2(qk_rope_head_dim),
                          LAYER_BYTES=kv_cache.stride(0), ROW_BYTES=width, NUM_TILES=tiles, TILES_PAD=next_pow2(tiles),
                          TILE=QUANT_BLOCK_SIZE)  # fmt: skip
        self._saturate, self._hw_cvt = torch_e4m3fn_saturates(), not triton_interpreting()
        self._store = Launcher(_STORE_ARGS, kv_cache.device)
        self._gather = Launcher(_GATHER_ARGS, kv_cache.device)
        self.device, self._device_index = kv_cache.device, kv_cache.get_device()
        self._bind_addresses()
        self._empties: dict[torch.dtype, torch.Tensor] = {}

    def _bind_addresses(self) -> None:
        """The rows' address (the kernels take three views of it); the plans start empty."""
        self._view_ptrs = (self.kv_cache.data_ptr(),) * 3
        self._store_plans: dict[tuple, Plan | None] = {}
        self._gather_plans: dict[tuple, Plan | None] = {}
        self._new_plans: dict[tuple, Plan | None] = {}

    def _check_layer(self, layer_index: int) -> None:
        if not 0 <= layer_index < self.layers:
            raise ValueError(f"layer_index {layer_index} out of range for {self.layers} layers")

    def _check_store(self, loc: torch.Tensor, cache_k_nope: torch.Tensor, cache_k_rope: torch.Tensor
                     ) -> tuple[int, tuple[int, int], tuple[int, int]]:  # fmt: skip
        """(rows, nope strides, rope strides) of a store, checked."""
        n = check_loc(loc)
        nope_s = _geometry(cache_k_nope, self.kv_lora_rank, n, "cache_k_nope")
        rope_s = _geometry(cache_k_rope, self.qk_rope_head_dim, n, "cache_k_rope")
        nope_dtype, rope_dtype = cache_k_nope.dtype, cache_k_rope.dtype
        if nope_dtype not in _FLOAT_INPUTS or rope_dtype not in _FLOAT_INPUTS:
            name, dtype = ("cache_k_nope", nope_dtype) if nope_dtype not in _FLOAT_INPUTS else ("cache_k_rope", rope_dtype)
            raise ValueError(f"{name} must be float32/float16/bfloat16 to be quantized, got {dtype}")
        return n, nope_s, rope_s

    def _check_gather(self, loc: torch.Tensor, nope_out: torch.Tensor, rope_out: torch.Tensor) -> int:
        n = check_loc(loc)
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
            loc_stride, strides = plan.fixed  # the runtime arguments (_STORE_ARGS); the plan adds its constexprs
            plan(n, (*self._view_ptrs, layer_index, np_, rp, lp, loc_stride, n, *strides),
                 (*self._views, nope, rope, loc))  # fmt: skip

    def _plan_store(self, loc, nope, rope) -> Plan | None:
        n, nope_s, rope_s = self._check_store(loc, nope, rope)
        if n == 0:
            return None
        dev = self._device_index
        if loc.get_device() != dev or nope.get_device() != dev or rope.get_device() != dev:
            check_device(dev, self.device, loc=loc, cache_k_nope=nope, cache_k_rope=rope)
        block_n = min(_STORE_BLOCK_N, next_pow2(n))
        key = (nope.dtype, rope.dtype, nope_s, rope_s, nope.data_ptr() & 15, rope.data_ptr() & 15, loc.dtype,
               loc.data_ptr() & 15, block_n)  # fmt: skip
        constexprs = _STORE_ARGS.constexprs(**self._dims, ROPE_BF16=rope.dtype == torch.bfloat16, SCALE_MIN=SCALE_MIN,
                                            SATURATE=self._saturate, HW_CVT=self._hw_cvt, BLOCK_N=block_n)  # fmt: skip
        fixed = (loc.stride(0), (*nope_s, *rope_s))
        return Plan(self._store, key, block_n, (1, 1), _STORE_NUM_WARPS, fixed, constexprs=constexprs)

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
            check_device(self._device_index, self.device, loc=loc, nope_out=a, rope_out=b)
            plan = remember(self._gather_plans, signature,
                            self._plan_gather(n, loc.dtype, lp, ap, bp, a.dtype, loc.stride(0)))  # fmt: skip
        self._fire_gather(plan, n, layer_index, lp, ap, bp, loc, a, b)

    def _plan_gather(self, n: int, loc_dtype, lp: int, ap: int, bp: int, dtype, loc_stride: int) -> Plan | None:
        if n == 0:
            return None
        block_n = min(_GATHER_BLOCK_N, next_pow2(n))
        out = dtypes.dtype_code(dtype)
        key = (out, ap & 15, bp & 15, loc_dtype, lp & 15, block_n)
        constexprs = _GATHER_ARGS.constexprs(**self._dims, OUT=out, HW_CVT=self._hw_cvt, BLOCK_N=block_n)
        return Plan(self._gather, key, block_n, (1, 1), _GATHER_NUM_WARPS, loc_stride, constexprs=constexprs)

    def _fire_gather(self, plan: Plan | None, n: int, layer_index: int, lp: int, ap: int, bp: int, loc, a, b) -> None:
        if not 0 <= layer_index < self.layers:
            self._check_layer(layer_index)
        if plan is not None:
            # the runtime arguments (_GATHER_ARGS; the plan's fixed part is loc's stride); the plan adds its constexprs
            plan(n, (*self._view_ptrs, layer_index, lp, plan.fixed, n, ap, bp), (*self._views, loc, a, b))

    def gather_new(self, layer_index: int, loc: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows ``loc`` dequantized into two new contiguous tensors ``[N, 1, kv_lora_rank]`` and
        ``[N, 1, qk_rope_head_dim]`` of ``dtype`` (float32/float16/bfloat16).  Planned once per signature; new
        outputs are 16-byte aligned (the caching allocator's blocks are), which the plan takes for granted and
        checks."""
        shape = loc.shape
        if len(shape) != 1:
            check_loc(loc)
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
            check_loc(loc)
            if loc.get_device() != self._device_index:
                check_device(self._device_index, self.device, loc=loc)
            plan = self._plan_gather(n, loc.dtype, lp, ap, bp, dtype, loc.stride(0))
            if not (ap | bp) & 15:  # (a plan of unaligned outputs is used once, and forgotten at the next miss)
                remember(self._new_plans, signature, plan)
        self._fire_gather(plan, n, layer_index, lp, ap, bp, loc, nope, rope)
        return nope, rope


# ==========================================================================================================
# One call each (tests, benchmarks); pools keep a ScaledRows
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
