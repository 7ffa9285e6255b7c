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
``restore_state`` (unless the allocator says ``supports_backup = False``) and ``clear``.  After every step it checks that no location is handed out twice (nor a page
shared between requests), that the padding page is never handed out, that each request's tokens sit at their
offsets within its pages, that ``available_size()`` is exactly the capacity less the live (and pending) pages,
that an allocation that does not fit returns None and changes nothing, and that nothing leaks.

An allocator with a sliding-window side (it has ``free_swa``, as SGLang's ``SWATokenToKVPoolAllocator``) is
found by that capability, whatever its class: the machine then also gives back the window slots of a prefix of
a request's tokens (``free_swa``, whole pages) and checks the window side after every step through the full ->
window map (``translate_loc_from_full_to_swa``, or ``full_to_swa_index_mapping``): no window slot mapped by two
live tokens, no window page shared between requests, tokens that left the window map to the padding slot, the
others keep their offsets, and ``swa_available_size()`` is exactly the window capacity less the window pages
live tokens map into (and those pending in a free group).

The run takes a few hundred sequences (``AllocatorConformance.examples``, 200, or more when the active profile
asks for more than Hypothesis's default); ``pytest --hypothesis-profile=long`` (registered here: 10,000
examples) runs a long one.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule, run_state_machine_as_test

from kvcore.testing.tensors import addresses_kept

__all__ = ["KIT_REQUESTS", "REQUEST_GROUPS", "AllocatorConformance", "AllocatorMachine", "BackendAllocatorConformance"]

settings.register_profile("long", max_examples=10_000, stateful_step_count=50, deadline=None,
                          suppress_health_check=list(HealthCheck))  # fmt: skip


#: size groups counted in requests, and how many the kit's pools hold: per-request state can be large (DeepSeek-V4's
#: ratio-128 rings are half a MiB a request and layer), and the checks address tokens, not requests
REQUEST_GROUPS = frozenset({"requests", "running_requests"})
KIT_REQUESTS = 5

#: What an allocator with a sliding-window side must also offer, for the window checks to see that side.
WINDOW_SIDE_API = ("free_swa", "swa_available_size", "full_available_size")


class AllocatorMachine(RuleBasedStateMachine):
    """Random lifetimes of an allocator from ``factory()`` (set on a subclass), checked against a model: each
    live request is the list of its locations; requests never share a page.

    An allocator with ``free_swa`` has a sliding-window side: every location it hands out (a *full* location)
    comes with a window slot, read through ``translate_loc_from_full_to_swa`` (or ``full_to_swa_index_mapping``).
    The model then also keeps, per request, how many of its first tokens left the window (``slid``): those map
    to the padding slot, every other live token to a window slot of its own.

    A subclass that knows more of its allocator checks more through these hooks, keeping every rule and check:

    - an ``@initialize`` rule named ``setup`` replaces this one (to draw the allocator's parameters); it calls
      :meth:`start` with the allocator;
    - :meth:`refusal_state`: what an allocation that does not fit must leave unchanged;
    - :meth:`check_result`: a check of every allocation's result;
    - ``call_by_keyword``: also call ``alloc_extend`` / ``alloc_decode`` with SGLang's keyword names, leaving the
      CPU copies out when not passing them;
    - ``decode_empty_requests``: a decode step may also give a request that holds no token yet its first one;
    - more ``@invariant`` methods, reading the model (``reqs``, ``pending``, ``in_group``, ``capacity``)."""

    factory: Callable[[], Any] = None  # type: ignore[assignment]
    #: call alloc_extend / alloc_decode by SGLang's keyword names too (drawn per call), not only by position
    call_by_keyword = False
    #: a decode step may pick requests that hold no token yet (``last_loc`` -1: their first token opens a page)
    decode_empty_requests = False

    @initialize()
    def setup(self):
        self.start(type(self).factory())

    def start(self, allocator) -> None:
        """Begin a run on a fresh ``allocator``: read its capacity (and its window side's), empty model.  An allocator
        whose availability this model does not describe says why in ``lifetime_model_mismatch`` (a string): the run
        is skipped with that reason (its family's own tests check it)."""
        mismatch = getattr(allocator, "lifetime_model_mismatch", None)
        if mismatch:
            pytest.skip(f"{type(allocator).__name__}: {mismatch}")
        self.a = allocator
        self.ps = int(self.a.page_size)
        self.device = getattr(self.a, "device", "cpu")
        self.windowed = callable(getattr(self.a, "free_swa", None))
        if self.windowed:
            self._require_window_side_api()
            self.capacity = self.a.full_available_size()
            self.window_capacity = self.a.swa_available_size()
            assert self.window_capacity > 0 and self.window_capacity % self.ps == 0, (
                f"a fresh allocator offers {self.window_capacity} window slots; give its window side whole pages"
            )  # fmt: skip
        else:
            self.capacity = self.a.available_size()
        assert self.capacity > 0 and self.capacity % self.ps == 0, f"a fresh allocator offers {self.capacity} tokens"
        #: whether ``backup_state`` / ``restore_state`` are driven (an allocator says ``supports_backup = False``
        #: when it keeps no snapshots: a unified memory's, whose frees move data)
        self.snapshots = bool(getattr(self.a, "supports_backup", True))
        self.reqs: dict[int, list[int]] = {}
        self.slid: dict[int, int] = {}  # request -> its first tokens whose window slots were given back
        self.pending: set[int] = set()  # pages freed inside an open free group
        self.pending_window: set[int] = set()  # window pages freed inside an open free group
        self.in_group = False
        self.next_id = 0
        self.checkpoint = None

    def _require_window_side_api(self) -> None:
        missing = [name for name in WINDOW_SIDE_API if not callable(getattr(self.a, name, None))]
        if not (callable(getattr(self.a, "translate_loc_from_full_to_swa", None))
                or isinstance(getattr(self.a, "full_to_swa_index_mapping", None), torch.Tensor)):  # fmt: skip
            missing.append("translate_loc_from_full_to_swa (or a full_to_swa_index_mapping tensor)")
        assert not missing, (
            f"{type(self.a).__name__} has free_swa, so it has a sliding-window side, but lacks {', '.join(missing)}; "
            "add them (as SGLang's SWATokenToKVPoolAllocator has) so the window side can be checked"
        )  # fmt: skip

    # -- model --------------------------------------------------------------------------------------------

    def _used_pages(self) -> set[int]:
        return {loc // self.ps for locs in self.reqs.values() for loc in locs} | self.pending

    def _window_pages_in_use(self) -> int:
        """Window pages the model says are taken: one per full page of a token still in the window (both sides
        move in step, page for page), plus those pending in a free group."""
        in_window = {loc // self.ps for rid, locs in self.reqs.items() for loc in locs[self.slid.get(rid, 0):]}
        return len(in_window) + len(self.pending_window)

    def token_capacity(self) -> int:
        """Tokens the allocator holds when no request does: ``capacity``, read at the start; a machine whose
        allocator shares its bytes with something else it drives (a unified memory's state slots) says what is
        left to the tokens now."""
        return self.capacity

    def window_token_capacity(self) -> int:
        """Window slots the allocator holds when no token maps into the window: ``window_capacity``, read at the
        start; a machine whose window side shares its bytes with the full side says what the full pages leave."""
        return self.window_capacity

    def free_pages(self) -> int:
        """Pages an allocation can still take: on every side at once (a machine whose sides share their bytes says
        what a page of both takes of them)."""
        free = self.token_capacity() // self.ps - len(self._used_pages())
        if self.windowed:
            free = min(free, self.window_token_capacity() // self.ps - self._window_pages_in_use())
        return free

    def _window_slots(self, locs: list[int]) -> list[int]:
        """The window slot each full location maps to (0, the padding slot, for none): the allocator's map when it
        keeps one as a tensor (its slots, virtual ones for a unified memory's), else its translation."""
        if not locs:
            return []
        index = self._t(locs)
        mapping = getattr(self.a, "full_to_swa_index_mapping", None)
        slots = mapping[index] if isinstance(mapping, torch.Tensor) else self.a.translate_loc_from_full_to_swa(index)
        return [int(w) for w in slots.tolist()]

    def _t(self, values) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64, device=self.device)

    def refusal_state(self) -> Any:
        """What an allocation that does not fit must leave unchanged (compared with ``==``): by default
        ``available_size()``; a subclass may read more of its allocator (its free lists)."""
        return self.a.available_size()

    def check_result(self, out: torch.Tensor, what: str) -> None:
        """A check of the locations an allocation returned (called after the count is checked); none by
        default."""

    def _unchanged(self, before: Any, out, what: str) -> None:
        assert out is None, f"{what} should not fit ({self.free_pages()} free pages) but returned {out}"
        assert self.refusal_state() == before, f"a refused {what} changed the allocator's state (refusal_state())"

    def _lens_call(self, data, method: str, positional: list, keywords: dict[str, Any]):
        """``method`` of the allocator, by position (SGLang's order, ``None`` for CPU copies not passed) or, for a
        machine with ``call_by_keyword``, drawn: by SGLang's keyword names, leaving out the ``None`` CPU copies."""
        if self.call_by_keyword and data.draw(st.booleans(), label=f"{method} by keyword"):
            first, *_ = positional
            return getattr(self.a, method)(first, **{k: v for k, v in keywords.items() if v is not None})
        return getattr(self.a, method)(*positional)

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
        pre_cpu, seq_cpu = (pre_t.cpu(), seq_t.cpu()) if cpu else (None, None)
        before = self.refusal_state()
        out = self._lens_call(data, "alloc_extend", [pre_t, pre_cpu, seq_t, seq_cpu, last_t, sum(adds)],
                              dict(prefix_lens_cpu=pre_cpu, seq_lens=seq_t, seq_lens_cpu=seq_cpu, last_loc=last_t,
                                   extend_num_tokens=sum(adds)))  # fmt: skip
        needed = sum(-(-s // self.ps) - -(-p // self.ps) for p, s in zip(pre, seq))
        if needed > self.free_pages():
            self._unchanged(before, out, f"alloc_extend of {needed} new pages")
            return
        assert out is not None and out.numel() == sum(adds), f"alloc_extend returned {out} for {sum(adds)} tokens"
        self.check_result(out, "alloc_extend")
        self.next_id += n_new
        pos = 0
        for i, k in zip(ids, adds):
            self.reqs.setdefault(i, []).extend(out[pos : pos + k].tolist())
            pos += k

    @precondition(lambda self: self.reqs)
    @rule(data=st.data())
    def decode(self, data):
        ids = data.draw(st.lists(st.sampled_from(sorted(self.reqs)), unique=True, min_size=1, max_size=4))
        if not self.decode_empty_requests:
            ids = [i for i in ids if self.reqs[i]]
        if not ids:
            return
        seq_t = self._t([len(self.reqs[i]) + 1 for i in ids])
        last_t = self._t([self.reqs[i][-1] if self.reqs[i] else -1 for i in ids])
        seq_cpu = seq_t.cpu() if data.draw(st.booleans()) else None
        before = self.refusal_state()
        out = self._lens_call(data, "alloc_decode", [seq_t, seq_cpu, last_t],
                              dict(seq_lens_cpu=seq_cpu, last_loc=last_t))  # fmt: skip
        needed = sum(len(self.reqs[i]) % self.ps == 0 for i in ids)
        if needed > self.free_pages():
            self._unchanged(before, out, f"alloc_decode of {needed} new pages")
            return
        assert out is not None and out.numel() == len(ids), f"alloc_decode returned {out} for {len(ids)} requests"
        self.check_result(out, "alloc_decode")
        for i, loc in zip(ids, out.tolist()):
            self.reqs[i].append(loc)

    @rule(pages=st.integers(0, 4))
    def alloc_pages(self, pages):
        before = self.refusal_state()
        out = self.a.alloc(pages * self.ps)
        if pages > self.free_pages():
            self._unchanged(before, out, f"alloc of {pages} pages")
            return
        assert out is not None and out.numel() == pages * self.ps, f"alloc returned {out} for {pages} pages"
        self.check_result(out, "alloc")
        self.reqs[self.next_id] = out.tolist()
        self.next_id += 1

    @precondition(lambda self: self.reqs)
    @rule(data=st.data())
    def free_request(self, data):
        i = data.draw(st.sampled_from(sorted(self.reqs)))
        locs = self.reqs.pop(i)
        slid = self.slid.pop(i, 0)
        if self.in_group and self.windowed:  # read before the free: the window pages its tokens hold till the end
            self.pending_window |= {w // self.ps for w in self._window_slots(locs[slid:]) if w}
        order = data.draw(st.permutations(range(len(locs))))
        self.a.free(self._t([locs[j] for j in order]))
        if self.in_group:
            self.pending |= {loc // self.ps for loc in locs}

    @precondition(lambda self: self.windowed and any(len(locs) > self.ps for locs in self.reqs.values()))
    @rule(data=st.data())
    def free_swa(self, data):
        """Tokens that slid out of the window: ``free_swa`` of the first ``k`` tokens of a live request, in a
        random order, possibly again over pages already given back.  The page of its last token stays (an
        engine's window always holds it, and the next extend continues it on both sides).  The window side
        gives back whole pages, so the model takes the first ``k`` tokens rounded up to a page as gone; the
        slots come back at once, also inside a free group (as SGLang's ``free_swa``)."""
        i = data.draw(st.sampled_from(sorted(rid for rid, locs in self.reqs.items() if len(locs) > self.ps)))
        locs = self.reqs[i]
        start_of_last_page = (len(locs) - 1) // self.ps * self.ps
        k = data.draw(st.integers(1, start_of_last_page))
        order = data.draw(st.permutations(range(k)))
        self.a.free_swa(self._t([locs[j] for j in order]))
        self.slid[i] = max(self.slid.get(i, 0), -(-k // self.ps) * self.ps)

    @precondition(lambda self: not self.in_group)
    @rule()
    def group_begin(self):
        self.a.free_group_begin()
        self.in_group = True

    @precondition(lambda self: self.in_group)
    @rule()
    def group_end(self):
        self.a.free_group_end()
        self.in_group, self.pending, self.pending_window = False, set(), set()

    @precondition(lambda self: self.snapshots and not self.in_group)
    @rule()
    def backup(self):
        self.checkpoint = (self.a.backup_state(), {k: list(v) for k, v in self.reqs.items()}, dict(self.slid))

    @precondition(lambda self: self.checkpoint is not None and not self.in_group)
    @rule()
    def restore(self):
        state, reqs, slid = self.checkpoint
        self.a.restore_state(state)
        self.reqs, self.slid = {k: list(v) for k, v in reqs.items()}, dict(slid)

    @precondition(lambda self: not self.in_group)
    @rule()
    def clear(self):
        self.a.clear()
        self.reqs, self.slid, self.checkpoint = {}, {}, None

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
        expected = self.token_capacity() - self.ps * len(self._used_pages())
        if self.windowed:
            got = self.a.full_available_size()
            assert got == expected, f"full_available_size() is {got}, the live and pending pages leave {expected}"
            expected = self.ps * self.free_pages()
            got = self.a.available_size()
            assert got == expected, f"available_size() is {got}, the smaller side has {expected} tokens free"
        else:
            got = self.a.available_size()
            assert got == expected, f"available_size() is {got}, the live and pending pages leave {expected}"

    @invariant()
    def window_side_holds_what_the_model_holds(self):
        """For an allocator with a sliding-window side, what the live tokens map to: no window slot twice, no
        window page shared between requests, the padding page never; ``swa_available_size()`` exactly the
        window capacity less the pages they map into (and the pending ones), so a page given back while a
        token still maps into it shows here; then the model: a token that left the window maps to the padding
        slot, one in it keeps its offset and its request's window page."""
        if not getattr(self, "windowed", False):
            return
        ps = self.ps
        live = [(rid, t, loc) for rid, locs in self.reqs.items() for t, loc in enumerate(locs)]
        slots = self._window_slots([loc for _, _, loc in live])
        holder: dict[int, tuple[int, int]] = {}  # window slot -> (request, token)
        owner: dict[int, int] = {}  # window page -> request
        for (rid, t, loc), w in zip(live, slots):
            if w == 0:
                continue
            assert w >= ps, f"token {t} of request {rid} (location {loc}) maps into the padding window page: slot {w}"
            first = holder.setdefault(w, (rid, t))
            assert first == (rid, t), (
                f"window slot {w} is mapped by token {first[1]} of request {first[0]} and token {t} of request {rid}"
            )  # fmt: skip
            assert owner.setdefault(w // ps, rid) == rid, (
                f"window page {w // ps} is mapped by requests {owner[w // ps]} and {rid} (pages are per request)"
            )  # fmt: skip
        mapped = set(owner) | self.pending_window
        expected = self.window_token_capacity() - ps * len(mapped)
        got = self.a.swa_available_size()
        assert got == expected, (
            f"swa_available_size() is {got}, but live tokens map into {len(owner)} window page(s) and "
            f"{len(self.pending_window)} more pending in the free group, which leaves {expected}: a window page "
            "was given back while tokens still map into it (free_swa must clear the map of every token of the pages "
            "it gives back), or one leaked"
        )  # fmt: skip
        for n, ((rid, t, loc), w) in enumerate(zip(live, slots)):
            slid = self.slid.get(rid, 0)
            if t < slid:
                assert w == 0, (
                    f"token {t} of request {rid} left the window (free_swa gave back the pages of its first {slid} "
                    f"tokens) but still maps to window slot {w}; free_swa must clear the map of every token of the "
                    "pages it gives back"
                )  # fmt: skip
                continue
            assert w != 0, f"token {t} of request {rid} is still in the window but maps to the padding slot"
            assert w % ps == t % ps, f"token {t} of request {rid} sits at offset {w % ps} of its window page"
            if t % ps and t - 1 >= slid:  # live lists a request's tokens in order: n - 1 is token t - 1
                assert w // ps == slots[n - 1] // ps, f"request {rid} left its window page mid-page at token {t}"


class AllocatorConformance:
    """Run :class:`AllocatorMachine` on the allocators ``allocator_factory`` makes (a fixture returning a
    zero-argument callable that builds a fresh allocator).

    ``examples`` is how many random sequences a run draws; a Hypothesis profile asking for more examples than
    Hypothesis's default (``--hypothesis-profile=long``) raises it.  Lower it on a subclass only for an
    allocator that is slow to drive (Triton kernels in the CPU interpreter) and is run long elsewhere."""

    examples: int = 200
    #: the machine run: :class:`AllocatorMachine` or a subclass that checks more of its allocator
    machine: type = AllocatorMachine

    @pytest.fixture
    def allocator_factory(self):
        pytest.fail("provide an allocator_factory fixture: a zero-argument callable returning a fresh allocator")

    def test_random_request_lifetimes(self, allocator_factory):
        machine = type("Machine", (self.machine,), {"factory": staticmethod(allocator_factory)})
        active = settings()
        asked = active.max_examples if active.max_examples > settings.get_profile("default").max_examples else 0
        run_state_machine_as_test(machine, settings=settings(
            max_examples=max(self.examples, asked), stateful_step_count=max(25, active.stateful_step_count),
            deadline=None, suppress_health_check=list(HealthCheck),
        ))  # fmt: skip

    def test_a_deep_copy_allocates_apart(self, allocator_factory):
        """``copy.deepcopy`` of an allocator (and its pool: a cache copied to reuse a prompt) keeps free lists of its
        own: it hands out what the original hands out next, and what either takes or gives back the other does not
        see."""
        allocator = allocator_factory()
        page = allocator.page_size
        held = allocator.alloc(page)  # (its kernels have launched)
        assert held is not None, "a fresh allocator refused one page"
        twin = copy.deepcopy(allocator)
        kept = addresses_kept(twin, allocator)
        assert not kept, f"the copy keeps addresses of the original's memory, at {', '.join(kept[:4])}"
        pool = allocator.get_kvcache()
        assert pool is None or twin.get_kvcache() is not pool, "the copy hands out slots of the original's pool"
        free = allocator.available_size()
        assert twin.available_size() == free
        taken = twin.alloc(page)
        assert taken is not None and allocator.available_size() == free
        mine = allocator.alloc(page)
        assert torch.equal(mine.cpu(), taken.cpu()), "the copy and the original hand out other slots from one state"
        twin.free(taken)
        twin.free(held)
        assert allocator.available_size() == free - page and twin.available_size() == free + page


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
        for group in REQUEST_GROUPS & sizes.keys():  # per-request state: a few requests, not one per token
            sizes[group] = min(kv_allocator_pool_size, KIT_REQUESTS)
        pool = hook.kvcore_create_pool(backend=kv_backend_spec, request=kv_request, layout=layout, sizes=sizes)

        def make():
            allocator = hook.kvcore_choose_allocator(backend=kv_backend_spec, request=kv_request, pool=pool, sizes=sizes)
            assert allocator is not None, f"no kvcore_choose_allocator hook built an allocator for {kv_backend_spec.name!r}"
            return allocator

        return make
