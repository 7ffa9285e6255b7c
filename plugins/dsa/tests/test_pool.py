"""The DSA pool's own API: the fp8 row through set/get, the indexer accessors, the shape checks.

Triton (interpreted on the CPU) and native pools must agree bit for bit; rows and keys are random, never zero.
These pools live on the CPU, so a compiled run (KVCORE_TEST_COMPILED=1) builds its "triton" pools with the
torch path here: the compiled kernels are checked on CUDA by test_kernels.py, this file checks the pool's API.
"""

from __future__ import annotations

import pytest
import torch

from kvcore.errors import ConfigError
from kvcore.testing.tensors import bits_equal, compiled, randn_nonzero
from kvcore_dsa import kernels
from kvcore_dsa.layout import calculate_mla_kv_cache_dim, dsa_layout, index_page_bytes, scaled_row_bytes
from kvcore_dsa.pool import DSATokenToKVPool, NSATokenToKVPool
from kvcore_mla.pool import MLATokenToKVPool


RANK, ROPE, LAYERS, SIZE = 512, 64, 2, 4 * 64


class Layer:
    def __init__(self, layer_id):
        self.layer_id = layer_id


#: the "triton" pools of this file: interpreted Triton on the CPU, or the torch path in compiled runs (above)
TRITON_ON_CPU = "native" if compiled() else "triton"


def make_pool(dtype=torch.float8_e4m3fn, kernels_mode="triton", index_dtype=None, start_layer=None, **overrides):
    kernels_mode = TRITON_ON_CPU if kernels_mode == "triton" else kernels_mode
    kw = dict(
        size=SIZE, page_size=64, kv_lora_rank=RANK, dtype=dtype, qk_rope_head_dim=ROPE, layer_num=LAYERS,
        device="cpu", index_head_dim=128, enable_memory_saver=False, start_layer=start_layer,
        kernels=kernels_mode, index_dtype=index_dtype,
    )  # fmt: skip
    kw.update(overrides)
    return DSATokenToKVPool(**kw)


def _randomize(pool, seed):
    gen = torch.Generator().manual_seed(seed)
    for buf in pool.buffers().values():
        raw = buf.view(torch.uint8)
        raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=gen))


# -- shapes ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "dtype, index_dtype, row_dim, row_dtype, page_bytes",
    [
        (torch.float8_e4m3fn, None, 656, torch.uint8, 8448),
        (torch.bfloat16, None, 576, torch.bfloat16, 8448),
        (torch.float8_e4m3fn, "bfloat16", 656, torch.uint8, 16384),
        (torch.float8_e5m2, "fp8", 576, torch.uint8, 8448),  # only e4m3fn gets the scaled row, as in SGLang
    ],
)
def test_buffers_and_layout(dtype, index_dtype, row_dim, row_dtype, page_bytes):
    pool = make_pool(dtype, index_dtype=index_dtype)
    assert pool.kv_cache.shape == (LAYERS, SIZE + 64, 1, row_dim) and pool.kv_cache.dtype == row_dtype
    assert pool.index_k_with_scale_cache.shape == (LAYERS, (SIZE + 64 + 1) // 64, page_bytes)
    assert set(pool.buffers()) == {"kv", "index_k"} and set(pool.token_buffers()) == {"kv"}
    assert pool.get_kv_size_bytes() == pool.kv_cache.nbytes + pool.index_k_with_scale_cache.nbytes
    assert pool.mem_usage * 2**30 == pytest.approx(pool.get_kv_size_bytes())
    ptrs, lens, items = pool.get_state_buf_infos()
    assert lens == [page_bytes * pool.index_k_with_scale_cache.shape[1]] * LAYERS and items == [page_bytes] * LAYERS
    assert ptrs[1] == pool.index_k_with_scale_buffer[1].data_ptr()
    layout = dsa_layout(backend="dsa", page_size=64, dtype=dtype, kv_lora_rank=RANK, qk_rope_head_dim=ROPE,
                        index_head_dim=128, layer_num=LAYERS, index_dtype=index_dtype)  # fmt: skip
    declared = layout.by_name()
    assert declared["kv"].shape(SIZE) == tuple(pool.kv_cache.shape)
    assert declared["index_k"].shape(SIZE) == tuple(pool.index_k_with_scale_cache.shape)
    assert layout.total_bytes({"tokens": SIZE}) == pool.get_kv_size_bytes()


@pytest.mark.parametrize("dtype, scaled", [(torch.float8_e4m3fn, True), (torch.bfloat16, False)])
def test_sglang_dsa_names_and_their_nsa_aliases(dtype, scaled):
    pool = make_pool(dtype, kernels_mode="native")
    assert pool.dsa_kv_cache_store_fp8 is scaled and pool.nsa_kv_cache_store_fp8 is scaled
    assert NSATokenToKVPool is DSATokenToKVPool
    mla = MLATokenToKVPool(size=64, page_size=1, dtype=torch.float8_e4m3fn, kv_lora_rank=RANK, qk_rope_head_dim=ROPE,
                           layer_num=1, device="cpu", enable_memory_saver=False, kernels="native")  # fmt: skip
    assert mla.dsa_kv_cache_store_fp8 is False and mla.nsa_kv_cache_store_fp8 is False


def test_calculate_mla_kv_cache_dim():
    assert calculate_mla_kv_cache_dim(512, 64, torch.float8_e4m3fn, is_dsa=True) == 656
    assert calculate_mla_kv_cache_dim(512, 64, torch.float8_e4m3fn, is_dsa=False) == 576
    assert calculate_mla_kv_cache_dim(512, 64, torch.bfloat16, is_dsa=True) == 576
    assert calculate_mla_kv_cache_dim(256, 32, torch.float8_e4m3fn, is_dsa=True) == 256 + 8 + 64
    assert scaled_row_bytes(512, 64) == 656
    assert index_page_bytes(torch.float8_e4m3fn) == 64 * 128 + 64 * 4 == 8448
    assert index_page_bytes(torch.bfloat16) == 64 * 128 * 2 == 16384
    with pytest.raises(ConfigError, match="multiple of 128"):
        calculate_mla_kv_cache_dim(500, 64, torch.float8_e4m3fn, is_dsa=True)


@pytest.mark.parametrize("page_size", [1, 16, 32, 128])
def test_page_size_other_than_64_is_a_config_error(page_size):
    message = r"kv_cache\.page_size must be 64 for DSA \(the indexer's page\)"
    with pytest.raises(ConfigError, match=message):
        make_pool(page_size=page_size, size=4 * 128)
    with pytest.raises(ConfigError, match=message):
        dsa_layout(backend="dsa", page_size=page_size, dtype=torch.bfloat16, kv_lora_rank=RANK,
                   qk_rope_head_dim=ROPE, index_head_dim=128, layer_num=LAYERS)  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.bfloat16])
def test_kv_lora_rank_must_be_a_multiple_of_128(dtype):
    with pytest.raises(ConfigError, match=r"kv_lora_rank=320 must be a multiple of 128"):
        make_pool(dtype, kv_lora_rank=320)
    with pytest.raises(ConfigError, match=r"index_head_dim=64 must be 128"):
        make_pool(dtype, index_head_dim=64)
    with pytest.raises(ConfigError, match=r"index_dtype='int8' is not one of"):
        make_pool(dtype, index_dtype="int8")


# -- latent rows ---------------------------------------------------------------------------------------------


def _parts(n, seed, dtype=torch.bfloat16):
    gen = torch.Generator().manual_seed(seed)
    fused = randn_nonzero((n, 1, RANK + ROPE + 5), torch.float32, gen, 4.0, "cpu").to(dtype)
    return fused[..., :RANK], fused[..., RANK : RANK + ROPE], fused[..., : RANK + ROPE]


@pytest.mark.parametrize("n", [1, 7, 33])
def test_fp8_set_get_through_the_pool(n):
    pools = {mode: make_pool(kernels_mode=mode, start_layer=3) for mode in ("triton", "native")}
    for pool in pools.values():
        _randomize(pool, 0)
    gen = torch.Generator().manual_seed(n)
    loc = (torch.randperm(SIZE, generator=gen)[:n] + 64).to(torch.int32)
    nope, rope, row = _parts(n, n)
    for pool in pools.values():
        pool.set_mla_kv_buffer(Layer(4), loc, nope, rope)
    assert bits_equal(pools["triton"].kv_cache, pools["native"].kv_cache)
    want = kernels.quantize_concatenated(row, RANK)
    assert bits_equal(pools["triton"].kv_cache[1, loc.long()], want)
    # The key buffer view is the raw row as fp8, the value buffer its nope part.
    assert pools["triton"].get_key_buffer(4).shape == (SIZE + 64, 1, 656)
    assert pools["triton"].get_value_buffer(4).shape == (SIZE + 64, 1, RANK)

    for dst in (None, torch.float32, torch.float16, torch.bfloat16):
        got = pools["triton"].get_mla_kv_buffer(4, loc, dst)
        ref = pools["native"].get_mla_kv_buffer(4, loc, dst)
        want_nope, want_rope = kernels.dequantize_rows(want[:, 0], RANK, ROPE, dst or torch.bfloat16)
        assert got[0].shape == (n, 1, RANK) and got[1].shape == (n, 1, ROPE)
        assert bits_equal(got[0], ref[0]) and bits_equal(got[1], ref[1])
        assert bits_equal(got[0][:, 0], want_nope) and bits_equal(got[1][:, 0], want_rope)
    assert bits_equal(pools["triton"].get_mla_kv_buffer(4, loc)[1][:, 0], rope[:, 0])  # rope exact


def test_fp8_set_kv_buffer_quantizes_concatenated_rows_and_copies_quantized_bytes():
    pool, other = make_pool(), make_pool()
    n = 9
    loc = torch.arange(64, 64 + 2 * n, 2)
    nope, rope, row = _parts(n, 3)
    pool.set_mla_kv_buffer(1, loc, nope, rope)
    other.set_kv_buffer(1, loc, row, None)  # [N, 1, 576] concatenated
    assert bits_equal(other.kv_cache, pool.kv_cache)
    other.kv_cache.zero_()
    other.set_kv_buffer(1, loc, row.reshape(n, RANK + ROPE).float(), None)  # [N, 576] float32
    assert bits_equal(other.kv_cache, pool.kv_cache)
    quantized = pool.kv_cache[1, loc].clone()
    other.kv_cache.zero_()
    other.set_kv_buffer(1, loc + 1, quantized.view(torch.float8_e4m3fn), None)  # already in the row format
    assert bits_equal(other.kv_cache[1, loc + 1], quantized)
    with pytest.raises(ValueError, match="scales"):
        other.set_kv_buffer(1, loc, row, None, k_scale=2.0)
    with pytest.raises(ValueError, match="576"):
        other.set_kv_buffer(1, loc, row[..., :500], None)


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.bfloat16], ids=["fp8", "bf16"])
def test_layer_id_override_on_both_writes(dtype):
    by_id, by_override = make_pool(dtype, "native", start_layer=3), make_pool(dtype, "native", start_layer=3)
    loc = torch.tensor([64, 130, 65])
    nope, rope, row = (t.cpu() for t in _parts(3, 5))  # the pools are CPU pools in both test modes
    by_id.set_mla_kv_buffer(4, loc, nope, rope)
    by_override.set_mla_kv_buffer(None, loc, nope, rope, layer_id_override=4)
    assert bits_equal(by_override.kv_cache, by_id.kv_cache)
    by_id.set_kv_buffer(3, loc, row, None)
    by_override.set_kv_buffer(Layer(4), loc, row, None, layer_id_override=3)
    assert bits_equal(by_override.kv_cache, by_id.kv_cache)
    assert not bits_equal(by_id.kv_cache[0], torch.zeros_like(by_id.kv_cache[0]))


def test_bf16_pool_is_plain_mla():
    pool = make_pool(torch.bfloat16)
    n = 7
    loc = torch.arange(70, 70 + n)
    nope, rope, row = _parts(n, 4)
    pool.set_mla_kv_buffer(0, loc, nope, rope)
    assert bits_equal(pool.kv_cache[0, loc], row)
    got_nope, got_rope = pool.get_mla_kv_buffer(0, loc)
    assert bits_equal(got_nope, nope.contiguous()) and bits_equal(got_rope, rope.contiguous())


def _index_entries(pool, layer, fp8):
    """Every token's indexer key (and scale) bytes in token order, read through the pool's public accessor
    over all pages: ``[tokens, key bytes (+ 4)]``."""
    pages = pool.index_k_with_scale_cache.shape[1]
    table = torch.arange(pages, dtype=torch.int32)
    keys = pool.get_index_k_continuous(layer, pages * 64, table).view(torch.uint8).reshape(pages * 64, -1)
    if not fp8:
        return keys
    return torch.cat([keys, pool.get_index_k_scale_continuous(layer, pages * 64, table)], dim=1)


@pytest.mark.parametrize("index_dtype", [None, "bfloat16"], ids=["fp8", "bf16"])
@pytest.mark.parametrize("mode", ["triton", "native"])
def test_move_carries_latent_rows_and_indexer_keys(index_dtype, mode):
    """A move (here a chain across a page boundary: 64 -> 65 -> 200, 130 -> 64) takes each token's latent
    row and its indexer key and scale along, in every layer, and changes nothing else."""
    pool = make_pool(kernels_mode=mode, index_dtype=index_dtype)
    _randomize(pool, 5)
    fp8 = index_dtype is None
    src, tgt = torch.tensor([64, 65, 130]), torch.tensor([65, 200, 64])
    kv_before = pool.kv_cache.clone()
    index_before = [_index_entries(pool, layer, fp8) for layer in range(LAYERS)]
    pool.move_kv_cache(tgt, src)
    want = kv_before.clone()
    want[:, tgt] = kv_before[:, src]
    assert bits_equal(pool.kv_cache, want)
    for layer in range(LAYERS):
        want = index_before[layer].clone()
        want[tgt] = index_before[layer][src]
        assert bits_equal(_index_entries(pool, layer, fp8), want)


@pytest.mark.parametrize("index_dtype", [None, "bfloat16"], ids=["fp8", "bf16"])
def test_cpu_copy_carries_indexer_keys(index_dtype):
    pool = make_pool(index_dtype=index_dtype)
    _randomize(pool, 8)
    fp8 = index_dtype is None
    src, dst = torch.tensor([64, 127, 128, 250]), torch.tensor([300, 66, 129, 191])
    saved = [_index_entries(pool, layer, fp8)[src] for layer in range(LAYERS)]
    copy = pool.get_cpu_copy(src)
    assert set(copy) == ({"kv", "index_k", "index_k_scale"} if fp8 else {"kv", "index_k"})
    _randomize(pool, 9)
    pool.load_cpu_copy(copy, dst)
    for layer in range(LAYERS):
        assert bits_equal(_index_entries(pool, layer, fp8)[dst], saved[layer])


# -- indexer -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("index_dtype", [None, "bfloat16"], ids=["fp8", "bf16"])
@pytest.mark.parametrize("mode", ["triton", "native"])
def test_index_accessors_at_page_boundaries(index_dtype, mode):
    pool = make_pool(kernels_mode=mode, index_dtype=index_dtype, start_layer=2)
    _randomize(pool, 6)
    gen = torch.Generator().manual_seed(7)
    seq_len = 129  # tokens 0, 63 | 64, 65, 127 | 128 cross two page boundaries
    page_table = (torch.randperm(4, generator=gen)[:3] + 1).to(torch.int32)  # pages 1..4 (0 is padding)
    i = torch.arange(seq_len)
    loc = page_table.long()[i // 64] * 64 + i % 64
    keys = randn_nonzero((seq_len, 128), torch.float32, gen, 3.0, "cpu")
    fp8 = index_dtype is None
    keys = keys.to(torch.float8_e4m3fn) if fp8 else keys.to(torch.bfloat16)
    scales = torch.rand(seq_len, generator=gen) + 0.01
    pool.set_index_k_scale_buffer(3, loc, keys, scales if fp8 else None)

    got_keys = pool.get_index_k_continuous(Layer(3), seq_len, page_table)
    if fp8:
        assert got_keys.dtype == torch.uint8 and got_keys.shape == (seq_len, 128)
        assert bits_equal(got_keys, keys.view(torch.uint8))
        got_scales = pool.get_index_k_scale_continuous(3, seq_len, page_table)
        assert got_scales.shape == (seq_len, 4) and bits_equal(got_scales.view(torch.float32)[:, 0], scales)
        fused = pool.get_index_k_scale_buffer(3, seq_len, page_table)
        assert bits_equal(fused[0], got_keys) and bits_equal(fused[1], got_scales)
    else:
        assert bits_equal(got_keys, keys)
        with pytest.raises(ValueError, match="no scales"):
            pool.get_index_k_scale_continuous(3, seq_len, page_table)
        with pytest.raises(ValueError, match="no scales"):
            pool.set_index_k_scale_buffer(3, loc, keys, scales)
    # The boundary tokens sit where the format says.
    page_buf = pool.get_index_k_with_scale_buffer(3)
    key_bytes = 128 if fp8 else 256
    for t in (0, 63, 64, 65, 127, 128):
        page, slot = int(page_table[t // 64]), t % 64
        assert int(loc[t]) == page * 64 + slot
        assert bits_equal(page_buf[page, slot * key_bytes : (slot + 1) * key_bytes], keys[t].view(torch.uint8))
        if fp8:
            assert bits_equal(page_buf[page, 8192 + 4 * slot : 8196 + 4 * slot], scales[t : t + 1].view(torch.uint8))
    # The other layer is untouched.
    other = make_pool(kernels_mode=mode, index_dtype=index_dtype, start_layer=2)
    _randomize(other, 6)
    assert bits_equal(pool.index_k_with_scale_cache[0], other.index_k_with_scale_cache[0])


def test_index_rejects_wrong_inputs():
    pool = make_pool()
    loc = torch.tensor([64, 65])
    keys = torch.ones(2, 128).to(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="index_k_scale"):
        pool.set_index_k_scale_buffer(0, loc, keys, None)
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        pool.set_index_k_scale_buffer(0, loc, keys.float(), torch.ones(2))
    with pytest.raises(ValueError, match="index_head_dim"):
        pool.set_index_k_scale_buffer(0, loc, keys[:, :64], torch.ones(2))
    with pytest.raises(IndexError, match="layer"):
        pool.set_index_k_scale_buffer(LAYERS, loc, keys, torch.ones(2))


def test_self_test_write_writes_both_buffers():
    for dtype, index_dtype in ((torch.float8_e4m3fn, None), (torch.bfloat16, "bfloat16")):
        pool = make_pool(dtype, index_dtype=index_dtype)
        _randomize(pool, 8)
        fp8 = index_dtype is None
        index_before = pool.index_k_with_scale_cache.clone()
        entries_before = _index_entries(pool, 1, fp8)
        loc = torch.tensor([64, 127, 128, 200])
        expected = pool.self_test_write(1, loc, torch.Generator().manual_seed(1))
        assert set(expected) == ({"kv", "index_k", "index_k_scale"} if fp8 else {"kv", "index_k"})
        assert bits_equal(pool.kv_cache[1, loc], expected["kv"])
        # The indexer rows returned are the ones now read back through the pool's accessors, at loc only.
        written = torch.cat([expected["index_k"], expected["index_k_scale"]], dim=1) if fp8 else expected["index_k"]
        want = entries_before.clone()
        want[loc] = written
        assert bits_equal(_index_entries(pool, 1, fp8), want)
        assert not torch.equal(pool.index_k_with_scale_cache[1], index_before[1])
        assert torch.equal(pool.index_k_with_scale_cache[0], index_before[0])
