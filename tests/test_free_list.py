"""kvcore.kernels.free_list: the allocators' device free lists, against plain Python lists on random operations (both
implementations), and the decode loop of both allocators under CUDA's sync debug mode on a GPU."""

from __future__ import annotations

import os
import random

import pytest
import torch

from kvcore.kernels import allocator_kernels as K
from kvcore.kernels import free_list
from kvcore.allocators import PagedTokenToKVPoolAllocator, TokenToKVPoolAllocator
from kvcore.kernels.free_list import ALLOCATED, FREE, FreePageList

COMPILED = os.environ.get("KVCORE_TEST_COMPILED") == "1"
DEVICE = torch.device("cuda" if COMPILED else "cpu")
IMPLS = [True, False]  # use_triton


class Model:
    """What a :class:`FreePageList` holds, as Python lists."""

    def __init__(self, capacity: int, page_size: int, to_front: bool, need_sort: bool, sort_each_free: bool = False):
        self.ps, self.to_front, self.need_sort, self.sort_each_free = page_size, to_front, need_sort, sort_each_free
        self.ring, self.held, self.staged = list(range(1, capacity + 1)), [], []
        self.allocated: set[int] = set()

    def take(self, n: int) -> list[int]:
        out, self.ring = self.ring[:n], self.ring[n:]
        self.allocated |= set(out)
        return out

    def release(self, tokens: list[int], staged: bool) -> None:
        kept = []
        for t in tokens:
            page = t // self.ps
            if page in self.allocated:
                self.allocated.discard(page)
                kept.append(page)
        self._put(kept, staged)

    def commit(self) -> None:
        staged, self.staged = self.staged, []
        self._put(staged, False)

    def _put(self, pages: list[int], staged: bool) -> None:
        if staged:
            self.staged += pages  # in order: the commit is the free that sorts
            return
        if self.sort_each_free:
            pages = sorted(pages)
        if self.need_sort:
            self.held += pages
        elif self.to_front:
            self.ring = pages + self.ring
        else:
            self.ring = self.ring + pages

    def merge(self) -> None:
        self.ring, self.held = sorted(self.ring + self.held), []


def _tokens(rng: random.Random, pages: list[int], ps: int) -> list[int]:
    """Token indices of ``pages`` (some tokens of each, some twice, shuffled a little), plus strays: the
    padding page, out-of-range and negative tokens."""
    tokens = [p * ps + rng.randrange(ps) for p in pages for _ in range(rng.randint(1, 2))]
    if tokens and rng.random() < 0.5:
        i = rng.randrange(len(tokens))
        tokens.insert(rng.randrange(len(tokens) + 1), tokens[i])
    if rng.random() < 0.3:
        tokens.insert(rng.randrange(len(tokens) + 1), rng.randrange(ps))  # the padding page
    return tokens


MODES = {  # to_front, need_sort, sort_each_free
    "front": (True, False, False),  # the token allocator's order, at the head
    "back": (False, False, False),  # the token allocator's
    "need_sort": (True, True, False),
    "front-sorted": (True, False, True),  # the paged allocator's
    "back-sorted": (False, False, True),
    "need_sort-sorted": (True, True, True),  # the paged allocator's under need_sort
}


#: (use_triton, blocks) of the random runs: the release kernel's blocks as shipped, or small (Triton only: the
#: torch reference has no blocks), so that random frees of a few pages cross blocks and sorted frees take both
#: ways: ranks counted in several tiles, and a pass over the page states
RANDOM_RUNS = {"triton": (True, False), "triton-small-blocks": (True, True), "native": (False, False)}


@pytest.mark.parametrize("run", sorted(RANDOM_RUNS))
@pytest.mark.parametrize("mode", sorted(MODES))
@pytest.mark.parametrize("seed", range(3))
def test_random_operations_match_lists(run, mode, seed, monkeypatch):
    use_triton, small_blocks = RANDOM_RUNS[run]
    if small_blocks:
        monkeypatch.setattr(free_list, "_BLOCK", 8)
        monkeypatch.setattr(free_list, "_RANK_ROWS", 4)
        monkeypatch.setattr(free_list, "_RANK_COLS", 2)
        monkeypatch.setattr(free_list, "_SCAN_BLOCK", 8)
    to_front, need_sort, sort_each_free = MODES[mode]
    rng = random.Random(seed)
    capacity, ps = rng.choice([(7, 1), (13, 3), (40, 2)])
    fl = FreePageList(capacity, ps, DEVICE, use_triton=use_triton, to_front=to_front, need_sort=need_sort,
                      sort_each_free=sort_each_free)  # fmt: skip
    model = Model(capacity, ps, to_front, need_sort, sort_each_free)
    pages_impl = K.alloc_pages_triton if use_triton else K.alloc_pages_native
    decode_impl = K.alloc_decode_triton if use_triton else K.alloc_decode_native
    in_group, snap = False, None
    for step in range(60):
        op = rng.choice(["take", "take", "decode", "release", "release", "group", "merge", "snapshot", "restore"])
        if op == "decode":  # a decode step: the kernel counts the pages it takes
            free, bs = fl.exact()[0], rng.randint(0, 6)
            opens = [rng.random() < 0.5 for _ in range(bs)]
            while sum(opens) > free:
                opens[opens.index(True)] = False
            seq = torch.tensor([3 * ps + 1 if o else 3 * ps + 2 - (ps == 1) for o in opens], dtype=torch.int64)
            if ps == 1:  # every token opens a page
                seq, opens = seq[: free], [True] * min(bs, free)
            last = torch.arange(seq.numel(), dtype=torch.int64) * 10 + 5
            fl.before_write()
            got = decode_impl(seq.to(DEVICE), last.to(DEVICE), fl.decode_source(seq.numel()), ps).tolist()
            pages = iter(model.take(sum(opens)))
            assert got == [next(pages) * ps if o else int(l) + 1 for o, l in zip(opens, last)], f"step {step}"
            assert fl.known <= fl.exact()[0]
        elif op == "take":
            n = rng.randint(0, max(0, fl.exact()[0]))
            fl.before_write()
            got = pages_impl(fl.source(), n, ps)
            fl.took(n)
            assert (got[::ps] // ps).tolist() == model.take(n), f"step {step}: take({n})"
        elif op == "release" and model.allocated:
            chosen = rng.sample(sorted(model.allocated), rng.randint(1, len(model.allocated)))
            tokens = _tokens(rng, chosen, ps)
            if rng.random() < 0.2:  # a page freed again: ignored
                tokens += _tokens(rng, chosen[:1], ps)
            # inside a group, now and then a release beside the staged pages (a sorted one gathers its pages
            # after them)
            staged = in_group and rng.random() < 0.8
            fl.release(torch.tensor(tokens, dtype=torch.int64, device=DEVICE), staged=staged)
            model.release(tokens, staged)
        elif op == "group":
            if in_group:
                fl.commit_staged()
                model.commit()
            in_group = not in_group
        elif op == "merge" and not in_group:
            fl.merge_held()
            model.merge()
        elif op == "snapshot" and not in_group:
            snap = (fl.snapshot(), (list(model.ring), list(model.held), set(model.allocated)))
        elif op == "restore" and snap is not None and not in_group:
            fl.restore(snap[0])
            model.ring, model.held, model.allocated = list(snap[1][0]), list(snap[1][1]), set(snap[1][2])
        assert fl.ids().tolist() == model.ring, f"step {step} ({op})"
        assert fl.held_ids().tolist() == model.held, f"step {step} ({op})"
        assert fl.exact() == (len(model.ring), len(model.held))
        state = fl.state[1 : capacity + 1].tolist()
        assert [p + 1 for p, s in enumerate(state) if s == ALLOCATED] == sorted(model.allocated)
        assert all(s in (FREE, ALLOCATED) for s in state), "a free left a position mark behind"


def test_counts_from_an_abandoned_state_are_ignored():
    """A word published for a state that a restore abandoned (a kernel still in flight on a GPU) must not
    count: here it is written by hand, as a late kernel would."""
    fl = FreePageList(8, 1, DEVICE, use_triton=False, to_front=True, need_sort=False)
    snap = fl.snapshot()
    taken = K.alloc_pages_native(fl.source(), 4, 1)
    fl.took(4)
    old_epoch = fl._epoch
    fl.restore(snap)
    fl._words[0] = (old_epoch << 40) | 100  # "100 pages added" in the abandoned epoch
    assert fl.refresh() == 8 and fl.exact() == (8, 0)
    assert taken.tolist() == [1, 2, 3, 4] and fl.ids().tolist() == list(range(1, 9))


@pytest.mark.parametrize("use_triton", IMPLS, ids=["triton", "native"])
def test_decode_counts_reach_the_host_through_the_words(use_triton):
    """A decode step counts its pages on the device; until its word is read the host assumes the most it may
    have taken, and a word written by an earlier launch (still the latest the host can see while later kernels
    run) tightens only what that launch covers.  A word of an abandoned epoch counts for nothing."""
    decode = K.alloc_decode_triton if use_triton else K.alloc_decode_native
    fl = FreePageList(16, 4, DEVICE, use_triton=use_triton, to_front=True, need_sort=False)

    def step(seq):
        fl.before_write()
        source = fl.decode_source(len(seq))
        decode(torch.tensor(seq, device=DEVICE), torch.zeros(len(seq), dtype=torch.int64, device=DEVICE), source, 4)

    step([5, 6, 9, 13, 2])  # 5, 9 and 13 open a page: 3 of at most 5
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()
    first = int(fl._words[0])
    step([1, 3, 17])  # 2 of at most 3
    assert fl.known == 16 - 5 - 3  # nothing read yet: the most each step may have taken
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()
    second = int(fl._words[0])
    fl._words[0] = first  # as if the second step's kernel were still running
    assert fl.refresh() == 16 - 3 - 3
    fl._words[0] = second
    assert fl.refresh() == 16 - 3 - 2 == fl.exact()[0]
    fl.restore(fl.snapshot())  # a new epoch
    step([1])
    fl._words[0] = second  # a word of the old epoch: ignored
    assert fl.refresh() == 11 - 1 and fl.exact()[0] == 10


def test_an_empty_free_group_launches_nothing(monkeypatch):
    """Most decode steps of an engine end an empty free group: its commit must cost no launch.  A commit after a
    staged release launches once; after a restore it launches (the snapshot may hold staged pages)."""
    fl = FreePageList(8, 1, DEVICE, use_triton=False, to_front=True, need_sort=False)
    launches, put = [], fl._put
    monkeypatch.setattr(fl, "_put", lambda index, staged, from_staged: (launches.append(from_staged),
                                                                          put(index, staged, from_staged)))  # fmt: skip
    fl.commit_staged()
    assert launches == []
    taken = K.alloc_pages_native(fl.source(), 2, 1)
    fl.took(2)
    fl.release(taken, staged=True)
    assert fl.exact() == (6, 0)  # staged: not free yet
    fl.commit_staged()
    fl.commit_staged()
    assert launches == [False, True] and fl.exact() == (8, 0)
    fl.restore(fl.snapshot())
    fl.commit_staged()
    assert launches == [False, True, True] and fl.exact() == (8, 0)

    alloc = PagedTokenToKVPoolAllocator(64, 4, torch.bfloat16, DEVICE, None, need_sort=False, kernels="native")
    monkeypatch.setattr(FreePageList, "_put", lambda *args: pytest.fail("an empty group launched"))
    alloc.free_group_begin()
    alloc.free_group_end()


@pytest.mark.parametrize("use_triton", IMPLS, ids=["triton", "native"])
@pytest.mark.parametrize("sort_each_free", [False, True], ids=["first-occurrence", "ascending"])
def test_long_frees_cross_the_kernel_block(use_triton, sort_each_free):
    """More tokens than one block of the release kernel, pages repeating across blocks."""
    ps, capacity = 2, 1500
    fl = FreePageList(capacity, ps, DEVICE, use_triton=use_triton, to_front=True, need_sort=False,
                      sort_each_free=sort_each_free)  # fmt: skip
    fl.before_write()
    got = (K.alloc_pages_triton if use_triton else K.alloc_pages_native)(fl.source(), capacity, ps)
    fl.took(capacity)
    order = list(range(capacity, 0, -1))
    tokens = [p * ps + 1 for p in order] + [p * ps for p in order[::3]]  # every page, then a third again
    fl.release(torch.tensor(tokens, device=DEVICE))
    assert got.numel() == capacity * ps and fl.ids().tolist() == (sorted(order) if sort_each_free else order)


@pytest.mark.parametrize("use_triton", IMPLS, ids=["triton", "native"])
@pytest.mark.parametrize("spread", ["wide", "narrow"])
@pytest.mark.parametrize("grouped", [False, True], ids=["free", "group"])
def test_sorted_frees_of_many_pages(use_triton, spread, grouped):
    """A sorted free of hundreds of pages, with the kernel's own blocks: pages spread over a wide range are
    ranked over several tiles of comparisons, pages of a narrow range by a pass over its page states; from a
    release, or from a commit of three staged releases (one free)."""
    rng = random.Random(f"{spread}{grouped}")
    capacity, ps = 20000, 3
    fl = FreePageList(capacity, ps, DEVICE, use_triton=use_triton, to_front=True, need_sort=False, sort_each_free=True)
    fl.before_write()
    K.alloc_pages_native(fl.source(), capacity - 2, ps)  # pages 1 .. capacity - 2; the last two stay free
    fl.took(capacity - 2)
    pages = rng.sample(range(1, capacity - 1), 300) if spread == "wide" else rng.sample(range(5000, 6400), 1300)
    tokens = [p * ps + rng.randrange(ps) for p in pages for _ in range(rng.randint(1, 2))]
    tokens += rng.sample(tokens, 50) + [0, 1, (capacity - 1) * ps]  # again, the padding page, a free page
    rng.shuffle(tokens)
    parts = [tokens[: len(tokens) // 3], tokens[len(tokens) // 3 : len(tokens) // 2], tokens[len(tokens) // 2 :]]
    for part in parts if grouped else [tokens]:
        fl.release(torch.tensor(part, dtype=torch.int64, device=DEVICE), staged=grouped)
    fl.commit_staged()
    assert fl.ids().tolist() == sorted(pages) + [capacity - 1, capacity]
    state = fl.state[1 : capacity + 1]
    assert (state == FREE).sum() == len(pages) + 2 and bool((state[torch.tensor(pages) - 1] == FREE).all())
    assert bool(((state == FREE) | (state == ALLOCATED)).all()), "a free left a mark behind"


# ------------------------------------------------------------------------------------------------------------
# The decode loop on a GPU
# ------------------------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the sync check needs a CUDA device (run compiled on the GPU)")
@pytest.mark.parametrize("kind, page_size", [("paged", 1), ("paged", 16), ("paged", 64), ("token", 1)])
def test_the_decode_loop_never_waits_for_the_device(kind, page_size):
    """alloc_decode (with the CPU lengths an engine has), alloc, free and free groups under sync debug mode
    "error": any call that made the host wait for the device would raise.  (The token allocator's pages hold one
    token.)"""
    bs, steps, finishing = 256, 6, 8
    size = bs * 64 * page_size
    if kind == "token":
        a = TokenToKVPoolAllocator(size, torch.bfloat16, "cuda", None, need_sort=False)
    else:
        a = PagedTokenToKVPoolAllocator(size, page_size, torch.bfloat16, "cuda", None, need_sort=False)
    seq = torch.ones(bs, dtype=torch.int64)
    last = a.alloc_extend(torch.zeros(bs, dtype=torch.int64, device="cuda"), seq * 0, seq.cuda(), seq,
                          torch.full((bs,), -1, dtype=torch.int64, device="cuda"), bs)  # fmt: skip
    finished = [a.alloc(finishing * page_size) for _ in range(steps)]  # pages of requests that end in the loop
    lengths = [seq + k + 1 for k in range(steps)]
    on_device = [x.cuda() for x in lengths]
    start = a.available_size()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for k in range(steps):
            last = a.alloc_decode(on_device[k], lengths[k], last)
            a.free_group_begin()
            a.free(finished[k])
            a.free_group_end()
            again = a.alloc(page_size)  # a new request's first page
            a.free(again)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    new_pages = sum(int(((x - 1) % page_size == 0).sum()) for x in lengths)
    assert a.available_size() == start + (steps * finishing - new_pages) * page_size  # exact (and may wait)
