"""ReqToTokenPool: request slots 1..size, row 0 reserved for padded (CUDA-graph) batches, as in SGLang."""

from __future__ import annotations

import pytest
import torch

import kvcore
from kvcore.pools import ReqToTokenPool


def test_row_zero_is_reserved_and_size_requests_stay_available():
    pool = ReqToTokenPool(size=4, max_context_len=8, device="cpu")
    assert pool.req_to_token.shape == (5, 8) and pool.req_to_token.dtype == torch.int32
    assert pool.available_size() == 4
    taken = pool.alloc(4)
    assert sorted(taken) == [1, 2, 3, 4]
    assert pool.alloc(1) is None and pool.available_size() == 0
    pool.free(taken[1:3])
    pool.free(taken[0])
    assert sorted(pool.alloc(3)) == sorted(taken[:3])
    pool.clear()
    assert pool.free_slots == [1, 2, 3, 4]


def test_padding_row_writes_do_not_touch_live_requests():
    pool = ReqToTokenPool(size=2, max_context_len=4, device="cpu")
    (slot,) = pool.alloc(1)
    pool.write((slot, slice(0, 4)), torch.tensor([5, 6, 7, 8], dtype=torch.int32))
    pool.write((0, slice(0, 4)), torch.tensor([0, 0, 0, 0], dtype=torch.int32))  # a padded dummy request
    assert pool.req_to_token[slot].tolist() == [5, 6, 7, 8]


def test_rejects_empty_pools():
    with pytest.raises(ValueError, match="positive"):
        ReqToTokenPool(size=0, max_context_len=8, device="cpu")


def test_built_request_table_is_the_planned_one():
    cfg = kvcore.load_config("model=qwen2.5-0.5b", "hardware=cpu", "memory.max_total_tokens=4096")
    pools = kvcore.build_pools(cfg)
    table = pools.req_to_token_pool
    assert table.size == pools.plan.max_running_requests
    assert table.req_to_token.nbytes == pools.plan.req_to_token_bytes
    assert table.available_size() == pools.plan.max_running_requests
