"""The MHA pool against kvcore's conformance kit, used exactly as a vendor would use it."""

import pytest
import torch
from kvcore_mha.layout import mha_layout
from kvcore_mha.pool import MHATokenToKVPool

from kvcore.testing import KVCacheConformance
from kvcore.testing.tensors import test_device

HEADS, HEAD_DIM, V_HEAD_DIM, LAYERS = 3, 24, 16, 3


@pytest.fixture(
    params=[
        (torch.bfloat16, "triton", 1),
        (torch.float8_e4m3fn, "triton", 4),
        (torch.float32, "native", 1),
        (torch.float8_e5m2, "native", 16),
    ],
    ids=lambda p: f"{str(p[0]).removeprefix('torch.')}-{p[1]}-page{p[2]}",
)
def variant(request):
    return request.param


class TestMHAConformance(KVCacheConformance):
    @pytest.fixture
    def kv_page_size(self, variant):
        return variant[2]

    @pytest.fixture
    def kv_pool_factory(self, variant):
        dtype, kernels, _ = variant

        def make(size, page_size, start_layer):
            return MHATokenToKVPool(
                size=size, page_size=page_size, dtype=dtype, head_num=HEADS, head_dim=HEAD_DIM, layer_num=LAYERS,
                device=test_device(), enable_memory_saver=False, v_head_dim=V_HEAD_DIM, start_layer=start_layer,
                kernels=kernels,
            )

        return make

    @pytest.fixture
    def kv_layout(self, kv_pool):
        return mha_layout(
            backend="mha", page_size=kv_pool.page_size, dtype=kv_pool.dtype, head_num=HEADS, head_dim=HEAD_DIM,
            v_head_dim=V_HEAD_DIM, layer_num=LAYERS,
        )
