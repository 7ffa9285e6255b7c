"""The MHA pool's declared buffers; importing this needs no kernels (the planner uses it on any machine)."""

from __future__ import annotations

import torch

from kvcore.layout import BufferLayout, PoolLayout
from kvcore.kernels.dtypes import storage_dtype


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


def page_major_layout(
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
    """The buffer of a :class:`~kvcore_mha.page_major.PageMajorMHATokenToKVPool`: one row per page (all layers'
    K and V of ``page_size`` tokens), plus the padding page.

    :raises ConfigError: when values are not as wide as keys (they share the page's rows).
    """
    from kvcore.errors import ConfigError

    if v_head_dim != head_dim:
        raise ConfigError(f"kv_cache.layout=page_major keeps K and V rows alike: the value head dim {v_head_dim} != the "
                          f"key head dim {head_dim}; use kv_cache.layout=token_major for this model")  # fmt: skip
    store = storage_dtype(dtype)
    buffer = BufferLayout(name=f"{prefix}kv", layers=1, row_shape=(layer_num, 2, page_size, head_num, head_dim),
                          dtype=store, sized_by=sized_by, tokens_per_row=page_size, pad_tokens=page_size)  # fmt: skip
    notes = ["page-major: a page of all layers contiguous", *(["fp8 stored as uint8"] if store != dtype else [])]
    return PoolLayout(backend=backend, buffers=(buffer,), notes=notes)
