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

When a free compacts a side, the allocator calls the mover the side's owner registered
(:meth:`UnifiedMemory.on_move`) with the physical units to copy, before it reuses them.
"""

from __future__ import annotations

from collections.abc import Callable

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


class UnifiedMemory:
    """One byte range shared by two kinds of units (see the module docstring).

    :param capacity_bytes: the shared range's bytes (padding units come on top), rounded down so that the range
        ends on an :data:`ALIGN`-byte boundary.
    :param low_unit_bytes: one low unit (every full-attention layer of one KV page, say).
    :param high_unit_bytes: one high unit (a request's recurrent state, or a window page).
    :param device: where the bytes live.
    :param low_ids: virtual ids of the low side (default: as many as the range holds of its units).
    :param high_ids: the same for the high side.
    """

    def __init__(self, capacity_bytes: int, low_unit_bytes: int, high_unit_bytes: int, device: torch.device | str,
                 *, low_ids: int | None = None, high_ids: int | None = None):  # fmt: skip
        self.device = torch.device(device)
        capacity_bytes = (int(low_unit_bytes) + int(capacity_bytes)) // ALIGN * ALIGN - int(low_unit_bytes)
        self.allocator = MultiEndedAllocator(capacity_bytes, low_unit_bytes, high_unit_bytes, low_ids=low_ids,
                                             high_ids=high_ids, mover=self._move)  # fmt: skip
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

    def on_move(self, side: str, mover: SideMover) -> None:
        """Register how ``side``'s envelopes move when a free compacts it (its owner's pool copies them)."""
        if side not in (LOW, HIGH):
            raise ValueError(f"side must be {LOW!r} or {HIGH!r}, got {side!r}")
        self._movers[side] = mover

    def _move(self, side: str, src: np.ndarray, dst: np.ndarray) -> None:
        mover = self._movers.get(side)
        if mover is None:
            raise RuntimeError(f"the {side} side of a unified memory compacted, but nothing registered how its units "
                               "move (UnifiedMemory.on_move)")  # fmt: skip
        mover(src, dst)
