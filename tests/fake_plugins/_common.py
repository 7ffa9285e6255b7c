"""Helpers the fake plugins share: a backend record with a plain K/V layout."""

from __future__ import annotations

from kvcore.backend import BackendSpec
from kvcore.layout import BufferLayout, PoolLayout


def kv_layout(name: str, request) -> PoolLayout:
    common = dict(layers=request.layer_num, dtype=request.kv_dtype, pad_tokens=request.page_size)
    return PoolLayout(
        backend=name,
        buffers=(
            BufferLayout(name="k", row_shape=(request.head_num, request.head_dim), **common),
            BufferLayout(name="v", row_shape=(request.head_num, request.v_head_dim), **common),
        ),
    )


def mha_pool(request, layout, sizes):
    from kvcore_mha.pool import MHATokenToKVPool

    return MHATokenToKVPool(
        size=sizes["tokens"],
        head_num=request.head_num,
        head_dim=request.head_dim,
        v_head_dim=request.v_head_dim,
        **request.pool_kwargs(),
    )


def spec(name: str, **kwargs) -> BackendSpec:
    kwargs.setdefault("attention", ("mha",))
    return BackendSpec(
        name=name,
        layout=lambda request: kv_layout(name, request),
        create_pool=mha_pool,
        **kwargs,
    )
