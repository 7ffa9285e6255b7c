"""What the unified memory costs on the GPU, beside the split pools (``python benchmarks/bench_unified_device.py``).

Qwen3-Next-80B on one GPU (12 full-attention layers of 2 KV heads x 256, 36 gated-DeltaNet layers), bf16, page 16,
a 32 GiB budget (``memory.budget_gib``), built through ``kvcore.build_pools`` with ``memory.unified`` false and true:

- **store**: ``set_kv_buffer`` of one full-attention layer at decode (64 and 256 tokens, one per request) and
  prefill (8192) sizes, inside CUDA-graph replay; the unified pool's tokens are virtual, so its store either looks
  its rows up in the virtual -> physical table (``loc``), or takes the physical tokens the engine translated once
  for the step (``KVWriteLoc(allocator.translate_write_loc(loc), physical=True)``).  Ratio unified / split (target:
  within 10%).  The same for Kimi-Linear-48B's MLA layers (``set_mla_kv_buffer``).
- **translation**: what the decode path adds: ``allocator.translate_write_loc`` of the step's tokens and
  ``translate_mamba_indices`` of its requests' state slots (graph replay).
- **engine loop**: requests arrive (prompts of 1-2048 tokens, a state slot each), decode and finish at random,
  eager, the device waited for at each step (the unified pool's stores take the step's physical tokens): wall us
  per step, split against unified.
- **compaction**: a free leaves holes (compaction is lazy) and ``memory.flush()`` moves the envelopes above them:
  one request of 4096 tokens (256 pages of every full layer) freed below 256 live pages, and a state slot freed below
  255 others (one envelope of every linear layer moves); host time of each call and until the device finished,
  against the copy ceiling for the bytes moved.

Correctness first: the unified store must read back what the split one does.
"""

from __future__ import annotations

import time

import torch

import kvcore
from kvcore.tools.timing import copy_ceiling_gbps, graph_us
from kvcore.pools import KVWriteLoc

MODEL = ["model=qwen3-next-80b", "hardware.device=cuda", "memory.budget_gib=32", "kv_cache.page_size=16",
         "memory.max_running_requests=256"]  # fmt: skip
MLA_MODEL = ["model=kimi-linear-48b", *MODEL[1:]]


def build(unified: bool, model=MODEL):
    cfg = kvcore.load_config(*model, f"memory.unified={str(unified).lower()}")
    return kvcore.build_pools(cfg)


def store_cases(pools, n: int, unified: bool) -> dict:
    """The stores of ``n`` new tokens into one full-attention layer, by name (``loc``; on the unified pool also
    ``physical``: a KVWriteLoc of the step's physical tokens), each checked to read back; and the tokens."""
    pool, alloc = pools.token_to_kv_pool, pools.token_to_kv_pool_allocator
    loc = alloc.alloc(-(-n // 16) * 16)[:n]
    layer = pool.full_attention_layer_ids[0]
    full = pool.full_kv_pool
    where = {"loc": loc}
    if unified:
        where["physical"] = KVWriteLoc(alloc.translate_write_loc(loc), physical=True)
    phys = full.translate_loc(loc) if unified else loc.long()
    cases = {}
    for name, at in where.items():
        if pool.use_mla:
            nope = torch.randn((n, 1, full.kv_lora_rank), device="cuda", dtype=torch.bfloat16)
            rope = torch.randn((n, 1, full.qk_rope_head_dim), device="cuda", dtype=torch.bfloat16)
            fn = (lambda at=at, nope=nope, rope=rope: pool.set_mla_kv_buffer(layer, at, nope, rope))
            want = torch.cat([nope, rope], dim=-1)
        else:
            k = torch.randn((n, pool.head_num, pool.head_dim), device="cuda", dtype=torch.bfloat16)
            fn = (lambda at=at, k=k: pool.set_kv_buffer(layer, at, k, -k))
            want = k
        fn()
        torch.cuda.synchronize()
        keys = pool.get_key_buffer(layer)
        got = keys[phys // 16, phys % 16] if unified else keys[phys]
        assert torch.equal(got.reshape(want.shape), want), f"{name}: the store did not read back at {n} tokens"
        cases[name] = fn
    return cases, loc


def store_table(model, title: str) -> None:
    """Split against unified stores of one full-attention layer of ``model`` (graph replay, us per call)."""
    results = {}
    for unified in (False, True):
        pools = build(unified, model)
        for n in (64, 256, 8192):
            cases, loc = store_cases(pools, n, unified)
            for name, fn in cases.items():
                results[("unified " if unified else "split ") + name, n] = graph_us(fn)
            pools.token_to_kv_pool_allocator.free(loc)
        del pools
        torch.cuda.empty_cache()
    print(f"\n{title}: store of one full-attention layer (graph replay, us per call)")
    print(f"{'tokens':>8} {'split':>9} {'unified loc':>12} {'unified physical':>17} {'loc/split':>10} "
          f"{'physical/split':>15}")
    for n in (64, 256, 8192):
        s, u, p = results[("split loc", n)], results[("unified loc", n)], results[("unified physical", n)]
        print(f"{n:>8} {s:>9.2f} {u:>12.2f} {p:>17.2f} {u / s:>10.2f} {p / s:>15.2f}")


def timed_free(what: str, memory, unit_bytes: int, ceiling: float, free) -> list[tuple]:
    """A free, then the compaction it leaves for later (``memory.flush()``): for each, (what, units moved, bytes
    moved, host us of the call, us until the device is done, fraction of the copy ceiling the moves ran at over the
    whole time)."""
    rows = []
    for name, call in ((f"free {what}", free), ("flush after it", memory.flush)):
        torch.cuda.synchronize()
        moved_before = memory.allocator.moved_units
        start = time.perf_counter()
        call()
        host = time.perf_counter() - start
        torch.cuda.synchronize()
        total = time.perf_counter() - start
        moved = memory.allocator.moved_units - moved_before
        nbytes = moved * unit_bytes
        rows.append((name, moved, nbytes, host * 1e6, total * 1e6, 2 * nbytes / total / 1e9 / ceiling))
    return rows


class _Req:
    """A request as the request table reads it (its kept state slot)."""

    mamba_pool_idx = None


def physical_write_loc(alloc, loc):
    """What an engine passes to the step's stores: a unified pool's physical tokens, translated once, or ``loc``."""
    translate = getattr(alloc, "translate_write_loc", None)
    return loc if translate is None else KVWriteLoc(translate(loc), physical=True)


def engine_loop(pools, steps: int = 300, seed: int = 2) -> tuple[float, float, int]:
    """Continuous batching, eager: each step 0-2 requests arrive with prompts of 1-2048 tokens (a request-table row
    and state slot, ``alloc_extend``, a store per full-attention layer), every running request decodes one token
    (``alloc_decode``, a store per layer), 2% of them finish (their tokens and rows freed).  Returns (wall us per
    step, device waited for at the end of each step; the state slots taken at the peak; steps run)."""
    import random

    rng = random.Random(seed)
    alloc, table, pool = pools.token_to_kv_pool_allocator, pools.req_to_token_pool, pools.token_to_kv_pool
    layers, (h, d) = pool.full_attention_layer_ids, (pool.head_num, pool.head_dim)
    rows = torch.randn((2048, h, d), device="cuda", dtype=torch.bfloat16)
    running, peak, spent = [], 0, 0.0
    zero = torch.zeros(1, dtype=torch.int64)
    torch.cuda.synchronize()
    for _ in range(steps):
        start = time.perf_counter()
        for _ in range(rng.randint(0, 2)):
            n, req = rng.randint(1, 2048), _Req()
            try:
                slot = table.alloc(1, [req])
            except RuntimeError:  # no state slot left: the request waits
                break
            if slot is None:
                break
            seq = torch.tensor([n])
            loc = alloc.alloc_extend(zero.cuda(), zero, seq.cuda(), seq, torch.tensor([-1], device="cuda"), n)
            if loc is None:
                table.free(slot)
                break
            where = physical_write_loc(alloc, loc)
            for layer in layers:
                pool.set_kv_buffer(layer, where, rows[:n], rows[:n])
            running.append([n, slot[0], [loc]])
        if running:
            seq = torch.tensor([r[0] + 1 for r in running])
            last = torch.cat([r[2][-1][-1:] for r in running])
            loc = alloc.alloc_decode(seq.cuda(), seq, last)
            if loc is not None:
                where = physical_write_loc(alloc, loc)
                for layer in layers:
                    pool.set_kv_buffer(layer, where, rows[: loc.numel()], rows[: loc.numel()])
                for i, r in enumerate(running):
                    r[0] += 1
                    r[2].append(loc[i : i + 1])
        done = [r for r in running if rng.random() < 0.02]
        for r in done:
            alloc.free(torch.cat(r[2]))
            table.free(r[1])
        running = [r for r in running if r not in done]
        torch.cuda.synchronize()
        spent += time.perf_counter() - start
        peak = max(peak, len(running))
    for r in running:
        alloc.free(torch.cat(r[2]))
        table.free(r[1])
    return spent / steps * 1e6, peak, steps


def main() -> None:
    ceiling = copy_ceiling_gbps()
    print(f"{torch.cuda.get_device_name()}: device copy ceiling {ceiling:.0f} GB/s (read + write)")
    rows = []
    results = {}
    for unified in (False, True):
        pools = build(unified)
        name = "unified" if unified else "split"
        engine_loop(pools, steps=30, seed=1)  # warm
        results[(name, "loop")] = engine_loop(pools)
        for n in (64, 256):
            cases, loc = store_cases(pools, n, unified)
            results[(name, n)] = graph_us(cases["loc"])
            pools.token_to_kv_pool_allocator.free(loc)
        if unified:
            pool, table = pools.token_to_kv_pool, pools.req_to_token_pool
            states, alloc = pool.mamba_pool, pools.token_to_kv_pool_allocator
            slots = states.alloc(256)
            for bs in (64, 256):
                locs = torch.randint(16, 16 * 1000, (bs,), device="cuda")
                ids = slots[:bs].to(torch.int32)
                results[("translate_loc", bs)] = graph_us(lambda: alloc.translate_write_loc(locs))
                results[("translate_mamba", bs)] = graph_us(lambda: table.translate_mamba_indices(ids))
            alloc, memory = pools.token_to_kv_pool_allocator, states.memory
            first = alloc.alloc(4096)
            rest = alloc.alloc(4096)
            rows += timed_free("4096 tokens below 4096 live", memory, memory.low_unit, ceiling,
                               lambda: alloc.free(first))  # the 256 pages above move down into its place
            alloc.free(rest)
            rows += timed_free("1 state slot below 255 live", memory, memory.high_unit, ceiling,
                               lambda: states.free(slots[:1]))  # the topmost envelope moves into its place
            states.free(slots[1:])
            torch.cuda.synchronize()
            start = time.perf_counter()
            one = states.alloc(1)  # its 37 MiB envelope zeroed
            host = time.perf_counter() - start
            torch.cuda.synchronize()
            results["alloc_state"] = (host * 1e6, (time.perf_counter() - start) * 1e6)
            states.free(one)
        del pools
        torch.cuda.empty_cache()
    store_table(MODEL, "Qwen3-Next-80B (MHA, 2 KV heads x 256)")
    store_table(MLA_MODEL, "Kimi-Linear-48B (MLA, 512 + 64)")
    print("\nengine loop (Qwen3-Next, page 16, churning requests with prompts of 1-2048 tokens, eager), wall us per "
          "step, device waited for each step")
    for name in ("split", "unified"):
        us, peak, steps = results[(name, "loop")]
        print(f"  {name:>8}: {us:.0f} us per step over {steps} steps, {peak} requests running at the peak")
    print("\ndecode-path translation (graph replay, us per call)")
    for bs in (64, 256):
        print(f"  batch {bs:>3}: translate_write_loc {results[('translate_loc', bs)]:.2f}, translate_mamba_indices "
              f"{results[('translate_mamba', bs)]:.2f}; the split store of {bs} tokens {results[('split', bs)]:.2f}")
    print("\nfrees and compaction (host us of the call, us until the device finished, moved units and bytes, "
          "fraction of the copy ceiling)")
    print(f"  alloc of 1 state slot (its envelope zeroed): host {results['alloc_state'][0]:.0f} us, total "
          f"{results['alloc_state'][1]:.0f} us")
    for what, units, nbytes, host, total, frac in rows:
        print(f"  {what}: {units} units, {nbytes / 2**20:.1f} MiB, host {host:.0f} us, total {total:.0f} us, "
              f"{frac:.2f} of the ceiling")


if __name__ == "__main__":
    main()
