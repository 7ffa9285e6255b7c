"""The core's default answers to the ``firstresult`` hooks, registered ``trylast`` so any plugin overrides them."""

from __future__ import annotations

from kvcore.hookspecs import hookimpl


@hookimpl(trylast=True)
def kvcore_buffer_layout(backend, request):
    return backend.layout(request)


@hookimpl(trylast=True)
def kvcore_create_pool(backend, request, layout, sizes):
    return backend.create_pool(request, layout, sizes)


@hookimpl(trylast=True)
def kvcore_create_req_to_token_pool(request, size, max_context_len):
    from kvcore.pools import DecodeReqToTokenPool, ReqToTokenPool

    if request.mode.disaggregation == "decode":
        return DecodeReqToTokenPool(size=size, max_context_len=max_context_len, device=request.device,
                                    enable_memory_saver=False, pre_alloc_size=request.mode.pre_alloc_size)  # fmt: skip
    return ReqToTokenPool(size=size, max_context_len=max_context_len, device=request.device, enable_memory_saver=False)


@hookimpl(trylast=True)
def kvcore_choose_allocator(request, pool, sizes):
    from kvcore.allocators import PagedTokenToKVPoolAllocator, TokenToKVPoolAllocator

    size = sizes["tokens"]
    if request.page_size == 1:
        return TokenToKVPoolAllocator(
            size, dtype=request.kv_dtype, device=request.device, kvcache=pool, need_sort=request.mode.need_sort, kernels=request.kernels
        )
    return PagedTokenToKVPoolAllocator(
        size,
        page_size=request.page_size,
        dtype=request.kv_dtype,
        device=request.device,
        kvcache=pool,
        need_sort=request.mode.need_sort,
        kernels=request.kernels,
    )
