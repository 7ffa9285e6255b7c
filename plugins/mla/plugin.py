"""The MLA pool family as a kvcore plugin (entry point ``mla``), registered exactly like a vendor's.

Serves ``model.attention: mla`` (DeepSeek-V2/V3 style multi-head latent attention).  The dimensions come from
the model config: ``model.kv_lora_rank`` and ``model.qk_rope_head_dim``.  The latent row is shared by all heads,
so every tensor-parallel rank stores the same rows (``request.head_num`` does not enter the layout).
"""

from __future__ import annotations

from kvcore.backend import BackendSpec, PoolRequest
from kvcore.errors import ConfigError
from kvcore.hookspecs import hookimpl
from kvcore.layout import PoolLayout

BACKEND = "mla"


def mla_dims(request: PoolRequest) -> tuple[int, int]:
    """``(kv_lora_rank, qk_rope_head_dim)`` of the request's model.

    :raises ConfigError: naming ``model.kv_lora_rank`` / ``model.qk_rope_head_dim`` when missing.
    """
    model = request.model
    dims = []
    for key in ("kv_lora_rank", "qk_rope_head_dim"):
        value = getattr(model, key, None)
        if value is None:
            name = getattr(model, "name", "?")
            raise ConfigError(
                f"model.{key} is not set for model {name!r} (attention={request.attention}): MLA pools need "
                f"model.kv_lora_rank and model.qk_rope_head_dim from the model's config.json"
            )
        dims.append(int(value))
    return dims[0], dims[1]


def layout(request: PoolRequest) -> PoolLayout:
    from kvcore_mla.layout import mla_layout

    kv_lora_rank, qk_rope_head_dim = mla_dims(request)
    return mla_layout(
        backend=BACKEND,
        page_size=request.page_size,
        dtype=request.kv_dtype,
        kv_lora_rank=kv_lora_rank,
        qk_rope_head_dim=qk_rope_head_dim,
        layer_num=request.layer_num,
    )


def create_pool(request: PoolRequest, layout: PoolLayout, sizes):
    from kvcore_mla.pool import MLATokenToKVPool

    kv_lora_rank, qk_rope_head_dim = mla_dims(request)
    return MLATokenToKVPool(
        size=sizes["tokens"],
        kv_lora_rank=kv_lora_rank,
        qk_rope_head_dim=qk_rope_head_dim,
        **request.pool_kwargs(),
    )


@hookimpl(trylast=True)
def kvcore_register_backends():
    return [
        BackendSpec(
            name=BACKEND,
            attention=("mla",),
            layout=layout,
            create_pool=create_pool,
            description="MLA pool: one latent row (kv_lora_rank + rope) per token and layer, bf16/fp16/fp32/fp8 "
            "(uint8 storage), one-launch Triton nope/rope store and gather, shared row move",
        )
    ]
