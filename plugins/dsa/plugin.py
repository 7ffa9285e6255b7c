"""The DSA pool family (DeepSeek sparse attention, DeepSeek-V3.2) as a kvcore plugin (entry point ``dsa``).

Model sections: ``model.mla`` (:class:`~kvcore_mla.layout.MLADims`, the latent row) and ``model.dsa``
(:class:`~kvcore_dsa.layout.DSADims`, the indexer).  Options: ``kv_cache.options.index_dtype``
(:class:`~kvcore_dsa.layout.DSAOptions`).

The indexer's page is 64 tokens, so the pool's page size must be 64: the backend declares
``page_sizes=(64,)``, so selection says so (``page size 16 not in [64] (set kv_cache.page_size=64)``) and
``kvcore check`` probes that page size only; the layout function refuses other sizes too, for direct callers.
"""

from __future__ import annotations

import attrs

from kvcore.backend import BackendSpec, PoolRequest
from kvcore.errors import ConfigError
from kvcore.hookspecs import hookimpl
from kvcore.layout import PoolLayout
from kvcore_dsa.layout import DSADims, DSAOptions
from kvcore_mla.layout import MLADims

#: the kvcore plugin API this plugin is written for (kvcore.hookspecs.API_VERSION); checked when it loads
KVCORE_API_VERSION = "4"

BACKEND = "dsa"


def _ratio(request: PoolRequest) -> int:
    """``kv_cache.options.host_to_device_ratio``: HiSparse above 1."""
    return request.options.host_to_device_ratio


def _dims(request: PoolRequest) -> dict:
    mla, dsa = request.section("mla"), request.section("dsa")
    return dict(
        kv_lora_rank=mla.kv_lora_rank,
        qk_rope_head_dim=mla.qk_rope_head_dim,
        index_head_dim=dsa.index_head_dim,
        index_dtype=request.options.index_dtype,
    )


def layout(request: PoolRequest) -> PoolLayout:
    """The DSA buffers of this rank's layers; with ``parallel.cp_size`` > 1, of its share of them and the scratch
    layer (:mod:`kvcore_dsa.layer_split`)."""
    from kvcore_dsa.layout import dsa_layout

    if request.cp_size <= 1:
        return dsa_layout(backend=BACKEND, page_size=request.page_size, dtype=request.kv_dtype,
                          layer_num=request.layer_num, host_to_device_ratio=_ratio(request), **_dims(request))  # fmt: skip
    if _ratio(request) > 1:
        raise ConfigError(f"kv_cache.options.host_to_device_ratio={_ratio(request)} (HiSparse) with parallel.cp_size="
                          f"{request.cp_size} (layer split): kvcore builds one or the other; set one of them to 1")  # fmt: skip
    from kvcore_dsa.layer_split import layer_shard_range, stacked_layers

    stacked = stacked_layers(request.cp_rank, request.cp_size, request.layer_num)
    split = dsa_layout(backend=BACKEND, page_size=request.page_size, dtype=request.kv_dtype, layer_num=stacked,
                       **_dims(request))  # fmt: skip
    start, end = layer_shard_range(request.cp_rank, request.cp_size, request.layer_num)
    note = (f"layer split over parallel.cp_size={request.cp_size} ranks: this rank (cp rank {request.cp_rank}) stores "
            f"layers {request.start_layer + start}..{request.start_layer + end - 1} of {request.layer_num} and one "
            f"scratch layer it receives the others into")  # fmt: skip
    return attrs.evolve(split, notes=(*split.notes, note))


def create_pool(request: PoolRequest, layout: PoolLayout, sizes):
    """A DSATokenToKVPool; HiSparse's with ``host_to_device_ratio`` > 1, the layer split's with ``cp_size`` > 1."""
    if _ratio(request) > 1:
        from kvcore_dsa.hisparse import HiSparseDSATokenToKVPool as pool_class

        extra = dict(host_to_device_ratio=_ratio(request))
    elif request.cp_size > 1:
        from kvcore_dsa.layer_split import LayerSplitDSATokenToKVPool as pool_class

        extra = dict(layer_shard_rank=request.cp_rank, layer_shard_size=request.cp_size)
    else:
        from kvcore_dsa.pool import DSATokenToKVPool as pool_class

        extra = {}
    return pool_class(size=sizes["tokens"], **_dims(request), **request.pool_kwargs(), **extra)


@hookimpl
def kvcore_register_backends():
    return [
        BackendSpec(
            name=BACKEND,
            attention=("dsa",),
            layout=layout,
            create_pool=create_pool,
            page_sizes=(64,),  # the indexer's page; layout() also refuses others, saying why
            model_sections={"mla": MLADims, "dsa": DSADims},
            options_schema=DSAOptions,
            description=(
                "DeepSeek sparse attention: MLA latent rows (fp8: 656-byte rows with per-128 scales and bf16 rope) "
                "plus the indexer's key pages; page size 64"
            ),
        )
    ]


@hookimpl
def kvcore_choose_allocator(backend, request, pool, sizes):
    """HiSparse's allocator (logical tokens and device slots) for a HiSparse pool; None (the core's choice) else."""
    if backend.name != BACKEND or _ratio(request) <= 1:
        return None
    from kvcore_dsa.hisparse import HiSparseTokenToKVPoolAllocator

    return HiSparseTokenToKVPoolAllocator(sizes["tokens"], request.page_size, request.kv_dtype, request.device, pool,
                                          need_sort=request.mode.need_sort, host_to_device_ratio=_ratio(request),
                                          kernels=request.kernels)  # fmt: skip


@hookimpl
def kvcore_bench_cases():
    """``kvcore bench``'s cases of this family (:mod:`kvcore_dsa.bench`, imported only when the bench runs)."""
    from kvcore_dsa.bench import bench_cases

    return bench_cases()
