"""RowStore (one launch writing the same tokens' rows into 1 to 3 buffers) against its torch reference: random
rows, odd head sizes, strided inputs, conversions into every cache dtype, and nothing but the target rows
written."""

from __future__ import annotations

import pytest
import torch
from kvcore_mha.row_store import RowStore

from kvcore.kernels.dtypes import storage_dtype
from kvcore.testing.tensors import bits_equal, poison, randn_nonzero, test_device

DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn, torch.float8_e5m2]


def caches(shapes, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return [poison((3, 23, *shape), storage_dtype(dtype), g) for shape in shapes]


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("shapes", [[(3, 5)], [(3, 5), (3, 7)], [(2, 9), (2, 9), (2, 3)]], ids=["one", "two", "three"])
@pytest.mark.parametrize("source", [torch.float32, torch.bfloat16, "same"])
def test_triton_matches_the_reference_and_touches_only_the_rows(dtype, shapes, source):
    source = dtype if source == "same" else source
    gen = torch.Generator().manual_seed(5)
    n = 6
    loc = (torch.randperm(22, generator=gen)[:n] + 1).to(test_device())
    inputs = []
    for heads, dim in shapes:  # strided in the head dim: every other column of a wider tensor
        wide = randn_nonzero((n, heads, 2 * dim), torch.float32, gen, 3.0).to(source)
        inputs.append(wide[..., ::2])
    before = [x.clone() for x in inputs]
    got, want = caches(shapes, dtype, 1), caches(shapes, dtype, 1)
    RowStore(got, dtype, use_triton=True)(2, loc, *inputs)
    RowStore(want, dtype, use_triton=False)(2, loc, *inputs)
    for g_cache, w_cache, x in zip(got, want, inputs):
        assert bits_equal(g_cache, w_cache)
        assert bits_equal(g_cache[2, loc.long()], x.to(dtype).view(storage_dtype(dtype)))
    untouched = caches(shapes, dtype, 1)
    for g_cache, u in zip(got, untouched):
        g_cache[2, loc.long()] = u[2, loc.long()]
        assert bits_equal(g_cache, u), "a row outside loc changed"
    assert all(bits_equal(a, b) for a, b in zip(inputs, before)), "an input was modified"


def test_errors_name_the_input():
    store = RowStore(caches([(2, 4), (2, 4)], torch.bfloat16, 0), torch.bfloat16, names=("cache_k", "cache_v"))
    loc = torch.tensor([1, 2], device=test_device())
    x = torch.zeros(2, 2, 4, device=test_device())
    with pytest.raises(ValueError, match=r"cache_v must be \[N, H, D\]"):
        store(0, loc, x, x[:, :1])
    with pytest.raises(ValueError, match="expected 2 inputs"):
        store(0, loc, x)
    with pytest.raises(ValueError, match="layer_index 3 out of range"):
        store(3, loc, x, x)
    with pytest.raises(ValueError, match="RowStore writes 1 to 3 buffers"):
        RowStore([], torch.bfloat16)
