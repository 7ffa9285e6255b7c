"""DeepSeek-V4's quantize-and-store kernels: latent rows (the "V4" FlashMLA pages) and lightning-indexer keys, one
layer's ``[num_pages, page_bytes]`` uint8 buffer per call.

Formats and arithmetic are in :mod:`kvcore_dsv4.quantize`, whose torch references (``store_latent_native``,
``store_index_native``) these kernels match byte for byte; all byte offsets are int64; a negative location is
skipped.  fp8 and bf16 encodings go through :mod:`kvcore.kernels.fp8`'s integer encoders under the interpreter
(whose float->fp8 and float->bf16 casts round wrongly) and through the hardware conversion when compiled: both
round to nearest even, and no value reaching them is out of e4m3's range (|x * 2**-e| <= 448 for the latents,
clamped to 448 for the keys), so torch's overflow rules never apply.  The divisions are ``div_rn`` (IEEE; one or
two per tile or key, not per value: a latent code is an exact multiply by a power of two, a key code a multiply
by the rounded reciprocal, as the reference computes them).

``store_latent_triton`` (:class:`LatentStore`)
    Grid ``(cdiv(n, BLOCK_N),)``: a program takes ``BLOCK_N`` whole latents: loads the 448 nope values as
    ``[BLOCK_N, 8, 64]`` (the eighth tile masked), computes the 7 tile exponents, writes the fp8 codes, the scale
    bytes (never the padding byte) and the rope converted to bf16 (the 64 rope values loaded apart: every input
    byte is read once).
``store_index_triton`` (:class:`IndexStore`)
    Grid ``(cdiv(n, BLOCK_N),)``: a program takes ``BLOCK_N`` whole keys and writes their codes and float32 scales.

Host time: an engine stores per layer and step with changing ``n``.  Each store keeps a memo of plans
(:mod:`kvcore.kernels.launch`) keyed by the call's metadata (the buffer's page geometry and alignment, the
locations' and inputs' dtypes, strides, devices and alignments, ``page_size``, and the size class of ``n``); the
first call of a signature runs every check and builds its plan (tile, warps, constexprs, launch key), every later
one reads the metadata, finds the plan in one dict lookup and launches the compiled kernel directly with the
buffer, locations and inputs as addresses (no dispatcher, no view, no allocation, no host sync: CUDA-graph safe).
The layers of one stacked buffer share their plans (a layer's buffer differs only in its address).  ``n = 0``
launches nothing.  Both stores take inputs ``[n, W]`` or ``[n, 1, W]`` with any strides (views of a fused
projection) and int32 or int64 locations of any stride.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvcore.kernels.dtypes import E4M3FN_MAX
from kvcore.kernels.fp8 import f32_to_bf16_bits, finite_f32_to_e4m3fn_bytes, torch_e4m3fn_saturates
from kvcore.kernels.kernel_mode import triton_interpreting
from kvcore.kernels.launch import UNPLANNED, KernelArgs, Plan, launcher_for, remember
from kvcore.kernels.row_move import next_pow2
from kvcore_dsv4.quantize import (
    DATA_BYTES,
    INDEX_SCALE_BYTES,
    NOPE,
    NUM_TILES,
    ROPE,
    SCALE_BYTES,
    SCALE_FLOOR,
    TILE,
    check_index_call,
    check_latent_call,
)

__all__ = ["IndexStore", "LatentStore", "store_index_triton", "store_latent_triton"]

_E4M3FN_MAX = tl.constexpr(E4M3FN_MAX)
_E4M3FN_MIN = tl.constexpr(-E4M3FN_MAX)
_SCALE_FLOOR = tl.constexpr(SCALE_FLOOR)

# Tokens per program (powers of two) and warps.  On an H200 (RESULTS.md): the latent store's are the best or within
# noise of the best of 2-32 tokens x 1-4 warps at 256 and 32768 tokens (benchmarks/tune_dsv4.py, L2 emptied between
# calls); the indexer store's, of 4-64 keys x 1-8 warps timed in CUDA-graph replay as `kvcore bench` times it
# (benchmarks/tune_row_stores.py): 16 keys x 2 warps take 3.96 us for 32768 keys (0.76 of the copy ceiling; 8 x 1:
# 4.44 us, 0.67) and 2.02 us for 256.  Decode calls take min(BLOCK_N, next_pow2(n)).
_LATENT_BLOCK_N = 2
_LATENT_NUM_WARPS = 1
_INDEX_BLOCK_N = 16
_INDEX_NUM_WARPS = 2


# ==========================================================================================================
# Device functions
# ==========================================================================================================


@triton.jit
def _token_block(loc_ptr, loc_stride, n_tokens, PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr):
    """This program's ``BLOCK_N`` tokens: (token index, whether it is stored (a real token with loc >= 0), page,
    slot), all int64."""
    offs_n = (tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    loc = tl.load(loc_ptr + offs_n * loc_stride, mask=offs_n < n_tokens, other=-1).to(tl.int64)
    keep = loc >= 0
    loc = tl.where(keep, loc, 0)
    return offs_n, keep, loc // PAGE_SIZE, loc % PAGE_SIZE


@triton.jit
def _bf16_bits(v, X_BF16: tl.constexpr, HW_CVT: tl.constexpr):
    """Input values -> int16 bfloat16 bits: bf16 copied, float16/float32 rounded to nearest even."""
    if X_BF16:
        bits = v.to(tl.int16, bitcast=True)
    else:
        vf = v.to(tl.float32)
        if HW_CVT:
            bits = vf.to(tl.bfloat16).to(tl.int16, bitcast=True)
        else:
            bits = f32_to_bf16_bits(vf).to(tl.int16)
    return bits


# ==========================================================================================================
# Kernels
# ==========================================================================================================


@triton.jit(do_not_specialize=["n_tokens", "loc_stride"])
def _store_latent_kernel(
    buf_u8,
    buf_i16,
    loc_ptr,
    n_tokens,
    x_ptr,
    loc_stride,
    x_sn,
    x_sd,
    PAGE_SIZE: tl.constexpr,
    PAGE_BYTES: tl.constexpr,
    NOPE: tl.constexpr,
    ROPE: tl.constexpr,
    TILE: tl.constexpr,
    TILES_PAD: tl.constexpr,
    DATA_BYTES: tl.constexpr,
    SCALE_BYTES: tl.constexpr,
    X_BF16: tl.constexpr,
    SATURATE: tl.constexpr,
    HW_CVT: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """``BLOCK_N`` latents: fp8 codes and ue8m0 scale bytes of the ``NOPE // TILE`` nope tiles (padded to
    ``TILES_PAD``, a power of two, and masked), and the bf16 rope.  ``buf_u8`` and ``buf_i16`` are the same
    buffer, addressed in bytes and in int16 elements (rows and the rope start are even)."""
    offs_n, keep, page, slot = _token_block(loc_ptr, loc_stride, n_tokens, PAGE_SIZE, BLOCK_N)
    x_row = x_ptr + offs_n * x_sn
    cols = tl.arange(0, TILES_PAD * TILE)
    mask = keep[:, None] & (cols < NOPE)[None, :]
    x = tl.load(x_row[:, None] + cols[None, :].to(tl.int64) * x_sd, mask=mask, other=0.0).to(tl.float32)
    x3 = tl.reshape(x, (BLOCK_N, TILES_PAD, TILE))
    amax = tl.max(tl.abs(x3), axis=2)
    s = tl.math.div_rn(tl.maximum(amax, _SCALE_FLOOR), tl.zeros_like(amax) + _E4M3FN_MAX)
    # e = ceil(log2(s)), exactly: s's exponent, plus one unless s is a power of two; stored biased (e + 127)
    bits = s.to(tl.int32, bitcast=True)
    biased = (bits >> 23) + ((bits & 0x7FFFFF) != 0).to(tl.int32)
    pow2 = ((254 - biased) << 23).to(tl.float32, bitcast=True)  # 2**-e
    q = tl.reshape(x3 * pow2[:, :, None], (BLOCK_N, TILES_PAD * TILE))
    page_start = page * PAGE_BYTES
    tl.store(buf_u8 + (page_start + slot * DATA_BYTES)[:, None] + cols[None, :], finite_f32_to_e4m3fn_bytes(q, SATURATE, HW_CVT),
             mask=mask)  # fmt: skip
    t = tl.arange(0, TILES_PAD)
    scale_row = page_start + PAGE_SIZE * DATA_BYTES + slot * SCALE_BYTES
    tl.store(buf_u8 + scale_row[:, None] + t[None, :], biased.to(tl.uint8),
             mask=keep[:, None] & (t < NOPE // TILE)[None, :])  # fmt: skip
    r = tl.arange(0, ROPE)
    rope = tl.load(x_row[:, None] + (NOPE + r)[None, :].to(tl.int64) * x_sd, mask=keep[:, None], other=0.0)
    rope_dst = page * (PAGE_BYTES // 2) + slot * (DATA_BYTES // 2) + NOPE // 2
    tl.store(buf_i16 + rope_dst[:, None] + r[None, :], _bf16_bits(rope, X_BF16, HW_CVT), mask=keep[:, None])


@triton.jit(do_not_specialize=["n_tokens", "loc_stride"])
def _store_index_kernel(
    buf_u8,
    buf_f32,
    loc_ptr,
    n_tokens,
    x_ptr,
    loc_stride,
    x_sn,
    x_sd,
    PAGE_SIZE: tl.constexpr,
    PAGE_BYTES: tl.constexpr,
    DIM: tl.constexpr,
    SATURATE: tl.constexpr,
    HW_CVT: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """``BLOCK_N`` keys: ``DIM`` fp8 codes and a float32 scale each.  ``buf_u8`` and ``buf_f32`` are the same
    buffer, addressed in bytes and in float32 elements (pages and the scales' start are multiples of 4 bytes)."""
    offs_n, keep, page, slot = _token_block(loc_ptr, loc_stride, n_tokens, PAGE_SIZE, BLOCK_N)
    cols = tl.arange(0, DIM)
    x = tl.load(x_ptr + offs_n[:, None] * x_sn + cols[None, :].to(tl.int64) * x_sd, mask=keep[:, None],
                other=0.0).to(tl.float32)  # fmt: skip
    amax = tl.max(tl.abs(x), axis=1)
    scale = tl.math.div_rn(tl.maximum(amax, _SCALE_FLOOR), tl.zeros_like(amax) + _E4M3FN_MAX)
    inv = tl.math.div_rn(tl.zeros_like(scale) + 1.0, scale)
    q = tl.minimum(tl.maximum(x * inv[:, None], _E4M3FN_MIN), _E4M3FN_MAX)
    tl.store(buf_u8 + (page * PAGE_BYTES + slot * DIM)[:, None] + cols[None, :], finite_f32_to_e4m3fn_bytes(q, SATURATE, HW_CVT),
             mask=keep[:, None])  # fmt: skip
    tl.store(buf_f32 + page * (PAGE_BYTES // 4) + (PAGE_SIZE * DIM) // 4 + slot, scale, mask=keep)


#: the argument lists (:class:`kvcore.kernels.launch.KernelArgs`): per call the buffer's address (twice: two views),
#: the locations' address, the count and the input's address; then the strides the plan fixes.  Pointers as
#: addresses.
_LATENT_ARGS = KernelArgs(
    _store_latent_kernel,
    runtime=("buf_u8 buf_i16 loc_ptr n_tokens x_ptr", "loc_stride x_sn x_sd"),
    constexprs="PAGE_SIZE PAGE_BYTES NOPE ROPE TILE TILES_PAD DATA_BYTES SCALE_BYTES X_BF16 SATURATE HW_CVT BLOCK_N",
    pointers="buf_u8 buf_i16 loc_ptr x_ptr",
)
_INDEX_ARGS = KernelArgs(
    _store_index_kernel,
    runtime=("buf_u8 buf_f32 loc_ptr n_tokens x_ptr", "loc_stride x_sn x_sd"),
    constexprs="PAGE_SIZE PAGE_BYTES DIM SATURATE HW_CVT BLOCK_N",
    pointers="buf_u8 buf_f32 loc_ptr x_ptr",
)


def _latent_views(buf: torch.Tensor, loc: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return buf, buf.view(torch.int16), loc, x


def _index_views(buf: torch.Tensor, loc: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return buf, buf.view(torch.float32), loc, x


# ==========================================================================================================
# Stores: checked and planned once per call signature
# ==========================================================================================================


class _Store:
    """A quantize-and-store with its memo of plans (see the module docstring); subclasses plan."""

    def __init__(self):
        self._plans: dict[tuple, Plan | None] = {}

    def __call__(self, buf: torch.Tensor, loc: torch.Tensor, x: torch.Tensor, page_size: int) -> None:
        bp, lp, xp, n, xs = buf.data_ptr(), loc.data_ptr(), x.data_ptr(), loc.numel(), x.shape
        signature = ((n - 1).bit_length() if n else -1, page_size, buf.shape[1:], buf.stride(), buf.dtype,
                     buf.get_device(), bp & 15, loc.stride(), loc.dtype, loc.get_device(), lp & 15, xs[1:],
                     x.stride(), x.dtype, x.get_device(), xp & 15)  # fmt: skip
        plan = self._plans.get(signature, UNPLANNED)
        if plan is UNPLANNED or xs[0] != n:  # a first call, or inputs of another count (refused)
            plan = remember(self._plans, signature, self._plan(buf, loc, x, page_size))
        if plan is not None:
            plan(n, (bp, bp, lp, n, xp), (buf, loc, x))

    def _plan(self, buf: torch.Tensor, loc: torch.Tensor, x: torch.Tensor, page_size: int) -> Plan | None:
        raise NotImplementedError


def _launch_key(buf: torch.Tensor, loc: torch.Tensor, x2: torch.Tensor) -> tuple:
    """What Triton specializes on beyond the constexprs and warps: dtypes, 16-byte alignments, the input's strides
    (the other ints are ``do_not_specialize``)."""
    return (x2.dtype, *x2.stride(), x2.data_ptr() % 16 == 0, loc.dtype, loc.data_ptr() % 16 == 0,
            buf.data_ptr() % 16 == 0)  # fmt: skip


class LatentStore(_Store):
    """Quantize-and-store of latent rows, planned once per call signature: ``LatentStore()(buf, loc, x,
    page_size)`` is :func:`store_latent_triton` (which uses one shared instance)."""

    def _plan(self, buf, loc, x, page_size) -> Plan | None:
        x2 = check_latent_call(buf, loc, x, page_size)
        n = loc.shape[0]
        if n == 0:
            return None
        if buf.data_ptr() % 2:
            raise ValueError("the latent buffer's address must be even (its rope is written as bf16)")
        block_n = min(_LATENT_BLOCK_N, next_pow2(n))
        constexprs = _LATENT_ARGS.constexprs(
            PAGE_SIZE=page_size, PAGE_BYTES=buf.shape[1], NOPE=NOPE, ROPE=ROPE, TILE=TILE,
            TILES_PAD=next_pow2(NUM_TILES), DATA_BYTES=DATA_BYTES, SCALE_BYTES=SCALE_BYTES,
            X_BF16=x2.dtype == torch.bfloat16, SATURATE=torch_e4m3fn_saturates(), HW_CVT=not triton_interpreting(),
            BLOCK_N=block_n,
        )  # fmt: skip
        return Plan(launcher_for(_LATENT_ARGS, buf.device), _launch_key(buf, loc, x2), block_n, (1, 1),
                    _LATENT_NUM_WARPS, views=_latent_views, constexprs=constexprs,
                    tail=(loc.stride(0), *x2.stride()))  # fmt: skip


class IndexStore(_Store):
    """Quantize-and-store of indexer keys, planned once per call signature: ``IndexStore()(buf, loc, x,
    page_size)`` is :func:`store_index_triton` (which uses one shared instance)."""

    def _plan(self, buf, loc, x, page_size) -> Plan | None:
        x2 = check_index_call(buf, loc, x, page_size)
        n, dim = loc.shape[0], x2.shape[1]
        if dim & (dim - 1) or (page_size * dim) % INDEX_SCALE_BYTES or buf.data_ptr() % 4:
            raise ValueError(f"the indexer store needs a power-of-two key width ({dim}), scales starting at a "
                             "multiple of 4 bytes and a 4-byte aligned buffer")  # fmt: skip
        if n == 0:
            return None
        block_n = min(_INDEX_BLOCK_N, next_pow2(n))
        constexprs = _INDEX_ARGS.constexprs(PAGE_SIZE=page_size, PAGE_BYTES=buf.shape[1], DIM=dim,
                                            SATURATE=torch_e4m3fn_saturates(), HW_CVT=not triton_interpreting(),
                                            BLOCK_N=block_n)  # fmt: skip
        return Plan(launcher_for(_INDEX_ARGS, buf.device), _launch_key(buf, loc, x2), block_n, (1, 1),
                    _INDEX_NUM_WARPS, views=_index_views, constexprs=constexprs,
                    tail=(loc.stride(0), *x2.stride()))  # fmt: skip


_LATENT = LatentStore()
_INDEX = IndexStore()


def store_latent_triton(buf: torch.Tensor, loc: torch.Tensor, x: torch.Tensor, page_size: int) -> None:
    """Quantize latents into one layer's V4 latent pages (format: :mod:`kvcore_dsv4.quantize`).

    :param buf: contiguous uint8 ``[num_pages, latent_page_bytes(page_size)]``, one layer.
    :param loc: ``[n]`` int32/int64 distinct slots (< ``num_pages * page_size``, not checked); negative ones are
        skipped.
    :param x: ``[n, 512]`` (or ``[n, 1, 512]``) float32/float16/bfloat16, any strides: 448 nope then 64 rope values.
    :param page_size: slots per page.
    :returns: nothing; the bytes are :func:`~kvcore_dsv4.quantize.store_latent_native`'s.  One launch (none for
        ``n = 0``), no allocation, no host sync.
    """
    _LATENT(buf, loc, x, page_size)


def store_index_triton(buf: torch.Tensor, loc: torch.Tensor, x: torch.Tensor, page_size: int) -> None:
    """Quantize indexer keys into one layer's fp8 indexer pages (format: :mod:`kvcore_dsv4.quantize`).

    :param buf: contiguous uint8 ``[num_pages, page_size * (D + 4)]``, one layer.
    :param loc: ``[n]`` int32/int64 distinct slots; negative ones are skipped.
    :param x: ``[n, D]`` (or ``[n, 1, D]``) float32/float16/bfloat16, any strides; D a power of two (128).
    :param page_size: keys per page.
    :returns: nothing; the bytes are :func:`~kvcore_dsv4.quantize.store_index_native`'s.  One launch (none for
        ``n = 0``), no allocation, no host sync.
    """
    _INDEX(buf, loc, x, page_size)
