"""The MHA pool's own write surface, as SGLang's callers use it: layer ids and overrides, SGLang's scale rule."""

from __future__ import annotations

import pytest
import torch

from kvcore.testing.tensors import bits_equal, randn_nonzero, test_device
from kvcore_mha.pool import MHATokenToKVPool

HEADS, DIM, LAYERS, SIZE = 2, 16, 3, 32


class Layer:
    def __init__(self, layer_id):
        self.layer_id = layer_id


def make_pool(dtype=torch.bfloat16, start_layer=4):
    return MHATokenToKVPool(
        size=SIZE, page_size=1, dtype=dtype, head_num=HEADS, head_dim=DIM, layer_num=LAYERS, device=test_device(),
        enable_memory_saver=False, start_layer=start_layer,
    )  # fmt: skip


def rows(n, seed, dtype=torch.bfloat16):
    gen = torch.Generator().manual_seed(seed)
    return tuple(randn_nonzero((n, HEADS, DIM), dtype, gen, 2.0) for _ in range(2))


def test_layer_id_override_addresses_the_layer_like_an_id():
    by_id, by_override = make_pool(), make_pool()
    loc = torch.tensor([3, 9, 17], device=test_device())
    k, v = rows(3, 0)
    by_id.set_kv_buffer(6, loc, k, v)
    by_override.set_kv_buffer(None, loc, k, v, layer_id_override=6)  # a composite pool's call
    assert bits_equal(by_override.k_cache, by_id.k_cache) and bits_equal(by_override.v_cache, by_id.v_cache)
    by_override.set_kv_buffer(Layer(4), loc, v, k, None, None, 5)  # the override wins over the layer object
    assert bits_equal(by_override.k_cache[1, loc], v) and bits_equal(by_override.k_cache[0], by_id.k_cache[0])
    with pytest.raises(IndexError, match="layer 7 is not stored"):
        by_override.set_kv_buffer(None, loc, k, v, layer_id_override=7)


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float8_e4m3fn], ids=["bf16", "fp8"])
def test_scales_divide_converted_inputs_and_leave_them_untouched(cache_dtype):
    pool = make_pool(cache_dtype)
    loc = torch.tensor([1, 2, 30], device=test_device())
    k, v = rows(3, 1, torch.float32)
    k_before, v_before = k.clone(), v.clone()
    pool.set_kv_buffer(Layer(5), loc, k, v, k_scale=2.0, v_scale=4.0)
    assert bits_equal(k, k_before) and bits_equal(v, v_before)  # SGLang divides in place; kvcore never does
    stored = lambda x: x.to(cache_dtype).view(pool.store_dtype)  # noqa: E731
    assert bits_equal(pool.k_cache[1, loc], stored(k / 2)) and bits_equal(pool.v_cache[1, loc], stored(v / 4))
    same = k.to(cache_dtype)  # already in the cache dtype: copied, scales ignored
    pool.set_kv_buffer(5, loc, same, same, k_scale=2.0, v_scale=2.0)
    assert bits_equal(pool.k_cache[1, loc], same.view(pool.store_dtype))
