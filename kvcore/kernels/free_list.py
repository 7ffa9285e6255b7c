"""The free pages of an allocator, kept on its device and counted on the host without waiting
(:class:`FreePageList`).

An allocator's decode loop (``alloc_decode``, ``free``, ``free_group_end``) must never make the host wait for
the device, yet it must know how many pages it may hand out.  Dropping duplicate pages from a free (the
tokens of one page come in together) is data-dependent, and so is the number of pages a free gives back;
``torch.unique`` or a boolean mask would read the device.  Here instead:

* Every page has a **state**, FREE or ALLOCATED, on the device.  A free keeps a page only if it is allocated
  and this is its first occurrence in the call (an ``atomic_min`` of the position marks the first), so
  duplicates, pages freed twice and the padding page are dropped on the device, in one pass, without sorting
  and without any shape that depends on the data.
* **Order.**  Kept pages go in the order of their first occurrence (SGLang's token allocator), or, with
  ``sort_each_free``, in ascending page order (SGLang's paged allocator, whose ``free`` takes ``torch.unique`` of
  the pages).  The release kernel sorts in the same launch, choosing on the device the cheaper of two ways
  from their step counts (weighted by ``_RANK_STEP_COST`` and ``_SCAN_STEP_COST``): each kept page's rank
  counted among the kept pages (``kept**2`` comparisons, in tiles of ``_RANK_ROWS x _RANK_COLS``; a release
  first gathers its kept pages after the staged list), or a pass over the page states from the lowest to the
  highest kept page (``_SCAN_BLOCK`` states a step; each kept page is still marked there).  Nothing depends on
  the data's shape and nothing is read on the host.  Staged pages keep the order of first occurrence and are
  sorted all together by the commit that moves them: a free group is one free, as in SGLang (whose
  ``free_group_end`` frees the concatenation of the group).
* The lists are device buffers of fixed size: the **ring** (the free list: taken from its head; freed pages
  go in at the head, reused first, or at the tail), **held** (pages released under ``need_sort``: merged
  into the ring, sorted, when an allocation falls short) and **staged** (pages freed inside a free group,
  moved to the ring or to held by :meth:`FreePageList.commit_staged`).
* The host knows ``taken`` (pages taken by allocations whose size it decided) exactly; the device keeps
  ``OFFSET`` (the ring's head is ``(taken - OFFSET) mod capacity``), ``ADDED`` (pages put in the ring, less
  the pages decode steps took: the ring holds ``capacity + ADDED - taken``), ``HELD`` and ``STAGED`` (the two
  lists' lengths).  A decode step counts the pages it takes on the device (how many requests open a page is
  data the host would have to count every step) and moves ``OFFSET`` and ``ADDED`` back by that count.
* Every launch that changes ``ADDED`` carries a sequence number and writes the new ``ADDED`` with it into a
  word of host memory (pinned, written by the kernel itself: no copy, no event), tagged with an **epoch**;
  the held list's length gets a word too.  The host's counts are lower bounds: ``ADDED`` as of the last
  word it read, plus, for each later launch, nothing for a free and minus the request count for a decode
  step (the most pages it can take).  An allocation that fits under them never waits; one that does not (a
  nearly full pool) re-reads the words, counts the step's pages itself and, failing that, waits for the
  device (:meth:`FreePageList.exact`, which ``available_size`` uses by design).  ``clear``, ``restore`` and
  a merge start a new epoch, so a word written for an abandoned state (a kernel still in flight) is ignored.

Snapshots are copy-on-write: :meth:`FreePageList.snapshot` shares the buffers, and the next launch that would
write them copies them first, so a backup that is restored before anything changes costs no copy.

Both implementations (a Triton kernel per operation, launched directly through :class:`kvcore.kernels.launch.Launcher`,
and a torch reference) keep the same buffers and give the same results.  The torch one on a GPU reads the
counts of a staged commit and a merge (it is the reference, not the hot path); on the CPU nothing waits.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from kvcore.kernels.addresses import KeepsAddresses, page_locked
from kvcore.kernels.launch import KernelArgs, Launcher, Plan

__all__ = ["ALLOCATED", "FREE", "TAKEN_BIAS", "FreePageList", "PageSource", "head_of", "word_bits"]

FREE, ALLOCATED = -1, 2**31 - 1  # page states (int32)
OFFSET, ADDED, HELD, STAGED = 0, 1, 2, 3  # the fields of ``ctl``
TO_FRONT, TO_BACK, TO_HELD, TO_STAGED = 0, 1, 2, 3  # where a free puts its pages
#: ``taken`` goes to the kernels biased by this, so Triton always types it int64 (an int that fits in 32 bits
#: would be typed int32, and ``taken`` grows past 2**31 on a long-running server).
TAKEN_BIAS = 1 << 40
# A published word: epoch (bits 48..62) | launch sequence number mod 2**16 (bits 32..47) | count mod 2**32.
_VALUE_BITS, _SEQ_BITS = 32, 16
_VALUE = (1 << _VALUE_BITS) - 1
_SEQ = (1 << _SEQ_BITS) - 1
_EPOCH_SHIFT = _VALUE_BITS + _SEQ_BITS
_EPOCHS = 1 << 15
#: launches kept in the host's lower bound before the words are read anyway (reading them costs no wait; a
#: launch's word is read correctly while fewer than 2**16 launches are in flight after it)
_MAX_PENDING = 1024
_BLOCK = 1024
#: the tile of comparisons a sorted free counts ranks in (rows: pages ranked at once, columns: pages compared)
_RANK_ROWS, _RANK_COLS = 256, 32
#: the page states a sorted free's pass over the page states reads in one step
_SCAN_BLOCK = 1024
#: the device time of one step of each way, relative (what a sorted free compares to choose; on an H200, a rank
#: step of 256 x 32 took about 0.57 us and a scan step of 1024 states about 1.0 us)
_RANK_STEP_COST, _SCAN_STEP_COST = 1, 2
_WARPS = 4  # warps of the release kernel's one program
_ALLOCATED = tl.constexpr(ALLOCATED)


class PageSource(NamedTuple):
    """What the allocation kernels read new pages from: the ring, its control words, the page states and the
    host's ``taken`` (:mod:`kvcore.kernels.allocator_kernels`); a decode step also publishes its ``ADDED`` into
    ``words[0]`` with ``word_bits`` (:func:`word_bits`)."""

    ring: torch.Tensor
    ctl: torch.Tensor
    state: torch.Tensor
    taken: int
    capacity: int
    words: torch.Tensor
    word_bits: int

    @classmethod
    def of(cls, free_pages: torch.Tensor) -> PageSource:
        """A source handing out ``free_pages`` in order (for tests and tools: a fresh ring holding them)."""
        n, device = free_pages.numel(), free_pages.device
        ring = torch.cat((free_pages.to(torch.int64), torch.zeros(1, dtype=torch.int64, device=device)))
        top = int(free_pages.max()) if n else 0
        state = torch.full((top + 2,), FREE, dtype=torch.int32, device=device)
        ctl, words = torch.zeros(4, dtype=torch.int64, device=device), torch.zeros(2, dtype=torch.int64, device=device)
        return cls(ring, ctl, state, 0, max(n, 1), words, word_bits(1, 0))


def word_bits(epoch: int, seq: int) -> int:
    """The epoch and sequence-number bits of a published word (its count goes in the low 32 bits)."""
    return (epoch << _EPOCH_SHIFT) | ((seq & _SEQ) << _VALUE_BITS)


def head_of(ctl: torch.Tensor, taken: int, capacity: int) -> torch.Tensor:
    """The ring's head position (a 0-d device tensor): ``(taken - OFFSET) mod capacity``."""
    return (taken - ctl[OFFSET]) % capacity


@triton.jit
def _ring_slot(base, rank, cap):
    # The ring slot ``(base + rank) mod cap`` for ``base`` and ``rank`` in ``[0, cap)``, without a division (an
    # int64 division per lane costs more than the rest of a step).
    slot = base + rank
    return tl.where(slot >= cap, slot - cap, slot)


@triton.jit
def _write_in_source_order(
    src_ptr, ring_ptr, held_ptr, staged_ptr, state_ptr, total, base, cap,
    PAGE_SIZE: tl.constexpr, FROM_STAGED: tl.constexpr, DEST: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    # The kept pages in the order of their first occurrence in the source, from ``base`` on; a released page is
    # marked FREE (a staged one already is).  Returns how many were written.
    lanes = tl.arange(0, BLOCK)
    written = tl.sum(tl.zeros([BLOCK], dtype=tl.int64), axis=0)
    for start in range(0, total, BLOCK):
        i = start + lanes
        if FROM_STAGED:
            keep = i < total
            page = tl.load(staged_ptr + i, mask=keep, other=0)
        else:
            page = tl.load(src_ptr + i, mask=i < total, other=0).to(tl.int64) // PAGE_SIZE
            ok = (i < total) & (page >= 0) & (page <= cap)
            keep = ok & (tl.load(state_ptr + page, mask=ok, other=-1, volatile=True) == i)
        k = keep.to(tl.int32)
        rank = written + (tl.cumsum(k, axis=0) - k).to(tl.int64)
        if DEST <= 1:
            tl.store(ring_ptr + _ring_slot(base, rank, cap), page, mask=keep)
        elif DEST == 2:
            tl.store(held_ptr + base + rank, page, mask=keep)
        else:
            tl.store(staged_ptr + base + rank, page, mask=keep)
        if not FROM_STAGED:
            tl.store(state_ptr + page, tl.full([BLOCK], -1, tl.int32), mask=keep)
        written += tl.sum(k.to(tl.int64), axis=0)
    return written


@triton.jit
def _scatter_by_rank(
    from_ptr, count, ring_ptr, held_ptr, base, cap,
    DEST: tl.constexpr, RANK_ROWS: tl.constexpr, RANK_COLS: tl.constexpr,
):  # fmt: skip
    # The ``count`` distinct pages at ``from_ptr`` in ascending order from ``base`` on: each goes ``r`` places
    # after it, ``r`` the number of them below it, counted in tiles of RANK_ROWS x RANK_COLS comparisons.
    rows = tl.arange(0, RANK_ROWS)
    cols = tl.arange(0, RANK_COLS)
    for first_row in range(0, count, RANK_ROWS):
        i = first_row + rows
        mine = tl.load(from_ptr + i, mask=i < count, other=0)
        mine32 = mine.to(tl.int32)  # page ids fit: the capacity is below 2**31
        below = tl.zeros([RANK_ROWS], dtype=tl.int32)
        for first_col in range(0, count, RANK_COLS):
            j = first_col + cols
            theirs = tl.load(from_ptr + j, mask=j < count, other=cap + 1).to(tl.int32)
            below += tl.sum((theirs[None, :] < mine32[:, None]).to(tl.int32), axis=1)
        rank = below.to(tl.int64)
        if DEST <= 1:
            tl.store(ring_ptr + _ring_slot(base, rank, cap), mine, mask=i < count)
        else:
            tl.store(held_ptr + base + rank, mine, mask=i < count)


@triton.jit
def _write_by_page_scan(
    ring_ptr, held_ptr, staged_ptr, state_ptr, total, base, lowest, highest, cap,
    FROM_STAGED: tl.constexpr, DEST: tl.constexpr, BLOCK: tl.constexpr, SCAN_BLOCK: tl.constexpr,
):  # fmt: skip
    # The kept pages in ascending order, found by a pass over the page states ``lowest .. highest``: a released
    # page is marked with its position (pass 1 of the release kernel), a staged one is marked here first.  Each
    # is marked FREE again.  Returns how many were written.
    lanes = tl.arange(0, BLOCK)
    if FROM_STAGED:
        for start in range(0, total, BLOCK):
            i = start + lanes
            page = tl.load(staged_ptr + i, mask=i < total, other=0)
            tl.store(state_ptr + page, tl.zeros([BLOCK], dtype=tl.int32), mask=i < total)
        tl.debug_barrier()
    states = tl.arange(0, SCAN_BLOCK)
    written = tl.sum(tl.zeros([SCAN_BLOCK], dtype=tl.int64), axis=0)
    for start in range(lowest, highest + 1, SCAN_BLOCK):
        page = start + states
        inside = page <= highest
        mark = tl.load(state_ptr + page, mask=inside, other=-1, volatile=True)
        keep = inside & (mark >= 0) & (mark != _ALLOCATED)
        k = keep.to(tl.int32)
        rank = written + (tl.cumsum(k, axis=0) - k).to(tl.int64)
        if DEST <= 1:
            tl.store(ring_ptr + _ring_slot(base, rank, cap), page, mask=keep)
        else:
            tl.store(held_ptr + base + rank, page, mask=keep)
        tl.store(state_ptr + page, tl.full([SCAN_BLOCK], -1, tl.int32), mask=keep)
        written += tl.sum(k.to(tl.int64), axis=0)
    return written


@triton.jit(do_not_specialize=["n", "taken", "bits"])
def _release_kernel(
    src_ptr, n, ring_ptr, held_ptr, staged_ptr, ctl_ptr, state_ptr, words_ptr,
    taken, bits, cap,
    PAGE_SIZE: tl.constexpr, FROM_STAGED: tl.constexpr, DEST: tl.constexpr, ASCENDING: tl.constexpr,
    BIAS: tl.constexpr, BLOCK: tl.constexpr, RANK_ROWS: tl.constexpr, RANK_COLS: tl.constexpr,
    SCAN_BLOCK: tl.constexpr, RANK_STEP_COST: tl.constexpr, SCAN_STEP_COST: tl.constexpr,
):  # fmt: skip
    # One program.  Pass 1 marks each allocated page with its first position in ``src`` (atomic_min: a FREE
    # page, -1, stays as it is); pass 2 counts the pages kept (when they go in front of the head, whose new
    # position depends on it, or when they are sorted) and, when sorted, finds the lowest and highest of them;
    # pass 3 writes them and marks them FREE, in order of first occurrence or (ASCENDING) in ascending order,
    # whichever of two ways costs fewer steps: ranks counted among the kept pages (kept**2 comparisons, after
    # the kept pages of a release are gathered after the staged list), or a pass over the page states from the
    # lowest to the highest kept page (each is still marked there; a staged page is marked first).
    taken = taken - BIAS
    offset = tl.load(ctl_ptr + 0)
    added = tl.load(ctl_ptr + 1)
    held = tl.load(ctl_ptr + 2)
    staged = tl.load(ctl_ptr + 3)
    lanes = tl.arange(0, BLOCK)
    zero = tl.sum(tl.zeros([BLOCK], dtype=tl.int64), axis=0)
    if FROM_STAGED:
        total = staged
    else:
        total = zero + n
        for start in range(0, n, BLOCK):
            i = start + lanes
            page = tl.load(src_ptr + i, mask=i < n, other=0).to(tl.int64) // PAGE_SIZE
            ok = (i < n) & (page >= 0) & (page <= cap)
            tl.atomic_min(state_ptr + page, i.to(tl.int32), mask=ok)
        tl.debug_barrier()

    kept = zero
    lowest = zero + cap + 1
    highest = zero
    if FROM_STAGED:
        kept = total
        if ASCENDING:
            for start in range(0, total, BLOCK):
                i = start + lanes
                page = tl.load(staged_ptr + i, mask=i < total, other=0)
                lowest = tl.minimum(lowest, tl.min(tl.where(i < total, page, cap + 1), axis=0))
                highest = tl.maximum(highest, tl.max(tl.where(i < total, page, 0), axis=0))
    elif DEST == 0 or ASCENDING:
        for start in range(0, total, BLOCK):
            i = start + lanes
            page = tl.load(src_ptr + i, mask=i < total, other=0).to(tl.int64) // PAGE_SIZE
            ok = (i < total) & (page >= 0) & (page <= cap)
            keep = ok & (tl.load(state_ptr + page, mask=ok, other=-1, volatile=True) == i)
            kept += tl.sum(keep.to(tl.int64), axis=0)
            if ASCENDING:
                lowest = tl.minimum(lowest, tl.min(tl.where(keep, page, cap + 1), axis=0))
                highest = tl.maximum(highest, tl.max(tl.where(keep, page, 0), axis=0))

    head = ((taken - offset) % cap + cap) % cap
    if DEST == 0:
        base = (head - kept + cap) % cap  # kept <= cap
    elif DEST == 1:
        base = (head + cap + added - taken) % cap  # past the ring's last page: head + its count
    elif DEST == 2:
        base = held
    else:
        base = staged
    if ASCENDING:
        rank_steps = ((kept + RANK_ROWS - 1) // RANK_ROWS) * ((kept + RANK_COLS - 1) // RANK_COLS)
        scan_steps = (tl.maximum(highest - lowest + 1, 0) + SCAN_BLOCK - 1) // SCAN_BLOCK
        if rank_steps * RANK_STEP_COST <= scan_steps * SCAN_STEP_COST:
            if FROM_STAGED:
                gathered = zero  # the staged list itself
            else:  # gather the kept pages after the staged list (free room: kept + staged pages <= capacity)
                gathered = staged
                _write_in_source_order(src_ptr, ring_ptr, held_ptr, staged_ptr, state_ptr, total, staged, cap,
                                       PAGE_SIZE, False, 3, BLOCK)  # fmt: skip
                tl.debug_barrier()  # the gathered pages, visible to every thread
            _scatter_by_rank(staged_ptr + gathered, kept, ring_ptr, held_ptr, base, cap, DEST, RANK_ROWS, RANK_COLS)
            written = kept
        else:
            written = _write_by_page_scan(ring_ptr, held_ptr, staged_ptr, state_ptr, total, base, lowest, highest,
                                          cap, FROM_STAGED, DEST, BLOCK, SCAN_BLOCK)  # fmt: skip
    else:
        written = _write_in_source_order(src_ptr, ring_ptr, held_ptr, staged_ptr, state_ptr, total, base, cap,
                                         PAGE_SIZE, FROM_STAGED, DEST, BLOCK)  # fmt: skip

    if DEST == 0:
        tl.store(ctl_ptr + 0, offset + written)
    if DEST <= 1:
        tl.store(ctl_ptr + 1, added + written)
        tl.store(words_ptr + 0, bits | ((added + written) & 0xFFFFFFFF))
    elif DEST == 2:
        tl.store(ctl_ptr + 2, held + written)
        tl.store(words_ptr + 1, bits | ((held + written) & 0xFFFFFFFF))
    else:
        tl.store(ctl_ptr + 3, staged + written)
    if FROM_STAGED:
        tl.store(ctl_ptr + 3, zero)


#: the release kernel's argument list (:class:`kvcore.kernels.launch.KernelArgs`; its ``*_ptr`` parameters are passed
#: as addresses)
_RELEASE_ARGS = KernelArgs(
    _release_kernel,
    runtime="src_ptr n ring_ptr held_ptr staged_ptr ctl_ptr state_ptr words_ptr taken bits cap",
    constexprs="PAGE_SIZE FROM_STAGED DEST ASCENDING BIAS BLOCK RANK_ROWS RANK_COLS SCAN_BLOCK RANK_STEP_COST "
               "SCAN_STEP_COST",
)  # fmt: skip


class FreePageList(KeepsAddresses):
    """Pages ``1 .. capacity`` of one allocator: which are free, in which order; see the module docstring.

    :param capacity: the number of pages (ids ``1 .. capacity``; page 0 is padding and never handed out).
    :param page_size: tokens per page: frees take token indices and keep ``index // page_size``.
    :param device: where the lists live.
    :param use_triton: Triton kernels (else the torch reference).
    :param to_front: freed pages go to the head of the ring (reused first) rather than its tail.
    :param need_sort: freed pages are held back and merged sorted when an allocation falls short.
    :param sort_each_free: the pages of one free (a :meth:`release`, or the pages a :meth:`commit_staged` moves)
        go in ascending page order (SGLang's paged allocator: ``torch.unique`` of the freed pages), rather than in
        the order of their first occurrence (its token allocator).
    """

    def __init__(self, capacity: int, page_size: int, device: torch.device, *, use_triton: bool,
                 to_front: bool, need_sort: bool, sort_each_free: bool = False):  # fmt: skip
        self.capacity, self.page_size, self.device = int(capacity), int(page_size), torch.device(device)
        self.use_triton, self.need_sort, self.sort_each_free = use_triton, need_sort, sort_each_free
        self._release_to = TO_HELD if need_sort else (TO_FRONT if to_front else TO_BACK)
        self._on_gpu = self.device.type == "cuda"
        if self._on_gpu and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self._device_index = self.device.index if self._on_gpu else -1
        self._words_tensor = torch.zeros(2, dtype=torch.int64, pin_memory=self._on_gpu)
        self._words = self._words_tensor.numpy()
        self._epoch = 0
        self._seq = 0  # the sequence number of the last launch that changed ADDED (never reset)
        self._launch = Launcher(_RELEASE_ARGS, self.device) if use_triton else None
        self._release_plans: dict[tuple, Plan] = {}  # one per kind of release (see _put_triton)
        self.clear()

    # -- state ----------------------------------------------------------------------------------------------

    def _bind_addresses(self) -> None:
        """A copy's published words: page-locked again, and a new epoch, which forgets the addresses kept (the words
        the original's launches still publish are not the copy's; its counts stay lower bounds until its own
        launches publish)."""
        self._words_tensor = page_locked(self._words_tensor, self._on_gpu)
        self._words = self._words_tensor.numpy()
        self._new_epoch()

    def clear(self) -> None:
        """Every page free, in ascending order; nothing held or staged."""
        cap, dev = self.capacity, self.device
        self.ring = torch.zeros(cap + 1, dtype=torch.int64, device=dev)  # + a spare slot for masked writes
        self.ring[:cap] = torch.arange(1, cap + 1, dtype=torch.int64, device=dev)
        self.held = torch.zeros(cap + 1 if self.need_sort else 1, dtype=torch.int64, device=dev)  # only need_sort holds
        self.staged = torch.zeros(cap + 1, dtype=torch.int64, device=dev)
        self.state = torch.full((cap + 2,), FREE, dtype=torch.int32, device=dev)  # + a spare slot
        self.ctl = torch.zeros(4, dtype=torch.int64, device=dev)
        self.taken = 0
        # ADDED's lower bound: exact as of a published word, then per later launch (sequence number, change's
        # lower bound) and the sum of those changes
        self._added, self._pending, self._pending_sum = 0, [], 0
        self._held = 0  # a lower bound of ctl[HELD]
        self._staged_any = False  # whether a release was staged since the last commit
        self._shared = False
        self._new_epoch()

    def snapshot(self) -> tuple:
        """Everything :meth:`restore` needs (no copy now; the next write copies the buffers instead)."""
        self._shared = True
        return (self.ring, self.held, self.staged, self.state, self.ctl, self.taken, self._added,
                tuple(self._pending), self._pending_sum, self._held)  # fmt: skip

    def restore(self, snapshot: tuple) -> None:
        (self.ring, self.held, self.staged, self.state, self.ctl, self.taken, self._added, pending,
         self._pending_sum, self._held) = snapshot  # fmt: skip
        self._pending = list(pending)
        self._staged_any = True  # the snapshot may hold staged pages: the next commit launches
        self._shared = True  # it may be restored again: copy before writing
        self._new_epoch()

    def before_write(self) -> None:
        """Copy the buffers a snapshot shares; every launch that writes them calls this first."""
        if self._shared:
            self.ring, self.held, self.staged = self.ring.clone(), self.held.clone(), self.staged.clone()
            self.state, self.ctl = self.state.clone(), self.ctl.clone()
            self._shared = False
            self._ptrs = None

    def _new_epoch(self) -> None:
        # Words of the old epoch are ignored from now on: fold the pending changes into the lower bound.
        self._added, self._pending, self._pending_sum = self._added + self._pending_sum, [], 0
        self._epoch = self._epoch % (_EPOCHS - 1) + 1  # 1 .. 2**15 - 1: a word always needs 64 bits
        self._epoch_bits = word_bits(self._epoch, 0)
        self._words[0] = word_bits(self._epoch, self._seq) | (self._added & _VALUE)
        self._words[1] = self._epoch_bits | self._held
        self._ptrs = None

    # -- counts ---------------------------------------------------------------------------------------------

    @property
    def known(self) -> int:
        """A lower bound of the pages in the ring (exact on the CPU)."""
        return self.capacity + self._added + self._pending_sum - self.taken

    @property
    def held_known(self) -> int:
        """A lower bound of the pages held back under ``need_sort``."""
        return self._held

    def refresh(self, wait: bool = False) -> int:
        """Read the counts the kernels published; with ``wait``, read the device's own counts instead (exact:
        on a GPU this waits for the device).  Returns :attr:`known`."""
        if wait:
            self._added, self._held = self.ctl[ADDED : HELD + 1].tolist()
            self._pending, self._pending_sum = [], 0
            return self.known
        ring, held = int(self._words[0]), int(self._words[1])
        if ring >> _EPOCH_SHIFT == self._epoch and self._pending:
            # the launch that wrote the word: the latest one whose sequence number has these low bits
            seq = self._seq - ((self._seq - (ring >> _VALUE_BITS)) & _SEQ)
            if seq >= self._pending[0][0]:
                delta = ((ring & _VALUE) - self._added) & _VALUE  # ADDED as of that launch, mod 2**32
                self._added += delta - (1 << _VALUE_BITS) if delta >> (_VALUE_BITS - 1) else delta
                done = 0
                while done < len(self._pending) and self._pending[done][0] <= seq:
                    self._pending_sum -= self._pending[done][1]
                    done += 1
                del self._pending[:done]
        if held >> _EPOCH_SHIFT == self._epoch:
            self._held = max(self._held, held & _VALUE)
        return self.known

    def exact(self) -> tuple[int, int]:
        """``(ring, held)`` page counts, exact (waits for the device on a GPU)."""
        self.refresh(wait=True)
        return self.known, self._held

    def ids(self) -> torch.Tensor:
        """The ring's pages in the order they will be handed out (waits; for inspection)."""
        n = self.exact()[0]
        head = int(head_of(self.ctl, self.taken, self.capacity))
        return self.ring[(head + torch.arange(n, device=self.device)) % self.capacity]

    def held_ids(self) -> torch.Tensor:
        """The pages held back, in the order they were freed (waits; for inspection)."""
        return self.held[: self.exact()[1]].clone()

    # -- updates --------------------------------------------------------------------------------------------

    def source(self) -> PageSource:
        """The ring as allocation kernels read it (call :meth:`before_write` first: they mark pages)."""
        return PageSource(self.ring, self.ctl, self.state, self.taken, self.capacity, self._words_tensor, 0)

    def decode_source(self, most: int) -> PageSource:
        """:meth:`source` for a decode step that takes at most ``most`` pages and counts them on the device
        (``most <= known``, which the caller checks); its launch publishes ``ADDED`` with the bits of
        :meth:`decode_bits`."""
        bits = self.decode_bits(most)
        return PageSource(self.ring, self.ctl, self.state, self.taken, self.capacity, self._words_tensor, bits)

    def decode_bits(self, most: int) -> int:
        """Number the next decode launch, which takes at most ``most`` pages (``most <= known``, which the
        caller checks) and counts them on the device, and return the bits of the word it publishes."""
        return self._sequenced(-most)

    @property
    def words(self) -> torch.Tensor:
        """The two published words (host memory, pinned on a GPU): the ring's and the held list's counts."""
        return self._words_tensor

    def pointers(self) -> tuple[int, int, int, int, int, int]:
        """The addresses of ``ring, held, staged, ctl, state`` and the published words, for direct launches
        (valid until a write copies the buffers a snapshot shares: call :meth:`before_write` first)."""
        ptrs = self._ptrs
        if ptrs is None:
            ptrs = self._ptrs = (self.ring.data_ptr(), self.held.data_ptr(), self.staged.data_ptr(),
                                 self.ctl.data_ptr(), self.state.data_ptr(), self._words_tensor.data_ptr())  # fmt: skip
        return ptrs

    def _sequenced(self, least_change: int) -> int:
        """Number the next launch that changes ``ADDED`` (by at least ``least_change``), count that change in
        the host's lower bound, and return the bits its published word carries."""
        self._seq = seq = self._seq + 1
        self._pending.append((seq, least_change))
        self._pending_sum += least_change
        if len(self._pending) > _MAX_PENDING:
            self.refresh()
        return self._epoch_bits | ((seq & _SEQ) << _VALUE_BITS)

    def took(self, n: int) -> None:
        """Record that a kernel took the ``n`` pages at the head (``n <= known``, which the caller checks)."""
        self.taken += n

    def release(self, index: torch.Tensor, *, staged: bool = False) -> None:
        """Give back the pages holding token indices ``index`` (allocated ones, each once; ascending with
        ``sort_each_free``, else in order of first occurrence): to the ring, held back under ``need_sort``, or
        ``staged`` until :meth:`commit_staged` (which sorts all the pages it moves together: staging keeps the
        order of first occurrence)."""
        self._staged_any |= staged
        self._put(index, staged, False)

    def commit_staged(self) -> None:
        """Move the staged pages where a release would have put them, as one free (with ``sort_each_free``, all
        of them in ascending order; nothing to launch when nothing was staged since the last commit: an engine's
        free group is empty on most decode steps)."""
        if self._staged_any:
            self._staged_any = False
            self._put(None, False, True)

    def merge_held(self) -> None:
        """Append the held pages to the ring and sort the ring (ascending from its head)."""
        self.before_write()
        cap = self.capacity
        i = torch.arange(cap, dtype=torch.int64, device=self.device)
        count = cap + self.ctl[ADDED] - self.taken
        mine = self.ring[(head_of(self.ctl, self.taken, cap) + i) % cap]
        theirs = self.held[(i - count).clamp(0, self.held.numel() - 1)]
        after_last = torch.iinfo(torch.int64).max
        merged = torch.where(i < count, mine, torch.where(i - count < self.ctl[HELD], theirs, after_last))
        self.ring[:cap] = torch.sort(merged).values
        self.ctl[OFFSET] = self.taken  # the head is now position 0
        self.ctl[ADDED] += self.ctl[HELD]
        self.ctl[HELD] = 0
        self._added, self._held = self._added + self._held, 0
        self._new_epoch()

    def _put(self, index: torch.Tensor | None, staged: bool, from_staged: bool) -> None:
        self.before_write()
        dest = TO_STAGED if staged else self._release_to
        bits = self._sequenced(0) if dest <= TO_BACK else self._epoch_bits  # only ring releases change ADDED
        if self.use_triton:
            self._put_triton(index, dest, from_staged, bits)
        else:
            self._put_native(index, dest, from_staged, bits)
        if not self._on_gpu:  # nothing to wait for: the counts are exact at once
            self.refresh()

    def _put_triton(self, index: torch.Tensor | None, dest: int, from_staged: bool, bits: int) -> None:
        src = self.staged if index is None else index.contiguous()  # read as a flat array
        if src.get_device() != self._device_index:
            raise ValueError(f"free takes indices on {self.device}, got {src.device}")
        n = 0 if index is None else index.numel()
        address = src.data_ptr()
        ring, held, staged, ctl, state, words = self.pointers()
        # the tuning constants are read at each call and key the plan (the launcher keys the kernel on every
        # constexpr): a changed one makes another plan, never launches the old kernel
        kind = (src.dtype, address % 16 == 0, from_staged, dest, _BLOCK, _RANK_ROWS, _RANK_COLS, _SCAN_BLOCK,
                _RANK_STEP_COST, _SCAN_STEP_COST)  # fmt: skip
        plan = self._release_plans.get(kind)
        if plan is None:
            constexprs = _RELEASE_ARGS.constexprs(
                PAGE_SIZE=self.page_size, FROM_STAGED=from_staged, DEST=dest,
                ASCENDING=self.sort_each_free and dest != TO_STAGED, BIAS=TAKEN_BIAS, BLOCK=_BLOCK,
                RANK_ROWS=_RANK_ROWS, RANK_COLS=_RANK_COLS, SCAN_BLOCK=_SCAN_BLOCK, RANK_STEP_COST=_RANK_STEP_COST,
                SCAN_STEP_COST=_SCAN_STEP_COST,
            )  # fmt: skip
            plan = self._release_plans[kind] = Plan(self._launch, kind[:2], 1, (1, 1), _WARPS, constexprs=constexprs)
        plan(1, (address, n, ring, held, staged, ctl, state, words, self.taken + TAKEN_BIAS, bits, self.capacity),
             lambda: (src, self.ring, self.held, self.staged, self.ctl, self.state, self._words_tensor))  # one program

    def _put_native(self, index: torch.Tensor | None, dest: int, from_staged: bool, bits: int) -> None:
        cap, ctl, dev = self.capacity, self.ctl, self.device
        if from_staged:
            total = int(ctl[STAGED])  # the reference reads the count (on a GPU: waits)
            page, keep = self.staged[:total], torch.ones(total, dtype=torch.bool, device=dev)
        else:
            page = index.reshape(-1).to(device=dev, dtype=torch.int64) // self.page_size
            ok = (page >= 0) & (page <= cap)
            page = torch.where(ok, page, cap + 1)  # the spare state slot
            pos = torch.arange(page.numel(), dtype=torch.int32, device=dev)
            self.state.scatter_reduce_(0, page, pos, "amin")
            keep = ok & (self.state[page] == pos)
            self.state[cap + 1] = FREE
        k = keep.to(torch.int64)
        written = k.sum()
        if self.sort_each_free and dest != TO_STAGED:  # the kept pages first, ascending
            page = torch.sort(torch.where(keep, page, torch.iinfo(torch.int64).max)).values
            rank = torch.arange(page.numel(), device=dev)
            keep = rank < written
        else:
            rank = torch.cumsum(k, 0) - k
        head = head_of(ctl, self.taken, cap)
        if dest == TO_FRONT:
            base, target, size = head - written, self.ring, cap
        elif dest == TO_BACK:
            base, target, size = head + cap + ctl[ADDED] - self.taken, self.ring, cap
        else:
            base, target, size = ctl[HELD if dest == TO_HELD else STAGED], (self.held if dest == TO_HELD else self.staged), None
        where = base + rank if size is None else (base + rank) % size
        target.index_put_((torch.where(keep, where, cap),), page)  # dropped pages: the spare slot
        if not from_staged:
            self.state.index_put_((torch.where(keep, page, cap + 1),), torch.tensor(FREE, dtype=torch.int32, device=dev))
        if dest == TO_FRONT:
            ctl[OFFSET] += written
        field = {TO_FRONT: ADDED, TO_BACK: ADDED, TO_HELD: HELD, TO_STAGED: STAGED}[dest]
        ctl[field] += written
        if from_staged:
            ctl[STAGED] = 0
        if dest != TO_STAGED:
            self._words_tensor[int(dest == TO_HELD)].copy_((ctl[field] & _VALUE) | bits, non_blocking=True)
