"""DeepSeek-V4's cases for ``kvcore bench`` (the ``kvcore_bench_cases`` hook of :mod:`kvcore_dsv4.plugin`).

A pool of three layers, one of each kind (window only, ratio 4, ratio 128), with DeepSeek-V4-Flash's latent (448
nope + 64 rope) and indexer key (128) and SGLang's 256-token pages; every buffer holds ``POOL_TOKENS`` slots, so
the drawn locations address window, compressed and indexer slots alike.  Each store quantizes bf16 inputs: a
latent reads 1024 bytes and writes 584, an indexer key reads 256 and writes 132.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from kvcore.hookspecs import STATE, BenchCase, BenchCases, BenchPool
from kvcore.tools.bench import POOL_TOKENS, at_loc, locations, rand

PAGE, LATENT, INDEX_DIM = 256, 512, 128
WINDOW, C4, C128 = 0, 1, 2


def _make(kernels: str):
    from kvcore_dsv4.pool import DeepSeekV4TokenToKVPool

    return DeepSeekV4TokenToKVPool(
        max_num_reqs=8, swa_size=POOL_TOKENS, c4_size=POOL_TOKENS, c128_size=POOL_TOKENS, c4_state_pool_size=64,
        c128_state_pool_size=0, page_size=PAGE, swa_page_size=PAGE, dtype=torch.float8_e4m3fn, c4_state_dtype=None,
        c128_state_dtype=None, qk_nope_head_dim=448, qk_rope_head_dim=64, indexer_head_dim=INDEX_DIM, layer_num=3,
        device="cuda", enable_memory_saver=False, compression_ratios=[0, 4, 128], kernels=kernels,
    )  # fmt: skip


def _inputs(n: int, gen: torch.Generator) -> SimpleNamespace:
    return SimpleNamespace(n=n, loc=locations(n, gen), latent=rand(gen, n, LATENT), index_k=rand(gen, n, INDEX_DIM))


def bench_cases() -> list[BenchCases]:
    latent_bytes, index_bytes = LATENT * 2 + 584, INDEX_DIM * 2 + INDEX_DIM + 4
    cases = [
        BenchCase(op="dsv4 window store (set_swa_key_buffer_radix_fused)", pool="dsv4", written=at_loc,
                  bytes_per_token=latent_bytes,
                  call=lambda p, x: lambda: p.set_swa_key_buffer_radix_fused(WINDOW, x.loc, x.latent)),
        BenchCase(op="dsv4 c4 store (set_extra_key_buffer_fused)", pool="dsv4", written=STATE,
                  bytes_per_token=latent_bytes,
                  call=lambda p, x: lambda: p.set_extra_key_buffer_fused(C4, x.loc, x.latent)),
        BenchCase(op="dsv4 indexer store (set_index_k_fused)", pool="dsv4", written=STATE, bytes_per_token=index_bytes,
                  call=lambda p, x: lambda: p.set_index_k_fused(C4, x.loc, x.index_k)),
    ]  # fmt: skip
    return [BenchCases(pools=(BenchPool(name="dsv4", make=_make),), inputs=_inputs, cases=cases)]
