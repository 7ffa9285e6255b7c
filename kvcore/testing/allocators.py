"""Allocator conformance: any allocator (token, paged, sliding-window, or a vendor's ``kvcore_choose_allocator``
result) driven through random request lifetimes against a small model of what it must hold.

A test file is a subclass plus one fixture::

    from kvcore.testing import AllocatorConformance

    class TestAcmeAllocator(AllocatorConformance):
        @pytest.fixture
        def allocator_factory(self):
            return lambda: make_my_allocator()   # a fresh allocator per run

The machine (a hypothesis ``RuleBasedStateMachine``) calls only the public API: ``alloc`` (whole pages),
``alloc_extend`` and ``alloc_decode`` (SGLang's positional order, with and without the CPU copies), ``free`` of a
live request's locations in any order, ``free_group_begin`` / ``free_group_end``, ``backup_state`` /
``restore_state`` and ``clear``.  After every step it checks that no location is handed out twice (nor a page
shared between requests), that the padding page is never handed out, that each request's tokens sit at their
offsets within its pages, that ``available_size()`` is exactly the capacity less the live (and pending) pages,
that an allocation that does not fit returns None and changes nothing, and that nothing leaks.

The run takes a few hundred sequences (``max(200, the active profile's max_examples)``); ``pytest
--hypothesis-profile=long`` (registered here: 10,000 examples) runs a long one.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule, run_state_machine_as_test

__all__ = ["AllocatorConformance", "AllocatorMachine", "BackendAllocatorConformance"]

settings.register_profile("long", max_examples=10_000, stateful_step_count=50, deadline=None,
                          suppress_health_check=list(HealthCheck))  # fmt: skip


class AllocatorMachine(RuleBasedStateMachine):
    """Random lifetimes of an allocator from ``factory()`` (set on a subclass), checked against a model: each
    live request is the list of its locations; requests never share a page."""

    factory: Callable[[], Any] = None  # type: ignore[assignment]

    @initialize()
    def setup(self):
        self.a = type(self).factory()
        self.ps = int(self.a.page_size)
        self.device = getattr(self.a, "device", "cpu")
        self.capacity = self.a.available_size()
        assert self.capacity > 0 and self.capacity % self.ps == 0, f"a fresh allocator offers {self.capacity} tokens"
        self.reqs: dict[int, list[int]] = {}
        self.pending: set[int] = set()  # pages freed inside an open free group
        self.in_group = False
        self.next_id = 0
        self.checkpoint = None

    # -- model --------------------------------------------------------------------------------------------

    def _used_pages(self) -> set[int]:
        return {loc // self.ps for locs in self.reqs.values() for loc in locs} | self.pending

    def _free_pages(self) -> int:
        return self.capacity // self.ps - len(self._used_pages())

    def _t(self, values) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64, device=self.device)

    def _unchanged(self, before: int, out, what: str) -> None:
        assert out is None, f"{what} should not fit ({self._free_pages()} free pages) but returned {out}"
        assert self.a.available_size() == before, f"a refused {what} changed available_size"

    # -- rules --------------------------------------------------------------------------------------------

    @rule(data=st.data())
    def extend(self, data):
        ids = data.draw(st.lists(st.sampled_from(sorted(self.reqs)), unique=True, max_size=3)) if self.reqs else []
        n_new = data.draw(st.integers(0 if ids else 1, 2))
        ids = ids + list(range(self.next_id, self.next_id + n_new))
        adds = [data.draw(st.integers(0, 2 * self.ps + 1)) for _ in ids]
        pre = [len(self.reqs.get(i, [])) for i in ids]
        seq = [p + k for p, k in zip(pre, adds)]
        last = [self.reqs[i][-1] if self.reqs.get(i) else -1 for i in ids]
        pre_t, seq_t, last_t = self._t(pre), self._t(seq), self._t(last)
        cpu = data.draw(st.booleans())
        before = self.a.available_size()
        out = self.a.alloc_extend(pre_t, pre_t.cpu() if cpu else None, seq_t, seq_t.cpu() if cpu else None, last_t,
                                  sum(adds))  # fmt: skip
        needed = sum(-(-s // self.ps) - -(-p // self.ps) for p, s in zip(pre, seq))
        if needed > self._free_pages():
            self._unchanged(before, out, f"alloc_extend of {needed} new pages")
            return
        assert out is not None and out.numel() == sum(adds), f"alloc_extend returned {out} for {sum(adds)} tokens"
        self.next_id += n_new
        pos = 0
        for i, k in zip(ids, adds):
            self.reqs.setdefault(i, []).extend(out[pos : pos + k].tolist())
            pos += k

    @precondition(lambda self: self.reqs)
    @rule(data=st.data())
    def decode(self, data):
        ids = data.draw(st.lists(st.sampled_from(sorted(self.reqs)), unique=True, min_size=1, max_size=4))
        ids = [i for i in ids if self.reqs[i]] or ids[:0]
        if not ids:
            return
        seq_t, last_t = self._t([len(self.reqs[i]) + 1 for i in ids]), self._t([self.reqs[i][-1] for i in ids])
        before = self.a.available_size()
        out = self.a.alloc_decode(seq_t, seq_t.cpu() if data.draw(st.booleans()) else None, last_t)
        needed = sum(len(self.reqs[i]) % self.ps == 0 for i in ids)
        if needed > self._free_pages():
            self._unchanged(before, out, f"alloc_decode of {needed} new pages")
            return
        assert out is not None and out.numel() == len(ids)
        for i, loc in zip(ids, out.tolist()):
            self.reqs[i].append(loc)

    @rule(pages=st.integers(0, 4))
    def alloc_pages(self, pages):
        before = self.a.available_size()
        out = self.a.alloc(pages * self.ps)
        if pages > self._free_pages():
            self._unchanged(before, out, f"alloc of {pages} pages")
            return
        assert out is not None and out.numel() == pages * self.ps
        self.reqs[self.next_id] = out.tolist()
        self.next_id += 1

    @precondition(lambda self: self.reqs)
    @rule(data=st.data())
    def free_request(self, data):
        i = data.draw(st.sampled_from(sorted(self.reqs)))
        locs = self.reqs.pop(i)
        order = data.draw(st.permutations(range(len(locs))))
        self.a.free(self._t([locs[j] for j in order]))
        if self.in_group:
            self.pending |= {loc // self.ps for loc in locs}

    @precondition(lambda self: not self.in_group)
    @rule()
    def group_begin(self):
        self.a.free_group_begin()
        self.in_group = True

    @precondition(lambda self: self.in_group)
    @rule()
    def group_end(self):
        self.a.free_group_end()
        self.in_group, self.pending = False, set()

    @precondition(lambda self: not self.in_group)
    @rule()
    def backup(self):
        self.checkpoint = (self.a.backup_state(), {k: list(v) for k, v in self.reqs.items()})

    @precondition(lambda self: self.checkpoint is not None and not self.in_group)
    @rule()
    def restore(self):
        state, reqs = self.checkpoint
        self.a.restore_state(state)
        self.reqs = {k: list(v) for k, v in reqs.items()}

    @precondition(lambda self: not self.in_group)
    @rule()
    def clear(self):
        self.a.clear()
        self.reqs, self.checkpoint = {}, None

    # -- invariants ---------------------------------------------------------------------------------------

    @invariant()
    def holds_what_the_model_holds(self):
        """No location twice, pages respected, then ``available_size`` exact (in this order, so a location
        handed out twice is reported as such)."""
        if not hasattr(self, "a"):
            return
        owner: dict[int, int] = {}
        for rid, locs in self.reqs.items():
            assert len(locs) == len(set(locs)), f"request {rid} holds a location twice: {locs}"
            for t, loc in enumerate(locs):
                page = loc // self.ps
                assert page >= 1, f"the padding page was handed out (location {loc})"
                assert loc % self.ps == t % self.ps, f"token {t} of request {rid} sits at offset {loc % self.ps}"
                if t % self.ps:
                    assert page == locs[t - 1] // self.ps, f"request {rid} left its page mid-page at token {t}"
                assert owner.setdefault(page, rid) == rid, f"page {page} handed to requests {owner[page]} and {rid}"
        expected = self.capacity - self.ps * len(self._used_pages())
        got = self.a.available_size()
        assert got == expected, f"available_size() is {got}, the live and pending pages leave {expected}"


class AllocatorConformance:
    """Run :class:`AllocatorMachine` on the allocators ``allocator_factory`` makes (a fixture returning a
    zero-argument callable that builds a fresh allocator)."""

    @pytest.fixture
    def allocator_factory(self):
        pytest.fail("provide an allocator_factory fixture: a zero-argument callable returning a fresh allocator")

    def test_random_request_lifetimes(self, allocator_factory):
        machine = type("Machine", (AllocatorMachine,), {"factory": staticmethod(allocator_factory)})
        active = settings()
        run_state_machine_as_test(machine, settings=settings(
            max_examples=max(200, active.max_examples), stateful_step_count=max(25, active.stateful_step_count),
            deadline=None, suppress_health_check=list(HealthCheck),
        ))  # fmt: skip


class BackendAllocatorConformance(AllocatorConformance):
    """:class:`AllocatorConformance` on the allocator a backend gets from ``kvcore_choose_allocator`` (a vendor's
    hook or the core's default), for a small pool of that backend built through the same hooks as
    :func:`kvcore.build_pools`.  Uses the kit's backend fixtures (``backend``, ``config`` and ``variants`` class
    attributes, as :class:`~kvcore.testing.KVCacheConformance`); the pool holds ``kv_allocator_pool_size``
    tokens in ``tokens`` and in every size group of its layout."""

    @pytest.fixture
    def kv_allocator_pool_size(self, kv_page_size):
        return 13 if kv_page_size == 1 else 9 * kv_page_size

    @pytest.fixture
    def allocator_factory(self, kv_request, kv_backend_spec, kv_registry, kv_allocator_pool_size):
        from kvcore.api import buffer_layout

        hook = kv_registry.hook
        layout = buffer_layout(kv_backend_spec, kv_registry, kv_request)
        sizes = {"tokens": kv_allocator_pool_size, **{group: kv_allocator_pool_size for group in layout.groups}}
        pool = hook.kvcore_create_pool(backend=kv_backend_spec, request=kv_request, layout=layout, sizes=sizes)

        def make():
            allocator = hook.kvcore_choose_allocator(backend=kv_backend_spec, request=kv_request, pool=pool, sizes=sizes)
            assert allocator is not None, f"no kvcore_choose_allocator hook built an allocator for {kv_backend_spec.name!r}"
            return allocator

        return make
