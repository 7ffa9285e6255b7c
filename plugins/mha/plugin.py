"""The MHA/GQA pool family as a kvcore plugin (entry point ``mha``), registered exactly like a vendor's."""

from __future__ import annotations

from kvcore.backend import BackendSpec, PoolRequest
from kvcore.hookspecs import hookimpl
from kvcore.layout import PoolLayout

BACKEND = "mha"


def layout(request: PoolRequest) -> PoolLayout:
    from kvcore_mha.layout import mha_layout

    return mha_layout(
        backend=BACKEND,
        page_size=request.page_size,
        dtype=request.kv_dtype,
        head_num=request.head_num,
        head_dim=request.head_dim,
        v_head_dim=request.v_head_dim,
        layer_num=request.layer_num,
    )


def create_pool(request: PoolRequest, layout: PoolLayout, sizes):
    from kvcore_mha.pool import MHATokenToKVPool

    return MHATokenToKVPool(
        size=sizes["tokens"],
        head_num=request.head_num,
        head_dim=request.head_dim,
        v_head_dim=request.v_head_dim,
        **request.pool_kwargs(),
    )


@hookimpl
def kvcore_register_backends():
    return [
        BackendSpec(
            name=BACKEND,
            attention=("mha",),
            layout=layout,
            create_pool=create_pool,
            description="MHA/GQA pool: per-layer K and V rows, bf16/fp16/fp32/fp8 (uint8 storage), Triton store and move",
        )
    ]
