"""The block-scaled family's cases for ``kvcore bench`` (the ``kvcore_bench_cases`` hook of
:mod:`kvcore_fp4.plugin`).

Llama-3-8B's rows (8 KV heads x 128, 2 layers) as nvfp4 codes: the store that quantizes bf16 K and V, and the
gather that dequantizes the rows asked for (returning new tensors, and into given outputs).  The pool holds
``kvcore.tools.bench.POOL_TOKENS`` tokens on the CUDA device; its per-layer global scales are 1 (a constant, not
random bytes).
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from kvcore.hookspecs import GATHER, INTO, BenchCase, BenchCases, BenchPool
from kvcore.tools.bench import POOL_TOKENS, at_loc, into, locations, rand

HEADS, HEAD_DIM = 8, 128  # Llama-3-8B
#: bytes per token: bf16 K and V (2 bytes a value) on one side, codes and scales (1/2 + 1/16 a value) on the other
NVFP4_BYTES = 2 * HEADS * HEAD_DIM * 41 // 16


def _pool(kernels: str):
    from kvcore_fp4.pool import MHATokenToKVPoolFP4

    return MHATokenToKVPoolFP4(size=POOL_TOKENS, page_size=1, dtype=torch.bfloat16, head_num=HEADS, head_dim=HEAD_DIM,
                               layer_num=2, device="cuda", enable_memory_saver=False, kernels=kernels,
                               kv_format="nvfp4")  # fmt: skip


def _unit_global_scale(pool) -> None:
    if getattr(pool, "global_scale", None) is not None:
        pool.global_scale.fill_(1.0)


def _inputs(n: int, gen: torch.Generator) -> SimpleNamespace:
    return SimpleNamespace(n=n, loc=locations(n, gen), k=rand(gen, n, HEADS, HEAD_DIM), v=rand(gen, n, HEADS, HEAD_DIM))


def bench_cases() -> list[BenchCases]:
    cases = (
        BenchCase(op="nvfp4 set_kv_buffer (quantize)", pool="nvfp4",
                  call=lambda p, x: lambda: p.set_kv_buffer(0, x.loc, x.k, x.v), written=at_loc,
                  bytes_per_token=NVFP4_BYTES),
        BenchCase(op="nvfp4 get_kv_buffer_by_loc", pool="nvfp4",
                  call=lambda p, x: lambda: p.get_kv_buffer_by_loc(0, x.loc), written=GATHER,
                  bytes_per_token=NVFP4_BYTES),
        BenchCase(op="nvfp4 get_kv_buffer_by_loc (out=)", pool="nvfp4",
                  call=lambda p, x: into(p, "get_kv_buffer_by_loc", 0, x.loc, shapes=((x.n, HEADS, HEAD_DIM),) * 2),
                  written=INTO, bytes_per_token=NVFP4_BYTES),
    )  # fmt: skip
    pool = BenchPool(name="nvfp4", make=_pool, prepare=_unit_global_scale)
    return [BenchCases(pools=(pool,), inputs=_inputs, cases=cases)]
