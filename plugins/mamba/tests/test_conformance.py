"""The hybrid linear-attention backend against kvcore's conformance kit, as a vendor would run it: K/V of the
full-attention layers checked per token, the per-request states declared and allocated as the layout says."""

from kvcore.testing import KVCacheConformance, Variant


class TestHybridLinearConformance(KVCacheConformance):
    backend = "mamba"
    # tiny-qwen3-next with odd head sizes: layers 3 and 7 keep K/V, the six others a DeltaNet state each.
    config = ["model=tiny-qwen3-next", "model.num_attention_heads=3", "model.num_key_value_heads=3",
              "model.head_dim=24", "model.v_head_dim=16", "model.mamba.num_heads=3", "model.mamba.head_dim=5"]  # fmt: skip
    variants = [Variant("bfloat16", "triton", 1), Variant("float8_e4m3fn", "triton", 4),
                Variant("float32", "native", 1), Variant("bfloat16", "native", 16)]  # fmt: skip


class TestHybridLinearSpeculativeConformance(KVCacheConformance):
    """The same with speculative decoding: the draft tokens' states are declared and allocated too."""

    backend = "mamba"
    config = [*TestHybridLinearConformance.config, "kv_cache.options.speculative_num_draft_tokens=2"]
    variants = [Variant("bfloat16", "triton", 1), Variant("float32", "native", 4)]


class TestHybridLinearMLAConformance(KVCacheConformance):
    """Full-attention layers with MLA latent rows (the mamba_mla backend) beside DeltaNet states."""

    backend = "mamba_mla"
    config = [*TestHybridLinearConformance.config, "model.attention=mamba_mla", "model.mla.kv_lora_rank=48",
              "model.mla.qk_rope_head_dim=16"]  # fmt: skip
    variants = [Variant("bfloat16", "triton", 1), Variant("float8_e4m3fn", "native", 4)]
