"""The head-major gather (kvcore.kernels.head_gather): the Triton kernel against its torch reference, bit for bit,
on random rows of token-major buffers and page-major views, odd sizes, every conversion it makes."""

from __future__ import annotations

import pytest
import torch

from kvcore.kernels.head_gather import HeadGather, gather_heads_native, gather_heads_triton
from kvcore.testing.tensors import test_device

DEVICE = test_device()


def random_rows(shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * 3
    x[..., 0] = 1e-40  # a float32 subnormal: flushed or kept alike by both paths
    return x.to(dtype).to(DEVICE)


def same_bits(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


CASES = [
    (torch.bfloat16, torch.bfloat16, None),
    (torch.float32, torch.float32, None),
    (torch.float16, torch.float32, None),
    (torch.bfloat16, torch.float32, None),
    (torch.float32, torch.bfloat16, None),
    (torch.float8_e4m3fn, torch.bfloat16, None),
    (torch.float8_e4m3fn, torch.bfloat16, 0.5),
    (torch.float8_e5m2, torch.float16, 2.0),
]


@pytest.mark.parametrize("src_dtype, out_dtype, scale", CASES)
@pytest.mark.parametrize("heads, dk, dv", [(2, 24, 24), (3, 16, 8)])
def test_token_rows(src_dtype, out_dtype, scale, heads, dk, dv):
    rows = 50
    k = random_rows((rows, heads, dk), src_dtype, 1)
    v = random_rows((rows, heads, dv), src_dtype, 2)
    g = torch.Generator().manual_seed(3)
    locs = torch.randint(0, rows, (3, 37), generator=g).to(DEVICE)
    locs[1, -5:] = 0  # a freed row reads the padding slot
    got = gather_heads_triton(k, v, locs, out_dtype, scale, scale)
    want = gather_heads_native(k, v, locs, out_dtype, scale, scale)
    assert got[0].is_contiguous() and got[0].shape == (3, heads, 37, dk) and got[1].shape == (3, heads, 37, dv)
    assert same_bits(got[0], want[0]) and same_bits(got[1], want[1])


@pytest.mark.parametrize("page", [4, 16])
def test_page_major_views_and_strided_locations(page):
    """A page-major pool's paged view (its page stride spans every layer) and locations that are a slice of a
    request table (row stride past the sequence)."""
    pages, layers, heads, dim = 9, 3, 2, 16
    kv = random_rows((pages, layers, 2, page, heads, dim), torch.bfloat16, 4)
    layer = 1
    k, v = kv[:, layer, 0], kv[:, layer, 1]  # [pages, page, heads, dim] views
    table = torch.randint(page, pages * page, (4, 40), generator=torch.Generator().manual_seed(5)).to(DEVICE)
    locs = table[:, :29]
    got = gather_heads_triton(k, v, locs, torch.bfloat16)
    want = gather_heads_native(k, v, locs, torch.bfloat16)
    assert same_bits(got[0], want[0]) and same_bits(got[1], want[1])
    # the reference itself: row t of batch b, head h is the stored row
    b, t, h = 2, 11, 1
    loc = int(locs[b, t])
    assert torch.equal(got[0][b, h, t], k[loc // page, loc % page, h])


def test_empty_and_refused():
    k = random_rows((8, 2, 16), torch.bfloat16, 6)
    empty = gather_heads_triton(k, k, torch.zeros((2, 0), dtype=torch.int64, device=DEVICE), torch.bfloat16)
    assert empty[0].shape == (2, 2, 0, 16)
    with pytest.raises(ValueError, match="float32, float16 or bfloat16"):
        gather_heads_triton(k, k, torch.zeros((1, 1), dtype=torch.int64, device=DEVICE), torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="locs \\[batch, seq\\]"):
        gather_heads_triton(k, k, torch.zeros(3, dtype=torch.int64, device=DEVICE), torch.bfloat16)


# -- HeadGather: the same gather planned once for every layer of a pool ------------------------------------------


@pytest.mark.parametrize("src_dtype, out_dtype, scale", CASES)
def test_head_gather_matches_the_reference_on_every_layer(src_dtype, out_dtype, scale):
    """Each layer of stacked token rows, locations of several lengths and dtypes (one plan per kind, the lengths
    read per call), a freed row reading the padding slot."""
    layers, rows, heads, dk, dv = 3, 40, 2, 24, 8
    k = random_rows((layers, rows, heads, dk), src_dtype, 7)
    v = random_rows((layers, rows, heads, dv), src_dtype, 8)
    gather = HeadGather(k.unbind(0), v.unbind(0), out_dtype, scale, scale, use_triton=True)
    g = torch.Generator().manual_seed(9)
    for step, seq in enumerate((13, 1, 37, 14)):
        locs = torch.randint(0, rows, (3, seq), generator=g).to(DEVICE)
        locs[2, :] = 0
        if step % 2:
            locs = locs.to(torch.int32)
        for layer in range(layers):
            got = gather(layer, locs)
            want = gather_heads_native(k[layer], v[layer], locs, out_dtype, scale, scale)
            assert got[0].shape == (3, heads, seq, dk) and got[0].is_contiguous()
            assert same_bits(got[0], want[0]) and same_bits(got[1], want[1]), (step, layer)


def test_head_gather_reads_a_slice_of_a_table_and_page_major_views():
    pages, layers, page, heads, dim = 9, 2, 4, 2, 16
    kv = random_rows((pages, layers, 2, page, heads, dim), torch.bfloat16, 10)
    gather = HeadGather([kv[:, i, 0] for i in range(layers)], [kv[:, i, 1] for i in range(layers)], torch.float32,
                        use_triton=True)  # fmt: skip
    table = torch.randint(page, pages * page, (3, 40), generator=torch.Generator().manual_seed(11)).to(DEVICE)
    for length in (29, 30):
        locs = table[:, :length]  # row stride 40: read per call
        for layer in range(layers):
            got = gather(layer, locs)
            want = gather_heads_native(kv[:, layer, 0], kv[:, layer, 1], locs, torch.float32)
            assert same_bits(got[0], want[0]) and same_bits(got[1], want[1])


def test_head_gather_native_and_refusals():
    k = random_rows((2, 8, 2, 16), torch.bfloat16, 12)
    locs = torch.tensor([[1, 2, 3]], device=DEVICE)
    native = HeadGather(k.unbind(0), k.unbind(0), torch.float32, use_triton=False)
    want = gather_heads_native(k[1], k[1], locs, torch.float32)
    assert all(same_bits(a, b) for a, b in zip(native(1, locs), want))
    gather = HeadGather(k.unbind(0), k.unbind(0), torch.bfloat16, use_triton=True)
    assert gather(0, locs[:, :0])[0].shape == (1, 2, 0, 16)
    with pytest.raises(ValueError, match="token dim packed"):
        gather(0, torch.zeros((4, 2), dtype=torch.int64, device=DEVICE).t())
    with pytest.raises(ValueError, match="int32/int64"):
        gather(0, locs.float())
    with pytest.raises(ValueError, match="laid out unlike layer 0"):
        HeadGather([k[0], k[0, :4]], [k[0], k[1]], torch.bfloat16, use_triton=True)
    with pytest.raises(ValueError, match="float32, float16 or bfloat16"):
        HeadGather(k.unbind(0), k.unbind(0), torch.int8, use_triton=True)
