"""The hybrid linear-attention family's case for ``kvcore bench`` (the ``kvcore_bench_cases`` hook of
:mod:`kvcore_mamba.plugin`).

Qwen3-Next's per-request states on one of two tensor-parallel ranks (36 gated DeltaNet layers: conv window
[4096, 3] bf16, temporal [16, 128, 128] float32; 36.8 MiB a slot), copied between slots (``copy_from``) at 8 and
256 slots only.  The pool holds twice the larger count, on the CUDA device.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import torch

from kvcore.hookspecs import STATE, BenchCase, BenchCases, BenchPool

STATE_SLOTS = (8, 256)  # sizes of the state copy; its pool holds twice the larger
#: Qwen3-Next's DeltaNet state on one of two tensor-parallel ranks
LAYERS, CONV, TEMPORAL = 36, (4096, 3), (16, 128, 128)
#: bytes a slot's copy reads + writes
SLOT_BYTES = 2 * LAYERS * (math.prod(CONV) * 2 + math.prod(TEMPORAL) * 4)


def _pool(kernels: str):
    from kvcore_mamba.layout import LinearStateParams, StateDtype, StateShape
    from kvcore_mamba.pool import MambaPool

    params = LinearStateParams(layers=list(range(LAYERS)), shape=StateShape(conv=[CONV], temporal=TEMPORAL),
                               dtype=StateDtype(conv=torch.bfloat16, temporal=torch.float32))  # fmt: skip
    return MambaPool(size=2 * max(STATE_SLOTS), device="cuda", kernels=kernels, cache_params=params)


def _inputs(n: int, gen: torch.Generator) -> SimpleNamespace:
    """``n`` source and ``n`` target slots, distinct, past the padding slot 0."""
    slots = (torch.randperm(2 * max(STATE_SLOTS), generator=gen)[: 2 * n] + 1).cuda()
    return SimpleNamespace(src=slots[:n], dst=slots[n:])


def bench_cases() -> list[BenchCases]:
    case = BenchCase(op="mamba copy_from (36 layers)", pool="mamba",
                     call=lambda p, x: lambda: p.copy_from(x.src, x.dst), written=STATE, bytes_per_token=SLOT_BYTES,
                     sizes=STATE_SLOTS)  # fmt: skip
    return [BenchCases(pools=(BenchPool(name="mamba", make=_pool),), inputs=_inputs, cases=(case,))]
