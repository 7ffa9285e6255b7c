"""Token and paged KV allocators: kernels against torch references and a pure-Python model, and allocator
bookkeeping (None-when-short, padding slot, need_sort deferral, free groups, backup/restore, clear), with the
conformance kit's hypothesis state machine (extended with kvcore's own free lists) checking that live allocations
never overlap.

Triton kernels run under TRITON_INTERPRET=1 (set by the root conftest), so sizes stay small.
"""

from __future__ import annotations

import os
import random

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import initialize, invariant

from kvcore.kernels import allocator_kernels as K
from kvcore.kernels.free_list import ALLOCATED, PageSource
from kvcore.errors import ConfigError
from kvcore.allocators import (
    BaseTokenToKVPoolAllocator,
    PagedTokenToKVPoolAllocator,
    TokenToKVPoolAllocator,
)
from kvcore.testing import AllocatorMachine

COMPILED = os.environ.get("KVCORE_TEST_COMPILED") == "1"
if COMPILED and not torch.cuda.is_available():
    pytest.skip("KVCORE_TEST_COMPILED=1 needs a CUDA device", allow_module_level=True)
DEVICE = "cuda" if COMPILED else "cpu"

KERNELS = ["triton", "native"]
PAGE_SIZES = [1, 3, 16, 64]

EXTEND_IMPLS = {"triton": K.alloc_extend_triton, "native": K.alloc_extend_native}
DECODE_IMPLS = {"triton": K.alloc_decode_triton, "native": K.alloc_decode_native}


# ------------------------------------------------------------------------------------------------------------
# Pure-Python model: walks the tokens one at a time, keeping a write cursor (independent of the closed-form
# arithmetic the kernels and references use).
# ------------------------------------------------------------------------------------------------------------


def model_extend(pre, seq, last, free, ps):
    """Returns (locations, pages used)."""
    out, used = [], 0
    for p, s, loc in zip(pre, seq, last):
        for t in range(p, s):
            if t % ps == 0:  # this token opens a page
                loc = free[used] * ps
                used += 1
            else:  # next slot of the page the previous token is in
                loc = loc + 1
            out.append(loc)
    return out, used


def model_decode(seq, last, free, ps):
    out, used = [], 0
    for s, loc in zip(seq, last):
        if (s - 1) % ps == 0:
            out.append(free[used] * ps)
            used += 1
        else:
            out.append(loc + 1)
    return out, used


def random_batch(rng: random.Random, ps: int, bs: int, max_len: int):
    """prefix/seq lens (0 prefixes, page-aligned prefixes, zero-token extends) and consistent last_loc."""
    pre, seq, last = [], [], []
    for _ in range(bs):
        kind = rng.randrange(4)
        if kind == 0:
            p = 0
        elif kind == 1:
            p = ps * rng.randint(1, 3)  # prefix ends exactly on a page boundary
        else:
            p = rng.randint(1, max_len)
        s = p + (0 if rng.random() < 0.1 else rng.randint(1, max_len))
        if p % ps:
            loc = rng.randint(5000, 6000) * ps + (p - 1) % ps
        elif p == 0:
            loc = -1
        else:  # ignored: either value must give the same result
            loc = rng.choice([-1, rng.randint(5000, 6000) * ps + ps - 1])
        pre.append(p)
        seq.append(s)
        last.append(loc)
    return pre, seq, last


def allocated(source: PageSource) -> list[int]:
    """The pages a kernel marked allocated."""
    return torch.nonzero(source.state[:-1] == ALLOCATED).reshape(-1).tolist()  # the last: a spare slot


def tensors(*lists, dtype=torch.int64):
    return [torch.tensor(x, dtype=dtype, device=DEVICE) for x in lists]


# ------------------------------------------------------------------------------------------------------------
# Kernels vs references vs model
# ------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("ps", PAGE_SIZES)
@pytest.mark.parametrize("bs", [1, 5, K._LIST_COUNT_MAX, K._LIST_COUNT_MAX + 1, 200])
def test_extend_counts_are_the_tokens_and_pages_of_an_extend(ps, bs):
    """One pass over the CPU lengths gives the tokens and the new pages, counted on the lists for small batches
    and through numpy for large ones, both as the model counts them (int32 and int64 lengths)."""
    rng = random.Random(bs * 7 + ps)
    pre, seq, last = random_batch(rng, ps, bs, max_len=3 * ps + 9)
    _, pages = model_extend(pre, seq, last, list(range(10**6)), ps)
    for dtype in (torch.int32, torch.int64):
        pre_t, seq_t = (torch.tensor(x, dtype=dtype) for x in (pre, seq))
        assert K.extend_counts(pre_t, seq_t, ps) == (sum(seq) - sum(pre), pages)


@pytest.mark.parametrize("ps", PAGE_SIZES)
@pytest.mark.parametrize("seed", range(4))
def test_alloc_extend_kernel_matches_reference_and_model(ps, seed):
    rng = random.Random(seed * 100 + ps)
    bs = rng.randint(1, 6)
    pre, seq, last = random_batch(rng, ps, bs, max_len=2 * ps + 5)
    _, need = model_extend(pre, seq, last, list(range(10**6)), ps)
    free = rng.sample(range(1, 4000), need + rng.randint(0, 3))  # shuffled, with spare pages
    expected, used = model_extend(pre, seq, last, free, ps)
    assert used == need == K.num_new_pages_extend(*tensors(pre, seq), ps)

    lens_dtype = torch.int32 if seed % 2 else torch.int64
    pre_t, seq_t = tensors(pre, seq, dtype=lens_dtype)
    (last_t, free_t) = tensors(last, free)
    n = sum(seq) - sum(pre)
    results = {}
    for name, fn in EXTEND_IMPLS.items():
        source = PageSource.of(free_t)
        out = fn(pre_t, seq_t, last_t, source, ps, n)
        assert out.dtype == torch.int64 and out.shape == (n,)
        assert out.tolist() == expected, name
        assert allocated(source) == sorted(free[:used]), name
        results[name] = out
    assert torch.equal(results["triton"], results["native"])


@pytest.mark.parametrize("ps", PAGE_SIZES)
@pytest.mark.parametrize("seed", range(4))
def test_alloc_decode_kernel_matches_reference_and_model(ps, seed):
    rng = random.Random(seed * 100 + ps + 7)
    bs = rng.randint(1, 8)
    seq, last = [], []
    for _ in range(bs):
        s = rng.choice([1, ps + 1, 2 * ps + 1, rng.randint(1, 4 * ps + 2)])  # page openers and others
        seq.append(s)
        last.append(rng.randint(5000, 6000) * ps + (s - 2) % ps if s > 1 else -1)
    _, need = model_decode(seq, last, list(range(10**6)), ps)
    free = rng.sample(range(1, 4000), need + rng.randint(0, 3))
    expected, used = model_decode(seq, last, free, ps)
    assert used == need == K.num_new_pages_decode(torch.tensor(seq), ps)

    lens_dtype = torch.int32 if seed % 2 else torch.int64
    (seq_t,) = tensors(seq, dtype=lens_dtype)
    last_t, free_t = tensors(last, free)
    results = {}
    for name, fn in DECODE_IMPLS.items():
        source = PageSource.of(free_t)
        out = fn(seq_t, last_t, source, ps)
        assert out.dtype == torch.int64 and out.shape == (bs,)
        assert out.tolist() == expected, name
        assert allocated(source) == sorted(free[:used]), name
        # the pages taken are counted on the device: OFFSET and ADDED move back by them, and ADDED is published
        assert source.ctl[:2].tolist() == [-used, -used], name
        assert int(source.words[0]) == source.word_bits | (-used & 0xFFFFFFFF), name
        results[name] = out
    assert torch.equal(results["triton"], results["native"])


def test_kernels_large_batch_and_long_request():
    """Batches longer than the kernels' request block and requests longer than their token block."""
    rng = random.Random(1)
    ps = 3
    bs = K._BS_BLOCK + 20
    pre, seq, last = random_batch(rng, ps, bs, max_len=4)
    pre[5], seq[5], last[5] = 4, 4 + 2 * K._TOKEN_BLOCK + 7, 5000 * ps
    _, need = model_extend(pre, seq, last, list(range(10**6)), ps)
    free = rng.sample(range(1, 10**5), need)
    expected, _ = model_extend(pre, seq, last, free, ps)
    pre_t, seq_t, last_t, free_t = tensors(pre, seq, last, free)
    n = sum(seq) - sum(pre)
    for fn in EXTEND_IMPLS.values():
        assert fn(pre_t, seq_t, last_t, PageSource.of(free_t), ps, n).tolist() == expected

    dseq = [s + 1 for s in seq]
    dlast = [5000 * ps + (s - 1) % ps for s in seq]
    expected, _ = model_decode(dseq, dlast, free, ps)
    for fn in DECODE_IMPLS.values():
        assert fn(*tensors(dseq, dlast), PageSource.of(free_t), ps).tolist() == expected


@pytest.mark.parametrize("impl", KERNELS)
def test_kernels_empty_inputs(impl):
    free = PageSource.of(torch.arange(1, 5, device=DEVICE))
    (z,) = tensors([])
    assert EXTEND_IMPLS[impl](z, z, z, free, 4, 0).numel() == 0
    assert DECODE_IMPLS[impl](z, z, free, 4).numel() == 0
    one, four, fourteen = tensors([3], [4], [14])
    assert EXTEND_IMPLS[impl](one, one, fourteen, free, 4, 0).numel() == 0  # zero-token extend
    # No free page needed, empty free list.
    out = EXTEND_IMPLS[impl](one, four, fourteen, PageSource.of(z), 4, 1)
    assert out.tolist() == [15]


def test_kernel_arg_shape_errors():
    a = torch.tensor([1, 2])
    with pytest.raises(ValueError, match="one length"):
        K.alloc_extend_native(a, a, torch.tensor([1]), PageSource.of(a), 4, 2)
    with pytest.raises(ValueError, match="seq_lens and last_loc"):
        K.alloc_decode_native(a, torch.tensor([1]), PageSource.of(a), 4)


# ------------------------------------------------------------------------------------------------------------
# Allocators
# ------------------------------------------------------------------------------------------------------------


def make(kind, size, ps=1, need_sort=False, kernels="native"):
    if kind == "token":
        return TokenToKVPoolAllocator(size, torch.float16, DEVICE, "KV", need_sort, kernels=kernels)
    return PagedTokenToKVPoolAllocator(size, ps, torch.float16, DEVICE, "KV", need_sort, kernels=kernels)


def state_lists(a):
    return a.free_pages.tolist(), a.release_pages.tolist()


def test_fresh_state_and_attributes():
    a = make("token", 10)
    assert isinstance(a, BaseTokenToKVPoolAllocator)
    assert a.free_pages.tolist() == list(range(1, 11)) and a.free_pages.dtype == torch.int64
    assert a.release_pages.numel() == 0 and a.page_size == 1 and a.size == 10
    assert a.available_size() == 10 and a.get_kvcache() == "KV" and a.dtype == torch.float16
    assert a.is_not_in_free_group and a.free_group == []

    p = make("paged", 35, ps=4)
    assert p.num_pages == 8 and p.free_pages.tolist() == list(range(1, 9))
    assert p.available_size() == 32 and p.page_size == 4 and p.device == torch.device(DEVICE)


def test_constructor_errors():
    with pytest.raises(ConfigError, match="size"):
        make("token", 0)
    with pytest.raises(ConfigError, match="page_size"):
        make("paged", 8, ps=0)
    with pytest.raises(ConfigError, match="no whole page"):
        make("paged", 3, ps=4)
    with pytest.raises(ConfigError, match="hardware.kernels"):
        make("paged", 8, ps=4, kernels="cuda")


@pytest.mark.parametrize("need_sort", [False, True])
def test_token_alloc_short_changes_nothing(need_sort):
    a = make("token", 8, need_sort=need_sort)
    x = a.alloc(5)
    assert x.tolist() == [1, 2, 3, 4, 5]
    a.free(x[:2])
    before = state_lists(a)
    assert a.alloc(7) is None
    assert state_lists(a) == before and a.available_size() == 5
    assert a.alloc(5) is not None and a.available_size() == 0
    assert a.alloc(1) is None
    assert a.alloc(0).numel() == 0


@pytest.mark.parametrize("need_sort", [False, True])
def test_paged_alloc_short_changes_nothing(need_sort):
    a = make("paged", 16, ps=4, need_sort=need_sort)
    x = a.alloc(8)
    assert x.tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    a.free(x[4:])
    before = state_lists(a)
    assert a.alloc(16) is None
    assert state_lists(a) == before and a.available_size() == 12
    pre, seq, last = tensors([0, 0], [5, 9], [-1, -1])
    assert a.alloc_extend(pre, None, seq, None, last, 14) is None  # needs 2 + 3 pages, 3 left
    assert state_lists(a) == before
    seq, last = tensors([1, 1, 5, 9], [-1, -1, 3, 7])
    assert a.alloc_decode(seq, None, last) is None  # needs 4 pages
    assert state_lists(a) == before


def test_paged_alloc_needs_whole_pages():
    a = make("paged", 16, ps=4)
    with pytest.raises(ValueError, match=r"need_size=6 .* page_size=4"):
        a.alloc(6)
    assert a.available_size() == 16


@pytest.mark.parametrize("kind,ps", [("token", 1), ("paged", 1), ("paged", 3)])
def test_padding_slot_never_handed_out_and_realloc(kind, ps):
    a = make(kind, 12 if ps == 1 else 12, ps=ps)
    got = a.alloc(a.available_size())
    assert 0 not in (got // ps).tolist()
    assert sorted(got.tolist()) == list(range(ps, ps + 12 // ps * ps))
    assert a.alloc(ps) is None
    a.free(got[ps : 3 * ps])
    again = a.alloc(2 * ps)
    assert sorted(again.tolist()) == sorted(got[ps : 3 * ps].tolist())


def test_token_free_appends_paged_free_prepends():
    a = make("token", 6)
    x = a.alloc(3)
    a.free(x[1:2])
    assert a.free_pages.tolist() == [4, 5, 6, 2]
    p = make("paged", 24, ps=4)
    y = p.alloc(8)  # pages 1, 2
    p.free(y)
    assert p.free_pages.tolist() == [1, 2, 3, 4, 5, 6]
    y = p.alloc(8)
    p.free(y[5:6])  # one token of page 2 frees page 2
    assert p.free_pages.tolist() == [2, 3, 4, 5, 6]


def _page_tokens(pages, ps, *, extra=()):
    """The token indices of whole ``pages``, each page's tokens backwards (the order must not matter), then
    ``extra`` token indices."""
    tokens = [p * ps + o for p in pages for o in reversed(range(ps))] + list(extra)
    return torch.tensor(tokens, dtype=torch.int64, device=DEVICE)


@pytest.mark.parametrize("kernels", KERNELS)
@pytest.mark.parametrize("ps", [1, 16, 64])
def test_paged_free_hands_pages_out_in_sglangs_order(kernels, ps):
    # SGLang's paged free puts torch.unique of the freed pages (ascending) at the head of the free list, so the
    # pages of one free come back lowest first, before the older free pages; a page given twice, a page that
    # is already free and the padding page are dropped (kvcore's rule).
    a = make("paged", 10 * ps, ps=ps, kernels=kernels)
    assert (a.alloc(8 * ps)[::ps] // ps).tolist() == list(range(1, 9))  # free: [9, 10]
    a.free(_page_tokens([7, 3, 5], ps, extra=[3 * ps, 9 * ps, 0]))  # page 3 again, free page 9, padding
    expected = [3, 5, 7] + [9, 10]
    assert a.free_pages.tolist() == expected
    a.free(_page_tokens([8, 1], ps))
    expected = [1, 8] + expected
    assert a.free_pages.tolist() == expected
    # the next allocations take them from the head, in that order: whole pages, an extend, a decode step
    assert (a.alloc(ps)[::ps] // ps).tolist() == expected[:1]
    pre, seq, last = tensors([0, 0], [ps, 1], [-1, -1])
    out = a.alloc_extend(pre, pre.cpu(), seq, seq.cpu(), last, ps + 1)
    assert (out[[0, ps]] // ps).tolist() == expected[1:3]
    seq, last = tensors([1, 1], [-1, -1])
    assert (a.alloc_decode(seq, seq.cpu(), last) // ps).tolist() == expected[3:5]
    assert a.free_pages.tolist() == expected[5:]


@pytest.mark.parametrize("kernels", KERNELS)
@pytest.mark.parametrize("ps", [1, 16, 64])
def test_paged_free_group_is_one_sorted_free(kernels, ps):
    # SGLang's free_group_end frees the concatenation of the group's frees: one torch.unique over all of them.
    a = make("paged", 10 * ps, ps=ps, kernels=kernels)
    a.alloc(8 * ps)
    a.free_group_begin()
    a.free(_page_tokens([7, 3], ps))
    a.free(_page_tokens([5, 1], ps, extra=[7 * ps]))
    a.free_group_end()
    assert a.free_pages.tolist() == [1, 3, 5, 7, 9, 10]
    assert (a.alloc(4 * ps)[::ps] // ps).tolist() == [1, 3, 5, 7]


@pytest.mark.parametrize("kernels", KERNELS)
@pytest.mark.parametrize("ps", [1, 16])
def test_paged_need_sort_keeps_each_free_sorted_until_the_merge(kernels, ps):
    # Under need_sort SGLang appends each free's torch.unique to its deferred pages and sorts all of them with
    # the free list when an allocation falls short.
    a = make("paged", 10 * ps, ps=ps, need_sort=True, kernels=kernels)
    a.alloc(8 * ps)
    a.free(_page_tokens([7, 3, 5], ps))
    a.free(_page_tokens([4, 2], ps))
    assert a.release_pages.tolist() == [3, 5, 7, 2, 4] and a.free_pages.tolist() == [9, 10]
    assert (a.alloc(4 * ps)[::ps] // ps).tolist() == [2, 3, 4, 5]  # short: merged and sorted first
    assert a.free_pages.tolist() == [7, 9, 10] and a.release_pages.numel() == 0


@pytest.mark.parametrize("kernels", KERNELS)
@pytest.mark.parametrize("need_sort", [False, True])
def test_token_free_keeps_the_order_given(kernels, need_sort):
    # SGLang's token allocator appends the freed slots as given, unsorted (to release_pages under need_sort),
    # and a free group as the concatenation of its frees; kvcore drops a slot given twice and the padding slot.
    a = make("token", 10, need_sort=need_sort, kernels=kernels)
    a.alloc(8)
    a.free(torch.tensor([7, 3, 5, 3, 0], device=DEVICE))
    a.free_group_begin()
    a.free(torch.tensor([8, 1], device=DEVICE))
    a.free(torch.tensor([2], device=DEVICE))
    a.free_group_end()
    freed = [7, 3, 5, 8, 1, 2]
    if need_sort:
        assert a.free_pages.tolist() == [9, 10] and a.release_pages.tolist() == freed
    else:
        assert a.free_pages.tolist() == [9, 10] + freed
        assert a.alloc(4).tolist() == [9, 10, 7, 3]


def test_empty_free_is_noop():
    for a in (make("token", 4, need_sort=True), make("paged", 8, ps=2)):
        before = state_lists(a)
        a.free(torch.empty(0, dtype=torch.int64, device=DEVICE))
        assert state_lists(a) == before


@pytest.mark.parametrize("kind,ps", [("token", 1), ("paged", 2)])
def test_need_sort_defers_and_merges_sorted(kind, ps):
    a = make(kind, 8 * ps, ps=ps, need_sort=True)
    x = a.alloc(6 * ps)  # pages 1..6
    a.free(x[4 * ps : 5 * ps])  # page 5
    a.free(x[0:ps])  # page 1
    a.free(x[2 * ps : 3 * ps])  # page 3
    assert a.free_pages.tolist() == [7, 8]
    assert sorted(a.release_pages.tolist()) == [1, 3, 5]
    assert a.available_size() == 5 * ps
    y = a.alloc(2 * ps)  # fits in the free list: no merge
    assert (y // ps).unique().tolist() == [7, 8] and a.free_pages.numel() == 0
    z = a.alloc(2 * ps)  # short: merge and sort first
    assert (z[::ps] // ps).tolist() == [1, 3]
    assert a.free_pages.tolist() == [5] and a.release_pages.numel() == 0
    a.free(z)
    assert a.alloc(4 * ps) is None  # still short after merging: nothing merged
    assert a.free_pages.tolist() == [5] and sorted(a.release_pages.tolist()) == [1, 3]


@pytest.mark.parametrize("kind,ps", [("token", 1), ("paged", 4)])
@pytest.mark.parametrize("need_sort", [False, True])
def test_free_group(kind, ps, need_sort):
    a = make(kind, 8 * ps, ps=ps, need_sort=need_sort)
    x = a.alloc(6 * ps)
    a.free_group_begin()
    assert not a.is_not_in_free_group
    a.free(x[:ps])
    a.free(x[2 * ps : 4 * ps])
    a.free(torch.empty(0, dtype=torch.int64, device=DEVICE))
    assert a.available_size() == 2 * ps
    a.free_group_end()
    assert a.is_not_in_free_group and a.free_group == []
    assert a.available_size() == 5 * ps
    freed = sorted(a.free_pages.tolist() + a.release_pages.tolist())
    assert freed == [1, 3, 4, 7, 8]
    a.free_group_begin()
    a.free_group_end()  # empty group
    assert a.available_size() == 5 * ps


@pytest.mark.parametrize("kind,ps", [("token", 1), ("paged", 16)])
@pytest.mark.parametrize("need_sort", [False, True])
def test_free_group_keeps_a_copy_of_each_freed_tensor(kind, ps, need_sort):
    # An engine reuses its index tensor before the group ends (SGLang's scheduler does): the pending frees must
    # be what the tensor held at free() time, not what it holds at free_group_end().
    a = make(kind, 8 * ps, ps=ps, need_sort=need_sort)
    x = a.alloc(8 * ps)
    a.free_group_begin()
    reused = x[: 2 * ps].clone()
    a.free(reused)
    reused.zero_()  # the caller's buffer now points at the padding slot
    a.free_group_end()
    assert a.available_size() == 2 * ps
    free = sorted(a.free_pages.tolist() + a.release_pages.tolist())
    assert free == [1, 2], f"pending frees changed with the caller's tensor: free pages {free}"
    assert a.alloc(2 * ps).min().item() >= ps, "the padding page was handed out"


@pytest.mark.parametrize("kind,ps", [("token", 1), ("paged", 16)])
def test_nested_free_group_begin_is_refused_and_keeps_pending_frees(kind, ps):
    a = make(kind, 8 * ps, ps=ps)
    x = a.alloc(8 * ps)
    a.free_group_begin()
    a.free(x[: 2 * ps])
    with pytest.raises(RuntimeError, match="already open .*call free_group_end first"):
        a.free_group_begin()
    assert a.available_size() == 0  # still held back
    a.free(x[2 * ps : 3 * ps])
    a.free_group_end()
    assert a.available_size() == 3 * ps and a.is_not_in_free_group


@pytest.mark.parametrize("kind,ps", [("token", 1), ("paged", 4)])
def test_alloc_calls_in_another_order_name_sglangs(kind, ps):
    # kvcore's earlier order was alloc_extend(prefix_lens, seq_lens, last_loc, n) and alloc_decode(seq_lens, last_loc).
    a = make(kind, 8 * ps, ps=ps)
    pre, seq, last = tensors([0], [3], [-1])
    with pytest.raises(TypeError, match=r"alloc_extend\(prefix_lens, prefix_lens_cpu, seq_lens, seq_lens_cpu"):
        a.alloc_extend(pre, seq, last, 3)
    with pytest.raises(TypeError, match=r"alloc_decode\(seq_lens, seq_lens_cpu, last_loc\)"):
        a.alloc_decode(seq, last)
    with pytest.raises(TypeError, match="extend_num_tokens must be an int"):
        a.alloc_extend(pre, pre.cpu(), seq, seq.cpu(), last, None)
    assert a.available_size() == 8 * ps
    assert a.alloc_extend(pre, pre.cpu(), seq, seq.cpu(), last, 3).numel() == 3
    dseq, dlast = tensors([4], [a.alloc(ps)[0].item()])
    assert a.alloc_decode(dseq, dseq.cpu(), dlast).numel() == 1


@pytest.mark.parametrize("kind,ps", [("token", 1), ("paged", 4)])
def test_backup_restore_and_clear(kind, ps):
    a = make(kind, 8 * ps, ps=ps, need_sort=True)
    x = a.alloc(3 * ps)
    a.free(x[:ps])
    state = a.backup_state()
    before = state_lists(a)
    y = a.alloc(5 * ps)
    a.free(y)
    a.free(x[ps:])
    assert state_lists(a) != before
    a.restore_state(state)
    assert state_lists(a) == before and a.available_size() == 6 * ps
    a.clear()
    assert a.free_pages.tolist() == list(range(1, 9)) and a.release_pages.numel() == 0
    assert a.available_size() == 8 * ps and a.is_not_in_free_group


@pytest.mark.parametrize("kernels", KERNELS)
def test_paged_alloc_extend_and_decode(kernels):
    ps = 4
    a = make("paged", 40, ps=ps, kernels=kernels)
    # Request 0: new, 6 tokens; request 1: new, 4 tokens; request 2: new, 0 tokens.
    pre, seq, last = tensors([0, 0, 0], [6, 4, 0], [-1, -1, -1])
    out = a.alloc_extend(pre, pre.cpu(), seq, seq.cpu(), last, 10)  # SGLang's positional order
    assert out.tolist() == [4, 5, 6, 7, 8, 9, 12, 13, 14, 15]
    assert a.available_size() == 40 - 3 * ps
    # Extend request 0 (prefix ends mid-page at 9) by 5, request 1 (prefix ends on a boundary) by 1.
    pre, seq, last = tensors([6, 4], [11, 5], [9, -1])
    out = a.alloc_extend(pre, seq_lens=seq, last_loc=last, extend_num_tokens=6)  # no CPU copies: read on the device
    assert out.tolist() == [10, 11, 16, 17, 18, 20]
    # Decode: request 0 at seq 12 (continues page 4), request 1 at seq 6 (continues page 5),
    # request 2 at seq 1 (new page).
    seq, last = tensors([12, 6, 1], [18, 20, -1])
    out = a.alloc_decode(seq, torch.tensor([12, 6, 1]), last)
    assert out.tolist() == [19, 21, 24]
    assert a.free_pages.tolist() == [7, 8, 9, 10]


@pytest.mark.parametrize("kernels", KERNELS)
def test_paged_alloc_decode_takes_strided_and_int32_inputs_and_refuses_bad_shapes(kernels):
    # An engine's seq_lens / last_loc may be a column of a bigger table, or int32: the step reads them as they
    # are, the result equals the one from plain int64 copies on a twin allocator.
    ps = 4
    a, twin = make("paged", 40, ps=ps, kernels=kernels), make("paged", 40, ps=ps, kernels=kernels)
    first = a.alloc(2 * ps)
    assert torch.equal(first, twin.alloc(2 * ps))
    seq, last = [5, 7, 1], [first[3].item(), first[6].item(), -1]
    table = torch.tensor([[s, -9, l] for s, l in zip(seq, last)], dtype=torch.int32, device=DEVICE)
    out = a.alloc_decode(table[:, 0], None, table[:, 2])  # strided int32 columns
    expected = twin.alloc_decode(*tensors(seq), None, *tensors(last))
    assert out.dtype == torch.int64 and out.tolist() == expected.tolist()
    assert a.free_pages.tolist() == twin.free_pages.tolist()
    with pytest.raises(ValueError, match="1-D seq_lens and last_loc of one length"):
        a.alloc_decode(*tensors([5, 7]), None, *tensors([3]))
    assert a.free_pages.tolist() == twin.free_pages.tolist()  # a refused step takes nothing


def test_alloc_extend_checks_token_count():
    a = make("paged", 16, ps=4)
    pre, seq, last = tensors([0], [5], [-1])
    with pytest.raises(ValueError, match="extend_num_tokens=4"):
        a.alloc_extend(pre, pre.cpu(), seq, seq.cpu(), last, 4)
    assert a.available_size() == 16


@pytest.mark.parametrize("kernels", KERNELS)
@pytest.mark.parametrize("ps", PAGE_SIZES)
def test_paged_allocator_matches_model_on_random_batches(kernels, ps):
    rng = random.Random(ps)
    a = make("paged", 400 * ps, ps=ps, kernels=kernels)
    a.free(a.alloc(40 * ps)[torch.randperm(40 * ps, generator=torch.Generator().manual_seed(ps)).to(DEVICE)])  # shuffle
    for _ in range(3):
        pre, seq, last = random_batch(rng, ps, rng.randint(1, 5), max_len=2 * ps + 3)
        free = a.free_pages.tolist()
        expected, used = model_extend(pre, seq, last, free, ps)
        pre_t, seq_t, last_t = tensors(pre, seq, last)
        out = a.alloc_extend(pre_t, pre_t.cpu(), seq_t, seq_t.cpu(), last_t, len(expected))
        assert out.tolist() == expected
        assert a.free_pages.tolist() == free[used:]
        dseq = [s + 1 for s in seq]
        dlast = [rng.randint(1, 10**4) * ps + (s - 1) % ps for s in seq]
        free = a.free_pages.tolist()
        expected, used = model_decode(dseq, dlast, free, ps)
        dseq_t, dlast_t = tensors(dseq, dlast)
        out = a.alloc_decode(dseq_t, torch.tensor(dseq), dlast_t)
        assert out.tolist() == expected
        assert a.free_pages.tolist() == free[used:]


def test_token_allocator_extend_and_decode_are_plain_alloc():
    a = make("token", 10)
    pre, seq, last = tensors([2, 0], [5, 1], [7, -1])
    dseq, dlast = tensors([6, 2], [4, 4])
    assert a.alloc_extend(pre, pre.cpu(), seq, seq.cpu(), last, 4).tolist() == [1, 2, 3, 4]
    assert a.alloc_decode(dseq, dseq.cpu(), dlast).tolist() == [5, 6]
    assert a.alloc_extend(pre, None, seq, None, last, 5) is None and a.available_size() == 4
    # A paged allocator with one-token pages gives the same locations.
    p = make("paged", 10, ps=1)
    assert p.alloc_extend(pre, None, seq, None, last, 4).tolist() == [1, 2, 3, 4]
    assert p.alloc_decode(dseq, None, dlast).tolist() == [5, 6]


def test_kernel_mode_auto_on_cpu_uses_reference():
    a = make("paged", 16, ps=4, kernels="auto")
    impl = "triton" if DEVICE == "cuda" else "native"
    assert a._extend_step.use_triton == a._decode_step.use_triton == (impl == "triton")


# ------------------------------------------------------------------------------------------------------------
# Hypothesis state machine: the kit's (kvcore.testing.AllocatorMachine: random extend / decode / alloc / free /
# free-group / backup / restore / clear sequences against a model of live requests) on kvcore's own allocators,
# with what only they promise checked on top.
# ------------------------------------------------------------------------------------------------------------


class KvcoreAllocatorMachine(AllocatorMachine):
    """The kit's machine on a token or paged allocator drawn per run (page size 1, 3 or 4, ``need_sort`` or not,
    Triton or torch kernels, a size with a partial page that must not be handed out), checked beyond the kit
    against what kvcore's allocators expose: a refused allocation leaves the free lists exactly as they were,
    results are int64, the free lists (``free_pages`` + ``release_pages``) hold every page not live exactly once
    (sorted under ``need_sort``), live pages are never beyond the last whole page, and the allocator's free-group
    flag is the model's.  Calls go by position or by SGLang's keyword names, and a decode step may give a request
    its first token."""

    NUM_PAGES = 12
    call_by_keyword = True
    decode_empty_requests = True

    @initialize(
        ps=st.sampled_from([1, 3, 4]),
        need_sort=st.booleans(),
        kernels=st.sampled_from(KERNELS),
        token_class=st.booleans(),
    )
    def setup(self, ps, need_sort, kernels, token_class):
        if ps == 1 and token_class:
            allocator = make("token", self.NUM_PAGES, need_sort=need_sort)
        else:  # a partial last page: only the whole pages are handed out
            allocator = make("paged", self.NUM_PAGES * ps + ps - 1, ps=ps, need_sort=need_sort, kernels=kernels)
        self.start(allocator)
        assert self.capacity == self.NUM_PAGES * ps, f"{self.capacity} tokens offered by {self.NUM_PAGES} pages of {ps}"

    def refusal_state(self):
        return self.a.available_size(), state_lists(self.a)

    def check_result(self, out, what):
        assert out.dtype == torch.int64, f"{what} returned {out.dtype} locations"

    @invariant()
    def free_lists_are_the_complement_of_live_pages(self):
        free = self.a.free_pages.tolist() + self.a.release_pages.tolist()
        assert len(free) == len(set(free)), "a page is on the free lists twice"
        used = self._used_pages()
        assert set(free) == set(range(1, self.NUM_PAGES + 1)) - used
        if self.a.need_sort:
            assert self.a.free_pages.tolist() == sorted(self.a.free_pages.tolist())

    @invariant()
    def live_pages_are_whole_pages_of_the_pool(self):
        pages = {loc // self.ps for locs in self.reqs.values() for loc in locs}
        assert pages <= set(range(1, self.NUM_PAGES + 1)), f"pages {sorted(pages)} beyond 1..{self.NUM_PAGES}"

    @invariant()
    def free_group_flag_is_the_models(self):
        assert self.a.is_not_in_free_group == (not self.in_group)


TestAllocatorMachine = KvcoreAllocatorMachine.TestCase
TestAllocatorMachine.settings = settings(
    max_examples=150,
    stateful_step_count=25,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)


def test_cpu_copy_delegates_to_the_pool():
    class RecordingPool:
        def __init__(self):
            self.calls = []

        def get_cpu_copy(self, indices, **kwargs):
            self.calls.append(("get", indices.tolist(), kwargs))
            return {"copy": indices.clone()}

        def load_cpu_copy(self, copy, indices, **kwargs):
            self.calls.append(("load", copy["copy"].tolist(), indices.tolist(), kwargs))

    pool = RecordingPool()
    allocator = TokenToKVPoolAllocator(16, dtype=torch.bfloat16, device="cpu", kvcache=pool, need_sort=False)
    copy = allocator.get_cpu_copy(torch.tensor([3, 4]))
    allocator.load_cpu_copy(copy, torch.tensor([7, 8]))
    assert pool.calls == [("get", [3, 4], {}), ("load", [3, 4], [7, 8], {})]
    # SGLang's retraction path names the request's state; the allocator passes it on when given.
    mamba = torch.tensor([2])
    copy = allocator.get_cpu_copy(torch.tensor([3]), mamba_indices=mamba, req_pool_index=5)
    allocator.load_cpu_copy(copy, torch.tensor([9]), mamba_indices=mamba, req_pool_index=5)
    assert pool.calls[2:] == [
        ("get", [3], {"mamba_indices": mamba, "req_pool_index": 5}),
        ("load", [3], [9], {"mamba_indices": mamba, "req_pool_index": 5}),
    ]


def test_debug_print_reports_the_free_lists():
    allocator = PagedTokenToKVPoolAllocator(64, page_size=16, dtype=torch.bfloat16, device="cpu", kvcache=None, need_sort=True)
    allocator.free(allocator.alloc(32))
    line = allocator.debug_print()
    assert "2 free and 2 deferred page(s) of 16 token(s)" in line and "64 of 64 tokens available" in line


def test_get_num_new_pages_counts_the_pages_requests_open():
    """Requests growing from ``prefix_lens`` to ``seq_lens`` tokens: a request whose prefix ends inside a page fills it
    first; one of no new tokens opens none (SGLang's helper, counted here by hand)."""
    from kvcore.allocators import get_num_new_pages

    prefix, seq = torch.tensor([0, 5, 16, 17, 30]), torch.tensor([1, 16, 33, 17, 64])
    # pages of 16: 1 (0 -> 1), 0 (5 -> 16 stays in page 0), 2 (16 -> 33: pages 1 and 2), 0, 2 (30 -> 64: pages 2, 3)
    assert get_num_new_pages(seq, 16, prefix) == 1 + 0 + 2 + 0 + 2
    assert get_num_new_pages(seq, 1, prefix) == int((seq - prefix).sum())


def test_fill_to_pages_completes_the_last_page_then_takes_new_ones():
    from kvcore.allocators import PagedTokenToKVPoolAllocator, fill_to_pages

    allocator = PagedTokenToKVPoolAllocator(8 * 4, 4, torch.float16, "cpu", None, False)
    held = allocator.alloc(8)[:6]  # two pages, the last one half used
    free = allocator.available_size()
    buffer = fill_to_pages(held, 16, allocator)
    assert buffer.numel() == 16 and torch.equal(buffer[:6], held)
    assert torch.equal(buffer[6:8], torch.arange(int(held[-1]) + 1, int(held[-1]) + 3))  # the rest of its page
    assert allocator.available_size() == free - 8 and len(set(buffer.tolist())) == 16
    assert set((buffer[8:] // 4).tolist()).isdisjoint((held // 4).tolist())  # whole new pages
    with pytest.raises(RuntimeError, match="more device slots"):
        fill_to_pages(buffer, 16 + 4 * 8, allocator)


def test_take_mapped_slots_hands_over_and_unmaps():
    from kvcore.allocators import take_mapped_slots

    mapping = torch.tensor([0, 7, 0, 9, 4, 0, -1])
    assert take_mapped_slots(mapping, torch.tensor([3, 2, 1, 4])).tolist() == [9, 7, 4]  # cold tokens left out
    assert mapping.tolist() == [0, 0, 0, 0, 0, 0, -1]


def test_alloc_first_slots_takes_whole_pages():
    from kvcore.allocators import PagedTokenToKVPoolAllocator, alloc_first_slots

    allocator = PagedTokenToKVPoolAllocator(4 * 4, 4, torch.float16, "cpu", None, False)
    slots = alloc_first_slots(allocator, 6)  # two pages taken, the first six of their slots handed out
    assert slots.numel() == 6 and allocator.available_size() == 8
    assert len(set((slots // 4).tolist())) == 2 and (slots[:4] % 4).tolist() == [0, 1, 2, 3]
    assert alloc_first_slots(allocator, 9) is None and allocator.available_size() == 8
