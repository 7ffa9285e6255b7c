"""The DSA family's cases for ``kvcore bench`` (the ``kvcore_bench_cases`` hook of :mod:`kvcore_dsa.plugin`).

DeepSeek-V3.2's rows (2 layers, page 64): the latent row stored as fp8 with its scales (656 bytes a token:
``kv_lora_rank`` 512 + 4 float32 scales + rope 64 in bf16) and read back dequantized, and the indexer's 128-wide
fp8 keys with their scales, stored per token and gathered by page.  The pool holds
``kvcore.tools.bench.POOL_TOKENS`` tokens on the CUDA device.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from kvcore.hookspecs import GATHER, INTO, BenchCase, BenchCases, BenchPool
from kvcore.tools.bench import POOL_TOKENS, at_loc, into, locations, rand

RANK, ROPE = 512, 64  # DeepSeek-V3.2
INDEX_HEAD_DIM = 128
#: bytes of one token's fp8 latent row with its scales and bf16 rope part
FP8_ROW_BYTES = 656
#: the bf16 latent row a store reads or a gather writes
BF16_ROW_BYTES = (RANK + ROPE) * 2


def _pool(kernels: str):
    from kvcore_dsa.pool import DSATokenToKVPool

    return DSATokenToKVPool(size=POOL_TOKENS, page_size=64, dtype=torch.float8_e4m3fn, kv_lora_rank=RANK,
                            qk_rope_head_dim=ROPE, layer_num=2, index_head_dim=INDEX_HEAD_DIM, device="cuda",
                            enable_memory_saver=False, kernels=kernels)  # fmt: skip


def _inputs(n: int, gen: torch.Generator) -> SimpleNamespace:
    return SimpleNamespace(
        n=n, loc=locations(n, gen), nope=rand(gen, n, 1, RANK), rope=rand(gen, n, 1, ROPE),
        keys=rand(gen, n, INDEX_HEAD_DIM).to(torch.float8_e4m3fn), scales=torch.rand(n, generator=gen).add_(0.01).cuda(),
        pages=torch.arange(1, 2 + n // 64, dtype=torch.int32).cuda(),
    )  # fmt: skip


def bench_cases() -> list[BenchCases]:
    cases = (
        BenchCase(op="dsa set_mla_kv_buffer (fp8 quantize)", pool="dsa",
                  call=lambda p, x: lambda: p.set_mla_kv_buffer(0, x.loc, x.nope, x.rope), written=at_loc,
                  bytes_per_token=BF16_ROW_BYTES + FP8_ROW_BYTES),
        BenchCase(op="dsa get_mla_kv_buffer (dequantize)", pool="dsa",
                  call=lambda p, x: lambda: p.get_mla_kv_buffer(0, x.loc), written=GATHER,
                  bytes_per_token=FP8_ROW_BYTES + BF16_ROW_BYTES),
        BenchCase(op="dsa get_mla_kv_buffer (out=)", pool="dsa",
                  call=lambda p, x: into(p, "get_mla_kv_buffer", 0, x.loc, shapes=((x.n, 1, RANK), (x.n, 1, ROPE))),
                  written=INTO, bytes_per_token=FP8_ROW_BYTES + BF16_ROW_BYTES),
        BenchCase(op="dsa set_index_k_scale_buffer", pool="dsa",
                  call=lambda p, x: lambda: p.set_index_k_scale_buffer(0, x.loc, x.keys, x.scales), written=at_loc),
        BenchCase(op="dsa get_index_k_scale_buffer", pool="dsa",
                  call=lambda p, x: lambda: p.get_index_k_scale_buffer(0, x.n, x.pages), written=GATHER),
        BenchCase(op="dsa get_index_k_scale_buffer (out=)", pool="dsa",
                  call=lambda p, x: into(p, "get_index_k_scale_buffer", 0, x.n, x.pages,
                                         shapes=((x.n, INDEX_HEAD_DIM), (x.n, 4)), dtype=torch.uint8),
                  written=INTO),
    )  # fmt: skip
    return [BenchCases(pools=(BenchPool(name="dsa", make=_pool),), inputs=_inputs, cases=cases)]
