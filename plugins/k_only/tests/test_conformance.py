"""The K-only backend against kvcore's conformance kit, and what sets it apart: no values, half the bytes."""

import pytest
import torch

from kvcore import load_config, plan_memory
from kvcore.testing import KVCacheConformance, Variant
from kvcore.testing.tensors import test_device

# qwen2.5-0.5b shrunk: 3 layers of 3 KV heads x 24
CONFIG = ["model=qwen2.5-0.5b", "model.num_hidden_layers=3", "model.num_attention_heads=3",
          "model.num_key_value_heads=3", "model.head_dim=24"]  # fmt: skip


class TestKOnlyConformance(KVCacheConformance):
    backend = "k_only"
    config = CONFIG
    variants = [Variant("bfloat16", "triton", 1), Variant("float8_e4m3fn", "triton", 4), Variant("float32", "native", 1),
                Variant("float8_e5m2", "native", 16)]  # fmt: skip


def test_bytes_per_token_are_the_keys_alone():
    base = ["model=llama-3-8b", "hardware=h200"]
    keys = plan_memory(load_config(*base, "kv_cache.backend=k_only"))
    both = plan_memory(load_config(*base, "kv_cache.backend=mha"))
    m = load_config(*base).model
    assert keys.bytes_per_token == m.num_key_value_heads * m.head_dim * 2 * m.num_hidden_layers  # bf16 keys
    assert 2 * keys.bytes_per_token == both.bytes_per_token


def test_values_and_scales_are_refused():
    from kvcore_k_only import MHATokenToKOnlyPool

    pool = MHATokenToKOnlyPool(8, 1, torch.bfloat16, 2, 4, 1, test_device(), kernels="native")
    loc = torch.tensor([1, 2], device=test_device())
    x = torch.ones(2, 2, 4, device=test_device())
    with pytest.raises(ValueError, match="keeps keys only"):
        pool.set_kv_buffer(0, loc, x, x)
    with pytest.raises(ValueError, match="unscaled keys"):
        pool.set_kv_buffer(0, loc, x, None, k_scale=2.0)
    with pytest.raises(NotImplementedError, match="keeps keys only"):
        pool.get_value_buffer(0)
    pool.set_kv_buffer(0, loc, x.to(torch.bfloat16), None, k_scale=2.0)  # same dtype: the scale is ignored
    assert torch.equal(pool.get_key_buffer(0)[1:3], x.to(torch.bfloat16))
