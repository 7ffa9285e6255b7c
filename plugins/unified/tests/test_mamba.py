"""A hybrid linear-attention model on one unified memory (kvcore_unified.mamba.init_unified_mamba_pools): requests
come and go, each with its full-attention tokens (low side) and its state slot (high side); after every step each
live token's K/V and each live request's states read back byte for byte through the translated views, across
the compactions of both sides, and the two kinds take each other's bytes."""

from __future__ import annotations

import random

import pytest
import torch
from kvcore_mamba.layout import LinearStateParams, StateDtype, StateShape
from kvcore_unified.allocator import HIGH, LOW
from kvcore_unified.mamba import full_page_bytes, init_unified_mamba_pools
from kvcore_unified.states import state_envelope

from kvcore.errors import ConfigError
from kvcore.testing.tensors import bits_equal, test_device
from kvcore.pools import KVWriteLoc

H, D, PS = 2, 8, 4
FULL, LINEAR = [3], [0, 1, 2]
PARAMS = LinearStateParams(layers=LINEAR, shape=StateShape(conv=[(6, 3)], temporal=(2, 5, 3)),
                           dtype=StateDtype(conv=torch.bfloat16, temporal=torch.float32))  # fmt: skip


def build(kernels: str, tokens: int = 48, slots: int = 6, **kw):
    keywords = dict(device=test_device(), kv_cache_dtype=torch.bfloat16, head_num=H, head_dim=D, page_size=PS,
                    start_layer=0, end_layer=3, is_draft_worker=False, use_mla_backend=False, mamba_layer_ids=LINEAR,
                    full_attention_layer_ids=FULL, mamba2_cache_params=PARAMS, model_context_len=64,
                    extra_max_context_len=4, max_total_num_tokens=tokens, max_mamba_cache_size=slots, max_num_reqs=8,
                    kernels=kernels)  # fmt: skip
    keywords.update(kw)
    return init_unified_mamba_pools(**keywords)


class _Req:
    """SGLang's request, as the request table reads it (a kept state slot)."""

    def __init__(self):
        self.mamba_pool_idx = None
        self.locs = self.k = None
        self.state: dict[str, torch.Tensor] = {}


def _write_states(bundle, req, gen):
    """Random states into the request's slot, through the views at its physical slot; kept for the checks."""
    table = bundle.req_to_token_pool
    slot = table.translate_mamba_indices(torch.tensor([req.mamba_pool_idx], device=table.device)).long()
    for i, layer in enumerate(LINEAR):
        cache = table.mamba2_layer_cache(layer)
        for name, t in (("conv", cache.conv[0]), ("temporal", cache.temporal)):
            value = torch.randn(t[slot].shape, generator=gen).to(t.dtype).to(t.device)
            t[slot] = value
            req.state[f"{name}{i}"] = value


def _check(bundle, running):
    memory = bundle.unified_memory_pool
    memory.settle_frees()  # the step's frees reach the tables, as the allocators' next query would have them
    memory.allocator.check()
    pool, table = bundle.token_to_kv_pool, bundle.req_to_token_pool
    full = pool.full_kv_pool
    for req in running:
        phys = full.translate_loc(req.locs)
        k, v = pool.get_key_buffer(FULL[0]), pool.get_value_buffer(FULL[0])
        assert bits_equal(k[phys // PS, phys % PS], req.k) and bits_equal(v[phys // PS, phys % PS], -req.k)
        slot = table.translate_mamba_indices(torch.tensor([req.mamba_pool_idx], device=table.device)).long()
        for i, layer in enumerate(LINEAR):
            cache = table.mamba2_layer_cache(layer)
            assert bits_equal(cache.conv[0][slot], req.state[f"conv{i}"])
            assert bits_equal(cache.temporal[slot], req.state[f"temporal{i}"])


@pytest.mark.parametrize("lazy", [False, True], ids=["eager", "lazy"])
@pytest.mark.parametrize("physical", [False, True], ids=["virtual-locations", "physical-write-loc"])
@pytest.mark.parametrize("kernels", ["native", "triton"])
def test_requests_come_and_go_and_keep_their_tokens_and_states(kernels, physical, lazy):
    """Stores by the allocator's (virtual) tokens, or (``physical``) by a KVWriteLoc of their physical tokens;
    compaction at every free, or (``lazy``) when a side needs the bytes and at an engine's flush between steps."""
    bundle = build(kernels, lazy_compaction=lazy)
    dev = test_device()
    alloc, table, pool = bundle.token_to_kv_pool_allocator, bundle.req_to_token_pool, bundle.token_to_kv_pool
    memory = bundle.unified_memory_pool
    rng, gen = random.Random(1), torch.Generator().manual_seed(1)
    running: list[_Req] = []
    zero = torch.zeros(1, dtype=torch.int64)
    for step in range(36):
        if rng.random() < 0.55:
            req = _Req()
            if table.available_size() and memory.allocator.available(HIGH):
                rows = table.alloc(1, [req])
                n = rng.randint(1, 9)
                seq = torch.tensor([n])
                loc = alloc.alloc_extend(zero.to(dev), zero, seq.to(dev), seq, torch.tensor([-1], device=dev), n)
                if loc is None:
                    table.free(rows)
                else:
                    req.row, req.locs = rows[0], loc
                    req.k = torch.randn((n, H, D), generator=gen).to(torch.bfloat16).to(dev)
                    where = KVWriteLoc(alloc.translate_write_loc(loc), physical=True) if physical else loc
                    pool.set_kv_buffer(FULL[0], where, req.k, -req.k)
                    _write_states(bundle, req, gen)
                    running.append(req)
        if running and rng.random() < 0.4:
            done = rng.sample(running, rng.randint(1, len(running)))
            for req in done:
                alloc.free(req.locs)
                table.free(req.row)
            running = [r for r in running if r not in done]
        if lazy and step % 9 == 8:
            bundle.unified_memory_pool.flush()
        _check(bundle, running)
    assert memory.allocator.moved_units > 0, "nothing compacted: the test checks no move"
    for req in running:
        alloc.free(req.locs)
        table.free(req.row)
    memory.settle_frees()
    assert memory.allocator.used(LOW) == 0 and memory.allocator.used(HIGH) == 0


def test_the_two_kinds_trade_bytes():
    bundle = build("native", tokens=32, slots=4)
    memory = bundle.unified_memory_pool
    states, alloc = bundle.req_to_token_pool.mamba_pool, bundle.token_to_kv_pool_allocator
    unit = state_envelope(PARAMS, len(LINEAR)).unit_bytes
    page = full_page_bytes(layers=1, page_size=PS, kv_cache_dtype=torch.bfloat16, use_mla=False, head_num=H, head_dim=D)
    budget = 32 // PS * page + 4 * unit
    assert memory.capacity == (page + budget) // 16 * 16 - page  # the split pools' bytes, the range's end aligned
    # all of it tokens: more than the split pools' 32
    assert alloc.available_size() == memory.capacity // page * PS > 32
    # all of it state slots: more than the split pools' 4
    assert states.available_size() == memory.capacity // unit > 4
    slots = states.alloc(states.available_size())
    assert slots is not None and alloc.available_size() == (memory.capacity - slots.numel() * unit) // page * PS
    states.free(slots)
    assert alloc.available_size() == memory.capacity // page * PS


def test_new_slots_are_zeroed_and_copies_translate():
    bundle = build("native")
    states = bundle.req_to_token_pool.mamba_pool
    a, b = states.alloc(1), states.alloc(1)
    cache = states.mamba2_layer_cache(0)
    pa = states.translate(a)
    cache.temporal[pa] = 7.0
    states.free(a)  # b's envelope moves down into a's place, at the flush (compaction is lazy by default)
    assert bundle.unified_memory_pool.flush() == 1
    c = states.fork_from(b)
    assert bool((cache.temporal[states.translate(c)] == cache.temporal[states.translate(b)]).all())
    d = states.alloc(1)
    assert bool((cache.temporal[states.translate(d)] == 0).all()), "a new slot keeps a freed slot's state"


def test_a_decode_workers_request_table_pre_allocates_rows_over_the_same_states():
    """SGLang's decode worker passes decode_pre_alloc_size: its request table has that many more rows, and their
    state slots come from the unified memory."""
    bundle = build("native", decode_pre_alloc_size=3)
    table, memory = bundle.req_to_token_pool, bundle.unified_memory_pool
    assert type(table).__name__ == "HybridMambaDecodeReqToTokenPool" and table.mamba_pool is bundle.token_to_kv_pool.mamba_pool
    assert table.req_to_token.shape[0] == 8 + 3 + 1  # max_num_reqs, the pre-allocated rows, padding
    reqs = [_Req() for _ in range(10)]  # more requests than max_num_reqs: the pre-allocated rows take the rest
    rows = table.alloc(10, reqs)
    assert rows is not None and len(rows) == 10 and memory.allocator.used(HIGH) == 10
    slots = table.translate_mamba_indices(table.get_mamba_indices(torch.as_tensor(rows, device=table.device)))
    assert slots.unique().numel() == 10 and bool((slots != memory.padding_page(HIGH)).all())


def test_refusals_name_the_keyword():
    with pytest.raises(ConfigError, match="is_draft_worker"):
        build("native", is_draft_worker=True)
    with pytest.raises(ConfigError, match="not even one request"):
        build("native", tokens=0, slots=0)


@pytest.mark.parametrize("physical", [False, True], ids=["virtual-locations", "physical-write-loc"])
@pytest.mark.parametrize("kernels", ["native", "triton"])
def test_mla_full_attention_pages_keep_their_latent_rows(kernels, physical):
    """A Kimi-Linear-shaped model: MLA latent rows of the full-attention layers on the low side."""
    rank, rope = 16, 8
    bundle = build(kernels, use_mla_backend=True, kv_lora_rank=rank, qk_rope_head_dim=rope)
    dev = test_device()
    alloc, pool, states = bundle.token_to_kv_pool_allocator, bundle.token_to_kv_pool, bundle.req_to_token_pool.mamba_pool
    gen = torch.Generator().manual_seed(2)
    held = []
    for n in (5, 3, 7, 2):
        locs = alloc.alloc(-(-n // PS) * PS)
        nope = torch.randn((locs.numel(), 1, rank), generator=gen).to(torch.bfloat16).to(dev)
        rope_part = torch.randn((locs.numel(), 1, rope), generator=gen).to(torch.bfloat16).to(dev)
        where = KVWriteLoc(alloc.translate_write_loc(locs), physical=True) if physical else locs
        pool.set_mla_kv_buffer(FULL[0], where, nope, rope_part)
        held.append((locs, torch.cat([nope, rope_part], dim=-1)))
        states.alloc(1)  # the high side takes bytes in between
    alloc.free(held.pop(0)[0])  # the pages above move down (at the flush: compaction is lazy by default)
    alloc.free(held.pop(1)[0])
    assert bundle.unified_memory_pool.flush() > 0
    for locs, rows in held:
        phys = pool.full_kv_pool.translate_loc(locs)
        assert bits_equal(pool.get_key_buffer(FULL[0])[phys // PS, phys % PS], rows)
        nope, rope_part = pool.get_mla_kv_buffer(FULL[0], locs)
        assert bits_equal(torch.cat([nope, rope_part], dim=-1), rows)
        nope, rope_part = pool.get_mla_kv_buffer(FULL[0], KVWriteLoc(alloc.translate_kv_loc(locs), physical=True))
        assert bits_equal(torch.cat([nope, rope_part], dim=-1), rows)
