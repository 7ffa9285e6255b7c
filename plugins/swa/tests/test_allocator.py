"""SWATokenToKVPoolAllocator over realistic request lifetimes, checked after every step against a small
Python model of both sides: which full and window slots are taken, what each live full location maps to."""

from __future__ import annotations

import pytest
import torch

from kvcore.testing.tensors import test_device
from kvcore_swa.allocator import SWATokenToKVPoolAllocator

DEVICE = test_device()
FULL, WINDOW = 96, 48


class Model:
    """What the allocator must hold: live full locations, each with its window slot (0 once freed early)."""

    def __init__(self, alloc: SWATokenToKVPoolAllocator):
        self.alloc, self.page = alloc, alloc.page_size
        self.window_of: dict[int, int] = {}

    def add(self, full: torch.Tensor) -> None:
        mapping = self.alloc.full_to_swa_index_mapping
        for f in full.tolist():
            assert f not in self.window_of, f"full location {f} handed out twice"
            self.window_of[f] = int(mapping[f])

    def check(self) -> None:
        a, page = self.alloc, self.page
        full_pages = {f // page for f in self.window_of}
        window_pages = {w // page for w in self.window_of.values() if w}
        assert 0 not in full_pages and 0 not in window_pages, "the padding page was handed out"
        assert a.full_available_size() == FULL - len(full_pages) * page
        assert a.swa_available_size() == WINDOW - len(window_pages) * page
        assert a.available_size() == min(a.full_available_size(), a.swa_available_size())
        live_windows = [w for w in self.window_of.values() if w]
        assert len(set(live_windows)) == len(live_windows), "two full locations share a window slot"
        mapping = a.full_to_swa_index_mapping.cpu()
        for f, w in self.window_of.items():
            assert int(mapping[f]) == w
            if w:  # a token keeps its offset within its page on both sides
                assert f % page == w % page
        assert int(mapping[0]) == 0

    def drop(self, full: list[int], window_only: bool = False) -> None:
        for f in full:
            if window_only:
                self.window_of[f] = 0
            else:
                del self.window_of[f]


def _t(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64, device=DEVICE)


@pytest.mark.parametrize("page_size", [1, 4])
def test_request_lifetimes(page_size):
    """Two requests: prefill, decode, slide out of the window, extend after a prefix, free; then a free group,
    backup/restore, an allocation too big for the window side, and clear."""
    a = SWATokenToKVPoolAllocator(FULL, WINDOW, page_size, torch.bfloat16, DEVICE, kvcache=None, need_sort=False)
    m = Model(a)
    m.check()

    # prefill A (10 tokens) and B (6 tokens) in one extend
    pre, seq = _t([0, 0]), _t([10, 6])
    first = a.alloc_extend(pre, pre.cpu(), seq, seq.cpu(), _t([-1, -1]), 16)
    assert first is not None and first.numel() == 16
    m.add(first)
    m.check()
    a_locs, b_locs = first[:10].tolist(), first[10:].tolist()

    # three decode steps for both
    for step in range(3):
        seq = _t([11 + step, 7 + step])
        new = a.alloc_decode(seq, seq.cpu(), _t([a_locs[-1], b_locs[-1]]))
        assert new is not None
        if page_size > 1:  # a request continues its page on both sides while it has room
            for last, loc, n in ((a_locs[-1], int(new[0]), 11 + step), (b_locs[-1], int(new[1]), 7 + step)):
                if (n - 1) % page_size:
                    assert loc == last + 1
                    window = a.full_to_swa_index_mapping
                    assert int(window[loc]) == int(window[last]) + 1
        m.add(new)
        a_locs.append(int(new[0]))
        b_locs.append(int(new[1]))
        m.check()

    # A's first 8 tokens slid out of every window (whole pages when paged): window slots back, full kept
    gone = a_locs[:8]
    window_before = a.swa_available_size()
    a.free_swa(_t(gone))
    m.drop(gone, window_only=True)
    m.check()
    assert a.swa_available_size() == window_before + 8 and a.full_available_size() == FULL - len({f // page_size for f in m.window_of}) * page_size

    # B extends by 5 after its 9-token prefix (ending inside a page when paged)
    pre, seq = _t([9]), _t([14])
    more = a.alloc_extend(pre, pre.cpu(), seq, seq.cpu(), _t([b_locs[-1]]), 5)
    assert more is not None
    if page_size > 1 and 9 % page_size:
        assert int(more[0]) == b_locs[-1] + 1
        assert int(a.full_to_swa_index_mapping[int(more[0])]) == int(a.full_to_swa_index_mapping[b_locs[-1]]) + 1
    m.add(more)
    b_locs += more.tolist()
    m.check()

    # backup, allocate and free, restore: both sides and the map as before
    state = a.backup_state()
    extra = a.alloc(page_size * 2)
    assert extra is not None
    a.free(_t(b_locs[:page_size]))  # a request alive at the backup, freed after it
    a.restore_state(state)
    assert not bool(a.full_to_swa_index_mapping[extra].any()), "the slots taken after the backup still map"
    m.check()

    # an allocation the window side cannot hold returns None and takes nothing from the full side
    full_before = a.full_available_size()
    assert a.alloc(a.swa_available_size() + page_size) is None
    assert a.full_available_size() == full_before
    m.check()

    # free both requests inside a free group: nothing comes back until the group ends
    a.free_group_begin()
    a.free(_t(a_locs))
    a.free(_t(b_locs))
    assert a.full_available_size() == full_before
    a.free_group_end()
    m.drop(a_locs)
    m.drop(b_locs)
    m.check()
    assert a.full_available_size() == FULL and a.swa_available_size() == WINDOW
    freed = _t(a_locs + b_locs)
    assert int(a.full_to_swa_index_mapping[freed].abs().sum()) == 0, "freed full locations still map to window slots"

    again = a.alloc(4 * page_size)
    m.add(again)
    m.check()
    a.clear()
    m.drop(again.tolist())
    m.check()


def test_the_map_is_registered_with_the_pool_and_absent_locations_stay_absent():
    registered = []

    class Pool:
        def register_mapping(self, mapping):
            registered.append(mapping)

    a = SWATokenToKVPoolAllocator(16, 8, 1, torch.bfloat16, DEVICE, kvcache=Pool(), need_sort=False)
    assert registered == [a.full_to_swa_index_mapping] and a.full_to_swa_index_mapping.numel() == 16 + 1
    loc = a.alloc(3)
    assert a.translate_loc_from_full_to_swa(loc).tolist() == a.full_to_swa_index_mapping[loc].tolist()
    assert a.translate_loc_from_full_to_swa(_t([-1, 0])).tolist() == [-1, 0]
    a.free_swa(loc[:1])
    assert int(a.translate_loc_from_full_to_swa(loc[:1])) == 0


def test_window_side_smaller_than_a_batch_refuses_it_whole():
    a = SWATokenToKVPoolAllocator(32, 8, 1, torch.bfloat16, DEVICE, kvcache=None, need_sort=False)
    pre, seq = _t([0, 0]), _t([5, 5])
    assert a.alloc_extend(pre, pre.cpu(), seq, seq.cpu(), _t([-1, -1]), 10) is None
    assert a.full_available_size() == 32 and a.swa_available_size() == 8
    assert a.alloc_decode(_t([1] * 9), None, _t([0] * 9)) is None
    assert a.full_available_size() == 32


# -- free_swa at page_size > 1: the window side gives back whole pages (issue 25) ---------------------------


def _request_of(a: SWATokenToKVPoolAllocator, tokens: int) -> torch.Tensor:
    """A new request of ``tokens`` tokens, prefilled by one alloc_extend."""
    pre, seq = _t([0]), _t([tokens])
    out = a.alloc_extend(pre, pre.cpu(), seq, seq.cpu(), _t([-1]), tokens)
    assert out is not None, f"no room for a request of {tokens} tokens"
    return out


def _window_of(a: SWATokenToKVPoolAllocator, locs: torch.Tensor) -> list[int]:
    return a.translate_loc_from_full_to_swa(locs).tolist()


def _paged_pair(kernels: str) -> SWATokenToKVPoolAllocator:
    """32 full tokens and 16 window slots in pages of 4 (pages 1..8 and 1..4): a first request of 8 tokens takes
    pages 1 and 2 on both sides."""
    return SWATokenToKVPoolAllocator(32, 16, 4, torch.bfloat16, DEVICE, kvcache=None, need_sort=False, kernels=kernels)


@pytest.mark.parametrize("kernels", ["native", "triton"])
def test_free_swa_of_one_token_clears_the_map_of_its_whole_window_page(kernels):
    """The issue's reproduction: free_swa of A's first token gives back A's first window page, so all four of
    its tokens must map to the padding slot; B then gets that page (freed pages come first) without sharing a
    window slot with A."""
    a = _paged_pair(kernels)
    A = _request_of(a, 8)
    assert A.tolist() == list(range(4, 12)) and _window_of(a, A) == list(range(4, 12))

    a.free_swa(A[:1])
    assert _window_of(a, A) == [0, 0, 0, 0, 8, 9, 10, 11]
    assert a.swa_available_size() == 16 - 4 and a.full_available_size() == 32 - 8

    B = _request_of(a, 12)
    assert B.tolist() == list(range(12, 24))
    assert _window_of(a, B) == [4, 5, 6, 7, *range(12, 20)]
    assert not set(_window_of(a, A)) - {0} & set(_window_of(a, B)), "a window slot is mapped by both A and B"
    assert a.swa_available_size() == 0


@pytest.mark.parametrize("kernels", ["native", "triton"])
def test_free_swa_twice_gives_nothing_back_twice(kernels):
    """A second free_swa inside a window page already given back, also once another request holds that page,
    changes nothing."""
    a = _paged_pair(kernels)
    A = _request_of(a, 8)
    a.free_swa(A[:1])
    a.free_swa(A[:1])
    assert a.swa_available_size() == 16 - 4 and _window_of(a, A) == [0, 0, 0, 0, 8, 9, 10, 11]

    B = _request_of(a, 4)  # takes window page 1, which A held
    assert _window_of(a, B) == [4, 5, 6, 7]
    a.free_swa(A[1:3])  # the other tokens of A's first page: their map was cleared with it
    a.free_swa(A[:4])
    assert a.swa_available_size() == 16 - 8, "a second free_swa of A's first page gave back B's window page"
    assert _window_of(a, B) == [4, 5, 6, 7] and _window_of(a, A) == [0, 0, 0, 0, 8, 9, 10, 11]


@pytest.mark.parametrize("kernels", ["native", "triton"])
def test_free_after_free_swa_gives_back_only_the_pages_still_held(kernels):
    """free of a request whose first window page went back early (and went to B) gives back its full pages and
    its remaining window page, not B's."""
    a = _paged_pair(kernels)
    A = _request_of(a, 8)
    a.free_swa(A[1:2])
    B = _request_of(a, 4)
    assert _window_of(a, B) == [4, 5, 6, 7]

    a.free(A)
    assert a.full_available_size() == 32 - 4 and a.swa_available_size() == 16 - 4
    assert _window_of(a, B) == [4, 5, 6, 7] and _window_of(a, A) == [0] * 8
    a.free(B)
    assert a.full_available_size() == 32 and a.swa_available_size() == 16


@pytest.mark.parametrize("kernels", ["native", "triton"])
def test_free_swa_inside_a_free_group(kernels):
    """free_swa is not held by a free group (as SGLang's): A's first window page comes back at once and goes to
    B; A's free is held until the group ends, and then gives back only A's own pages."""
    a = _paged_pair(kernels)
    A = _request_of(a, 8)
    a.free_group_begin()
    a.free_swa(A[:1])
    assert a.swa_available_size() == 16 - 4
    B = _request_of(a, 8)
    assert _window_of(a, B)[:4] == [4, 5, 6, 7]
    a.free(A)
    assert a.full_available_size() == 32 - 16 and a.swa_available_size() == 16 - 12, "a free inside the group came back"
    a.free_group_end()
    assert a.full_available_size() == 32 - 8 and a.swa_available_size() == 16 - 8
    assert _window_of(a, B)[:4] == [4, 5, 6, 7] and _window_of(a, A) == [0] * 8


def test_free_swa_at_page_size_1_frees_only_the_tokens_named():
    a = SWATokenToKVPoolAllocator(16, 8, 1, torch.bfloat16, DEVICE, kvcache=None, need_sort=False)
    A = _request_of(a, 4)
    window = _window_of(a, A)
    a.free_swa(A[1:2])
    assert _window_of(a, A) == [window[0], 0, *window[2:]] and a.swa_available_size() == 8 - 3
    a.free_swa(A[1:2])
    assert a.swa_available_size() == 8 - 3


@pytest.mark.parametrize("page_size", [1, 4])
def test_free_swa_ignores_locations_no_page_holds(page_size):
    """Negative locations and those past the last whole page (30 tokens hold 7 pages of 4) change nothing."""
    a = SWATokenToKVPoolAllocator(30, 16, page_size, torch.bfloat16, DEVICE, kvcache=None, need_sort=False)
    A = _request_of(a, 8)
    before = _window_of(a, A), a.swa_available_size()
    a.free_swa(_t([-1, -4, 30 + page_size - 1, 10**6]))
    assert (_window_of(a, A), a.swa_available_size()) == before
