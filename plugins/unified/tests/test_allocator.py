"""MultiEndedAllocator: the two ends share the bytes, virtual ids stay valid across compaction (eager, at every
free; lazy, when the other side needs the bytes), nothing moves while moves are held, and what a unit holds moves
with it byte for byte (a byte arena stands in for the pool, its mover copies envelopes)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvcore_unified.allocator import HIGH, LOW, MultiEndedAllocator


class Arena:
    """A byte range and the mover a pool would give the allocator: envelopes copied in one batch."""

    def __init__(self, capacity: int):
        self.bytes = np.zeros(capacity, dtype=np.uint8)
        self.allocator: MultiEndedAllocator | None = None
        self.calls: list[tuple[str, int]] = []

    def move(self, side: str, src: np.ndarray, dst: np.ndarray) -> None:
        a = self.allocator
        unit = a.unit_bytes(side)
        assert not set(src.tolist()) & set(dst.tolist()), "a batch move must not overlap"
        blocks = [self.bytes[o : o + unit].copy() for o in a.byte_offset(side, src)]
        for o, block in zip(a.byte_offset(side, dst), blocks):
            self.bytes[o : o + unit] = block
        self.calls.append((side, len(src)))

    def write(self, side: str, ids: np.ndarray, tag: int) -> None:
        a = self.allocator
        unit = a.unit_bytes(side)
        for i, o in zip(ids, a.byte_offset(side, a.physical(side, ids))):
            self.bytes[o : o + unit] = pattern(side, int(i), tag, unit)

    def read(self, side: str, i: int) -> np.ndarray:
        a = self.allocator
        unit = a.unit_bytes(side)
        o = int(a.byte_offset(side, a.physical(side, [i]))[0])
        return self.bytes[o : o + unit]


def pattern(side: str, i: int, tag: int, unit: int) -> np.ndarray:
    return ((np.arange(unit) * 7 + i * 13 + tag * 31 + (side == HIGH) * 101) % 251).astype(np.uint8)


def make(capacity=1000, low=40, high=90, **kw):
    arena = Arena(capacity)
    arena.allocator = MultiEndedAllocator(capacity, low, high, mover=arena.move, **kw)
    return arena, arena.allocator


def test_the_two_ends_share_the_bytes():
    _, a = make()
    assert (a.available(LOW), a.available(HIGH)) == (25, 11)
    low = a.alloc(LOW, 20)  # 800 bytes from the bottom
    assert a.available(HIGH) == 2 and a.alloc(HIGH, 3) is None and a.used(HIGH) == 0
    high = a.alloc(HIGH, 2)  # 180 from the top
    assert a.free_bytes() == 20 and a.available(LOW) == 0
    a.free(LOW, low[:5])  # 200 bytes back, usable by the other end
    assert a.available(HIGH) == 2 and a.alloc(HIGH, 2) is not None
    assert list(a.byte_offset(HIGH, np.array([0, 1]))) == [910, 820]
    a.check()
    assert high.tolist() == [1, 2]


def test_an_eager_free_compacts_its_side_and_ids_stay_valid():
    arena, a = make(lazy=False)
    ids = a.alloc(LOW, 6)
    arena.write(LOW, ids, tag=1)
    a.free(LOW, [ids[1], ids[3]])  # holes at 1 and 3; units 4 and 5 move down into them
    assert arena.calls == [(LOW, 2)] and a.used(LOW) == 4 and a.moved_units == 2
    assert sorted(a.physical(LOW, [ids[0], ids[2], ids[4], ids[5]]).tolist()) == [0, 1, 2, 3]
    for i in (ids[0], ids[2], ids[4], ids[5]):
        assert np.array_equal(arena.read(LOW, int(i)), pattern(LOW, int(i), 1, 40))
    a.free(LOW, [ids[5]] * 3 + [0, 99, ids[1]])  # repeats, padding, unknown and already freed ids are ignored
    assert a.used(LOW) == 3
    a.check()


def test_freeing_the_top_moves_nothing():
    for lazy in (False, True):
        arena, a = make(lazy=lazy)
        ids = a.alloc(HIGH, 4)
        a.free(HIGH, ids[2:])
        assert arena.calls == [] and a.used(HIGH) == 2 and a.holes(HIGH) == 0


def test_a_lazy_free_leaves_holes_that_move_only_when_the_other_side_needs_the_bytes():
    """Capacity 1000, low units of 40, high of 90."""
    arena, a = make()
    low = a.alloc(LOW, 20)  # 800 bytes
    arena.write(LOW, low, tag=1)
    a.free(LOW, low[[2, 5, 7]])  # three holes; nothing moves
    assert arena.calls == [] and a.used(LOW) == 17 and a.holes(LOW) == 3
    refill = a.alloc(LOW, 2)  # the side's holes first, lowest first: still nothing moves
    assert arena.calls == [] and sorted(a.physical(LOW, refill).tolist()) == [2, 5] and a.holes(LOW) == 1
    arena.write(LOW, refill, tag=2)
    # the high side needs 180 bytes: 200 lie between the tops, nothing moves
    assert a.available(HIGH) == 2 and a.alloc(HIGH, 1) is not None and arena.calls == []
    a.free(LOW, low[[0, 1]])  # two more holes: 3 in all, 120 bytes the high side can have after compaction
    assert a.available(HIGH) == 2 and arena.calls == []
    a.hold_moves()  # a transfer reads envelopes by their places: the holes cannot be compacted away
    assert a.available(HIGH) == 1 and a.alloc(HIGH, 2) is None and arena.calls == [] and a.flush() == 0
    a.release_moves()
    assert a.alloc(HIGH, 2) is not None  # now the low side compacts: its top live units move into its holes
    assert arena.calls == [(LOW, 3)] and a.holes(LOW) == 0 and a.moved_units == 3
    for i in [*low[[3, 4, 6]], *low[8:]]:
        assert np.array_equal(arena.read(LOW, int(i)), pattern(LOW, int(i), 1, 40)), f"low id {i} lost"
    for i in refill:
        assert np.array_equal(arena.read(LOW, int(i)), pattern(LOW, int(i), 2, 40))
    a.check()
    with pytest.raises(RuntimeError, match="hold_moves"):
        a.release_moves()


def test_flush_compacts_both_sides():
    arena, a = make()
    low, high = a.alloc(LOW, 6), a.alloc(HIGH, 4)
    a.free(LOW, low[:2])
    a.free(HIGH, high[1:2])
    assert a.flush() == 3 and sorted(arena.calls) == [(HIGH, 1), (LOW, 2)]
    assert a.holes(LOW) == a.holes(HIGH) == 0 and a.free_bytes() == 1000 - 4 * 40 - 3 * 90
    a.check()


def test_device_tables_follow_the_host():
    _, a = make(device="cpu")
    ids = a.alloc(LOW, 5)
    a.free(LOW, ids[:2])
    table = a.device_table(LOW)
    assert table[ids[2:]].tolist() == a.physical(LOW, ids[2:]).tolist() and table[ids[0]].item() == -1
    a.check()
    with pytest.raises(RuntimeError, match="device="):
        make()[1].device_table(LOW)


class TwoEnds(RuleBasedStateMachine):
    """Interleaved allocations and frees of both ends (lazy), flushes, and moves held and released; after every step
    the tables agree, the ends do not overlap, nothing moved while moves were held, and every live unit still holds
    what was written into it."""

    lazy = True

    def __init__(self):
        super().__init__()
        self.arena, self.a = make(capacity=2000, low=48, high=112, device="cpu", lazy=self.lazy)
        self.live: dict[str, dict[int, int]] = {LOW: {}, HIGH: {}}
        self.tag = 0

    @rule(side=st.sampled_from([LOW, HIGH]), count=st.integers(0, 12))
    def alloc(self, side, count):
        fits = count <= self.a.available(side)
        calls = len(self.arena.calls)
        ids = self.a.alloc(side, count)
        assert (ids is not None) == fits
        assert not self.a.moves_held or len(self.arena.calls) == calls, "an envelope moved while moves were held"
        if ids is not None:
            self.tag += 1
            self.arena.write(side, ids, self.tag)
            self.live[side].update((int(i), self.tag) for i in ids)

    @precondition(lambda self: self.live[LOW] or self.live[HIGH])
    @rule(side=st.sampled_from([LOW, HIGH]), data=st.data())
    def free(self, side, data):
        live = sorted(self.live[side])
        chosen = data.draw(st.lists(st.sampled_from(live), max_size=len(live))) if live else []
        self.a.free(side, chosen + [0])
        for i in chosen:
            self.live[side].pop(i, None)

    @rule()
    def flush(self):
        moved = self.a.flush()
        assert moved == 0 or not self.a.moves_held
        if not self.a.moves_held:
            assert self.a.holes(LOW) == self.a.holes(HIGH) == 0

    @precondition(lambda self: self.lazy)
    @rule(hold=st.booleans())
    def hold_or_release(self, hold):
        if hold:
            self.a.hold_moves()
        elif self.a.moves_held:
            self.a.release_moves()

    @invariant()
    def consistent(self):
        self.a.check()
        for side, live in self.live.items():
            assert self.a.used(side) == len(live)
            unit = self.a.unit_bytes(side)
            for i, tag in live.items():
                assert np.array_equal(self.arena.read(side, i), pattern(side, i, tag, unit)), f"{side} id {i} lost"


class EagerTwoEnds(TwoEnds):
    """The same with eager compaction (no holes outlive a free)."""

    lazy = False

    @invariant()
    def no_holes(self):
        assert self.a.holes(LOW) == self.a.holes(HIGH) == 0


TestTwoEnds = TwoEnds.TestCase
TestTwoEnds.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
TestEagerTwoEnds = EagerTwoEnds.TestCase
TestEagerTwoEnds.settings = settings(max_examples=30, stateful_step_count=40, deadline=None)
