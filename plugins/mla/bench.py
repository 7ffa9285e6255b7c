"""The MLA family's cases for ``kvcore bench`` (the ``kvcore_bench_cases`` hook of :mod:`kvcore_mla.plugin`).

DeepSeek-V3's latent rows (``kv_lora_rank`` 512 + rope 64, bf16, 2 layers): the store of the two parts, the store of
a concatenated row, and the gather of both parts (returning new tensors, and into given outputs).  The pool holds
``kvcore.tools.bench.POOL_TOKENS`` tokens on the CUDA device.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from kvcore.hookspecs import GATHER, INTO, BenchCase, BenchCases, BenchPool
from kvcore.tools.bench import POOL_TOKENS, at_loc, into, locations, rand

RANK, ROPE = 512, 64  # DeepSeek-V3
#: bytes a latent row store or gather reads + writes per token (bf16 in, bf16 out)
ROW_BYTES = 2 * (RANK + ROPE) * 2


def _pool(kernels: str):
    from kvcore_mla.pool import MLATokenToKVPool

    return MLATokenToKVPool(size=POOL_TOKENS, page_size=1, dtype=torch.bfloat16, kv_lora_rank=RANK,
                            qk_rope_head_dim=ROPE, layer_num=2, device="cuda", enable_memory_saver=False,
                            kernels=kernels)  # fmt: skip


def _inputs(n: int, gen: torch.Generator) -> SimpleNamespace:
    return SimpleNamespace(n=n, loc=locations(n, gen), nope=rand(gen, n, 1, RANK), rope=rand(gen, n, 1, ROPE),
                           latent=rand(gen, n, 1, RANK + ROPE))  # fmt: skip


def latent_into(p, x):
    """``get_mla_kv_buffer(0, loc, out=...)`` into bf16 outputs made once."""
    return into(p, "get_mla_kv_buffer", 0, x.loc, shapes=((x.n, 1, RANK), (x.n, 1, ROPE)))


def bench_cases() -> list[BenchCases]:
    cases = (
        BenchCase(op="mla set_mla_kv_buffer", pool="mla",
                  call=lambda p, x: lambda: p.set_mla_kv_buffer(0, x.loc, x.nope, x.rope), written=at_loc,
                  bytes_per_token=ROW_BYTES),
        BenchCase(op="mla set_kv_buffer (concatenated)", pool="mla",
                  call=lambda p, x: lambda: p.set_kv_buffer(0, x.loc, x.latent, None), written=at_loc,
                  bytes_per_token=ROW_BYTES),
        BenchCase(op="mla get_mla_kv_buffer", pool="mla", call=lambda p, x: lambda: p.get_mla_kv_buffer(0, x.loc),
                  written=GATHER, bytes_per_token=ROW_BYTES),
        BenchCase(op="mla get_mla_kv_buffer (out=)", pool="mla", call=latent_into, written=INTO,
                  bytes_per_token=ROW_BYTES),
    )  # fmt: skip
    return [BenchCases(pools=(BenchPool(name="mla", make=_pool),), inputs=_inputs, cases=cases)]
