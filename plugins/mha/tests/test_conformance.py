"""The MHA backend against kvcore's conformance kit, used exactly as a vendor would use it: the kit builds the
pools and the layout from the backend's name and a small model config."""

import pytest

from kvcore.testing import KVCacheConformance

# qwen2.5-0.5b shrunk: 3 layers of 3 KV heads x 24 (values 16), so every kernel sees odd sizes.
SMALL_MODEL = [
    "model=qwen2.5-0.5b", "model.num_hidden_layers=3", "model.num_attention_heads=3", "model.num_key_value_heads=3",
    "model.head_dim=24", "model.v_head_dim=16",
]  # fmt: skip


@pytest.fixture(
    params=[("bfloat16", "triton", 1), ("float8_e4m3fn", "triton", 4), ("float32", "native", 1),
            ("float8_e5m2", "native", 16)],
    ids=lambda p: f"{p[0]}-{p[1]}-page{p[2]}",
)  # fmt: skip
def variant(request):
    return request.param


class TestMHAConformance(KVCacheConformance):
    @pytest.fixture
    def kv_backend(self):
        return "mha"

    @pytest.fixture
    def kv_config(self, variant):
        return [*SMALL_MODEL, f"kv_cache.dtype={variant[0]}"]

    @pytest.fixture
    def kv_kernels(self, variant):
        return variant[1]

    @pytest.fixture
    def kv_page_size(self, variant):
        return variant[2]
