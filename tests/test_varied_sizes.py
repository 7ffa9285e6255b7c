"""Call plans at changing token counts, as an engine's prefill sizes and decode batches change from step to step:
every hot path keeps one plan per size class (the power of two a count rounds up to), not per count, so a run of
calls with a new count each plans at most once per class; every call of a class writes and reads what the torch
path does; a call whose tensors disagree on the count is refused after good calls of its class as it is without
them, and leaves the class's plan in place.

Pools run their Triton kernels (interpreted on the CPU, compiled on CUDA with KVCORE_TEST_COMPILED=1)."""

from __future__ import annotations

import random

import pytest
import torch

from kvcore.testing.tensors import bits_equal, test_device
from kvcore_dsa.pool import DSATokenToKVPool
from kvcore_fp4.pool import MHATokenToKVPoolFP4
from kvcore_mha.page_major import PageMajorMHATokenToKVPool
from kvcore_mha.pool import MHATokenToKVPool
from kvcore_mla.pool import MLATokenToKVPool

DEVICE = test_device()
SIZE = 128  # tokens of every pool
COUNTS = [37, 5, 1, 20, 33, 6, 3, 2, 17, 64, 7, 40, 4, 63, 9, 2, 1, 48]  # a new count nearly every call
#: fewer counts for the families whose kernels the interpreter runs slowest (still several counts sharing a size
#: class: 37, 64 and 40; 5 and 6)
SHORT_COUNTS = [37, 5, 1, 20, 3, 2, 64, 6, 40, 1]
SLOW = {"nvfp4"}


def _classes(counts) -> int:
    """Distinct size classes of ``counts`` (the power of two each rounds up to)."""
    return len({(n - 1).bit_length() for n in counts})


def _common(kernels):
    return dict(device=DEVICE, enable_memory_saver=False, kernels=kernels)


POOLS = {
    "mha": lambda k: MHATokenToKVPool(size=SIZE, page_size=1, dtype=torch.bfloat16, head_num=2, head_dim=16,
                                      layer_num=2, **_common(k)),
    "mha fp8": lambda k: MHATokenToKVPool(size=SIZE, page_size=1, dtype=torch.float8_e4m3fn, head_num=2, head_dim=16,
                                          layer_num=2, **_common(k)),
    "page-major": lambda k: PageMajorMHATokenToKVPool(size=SIZE, page_size=8, dtype=torch.bfloat16, head_num=2,
                                                      head_dim=16, layer_num=2, **_common(k)),
    "mla": lambda k: MLATokenToKVPool(size=SIZE, page_size=1, dtype=torch.bfloat16, kv_lora_rank=64,
                                      qk_rope_head_dim=16, layer_num=2, **_common(k)),
    "dsa": lambda k: DSATokenToKVPool(size=SIZE, page_size=64, kv_lora_rank=512, dtype=torch.float8_e4m3fn,
                                      qk_rope_head_dim=64, layer_num=2, index_head_dim=128, **_common(k)),
    "nvfp4": lambda k: MHATokenToKVPoolFP4(size=SIZE, page_size=1, dtype=torch.bfloat16, head_num=2, head_dim=32,
                                           layer_num=2, kv_format="nvfp4", **_common(k)),
}  # fmt: skip


def _planners(pool) -> list[dict]:
    """The plan memos of a pool's hot paths."""
    found = []
    for name in ("_store", "_rows", "_scaled", "_indexer"):
        obj = getattr(pool, name, None)
        if obj is not None:
            found += [memo for attr, memo in vars(obj).items() if attr.endswith("plans")]
    assert found, "the pool's hot paths keep no plans here: this test names the wrong attributes"
    return found


def _rand(g, *shape, dtype=torch.bfloat16):
    return (torch.randn(*shape, generator=g) * 2).to(dtype).to(DEVICE)


def _calls(family: str, pool, g, n: int, layer: int):
    """The hot-path calls of ``family`` for ``n`` tokens: (what, call) pairs, each returning what it read (or
    None for a write)."""
    loc = (torch.randperm(SIZE - 1, generator=g)[:n] + 1).to(DEVICE)
    if family in ("mha", "mha fp8", "page-major", "nvfp4"):
        heads, dim = (2, 32) if family == "nvfp4" else (2, 16)
        k, v = _rand(g, n, heads, dim), _rand(g, n, heads, dim)
        calls = [("set_kv_buffer", lambda: pool.set_kv_buffer(layer, loc, k, v))]
        if family == "nvfp4":
            out = tuple(torch.empty(n, heads, dim, dtype=torch.bfloat16, device=DEVICE) for _ in range(2))
            calls += [("get_kv_buffer_by_loc", lambda: pool.get_kv_buffer_by_loc(layer, loc)),
                      ("get_kv_buffer_by_loc out=", lambda: pool.get_kv_buffer_by_loc(layer, loc, out=out))]
        return calls
    rank, rope = (64, 16) if family == "mla" else (512, 64)
    nope, rope_part = _rand(g, n, 1, rank), _rand(g, n, 1, rope)
    out = (torch.empty(n, 1, rank, dtype=torch.bfloat16, device=DEVICE),
           torch.empty(n, 1, rope, dtype=torch.bfloat16, device=DEVICE))  # fmt: skip
    calls = [("set_mla_kv_buffer", lambda: pool.set_mla_kv_buffer(layer, loc, nope, rope_part)),
             ("get_mla_kv_buffer", lambda: pool.get_mla_kv_buffer(layer, loc)),
             ("get_mla_kv_buffer out=", lambda: pool.get_mla_kv_buffer(layer, loc, out=out))]  # fmt: skip
    if family == "mla":
        latent = _rand(g, n, 1, rank + rope)
        calls.append(("set_kv_buffer (whole rows)", lambda: pool.set_kv_buffer(layer, loc, latent, None)))
    else:
        keys = torch.randint(0, 256, (n, 128), generator=g, dtype=torch.uint8).to(DEVICE)
        scales = torch.rand(n, generator=g).to(DEVICE)
        pages = torch.tensor([1, 0], device=DEVICE)
        calls += [("set_index_k_scale_buffer", lambda: pool.set_index_k_scale_buffer(layer, loc, keys, scales)),
                  ("get_index_k_scale_buffer", lambda: pool.get_index_k_scale_buffer(layer, n, pages))]
    return calls


@pytest.mark.parametrize("family", list(POOLS))
def test_a_new_count_every_call_plans_once_per_size_class_and_matches_the_torch_path(family):
    fast, ref = POOLS[family]("triton"), POOLS[family]("native")
    for pool in (fast, ref):  # the same contents in both
        for buf in pool.buffers().values():
            buf.view(torch.uint8).copy_(torch.randint(0, 256, buf.view(torch.uint8).shape, dtype=torch.uint8,
                                                      generator=torch.Generator().manual_seed(1)).to(DEVICE))
        if getattr(pool, "global_scale", None) is not None:
            pool.global_scale.fill_(1.0)
    counts = SHORT_COUNTS if family in SLOW else COUNTS
    for step, n in enumerate(counts):
        layer = step % 2
        mine = _calls(family, fast, torch.Generator().manual_seed(step), n, layer)
        theirs = _calls(family, ref, torch.Generator().manual_seed(step), n, layer)
        for (what, call), (_, reference) in zip(mine, theirs):
            got, want = call(), reference()
            if got is not None:
                assert all(bits_equal(a, b) for a, b in zip(got, want)), f"{what} at N={n} (call {step})"
            assert all(bits_equal(a, b) for a, b in zip(fast.buffers().values(), ref.buffers().values())), (
                f"{what} at N={n} (call {step})")
    classes, signatures = _classes(counts), len(mine)  # each call has one signature a size class
    for memo in _planners(fast):
        assert len(memo) <= signatures * classes, f"{len(memo)} plans for {classes} size classes: a plan per count"


@pytest.mark.parametrize("family", ["mha", "mla", "dsa", "nvfp4"])
def test_a_count_mismatch_is_refused_after_good_calls_of_its_class_and_keeps_their_plan(family):
    """Counts 5 and 7 share a size class: after good calls of 5 tokens, 7 locations with rows of 6 are refused
    as by a pool that never planned, and the next good call of 7 tokens still writes what the torch path does."""
    fast, ref, fresh = POOLS[family]("triton"), POOLS[family]("native"), POOLS[family]("triton")
    g = torch.Generator().manual_seed(3)
    loc5, loc7 = (torch.randperm(SIZE - 1, generator=g)[:7] + 1).to(DEVICE)[:5], (torch.arange(7) + 10).to(DEVICE)
    if family in ("mha", "nvfp4"):
        dim = 32 if family == "nvfp4" else 16
        k5, k6, k7 = (_rand(g, n, 2, dim) for n in (5, 6, 7))

        def write(pool, loc, k):
            pool.set_kv_buffer(0, loc, k, k)
    else:
        rank, rope = (64, 16) if family == "mla" else (512, 64)
        k5, k6, k7 = ((_rand(g, n, 1, rank), _rand(g, n, 1, rope)) for n in (5, 6, 7))

        def write(pool, loc, k):
            pool.set_mla_kv_buffer(0, loc, *k)
    write(fast, loc5, k5)
    write(fast, loc5, k5)
    messages = []
    for pool in (fast, fresh):
        with pytest.raises(ValueError) as refused:
            write(pool, loc7, k6)
        messages.append(str(refused.value))
    assert messages[0] == messages[1]
    for pool in (fast, ref):
        write(pool, loc7, k7)
    rows = fast.token_rows()
    reference = ref.token_rows()
    assert all(bits_equal(rows[b].take(loc7), reference[b].take(loc7)) for b in rows)


def test_a_long_run_of_counts_keeps_the_plans_of_its_size_classes():
    """Hundreds of calls, each of a new count from 1 to 4096: the MHA store plans once per size class (13),
    never again, and the memo never empties (the plans in use stay)."""
    if DEVICE != "cuda":
        counts = [random.Random(5).randint(1, 300) for _ in range(60)]  # interpreted: small sizes
    else:
        counts = [random.Random(5).randint(1, 4096) for _ in range(400)]
    pool = MHATokenToKVPool(size=max(counts) + 1, page_size=1, dtype=torch.bfloat16, head_num=2, head_dim=16, layer_num=1,
                            **_common("triton"))  # fmt: skip
    k = _rand(torch.Generator().manual_seed(0), max(counts), 2, 16)
    loc = torch.arange(1, max(counts) + 1, device=DEVICE)
    planned = []
    for n in counts:
        pool.set_kv_buffer(0, loc[:n], k[:n], k[:n])
        planned.append(len(pool._store._plans))
    assert planned[-1] == _classes(counts)
    assert planned == sorted(planned), "plans were forgotten and made again"
    assert bits_equal(pool.k_cache[0, 1 : max(counts) + 1], k)
