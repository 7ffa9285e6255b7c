"""The MLA pool against kvcore's conformance kit, used exactly as a vendor would use it, plus the MLA-specific
surface of the pool (split store, gather, SGLang-style accessors)."""

import pytest
import torch
from kvcore_mla.layout import mla_layout
from kvcore_mla.pool import MLATokenToKVPool

from kvcore.testing import BaseStoreTests, KVCacheConformance, Variant, assert_same_bytes, randomize
from kvcore.testing.tensors import bits_equal, randn_nonzero, test_device

KV_LORA_RANK, ROPE_DIM, LAYERS = 64, 16, 3


def make_pool(dtype, kernels, size=61, page_size=1, start_layer=0, **kw):
    return MLATokenToKVPool(
        size=size, page_size=page_size, dtype=dtype, kv_lora_rank=KV_LORA_RANK, qk_rope_head_dim=ROPE_DIM,
        layer_num=LAYERS, device=test_device(), enable_memory_saver=False, start_layer=start_layer, kernels=kernels, **kw,
    )  # fmt: skip


# tiny-mla shrunk to 3 layers of 64 + 16 latent values, so the kernels see odd sizes.
SMALL_MODEL = ["model=tiny-mla", "model.num_hidden_layers=3", f"model.mla.kv_lora_rank={KV_LORA_RANK}",
               f"model.mla.qk_rope_head_dim={ROPE_DIM}"]  # fmt: skip


class TestMLAConformance(KVCacheConformance):
    """The kit builds the pools and the layout from the backend's name and the small model."""

    backend = "mla"
    config = SMALL_MODEL
    variants = [Variant("bfloat16", "triton", 1), Variant("float8_e4m3fn", "triton", 4), Variant("float32", "native", 1),
                Variant("float8_e5m2", "native", 16), Variant("float16", "triton", 16)]  # fmt: skip


def concat_writer(pool, layer, loc, generator):
    """Writes through set_kv_buffer (already concatenated rows) instead of the split store."""
    width = pool.kv_lora_rank + pool.qk_rope_head_dim
    rows = randn_nonzero((loc.numel(), 1, width), torch.float32, generator, 4.0, device=pool.device)
    pool.set_kv_buffer(layer, loc, rows, None)
    return {"kv": rows.to(pool.dtype).view(pool.store_dtype)}


class TestMLAConcatenatedWrites(BaseStoreTests):
    """The kit's store tests again, writing with set_kv_buffer (fp8 from float32, on the Triton path)."""

    backend = "mla"
    config = SMALL_MODEL
    variants = [Variant("float8_e4m3fn", "triton", 1)]

    @pytest.fixture
    def kv_writer(self):
        return concat_writer


# ==========================================================================================================
# MLA-specific pool surface
# ==========================================================================================================


class Layer:
    def __init__(self, layer_id):
        self.layer_id = layer_id


DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn, torch.float8_e5m2]


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_split_and_concatenated_writes_and_both_kernel_modes_agree(dtype):
    gen = torch.Generator().manual_seed(1)
    pools = {k: make_pool(dtype, k, start_layer=2) for k in ("triton", "native")}
    concat = make_pool(dtype, "triton", start_layer=2)
    for p in (*pools.values(), concat):
        p.kv_cache.view(torch.uint8).copy_(torch.randint(0, 256, p.kv_cache.view(torch.uint8).shape, dtype=torch.uint8,
                                                         generator=torch.Generator().manual_seed(9)).to(p.device))  # fmt: skip
    n = 7
    loc = (torch.randperm(60, generator=gen)[:n].int() + 1).to(test_device())
    kv_a = randn_nonzero((n, 1, KV_LORA_RANK + ROPE_DIM + 2), torch.float32, gen, 20.0)
    nope, rope = kv_a[..., :KV_LORA_RANK], kv_a[..., KV_LORA_RANK : KV_LORA_RANK + ROPE_DIM]
    before = kv_a.clone()
    for p in pools.values():
        p.set_mla_kv_buffer(Layer(4), loc, nope, rope)
    concat.set_kv_buffer(4, loc, torch.cat([nope, rope], -1), None)
    assert bits_equal(kv_a, before)
    assert_same_bytes(pools["triton"].kv_cache, pools["native"].kv_cache, "triton vs native split store")
    assert_same_bytes(concat.kv_cache, pools["native"].kv_cache, "concatenated vs split store")

    want = torch.cat([nope, rope], -1).to(dtype)
    pool = pools["triton"]
    key = pool.get_key_buffer(4)
    value = pool.get_value_buffer(Layer(4))
    assert key.dtype == dtype and key.shape == (62, 1, KV_LORA_RANK + ROPE_DIM)
    assert value.dtype == dtype and value.shape == (62, 1, KV_LORA_RANK)
    assert value.data_ptr() == key.data_ptr()
    assert bits_equal(key[loc.long()], want)
    k2, v2 = pool.get_kv_buffer(4)
    assert k2.data_ptr() == key.data_ptr() and v2.shape == value.shape

    for kernels, p in pools.items():
        for dst in (None, torch.float32, torch.bfloat16):
            got_nope, got_rope = p.get_mla_kv_buffer(Layer(4), loc, dst)
            out_dtype = dst or dtype
            assert got_nope.shape == (n, 1, KV_LORA_RANK) and got_rope.shape == (n, 1, ROPE_DIM)
            assert got_nope.dtype == got_rope.dtype == out_dtype
            assert bits_equal(got_nope, want[..., :KV_LORA_RANK].to(out_dtype)), (kernels, dst)
            assert bits_equal(got_rope, want[..., KV_LORA_RANK:].to(out_dtype)), (kernels, dst)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn], ids=["bf16", "fp8"])
def test_layer_id_override_on_both_writes(dtype):
    gen = torch.Generator().manual_seed(11)
    loc = torch.tensor([2, 40, 7], device=test_device())
    fused = randn_nonzero((3, 1, KV_LORA_RANK + ROPE_DIM), torch.float32, gen, 3.0)
    nope, rope = fused[..., :KV_LORA_RANK], fused[..., KV_LORA_RANK:]
    by_id, by_override = make_pool(dtype, "auto", start_layer=2), make_pool(dtype, "auto", start_layer=2)
    by_id.set_mla_kv_buffer(3, loc, nope, rope)
    by_override.set_mla_kv_buffer(None, loc, nope, rope, layer_id_override=3)
    assert bits_equal(by_override.kv_cache, by_id.kv_cache)
    by_id.set_kv_buffer(4, loc, fused, None)
    by_override.set_kv_buffer(Layer(2), loc, fused, None, layer_id_override=4)
    assert bits_equal(by_override.kv_cache, by_id.kv_cache)
    assert bits_equal(by_id.kv_cache[2, loc.long()], fused.to(dtype).view(by_id.store_dtype))


def test_sizes_views_and_errors():
    pool = make_pool(torch.float8_e4m3fn, "native", size=64, page_size=16, start_layer=1)
    assert pool.kv_cache.shape == (LAYERS, 80, 1, KV_LORA_RANK + ROPE_DIM)
    assert pool.kv_cache.dtype == torch.uint8 and pool.store_dtype == torch.uint8
    assert len(pool.kv_buffer) == LAYERS and pool.kv_buffer[1].data_ptr() == pool.kv_cache[1].data_ptr()
    assert pool.buffers() == {"kv": pool.kv_cache} and pool.token_buffers() == {"kv": pool.kv_cache}
    size = pool.get_kv_size_bytes()
    assert isinstance(size, int) and size == LAYERS * 80 * 80
    assert pool.mem_usage == size / (1 << 30)
    loc = torch.tensor([17, 18])
    x = torch.ones(2, 1, KV_LORA_RANK + ROPE_DIM)
    with pytest.raises(ValueError, match="unscaled"):
        pool.set_kv_buffer(1, loc, x, None, k_scale=0.5)
    with pytest.raises(ValueError, match="kv_lora_rank"):
        pool.set_kv_buffer(1, loc, x[..., :-1], None)
    with pytest.raises(ValueError, match="qk_rope_head_dim"):
        pool.set_mla_kv_buffer(1, loc, x[..., :KV_LORA_RANK], x[..., : ROPE_DIM + 1])
    with pytest.raises(IndexError, match="layer 0"):
        pool.set_mla_kv_buffer(0, loc, x[..., :KV_LORA_RANK], x[..., :ROPE_DIM])
    with pytest.raises(TypeError, match="layer_id"):
        pool.get_mla_kv_buffer("1", loc)
    with pytest.raises(NotImplementedError):
        MLATokenToKVPool(8, 1, torch.bfloat16, 64, 16, 1, "cpu", enable_memory_saver=True)


def test_wider_rows_for_subclasses():
    # kv_cache_dim widens the row (a family's own format); the split store fills the first columns only.
    pool = make_pool(torch.bfloat16, "triton", size=16, kv_cache_dim=KV_LORA_RANK + ROPE_DIM + 8)
    randomize(pool, torch.Generator().manual_seed(3))
    before = pool.kv_cache.clone()
    loc = torch.tensor([3, 5, 7], device=test_device())
    expected = pool.self_test_write(1, loc, torch.Generator().manual_seed(4))
    assert_same_bytes(pool.kv_cache[1, loc], expected["kv"], "rows written by self_test_write")
    assert_same_bytes(pool.kv_cache[1, loc, :, KV_LORA_RANK + ROPE_DIM :], before[1, loc, :, KV_LORA_RANK + ROPE_DIM :],
                      "columns past the rope key")  # fmt: skip
    layout = mla_layout(
        backend="x", page_size=1, dtype=torch.bfloat16, kv_lora_rank=KV_LORA_RANK, qk_rope_head_dim=ROPE_DIM,
        layer_num=LAYERS, kv_cache_dim=KV_LORA_RANK + ROPE_DIM + 8,
    )  # fmt: skip
    assert layout.total_bytes({"tokens": 16}) == pool.get_kv_size_bytes()


def test_layout_declares_one_latent_buffer():
    layout = mla_layout(backend="mla", page_size=64, dtype=torch.float8_e4m3fn, kv_lora_rank=512,
                        qk_rope_head_dim=64, layer_num=61)  # fmt: skip
    (buf,) = layout.buffers
    assert buf.name == "kv" and buf.row_shape == (1, 576) and buf.dtype == torch.uint8 and buf.pad_tokens == 64
    assert layout.bytes_per_token == 576 * 61
    assert "fp8 stored as uint8" in layout.notes
    with pytest.raises(ValueError):
        mla_layout(backend="mla", page_size=1, dtype=torch.bfloat16, kv_lora_rank=0, qk_rope_head_dim=64, layer_num=1)
