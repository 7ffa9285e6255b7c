"""acme's Triton store against its torch reference: random rows, odd head sizes, strided and converted inputs,
every byte of the buffer compared (Triton runs in its CPU interpreter under the kit, compiled on a GPU with
KVCORE_TEST_COMPILED=1)."""

import pytest
import torch

from kvcore.testing import randomize
from kvcore.testing.tensors import randn_nonzero, test_device
from kvcore_acme.kernels import store_kv_native, store_kv_triton
from kvcore_acme.pool import AcmeKVPool


@pytest.mark.parametrize("page_size", [1, 3, 16])
@pytest.mark.parametrize("cache_dtype, input_dtype", [(torch.bfloat16, torch.bfloat16), (torch.float32, torch.float16),
                                                      (torch.float32, torch.bfloat16), (torch.float16, torch.float16)])  # fmt: skip
def test_triton_store_matches_the_reference(page_size, cache_dtype, input_dtype):
    g = torch.Generator().manual_seed(page_size)
    pools = [AcmeKVPool(size=5 * page_size, page_size=page_size, dtype=cache_dtype, head_num=3, head_dim=13,
                        layer_num=2, device=test_device(), kernels="native") for _ in range(2)]  # fmt: skip
    randomize(pools[0], torch.Generator().manual_seed(7))
    pools[1].kv_cache.copy_(pools[0].kv_cache)
    n = 4
    loc = (torch.randperm(5 * page_size, generator=g)[:n] + page_size).to(test_device())
    wide = randn_nonzero((n, 3, 2 * 13), input_dtype, g, 3.0)  # strided in the head dim: every other column
    k, v = wide[..., ::2], randn_nonzero((n, 3, 13), input_dtype, g, 3.0)
    store_kv_triton(pools[0].kv_cache, 1, loc, k, v)
    store_kv_native(pools[1].kv_cache, 1, loc, k, v)
    assert torch.equal(pools[0].kv_cache.view(torch.uint8), pools[1].kv_cache.view(torch.uint8))
    pages, slots = loc.long() // page_size, loc.long() % page_size
    assert torch.equal(pools[0].kv_cache[1, pages, 0, slots], k.to(cache_dtype))
    assert torch.equal(pools[0].get_value_buffer(1)[pages, slots], v.to(cache_dtype))


def test_scales_are_refused_for_inputs_that_need_converting():
    pool = AcmeKVPool(size=8, page_size=4, dtype=torch.bfloat16, head_num=1, head_dim=8, layer_num=1, device=test_device())
    x = torch.ones(2, 1, 8, device=test_device())
    with pytest.raises(ValueError, match="unscaled"):
        pool.set_kv_buffer(0, torch.tensor([4, 5], device=test_device()), x, x, k_scale=2.0)
