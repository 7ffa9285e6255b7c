"""The block-scaled family as a kvcore plugin (entry point ``fp4``): MHA and MLA pools of
``kv_cache.dtype=fp4_e2m1``, ``nvfp4`` or ``mxfp8``."""

from __future__ import annotations

from kvcore.backend import BackendSpec, PoolRequest
from kvcore.hookspecs import hookimpl
from kvcore.layout import PoolLayout

#: the kvcore plugin API this plugin is written for (kvcore.hookspecs.API_VERSION); checked when it loads
KVCORE_API_VERSION = "4"

BACKEND = "fp4"
MLA_BACKEND = "fp4_mla"
FORMATS = ("fp4_e2m1", "nvfp4", "mxfp8")


def layout(request: PoolRequest) -> PoolLayout:
    from kvcore_fp4.layout import fp4_mha_layout

    return fp4_mha_layout(backend=BACKEND, request=request)


def create_pool(request: PoolRequest, layout: PoolLayout, sizes):
    from kvcore_fp4.pool import MHATokenToKVPoolFP4

    kwargs = request.pool_kwargs()
    kwargs["dtype"] = request.model_dtype  # what reads return; the codes are bytes
    return MHATokenToKVPoolFP4(size=sizes["tokens"], head_num=request.head_num, head_dim=request.head_dim,
                               v_head_dim=request.v_head_dim, kv_format=request.kv_format, **kwargs)  # fmt: skip


def mla_layout(request: PoolRequest) -> PoolLayout:
    from kvcore_fp4.layout import fp4_mla_layout

    return fp4_mla_layout(backend=MLA_BACKEND, request=request)


def create_mla_pool(request: PoolRequest, layout: PoolLayout, sizes):
    from kvcore_fp4.pool import MLATokenToKVPoolFP4

    mla = request.section("mla")
    kwargs = request.pool_kwargs()
    kwargs["dtype"] = request.model_dtype
    return MLATokenToKVPoolFP4(size=sizes["tokens"], kv_lora_rank=mla.kv_lora_rank, qk_rope_head_dim=mla.qk_rope_head_dim,
                               kv_format=request.kv_format, **kwargs)  # fmt: skip


@hookimpl
def kvcore_register_backends():
    from kvcore_mla.layout import MLADims

    return [
        BackendSpec(
            name=BACKEND,
            attention=("mha",),
            layout=layout,
            create_pool=create_pool,
            kv_dtypes=(),
            kv_formats=FORMATS,
            description="block-scaled MHA pool: fp4_e2m1 / nvfp4 / mxfp8 codes and scales per row, quantized in the "
            "store, dequantized by location (Triton, one launch each)",
        ),
        BackendSpec(
            name=MLA_BACKEND,
            attention=("mla",),
            layout=mla_layout,
            create_pool=create_mla_pool,
            kv_dtypes=(),
            kv_formats=FORMATS,
            model_sections={"mla": MLADims},
            description="block-scaled MLA pool: latent rows' nope and rope quantized apart, read by location",
        ),
    ]


@hookimpl
def kvcore_bench_cases():
    """``kvcore bench``'s cases of this family (:mod:`kvcore_fp4.bench`, imported only when the bench runs)."""
    from kvcore_fp4.bench import bench_cases

    return bench_cases()
