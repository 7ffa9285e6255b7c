"""A free list of page ids that never makes the host wait for the device (:class:`PageQueue`).

The paged allocator's free path must drop duplicate pages (the tokens of one page come in together), and any
operation whose output size depends on the data (``torch.unique``, a boolean mask) makes the host read the
device: one synchronisation per free, in the middle of every decode step.  Here instead:

* the ids live in a device ring buffer with device-side ``head`` and ``count``; every update has a shape the
  host knows.  A free sorts its pages and writes the first of each run of equal ids into the ring (the
  duplicates go to a spare slot past the end), and adds how many it wrote to ``count``, all on the device;
* the host keeps ``known``, a lower bound of ``count``: taking pages lowers it at once, and what each free
  added arrives through a non-blocking copy into pinned memory, read when its CUDA event has completed.  An
  allocation that fits under ``known`` never waits; only one that does not (a nearly full pool) waits for the
  outstanding counts, and :meth:`PageQueue.exact` (``available_size``) waits for them by design.

On the CPU there is nothing to wait for and ``known`` is always exact.

Snapshots (:meth:`PageQueue.snapshot`) are copy-on-write: a snapshot shares the ring until the next write,
which copies it first, so a backup that is restored before anything is freed costs no copy.
"""

from __future__ import annotations

import torch

__all__ = ["PageQueue", "distinct_sorted"]

_AFTER_LAST = torch.iinfo(torch.int64).max  # sorts after every page id


def distinct_sorted(ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``ids`` sorted, and a mask of the first of each run of equal values (so ``sorted[mask]`` are the distinct
    ids, ascending), both of ``ids``' length: no output size depends on the data."""
    ordered = torch.sort(ids.reshape(-1)).values
    first = torch.ones_like(ordered, dtype=torch.bool)
    first[1:] = ordered[1:] != ordered[:-1]
    return ordered, first


class PageQueue:
    """Page ids in order, taken from the front, added at the front or the back; see the module docstring.

    :param capacity: the most ids it ever holds (the allocator's page count).
    """

    def __init__(self, capacity: int, device: torch.device):
        self.capacity = int(capacity)
        self.device = device
        self._async = device.type == "cuda"
        self.clear()

    # -- state ----------------------------------------------------------------------------------------------

    def clear(self, ids: torch.Tensor | None = None) -> None:
        """Hold exactly ``ids`` (an int64 tensor of known length; none by default)."""
        self._ring = torch.zeros(self.capacity + 1, dtype=torch.int64, device=self.device)  # + the spare slot
        n = 0 if ids is None else ids.numel()
        if n:
            self._ring[:n] = ids
        self._head = torch.zeros((), dtype=torch.int64, device=self.device)
        self._count = torch.full((), n, dtype=torch.int64, device=self.device)
        self.known = n
        self._pending: list[tuple[torch.Tensor, object]] = []
        self._shared = False

    def snapshot(self) -> tuple:
        """Everything :meth:`restore` needs (no copy now; the next write copies the ring instead)."""
        self._shared = True
        return (self._ring, self._head, self._count, self.known, tuple(self._pending))

    def restore(self, snapshot: tuple) -> None:
        self._ring, self._head, self._count, self.known, pending = snapshot
        self._pending = list(pending)
        self._shared = True  # the snapshot may be restored again: copy before writing

    # -- counts ---------------------------------------------------------------------------------------------

    def refresh(self, wait: bool = False) -> int:
        """Add to :attr:`known` the counts of frees that have arrived (all of them, waiting, when ``wait``)."""
        while self._pending:
            count, event = self._pending[0]
            if event is not None and not wait and not event.query():
                break
            if event is not None:
                event.synchronize()
            self.known += int(count)
            self._pending.pop(0)
        return self.known

    def exact(self) -> int:
        """The number of ids held (waits for outstanding counts on a GPU)."""
        return self.refresh(wait=True)

    def ids(self) -> torch.Tensor:
        """The ids in order (waits for outstanding counts; for inspection, not the hot path)."""
        n = self.exact()
        return self._ring[(self._head + torch.arange(n, device=self.device)) % self.capacity]

    # -- updates --------------------------------------------------------------------------------------------

    def take(self, n: int) -> torch.Tensor:
        """The first ``n`` ids (``n <= known``, which the caller checks), removed from the queue."""
        if n > self.known:
            raise RuntimeError(f"PageQueue.take({n}) with only {self.known} ids known to be held; refresh first")
        out = self._ring[(self._head + torch.arange(n, device=self.device)) % self.capacity]
        self._head = (self._head + n) % self.capacity
        self._count = self._count - n
        self.known -= n
        return out

    def put(self, ordered: torch.Tensor, keep: torch.Tensor, *, front: bool) -> None:
        """Add ``ordered[keep]`` (in that order) at the front or the back, without reading ``keep`` on the host."""
        if ordered.numel() == 0:
            return
        if self._shared:
            self._ring, self._shared = self._ring.clone(), False
        keep_i = keep.to(torch.int64)
        added = keep_i.sum()
        rank = torch.cumsum(keep_i, 0) - keep_i
        start = (self._head - added) % self.capacity if front else (self._head + self._count) % self.capacity
        where = torch.where(keep, (start + rank) % self.capacity, self.capacity)  # duplicates: the spare slot
        self._ring.index_put_((where,), ordered)
        if front:
            self._head = start
        self._count = self._count + added
        self._record(added)

    def absorb(self, other: PageQueue) -> None:
        """Take every id of ``other`` (emptying it) and sort the union ascending, on the device."""
        if self._shared:
            self._ring, self._shared = self._ring.clone(), False
        i = torch.arange(self.capacity, device=self.device)
        j = i - self._count
        mine = self._ring[(self._head + i) % self.capacity]
        theirs = other._ring[(other._head + j.clamp(min=0)) % other.capacity]
        merged = torch.where(i < self._count, mine, torch.where(j < other._count, theirs, _AFTER_LAST))
        self._ring[: self.capacity] = torch.sort(merged).values
        self._head = torch.zeros_like(self._head)
        self._count = self._count + other._count
        self.known += other.known
        self._pending += other._pending
        other.clear()

    def _record(self, added: torch.Tensor) -> None:
        if not self._async:
            self._pending.append((added, None))
            self.refresh()
            return
        host = torch.empty((), dtype=torch.int64, pin_memory=True)
        host.copy_(added, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        self._pending.append((host, event))
