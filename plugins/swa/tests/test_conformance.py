"""The SWA backend against kvcore's conformance kit, as a vendor would run it: its pool twice, as the kit builds
it (window layers address full locations directly) and with a full -> window slot map registered, as its
allocator does (every write, move, offload and check then goes through the map); and its allocator through the
kit's allocator state machine, window side included, at page sizes 1, 4 and 16."""

import pytest
import torch

from kvcore.testing import AllocatorConformance, KVCacheConformance, Variant
from kvcore.testing.tensors import compiled, test_device
from kvcore_swa.allocator import SWATokenToKVPoolAllocator

# tiny-swa shrunk to odd sizes: 5 layers (interval 3: layer 2 attends to every token; 0, 1, 3 and 4 slide).
CONFIG = ["model=tiny-swa", "model.num_hidden_layers=5", "model.num_attention_heads=3", "model.num_key_value_heads=3",
          "model.head_dim=24", "model.v_head_dim=16", "model.swa.sliding_window=8"]  # fmt: skip
VARIANTS = [Variant("bfloat16", "triton", 1), Variant("float8_e4m3fn", "triton", 4), Variant("float32", "native", 1),
            Variant("bfloat16", "native", 16)]  # fmt: skip


def shuffled_pages(size: int, page_size: int, generator: torch.Generator) -> torch.Tensor:
    """A full -> window slot map as the allocator builds one: pages shuffled, offsets kept, page 0 -> page 0."""
    pages = size // page_size
    window_page = torch.cat([torch.zeros(1, dtype=torch.int64), torch.randperm(pages, generator=generator) + 1])
    return (window_page[:, None] * page_size + torch.arange(page_size)).reshape(-1)


class TestSWAConformance(KVCacheConformance):
    backend = "swa"
    config = CONFIG
    variants = VARIANTS


class TestSWAConformanceThroughTheMap(KVCacheConformance):
    backend = "swa"
    config = CONFIG
    variants = VARIANTS

    @pytest.fixture
    def kv_pool_factory(self, kv_pool_factory):
        def make(size, page_size, start_layer):
            pool = kv_pool_factory(size=size, page_size=page_size, start_layer=start_layer)
            mapping = shuffled_pages(pool.size, page_size, torch.Generator().manual_seed(size + start_layer))
            pool.register_mapping(mapping.to(pool.device))
            return pool

        return make


class TestSWAPageMajorConformance(KVCacheConformance):
    """kv_cache.layout=page_major: both sub-pools page-major, the window one behind the shuffled map."""

    backend = "swa"
    config = [*CONFIG, "model.v_head_dim=24", "kv_cache.layout=page_major"]  # K and V rows alike
    variants = [Variant("bfloat16", "triton", 1), Variant("float8_e4m3fn", "triton", 4), Variant("bfloat16", "native", 16)]

    @pytest.fixture
    def kv_pool_factory(self, kv_pool_factory):
        def make(size, page_size, start_layer):
            pool = kv_pool_factory(size=size, page_size=page_size, start_layer=start_layer)
            mapping = shuffled_pages(pool.size, page_size, torch.Generator().manual_seed(size + start_layer))
            pool.register_mapping(mapping.to(pool.device))
            return pool

        return make


# (full tokens, window slots, page size, kernels): the window side smaller, so it is the one that fills up; the
# Triton kernels run in the CPU interpreter, slow enough that only the token allocator's are driven here.
SWA_ALLOCATORS = {
    "page1-triton": (16, 9, 1, "triton"),
    "page4-native": (48, 28, 4, "native"),
    "page16-native": (112, 64, 16, "native"),
}


class TestSWAAllocatorConformance(AllocatorConformance):
    """The kit's allocator machine, which also drives ``free_swa`` and checks the window side after every step.
    40 sequences keep it to seconds on a CPU; ``--hypothesis-profile=long`` runs it long."""

    examples = 40

    @pytest.fixture(params=sorted(SWA_ALLOCATORS))
    def allocator_factory(self, request):
        full, window, page_size, kernels = SWA_ALLOCATORS[request.param]
        kernels = kernels if not compiled() else "auto"
        return lambda: SWATokenToKVPoolAllocator(full, window, page_size, torch.bfloat16, test_device(), None,
                                                 need_sort=False, kernels=kernels)  # fmt: skip
