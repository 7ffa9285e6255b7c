"""The kit's allocator conformance on every built-in allocator (token, paged with both kernel modes,
sliding-window with a smaller window side), and on deliberately broken allocators, which it must fail."""

from __future__ import annotations

import re

import pytest
import torch
from hypothesis.errors import Flaky

from kvcore.allocators import PagedTokenToKVPoolAllocator, TokenToKVPoolAllocator
from kvcore.testing import AllocatorConformance
from kvcore.testing.tensors import compiled, test_device
from kvcore_swa.allocator import SWATokenToKVPoolAllocator

DEVICE = test_device()
KERNELS = "triton" if not compiled() else "auto"

FACTORIES = {
    "token": lambda: TokenToKVPoolAllocator(13, torch.bfloat16, DEVICE, None, need_sort=False),
    "token-sorted": lambda: TokenToKVPoolAllocator(13, torch.bfloat16, DEVICE, None, need_sort=True),
    "paged-3-triton": lambda: PagedTokenToKVPoolAllocator(36, 3, torch.bfloat16, DEVICE, None, False, KERNELS),
    "paged-4-native-sorted": lambda: PagedTokenToKVPoolAllocator(44, 4, torch.bfloat16, DEVICE, None, True, "native"),
    "swa-1": lambda: SWATokenToKVPoolAllocator(16, 9, 1, torch.bfloat16, DEVICE, None, need_sort=False),
    "swa-4": lambda: SWATokenToKVPoolAllocator(48, 28, 4, torch.bfloat16, DEVICE, None, need_sort=False, kernels=KERNELS),
}


class TestBuiltinAllocators(AllocatorConformance):
    @pytest.fixture(params=sorted(FACTORIES))
    def allocator_factory(self, request):
        return FACTORIES[request.param]


class _TwiceHandedOut(TokenToKVPoolAllocator):
    """Hands its first slot out again on every other allocation."""

    def alloc(self, need_size):
        out = super().alloc(need_size)
        if out is not None and out.numel() >= 2 and not hasattr(self, "_done"):
            self._done = True
            out = out.clone()
            out[1] = out[0]
        return out


class _Leaky(TokenToKVPoolAllocator):
    """Forgets every other free."""

    def free(self, free_index):
        self._count = getattr(self, "_count", 0) + 1
        if self._count % 2 == 0:
            super().free(free_index)


class _PaddingToo(TokenToKVPoolAllocator):
    """Hands out the padding slot in place of its first slot."""

    def alloc(self, need_size):
        out = super().alloc(need_size)
        if out is not None and out.numel() and not hasattr(self, "_done"):
            self._done = True
            out = out.clone()
            out[0] = 0
        return out


def _messages(exc: BaseException) -> str:
    """Every message of an error (hypothesis reports several distinct failures as an exception group)."""
    inner = getattr(exc, "exceptions", ())
    return " | ".join([str(exc), *(_messages(e) for e in inner)])


@pytest.mark.parametrize("broken, says", [(_TwiceHandedOut, r"holds a location twice|handed to requests"),
                                          (_Leaky, r"available_size\(\) is"),
                                          (_PaddingToo, "padding page was handed out")])  # fmt: skip
def test_broken_allocators_fail_the_kit(broken, says):
    suite = AllocatorConformance()
    with pytest.raises((AssertionError, Flaky, BaseExceptionGroup)) as err:
        suite.test_random_request_lifetimes(lambda: broken(12, torch.bfloat16, DEVICE, None, need_sort=False))
    assert re.search(says, _messages(err.value)), _messages(err.value)
