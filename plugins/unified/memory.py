"""The bytes of a unified memory and who moves what in them (:class:`UnifiedMemory`).

One uint8 tensor holds a padding unit of the low side, the shared range of ``capacity_bytes`` the
:class:`~kvcore_unified.allocator.MultiEndedAllocator` hands out from its two ends, and a padding unit of the high side::

    [ low padding | low units 0, 1, 2 ... ->        free        <- ... high units 2, 1, 0 | high padding ]

Each side is seen by its owner as an array of *pages* of its unit, in address order, laid over
:meth:`UnifiedMemory.side_memory`: low physical unit ``p`` is page ``p + 1`` of :meth:`low_memory` (page 0 is the
low padding), high physical unit ``p`` is page ``high_pages - 1 - p`` of :meth:`high_memory` (page ``high_pages``
is the high padding; pages below the high side's lowest unit overlap the low side's bytes and are never mapped).
:meth:`UnifiedMemory.page_of` and :meth:`UnifiedMemory.padding_page` give those numbers.  The range's end is kept
on a 16-byte boundary (``capacity_bytes`` rounded down), so a side whose unit is a multiple of 16 bytes has every
page aligned for any element type.

When a side compacts, the allocator calls the mover the side's owner registered (:meth:`UnifiedMemory.on_move`)
with the physical units to copy, before it reuses them.

**Frees that do not wait.**  The owners' ``free`` takes the engine's ids as a device tensor; the bookkeeping needs
them on the host.  :meth:`UnifiedMemory.free_later` starts their copy to pinned host memory behind the work already
queued and returns; the next query or allocation of either side (:meth:`UnifiedMemory.settle_frees`) waits for that
copy alone (long done by then, as a rule) and gives the ids back.  No free waits for the device.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import numpy as np
import torch

from kvcore.planning.unified import ALIGN  # the byte boundary the range ends on (the planner counts it the same)
from kvcore_unified.allocator import HIGH, LOW, MultiEndedAllocator

__all__ = ["UnifiedMemory", "ALIGN"]

#: a unit at least this large is moved by a copy of its own (an index copy of few, huge rows runs far below the
#: device's copy rate: 6 GB/s for one 37 MiB state envelope on an H200)
_WHOLE_COPY_BYTES = 1 << 20

#: ``mover(src, dst)``: copy the envelopes of physical units ``src`` of one side to its units ``dst`` (int64 host arrays)
SideMover = Callable[[np.ndarray, np.ndarray], None]


class _PendingFree(NamedTuple):
    """A free whose ids are on their way to the host: ``settle(ids)`` once ``ready`` (None: they are there)."""

    ids: torch.Tensor
    ready: "torch.cuda.Event | None"
    settle: Callable[[np.ndarray], None]


class UnifiedMemory:
    """One byte range shared by two kinds of units (see the module docstring).

    :param capacity_bytes: the shared range's bytes (padding units come on top), rounded down so that the range
        ends on an :data:`ALIGN`-byte boundary.
    :param low_unit_bytes: one low unit (every full-attention layer of one KV page, say).
    :param high_unit_bytes: one high unit (a request's recurrent state, or a window page).
    :param device: where the bytes live.
    :param low_ids: virtual ids of the low side (default: as many as the range holds of its units).
    :param high_ids: the same for the high side.
    :param lazy_compaction: compact a side only when the other needs its freed bytes (True, SGLang's default), or
        at every free (False): :class:`~kvcore_unified.allocator.MultiEndedAllocator`'s ``lazy``.
    """

    def __init__(self, capacity_bytes: int, low_unit_bytes: int, high_unit_bytes: int, device: torch.device | str,
                 *, low_ids: int | None = None, high_ids: int | None = None, lazy_compaction: bool = True):  # fmt: skip
        self.device = torch.device(device)
        capacity_bytes = (int(low_unit_bytes) + int(capacity_bytes)) // ALIGN * ALIGN - int(low_unit_bytes)
        self.allocator = MultiEndedAllocator(capacity_bytes, low_unit_bytes, high_unit_bytes, low_ids=low_ids,
                                             high_ids=high_ids, mover=self._move, lazy=lazy_compaction)  # fmt: skip
        self._pending: list[_PendingFree] = []
        self.low_unit, self.high_unit = int(low_unit_bytes), int(high_unit_bytes)
        self.capacity = int(capacity_bytes)
        self.buffer = torch.zeros(self.low_unit + self.capacity + self.high_unit, dtype=torch.uint8, device=self.device)
        self._movers: dict[str, SideMover] = {}
        #: pages of the high side's unit that :meth:`high_memory` holds below its padding page
        self.high_pages = (self.low_unit + self.capacity) // self.high_unit

    def unit_bytes(self, side: str) -> int:
        """Bytes of one unit (one page) of ``side``."""
        return self.low_unit if side == LOW else self.high_unit

    def low_memory(self) -> torch.Tensor:
        """The low padding unit and the shared range: what a page-major pool of low units is laid over."""
        return self.buffer[: self.low_unit + self.capacity]

    def high_memory(self) -> torch.Tensor:
        """``high_pages + 1`` pages of the high unit ending with the high padding: what the high side's pool is laid
        over (its pages in address order; see the module docstring).

        :raises ValueError: when the high unit is not a multiple of :data:`ALIGN` bytes (its pages would not all be
            aligned for typed views).
        """
        if self.high_unit % ALIGN:
            raise ValueError(f"a high unit of {self.high_unit} bytes is not a multiple of {ALIGN}: pad the envelope")
        return self.buffer[self.buffer.numel() - (self.high_pages + 1) * self.high_unit:]

    def side_memory(self, side: str) -> torch.Tensor:
        """:meth:`low_memory` or :meth:`high_memory`."""
        return self.low_memory() if side == LOW else self.high_memory()

    def page_of(self, side: str, physical: np.ndarray) -> np.ndarray:
        """The pages of ``side``'s physical units in its :meth:`side_memory` (int64)."""
        physical = np.asarray(physical, dtype=np.int64)
        return physical + 1 if side == LOW else self.high_pages - 1 - physical

    def padding_page(self, side: str) -> int:
        """``side``'s padding page in its :meth:`side_memory`: where a virtual id not allocated points."""
        return 0 if side == LOW else self.high_pages

    def move_units(self, side: str, src: np.ndarray, dst: np.ndarray) -> None:
        """Copy whole units (envelopes) of ``side``, physical ``src`` to physical ``dst`` (disjoint int64 host
        arrays of one length), on the memory's device: the mover of an owner whose envelope is just bytes (every
        owner's: a page-major pool's page and a state slot's envelope are whole units).

        :raises ValueError: when the side's unit is not a multiple of :data:`ALIGN` bytes."""
        if self.unit_bytes(side) % ALIGN:
            raise ValueError(f"a {side} unit of {self.unit_bytes(side)} bytes is not a multiple of {ALIGN}")
        if len(src) == 0:
            return
        unit, memory = self.unit_bytes(side), self.side_memory(side)
        pages = memory[: memory.numel() // unit * unit].view(-1, unit)
        src_pages, dst_pages = self.page_of(side, src), self.page_of(side, dst)
        if unit >= _WHOLE_COPY_BYTES or len(src) <= 4:  # a copy per unit runs at the device's copy rate
            for s, d in zip(src_pages.tolist(), dst_pages.tolist()):
                pages[d].copy_(pages[s])
            return
        # many small units: one index copy, as 8-byte words (a unit is a multiple of 16 bytes on a 16-byte boundary)
        words = pages.view(torch.int64)
        src_t, dst_t = (torch.from_numpy(p).to(self.device) for p in (src_pages, dst_pages))
        words.index_copy_(0, dst_t, words.index_select(0, src_t))

    # -- frees that do not wait ---------------------------------------------------------------------------------

    def free_later(self, ids: torch.Tensor, settle: Callable[[np.ndarray], None]) -> None:
        """Call ``settle`` with ``ids`` as a flat int64 host array at the next :meth:`settle_frees`, in the order
        given.  A CUDA tensor is copied to pinned host memory on the current stream, behind the work queued
        before this call, without waiting; any other is copied now."""
        flat = ids.reshape(-1)
        if flat.device.type == "cuda":
            host = torch.empty(flat.shape, dtype=flat.dtype, pin_memory=True)
            host.copy_(flat, non_blocking=True)
            ready = torch.cuda.Event()
            ready.record()
            self._pending.append(_PendingFree(host, ready, settle))
        else:
            self._pending.append(_PendingFree(flat.clone(), None, settle))

    def settle_frees(self) -> None:
        """Hand every pending free its ids (waiting for their copies alone): what each owner's queries and
        allocations call first, so that they see every free made before them."""
        while self._pending:
            pending = self._pending.pop(0)
            if pending.ready is not None:
                pending.ready.synchronize()
            pending.settle(pending.ids.numpy().astype(np.int64, copy=False))

    def flush(self) -> int:
        """Settle the pending frees and compact both sides now (the free bytes one range): a time the engine
        chooses, between steps.  Returns the units moved."""
        self.settle_frees()
        return self.allocator.flush()

    def hold_moves(self) -> None:
        """Keep every unit where it is until :meth:`release_moves` (calls nest): a transfer reads or writes units by
        their physical places (:meth:`~kvcore_unified.allocator.MultiEndedAllocator.hold_moves`)."""
        self.allocator.hold_moves()

    def release_moves(self) -> None:
        """End one :meth:`hold_moves`."""
        self.allocator.release_moves()

    def on_move(self, side: str, mover: SideMover) -> None:
        """Register how ``side``'s envelopes move when it compacts (its owner's pool copies them)."""
        if side not in (LOW, HIGH):
            raise ValueError(f"side must be {LOW!r} or {HIGH!r}, got {side!r}")
        self._movers[side] = mover

    def _move(self, side: str, src: np.ndarray, dst: np.ndarray) -> None:
        mover = self._movers.get(side)
        if mover is None:
            raise RuntimeError(f"the {side} side of a unified memory compacted, but nothing registered how its units "
                               "move (UnifiedMemory.on_move)")  # fmt: skip
        mover(src, dst)
