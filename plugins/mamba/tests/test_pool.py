"""MambaPool, HybridReqToTokenPool and HybridLinearKVPool: state shapes from the model's dimensions, slots
zeroed on allocation, copies and forks in one launch against the torch reference, request lifetimes with
kept and ping-pong slots, and the errors."""

from __future__ import annotations

import types

import pytest
import torch

from kvcore.testing.tensors import bits_equal, test_device
from kvcore_mamba.layout import LinearAttentionDims, layer_kinds, state_params
from kvcore_mamba.pool import HybridLinearKVPool, HybridReqToTokenPool, MambaPool

DEVICE = test_device()
KERNELS = ["triton", "native"]
GDN = LinearAttentionDims(kind="gated_delta_net", num_heads=4, head_dim=8, state_size=6, num_groups=2, conv_kernel=4,
                          full_attention_interval=4)  # fmt: skip


def params(layers=(0, 1, 2, 4, 5, 6), dims=GDN, tp=1):
    return state_params(dims, torch.bfloat16, tp, list(layers))


def randomize(pool: MambaPool, seed: int = 0) -> None:
    g = torch.Generator().manual_seed(seed)
    for buf in pool.buffers().values():
        buf.copy_((torch.randn(buf.shape, generator=g) + 3).to(buf.dtype))


def test_state_shapes_follow_the_model_and_tensor_parallelism():
    # Qwen3-Next's DeltaNet at tp 2: conv channels 2 x 16 x 128 + 32 x 128 = 8192 -> 4096 per rank, 3 inputs;
    # the temporal state is [value heads / tp, key width, value width] in float32.
    qwen = LinearAttentionDims(kind="gated_delta_net", num_heads=32, head_dim=128, state_size=128, num_groups=16,
                               conv_kernel=4, full_attention_interval=4)  # fmt: skip
    full, linear = layer_kinds(48, 4)
    assert full == list(range(3, 48, 4)) and len(linear) == 36
    p = state_params(qwen, torch.bfloat16, 2, linear)
    assert p.shape.conv == [(4096, 3)] and p.shape.temporal == (16, 128, 128)
    assert p.dtype.conv == torch.bfloat16 and p.dtype.temporal == torch.float32
    assert p.mamba_cache_per_req == 36 * (4096 * 3 * 2 + 16 * 128 * 128 * 4)
    # Mamba2 keeps [heads, head width, state]
    m2 = LinearAttentionDims(kind="mamba2", num_heads=8, head_dim=64, state_size=128, num_groups=1, conv_kernel=4,
                             full_attention_interval=2)  # fmt: skip
    p2 = state_params(m2, torch.bfloat16, 1, [0])
    assert p2.shape.conv == [(8 * 64 + 2 * 128, 3)] and p2.shape.temporal == (8, 64, 128)
    with pytest.raises(ValueError, match="parallel.tp_size=3"):
        state_params(qwen, torch.bfloat16, 3, linear)


def test_slots_are_zeroed_when_handed_out_and_never_slot_0():
    pool = MambaPool(size=5, cache_params=params(), device=DEVICE)
    assert pool.mamba_cache.conv[0].shape == (6, 6, 2 * 2 * 6 + 4 * 8, 3) and pool.mamba_cache.temporal.shape == (6, 6, 4, 6, 8)
    randomize(pool)
    before = pool.mamba_cache.temporal.clone()
    got = pool.alloc(3)
    assert got.tolist() == [1, 2, 3] and pool.available_size() == 2
    for buf in pool.buffers().values():
        assert int(buf[:, got].count_nonzero()) == 0
    assert bits_equal(pool.mamba_cache.temporal[:, [0, 4, 5]], before[:, [0, 4, 5]])
    assert pool.alloc(3) is None and pool.available_size() == 2
    pool.free(got[:2])
    assert pool.available_size() == 4
    pool.clear()
    assert pool.available_size() == 5 and int(pool.mamba_cache.temporal.count_nonzero()) == 0
    layer = pool.mamba2_layer_cache(2)
    assert layer.temporal.data_ptr() == pool.mamba_cache.temporal[2].data_ptr()
    with pytest.raises(IndexError):
        pool.mamba2_layer_cache(6)


@pytest.mark.parametrize("kernels", KERNELS)
@pytest.mark.parametrize("pattern", ["disjoint", "swap", "cycle"])
def test_copy_from_moves_every_state_of_every_layer(kernels, pattern):
    pool = MambaPool(size=9, cache_params=params(), device=DEVICE, kernels=kernels)
    randomize(pool, 1)
    before = {name: buf.clone() for name, buf in pool.buffers().items()}
    src = torch.tensor([1, 4, 7], device=DEVICE)
    dst = {"disjoint": torch.tensor([2, 5, 9], device=DEVICE), "swap": torch.tensor([4, 1, 8], device=DEVICE),
           "cycle": torch.tensor([4, 7, 1], device=DEVICE)}[pattern]  # fmt: skip
    pool.copy_from(src, dst)
    for name, buf in pool.buffers().items():
        expected = before[name].clone()
        expected[:, dst] = before[name][:, src]  # every source read before any target is written
        assert bits_equal(buf, expected), name


@pytest.mark.parametrize("kernels", KERNELS)
def test_fork_copies_into_a_new_slot(kernels):
    pool = MambaPool(size=3, cache_params=params(), device=DEVICE, kernels=kernels)
    src = pool.alloc(1)
    randomize(pool, 2)
    dst = pool.fork_from(src)
    assert dst is not None and int(dst) != int(src)
    for buf in pool.buffers().values():
        assert bits_equal(buf[:, dst], buf[:, src])
    pool.alloc(pool.available_size())
    assert pool.fork_from(src) is None


def test_speculative_states_need_their_sizes():
    with pytest.raises(ValueError, match="speculative_num_draft_tokens and spec_state_size"):
        MambaPool(size=3, cache_params=params(), device=DEVICE, speculative_num_draft_tokens=4)
    pool = MambaPool(size=3, spec_state_size=2, cache_params=params(), device=DEVICE, speculative_num_draft_tokens=4)
    assert sorted(pool.buffers()) == ["conv", "intermediate_conv", "intermediate_ssm", "temporal"]
    assert sorted(pool.slot_buffers()) == ["conv", "temporal"]
    plain = MambaPool(size=3, cache_params=params(), device=DEVICE)
    with pytest.raises(RuntimeError, match="no speculative states"):
        plain.get_speculative_mamba2_params_all_layers()


def _req(**kw):
    return types.SimpleNamespace(mamba_pool_idx=None, mamba_ping_pong_track_buffer=None, mamba_next_track_idx=None, **kw)


def test_request_lifetimes_with_kept_slots():
    reqs = HybridReqToTokenPool(size=4, mamba_size=3, max_context_len=16, device=DEVICE, cache_params=params())
    a, b = _req(), _req()
    rows = reqs.alloc(2, [a, b])
    assert rows == [1, 2] and (a.mamba_pool_idx, b.mamba_pool_idx) == (1, 2)
    assert reqs.get_mamba_indices(torch.tensor(rows, device=DEVICE)).tolist() == [1, 2]
    # a chunked prefill keeps its state slot; its next chunk reuses it
    reqs.free(rows[0], free_mamba_cache=False)
    again = reqs.alloc(1, [a])
    assert again == [3] and a.mamba_pool_idx == 1 and reqs.mamba_pool.available_size() == 1
    assert reqs.mamba2_layer_cache(4).temporal.data_ptr() == reqs.mamba_pool.mamba_cache.temporal[3].data_ptr()
    with pytest.raises(IndexError, match=r"layer 3 keeps no linear-attention state"):
        reqs.mamba2_layer_cache(3)
    # out of state slots (4 requests, 3 slots): a clear error, and nothing taken
    c, d, e, f = _req(), _req(), _req(), _req()
    reqs.free([2, 3])
    with pytest.raises(RuntimeError, match="kv_cache.options.max_mamba_cache_size"):
        reqs.alloc(4, [c, d, e, f])
    assert reqs.available_size() == 4 and reqs.mamba_pool.available_size() == 3 and c.mamba_pool_idx is None
    reqs.clear()
    assert reqs.available_size() == 4 and int(reqs.req_index_to_mamba_index_mapping.count_nonzero()) == 0


def test_ping_pong_track_buffers():
    reqs = HybridReqToTokenPool(size=2, mamba_size=8, max_context_len=8, device=DEVICE, cache_params=params(),
                                enable_mamba_extra_buffer=True)  # fmt: skip
    a = _req()
    (row,) = reqs.alloc(1, [a])
    assert a.mamba_pool_idx == 1 and a.mamba_ping_pong_track_buffer.tolist() == [2, 3] and a.mamba_next_track_idx == 0
    assert reqs.req_index_to_mamba_ping_pong_track_buffer_mapping[row].tolist() == [2, 3]
    assert reqs.get_mamba_ping_pong_other_idx(0) == 1
    reqs.free(row, mamba_ping_pong_track_buffer_to_keep=1)  # slot 1 and track buffer 2 back, 3 kept
    assert reqs.mamba_pool.available_size() == 8 - 1
    with pytest.raises(ValueError, match="0 or 1"):
        reqs.free(row, mamba_ping_pong_track_buffer_to_keep=2)


def test_linear_layers_have_no_kv_and_offload_carries_states():
    mamba = MambaPool(size=4, cache_params=params(), device=DEVICE)
    pool = HybridLinearKVPool(size=16, dtype=torch.bfloat16, page_size=1, head_num=2, head_dim=8,
                              full_attention_layer_ids=[3, 7], device=DEVICE, mamba_pool=mamba, start_layer=0,
                              end_layer=7, kernels="native")  # fmt: skip
    assert pool.token_layers() == [3, 7] and sorted(pool.buffers()) == ["conv", "k", "temporal", "v"]
    with pytest.raises(IndexError, match=r"the full-attention layers are \[3, 7\]"):
        pool.get_key_buffer(2)
    randomize(mamba, 3)
    for buf in pool.token_buffers().values():
        buf.copy_(torch.randn(buf.shape).to(buf.dtype))
    tokens, slots = torch.tensor([1, 5], device=DEVICE), torch.tensor([2], device=DEVICE)
    saved = {name: buf[:, slots].clone() for name, buf in mamba.buffers().items()}
    kv = pool.token_rows()["k"].take(tokens)
    copy = pool.get_cpu_copy(tokens, mamba_indices=slots)
    with pytest.raises(ValueError, match="mamba_indices"):
        pool.load_cpu_copy(copy, tokens)
    pool.load_cpu_copy(copy, torch.tensor([9, 11], device=DEVICE), mamba_indices=torch.tensor([4], device=DEVICE))
    assert bits_equal(pool.token_rows()["k"].take(torch.tensor([9, 11], device=DEVICE)), kv)
    for name, buf in mamba.buffers().items():
        assert bits_equal(buf[:, [4]], saved[name])


def test_mla_inside_keeps_latent_rows_for_the_full_layers():
    mamba = MambaPool(size=2, cache_params=params(), device=DEVICE)
    pool = HybridLinearKVPool(size=16, dtype=torch.bfloat16, page_size=1, head_num=1, head_dim=8,
                              full_attention_layer_ids=[3, 7], device=DEVICE, mamba_pool=mamba, start_layer=0,
                              end_layer=7, kernels="native", use_mla=True, kv_lora_rank=16, qk_rope_head_dim=8)  # fmt: skip
    g = torch.Generator().manual_seed(5)
    nope = torch.randn(3, 1, 16, generator=g).to(torch.bfloat16).to(DEVICE)
    rope = torch.randn(3, 1, 8, generator=g).to(torch.bfloat16).to(DEVICE)
    loc = torch.tensor([2, 9, 4], device=DEVICE)
    pool.set_mla_kv_buffer(7, loc, nope, rope)
    got_nope, got_rope = pool.get_mla_kv_buffer(7, loc)
    assert bits_equal(got_nope, nope) and bits_equal(got_rope, rope)
    assert pool.get_key_buffer(7).data_ptr() == pool.full_kv_pool.kv_cache[1].data_ptr()
    with pytest.raises(IndexError, match=r"\[3, 7\]"):
        pool.set_mla_kv_buffer(5, loc, nope, rope)
    mha = HybridLinearKVPool(size=16, dtype=torch.bfloat16, page_size=1, head_num=1, head_dim=8,
                             full_attention_layer_ids=[3], device=DEVICE, mamba_pool=mamba, kernels="native")  # fmt: skip
    with pytest.raises(TypeError, match="use_mla=False"):
        mha.get_mla_kv_buffer(3, loc)
    with pytest.raises(ValueError, match="kv_lora_rank"):
        HybridLinearKVPool(size=16, dtype=torch.bfloat16, page_size=1, head_num=1, head_dim=8,
                           full_attention_layer_ids=[3], device=DEVICE, mamba_pool=mamba, use_mla=True)  # fmt: skip
