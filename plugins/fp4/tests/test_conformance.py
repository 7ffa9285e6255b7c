"""The block-scaled MHA backend against kvcore's conformance kit, each format with the Triton kernels and with
the torch path (the stored bytes are the format's codes either way, so the kit's byte-exact checks apply)."""

from kvcore.testing import LossyKVCacheConformance, Variant


class TestFP4Conformance(LossyKVCacheConformance):
    backend = "fp4"
    # qwen2.5-0.5b shrunk: 3 layers of 3 KV heads x 64 (values 32): whole blocks of 16 and of 32.
    config = ["model=qwen2.5-0.5b", "model.num_hidden_layers=3", "model.num_attention_heads=3",
              "model.num_key_value_heads=3", "model.head_dim=64", "model.v_head_dim=32"]  # fmt: skip
    variants = [Variant("fp4_e2m1", "triton", 1), Variant("nvfp4", "triton", 4), Variant("mxfp8", "triton", 1),
                Variant("fp4_e2m1", "native", 16), Variant("nvfp4", "native", 1), Variant("mxfp8", "native", 4)]  # fmt: skip


class TestFP4MLAConformance(LossyKVCacheConformance):
    backend = "fp4_mla"
    config = ["model=tiny-mla", "model.num_hidden_layers=3", "model.mla.kv_lora_rank=96", "model.mla.qk_rope_head_dim=32"]
    variants = [Variant("fp4_e2m1", "triton", 1), Variant("nvfp4", "native", 4), Variant("mxfp8", "triton", 16)]
