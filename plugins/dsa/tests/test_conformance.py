"""The DSA backend against kvcore's conformance kit, used exactly as a vendor would use it: the kit builds the
pools and the layout from the backend's name and a small model config.

The kit checks the indexer like the latent rows: both are :meth:`DSATokenToKVPool.token_rows` buffers, and
the pool's ``self_test_write`` returns the key and scale rows it wrote.
"""

import pytest

from kvcore.testing import KVCacheConformance, Variant


class TestDSAConformance(KVCacheConformance):
    backend = "dsa"
    # DeepSeek-V3.2 shrunk to 2 layers with a 256-wide latent (two fp8 tiles) and the real 128-wide indexer.
    config = ["model=deepseek-v3.2", "model.num_hidden_layers=2", "model.mla.kv_lora_rank=256", "parallel.tp_size=1"]
    variants = [Variant("float8_e4m3fn", "triton", 64), Variant("bfloat16", "triton", 64, ["kv_cache.options.index_dtype=bfloat16"]),
                Variant("float8_e4m3fn", "native", 64, ["kv_cache.options.index_dtype=fp8"])]  # fmt: skip

    @pytest.fixture
    def kv_pool_size(self):
        return 3 * 64
