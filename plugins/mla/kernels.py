"""Hot-path kernels of the MLA pool: storing latent rows, gathering them back, and moving rows between slots.

Buffer format (see the pool): all layers live in one tensor ``kv_cache`` of shape ``[L, R, 1, D]`` (R = size
+ page_size rows, row 0 is padding; ``[L, R, D]`` is accepted too) whose rows are contiguous.  A row holds the
compressed KV (``kv_lora_rank`` = "nope" columns) followed by the rope key (``qk_rope_head_dim`` columns),
e.g. 512 + 64 = 576 for DeepSeek-V3; a family with its own row format may make ``D`` wider.  The storage dtype
is the cache dtype, except fp8 caches, stored as ``torch.uint8`` holding float8_e4m3fn / float8_e5m2 bytes.
``cache_dtype=torch.uint8`` means raw bytes: inputs and outputs must then be uint8 too and are copied as is
(a family that packs its own byte layout, like DSA's fp8 rows with scales, reuses the kernels that way).

Every kernel has a torch reference of the same signature beside it (``*_native``).  A pool keeps one
:class:`LatentRows` bound to its cache (both paths, everything fixed at creation computed once, compiled
kernels launched directly: :mod:`kvcore.kernels.launch`); the functions below build one per call.

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

Kernel shapes: stores of up to ``ROW_KERNEL_MAX_TOKENS`` tokens (decode steps) one program a token writing its
whole row, both parts, in one tile (:func:`_mla_row_kernel`); larger stores and every gather grid ``(cdiv(N,
BLOCK_N), column blocks of nope + of rope)``, one program per ``[BLOCK_N, BLOCK_C]`` tile (BLOCK_C a power of two
up to ``MAX_BLOCK_C`` elements), which loads its ``BLOCK_N`` locations, then copies its tile, converting on the
way (:func:`_mla_rows_kernel`).  Cache rows are addressed as ``row * D`` with ``D`` a compile-time constant, so
each tile row is one wide contiguous access; offsets are int64 (pools exceed 2**31 bytes); inputs and outputs
may be strided in both dims (a nope/rope split of a larger projection needs no copy; a unit last-dim stride is
specialised).
No host sync and no allocation: the stores are CUDA-graph safe.

Conversions are bit-exact with torch's ``.to()`` of the process's torch, on the interpreter and on GPUs:
float casts round to nearest even (bf16 through :func:`kvcore.kernels.fp8.f32_to_bf16_bits` under the interpreter,
whose own cast truncates), fp8 encodes through :mod:`kvcore.kernels.fp8` (integer encoder under the interpreter,
``cvt`` plus torch's overflow rules on GPUs), fp8 decodes are exact, and bf16 widens to float32 by a bit
shift (the interpreter's cast mangles bf16 subnormals).  One exception: a NaN converted between float
formats (bf16/fp16/fp32, or an fp8 NaN decoded to a 16-bit float) stays a NaN, but its sign and payload bits
may differ from torch's (torch's own CPU and CUDA paths differ there); only NaN-ness is meaningful.
Same-dtype copies, fp8 encodes and fp8 -> float32 decodes are exact for every bit pattern.

Moves between slots are the family-independent row move of :mod:`kvcore.kernels.row_move` (``KVCache.move_kv_cache``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import triton
import triton.language as tl

from kvcore.kernels import dtypes
from kvcore.kernels.addresses import KeepsAddresses
from kvcore.kernels.dtypes import FP8_DTYPES, is_fp8_dtype, storage_dtype
from kvcore.kernels.fp8 import f32_to_bf16_bits, f32_to_fp8_bits, f32_to_fp8_bits_hw, fp8_bits_to_f32, torch_e4m3fn_saturates
from kvcore.kernels.kernel_mode import triton_interpreting
from kvcore.kernels.launch import UNPLANNED, KernelArgs, Launcher, Plan, cdiv, remember
from kvcore.pools import empty_of
from kvcore.kernels.row_move import next_pow2 as _next_pow2
from kvcore.kernels.row_move import prev_pow2 as _prev_pow2

__all__ = [
    "LatentRows",
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
#: warps per program: one per ELEMS_PER_WARP elements of a tile, at most MAX_WARPS.
ELEMS_PER_WARP = 1024
MAX_WARPS = 2
#: stores of up to this many tokens (decode sizes): one program a token writes the whole row
#: (:func:`_mla_row_kernel`), on ROW_KERNEL_WARPS warps.  On an H200 (benchmarks/RESULTS.md, sixth session), per
#: DeepSeek-V3 store in graph replay at 1 / 8 / 64 / 256 tokens: 1.37 / 1.48 / 1.54 / 1.68 us, the tiles 1.48 /
#: 1.69 / 1.77 / 1.84 us; at 4096 tokens the tiles are faster (3.14 us; a probe kernel of one program a token
#: took 3.81).  Gathers keep the tiles: one program a token read slower at 1 and 256 tokens (1.59 against 1.48,
#: 1.84 against 1.82 us).
ROW_KERNEL_MAX_TOKENS = 256
ROW_KERNEL_WARPS = 2

# The dtype codes of kvcore.kernels.dtypes, as the kernel compares them: ``IN`` says what a loaded tensor holds,
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
def _copy_tile(
    cache_ptr, rows, tok, mask_n, ext_ptr, ext_sn, ext_sd, c0, COL0: tl.constexpr, EXT0: tl.constexpr,
    WIDTH: tl.constexpr, BLOCK_C: tl.constexpr, ROW: tl.constexpr, EXT_PACKED: tl.constexpr, GATHER: tl.constexpr,
    IN: tl.constexpr, OUT: tl.constexpr, SATURATE: tl.constexpr, HW_CVT: tl.constexpr,
):  # fmt: skip
    """Columns ``[COL0 + c0, COL0 + c0 + BLOCK_C)`` (within ``WIDTH``) of cache rows ``rows`` <-> columns
    ``[EXT0 + c0, ...)`` of the external tensor's tokens ``tok`` (store: external -> cache; GATHER: back)."""
    cols = c0 + tl.arange(0, BLOCK_C)
    mask = mask_n[:, None] & (cols < WIDTH)[None, :]
    if EXT_PACKED:
        ext_off = tok[:, None] * ext_sn + (EXT0 + cols)[None, :]
    else:
        ext_off = tok[:, None] * ext_sn + (EXT0 + cols).to(tl.int64)[None, :] * ext_sd
    cache_off = rows[:, None] * ROW + (COL0 + cols)[None, :]
    if GATHER:
        x = tl.load(cache_ptr + cache_off, mask=mask, other=0)
        tl.store(ext_ptr + ext_off, _convert(x, IN, OUT, SATURATE, HW_CVT), mask=mask)
    else:
        x = tl.load(ext_ptr + ext_off, mask=mask, other=0)
        tl.store(cache_ptr + cache_off, _convert(x, IN, OUT, SATURATE, HW_CVT), mask=mask)


@triton.jit(do_not_specialize=["layer", "loc_stride", "n_tokens"])
def _mla_rows_kernel(
    cache_ptr, layer, loc_ptr, loc_stride, n_tokens, a_ptr, a_sn, a_sd, b_ptr, b_sn, b_sd,
    LAYER_STRIDE: tl.constexpr, ROW: tl.constexpr, A_WIDTH: tl.constexpr, B_WIDTH: tl.constexpr,
    B_EXT0: tl.constexpr, BLOCK_A: tl.constexpr, BLOCK_B: tl.constexpr, NUM_CB_A: tl.constexpr,
    A_PACKED: tl.constexpr, B_PACKED: tl.constexpr, GATHER: tl.constexpr, A_IN: tl.constexpr, A_OUT: tl.constexpr, B_IN: tl.constexpr,
    B_OUT: tl.constexpr, SATURATE: tl.constexpr, HW_CVT: tl.constexpr, BLOCK_N: tl.constexpr,
    PAGE_SIZE: tl.constexpr, PAGE_ROWS: tl.constexpr,
):  # fmt: skip
    """Grid ``(token blocks, column blocks of part A + of part B)``: each program copies one tile.  Part A
    (nope) is columns ``[0, A_WIDTH)`` of a row, part B (rope) ``[A_WIDTH, A_WIDTH + B_WIDTH)``; part B's
    external columns start at ``B_EXT0`` (0 for its own tensor, ``A_WIDTH`` when both parts are one tensor)."""
    tok = tl.program_id(0).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    pid_c = tl.program_id(1)
    mask_n = tok < n_tokens
    rows = tl.load(loc_ptr + tok * loc_stride, mask=mask_n, other=0).to(tl.int64)
    if PAGE_ROWS > 0:  # page-major rows (LatentRows' pages=)
        rows += (rows // PAGE_SIZE) * (PAGE_ROWS - PAGE_SIZE)
    cache = cache_ptr + layer.to(tl.int64) * LAYER_STRIDE
    if pid_c < NUM_CB_A:
        _copy_tile(cache, rows, tok, mask_n, a_ptr, a_sn, a_sd, pid_c * BLOCK_A, 0, 0, A_WIDTH, BLOCK_A, ROW,
                   A_PACKED, GATHER, A_IN, A_OUT, SATURATE, HW_CVT)  # fmt: skip
    else:
        _copy_tile(cache, rows, tok, mask_n, b_ptr, b_sn, b_sd, (pid_c - NUM_CB_A) * BLOCK_B, A_WIDTH, B_EXT0,
                   B_WIDTH, BLOCK_B, ROW, B_PACKED, GATHER, B_IN, B_OUT, SATURATE, HW_CVT)  # fmt: skip


@triton.jit(do_not_specialize=["layer", "loc_stride", "n_tokens"])
def _mla_row_kernel(
    cache_ptr, layer, loc_ptr, loc_stride, n_tokens, a_ptr, a_sn, a_sd, b_ptr, b_sn, b_sd,
    LAYER_STRIDE: tl.constexpr, ROW: tl.constexpr, A_WIDTH: tl.constexpr, B_WIDTH: tl.constexpr,
    B_EXT0: tl.constexpr, BLOCK: tl.constexpr, A_PACKED: tl.constexpr, B_PACKED: tl.constexpr,
    A_IN: tl.constexpr, A_OUT: tl.constexpr, B_IN: tl.constexpr, B_OUT: tl.constexpr,
    SATURATE: tl.constexpr, HW_CVT: tl.constexpr, PAGE_SIZE: tl.constexpr, PAGE_ROWS: tl.constexpr,
):  # fmt: skip
    """The stores at decode sizes.  Grid ``(tokens,)``: each program writes one token's whole row, both parts,
    in one ``BLOCK``-wide tile (a power of two >= ``A_WIDTH + B_WIDTH``), its location read as a scalar; parts
    and columns as :func:`_mla_rows_kernel`'s (``n_tokens``, the grid's extent, is not read: the two kernels take
    the same arguments).  Up to a few hundred tokens one program a token costs less device time than tiles of
    several tokens: nothing waits on a vector of locations, and one program fills the row."""
    t = tl.program_id(0).to(tl.int64)
    row = tl.load(loc_ptr + t * loc_stride).to(tl.int64)
    if PAGE_ROWS > 0:
        row += (row // PAGE_SIZE) * (PAGE_ROWS - PAGE_SIZE)
    cols = tl.arange(0, BLOCK)
    in_a = cols < A_WIDTH
    in_b = (cols >= A_WIDTH) & (cols < A_WIDTH + B_WIDTH)
    b_cols = cols - A_WIDTH + B_EXT0  # part B's columns in its own tensor (negative where masked off)
    if A_PACKED:
        a_at = a_ptr + t * a_sn + cols
    else:
        a_at = a_ptr + t * a_sn + cols.to(tl.int64) * a_sd
    if B_PACKED:
        b_at = b_ptr + t * b_sn + b_cols
    else:
        b_at = b_ptr + t * b_sn + b_cols.to(tl.int64) * b_sd
    a = _convert(tl.load(a_at, mask=in_a, other=0), A_IN, A_OUT, SATURATE, HW_CVT)
    b = _convert(tl.load(b_at, mask=in_b, other=0), B_IN, B_OUT, SATURATE, HW_CVT)
    cache = cache_ptr + layer.to(tl.int64) * LAYER_STRIDE + row * ROW
    tl.store(cache + cols, tl.where(in_a, a, b), mask=in_a | in_b)


#: the runtime arguments both kernels take, in the order a call passes them: per call the cache's address, the
#: layer, the locations' address, the plan's loc stride, the count; then each part's address (per call) and its
#: strides (the plan's).  Its pointers are passed as addresses.
_RUNTIME = "cache_ptr layer loc_ptr loc_stride n_tokens a_ptr a_sn a_sd b_ptr b_sn b_sd"
_POINTERS = "cache_ptr loc_ptr a_ptr b_ptr"
#: the argument lists (:class:`kvcore.kernels.launch.KernelArgs`) of the tile kernel and of the row kernel
_ROWS_ARGS = KernelArgs(
    _mla_rows_kernel, _RUNTIME,
    constexprs="LAYER_STRIDE ROW A_WIDTH B_WIDTH B_EXT0 BLOCK_A BLOCK_B NUM_CB_A A_PACKED B_PACKED GATHER A_IN A_OUT "
               "B_IN B_OUT SATURATE HW_CVT BLOCK_N PAGE_SIZE PAGE_ROWS",
    pointers=_POINTERS,
)  # fmt: skip
_ROW_ARGS = KernelArgs(
    _mla_row_kernel, _RUNTIME,
    constexprs="LAYER_STRIDE ROW A_WIDTH B_WIDTH B_EXT0 BLOCK A_PACKED B_PACKED A_IN A_OUT B_IN B_OUT SATURATE HW_CVT "
               "PAGE_SIZE PAGE_ROWS",
    pointers=_POINTERS,
)


def _plan(a_width: int, b_width: int, n_pad: int, copy: bool) -> tuple[int, int, int, int, int, int]:
    """(BLOCK_N, BLOCK_A, BLOCK_B, column blocks of A, of A + B, warps) for parts of the given widths and
    ``n_pad`` (a power of two) tokens."""
    block_a = min(_next_pow2(a_width), MAX_BLOCK_C)
    block_b = min(_next_pow2(b_width), MAX_BLOCK_C) if b_width else 1
    tile = COPY_TILE_ELEMS if copy else TILE_ELEMS
    block_n = max(1, min(tile // max(block_a, block_b), n_pad))
    num_cb_a = cdiv(a_width, block_a)
    num_cb = num_cb_a + (cdiv(b_width, block_b) if b_width else 0)
    warps = max(1, min(MAX_WARPS, block_n * block_a // ELEMS_PER_WARP))
    return block_n, block_a, block_b, num_cb_a, num_cb, warps


def _part(x: torch.Tensor, n: int, what: str) -> tuple[int, int, int]:
    """(width, token stride, column stride) of a [N, 1, W] or [N, W] tensor, read from its shape and strides
    (no view is made: a view costs a microsecond of host time)."""
    shape, stride = x.shape, x.stride()
    if len(shape) == 3 and shape[1] == 1 and shape[0] == n:
        return shape[2], stride[0], stride[2]
    if len(shape) == 2 and shape[0] == n:
        return shape[1], stride[0], stride[1]
    raise ValueError(f"{what} must be [N, 1, W] or [N, W] with N = len(loc) = {n}, got {tuple(shape)}")


def _kernel_view(x: torch.Tensor) -> torch.Tensor:
    """fp8 tensors as their uint8 bytes (same shape and strides)."""
    return x.view(torch.uint8) if is_fp8_dtype(x.dtype) else x


def _to_storage(x: torch.Tensor, cache_dtype: torch.dtype) -> torch.Tensor:
    """Torch's conversion of ``x`` to the cache dtype, as storage-dtype values."""
    y = x if x.dtype == cache_dtype else x.to(cache_dtype)
    return y.view(torch.uint8) if is_fp8_dtype(cache_dtype) else y


def _flat(x: torch.Tensor, width: int) -> torch.Tensor:
    return x.reshape(x.shape[0], width)


class LatentRows(KeepsAddresses):
    """The store and gather of one pool's stacked latent rows: the Triton kernel (``use_triton``) or its torch
    reference, sharing the checks.

    What is fixed at pool creation (row width, strides, constexprs, the launchers) is computed once; what is fixed
    by a call's signature (its tensors' shapes, strides, dtypes, devices and alignments) is checked and planned
    on the signature's first call (:class:`kvcore.kernels.launch.Plan`); a call reads its signature, finds its plan and
    launches once.

    :param kv_cache: ``[L, R, 1, D]`` (or ``[L, R, D]``) cache with contiguous rows, dtype
        ``storage_dtype(cache_dtype)``.
    :param cache_dtype: the cache's logical dtype (``torch.uint8``: raw bytes, copied only).
    :param use_triton: the Triton kernel (True) or the torch reference (False).
    :param pages: ``(page_size, rows_per_page)``: the rows are page-major, token ``t`` at row ``(t // page_size) *
        rows_per_page + t % page_size``, computed inside the launch (a page-major pool's physical tokens); every
        call's ``loc`` is then tokens.  ``page_size`` a power of two, ``rows_per_page`` at least ``page_size``.
    """

    def __init__(self, kv_cache: torch.Tensor, cache_dtype: torch.dtype, use_triton: bool = True,
                 pages: tuple[int, int] | None = None):  # fmt: skip
        if kv_cache.dim() == 4 and kv_cache.shape[2] == 1:
            width, inner = kv_cache.shape[3], kv_cache.stride(3)
        elif kv_cache.dim() == 3:
            width, inner = kv_cache.shape[2], kv_cache.stride(2)
        else:
            raise ValueError(f"kv_cache must be [L, R, 1, D] or [L, R, D], got {tuple(kv_cache.shape)}")
        if inner != 1 or kv_cache.stride(1) < width:
            raise ValueError("kv_cache rows must be contiguous")
        want = storage_dtype(cache_dtype)
        if kv_cache.dtype != want:
            raise ValueError(f"cache_dtype {cache_dtype} is stored as {want}, got kv_cache of {kv_cache.dtype}")
        self.kv_cache, self.cache_dtype, self.use_triton = kv_cache, cache_dtype, use_triton
        self.width, self.layers = width, kv_cache.shape[0]
        self.device, self._device_index = kv_cache.device, kv_cache.get_device()  # -1 on the CPU
        self.launch = Launcher(_ROWS_ARGS, kv_cache.device)
        self.launch_row = Launcher(_ROW_ARGS, kv_cache.device)
        self._row_stride, self._layer_stride = kv_cache.stride(1), kv_cache.stride(0)
        self._saturate, self._hw_cvt = torch_e4m3fn_saturates(), not triton_interpreting()
        self._codes: dict[tuple, tuple[int, int]] = {}
        self._empties: dict[torch.dtype, torch.Tensor] = {}
        self._page_size, self._page_rows = (1, 0) if pages is None else pages
        if pages is not None and (self._page_size < 1 or self._page_size & (self._page_size - 1)
                                  or self._page_rows < self._page_size):  # fmt: skip
            raise ValueError(f"pages=(page_size, rows_per_page) needs a power-of-two page_size and rows_per_page >= "
                             f"page_size, got {pages}")  # fmt: skip
        self._bind_addresses()

    def _bind_addresses(self) -> None:
        """The rows' address; the plans, which keep it, start empty."""
        self._cache_ptr = self.kv_cache.data_ptr()
        self._plans: dict[tuple, Plan | None] = {}

    # -- checks ---------------------------------------------------------------------------------------------

    def _check_layer(self, layer_index: int) -> None:
        if not 0 <= layer_index < self.layers:
            raise ValueError(f"layer_index {layer_index} out of range for {self.layers} layers")

    def _check_loc(self, loc: torch.Tensor) -> int:
        loc_dtype = loc.dtype
        if loc.dim() != 1 or (loc_dtype is not torch.int32 and loc_dtype is not torch.int64):
            raise ValueError(f"loc must be a 1-D int32/int64 tensor, got {loc_dtype} {tuple(loc.shape)}")
        if loc.get_device() != self._device_index:
            raise ValueError(f"loc is on {loc.device}, kv_cache on {self.device}")
        return loc.shape[0]

    def _codes_of(self, src: torch.dtype, dst: torch.dtype, what: str) -> tuple[int, int]:
        """(IN code, OUT code) of a conversion ``src -> dst`` (memoized)."""
        codes = self._codes.get((src, dst))
        if codes is None:
            codes = self._codes[(src, dst)] = (dtypes.dtype_code(src, what), dtypes.conversion_code(src, dst, what))
        return codes

    def _check_part(self, n: int, what: str, x: torch.Tensor, gather: bool) -> tuple[int, int, int, int, int]:
        """(width, token stride, column stride, IN code, OUT code) of one part, from the tensor's own tuples."""
        codes = self._codes_of(self.cache_dtype, x.dtype, what) if gather else self._codes_of(x.dtype, self.cache_dtype, what)
        if x.get_device() != self._device_index:
            raise ValueError(f"{what} is on {x.device}, kv_cache on {self.device}")
        return (*_part(x, n, what), *codes)

    def _check_width(self, parts) -> None:
        total = sum(part[0] for _, part in parts)
        if total > self.width:
            widths = " + ".join(f"{what} {part[0]}" for what, part in parts)
            raise ValueError(f"{widths} = {total} columns do not fit a cache row of {self.width}")

    # -- plans and the one launch ----------------------------------------------------------------------------

    def _plan(self, loc: torch.Tensor, a: torch.Tensor, b: torch.Tensor | None, names: tuple[str, str],
              gather: bool, split: bool = False) -> Plan | None:  # fmt: skip
        """The plan of a call's signature (:mod:`kvcore.kernels.launch`), after the full checks of the call; None when
        the call has no rows.  ``b`` None with ``split``: ``a`` is whole rows, copied as two parts split at
        the largest power of two below their width (576 = 512 + 64: tiles of 512 and 64 columns instead of one
        1024-wide tile with 448 idle lanes), part B the same tensor from that column on."""
        n = self._check_loc(loc)
        a_part = self._check_part(n, names[0], a, gather)
        if split:
            cut = _prev_pow2(a_part[0])
            if a_part[0] > self.width:
                self._check_width(((names[0], a_part),))
            b, b_ext0 = a, cut
            b_part = (a_part[0] - cut, *a_part[1:]) if cut < a_part[0] else (0, *a_part[1:])
            a_part = (cut, *a_part[1:])
        else:
            b_part, b_ext0 = self._check_part(n, names[1], b, gather), 0
            if a_part[0] + b_part[0] > self.width:
                self._check_width(((names[0], a_part), (names[1], b_part)))
        if n == 0:
            return None
        fp8 = a.dtype in FP8_DTYPES or b.dtype in FP8_DTYPES
        if fp8:
            a, b = _kernel_view(a), _kernel_view(b)
        key = (gather, a_part, b_part, b_ext0, a.dtype, b.dtype, a.data_ptr() & 15, b.data_ptr() & 15, loc.dtype,
               loc.data_ptr() & 15)  # fmt: skip
        n_pad = 1 << (n - 1).bit_length()
        # the constexprs both kernels take
        common = dict(LAYER_STRIDE=self._layer_stride, ROW=self._row_stride, A_WIDTH=a_part[0], B_WIDTH=b_part[0],
                      B_EXT0=b_ext0, A_PACKED=a_part[2] == 1, B_PACKED=b_part[2] == 1, A_IN=a_part[3],
                      A_OUT=a_part[4], B_IN=b_part[3], B_OUT=b_part[4], SATURATE=self._saturate,
                      HW_CVT=self._hw_cvt, PAGE_SIZE=self._page_size, PAGE_ROWS=self._page_rows)  # fmt: skip
        fixed = (loc.stride(0), a_part[1:3], b_part[1:3])
        views = self._byte_views if fp8 else None
        if n_pad <= ROW_KERNEL_MAX_TOKENS and not gather:  # one program a token
            block = _next_pow2(a_part[0] + b_part[0])
            return Plan(self.launch_row, key, 1, (1, 1), ROW_KERNEL_WARPS, fixed, views,
                        _ROW_ARGS.constexprs(BLOCK=block, **common))  # fmt: skip
        copy = a_part[4] == dtypes.SAME and (b_part[0] == 0 or b_part[4] == dtypes.SAME)
        block_n, block_a, block_b, num_cb_a, num_cb, warps = _plan(a_part[0], b_part[0], n_pad, copy)
        constexprs = _ROWS_ARGS.constexprs(BLOCK_A=block_a, BLOCK_B=block_b, NUM_CB_A=num_cb_a, GATHER=gather,
                                           BLOCK_N=block_n, **common)  # fmt: skip
        return Plan(self.launch, (*key, block_n, warps), block_n, (num_cb, 1), warps, fixed, views, constexprs)

    def _fire(self, plan: Plan | None, n: int, layer_index: int, lp: int, ap: int, bp: int, loc, a, b) -> None:
        """Launch ``plan`` (None: nothing to launch) for ``n`` tokens of one layer and the call's addresses.  (No
        closure here: its cells would cost every call; fp8 parts' byte views are the plan's ``views``.)"""
        if not 0 <= layer_index < self.layers:
            self._check_layer(layer_index)
        if plan is not None:  # the runtime arguments (_RUNTIME); the plan adds its constexprs
            loc_stride, a_strides, b_strides = plan.fixed
            plan(n, (self._cache_ptr, layer_index, lp, loc_stride, n, ap, *a_strides, bp, *b_strides),
                 (self.kv_cache, loc, a, b))  # fmt: skip

    @staticmethod
    def _byte_views(cache, loc, a, b) -> tuple[torch.Tensor, ...]:
        """The tensors behind a launch's addresses, fp8 parts as their bytes (what the dispatcher sees)."""
        return cache, loc, _kernel_view(a), _kernel_view(b)

    # -- the operations --------------------------------------------------------------------------------------

    def store(self, layer_index: int, loc: torch.Tensor, cache_k_nope: torch.Tensor, cache_k_rope: torch.Tensor) -> None:
        """See :func:`store_nope_rope_triton`."""
        if not self.use_triton:
            self._store_native(layer_index, loc, cache_k_nope, cache_k_rope)
            return
        a, b = cache_k_nope, cache_k_rope
        lp, ap, bp, n, as_, bs = loc.data_ptr(), a.data_ptr(), b.data_ptr(), loc.numel(), a.shape, b.shape
        signature = (0, (n - 1).bit_length() if n else -1, loc.stride(), loc.dtype, loc.get_device(), lp & 15,
                     as_[1:], a.stride(), a.dtype, a.get_device(), ap & 15, bs[1:], b.stride(), b.dtype,
                     b.get_device(), bp & 15)  # fmt: skip
        plan = self._plans.get(signature, UNPLANNED)
        if plan is UNPLANNED or as_[0] != n or bs[0] != n:  # a first call, or parts of another count (refused)
            plan = remember(self._plans, signature,
                            self._plan(loc, a, b, ("cache_k_nope", "cache_k_rope"), gather=False))
        self._fire(plan, n, layer_index, lp, ap, bp, loc, a, b)

    def store_rows(self, layer_index: int, loc: torch.Tensor, cache_k: torch.Tensor) -> None:
        """See :func:`store_rows_triton`."""
        if not self.use_triton:
            self._check_layer(layer_index)
            n = self._check_loc(loc)
            geo = self._check_part(n, "cache_k", cache_k, False)
            if geo[0] > self.width:
                self._check_width((("cache_k", geo),))
            rows = self.kv_cache[layer_index].flatten(1)
            rows[self._rows_of(loc), : geo[0]] = _to_storage(_flat(cache_k, geo[0]), self.cache_dtype)
            return
        lp, ap, n, shape = loc.data_ptr(), cache_k.data_ptr(), loc.numel(), cache_k.shape
        signature = (1, (n - 1).bit_length() if n else -1, loc.stride(), loc.dtype, loc.get_device(), lp & 15,
                     shape[1:], cache_k.stride(), cache_k.dtype, cache_k.get_device(), ap & 15)  # fmt: skip
        plan = self._plans.get(signature, UNPLANNED)
        if plan is UNPLANNED or shape[0] != n:  # a first call, or rows of another count (refused)
            plan = remember(self._plans, signature,
                            self._plan(loc, cache_k, None, ("cache_k", "cache_k"), gather=False, split=True))
        self._fire(plan, n, layer_index, lp, ap, ap, loc, cache_k, cache_k)

    def gather_new(self, layer_index: int, loc: torch.Tensor, dtype: torch.dtype, a_width: int, b_width: int
                   ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """Rows ``loc`` of a layer as two new contiguous tensors, columns ``[0, a_width)`` as ``[N, 1, a_width]``
        and the next ``b_width`` as ``[N, 1, b_width]``, of ``dtype`` (converted as :meth:`gather` converts).

        (Two allocations, :func:`kvcore.pools.empty_of`: on an H200 they cost less host time than one allocation
        carved into two views, each view costing about as much as an allocation.)  New outputs are 16-byte aligned
        (the caching allocator's blocks are), which the plan of a call signature takes for granted and checks."""
        shape = loc.shape
        if len(shape) != 1:
            self._check_loc(loc)
        n = shape[0]
        empty = self._empties.get(dtype)
        if empty is None:
            empty = empty_of(self._empties, dtype, self.device)
        a = empty.new_empty_strided((n, 1, a_width), (a_width, a_width, 1))
        b = empty.new_empty_strided((n, 1, b_width), (b_width, b_width, 1))
        if not self.use_triton:
            self.gather(layer_index, loc, a, b)
            return a, b
        lp, ap, bp = loc.data_ptr(), a.data_ptr(), b.data_ptr()
        signature = (3, (n - 1).bit_length() if n else -1, loc.stride(), loc.dtype, loc.get_device(), lp & 15, dtype,
                     a_width, b_width)  # fmt: skip
        plan = self._plans.get(signature, UNPLANNED)
        if plan is UNPLANNED or (ap | bp) & 15:  # a first call, or outputs less aligned than plans take them
            plan = self._plan(loc, a, b, ("out_nope", "out_rope"), gather=True)
            if not (ap | bp) & 15:  # (a plan of unaligned outputs is used once)
                remember(self._plans, signature, plan)
        self._fire(plan, n, layer_index, lp, ap, bp, loc, a, b)
        return a, b

    def gather(self, layer_index: int, loc: torch.Tensor, out_nope: torch.Tensor, out_rope: torch.Tensor,
               check: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None] | None = None) -> None:  # fmt: skip
        """See :func:`gather_nope_rope_triton`.  ``check(loc, out_nope, out_rope)``, when given, is a caller's own
        check of the outputs (a pool's exact shapes), run once per call signature before this one's own."""
        a, b = out_nope, out_rope
        if not self.use_triton:
            if check is not None:
                check(loc, a, b)
            self._gather_native(layer_index, loc, a, b)
            return
        lp, ap, bp, n, as_, bs = loc.data_ptr(), a.data_ptr(), b.data_ptr(), loc.numel(), a.shape, b.shape
        signature = (2, check, (n - 1).bit_length() if n else -1, loc.stride(), loc.dtype, loc.get_device(), lp & 15,
                     as_[1:], a.stride(), a.dtype, a.get_device(), ap & 15, bs[1:], b.stride(), b.dtype, b.get_device(),
                     bp & 15)  # fmt: skip
        plan = self._plans.get(signature, UNPLANNED)
        if plan is UNPLANNED or as_[0] != n or bs[0] != n:  # a first call, or outputs of another count (refused)
            if check is not None:
                check(loc, a, b)
            plan = remember(self._plans, signature, self._plan(loc, a, b, ("out_nope", "out_rope"), gather=True))
        self._fire(plan, n, layer_index, lp, ap, bp, loc, a, b)

    # -- the torch reference -----------------------------------------------------------------------------------

    def _native_parts(self, layer_index: int, loc: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                      names: tuple[str, str], gather: bool) -> tuple[int, int]:  # fmt: skip
        """The checks of the reference: (rows, width of A, width of B)."""
        self._check_layer(layer_index)
        n = self._check_loc(loc)
        a_part, b_part = self._check_part(n, names[0], a, gather), self._check_part(n, names[1], b, gather)
        if a_part[0] + b_part[0] > self.width:
            self._check_width(((names[0], a_part), (names[1], b_part)))
        return n, a_part[0], b_part[0]

    def _rows_of(self, loc: torch.Tensor) -> torch.Tensor:
        """The rows of ``loc`` (int64): themselves, or with ``pages`` their page-major rows."""
        idx = loc.long()
        if self._page_rows:
            idx = idx + torch.div(idx, self._page_size, rounding_mode="floor") * (self._page_rows - self._page_size)
        return idx

    def _store_native(self, layer_index: int, loc, cache_k_nope, cache_k_rope) -> None:
        names = ("cache_k_nope", "cache_k_rope")
        n, r, p = self._native_parts(layer_index, loc, cache_k_nope, cache_k_rope, names, False)
        if n:
            rows, idx = self.kv_cache[layer_index].flatten(1), self._rows_of(loc)
            rows[idx, :r] = _to_storage(_flat(cache_k_nope, r), self.cache_dtype)
            rows[idx, r : r + p] = _to_storage(_flat(cache_k_rope, p), self.cache_dtype)

    def _gather_native(self, layer_index: int, loc, out_nope, out_rope) -> None:
        n, r, p = self._native_parts(layer_index, loc, out_nope, out_rope, ("out_nope", "out_rope"), True)
        if n:
            rows = self.kv_cache[layer_index].flatten(1)[self._rows_of(loc)]
            if is_fp8_dtype(self.cache_dtype):
                rows = rows.view(self.cache_dtype)
            _flat(out_nope, r).copy_(rows[:, :r].to(out_nope.dtype))
            _flat(out_rope, p).copy_(rows[:, r : r + p].to(out_rope.dtype))


# ==========================================================================================================
# One call each (tests, benchmarks, other families); pools keep a LatentRows
# ==========================================================================================================


def store_nope_rope_native(
    kv_cache: torch.Tensor, layer_index: int, loc: torch.Tensor, cache_k_nope: torch.Tensor,
    cache_k_rope: torch.Tensor, *, cache_dtype: torch.dtype,
) -> None:  # fmt: skip
    """Torch reference of :func:`store_nope_rope_triton` (same signature and semantics)."""
    LatentRows(kv_cache, cache_dtype, use_triton=False).store(layer_index, loc, cache_k_nope, cache_k_rope)


def store_nope_rope_triton(
    kv_cache: torch.Tensor, layer_index: int, loc: torch.Tensor, cache_k_nope: torch.Tensor,
    cache_k_rope: torch.Tensor, *, cache_dtype: torch.dtype,
) -> None:  # fmt: skip
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
    LatentRows(kv_cache, cache_dtype).store(layer_index, loc, cache_k_nope, cache_k_rope)


def store_rows_native(
    kv_cache: torch.Tensor, layer_index: int, loc: torch.Tensor, cache_k: torch.Tensor, *, cache_dtype: torch.dtype
) -> None:
    """Torch reference of :func:`store_rows_triton` (same signature and semantics)."""
    LatentRows(kv_cache, cache_dtype, use_triton=False).store_rows(layer_index, loc, cache_k)


def store_rows_triton(
    kv_cache: torch.Tensor, layer_index: int, loc: torch.Tensor, cache_k: torch.Tensor, *, cache_dtype: torch.dtype
) -> None:
    """Write already concatenated latent rows ``cache_k`` [N, 1, W] (or [N, W]) into columns ``[0, W)`` of
    rows ``loc``, converted as :func:`store_nope_rope_triton` converts (same arguments otherwise).

    The row is copied as two parts split at the largest power of two below ``W`` (576 = 512 + 64), by the
    split store's kernel: byte-identical to the split store of the same values.
    """
    LatentRows(kv_cache, cache_dtype).store_rows(layer_index, loc, cache_k)


def _check_no_alias(kv_cache: torch.Tensor, *outputs: torch.Tensor) -> None:
    cache_storage = kv_cache.untyped_storage().data_ptr()
    if any(x.untyped_storage().data_ptr() == cache_storage for x in outputs):
        raise ValueError("gather outputs must not alias the cache")


def gather_nope_rope_native(
    kv_cache: torch.Tensor, layer_index: int, loc: torch.Tensor, out_nope: torch.Tensor, out_rope: torch.Tensor,
    *, cache_dtype: torch.dtype,
) -> None:  # fmt: skip
    """Torch reference of :func:`gather_nope_rope_triton` (same signature and semantics)."""
    _check_no_alias(kv_cache, out_nope, out_rope)
    LatentRows(kv_cache, cache_dtype, use_triton=False).gather(layer_index, loc, out_nope, out_rope)


def gather_nope_rope_triton(
    kv_cache: torch.Tensor, layer_index: int, loc: torch.Tensor, out_nope: torch.Tensor, out_rope: torch.Tensor,
    *, cache_dtype: torch.dtype,
) -> None:  # fmt: skip
    """Read rows ``loc`` of layer ``layer_index`` into ``out_nope`` (columns ``[0, Rn)``) and ``out_rope``
    (columns ``[Rn, Rn + Rp)``), in one launch.

    :param out_nope: ``[N, 1, Rn]`` (or ``[N, Rn]``) output, any strides, float32/float16/bfloat16 or fp8;
        values are ``row.view(cache_dtype).to(out.dtype)`` (fp8 caches decode exactly; a same-dtype output
        receives the bits).  It must not alias the cache.
    :param out_rope: ``[N, 1, Rp]`` (or ``[N, Rp]``) output, likewise.
    Other arguments as :func:`store_nope_rope_triton`.  The cache is not modified.
    """
    _check_no_alias(kv_cache, out_nope, out_rope)
    LatentRows(kv_cache, cache_dtype).gather(layer_index, loc, out_nope, out_rope)
