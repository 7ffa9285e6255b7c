"""Checked mode: each misuse of a pool or an allocator is refused with one error naming the call, the
argument, what was expected and what came; correct calls go through unchanged; with checked mode off nothing
is wrapped."""

from __future__ import annotations

import copy

import pytest
import torch

import kvcore.plugins
from kvcore import build_pools, load_config
from kvcore.checked import CheckedAllocator, CheckedPool, CheckError


@pytest.fixture(autouse=True)
def _fresh_registry(monkeypatch):
    for var in ("KVCORE_PLUGINS", "KVCORE_DISABLE_PLUGINS", "KVCORE_STRICT_PLUGINS", "KVCORE_CHECKED"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(kvcore.plugins.manager, "_REGISTRY", None)


def pools(*overrides):
    return build_pools(load_config("memory.budget_gib=0.01", "hardware.checked=true", *overrides))


@pytest.fixture
def mha():
    return pools()


def kv(pool, n, dtype=torch.bfloat16):
    return torch.ones(n, pool.head_num, pool.head_dim, dtype=dtype), torch.ones(n, pool.head_num, pool.v_head_dim, dtype=dtype)


def test_off_by_default_nothing_is_wrapped():
    p = build_pools(load_config("memory.budget_gib=0.01"))
    assert not isinstance(p.token_to_kv_pool, CheckedPool) and not isinstance(p.token_to_kv_pool_allocator, CheckedAllocator)


def test_the_environment_switches_it_on(monkeypatch):
    monkeypatch.setenv("KVCORE_CHECKED", "1")
    p = build_pools(load_config("memory.budget_gib=0.01"))
    assert isinstance(p.token_to_kv_pool, CheckedPool) and isinstance(p.token_to_kv_pool_allocator, CheckedAllocator)


def test_correct_calls_go_through(mha):
    pool, alloc = mha.token_to_kv_pool, mha.token_to_kv_pool_allocator
    loc = alloc.alloc(4)
    k, v = kv(pool, 4)
    pool.set_kv_buffer(0, loc, k, v)
    assert torch.equal(pool.get_key_buffer(0)[loc], k)
    pool.move_kv_cache(loc.flip(0), loc)
    alloc.free(loc)
    assert alloc.available_size() == alloc.size


def test_a_deep_copy_is_checked_and_apart(mha):
    """``copy.deepcopy`` of a checked pool and its allocator (a transformers cache copied to reuse a prompt): the
    copies are checked proxies of copies of the pool and allocator, each side's stores and frees its own."""
    pool, alloc = mha.token_to_kv_pool, mha.token_to_kv_pool_allocator
    loc = alloc.alloc(4)
    k, v = kv(pool, 4)
    pool.set_kv_buffer(0, loc, k, v)
    twin_pool, twin_alloc = copy.deepcopy((pool, alloc))
    assert isinstance(twin_pool, CheckedPool) and isinstance(twin_alloc, CheckedAllocator)
    assert twin_pool.unchecked is not pool.unchecked and twin_alloc.get_kvcache() is twin_pool.unchecked
    twin_pool.set_kv_buffer(0, loc, 2 * k, 2 * v)
    assert torch.equal(pool.get_key_buffer(0)[loc], k) and torch.equal(twin_pool.get_key_buffer(0)[loc], 2 * k)
    twin_alloc.free(loc)
    with pytest.raises(CheckError, match="free"):  # the copy's own record: freed once already
        twin_alloc.free(loc)
    alloc.free(loc)  # the original's record is its own
    assert alloc.available_size() == twin_alloc.available_size() == alloc.size


@pytest.mark.parametrize("loc, says", [
    (torch.tensor([5, 10**7]), "set_kv_buffer: loc must be locations in [0,"),
    (torch.tensor([5, -1]), "set_kv_buffer: loc must be locations in [0,"),
    (torch.tensor([0, 5]), "set_kv_buffer: loc must be outside the padding page [0, 1) for a write, got [0]"),
    (torch.tensor([5.0, 6.0]), "set_kv_buffer: loc must be int32 or int64, got torch.float32"),
    (torch.tensor([5, 6], device="meta"), "set_kv_buffer: loc must be on cpu, got meta"),
])  # fmt: skip
def test_store_locations(mha, loc, says):
    k, v = kv(mha.token_to_kv_pool, 2)
    with pytest.raises(CheckError, match=None) as err:
        mha.token_to_kv_pool.set_kv_buffer(0, loc, k, v)
    assert says in str(err.value)


def test_store_rows_and_layers(mha):
    pool = mha.token_to_kv_pool
    loc = torch.tensor([3, 4])
    k, v = kv(pool, 2)
    with pytest.raises(CheckError, match=r"cache_k must be one row per location \(2 rows\), got shape \(3,"):
        pool.set_kv_buffer(0, loc, *kv(pool, 3))
    with pytest.raises(CheckError, match="cache_v must be a float32/float16/bfloat16 or fp8 tensor, got torch.int64"):
        pool.set_kv_buffer(0, loc, k, v.long())
    with pytest.raises(CheckError, match=r"set_kv_buffer: layer must be one of this rank's layers 0..23, got 24"):
        pool.set_kv_buffer(24, loc, k, v)
    with pytest.raises(CheckError, match="layer must be one of this rank's layers"):
        pool.set_kv_buffer(None, loc, k, v, layer_id_override=-1)


def test_moves(mha):
    pool = mha.token_to_kv_pool
    with pytest.raises(CheckError, match=r"move_kv_cache: tgt_loc must be distinct locations, got repeats \[7\]"):
        pool.move_kv_cache(torch.tensor([7, 7]), torch.tensor([3, 4]))
    with pytest.raises(CheckError, match=r"tgt_loc must be as many locations as src_loc \(3\), got 2"):
        pool.move_kv_cache(torch.tensor([7, 8]), torch.tensor([3, 4, 5]))
    with pytest.raises(CheckError, match="move_kv_cache: tgt_loc must be outside the padding page"):
        pool.move_kv_cache(torch.tensor([0]), torch.tensor([3]))
    pool.move_kv_cache(torch.tensor([3]), torch.tensor([0]))  # reading the padding row is fine


def test_cpu_copies(mha):
    pool = mha.token_to_kv_pool
    copy = pool.get_cpu_copy(torch.tensor([3, 4]))
    with pytest.raises(CheckError, match="load_cpu_copy: indices must be outside the padding page"):
        pool.load_cpu_copy(copy, torch.tensor([0, 4]))
    with pytest.raises(CheckError, match="get_cpu_copy: indices must be locations in"):
        pool.get_cpu_copy(torch.tensor([10**8]))


@pytest.mark.parametrize("page", [1, 4])
def test_frees(page):
    p = pools(f"kv_cache.page_size={page}")
    alloc = p.token_to_kv_pool_allocator
    loc = alloc.alloc(2 * page)
    alloc.free(loc[:page])
    with pytest.raises(CheckError, match=r"free: free_index must be slots that are allocated \(a double free"):
        alloc.free(loc[:page])
    with pytest.raises(CheckError, match=rf"free: free_index must be outside the padding page \[0, {page}\), got \[0\]"):
        alloc.free(torch.tensor([0]))
    with pytest.raises(CheckError, match="free_index must be int32 or int64"):
        alloc.free(loc.float())
    never = torch.tensor([alloc.size])  # a slot nobody was handed
    with pytest.raises(CheckError, match="a double free, or never handed out"):
        alloc.free(never)
    # inside a free group a free counts when made
    alloc.free_group_begin()
    alloc.free(loc[page:])
    with pytest.raises(CheckError, match="double free"):
        alloc.free(loc[page:])
    alloc.free_group_end()
    assert alloc.available_size() == alloc.size


def test_backup_and_restore_carry_the_record(mha):
    alloc = mha.token_to_kv_pool_allocator
    state = alloc.backup_state()
    loc = alloc.alloc(3)
    alloc.restore_state(state)
    with pytest.raises(CheckError, match="double free"):  # restored: those slots are free again
        alloc.free(loc)
    again = alloc.alloc(3)
    alloc.free(again)
    alloc.clear()
    with pytest.raises(CheckError, match="double free"):
        alloc.free(again)


def test_mla_calls_are_checked_too():
    p = pools("model=tiny-mla")
    pool = p.token_to_kv_pool
    nope, rope = torch.ones(2, 1, 128, dtype=torch.bfloat16), torch.ones(2, 1, 32, dtype=torch.bfloat16)
    with pytest.raises(CheckError, match="set_mla_kv_buffer: loc must be outside the padding page"):
        pool.set_mla_kv_buffer(0, torch.tensor([0, 3]), nope, rope)
    with pytest.raises(CheckError, match=r"cache_k_rope must be one row per location \(2 rows\)"):
        pool.set_mla_kv_buffer(0, torch.tensor([2, 3]), nope, rope[:1])
    with pytest.raises(CheckError, match="get_mla_kv_buffer: loc must be locations in"):
        pool.get_mla_kv_buffer(0, torch.tensor([10**8]))
