"""The hybrid linear-attention family as a kvcore plugin (entry point ``mamba``): its backend, and the
request-pool hook that pairs its KV pool with a :class:`~kvcore_mamba.pool.HybridReqToTokenPool`."""

from __future__ import annotations

from kvcore.backend import BackendSpec, PoolRequest
from kvcore.hookspecs import hookimpl
from kvcore.layout import PoolLayout
from kvcore_mamba.layout import LinearAttentionDims, MambaOptions

#: the kvcore plugin API this plugin is written for (kvcore.hookspecs.API_VERSION); checked when it loads
KVCORE_API_VERSION = "4"

BACKEND = "mamba"
MLA_BACKEND = "mamba_mla"


def layout(request: PoolRequest) -> PoolLayout:
    from kvcore_mamba.layout import mamba_layout

    return mamba_layout(backend=MLA_BACKEND if "mla" in request.sections else BACKEND, request=request)


def create_pool(request: PoolRequest, layout: PoolLayout, sizes):
    from kvcore_mamba.layout import draft_tokens, rank_layers, rank_state_params
    from kvcore_mamba.pool import HybridLinearKVPool, MambaPool

    full, _ = rank_layers(request)
    mamba_pool = MambaPool(size=sizes["requests"], spec_state_size=sizes.get("running_requests", 0),
                           cache_params=rank_state_params(request), device=request.device, kernels=request.kernels,
                           speculative_num_draft_tokens=draft_tokens(request) or None)  # fmt: skip
    mla = request.sections.get("mla")
    return HybridLinearKVPool(
        size=sizes["tokens"], dtype=request.kv_dtype, page_size=request.page_size, head_num=request.head_num,
        head_dim=request.head_dim, v_head_dim=request.v_head_dim, full_attention_layer_ids=full,
        device=request.device, mamba_pool=mamba_pool, start_layer=request.start_layer, end_layer=request.end_layer,
        kernels=request.kernels, use_mla=mla is not None, kv_lora_rank=mla and mla.kv_lora_rank,
        qk_rope_head_dim=mla and mla.qk_rope_head_dim,
    )  # fmt: skip


@hookimpl
def kvcore_register_backends():
    from kvcore_mla.layout import MLADims

    return [
        BackendSpec(
            name=BACKEND,
            attention=("mamba",),
            layout=layout,
            create_pool=create_pool,
            model_sections={"mamba": LinearAttentionDims},
            options_schema=MambaOptions,
            description="hybrid linear-attention pool: full-attention K/V in an MHA pool, Mamba2 / gated DeltaNet "
            "states per request slot, reserved before the tokens",
        ),
        BackendSpec(
            name=MLA_BACKEND,
            attention=("mamba_mla",),
            layout=layout,
            create_pool=create_pool,
            model_sections={"mamba": LinearAttentionDims, "mla": MLADims},
            options_schema=MambaOptions,
            description="hybrid linear-attention pool whose full-attention layers keep MLA latent rows",
        ),
    ]


@hookimpl
def kvcore_create_req_to_token_pool(backend, request, size, max_context_len, sizes, pool):
    """The request table with state slots, sharing the KV pool's :class:`MambaPool`."""
    if backend.name not in (BACKEND, MLA_BACKEND):
        return None
    from kvcore_mamba.layout import draft_tokens, rank_state_params
    from kvcore_mamba.decode import HybridMambaDecodeReqToTokenPool
    from kvcore_mamba.pool import HybridReqToTokenPool

    options: MambaOptions = request.options
    extra = options.mamba_extra_buffer
    common = dict(
        size=size, max_context_len=max_context_len, device=request.device, cache_params=rank_state_params(request),
        enable_mamba_extra_buffer=extra != "off", start_layer=request.start_layer,
        # the track slots the planner reserved (layout.EXTRA_SLOTS): 2 with the overlap schedule, 1 without
        enable_overlap_schedule=None if extra == "off" else extra != "no_overlap",
        speculative_num_draft_tokens=draft_tokens(request) or None, mamba_pool=pool.mamba_pool,
        kernels=request.kernels,
    )  # fmt: skip
    if request.mode.disaggregation == "decode":
        return HybridMambaDecodeReqToTokenPool(mamba_size=sizes["requests"], pre_alloc_size=request.mode.pre_alloc_size,
                                               **common)  # fmt: skip
    return HybridReqToTokenPool(mamba_size=sizes["requests"], mamba_spec_state_size=sizes.get("running_requests", 0),
                                enable_mamba_extra_buffer_lazy=extra == "overlap_lazy", **common)  # fmt: skip


@hookimpl
def kvcore_bench_cases():
    """``kvcore bench``'s cases of this family (:mod:`kvcore_mamba.bench`, imported only when the bench runs)."""
    from kvcore_mamba.bench import bench_cases

    return bench_cases()
