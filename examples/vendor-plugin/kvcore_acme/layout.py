"""The acme backend's buffers, declared without allocating anything (kvcore's planner sizes pools from this on
any machine, and the conformance kit checks that the pool allocates exactly these bytes)."""

from __future__ import annotations

import torch

from kvcore.backend import PoolRequest
from kvcore.errors import ConfigError
from kvcore.layout import BufferLayout, PoolLayout

#: cache dtypes the acme kernels store (no fp8: the example keeps to plain casts)
ACME_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def acme_layout(backend: str, request: PoolRequest) -> PoolLayout:
    """One buffer ``kv``: a row per page, ``[2, page_size, heads, head_dim]`` (K then V), plus the padding page.

    :raises ConfigError: when values are narrower or wider than keys (K and V share the page's rows).
    """
    if request.v_head_dim != request.head_dim:
        raise ConfigError(
            f"backend {backend!r} interleaves K and V in one page, so model.v_head_dim ({request.v_head_dim}) must "
            f"equal model.head_dim ({request.head_dim}); use kv_cache.backend=mha for this model"
        )
    page = request.page_size
    return PoolLayout(
        backend=backend,
        buffers=[
            BufferLayout(
                name="kv", layers=request.layer_num, row_shape=(2, page, request.head_num, request.head_dim),
                dtype=request.kv_dtype, tokens_per_row=page, pad_tokens=page,
            )  # fmt: skip
        ],
        notes=["K and V interleaved per page"],
    )
