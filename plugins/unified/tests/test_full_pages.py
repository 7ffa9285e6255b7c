"""The full-attention side of a unified memory: SGLang's paged allocator over the low end of the shared bytes
(kvcore_unified.full_pages), a page-major MHA pool laid over them with virtual pages, and the high end taking and
giving back units of the same bytes in between.  Requests come and go; after every step each live token reads back
what was stored for it, byte for byte, across the compactions its neighbours' frees cause."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from kvcore_mha import PageMajorMHATokenToKVPool
from kvcore_unified.allocator import HIGH, LOW
from kvcore_unified.full_pages import UnifiedPagedAllocator
from kvcore_unified.memory import UnifiedMemory

from kvcore.testing.tensors import bits_equal, test_device

L, H, D, PS = 2, 2, 8, 4
PAGE_BYTES = L * 2 * PS * H * D * 2  # bf16
HIGH_BYTES = 700  # a high unit: not a multiple of a page


def build(kernels: str, pages: int = 12, lazy: bool = True):
    dev = test_device()
    memory = UnifiedMemory(pages * PAGE_BYTES + 100, PAGE_BYTES, HIGH_BYTES, dev, lazy_compaction=lazy)
    ids = memory.allocator.available(LOW)
    pool = PageMajorMHATokenToKVPool(ids * PS, PS, torch.bfloat16, H, D, L, dev, kernels=kernels,
                                     memory=memory.low_memory(), virtual_pages=ids)  # fmt: skip
    allocator = UnifiedPagedAllocator(memory, pool, PS, torch.bfloat16, dev, kernels=kernels)
    high_moves = []
    memory.on_move(HIGH, lambda src, dst: high_moves.append((src.tolist(), dst.tolist())))
    return memory, pool, allocator, high_moves


class _Request:
    def __init__(self, locs: torch.Tensor, k: torch.Tensor):
        self.locs, self.k = locs, k  # every token's location and the K row stored for it (V: its negation)


def _store(pool, locs, gen):
    k = torch.randn((locs.numel(), H, D), generator=gen).to(torch.bfloat16).to(locs.device)
    for layer in range(L):
        pool.set_kv_buffer(layer, locs, k, -k)
    return k


def _check(pool, allocator, memory, running):
    memory.allocator.check()
    assert allocator.available_size() == memory.allocator.available(LOW) * PS
    if not running:
        return
    locs = torch.cat([r.locs for r in running])
    want = torch.cat([r.k for r in running])
    phys = pool.translate_loc(locs)
    assert phys.unique().numel() == phys.numel(), "two live tokens on one physical slot"
    assert bool((phys >= PS).all()), "a live token on the padding page"
    for layer in range(L):
        keys, values = pool.get_key_buffer(layer), pool.get_value_buffer(layer)
        assert bits_equal(keys[phys // PS, phys % PS], want)
        assert bits_equal(values[phys // PS, phys % PS], -want)
    for r in running:  # SGLang's order: token t of a request at offset t % page of its (t // page)-th page
        t = torch.arange(r.locs.numel(), device=r.locs.device)
        assert bool((r.locs % PS == t % PS).all())
        pages = r.locs // PS
        assert bool((pages[t % PS != 0] == pages[(t - 1).clamp(min=0)][t % PS != 0]).all())


@pytest.mark.parametrize("lazy", [False, True], ids=["eager", "lazy"])
@pytest.mark.parametrize("kernels", ["native", "triton"])
def test_requests_come_and_go_and_every_token_keeps_its_bytes(kernels, lazy):
    """Eager: every free compacts; lazy: frees leave holes that allocations refill, the other side's allocations and
    an engine's flush between steps compact them."""
    dev = test_device()
    memory, pool, allocator, high_moves = build(kernels, lazy=lazy)
    rng, gen = random.Random(0), torch.Generator().manual_seed(0)
    running: list[_Request] = []
    high: list[int] = []
    zero = torch.zeros(1, dtype=torch.int64)
    for step in range(40):
        if rng.random() < 0.5:  # a new request: prefill of 1..9 tokens
            n = rng.randint(1, 9)
            seq_cpu = torch.tensor([n])
            loc = allocator.alloc_extend(zero.to(dev), zero, seq_cpu.to(dev), seq_cpu, torch.tensor([-1], device=dev), n)
            if loc is not None:
                running.append(_Request(loc, _store(pool, loc, gen)))
        if running:  # a decode step of every running request
            seq_cpu = torch.tensor([r.locs.numel() + 1 for r in running])
            last = torch.stack([r.locs[-1] for r in running])
            loc = allocator.alloc_decode(seq_cpu.to(dev), seq_cpu, last)
            if loc is not None:
                k = _store(pool, loc, gen)
                for i, r in enumerate(running):
                    r.locs, r.k = torch.cat([r.locs, loc[i : i + 1]]), torch.cat([r.k, k[i : i + 1]])
        if running and rng.random() < 0.35:  # requests finish, inside a free group
            done = rng.sample(running, rng.randint(1, len(running)))
            allocator.free_group_begin()
            for r in done:
                allocator.free(r.locs)
            allocator.free_group_end()
            running = [r for r in running if r not in done]
        if rng.random() < 0.3:  # the other side takes or gives back a unit of the same bytes
            if high and rng.random() < 0.5:
                memory.allocator.free(HIGH, [high.pop(rng.randrange(len(high)))])
            else:
                memory.settle_frees()
                got = memory.allocator.alloc(HIGH, 1)
                high += [] if got is None else got.tolist()
        if lazy and step % 9 == 8:
            memory.flush()
        _check(pool, allocator, memory, running)
    assert memory.allocator.moved_units > 0, "no free compacted the low side: the test checks nothing moved"
    for r in running:
        allocator.free(r.locs)
    assert allocator.available_size() == memory.allocator.available(LOW) * PS
    assert memory.allocator.used(LOW) == 0


def test_the_two_sides_share_the_bytes():
    memory, pool, allocator, _ = build("native", pages=4)
    start = allocator.available_size()
    assert start == 4 * PS
    assert memory.allocator.alloc(HIGH, 1) is not None  # 700 bytes: two pages' worth of the range
    assert allocator.available_size() == (4 * PAGE_BYTES + 100 - HIGH_BYTES) // PAGE_BYTES * PS
    assert allocator.alloc(allocator.available_size()) is not None
    assert allocator.alloc(PS) is None and allocator.available_size() == 0
    with pytest.raises(ValueError, match="whole pages"):
        allocator.alloc(PS + 1)


@pytest.mark.parametrize("lazy", [False, True], ids=["eager", "lazy"])
def test_freed_pages_go_back_to_the_padding_page(lazy):
    memory, pool, allocator, _ = build("native", lazy=lazy)
    a, b = allocator.alloc(2 * PS), allocator.alloc(PS)
    allocator.free(a)  # b moves down into a's place (lazy: at the flush)
    assert memory.allocator.used(LOW) == 3, "a free reads its tokens at the next query or allocation, not before"
    memory.settle_frees()
    assert memory.allocator.used(LOW) == 1
    if lazy:
        assert memory.allocator.moved_units == 0 and memory.flush() == 1
    assert memory.allocator.moved_units == 1
    assert pool.translate_loc(a).tolist() == list(range(PS)) * 2
    assert pool.translate_loc(b).tolist() == [PS + o for o in range(PS)]
    allocator.clear()
    assert memory.allocator.used(LOW) == 0 and pool.translate_loc(b).tolist() == list(range(PS))
    assert np.array_equal(allocator.free_pages.numpy()[:3], np.array(memory.allocator.free_ids(LOW)[:3]))
