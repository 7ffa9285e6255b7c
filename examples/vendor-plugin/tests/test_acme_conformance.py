"""The acme backend's whole test suite is kvcore's conformance kit: the pool checks under each dtype, kernels
mode and page size it serves, and its own allocator under the allocator checks."""

from kvcore.testing import BackendAllocatorConformance, KVCacheConformance, Variant

# Qwen2.5-0.5B's attention (2 KV heads x 64) cut to 3 layers; hardware.vendor=acme is what selects acme.
CONFIG = ["model=qwen2.5-0.5b", "model.num_hidden_layers=3", "hardware.vendor=acme"]


class TestAcmePool(KVCacheConformance):
    backend = "acme"
    config = CONFIG
    variants = [Variant("bfloat16", "triton", 1), Variant("float16", "triton", 16), Variant("float32", "triton", 4),
                Variant("bfloat16", "native", 16)]  # fmt: skip


class TestAcmeAllocator(BackendAllocatorConformance):
    backend = "acme"
    config = CONFIG
    variants = [Variant("bfloat16", "triton", 1), Variant("bfloat16", "triton", 4)]
