"""Hot-path kernels of the MLA pool: storing latent rows, gathering them back, and moving rows between slots.

Buffer format (see the pool): all layers live in one tensor ``kv_cache`` of shape ``[L, R, 1, D]`` (R = size
+ page_size rows, row 0 is padding; ``[L, R, D]`` is accepted too) whose rows are contiguous.  A row holds the
compressed KV (``kv_lora_rank`` = "nope" columns) followed by the rope key (``qk_rope_head_dim`` columns),
e.g. 512 + 64 = 576 for DeepSeek-V3; a family with its own row format may make ``D`` wider.  The storage dtype
is the cache dtype, except fp8 caches, stored as ``torch.uint8`` holding float8_e4m3fn / float8_e5m2 bytes.
``cache_dtype=torch.uint8`` means raw bytes: inputs and outputs must then be uint8 too and are copied as is
(a family that packs its own byte layout, like DSA's fp8 rows with scales, reuses the kernels that way).

Every kernel has a torch reference of the same signature beside it (``*_native``).  Nothing here picks an
implementation: the pool calls ``*_triton`` or ``*_native`` (see ``kvcore.kernel_mode``).

``store_nope_rope_triton``
    ``set_mla_kv_buffer``: writes ``cache_k_nope`` [N, 1, Rn] into columns ``[0, Rn)`` and ``cache_k_rope``
    [N, 1, Rp] into columns ``[Rn, Rn + Rp)`` of rows ``loc`` in ONE launch, with no concatenated temporary.
``store_rows_triton``
    ``set_kv_buffer``: writes already concatenated rows [N, 1, W] into columns ``[0, W)``.  It runs the same
    kernel, with the row split at the largest power of two below W (576 = 512 + 64), so a 576-wide row takes
    tiles of 512 and 64 columns instead of one 1024-wide tile with 448 idle lanes.
``gather_nope_rope_triton``
    ``get_mla_kv_buffer``: reads rows ``loc`` back into caller-provided nope / rope tensors of any float or
    fp8 dtype, in one launch.

Kernel shape (all three): grid ``(cdiv(N, BLOCK_N),)``, one program per block of tokens.  A program loads
its ``BLOCK_N`` locations once, then copies the nope part and the rope part as ``[BLOCK_N, BLOCK_C]`` tiles
(BLOCK_C a power of two up to ``MAX_BLOCK_C`` elements; a wider part loops over column tiles), converting on
the way.  Cache rows are addressed as ``row * D`` with ``D`` a compile-time constant, so each tile row is one
wide contiguous access; offsets are int64 (pools exceed 2**31 bytes); inputs and outputs may be strided in
both dims (a nope/rope split of a larger projection needs no copy; a unit last-dim stride is specialised).
No host sync and no allocation: the stores are CUDA-graph safe.

Conversions are bit-exact with torch's ``.to()`` of the process's torch, on the interpreter and on GPUs:
float casts round to nearest even (bf16 through :func:`kvcore.fp8.f32_to_bf16_bits` under the interpreter,
whose own cast truncates), fp8 encodes through :mod:`kvcore.fp8` (integer encoder under the interpreter,
``cvt`` plus torch's overflow rules on GPUs), fp8 decodes are exact, and bf16 widens to float32 by a bit
shift (the interpreter's cast mangles bf16 subnormals).  One exception: a NaN converted between float
formats (bf16/fp16/fp32, or an fp8 NaN decoded to a 16-bit float) stays a NaN, but its sign and payload bits
may differ from torch's (torch's own CPU and CUDA paths differ there); only NaN-ness is meaningful.
Same-dtype copies, fp8 encodes and fp8 -> float32 decodes are exact for every bit pattern.

Moves between slots are the family-independent row move of :mod:`kvcore.row_move` (``KVCache.move_kv_cache``).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from kvcore import dtypes
from kvcore.dtypes import is_fp8_dtype, storage_dtype
from kvcore.fp8 import f32_to_bf16_bits, f32_to_fp8_bits, f32_to_fp8_bits_hw, fp8_bits_to_f32, torch_e4m3fn_saturates
from kvcore.kernel_mode import triton_interpreting
from kvcore.row_move import next_pow2 as _next_pow2
from kvcore.row_move import prev_pow2 as _prev_pow2

__all__ = [
    "gather_nope_rope_native",
    "gather_nope_rope_triton",
    "store_nope_rope_native",
    "store_nope_rope_triton",
    "store_rows_native",
    "store_rows_triton",
]


# Tiling (elements), from a sweep on an H200 at 32k DeepSeek-V3 rows (benchmarks/tune_mla_dsa.py): column
# tiles of up to 256, about 2048 elements per program and 2 warps were within noise of the best setting of
# each of the bf16/fp8 stores and gathers (the bf16 copies barely depend on the setting at 2-4 warps).
MAX_BLOCK_C = 256
TILE_ELEMS = 2048
COPY_TILE_ELEMS = 2048
_NUM_WARPS = 2

# The dtype codes of kvcore.dtypes, as the kernel compares them: ``IN`` says what a loaded tensor holds,
# ``OUT`` what a conversion writes (SAME: the bits unchanged).
_SAME = tl.constexpr(dtypes.SAME)
_F32 = tl.constexpr(dtypes.F32)
_F16 = tl.constexpr(dtypes.F16)
_BF16 = tl.constexpr(dtypes.BF16)
_E4M3FN = tl.constexpr(dtypes.E4M3FN)
_E5M2 = tl.constexpr(dtypes.E5M2)


# ==========================================================================================================
# The kernel
# ==========================================================================================================


@triton.jit
def _convert(x, IN: tl.constexpr, OUT: tl.constexpr, SATURATE: tl.constexpr, HW_CVT: tl.constexpr):
    """Loaded values (``IN`` code) -> the values to store (``OUT`` code); see the module docstring."""
    if OUT == _SAME:
        y = x
    else:
        if IN == _BF16:
            # widened by a bit shift (the interpreter's cast mangles bf16 subnormals)
            xf = (x.to(tl.int16, bitcast=True).to(tl.int32) << 16).to(tl.float32, bitcast=True)
        elif IN == _E4M3FN:
            if HW_CVT and (OUT == _F16 or OUT == _BF16):
                # exact, through the hardware conversion; only a NaN's bits differ from the integer decoder,
                # and a NaN's bits are not kept into 16-bit floats anyway (see the module docstring)
                xf = x.to(tl.float8e4nv, bitcast=True).to(tl.float32)
            else:
                xf = fp8_bits_to_f32(x, IN)
        elif IN == _E5M2:
            xf = fp8_bits_to_f32(x, IN)
        else:  # float32 / float16
            xf = x.to(tl.float32)
        if OUT == _F32:
            y = xf
        elif OUT == _F16:
            y = xf.to(tl.float16)
        elif OUT == _BF16:
            if HW_CVT:
                y = xf.to(tl.bfloat16)
            else:
                y = f32_to_bf16_bits(xf).to(tl.int16).to(tl.bfloat16, bitcast=True)
        elif HW_CVT:
            y = f32_to_fp8_bits_hw(xf, OUT, SATURATE).to(tl.uint8)
        else:
            y = f32_to_fp8_bits(xf, OUT, SATURATE).to(tl.uint8)
    return y


@triton.jit
def _copy_part(
    cache_ptr,
    rows,
    tok,
    mask_n,
    ext_ptr,
    ext_sn,
    ext_sd,
    COL0: tl.constexpr,
    WIDTH: tl.constexpr,
    BLOCK_C: tl.constexpr,
    ROW: tl.constexpr,
    EXT_PACKED: tl.constexpr,
    GATHER: tl.constexpr,
    IN: tl.constexpr,
    OUT: tl.constexpr,
    SATURATE: tl.constexpr,
    HW_CVT: tl.constexpr,
):
    """Columns ``[COL0, COL0 + WIDTH)`` of cache rows ``rows`` <-> columns ``[0, WIDTH)`` of the external
    tensor's tokens ``tok`` (store: external -> cache; GATHER: cache -> external)."""
    for c0 in tl.static_range(0, WIDTH, BLOCK_C):
        cols = c0 + tl.arange(0, BLOCK_C)
        mask = mask_n[:, None] & (cols < WIDTH)[None, :]
        if EXT_PACKED:
            ext_off = tok[:, None] * ext_sn + cols[None, :]
        else:
            ext_off = tok[:, None] * ext_sn + cols.to(tl.int64)[None, :] * ext_sd
        cache_off = rows[:, None] * ROW + (COL0 + cols)[None, :]
        if GATHER:
            x = tl.load(cache_ptr + cache_off, mask=mask, other=0)
            tl.store(ext_ptr + ext_off, _convert(x, IN, OUT, SATURATE, HW_CVT), mask=mask)
        else:
            x = tl.load(ext_ptr + ext_off, mask=mask, other=0)
            tl.store(cache_ptr + cache_off, _convert(x, IN, OUT, SATURATE, HW_CVT), mask=mask)


@triton.jit
def _mla_rows_kernel(
    cache_ptr,
    loc_ptr,
    loc_stride,
    n_tokens,
    a_ptr,
    a_sn,
    a_sd,
    b_ptr,
    b_sn,
    b_sd,
    ROW: tl.constexpr,
    A_WIDTH: tl.constexpr,
    B_WIDTH: tl.constexpr,
    BLOCK_A: tl.constexpr,
    BLOCK_B: tl.constexpr,
    A_PACKED: tl.constexpr,
    B_PACKED: tl.constexpr,
    GATHER: tl.constexpr,
    A_IN: tl.constexpr,
    A_OUT: tl.constexpr,
    B_IN: tl.constexpr,
    B_OUT: tl.constexpr,
    SATURATE: tl.constexpr,
    HW_CVT: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """Part A (nope) is columns ``[0, A_WIDTH)`` of a row, part B (rope) ``[A_WIDTH, A_WIDTH + B_WIDTH)``;
    ``cache_ptr`` already points at the layer."""
    tok = tl.program_id(0).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = tok < n_tokens
    rows = tl.load(loc_ptr + tok * loc_stride, mask=mask_n, other=0).to(tl.int64)
    _copy_part(
        cache_ptr, rows, tok, mask_n, a_ptr, a_sn, a_sd, 0, A_WIDTH, BLOCK_A, ROW, A_PACKED, GATHER,
        A_IN, A_OUT, SATURATE, HW_CVT,
    )  # fmt: skip
    if B_WIDTH > 0:
        _copy_part(
            cache_ptr, rows, tok, mask_n, b_ptr, b_sn, b_sd, A_WIDTH, B_WIDTH, BLOCK_B, ROW, B_PACKED, GATHER,
            B_IN, B_OUT, SATURATE, HW_CVT,
        )  # fmt: skip


@functools.lru_cache(maxsize=1024)
def _plan(a_width: int, b_width: int, n_pad: int, copy: bool) -> tuple[int, int, int]:
    """(BLOCK_N, BLOCK_A, BLOCK_B) for parts of the given widths and ``n_pad`` (a power of two) tokens."""
    block_a = min(_next_pow2(a_width), MAX_BLOCK_C)
    block_b = min(_next_pow2(b_width), MAX_BLOCK_C) if b_width else 1
    tile = COPY_TILE_ELEMS if copy else TILE_ELEMS
    block_n = max(1, min(tile // max(block_a, block_b), n_pad))
    return block_n, block_a, block_b


def _launch(kv_cache, layer_index, loc, a, b, a_in, a_out, b_in, b_out, gather: bool) -> None:
    """One launch over ``loc``; ``a``/``b`` are 2-D [N, width] views (b may be None) in their kernel dtype."""
    n = loc.shape[0]
    if n == 0:
        return
    a_width = a.shape[1]
    b_width = 0 if b is None else b.shape[1]
    if b is None:
        b = a
    copy = a_out == dtypes.SAME and (b_width == 0 or b_out == dtypes.SAME)
    block_n, block_a, block_b = _plan(a_width, b_width, _next_pow2(n), copy)
    layer = kv_cache[layer_index]
    _mla_rows_kernel[(triton.cdiv(n, block_n),)](
        layer, loc, loc.stride(0), n, a, a.stride(0), a.stride(1), b, b.stride(0), b.stride(1),
        ROW=kv_cache.stride(1), A_WIDTH=a_width, B_WIDTH=b_width, BLOCK_A=block_a, BLOCK_B=block_b,
        A_PACKED=a.stride(1) == 1, B_PACKED=b.stride(1) == 1, GATHER=gather,
        A_IN=a_in, A_OUT=a_out, B_IN=b_in, B_OUT=b_out,
        SATURATE=torch_e4m3fn_saturates(), HW_CVT=not triton_interpreting(), BLOCK_N=block_n,
        num_warps=_NUM_WARPS,
    )  # fmt: skip


# ==========================================================================================================
# Argument checks and codes
# ==========================================================================================================


def _row_width(kv_cache: torch.Tensor, cache_dtype: torch.dtype) -> int:
    """Elements of one row of ``kv_cache`` [L, R, 1, D] or [L, R, D]; checks dtype and row contiguity."""
    if kv_cache.dim() == 4 and kv_cache.shape[2] == 1:
        width, inner = kv_cache.shape[3], (kv_cache.stride(3),)
    elif kv_cache.dim() == 3:
        width, inner = kv_cache.shape[2], (kv_cache.stride(2),)
    else:
        raise ValueError(f"kv_cache must be [L, R, 1, D] or [L, R, D], got {tuple(kv_cache.shape)}")
    if inner[0] != 1 or kv_cache.stride(1) < width:
        raise ValueError("kv_cache rows must be contiguous")
    want = storage_dtype(cache_dtype)
    if kv_cache.dtype != want:
        raise ValueError(f"cache_dtype {cache_dtype} is stored as {want}, got kv_cache of {kv_cache.dtype}")
    return width


def _check_layer_and_loc(kv_cache: torch.Tensor, layer_index: int, loc: torch.Tensor) -> int:
    if not 0 <= layer_index < kv_cache.shape[0]:
        raise ValueError(f"layer_index {layer_index} out of range for {kv_cache.shape[0]} layers")
    if loc.dim() != 1 or loc.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"loc must be a 1-D int32/int64 tensor, got {loc.dtype} {tuple(loc.shape)}")
    if loc.device != kv_cache.device:
        raise ValueError(f"loc is on {loc.device}, kv_cache on {kv_cache.device}")
    return loc.shape[0]


def _as_rows(x: torch.Tensor, n: int, what: str) -> torch.Tensor:
    """``x`` as a 2-D [N, W] view (from [N, W] or [N, 1, W]); never copies."""
    if x.dim() == 3 and x.shape[1] == 1:
        x = x.select(1, 0)
    if x.dim() != 2 or x.shape[0] != n:
        raise ValueError(f"{what} must be [N, 1, W] or [N, W] with N = len(loc) = {n}, got {tuple(x.shape)}")
    return x


def _kernel_view(x: torch.Tensor) -> torch.Tensor:
    """fp8 tensors as their uint8 bytes (same shape and strides)."""
    return x.view(torch.uint8) if is_fp8_dtype(x.dtype) else x


def _check_store(kv_cache, layer_index, loc, parts, cache_dtype) -> list[torch.Tensor]:
    """Validate a store of ``parts`` ({name: tensor}, written side by side from column 0); 2-D views."""
    width = _row_width(kv_cache, cache_dtype)
    n = _check_layer_and_loc(kv_cache, layer_index, loc)
    views = []
    for name, x in parts.items():
        dtypes.dtype_code(x.dtype, name)
        dtypes.conversion_code(x.dtype, cache_dtype, name)
        if x.device != kv_cache.device:
            raise ValueError(f"{name} is on {x.device}, kv_cache on {kv_cache.device}")
        views.append(_as_rows(x, n, name))
    total = sum(v.shape[1] for v in views)
    if total > width:
        widths = " + ".join(f"{name} {v.shape[1]}" for name, v in zip(parts, views))
        raise ValueError(f"{widths} = {total} columns do not fit a cache row of {width}")
    return views


# ==========================================================================================================
# Split store (set_mla_kv_buffer)
# ==========================================================================================================


def _to_storage(x: torch.Tensor, cache_dtype: torch.dtype) -> torch.Tensor:
    """Torch's conversion of ``x`` to the cache dtype, as storage-dtype values."""
    y = x if x.dtype == cache_dtype else x.to(cache_dtype)
    return y.view(torch.uint8) if is_fp8_dtype(cache_dtype) else y


def store_nope_rope_native(
    kv_cache: torch.Tensor,
    layer_index: int,
    loc: torch.Tensor,
    cache_k_nope: torch.Tensor,
    cache_k_rope: torch.Tensor,
    *,
    cache_dtype: torch.dtype,
) -> None:
    """Torch reference of :func:`store_nope_rope_triton` (same signature and semantics)."""
    parts = {"cache_k_nope": cache_k_nope, "cache_k_rope": cache_k_rope}
    nope, rope = _check_store(kv_cache, layer_index, loc, parts, cache_dtype)
    if loc.shape[0] == 0:
        return
    idx = loc.long()
    rows = kv_cache[layer_index].flatten(1)
    r = nope.shape[1]
    rows[idx, :r] = _to_storage(nope, cache_dtype)
    rows[idx, r : r + rope.shape[1]] = _to_storage(rope, cache_dtype)


def store_nope_rope_triton(
    kv_cache: torch.Tensor,
    layer_index: int,
    loc: torch.Tensor,
    cache_k_nope: torch.Tensor,
    cache_k_rope: torch.Tensor,
    *,
    cache_dtype: torch.dtype,
) -> None:
    """Write the latent rows of ``loc.numel()`` tokens from their two parts, in one launch.

    :param kv_cache: ``[L, R, 1, D]`` (or ``[L, R, D]``) cache with contiguous rows, dtype
        ``storage_dtype(cache_dtype)``.
    :param layer_index: 0-based layer in the stacked cache.
    :param loc: ``[N]`` int32 or int64 rows (distinct; duplicates leave one unspecified writer; not
        bounds-checked, which would need a host sync).
    :param cache_k_nope: ``[N, 1, Rn]`` (or ``[N, Rn]``), stored in columns ``[0, Rn)``; any strides.
    :param cache_k_rope: ``[N, 1, Rp]`` (or ``[N, Rp]``), stored in columns ``[Rn, Rn + Rp)``; any strides.
        Each input is float32/float16/bfloat16 or an fp8 dtype, converted separately to ``cache_dtype``
        exactly as ``x.to(cache_dtype)`` (an input already in ``cache_dtype`` is copied bit for bit).
        Neither input is modified.  ``Rn + Rp`` must not exceed ``D``; columns past it are left untouched.
    :param cache_dtype: the cache's logical dtype (``torch.uint8``: raw bytes, inputs must be uint8).
    """
    parts = {"cache_k_nope": cache_k_nope, "cache_k_rope": cache_k_rope}
    nope, rope = _check_store(kv_cache, layer_index, loc, parts, cache_dtype)
    _launch(
        kv_cache, layer_index, loc, _kernel_view(nope), _kernel_view(rope),
        dtypes.dtype_code(nope.dtype, "cache_k_nope"), dtypes.conversion_code(nope.dtype, cache_dtype, "cache_k_nope"),
        dtypes.dtype_code(rope.dtype, "cache_k_rope"), dtypes.conversion_code(rope.dtype, cache_dtype, "cache_k_rope"),
        gather=False,
    )  # fmt: skip


# ==========================================================================================================
# Concatenated store (set_kv_buffer)
# ==========================================================================================================


def store_rows_native(
    kv_cache: torch.Tensor, layer_index: int, loc: torch.Tensor, cache_k: torch.Tensor, *, cache_dtype: torch.dtype
) -> None:
    """Torch reference of :func:`store_rows_triton` (same signature and semantics)."""
    (rows_in,) = _check_store(kv_cache, layer_index, loc, {"cache_k": cache_k}, cache_dtype)
    if loc.shape[0] == 0:
        return
    rows = kv_cache[layer_index].flatten(1)
    rows[loc.long(), : rows_in.shape[1]] = _to_storage(rows_in, cache_dtype)


def store_rows_triton(
    kv_cache: torch.Tensor, layer_index: int, loc: torch.Tensor, cache_k: torch.Tensor, *, cache_dtype: torch.dtype
) -> None:
    """Write already concatenated latent rows ``cache_k`` [N, 1, W] (or [N, W]) into columns ``[0, W)`` of
    rows ``loc``, converted as :func:`store_nope_rope_triton` converts (same arguments otherwise).

    The row is copied as two parts split at the largest power of two below ``W`` (576 = 512 + 64), by the
    split store's kernel: byte-identical to the split store of the same values.
    """
    (rows_in,) = _check_store(kv_cache, layer_index, loc, {"cache_k": cache_k}, cache_dtype)
    width = rows_in.shape[1]
    split = _prev_pow2(width)
    view = _kernel_view(rows_in)
    in_code, out_code = dtypes.dtype_code(rows_in.dtype, "cache_k"), dtypes.conversion_code(rows_in.dtype, cache_dtype, "cache_k")
    tail = view[:, split:] if split < width else None
    _launch(kv_cache, layer_index, loc, view[:, :split], tail, in_code, out_code, in_code, out_code, gather=False)


# ==========================================================================================================
# Gather (get_mla_kv_buffer)
# ==========================================================================================================


def _check_gather(kv_cache, layer_index, loc, out_nope, out_rope, cache_dtype):
    width = _row_width(kv_cache, cache_dtype)
    n = _check_layer_and_loc(kv_cache, layer_index, loc)
    views = []
    for name, x in (("out_nope", out_nope), ("out_rope", out_rope)):
        dtypes.conversion_code(cache_dtype, x.dtype, name)
        if x.device != kv_cache.device:
            raise ValueError(f"{name} is on {x.device}, kv_cache on {kv_cache.device}")
        views.append(_as_rows(x, n, name))
    nope, rope = views
    if nope.shape[1] + rope.shape[1] > width:
        raise ValueError(
            f"out_nope {nope.shape[1]} + out_rope {rope.shape[1]} columns exceed a cache row of {width}"
        )
    cache_storage = kv_cache.untyped_storage().data_ptr()
    if cache_storage in (nope.untyped_storage().data_ptr(), rope.untyped_storage().data_ptr()):
        raise ValueError("gather outputs must not alias the cache")
    return nope, rope


def gather_nope_rope_native(
    kv_cache: torch.Tensor,
    layer_index: int,
    loc: torch.Tensor,
    out_nope: torch.Tensor,
    out_rope: torch.Tensor,
    *,
    cache_dtype: torch.dtype,
) -> None:
    """Torch reference of :func:`gather_nope_rope_triton` (same signature and semantics)."""
    nope, rope = _check_gather(kv_cache, layer_index, loc, out_nope, out_rope, cache_dtype)
    if loc.shape[0] == 0:
        return
    rows = kv_cache[layer_index].flatten(1)[loc.long()]
    if is_fp8_dtype(cache_dtype):
        rows = rows.view(cache_dtype)
    r = nope.shape[1]
    nope.copy_(rows[:, :r].to(nope.dtype))
    rope.copy_(rows[:, r : r + rope.shape[1]].to(rope.dtype))


def gather_nope_rope_triton(
    kv_cache: torch.Tensor,
    layer_index: int,
    loc: torch.Tensor,
    out_nope: torch.Tensor,
    out_rope: torch.Tensor,
    *,
    cache_dtype: torch.dtype,
) -> None:
    """Read rows ``loc`` of layer ``layer_index`` into ``out_nope`` (columns ``[0, Rn)``) and ``out_rope``
    (columns ``[Rn, Rn + Rp)``), in one launch.

    :param out_nope: ``[N, 1, Rn]`` (or ``[N, Rn]``) output, any strides, float32/float16/bfloat16 or fp8;
        values are ``row.view(cache_dtype).to(out.dtype)`` (fp8 caches decode exactly; a same-dtype output
        receives the bits).
    :param out_rope: ``[N, 1, Rp]`` (or ``[N, Rp]``) output, likewise.
    Other arguments as :func:`store_nope_rope_triton`.  The cache is not modified.
    """
    nope, rope = _check_gather(kv_cache, layer_index, loc, out_nope, out_rope, cache_dtype)
    in_code = dtypes.dtype_code(cache_dtype, "cache_dtype")
    _launch(
        kv_cache, layer_index, loc, _kernel_view(nope), _kernel_view(rope),
        in_code, dtypes.conversion_code(cache_dtype, nope.dtype, "out_nope"),
        in_code, dtypes.conversion_code(cache_dtype, rope.dtype, "out_rope"),
        gather=True,
    )  # fmt: skip
