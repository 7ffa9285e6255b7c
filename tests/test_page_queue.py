"""kvcore.page_queue: the paged allocator's device free list, against a plain Python list on random operations,
and (on a GPU) the decode loop of the paged allocator with torch's sync debug mode set to raise."""

from __future__ import annotations

import random

import pytest
import torch

from kvcore.allocators import PagedTokenToKVPoolAllocator
from kvcore.page_queue import PageQueue, distinct_sorted
from kvcore.testing.tensors import test_device

DEVICE = torch.device(test_device())


def t(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64, device=DEVICE)


def test_distinct_sorted_marks_the_first_of_each_run():
    ordered, first = distinct_sorted(t([5, 3, 5, 9, 3, 3]))
    assert ordered.tolist() == [3, 3, 3, 5, 5, 9]
    assert first.tolist() == [True, False, False, True, False, True]
    assert ordered[first].tolist() == [3, 5, 9]


@pytest.mark.parametrize("seed", range(6))
def test_random_operations_match_a_list(seed):
    rng = random.Random(seed)
    capacity = 13
    q, other = PageQueue(capacity, DEVICE), PageQueue(capacity, DEVICE)
    model, other_model = list(range(1, 8)), []
    q.clear(t(model))
    snapshots = []
    for _ in range(300):
        op = rng.choice(["take", "front", "back", "absorb", "snap", "restore"])
        outside = sorted(set(range(1, capacity + 1)) - set(model) - set(other_model))
        if op == "take" and model:
            n = rng.randint(0, len(model))
            assert q.take(n).tolist() == model[:n]
            model = model[n:]
        elif op in ("front", "back") and outside:
            picked = rng.sample(outside, rng.randint(1, len(outside)))
            with_duplicates = picked + rng.choices(picked, k=rng.randint(0, 4))
            q.put(*distinct_sorted(t(with_duplicates)), front=op == "front")
            model = sorted(picked) + model if op == "front" else model + sorted(picked)
        elif op == "absorb" and outside:
            picked = rng.sample(outside, rng.randint(1, len(outside)))
            other.put(*distinct_sorted(t(picked)), front=False)
            q.absorb(other)
            model = sorted(model + picked)
        elif op == "snap":
            snapshots.append((q.snapshot(), list(model)))
        elif op == "restore" and snapshots:
            state, model = rng.choice(snapshots)
            model = list(model)
            q.restore(state)
        assert q.known == len(model) == q.exact()
        assert q.ids().tolist() == model
        assert other.exact() == 0


def test_take_beyond_what_is_known_is_refused():
    q = PageQueue(4, DEVICE)
    q.clear(t([1, 2]))
    with pytest.raises(RuntimeError, match=r"take\(3\) with only 2"):
        q.take(3)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the sync check needs a CUDA device (run compiled on the GPU)")
@pytest.mark.parametrize("page_size", [1, 16, 64])
def test_the_paged_decode_loop_never_waits_for_the_device(page_size):
    """alloc_decode (with the CPU lengths an engine has), free and free groups under sync debug mode "error":
    any call that made the host wait for the device would raise."""
    bs, steps, finishing = 256, 6, 8
    a = PagedTokenToKVPoolAllocator(bs * 64 * page_size, page_size, torch.bfloat16, "cuda", None, need_sort=False)
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
    finally:
        torch.cuda.set_sync_debug_mode(0)
    new_pages = sum(int(((x - 1) % page_size == 0).sum()) for x in lengths)
    assert a.available_size() == start + (steps * finishing - new_pages) * page_size  # exact (and may wait)
