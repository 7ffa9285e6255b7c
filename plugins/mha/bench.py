"""The MHA family's cases for ``kvcore bench`` (the ``kvcore_bench_cases`` hook of :mod:`kvcore_mha.plugin`).

Llama-3-8B's rows (8 KV heads x 128, bf16, 32 layers; fp8 at 2 layers), token-major at page 1 and 16 and
page-major at page 16: the store of K and V, and the moves of every layer's rows (``move_kv_cache`` of N // 2
tokens).  Pools hold ``kvcore.tools.bench.POOL_TOKENS`` tokens on the CUDA device.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from kvcore.hookspecs import BenchCase, BenchCases, BenchPool
from kvcore.tools.bench import POOL_TOKENS, at_loc, locations, rand

HEADS, HEAD_DIM = 8, 128  # Llama-3-8B
#: bytes a K/V store reads + writes per token (bf16 K and V in, the same out)
KV_BYTES = 2 * 2 * HEADS * HEAD_DIM * 2


def _pool(kernels: str, *, page_size: int = 1, dtype: torch.dtype = torch.bfloat16, layer_num: int = 32,
          page_major: bool = False):  # fmt: skip
    from kvcore_mha.page_major import PageMajorMHATokenToKVPool
    from kvcore_mha.pool import MHATokenToKVPool

    cls = PageMajorMHATokenToKVPool if page_major else MHATokenToKVPool
    return cls(size=POOL_TOKENS, page_size=page_size, dtype=dtype, head_num=HEADS, head_dim=HEAD_DIM,
               layer_num=layer_num, device="cuda", enable_memory_saver=False, kernels=kernels)  # fmt: skip


def _inputs(n: int, gen: torch.Generator) -> SimpleNamespace:
    loc = locations(n, gen)
    half = max(1, n // 2)
    return SimpleNamespace(loc=loc, k=rand(gen, n, HEADS, HEAD_DIM), v=rand(gen, n, HEADS, HEAD_DIM),
                           tgt=loc[:half], src=loc[n - half :])  # fmt: skip


def _store(p, x):
    return lambda: p.set_kv_buffer(0, x.loc, x.k, x.v)


def _move(p, x):
    return lambda: p.move_kv_cache(x.tgt, x.src)


def _tgt(x):
    return x.tgt


def bench_cases() -> list[BenchCases]:
    pools = (
        BenchPool(name="mha", make=lambda kernels: _pool(kernels)),
        BenchPool(name="mha_page_major", make=lambda kernels: _pool(kernels, page_size=16, page_major=True)),
        BenchPool(name="mha_page16", make=lambda kernels: _pool(kernels, page_size=16)),
        BenchPool(name="mha_fp8", make=lambda kernels: _pool(kernels, dtype=torch.float8_e4m3fn, layer_num=2)),
    )
    cases = (
        BenchCase(op="mha set_kv_buffer bf16", pool="mha", call=_store, written=at_loc, bytes_per_token=KV_BYTES),
        BenchCase(op="mha set_kv_buffer fp8<-bf16", pool="mha_fp8", call=_store, written=at_loc),
        BenchCase(op="move_kv_cache mha 32 layers", pool="mha", call=_move, written=_tgt, move=True),
        BenchCase(op="mha set_kv_buffer bf16, page 16", pool="mha_page16", call=_store, written=at_loc,
                  bytes_per_token=KV_BYTES),
        BenchCase(op="page-major set_kv_buffer bf16, page 16", pool="mha_page_major", call=_store, written=at_loc,
                  bytes_per_token=KV_BYTES + 8),  # + the token -> row map entry
        BenchCase(op="move_kv_cache mha 32 layers, page 16", pool="mha_page16", call=_move, written=_tgt, move=True),
        BenchCase(op="move_kv_cache page-major 32 layers, page 16", pool="mha_page_major", call=_move, written=_tgt,
                  move=True),
    )  # fmt: skip
    return [BenchCases(pools=pools, inputs=_inputs, cases=cases)]
