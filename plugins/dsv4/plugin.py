"""DeepSeek-V4's pool as a kvcore plugin (entry point ``dsv4``): the backend of models whose attention is
``deepseek_v4`` (``DeepseekV4ForCausalLM``), paired with the sliding-window family's allocator.

Model section: ``model.deepseek_v4`` (:class:`~kvcore_dsv4.layout.DeepSeekV4Dims`).  Options:
``kv_cache.options.compress_state_dtype`` and ``kv_cache.options.host_to_device_ratio`` (HiSparse, above 1;
:class:`~kvcore_dsv4.layout.DeepSeekV4Options`).  The cache is SGLang's
fp8 "V4" pages whatever the model's dtype, so the backend serves ``kv_cache.dtype=float8_e4m3fn``; its pages are
128, 256 or 512 tokens (:data:`PAGE_SIZES`; SGLang runs 256).
"""

from __future__ import annotations

import torch

from kvcore.backend import BackendSpec, PoolRequest
from kvcore.hookspecs import hookimpl
from kvcore.layout import PoolLayout
from kvcore_dsv4.layout import ATTENTION, BACKEND, DeepSeekV4Dims, DeepSeekV4Options

#: the kvcore plugin API this plugin is written for (kvcore.hookspecs.API_VERSION); checked when it loads
KVCORE_API_VERSION = "4"
#: pages of whole ratio-128 blocks (SGLang runs 256); selection names them for any other kv_cache.page_size
PAGE_SIZES = (128, 256, 512)


def layout(request: PoolRequest) -> PoolLayout:
    from kvcore_dsv4.layout import dsv4_layout

    return dsv4_layout(request)


def create_pool(request: PoolRequest, layout: PoolLayout, sizes):
    """The configurator's ``DeepSeekV4TokenToKVPool`` call, from the plan's sizes: ``c4_size = tokens // 4``,
    ``c128_size = tokens // 128``, ratio-4 states per window page, ratio-128 states per request slot.  With HiSparse
    (``kv_cache.options.host_to_device_ratio`` = h > 1) ``enable_hisparse=True`` and ``c4_size`` the whole device
    pages of ``tokens // (4 h)`` (SGLang passes ``tokens // (4 h)``; its device allocator takes whole pages of it)."""
    from kvcore_dsv4.layout import host_to_device_ratio, ring_size, state_dtype
    from kvcore_dsv4.pool import DeepSeekV4TokenToKVPool

    dims: DeepSeekV4Dims = request.section("deepseek_v4")
    full, swa, page = sizes["tokens"], sizes["swa_tokens"], request.page_size
    drafting = request.mode.num_draft_tokens > 0
    slots = sizes.get("requests", 1)  # the ratio-128 rings' request slots (none without ratio-128 layers)
    states = state_dtype(request)
    hisparse = host_to_device_ratio(request)
    c4_size = full // 4 if hisparse == 1 else full // (page * hisparse) * (page // 4)
    return DeepSeekV4TokenToKVPool(
        max_num_reqs=slots - 1, num_req_slots=slots, swa_size=swa, c4_size=c4_size, c128_size=full // 128,
        c4_state_pool_size=swa // page * ring_size(4, drafting), c128_state_pool_size=slots * ring_size(128, drafting),
        page_size=page, swa_page_size=page, sliding_window=dims.sliding_window, dtype=request.kv_dtype,
        c4_state_dtype=states, c128_state_dtype=states, qk_nope_head_dim=dims.qk_nope_head_dim,
        qk_rope_head_dim=dims.qk_rope_head_dim, indexer_head_dim=dims.index_head_dim, layer_num=request.layer_num,
        device=request.device, enable_memory_saver=False, compression_ratios=dims.compress_ratios,
        start_layer=request.start_layer, end_layer=request.end_layer + 1,
        online_mtp_max_draft_tokens=request.mode.num_draft_tokens, enable_hisparse=hisparse > 1, kernels=request.kernels,
    )  # fmt: skip


@hookimpl
def kvcore_register_backends():
    return [BackendSpec(name=BACKEND, attention=(ATTENTION,), layout=layout, create_pool=create_pool,
                        kv_dtypes=(torch.float8_e4m3fn,), page_sizes=PAGE_SIZES,
                        model_sections={"deepseek_v4": DeepSeekV4Dims},
                        options_schema=DeepSeekV4Options,
                        description="DeepSeek-V4 compressed attention: every layer's window of fp8 latents (V4 pages), "
                        "ratio-4 and ratio-128 layers' compressed latents, the ratio-4 indexer keys and the "
                        "compressors' states")]  # fmt: skip


@hookimpl
def kvcore_choose_allocator(backend, request, pool, sizes):
    """SGLang's pairing: full locations from one side, window slots from the other, the map registered with the
    pool (:class:`kvcore_swa.SWATokenToKVPoolAllocator`); with HiSparse, wrapped in
    :class:`~kvcore_dsv4.hisparse.DeepSeekV4HiSparseTokenToKVPoolAllocator` (the ratio-4 latents' device slots)."""
    if backend.name != BACKEND:
        return None
    from kvcore_dsv4.layout import host_to_device_ratio
    from kvcore_swa import SWATokenToKVPoolAllocator

    allocator = SWATokenToKVPoolAllocator.for_plan(request, pool, sizes)
    if host_to_device_ratio(request) > 1:
        from kvcore_dsv4.hisparse import DeepSeekV4HiSparseTokenToKVPoolAllocator

        allocator = DeepSeekV4HiSparseTokenToKVPoolAllocator(allocator)
    return allocator


@hookimpl
def kvcore_bench_cases():
    """``kvcore bench``'s cases of this family (:mod:`kvcore_dsv4.bench`, imported only when the bench runs)."""
    from kvcore_dsv4.bench import bench_cases

    return bench_cases()
