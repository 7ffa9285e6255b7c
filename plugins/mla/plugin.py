"""The MLA pool family as a kvcore plugin (entry point ``mla``), registered exactly like a vendor's.

Serves ``model.attention: mla`` (DeepSeek-V2/V3 style multi-head latent attention).  The dimensions come from
the model section it declares, ``model.mla`` (:class:`~kvcore_mla.layout.MLADims`).  The latent row is shared by all heads,
so every tensor-parallel rank stores the same rows (``request.head_num`` does not enter the layout).
"""

from __future__ import annotations

from kvcore.backend import BackendSpec, PoolRequest
from kvcore.hookspecs import hookimpl
from kvcore.layout import PoolLayout
from kvcore_mla.layout import MLADims

#: the kvcore plugin API this plugin is written for (kvcore.hookspecs.API_VERSION); checked when it loads
KVCORE_API_VERSION = "4"

BACKEND = "mla"


def layout(request: PoolRequest) -> PoolLayout:
    from kvcore_mla.layout import mla_layout

    dims = request.section("mla")
    return mla_layout(
        backend=BACKEND,
        page_size=request.page_size,
        dtype=request.kv_dtype,
        kv_lora_rank=dims.kv_lora_rank,
        qk_rope_head_dim=dims.qk_rope_head_dim,
        layer_num=request.layer_num,
    )


def create_pool(request: PoolRequest, layout: PoolLayout, sizes):
    from kvcore_mla.pool import MLATokenToKVPool

    dims = request.section("mla")
    return MLATokenToKVPool(
        size=sizes["tokens"],
        kv_lora_rank=dims.kv_lora_rank,
        qk_rope_head_dim=dims.qk_rope_head_dim,
        **request.pool_kwargs(),
    )


@hookimpl
def kvcore_register_backends():
    return [
        BackendSpec(
            name=BACKEND,
            attention=("mla",),
            layout=layout,
            create_pool=create_pool,
            model_sections={"mla": MLADims},
            description="MLA pool: one latent row (kv_lora_rank + rope) per token and layer, bf16/fp16/fp32/fp8 "
            "(uint8 storage), one-launch Triton nope/rope store and gather, shared row move",
        )
    ]


@hookimpl
def kvcore_bench_cases():
    """``kvcore bench``'s cases of this family (:mod:`kvcore_mla.bench`, imported only when the bench runs)."""
    from kvcore_mla.bench import bench_cases

    return bench_cases()
