"""Host time of one decode step of the allocators (issue: allocators without a host sync), on a GPU.

A step is what an engine's decode loop asks of the allocator: ``alloc_decode`` for 256 requests (with the CPU
copy of their lengths), then a free group releasing the pages of the requests that finished.  The loop also
allocates pages for as many new requests (``alloc``), to stay in a steady state; its time is shown apart (see
``step_fn``).  ``decode+free`` times the plainer step the issue names, ``alloc_decode`` then one ``free`` of the
previous step's locations, without a group (see ``plain_step_fn``).  Each row times the best of 21 runs of 500
loops with no synchronisation inside (host time per call, each phase timed with ``time.perf_counter``, the
garbage collector off as in ``timeit``), for page sizes 1, 16 and 64, in 3 rounds over every row (each figure
the best of its rounds: the host's noisy stretches last seconds, longer than one row):

- ``token`` / ``paged``: kvcore's allocators (``kvcore_choose_allocator`` picks the token allocator at page size
  1 and the paged one otherwise; the paged one is timed at page size 1 too);
- ``legacy`` / ``legacy-token``: the previous designs, kept here as the reference (free lists as tensors sliced
  on every allocation; ``torch.unique`` in the paged ``free``, ``torch.cat`` in both), measured in the same run;
- ``sync-free``: whether the step ran under ``torch.cuda.set_sync_debug_mode("error")`` without raising.

    python benchmarks/bench_allocator.py
"""

from __future__ import annotations

import gc
import time

import torch
import triton
import triton.language as tl

from kvcore.allocators import PagedTokenToKVPoolAllocator, TokenToKVPoolAllocator
from kvcore.kernels import allocator_kernels as k

BS, FINISHING, STEPS, RUNS, ROUNDS = 256, 8, 500, 21, 3


@triton.jit
def _legacy_decode_kernel(seq_lens_ptr, last_loc_ptr, free_pages_ptr, out_ptr, PAGE_SIZE: tl.constexpr,
                          BS_BLOCK: tl.constexpr):  # fmt: skip
    # The previous design's decode kernel: new pages from the front of a plain free-list tensor.
    pid = tl.program_id(0)
    offs = tl.arange(0, BS_BLOCK)
    acc = tl.zeros([BS_BLOCK], dtype=tl.int64)
    for start in range(0, pid, BS_BLOCK):
        mask = start + offs < pid
        seq = tl.load(seq_lens_ptr + start + offs, mask=mask, other=0).to(tl.int64)
        acc += (mask & ((seq - 1) % PAGE_SIZE == 0)).to(tl.int64)
    seq = tl.load(seq_lens_ptr + pid).to(tl.int64)
    need = (seq - 1) % PAGE_SIZE == 0
    page = tl.load(free_pages_ptr + tl.sum(acc, axis=0), mask=need, other=0)
    tl.store(out_ptr + pid, tl.where(need, page * PAGE_SIZE, tl.load(last_loc_ptr + pid) + 1))


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
        out = torch.empty_like(seq_lens)
        _legacy_decode_kernel[(seq_lens.numel(),)](seq_lens, last_loc, self.free_pages, out, self.page_size, 256)
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


class LegacyTokenAllocator(LegacyPagedAllocator):
    """The token allocator before the device free lists: slicing on alloc, ``torch.cat`` on free."""

    def alloc(self, need):
        out, self.free_pages = self.free_pages[:need], self.free_pages[need:]
        return out

    def alloc_decode(self, seq_lens, seq_lens_cpu, last_loc):
        return self.alloc(seq_lens.numel())

    def free(self, index):
        if self.group is not None:
            self.group.append(index.clone())
            return
        self.free_pages = torch.cat((self.free_pages, index))


def make(kind, page_size):
    size = 1 << 21  # 2M tokens
    if kind == "legacy":
        return LegacyPagedAllocator(size, page_size, "cuda")
    if kind == "legacy-token":
        return LegacyTokenAllocator(size, page_size, "cuda")
    if kind == "paged":
        return PagedTokenToKVPoolAllocator(size, page_size, torch.bfloat16, "cuda", None, need_sort=False)
    return TokenToKVPoolAllocator(size, torch.bfloat16, "cuda", None, need_sort=False)


PHASES = ("alloc_decode", "free group", "alloc")


def step_fn(a, page_size, clock=None):
    """A closure running one decode step in a steady state: every request opens a new page (the worst case),
    a free group gives back the previous step's new pages and the pages of FINISHING requests, and ``alloc``
    takes pages for FINISHING new requests.  With ``clock`` (a list of PHASES totals) each phase's host time
    is added to it."""
    seq = torch.full((BS,), 3 * page_size + 1, dtype=torch.int64)  # (seq - 1) % page_size == 0: a new page each
    seq_dev = seq.cuda()
    last = (torch.arange(BS, device="cuda") + 1000) * page_size
    finished = a.alloc(FINISHING * page_size)
    previous = a.alloc_decode(seq_dev, seq, last)
    now = time.perf_counter

    def step():
        nonlocal finished, previous
        t0 = now()
        out = a.alloc_decode(seq_dev, seq, last)
        t1 = now()
        a.free_group_begin()
        a.free(previous)
        a.free(finished)
        a.free_group_end()
        t2 = now()
        finished = a.alloc(FINISHING * page_size)
        t3 = now()
        previous = out
        if clock is not None:
            clock[0] += t1 - t0
            clock[1] += t2 - t1
            clock[2] += t3 - t2

    return step


def plain_step_fn(a, page_size):
    """A closure running ``alloc_decode`` of BS requests (each opening a page) and one ``free`` of the previous
    step's locations: a steady state with no free group."""
    seq = torch.full((BS,), 3 * page_size + 1, dtype=torch.int64)
    seq_dev = seq.cuda()
    last = (torch.arange(BS, device="cuda") + 1000) * page_size
    previous = a.alloc_decode(seq_dev, seq, last)

    def step():
        nonlocal previous
        out = a.alloc_decode(seq_dev, seq, last)
        a.free(previous)
        previous = out

    return step


def host_us(step, clock=None) -> float:
    """Host time per call of ``step`` (best of RUNS runs of STEPS calls: the host's noise only ever adds time);
    ``clock`` ends with that run's phase times per call.  The garbage collector is off while timing, as in
    ``timeit``: a collection pass landing in one variant's run and not another's is noise, not host cost."""
    gc.collect()
    gc.disable()
    try:
        return _host_us(step, clock)
    finally:
        gc.enable()


def _host_us(step, clock):
    for _ in range(20):
        step()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(RUNS):
        phases = [0.0] * len(PHASES)
        if clock is not None:
            clock[:] = phases
        start = time.perf_counter()
        for _ in range(STEPS):
            step()
        us = (time.perf_counter() - start) / STEPS * 1e6
        if us < best:
            best = us
            if clock is not None:
                phases = [t / STEPS * 1e6 for t in clock]
                best_phases = phases
        torch.cuda.synchronize()
    if clock is not None:
        clock[:] = best_phases
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


ROWS = [(1, "token"), (1, "legacy-token"), (1, "paged"), (1, "legacy"), (16, "paged"), (16, "legacy"),
        (64, "paged"), (64, "legacy")]


def measure_row(page_size: int, kind: str) -> tuple:
    """``(loop, [decode, group, alloc], decode+free, sync-free)`` of one allocator, each on a fresh one."""
    a = make(kind, page_size)
    clock = [0.0] * len(PHASES)
    step = step_fn(a, page_size, clock)
    free_of_syncs = sync_free(step)
    loop = host_us(step, clock)
    plain = host_us(plain_step_fn(make(kind, page_size), page_size))
    return loop, list(clock), plain, free_of_syncs


def main() -> None:
    bare = torch.zeros(1, device="cuda")
    bare_us, best = float("inf"), {}
    for _ in range(ROUNDS):  # every row once per round: a noisy stretch of the host hits one round, not a row
        bare_us = min(bare_us, host_us(lambda: bare.add_(0)))
        for row in ROWS:
            loop, clock, plain, free_of_syncs = measure_row(*row)
            old = best.get(row)
            if old is None:
                best[row] = [loop, clock, plain, free_of_syncs]
                continue
            if loop < old[0]:
                old[0], old[1] = loop, clock
            old[2] = min(old[2], plain)
            old[3] = old[3] and free_of_syncs
    print(f"allocator decode step, {BS} requests, {FINISHING} finishing per step; bare x.add_(0) {bare_us:.2f} us")
    print("host us per step (alloc_decode + a free group), its phases, and the whole loop with the alloc for new")
    print("requests; decode+free = alloc_decode + one free, no group (the issue's words); /bare = per bare op;")
    print(f"each figure the best of {ROUNDS} rounds over every row")
    print(f"{'page':>5} {'allocator':<13} {'step':>7} {'/bare':>6} {'decode':>7} {'group':>7} {'alloc':>7} "
          f"{'loop':>7} {'sync-free':>10} {'decode+free':>12} {'/bare':>6}")  # fmt: skip
    for (page_size, kind), (loop, (decode, group, alloc), plain, free_of_syncs) in best.items():
        print(f"{page_size:>5} {kind:<13} {decode + group:>7.2f} {(decode + group) / bare_us:>6.2f} {decode:>7.2f} "
              f"{group:>7.2f} {alloc:>7.2f} {loop:>7.2f} {str(free_of_syncs):>10} {plain:>12.2f} "
              f"{plain / bare_us:>6.2f}")  # fmt: skip


if __name__ == "__main__":
    main()
