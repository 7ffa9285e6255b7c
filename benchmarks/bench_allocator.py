"""Host time of one decode step of the allocators (issue: allocators without a host sync), on a GPU.

A step is what an engine's decode loop asks of the allocator: ``alloc_decode`` for 256 requests (with the CPU
copy of their lengths), then a free group releasing the pages of the requests that finished (see ``step_fn``).  Each row times
2000 steps with no synchronisation inside the loop (host time per step), for page sizes 1, 16 and 64:

- ``kvcore``: the allocator ``kvcore_choose_allocator`` picks (the token allocator at page size 1, the paged one
  otherwise), and the paged allocator at page size 1 too;
- ``legacy``: the previous paged design, kept here as the reference (free lists as tensors, ``torch.unique`` in
  ``free``), measured in the same run;
- ``sync-free``: whether the step ran under ``torch.cuda.set_sync_debug_mode("error")`` without raising.

    python benchmarks/bench_allocator.py
"""

from __future__ import annotations

import time

import torch

from kvcore.allocators import PagedTokenToKVPoolAllocator, TokenToKVPoolAllocator
from kvcore import allocator_kernels as k

BS, FINISHING, STEPS = 256, 8, 2000


class LegacyPagedAllocator:
    """The paged allocator before the device free lists: slicing tensors, ``torch.unique`` on free."""

    def __init__(self, size, page_size, device):
        self.page_size, self.device = page_size, device
        self.free_pages = torch.arange(1, size // page_size + 1, dtype=torch.int64, device=device)
        self.group = None

    def alloc(self, need):
        n = need // self.page_size
        pages, self.free_pages = self.free_pages[:n], self.free_pages[n:]
        return (pages[:, None] * self.page_size + torch.arange(self.page_size, device=self.device)).reshape(-1)

    def alloc_decode(self, seq_lens, seq_lens_cpu, last_loc):
        n = k.num_new_pages_decode(seq_lens_cpu, self.page_size)
        if n > len(self.free_pages):
            return None
        out = k.alloc_decode_triton(seq_lens, last_loc, self.free_pages, self.page_size)
        self.free_pages = self.free_pages[n:]
        return out

    def free_group_begin(self):
        self.group = []

    def free_group_end(self):
        group, self.group = self.group, None
        if group:
            self.free(torch.cat(group))

    def free(self, index):
        if self.group is not None:
            self.group.append(index.clone())
            return
        self.free_pages = torch.cat((torch.unique(index // self.page_size), self.free_pages))


def make(kind, page_size):
    size = 1 << 21  # 2M tokens
    if kind == "legacy":
        return LegacyPagedAllocator(size, page_size, "cuda")
    if kind == "paged":
        return PagedTokenToKVPoolAllocator(size, page_size, torch.bfloat16, "cuda", None, need_sort=False)
    return TokenToKVPoolAllocator(size, torch.bfloat16, "cuda", None, need_sort=False)


def step_fn(a, page_size):
    """A closure running one decode step in a steady state: every request opens a new page (the worst case),
    and the free group gives back the previous step's new pages and the pages of FINISHING requests (which
    are allocated again afterwards, as new requests would take them)."""
    seq = torch.full((BS,), 3 * page_size + 1, dtype=torch.int64)  # (seq - 1) % page_size == 0: a new page each
    seq_dev = seq.cuda()
    last = (torch.arange(BS, device="cuda") + 1000) * page_size
    finished = a.alloc(FINISHING * page_size)
    previous = a.alloc_decode(seq_dev, seq, last)

    def step():
        nonlocal finished, previous
        out = a.alloc_decode(seq_dev, seq, last)
        a.free_group_begin()
        a.free(previous)
        a.free(finished)
        a.free_group_end()
        previous = out
        finished = a.alloc(FINISHING * page_size)

    return step


def host_us(step) -> float:
    for _ in range(20):
        step()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        for _ in range(STEPS):
            step()
        best = min(best, (time.perf_counter() - start) / STEPS * 1e6)
        torch.cuda.synchronize()
    return best


def sync_free(step) -> bool:
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
        return True
    except RuntimeError:
        return False
    finally:
        torch.cuda.set_sync_debug_mode(0)
        torch.cuda.synchronize()


def main() -> None:
    bare = torch.zeros(1, device="cuda")
    bare_us = host_us(lambda: bare.add_(0))
    print(f"allocator decode step, {BS} requests, {FINISHING} finishing per step; bare x.add_(0) {bare_us:.2f} us")
    print(f"{'page':>5} {'allocator':<10} {'host us/step':>13} {'/bare':>7} {'sync-free':>10}")
    for page_size in (1, 16, 64):
        kinds = ["token", "paged", "legacy"] if page_size == 1 else ["paged", "legacy"]
        for kind in kinds:
            a = make(kind, page_size)
            step = step_fn(a, page_size)
            free_of_syncs = sync_free(step)
            us = host_us(step)
            print(f"{page_size:>5} {kind:<10} {us:>13.2f} {us / bare_us:>7.2f} {str(free_of_syncs):>10}")


if __name__ == "__main__":
    main()
