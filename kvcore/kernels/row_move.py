"""Row moves over stacked cache buffers, for every pool family: ``buf[:, tgt] = buf[:, src]`` in all layers.

A pool keeps each buffer as one stacked tensor ``[layers, rows, ...]``; ``move_kv_cache(tgt, src)`` copies
rows ``src[i]`` to ``tgt[i]`` in every layer of one or two such buffers (K and V, or a single latent buffer),
as if every source were read before any target is written, so compaction shifts, swaps and cycles are safe.
Rows are moved as raw 32-/16-/8-bit words (whichever divides the row and its address), so any dtype works.
A token's row is the token itself (:func:`move_rows_triton`), or, for per-token state kept inside pages, a
row of its page (:func:`move_token_rows_triton` with :class:`kvcore.token_rows.TokenRows`).

``N <= MOVE_MAX_TOKENS`` (512) slots: one launch, grid ``(buffers x layers, column tiles)``.  A program owns
one (buffer, layer, column tile) region, loads the source rows of its tile for ALL N locations into
registers, synchronises its threads, then stores them; programs touch disjoint regions, so nothing races.
The tile width shrinks as N grows (about ``MOVE_TILE_BYTES`` per program, at most ``MOVE_MAX_TILE_BYTES``,
never under one 32-byte memory sector: narrower tiles measured 5x slower on an H200).

Larger N: the device marks the source rows and flags whether any target is another location's source;
without overlap one launch per buffer copies the rows in a single parallel pass, with overlap the rows go
through a scratch buffer (gather, then scatter, a group of layers at a time, at most
``MOVE_SCRATCH_BYTES``).  The path not taken exits at once: no host sync decides anything, and both paths
are CUDA-graph safe (the large path takes its flag and scratch from torch's caching allocator).  Every
launch, on both paths, is direct (:mod:`kvcore.kernels.launch`), with its pointers as addresses: the caller's
locations are checked to be on the buffers' device first.
``benchmarks/RESULTS.md`` has the measurements behind the thresholds.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvcore.kernels.addresses import KeepsAddresses
from kvcore.kernels.launch import KernelArgs, Launcher, cdiv, launcher_for
from kvcore.token_rows import TokenRows

# Tiling (bytes).
# Bytes per program: 128 KiB moved 256 slots of Qwen3-Next's 36.8 MiB states at 0.93 of the copy ceiling
# (0.82 with 32 KiB) and 512 slots of a 32-layer MHA pool at 0.82 (0.59) on an H200 (RESULTS.md, 2026-12-01).
MOVE_TILE_BYTES = 128 * 1024  # target bytes per program in registers
MOVE_MAX_TILE_BYTES = 128 * 1024  # hard cap per program
MOVE_MIN_TILE_BYTES = 32  # one DRAM sector
MOVE_MAX_TOKENS = 512  # beyond this, the device-flagged row copy (measured faster on an H200 from 1024 slots)
MOVE_SCRATCH_BYTES = 256 * 1024 * 1024  # scratch bound of the fallback
# Large-move row copies: 64 KB per program, 8 warps (benchmarks/tune_mha.py on an H200: 0.84 of the copy
# ceiling at 4096 slots x 32 layers, against 0.77 with 16 KB and 4 warps).
_COPY_TILE_WORDS = 16384
_COPY_NUM_WARPS = 8
_COPY_MAX_BLOCK_C = 1024
_FLAG_BLOCK = 1024


def next_pow2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1)."""
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def prev_pow2(n: int) -> int:
    """The largest power of two <= n (1 for n <= 1)."""
    return 1 << (max(n, 1).bit_length() - 1)




def _check_same_layers(first: TokenRows, second: TokenRows | None) -> None:
    if first.index_map is not None or (second is not None and second.index_map is not None):
        raise ValueError(
            "row moves address tokens by their rows; for token rows behind an index map, translate the tokens "
            "first (index_map[tokens]) and move the buffer's own slots"
        )
    if second is not None and first.rows.shape[0] != second.rows.shape[0]:
        raise ValueError(
            f"both buffers must stack the same layers, got {tuple(first.rows.shape)} and {tuple(second.rows.shape)}"
        )


def _check_locs(tgt_loc: torch.Tensor, src_loc: torch.Tensor) -> int:
    """The number of slots moved; raises unless both are 1-D int32/int64 tensors of one length."""
    for name, t in (("tgt_loc", tgt_loc), ("src_loc", src_loc)):
        if t.dim() != 1 or t.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{name} must be a 1-D int32/int64 tensor, got {t.dtype} {tuple(t.shape)}")
    if tgt_loc.shape != src_loc.shape:
        raise ValueError(f"tgt_loc {tuple(tgt_loc.shape)} and src_loc {tuple(src_loc.shape)} differ")
    return tgt_loc.shape[0]


def _check_move_args(first: TokenRows, second: TokenRows | None, tgt_loc, src_loc) -> None:
    _check_same_layers(first, second)
    _check_locs(tgt_loc, src_loc)


def _identity_rows(k_cache: torch.Tensor, v_cache: torch.Tensor | None) -> tuple[TokenRows, TokenRows | None]:
    """K/V caches whose rows are the tokens; both ``[L, R, ...]`` with the same L and R."""
    if v_cache is not None and (k_cache.dim() < 2 or v_cache.dim() < 2 or k_cache.shape[:2] != v_cache.shape[:2]):
        raise ValueError(f"K/V caches must be [L, R, ...] alike, got {tuple(k_cache.shape)}, {tuple(v_cache.shape)}")
    return TokenRows(k_cache), None if v_cache is None else TokenRows(v_cache)


def move_token_rows_native(
    first: TokenRows, second: TokenRows | None, tgt_loc: torch.Tensor, src_loc: torch.Tensor
) -> None:
    """Torch reference of :func:`move_token_rows_triton`: per buffer and layer, gather the source rows, then
    scatter them."""
    _check_move_args(first, second, tgt_loc, src_loc)
    if tgt_loc.numel() == 0:
        return
    for token_rows in (first,) if second is None else (first, second):
        buf = token_rows.rows
        tgt, src = token_rows.row_of(tgt_loc).long(), token_rows.row_of(src_loc).long()
        for layer in range(buf.shape[0]):
            rows = buf[layer].index_select(0, src)
            buf[layer].index_copy_(0, tgt, rows)


def move_rows_native(
    k_cache: torch.Tensor, v_cache: torch.Tensor | None, tgt_loc: torch.Tensor, src_loc: torch.Tensor
) -> None:
    """Torch reference of :func:`move_rows_triton`."""
    move_token_rows_native(*_identity_rows(k_cache, v_cache), tgt_loc, src_loc)


def _check_packed_rows(buf: torch.Tensor) -> None:
    """Rows packed one after the other (``buf[l, r]`` contiguous, ``stride(1)`` one row); layers may be any
    stride apart (a page-major pool's layers interleave inside its pages)."""
    if buf.dim() < 2 or not buf[0, 0].is_contiguous() or buf.stride(1) != max(1, buf[0, 0].numel()):
        raise ValueError("cache buffers need packed rows: [L, R, ...] with each row contiguous and rows back to back")


def _row_words(buf: torch.Tensor) -> torch.Tensor:
    """``buf`` [L, R, ...] (packed rows) viewed as [L, R, W] words of the widest of int32/int16/uint8 that
    divides a row, the layer stride and the base address (a view: writes through it land in ``buf``)."""
    _check_packed_rows(buf)
    b = buf.view(torch.uint8) if buf.dim() > 2 else buf.unsqueeze(-1).view(torch.uint8)
    b = b.flatten(2)
    w = _word_bytes(buf)
    return b.view({4: torch.int32, 2: torch.int16}[w]) if w > 1 else b


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
def _token_row(t, TOKENS_PER_PAGE: tl.constexpr, ROWS_PER_PAGE: tl.constexpr, FIRST_ROW: tl.constexpr):
    """:meth:`kvcore.token_rows.TokenRows.row_of` on the device."""
    if TOKENS_PER_PAGE == ROWS_PER_PAGE and FIRST_ROW == 0:
        r = t
    else:
        r = t + (t // TOKENS_PER_PAGE) * (ROWS_PER_PAGE - TOKENS_PER_PAGE) + FIRST_ROW
    return r


@triton.jit(do_not_specialize=["tgt_stride", "src_stride", "n_tokens"])
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
    K_TPP: tl.constexpr,
    K_RPP: tl.constexpr,
    K_FIRST: tl.constexpr,
    V_TPP: tl.constexpr,
    V_RPP: tl.constexpr,
    V_FIRST: tl.constexpr,
    N_PAD: tl.constexpr,
):
    """Strides, ROW and TILE are in words of WORD bytes (the caches' pointers are cast to those words);
    TPP, RPP and FIRST are each buffer's tokens per page, rows per page and first token row of a page
    (:class:`kvcore.token_rows.TokenRows`)."""
    pid_b = tl.program_id(0)
    pid_c = tl.program_id(1)
    offs = tl.arange(0, N_PAD)
    mask_n = offs < n_tokens
    tgt = tl.load(tgt_ptr + offs * tgt_stride, mask=mask_n, other=0).to(tl.int64)
    src = tl.load(src_ptr + offs * src_stride, mask=mask_n, other=0).to(tl.int64)
    if pid_b < num_layers:
        _move_tile(
            k_ptr, pid_b, k_layer_stride, _token_row(tgt, K_TPP, K_RPP, K_FIRST), _token_row(src, K_TPP, K_RPP, K_FIRST),
            mask_n, pid_c, K_ROW, K_TILE, K_WORD,
        )  # fmt: skip
    else:
        _move_tile(
            v_ptr, pid_b - num_layers, v_layer_stride, _token_row(tgt, V_TPP, V_RPP, V_FIRST),
            _token_row(src, V_TPP, V_RPP, V_FIRST), mask_n, pid_c, V_ROW, V_TILE, V_WORD,
        )  # fmt: skip


#: the move kernel's argument list (:class:`kvcore.kernels.launch.KernelArgs`): per call the buffers' addresses, the
#: locations' addresses and strides and the count, then what the buffers fix; its pointers are passed as addresses
_MOVE_ARGS = KernelArgs(
    _move_kv_kernel,
    runtime=("k_ptr v_ptr tgt_ptr src_ptr tgt_stride src_stride n_tokens",
             "num_layers k_layer_stride v_layer_stride"),
    constexprs="K_ROW V_ROW K_TILE V_TILE K_WORD V_WORD K_TPP K_RPP K_FIRST V_TPP V_RPP V_FIRST N_PAD",
)


def _word_bytes(buf: torch.Tensor) -> int:
    """The widest of 4/2/1 bytes dividing a row of ``buf`` [L, R, ...] (packed rows), its layer stride and its
    address."""
    row_bytes = buf.stride(1) * buf.element_size()
    layer_bytes = buf.stride(0) * buf.element_size()
    ptr = buf.data_ptr()
    for w in (4, 2):
        if row_bytes % w == 0 and layer_bytes % w == 0 and ptr % w == 0:
            return w
    return 1


def _move_plan(n: int, k_row_bytes: int, v_row_bytes: int) -> tuple[int, int]:
    """(N_pad, tile bytes) of the single-launch path."""
    n_pad = next_pow2(n)
    row_cap = next_pow2(max(k_row_bytes, v_row_bytes))
    tile = prev_pow2(max(MOVE_TILE_BYTES // n_pad, MOVE_MIN_TILE_BYTES))
    return n_pad, max(1, min(tile, row_cap))


@triton.jit(do_not_specialize=["n_rows"])
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


#: the argument list of the large moves' row copy (:class:`kvcore.kernels.launch.KernelArgs`; its ``*_ptr``
#: parameters are passed as addresses)
_COPY_ARGS = KernelArgs(
    _copy_rows_kernel,
    runtime="src_ptr dst_ptr src_idx_ptr dst_idx_ptr src_idx_stride dst_idx_stride n_rows src_layer_stride "
            "dst_layer_stride guard_ptr",
    constexprs="ROW SRC_INDEXED DST_INDEXED GUARD BLOCK_N BLOCK_C",
)  # fmt: skip


def _launch(binding: KernelArgs, grid: tuple, args: tuple, key: tuple, num_warps: int = 4,
            device: torch.device | None = None) -> None:  # fmt: skip
    """``kernel[grid](*args)`` launched directly (:mod:`kvcore.kernels.launch`).  ``args`` are every parameter in
    the binding's order (its runtime ones, then its constexprs), tensors where the kernel takes pointers; they go
    as addresses, and the key adds their dtypes and 16-byte alignments to ``key``, which must name every other
    runtime argument Triton specializes on (the launcher adds the constexprs and the warps).  ``device``: where it
    runs (default: the first tensor's)."""
    tensors, addresses, meta = [], [], list(key)
    for a in args:
        if isinstance(a, torch.Tensor):
            p = a.data_ptr()
            tensors.append(a)
            addresses.append(p)
            meta.append(a.dtype)
            meta.append(p % 16 == 0)
        else:
            addresses.append(a)
    launcher_for(binding, device or tensors[0].device)(tuple(meta), grid[0], grid[1], addresses, tensors, num_warps,
                                                       grid[2])  # fmt: skip


def _copy_rows(src, dst, src_idx, dst_idx, n, guard=None, guard_mode=0, device=None):
    """Launch :func:`_copy_rows_kernel` over all layers of ``src``/``dst`` ([Lg, rows, W] word views), on ``device``
    (default: ``src``'s)."""
    row = src.shape[2]
    block_c = min(next_pow2(row), _COPY_MAX_BLOCK_C)
    block_n = max(1, min(_COPY_TILE_WORDS // block_c, next_pow2(n)))
    dummy = src_idx if src_idx is not None else dst_idx
    grid = (cdiv(n, block_n), cdiv(row, block_c), src.shape[0])
    strides = (1 if src_idx is None else src_idx.stride(0), 1 if dst_idx is None else dst_idx.stride(0),
               src.stride(0), dst.stride(0))  # fmt: skip
    constexprs = _COPY_ARGS.constexprs(ROW=row, SRC_INDEXED=src_idx is not None, DST_INDEXED=dst_idx is not None,
                                       GUARD=guard_mode, BLOCK_N=block_n, BLOCK_C=block_c)  # fmt: skip
    _launch(_COPY_ARGS, grid, (
        src, dst, dummy if src_idx is None else src_idx, dummy if dst_idx is None else dst_idx, strides[0],
        strides[1], n, strides[2], strides[3], guard if guard is not None else dummy, *constexprs,
    ), strides, _COPY_NUM_WARPS, device)  # fmt: skip


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


@triton.jit(do_not_specialize=["n"])
def _mark_sources_kernel(marks_ptr, src_ptr, src_stride, n, BLOCK: tl.constexpr):
    """marks[src[i]] = 1 for every i (marks starts zeroed)."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    src = tl.load(src_ptr + offs.to(tl.int64) * src_stride, mask=mask, other=0).to(tl.int64)
    tl.store(marks_ptr + src, tl.full([BLOCK], 1, tl.int8), mask=mask)


@triton.jit(do_not_specialize=["n"])
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


#: the argument lists of the overlap flag's kernels (their ``*_ptr`` parameters are passed as addresses)
_MARK_ARGS = KernelArgs(_mark_sources_kernel, "marks_ptr src_ptr src_stride n", "BLOCK")
_FLAG_ARGS = KernelArgs(_flag_overlaps_kernel, "marks_ptr tgt_ptr src_ptr tgt_stride src_stride flag_ptr n", "BLOCK")


def _flag_overlaps(rows: int, tgt_loc: torch.Tensor, src_loc: torch.Tensor) -> torch.Tensor:
    """A device int32 flag, 1 when the move's targets overlap other locations' sources (no host sync)."""
    n = tgt_loc.shape[0]
    marks = torch.zeros(rows, dtype=torch.int8, device=tgt_loc.device)
    flag = torch.zeros(1, dtype=torch.int32, device=tgt_loc.device)
    grid = (cdiv(n, _FLAG_BLOCK), 1, 1)
    strides = (tgt_loc.stride(0), src_loc.stride(0))
    _launch(_MARK_ARGS, grid, (marks, src_loc, strides[1], n, *_MARK_ARGS.constexprs(BLOCK=_FLAG_BLOCK)), strides)
    _launch(_FLAG_ARGS, grid, (marks, tgt_loc, src_loc, *strides, flag, n, *_FLAG_ARGS.constexprs(BLOCK=_FLAG_BLOCK)),
            strides)  # fmt: skip
    return flag


class RowMover(KeepsAddresses):
    """:func:`move_token_rows_triton` bound to one or two buffers: everything fixed by the buffers (word
    views, row widths, paging constexprs, the launcher) is computed once, so a move of up to
    ``MOVE_MAX_TOKENS`` slots costs one check of its index tensors and one direct launch (:mod:`kvcore.kernels.launch`).

    :param first: a ``[L, R, ...]`` buffer of packed rows (layers any stride apart) and where each token's row
        lies in it.
    :param second: a second buffer with the same L (its rows and paging may differ), or None.
    """

    def __init__(self, first: TokenRows, second: TokenRows | None = None):
        _check_same_layers(first, second)
        self.buffers = (first,) if second is None else (first, second)
        for b in self.buffers:
            _check_packed_rows(b.rows)
        k_cache = first.rows
        v_rows = second if second is not None else first  # the V half of the grid is not launched
        v_cache = v_rows.rows
        self._kwb, self._vwb = _word_bytes(k_cache), _word_bytes(v_cache)
        self._k_row_bytes = k_cache.stride(1) * k_cache.element_size()
        self._v_row_bytes = v_cache.stride(1) * v_cache.element_size()
        k_row, v_row = self._k_row_bytes // self._kwb, self._v_row_bytes // self._vwb
        self._caches, self._layers = (k_cache, v_cache), k_cache.shape[0]
        es_k, es_v = k_cache.element_size(), v_cache.element_size()
        # the runtime arguments the buffers fix (layers, layer strides in words), and the constexprs
        self._layer_args = (self._layers, k_cache.stride(0) * es_k // self._kwb, v_cache.stride(0) * es_v // self._vwb)
        self._fixed = dict(K_ROW=k_row, V_ROW=v_row, K_WORD=self._kwb, V_WORD=self._vwb, K_TPP=first.tokens_per_page,
                           K_RPP=first.rows_per_page, K_FIRST=first.first_row, V_TPP=v_rows.tokens_per_page,
                           V_RPP=v_rows.rows_per_page, V_FIRST=v_rows.first_row)  # fmt: skip
        self._plans: dict[int, tuple] = {}
        self._words = tuple(_row_words(b.rows) for b in self.buffers)  # the large path's word views
        self.launch = Launcher(_MOVE_ARGS, k_cache.device)
        self._device_index = k_cache.get_device()
        self._bind_addresses()

    def _bind_addresses(self) -> None:
        """The K and V buffers' addresses (the first buffer's twice when there is no second)."""
        self._cache_ptrs = (self._caches[0].data_ptr(), self._caches[1].data_ptr())

    def _plan(self, n: int) -> tuple[int, int, tuple]:
        """(column programs, warps, the kernel's constexprs) of the single-launch path for ``n`` slots."""
        plan = self._plans.get(n)
        if plan is None:
            n_pad, tile_bytes = _move_plan(n, self._k_row_bytes, self._v_row_bytes)
            k_tile, v_tile = max(1, tile_bytes // self._kwb), max(1, tile_bytes // self._vwb)
            n_col = max(cdiv(self._fixed["K_ROW"], k_tile), cdiv(self._fixed["V_ROW"], v_tile))
            num_warps = max(1, min(8, prev_pow2(n_pad * tile_bytes // 4096)))
            constexprs = _MOVE_ARGS.constexprs(**self._fixed, K_TILE=k_tile, V_TILE=v_tile, N_PAD=n_pad)
            plan = self._plans[n] = (n_col, num_warps, constexprs)
        return plan

    def __call__(self, tgt_loc: torch.Tensor, src_loc: torch.Tensor) -> None:
        """Rows of tokens ``tgt_loc[i]`` <- rows of tokens ``src_loc[i]``, in every layer of the buffers (see
        :func:`move_token_rows_triton`)."""
        n = _check_locs(tgt_loc, src_loc)
        if n == 0:
            return
        device = self._device_index  # checked here: the launches take addresses, which the driver does not check
        if tgt_loc.get_device() != device or src_loc.get_device() != device:
            raise ValueError(f"tgt_loc and src_loc must be on {self._caches[0].device}, got {tgt_loc.device} and "
                             f"{src_loc.device}")  # fmt: skip
        if n > MOVE_MAX_TOKENS:
            self._move_large(tgt_loc, src_loc, n)
            return
        n_col, num_warps, constexprs = self._plan(n)
        tp, sp = tgt_loc.data_ptr(), src_loc.data_ptr()
        # the key: what Triton specializes the locations on (the launcher adds the constexprs and the warps)
        self.launch((tgt_loc.dtype, src_loc.dtype, tp & 15, sp & 15), len(self.buffers) * self._layers, n_col, (
            *self._cache_ptrs, tp, sp, tgt_loc.stride(0), src_loc.stride(0), n, *self._layer_args, *constexprs,
        ), (*self._caches, tgt_loc, src_loc), num_warps)  # fmt: skip

    def _move_large(self, tgt_loc: torch.Tensor, src_loc: torch.Tensor, n: int) -> None:
        # The device decides: without overlap a straight parallel row copy (one pass over the bytes);
        # with overlap the gather/scatter through scratch.  The path not taken exits at once.  Overlap is a
        # property of the tokens (a token's row is the same function of it in each buffer), and no token
        # exceeds its buffer's row count.
        flag = _flag_overlaps(max(b.rows.shape[1] for b in self.buffers), tgt_loc, src_loc)
        for token_rows, words in zip(self.buffers, self._words):
            tgt, src = token_rows.row_of(tgt_loc), token_rows.row_of(src_loc)
            _copy_rows(words, words, src, tgt, n, flag, 1)
            _move_via_scratch(words, tgt, src, flag, 2)


def move_token_rows_triton(
    first: TokenRows, second: TokenRows | None, tgt_loc: torch.Tensor, src_loc: torch.Tensor
) -> None:
    """For every layer of one or two buffers: the rows of tokens ``tgt_loc[i]`` <- the rows of tokens
    ``src_loc[i]``, as if every source were read before any target is written (so overlapping moves such as
    compaction shifts, swaps and cycles are fine).  Targets must be distinct.

    :param first: a contiguous ``[L, R, ...]`` buffer (any dtype; rows move as raw words) and where each
        token's row lies in it (:class:`~kvcore.token_rows.TokenRows`: the token itself, or a row inside its
        page).
    :param second: a second buffer with the same L (its rows and paging may differ), or None.
    :param tgt_loc: ``[N]`` int32/int64 target tokens, on the buffers' device.
    :param src_loc: ``[N]`` int32/int64 source tokens.

    ``N <= MOVE_MAX_TOKENS`` (512): one kernel launch (token rows are found on the device), no allocation, no
    host sync (CUDA-graph safe; N is read from the tensor shape).  Larger N: a device-side overlap flag
    picks, without a host sync, a one-pass parallel row copy (no overlap) or a gather/scatter through a
    scratch buffer (overlap).  A pool keeps one :class:`RowMover` per buffer pair instead of calling this.
    """
    RowMover(first, second)(tgt_loc, src_loc)


def move_rows_triton(
    k_cache: torch.Tensor, v_cache: torch.Tensor | None, tgt_loc: torch.Tensor, src_loc: torch.Tensor
) -> None:
    """:func:`move_token_rows_triton` for buffers whose rows are the tokens: for every layer of both
    buffers, rows ``tgt_loc[i]`` <- rows ``src_loc[i]``, as torch's ``buf[:, tgt] = buf[:, src]``.

    :param k_cache: contiguous ``[L, R, ...]`` buffer, any dtype.
    :param v_cache: contiguous ``[L, R, ...]`` buffer with the same L and R (its row width may differ), or
        None for a pool with one buffer (MLA's latent rows).
    """
    move_token_rows_triton(*_identity_rows(k_cache, v_cache), tgt_loc, src_loc)


def copy_rows(src: torch.Tensor, dst: torch.Tensor, src_idx: torch.Tensor, dst_idx: torch.Tensor,
              use_triton: bool = True) -> None:  # fmt: skip
    """``dst[:, dst_idx[i]] = src[:, src_idx[i]]`` in every layer of two stacked buffers ``[L, rows, ...]`` of one
    row shape and dtype (packed rows), in one launch.  One of the two may be pinned host memory while the other is
    on a CUDA device: the kernel, run on that device, reads or writes the host rows over the bus (unified
    addressing), so a gather of scattered rows from host memory is one launch; like any launch it is asynchronous:
    synchronize before the host reads rows it wrote.  ``src_idx`` / ``dst_idx``: 1-D
    int32/int64 of one length, on the device the kernel runs on (the CPU for two CPU buffers); targets distinct.

    :raises ValueError: for buffers of other shapes, dtypes or layers, or indices of other lengths.
    """
    if src.shape[0] != dst.shape[0] or src.shape[2:] != dst.shape[2:] or src.dtype != dst.dtype:
        raise ValueError(f"copy_rows: [L, rows, ...] buffers of one row shape and dtype, got {tuple(src.shape)} "
                         f"{src.dtype} and {tuple(dst.shape)} {dst.dtype}")  # fmt: skip
    if src_idx.dim() != 1 or src_idx.shape != dst_idx.shape:
        raise ValueError(f"copy_rows: 1-D indices of one length, got {tuple(src_idx.shape)} and {tuple(dst_idx.shape)}")
    n = src_idx.numel()
    if n == 0:
        return
    device = dst.device if dst.device.type == "cuda" else src.device
    if not use_triton:
        rows = src[:, src_idx.to(src.device).long()]
        dst[:, dst_idx.to(dst.device).long()] = rows.to(dst.device)
        return
    if src_idx.device != device or dst_idx.device != device:
        raise ValueError(f"copy_rows: the indices must be on {device}, where the copy runs")
    for name, buf in (("src", src), ("dst", dst)):
        if device.type == "cuda" and buf.device.type == "cpu" and not buf.is_pinned():
            raise ValueError(f"copy_rows: {name} is pageable host memory, which a kernel cannot reach: pin it "
                             "(tensor.pin_memory())")  # fmt: skip
    words = _row_words(src), _row_words(dst)
    if words[0].dtype != words[1].dtype:  # the two allow different words: move bytes
        words = tuple(w.view(torch.uint8) for w in words)
    _copy_rows(*words, src_idx, dst_idx, n, device=device)
