"""The DSA pool's fp8 latent row, as torch computes it: the references the Triton kernels of
:mod:`kvcore_dsa.scaled_rows` are bit-exact with (row formats: :mod:`kvcore_dsa.layout`).

Quantization, exactly as these references compute it (and so the Triton kernels, bit for bit)::

    amax  = max |x| over the 128 values of a tile, in float32
    scale = max(amax / 448, 2**-126)                       IEEE division; the clamp is the zero-tile guard
    q     = e4m3fn(x / scale)                              IEEE division, round to nearest even
    x'    = float32(q) * scale                             dequantization (then cast to the asked dtype)

The references divide by device tensors (torch's CUDA division by a host scalar multiplies by its reciprocal
instead).  NaN and infinite inputs are outside the contract (a GPU's max ignores NaN, torch's amax propagates
it), and so are float32 subnormal inputs on a GPU that flushes them (the scale itself is never subnormal: see
the zero-tile guard).
"""

from __future__ import annotations

import torch

from kvcore.kernels.dtypes import E4M3FN_MAX
from kvcore_dsa.layout import QUANT_BLOCK_SIZE, ROPE_STORAGE_DTYPE, SCALE_MIN

__all__ = ["dequantize_rows", "quantize_concatenated", "quantize_parts"]


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
