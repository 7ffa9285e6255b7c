"""Bit-exact tests of the MHA store kernel (and the MHA names of the shared row move) against the torch reference.

On a CPU-only machine the Triton kernels run in Triton's interpreter (the root conftest sets
TRITON_INTERPRET=1).  With KVCORE_TEST_COMPILED=1 on a GPU machine the same tests run the compiled kernels
on CUDA tensors.
"""

from __future__ import annotations

import pytest
import torch
import triton

from kvcore.kernels import row_move
from kvcore.kernels import dtypes
from kvcore_mha import kernels

from kvcore.testing.tensors import bits_equal as _bits_equal
from kvcore.testing.tensors import compiled, skip_module_without_device, test_device
from kvcore.testing.tensors import poison as _poison
from kvcore.testing.tensors import randn_nonzero as _randn

skip_module_without_device()
COMPILED, DEVICE = compiled(), test_device()


# ==========================================================================================================
# store_kv
# ==========================================================================================================

L, H, DK, DV = 3, 3, 72, 40
ROWS = 70  # size 64 + page_size 6; row 0 is padding


def _make_inputs(n, src_dtype, layout, gen, magnitude):
    """cache_k [n, H, DK], cache_v [n, H, DV] in the requested memory layout."""
    if layout == "contiguous":
        k = _randn((n, H, DK), src_dtype, gen, magnitude)
        v = _randn((n, H, DV), src_dtype, gen, magnitude)
    elif layout == "qkv_split":  # strided token dim, packed heads: views into a fused qkv projection
        width = 2 * H * DK + H * DV + 3
        qkv = _randn((n, width), src_dtype, gen, magnitude)
        k = qkv[:, H * DK : 2 * H * DK].view(n, H, DK)
        v = qkv[:, 2 * H * DK : 2 * H * DK + H * DV].view(n, H, DV)
    else:  # "transposed": dim stride != 1, heads not packed
        k = _randn((n, DK, H), src_dtype, gen, magnitude).transpose(1, 2)
        v = _randn((n, DV, H), src_dtype, gen, magnitude).transpose(1, 2)
    return k, v


def _make_scale(kind):
    if kind is None:
        return None
    if kind == "float":
        return 0.37
    if kind == "tensor0d":
        return torch.tensor(1.7, device=DEVICE)
    return torch.tensor([0.23], device=DEVICE)  # "tensor1"


# (src dtype, cache dtype, k scale kind, v scale kind, N, loc dtype, layout, magnitude)
STORE_CASES = [
    (torch.bfloat16, torch.bfloat16, None, None, 7, torch.int64, "contiguous", 1.0),
    (torch.bfloat16, torch.bfloat16, None, None, 33, torch.int32, "qkv_split", 1.0),
    (torch.float32, torch.bfloat16, None, None, 33, torch.int64, "contiguous", 3.0),
    (torch.float32, torch.bfloat16, None, None, 1, torch.int32, "transposed", 3.0),
    (torch.float32, torch.float16, None, None, 7, torch.int32, "qkv_split", 3.0),
    (torch.bfloat16, torch.float32, None, None, 7, torch.int64, "contiguous", 1.0),
    (torch.float16, torch.bfloat16, None, None, 7, torch.int64, "contiguous", 1.0),
    (torch.bfloat16, torch.float8_e4m3fn, None, None, 33, torch.int64, "contiguous", 100.0),
    (torch.bfloat16, torch.float8_e4m3fn, "float", "tensor0d", 7, torch.int32, "qkv_split", 100.0),
    (torch.bfloat16, torch.float8_e4m3fn, "tensor1", None, 1, torch.int64, "transposed", 100.0),
    (torch.float32, torch.float8_e4m3fn, "float", "float", 33, torch.int32, "contiguous", 1e-2),
    (torch.bfloat16, torch.float8_e5m2, None, None, 33, torch.int32, "contiguous", 1e4),
    (torch.bfloat16, torch.float8_e5m2, "tensor0d", "float", 7, torch.int64, "qkv_split", 1e4),
    (torch.float16, torch.float8_e5m2, "float", "tensor1", 1, torch.int32, "contiguous", 1e-3),
    # SGLang's rule: scales divide every converted input, whatever the cache dtype ...
    (torch.float32, torch.bfloat16, "float", "tensor0d", 33, torch.int64, "qkv_split", 3.0),
    (torch.bfloat16, torch.float32, "tensor1", "float", 7, torch.int32, "transposed", 1.0),
    (torch.float32, torch.float16, "tensor0d", None, 7, torch.int64, "contiguous", 3.0),
    # ... and are ignored for inputs already in the cache dtype.
    (torch.bfloat16, torch.bfloat16, "float", "tensor1", 7, torch.int64, "qkv_split", 1.0),
]


def _case_id(case):
    src, dst, ks, vs, n, loc_dtype, layout, _ = case
    name = lambda d: str(d).replace("torch.", "")  # noqa: E731
    return f"{name(src)}->{name(dst)}-k{ks}-v{vs}-N{n}-{name(loc_dtype)}-{layout}"


def _run_store(case, layer_index, seed=0):
    src_dtype, cache_dtype, k_scale_kind, v_scale_kind, n, loc_dtype, layout, magnitude = case
    gen = torch.Generator().manual_seed(seed)
    store = dtypes.storage_dtype(cache_dtype)
    k_cache = _poison((L, ROWS, H, DK), store, gen)
    v_cache = _poison((L, ROWS, H, DV), store, gen)
    loc = (torch.randperm(ROWS - 1, generator=gen)[:n] + 1).to(loc_dtype).to(DEVICE)
    cache_k, cache_v = _make_inputs(n, src_dtype, layout, gen, magnitude)
    k_scale, v_scale = _make_scale(k_scale_kind), _make_scale(v_scale_kind)
    inputs_before = (cache_k.clone(), cache_v.clone())

    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    kw = dict(k_scale=k_scale, v_scale=v_scale, cache_dtype=cache_dtype)
    kernels.store_kv_native(ref_k, ref_v, layer_index, loc, cache_k, cache_v, **kw)
    out_k, out_v = k_cache.clone(), v_cache.clone()
    kernels.store_kv_triton(out_k, out_v, layer_index, loc, cache_k, cache_v, **kw)

    # Inputs untouched.
    assert _bits_equal(cache_k, inputs_before[0]) and _bits_equal(cache_v, inputs_before[1])
    # Triton == reference, bit for bit, over the whole buffers (untouched rows included).
    assert _bits_equal(out_k, ref_k)
    assert _bits_equal(out_v, ref_v)
    # Only the rows in loc of the one layer changed (padding row 0 included in "untouched").
    written = torch.zeros(L, ROWS, dtype=torch.bool, device=DEVICE)
    written[layer_index, loc.long()] = True
    for before, after in ((k_cache, out_k), (v_cache, out_v)):
        assert _bits_equal(after[~written], before[~written])
    assert _bits_equal(out_k[:, 0], k_cache[:, 0]) and _bits_equal(out_v[:, 0], v_cache[:, 0])
    return cache_k, cache_v, out_k, out_v, loc, k_scale, v_scale


@pytest.mark.parametrize("case", STORE_CASES, ids=[_case_id(c) for c in STORE_CASES])
def test_store_kv_matches_reference(case):
    cache_k, cache_v, out_k, out_v, loc, k_scale, v_scale = _run_store(case, layer_index=1)
    # Independent check of the reference's conversion.
    cache_dtype = case[1]
    idx = loc.long()
    for x, out, scale in ((cache_k, out_k, k_scale), (cache_v, out_v, v_scale)):
        if x.dtype == cache_dtype:
            want = x
        elif scale is not None:
            want = (x.float() / torch.as_tensor(scale, dtype=torch.float32).to(DEVICE).reshape(1)).to(cache_dtype)
        else:
            want = x.to(cache_dtype)
        if dtypes.is_fp8_dtype(cache_dtype):
            want = want.view(torch.uint8)
        assert _bits_equal(out[1, idx], want)


@pytest.mark.parametrize("cache_dtype", dtypes.FP8_DTYPES, ids=["e4m3fn", "e5m2"])
@pytest.mark.parametrize("scale_kind", ["float", "tensor0d"])
def test_store_kv_scale_division_near_ties(cache_dtype, scale_kind):
    # Inputs whose quotient lands on or next to an fp8 rounding tie: multiplying by the reciprocal of the
    # scale instead of dividing (or an approximate division) changes some of these bytes.
    scale = _make_scale(scale_kind)
    s = torch.as_tensor(scale, dtype=torch.float32).cpu().reshape(1)
    v = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(cache_dtype).float()
    v = v[v.isfinite()].unique().sort().values
    mids = ((v[1:].double() + v[:-1].double()) / 2).float()
    base = torch.cat([mids, v])
    q = base * s
    x = torch.cat([q, torch.nextafter(q, torch.tensor(1e38)), torch.nextafter(q, torch.tensor(-1e38))])
    x = torch.where(x == 0, torch.ones_like(x), x)
    gen = torch.Generator().manual_seed(7)
    n = triton.cdiv(x.numel(), H * DK)
    flat = torch.cat([x, torch.ones(n * H * DK - x.numel())])
    cache_k = flat.reshape(n, H, DK).to(DEVICE)
    cache_v = _randn((n, H, DV), torch.float32, gen, 10.0)
    k_cache = _poison((L, ROWS, H, DK), torch.uint8, gen)
    v_cache = _poison((L, ROWS, H, DV), torch.uint8, gen)
    loc = torch.arange(1, n + 1, device=DEVICE)
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    kw = dict(k_scale=scale, v_scale=scale, cache_dtype=cache_dtype)
    kernels.store_kv_native(ref_k, ref_v, 0, loc, cache_k, cache_v, **kw)
    kernels.store_kv_triton(k_cache, v_cache, 0, loc, cache_k, cache_v, **kw)
    assert _bits_equal(k_cache, ref_k) and _bits_equal(v_cache, ref_v)


def test_store_kv_last_layer_and_fp8_bytes_copy():
    # fp8 input into an fp8 cache: a plain byte copy; last layer of the stack.
    gen = torch.Generator().manual_seed(3)
    n = 5
    k_cache = _poison((L, ROWS, H, DK), torch.uint8, gen)
    v_cache = _poison((L, ROWS, H, DV), torch.uint8, gen)
    cache_k = _randn((n, H, DK), torch.float32, gen, 10.0).to(torch.float8_e5m2)
    cache_v = _randn((n, H, DV), torch.float32, gen, 10.0).to(torch.float8_e5m2)
    loc = torch.tensor([ROWS - 1, 3, 9, 1, 40], device=DEVICE)
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    kernels.store_kv_native(ref_k, ref_v, L - 1, loc, cache_k, cache_v, cache_dtype=torch.float8_e5m2)
    kernels.store_kv_triton(k_cache, v_cache, L - 1, loc, cache_k, cache_v, cache_dtype=torch.float8_e5m2)
    assert _bits_equal(k_cache, ref_k) and _bits_equal(v_cache, ref_v)
    assert _bits_equal(k_cache[L - 1, loc], cache_k.view(torch.uint8))


@pytest.mark.parametrize("impl", ["triton", "native"])
def test_store_kv_scales_apply_only_to_converted_inputs(impl):
    # SGLang's rule: a float32 input into a bf16 cache with k_scale=2 stores x / 2 (exact in binary, so
    # (x / 2).to(bf16) is an independent expectation); an input already in the cache dtype is copied unscaled.
    store = getattr(kernels, f"store_kv_{impl}")
    gen = torch.Generator().manual_seed(4)
    n = 4
    k_cache = _poison((L, ROWS, H, DK), torch.bfloat16, gen)
    v_cache = _poison((L, ROWS, H, DV), torch.bfloat16, gen)
    cache_k, cache_v = _make_inputs(n, torch.float32, "contiguous", gen, 1.0)
    before = (cache_k.clone(), cache_v.clone())
    loc = torch.tensor([2, 4, 6, 8], dtype=torch.int32, device=DEVICE)
    store(k_cache, v_cache, 0, loc, cache_k, cache_v, k_scale=2.0, v_scale=torch.tensor(0.5, device=DEVICE),
          cache_dtype=torch.bfloat16)  # fmt: skip
    assert _bits_equal(k_cache[0, loc.long()], (cache_k / 2).to(torch.bfloat16))
    assert _bits_equal(v_cache[0, loc.long()], (cache_v * 2).to(torch.bfloat16))
    assert _bits_equal(cache_k, before[0]) and _bits_equal(cache_v, before[1]), "the caller's inputs changed"
    bk, bv = cache_k.to(torch.bfloat16), cache_v.to(torch.bfloat16)
    store(k_cache, v_cache, 1, loc, bk, bv, k_scale=2.0, v_scale=2.0, cache_dtype=torch.bfloat16)
    assert _bits_equal(k_cache[1, loc.long()], bk) and _bits_equal(v_cache[1, loc.long()], bv)
    # fp8 bytes into an fp8 cache: copied, the scale ignored.
    k8 = _poison((L, ROWS, H, DK), torch.uint8, gen)
    v8 = _poison((L, ROWS, H, DV), torch.uint8, gen)
    x8k, x8v = cache_k.to(torch.float8_e4m3fn), cache_v.to(torch.float8_e4m3fn)
    store(k8, v8, 0, loc, x8k, x8v, k_scale=3.0, v_scale=3.0, cache_dtype=torch.float8_e4m3fn)
    assert _bits_equal(k8[0, loc.long()], x8k.view(torch.uint8)) and _bits_equal(v8[0, loc.long()], x8v.view(torch.uint8))


def test_store_kv_small_rows_and_empty():
    # 1 head x 8 dims fp8 rows (8-byte rows), many tokens per program.
    gen = torch.Generator().manual_seed(5)
    rows, n = 300, 257
    k_cache = _poison((2, rows, 1, 8), torch.uint8, gen)
    v_cache = _poison((2, rows, 1, 8), torch.uint8, gen)
    cache_k = _randn((n, 1, 8), torch.bfloat16, gen, 50.0)
    cache_v = _randn((n, 1, 8), torch.bfloat16, gen, 50.0)
    loc = (torch.randperm(rows - 1, generator=gen)[:n] + 1).to(DEVICE)
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    kw = dict(k_scale=0.8, cache_dtype=torch.float8_e4m3fn)
    kernels.store_kv_native(ref_k, ref_v, 1, loc, cache_k, cache_v, **kw)
    kernels.store_kv_triton(k_cache, v_cache, 1, loc, cache_k, cache_v, **kw)
    assert _bits_equal(k_cache, ref_k) and _bits_equal(v_cache, ref_v)
    # N = 0 is a no-op.
    empty = torch.empty(0, dtype=torch.int64, device=DEVICE)
    kernels.store_kv_triton(
        k_cache, v_cache, 0, empty, cache_k[:0], cache_v[:0], cache_dtype=torch.float8_e4m3fn
    )  # fmt: skip
    assert _bits_equal(k_cache, ref_k)


@pytest.mark.parametrize("map_dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float8_e4m3fn], ids=["bf16", "e4m3fn"])
def test_store_kv_through_an_index_map(map_dtype, cache_dtype):
    """Rows ``index_map[loc]`` (a sliding-window sub-pool's slots of full-pool locations), translated inside the
    store: the same bytes as storing at the translated rows directly, and nothing else written."""
    gen = torch.Generator().manual_seed(7)
    n, full_slots = 23, 200
    store = dtypes.storage_dtype(cache_dtype)
    k_cache, v_cache = _poison((L, ROWS, H, DK), store, gen), _poison((L, ROWS, H, DV), store, gen)
    index_map = torch.zeros(full_slots, dtype=map_dtype)
    loc = torch.randperm(full_slots - 1, generator=gen)[:n] + 1
    index_map[loc] = (torch.randperm(ROWS - 1, generator=gen)[:n] + 1).to(map_dtype)
    loc, index_map = loc.to(DEVICE), index_map.to(DEVICE)
    cache_k, cache_v = _make_inputs(n, torch.float32, "qkv_split", gen, 20.0)
    want_k, want_v = k_cache.clone(), v_cache.clone()
    kernels.store_kv_native(want_k, want_v, 2, index_map[loc].long(), cache_k, cache_v, cache_dtype=cache_dtype)
    for store_kv in (kernels.store_kv_triton, kernels.store_kv_native):
        got_k, got_v = k_cache.clone(), v_cache.clone()
        store_kv(got_k, got_v, 2, loc, cache_k, cache_v, cache_dtype=cache_dtype, index_map=index_map)
        assert _bits_equal(got_k, want_k) and _bits_equal(got_v, want_v), store_kv.__name__
    with pytest.raises(ValueError, match="index_map"):
        kernels.store_kv_triton(k_cache, v_cache, 0, loc, cache_k, cache_v, cache_dtype=cache_dtype,
                                index_map=index_map.float())  # fmt: skip


@pytest.mark.parametrize("with_map", [False, True], ids=["tokens", "mapped-tokens"])
@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float8_e4m3fn], ids=["bf16", "e4m3fn"])
def test_store_kv_on_page_major_rows(cache_dtype, with_map):
    """``pages=(page_size, rows_per_page)``: token ``t`` (after the map, when one is given) lands on row ``(t //
    page_size) * rows_per_page + t % page_size``, computed in the launch: the same bytes as storing at those rows
    directly (computed here by hand), nothing else written."""
    gen = torch.Generator().manual_seed(8)
    page, rows_per_page, n = 4, 11, 19  # rows_per_page: a page of several layers' key rows, not a power of two
    tokens = (ROWS // rows_per_page) * page  # every token whose row the cache holds
    store = dtypes.storage_dtype(cache_dtype)
    k_cache, v_cache = _poison((L, ROWS, H, DK), store, gen), _poison((L, ROWS, H, DV), store, gen)
    token = torch.randperm(tokens - 1, generator=gen)[:n] + 1
    rows = torch.tensor([(t // page) * rows_per_page + t % page for t in token.tolist()])
    if with_map:  # the call passes full locations whose map gives the tokens
        index_map = torch.zeros(97, dtype=torch.int64)
        loc = torch.randperm(96, generator=gen)[:n] + 1
        index_map[loc] = token
        loc, index_map = loc.to(DEVICE), index_map.to(DEVICE)
    else:
        loc, index_map = token.to(DEVICE), None
    cache_k, cache_v = _make_inputs(n, torch.float32, "qkv_split", gen, 20.0)
    want_k, want_v = k_cache.clone(), v_cache.clone()
    kernels.store_kv_native(want_k, want_v, 1, rows.to(DEVICE), cache_k, cache_v, cache_dtype=cache_dtype)
    for use_triton in (True, False):
        got_k, got_v = k_cache.clone(), v_cache.clone()
        paged = kernels.KVStore(got_k, got_v, cache_dtype, use_triton, pages=(page, rows_per_page))
        paged(1, loc, cache_k, cache_v, index_map=index_map)
        assert _bits_equal(got_k, want_k) and _bits_equal(got_v, want_v), f"use_triton={use_triton}"
    for bad in ((3, 8), (4, 3), (0, 4)):
        with pytest.raises(ValueError, match="pages="):
            kernels.KVStore(k_cache, v_cache, cache_dtype, pages=bad)


def test_store_kv_rejects_bad_arguments():
    k_cache = torch.zeros(2, 8, 1, 8, dtype=torch.bfloat16, device=DEVICE)
    v_cache = torch.zeros(2, 8, 1, 8, dtype=torch.bfloat16, device=DEVICE)
    x = torch.ones(2, 1, 8, dtype=torch.bfloat16, device=DEVICE)
    loc = torch.tensor([1, 2], device=DEVICE)
    with pytest.raises(ValueError):  # fp8 cache must be stored as uint8
        kernels.store_kv_triton(k_cache, v_cache, 0, loc, x, x, cache_dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError):  # layer out of range
        kernels.store_kv_triton(k_cache, v_cache, 2, loc, x, x, cache_dtype=torch.bfloat16)
    with pytest.raises(ValueError):  # shape mismatch
        kernels.store_kv_triton(k_cache, v_cache, 0, loc[:1], x, x, cache_dtype=torch.bfloat16)
    store = kernels.KVStore(k_cache, v_cache, torch.bfloat16)
    store(0, loc, x, x)  # a good call first: its plan is kept
    for bad in (x.reshape(2, 8), x.reshape(16), x.unsqueeze(-1), x[:, :, :4]):  # 2, 1 and 4 dims, another width
        with pytest.raises(ValueError, match=r"cache_k must be \[N, H, Dk\]"):
            store(0, loc, bad, x)
        with pytest.raises(ValueError, match=r"cache_v must be \[N, H, Dv\]"):
            store(0, loc, x, bad)
    k8, v8 = k_cache.view(torch.uint8), v_cache.view(torch.uint8)[..., :8]
    x8 = torch.ones(2, 1, 16, device=DEVICE).to(torch.float8_e4m3fn)
    with pytest.raises(ValueError):  # K and V caches with different head counts / shapes
        kernels.store_kv_triton(k8, v8.reshape(2, 8, 2, 4), 0, loc, x8, x8, cache_dtype=torch.float8_e4m3fn)


# ==========================================================================================================
# CUDA graphs (GPU only)
# ==========================================================================================================


@pytest.mark.gpu
@pytest.mark.skipif(not COMPILED, reason="needs compiled kernels on a CUDA device")
def test_kernels_capture_in_cuda_graph():
    gen = torch.Generator().manual_seed(21)
    k_cache = _poison((3, 64, 2, 16), torch.uint8, gen)
    v_cache = _poison((3, 64, 2, 8), torch.uint8, gen)
    loc = torch.tensor([3, 9, 4], device=DEVICE)
    cache_k = _randn((3, 2, 16), torch.bfloat16, gen, 30.0)
    cache_v = _randn((3, 2, 8), torch.bfloat16, gen, 30.0)
    scale = torch.tensor(0.5, device=DEVICE)
    tgt = torch.tensor([10, 11, 12], device=DEVICE)
    src = torch.tensor([11, 12, 3], device=DEVICE)

    def step(kc, vc):
        kernels.store_kv_triton(kc, vc, 1, loc, cache_k, cache_v, k_scale=scale, v_scale=scale,
                                cache_dtype=torch.float8_e4m3fn)  # fmt: skip
        row_move.move_rows_triton(kc, vc, tgt, src)

    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    kernels.store_kv_native(ref_k, ref_v, 1, loc, cache_k, cache_v, k_scale=scale, v_scale=scale,
                            cache_dtype=torch.float8_e4m3fn)  # fmt: skip
    row_move.move_rows_native(ref_k, ref_v, tgt, src)

    warm_k, warm_v = k_cache.clone(), v_cache.clone()
    step(warm_k, warm_v)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step(k_cache, v_cache)
    graph.replay()
    torch.cuda.synchronize()
    assert _bits_equal(k_cache, ref_k) and _bits_equal(v_cache, ref_v)
