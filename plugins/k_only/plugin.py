"""The K-only pool as a kvcore plugin (entry point ``k_only``): selected by name (``kv_cache.backend=k_only``),
never in place of the MHA pool (priority -10)."""

from __future__ import annotations

from kvcore.backend import BackendSpec, PoolRequest
from kvcore.kernels.dtypes import storage_dtype
from kvcore.hookspecs import hookimpl
from kvcore.layout import BufferLayout, PoolLayout

#: the kvcore plugin API this plugin is written for (kvcore.hookspecs.API_VERSION); checked when it loads
KVCORE_API_VERSION = "4"

BACKEND = "k_only"


def layout(request: PoolRequest) -> PoolLayout:
    """One buffer ``k``: a row of ``[head_num, head_dim]`` per token plus the padding page."""
    store = storage_dtype(request.kv_dtype)
    keys = BufferLayout(name="k", layers=request.layer_num, row_shape=(request.head_num, request.head_dim),
                        dtype=store, pad_tokens=request.page_size)  # fmt: skip
    return PoolLayout(backend=BACKEND, buffers=[keys],
                      notes=["keys only", *(["fp8 stored as uint8"] if store != request.kv_dtype else [])])  # fmt: skip


def create_pool(request: PoolRequest, layout: PoolLayout, sizes):
    from kvcore_k_only.pool import MHATokenToKOnlyPool

    return MHATokenToKOnlyPool(size=sizes["tokens"], head_num=request.head_num, head_dim=request.head_dim,
                               **request.pool_kwargs())  # fmt: skip


@hookimpl
def kvcore_register_backends():
    return [BackendSpec(name=BACKEND, attention=("mha",), layout=layout, create_pool=create_pool, priority=-10,
                        description="keys without values (index layers that never read V): half the bytes of mha; "
                        "select with kv_cache.backend=k_only")]  # fmt: skip
