"""One byte range shared by two kinds of fixed-size units that grow from its two ends (:class:`MultiEndedAllocator`).

The unified memory of a hybrid model: the *low* end holds, say, full-attention KV pages (every layer of one page in
one envelope of ``low_unit_bytes``) and grows up from byte 0; the *high* end holds per-request recurrent states
(or sliding-window pages) in envelopes of ``high_unit_bytes`` and grows down from the top.  Whatever one kind does
not use, the other can take: no ratio is fixed at start-up.

Engines hold *virtual* ids (``1 .. low_ids`` and ``1 .. high_ids``; 0 is padding on both sides), which never
change while allocated.  A side's units lie at its end, below its *top*; a free leaves holes there.  *Compaction*
moves the side's topmost live units into its holes (one batched move of whole envelopes, through the ``mover`` the
pool supplies) and rewrites their virtual -> physical entries, so an id an engine holds stays valid across the
move.  Eager (``lazy=False``): every free compacts its side at once, so the free bytes between the two ends are
always one range.  Lazy (the default): a free moves nothing; an allocation fills its side's holes first, then takes
bytes from the range between the tops, and compacts the *other* side only when that range is too small, so bytes
move only when one kind needs what the other freed.  :meth:`MultiEndedAllocator.flush` compacts both sides at a
time the engine chooses; :meth:`MultiEndedAllocator.hold_moves` keeps every envelope where it is (a transfer
reading them) until released.  Physical unit ``p`` of the low side starts at byte ``p * low_unit_bytes``; physical
unit ``p`` of the high side at byte ``capacity - (p + 1) * high_unit_bytes``.

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
    """One end's tables: virtual -> physical (``-1``: not allocated), physical -> virtual (0 at a hole), its free
    virtual ids, its top (physical units ``0 .. top - 1`` hold its live units and its holes) and its holes."""

    __slots__ = ("name", "unit", "ids", "v2p", "p2v", "top", "holes", "free_ids", "device")

    def __init__(self, name: str, unit: int, ids: int, physical: int):
        self.name, self.unit, self.ids = name, unit, ids
        self.v2p = np.full(ids + 1, -1, dtype=np.int64)
        self.v2p[0] = 0  # the padding id maps to the padding unit
        self.p2v = np.zeros(max(physical, 1), dtype=np.int64)
        self.top = 0
        self.holes: list[int] = []  # physical units below top not allocated
        #: the free virtual ids as a stack: the next allocation takes from the end (id 1 first, then the most
        #: recently freed), so neither taking nor giving back shifts the list
        self.free_ids: list[int] = list(range(ids, 0, -1))
        self.device: torch.Tensor | None = None

    @property
    def used(self) -> int:
        return self.top - len(self.holes)


class MultiEndedAllocator:
    """Two stacks of fixed-size units in one byte range (see the module docstring).

    :param capacity_bytes: the bytes both ends share (the pool's arena, padding units excluded).
    :param low_unit_bytes: bytes of one low-end unit (an envelope: every layer of one KV page, say).
    :param high_unit_bytes: bytes of one high-end unit (every linear layer's state of one request slot, say).
    :param low_ids: virtual ids of the low end (``1 .. low_ids``); default: as many units as the whole range holds.
    :param high_ids: likewise for the high end.
    :param mover: copies envelopes when a side compacts (:data:`Moves`); None when nothing is stored (a planner's
        simulation, tests of the bookkeeping).
    :param device: where :meth:`device_table` keeps the virtual -> physical tables (None: not kept).
    :param lazy: compact only when an allocation needs the bytes (True, the default), or at every free (False);
        see the module docstring.
    """

    def __init__(self, capacity_bytes: int, low_unit_bytes: int, high_unit_bytes: int, *, low_ids: int | None = None,
                 high_ids: int | None = None, mover: Moves | None = None,
                 device: torch.device | str | None = None, lazy: bool = True):  # fmt: skip
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
        self.lazy = bool(lazy)
        self.device = None if device is None else torch.device(device)
        self.moved_units = 0  # envelopes moved by compaction so far (for reports)
        self._held = 0  # hold_moves() not yet released
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

    def holes(self, side: str) -> int:
        """Units of ``side`` freed below its top and not yet compacted away (0 after a compaction)."""
        return len(self._sides[side].holes)

    def free_bytes(self) -> int:
        """Bytes no live unit holds: what the two sides can still take between them (after compaction, when moves
        are not held)."""
        low, high = self._sides[LOW], self._sides[HIGH]
        return self.capacity - low.used * low.unit - high.used * high.unit

    def available(self, side: str) -> int:
        """Units ``side`` can still take (its holes, then the range between its top and the other side's live units,
        or its top while moves are held; and its free virtual ids, permitting)."""
        s, other = self._sides[side], self._other(side)
        other_end = other.top if self._held else other.used
        return min(len(s.holes) + (self.capacity - s.top * s.unit - other_end * other.unit) // s.unit,
                   len(s.free_ids))  # fmt: skip

    def free_ids(self, side: str) -> list[int]:
        """``side``'s virtual ids not allocated, in the order :meth:`alloc` takes them."""
        return self._sides[side].free_ids[::-1]

    def physical(self, side: str, ids: Sequence[int] | np.ndarray) -> np.ndarray:
        """The physical units of virtual ``ids`` of ``side`` (``-1`` for an id not allocated)."""
        return self._sides[side].v2p[np.asarray(ids, dtype=np.int64)]

    def virtual(self, side: str) -> np.ndarray:
        """The virtual ids of ``side``'s units by physical position, up to its top (``[top]``; 0 at a hole)."""
        s = self._sides[side]
        return s.p2v[: s.top].copy()

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
        bytes or the side's virtual ids do not suffice.  Takes the side's holes first (lowest first), then units
        above its top, compacting the other side first when the range between the tops is too small."""
        s = self._sides[side]
        if count < 0:
            raise ValueError(f"alloc of {count} units")
        if count > self.available(side):
            return None
        from_top = count - min(count, len(s.holes))
        other = self._other(side)
        if from_top * s.unit > self.capacity - s.top * s.unit - other.top * other.unit:
            self._compact(other)
        ids = np.asarray(s.free_ids[len(s.free_ids) - count:][::-1], dtype=np.int64)
        del s.free_ids[len(s.free_ids) - count:]
        s.holes.sort()
        refill = s.holes[: count - from_top]
        del s.holes[: count - from_top]
        physical = np.concatenate([np.asarray(refill, dtype=np.int64),
                                   np.arange(s.top, s.top + from_top, dtype=np.int64)])  # fmt: skip
        s.v2p[ids] = physical
        s.p2v[physical] = ids
        s.top += from_top
        self._publish(s, ids)
        return ids

    def free(self, side: str, ids: Sequence[int] | np.ndarray) -> None:
        """Give back virtual ``ids`` of ``side`` (ids not allocated, the padding id and repeats are ignored).  Their
        units become holes (the topmost ones lower the top); eager, the side then compacts at once."""
        s = self._sides[side]
        ids = np.unique(np.asarray(ids, dtype=np.int64).reshape(-1))
        ids = ids[(ids > 0) & (ids <= s.ids)]
        ids = ids[s.v2p[ids] >= 0]
        if ids.size == 0:
            return
        units = s.v2p[ids]
        s.v2p[ids] = -1
        s.p2v[units] = 0
        s.free_ids.extend(ids[::-1].tolist())
        s.holes.extend(units.tolist())
        self._lower_top(s)
        self._publish(s, ids)
        if not self.lazy:
            self._compact(s)

    def flush(self) -> int:
        """Compact both sides now (nothing while moves are held): their live units dense at their ends, the free
        bytes one range.  Returns the units moved."""
        before = self.moved_units
        for s in self._sides.values():
            self._compact(s)
        return self.moved_units - before

    def hold_moves(self) -> None:
        """Keep every envelope where it is until :meth:`release_moves` (calls nest): allocations then take holes and
        the range between the tops only, and no compaction runs (a transfer is reading or writing envelopes by
        their physical places)."""
        self._held += 1

    def release_moves(self) -> None:
        """End one :meth:`hold_moves`."""
        if self._held == 0:
            raise RuntimeError("release_moves without hold_moves")
        self._held -= 1

    @property
    def moves_held(self) -> bool:
        return self._held > 0

    def clear(self) -> None:
        """Everything free (no envelope moves)."""
        for s in self._sides.values():
            s.v2p[1:] = -1
            s.p2v[:] = 0
            s.top = 0
            s.holes = []
            s.free_ids = list(range(s.ids, 0, -1))
            if s.device is not None:
                s.device.copy_(torch.from_numpy(s.v2p))

    # -- compaction -----------------------------------------------------------------------------------------

    def _other(self, side: str) -> _Side:
        return self._sides[HIGH if side == LOW else LOW]

    @staticmethod
    def _lower_top(s: _Side) -> None:
        """Holes at the top are no units: lower the top past them."""
        if not s.holes or max(s.holes) < s.top - 1:
            return
        holes = set(s.holes)
        while s.top and s.top - 1 in holes:
            s.top -= 1
            holes.discard(s.top)
        s.holes = sorted(holes)

    def _compact(self, s: _Side) -> None:
        """Move ``s``'s topmost live units into its holes (one :data:`Moves` call); nothing while moves are held."""
        if not s.holes or self._held:
            return
        used = s.used
        holes = np.asarray(s.holes, dtype=np.int64)
        fill = np.sort(holes[holes < used])  # the holes below the new top, filled by the live units above it
        tail = np.setdiff1d(np.arange(used, s.top, dtype=np.int64), holes, assume_unique=True)
        if fill.size:
            if self.mover is not None:
                self.mover(s.name, tail, fill)
            movers = s.p2v[tail]
            s.v2p[movers] = fill
            s.p2v[fill] = movers
            s.p2v[tail] = 0
            self.moved_units += int(fill.size)
            self._publish(s, movers)
        s.top, s.holes = used, []

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
        """Raise AssertionError unless the tables agree: each side's live ids and holes fill physical ``0 .. top -
        1`` once each (its top not on a hole), the two tops do not overlap, and the device tables equal the host's
        (reading the device)."""
        for s in self._sides.values():
            live = np.nonzero(s.v2p[1:] >= 0)[0] + 1
            assert live.size == s.used, f"{s.name}: {live.size} live ids but {s.used} units used"
            units = np.sort(np.concatenate([s.v2p[live], np.asarray(s.holes, dtype=np.int64)]))
            assert np.array_equal(units, np.arange(s.top)), f"{s.name}: live units and holes do not fill its top"
            assert not s.holes or max(s.holes) < s.top - 1, f"{s.name}: its top is a hole"
            assert np.array_equal(s.p2v[s.v2p[live]], live), f"{s.name}: physical -> virtual disagrees"
            assert not s.p2v[np.asarray(s.holes, dtype=np.int64)].any(), f"{s.name}: a hole names a virtual id"
            assert len(s.free_ids) == s.ids - s.used and not set(s.free_ids) & set(live.tolist())
            if s.device is not None:
                assert np.array_equal(s.device.cpu().numpy(), s.v2p), f"{s.name}: the device table is stale"
        low, high = self._sides[LOW], self._sides[HIGH]
        assert low.top * low.unit + high.top * high.unit <= self.capacity, "the two ends overlap"
