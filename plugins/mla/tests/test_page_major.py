"""The page-major MLA pool: its stores and reads give what the token-major pool's give for the same inputs, a
page's bytes (all layers) are one contiguous block at the address the layout says, whole pages move and offload as
blocks, and over given memory with virtual pages the data follows the owner's moves and remaps byte for byte; the
conformance kit runs on it plainly and through shuffled virtual pages."""

from __future__ import annotations

import pytest
import torch
from kvcore_mla import MLATokenToKVPool, PageMajorMLATokenToKVPool, mla_layout

from kvcore.testing import KVCacheConformance, Variant, randomize
from kvcore.testing.tensors import bits_equal, randn_nonzero, test_device
from kvcore.pools import KVWriteLoc

# a 40 + 8 = 48-wide latent row: not a power of two, so the concatenated store splits it (32 + 16)
RANK, ROPE, L = 40, 8, 3
WIDTH = RANK + ROPE
DTYPES = [torch.bfloat16, torch.float8_e4m3fn]
DTYPE_IDS = ["bf16", "fp8"]


def make(size, page_size, dtype=torch.bfloat16, kernels="triton", start_layer=0, **kw):
    return PageMajorMLATokenToKVPool(size, page_size, dtype, RANK, ROPE, L, test_device(), start_layer=start_layer,
                                     kernels=kernels, **kw)  # fmt: skip


def tokens_of(pages: torch.Tensor, page_size: int) -> torch.Tensor:
    """Every token of ``pages``, page after page."""
    return (pages[:, None] * page_size + torch.arange(page_size, device=pages.device)).reshape(-1)


def as_raw(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous().view(torch.uint8).reshape(-1)


@pytest.mark.parametrize("bundled", [False, True], ids=["loc", "KVWriteLoc"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("kernels", ["triton", "native"])
def test_stores_and_reads_match_the_token_major_pool(dtype, page_size, kernels, bundled):
    """Both writes (split and concatenated) of an odd number of tokens in every layer leave each layer's paged
    view holding the token-major pool's rows, byte for byte, and every read returns the token-major pool's; the
    same with the tokens in a KVWriteLoc (marked physical for the page-major pool, whose tokens are)."""
    size = 13 if page_size == 1 else 3 * page_size
    gen = torch.Generator().manual_seed(page_size)
    pm = make(size, page_size, dtype, kernels, start_layer=2)
    tm = MLATokenToKVPool(size, page_size, dtype, RANK, ROPE, L, test_device(), False, start_layer=2, kernels=kernels)
    loc = (torch.randperm(size, generator=gen)[:7] + page_size).to(test_device())
    for layer in range(2, 2 + L):
        wide = randn_nonzero((7, 1, WIDTH + 5), torch.float32, gen, 3.0)  # nope / rope as strided views of it
        nope, rope = wide[..., :RANK], wide[..., RANK:WIDTH]
        for pool, physical in ((pm, True), (tm, False)):
            pool.set_mla_kv_buffer(layer, KVWriteLoc(loc, physical=physical) if bundled else loc, nope, rope)
        concat = randn_nonzero((7, 1, WIDTH), torch.float32, gen, 3.0)
        for pool, physical in ((pm, True), (tm, False)):
            pool.set_kv_buffer(layer, KVWriteLoc(loc[:4], physical=physical) if bundled else loc[:4], concat[:4], None)
    for layer in range(2, 2 + L):
        keys, values = pm.get_key_buffer(layer), pm.get_value_buffer(layer)
        assert keys.shape == (size // page_size + 1, page_size, 1, WIDTH) and keys.dtype == dtype
        assert values.shape == (size // page_size + 1, page_size, 1, RANK) and values.data_ptr() == keys.data_ptr()
        assert bits_equal(keys.reshape(-1, 1, WIDTH), tm.get_key_buffer(layer))
        assert bits_equal(values.reshape(-1, 1, RANK), tm.get_value_buffer(layer))
        for dst in (None, torch.float32):
            where = KVWriteLoc(loc, physical=True) if bundled else loc
            for got, want in zip(pm.get_mla_kv_buffer(layer, where, dst), tm.get_mla_kv_buffer(layer, loc, dst)):
                assert bits_equal(got, want)
        out = (torch.empty(7, 1, RANK, dtype=dtype, device=test_device()),
               torch.empty(7, 1, ROPE, dtype=dtype, device=test_device()))  # fmt: skip
        assert pm.get_mla_kv_buffer(layer, loc.int(), out=out) is out
        assert bits_equal(torch.cat(out, -1), tm.get_key_buffer(layer)[loc])


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_a_page_is_one_block_at_the_address_the_layout_gives(dtype):
    size, page = 12, 4
    pool = make(size, page, dtype, start_layer=1)
    layout = mla_layout(backend="mla", page_size=page, dtype=dtype, kv_lora_rank=RANK, qk_rope_head_dim=ROPE,
                        layer_num=L, page_major=True)  # fmt: skip
    token_major = mla_layout(backend="mla", page_size=page, dtype=dtype, kv_lora_rank=RANK, qk_rope_head_dim=ROPE,
                             layer_num=L)  # fmt: skip
    (buf,) = layout.buffers
    assert tuple(pool.kv_cache.shape) == buf.shape(size) == (1, size // page + 1, L, page, WIDTH)
    assert pool.kv_cache.dtype == buf.dtype and layout.bytes_per_token == token_major.bytes_per_token
    randomize(pool, torch.Generator().manual_seed(1))
    page_bytes = L * page * WIDTH * dtype.itemsize
    ptrs, lens, items = pool.get_contiguous_buf_infos()
    assert ptrs == [pool.kv_cache.data_ptr()] and lens == [(size // page + 1) * page_bytes] and items == [page_bytes]
    loc = torch.tensor([5, 6, 13, 15], device=test_device())
    rows = randn_nonzero((4, 1, WIDTH), torch.float32, torch.Generator().manual_seed(2), 3.0)
    pool.set_mla_kv_buffer(3, loc, rows[..., :RANK], rows[..., RANK:])  # global layer 3 = local layer 2
    raw, row = pool.kv_cache.view(torch.uint8).reshape(-1), WIDTH * dtype.itemsize
    for i, t in enumerate(loc.tolist()):
        at = (t // page) * page_bytes + (2 * page + t % page) * row  # the page, layer 2, the token's slot
        assert bits_equal(raw[at : at + row], as_raw(rows[i].to(dtype)))


def test_whole_pages_move_and_offload_as_blocks():
    page = 4
    pool = make(24, page)
    randomize(pool, torch.Generator().manual_seed(3))
    before = pool.kv_cache.clone()
    src, tgt = torch.tensor([2, 5], device=test_device()), torch.tensor([5, 1], device=test_device())  # overlapping
    pool.move_pages(tgt, src)
    assert bits_equal(pool.kv_cache[0, 5], before[0, 2]) and bits_equal(pool.kv_cache[0, 1], before[0, 5])
    again = make(24, page)
    again.kv_cache.copy_(before)
    again.move_kv_cache(tokens_of(tgt, page), tokens_of(src, page))  # token moves of whole pages: the same bytes
    assert bits_equal(again.kv_cache, pool.kv_cache)
    copy = pool.get_cpu_copy(tokens_of(torch.tensor([3, 4], device=test_device()), page))
    assert set(copy) == {"pages"} and copy["pages"].shape == (2, L, page, WIDTH) and copy["pages"].device.type == "cpu"
    pool.load_cpu_copy(copy, tokens_of(torch.tensor([6, 1], device=test_device()), page))
    assert bits_equal(pool.kv_cache[0, 6], pool.kv_cache[0, 3]) and bits_equal(pool.kv_cache[0, 1], pool.kv_cache[0, 4])
    partial = torch.tensor([4, 5, 6], device=test_device())
    assert pool.whole_pages(partial) is None  # not whole pages: rows instead
    rows = pool.get_cpu_copy(partial)
    assert set(rows) == {"kv"}
    with pytest.raises(ValueError, match="whole pages"):
        pool.load_cpu_copy(copy, partial)


# -- pages over given memory, virtual pages mapped by their owner ---------------------------------------------------


def make_virtual(dtype=torch.bfloat16, kernels="triton", page=4, pages=6, virtual_pages=9, memory_bytes=None,
                 start_layer=0):  # fmt: skip
    """A pool of ``pages`` pages laid over zeroed memory (64 bytes more than it needs), none of its virtual pages
    mapped: (pool, memory, bytes of a page of all layers)."""
    page_bytes = L * page * WIDTH * dtype.itemsize
    memory = torch.zeros(memory_bytes or (pages + 1) * page_bytes + 64, dtype=torch.uint8, device=test_device())
    pool = make(pages * page, page, dtype, kernels, start_layer, memory=memory, virtual_pages=virtual_pages)
    return pool, memory, page_bytes


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("kernels", ["triton", "native"])
def test_virtual_pages_store_where_they_are_mapped_and_follow_a_move(dtype, kernels):
    """Virtual pages 7 and 2 mapped to physical pages 1 and 4 of the given memory: a store lands in those bytes and
    reads back by virtual token; after the owner moves page 4 to 3 (move_pages, then remap_pages) the same virtual
    tokens read the same bytes, and a new store lands on page 3."""
    dev, page = test_device(), 4
    pool, memory, page_bytes = make_virtual(dtype, kernels)
    assert pool.kv_cache.data_ptr() == memory.data_ptr()
    pool.remap_pages(torch.tensor([7, 2], device=dev), torch.tensor([1, 4], device=dev))
    gen = torch.Generator().manual_seed(4)
    loc = torch.tensor([29, 30, 8, 11], device=dev)  # virtual page 7 (slots 1, 2), page 2 (slots 0, 3)
    rows = randn_nonzero((4, 1, WIDTH), torch.float32, gen, 3.0)
    pool.set_mla_kv_buffer(1, loc, rows[..., :RANK], rows[..., RANK:])
    phys = pool.translate_loc(loc)
    assert phys.tolist() == [1 * page + 1, 1 * page + 2, 4 * page + 0, 4 * page + 3]
    keys = pool.get_key_buffer(1)
    assert bits_equal(keys[phys // page, phys % page], rows.to(dtype))
    at = 1 * page_bytes + (1 * page + 1) * WIDTH * dtype.itemsize  # physical page 1, layer 1, slot 1: token 29
    assert bits_equal(memory[at : at + WIDTH * dtype.itemsize], as_raw(rows[0].to(dtype)))
    read = torch.cat(pool.get_mla_kv_buffer(1, loc), -1)
    assert bits_equal(read, rows.to(dtype))
    # the owner compacts: physical page 4 moves to 3; the virtual tokens read the same bytes from there
    pool.move_pages(torch.tensor([3], device=dev), torch.tensor([4], device=dev))
    pool.remap_pages(torch.tensor([2], device=dev), torch.tensor([3], device=dev))
    assert pool.translate_loc(loc).tolist()[2:] == [3 * page + 0, 3 * page + 3]
    assert bits_equal(torch.cat(pool.get_mla_kv_buffer(1, loc), -1), read)
    new = randn_nonzero((1, 1, WIDTH), torch.float32, gen, 3.0)
    pool.set_kv_buffer(0, loc[3:], new, None)
    assert bits_equal(pool.get_key_buffer(0)[3, 3], new[0].to(dtype))
    # token moves and offload go through the same table
    pool.remap_pages(torch.tensor([5], device=dev), torch.tensor([2], device=dev))
    pool.move_kv_cache(tokens_of(torch.tensor([5], device=dev), page), tokens_of(torch.tensor([2], device=dev), page))
    assert bits_equal(pool.kv_cache[0, 2], pool.kv_cache[0, 3])
    copy = pool.get_cpu_copy(tokens_of(torch.tensor([2], device=dev), page))
    assert set(copy) == {"pages"} and bits_equal(copy["pages"][0], pool.kv_cache[0, 3].cpu())


def test_unmapped_virtual_pages_sit_on_the_padding_page_and_refusals():
    dev = test_device()
    pool, memory, page_bytes = make_virtual()
    assert pool.translate_loc(torch.tensor([5, 6, 37], device=dev)).tolist() == [1, 2, 1]  # page 0, their slots
    x = torch.ones(2, 1, WIDTH, device=dev)
    pool.set_kv_buffer(2, torch.tensor([6, 37], device=dev), x, None)  # unmapped tokens write the padding page only
    assert memory[:page_bytes].any() and not memory[page_bytes:].any()
    pool.remap_pages(torch.tensor([1], device=dev), torch.tensor([2], device=dev))
    pool.remap_pages(torch.tensor([1], device=dev), torch.tensor([0], device=dev))  # freed: back on the padding page
    pool.set_kv_buffer(2, torch.tensor([5], device=dev), x[:1], None)
    assert not memory[page_bytes:].any()
    # the refusals of remap_pages and of too little memory are kvcore.pools.PageMajorPages's, tested with the MHA pool
    with pytest.raises(ValueError, match="uint8"):
        make(24, 4, memory=torch.zeros(10**5, device=dev))
    with pytest.raises(ValueError, match="boundary"):
        make(24, 4, memory=torch.zeros(10**5, dtype=torch.uint8, device=dev)[1:])


# -- the conformance kit ---------------------------------------------------------------------------------------------

VARIANTS = [Variant("bfloat16", "triton", 1), Variant("float8_e4m3fn", "triton", 4), Variant("float32", "native", 16),
            Variant("float8_e5m2", "native", 4)]  # fmt: skip


class TestPageMajorMLAConformance(KVCacheConformance):
    """The kit on the pool and its declared layout (no backend serves kv_cache.layout=page_major for MLA yet)."""

    variants = VARIANTS

    @pytest.fixture
    def kv_layout(self, kv_variant):
        return mla_layout(backend="mla", page_size=kv_variant.page_size, dtype=getattr(torch, kv_variant.dtype),
                          kv_lora_rank=RANK, qk_rope_head_dim=ROPE, layer_num=L, page_major=True)  # fmt: skip

    @pytest.fixture
    def kv_pool_factory(self, kv_variant):
        def build(size, page_size, start_layer):
            return make(size, page_size, getattr(torch, kv_variant.dtype), kv_variant.kernels, start_layer)

        return build


class TestVirtualPageMajorMLAConformance(TestPageMajorMLAConformance):
    """The same, the pool laid over given memory with its virtual pages mapped to shuffled physical pages: every
    store, move, offload and check goes through the virtual -> physical table."""

    variants = VARIANTS[:2]

    @pytest.fixture
    def kv_pool_factory(self, kv_variant):
        def build(size, page_size, start_layer):
            pages = size // page_size
            pool, _, _ = make_virtual(getattr(torch, kv_variant.dtype), kv_variant.kernels, page_size, pages, pages,
                                      start_layer=start_layer)  # fmt: skip
            physical = torch.randperm(pages, generator=torch.Generator().manual_seed(size + start_layer)) + 1
            pool.remap_pages(torch.arange(1, pages + 1, device=test_device()), physical.to(test_device()))
            return pool

        return build
