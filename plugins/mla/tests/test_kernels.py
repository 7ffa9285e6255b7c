"""Bit-exact tests of the MLA kernels (split store, concatenated store, gather) against the torch reference.

On a CPU-only machine the Triton kernels run in Triton's interpreter (the root conftest sets
TRITON_INTERPRET=1).  With KVCORE_TEST_COMPILED=1 on a GPU machine the same tests run the compiled kernels
on CUDA tensors.
"""

from __future__ import annotations

import pytest
import torch

from kvcore.kernels import dtypes, row_move
from kvcore.testing.tensors import bits_equal, compiled, poison, randn_nonzero, skip_module_without_device, test_device
from kvcore_mla import kernels


skip_module_without_device()
COMPILED, DEVICE = compiled(), test_device()
# numpy warns when the interpreter's float32 -> float16 cast overflows to inf (as it should).
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")

L = 3
ROWS = 70  # size 64 + page_size 6; row 0 is padding
DIMS = {"small": (64, 16), "dsv3": (512, 64)}  # (kv_lora_rank, qk_rope_head_dim)
FLOATS = (torch.bfloat16, torch.float16, torch.float32)
CACHE_DTYPES = FLOATS + dtypes.FP8_DTYPES
DST_DTYPES = FLOATS + dtypes.FP8_DTYPES


@pytest.fixture(autouse=True, params=["one program a token", "tiles"])
def kernel_shape(request, monkeypatch):
    """Every test runs both store kernels: one program a token (decode sizes, up to ROW_KERNEL_MAX_TOKENS) and
    the tiles (above, and every gather)."""
    if request.param == "tiles":
        monkeypatch.setattr(kernels, "ROW_KERNEL_MAX_TOKENS", 0)
    return request.param


def _name(dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _cache(dims: str, cache_dtype, gen) -> torch.Tensor:
    r, p = DIMS[dims]
    return poison((L, ROWS, 1, r + p), dtypes.storage_dtype(cache_dtype), gen)


def _loc(n, loc_dtype, gen) -> torch.Tensor:
    return (torch.randperm(ROWS - 1, generator=gen)[:n] + 1).to(loc_dtype).to(DEVICE)


def _values(shape, dtype, gen, magnitude) -> torch.Tensor:
    """Random non-zero values of ``dtype`` (fp8 via float32, so they are finite)."""
    if dtypes.is_fp8_dtype(dtype):
        return randn_nonzero(shape, torch.float32, gen, magnitude).to(dtype)
    return randn_nonzero(shape, dtype, gen, magnitude)


def _nope_rope(n, dims, src_dtype, layout, gen, magnitude):
    """(cache_k_nope [n, 1, R], cache_k_rope [n, 1, P]) in the requested memory layout."""
    r, p = DIMS[dims]
    if layout == "contiguous":
        return _values((n, 1, r), src_dtype, gen, magnitude), _values((n, 1, p), src_dtype, gen, magnitude)
    if layout == "split":  # views of one latent projection [n, 1, R + P + extra]: strided token dim
        kv_a = _values((n, 1, r + p + 5), src_dtype, gen, magnitude)
        return kv_a[..., :r], kv_a[..., r : r + p]
    # "strided": the last dim is strided too (every other element of a wider tensor), 2-D inputs
    wide = _values((n, 2 * (r + p)), src_dtype, gen, magnitude)[:, ::2]
    return wide[:, :r], wide[:, r:]


def _changed_rows_only(before, after, layer, loc) -> None:
    written = torch.zeros(L, ROWS, dtype=torch.bool, device=DEVICE)
    written[layer, loc.long()] = True
    assert bits_equal(after[~written], before[~written]), "rows outside loc changed"
    assert bits_equal(after[:, 0], before[:, 0]), "padding row changed"


def _torch_cast(x: torch.Tensor, dtype) -> torch.Tensor:
    """x.to(dtype), as storage-dtype bytes for fp8."""
    y = x.to(dtype)
    return y.view(torch.uint8) if dtypes.is_fp8_dtype(dtype) else y


# ==========================================================================================================
# split store: set_mla_kv_buffer
# ==========================================================================================================

# (src dtype, cache dtype, N, loc dtype, layout, magnitude, dims)
STORE_CASES = [
    (torch.bfloat16, torch.bfloat16, 7, torch.int64, "split", 1.0, "dsv3"),
    (torch.bfloat16, torch.bfloat16, 1, torch.int32, "contiguous", 1.0, "small"),
    (torch.float32, torch.bfloat16, 33, torch.int32, "split", 3.0, "small"),
    (torch.float32, torch.bfloat16, 7, torch.int64, "strided", 3.0, "dsv3"),
    (torch.float32, torch.float16, 33, torch.int64, "contiguous", 3.0, "small"),
    (torch.bfloat16, torch.float32, 7, torch.int32, "strided", 1.0, "small"),
    (torch.float16, torch.bfloat16, 1, torch.int64, "split", 1.0, "dsv3"),
    (torch.float32, torch.float32, 33, torch.int64, "split", 1.0, "small"),
    (torch.bfloat16, torch.float8_e4m3fn, 33, torch.int64, "split", 100.0, "dsv3"),
    (torch.float32, torch.float8_e4m3fn, 7, torch.int32, "strided", 300.0, "small"),  # overflow saturates
    (torch.float16, torch.float8_e4m3fn, 1, torch.int32, "contiguous", 1e-2, "small"),  # subnormals
    (torch.bfloat16, torch.float8_e5m2, 33, torch.int32, "split", 1e4, "small"),
    (torch.float32, torch.float8_e5m2, 7, torch.int64, "contiguous", 1e-4, "dsv3"),
    (torch.float8_e4m3fn, torch.float8_e4m3fn, 7, torch.int64, "split", 10.0, "small"),  # byte copy
    (torch.float8_e4m3fn, torch.bfloat16, 33, torch.int32, "strided", 10.0, "small"),  # fp8 decoded
    (torch.float8_e5m2, torch.float8_e4m3fn, 7, torch.int64, "contiguous", 10.0, "small"),  # fp8 -> fp8
]


def _case_id(case):
    src, dst, n, loc_dtype, layout, _, dims = case
    return f"{_name(src)}->{_name(dst)}-N{n}-{_name(loc_dtype)}-{layout}-{dims}"


@pytest.mark.parametrize("case", STORE_CASES, ids=[_case_id(c) for c in STORE_CASES])
def test_store_nope_rope_matches_reference(case):
    src_dtype, cache_dtype, n, loc_dtype, layout, magnitude, dims = case
    gen = torch.Generator().manual_seed(n)
    r, p = DIMS[dims]
    cache = _cache(dims, cache_dtype, gen)
    loc = _loc(n, loc_dtype, gen)
    nope, rope = _nope_rope(n, dims, src_dtype, layout, gen, magnitude)
    inputs = (nope.clone(), rope.clone())
    layer = 1

    ref, out = cache.clone(), cache.clone()
    kernels.store_nope_rope_native(ref, layer, loc, nope, rope, cache_dtype=cache_dtype)
    kernels.store_nope_rope_triton(out, layer, loc, nope, rope, cache_dtype=cache_dtype)

    assert bits_equal(nope, inputs[0]) and bits_equal(rope, inputs[1]), "inputs modified"
    assert bits_equal(out, ref), "Triton store differs from the torch reference"
    _changed_rows_only(cache, out, layer, loc)
    # Independent check of the reference: the row is nope.to(dtype) then rope.to(dtype), nothing else.
    rows = out[layer, loc.long(), 0]
    assert bits_equal(rows[:, :r], _torch_cast(nope.reshape(n, r), cache_dtype))
    assert bits_equal(rows[:, r:], _torch_cast(rope.reshape(n, p), cache_dtype))


def test_store_nope_rope_last_layer_and_fp8_specials():
    # Every special fp8 input class at once, into the last layer: NaN, +-inf, overflow, ties, subnormals, -0.
    gen = torch.Generator().manual_seed(11)
    r, p = DIMS["small"]
    special = torch.tensor([float("nan"), float("inf"), -float("inf"), 1e6, -500.0, 464.0, -0.0, 2.0**-10,
                            3 * 2.0**-10, 61440.0, 57344.0, 1e-30])  # fmt: skip
    n = 9
    x = randn_nonzero((n, r + p), torch.float32, gen, 50.0)
    x.view(-1)[: special.numel() * 4 : 4] = special.to(DEVICE)
    for cache_dtype in dtypes.FP8_DTYPES:
        cache = _cache("small", cache_dtype, gen)
        loc = _loc(n, torch.int64, gen)
        ref, out = cache.clone(), cache.clone()
        kernels.store_nope_rope_native(ref, L - 1, loc, x[:, :r], x[:, r:], cache_dtype=cache_dtype)
        kernels.store_nope_rope_triton(out, L - 1, loc, x[:, :r], x[:, r:], cache_dtype=cache_dtype)
        assert bits_equal(out, ref), cache_dtype
        assert bits_equal(out[L - 1, loc, 0], x.to(cache_dtype).view(torch.uint8))


def test_store_parts_of_different_dtypes_and_narrower_than_the_row():
    # nope bf16 and rope fp32 (each converted on its own), into a row 8 columns wider than nope + rope.
    gen = torch.Generator().manual_seed(12)
    r, p, extra = 64, 16, 8
    cache = poison((L, ROWS, 1, r + p + extra), torch.uint8, gen)
    loc = _loc(7, torch.int32, gen)
    nope = randn_nonzero((7, 1, r), torch.bfloat16, gen, 20.0)
    rope = randn_nonzero((7, 1, p), torch.float32, gen, 20.0)
    ref, out = cache.clone(), cache.clone()
    kernels.store_nope_rope_native(ref, 0, loc, nope, rope, cache_dtype=torch.float8_e4m3fn)
    kernels.store_nope_rope_triton(out, 0, loc, nope, rope, cache_dtype=torch.float8_e4m3fn)
    assert bits_equal(out, ref)
    assert bits_equal(out[0, loc.long(), 0, r + p :], cache[0, loc.long(), 0, r + p :]), "columns past rope changed"


def test_store_raw_bytes_layout():
    # cache_dtype=uint8: a family's own byte rows (DSA-style: 528 value+scale bytes, 128 rope bytes) copied as is.
    gen = torch.Generator().manual_seed(13)
    cache = poison((2, ROWS, 1, 656), torch.uint8, gen)
    loc = _loc(5, torch.int64, gen)
    nope = poison((5, 1, 528), torch.uint8, gen)
    rope = poison((5, 1, 128), torch.uint8, gen)
    out = cache.clone()
    kernels.store_nope_rope_triton(out, 1, loc, nope, rope, cache_dtype=torch.uint8)
    assert bits_equal(out[1, loc, 0], torch.cat([nope, rope], -1)[:, 0])
    back = (torch.empty_like(nope), torch.empty_like(rope))
    kernels.gather_nope_rope_triton(out, 1, loc, *back, cache_dtype=torch.uint8)
    assert bits_equal(back[0], nope) and bits_equal(back[1], rope)


def test_store_and_gather_are_one_launch(monkeypatch, kernel_shape):
    launches = []
    for kernel in (kernels._mla_rows_kernel, kernels._mla_row_kernel):

        def counting_run(*args, _run=kernel.run, _name=kernel.__name__, **kwargs):
            launches.append(_name)
            return _run(*args, **kwargs)

        monkeypatch.setattr(kernel, "run", counting_run)
    gen = torch.Generator().manual_seed(14)
    cache = _cache("dsv3", torch.bfloat16, gen)
    loc = _loc(33, torch.int64, gen)
    nope, rope = _nope_rope(33, "dsv3", torch.float32, "split", gen, 1.0)
    kernels.store_nope_rope_triton(cache, 0, loc, nope, rope, cache_dtype=torch.bfloat16)
    assert len(launches) == 1
    kernels.store_rows_triton(cache, 0, loc, torch.cat([nope, rope], -1), cache_dtype=torch.bfloat16)
    assert len(launches) == 2
    out = (torch.empty(33, 1, 512, device=DEVICE), torch.empty(33, 1, 64, device=DEVICE))
    kernels.gather_nope_rope_triton(cache, 0, loc, *out, cache_dtype=torch.bfloat16)
    assert len(launches) == 3
    store = "_mla_row_kernel" if kernel_shape == "one program a token" else "_mla_rows_kernel"
    assert launches == [store, store, "_mla_rows_kernel"]


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float8_e4m3fn], ids=_name)
def test_page_major_rows_store_and_gather(cache_dtype):
    """``LatentRows(pages=(page_size, rows_per_page))``: token ``t`` is row ``(t // page_size) * rows_per_page + t %
    page_size`` (computed in the launch) for the split store, the concatenated store and the gather, as rows
    computed by hand give them through the plain rows."""
    gen = torch.Generator().manual_seed(15)
    page, rows_per_page, n = 2, 7, 13
    cache = _cache("small", cache_dtype, gen)
    token = torch.randperm((ROWS // rows_per_page) * page - 1, generator=gen)[:n] + 1
    rows = torch.tensor([(t // page) * rows_per_page + t % page for t in token.tolist()], device=DEVICE)
    token = token.to(DEVICE)
    nope, rope = _nope_rope(n, "small", torch.float32, "split", gen, 1.0)
    for use_triton in (True, False):
        want, got = cache.clone(), cache.clone()
        plain, paged = kernels.LatentRows(want, cache_dtype, use_triton), kernels.LatentRows(
            got, cache_dtype, use_triton, pages=(page, rows_per_page))  # fmt: skip
        plain.store(2, rows, nope, rope)
        paged.store(2, token, nope, rope)
        plain.store_rows(0, rows, torch.cat([nope, rope], -1))
        paged.store_rows(0, token, torch.cat([nope, rope], -1))
        assert bits_equal(got, want), f"use_triton={use_triton}"
        for layer in (0, 2):
            assert all(bits_equal(a, b) for a, b in zip(paged.gather_new(layer, token, torch.float32, 64, 16),
                                                         plain.gather_new(layer, rows, torch.float32, 64, 16)))  # fmt: skip
    with pytest.raises(ValueError, match="pages="):
        kernels.LatentRows(cache, cache_dtype, pages=(3, 7))


# ==========================================================================================================
# concatenated store: set_kv_buffer
# ==========================================================================================================

CONCAT_CASES = [
    (torch.bfloat16, torch.bfloat16, 33, "dsv3", False),
    (torch.float32, torch.bfloat16, 7, "small", True),
    (torch.bfloat16, torch.float8_e4m3fn, 33, "dsv3", True),
    (torch.float32, torch.float8_e5m2, 1, "small", False),
    (torch.float16, torch.float32, 7, "small", False),
]


@pytest.mark.parametrize(
    "src_dtype, cache_dtype, n, dims, strided", CONCAT_CASES,
    ids=[f"{_name(c[0])}->{_name(c[1])}-N{c[2]}-{c[3]}{'-strided' if c[4] else ''}" for c in CONCAT_CASES],
)  # fmt: skip
def test_concatenated_store_matches_reference_and_split_store(src_dtype, cache_dtype, n, dims, strided):
    gen = torch.Generator().manual_seed(20 + n)
    r, p = DIMS[dims]
    cache = _cache(dims, cache_dtype, gen)
    loc = _loc(n, torch.int32 if n == 7 else torch.int64, gen)
    nope, rope = _nope_rope(n, dims, src_dtype, "split", gen, 50.0)
    cat = torch.cat([nope, rope], -1)
    if strided:  # rows of a wider tensor
        wide = _values((n, 1, r + p + 7), src_dtype, gen, 1.0)
        wide[..., 3 : 3 + r + p] = cat
        cat = wide[..., 3 : 3 + r + p]
    before = cat.clone()

    split, ref, out = cache.clone(), cache.clone(), cache.clone()
    kernels.store_nope_rope_triton(split, 2, loc, nope, rope, cache_dtype=cache_dtype)
    kernels.store_rows_native(ref, 2, loc, cat, cache_dtype=cache_dtype)
    kernels.store_rows_triton(out, 2, loc, cat, cache_dtype=cache_dtype)
    assert bits_equal(cat, before)
    assert bits_equal(out, ref), "Triton concatenated store differs from the torch reference"
    assert bits_equal(out, split), "concatenated store differs from the split store of the same values"
    _changed_rows_only(cache, out, 2, loc)


def test_concatenated_store_power_of_two_row():
    # A power-of-two row (no split tail): one part only.
    gen = torch.Generator().manual_seed(30)
    cache = poison((L, ROWS, 1, 64), torch.float16, gen)
    loc = _loc(5, torch.int64, gen)
    x = randn_nonzero((5, 64), torch.float32, gen, 3.0)
    ref, out = cache.clone(), cache.clone()
    kernels.store_rows_native(ref, 0, loc, x, cache_dtype=torch.float16)
    kernels.store_rows_triton(out, 0, loc, x, cache_dtype=torch.float16)
    assert bits_equal(out, ref)


# ==========================================================================================================
# gather: get_mla_kv_buffer
# ==========================================================================================================


def _nan_mask(x: torch.Tensor) -> torch.Tensor:
    return x.float().isnan()


def _same_values(out: torch.Tensor, ref: torch.Tensor) -> bool:
    """Bit-exact, except that a NaN only has to stay a NaN (payload and sign of float-to-float NaN
    conversions differ between torch's own CPU and CUDA paths)."""
    if out.shape != ref.shape or out.dtype != ref.dtype:
        return False
    nan = _nan_mask(ref)
    if not torch.equal(nan, _nan_mask(out)):
        return False
    return bits_equal(out[~nan], ref[~nan])


def _gather_both(cache, layer, loc, dims, dst_dtype, cache_dtype, out_layout="contiguous"):
    r, p = DIMS[dims]
    n = loc.shape[0]

    def outputs():
        if out_layout == "contiguous":
            return (torch.empty(n, 1, r, dtype=dst_dtype, device=DEVICE),
                    torch.empty(n, 1, p, dtype=dst_dtype, device=DEVICE))  # fmt: skip
        both = torch.empty(n, 1, r + p + 3, dtype=dst_dtype, device=DEVICE)  # views of one wider tensor
        return both[..., :r], both[..., r + 3 :]

    ref, out = outputs(), outputs()
    before = cache.clone()
    kernels.gather_nope_rope_native(cache, layer, loc, *ref, cache_dtype=cache_dtype)
    kernels.gather_nope_rope_triton(cache, layer, loc, *out, cache_dtype=cache_dtype)
    assert bits_equal(cache, before), "gather modified the cache"
    return ref, out


@pytest.mark.parametrize("dst_dtype", DST_DTYPES, ids=_name)
@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES, ids=_name)
def test_gather_every_destination_dtype(cache_dtype, dst_dtype):
    """Rows written by the store, read back in every destination dtype: bit-exact with torch's .to()."""
    gen = torch.Generator().manual_seed(40)
    dims = "small"
    n = 33
    cache = _cache(dims, cache_dtype, gen)
    loc = _loc(n, torch.int32, gen)
    nope, rope = _nope_rope(n, dims, torch.float32, "split", gen, 30.0)
    kernels.store_nope_rope_native(cache, 1, loc, nope, rope, cache_dtype=cache_dtype)
    ref, out = _gather_both(cache, 1, loc, dims, dst_dtype, cache_dtype)
    for o, rf in zip(out, ref):
        assert bits_equal(o, rf)
    # independent: the stored row viewed as the cache dtype, then torch's .to(dst_dtype)
    rows = cache[1, loc.long(), 0]
    rows = rows.view(cache_dtype) if dtypes.is_fp8_dtype(cache_dtype) else rows
    assert bits_equal(out[0][:, 0], rows[:, : DIMS[dims][0]].to(dst_dtype))


@pytest.mark.parametrize("dst_dtype", DST_DTYPES, ids=_name)
@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES, ids=_name)
def test_gather_every_bit_pattern(cache_dtype, dst_dtype):
    """Rows of random bytes (fp8: every one of the 256 bytes, NaN and inf included), DeepSeek-V3 width,
    int64 locations, outputs that are strided views."""
    gen = torch.Generator().manual_seed(41)
    dims = "dsv3"
    n = 7
    cache = _cache(dims, cache_dtype, gen)
    loc = _loc(n, torch.int64, gen)
    if dtypes.is_fp8_dtype(cache_dtype):
        every = torch.arange(256, dtype=torch.int32).to(torch.uint8).repeat(n * 576 // 256 + 1)[: n * 576]
        cache[2, loc] = every.reshape(n, 1, 576).to(DEVICE)
    ref, out = _gather_both(cache, 2, loc, dims, dst_dtype, cache_dtype, out_layout="views")
    # torch 2.11 on an H200 decodes e5m2 NaN bytes (0x7d-0x7f, 0xfd-0xff) to the canonical float32 NaN
    # 0x7fffffff, while its CPU path (and kvcore, on both) keeps the payload: measured 2026-11-29
    # (benchmarks/RESULTS.md). Off the CPU, that decode is compared as values, NaN staying NaN.
    cpu_nan_decode = DEVICE == "cpu" or cache_dtype != torch.float8_e5m2
    exact = cache_dtype == dst_dtype or dtypes.is_fp8_dtype(dst_dtype) or (
        dtypes.is_fp8_dtype(cache_dtype) and dst_dtype == torch.float32 and cpu_nan_decode
    )
    for o, rf in zip(out, ref):
        assert bits_equal(o, rf) if exact else _same_values(o, rf)


@pytest.mark.parametrize("n", [1, 33])
def test_gather_native_and_triton_agree_on_padding_and_duplicates(n):
    # Reading the padding row and the same row twice is fine (reads never race).
    gen = torch.Generator().manual_seed(42)
    cache = _cache("small", torch.bfloat16, gen)
    loc = torch.cat([torch.zeros(1, dtype=torch.int64, device=DEVICE), _loc(n, torch.int64, gen)])[:n]
    loc[-1] = loc[0]
    ref, out = _gather_both(cache, 0, loc, "small", torch.float32, torch.bfloat16)
    assert bits_equal(out[0], ref[0]) and bits_equal(out[1], ref[1])


@pytest.mark.parametrize("n", [0, 1, 33])
@pytest.mark.parametrize("dst_dtype", (torch.bfloat16, torch.float32), ids=_name)
def test_gather_new_returns_disjoint_contiguous_rows(n, dst_dtype):
    """``gather_new`` (get_mla_kv_buffer's path): two new contiguous tensors holding what the torch reference
    gathers into tensors of its own; writing one leaves the other alone."""
    gen = torch.Generator().manual_seed(43)
    r, p = DIMS["small"]
    cache = _cache("small", torch.bfloat16, gen)
    loc = _loc(n, torch.int64, gen)
    nope, rope = kernels.LatentRows(cache, torch.bfloat16, use_triton=True).gather_new(2, loc, dst_dtype, r, p)
    assert (nope.shape, rope.shape) == ((n, 1, r), (n, 1, p)) and nope.dtype == rope.dtype == dst_dtype
    assert nope.is_contiguous() and rope.is_contiguous()
    ref_nope, ref_rope = torch.empty_like(nope), torch.empty_like(rope)
    kernels.gather_nope_rope_native(cache, 2, loc, ref_nope, ref_rope, cache_dtype=torch.bfloat16)
    assert bits_equal(nope, ref_nope) and bits_equal(rope, ref_rope)
    nope.fill_(7.0)
    assert bits_equal(rope, ref_rope), "the two outputs overlap"
    with pytest.raises(ValueError, match="do not fit a cache row"):
        kernels.LatentRows(cache, torch.bfloat16).gather_new(0, loc, dst_dtype, r, p + 1)


# ==========================================================================================================
# edge cases and errors
# ==========================================================================================================


def test_empty_is_a_no_op():
    gen = torch.Generator().manual_seed(50)
    cache = _cache("small", torch.float8_e4m3fn, gen)
    before = cache.clone()
    empty = torch.empty(0, dtype=torch.int64, device=DEVICE)
    nope, rope = torch.empty(0, 1, 64, device=DEVICE), torch.empty(0, 1, 16, device=DEVICE)
    for store in (kernels.store_nope_rope_triton, kernels.store_nope_rope_native):
        store(cache, 0, empty, nope, rope, cache_dtype=torch.float8_e4m3fn)
    kernels.store_rows_triton(cache, 0, empty, torch.empty(0, 80, device=DEVICE), cache_dtype=torch.float8_e4m3fn)
    kernels.gather_nope_rope_triton(cache, 0, empty, nope, rope, cache_dtype=torch.float8_e4m3fn)
    assert bits_equal(cache, before)


def test_rejects_bad_arguments():
    cache = torch.zeros(2, 8, 1, 80, dtype=torch.bfloat16, device=DEVICE)
    nope = torch.ones(2, 1, 64, dtype=torch.bfloat16, device=DEVICE)
    rope = torch.ones(2, 1, 16, dtype=torch.bfloat16, device=DEVICE)
    loc = torch.tensor([1, 2], device=DEVICE)
    store = kernels.store_nope_rope_triton
    with pytest.raises(ValueError, match="stored as"):  # fp8 cache must be stored as uint8
        store(cache, 0, loc, nope, rope, cache_dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="layer_index"):
        store(cache, 2, loc, nope, rope, cache_dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="N = len"):
        store(cache, 0, loc[:1], nope, rope, cache_dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="do not fit"):
        wide_rope = torch.ones(2, 1, 17, dtype=torch.bfloat16, device=DEVICE)
        store(cache, 0, loc, nope, wide_rope, cache_dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="loc"):
        store(cache, 0, loc.float(), nope, rope, cache_dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="unsupported"):
        store(cache, 0, loc, nope.to(torch.int32), rope, cache_dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="raw uint8"):
        raw_cache, raw_nope = cache.view(torch.uint8)[..., :80], nope.view(torch.uint8)[..., :64]
        store(raw_cache, 0, loc, raw_nope, rope, cache_dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="contiguous"):
        store(cache[..., ::2], 0, loc, nope[..., :32], rope[..., :8], cache_dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="alias"):
        kernels.gather_nope_rope_triton(cache, 0, loc, cache[0, :2, :, :64], rope, cache_dtype=torch.bfloat16)


# ==========================================================================================================
# CUDA graphs (GPU only)
# ==========================================================================================================


@pytest.mark.gpu
@pytest.mark.skipif(not COMPILED, reason="needs compiled kernels on a CUDA device")
def test_kernels_capture_in_cuda_graph():
    gen = torch.Generator().manual_seed(60)
    cache = _cache("dsv3", torch.float8_e4m3fn, gen)
    loc = torch.tensor([3, 9, 4], device=DEVICE)
    nope, rope = _nope_rope(3, "dsv3", torch.bfloat16, "split", gen, 30.0)
    cat = torch.cat([nope, rope], -1)
    loc2 = torch.tensor([20, 21, 22], device=DEVICE)
    tgt, src = torch.tensor([30, 31, 32], device=DEVICE), torch.tensor([31, 32, 3], device=DEVICE)
    out = (torch.empty(3, 1, 512, dtype=torch.bfloat16, device=DEVICE),
           torch.empty(3, 1, 64, dtype=torch.bfloat16, device=DEVICE))  # fmt: skip

    def step(c, o):
        kernels.store_nope_rope_triton(c, 1, loc, nope, rope, cache_dtype=torch.float8_e4m3fn)
        kernels.store_rows_triton(c, 2, loc2, cat, cache_dtype=torch.float8_e4m3fn)
        row_move.move_rows_triton(c, None, tgt, src)
        kernels.gather_nope_rope_triton(c, 1, loc, *o, cache_dtype=torch.float8_e4m3fn)

    ref = cache.clone()
    ref_out = (torch.empty_like(out[0]), torch.empty_like(out[1]))
    kernels.store_nope_rope_native(ref, 1, loc, nope, rope, cache_dtype=torch.float8_e4m3fn)
    kernels.store_rows_native(ref, 2, loc2, cat, cache_dtype=torch.float8_e4m3fn)
    row_move.move_rows_native(ref, None, tgt, src)
    kernels.gather_nope_rope_native(ref, 1, loc, *ref_out, cache_dtype=torch.float8_e4m3fn)

    step(cache.clone(), (torch.empty_like(out[0]), torch.empty_like(out[1])))  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step(cache, out)
    graph.replay()
    torch.cuda.synchronize()
    assert bits_equal(cache, ref)
    assert bits_equal(out[0], ref_out[0]) and bits_equal(out[1], ref_out[1])
