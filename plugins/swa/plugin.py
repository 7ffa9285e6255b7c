"""The hybrid sliding-window family as a kvcore plugin (entry point ``swa``): its backend, and the allocator
hook that pairs its pools with a :class:`~kvcore_swa.allocator.SWATokenToKVPoolAllocator`."""

from __future__ import annotations

from kvcore.backend import BackendSpec, PoolRequest
from kvcore.hookspecs import hookimpl
from kvcore.layout import PoolLayout
from kvcore_swa.layout import SWADims

#: the kvcore plugin API this plugin is written for (kvcore.hookspecs.API_VERSION); checked when it loads
KVCORE_API_VERSION = "4"

BACKEND = "swa"


def layout(request: PoolRequest) -> PoolLayout:
    from kvcore_swa.layout import swa_layout

    return swa_layout(backend=BACKEND, request=request)


def create_pool(request: PoolRequest, layout: PoolLayout, sizes):
    from kvcore_mha import MHATokenToKVPool, PageMajorMHATokenToKVPool
    from kvcore_swa.layout import swa_shape
    from kvcore_swa.pool import SWAKVPool

    shape = swa_shape(request)
    kwargs = request.pool_kwargs()
    kwargs.pop("layer_num")
    return SWAKVPool(
        size=sizes["tokens"],
        size_swa=sizes.get("swa_tokens", 0),
        head_num=request.head_num,
        head_dim=request.head_dim,
        v_head_dim=request.v_head_dim,
        swa_attention_layer_ids=shape.swa_attention_layer_ids,
        full_attention_layer_ids=shape.full_attention_layer_ids,
        swa_head_num=shape.swa_head_num,
        swa_head_dim=shape.swa_head_dim,
        swa_v_head_dim=shape.swa_v_head_dim,
        token_to_kv_pool_class=PageMajorMHATokenToKVPool if request.layout == "page_major" else MHATokenToKVPool,
        **kwargs,
    )


@hookimpl
def kvcore_register_backends():
    return [
        BackendSpec(
            name=BACKEND,
            attention=("swa",),
            layout=layout,
            create_pool=create_pool,
            model_sections={"swa": SWADims},
            layouts=("token_major", "page_major"),
            description="hybrid sliding-window pool: full-attention and window layers in two MHA pools, "
            "window writes translated inside the store",
        )
    ]


@hookimpl
def kvcore_choose_allocator(backend, request, pool, sizes):
    """The paired allocator for this family's pools that have window layers; None (the core's choice) else."""
    if backend.name != BACKEND or "swa_tokens" not in sizes:
        return None
    from kvcore_swa.allocator import SWATokenToKVPoolAllocator

    return SWATokenToKVPoolAllocator.for_plan(request, pool, sizes)


@hookimpl
def kvcore_bench_cases():
    """``kvcore bench``'s cases of this family (:mod:`kvcore_swa.bench`, imported only when the bench runs)."""
    from kvcore_swa.bench import bench_cases

    return bench_cases()
