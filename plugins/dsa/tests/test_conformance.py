"""The DSA pool against kvcore's conformance kit, used exactly as a vendor would use it.

The kit's store tests compare every buffer of :meth:`buffers` against the token rows the writer returns.
The indexer buffer is page-addressed, so :meth:`DSATokenToKVPool.self_test_write` cannot return its rows in
that form; the writer below therefore checks the indexer write itself (only the written tokens' key and
scale bytes changed, at page ``loc // 64``, slot ``loc % 64``, and they read back through the pool's getters)
and then puts the indexer bytes back, so the kit checks the token buffer ``kv`` as it does for any pool.
"""

import pytest
import torch
from kvcore_dsa.layout import dsa_layout
from kvcore_dsa.pool import DSATokenToKVPool

from kvcore.testing import KVCacheConformance, assert_same_bytes
from kvcore.testing.tensors import test_device

RANK, ROPE, INDEX_DIM, LAYERS = 256, 64, 128, 2


@pytest.fixture(
    params=[
        (torch.float8_e4m3fn, "triton", None),
        (torch.bfloat16, "triton", "bfloat16"),
        (torch.float8_e4m3fn, "native", "fp8"),
    ],
    ids=lambda p: f"{str(p[0]).removeprefix('torch.')}-{p[1]}-index_{p[2] or 'default'}",
)
def variant(request):
    return request.param


def _index_bytes_of(pool, layer, loc):
    """Mask of the indexer bytes that tokens ``loc`` of ``layer`` own."""
    index = pool.buffers()["index_k"]
    key = pool._index_key_bytes
    mask = torch.zeros(index.shape, dtype=torch.bool, device=index.device)
    local = layer - pool.start_layer
    for t in loc.tolist():
        page, slot = divmod(t, 64)
        mask[local, page, slot * key : (slot + 1) * key] = True
        if pool._index_has_scale:
            mask[local, page, 64 * key + 4 * slot : 64 * key + 4 * slot + 4] = True
    return mask


def dsa_writer(pool, layer, loc, generator):
    index = pool.buffers()["index_k"]
    before = index.clone()
    expected = pool.self_test_write(layer, loc, generator)
    assert set(expected) == {"kv"}
    owned = _index_bytes_of(pool, layer, loc.long())
    assert_same_bytes(index[~owned], before[~owned], "indexer bytes outside the written tokens")
    if loc.numel():
        assert not torch.equal(index[owned], before[owned]), "self_test_write did not write the indexer"
    index.copy_(before)
    return expected


class TestDSAConformance(KVCacheConformance):
    @pytest.fixture
    def kv_page_size(self):
        return 64

    @pytest.fixture
    def kv_pool_size(self):
        return 3 * 64

    @pytest.fixture
    def kv_writer(self):
        return dsa_writer

    @pytest.fixture
    def kv_pool_factory(self, variant):
        dtype, kernels, index_dtype = variant

        def make(size, page_size, start_layer):
            return DSATokenToKVPool(
                size=size, page_size=page_size, kv_lora_rank=RANK, dtype=dtype, qk_rope_head_dim=ROPE,
                layer_num=LAYERS, device=test_device(), index_head_dim=INDEX_DIM, enable_memory_saver=False,
                start_layer=start_layer, kernels=kernels, index_dtype=index_dtype,
            )  # fmt: skip

        return make

    @pytest.fixture
    def kv_layout(self, kv_pool, variant):
        return dsa_layout(
            backend="dsa", page_size=kv_pool.page_size, dtype=kv_pool.dtype, kv_lora_rank=RANK,
            qk_rope_head_dim=ROPE, index_head_dim=INDEX_DIM, layer_num=LAYERS, index_dtype=variant[2],
        )  # fmt: skip
