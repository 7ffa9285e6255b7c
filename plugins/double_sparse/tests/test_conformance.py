"""The DoubleSparse backend against kvcore's conformance kit (labels are token rows like K and V: moved,
offloaded and checked with them), its bytes per token, and its errors."""

import pytest
import torch

from kvcore import load_config, plan_memory
from kvcore.errors import ConfigError
from kvcore.testing import KVCacheConformance, Variant
from kvcore.testing.tensors import bits_equal, randn_nonzero, test_device

CONFIG = ["model=qwen2.5-0.5b", "model.num_hidden_layers=3", "model.num_attention_heads=3",
          "model.num_key_value_heads=3", "model.head_dim=24", "kv_cache.options.heavy_channel_num=5"]  # fmt: skip


class TestDoubleSparseConformance(KVCacheConformance):
    backend = "double_sparse"
    config = CONFIG
    variants = [Variant("bfloat16", "triton", 1), Variant("float8_e4m3fn", "triton", 4), Variant("float32", "native", 1),
                Variant("float16", "native", 16)]  # fmt: skip


def test_bytes_per_token_include_the_labels():
    base = ["model=llama-3-8b", "hardware=h200", "kv_cache.backend=double_sparse"]
    m = load_config(*base).model
    for heavy in (16, 32):
        plan = plan_memory(load_config(*base, f"kv_cache.options.heavy_channel_num={heavy}"))
        per_layer = m.num_key_value_heads * (2 * m.head_dim + heavy) * 2  # bf16 K, V and labels
        assert plan.bytes_per_token == per_layer * m.num_hidden_layers


def test_one_call_writes_keys_values_and_labels():
    from kvcore_double_sparse import DoubleSparseTokenToKVPool

    gen = torch.Generator().manual_seed(3)
    pool = DoubleSparseTokenToKVPool(16, 4, torch.bfloat16, 2, 8, 2, test_device(), heavy_channel_num=3, start_layer=4,
                                     kernels="triton")  # fmt: skip
    loc = torch.tensor([5, 9, 17], device=test_device())
    k, v, label = (randn_nonzero((3, 2, w), torch.float32, gen) for w in (8, 8, 3))
    pool.set_kv_buffer(5, loc, k, v, label)
    for got, want in ((pool.get_key_buffer(5), k), (pool.get_value_buffer(5), v), (pool.get_label_buffer(5), label)):
        assert bits_equal(got[loc], want.to(torch.bfloat16))
    assert pool.label_buffer[1].shape == (20, 2, 3) and pool.get_label_buffer(4).abs().sum() == 0


@pytest.mark.parametrize("override, says", [
    ("kv_cache.options.heavy_channel_num=200", "kv_cache.options.heavy_channel_num=200 must be in 1..128"),
    ("kv_cache.options.heavy_channels=8", "heavy_channels"),
])  # fmt: skip
def test_option_errors_name_the_key(override, says):
    with pytest.raises(ConfigError, match=says.replace(".", r"\.").replace("(", r"\(")):
        plan_memory(load_config("model=llama-3-8b", "hardware=h200", "kv_cache.backend=double_sparse", override))
