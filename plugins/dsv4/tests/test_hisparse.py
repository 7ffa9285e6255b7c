"""DeepSeek-V4 with HiSparse (kvcore_dsv4.hisparse): the configurator's call with ``enable_hisparse=True``, the
ratio-4 latents stored and read by logical slot through the allocator's map, the host mirror's round trip, the
allocator's sides and device buffers, the plan by hand and ``kvcore up``."""

import pytest
import torch

from kvcore import build_pools, load_config, plan_memory
from kvcore.errors import ConfigError
from kvcore.testing.tensors import randn_nonzero, test_device
from kvcore.tools.cli import main
from kvcore_dsv4.tests.test_pool import CONFIG, PAGE, RATIOS, hand_bytes, latent_page, sglang_call

HISPARSE = "kv_cache.options.host_to_device_ratio=2"


def pools(budget=0.05, *extra):
    return build_pools(load_config(*CONFIG, "hardware=cpu", f"memory.budget_gib={budget}",
                                   "memory.max_running_requests=2", HISPARSE, *extra))  # fmt: skip


def pools_on_test_device(kernels: str):
    """Pools on the tests' device (the GPU in compiled runs) with ``kernels``: the Triton stores interpreted on the
    CPU, compiled on a GPU."""
    return pools(0.05, f"hardware.device={test_device()}", f"hardware.kernels={kernels}")


def test_the_configurators_call_keeps_the_ratio_4_latents_of_c4_size_slots():
    """``enable_hisparse=True``: ``c4_size`` device slots (here 2048 // 8) for ``c128_size x 32`` logical slots, a
    host mirror of every logical slot, the map SGLang's allocator registers (logical slots, a page, a trailing -1)."""
    from kvcore_dsv4 import HiSparseC4DevicePool

    pool = sglang_call(enable_hisparse=True, c4_size=2048 // 8)
    c4 = pool.c4_kv_pool
    assert isinstance(c4, HiSparseC4DevicePool) and pool.enable_hisparse
    assert pool.buffers()["c4_kv"].shape == (2, (256 + 256) // 64, latent_page(64))
    assert c4.host_kv_cache.shape == (2, (512 + 256) // 64, latent_page(64)) and c4.host_kv_cache.device.type == "cpu"
    assert c4.size == 256 and c4.logical_size == pool.c4_logical_size == 512
    assert c4.full_to_hisparse_device_index_mapping.shape == (512 + 64 + 1,)
    assert c4.data_ptrs.tolist() == [b.data_ptr() for b in c4.kv_buffer]
    # transfer engines see SGLang's list: the ratio-4 device pages first (its decode side skips them by count)
    ptrs, lens, items = pool.get_contiguous_buf_infos()
    assert ptrs[:2] == [b.data_ptr() for b in c4.kv_buffer] and items[:2] == [latent_page(64)] * 2
    full = torch.tensor([0, 3, 4, 7, 10, 11, 15], device=test_device())
    assert c4.translate_loc_from_full_to_compressed(full).tolist() == [0, 1, 2, 3]
    with pytest.raises(ValueError, match="entries"):
        c4.register_mapping(torch.zeros(10, dtype=torch.int64))


@pytest.mark.parametrize("kernels", ["native", "triton"])
def test_stores_go_to_the_device_slots_of_logical_slots_and_round_trip_through_the_host(kernels):
    """A ratio-4 store at logical slots writes their device slots (the bytes a plain pool writes there); backed up,
    made cold and brought back into other device slots (a copy from pinned host memory in compiled runs), they read
    the same."""
    from kvcore_dsv4.quantize import store_latent_native

    p = pools_on_test_device(kernels)
    pool, allocator = p.token_to_kv_pool, p.token_to_kv_pool_allocator
    c4, dev = pool.c4_kv_pool, test_device()
    lens = [torch.tensor(v) for v in ([0, 0], [100, 40], [-1, -1])]
    full = allocator.alloc_extend(lens[0].to(dev), lens[0], lens[1].to(dev), lens[1], lens[2].to(dev), 140)
    logical = c4.translate_loc_from_full_to_compressed(full)
    assert logical.numel() == 100 // 4 + 40 // 4
    device = c4._translate_loc_to_hisparse_device(logical)
    assert (device >= c4.page_size).all() and len(set(device.tolist())) == logical.numel()
    gen = torch.Generator().manual_seed(2)
    x = randn_nonzero((logical.numel(), 512), torch.bfloat16, gen, 2.0, dev)
    before = pool.buffers()["c4_kv"].clone()
    pool.set_extra_key_buffer_fused(3, logical, x)  # global layer 3: the second ratio-4 layer
    expected = before.clone()
    store_latent_native(expected[1], device, x, c4.page_size)
    assert torch.equal(pool.buffers()["c4_kv"], expected)
    stored = c4.read(1, logical)
    assert ((stored - x.float()).norm() / x.float().norm()).item() < 0.07

    c4.backup_to_host(logical)
    if dev == "cuda":
        torch.cuda.synchronize()  # the copy to the host runs on the stream
    assert torch.equal(c4.read_host(1, logical), stored.cpu())
    allocator.free_compressed(logical)
    assert (c4._translate_loc_to_hisparse_device(logical) == 0).all()
    slots = allocator.load_to_device(logical)
    assert slots is not None and torch.equal(c4._translate_loc_to_hisparse_device(logical), slots.long())
    assert torch.equal(c4.read(1, logical), stored)


def test_the_allocator_takes_and_gives_back_every_side():
    from kvcore_dsv4 import DeepSeekV4HiSparseTokenToKVPoolAllocator

    p = pools()
    allocator = p.token_to_kv_pool_allocator
    assert isinstance(allocator, DeepSeekV4HiSparseTokenToKVPoolAllocator)
    device_free = allocator.hisparse_attn_allocator.available_size()
    assert allocator.hisparse_page_size == PAGE // 4 and allocator.page_size == PAGE
    assert allocator.available_size() == min(allocator.logical_attn_allocator.available_size(), device_free * 4)
    full = allocator.alloc_extend(torch.tensor([0]), torch.tensor([0]), torch.tensor([300]), torch.tensor([300]),
                                  torch.tensor([-1]), 300)  # fmt: skip
    assert full.numel() == 300
    # two full pages and two device pages (75 compressed slots) taken
    assert allocator.hisparse_attn_allocator.available_size() == device_free - 2 * (PAGE // 4)
    last = full[-1:]
    step = allocator.alloc_decode(torch.tensor([301]), torch.tensor([301]), last)
    assert step.numel() == 1 and allocator.hisparse_attn_allocator.available_size() == device_free - 2 * (PAGE // 4)
    with pytest.raises(ValueError, match="whole pages"):
        allocator.alloc(4)
    pages = allocator.alloc(2 * PAGE)  # whole pages: their compressed slots mapped to whole device pages, in order
    compressed = allocator.hisparse_kvcache.translate_loc_from_full_to_compressed(pages)
    device = allocator.full_to_hisparse_device_index_mapping[compressed]
    assert compressed.numel() == PAGE // 2 and (device % (PAGE // 4) == compressed % (PAGE // 4)).all()
    assert allocator.hisparse_attn_allocator.available_size() == device_free - 4 * (PAGE // 4)
    allocator.free(pages)
    allocator.free(torch.cat([full, step]))
    assert allocator.hisparse_attn_allocator.available_size() == device_free
    assert (allocator.full_to_hisparse_device_index_mapping[:-1] == 0).all()
    assert allocator.available_size() == min(allocator.logical_attn_allocator.available_size(), device_free * 4)
    # an extension the device side cannot hold is refused with nothing taken
    logical_free = allocator.logical_attn_allocator.available_size()
    too_long = device_free * 4 + PAGE
    assert allocator.alloc_extend(torch.tensor([0]), torch.tensor([0]), torch.tensor([too_long]),
                                  torch.tensor([too_long]), torch.tensor([-1]), too_long) is None  # fmt: skip
    assert allocator.logical_attn_allocator.available_size() == logical_free


def test_device_buffers_keep_the_newest_slot_and_give_surplus_pages_back():
    """``alloc_device_buffer``: a request holding more device slots than its buffer keeps the first ones with its
    newest in the last kept place, and gives back the pages only the surplus used; one holding fewer gets the rest
    of its last page and new pages."""
    p = pools()
    allocator = p.token_to_kv_pool_allocator
    page = allocator.hisparse_page_size
    free = allocator.hisparse_attn_allocator.available_size()
    full = allocator.alloc_extend(torch.tensor([0]), torch.tensor([0]), torch.tensor([4 * PAGE]),
                                  torch.tensor([4 * PAGE]), torch.tensor([-1]), 4 * PAGE)  # fmt: skip
    logical = allocator.hisparse_kvcache.translate_loc_from_full_to_compressed(full)
    held = allocator.full_to_hisparse_device_index_mapping[logical].clone()  # 4 device pages of 64
    pages = [set((held[i * page : (i + 1) * page] // page).tolist()) for i in range(4)]
    assert all(len(p) == 1 for p in pages) and len(set.union(*pages)) == 4
    buffer = allocator.alloc_device_buffer(logical, 2 * page)
    want = held[: 2 * page].clone()
    want[page] = held[-1]  # the newest slot in the first place of the buffer's last page
    assert torch.equal(buffer, want)
    assert (allocator.full_to_hisparse_device_index_mapping[logical] == 0).all()
    # the buffer uses pages 1, 2 and (its newest slot) 4: only page 3 held nothing but surplus, and goes back
    assert allocator.hisparse_attn_allocator.available_size() == free - 3 * page

    short = allocator.alloc_extend(torch.tensor([0]), torch.tensor([0]), torch.tensor([40]), torch.tensor([40]),
                                   torch.tensor([-1]), 40)  # fmt: skip
    logical = allocator.hisparse_kvcache.translate_loc_from_full_to_compressed(short)  # 10 slots of one page
    held = allocator.full_to_hisparse_device_index_mapping[logical].clone()
    buffer = allocator.alloc_device_buffer(logical, 2 * page)
    assert buffer.numel() == 2 * page and torch.equal(buffer[:10], held)
    assert torch.equal(buffer[10:page], torch.arange(int(held[-1]) + 1, int(held[-1]) + 1 + page - 10))
    assert len(set(buffer.tolist())) == 2 * page
    with pytest.raises(ValueError, match="whole device pages"):
        allocator.alloc_device_buffer(logical, page + 1)


def test_the_plan_keeps_a_share_of_the_ratio_4_latents_on_the_device():
    """By hand: the ratio-4 latents take (tokens / (page x 2) + 4) device pages a layer instead of (tokens / page +
    4); everything else as without HiSparse; ``c4_max_total_num_tokens`` is tokens // 8."""
    budget = 0.02
    plan = plan_memory(load_config(*CONFIG, "hardware=cpu", f"memory.budget_gib={budget}",
                                   "memory.max_running_requests=3", HISPARSE))  # fmt: skip
    full, swa, slots = plan.sizes["tokens"], plan.sizes["swa_tokens"], plan.sizes["requests"]
    n4 = RATIOS.count(4)
    c4_saved = n4 * (full // PAGE - full // (2 * PAGE)) * latent_page(PAGE // 4)
    assert plan.kv_cache_bytes == hand_bytes(full, swa, slots) - c4_saved
    plain = plan_memory(load_config(*CONFIG, "hardware=cpu", f"memory.budget_gib={budget}",
                                    "memory.max_running_requests=3"))  # fmt: skip
    assert full > plain.sizes["tokens"]  # the budget holds more tokens
    built = pools(budget, "memory.max_running_requests=3").token_to_kv_pool
    assert built.buffers()["c4_kv"].shape[1] == full // (2 * PAGE) + 4
    assert sum(b.nbytes for b in built.buffers().values()) == plan.kv_cache_bytes


def test_plan_names_the_device_share_and_up_is_ready(capsys):
    args = [*CONFIG, "hardware=cpu", "memory.budget_gib=0.05", "memory.max_running_requests=2", HISPARSE]
    assert main(["plan", *args]) == 0
    out = capsys.readouterr().out
    full = plan_memory(load_config(*args)).sizes["tokens"]
    assert f"c4_max_total_num_tokens = {full // 8}" in out and "HiSparse" in out
    assert main(["up", *args]) == 0
    out = capsys.readouterr().out
    assert "DeepSeekV4HiSparseTokenToKVPoolAllocator" in out and "kvcore up: ready" in out


def test_hisparse_without_ratio_4_layers_names_the_key():
    with pytest.raises(ConfigError, match="host_to_device_ratio"):
        plan_memory(load_config(*CONFIG, "hardware=cpu", "memory.budget_gib=0.05", HISPARSE,
                                "model.deepseek_v4.compress_ratios=[0,128,128,0,128,0]"))  # fmt: skip
    plain = sglang_call(enable_hisparse=False)
    allocator = type("A", (), {"get_kvcache": lambda self: plain})()
    from kvcore_dsv4 import DeepSeekV4HiSparseTokenToKVPoolAllocator

    with pytest.raises(ConfigError, match="enable_hisparse=True"):
        DeepSeekV4HiSparseTokenToKVPoolAllocator(allocator)


def test_random_request_lifetimes_keep_both_sides_consistent():
    """Requests come and go (prefills, chunked extensions, then decode steps, frees in any order); after every step:
    no full location or device slot is held twice, every compressed slot an extension completed is mapped to a
    device slot at its own offset in a device page of its request's own, the device side's free slots are its
    capacity less the pages mapped, and at the end everything is free and unmapped."""
    import random

    p = pools(0.02, "memory.max_running_requests=3")
    allocator = p.token_to_kv_pool_allocator
    mapping = allocator.full_to_hisparse_device_index_mapping
    page, dpage = allocator.page_size, allocator.hisparse_page_size
    capacity = allocator.hisparse_attn_allocator.available_size()
    fresh = (allocator.logical_attn_allocator.full_available_size(), allocator.swa_available_size())
    rng = random.Random(5)
    reqs: dict[int, list[int]] = {}  # request -> its full locations
    decoding: set[int] = set()
    extended: dict[int, int] = {}  # request -> tokens placed by extensions (their compressed slots are mapped)
    for step in range(150):
        op = rng.random()
        if op < 0.35 or not reqs:
            rid, prefix, n = step, 0, rng.randint(1, 2 * page + 5)
        elif op < 0.55:
            rid = rng.choice([r for r in reqs if r not in decoding] or [None])
            if rid is None:
                continue
            prefix, n = len(reqs[rid]), rng.randint(1, page)
        elif op < 0.8:
            ids = rng.sample(sorted(reqs), min(len(reqs), 2))
            seq = torch.tensor([len(reqs[i]) + 1 for i in ids])
            out = allocator.alloc_decode(seq, seq, torch.tensor([reqs[i][-1] for i in ids]))
            if out is not None:
                for i, loc in zip(ids, out.tolist()):
                    reqs[i].append(loc)
                    decoding.add(i)
            continue
        else:
            rid = rng.choice(sorted(reqs))
            locs = reqs.pop(rid)
            decoding.discard(rid)
            extended.pop(rid, None)
            rng.shuffle(locs)
            allocator.free(torch.tensor(locs))
            continue
        last = torch.tensor([reqs[rid][-1] if prefix else -1])
        out = allocator.alloc_extend(torch.tensor([prefix]), torch.tensor([prefix]), torch.tensor([prefix + n]),
                                     torch.tensor([prefix + n]), last, n)  # fmt: skip
        if out is not None:
            reqs.setdefault(rid, []).extend(out.tolist())
            extended[rid] = prefix + n
        # the invariants
        held = [loc for locs in reqs.values() for loc in locs]
        assert len(held) == len(set(held)) and min(held, default=page) >= page
        device_pages: dict[int, int] = {}
        slots = []
        for r, locs in reqs.items():
            compressed = [loc // 4 for loc in locs[: extended.get(r, 0)] if (loc + 1) % 4 == 0]
            dev = mapping[torch.tensor(compressed, dtype=torch.long)].tolist()
            assert all(d >= dpage and d % dpage == c % dpage for c, d in zip(compressed, dev)), (step, r)
            for d in dev:
                assert device_pages.setdefault(d // dpage, r) == r, f"device page {d // dpage} shared"
            slots += dev
        assert len(slots) == len(set(slots))
        assert allocator.hisparse_attn_allocator.available_size() == capacity - dpage * len(device_pages)
    for locs in reqs.values():
        allocator.free(torch.tensor(locs))
    assert allocator.hisparse_attn_allocator.available_size() == capacity
    assert not mapping[:-1].any()
    assert (allocator.logical_attn_allocator.full_available_size(), allocator.swa_available_size()) == fresh
