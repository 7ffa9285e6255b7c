"""The acme store kernel: K and V rows of N tokens into the page-interleaved buffer, one launch per layer.

Buffer (see :mod:`kvcore_acme.layout`): ``kv`` is ``[layers, pages, 2, page_size, heads, head_dim]``; token ``t``
keeps its K row at ``kv[layer, t // page_size, 0, t % page_size]`` and its V row at ``[..., 1, ...]``.

:func:`store_kv_triton` and its torch reference :func:`store_kv_native` take the same arguments and write the same
bytes; the pool calls one of them by kvcore's kernels mode (``hardware.kernels``).  Inputs are converted to the
cache dtype on the way (Triton's cast and torch's ``.to`` round alike for the widening and same-dtype stores
the tests check bit for bit).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_BLOCK = 1024  # elements of one row a program copies at a time


@triton.jit
def _store_kv_kernel(kv_ptr, k_ptr, v_ptr, loc_ptr, layer_offset, page_stride, k_stride, v_stride,
                     PAGE: tl.constexpr, ROW: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < ROW
    loc = tl.load(loc_ptr + token).to(tl.int64)
    # K row of the token's page slot; its V row is PAGE rows further on, in the same page.
    k_dst = kv_ptr + layer_offset + (loc // PAGE) * page_stride + (loc % PAGE) * ROW
    k = tl.load(k_ptr + token * k_stride + cols, mask=mask)
    v = tl.load(v_ptr + token * v_stride + cols, mask=mask)
    tl.store(k_dst + cols, k.to(kv_ptr.dtype.element_ty), mask=mask)
    tl.store(k_dst + PAGE * ROW + cols, v.to(kv_ptr.dtype.element_ty), mask=mask)


def _rows(x: torch.Tensor, n: int, row: int) -> torch.Tensor:
    """``x`` as ``[n, row]`` with unit stride along the row (a copy only when the head dims are not packed)."""
    x = x.reshape(n, row)
    return x if x.stride(1) == 1 else x.contiguous()


def store_kv_triton(kv: torch.Tensor, layer: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """Write ``k`` / ``v`` (``[N, heads, head_dim]``, any float dtype) at tokens ``loc`` of local ``layer``."""
    n = loc.numel()
    if n == 0:
        return
    _, _, _, page, heads, head_dim = kv.shape
    row = heads * head_dim
    k2, v2 = _rows(k, n, row), _rows(v, n, row)
    block = min(triton.next_power_of_2(row), MAX_BLOCK)
    grid = (n, triton.cdiv(row, block))
    _store_kv_kernel[grid](kv, k2, v2, loc, layer * kv.stride(0), kv.stride(1), k2.stride(0), v2.stride(0),
                           PAGE=page, ROW=row, BLOCK=block)  # fmt: skip


def store_kv_native(kv: torch.Tensor, layer: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """The torch reference of :func:`store_kv_triton`."""
    page = kv.shape[3]
    loc = loc.long()
    pages, slots = torch.div(loc, page, rounding_mode="floor"), loc % page
    kv[layer, pages, 0, slots] = k.to(kv.dtype)
    kv[layer, pages, 1, slots] = v.to(kv.dtype)
