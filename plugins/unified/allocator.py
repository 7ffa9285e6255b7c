"""One byte range shared by two kinds of fixed-size units that grow from its two ends (:class:`MultiEndedAllocator`).

The unified memory of a hybrid model: the *low* end holds, say, full-attention KV pages (every layer of one page in
one envelope of ``low_unit_bytes``) and grows up from byte 0; the *high* end holds per-request recurrent states
(or sliding-window pages) in envelopes of ``high_unit_bytes`` and grows down from the top.  Whatever one kind does
not use, the other can take: no ratio is fixed at start-up.

Engines hold *virtual* ids (``1 .. low_ids`` and ``1 .. high_ids``; 0 is padding on both sides), which never
change while allocated.  Each side keeps its units dense at its end: a free moves the side's topmost units into
the holes it leaves (one batched move of whole envelopes, through the ``mover`` the pool supplies) and rewrites
their virtual -> physical entries, so the free bytes between the two ends are always one range, and an id an
engine holds stays valid across the move.  Physical unit ``p`` of the low side starts at byte ``p * low_unit_bytes``;
physical unit ``p`` of the high side at byte ``capacity - (p + 1) * high_unit_bytes``.

The bookkeeping is on the host (numpy): no call reads the device.  The virtual -> physical tables a pool's kernels
read are kept on the pool's device as well (:meth:`MultiEndedAllocator.device_table`), updated after each change
by small host-to-device copies that do not wait for the device.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch

__all__ = ["LOW", "HIGH", "MultiEndedAllocator", "Moves"]

LOW, HIGH = "low", "high"

#: ``mover(side, src, dst)``: copy the envelopes of physical units ``src`` to physical units ``dst`` of ``side``
#: (int64 host arrays of one length; the two sets never overlap), before the allocator reuses ``src``
Moves = Callable[[str, np.ndarray, np.ndarray], None]


class _Side:
    """One end's tables: virtual -> physical (``-1``: not allocated), physical -> virtual, its free virtual ids."""

    __slots__ = ("name", "unit", "ids", "v2p", "p2v", "used", "free_ids", "device")

    def __init__(self, name: str, unit: int, ids: int, physical: int):
        self.name, self.unit, self.ids = name, unit, ids
        self.v2p = np.full(ids + 1, -1, dtype=np.int64)
        self.v2p[0] = 0  # the padding id maps to the padding unit
        self.p2v = np.zeros(max(physical, 1), dtype=np.int64)
        self.used = 0
        self.free_ids: list[int] = list(range(1, ids + 1))
        self.device: torch.Tensor | None = None


class MultiEndedAllocator:
    """Two stacks of fixed-size units in one byte range (see the module docstring).

    :param capacity_bytes: the bytes both ends share (the pool's arena, padding units excluded).
    :param low_unit_bytes: bytes of one low-end unit (an envelope: every layer of one KV page, say).
    :param high_unit_bytes: bytes of one high-end unit (every linear layer's state of one request slot, say).
    :param low_ids: virtual ids of the low end (``1 .. low_ids``); default: as many units as the whole range holds.
    :param high_ids: likewise for the high end.
    :param mover: copies envelopes when a free compacts a side (:data:`Moves`); None when nothing is stored (a
        planner's simulation, tests of the bookkeeping).
    :param device: where :meth:`device_table` keeps the virtual -> physical tables (None: not kept).
    """

    def __init__(self, capacity_bytes: int, low_unit_bytes: int, high_unit_bytes: int, *, low_ids: int | None = None,
                 high_ids: int | None = None, mover: Moves | None = None,
                 device: torch.device | str | None = None):  # fmt: skip
        if capacity_bytes <= 0 or low_unit_bytes <= 0 or high_unit_bytes <= 0:
            raise ValueError(f"capacity and unit sizes must be positive, got capacity_bytes={capacity_bytes}, "
                             f"low_unit_bytes={low_unit_bytes}, high_unit_bytes={high_unit_bytes}")  # fmt: skip
        self.capacity = int(capacity_bytes)
        most_low, most_high = self.capacity // low_unit_bytes, self.capacity // high_unit_bytes
        self._sides = {
            LOW: _Side(LOW, int(low_unit_bytes), most_low if low_ids is None else int(low_ids), most_low),
            HIGH: _Side(HIGH, int(high_unit_bytes), most_high if high_ids is None else int(high_ids), most_high),
        }
        self.mover = mover
        self.device = None if device is None else torch.device(device)
        self.moved_units = 0  # envelopes moved by compaction so far (for reports)
        if self.device is not None:
            for side in self._sides.values():
                side.device = torch.from_numpy(side.v2p.copy()).to(self.device)

    # -- queries -------------------------------------------------------------------------------------------

    def unit_bytes(self, side: str) -> int:
        """Bytes of one unit of ``side``."""
        return self._sides[side].unit

    def ids(self, side: str) -> int:
        """How many virtual ids ``side`` has (``1 .. ids``), free or not."""
        return self._sides[side].ids

    def used(self, side: str) -> int:
        """Units of ``side`` allocated now."""
        return self._sides[side].used

    def free_bytes(self) -> int:
        """Bytes between the two ends: what either side can still take."""
        low, high = self._sides[LOW], self._sides[HIGH]
        return self.capacity - low.used * low.unit - high.used * high.unit

    def available(self, side: str) -> int:
        """Units ``side`` can still take (the free bytes, and its free virtual ids, permitting)."""
        s = self._sides[side]
        return min(self.free_bytes() // s.unit, len(s.free_ids))

    def free_ids(self, side: str) -> list[int]:
        """``side``'s virtual ids not allocated, in the order :meth:`alloc` takes them."""
        return list(self._sides[side].free_ids)

    def physical(self, side: str, ids: Sequence[int] | np.ndarray) -> np.ndarray:
        """The physical units of virtual ``ids`` of ``side`` (``-1`` for an id not allocated)."""
        return self._sides[side].v2p[np.asarray(ids, dtype=np.int64)]

    def virtual(self, side: str) -> np.ndarray:
        """The virtual ids of ``side``'s allocated units, by physical position (``[used]``)."""
        s = self._sides[side]
        return s.p2v[: s.used].copy()

    def byte_offset(self, side: str, physical: np.ndarray | int) -> np.ndarray:
        """Where physical units of ``side`` start in the byte range."""
        s = self._sides[side]
        p = np.asarray(physical, dtype=np.int64)
        return p * s.unit if side == LOW else self.capacity - (p + 1) * s.unit

    def device_table(self, side: str) -> torch.Tensor:
        """``side``'s virtual -> physical table on the allocator's device (int64 ``[ids + 1]``; ``-1`` for an id
        not allocated), current as of the last call: what a pool's kernels translate virtual ids with."""
        table = self._sides[side].device
        if table is None:
            raise RuntimeError("this MultiEndedAllocator keeps no device tables (built without device=)")
        return table

    # -- allocation ---------------------------------------------------------------------------------------

    def alloc(self, side: str, count: int) -> np.ndarray | None:
        """``count`` new units of ``side``: their virtual ids (int64), or None (and nothing taken) when the free
        bytes or the side's virtual ids do not suffice."""
        s = self._sides[side]
        if count < 0:
            raise ValueError(f"alloc of {count} units")
        if count > self.available(side):
            return None
        ids = np.asarray(s.free_ids[:count], dtype=np.int64)
        del s.free_ids[:count]
        physical = np.arange(s.used, s.used + count, dtype=np.int64)
        s.v2p[ids] = physical
        s.p2v[physical] = ids
        s.used += count
        self._publish(s, ids)
        return ids

    def free(self, side: str, ids: Sequence[int] | np.ndarray) -> None:
        """Give back virtual ``ids`` of ``side`` (ids not allocated, the padding id and repeats are ignored), then
        compact the side: its topmost live units move into the holes below, in one :data:`Moves` call."""
        s = self._sides[side]
        ids = np.unique(np.asarray(ids, dtype=np.int64).reshape(-1))
        ids = ids[(ids > 0) & (ids <= s.ids)]
        ids = ids[s.v2p[ids] >= 0]
        if ids.size == 0:
            return
        holes = np.sort(s.v2p[ids])
        remaining = s.used - ids.size
        s.v2p[ids] = -1
        s.free_ids.extend(int(i) for i in ids)
        keep_tail = np.setdiff1d(np.arange(remaining, s.used, dtype=np.int64), holes, assume_unique=True)
        fill = holes[holes < remaining]  # the holes below the new top, filled by the live units above it
        changed = ids
        if fill.size:
            if self.mover is not None:
                self.mover(side, keep_tail, fill)
            movers = s.p2v[keep_tail]
            s.v2p[movers] = fill
            s.p2v[fill] = movers
            self.moved_units += int(fill.size)
            changed = np.concatenate([ids, movers])
        s.used = remaining
        self._publish(s, changed)

    def clear(self) -> None:
        """Everything free (no envelope moves)."""
        for s in self._sides.values():
            s.v2p[1:] = -1
            s.used = 0
            s.free_ids = list(range(1, s.ids + 1))
            if s.device is not None:
                s.device.copy_(torch.from_numpy(s.v2p))

    def _publish(self, s: _Side, ids: np.ndarray) -> None:
        """Copy the changed entries of ``s``'s table to its device copy (no wait for the device)."""
        if s.device is None or ids.size == 0:
            return
        index = torch.from_numpy(np.ascontiguousarray(ids))
        values = torch.from_numpy(s.v2p[ids])
        if s.device.device.type == "cuda":
            index, values = index.pin_memory().to(s.device.device, non_blocking=True), values.pin_memory().to(
                s.device.device, non_blocking=True
            )
        s.device[index] = values

    # -- checks (tests, the conformance kit) -------------------------------------------------------------

    def check(self) -> None:
        """Raise AssertionError unless the tables agree: each side's live ids fill physical ``0 .. used - 1``
        once each, the two ends do not overlap, and the device tables equal the host's (reading the device)."""
        for s in self._sides.values():
            live = np.nonzero(s.v2p[1:] >= 0)[0] + 1
            assert live.size == s.used, f"{s.name}: {live.size} live ids but {s.used} units used"
            assert np.array_equal(np.sort(s.v2p[live]), np.arange(s.used)), f"{s.name}: physical units not dense"
            assert np.array_equal(s.p2v[s.v2p[live]], live), f"{s.name}: physical -> virtual disagrees"
            assert len(s.free_ids) == s.ids - s.used and not set(s.free_ids) & set(live.tolist())
            if s.device is not None:
                assert np.array_equal(s.device.cpu().numpy(), s.v2p), f"{s.name}: the device table is stale"
        assert self.free_bytes() >= 0, "the two ends overlap"
