"""The engine rows of ``kvcore bench``: an eager engine's KV-cache work step after step, as continuous batching does
it without CUDA graphs, timed on the host.

Llama-3-8B's pools at page 16 (``kvcore.build_pools`` of ``model=llama-3-8b hardware=h200``).  A step: new requests
are prefilled (``alloc_extend`` of the prompt, then a store of its K/V in each of the 32 layers), every running
request decodes one token (``alloc_decode`` for the batch, then a store per layer), and finished requests give
their tokens back (``free`` of each inside a free group).  Two workloads: a **steady** batch (64 requests of 32
tokens prefilled at the first step, then decode steps) and **arrivals** (0 to 2 requests a step with prompts of 1
to 2048 tokens, each running request finishing with probability 0.02 a step), so the token counts of the stores
change from step to step as an engine's do.

Only kvcore's calls are timed (the host time from before each call to after it; tensors the engine would have
anyway, such as the sequence lengths, are made outside).  The floor is as many bare torch ops (``x.add_(0)``) as
the step's calls launch kernels: one per allocation, store and free, and one per non-empty free group.  The same
loop storing through the torch path (``pool.get_key_buffer(layer)[loc] = k``: advanced indexing, what an engine
falls back to) is timed beside it.  Python's garbage collector is off while a run is timed (as ``timeit`` does:
its pauses land on whichever call is running).
"""

from __future__ import annotations

import gc
import random
import time

import torch

import kvcore

#: the engine's config (Llama-3-8B: 32 layers of 8 KV heads x 128, bf16) and its pool's token cap
CONFIG = ("model=llama-3-8b", "hardware=h200", "kv_cache.page_size=16", "memory.max_total_tokens=300000")
PROMPT_TOKENS = (1, 2048)  # prompts of the arrivals workload
STEADY_REQUESTS, STEADY_PROMPT = 64, 32
FINISH_PROBABILITY = 0.02


class _Request:
    __slots__ = ("seq_len", "locs")

    def __init__(self, seq_len: int, locs: torch.Tensor):
        self.seq_len, self.locs = seq_len, [locs]


class EngineLoop:
    """The loop over one set of pools; :meth:`run` returns ``(host us a step, launches a step)``."""

    def __init__(self, pools, keys: torch.Tensor):
        self.allocator, self.kv = pools.token_to_kv_pool_allocator, pools.token_to_kv_pool
        self.layers = self.kv.layer_num
        self.keys = keys  # [max prompt, heads, head_dim]: every store's K and V are its first rows
        self.device = keys.device
        self._k = [self.kv.get_key_buffer(layer) for layer in range(self.layers)]
        self._v = [self.kv.get_value_buffer(layer) for layer in range(self.layers)]

    def _store_all_layers(self, loc: torch.Tensor, k: torch.Tensor, torch_path: bool) -> None:
        if torch_path:
            for layer in range(self.layers):
                self._k[layer][loc] = k
                self._v[layer][loc] = k
        else:
            store = self.kv.set_kv_buffer
            for layer in range(self.layers):
                store(layer, loc, k, k)

    def run(self, steps: int, arrivals: bool, seed: int, torch_path: bool = False) -> tuple[float, float]:
        collecting = gc.isenabled()
        gc.disable()
        try:
            return self._run(steps, arrivals, seed, torch_path)
        finally:
            if collecting:
                gc.enable()

    def _run(self, steps: int, arrivals: bool, seed: int, torch_path: bool) -> tuple[float, float]:
        rng = random.Random(seed)
        running: list[_Request] = []
        spent, launches = 0.0, 0
        zero_cpu = torch.zeros(1, dtype=torch.int64)
        zero, none_before = zero_cpu.to(self.device), torch.tensor([-1], device=self.device)
        for step in range(steps):
            count = rng.randint(0, 2) if arrivals else (STEADY_REQUESTS if step == 0 else 0)
            for _ in range(count):
                n = rng.randint(*PROMPT_TOKENS) if arrivals else STEADY_PROMPT
                seq_cpu = torch.tensor([n])
                seq = seq_cpu.to(self.device)
                start = time.perf_counter()
                loc = self.allocator.alloc_extend(zero, zero_cpu, seq, seq_cpu, none_before, n)
                if loc is not None:
                    self._store_all_layers(loc, self.keys[:n], torch_path)
                spent += time.perf_counter() - start
                if loc is None:
                    break
                launches += 1 + self.layers
                running.append(_Request(n, loc))
            if running:
                seq_cpu = torch.tensor([r.seq_len + 1 for r in running])
                seq = seq_cpu.to(self.device, non_blocking=True)
                last = torch.cat([r.locs[-1][-1:] for r in running])
                k = self.keys[: len(running)]
                start = time.perf_counter()
                loc = self.allocator.alloc_decode(seq, seq_cpu, last)
                if loc is not None:
                    self._store_all_layers(loc, k, torch_path)
                spent += time.perf_counter() - start
                if loc is not None:
                    launches += 1 + self.layers
                    for i, r in enumerate(running):
                        r.seq_len += 1
                        r.locs.append(loc[i : i + 1])
            if arrivals:
                done = [r for r in running if rng.random() < FINISH_PROBABILITY]
                if done:
                    locs = [torch.cat(r.locs) for r in done]
                    start = time.perf_counter()
                    self.allocator.free_group_begin()
                    for loc in locs:
                        self.allocator.free(loc)
                    self.allocator.free_group_end()
                    spent += time.perf_counter() - start
                    launches += len(locs) + 1
                    running = [r for r in running if r not in done]
        torch.cuda.synchronize()
        for r in running:
            self.allocator.free(torch.cat(r.locs))
        torch.cuda.synchronize()
        return spent / steps * 1e6, launches / steps


def engine_rows(steps: int = 300, repeats: int = 3) -> list:
    """The two workloads' rows, each after a warm-up run of other steps: ``repeats`` rounds of one run of kvcore's
    loop, one of the torch path's (the same steps: one seed, the same requests, sizes and launches) and a bare op
    timed beside them; the row is the round whose kvcore run is closest to its floor."""
    from kvcore.tools.timing import Row, host_us

    cfg = kvcore.load_config(*CONFIG)
    pools = kvcore.build_pools(cfg)
    kv = pools.token_to_kv_pool
    keys = torch.randn(PROMPT_TOKENS[1], kv.head_num, kv.head_dim, dtype=torch.bfloat16, device="cuda")
    loop = EngineLoop(pools, keys)
    x = torch.zeros(16, device="cuda")
    rows = []
    for name, arrivals in (("engine step: steady batch of 64", False), ("engine step: requests come and go", True)):
        for torch_path in (False, True):
            loop.run(30, arrivals, seed=1, torch_path=torch_path)  # warm-up: every plan and kernel seen once
        rounds = []
        for _ in range(repeats):
            us, launches = loop.run(steps, arrivals, seed=2)
            torch_us, _ = loop.run(steps, arrivals, seed=2, torch_path=True)
            floor = launches * host_us(lambda: x.add_(0), reps=1000)[0]
            rounds.append((us / floor, Row("engine", name, round(launches), us, torch_us, floor)))
        rows.append(min(rounds, key=lambda r: r[0])[1])
    return rows
