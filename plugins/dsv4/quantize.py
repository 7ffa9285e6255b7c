"""DeepSeek-V4's cached rows as torch computes them: the references the Triton stores of :mod:`kvcore_dsv4.kernels`
are bit-exact with, the reads (dequantization), and the checks both share.

A buffer is one layer, uint8 ``[num_pages, page_bytes]``; token slot ``loc`` is slot ``loc % page_size`` of page
``loc // page_size``; a negative ``loc`` is skipped (nothing is written).  Locations must be distinct and below
``num_pages * page_size`` (not checked: that would cost a host sync).

**Latent rows** (SGLang's "V4" FlashMLA pages): a latent ``x[512]`` is :data:`NOPE` = 448 nope values then
:data:`ROPE` = 64 rope values.  ``page_bytes = ceil(page_size * 584 / 576) * 576`` (:func:`latent_page_bytes`).

* data row at byte ``page * page_bytes + slot * 576``: bytes ``[0, 448)`` the fp8 e4m3fn codes of the nope values,
  bytes ``[448, 576)`` the rope values as bfloat16 (round to nearest even from float16/float32; bfloat16 copied);
* scale row at byte ``page * page_bytes + page_size * 576 + slot * 8``: byte ``t`` (0..6) is the "ue8m0" scale of
  nope tile ``t`` (values ``[64 t, 64 t + 64)``), byte 7 is padding and never written.

Quantization of one tile, in float32::

    amax = max |x|                                  (exact)
    s    = max(amax, 1e-8) / 448                    IEEE division (1e-8 is float32(1e-8))
    e    = ceil(log2(s))                            exactly, from the bits of s (s >= 1e-8 / 448 is normal):
                                                    its unbiased exponent, plus one if any mantissa bit is set
    byte = e + 127                                  (92 .. 246 for finite float32 inputs)
    code = e4m3fn(x * 2**-e)                        the multiply is exact (a power of two; a product below
                                                    2**-126 rounds to a signed zero code either way), the
                                                    conversion rounds to nearest even; |x * 2**-e| <= 448
    read = float32(code) * 2**e                     exact

**Indexer keys** (ratio-4 lightning indexer, fp8): a key ``x[D]`` (D = 128).  ``page_bytes = page_size * (D + 4)``
(:func:`index_page_bytes`): the key's D codes at byte ``page * page_bytes + slot * D``, its float32 scale (little
endian) at ``page * page_bytes + page_size * D + slot * 4``.  Quantization of one key, in float32::

    amax  = max |x|
    scale = max(amax, 1e-8) / 448                   IEEE division; stored
    inv   = 1 / scale                               IEEE division
    code  = e4m3fn(clamp(x * inv, -448, 448))       float32 multiply (rounded), round to nearest even
    read  = float32(code) * scale                   float32 multiply (rounded)

The references divide by tensors, never by a Python number (torch's CUDA division by a host scalar multiplies by
its reciprocal, which is not the IEEE quotient).  NaN and infinite inputs are outside the contract.  float32
subnormal inputs are not: whatever a GPU does with them (flushing keeps the sign), their codes are signed zeros.
"""

from __future__ import annotations

import torch

from kvcore.kernels.dtypes import E4M3FN_MAX

__all__ = [
    "DATA_BYTES",
    "INDEX_SCALE_BYTES",
    "LATENT_DIM",
    "NOPE",
    "NUM_TILES",
    "ROPE",
    "SCALE_BYTES",
    "SCALE_FLOOR",
    "TILE",
    "check_index_call",
    "check_latent_call",
    "dequantize_index",
    "dequantize_latent",
    "index_page_bytes",
    "latent_page_bytes",
    "quantize_index",
    "quantize_latent",
    "read_index",
    "read_latent",
    "store_index_native",
    "store_latent_native",
]

#: nope and rope values of a latent, and the nope values sharing one scale byte
NOPE, ROPE, TILE = 448, 64, 64
LATENT_DIM = NOPE + ROPE
NUM_TILES = NOPE // TILE
#: bytes of a latent's data row (fp8 nope, bf16 rope) and of its scale row (a byte per tile, a padding byte)
DATA_BYTES = NOPE + 2 * ROPE
SCALE_BYTES = 8
#: a latent page is padded to a multiple of this many bytes
PAGE_ALIGN = 576
#: the float32 scale of an indexer key
INDEX_SCALE_BYTES = 4
#: the zero-tile guard, float32(1e-8) as a Python float (exactly representable in float32)
SCALE_FLOOR = float(torch.tensor(1e-8, dtype=torch.float32).item())
#: the exponent bias of float32 (and of the ue8m0 scale bytes)
_BIAS = 127

_FLOAT_INPUTS = (torch.float32, torch.float16, torch.bfloat16)


def latent_page_bytes(page_size: int) -> int:
    """``ceil(page_size * 584 / 576) * 576``: the bytes of a latent page of ``page_size`` slots."""
    return -(-page_size * (DATA_BYTES + SCALE_BYTES) // PAGE_ALIGN) * PAGE_ALIGN


def index_page_bytes(page_size: int, dim: int = 128) -> int:
    """``page_size * (dim + 4)``: the bytes of an indexer page of ``page_size`` keys of ``dim`` values."""
    return page_size * (dim + INDEX_SCALE_BYTES)


# ==========================================================================================================
# Checks (shared with the Triton stores, which run them once per call signature)
# ==========================================================================================================


def _check_buffer(buf: torch.Tensor, page_size: int, page_bytes: int, what: str) -> None:
    if not isinstance(page_size, int) or page_size < 1:
        raise ValueError(f"page_size must be a positive int, got {page_size!r}")
    if buf.dtype != torch.uint8 or buf.dim() != 2 or buf.stride() != (buf.shape[1], 1):
        raise ValueError(f"the {what} buffer must be a contiguous uint8 [num_pages, page_bytes] tensor (one layer), "
                         f"got {buf.dtype} {tuple(buf.shape)} strides {buf.stride()}")  # fmt: skip
    if buf.shape[1] != page_bytes:
        raise ValueError(f"{what} pages of {page_size} slots hold {page_bytes} bytes, the buffer's rows hold "
                         f"{buf.shape[1]}: wrong page_size or buffer")  # fmt: skip


def _check_loc(loc: torch.Tensor) -> int:
    if loc.dim() != 1 or loc.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"loc must be a 1-D int32/int64 tensor, got {loc.dtype} {tuple(loc.shape)}")
    return loc.shape[0]


def _rows(x: torch.Tensor, n: int, width: int) -> torch.Tensor:
    """``x`` as ``[n, width]`` (a view), checked: ``[n, width]`` or ``[n, 1, width]``, a float dtype."""
    shape = tuple(x.shape)
    if shape == (n, 1, width):
        x = x[:, 0]
    elif shape != (n, width):
        raise ValueError(f"x must be [{n}, {width}] (or [{n}, 1, {width}]), got {shape}")
    if x.dtype not in _FLOAT_INPUTS:
        raise ValueError(f"x must be float32/float16/bfloat16 to be quantized, got {x.dtype}")
    return x


def _check_devices(buf: torch.Tensor, **tensors: torch.Tensor) -> None:
    for name, t in tensors.items():
        if t.device != buf.device:
            raise ValueError(f"{name} is on {t.device}, the buffer on {buf.device}")


def check_latent_call(buf: torch.Tensor, loc: torch.Tensor, x: torch.Tensor, page_size: int) -> torch.Tensor:
    """Checks a latent store's arguments; returns ``x`` as ``[n, 512]``."""
    _check_buffer(buf, page_size, latent_page_bytes(page_size), "latent")
    n = _check_loc(loc)
    x = _rows(x, n, LATENT_DIM)
    _check_devices(buf, loc=loc, x=x)
    return x


def check_index_call(buf: torch.Tensor, loc: torch.Tensor, x: torch.Tensor, page_size: int) -> torch.Tensor:
    """Checks an indexer store's arguments; returns ``x`` as ``[n, D]`` (D from the buffer's page bytes)."""
    if not isinstance(page_size, int) or page_size < 1:
        raise ValueError(f"page_size must be a positive int, got {page_size!r}")
    dim = buf.shape[-1] // page_size - INDEX_SCALE_BYTES if buf.dim() == 2 else -1
    _check_buffer(buf, page_size, index_page_bytes(page_size, dim), "indexer")
    n = _check_loc(loc)
    x = _rows(x, n, dim)
    _check_devices(buf, loc=loc, x=x)
    return x


# ==========================================================================================================
# Latent rows
# ==========================================================================================================


def _full(t: torch.Tensor, value: float) -> torch.Tensor:
    return torch.full_like(t, value)


def _latent_exponents(nope_tiles: torch.Tensor) -> torch.Tensor:
    """``[n, 7, 64]`` float32 -> ``[n, 7]`` int32 biased exponents ``e + 127`` (the scale bytes)."""
    amax = nope_tiles.abs().amax(dim=-1)
    s = torch.maximum(amax, _full(amax, SCALE_FLOOR)) / _full(amax, E4M3FN_MAX)
    bits = s.view(torch.int32)
    return (bits >> 23) + ((bits & 0x7FFFFF) != 0).to(torch.int32)


def _pow2(biased: torch.Tensor) -> torch.Tensor:
    """int32 biased exponents (1..254) -> float32 powers of two, exactly (from the bits)."""
    return (biased.to(torch.int32) << 23).view(torch.float32)


def quantize_latent(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Torch reference of a latent row (see the module docstring).

    :param x: ``[n, 512]`` float32/float16/bfloat16, any strides.
    :returns: ``(codes, rope, scales)``: uint8 ``[n, 448]`` fp8 e4m3fn codes, uint8 ``[n, 128]`` the bf16 rope
        bytes, uint8 ``[n, 7]`` the ue8m0 scale bytes (``e + 127``).
    """
    n = x.shape[0]
    x = _rows(x, n, LATENT_DIM)
    tiles = x[:, :NOPE].float().reshape(n, NUM_TILES, TILE)
    biased = _latent_exponents(tiles)
    q = tiles * _pow2(2 * _BIAS - biased).unsqueeze(-1)  # x * 2**-e, exact
    codes = q.to(torch.float8_e4m3fn).view(torch.uint8).reshape(n, NOPE)
    rope = x[:, NOPE:].to(torch.bfloat16).contiguous().view(torch.uint8).reshape(n, 2 * ROPE)
    return codes, rope, biased.to(torch.uint8)


def dequantize_latent(codes: torch.Tensor, rope: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``(codes [n, 448], rope [n, 128], scales [n, 7])`` uint8 -> float32 ``[n, 512]``: ``float32(code) * 2**e``
    and the bf16 rope; exact (scale bytes 1..254: every one a store writes)."""
    n = codes.shape[0]
    q = codes.contiguous().view(torch.float8_e4m3fn).float().reshape(n, NUM_TILES, TILE)
    nope = (q * _pow2(scales.to(torch.int32)).unsqueeze(-1)).reshape(n, NOPE)
    return torch.cat([nope, rope.contiguous().view(torch.bfloat16).float().reshape(n, ROPE)], dim=1)


def _latent_addresses(loc: torch.Tensor, page_size: int, page_bytes: int) -> tuple[torch.Tensor, torch.Tensor]:
    """int64 byte offsets of the data rows and scale rows of slots ``loc`` (non-negative)."""
    loc = loc.long()
    page, slot = loc // page_size, loc % page_size
    data = page * page_bytes + slot * DATA_BYTES
    return data, page * page_bytes + page_size * DATA_BYTES + slot * SCALE_BYTES


def _columns(start: torch.Tensor, width: int) -> torch.Tensor:
    return start.unsqueeze(1) + torch.arange(width, device=start.device)


def store_latent_native(buf: torch.Tensor, loc: torch.Tensor, x: torch.Tensor, page_size: int) -> None:
    """Torch reference of :func:`kvcore_dsv4.kernels.store_latent_triton` (same arguments, same bytes): quantize
    latents ``x`` ``[n, 512]`` into slots ``loc`` of one layer's buffer; negative slots are skipped."""
    x = check_latent_call(buf, loc, x, page_size)
    if loc.numel() == 0:
        return
    codes, rope, scales = quantize_latent(x)
    data, scale_rows = _latent_addresses(loc.clamp(min=0), page_size, buf.shape[1])
    flat = buf.view(-1)
    _write_kept(flat, _columns(data, DATA_BYTES), torch.cat([codes, rope], dim=1), loc)
    _write_kept(flat, _columns(scale_rows, NUM_TILES), scales, loc)


def _write_kept(flat: torch.Tensor, at: torch.Tensor, rows: torch.Tensor, loc: torch.Tensor) -> None:
    """``flat[at] = rows`` for the tokens of non-negative ``loc``, as if the others were not there.  A negative
    slot's row is aimed at slot 0 and carries what slot 0 ends with (the last row written there, else its bytes
    as they were), so every write to slot 0 agrees.  No boolean indexing: nothing waits for the device, so a CUDA
    graph can capture it."""
    keep = (loc >= 0).unsqueeze(1)
    at_zero = torch.where(loc == 0, torch.arange(loc.numel(), device=loc.device), -1).max()
    last = rows.index_select(0, at_zero.clamp(min=0).reshape(1))  # a tensor index: no read of the device
    slot0 = torch.where(at_zero >= 0, last, flat[at])
    flat[at] = torch.where(keep, rows, slot0)


def read_latent(buf: torch.Tensor, loc: torch.Tensor, page_size: int) -> torch.Tensor:
    """Dequantized latents of slots ``loc``: float32 ``[n, 512]`` (a negative slot reads as zeros)."""
    _check_buffer(buf, page_size, latent_page_bytes(page_size), "latent")
    _check_loc(loc)
    keep = (loc >= 0).unsqueeze(1)
    data, scale_rows = _latent_addresses(loc.clamp(min=0), page_size, buf.shape[1])
    flat = buf.view(-1)
    rows = flat[_columns(data, DATA_BYTES)]
    values = dequantize_latent(rows[:, :NOPE], rows[:, NOPE:], flat[_columns(scale_rows, NUM_TILES)])
    return torch.where(keep, values, torch.zeros_like(values))


# ==========================================================================================================
# Indexer keys
# ==========================================================================================================


def quantize_index(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch reference of an indexer key (see the module docstring).

    :param x: ``[n, D]`` float32/float16/bfloat16, any strides.
    :returns: ``(codes, scale)``: uint8 ``[n, D]`` fp8 e4m3fn codes and float32 ``[n]`` scales.
    """
    n, dim = x.shape[0], x.shape[-1]
    xf = _rows(x, n, dim).float()
    amax = xf.abs().amax(dim=-1, keepdim=True)
    scale = torch.maximum(amax, _full(amax, SCALE_FLOOR)) / _full(amax, E4M3FN_MAX)
    inv = _full(scale, 1.0) / scale
    q = (xf * inv).clamp(-E4M3FN_MAX, E4M3FN_MAX)
    return q.to(torch.float8_e4m3fn).view(torch.uint8), scale.reshape(n)


def dequantize_index(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``(codes [n, D] uint8, scale [n] float32)`` -> float32 ``[n, D]``: ``float32(code) * scale``."""
    return codes.contiguous().view(torch.float8_e4m3fn).float() * scale.reshape(-1, 1)


def _index_addresses(loc: torch.Tensor, page_size: int, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    loc = loc.long()
    page, slot = loc // page_size, loc % page_size
    page_start = page * index_page_bytes(page_size, dim)
    return page_start + slot * dim, page_start + page_size * dim + slot * INDEX_SCALE_BYTES


def store_index_native(buf: torch.Tensor, loc: torch.Tensor, x: torch.Tensor, page_size: int) -> None:
    """Torch reference of :func:`kvcore_dsv4.kernels.store_index_triton` (same arguments, same bytes): quantize keys
    ``x`` ``[n, D]`` into slots ``loc`` of one layer's indexer buffer; negative slots are skipped."""
    x = check_index_call(buf, loc, x, page_size)
    if loc.numel() == 0:
        return
    dim = x.shape[1]
    codes, scale = quantize_index(x)
    keys, scales = _index_addresses(loc.clamp(min=0), page_size, dim)
    flat = buf.view(-1)
    _write_kept(flat, _columns(keys, dim), codes, loc)
    _write_kept(flat, _columns(scales, INDEX_SCALE_BYTES), scale.view(torch.uint8).reshape(-1, INDEX_SCALE_BYTES), loc)


def read_index(buf: torch.Tensor, loc: torch.Tensor, page_size: int) -> torch.Tensor:
    """Dequantized keys of slots ``loc``: float32 ``[n, D]`` (a negative slot reads as zeros)."""
    if not isinstance(page_size, int) or page_size < 1 or buf.dim() != 2:
        raise ValueError(f"page_size must be a positive int and buf [num_pages, page_bytes], got {page_size!r}, "
                         f"{tuple(buf.shape)}")  # fmt: skip
    dim = buf.shape[1] // page_size - INDEX_SCALE_BYTES
    _check_buffer(buf, page_size, index_page_bytes(page_size, dim), "indexer")
    _check_loc(loc)
    keep = (loc >= 0).unsqueeze(1)
    keys, scales = _index_addresses(loc.clamp(min=0), page_size, dim)
    flat = buf.view(-1)
    scale = flat[_columns(scales, INDEX_SCALE_BYTES)].contiguous().view(torch.float32).reshape(-1)
    values = dequantize_index(flat[_columns(keys, dim)], scale)
    return torch.where(keep, values, torch.zeros_like(values))
