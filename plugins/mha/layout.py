"""The MHA pool's declared buffers; importing this needs no kernels (the planner uses it on any machine)."""

from __future__ import annotations

import torch

from kvcore.layout import BufferLayout, PoolLayout
from kvcore.dtypes import storage_dtype


def mha_layout(
    *,
    backend: str,
    page_size: int,
    dtype: torch.dtype,
    head_num: int,
    head_dim: int,
    v_head_dim: int,
    layer_num: int,
    sized_by: str = "tokens",
    prefix: str = "",
) -> PoolLayout:
    """The buffers of an :class:`MHATokenToKVPool`: K and V, one row per token plus a padding page."""
    store = storage_dtype(dtype)
    common = dict(layers=layer_num, dtype=store, sized_by=sized_by, pad_tokens=page_size)
    notes = ("fp8 stored as uint8",) if store != dtype else ()
    return PoolLayout(
        backend=backend,
        buffers=(
            BufferLayout(name=f"{prefix}k", row_shape=(head_num, head_dim), **common),
            BufferLayout(name=f"{prefix}v", row_shape=(head_num, v_head_dim), **common),
        ),
        notes=notes,
    )
