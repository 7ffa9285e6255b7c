"""The MHA/GQA pool family as a kvcore plugin (entry point ``mha``), registered exactly like a vendor's."""

from __future__ import annotations

import attrs

from kvcore.backend import BackendSpec, PoolRequest
from kvcore.hookspecs import hookimpl
from kvcore.layout import PoolLayout

#: the kvcore plugin API this plugin is written for (kvcore.hookspecs.API_VERSION); checked when it loads
KVCORE_API_VERSION = "4"

BACKEND = "mha"
NOOP = "noop"


def layout(request: PoolRequest) -> PoolLayout:
    from kvcore_mha.layout import mha_layout, page_major_layout

    build = page_major_layout if request.layout == "page_major" else mha_layout
    return build(
        backend=BACKEND,
        page_size=request.page_size,
        dtype=request.kv_dtype,
        head_num=request.head_num,
        head_dim=request.head_dim,
        v_head_dim=request.v_head_dim,
        layer_num=request.layer_num,
    )


def create_pool(request: PoolRequest, layout: PoolLayout, sizes):
    from kvcore_mha.page_major import PageMajorMHATokenToKVPool
    from kvcore_mha.pool import MHATokenToKVPool

    return (PageMajorMHATokenToKVPool if request.layout == "page_major" else MHATokenToKVPool)(
        size=sizes["tokens"],
        head_num=request.head_num,
        head_dim=request.head_dim,
        v_head_dim=request.v_head_dim,
        **request.pool_kwargs(),
    )


def noop_layout(request: PoolRequest) -> PoolLayout:
    """A placeholder page of K and V per layer (fixed rows: no bytes per token), whatever the size."""
    from kvcore_mha.layout import mha_layout

    full = mha_layout(backend=NOOP, page_size=request.page_size, dtype=request.kv_dtype, head_num=request.head_num,
                      head_dim=request.head_dim, v_head_dim=request.v_head_dim, layer_num=request.layer_num)  # fmt: skip
    placeholders = [attrs.evolve(b, fixed_rows=request.page_size) for b in full.buffers]
    return attrs.evolve(full, buffers=placeholders, notes=[*full.notes, "stores nothing: prefill-only serving"])


def create_noop_pool(request: PoolRequest, layout: PoolLayout, sizes):
    from kvcore_mha.noop import NoOpMHATokenToKVPool

    return NoOpMHATokenToKVPool(size=sizes["tokens"], head_num=request.head_num, head_dim=request.head_dim,
                                v_head_dim=request.v_head_dim, **request.pool_kwargs())  # fmt: skip


@hookimpl
def kvcore_register_backends():
    return [
        BackendSpec(
            name=NOOP,
            attention=("mha",),
            layout=noop_layout,
            create_pool=create_noop_pool,
            priority=-10,
            description="no-op pool for prefill-only serving: token capacity for admission, no storage (placeholders); "
            "select with kv_cache.backend=noop",
        ),
        BackendSpec(
            name=BACKEND,
            attention=("mha",),
            layout=layout,
            create_pool=create_pool,
            layouts=("token_major", "page_major"),
            description="MHA/GQA pool: per-layer K and V rows, bf16/fp16/fp32/fp8 (uint8 storage), Triton store and move; "
            "kv_cache.layout=page_major keeps a page of all layers contiguous",
        )
    ]


@hookimpl
def kvcore_bench_cases():
    """``kvcore bench``'s cases of this family (:mod:`kvcore_mha.bench`, imported only when the bench runs)."""
    from kvcore_mha.bench import bench_cases

    return bench_cases()
