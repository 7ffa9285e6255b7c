"""The torch paths of the head gather (:mod:`kvcore.kernels.head_gather`): a layer's rows taken at and put to token
locations, and the references its kernels are checked against, bit for bit, which the pools' torch paths (the CPU's,
``kernels=native``) run."""

from __future__ import annotations

import torch

from kvcore.kernels.dtypes import is_fp8_dtype

__all__ = ["gather_heads_native", "put_rows", "store_and_gather_native", "take_rows"]


def take_rows(buffer: torch.Tensor, locs: torch.Tensor) -> torch.Tensor:
    """The rows of tokens ``locs`` (a copy, ``[*locs.shape, heads, dim]``) of a layer's token rows ``[rows, heads,
    dim]`` or paged view ``[pages, page_size, heads, dim]``; fp8 rows are gathered as their bytes (fp8 indexing
    kernels are not on every device) and viewed back."""
    dtype = buffer.dtype
    if is_fp8_dtype(dtype):
        buffer = buffer.view(torch.uint8)
    if buffer.dim() == 4:
        rows = buffer[locs // buffer.shape[1], locs % buffer.shape[1]]
    else:
        rows = buffer[locs]
    return rows.view(dtype) if rows.dtype != dtype else rows


def gather_heads_native(k: torch.Tensor, v: torch.Tensor, locs: torch.Tensor, out_dtype: torch.dtype,
                        k_scale: float | None = None, v_scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Torch reference of :func:`~kvcore.kernels.head_gather.gather_heads_triton` (an index gather, a conversion
    and a transposing copy per tensor)."""
    outs = []
    for buffer, scale in ((k, k_scale), (v, v_scale)):
        rows = take_rows(buffer, locs.to(torch.int64))
        if rows.dtype != out_dtype:
            rows = rows.to(torch.float32)
            rows = (rows * scale if scale is not None else rows).to(out_dtype)
        outs.append(rows.transpose(1, 2).contiguous())
    return outs[0], outs[1]


def put_rows(buffer: torch.Tensor, locs: torch.Tensor, rows: torch.Tensor) -> None:
    """Write ``rows`` (``[*locs.shape, heads, dim]``, the buffer's dtype) at tokens ``locs`` of a layer's token rows
    or paged view (:func:`take_rows`'s layouts; fp8 written as its bytes)."""
    if is_fp8_dtype(buffer.dtype):
        buffer, rows = buffer.view(torch.uint8), rows.view(torch.uint8)
    if buffer.dim() == 4:
        buffer[locs // buffer.shape[1], locs % buffer.shape[1]] = rows
    else:
        buffer[locs] = rows


def store_and_gather_native(k: torch.Tensor, v: torch.Tensor, locs: torch.Tensor, k_new: torch.Tensor,
                            v_new: torch.Tensor, out_dtype: torch.dtype, k_scale: float | None = None,
                            v_scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Torch reference of :meth:`~kvcore.kernels.head_gather.HeadGather.store_and_gather`: the new rows stored as a
    K/V pool's ``set_kv_buffer`` stores them, then :func:`gather_heads_native`."""
    q = k_new.shape[2]
    new_locs = locs[:, locs.shape[1] - q :].to(torch.int64)
    for buffer, x, scale in ((k, k_new, k_scale), (v, v_new, v_scale)):
        rows = x.transpose(1, 2)  # [batch, q, heads, dim]
        if rows.dtype != buffer.dtype:
            if scale is not None:  # a device tensor: torch divides element-wise (a number would be a reciprocal)
                rows = rows.float() / torch.tensor([float(scale)], device=rows.device)
            rows = rows.to(buffer.dtype)
        put_rows(buffer, new_locs, rows)
    return gather_heads_native(k, v, locs, out_dtype, k_scale, v_scale)
