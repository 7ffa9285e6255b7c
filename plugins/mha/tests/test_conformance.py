"""The MHA backend against kvcore's conformance kit, used exactly as a vendor would use it: the kit builds the
pools and the layout from the backend's name and a small model config."""

from kvcore.testing import KVCacheConformance, Variant


class TestMHAConformance(KVCacheConformance):
    backend = "mha"
    # qwen2.5-0.5b shrunk: 3 layers of 3 KV heads x 24 (values 16), so every kernel sees odd sizes.
    config = ["model=qwen2.5-0.5b", "model.num_hidden_layers=3", "model.num_attention_heads=3",
              "model.num_key_value_heads=3", "model.head_dim=24", "model.v_head_dim=16"]  # fmt: skip
    variants = [Variant("bfloat16", "triton", 1), Variant("float8_e4m3fn", "triton", 4),
                Variant("float32", "native", 1), Variant("float8_e5m2", "native", 16)]  # fmt: skip


class TestPageMajorConformance(KVCacheConformance):
    """kv_cache.layout=page_major: the same checks through the page-major pool's rows."""

    backend = "mha"
    config = ["model=qwen2.5-0.5b", "model.num_hidden_layers=3", "model.num_attention_heads=3",
              "model.num_key_value_heads=3", "model.head_dim=24", "kv_cache.layout=page_major"]  # fmt: skip
    variants = [Variant("bfloat16", "triton", 1), Variant("float8_e4m3fn", "triton", 4), Variant("float32", "native", 16),
                Variant("float8_e5m2", "native", 4)]  # fmt: skip
