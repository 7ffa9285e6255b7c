"""SGLang's KV-cache configurator builds kvcore's pools unchanged.

Every constructor call of a pool, request table or allocator in SGLang's KV-cache configurator
(``KVCacheConfigurator._init_pools``) whose class kvcore has is made here with
SGLang's exact keyword set, at the values its code paths give at SGLang's default server arguments (small CPU
sizes), and each pool built must work: a store and a read of the same rows.  Every keyword value that asks for a
feature kvcore does not have is a one-line :class:`~kvcore.errors.ConfigError` naming the keyword.

Then SGLang's return types and attribute names: ``get_kv_size_bytes()`` is ``(K bytes, V bytes)`` for the
MHA-shaped pools (the block-scaled MHA pool and ``SWAKVPool`` too), one int for MLA and DSA, the full-attention
pool's answer for ``HybridLinearKVPool``; the block-scaled pools answer to ``k_buffer`` / ``v_buffer`` /
``k_scale_buffer`` / ``v_scale_buffer``.
"""

from __future__ import annotations

import types

import pytest
import torch

from kvcore.allocators import PagedTokenToKVPoolAllocator, TokenToKVPoolAllocator
from kvcore.errors import ConfigError
from kvcore.pools import KVCache, ReqToTokenPool
from kvcore.testing.tensors import bits_equal, test_device
from kvcore_dsa.pool import DSATokenToKVPool
from kvcore_fp4.pool import LOSSY_BOUNDS, MHATokenToKVPoolFP4, MLATokenToKVPoolFP4
from kvcore_mamba.layout import LinearAttentionDims, layer_kinds, state_params
from kvcore_mamba.pool import HybridLinearKVPool, HybridReqToTokenPool
from kvcore_mha.noop import NoOpMHATokenToKVPool
from kvcore_mha.page_major import PageMajorMHATokenToKVPool
from kvcore_mha.pool import MHATokenToKVPool
from kvcore_mla.pool import MLATokenToKVPool
from kvcore_swa.allocator import SWATokenToKVPoolAllocator
from kvcore_swa.pool import SWAKVPool

DEVICE = test_device()

# -- SGLang's default server arguments, as the configurator reads them ----------------------------------------

SERVER_ARGS = types.SimpleNamespace(
    page_size=1, enable_memory_saver=False, speculative_algorithm=None, speculative_eagle_topk=None,
    max_speculative_num_draft_tokens=None, disable_overlap_schedule=False, enable_pdmux=False,
    enable_page_major_kv_layout=False, enable_linear_replayssm=False, linear_replayssm_cache_len=16,
    prefill_only_disable_kv_cache=False, max_mamba_cache_size=6, dsa_prefill_backend=None, dsa_decode_backend=None,
    disaggregation_mode="null", dcp_size=1,
)  # fmt: skip
#: what the configurator derives from them (and from its own defaults)
POST_CAPTURE_KV_ACTIVE = False  # KVCacheConfigurator.post_capture_kv_active
ENABLE_KV_CACHE_COPY = SERVER_ARGS.speculative_algorithm is not None  # False
ENABLE_ALT_STREAM = not SERVER_ARGS.enable_pdmux  # True
ENABLE_OVERLAP_SCHEDULE = not SERVER_ARGS.disable_overlap_schedule  # True
ENABLE_MAMBA_EXTRA_BUFFER = False  # server_args.enable_mamba_extra_buffer(): radix strategy "auto"
ENABLE_MAMBA_EXTRA_BUFFER_LAZY = False
NEED_SORT = SERVER_ARGS.disaggregation_mode in ("decode", "prefill")  # False


def mha_pool_class(enable_page_major: bool = SERVER_ARGS.enable_page_major_kv_layout) -> type:
    return PageMajorMHATokenToKVPool if enable_page_major else MHATokenToKVPool


# a small model: 4 layers, 2 KV heads of 16 (values 16), context 32
LAYERS, HEADS, HEAD_DIM, V_HEAD_DIM, CONTEXT = 4, 2, 16, 16, 32
TOKENS, REQS = 32, 4


def rows(n, heads, dim, seed, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, heads, dim, generator=g) * 2 + 0.25).to(dtype).to(DEVICE)


def relative_rms(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.float().cpu(), want.float().cpu()
    return float((got - want).pow(2).mean().sqrt() / want.pow(2).mean().sqrt())


def loc_of(*tokens):
    return torch.tensor(tokens, dtype=torch.int64, device=DEVICE)


def at(buffer: torch.Tensor, loc: torch.Tensor) -> torch.Tensor:
    """Rows ``loc`` of a layer's K or V buffer, token-major ``[rows, H, D]`` or page-major ``[pages, page, H, D]``."""
    return buffer.reshape(-1, *buffer.shape[-2:])[loc]


class Layer:
    """What engines pass as ``layer``: an attention module with a ``layer_id``."""

    def __init__(self, layer_id):
        self.layer_id = layer_id


# -- the plain MHA pools: mha_pool_class and NoOpMHATokenToKVPool -----------------------------------------------


def mha_call(pool_cls, **overrides):
    """SGLang's call of ``pool_cls`` (NoOpMHATokenToKVPool if prefill_only_disable_kv_cache else
    mha_pool_class), keyword for keyword."""
    kw = dict(
        page_size=SERVER_ARGS.page_size, dtype=torch.bfloat16, head_num=HEADS, head_dim=HEAD_DIM,
        v_head_dim=V_HEAD_DIM, layer_num=LAYERS, device=DEVICE, enable_memory_saver=SERVER_ARGS.enable_memory_saver,
        start_layer=0, end_layer=LAYERS - 1, enable_alt_stream=ENABLE_ALT_STREAM,
        enable_kv_cache_copy=ENABLE_KV_CACHE_COPY, post_capture_active=POST_CAPTURE_KV_ACTIVE,
    )  # fmt: skip
    kw.update(overrides)
    return pool_cls(TOKENS, **kw)


@pytest.mark.parametrize("page_major", [False, True], ids=["mha", "page_major"])
def test_mha_pool_class_call_builds_a_working_pool(page_major):
    pool = mha_call(mha_pool_class(page_major))
    loc, k, v = loc_of(3, 17, 9), rows(3, HEADS, HEAD_DIM, 1), rows(3, HEADS, V_HEAD_DIM, 2)
    pool.set_kv_buffer(Layer(2), loc, k, v)
    assert bits_equal(at(pool.get_key_buffer(2), loc), k) and bits_equal(at(pool.get_value_buffer(2), loc), v)
    pool.move_kv_cache(loc_of(30, 31, 29), loc)  # enable_kv_cache_copy=False: moves work all the same
    assert bits_equal(at(pool.get_key_buffer(2), loc_of(30, 31, 29)), k)
    assert pool.alt_stream is None and pool.post_capture_active is False


def test_noop_call_builds_the_placeholder_pool():
    pool = mha_call(NoOpMHATokenToKVPool)
    assert pool.size == TOKENS and pool.k_buffer[0].shape == (SERVER_ARGS.page_size, HEADS, HEAD_DIM)
    with pytest.raises(RuntimeError, match="stores nothing"):
        pool.set_kv_buffer(Layer(0), loc_of(1), rows(1, HEADS, HEAD_DIM, 3), rows(1, HEADS, V_HEAD_DIM, 4))


def test_speculative_and_pdmux_values_are_accepted():
    """enable_kv_cache_copy=True (a speculative algorithm) and enable_alt_stream=False (--enable-pdmux)."""
    for cls in (MHATokenToKVPool, PageMajorMHATokenToKVPool, NoOpMHATokenToKVPool, MHATokenToKVPoolFP4):
        kw = {"dtype": torch.float4_e2m1fn_x2} if cls is MHATokenToKVPoolFP4 else {}
        pool = mha_call(cls, enable_kv_cache_copy=True, enable_alt_stream=False, **kw)
        assert pool.size == TOKENS


@pytest.mark.parametrize("cls", [MHATokenToKVPool, PageMajorMHATokenToKVPool, NoOpMHATokenToKVPool,
                                 MHATokenToKVPoolFP4])  # fmt: skip
def test_post_capture_pools_are_refused(cls):
    with pytest.raises(ConfigError, match=r"post_capture_active=True.*CUDA-graph capture.*post_capture_active=False"):
        mha_call(cls, post_capture_active=True)


# -- the block-scaled MHA pool ------------------------------------------------------------------------------


def fp4_call(**overrides):
    """SGLang's MHATokenToKVPoolFP4 call (kv_cache_dtype float4_e2m1fn_x2)."""
    kw = dict(
        page_size=SERVER_ARGS.page_size, dtype=torch.float4_e2m1fn_x2, head_num=HEADS, head_dim=HEAD_DIM,
        v_head_dim=V_HEAD_DIM, layer_num=LAYERS, device=DEVICE, enable_memory_saver=SERVER_ARGS.enable_memory_saver,
        start_layer=0, end_layer=LAYERS - 1, enable_alt_stream=ENABLE_ALT_STREAM,
        enable_kv_cache_copy=ENABLE_KV_CACHE_COPY,
    )  # fmt: skip
    kw.update(overrides)
    return MHATokenToKVPoolFP4(TOKENS, **kw)


def test_fp4_call_builds_a_working_pool():
    pool = fp4_call()
    loc, k, v = loc_of(5, 6, 20), rows(3, HEADS, HEAD_DIM, 5), rows(3, HEADS, V_HEAD_DIM, 6)
    pool.set_kv_buffer(Layer(3), loc, k, v)
    got_k, got_v = pool.get_kv_buffer_by_loc(3, loc)
    assert relative_rms(got_k, k) < LOSSY_BOUNDS["fp4_e2m1"] and relative_rms(got_v, v) < LOSSY_BOUNDS["fp4_e2m1"]


def test_fp4_answers_to_sglangs_buffer_names():
    pool = fp4_call(v_head_dim=32)
    rows_ = TOKENS + SERVER_ARGS.page_size
    for name, stacked, width in (("k_buffer", pool.k_data, HEAD_DIM), ("v_buffer", pool.v_data, 32)):
        views = getattr(pool, name)
        assert len(views) == LAYERS
        for i, view in enumerate(views):  # SGLang's: [m, head_num, head_dim // 2] uint8 per layer
            assert view.shape == (rows_, HEADS, width // 2) and view.dtype == torch.uint8
            assert view.data_ptr() == stacked[i].data_ptr()
    for name, stacked, width in (("k_scale_buffer", pool.k_scale, HEAD_DIM), ("v_scale_buffer", pool.v_scale, 32)):
        views = getattr(pool, name)
        assert len(views) == LAYERS
        for i, view in enumerate(views):  # SGLang's: [m, head_num * head_dim // 16] uint8 per layer
            assert view.shape == (rows_, HEADS * width // 16) and view.dtype == torch.uint8
            assert view.data_ptr() == stacked[i].data_ptr()
    loc = loc_of(2, 7)
    pool.set_kv_buffer(1, loc, rows(2, HEADS, HEAD_DIM, 7), rows(2, HEADS, 32, 8))
    assert int(pool.k_buffer[1][loc].count_nonzero()) > 0 and bits_equal(pool.k_buffer[1][loc], pool.k_data[1, loc])
    assert bits_equal(pool.v_scale_buffer[1][loc], pool.v_scale[1, loc].reshape(2, -1))


@pytest.mark.parametrize("kv_format", ["fp4_e2m1", "nvfp4", "mxfp8"])
def test_fp4_kv_size_bytes_is_k_and_v(kv_format):
    pool = fp4_call(dtype=torch.bfloat16, kv_format=kv_format, head_dim=32, v_head_dim=64)  # whole blocks of 32
    size = pool.get_kv_size_bytes()
    assert isinstance(size, tuple) and len(size) == 2
    k_bytes, v_bytes = size
    extra = 0 if pool.global_scale is None else pool.global_scale.nbytes // 2
    assert k_bytes == pool.k_data.nbytes + pool.k_scale.nbytes + extra
    assert v_bytes == pool.v_data.nbytes + pool.v_scale.nbytes + extra
    assert k_bytes + v_bytes == sum(b.nbytes for b in pool.buffers().values())


# -- MLA: MLATokenToKVPool, MLATokenToKVPoolFP4 -----------------------------------------------------------------

RANK, ROPE = 64, 16


def mla_call(cls, dtype=torch.bfloat16):
    return cls(TOKENS, page_size=SERVER_ARGS.page_size, dtype=dtype, kv_lora_rank=RANK, qk_rope_head_dim=ROPE,
               layer_num=LAYERS, device=DEVICE, enable_memory_saver=SERVER_ARGS.enable_memory_saver, start_layer=0,
               end_layer=LAYERS - 1)  # fmt: skip


@pytest.mark.parametrize("cls", [MLATokenToKVPool, MLATokenToKVPoolFP4])
def test_mla_calls_build_working_pools(cls):
    pool = mla_call(cls, torch.float4_e2m1fn_x2 if cls is MLATokenToKVPoolFP4 else torch.bfloat16)
    loc, nope, rope = loc_of(4, 11), rows(2, 1, RANK, 9), rows(2, 1, ROPE, 10)
    pool.set_mla_kv_buffer(Layer(1), loc, nope, rope)
    got_nope, got_rope = pool.get_mla_kv_buffer(Layer(1), loc)
    if cls is MLATokenToKVPool:
        assert bits_equal(got_nope, nope) and bits_equal(got_rope, rope)
    else:
        assert relative_rms(got_nope, nope) < 0.2 and relative_rms(got_rope, rope) < 0.2  # FP4 codes of 2 rows
    assert isinstance(pool.get_kv_size_bytes(), int)
    assert pool.get_kv_size_bytes() == sum(b.nbytes for b in pool.buffers().values())


def test_mla_fp4_answers_to_sglangs_buffer_names():
    pool = mla_call(MLATokenToKVPoolFP4, torch.float4_e2m1fn_x2)
    m, width = TOKENS + 1, RANK + ROPE
    assert [v.shape for v in pool.kv_buffer] == [(m, 1, width // 2)] * LAYERS  # SGLang's shapes
    assert [v.shape for v in pool.kv_scale_buffer] == [(m, width // 16)] * LAYERS
    assert pool.kv_buffer[2].data_ptr() == pool.kv_data[2].data_ptr()
    assert pool.kv_scale_buffer[2].data_ptr() == pool.kv_scale[2].data_ptr()


# -- DSA ------------------------------------------------------------------------------------------------------

DSA_RANK, DSA_ROPE, DSA_PAGE, INDEX_HEAD_DIM = 512, 64, 64, 128


def sglang_kv_cache_dim(dtype) -> int:
    """SGLang's ``calculate_mla_kv_cache_dim`` for a DSA model at the default DSA backends (not trtllm, not HIP):
    the scaled fp8 row for float8_e4m3fn, the plain latent row otherwise."""
    if dtype == torch.float8_e4m3fn:
        return DSA_RANK + DSA_RANK // DSATokenToKVPool.quant_block_size * 4 + DSA_ROPE * DSATokenToKVPool.rope_storage_dtype.itemsize
    return DSA_RANK + DSA_ROPE


def dsa_call(dtype, **overrides):
    kw = dict(page_size=DSA_PAGE, dtype=dtype, kv_lora_rank=DSA_RANK, qk_rope_head_dim=DSA_ROPE, layer_num=2,
              device=DEVICE, kv_cache_dim=sglang_kv_cache_dim(dtype), enable_memory_saver=SERVER_ARGS.enable_memory_saver,
              start_layer=0, end_layer=1, index_head_dim=INDEX_HEAD_DIM)  # fmt: skip
    kw.update(overrides)
    return DSATokenToKVPool(2 * DSA_PAGE, **kw)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_dsa_call_builds_a_working_pool(dtype):
    pool = dsa_call(dtype)
    assert pool.kv_cache_dim == sglang_kv_cache_dim(dtype)
    loc, nope, rope = loc_of(65, 3), rows(2, 1, DSA_RANK, 11), rows(2, 1, DSA_ROPE, 12)
    pool.set_mla_kv_buffer(Layer(1), loc, nope, rope)
    got_nope, got_rope = pool.get_mla_kv_buffer(Layer(1), loc, torch.bfloat16)
    if dtype == torch.bfloat16:
        assert bits_equal(got_nope, nope) and bits_equal(got_rope, rope)
    else:
        assert relative_rms(got_nope, nope) < 0.07 and bits_equal(got_rope, rope)
    size = pool.get_kv_size_bytes()
    assert isinstance(size, int) and size == pool.kv_cache.nbytes + pool.index_k_with_scale_cache.nbytes


def test_dsa_kv_cache_dim_is_checked_against_the_row():
    with pytest.raises(ConfigError, match=r"kv_cache_dim=576.*656.*pass kv_cache_dim=656"):
        dsa_call(torch.float8_e4m3fn, kv_cache_dim=DSA_RANK + DSA_ROPE)  # the trtllm / HIP raw row
    with pytest.raises(ConfigError, match=r"kv_cache_dim=600"):
        dsa_call(torch.bfloat16, kv_cache_dim=600)


# -- SWAKVPool and its allocator ------------------------------------------------------------------------------

SWA_IDS, FULL_IDS, SWA_TOKENS = [0, 2], [1, 3], 16


def swa_call(compress: bool = False, **overrides):
    """SGLang's CUDA-path SWAKVPool call (with the hybrid-SWA-compress kwargs when ``compress``)."""
    kwargs = dict(swa_head_num=1, swa_head_dim=8, swa_v_head_dim=8, v_head_dim=V_HEAD_DIM) if compress else {}
    kw = dict(
        size=TOKENS, size_swa=SWA_TOKENS, page_size=SERVER_ARGS.page_size, dtype=torch.bfloat16, head_num=HEADS,
        head_dim=HEAD_DIM, swa_attention_layer_ids=SWA_IDS, full_attention_layer_ids=FULL_IDS, device=DEVICE,
        enable_kv_cache_copy=ENABLE_KV_CACHE_COPY, token_to_kv_pool_class=mha_pool_class(), **kwargs,
    )  # fmt: skip
    kw.update(overrides)
    return SWAKVPool(**kw)


@pytest.mark.parametrize("compress", [False, True], ids=["swa", "swa_compress"])
def test_swa_call_and_its_allocator_build_a_working_pool(compress):
    pool = swa_call(compress)
    allocator = SWATokenToKVPoolAllocator(TOKENS, SWA_TOKENS, page_size=SERVER_ARGS.page_size, dtype=torch.bfloat16,
                                          device=DEVICE, kvcache=pool, need_sort=NEED_SORT)  # fmt: skip
    pool.register_mapping(allocator.full_to_swa_index_mapping)
    loc = allocator.alloc(3)
    heads, width = (1, 8) if compress else (HEADS, HEAD_DIM)
    for layer, (h, d) in ((0, (heads, width)), (1, (HEADS, HEAD_DIM))):
        k, v = rows(3, h, d, 20 + layer), rows(3, h, d, 30 + layer)
        pool.set_kv_buffer(Layer(layer), loc, k, v)
        slots = allocator.full_to_swa_index_mapping[loc] if layer in SWA_IDS else loc
        got_k, got_v = pool.get_kv_buffer(layer)
        assert bits_equal(got_k[slots], k) and bits_equal(got_v[slots], v)


def test_swa_call_when_every_layer_slides():
    """full_max_total_num_tokens == 0 (SGLang then pairs the pool with a pure-SWA allocator): locations are the
    window slots, here from an ordinary allocator over them."""
    pool = swa_call(size=0, swa_attention_layer_ids=[0, 1, 2, 3], full_attention_layer_ids=[])
    assert pool.full_kv_pool is None and pool.size == SWA_TOKENS
    allocator = TokenToKVPoolAllocator(SWA_TOKENS, dtype=torch.bfloat16, device=DEVICE, kvcache=pool, need_sort=NEED_SORT)
    loc, k, v = allocator.alloc(2), rows(2, HEADS, HEAD_DIM, 60), rows(2, HEADS, HEAD_DIM, 61)
    pool.set_kv_buffer(Layer(3), loc, k, v)
    assert bits_equal(pool.get_key_buffer(3)[loc], k) and bits_equal(pool.get_value_buffer(3)[loc], v)


def test_swa_ascend_keyword_set_with_kvcore_classes():
    """The Ascend path's keywords (post_capture_active, token_to_kv_pool_class) with kvcore's MHA class."""
    pool = swa_call(post_capture_active=POST_CAPTURE_KV_ACTIVE, enable_kv_cache_copy=False,
                    token_to_kv_pool_class=MHATokenToKVPool)  # fmt: skip
    pool.set_kv_buffer(1, loc_of(4), rows(1, HEADS, HEAD_DIM, 1), rows(1, HEADS, HEAD_DIM, 2))
    assert bits_equal(pool.get_key_buffer(1)[loc_of(4)], rows(1, HEADS, HEAD_DIM, 1))


def test_swa_page_major_sub_pools_and_kv_size_bytes():
    pool = swa_call(token_to_kv_pool_class=mha_pool_class(True), enable_kv_cache_copy=True)
    assert isinstance(pool.full_kv_pool, PageMajorMHATokenToKVPool)
    k_bytes, v_bytes = pool.get_kv_size_bytes()
    assert k_bytes == v_bytes and k_bytes + v_bytes == sum(b.nbytes for b in pool.buffers().values())
    mha = swa_call()
    assert mha.get_kv_size_bytes() == (mha.full_kv_pool.k_cache.nbytes + mha.swa_kv_pool.k_cache.nbytes,
                                       mha.full_kv_pool.v_cache.nbytes + mha.swa_kv_pool.v_cache.nbytes)  # fmt: skip


class NPUMHATokenToKVPool(KVCache):
    """Stands for the Ascend path's NPU pool class: another engine's pool, not kvcore's."""


@pytest.mark.parametrize("cls", [NPUMHATokenToKVPool, NoOpMHATokenToKVPool, MLATokenToKVPool, MHATokenToKVPoolFP4, "mha"])
def test_swa_sub_pool_classes_other_than_kvcore_mha_are_refused(cls):
    with pytest.raises(ConfigError, match=r"token_to_kv_pool_class=.*kvcore_mha\.pool\.MHATokenToKVPool"):
        swa_call(token_to_kv_pool_class=cls)


def test_swa_post_capture_is_refused():
    with pytest.raises(ConfigError, match=r"SWAKVPool\(post_capture_active=True\)"):
        swa_call(post_capture_active=True)


# -- hybrid linear attention: HybridReqToTokenPool and HybridLinearKVPool ----------------------------------------

GDN = LinearAttentionDims(kind="gated_delta_net", num_heads=2, head_dim=8, state_size=4, num_groups=1, conv_kernel=4,
                          full_attention_interval=4)  # fmt: skip
HYBRID_LAYERS = 8
FULL_LAYERS, LINEAR_LAYERS = layer_kinds(HYBRID_LAYERS, GDN.full_attention_interval)  # [3, 7], [0, 1, 2, 4, 5, 6]
#: what the configurator's mambaish_config carries: every linear layer of the model (all pipeline stages)
CACHE_PARAMS = state_params(GDN, torch.bfloat16, 1, LINEAR_LAYERS)


def hybrid_req_call(stage=(0, HYBRID_LAYERS), **overrides):
    """SGLang's HybridReqToTokenPool call, for the pipeline stage of layers ``stage[0] .. stage[1] - 1``."""
    start_layer, end_layer = stage
    kw = dict(
        size=REQS, mamba_size=SERVER_ARGS.max_mamba_cache_size, mamba_spec_state_size=REQS, max_context_len=CONTEXT,
        device=DEVICE, enable_memory_saver=SERVER_ARGS.enable_memory_saver, cache_params=CACHE_PARAMS,
        mamba_layer_ids=[i for i in CACHE_PARAMS.layers if start_layer <= i < end_layer],
        enable_mamba_extra_buffer=ENABLE_MAMBA_EXTRA_BUFFER,
        enable_mamba_extra_buffer_lazy=ENABLE_MAMBA_EXTRA_BUFFER_LAZY,
        speculative_num_draft_tokens=SERVER_ARGS.max_speculative_num_draft_tokens,
        speculative_eagle_topk=SERVER_ARGS.speculative_eagle_topk, enable_overlap_schedule=ENABLE_OVERLAP_SCHEDULE,
        start_layer=start_layer, enable_linear_replayssm=SERVER_ARGS.enable_linear_replayssm,
        linear_replayssm_cache_len=SERVER_ARGS.linear_replayssm_cache_len,
        mamba_envelope_layout=SERVER_ARGS.enable_page_major_kv_layout,
    )  # fmt: skip
    kw.update(overrides)
    return HybridReqToTokenPool(**kw)


def hybrid_kv_call(req_to_token_pool, stage=(0, HYBRID_LAYERS), use_mla=False, is_draft_worker=False, **overrides):
    """SGLang's HybridLinearKVPool call (``extra_args`` with the MLA dimensions when ``use_mla``)."""
    start_layer, end_layer = stage
    extra_args = dict(kv_lora_rank=RANK, qk_rope_head_dim=ROPE) if use_mla else {}
    kw = dict(
        page_size=SERVER_ARGS.page_size, size=TOKENS, dtype=torch.bfloat16, head_num=HEADS, head_dim=HEAD_DIM,
        full_attention_layer_ids=[0] if is_draft_worker else [i for i in FULL_LAYERS if start_layer <= i < end_layer],
        device=DEVICE, mamba_pool=req_to_token_pool.mamba_pool if req_to_token_pool is not None else None,
        enable_memory_saver=SERVER_ARGS.enable_memory_saver, enable_kv_cache_copy=ENABLE_KV_CACHE_COPY,
        use_mla=use_mla, start_layer=start_layer, full_kv_pool_class=mha_pool_class(),
        post_capture_active=POST_CAPTURE_KV_ACTIVE, **extra_args,
    )  # fmt: skip
    kw.update(overrides)
    return HybridLinearKVPool(**kw)


def _req(rid):
    return types.SimpleNamespace(rid=rid, mamba_pool_idx=None, mamba_ping_pong_track_buffer=None,
                                 mamba_next_track_idx=None)  # fmt: skip


def test_hybrid_calls_build_working_pools():
    reqs = hybrid_req_call()
    assert reqs.mamba_pool.num_mamba_layers == len(LINEAR_LAYERS) and reqs.mamba_ping_pong_track_buffer_size == 2
    slots = reqs.alloc(2, [_req(0), _req(1)])
    assert slots == [1, 2]
    state = reqs.mamba2_layer_cache(5)
    index = reqs.get_mamba_indices(torch.tensor(slots, device=DEVICE)).long()
    value = torch.full_like(state.temporal[index], 1.5)
    state.temporal[index] = value
    assert bits_equal(reqs.mamba2_layer_cache(5).temporal[index], value)
    pool = hybrid_kv_call(reqs)
    assert pool.mamba_pool is reqs.mamba_pool and isinstance(pool.full_kv_pool, MHATokenToKVPool)
    loc, k, v = loc_of(8, 1), rows(2, HEADS, HEAD_DIM, 40), rows(2, HEADS, HEAD_DIM, 41)
    pool.set_kv_buffer(Layer(7), loc, k, v)
    got_k, got_v = pool.get_kv_buffer(7)
    assert bits_equal(got_k[loc], k) and bits_equal(got_v[loc], v)
    pool.move_kv_cache(loc_of(20, 21), loc)
    assert bits_equal(pool.get_key_buffer(7)[loc_of(20, 21)], k)


def test_hybrid_calls_on_a_later_pipeline_stage():
    """Layers 4 .. 7 on this rank: its linear layers [4, 5, 6] out of cache_params' six; full layer 7."""
    counter = types.SimpleNamespace(waited=[], wait_until=None)
    counter.wait_until = counter.waited.append
    reqs = hybrid_req_call(stage=(4, HYBRID_LAYERS))
    assert reqs.mamba_pool.num_mamba_layers == 3 and sorted(reqs.mamba_map) == [4, 5, 6]
    reqs.register_layer_transfer_counter(counter)
    assert reqs.mamba2_layer_cache(6).temporal.data_ptr() == reqs.mamba_pool.mamba_cache.temporal[2].data_ptr()
    assert counter.waited == [2]  # layer 6 is the stage's third layer
    with pytest.raises(IndexError, match="keeps no linear-attention state"):
        reqs.mamba2_layer_cache(1)
    pool = hybrid_kv_call(reqs, stage=(4, HYBRID_LAYERS))
    assert pool.full_attention_layer_ids == [7] and pool.start_layer == 4
    pool.set_kv_buffer(7, loc_of(2), rows(1, HEADS, HEAD_DIM, 42), rows(1, HEADS, HEAD_DIM, 43))
    assert bits_equal(pool.get_key_buffer(7)[loc_of(2)], rows(1, HEADS, HEAD_DIM, 42))


def test_hybrid_draft_worker_and_mla_calls():
    reqs = hybrid_req_call()
    draft = hybrid_kv_call(reqs, is_draft_worker=True)
    draft.set_kv_buffer(0, loc_of(3), rows(1, HEADS, HEAD_DIM, 44), rows(1, HEADS, HEAD_DIM, 45))
    assert bits_equal(draft.get_value_buffer(0)[loc_of(3)], rows(1, HEADS, HEAD_DIM, 45))
    # use_mla: the configurator still passes full_kv_pool_class=mha_pool_class; the latent rows go to MLA's pool
    mla = hybrid_kv_call(reqs, use_mla=True)
    assert isinstance(mla.full_kv_pool, MLATokenToKVPool)
    nope, rope = rows(2, 1, RANK, 46), rows(2, 1, ROPE, 47)
    mla.set_mla_kv_buffer(Layer(3), loc_of(5, 6), nope, rope)
    got_nope, got_rope = mla.get_mla_kv_buffer(Layer(3), loc_of(5, 6))
    assert bits_equal(got_nope, nope) and bits_equal(got_rope, rope)
    assert mla.get_kv_size_bytes() == mla.full_kv_pool.get_kv_size_bytes() == mla.full_kv_pool.kv_cache.nbytes


def test_hybrid_kv_pool_without_states():
    pool = hybrid_kv_call(None)
    assert pool.mamba_pool is None and sorted(pool.buffers()) == ["k", "v"]
    assert pool.size_groups() == {"tokens": TOKENS} and pool.get_state_buf_infos() == ([], [], [])
    pool.set_kv_buffer(3, loc_of(4), rows(1, HEADS, HEAD_DIM, 48), rows(1, HEADS, HEAD_DIM, 49))
    assert bits_equal(pool.get_key_buffer(3)[loc_of(4)], rows(1, HEADS, HEAD_DIM, 48))
    assert pool.get_kv_size_bytes() == pool.full_kv_pool.get_kv_size_bytes()
    copy = pool.get_cpu_copy(loc_of(4))
    pool.load_cpu_copy(copy, loc_of(9))
    assert bits_equal(pool.get_key_buffer(3)[loc_of(9)], rows(1, HEADS, HEAD_DIM, 48))
    with pytest.raises(ValueError, match="mamba_pool=None"):
        pool.get_cpu_copy(loc_of(4), mamba_indices=torch.tensor([1]))


def test_hybrid_kv_size_bytes_is_the_full_pools_and_states_are_reported_apart():
    reqs = hybrid_req_call()
    pool = hybrid_kv_call(reqs)
    size = pool.get_kv_size_bytes()
    assert isinstance(size, tuple) and size == pool.full_kv_pool.get_kv_size_bytes()
    assert size == (pool.full_kv_pool.k_cache.nbytes, pool.full_kv_pool.v_cache.nbytes)
    assert pool.get_state_buf_infos() == reqs.mamba_pool.get_contiguous_buf_infos()
    assert pool.get_contiguous_buf_infos() == pool.full_kv_pool.get_contiguous_buf_infos()
    states = sum(b.nbytes for b in reqs.mamba_pool.buffers().values())
    assert sum(size) + states == sum(b.nbytes for b in pool.buffers().values())


def test_hybrid_page_major_full_pool():
    """enable_page_major_kv_layout: full_kv_pool_class=PageMajorMHATokenToKVPool (the states' envelope, refused
    below, is a separate keyword)."""
    pool = hybrid_kv_call(hybrid_req_call(), full_kv_pool_class=mha_pool_class(True))
    assert isinstance(pool.full_kv_pool, PageMajorMHATokenToKVPool)
    loc, k, v = loc_of(6, 2), rows(2, HEADS, HEAD_DIM, 50), rows(2, HEADS, HEAD_DIM, 51)
    pool.set_kv_buffer(Layer(7), loc, k, v)
    assert bits_equal(at(pool.get_key_buffer(7), loc), k)
    pool.move_kv_cache(loc_of(30, 31), loc)
    assert bits_equal(at(pool.get_value_buffer(7), loc_of(30, 31)), v)
    assert pool.token_rows().keys() == {"k", "v"} and pool.layer_in_buffer("k", 7) == 1


@pytest.mark.parametrize(
    "overrides, keyword",
    [
        (dict(enable_linear_replayssm=True), "enable_linear_replayssm"),
        (dict(mamba_envelope_layout=True), "mamba_envelope_layout"),
        (dict(mamba_layer_ids=[0, 3]), "mamba_layer_ids"),
        (dict(mamba_layer_ids=[0, 0]), "mamba_layer_ids"),
        (dict(start_layer=2), "start_layer"),
        (dict(enable_mamba_extra_buffer=True, enable_mamba_extra_buffer_lazy=True, enable_overlap_schedule=False),
         "enable_mamba_extra_buffer_lazy"),
        (dict(enable_mamba_extra_buffer_lazy=True), "enable_mamba_extra_buffer_lazy"),
        (dict(linear_replayssm_cache_len=0), "linear_replayssm_cache_len"),
        (dict(speculative_eagle_topk=0), "speculative_eagle_topk"),
    ],
)  # fmt: skip
def test_hybrid_req_pool_refusals_name_the_keyword(overrides, keyword):
    with pytest.raises(ConfigError, match=rf"HybridReqToTokenPool\({keyword}="):
        hybrid_req_call(**overrides)


@pytest.mark.parametrize(
    "overrides, keyword",
    [
        (dict(post_capture_active=True), "post_capture_active"),
        (dict(full_kv_pool_class=NPUMHATokenToKVPool), "full_kv_pool_class"),
        (dict(full_kv_pool_class=NoOpMHATokenToKVPool), "full_kv_pool_class"),
        (dict(full_kv_pool_class=MLATokenToKVPool), "full_kv_pool_class"),
        (dict(use_mla=True, full_kv_pool_class=PageMajorMHATokenToKVPool), "full_kv_pool_class"),
    ],
)  # fmt: skip
def test_hybrid_kv_pool_refusals_name_the_keyword(overrides, keyword):
    with pytest.raises(ConfigError, match=rf"HybridLinearKVPool\({keyword}="):
        hybrid_kv_call(hybrid_req_call(), **overrides)


def test_hybrid_extra_buffer_schedules():
    """The extra buffer's track slots: 2 with the overlap schedule, 1 without, 1 of 2 set in the lazy mode."""
    overlap = hybrid_req_call(enable_mamba_extra_buffer=True)
    a = _req(0)
    overlap.alloc(1, [a])
    assert overlap.mamba_ping_pong_track_buffer_size == 2 and len(a.mamba_ping_pong_track_buffer) == 2
    plain = hybrid_req_call(enable_mamba_extra_buffer=True, enable_overlap_schedule=False)
    b = _req(1)
    plain.alloc(1, [b])
    assert plain.mamba_ping_pong_track_buffer_size == 1 and b.mamba_ping_pong_track_buffer.tolist() == [2]
    lazy = hybrid_req_call(enable_mamba_extra_buffer=True, enable_mamba_extra_buffer_lazy=True)
    c = _req(2)
    (row,) = lazy.alloc(1, [c])
    c.req_pool_idx = row
    assert c.mamba_ping_pong_track_buffer.tolist() == [2, -1]
    assert lazy.req_index_to_mamba_ping_pong_track_buffer_mapping[row].tolist() == [2, -1]
    assert lazy.mamba_pool.available_size() == SERVER_ARGS.max_mamba_cache_size - 2
    assert lazy.get_mamba_ping_pong_keep_idx(c) == 0
    lazy.set_mamba_ping_pong_slot(c, 1, lazy.mamba_pool.alloc(1)[0])
    assert lazy.req_index_to_mamba_ping_pong_track_buffer_mapping[row].tolist() == [2, 3]
    lazy.free(row)
    assert lazy.mamba_pool.available_size() == SERVER_ARGS.max_mamba_cache_size
    d = _req(3)
    (row,) = lazy.alloc(1, [d])
    lazy.free(row)  # the unset -1 slot is skipped
    assert lazy.mamba_pool.available_size() == SERVER_ARGS.max_mamba_cache_size


# -- the request table and the allocators ---------------------------------------------------------------------


def test_req_to_token_pool_and_allocator_calls():
    reqs = ReqToTokenPool(size=REQS, max_context_len=CONTEXT, device=DEVICE,
                          enable_memory_saver=SERVER_ARGS.enable_memory_saver)  # fmt: skip
    assert reqs.alloc(2) == [1, 2]
    pool = mha_call(MHATokenToKVPool)
    token = TokenToKVPoolAllocator(TOKENS, dtype=torch.bfloat16, device=DEVICE, kvcache=pool, need_sort=NEED_SORT)
    assert token.get_kvcache() is pool and token.alloc(3).numel() == 3
    paged_pool = mha_call(MHATokenToKVPool, page_size=4)
    paged = PagedTokenToKVPoolAllocator(TOKENS * SERVER_ARGS.dcp_size, page_size=4 * SERVER_ARGS.dcp_size,
                                        dtype=torch.bfloat16, device=DEVICE, kvcache=paged_pool, need_sort=NEED_SORT)  # fmt: skip
    assert paged.alloc(8).numel() == 8


def test_decode_worker_calls():
    """The configurator's calls under disaggregation_mode=decode: DecodeReqToTokenPool, and
    HybridMambaDecodeReqToTokenPool for linear-attention hybrids, with its keywords (pre_alloc_size is
    disaggregation_decode_extra_slots, 0 by default for a large batch, here 3)."""
    from kvcore.pools import DecodeReqToTokenPool
    from kvcore_mamba.decode import HybridMambaDecodeReqToTokenPool

    pre_alloc_size = 3
    reqs = DecodeReqToTokenPool(size=REQS, max_context_len=CONTEXT, device=DEVICE,
                                enable_memory_saver=SERVER_ARGS.enable_memory_saver, pre_alloc_size=pre_alloc_size)  # fmt: skip
    assert reqs.alloc(REQS + pre_alloc_size) == list(range(1, REQS + pre_alloc_size + 1)) and reqs.alloc(1) is None
    start_layer, end_layer = 0, HYBRID_LAYERS
    hybrid = HybridMambaDecodeReqToTokenPool(
        size=REQS, max_context_len=CONTEXT, device=DEVICE, enable_memory_saver=SERVER_ARGS.enable_memory_saver,
        cache_params=CACHE_PARAMS, mamba_layer_ids=[i for i in CACHE_PARAMS.layers if start_layer <= i < end_layer],
        speculative_num_draft_tokens=SERVER_ARGS.max_speculative_num_draft_tokens,
        speculative_eagle_topk=SERVER_ARGS.speculative_eagle_topk, enable_mamba_extra_buffer=ENABLE_MAMBA_EXTRA_BUFFER,
        pre_alloc_size=pre_alloc_size, enable_overlap_schedule=ENABLE_OVERLAP_SCHEDULE,
        mamba_size=SERVER_ARGS.max_mamba_cache_size, start_layer=start_layer,
    )  # fmt: skip
    # max_mamba_cache_size 6 is raised to the 7 requests' slots, as SGLang does
    assert hybrid.mamba_pool.size == REQS + pre_alloc_size
    slots = hybrid.alloc(REQS + pre_alloc_size, [_req(i) for i in range(REQS + pre_alloc_size)])
    assert slots == list(range(1, REQS + pre_alloc_size + 1))
    pool = hybrid_kv_call(hybrid)
    assert pool.mamba_pool is hybrid.mamba_pool


# -- get_kv_size_bytes of the other families ---------------------------------------------------------------------


def test_kv_size_bytes_of_the_mha_shaped_pools_is_a_pair():
    for cls in (MHATokenToKVPool, PageMajorMHATokenToKVPool, NoOpMHATokenToKVPool):
        pool = mha_call(cls)
        size = pool.get_kv_size_bytes()
        assert isinstance(size, tuple) and len(size) == 2, cls.__name__
        assert sum(size) == sum(b.nbytes for b in pool.buffers().values())
