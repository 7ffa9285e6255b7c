"""The allocator conformance kit on a unified memory's token allocator, with state slots taken and given back
between its steps (interleaved on the same bytes), and on its sliding-window allocator (full and window pages on
the two sides of the same bytes), at page sizes 1 and 16.

Beyond the kit's own checks (no location twice, pages per request, exact ``available_size`` — here what the
bytes the state slots leave hold), this machine writes a K row for every token it is handed and a state for every
slot it takes, and after every step reads all of them back through the translated views: compaction of either
side must lose nothing."""

from __future__ import annotations

import hypothesis.strategies as st
import pytest
import torch
from hypothesis.stateful import invariant, rule
from kvcore_mamba.layout import LinearStateParams, StateDtype, StateShape
from kvcore_unified.allocator import HIGH, LOW
from kvcore_unified.mamba import init_unified_mamba_pools
from kvcore_unified.swa import init_unified_swa_pools

from kvcore.testing.allocators import AllocatorConformance, AllocatorMachine
from kvcore.testing.tensors import test_device

H, D = 1, 4
PARAMS = LinearStateParams(layers=[0], shape=StateShape(conv=[(2, 2)], temporal=(1, 2, 2)),
                           dtype=StateDtype(conv=torch.float32, temporal=torch.float32))  # fmt: skip


def _bundle(page_size: int, kernels: str):
    return init_unified_mamba_pools(
        device=test_device(), kv_cache_dtype=torch.float32, head_num=H, head_dim=D, page_size=page_size,
        start_layer=0, end_layer=1, is_draft_worker=False, use_mla_backend=False, mamba_layer_ids=[0],
        full_attention_layer_ids=[1], mamba2_cache_params=PARAMS, model_context_len=64, extra_max_context_len=4,
        max_total_num_tokens=8 * page_size, max_mamba_cache_size=3, max_num_reqs=4, kernels=kernels,
    )  # fmt: skip


class UnifiedMachine(AllocatorMachine):
    """The kit's machine plus state slots on the same bytes, and the bytes of every token and slot checked."""

    call_by_keyword = True

    def start(self, allocator) -> None:
        self.memory = allocator.memory
        self.pool = allocator.get_kvcache()
        self.states = self.pool.mamba_pool
        self.slots: dict[int, torch.Tensor] = {}  # virtual slot -> the temporal state written into it
        self.rows: dict[int, torch.Tensor] = {}  # location -> the K row written for it
        self.counter = 0
        super().start(allocator)

    def token_capacity(self) -> int:
        """What the state slots held leave of the shared bytes, in whole pages of tokens."""
        left = self.memory.capacity - len(self.slots) * self.memory.high_unit
        return left // self.memory.low_unit * self.ps

    def check_result(self, out: torch.Tensor, what: str) -> None:
        if out.numel() == 0:
            return
        self.counter += 1
        k = torch.arange(out.numel() * H * D, dtype=torch.float32).reshape(-1, H, D) + 1000.0 * self.counter
        self.pool.set_kv_buffer(1, out.to(self.pool.device), k.to(self.pool.device), -k.to(self.pool.device))
        for loc, row in zip(out.tolist(), k):
            self.rows[loc] = row

    @rule(n=st.integers(1, 3))
    def take_state_slots(self, n):
        free_bytes = (self.memory.capacity - len(self._used_pages()) * self.memory.low_unit
                      - len(self.slots) * self.memory.high_unit)  # fmt: skip
        fits = free_bytes >= n * self.memory.high_unit
        got = self.states.alloc(n)
        assert (got is not None) == fits, f"alloc of {n} state slots returned {got} with {free_bytes} bytes free"
        if got is None:
            return
        temporal = self.states.mamba2_layer_cache(0).temporal
        for slot in got.tolist():
            assert slot not in self.slots, f"state slot {slot} handed out twice"
            self.counter += 1
            value = torch.full(temporal.shape[1:], float(self.counter), device=temporal.device)
            assert bool((temporal[self.states.translate(torch.tensor([slot]))] == 0).all()), "a new slot is not zeroed"
            temporal[self.states.translate(torch.tensor([slot]))] = value
            self.slots[slot] = value

    @rule(data=st.data())
    def give_back_state_slots(self, data):
        if not self.slots:
            return
        done = data.draw(st.lists(st.sampled_from(sorted(self.slots)), min_size=1, unique=True))
        self.states.free(torch.tensor(done))
        for slot in done:
            del self.slots[slot]

    @invariant()
    def every_byte_stays(self):
        if not hasattr(self, "a"):
            return
        self.memory.settle_frees()  # the frees so far reach the tables (as any query of the allocators does)
        self.memory.allocator.check()
        assert self.memory.allocator.used(HIGH) == len(self.slots)
        temporal = self.states.mamba2_layer_cache(0).temporal
        for slot, value in self.slots.items():
            assert torch.equal(temporal[self.states.translate(torch.tensor([slot]))][0], value), f"state slot {slot} lost"
        live = [loc for locs in self.reqs.values() for loc in locs]
        if live:
            phys = self.pool.full_kv_pool.translate_loc(torch.tensor(live, device=self.pool.device))
            keys = self.pool.get_key_buffer(1)[phys // self.ps, phys % self.ps].cpu()
            want = torch.stack([self.rows[loc] for loc in live])
            assert torch.equal(keys, want), "a token's K row changed"
        assert self.memory.allocator.used(LOW) == len(self._used_pages()) or self.in_group


class UnifiedSWAMachine(AllocatorMachine):
    """The kit's machine on a unified memory's sliding-window allocator: full pages on one side, window pages on the
    other, each side's capacity what the other's pages leave of the shared bytes."""

    call_by_keyword = True

    def start(self, allocator) -> None:
        self.memory = allocator.memory
        super().start(allocator)

    def _left(self) -> int:
        """Bytes the live (and pending) full and window pages leave."""
        m = self.memory
        return m.capacity - len(self._used_pages()) * m.low_unit - self._window_pages_in_use() * m.high_unit

    def token_capacity(self) -> int:
        return (self._left() // self.memory.low_unit + len(self._used_pages())) * self.ps

    def window_token_capacity(self) -> int:
        return (self._left() // self.memory.high_unit + self._window_pages_in_use()) * self.ps

    def free_pages(self) -> int:
        """A new page takes a full page and a window page of the same bytes."""
        return self._left() // (self.memory.low_unit + self.memory.high_unit)


def _swa_allocator(page_size: int):
    bundle = init_unified_swa_pools(
        device=test_device(), kv_cache_dtype=torch.float32, head_num=1, head_dim=4, v_head_dim=4, swa_head_num=1,
        swa_head_dim=8, swa_v_head_dim=8, page_size=page_size, start_layer=0, end_layer=2,
        swa_attention_layer_ids=[0], full_attention_layer_ids=[1], full_max_total_num_tokens=8 * page_size,
        swa_max_total_num_tokens=4 * page_size, kernels="native",
    )  # fmt: skip
    return bundle.token_to_kv_pool_allocator


@pytest.mark.parametrize("page_size", [1, 16])
class TestUnifiedSWAAllocatorKit(AllocatorConformance):
    machine = UnifiedSWAMachine
    examples = 60

    @pytest.fixture
    def allocator_factory(self, page_size):
        return lambda: _swa_allocator(page_size)


@pytest.mark.parametrize("page_size", [1, 16])
class TestUnifiedAllocatorKit(AllocatorConformance):
    machine = UnifiedMachine
    examples = 60

    @pytest.fixture
    def allocator_factory(self, page_size):
        return lambda: _bundle(page_size, "native").token_to_kv_pool_allocator
