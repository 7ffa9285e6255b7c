"""SWAKVPool beyond the kit: routing by layer, the full -> window map inside the store, a model whose layers
all slide, sub-pool classes without an index map, and the errors."""

from __future__ import annotations

import pytest
import torch

from kvcore.testing.tensors import bits_equal, test_device
from kvcore.pools import KVWriteLoc
from kvcore_mha.pool import MHATokenToKVPool
from kvcore_swa.pool import SWAKVPool

DEVICE = test_device()
KERNELS = ["triton", "native"]


def make_pool(kernels="triton", page_size=1, full=(2, 5), swa=(0, 1, 3, 4), size=32, size_swa=16, **kw) -> SWAKVPool:
    return SWAKVPool(size=size, size_swa=size_swa, page_size=page_size, dtype=kw.pop("dtype", torch.bfloat16),
                     head_num=2, head_dim=16, swa_attention_layer_ids=list(swa), full_attention_layer_ids=list(full),
                     device=DEVICE, kernels=kernels, **kw)  # fmt: skip


def rows(n, heads, dim, seed, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, heads, dim, generator=g) * 3 + 0.5).to(dtype).to(DEVICE)


def test_layers_route_to_their_sub_pool():
    pool = make_pool()
    assert pool.layers_mapping == {2: (0, False), 5: (1, False), 0: (0, True), 1: (1, True), 3: (2, True), 4: (3, True)}
    assert pool.get_key_buffer(5).data_ptr() == pool.full_kv_pool.k_buffer[1].data_ptr()
    assert pool.get_value_buffer(3).data_ptr() == pool.swa_kv_pool.v_buffer[2].data_ptr()
    assert sorted(pool.buffers()) == ["k", "swa_k", "swa_v", "v"]
    assert pool.size_groups() == {"tokens": 32, "swa_tokens": 16}
    assert [pool.layer_in_buffer("swa_k", i) for i in range(6)] == [0, 1, None, 2, 3, None]
    assert [pool.layer_in_buffer("v", i) for i in range(6)] == [None, None, 0, None, None, 1]
    with pytest.raises(IndexError, match=r"full-attention layers \[2, 5\], sliding-window layers \[0, 1, 3, 4\]"):
        pool.get_key_buffer(6)


@pytest.mark.parametrize("write", ["locations", "KVWriteLoc", "KVWriteLoc with swa_loc"])
@pytest.mark.parametrize("kernels", KERNELS)
@pytest.mark.parametrize("page_size", [1, 4])
def test_window_writes_go_through_the_map(kernels, page_size, write):
    """A window layer's rows of full locations land at their mapped window slots (translated in the store, or
    given as a KVWriteLoc's ``swa_loc``); a full layer's at the locations themselves; nothing else changes."""
    pool = make_pool(kernels, page_size)
    g = torch.Generator().manual_seed(3)
    mapping = torch.zeros(pool.size + page_size, dtype=torch.int64)
    loc = torch.randperm(pool.size, generator=g)[:7] + page_size
    mapping[loc] = torch.randperm(pool.size_swa, generator=g)[:7] + page_size
    pool.register_mapping(mapping.to(DEVICE))
    loc = loc.to(DEVICE)
    before = {name: buf.clone() for name, buf in pool.buffers().items()}
    k, v = rows(7, 2, 16, 1), rows(7, 2, 16, 2)
    where = {"locations": loc, "KVWriteLoc": KVWriteLoc(loc),
             "KVWriteLoc with swa_loc": KVWriteLoc(loc, swa_loc=pool.translate_loc_from_full_to_swa(loc))}[write]
    pool.set_kv_buffer(3, where, k, v)  # window layer 3 = index 2 of the window sub-pool
    pool.set_kv_buffer(None, where, v, k, layer_id_override=5)  # full layer 5 = index 1 of the full sub-pool
    slots = mapping.to(DEVICE)[loc]
    assert bits_equal(pool.swa_kv_pool.k_cache[2, slots], k) and bits_equal(pool.swa_kv_pool.v_cache[2, slots], v)
    assert bits_equal(pool.full_kv_pool.k_cache[1, loc], v) and bits_equal(pool.full_kv_pool.v_cache[1, loc], k)
    # everything else as before
    pool.swa_kv_pool.k_cache[2, slots] = before["swa_k"][2, slots]
    pool.swa_kv_pool.v_cache[2, slots] = before["swa_v"][2, slots]
    pool.full_kv_pool.k_cache[1, loc] = before["k"][1, loc]
    pool.full_kv_pool.v_cache[1, loc] = before["v"][1, loc]
    for name, buf in pool.buffers().items():
        assert bits_equal(buf, before[name]), name
    assert pool.translate_loc_from_full_to_swa(loc).dtype == torch.int32


def test_without_a_map_window_layers_use_full_locations():
    pool = make_pool("native", size=16, size_swa=16)
    with pytest.raises(RuntimeError, match="no full -> sliding-window mapping"):
        pool.translate_loc_from_full_to_swa(torch.tensor([1], device=DEVICE))
    loc = torch.tensor([3, 9], device=DEVICE)
    k, v = rows(2, 2, 16, 4), rows(2, 2, 16, 5)
    pool.set_kv_buffer(0, loc, k, v)
    assert bits_equal(pool.swa_kv_pool.k_cache[0, loc], k)


def test_moves_translate_window_slots_and_slid_out_tokens_touch_only_padding():
    pool = make_pool("native", size=16, size_swa=8)
    mapping = torch.zeros(17, dtype=torch.int64)
    mapping[torch.tensor([1, 2, 3, 4])] = torch.tensor([5, 6, 0, 7])  # token 3 slid out of the window
    pool.register_mapping(mapping.to(DEVICE))
    for buf in pool.buffers().values():
        buf.copy_(torch.randn(buf.shape).to(buf.dtype))
    before = {name: buf.clone() for name, buf in pool.buffers().items()}
    tgt, src = torch.tensor([4, 3], device=DEVICE), torch.tensor([1, 2], device=DEVICE)
    pool.move_kv_cache(tgt, src)
    assert bits_equal(pool.full_kv_pool.k_cache[:, tgt], before["k"][:, src])
    assert bits_equal(pool.swa_kv_pool.k_cache[:, 7], before["swa_k"][:, 5])  # token 4's slot <- token 1's
    untouched = [s for s in range(pool.size_swa + 1) if s not in (0, 7)]  # 0: token 3's (slid out) target
    assert bits_equal(pool.swa_kv_pool.v_cache[:, untouched], before["swa_v"][:, untouched])


def test_a_model_whose_layers_all_slide_has_no_full_sub_pool():
    pool = make_pool(full=(), swa=(0, 1, 2), size=24, size_swa=8)
    assert pool.full_kv_pool is None and sorted(pool.buffers()) == ["swa_k", "swa_v"]
    assert pool.size_groups() == {"tokens": 24, "swa_tokens": 8}
    assert pool.get_kv_size_bytes() == pool.swa_kv_pool.get_kv_size_bytes()
    assert pool.get_state_buf_infos() == pool.swa_kv_pool.get_contiguous_buf_infos()


class _PoolWithoutIndexMap(MHATokenToKVPool):
    """A vendor-style token pool whose store takes no index map."""

    def set_kv_buffer(self, layer, loc, cache_k, cache_v, k_scale=None, v_scale=None, layer_id_override=None):
        super().set_kv_buffer(layer, loc, cache_k, cache_v, k_scale, v_scale, layer_id_override)


def test_sub_pool_classes_without_an_index_map_get_translated_locations():
    pool = make_pool("native", token_to_kv_pool_class=_PoolWithoutIndexMap, size=16, size_swa=16)
    mapping = torch.arange(17, dtype=torch.int64).flip(0).roll(1)  # 0 -> 0, t -> 17 - t
    pool.register_mapping(mapping.to(DEVICE))
    loc = torch.tensor([2, 5], device=DEVICE)
    k, v = rows(2, 2, 16, 6), rows(2, 2, 16, 7)
    pool.set_kv_buffer(1, loc, k, v)
    assert isinstance(pool.swa_kv_pool, _PoolWithoutIndexMap)
    assert bits_equal(pool.swa_kv_pool.k_cache[1, torch.tensor([15, 12], device=DEVICE)], k)


def test_sizes_bytes_and_buffer_infos_cover_both_sub_pools():
    pool = make_pool("native", swa_head_num=1, swa_head_dim=8, swa_v_head_dim=4)
    k_bytes, v_bytes = pool.get_kv_size_bytes()
    assert k_bytes == pool.full_kv_pool.k_cache.nbytes + pool.swa_kv_pool.k_cache.nbytes
    assert v_bytes == pool.full_kv_pool.v_cache.nbytes + pool.swa_kv_pool.v_cache.nbytes
    assert pool.swa_kv_pool.k_cache.shape[2:] == (1, 8) and pool.swa_kv_pool.v_cache.shape[2:] == (1, 4)
    ptrs, lens, _ = pool.get_contiguous_buf_infos()
    assert len(ptrs) == 2 * 2 + 2 * 4 and sum(lens) == k_bytes + v_bytes


def test_constructor_errors():
    with pytest.raises(ValueError, match="distinct"):
        make_pool(full=(1,), swa=(0, 1))
    with pytest.raises(ValueError, match="must together be layers"):
        make_pool(full=(3,), swa=(0, 1))
    with pytest.raises(ValueError, match="whole pages"):
        make_pool(page_size=4, size_swa=6)
    with pytest.raises(ValueError, match="transposed"):
        make_pool(enable_kvcache_transpose=True)
