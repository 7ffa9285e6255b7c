"""The DSA backend against kvcore's conformance kit, used exactly as a vendor would use it: the kit builds the
pools and the layout from the backend's name and a small model config.

The kit checks the indexer like the latent rows: both are :meth:`DSATokenToKVPool.token_rows` buffers, and
the pool's ``self_test_write`` returns the key and scale rows it wrote.
"""

import pytest

from kvcore.testing import KVCacheConformance

# DeepSeek-V3.2 shrunk to 2 layers with a 256-wide latent (two fp8 tiles) and the real 128-wide indexer.
SMALL_MODEL = ["model=deepseek-v3.2", "model.num_hidden_layers=2", "model.mla.kv_lora_rank=256", "parallel.tp_size=1"]


@pytest.fixture(
    params=[("float8_e4m3fn", "triton", None), ("bfloat16", "triton", "bfloat16"), ("float8_e4m3fn", "native", "fp8")],
    ids=lambda p: f"{p[0]}-{p[1]}-index_{p[2] or 'default'}",
)
def variant(request):
    return request.param


class TestDSAConformance(KVCacheConformance):
    @pytest.fixture
    def kv_backend(self):
        return "dsa"

    @pytest.fixture
    def kv_config(self, variant):
        dtype, _, index_dtype = variant
        options = [] if index_dtype is None else [f"kv_cache.options.index_dtype={index_dtype}"]
        return [*SMALL_MODEL, f"kv_cache.dtype={dtype}", *options]

    @pytest.fixture
    def kv_kernels(self, variant):
        return variant[1]

    @pytest.fixture
    def kv_page_size(self):
        return 64

    @pytest.fixture
    def kv_pool_size(self):
        return 3 * 64
