"""Call plans of the MHA family's stores (:class:`kvcore.kernels.launch.Plan`): :class:`KVStore` (the MHA and page-major
pools' store) and :class:`RowStore` check and plan a call signature once, then launch from the plan.

Every later call of a signature writes what the torch reference writes, whatever its data, locations, layer,
scales and index map (read per call, never baked into the plan); a call the checks refuse is refused as a store
without plans refuses it, after good calls of a neighbouring signature too, and writes nothing; inputs and
locations of other strides after contiguous ones get plans of their own and land where they should.

Stores run their Triton kernels (interpreted on the CPU, compiled on CUDA with KVCORE_TEST_COMPILED=1)."""

from __future__ import annotations

import pytest
import torch

from kvcore.kernels.dtypes import storage_dtype
from kvcore.testing.tensors import bits_equal, poison, randn_nonzero, skip_module_without_device, test_device
from kvcore_mha.kernels import KVStore
from kvcore_mha.page_major import PageMajorMHATokenToKVPool
from kvcore_mha.pool import MHATokenToKVPool
from kvcore_mha.row_store import RowStore

skip_module_without_device()
DEVICE = test_device()

L, R, H, DK, DV = 3, 40, 2, 24, 8  # layers, rows (row 0 is padding), heads, key and value widths
N = 6
FP8 = torch.float8_e4m3fn


# ==========================================================================================================
# helpers
# ==========================================================================================================


def kv_stores(cache_dtype: torch.dtype, index_map: torch.Tensor | None = None, seed: int = 0
              ) -> tuple[KVStore, KVStore]:  # fmt: skip
    """A Triton store and its torch reference over two copies of the same random cache bytes."""
    gen = torch.Generator().manual_seed(seed)
    store = storage_dtype(cache_dtype)
    k, v = poison((L, R, H, DK), store, gen), poison((L, R, H, DV), store, gen)
    return (KVStore(k, v, cache_dtype, index_map=index_map),
            KVStore(k.clone(), v.clone(), cache_dtype, use_triton=False, index_map=index_map))  # fmt: skip


def same_caches(a: KVStore, b: KVStore) -> bool:
    return bits_equal(a.k_cache, b.k_cache) and bits_equal(a.v_cache, b.v_cache)


def kv_inputs(dtype: torch.dtype, seed: int, layout: str = "contiguous", n: int = N
              ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """``cache_k`` [n, H, DK] and ``cache_v`` [n, H, DV] in a memory layout: contiguous, views of a fused qkv
    projection (strided tokens; ``misaligned``: one element off, addresses no multiple of 16), or transposed
    (strided heads and dims)."""
    gen = torch.Generator().manual_seed(seed)
    if layout == "contiguous":
        return randn_nonzero((n, H, DK), dtype, gen, 3.0), randn_nonzero((n, H, DV), dtype, gen, 3.0)
    if layout in ("qkv_split", "misaligned"):
        fused = randn_nonzero((n, 2 * H * DK + H * DV + 3), dtype, gen, 3.0)
        k0 = H * DK + (layout == "misaligned")
        return fused[:, k0 : k0 + H * DK].view(n, H, DK), fused[:, k0 + H * DK : k0 + H * DK + H * DV].view(n, H, DV)
    assert layout == "transposed"
    k, v = randn_nonzero((n, DK, H), dtype, gen, 3.0), randn_nonzero((n, DV, H), dtype, gen, 3.0)
    return k.transpose(1, 2), v.transpose(1, 2)


def locations(seed: int, n: int = N, dtype: torch.dtype = torch.int64, step: int = 1, rows: int = R,
              offset: int = 0) -> torch.Tensor:  # fmt: skip
    """``n`` distinct rows in ``[1, rows)``; ``step`` > 1: every ``step``-th element of a wider tensor; ``offset``
    elements into it (an address no multiple of 16)."""
    picked = (torch.randperm(rows - 1, generator=torch.Generator().manual_seed(seed))[:n] + 1).to(dtype)
    wide = torch.zeros(offset + n * step, dtype=dtype)
    wide[offset::step] = picked
    return wide.to(DEVICE)[offset::step]


def scale_of(kind: str | None, call: int):
    """A scale of the given kind that differs from call to call (a plan must read it per call)."""
    if kind == "float":
        return 0.5 + 0.25 * call
    if kind == "tensor":
        return torch.tensor([2.0 - 0.375 * call], device=DEVICE)  # a new tensor, of the same signature, each call
    return None


def refusal(call) -> str:
    """The ValueError message of ``call()``."""
    with pytest.raises(ValueError) as info:
        call()
    return str(info.value)


# ==========================================================================================================
# KVStore
# ==========================================================================================================


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, FP8], ids=["bf16", "fp8"])
@pytest.mark.parametrize("scales", [None, "float", "tensor", "mixed"])
@pytest.mark.parametrize("mapped", [False, True], ids=["loc", "index_map"])
def test_kv_store_later_calls_of_a_signature_write_their_own_rows(cache_dtype, scales, mapped):
    """One plan serves every call of a signature: new data, locations, layers, scale values (a float scale's
    value, a scale tensor's address) and index maps each call, bytes as the torch reference writes them."""
    got, want = kv_stores(cache_dtype)
    for call in range(4):
        k, v = kv_inputs(torch.float32, seed=10 + call)
        loc = locations(seed=call)
        if mapped:  # a new map each call (same signature): the rows are map[loc]
            loc = locations(seed=call, rows=3 * R)
            index_map = torch.zeros(3 * R, dtype=torch.int64)
            index_map[loc.cpu()] = locations(seed=100 + call).cpu()
            index_map = index_map.to(DEVICE)
        else:
            index_map = None
        k_scale = scale_of("float" if scales == "mixed" else scales, call)
        v_scale = scale_of("tensor" if scales == "mixed" else scales, call)
        for store in (got, want):
            store(call % L, loc, k, v, k_scale, v_scale, index_map)
        assert same_caches(got, want), f"call {call}"
    assert len(got._plans) == 1, "the later calls planned again"


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, FP8], ids=["bf16", "fp8"])
def test_kv_store_inputs_of_the_cache_dtype_are_copied_call_after_call(cache_dtype):
    """Inputs already in the cache dtype (fp8 ones read as their bytes) are copied, any scales ignored."""
    got, want = kv_stores(cache_dtype)
    for call in range(3):
        k, v = kv_inputs(cache_dtype, seed=20 + call, layout="qkv_split")
        loc = locations(seed=30 + call)
        for store in (got, want):
            store(call % L, loc, k, v, scale_of("tensor", call), scale_of("float", call))
        assert same_caches(got, want)
        assert bits_equal(got.k_cache[call % L, loc], k.view(got.k_cache.dtype))
    assert len(got._plans) == 1


def test_kv_store_other_strides_after_contiguous_inputs_land_right():
    """Inputs of other strides or alignments, and strided, misaligned or int32 locations, after a contiguous call:
    each signature its own plan, every call's bytes the reference's.  (Alignment changes no byte under the
    interpreter; compiled with KVCORE_LAUNCH_CHECK=1, a plan of the wrong alignment fails its launch check.)"""
    got, want = kv_stores(FP8)
    calls = [("contiguous", 1, 0, torch.int64), ("qkv_split", 1, 0, torch.int64), ("misaligned", 1, 0, torch.int64),
             ("transposed", 1, 0, torch.int64), ("contiguous", 2, 0, torch.int64), ("contiguous", 1, 1, torch.int64),
             ("transposed", 3, 0, torch.int32), ("contiguous", 1, 0, torch.int64)]  # fmt: skip
    for call, (layout, step, offset, loc_dtype) in enumerate(calls):
        k, v = kv_inputs(torch.bfloat16, seed=40 + call, layout=layout)
        loc = locations(seed=50 + call, dtype=loc_dtype, step=step, offset=offset)
        for store in (got, want):
            store(call % L, loc, k, v, 0.75)
        assert same_caches(got, want), f"call {call}: {layout}, loc step {step} offset {offset}, {loc_dtype}"
    assert len(got._plans) == len(calls) - 1, "the last call (the first's signature) planned again"


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, FP8], ids=["bf16", "fp8"])
def test_kv_store_scales_of_another_kind_than_the_last_calls(cache_dtype):
    """Scales of each kind (none, a number, a tensor; K's and V's apart) after calls with others, every other
    argument's signature the same: each kind its own plan, each call scaled as the reference scales."""
    got, want = kv_stores(cache_dtype)
    k, v = kv_inputs(torch.float32, seed=7, layout="qkv_split")
    kinds = [(None, None), ("float", "float"), ("tensor", "tensor"), (None, None), ("float", None), (None, "tensor"),
             ("tensor", "float"), ("float", "float")]  # fmt: skip
    for call, (k_kind, v_kind) in enumerate(kinds):
        loc = locations(seed=call)
        for store in (got, want):
            store(call % L, loc, k, v, scale_of(k_kind, call), scale_of(v_kind, call))
        assert same_caches(got, want), f"call {call}: scales {k_kind}, {v_kind}"
    assert len(got._plans) == 6


def test_kv_store_refuses_after_good_calls_as_without_plans():
    """A call the checks refuse, its signature one value away from a planned one's, is refused with the message
    of a store that never planned, every time, and writes nothing."""
    got, want = kv_stores(torch.bfloat16)
    k, v = kv_inputs(torch.float32, seed=1)
    loc = locations(seed=2)
    index_map = torch.arange(R, device=DEVICE)
    for store in (got, want):
        store(1, loc, k, v, torch.tensor(0.5, device=DEVICE), None, index_map)  # plans this signature
    assert len(got._plans) == 1
    bad_calls = {
        "an input dtype no kernel converts": (1, loc, k.to(torch.int32), v.to(torch.int32)),
        "cache_v of another dtype": (1, loc, k, v.to(torch.float16)),
        "cache_k of another width": (1, loc, k[..., : DK - 1], v),
        "cache_v of other heads": (1, loc, k, v[:, :1]),
        "loc of another length": (1, loc[:-1], k, v),
        "loc of a float dtype": (1, loc.float(), k, v),
        "loc of two dims": (1, loc[:, None], k, v),
        "a layer out of range": (L, loc, k, v),
        "a negative layer": (-1, loc, k, v),
    }
    for what, (layer, bad_loc, bad_k, bad_v) in bad_calls.items():
        fresh, _ = kv_stores(torch.bfloat16)
        expected = refusal(lambda: fresh(layer, bad_loc, bad_k, bad_v, torch.tensor(0.5, device=DEVICE), None,
                                         index_map))  # fmt: skip
        for _ in range(2):
            assert refusal(lambda: got(layer, bad_loc, bad_k, bad_v, torch.tensor(0.5, device=DEVICE), None,
                                       index_map)) == expected, what  # fmt: skip
    bad_scales = {"a scale tensor of two elements": torch.tensor([0.5, 0.5], device=DEVICE)}
    if DEVICE != "cpu":
        bad_scales["a scale tensor on another device"] = torch.tensor(0.5)
    for what, bad_scale in bad_scales.items():
        fresh, _ = kv_stores(torch.bfloat16)
        expected = refusal(lambda: fresh(1, loc, k, v, bad_scale, None, index_map))
        assert refusal(lambda: got(1, loc, k, v, bad_scale, None, index_map)) == expected, what
    fresh, _ = kv_stores(torch.bfloat16)
    bad_map = index_map.float()
    expected = refusal(lambda: fresh(1, loc, k, v, torch.tensor(0.5, device=DEVICE), None, bad_map))
    assert refusal(lambda: got(1, loc, k, v, torch.tensor(0.5, device=DEVICE), None, bad_map)) == expected
    strided_map = torch.arange(2 * R, device=DEVICE)[::2]  # the kernel reads a map's entries packed
    for store in (got, want):
        with pytest.raises(ValueError, match="index_map must be contiguous"):
            store(1, loc, k, v, torch.tensor(0.5, device=DEVICE), None, strided_map)
    assert same_caches(got, want), "a refused call wrote"


def test_kv_store_with_its_own_map_writes_through_it_and_takes_no_other():
    """A store given a map at creation (a page-major pool's) writes rows ``map[loc]`` on every call and refuses a
    call's own map; a map that is not 1-D int32/int64 is refused at creation."""
    own = torch.randperm(R - 1, generator=torch.Generator().manual_seed(3)).add(1).to(DEVICE)
    got, want = kv_stores(torch.bfloat16, index_map=own)
    _, by_map = kv_stores(torch.bfloat16)
    for call in range(3):
        k, v = kv_inputs(torch.bfloat16, seed=60 + call, layout="qkv_split")
        loc = locations(seed=70 + call, rows=R - 1)
        for store in (got, want):
            store(call % L, loc, k, v)
        by_map(call % L, loc, k, v, index_map=own)
        assert same_caches(got, want) and same_caches(got, by_map), f"call {call}"
    message = "writes every call through its own index_map"
    with pytest.raises(ValueError, match=message):
        got(0, loc, k, v, index_map=torch.arange(R, device=DEVICE))
    with pytest.raises(ValueError, match=message):
        want(0, loc, k, v, index_map=torch.arange(R, device=DEVICE))
    with pytest.raises(ValueError, match="index_map must be a 1-D int32/int64 tensor"):
        kv_stores(torch.bfloat16, index_map=own.float())


# ==========================================================================================================
# The pools over KVStore
# ==========================================================================================================


def pools(cls, dtype: torch.dtype = torch.bfloat16):
    """A pool on Triton kernels and one on the torch reference, alike."""
    kw = dict(size=32, page_size=4, dtype=dtype, head_num=H, head_dim=DK, layer_num=L, device=DEVICE,
              enable_memory_saver=False, start_layer=2)  # fmt: skip
    return cls(kernels="triton", **kw), cls(kernels="native", **kw)


@pytest.mark.parametrize("cls", [MHATokenToKVPool, PageMajorMHATokenToKVPool], ids=["mha", "page_major"])
def test_pools_write_every_call_as_their_reference(cls):
    """Calls of one signature over layers, then other layouts and [N, H * D] inputs: the reference's bytes."""
    got, want = pools(cls, FP8)
    layouts = ["contiguous"] * 3 + ["qkv_split", "flat"]
    for call, layout in enumerate(layouts):
        gen = torch.Generator().manual_seed(80 + call)
        k, v = randn_nonzero((N, H, DK), torch.bfloat16, gen, 3.0), randn_nonzero((N, H, DK), torch.bfloat16, gen, 3.0)
        if layout == "qkv_split":
            fused = randn_nonzero((N, 3 * H * DK), torch.bfloat16, gen, 3.0)
            k, v = fused[:, H * DK : 2 * H * DK].view(N, H, DK), fused[:, 2 * H * DK :].view(N, H, DK)
        elif layout == "flat":
            k, v = k.reshape(N, H * DK), v.reshape(N, H * DK)
        loc = locations(seed=90 + call, rows=33)
        for pool in (got, want):
            pool.set_kv_buffer(2 + call % L, loc, k, v)
        for name, buf in got.buffers().items():
            assert bits_equal(buf, want.buffers()[name]), f"call {call} ({layout}): {name}"


@pytest.mark.parametrize("cls", [MHATokenToKVPool, PageMajorMHATokenToKVPool], ids=["mha", "page_major"])
def test_pools_name_the_layer_of_a_call_refused_after_good_ones(cls):
    got, _ = pools(cls)
    gen = torch.Generator().manual_seed(4)
    k, v = randn_nonzero((N, H, DK), torch.bfloat16, gen), randn_nonzero((N, H, DK), torch.bfloat16, gen)
    loc = locations(seed=5, rows=33)
    got.set_kv_buffer(3, loc, k, v)
    with pytest.raises(ValueError, match=r"layer 4: cache_k must be \[N, H, Dk\]"):
        got.set_kv_buffer(4, loc[:-1], k, v)
    with pytest.raises(IndexError, match="layer 5 is not stored"):
        got.set_kv_buffer(5, loc, k, v)
    with pytest.raises(IndexError, match="layer 1 is not stored"):
        got.set_kv_buffer(None, loc, k, v, layer_id_override=1)


# ==========================================================================================================
# RowStore
# ==========================================================================================================

ROW_SHAPES = [(2, 5), (2, 3), (1, 7)]


def row_stores(count: int, cache_dtype: torch.dtype) -> tuple[RowStore, RowStore]:
    gen = torch.Generator().manual_seed(count)
    caches = [poison((L, R, *shape), storage_dtype(cache_dtype), gen) for shape in ROW_SHAPES[:count]]
    return RowStore(caches, cache_dtype), RowStore([c.clone() for c in caches], cache_dtype, use_triton=False)


def row_inputs(count: int, dtype: torch.dtype, seed: int, strided: bool = False) -> list[torch.Tensor]:
    """One input per buffer; ``strided``: every other token and column of a wider tensor."""
    gen = torch.Generator().manual_seed(seed)
    if not strided:
        return [randn_nonzero((N, *shape), dtype, gen, 3.0) for shape in ROW_SHAPES[:count]]
    return [randn_nonzero((2 * N, h, 2 * d), dtype, gen, 3.0)[::2, :, ::2] for h, d in ROW_SHAPES[:count]]


def same_rows(a: RowStore, b: RowStore) -> bool:
    return all(bits_equal(x, y) for x, y in zip(a.caches, b.caches))


@pytest.mark.parametrize("count", [1, 2, 3])
@pytest.mark.parametrize("cache_dtype,source", [(torch.bfloat16, torch.float32), (FP8, torch.bfloat16), (FP8, FP8)],
                         ids=["bf16", "fp8", "fp8_bytes"])  # fmt: skip
def test_row_store_later_calls_and_other_strides_write_their_own_rows(count, cache_dtype, source):
    """Three calls of one signature (new data, locations, layers), then strided inputs and locations, then the
    first signature again: the reference's bytes every time, one plan per signature."""
    got, want = row_stores(count, cache_dtype)
    calls = [(False, 1), (False, 1), (False, 1), (True, 1), (False, 2), (False, 1)]
    for call, (strided, step) in enumerate(calls):
        inputs = row_inputs(count, source, seed=call, strided=strided)
        loc = locations(seed=10 + call, step=step)
        for store in (got, want):
            store(call % L, loc, *inputs)
        assert same_rows(got, want), f"call {call}"
    assert len(got._plans) == 3


def test_row_store_refuses_after_good_calls_as_without_plans():
    got, want = row_stores(2, torch.bfloat16)
    a, b = row_inputs(2, torch.bfloat16, seed=1)
    loc = locations(seed=2)
    for store in (got, want):
        store(0, loc, a, b)
    bad_calls = {
        "one input short": (0, loc, a),
        "an input of another width": (0, loc, a, b[..., :-1]),
        "loc of another length": (0, loc[:-1], a, b),
        "loc of a float dtype": (0, loc.float(), a, b),
        "an input dtype no kernel converts": (0, loc, a, b.to(torch.int32)),
        "a layer out of range": (L, loc, a, b),
    }
    for what, args in bad_calls.items():
        fresh, _ = row_stores(2, torch.bfloat16)
        expected = refusal(lambda: fresh(*args))
        for _ in range(2):
            assert refusal(lambda: got(*args)) == expected, what
    assert same_rows(got, want), "a refused call wrote"
