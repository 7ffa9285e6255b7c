"""Read accessors called with ``out=`` (a kvcore extension): the gather writes the caller's tensors, returns
them, and reads exactly what the allocating call returns; bad outputs are refused with the method's name.

Every family's gather accessor, with the Triton kernels (interpreted on the CPU, compiled on CUDA with
KVCORE_TEST_COMPILED=1) and with the torch path."""

from __future__ import annotations

import re

import pytest
import torch

from kvcore.testing.tensors import bits_equal, test_device
from kvcore_dsa.pool import DSATokenToKVPool
from kvcore_fp4.pool import MHATokenToKVPoolFP4, MLATokenToKVPoolFP4
from kvcore_mla.pool import MLATokenToKVPool

DEVICE = test_device()
RANK, ROPE = 64, 16


def _mla(kernels):
    return MLATokenToKVPool(size=24, page_size=4, dtype=torch.bfloat16, kv_lora_rank=RANK, qk_rope_head_dim=ROPE,
                            layer_num=2, device=DEVICE, enable_memory_saver=False, kernels=kernels)  # fmt: skip


def _dsa(kernels):
    return DSATokenToKVPool(size=128, page_size=64, kv_lora_rank=512, dtype=torch.float8_e4m3fn, qk_rope_head_dim=64,
                            layer_num=2, device=DEVICE, index_head_dim=128, enable_memory_saver=False,
                            kernels=kernels)  # fmt: skip


def _fp4(kernels):
    return MHATokenToKVPoolFP4(size=24, page_size=4, dtype=torch.bfloat16, head_num=2, head_dim=32, layer_num=2,
                               device=DEVICE, enable_memory_saver=False, kernels=kernels, kv_format="nvfp4")  # fmt: skip


def _fp4_mla(kernels):
    return MLATokenToKVPoolFP4(size=24, page_size=4, dtype=torch.bfloat16, kv_lora_rank=RANK, qk_rope_head_dim=ROPE,
                               layer_num=2, device=DEVICE, enable_memory_saver=False, kernels=kernels,
                               kv_format="fp4_e2m1")  # fmt: skip


LOC = [9, 2, 17, 5]
#: (pool factory, the read with or without ``out``)
READS = {
    "mla get_mla_kv_buffer": (_mla, lambda p, loc, **kw: p.get_mla_kv_buffer(1, loc, **kw)),
    "dsa get_mla_kv_buffer": (_dsa, lambda p, loc, **kw: p.get_mla_kv_buffer(1, loc, torch.float32, **kw)),
    "dsa get_index_k_scale_buffer": (_dsa, lambda p, loc, **kw: p.get_index_k_scale_buffer(
        1, 70, torch.tensor([1, 0], device=DEVICE), **kw)),
    "fp4 get_kv_buffer_by_loc": (_fp4, lambda p, loc, **kw: p.get_kv_buffer_by_loc(1, loc, **kw)),
    "fp4 get_mla_kv_buffer": (_fp4_mla, lambda p, loc, **kw: p.get_mla_kv_buffer(1, loc, **kw)),
}  # fmt: skip


def _written(factory, kernels):
    pool = factory(kernels)
    written = torch.arange(1, pool.size + 1, device=DEVICE)  # every row, so the indexer's pages are filled too
    pool.self_test_write(1, written, torch.Generator().manual_seed(4))
    return pool


@pytest.mark.parametrize("kernels", ["triton", "native"])
@pytest.mark.parametrize("read", sorted(READS))
def test_a_read_into_the_callers_tensors_returns_them_with_what_the_allocating_read_returns(read, kernels):
    factory, call = READS[read]
    pool = _written(factory, kernels)
    loc = torch.tensor(LOC, device=DEVICE)
    want = call(pool, loc)
    out = tuple(torch.full_like(w, 7) for w in want)
    got = call(pool, loc, out=out)
    assert len(got) == len(out) and all(g is o for g, o in zip(got, out))
    assert all(bits_equal(g, w) for g, w in zip(got, want))


@pytest.mark.parametrize("kernels", ["triton", "native"])
def test_a_read_into_strided_views_of_a_wider_buffer(kernels):
    """An engine's buffers may be views (here the latent row's two parts side by side in one buffer, padded)."""
    pool = _written(_mla, kernels)
    loc = torch.tensor(LOC, device=DEVICE)
    wide = torch.zeros(len(LOC), 1, RANK + ROPE + 8, dtype=torch.bfloat16, device=DEVICE)
    nope, rope = pool.get_mla_kv_buffer(1, loc, out=(wide[..., :RANK], wide[..., RANK : RANK + ROPE]))
    want = pool.get_mla_kv_buffer(1, loc)
    assert bits_equal(nope, want[0]) and bits_equal(rope, want[1])
    assert int(wide[..., RANK + ROPE :].count_nonzero()) == 0


@pytest.mark.parametrize("kernels", ["triton", "native"])
@pytest.mark.parametrize("read", sorted(READS))
def test_bad_outputs_are_refused_with_the_method_and_what_it_needs(read, kernels):
    """Also after a good call into outputs of the same shapes: a hot path plans each call signature once
    (kvcore.kernels.launch), and a bad output is another signature, checked in full."""
    factory, call = READS[read]
    pool = _written(factory, kernels)
    loc = torch.tensor(LOC, device=DEVICE)
    want = call(pool, loc)
    call(pool, loc, out=tuple(torch.empty_like(w) for w in want))
    method = read.split()[1]
    with pytest.raises(ValueError, match=f"{method}: out must be a tuple of 2 tensors"):
        call(pool, loc, out=want[0])
    with pytest.raises(ValueError, match=re.escape(f"{method}: out[0] must be a tensor")):
        call(pool, loc, out=(None, want[1]))
    short = (want[0], want[1][:-1])
    needs = re.escape(f"{method}: out[1] must be a tensor of shape {tuple(want[1].shape)}")
    with pytest.raises(ValueError, match=needs):
        call(pool, loc, out=short)
    mixed = (want[0], want[1].to(torch.float16 if want[1].dtype != torch.float16 else torch.float32))
    with pytest.raises(ValueError, match=f"{method}: out tensors must share one dtype"):
        call(pool, loc, out=mixed)


def test_an_out_dtype_other_than_dst_dtype_is_refused():
    pool = _written(_mla, "native")
    loc = torch.tensor(LOC, device=DEVICE)
    out = pool.get_mla_kv_buffer(1, loc)
    with pytest.raises(ValueError, match="get_mla_kv_buffer: out tensors must share one dtype = dst_dtype torch.float16"):
        pool.get_mla_kv_buffer(1, loc, torch.float16, out=out)
