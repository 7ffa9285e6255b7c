"""A hybrid sliding-window model on a unified memory (kvcore_unified.swa): full-attention pages on the low side, window
pages on the high side of one byte range.  Requests come and go, extend, decode and slide out of the window; after
every step each live token reads back what was stored for it, byte for byte, through the translated paged views of
its full and window layers, across the compactions both sides go through.  The two sides trade bytes, a refused
allocation changes nothing, and the factory takes SGLang's keywords."""

from __future__ import annotations

import random

import pytest
import torch
from kvcore_swa.allocator import SWATokenToKVPoolAllocator
from kvcore_swa.pool import SWAKVPool
from kvcore_unified.allocator import HIGH, LOW
from kvcore_unified.full_pages import UnifiedPagedAllocator
from kvcore_unified.swa import UnifiedSWAKVPool, UnifiedSWATokenToKVPoolAllocator, init_unified_swa_pools

from kvcore.errors import ConfigError
from kvcore.testing.tensors import bits_equal, test_device
from kvcore.pools import KVWriteLoc

FULL_LAYERS, SWA_LAYERS = [1], [0, 2]
H, D = 2, 8  # full-attention heads: 64 bytes a token in bf16
SH, SD = 1, 16  # window heads: 128 bytes a token over the two window layers
WINDOW = 6  # tokens a request keeps in the window
SHAPES = {layer: (H, D) for layer in FULL_LAYERS} | {layer: (SH, SD) for layer in SWA_LAYERS}


def keywords(page_size: int, full_tokens: int, swa_tokens: int, kernels: str = "native", **extra) -> dict:
    """SGLang's keywords, as its configurator passes them (and kvcore's ``kernels``)."""
    return dict(device=test_device(), kv_cache_dtype=torch.bfloat16, head_num=H, head_dim=D, v_head_dim=D,
                swa_head_num=SH, swa_head_dim=SD, swa_v_head_dim=SD, page_size=page_size, start_layer=0, end_layer=3,
                swa_attention_layer_ids=SWA_LAYERS, full_attention_layer_ids=FULL_LAYERS,
                full_max_total_num_tokens=full_tokens, swa_max_total_num_tokens=swa_tokens, enable_memory_saver=False,
                need_sort=False, forward_stream=None, lazy_compaction=True, kernels=kernels) | extra  # fmt: skip


def build(page_size: int, full_tokens: int = 64, swa_tokens: int = 32, kernels: str = "native", lazy: bool = True):
    bundle = init_unified_swa_pools(**keywords(page_size, full_tokens, swa_tokens, kernels, lazy_compaction=lazy))
    return bundle.unified_memory_pool, bundle.token_to_kv_pool, bundle.token_to_kv_pool_allocator


@pytest.fixture
def moves(monkeypatch):
    """Pages moved by compaction, by side."""
    counted = {LOW: 0, HIGH: 0}
    original = UnifiedPagedAllocator._move

    def counting(self, src, dst):
        counted[self.side] += len(src)
        original(self, src, dst)

    monkeypatch.setattr(UnifiedPagedAllocator, "_move", counting)
    return counted


class _Request:
    """A request's full locations, the K rows stored for them by layer (V: their negation), and how many of its first
    tokens slid out of the window."""

    def __init__(self):
        self.locs = torch.zeros(0, dtype=torch.int64, device=test_device())
        self.k = {layer: torch.zeros((0, *shape), dtype=torch.bfloat16, device=test_device())
                  for layer, shape in SHAPES.items()}  # fmt: skip
        self.slid = 0

    def add(self, locs: torch.Tensor, k: dict[int, torch.Tensor]) -> None:
        self.locs = torch.cat([self.locs, locs])
        self.k = {layer: torch.cat([self.k[layer], rows]) for layer, rows in k.items()}


def _write_loc(allocator, locs: torch.Tensor, physical: bool):
    """What the stores take: the full locations, or (``physical``) the step's physical tokens of both sides, as an
    engine translates them once per step."""
    if not physical:
        return locs
    return KVWriteLoc(allocator.translate_write_loc(locs), swa_loc=allocator.translate_loc_from_full_to_swa(locs),
                      physical=True)  # fmt: skip


def _store(pool, locs: torch.Tensor, gen: torch.Generator, where=None) -> dict[int, torch.Tensor]:
    """Random K rows (and their negation as V) at full locations ``locs`` of every layer (written at ``where``
    when given: their KVWriteLoc)."""
    rows = {}
    for layer, shape in SHAPES.items():
        k = torch.randn((locs.numel(), *shape), generator=gen).to(torch.bfloat16).to(locs.device)
        pool.set_kv_buffer(layer, locs if where is None else where, k, -k)
        rows[layer] = k
    return rows


def _read(pool, layer: int, phys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The K and V rows of physical tokens ``phys`` in ``layer``'s paged views."""
    page = pool.page_size
    phys = phys.long()
    at = (phys // page, phys % page)
    return pool.get_key_buffer(layer)[at], pool.get_value_buffer(layer)[at]


def _check(memory, pool, allocator, running: list[_Request]) -> None:
    ends, page = memory.allocator, pool.page_size
    memory.settle_frees()  # the step's frees reach the tables, as the allocators' next query would have them
    ends.check()
    assert allocator.full_available_size() == ends.available(LOW) * page
    assert allocator.swa_available_size() == ends.available(HIGH) * page
    pair = memory.low_unit + memory.high_unit
    joint = min(ends.free_bytes() // pair, ends.available(LOW), ends.available(HIGH))
    assert allocator.available_size() == joint * page
    if not running:
        return
    full = torch.cat([r.locs for r in running])
    phys = pool.translate_loc(full)
    assert phys.unique().numel() == phys.numel(), "two live tokens on one full-attention slot"
    assert bool((phys >= page).all()), "a live token on the full side's padding page"
    for layer in FULL_LAYERS:
        k, v = _read(pool, layer, phys)
        want = torch.cat([r.k[layer] for r in running])
        assert bits_equal(k, want) and bits_equal(v, -want), f"full-attention layer {layer} lost a token's bytes"
    kept = torch.cat([r.locs[r.slid :] for r in running])
    window = pool.translate_loc_from_full_to_swa(kept)
    assert window.dtype == torch.int32
    assert window.unique().numel() == window.numel(), "two live tokens on one window slot"
    assert not bool((window.long() // page == memory.high_pages).any()), "a token in the window reads the padding page"
    for layer in SWA_LAYERS:
        k, v = _read(pool, layer, window)
        want = torch.cat([r.k[layer][r.slid :] for r in running])
        assert bits_equal(k, want) and bits_equal(v, -want), f"window layer {layer} lost a token's bytes"
    gone = torch.cat([r.locs[: r.slid] for r in running])
    assert bool((pool.translate_loc_from_full_to_swa(gone).long() // page == memory.high_pages).all())
    assert torch.equal(allocator.translate_loc_from_full_to_swa(full), pool.translate_loc_from_full_to_swa(full).long())


def _extend(allocator, request: _Request | None, n: int) -> torch.Tensor | None:
    """``n`` more tokens for ``request`` (a new one when None), SGLang's call."""
    dev = test_device()
    prefix = 0 if request is None else request.locs.numel()
    pre_cpu, seq_cpu = torch.tensor([prefix]), torch.tensor([prefix + n])
    last = torch.tensor([-1 if request is None else int(request.locs[-1])], device=dev)
    return allocator.alloc_extend(pre_cpu.to(dev), pre_cpu, seq_cpu.to(dev), seq_cpu, last, n)


@pytest.mark.parametrize("lazy,physical", [(False, False), (True, False), (True, True)],
                         ids=["eager", "lazy", "lazy-physical-write-loc"])
@pytest.mark.parametrize("kernels", ["native", "triton"])
@pytest.mark.parametrize("page_size", [1, 4])
def test_requests_come_and_go_and_every_token_keeps_its_bytes(page_size, kernels, lazy, physical, moves):
    """Stores by full location, or (``physical``) by the physical tokens of a KVWriteLoc taken once per step;
    compaction at every free, or (``lazy``) when a side needs the bytes and at an engine's flush between steps."""
    memory, pool, allocator = build(page_size, kernels=kernels, lazy=lazy)
    rng, gen = random.Random(page_size), torch.Generator().manual_seed(0)
    running: list[_Request] = []
    padding = torch.zeros(2, dtype=torch.int64, device=test_device())
    for step in range(36):
        if rng.random() < 0.5:  # a new request: a prefill of 1..9 tokens
            request, n = _Request(), rng.randint(1, 9)
            loc = _extend(allocator, None, n)
            if loc is not None:
                request.add(loc, _store(pool, loc, gen, _write_loc(allocator, loc, physical)))
                running.append(request)
        if running and rng.random() < 0.3:  # a request extends after its prefix (continuing its last page)
            request = rng.choice(running)
            loc = _extend(allocator, request, rng.randint(1, 6))
            if loc is not None:
                request.add(loc, _store(pool, loc, gen, _write_loc(allocator, loc, physical)))
        if running:  # a decode step of every running request
            seq_cpu = torch.tensor([r.locs.numel() + 1 for r in running])
            last = torch.stack([r.locs[-1] for r in running])
            loc = allocator.alloc_decode(seq_cpu.to(padding.device), seq_cpu, last)
            if loc is not None:
                rows = _store(pool, loc, gen, _write_loc(allocator, loc, physical))
                for i, r in enumerate(running):
                    r.add(loc[i : i + 1], {layer: k[i : i + 1] for layer, k in rows.items()})
        for r in running:  # the tokens before the last WINDOW slide out, by whole pages
            slid = (r.locs.numel() - WINDOW) // page_size * page_size
            if slid > r.slid:
                allocator.free_swa(r.locs[r.slid : slid])
                r.slid = slid
        if running and rng.random() < 0.3:  # requests finish, inside a free group
            allocator.free_group_begin()
            for r in (done := rng.sample(running, rng.randint(1, len(running)))):
                allocator.free(r.locs)
            allocator.free_group_end()
            running = [r for r in running if r not in done]
        for layer, (heads, dim) in SHAPES.items():  # a padded batch writes the padding location: lands nowhere live
            junk = torch.full((2, heads, dim), 7.0, dtype=torch.bfloat16, device=padding.device)
            pool.set_kv_buffer(layer, _write_loc(allocator, padding, physical), junk, junk)
        if lazy and step % 9 == 8:
            memory.flush()
        _check(memory, pool, allocator, running)
    assert moves[LOW] > 0 and moves[HIGH] > 0, f"compaction moved {moves}: the test checks nothing moved"
    for r in running:
        allocator.free(r.locs)
    memory.settle_frees()
    assert memory.allocator.used(LOW) == memory.allocator.used(HIGH) == 0
    assert not bool(allocator.full_to_swa_index_mapping.any())


def test_the_two_sides_trade_bytes():
    """A budget of 64 full and 16 window tokens: 64 * 64 + 16 * 128 bytes (pages of 4 tokens: 256 and 512 bytes)."""
    memory, pool, allocator = build(4, full_tokens=64, swa_tokens=16)
    assert allocator.full_available_size() == 96 and allocator.swa_available_size() == 48
    assert allocator.available_size() == 32  # a full page and a window page each
    # short requests, all in the window: twice the window tokens a fixed split would hold
    before = allocator.full_available_size()
    first = allocator.alloc(4)
    assert allocator.full_available_size() == before - 12, "a window page takes a full page's bytes twice over"
    taken = [first] + [allocator.alloc(4) for _ in range(7)]
    assert all(t is not None for t in taken) and allocator.alloc(4) is None
    assert len(taken) * 4 == 32 > 16 and allocator.full_available_size() == allocator.swa_available_size() == 0
    for t in taken:
        allocator.free(t)
    # one long request whose window slides: more full tokens than a fixed split would hold
    request, full_tokens = _Request(), 0
    while (loc := _extend(allocator, request if full_tokens else None, 4)) is not None:
        request.locs = torch.cat([request.locs, loc])
        full_tokens += 4
        if full_tokens > 4:
            full_before = allocator.full_available_size()
            allocator.free_swa(request.locs[full_tokens - 8 : full_tokens - 4])  # keep the last page in the window
            assert allocator.full_available_size() == full_before + 8  # a window page's bytes: two full pages
    # it stops where the window's live page and the next page's pair leave no room for another full page
    assert full_tokens == (memory.capacity - 2 * memory.high_unit) // memory.low_unit * 4 == 80 > 64
    memory.settle_frees()
    assert memory.allocator.used(HIGH) == 1


@pytest.mark.parametrize("page_size", [1, 4])
def test_a_refused_allocation_changes_nothing(page_size):
    memory, pool, allocator = build(page_size, full_tokens=64, swa_tokens=16)
    pair = memory.low_unit + memory.high_unit
    held = allocator.alloc((memory.capacity // pair - 1) * page_size)  # one page of each kind still fits
    assert held is not None and allocator.available_size() == page_size
    assert allocator.full_available_size() >= 2 * page_size  # the full side alone would take two pages
    ends, dev = memory.allocator, test_device()
    every = torch.arange((pool.size // page_size + 1) * page_size, device=dev)

    def state():
        tables = (allocator.full_to_swa_index_mapping.clone(), pool.translate_loc(every),
                  pool.swa_kv_pool.translate_loc(every[: pool.size_swa]), memory.buffer.clone())  # fmt: skip
        return ([ends.free_ids(s) for s in (LOW, HIGH)], ends.free_bytes(), *tables)

    before = state()
    assert _extend(allocator, None, 2 * page_size) is None  # two pages of each kind
    seq_cpu = torch.tensor([1, 1])  # two requests that each open a page
    assert allocator.alloc_decode(seq_cpu.to(dev), seq_cpu, torch.tensor([-1, -1], device=dev)) is None
    assert allocator.alloc(2 * page_size) is None
    after = state()
    assert after[:2] == before[:2]
    assert all(torch.equal(a, b) for a, b in zip(after[2:], before[2:]))
    assert _extend(allocator, None, page_size) is not None and allocator.available_size() == 0


def test_the_rollback_frees_only_the_pages_just_taken(monkeypatch):
    """Should the window side refuse what the check let through, the full side gives back its new pages alone."""
    memory, pool, allocator = build(4, full_tokens=64, swa_tokens=16)
    request = _Request()
    request.add(loc := _extend(allocator, None, 6), _store(pool, loc, torch.Generator().manual_seed(2)))
    held = allocator.alloc((allocator.available_size() // 4 - 1) * 4)
    assert held is not None and allocator.available_size() == 4
    used = memory.allocator.used(LOW)
    monkeypatch.setattr(allocator, "_joint_pages", lambda: 1 << 20)  # the check passes: the window side refuses
    assert _extend(allocator, request, 8) is None  # fills the request's page, then two new pages of each kind
    memory.settle_frees()
    assert memory.allocator.used(LOW) == used
    monkeypatch.undo()
    _check(memory, pool, allocator, [request])


def test_moves_and_cpu_copies_take_full_locations():
    memory, pool, allocator = build(4)
    gen = torch.Generator().manual_seed(1)
    first, a, b = allocator.alloc(4), allocator.alloc(8), allocator.alloc(8)
    rows_a = _store(pool, a, gen)
    _store(pool, b, gen)
    copy = pool.get_cpu_copy(a)
    moved = memory.allocator.moved_units
    allocator.free(first)  # compaction (at the flush): b's pages move into first's places, on both sides
    memory.flush()
    assert memory.allocator.moved_units > moved
    _store(pool, b, gen)
    pool.load_cpu_copy(copy, b)
    for layer in FULL_LAYERS + SWA_LAYERS:
        translate = pool.translate_loc_from_full_to_swa if layer in SWA_LAYERS else pool.translate_loc
        k, v = _read(pool, layer, translate(b))
        assert bits_equal(k, rows_a[layer]) and bits_equal(v, -rows_a[layer])
    rows_b = _store(pool, b, gen)
    pool.move_kv_cache(a, b)
    for layer in FULL_LAYERS + SWA_LAYERS:
        translate = pool.translate_loc_from_full_to_swa if layer in SWA_LAYERS else pool.translate_loc
        assert bits_equal(_read(pool, layer, translate(a))[0], rows_b[layer])


def test_the_bundle_and_what_it_refuses():
    bundle = init_unified_swa_pools(**keywords(4, 64, 32))
    pool, allocator = bundle.token_to_kv_pool, bundle.token_to_kv_pool_allocator
    assert bundle.req_to_token_pool is None and pool.memory is bundle.unified_memory_pool
    assert isinstance(pool, SWAKVPool) and isinstance(allocator, SWATokenToKVPoolAllocator)
    assert allocator.get_kvcache() is pool and pool.full_to_swa_index_mapping is allocator.full_to_swa_index_mapping
    assert pool.get_kv_size_bytes()[0] * 2 == bundle.unified_memory_pool.buffer.nbytes
    with pytest.raises(NotImplementedError, match="snapshot"):
        allocator.backup_state()
    import kvcore_unified

    assert kvcore_unified.UnifiedSWAKVPool is UnifiedSWAKVPool
    assert kvcore_unified.UnifiedSWATokenToKVPoolAllocator is UnifiedSWATokenToKVPoolAllocator
    refused = {"enable_memory_saver": True, "post_capture_active": True, "fused_draft": object(),
               "model_context_len": 4096, "v_head_dim": D * 2, "swa_v_head_dim": SD // 2}  # fmt: skip
    for keyword, value in refused.items():
        with pytest.raises(ConfigError, match=keyword):
            init_unified_swa_pools(**keywords(4, 64, 32, **{keyword: value}))
    with pytest.raises(ConfigError, match="total_bytes"):
        init_unified_swa_pools(**keywords(4, None, 32))
    with pytest.raises(ConfigError, match="full_max_total_num_tokens"):
        init_unified_swa_pools(**keywords(4, 1, 1))
    with pytest.raises(ValueError, match="end_layer"):
        init_unified_swa_pools(**keywords(4, 64, 32, end_layer=2))
    with pytest.raises(ConfigError, match="window layers"):
        init_unified_swa_pools(**keywords(4, 64, 32, end_layer=2, swa_attention_layer_ids=[],
                                          full_attention_layer_ids=[0, 1]))  # fmt: skip
    # total_bytes instead of the split pools' sizes
    sized = init_unified_swa_pools(**keywords(4, None, None, total_bytes=5000))
    assert sized.unified_memory_pool.capacity <= 5000 and sized.token_to_kv_pool_allocator.available_size() > 0


def test_physical_write_locs_need_the_window_tokens():
    """A KVWriteLoc marked physical carries full-side tokens only: a window layer cannot map them, and says what to
    pass."""
    _, pool, allocator = build(4)
    loc = allocator.alloc(4)
    k = torch.zeros((4, SH, SD), dtype=torch.bfloat16, device=loc.device)
    with pytest.raises(ValueError, match="swa_loc=allocator.translate_loc_from_full_to_swa"):
        pool.set_kv_buffer(SWA_LAYERS[0], KVWriteLoc(allocator.translate_write_loc(loc), physical=True), k, k)
    with pytest.raises(ValueError, match="out_width"):
        allocator.translate_write_loc(loc, out_width=8)
    out = torch.empty(4, dtype=torch.int64, device=loc.device)
    assert allocator.translate_kv_loc(loc, out=out) is out and torch.equal(out, pool.translate_loc(loc))
