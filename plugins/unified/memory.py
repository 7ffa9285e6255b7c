"""The bytes of a unified memory and who moves what in them (:class:`UnifiedMemory`).

One uint8 tensor holds a padding unit of the low side, the shared range of ``capacity_bytes`` the
:class:`~kvcore_unified.allocator.MultiEndedAllocator` hands out from its two ends, and a padding unit of the high side::

    [ low padding | low units 0, 1, 2 ... ->        free        <- ... high units 2, 1, 0 | high padding ]

Low physical unit ``p`` is at byte ``(p + 1) * low_unit_bytes``: a page-major pool laid over :meth:`low_memory`
sees it as its page ``p + 1`` (its page 0 is the padding).  High physical unit ``p`` ends where unit ``p - 1``
starts, the last one where the high padding starts.  When a free compacts a side, the allocator calls the mover
the side's owner registered (:meth:`UnifiedMemory.on_move`) with the physical units to copy, before it reuses them.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from kvcore_unified.allocator import HIGH, LOW, MultiEndedAllocator

__all__ = ["UnifiedMemory"]

#: ``mover(src, dst)``: copy the envelopes of physical units ``src`` of one side to its units ``dst`` (int64 host arrays)
SideMover = Callable[[np.ndarray, np.ndarray], None]


class UnifiedMemory:
    """One byte range shared by two kinds of units (see the module docstring).

    :param capacity_bytes: the shared range's bytes (padding units come on top).
    :param low_unit_bytes: one low unit (every full-attention layer of one KV page, say).
    :param high_unit_bytes: one high unit (a request's recurrent state, or a window page).
    :param device: where the bytes live.
    :param low_ids: virtual ids of the low side (default: as many as the range holds of its units).
    :param high_ids: the same for the high side.
    """

    def __init__(self, capacity_bytes: int, low_unit_bytes: int, high_unit_bytes: int, device: torch.device | str,
                 *, low_ids: int | None = None, high_ids: int | None = None):  # fmt: skip
        self.device = torch.device(device)
        self.allocator = MultiEndedAllocator(capacity_bytes, low_unit_bytes, high_unit_bytes, low_ids=low_ids,
                                             high_ids=high_ids, mover=self._move)  # fmt: skip
        self.low_unit, self.high_unit = int(low_unit_bytes), int(high_unit_bytes)
        self.capacity = int(capacity_bytes)
        self.buffer = torch.zeros(self.low_unit + self.capacity + self.high_unit, dtype=torch.uint8, device=self.device)
        self._movers: dict[str, SideMover] = {}

    def low_memory(self) -> torch.Tensor:
        """The low padding unit and the shared range: what a page-major pool of low units is laid over."""
        return self.buffer[: self.low_unit + self.capacity]

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
