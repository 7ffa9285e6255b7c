"""The page-major MHA pool: a page's bytes (all layers, K then V) are one contiguous block at the address the
layout says, the per-layer views read what the store wrote, whole pages move and offload as blocks, and the
plan counts the same bytes per token as the token-major pool."""

from __future__ import annotations

import pytest
import torch
from kvcore_mha import MHATokenToKVPool, PageMajorMHATokenToKVPool

from kvcore import load_config, plan_memory
from kvcore.errors import ConfigError, SelectionError
from kvcore.testing import randomize
from kvcore.testing.tensors import bits_equal, randn_nonzero, test_device

L, H, D, PS, SIZE = 3, 2, 8, 4, 24


def make(dtype=torch.bfloat16, kernels="triton", start_layer=0):
    return PageMajorMHATokenToKVPool(SIZE, PS, dtype, H, D, L, test_device(), start_layer=start_layer, kernels=kernels)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn], ids=["bf16", "fp8"])
@pytest.mark.parametrize("kernels", ["triton", "native"])
def test_a_page_is_one_block_at_the_address_the_layout_gives(dtype, kernels):
    pool = make(dtype, kernels, start_layer=2)
    gen = torch.Generator().manual_seed(1)
    randomize(pool, gen)
    item = pool.kv_cache.element_size()
    page_bytes = L * 2 * PS * H * D * item
    ptrs, lens, items = pool.get_contiguous_buf_infos()
    assert items == [page_bytes] and lens == [(SIZE // PS + 1) * page_bytes] and ptrs == [pool.kv_cache.data_ptr()]
    loc = torch.tensor([5, 6, 13, 22], device=test_device())
    k, v = randn_nonzero((4, H, D), torch.float32, gen, 3.0), randn_nonzero((4, H, D), torch.float32, gen, 3.0)
    pool.set_kv_buffer(3, loc, k, v)  # global layer 3 = local layer 1
    raw = pool.kv_cache.view(torch.uint8).reshape(-1)
    row = H * D * item
    for i, t in enumerate(loc.tolist()):
        page, slot = divmod(t, PS)
        k_at = page * page_bytes + (1 * 2 * PS + slot) * row  # layer 1, K half, the token's slot
        v_at = k_at + PS * row
        assert bits_equal(raw[k_at : k_at + row], k[i].to(dtype).contiguous().view(torch.uint8).reshape(-1))
        assert bits_equal(raw[v_at : v_at + row], v[i].to(dtype).contiguous().view(torch.uint8).reshape(-1))
    # the per-layer views: [pages, page_size, H, D], read back at (page, slot)
    keys, values = pool.get_key_buffer(3), pool.get_value_buffer(3)
    assert keys.shape == values.shape == (SIZE // PS + 1, PS, H, D) and keys.dtype == dtype
    pages, slots = loc // PS, loc % PS
    assert bits_equal(keys[pages, slots], k.to(dtype)) and bits_equal(values[pages, slots], v.to(dtype))


def test_stores_match_the_token_major_pool_byte_for_byte():
    gen = torch.Generator().manual_seed(2)
    pm, tm = make(), MHATokenToKVPool(SIZE, PS, torch.bfloat16, H, D, L, test_device(), False, kernels="triton")
    loc = torch.randperm(SIZE, generator=gen)[:9].to(test_device()) + PS
    for layer in range(L):
        k, v = randn_nonzero((9, H, D), torch.float32, gen), randn_nonzero((9, H, D), torch.float32, gen)
        pm.set_kv_buffer(layer, loc, k, v)
        tm.set_kv_buffer(layer, loc, k, v)
        assert bits_equal(pm.get_key_buffer(layer).reshape(-1, H, D), tm.get_key_buffer(layer))
        assert bits_equal(pm.get_value_buffer(layer).reshape(-1, H, D), tm.get_value_buffer(layer))


def test_whole_pages_move_and_offload_as_blocks():
    pool = make()
    randomize(pool, torch.Generator().manual_seed(3))
    before = pool.kv_cache.clone()
    src, tgt = torch.tensor([2, 5], device=test_device()), torch.tensor([5, 1], device=test_device())  # overlapping
    pool.move_pages(tgt, src)
    assert bits_equal(pool.kv_cache[0, 5], before[0, 2]) and bits_equal(pool.kv_cache[0, 1], before[0, 5])
    # token-level moves of whole pages agree with the block moves
    again = make()
    again.kv_cache.copy_(before)
    tokens = lambda pages: (pages[:, None] * PS + torch.arange(PS, device=test_device())).reshape(-1)  # noqa: E731
    again.move_kv_cache(tokens(tgt), tokens(src))
    assert bits_equal(again.kv_cache, pool.kv_cache)
    # offload: whole pages come back as page blocks and load back anywhere
    copy = pool.get_cpu_copy(tokens(torch.tensor([3, 4], device=test_device())))
    assert set(copy) == {"pages"} and copy["pages"].shape == (2, L, 2, PS, H, D) and copy["pages"].device.type == "cpu"
    pool.load_cpu_copy(copy, tokens(torch.tensor([6, 1], device=test_device())))
    assert bits_equal(pool.kv_cache[0, 6], pool.kv_cache[0, 3]) and bits_equal(pool.kv_cache[0, 1], pool.kv_cache[0, 4])
    assert pool.whole_pages(torch.tensor([4, 5, 6], device=test_device())) is None  # not whole pages: rows instead


def test_plan_counts_the_same_bytes_as_token_major():
    base = ["model=llama-3-8b", "hardware=h200", "kv_cache.page_size=16"]
    pm = plan_memory(load_config(*base, "kv_cache.layout=page_major"))
    tm = plan_memory(load_config(*base))
    assert pm.bytes_per_token == tm.bytes_per_token and pm.max_total_num_tokens == tm.max_total_num_tokens
    (buf,) = pm.layout.buffers
    assert buf.row_shape == (32, 2, 16, 8, 128) and buf.tokens_per_row == 16


def test_layouts_a_backend_does_not_serve_are_refused_by_selection():
    with pytest.raises(SelectionError, match=r"kv_cache.backend='mla' cannot serve this model: .*layout page_major not served"):
        plan_memory(load_config("model=tiny-mla", "kv_cache.layout=page_major", "kv_cache.backend=mla"))
    with pytest.raises(ConfigError, match=r"layout='pages' is not one of: token_major, page_major"):
        load_config("kv_cache.layout=pages")


# -- pages over given memory, virtual pages mapped by their owner ---------------------------------------------------


def make_virtual(dtype=torch.bfloat16, kernels="triton", memory_bytes=None, virtual_pages=9, **kw):
    page_bytes = L * 2 * PS * H * D * dtype.itemsize
    memory = torch.zeros(memory_bytes or (SIZE // PS + 1) * page_bytes + 64, dtype=torch.uint8, device=test_device())
    pool = PageMajorMHATokenToKVPool(SIZE, PS, dtype, H, D, L, test_device(), kernels=kernels, memory=memory,
                                     virtual_pages=virtual_pages, **kw)  # fmt: skip
    return pool, memory, page_bytes


def tokens_of(pages):
    return (pages[:, None] * PS + torch.arange(PS, device=test_device())).reshape(-1)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn], ids=["bf16", "fp8"])
@pytest.mark.parametrize("kernels", ["triton", "native"])
def test_virtual_pages_store_where_they_are_mapped_and_follow_a_move(dtype, kernels):
    """Virtual pages 7 and 2 mapped to physical pages 1 and 4 of the given memory: a store lands in those bytes,
    the reads through translate_loc find it; after the owner moves page 4 to 3 (move_pages, then remap_pages) the
    same virtual tokens read the same rows, and a new store lands on page 3."""
    dev = test_device()
    pool, memory, page_bytes = make_virtual(dtype, kernels)
    assert pool.kv_cache.data_ptr() == memory.data_ptr()
    virtual, physical = torch.tensor([7, 2], device=dev), torch.tensor([1, 4], device=dev)
    pool.remap_pages(virtual, physical)
    gen = torch.Generator().manual_seed(4)
    loc = torch.tensor([29, 30, 8, 11], device=dev)  # virtual page 7 (slots 1, 2), page 2 (slots 0, 3)
    k, v = randn_nonzero((4, H, D), torch.float32, gen, 3.0), randn_nonzero((4, H, D), torch.float32, gen, 3.0)
    pool.set_kv_buffer(1, loc, k, v)
    phys = pool.translate_loc(loc)
    assert phys.tolist() == [1 * PS + 1, 1 * PS + 2, 4 * PS + 0, 4 * PS + 3]
    keys, values = pool.get_key_buffer(1), pool.get_value_buffer(1)
    assert bits_equal(keys[phys // PS, phys % PS], k.to(dtype)) and bits_equal(values[phys // PS, phys % PS], v.to(dtype))
    item = dtype.itemsize
    row = H * D * item
    at = 1 * page_bytes + (1 * 2 * PS + 1) * row  # physical page 1, layer 1, K, slot 1: virtual token 29
    assert bits_equal(memory[at : at + row], k[0].to(dtype).contiguous().view(torch.uint8).reshape(-1))
    # the owner compacts: physical page 4 moves to 3
    pool.move_pages(torch.tensor([3], device=dev), torch.tensor([4], device=dev))
    pool.remap_pages(torch.tensor([2], device=dev), torch.tensor([3], device=dev))
    phys = pool.translate_loc(loc)
    assert phys.tolist()[2:] == [3 * PS + 0, 3 * PS + 3]
    assert bits_equal(keys[phys // PS, phys % PS], k.to(dtype)) and bits_equal(values[phys // PS, phys % PS], v.to(dtype))
    k2 = randn_nonzero((1, H, D), torch.float32, gen, 3.0)
    pool.set_kv_buffer(0, loc[3:], k2, k2)
    assert bits_equal(pool.get_key_buffer(0)[3, 3], k2[0].to(dtype))
    # token moves and offload go through the same table
    pool.remap_pages(torch.tensor([5], device=dev), torch.tensor([2], device=dev))
    pool.move_kv_cache(tokens_of(torch.tensor([5], device=dev)), tokens_of(torch.tensor([2], device=dev)))
    assert bits_equal(pool.kv_cache[0, 2], pool.kv_cache[0, 3])
    copy = pool.get_cpu_copy(tokens_of(torch.tensor([2], device=dev)))
    assert set(copy) == {"pages"} and bits_equal(copy["pages"][0], pool.kv_cache[0, 3].cpu())


@pytest.mark.parametrize("kernels", ["triton", "native"])
def test_an_owner_chooses_the_padding_page(kernels):
    """A unified memory's high side pads on its last page: unmapped virtual pages sit there, not on page 0."""
    dev = test_device()
    last = SIZE // PS
    pool, memory, page_bytes = make_virtual(kernels=kernels, padding_page=last)
    assert pool.translate_loc(torch.tensor([5, 6, 37], device=dev)).tolist() == [last * PS + 1, last * PS + 2,
                                                                                  last * PS + 1]  # fmt: skip
    x = torch.ones(1, H, D, device=dev)
    pool.set_kv_buffer(0, torch.tensor([6], device=dev), x, x)
    written = memory[: (last + 1) * page_bytes].view(last + 1, page_bytes).any(1)
    assert written.tolist() == [False] * last + [True], "an unmapped token wrote outside the padding page"


def test_unmapped_virtual_pages_sit_on_the_padding_page_and_refusals():
    dev = test_device()
    pool, memory, page_bytes = make_virtual()
    assert pool.translate_loc(torch.tensor([5, 6, 37], device=dev)).tolist() == [1, 2, 1]  # page 0, their slots
    x = torch.ones(1, H, D, device=dev)
    pool.set_kv_buffer(0, torch.tensor([6], device=dev), x, x)  # an unmapped token writes the padding page only
    assert not memory[page_bytes:].any()
    plain = make()
    with pytest.raises(ValueError, match="without virtual_pages"):
        plain.remap_pages(torch.tensor([1]), torch.tensor([1]))
    assert plain.translate_loc(torch.tensor([5], device=dev)).tolist() == [5]
    with pytest.raises(ValueError, match="one length"):
        pool.remap_pages(torch.tensor([1, 2], device=dev), torch.tensor([1], device=dev))
    with pytest.raises(ValueError, match="need .* bytes"):
        make_virtual(memory_bytes=page_bytes)
    with pytest.raises(ValueError, match="uint8"):
        PageMajorMHATokenToKVPool(SIZE, PS, torch.bfloat16, H, D, L, test_device(), memory=torch.zeros(10**5, device=dev))
