"""HiSparse DSA (kvcore_dsa.hisparse): a device of ``size`` slots for ``size * host_to_device_ratio`` logical tokens,
every token's latent rows in the host mirror.  The plan counts the device slots' rows and every logical token's
indexer keys, to the byte; requests are written hot, backed up, made cold, their device pages reused by others,
brought back in one gather from the host and read back byte for byte; the row copy between a host and a device
buffer matches torch's; the kit runs on the pool."""

from __future__ import annotations

import pytest
import torch
from kvcore_dsa.hisparse import HiSparseDSATokenToKVPool, HiSparseTokenToKVPoolAllocator

import kvcore
from kvcore.errors import ConfigError
from kvcore.kernels.row_move import copy_rows
from kvcore.testing import KVCacheConformance, Variant
from kvcore.testing.tensors import compiled, test_device

DSV32 = ["model=deepseek-v3.2", "hardware=cpu", "memory.budget_gib=4", "parallel.tp_size=1"]
ROW, INDEX_PAGE = 656, 64 * 128 + 64 * 4  # DeepSeek-V3.2's fp8 row; an fp8 indexer page of 64 keys and scales


@pytest.mark.parametrize("ratio", [2, 4])
def test_the_plan_counts_device_rows_and_every_tokens_indexer_keys(ratio):
    plan = kvcore.plan_memory(kvcore.load_config(*DSV32, f"kv_cache.options.host_to_device_ratio={ratio}"))
    assert plan.layout.bytes_per_token == 61 * (ROW + ratio * INDEX_PAGE / 64)
    size = plan.max_total_num_tokens
    pages = (ratio * size + 64 + 1) // 64  # SGLang's indexer pages for size * ratio tokens
    assert plan.kv_cache_bytes == 61 * ((size + 64) * ROW + pages * INDEX_PAGE)
    pools = kvcore.build_pools(kvcore.load_config(*DSV32, f"kv_cache.options.host_to_device_ratio={ratio}",
                                                  "memory.max_total_tokens=1024"))  # fmt: skip
    pool, allocator = pools.token_to_kv_pool, pools.token_to_kv_pool_allocator
    assert isinstance(pool, HiSparseDSATokenToKVPool) and isinstance(allocator, HiSparseTokenToKVPoolAllocator)
    assert sum(b.nbytes for b in pool.buffers().values()) == pools.plan.kv_cache_bytes
    assert allocator.size_full == ratio * 1024 and allocator.available_size() == 1024
    assert pool.host_kv_cache.shape == (61, ratio * 1024 + 64, 1, ROW)


def _build(kernels: str, size: int = 256, ratio: int = 2):
    dev = test_device()
    pool = HiSparseDSATokenToKVPool(size, 64, 128, torch.float8_e4m3fn, 64, 2, dev, 128, False,
                                    host_to_device_ratio=ratio, kernels=kernels)  # fmt: skip
    return pool, HiSparseTokenToKVPoolAllocator(size, 64, torch.float8_e4m3fn, dev, pool, host_to_device_ratio=ratio,
                                                kernels=kernels)  # fmt: skip


def _extend(allocator, n: int):
    dev = test_device()
    zero, seq = torch.zeros(1, dtype=torch.int64), torch.tensor([n])
    return allocator.alloc_extend(zero.to(dev), zero, seq.to(dev), seq, torch.tensor([-1], device=dev), n)


def _fill(pool, loc: torch.Tensor, seed: int):
    """Latent rows and indexer keys of ``loc`` in both layers; returns what reads give back for them."""
    gen = torch.Generator().manual_seed(seed)
    n, dev = loc.numel(), loc.device
    for layer in range(2):
        pool.set_mla_kv_buffer(layer, loc, torch.randn((n, 1, 128), generator=gen).to(dev),
                               torch.randn((n, 1, 64), generator=gen).to(dev))  # fmt: skip
        keys = (torch.randn((n, 128), generator=gen) * 4).to(torch.float8_e4m3fn).to(dev)
        pool.set_index_k_scale_buffer(layer, loc, keys, (torch.rand((n,), generator=gen) + 0.5).to(dev))
    return _read(pool, loc)


def _read(pool, loc):
    return [torch.cat(pool.get_mla_kv_buffer(layer, loc, torch.float32), -1) for layer in range(2)], [
        pool.get_index_k_continuous(layer, loc.numel(), torch.unique(loc // 64)).clone() for layer in range(2)]


@pytest.mark.parametrize("kernels", ["native", "triton"])
def test_cold_tokens_come_back_from_the_host_byte_for_byte(kernels):
    pool, allocator = _build(kernels)  # 256 device slots (4 pages), 512 logical tokens
    first = _extend(allocator, 128)
    want = _fill(pool, first, 1)
    pool.backup_to_host(first)
    allocator.free_hisparse(first)  # cold: its device pages back, its rows on the host
    assert allocator.available_size() == 256 and bool((pool.translate_loc_to_hisparse_device(first) == 0).all())
    second = _extend(allocator, 192)  # takes device pages first's rows were on
    other = _fill(pool, second, 2)
    assert allocator.available_size() == 64 and allocator.logical_attn_allocator.available_size() == 192
    slots = allocator.load_to_device(first[:64])  # one page's worth brought back
    assert slots is not None and allocator.load_to_device(first[64:]) is None  # no device page left for the rest
    hot = pool.translate_loc_to_hisparse_device(torch.cat([second, first[:64]]))
    assert hot.unique().numel() == hot.numel() and bool((hot >= 64).all()), "two hot tokens on one device slot"
    got = _read(pool, first[:64])
    assert all(torch.equal(g, w[:64]) for g, w in zip(got[0], want[0]))  # latent rows from the host
    assert all(torch.equal(g.view(torch.uint8), w.view(torch.uint8)) for g, w in zip(_read(pool, second)[0], other[0]))
    # the indexer keeps every logical token on the device: the cold ones' keys never left
    cold_keys = [pool.get_index_k_continuous(layer, 64, torch.unique(first[64:] // 64)) for layer in range(2)]
    assert all(torch.equal(g.view(torch.uint8), w[64:].view(torch.uint8)) for g, w in zip(cold_keys, want[1]))
    allocator.free(first)
    allocator.free(second)
    assert allocator.available_size() == 256 and allocator.logical_attn_allocator.available_size() == 512


def test_refusals_name_the_keyword():
    with pytest.raises(ConfigError, match="host_to_device_ratio"):
        HiSparseDSATokenToKVPool(128, 64, 128, torch.bfloat16, 64, 2, "cpu", 128, False, host_to_device_ratio=1)
    with pytest.raises(ConfigError, match="index_kpool"):
        HiSparseDSATokenToKVPool(128, 64, 128, torch.bfloat16, 64, 2, "cpu", 128, False, index_kpool=2)
    with pytest.raises(ConfigError, match="host_to_device_ratio=2 .* parallel.cp_size=2"):
        kvcore.plan_memory(kvcore.load_config(*DSV32, "kv_cache.options.host_to_device_ratio=2", "parallel.cp_size=2"))


@pytest.mark.parametrize("n", [1, 7, 130])
def test_a_row_copy_between_host_and_device_buffers_matches_torch(n):
    """``copy_rows`` from a (pinned, on a GPU) host buffer into a device one and back, every layer, random rows."""
    gen = torch.Generator().manual_seed(n)
    dev = test_device()
    pinned = compiled() and torch.cuda.is_available()
    host = torch.randint(0, 256, (3, 300, 1, 40), dtype=torch.uint8, generator=gen)
    host = host.pin_memory() if pinned else host
    device_rows = torch.zeros((3, 200, 1, 40), dtype=torch.uint8, device=dev)
    src, dst = torch.randperm(300, generator=gen)[:n], torch.randperm(200, generator=gen)[:n]
    copy_rows(host, device_rows, src.to(dev), dst.to(dev))
    want = torch.zeros_like(device_rows)
    want[:, dst.to(dev)] = host[:, src].to(dev)
    assert torch.equal(device_rows, want)
    back = torch.zeros(host.shape, dtype=host.dtype, pin_memory=pinned)
    copy_rows(device_rows, back, dst.to(dev), src.to(dev))
    if pinned:
        torch.cuda.synchronize()  # the kernel writes the host rows asynchronously
    assert torch.equal(back[:, src], host[:, src]) and int(back.count_nonzero()) == int(back[:, src].count_nonzero())
    if pinned:  # pageable host memory cannot be read by a kernel: refused, naming it
        with pytest.raises(ValueError, match="pageable host memory"):
            copy_rows(device_rows, torch.zeros(host.shape, dtype=host.dtype), dst.to(dev), src.to(dev))


class TestHiSparseConformance(KVCacheConformance):
    """The kit on a HiSparse pool: its tokens are logical ones, hot through the allocator's map."""

    backend = "dsa"
    config = ["model=deepseek-v3.2", "model.num_hidden_layers=2", "model.mla.kv_lora_rank=256", "parallel.tp_size=1",
              "kv_cache.options.host_to_device_ratio=2"]  # fmt: skip
    variants = [Variant("float8_e4m3fn", "triton", 64), Variant("float8_e4m3fn", "native", 64)]

    @pytest.fixture
    def kv_pool_size(self):
        return 3 * 64


def test_decode_steps_take_logical_tokens_only_and_device_buffers_follow_sglang():
    """As SGLang's allocator: a prefill's tokens are hot, a decode step's are logical only (no device slot), and a
    request's device buffer keeps the first slots it holds (the rest back) or tops them up to whole pages."""
    pool, allocator = _build("native")  # 256 device slots (4 pages), 512 logical tokens
    dev = test_device()
    first = _extend(allocator, 100)  # two device pages
    assert allocator.hisparse_attn_allocator.available_size() == 128
    seq = torch.tensor([101])
    step = allocator.alloc_decode(seq.to(dev), seq, first[-1:])
    assert step.numel() == 1 and int(allocator.full_to_hisparse_device_index_mapping[step]) == 0
    assert allocator.hisparse_attn_allocator.available_size() == 128
    held = allocator.full_to_hisparse_device_index_mapping[first].clone()
    buffer = allocator.alloc_device_buffer(torch.cat([first, step]), 64)
    assert torch.equal(buffer, held[:64]) and not allocator.full_to_hisparse_device_index_mapping[first].any()
    assert allocator.hisparse_attn_allocator.available_size() == 192  # the second page back
    buffer = allocator.alloc_device_buffer(first[:10], 128)  # nothing held any more: two new pages
    assert buffer.numel() == 128 and allocator.hisparse_attn_allocator.available_size() == 64
    with pytest.raises(ValueError, match="whole pages"):
        allocator.alloc_device_buffer(first, 65)
    allocator.configure_spec_scratch(128, device_buffer_size=192)
    assert allocator.request_slot_reserve(has_req_pool_slot=False, prefill_tokens=100) == 64 + 128
    assert allocator.request_slot_reserve(has_req_pool_slot=True, prefill_tokens=300) == 0
    with pytest.raises(ValueError, match="multiples of page_size"):
        allocator.configure_spec_scratch(10)


def test_random_request_lifetimes_keep_both_sides_consistent():
    """Prefills, chunked extensions, then decode steps, frees in any order; after every step no logical token or device
    slot is held twice, every prefilled token sits on a device slot at its own offset in a device page of its
    request's own, the device side's free slots are its capacity less the pages in use, and at the end all is free."""
    import random

    pool, allocator = _build("native")
    dev = test_device()
    mapping = allocator.full_to_hisparse_device_index_mapping
    page, capacity = allocator.page_size, allocator.hisparse_attn_allocator.available_size()
    rng = random.Random(7)
    reqs: dict[int, list[int]] = {}
    prefilled: dict[int, int] = {}  # tokens placed by alloc_extend (hot)
    decoding: set[int] = set()
    for step in range(200):
        op = rng.random()
        if op < 0.3 or not reqs:
            rid, prefix, n = step, 0, rng.randint(1, 100)
        elif op < 0.5:
            rid = rng.choice([r for r in reqs if r not in decoding] or [None])
            if rid is None:
                continue
            prefix, n = len(reqs[rid]), rng.randint(1, 70)
        elif op < 0.8:
            ids = rng.sample(sorted(reqs), min(len(reqs), 2))
            seq = torch.tensor([len(reqs[i]) + 1 for i in ids])
            out = allocator.alloc_decode(seq.to(dev), seq, torch.tensor([reqs[i][-1] for i in ids], device=dev))
            if out is not None:
                for i, loc in zip(ids, out.tolist()):
                    reqs[i].append(loc)
                    decoding.add(i)
            continue
        else:
            rid = rng.choice(sorted(reqs))
            locs = reqs.pop(rid)
            prefilled.pop(rid, None)
            decoding.discard(rid)
            rng.shuffle(locs)
            allocator.free(torch.tensor(locs, device=dev))
            continue
        p, q = torch.tensor([prefix]), torch.tensor([prefix + n])
        last = torch.tensor([reqs[rid][-1] if prefix else -1], device=dev)
        out = allocator.alloc_extend(p.to(dev), p, q.to(dev), q, last, n)
        if out is not None:
            reqs.setdefault(rid, []).extend(out.tolist())
            prefilled[rid] = prefix + n
        held = [loc for locs in reqs.values() for loc in locs]
        assert len(held) == len(set(held)) and min(held, default=page) >= page
        pages: dict[int, int] = {}
        for r, locs in reqs.items():
            hot = locs[: prefilled.get(r, 0)]
            slots = mapping[torch.tensor(hot, dtype=torch.long, device=dev)].tolist()
            assert all(s >= page and s % page == t % page for t, s in zip(hot, slots)), (step, r)
            for s in slots:
                assert pages.setdefault(s // page, r) == r, f"device page {s // page} shared"
            cold = locs[prefilled.get(r, 0) :]
            assert not mapping[torch.tensor(cold, dtype=torch.long, device=dev)].any()
        assert allocator.hisparse_attn_allocator.available_size() == capacity - page * len(pages)
    for locs in reqs.values():
        allocator.free(torch.tensor(locs, device=dev))
    assert allocator.hisparse_attn_allocator.available_size() == capacity and not mapping[:-1].any()
    assert allocator.logical_attn_allocator.available_size() == 512
