"""kvcore hooks of the acme backend (entry point ``acme`` in pyproject.toml).

kvcore calls them in this order: ``kvcore_register_backends`` when it loads the plugin; then, for a config
with ``hardware.vendor=acme`` and an MHA/GQA model, selection picks ``acme`` over the generic ``mha`` backend
(a backend naming the requested vendor is more specific); ``BackendSpec.layout`` (through the core's
``kvcore_buffer_layout``) sizes the pools; ``BackendSpec.create_pool`` builds the pool; and
:func:`kvcore_choose_allocator` below builds acme's own allocator.
"""

from __future__ import annotations

from kvcore.backend import BackendSpec, PoolRequest
from kvcore.hookspecs import hookimpl
from kvcore.layout import PoolLayout
from kvcore_acme.layout import ACME_DTYPES, acme_layout

#: the kvcore plugin API this plugin is written for (kvcore.hookspecs.API_VERSION); checked when it loads
KVCORE_API_VERSION = "4"

BACKEND = "acme"
VENDOR = "acme"


def layout(request: PoolRequest) -> PoolLayout:
    return acme_layout(BACKEND, request)


def create_pool(request: PoolRequest, layout: PoolLayout, sizes):
    from kvcore_acme.pool import AcmeKVPool  # imports Triton: only when a pool is built

    return AcmeKVPool(size=sizes["tokens"], head_num=request.head_num, head_dim=request.head_dim,
                      **request.pool_kwargs())  # fmt: skip


@hookimpl
def kvcore_register_backends():
    return [
        BackendSpec(
            name=BACKEND,
            attention=("mha",),
            layout=layout,
            create_pool=create_pool,
            kv_dtypes=ACME_DTYPES,
            devices=("cuda", "cpu"),
            vendors=(VENDOR,),
            description="acme paged pool: K and V interleaved per page, most-recently-freed pages first",
        )
    ]


@hookimpl
def kvcore_choose_allocator(backend, request, pool, sizes):
    """acme's allocator for acme's pools; None (the next plugin's or the core's choice) for any other backend."""
    if backend.name != BACKEND:
        return None
    from kvcore_acme.allocator import AcmePageAllocator

    return AcmePageAllocator(sizes["tokens"], request.page_size, request.kv_dtype, request.device, kvcache=pool)
