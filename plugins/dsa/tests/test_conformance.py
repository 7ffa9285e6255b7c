"""The DSA pool against kvcore's conformance kit, used exactly as a vendor would use it.

The kit checks the indexer like the latent rows: both are :meth:`DSATokenToKVPool.token_rows` buffers, and
the pool's ``self_test_write`` returns the key and scale rows it wrote.
"""

import pytest
import torch
from kvcore_dsa.layout import dsa_layout
from kvcore_dsa.pool import DSATokenToKVPool

from kvcore.testing import KVCacheConformance
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


class TestDSAConformance(KVCacheConformance):
    @pytest.fixture
    def kv_page_size(self):
        return 64

    @pytest.fixture
    def kv_pool_size(self):
        return 3 * 64

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
