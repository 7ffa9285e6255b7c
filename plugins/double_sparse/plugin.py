"""The DoubleSparse pool as a kvcore plugin (entry point ``double_sparse``): selected by name
(``kv_cache.backend=double_sparse``, SGLang's ``--enable-double-sparsity``), never in place of MHA."""

from __future__ import annotations

import attrs

from kvcore.backend import BackendSpec, PoolRequest
from kvcore.config import key
from kvcore.kernels.dtypes import storage_dtype
from kvcore.errors import ConfigError
from kvcore.hookspecs import hookimpl
from kvcore.layout import BufferLayout, PoolLayout

#: the kvcore plugin API this plugin is written for (kvcore.hookspecs.API_VERSION); checked when it loads
KVCORE_API_VERSION = "4"

BACKEND = "double_sparse"


@attrs.define
class DoubleSparseOptions:
    """kv_cache.options of the double_sparse backend."""

    heavy_channel_num: int = key(32, doc="channels per head kept as each token's label (SGLang's "
                                 "--ds-heavy-channel-num); at most the head dim")  # fmt: skip


def layout(request: PoolRequest) -> PoolLayout:
    """Buffers ``k``, ``v`` (``[head_num, head_dim]``) and ``label`` (``[head_num, heavy_channel_num]``) per token.

    :raises ConfigError: for a heavy channel count outside ``1 .. head_dim``, or values of another width.
    """
    heavy = request.options.heavy_channel_num
    if not 0 < heavy <= request.head_dim:
        raise ConfigError(f"kv_cache.options.heavy_channel_num={heavy} must be in 1..{request.head_dim} (the head dim "
                          f"of model {request.model_name}); e.g. kv_cache.options.heavy_channel_num={min(32, request.head_dim)}")  # fmt: skip
    if request.v_head_dim != request.head_dim:
        raise ConfigError(f"backend {BACKEND} stores values as wide as keys: model.v_head_dim={request.v_head_dim} must "
                          f"equal model.head_dim={request.head_dim}")  # fmt: skip
    store = storage_dtype(request.kv_dtype)
    common = dict(layers=request.layer_num, dtype=store, pad_tokens=request.page_size)
    return PoolLayout(
        backend=BACKEND,
        buffers=[BufferLayout(name="k", row_shape=(request.head_num, request.head_dim), **common),
                 BufferLayout(name="v", row_shape=(request.head_num, request.head_dim), **common),
                 BufferLayout(name="label", row_shape=(request.head_num, heavy), **common)],  # fmt: skip
        notes=[f"labels: {heavy} heavy channels per head", *(["fp8 stored as uint8"] if store != request.kv_dtype else [])],
    )


def create_pool(request: PoolRequest, layout: PoolLayout, sizes):
    from kvcore_double_sparse.pool import DoubleSparseTokenToKVPool

    return DoubleSparseTokenToKVPool(size=sizes["tokens"], head_num=request.head_num, head_dim=request.head_dim,
                                     heavy_channel_num=request.options.heavy_channel_num, **request.pool_kwargs())  # fmt: skip


@hookimpl
def kvcore_register_backends():
    return [BackendSpec(name=BACKEND, attention=("mha",), layout=layout, create_pool=create_pool, priority=-10,
                        options_schema=DoubleSparseOptions,
                        description="DoubleSparse: MHA keys and values plus heavy-channel labels per token, one "
                        "launch; select with kv_cache.backend=double_sparse")]  # fmt: skip
