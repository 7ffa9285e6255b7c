"""The DSA pool family (DeepSeek sparse attention, DeepSeek-V3.2) as a kvcore plugin (entry point ``dsa``).

Options (``kv_cache.options``):

``index_dtype``
    the indexer's key cache: ``float8_e4m3fn`` (default; 128 fp8 bytes + one float32 scale per token, the
    seed's format) or ``bfloat16`` (128 bf16 values per token, no scales).

The indexer's page is 64 tokens, so the pool's page size must be 64.  The backend declares no page sizes
(``page_sizes=None``) on purpose: selection would otherwise skip it with a bare "page size not in [64]", and
the layout function reports the real constraint instead (``kv_cache.page_size must be 64 for DSA ...``).
"""

from __future__ import annotations

from kvcore.backend import BackendSpec, PoolRequest
from kvcore.errors import ConfigError
from kvcore.hookspecs import hookimpl
from kvcore.layout import PoolLayout

BACKEND = "dsa"


def _model_dims(request: PoolRequest) -> dict:
    model = request.model
    dims = {}
    for key in ("kv_lora_rank", "qk_rope_head_dim", "index_head_dim"):
        value = getattr(model, key, None)
        if value is None:
            raise ConfigError(f"model.{key} is required for attention {request.attention} (backend {BACKEND!r})")
        dims[key] = value
    return dims


def _index_dtype(request: PoolRequest):
    from kvcore_dsa.layout import OPTIONS, resolve_index_dtype

    unknown = sorted(set(request.options) - set(OPTIONS))
    if unknown:
        raise ConfigError(
            f"kv_cache.options.{unknown[0]} is not an option of backend {BACKEND!r}; its options: {', '.join(OPTIONS)}"
        )
    return resolve_index_dtype(request.options.get("index_dtype"))


def layout(request: PoolRequest) -> PoolLayout:
    from kvcore_dsa.layout import PAGE_SIZE_MESSAGE, dsa_layout

    if request.page_size != 64:
        raise ConfigError(f"{PAGE_SIZE_MESSAGE}, got {request.page_size}; set kv_cache.page_size=64")
    return dsa_layout(
        backend=BACKEND,
        page_size=request.page_size,
        dtype=request.kv_dtype,
        layer_num=request.layer_num,
        index_dtype=_index_dtype(request),
        **_model_dims(request),
    )


def create_pool(request: PoolRequest, layout: PoolLayout, sizes):
    from kvcore_dsa.pool import DSATokenToKVPool

    return DSATokenToKVPool(
        size=sizes["tokens"],
        index_dtype=_index_dtype(request),
        **_model_dims(request),
        **request.pool_kwargs(),
    )


@hookimpl(trylast=True)
def kvcore_register_backends():
    return [
        BackendSpec(
            name=BACKEND,
            attention=("dsa",),
            layout=layout,
            create_pool=create_pool,
            page_sizes=None,  # 64 only, checked by layout() with an error that says why
            description=(
                "DeepSeek sparse attention: MLA latent rows (fp8: 656-byte rows with per-128 scales and bf16 rope) "
                "plus the indexer's key pages; page size 64"
            ),
        )
    ]
