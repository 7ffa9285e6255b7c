"""The MiniMax sparse family's cases for ``kvcore bench`` (the ``kvcore_bench_cases`` hook of
:mod:`kvcore_minimax_sparse.plugin`).

A pool of three layers, one of each kind: a dense layer, a sparse layer whose index keeps keys and values, a sparse
layer whose index keeps keys only.  The main K/V are MiniMax-M2's attention (8 KV heads of 128 per rank, bf16); the
index rows are one head of 128 (the lightning indexer's width in DeepSeek's sparse attention, which MiniMax's
sparse layers follow; no released MiniMax-M3 config.json gives it), kept in bf16 (a plain copy) or fp8 e4m3
(quantized from bf16 inputs).  The pool holds ``kvcore.tools.bench.POOL_TOKENS`` tokens on the CUDA device.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from kvcore.hookspecs import BenchCase, BenchCases, BenchPool
from kvcore.tools.bench import POOL_TOKENS, at_loc, locations, rand

HEADS, HEAD_DIM, INDEX_DIM = 8, 128, 128
DENSE, WITH_VALUE, KEYS_ONLY = 0, 1, 2
INDEX_ROW = INDEX_DIM * 2  # bytes of one bf16 index row


def _pool(index_dtype: torch.dtype):
    def make(kernels: str):
        from kvcore_minimax_sparse.pool import MiniMaxSparseKVPool

        return MiniMaxSparseKVPool(size=POOL_TOKENS, page_size=1, dtype=torch.bfloat16, head_num=HEADS,
                                   head_dim=HEAD_DIM, idx_head_dim=INDEX_DIM, dense_layer_ids=[DENSE],
                                   sparse_layer_ids=[WITH_VALUE, KEYS_ONLY], disable_value_sparse_layer_ids=[KEYS_ONLY],
                                   device="cuda", index_dtype=index_dtype, kernels=kernels)  # fmt: skip

    return make


def _inputs(n: int, gen: torch.Generator) -> SimpleNamespace:
    return SimpleNamespace(n=n, loc=locations(n, gen), k=rand(gen, n, HEADS, HEAD_DIM), v=rand(gen, n, HEADS, HEAD_DIM),
                           idx_k=rand(gen, n, 1, INDEX_DIM), idx_v=rand(gen, n, 1, INDEX_DIM))  # fmt: skip


def bench_cases() -> list[BenchCases]:
    main = 2 * 2 * HEADS * HEAD_DIM * 2  # K and V, read + written, bf16
    cases = []
    for pool, written in (("minimax-bf16", 2), ("minimax-fp8", 1)):  # bytes an index element is stored in
        row = INDEX_ROW + INDEX_DIM * written  # one index row read (bf16) and written
        cases += [
            BenchCase(op=f"{pool} set_index_kv_buffer", pool=pool, written=at_loc, bytes_per_token=2 * row,
                      call=lambda p, x: lambda: p.set_index_kv_buffer(WITH_VALUE, x.loc, x.idx_k, x.idx_v)),
            BenchCase(op=f"{pool} set_index_k_buffer (keys only)", pool=pool, written=at_loc, bytes_per_token=row,
                      call=lambda p, x: lambda: p.set_index_k_buffer(KEYS_ONLY, x.loc, x.idx_k)),
            BenchCase(op=f"{pool} set_fused_kv_index_buffer", pool=pool, written=at_loc, bytes_per_token=main + 2 * row,
                      call=lambda p, x: lambda: p.set_fused_kv_index_buffer(WITH_VALUE, x.loc, x.k, x.v, x.idx_k,
                                                                            x.idx_v)),
        ]  # fmt: skip
    pools = (BenchPool(name="minimax-bf16", make=_pool(torch.bfloat16)),
             BenchPool(name="minimax-fp8", make=_pool(torch.float8_e4m3fn)))  # fmt: skip
    return [BenchCases(pools=pools, inputs=_inputs, cases=cases)]
