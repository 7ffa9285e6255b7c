"""The sliding-window family's case for ``kvcore bench`` (the ``kvcore_bench_cases`` hook of
:mod:`kvcore_swa.plugin`).

gpt-oss's sliding-window layers (8 KV heads x 64, bf16): the store of K and V into the window, written through a
shuffled full -> window slot map as the family's allocator builds one.  One window layer and one full layer,
``kvcore.tools.bench.POOL_TOKENS`` tokens each, on the CUDA device.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from kvcore.hookspecs import BenchCase, BenchCases, BenchPool
from kvcore.tools.bench import POOL_TOKENS, at_loc, locations, rand

HEADS, HEAD_DIM = 8, 64  # gpt-oss


def _mapped(pool):
    """The pool with a full -> window slot map, shuffled (the same in every process: a fixed seed)."""
    g = torch.Generator().manual_seed(7)
    mapping = torch.cat([torch.zeros(1, dtype=torch.int64), torch.randperm(pool.size_swa, generator=g) + 1])
    pool.register_mapping(mapping.to(pool.device))
    return pool


def _pool(kernels: str):
    from kvcore_swa.pool import SWAKVPool

    return _mapped(SWAKVPool(size=POOL_TOKENS, size_swa=POOL_TOKENS, page_size=1, dtype=torch.bfloat16, head_num=HEADS,
                             head_dim=HEAD_DIM, swa_attention_layer_ids=[0], full_attention_layer_ids=[1],
                             device="cuda", enable_memory_saver=False, kernels=kernels))  # fmt: skip


def _inputs(n: int, gen: torch.Generator) -> SimpleNamespace:
    return SimpleNamespace(loc=locations(n, gen), k=rand(gen, n, HEADS, HEAD_DIM), v=rand(gen, n, HEADS, HEAD_DIM))


def bench_cases() -> list[BenchCases]:
    row_bytes = 2 * 2 * HEADS * HEAD_DIM * 2 + 8  # bf16 K and V in and out, + the map entry read
    case = BenchCase(op="swa set_kv_buffer (window, mapped)", pool="swa",
                     call=lambda p, x: lambda: p.set_kv_buffer(0, x.loc, x.k, x.v), written=at_loc,
                     bytes_per_token=row_bytes)  # fmt: skip
    return [BenchCases(pools=(BenchPool(name="swa", make=_pool),), inputs=_inputs, cases=(case,))]
