"""Hot-path kernels of the MHA pool: writing new K/V rows into the cache and moving rows between slots.

Buffer format (see the pool): all layers of K live in one contiguous tensor ``k_cache`` of shape
``[L, R, H, Dk]`` and V in ``v_cache`` of shape ``[L, R, H, Dv]`` (R = size + page_size rows, row 0 is
padding).  The storage dtype is the cache dtype, except fp8 caches, which are stored as ``torch.uint8``
holding float8_e4m3fn / float8_e5m2 bytes.  Offsets are computed in int64 (pools exceed 2**31 bytes).

Every kernel has a torch reference of the same signature beside it (``*_native``).  Nothing here picks an
implementation: the pool calls ``*_triton`` or ``*_native`` (see ``kvcore.kernel_mode``).

``store_kv_triton``
    One launch writes K and V: grid ``(token blocks, column blocks of K + column blocks of V)``; a program
    copies a ``[BLOCK_N, BLOCK_C]`` tile (rows of the layer addressed through ``loc``, columns of the
    flattened ``H * D`` row), converting to the cache dtype on the way.  Column blocks are up to
    ``STORE_MAX_BLOCK_C`` elements wide and ``BLOCK_N`` fills a tile of ``STORE_TILE_ELEMS`` elements.
    Sources may be strided in the token and head dims (qkv splits); when the head dim is packed
    (``stride(1) == D * stride(2)`` and ``stride(2) == 1``) the load is a plain contiguous row.

``move_kv_cache_triton``
    ``buf[:, tgt] = buf[:, src]`` for every layer of K and V in one launch, with gather-then-scatter
    semantics even when ``tgt`` and ``src`` overlap.  Rows are handled as 32-/16-/8-bit words (whichever
    divides the row), so any dtype works.  Grid ``(2 * L, column tiles)``: a program owns one (buffer,
    layer, column tile) region, loads the source rows of its tile for ALL N locations into registers,
    synchronises its threads, then stores them; programs touch disjoint regions, so nothing races.  The
    tile width shrinks as N grows (about ``MOVE_TILE_BYTES`` per program, at most ``MOVE_MAX_TILE_BYTES``,
    and never under one 32-byte memory sector: narrower tiles measured 5x slower on an H200).  It serves
    ``N <= MOVE_MAX_TOKENS`` (512).  Larger moves first mark the source rows and flag, on the device, whether
    any target is another location's source; without overlap one launch per buffer copies the rows in a
    single parallel pass, with overlap the rows go through a scratch buffer (gather, then scatter, a group
    of layers at a time, at most ``MOVE_SCRATCH_BYTES``).  The path not taken exits at once, so no host
    sync decides anything and both paths are CUDA-graph safe (the large path allocates its flag and
    scratch from torch's caching allocator).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from kvcore.kernel_mode import triton_interpreting

from kvcore.fp8 import (
    FP8_DTYPES,
    f32_to_bf16_bits,
    f32_to_fp8_bits,
    f32_to_fp8_bits_hw,
    fp8_kind,
    is_fp8_dtype,
    storage_dtype,
    torch_e4m3fn_saturates,
)

__all__ = [
    "MOVE_MAX_TOKENS",
    "MOVE_SCRATCH_BYTES",
    "move_kv_cache_native",
    "move_kv_cache_triton",
    "store_kv_native",
    "store_kv_triton",
]

# store_kv tiling (elements, not bytes).
STORE_MAX_BLOCK_C = 1024
STORE_TILE_ELEMS = 4096  # elements per program when converting (fp8 32k tokens: 0.92 of the copy ceiling)
STORE_COPY_TILE_ELEMS = 2048  # same-dtype stores (bf16 32k tokens: 0.92, against 0.90 with 4096)

# move_kv_cache tiling (bytes).
MOVE_TILE_BYTES = 32 * 1024  # target bytes per program in registers
MOVE_MAX_TILE_BYTES = 64 * 1024  # hard cap per program
MOVE_MIN_TILE_BYTES = 32  # one DRAM sector
MOVE_MAX_TOKENS = 512  # beyond this, the device-flagged row copy (measured faster on an H200 from 1024 slots)
MOVE_SCRATCH_BYTES = 256 * 1024 * 1024  # scratch bound of the fallback
# Large-move row copies: 64 KB per program, 8 warps (benchmarks/tune_mha.py on an H200: 0.84 of the copy
# ceiling at 4096 slots x 32 layers, against 0.77 with 16 KB and 4 warps).
_COPY_TILE_WORDS = 16384
_COPY_NUM_WARPS = 8
_STORE_NUM_WARPS = 4
_COPY_MAX_BLOCK_C = 1024
_FLAG_BLOCK = 1024

# Output codes of the store kernel's conversion.
_OUT_COPY = 0  # input dtype == cache dtype, no scale: move the bits
_OUT_F32 = 1
_OUT_F16 = 2
_OUT_BF16 = 3  # integer RNE (the interpreter truncates .to(tl.bfloat16)), bitcast to bf16
_OUT_FP8 = 4  # encoded with integer bit operations, stored as uint8

_FLOAT_INPUTS = (torch.float32, torch.float16, torch.bfloat16)

# Scale modes.
_SCALE_NONE = 0
_SCALE_VALUE = 1
_SCALE_POINTER = 2


def _next_pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def _prev_pow2(n: int) -> int:
    return 1 << (max(n, 1).bit_length() - 1)


# ==========================================================================================================
# store_kv
# ==========================================================================================================


def _check_store_args(k_cache, v_cache, layer_index, loc, cache_k, cache_v, cache_dtype, k_scale, v_scale):
    ks, vs = k_cache.shape, v_cache.shape
    if len(ks) != 4 or len(vs) != 4 or ks[:3] != vs[:3]:
        raise ValueError(f"caches must be [L, R, H, D] alike, got {tuple(ks)} and {tuple(vs)}")
    want = storage_dtype(cache_dtype)
    if k_cache.dtype != want or v_cache.dtype != want:
        raise ValueError(
            f"cache_dtype {cache_dtype} is stored as {want}, got k_cache {k_cache.dtype}, v_cache {v_cache.dtype}"
        )
    if not 0 <= layer_index < ks[0]:
        raise ValueError(f"layer_index {layer_index} out of range for {ks[0]} layers")
    if loc.dim() != 1 or loc.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"loc must be a 1-D int32/int64 tensor, got {loc.dtype} {tuple(loc.shape)}")
    n = loc.shape[0]
    if cache_k.shape != (n, ks[2], ks[3]):
        raise ValueError(f"cache_k must be [N, H, Dk] = {(n, ks[2], ks[3])}, got {tuple(cache_k.shape)}")
    if cache_v.shape != (n, vs[2], vs[3]):
        raise ValueError(f"cache_v must be [N, H, Dv] = {(n, vs[2], vs[3])}, got {tuple(cache_v.shape)}")
    if cache_k.dtype != cache_v.dtype:
        raise ValueError(f"cache_k and cache_v must share a dtype, got {cache_k.dtype} and {cache_v.dtype}")
    if cache_k.dtype not in _FLOAT_INPUTS:
        if cache_k.dtype != cache_dtype:
            raise ValueError(f"unsupported input dtype {cache_k.dtype} for cache dtype {cache_dtype}")
        if k_scale is not None or v_scale is not None:
            raise ValueError("inputs already in the fp8 cache dtype are copied as bytes; they take no scale")


def _scale_tensor(scale, device) -> torch.Tensor:
    """The scale as a float32 tensor of shape [1] on ``device`` (a device tensor, so that torch divides
    element-wise instead of multiplying by a host-computed reciprocal)."""
    return torch.as_tensor(scale, dtype=torch.float32).to(device).reshape(1)


def _convert_native(x: torch.Tensor, cache_dtype: torch.dtype, scale) -> torch.Tensor:
    if is_fp8_dtype(cache_dtype):
        if x.dtype == cache_dtype and scale is None:
            return x.view(torch.uint8)
        xf = x.float()
        if scale is not None:
            xf = xf / _scale_tensor(scale, x.device)
        return xf.to(cache_dtype).view(torch.uint8)
    return x.to(cache_dtype)


def store_kv_native(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    layer_index: int,
    loc: torch.Tensor,
    cache_k: torch.Tensor,
    cache_v: torch.Tensor,
    *,
    k_scale=None,
    v_scale=None,
    cache_dtype: torch.dtype,
) -> None:
    """Torch reference of :func:`store_kv_triton` (same signature and semantics)."""
    _check_store_args(k_cache, v_cache, layer_index, loc, cache_k, cache_v, cache_dtype, k_scale, v_scale)
    if not is_fp8_dtype(cache_dtype):
        k_scale = v_scale = None
    idx = loc.long()
    k_cache[layer_index, idx] = _convert_native(cache_k, cache_dtype, k_scale)
    v_cache[layer_index, idx] = _convert_native(cache_v, cache_dtype, v_scale)


@triton.jit
def _store_tile(
    dst_ptr,
    src_ptr,
    loc_ptr,
    loc_stride,
    n_tokens,
    pid_n,
    pid_c,
    src_sn,
    src_sh,
    src_sd,
    scale_ptr,
    scale_value,
    D: tl.constexpr,
    HD: tl.constexpr,
    DST_ROW_STRIDE: tl.constexpr,
    SRC_PACKED: tl.constexpr,
    OUT: tl.constexpr,
    FP8_KIND: tl.constexpr,
    SATURATE: tl.constexpr,
    SCALE_MODE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_C: tl.constexpr,
    HW_CVT: tl.constexpr,
):
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
    mask_n = offs_n < n_tokens
    mask = mask_n[:, None] & (cols < HD)[None, :]
    rows = tl.load(loc_ptr + offs_n.to(tl.int64) * loc_stride, mask=mask_n, other=0).to(tl.int64)

    if SRC_PACKED:
        src_off = offs_n.to(tl.int64)[:, None] * src_sn + cols[None, :]
    else:
        heads = (cols // D).to(tl.int64)
        dims = (cols % D).to(tl.int64)
        src_off = offs_n.to(tl.int64)[:, None] * src_sn + (heads * src_sh + dims * src_sd)[None, :]
    x = tl.load(src_ptr + src_off, mask=mask, other=0)
    dst = dst_ptr + rows[:, None] * DST_ROW_STRIDE + cols[None, :]

    if OUT == 0:
        tl.store(dst, x, mask=mask)
    else:
        xf = x.to(tl.float32)
        if OUT == 1:
            tl.store(dst, xf, mask=mask)
        elif OUT == 2:
            tl.store(dst, xf.to(tl.float16), mask=mask)
        elif OUT == 3:
            if HW_CVT:
                tl.store(dst, xf.to(tl.bfloat16), mask=mask)
            else:
                tl.store(dst, f32_to_bf16_bits(xf).to(tl.int16).to(tl.bfloat16, bitcast=True), mask=mask)
        else:
            if SCALE_MODE == 1:
                xf = tl.math.div_rn(xf, tl.zeros_like(xf) + scale_value)
            elif SCALE_MODE == 2:
                s = tl.load(scale_ptr).to(tl.float32)
                xf = tl.math.div_rn(xf, tl.zeros_like(xf) + s)
            if HW_CVT:
                tl.store(dst, f32_to_fp8_bits_hw(xf, FP8_KIND, SATURATE).to(tl.uint8), mask=mask)
            else:
                tl.store(dst, f32_to_fp8_bits(xf, FP8_KIND, SATURATE).to(tl.uint8), mask=mask)


@triton.jit
def _store_kv_kernel(
    k_cache_ptr,
    v_cache_ptr,
    k_layer_offset,
    v_layer_offset,
    k_src_ptr,
    v_src_ptr,
    loc_ptr,
    loc_stride,
    n_tokens,
    k_src_sn,
    k_src_sh,
    k_src_sd,
    v_src_sn,
    v_src_sh,
    v_src_sd,
    k_scale_ptr,
    v_scale_ptr,
    k_scale_value,
    v_scale_value,
    DK: tl.constexpr,
    DV: tl.constexpr,
    HDK: tl.constexpr,
    HDV: tl.constexpr,
    K_ROW_STRIDE: tl.constexpr,
    V_ROW_STRIDE: tl.constexpr,
    K_PACKED: tl.constexpr,
    V_PACKED: tl.constexpr,
    OUT: tl.constexpr,
    FP8_KIND: tl.constexpr,
    SATURATE: tl.constexpr,
    K_SCALE_MODE: tl.constexpr,
    V_SCALE_MODE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_CK: tl.constexpr,
    BLOCK_CV: tl.constexpr,
    NUM_CB_K: tl.constexpr,
    HW_CVT: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_c = tl.program_id(1)
    if pid_c < NUM_CB_K:
        _store_tile(
            k_cache_ptr + k_layer_offset, k_src_ptr, loc_ptr, loc_stride, n_tokens, pid_n, pid_c,
            k_src_sn, k_src_sh, k_src_sd, k_scale_ptr, k_scale_value,
            DK, HDK, K_ROW_STRIDE, K_PACKED, OUT, FP8_KIND, SATURATE, K_SCALE_MODE, BLOCK_N, BLOCK_CK, HW_CVT,
        )  # fmt: skip
    else:
        _store_tile(
            v_cache_ptr + v_layer_offset, v_src_ptr, loc_ptr, loc_stride, n_tokens, pid_n, pid_c - NUM_CB_K,
            v_src_sn, v_src_sh, v_src_sd, v_scale_ptr, v_scale_value,
            DV, HDV, V_ROW_STRIDE, V_PACKED, OUT, FP8_KIND, SATURATE, V_SCALE_MODE, BLOCK_N, BLOCK_CV, HW_CVT,
        )  # fmt: skip


def _scale_args(scale, dummy: torch.Tensor):
    """(mode, pointer, value) for a scale given as None, a python number, or a 0-d/1-element tensor.
    Tensors are read inside the kernel (no host sync; CUDA-graph safe)."""
    if scale is None:
        return _SCALE_NONE, dummy, 1.0
    if isinstance(scale, torch.Tensor):
        if scale.numel() != 1:
            raise ValueError(f"a scale tensor must hold one element, got shape {tuple(scale.shape)}")
        if scale.device != dummy.device:
            raise ValueError(f"scale tensor on {scale.device}, cache on {dummy.device}")
        return _SCALE_POINTER, scale, 1.0
    return _SCALE_VALUE, dummy, float(scale)


def store_kv_triton(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    layer_index: int,
    loc: torch.Tensor,
    cache_k: torch.Tensor,
    cache_v: torch.Tensor,
    *,
    k_scale=None,
    v_scale=None,
    cache_dtype: torch.dtype,
) -> None:
    """Write ``cache_k`` [N, H, Dk] and ``cache_v`` [N, H, Dv] into rows ``loc`` of layer ``layer_index``.

    :param k_cache: ``[L, R, H, Dk]`` cache, rows contiguous (``stride(2) == Dk``, ``stride(3) == 1``),
        dtype ``storage_dtype(cache_dtype)``.
    :param v_cache: ``[L, R, H, Dv]`` cache, same conditions.
    :param layer_index: 0-based layer in the stacked caches.
    :param loc: ``[N]`` int32 or int64 row indices (distinct; duplicates leave one unspecified writer).
    :param cache_k: ``[N, H, Dk]`` float32/float16/bfloat16, or ``cache_dtype`` itself (then copied as is,
        fp8 included, and no scale is accepted); any strides (qkv-split views need no copy).
    :param cache_v: ``[N, H, Dv]`` likewise.  Neither input is modified.
    :param k_scale: fp8 caches only: K is divided (IEEE division in float32) by this scale before
        encoding; a python number or a 0-d/1-element tensor on the cache's device (read in the kernel).
        Ignored for non-fp8 caches.
    :param v_scale: likewise for V.
    :param cache_dtype: the cache's logical dtype.  Same as the input: plain copy; float casts round to
        nearest even; fp8 bytes are bit-exact with ``(x.float() / scale).to(cache_dtype)`` of the torch
        running the process (see ``kvcore.fp8`` for e4m3fn overflow).
    """
    _check_store_args(k_cache, v_cache, layer_index, loc, cache_k, cache_v, cache_dtype, k_scale, v_scale)
    n = loc.shape[0]
    if n == 0:
        return
    _, _, h, dk = k_cache.shape
    dv = v_cache.shape[3]
    kcs, vcs = k_cache.stride(), v_cache.stride()
    if kcs[3] != 1 or kcs[2] != dk or vcs[3] != 1 or vcs[2] != dv:
        raise ValueError("cache rows must be contiguous ([H, D] packed)")
    fp8 = cache_dtype in FP8_DTYPES
    if not fp8:
        k_scale = v_scale = None

    k_src, v_src = cache_k, cache_v
    if cache_k.dtype == cache_dtype and k_scale is None and v_scale is None:
        out = _OUT_COPY
        if fp8:
            k_src, v_src = cache_k.view(torch.uint8), cache_v.view(torch.uint8)
    elif fp8:
        out = _OUT_FP8
    elif cache_dtype == torch.float32:
        out = _OUT_F32
    elif cache_dtype == torch.float16:
        out = _OUT_F16
    elif cache_dtype == torch.bfloat16:
        out = _OUT_BF16
    else:
        raise ValueError(f"unsupported cache dtype {cache_dtype}")

    k_mode, k_scale_ptr, k_scale_value = _scale_args(k_scale, k_cache)
    v_mode, v_scale_ptr, v_scale_value = _scale_args(v_scale, v_cache)
    kss, vss = k_src.stride(), v_src.stride()
    block_n, block_ck, block_cv, num_cb_k, num_cb = _store_plan(h * dk, h * dv, _next_pow2(n), out == _OUT_COPY)
    _store_kv_kernel[(triton.cdiv(n, block_n), num_cb)](
        k_cache, v_cache, layer_index * kcs[0], layer_index * vcs[0],
        k_src, v_src, loc, loc.stride(0), n,
        kss[0], kss[1], kss[2], vss[0], vss[1], vss[2],
        k_scale_ptr, v_scale_ptr, k_scale_value, v_scale_value,
        DK=dk, DV=dv, HDK=h * dk, HDV=h * dv, K_ROW_STRIDE=kcs[1], V_ROW_STRIDE=vcs[1],
        K_PACKED=kss[2] == 1 and kss[1] == dk, V_PACKED=vss[2] == 1 and vss[1] == dv,
        OUT=out, FP8_KIND=fp8_kind(cache_dtype), SATURATE=torch_e4m3fn_saturates(), HW_CVT=not triton_interpreting(),
        K_SCALE_MODE=k_mode, V_SCALE_MODE=v_mode,
        BLOCK_N=block_n, BLOCK_CK=block_ck, BLOCK_CV=block_cv, NUM_CB_K=num_cb_k,
        num_warps=_STORE_NUM_WARPS,
    )  # fmt: skip


@functools.lru_cache(maxsize=1024)
def _store_plan(hdk: int, hdv: int, n_pad: int, copy: bool) -> tuple[int, int, int, int, int]:
    """(BLOCK_N, BLOCK_CK, BLOCK_CV, column blocks of K, column blocks of K + V) of the store kernel."""
    block_ck = min(_next_pow2(hdk), STORE_MAX_BLOCK_C)
    block_cv = min(_next_pow2(hdv), STORE_MAX_BLOCK_C)
    tile = STORE_COPY_TILE_ELEMS if copy else STORE_TILE_ELEMS
    block_n = max(1, min(tile // max(block_ck, block_cv), n_pad))
    num_cb_k = triton.cdiv(hdk, block_ck)
    return block_n, block_ck, block_cv, num_cb_k, num_cb_k + triton.cdiv(hdv, block_cv)


# ==========================================================================================================
# move_kv_cache
# ==========================================================================================================


def _check_move_args(k_cache, v_cache, tgt_loc, src_loc):
    if k_cache.dim() < 2 or v_cache.dim() < 2 or k_cache.shape[:2] != v_cache.shape[:2]:
        raise ValueError(f"K/V caches must be [L, R, ...] alike, got {tuple(k_cache.shape)}, {tuple(v_cache.shape)}")
    for name, t in (("tgt_loc", tgt_loc), ("src_loc", src_loc)):
        if t.dim() != 1 or t.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{name} must be a 1-D int32/int64 tensor, got {t.dtype} {tuple(t.shape)}")
    if tgt_loc.shape != src_loc.shape:
        raise ValueError(f"tgt_loc {tuple(tgt_loc.shape)} and src_loc {tuple(src_loc.shape)} differ")


def move_kv_cache_native(
    k_cache: torch.Tensor, v_cache: torch.Tensor, tgt_loc: torch.Tensor, src_loc: torch.Tensor
) -> None:
    """Torch reference of :func:`move_kv_cache_triton`: per layer, gather the source rows, then scatter."""
    _check_move_args(k_cache, v_cache, tgt_loc, src_loc)
    if tgt_loc.numel() == 0:
        return
    tgt, src = tgt_loc.long(), src_loc.long()
    for buf in (k_cache, v_cache):
        for layer in range(buf.shape[0]):
            rows = buf[layer].index_select(0, src)
            buf[layer].index_copy_(0, tgt, rows)


def _row_words(buf: torch.Tensor) -> torch.Tensor:
    """``buf`` [L, R, ...] (contiguous) viewed as [L, R, W] words of the widest of int32/int16/uint8 that
    divides a row and the base address."""
    if not buf.is_contiguous():
        raise ValueError("cache buffers must be contiguous")
    L, R = buf.shape[:2]
    row_bytes = buf[0, 0].numel() * buf.element_size()
    b = buf.view(torch.uint8).reshape(L, R, row_bytes)
    for dt, w in ((torch.int32, 4), (torch.int16, 2)):
        if row_bytes % w == 0 and b.data_ptr() % w == 0:
            return b.view(dt)
    return b


@triton.jit
def _as_words(ptr, WORD: tl.constexpr):
    if WORD == 4:
        p = ptr.to(tl.pointer_type(tl.int32))
    elif WORD == 2:
        p = ptr.to(tl.pointer_type(tl.int16))
    else:
        p = ptr.to(tl.pointer_type(tl.uint8))
    return p


@triton.jit
def _move_tile(
    base_ptr, layer, layer_stride, tgt, src, mask_n, pid_c, ROW: tl.constexpr, TILE: tl.constexpr,
    WORD: tl.constexpr,
):  # fmt: skip
    if pid_c * TILE < ROW:
        cols = pid_c * TILE + tl.arange(0, TILE)
        mask = mask_n[:, None] & (cols < ROW)[None, :]
        ptr = _as_words(base_ptr, WORD) + layer.to(tl.int64) * layer_stride
        vals = tl.load(ptr + src[:, None] * ROW + cols[None, :], mask=mask)
        # All threads of the program must finish reading before any writes: a target row of one
        # location may be the source row of another, held by a different thread.
        tl.debug_barrier()
        tl.store(ptr + tgt[:, None] * ROW + cols[None, :], vals, mask=mask)


@triton.jit
def _move_kv_kernel(
    k_ptr,
    v_ptr,
    tgt_ptr,
    src_ptr,
    tgt_stride,
    src_stride,
    n_tokens,
    num_layers,
    k_layer_stride,
    v_layer_stride,
    K_ROW: tl.constexpr,
    V_ROW: tl.constexpr,
    K_TILE: tl.constexpr,
    V_TILE: tl.constexpr,
    K_WORD: tl.constexpr,
    V_WORD: tl.constexpr,
    N_PAD: tl.constexpr,
):
    """Strides, ROW and TILE are in words of WORD bytes (the caches' pointers are cast to those words)."""
    pid_b = tl.program_id(0)
    pid_c = tl.program_id(1)
    offs = tl.arange(0, N_PAD)
    mask_n = offs < n_tokens
    tgt = tl.load(tgt_ptr + offs * tgt_stride, mask=mask_n, other=0).to(tl.int64)
    src = tl.load(src_ptr + offs * src_stride, mask=mask_n, other=0).to(tl.int64)
    if pid_b < num_layers:
        _move_tile(k_ptr, pid_b, k_layer_stride, tgt, src, mask_n, pid_c, K_ROW, K_TILE, K_WORD)
    else:
        _move_tile(v_ptr, pid_b - num_layers, v_layer_stride, tgt, src, mask_n, pid_c, V_ROW, V_TILE, V_WORD)


def _word_bytes(buf: torch.Tensor) -> int:
    """The widest of 4/2/1 bytes dividing a row of ``buf`` [L, R, ...] (contiguous) and its address."""
    row_bytes = buf.stride(1) * buf.element_size()
    ptr = buf.data_ptr()
    for w in (4, 2):
        if row_bytes % w == 0 and ptr % w == 0:
            return w
    return 1


@functools.lru_cache(maxsize=1024)
def _move_plan(n: int, k_row_bytes: int, v_row_bytes: int) -> tuple[int, int]:
    """(N_pad, tile bytes) of the single-launch path."""
    n_pad = _next_pow2(n)
    row_cap = _next_pow2(max(k_row_bytes, v_row_bytes))
    tile = _prev_pow2(max(MOVE_TILE_BYTES // n_pad, MOVE_MIN_TILE_BYTES))
    return n_pad, max(1, min(tile, row_cap))


@triton.jit
def _copy_rows_kernel(
    src_ptr,
    dst_ptr,
    src_idx_ptr,
    dst_idx_ptr,
    src_idx_stride,
    dst_idx_stride,
    n_rows,
    src_layer_stride,
    dst_layer_stride,
    guard_ptr,
    ROW: tl.constexpr,
    SRC_INDEXED: tl.constexpr,
    DST_INDEXED: tl.constexpr,
    GUARD: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    """dst[layer, dst_idx[i]] = src[layer, src_idx[i]] (an index is i itself when not INDEXED).

    GUARD: 0 always runs; 1 runs only when ``guard_ptr[0] == 0``; 2 only when it is non-zero (the overlap
    flag of :func:`_flag_overlaps`, read on the device so no host sync decides the path).
    """
    if GUARD == 1:
        if tl.load(guard_ptr) != 0:
            return
    if GUARD == 2:
        if tl.load(guard_ptr) == 0:
            return
    pid_n = tl.program_id(0)
    pid_c = tl.program_id(1)
    layer = tl.program_id(2).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < n_rows
    cols = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
    mask = mask_n[:, None] & (cols < ROW)[None, :]
    if SRC_INDEXED:
        src_rows = tl.load(src_idx_ptr + offs_n.to(tl.int64) * src_idx_stride, mask=mask_n, other=0).to(tl.int64)
    else:
        src_rows = offs_n.to(tl.int64)
    if DST_INDEXED:
        dst_rows = tl.load(dst_idx_ptr + offs_n.to(tl.int64) * dst_idx_stride, mask=mask_n, other=0).to(tl.int64)
    else:
        dst_rows = offs_n.to(tl.int64)
    vals = tl.load(src_ptr + layer * src_layer_stride + src_rows[:, None] * ROW + cols[None, :], mask=mask)
    tl.store(dst_ptr + layer * dst_layer_stride + dst_rows[:, None] * ROW + cols[None, :], vals, mask=mask)


def _copy_rows(src, dst, src_idx, dst_idx, n, guard=None, guard_mode=0):
    """Launch :func:`_copy_rows_kernel` over all layers of ``src``/``dst`` ([Lg, rows, W] word views)."""
    row = src.shape[2]
    block_c = min(_next_pow2(row), _COPY_MAX_BLOCK_C)
    block_n = max(1, min(_COPY_TILE_WORDS // block_c, _next_pow2(n)))
    dummy = src_idx if src_idx is not None else dst_idx
    grid = (triton.cdiv(n, block_n), triton.cdiv(row, block_c), src.shape[0])
    _copy_rows_kernel[grid](
        src, dst, dummy if src_idx is None else src_idx, dummy if dst_idx is None else dst_idx,
        1 if src_idx is None else src_idx.stride(0), 1 if dst_idx is None else dst_idx.stride(0), n,
        src.stride(0), dst.stride(0), guard if guard is not None else dummy,
        ROW=row, SRC_INDEXED=src_idx is not None, DST_INDEXED=dst_idx is not None, GUARD=guard_mode,
        BLOCK_N=block_n, BLOCK_C=block_c, num_warps=_COPY_NUM_WARPS,
    )  # fmt: skip


def _move_via_scratch(
    words: torch.Tensor, tgt_loc: torch.Tensor, src_loc: torch.Tensor, guard=None, guard_mode: int = 0
) -> None:
    """Gather-then-scatter of one [L, R, W] word view through a scratch of at most MOVE_SCRATCH_BYTES
    (a group of layers at a time; every source row of a layer is read before any of its targets is written)."""
    n = tgt_loc.shape[0]
    layer_bytes = n * words.shape[2] * words.element_size()
    group = max(1, min(words.shape[0], MOVE_SCRATCH_BYTES // max(layer_bytes, 1)))
    scratch = torch.empty((group, n, words.shape[2]), dtype=words.dtype, device=words.device)
    for start in range(0, words.shape[0], group):
        part = words[start : start + group]
        buf = scratch[: part.shape[0]]
        _copy_rows(part, buf, src_loc, None, n, guard, guard_mode)
        _copy_rows(buf, part, None, tgt_loc, n, guard, guard_mode)


@triton.jit
def _mark_sources_kernel(marks_ptr, src_ptr, src_stride, n, BLOCK: tl.constexpr):
    """marks[src[i]] = 1 for every i (marks starts zeroed)."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    src = tl.load(src_ptr + offs.to(tl.int64) * src_stride, mask=mask, other=0).to(tl.int64)
    tl.store(marks_ptr + src, tl.full([BLOCK], 1, tl.int8), mask=mask)


@triton.jit
def _flag_overlaps_kernel(marks_ptr, tgt_ptr, src_ptr, tgt_stride, src_stride, flag_ptr, n, BLOCK: tl.constexpr):
    """flag = 1 when some target row is another location's source row.

    A target equal to its own source is no hazard: whoever reads that row sees its unchanged value.
    """
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tgt = tl.load(tgt_ptr + offs.to(tl.int64) * tgt_stride, mask=mask, other=0).to(tl.int64)
    src = tl.load(src_ptr + offs.to(tl.int64) * src_stride, mask=mask, other=0).to(tl.int64)
    hit = tl.load(marks_ptr + tgt, mask=mask, other=0)
    hazard = mask & (hit != 0) & (tgt != src)
    tl.store(flag_ptr + tl.zeros([BLOCK], tl.int32), tl.full([BLOCK], 1, tl.int32), mask=hazard)


def _flag_overlaps(rows: int, tgt_loc: torch.Tensor, src_loc: torch.Tensor) -> torch.Tensor:
    """A device int32 flag, 1 when the move's targets overlap other locations' sources (no host sync)."""
    n = tgt_loc.shape[0]
    marks = torch.zeros(rows, dtype=torch.int8, device=tgt_loc.device)
    flag = torch.zeros(1, dtype=torch.int32, device=tgt_loc.device)
    grid = (triton.cdiv(n, _FLAG_BLOCK),)
    _mark_sources_kernel[grid](marks, src_loc, src_loc.stride(0), n, BLOCK=_FLAG_BLOCK)
    _flag_overlaps_kernel[grid](
        marks, tgt_loc, src_loc, tgt_loc.stride(0), src_loc.stride(0), flag, n, BLOCK=_FLAG_BLOCK
    )  # fmt: skip
    return flag


def move_kv_cache_triton(
    k_cache: torch.Tensor, v_cache: torch.Tensor, tgt_loc: torch.Tensor, src_loc: torch.Tensor
) -> None:
    """For every layer of K and V: rows ``tgt_loc[i]`` <- rows ``src_loc[i]``, as torch's
    ``buf[:, tgt] = buf[:, src]`` (every source read before any target is written, so overlapping moves
    such as compaction shifts, swaps and cycles are fine).  Targets must be distinct.

    :param k_cache: contiguous ``[L, R, ...]`` buffer, any dtype (rows are moved as raw words).
    :param v_cache: contiguous ``[L, R, ...]`` buffer with the same L and R; its row width may differ.
    :param tgt_loc: ``[N]`` int32/int64 target rows, on the caches' device.
    :param src_loc: ``[N]`` int32/int64 source rows.

    ``N <= MOVE_MAX_TOKENS`` (512): one kernel launch, no allocation, no host sync (CUDA-graph safe; N is
    read from the tensor shape).  Larger N: a device-side overlap flag picks, without a host sync, a
    one-pass parallel row copy (no overlap) or a gather/scatter through a scratch buffer (overlap).
    """
    _check_move_args(k_cache, v_cache, tgt_loc, src_loc)
    n = tgt_loc.shape[0]
    if n == 0:
        return
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("cache buffers must be contiguous")
    if n > MOVE_MAX_TOKENS:
        # The device decides: without overlap a straight parallel row copy (one pass over the bytes);
        # with overlap the gather/scatter through scratch.  The path not taken exits at once.
        flag = _flag_overlaps(k_cache.shape[1], tgt_loc, src_loc)
        for words in (_row_words(k_cache), _row_words(v_cache)):
            _copy_rows(words, words, src_loc, tgt_loc, n, flag, 1)
            _move_via_scratch(words, tgt_loc, src_loc, flag, 2)
        return
    kwb, vwb = _word_bytes(k_cache), _word_bytes(v_cache)
    k_row_bytes = k_cache.stride(1) * k_cache.element_size()
    v_row_bytes = v_cache.stride(1) * v_cache.element_size()
    n_pad, tile_bytes = _move_plan(n, k_row_bytes, v_row_bytes)
    k_tile = max(1, tile_bytes // kwb)
    v_tile = max(1, tile_bytes // vwb)
    k_row, v_row = k_row_bytes // kwb, v_row_bytes // vwb
    n_col = max(triton.cdiv(k_row, k_tile), triton.cdiv(v_row, v_tile))
    num_warps = max(1, min(8, _prev_pow2(n_pad * tile_bytes // 4096)))
    L, R = k_cache.shape[0], k_cache.shape[1]
    _move_kv_kernel[(2 * L, n_col)](
        k_cache, v_cache, tgt_loc, src_loc, tgt_loc.stride(0), src_loc.stride(0), n, L, R * k_row, R * v_row,
        K_ROW=k_row, V_ROW=v_row, K_TILE=k_tile, V_TILE=v_tile, K_WORD=kwb, V_WORD=vwb, N_PAD=n_pad,
        num_warps=num_warps,
    )  # fmt: skip
