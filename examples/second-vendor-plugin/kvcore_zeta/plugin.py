"""The zeta backend: kvcore_mha's public layout and pool, declared for the zeta vendor only."""

from __future__ import annotations

from kvcore.backend import BackendSpec
from kvcore.hookspecs import hookimpl

#: the kvcore plugin API this plugin is written for (kvcore.hookspecs.API_VERSION); checked when it loads
KVCORE_API_VERSION = "4"

BACKEND = "zeta"


def layout(request):
    from kvcore_mha.layout import mha_layout

    return mha_layout(backend=BACKEND, page_size=request.page_size, dtype=request.kv_dtype, head_num=request.head_num,
                      head_dim=request.head_dim, v_head_dim=request.v_head_dim, layer_num=request.layer_num)  # fmt: skip


def create_pool(request, layout, sizes):
    from kvcore_mha import MHATokenToKVPool

    return MHATokenToKVPool(size=sizes["tokens"], head_num=request.head_num, head_dim=request.head_dim,
                            v_head_dim=request.v_head_dim, **request.pool_kwargs())  # fmt: skip


@hookimpl
def kvcore_register_backends():
    return [BackendSpec(name=BACKEND, attention=("mha",), layout=layout, create_pool=create_pool, vendors=("zeta",),
                        description="kvcore's MHA pool for zeta hardware")]  # fmt: skip
