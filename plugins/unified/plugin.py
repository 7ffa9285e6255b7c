"""The unified memory as a kvcore plugin (entry point ``unified``): with ``memory.unified=true`` it builds a hybrid
model's pools over one shared memory (:mod:`kvcore_unified.mamba`, :mod:`kvcore_unified.swa`) in place of the
family's split pools, answering the pool and allocator hooks before the family does.  The request table is the
family's own (it takes the state pool it is given).

It answers only for the target model's pools (a draft's are refused before, by ``kvcore.api.check_buildable``) and
only for the hybrid backends; the planner refuses ``memory.unified=true`` for any other with the key named.
"""

from __future__ import annotations

import weakref

from kvcore.hookspecs import hookimpl

#: the kvcore plugin API this plugin is written for (kvcore.hookspecs.API_VERSION); checked when it loads
KVCORE_API_VERSION = "4"

#: a unified pool built here -> how its allocator is made
_ALLOCATORS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _applies(request) -> bool:
    return request.mode.unified_memory and not request.mode.is_draft_worker


@hookimpl(tryfirst=True)
def kvcore_create_pool(backend, request, layout, sizes):
    """The hybrid model's KV pool over one unified memory of the split pools' bytes at ``sizes``."""
    if not _applies(request):
        return None
    from kvcore.planning.unified import unified_figures

    budget = unified_figures(layout, request.page_size, sizes).budget_bytes
    if backend.name in ("mamba", "mamba_mla"):
        from kvcore_mamba.layout import draft_tokens, rank_layers, rank_state_params
        from kvcore_unified.mamba import unified_hybrid_linear_kv_pool, unified_token_allocator

        full, _ = rank_layers(request)
        mla = request.sections.get("mla")
        params = rank_state_params(request)
        pool = unified_hybrid_linear_kv_pool(
            budget_bytes=budget, device=request.device, kv_cache_dtype=request.kv_dtype, head_num=request.head_num,
            head_dim=request.head_dim, v_head_dim=request.v_head_dim, page_size=request.page_size,
            start_layer=request.start_layer, end_layer=request.end_layer, full_attention_layer_ids=full,
            mamba_layer_ids=params.layers, cache_params=params, use_mla=mla is not None,
            kv_lora_rank=mla and mla.kv_lora_rank, qk_rope_head_dim=mla and mla.qk_rope_head_dim,
            spec_state_size=sizes.get("running_requests", 0), speculative_num_draft_tokens=draft_tokens(request) or None,
            kernels=request.kernels,
        )  # fmt: skip
        _ALLOCATORS[pool] = lambda: unified_token_allocator(pool, need_sort=request.mode.need_sort,
                                                            kernels=request.kernels)  # fmt: skip
        return pool
    if backend.name == "swa":
        from kvcore_swa.layout import swa_shape
        from kvcore_unified.swa import UnifiedSWATokenToKVPoolAllocator, unified_swa_kv_pool

        shape = swa_shape(request)
        pool = unified_swa_kv_pool(
            "memory.unified=true", device=request.device, kv_cache_dtype=request.kv_dtype,
            page_size=request.page_size, head_num=request.head_num, head_dim=request.head_dim,
            swa_head_num=shape.swa_head_num, swa_head_dim=shape.swa_head_dim, v_head_dim=request.v_head_dim,
            swa_v_head_dim=shape.swa_v_head_dim, full_attention_layer_ids=shape.full_attention_layer_ids,
            swa_attention_layer_ids=shape.swa_attention_layer_ids, start_layer=request.start_layer,
            end_layer=request.end_layer, kernels=request.kernels, total_bytes=budget,
        )  # fmt: skip
        _ALLOCATORS[pool] = lambda: UnifiedSWATokenToKVPoolAllocator(pool, need_sort=request.mode.need_sort,
                                                                     kernels=request.kernels)  # fmt: skip
        return pool
    return None


@hookimpl(tryfirst=True)
def kvcore_choose_allocator(backend, request, pool, sizes):
    """The allocator of a pool :func:`kvcore_create_pool` built (None for any other pool)."""
    make = _ALLOCATORS.get(pool)
    return None if make is None else make()
