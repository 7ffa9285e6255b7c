"""The MiniMax sparse backend against kvcore's conformance kit (index rows are token rows like K and V: moved,
offloaded and checked with them), its bytes per token by hand, SGLang's constructor call, and its errors."""

import pytest
import torch

from kvcore import load_config, plan_memory
from kvcore.errors import ConfigError
from kvcore.testing import KVCacheConformance, Variant
from kvcore.testing.tensors import bits_equal, randn_nonzero, test_device

CONFIG = ["model=tiny-minimax-sparse"]


class TestMiniMaxSparseConformance(KVCacheConformance):
    backend = "minimax_sparse"
    config = CONFIG
    variants = [Variant("bfloat16", "triton", 1), Variant("float8_e4m3fn", "triton", 4), Variant("float32", "native", 1),
                Variant("float16", "native", 16)]  # fmt: skip


def test_bytes_per_token_by_hand():
    """K and V of 5 layers (2 heads of 32), index keys of 3 sparse layers and index values of 2 (16 wide), bf16;
    an fp8 cache halves the main rows, not the index rows (they keep the model's dtype, as SGLang passes it)."""
    plan = plan_memory(load_config(*CONFIG))
    assert plan.bytes_per_token == 5 * 2 * 2 * 32 * 2 + (3 + 2) * 16 * 2
    fp8 = plan_memory(load_config(*CONFIG, "kv_cache.dtype=float8_e4m3fn"))
    assert fp8.bytes_per_token == 5 * 2 * 2 * 32 * 1 + (3 + 2) * 16 * 2


def sglang_call(**overrides):
    """The configurator's MiniMaxSparseKVPool call, keyword for keyword (index_dtype is the model's dtype)."""
    from kvcore_minimax_sparse import MiniMaxSparseKVPool

    kw = dict(size=64, page_size=4, dtype=torch.float8_e4m3fn, index_dtype=torch.bfloat16, head_num=2, head_dim=32,
              idx_head_dim=16, dense_layer_ids=[0, 1], sparse_layer_ids=[2, 3, 4], disable_value_sparse_layer_ids=[4],
              device=test_device(), enable_memory_saver=False, start_layer=0, end_layer=5)  # fmt: skip
    kw.update(overrides)
    return MiniMaxSparseKVPool(**kw)


def test_the_configurators_call_and_the_accessors():
    pool = sglang_call()
    gen = torch.Generator().manual_seed(0)
    loc = torch.tensor([5, 9, 17], device=test_device())
    k, v = (randn_nonzero((3, 2, 32), torch.float32, gen) for _ in range(2))
    ik, iv = (randn_nonzero((3, 1, 16), torch.float32, gen) for _ in range(2))
    pool.set_fused_kv_index_buffer(3, loc, k, v, ik, iv)
    assert bits_equal(pool.get_key_buffer(3)[loc].view(torch.uint8), k.to(torch.float8_e4m3fn).view(torch.uint8))
    index_k, index_v = pool.get_index_kv_buffer(3)
    assert bits_equal(index_k[loc], ik.to(torch.bfloat16)) and bits_equal(index_v[loc], iv.to(torch.bfloat16))
    pool.set_fused_kv_index_buffer(4, loc, k, v, ik.reshape(3, 16), None)  # a keys-only index, rows flattened
    assert bits_equal(pool.get_index_k_buffer(4)[loc], ik.to(torch.bfloat16))
    assert pool.get_index_k_buffer(3).data_ptr() == index_k.data_ptr()
    k_bytes, v_bytes = pool.get_kv_size_bytes()
    rows = 64 + 4
    assert (k_bytes, v_bytes) == (5 * rows * 2 * 32 + 3 * rows * 16 * 2, 5 * rows * 2 * 32 + 2 * rows * 16 * 2)
    ptrs, lens, items = pool.get_state_buf_infos()
    assert len(ptrs) == 3 + 2 and items == [4 * 16 * 2] * 5  # index rows, a page each, addressed by the main pages
    with pytest.raises(ValueError, match="layer 1 has no index values"):
        pool.get_index_kv_buffer(1)
    with pytest.raises(ValueError, match="layer 0 is not a sparse attention layer"):
        pool.get_index_k_buffer(0)


@pytest.mark.parametrize("overrides, keyword", [
    (dict(enable_hisparse=True), "enable_hisparse"),
    (dict(index_kv_pool_cls=object), "index_kv_pool_cls"),
    (dict(main_pool_cls=dict), "main_pool_cls"),
])  # fmt: skip
def test_what_kvcore_lacks_is_refused_by_keyword(overrides, keyword):
    with pytest.raises(ConfigError, match=keyword):
        sglang_call(**overrides)


def test_a_rank_keeps_its_own_layers():
    pool = sglang_call(start_layer=2, end_layer=5, size=16)
    assert (pool.start_layer, pool.end_layer, pool.dense_layer_ids) == (2, 4, [])
    assert pool.index_kv_layer_id_mapping == {2: 0, 3: 1} and pool.index_k_layer_id_mapping == {4: 0}
    with pytest.raises(ValueError, match="cover this rank's layers"):
        sglang_call(dense_layer_ids=[0], sparse_layer_ids=[2, 3, 4])


def test_layer_lists_repeat_and_an_empty_one_names_the_key():
    from kvcore_minimax_sparse.layout import MiniMaxSparseDims, layer_groups

    dims = MiniMaxSparseDims(index_head_dim=8, sparse_attention_freq=[0, 1], disable_index_value=[0, 0, 0, 1])
    assert layer_groups(dims, range(6)) == ([0, 2, 4], [1, 5], [3])
    with pytest.raises(ConfigError, match="model.minimax_sparse.sparse_attention_freq is empty"):
        plan_memory(load_config(*CONFIG, "model.minimax_sparse.sparse_attention_freq=[]"))
