"""The kit's allocator conformance on every built-in allocator (token, paged with both kernel modes; the
sliding-window one is run in plugins/swa/tests/test_conformance.py), and on deliberately broken allocators, which
it must fail."""

from __future__ import annotations

import re

import pytest
import torch
from hypothesis import HealthCheck, Phase, settings
from hypothesis.errors import Flaky
from hypothesis.stateful import run_state_machine_as_test

from kvcore.allocators import PagedTokenToKVPoolAllocator, TokenToKVPoolAllocator
from kvcore.testing import AllocatorConformance, AllocatorMachine
from kvcore.testing.tensors import compiled, test_device
from kvcore_swa.allocator import SWATokenToKVPoolAllocator

DEVICE = test_device()
KERNELS = "triton" if not compiled() else "auto"

FACTORIES = {
    "token": lambda: TokenToKVPoolAllocator(13, torch.bfloat16, DEVICE, None, need_sort=False),
    "token-sorted": lambda: TokenToKVPoolAllocator(13, torch.bfloat16, DEVICE, None, need_sort=True),
    "paged-3-triton": lambda: PagedTokenToKVPoolAllocator(36, 3, torch.bfloat16, DEVICE, None, False, KERNELS),
    "paged-4-native-sorted": lambda: PagedTokenToKVPoolAllocator(44, 4, torch.bfloat16, DEVICE, None, True, "native"),
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


class _SWAClearsOnlyTheNamedTokens(SWATokenToKVPoolAllocator):
    """The free_swa of issue 25: the window side gives back the whole page of each token named, but only the
    named tokens stop mapping into it, so the page's other tokens still do once it is handed to another request."""

    def free_swa(self, free_index):
        idx = free_index.reshape(-1).long()
        self.swa_attn_allocator.free(self.full_to_swa_index_mapping[idx])
        self.full_to_swa_index_mapping[idx] = 0


def _swa_clearing_only_the_named_tokens(page_size: int) -> _SWAClearsOnlyTheNamedTokens:
    """8 full pages, 5 window pages."""
    return _SWAClearsOnlyTheNamedTokens(8 * page_size, 5 * page_size, page_size, torch.bfloat16, DEVICE, None,
                                        need_sort=False, kernels="native")  # fmt: skip


class _NotAnSWAByName:
    """A composite allocator of another class (no SWATokenToKVPoolAllocator in its ancestry) with the same bug:
    the kit finds its window side by ``free_swa`` alone."""

    def __init__(self, page_size):
        self._inner = _swa_clearing_only_the_named_tokens(page_size)

    def __getattr__(self, name):
        return getattr(self._inner, name)


@pytest.mark.parametrize("page_size", [4, 16])
@pytest.mark.parametrize("make", [_swa_clearing_only_the_named_tokens, _NotAnSWAByName], ids=["swa", "other-class"])
def test_a_window_page_freed_while_still_mapped_fails_the_kit(page_size, make):
    """The window checks catch the bug from any allocator with free_swa (generation only, no shrinking: a few
    seconds)."""
    machine = type("Machine", (AllocatorMachine,), {"factory": staticmethod(lambda: make(page_size))})
    quick = settings(max_examples=200, stateful_step_count=25, deadline=None, phases=[Phase.generate],
                     suppress_health_check=list(HealthCheck), database=None)  # fmt: skip
    with pytest.raises((AssertionError, Flaky, BaseExceptionGroup)) as err:
        run_state_machine_as_test(machine, settings=quick)
    says = (r"swa_available_size\(\) is|window slot \d+ is mapped by|window page \d+ is mapped by|"
            r"left the window .* but still maps")  # fmt: skip
    assert re.search(says, _messages(err.value)), _messages(err.value)


class _WindowSideUnreadable(TokenToKVPoolAllocator):
    """Has free_swa, so a window side, but nothing the kit could read that side through."""

    def free_swa(self, free_index):
        pass


def test_an_allocator_with_free_swa_must_expose_its_window_side():
    with pytest.raises((AssertionError, BaseExceptionGroup)) as err:
        AllocatorConformance().test_random_request_lifetimes(
            lambda: _WindowSideUnreadable(12, torch.bfloat16, DEVICE, None, need_sort=False)
        )  # fmt: skip
    says = r"has free_swa, .* but lacks swa_available_size, full_available_size, translate_loc_from_full_to_swa"
    assert re.search(says, _messages(err.value)), _messages(err.value)
