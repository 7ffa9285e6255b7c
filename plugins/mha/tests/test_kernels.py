"""Bit-exact tests of the MHA kernels (store_kv, move_kv_cache) and the shared fp8 / bf16 encoders.

On a CPU-only machine the Triton kernels run in Triton's interpreter (the root conftest sets
TRITON_INTERPRET=1).  With KVCORE_TEST_COMPILED=1 on a GPU machine the same tests run the compiled kernels
on CUDA tensors.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest
import torch
import triton
import triton.language as tl

from kvcore import fp8

try:
    from kvcore_mha import kernels
except ImportError:  # the plugin package is not installed yet: load the module from its path
    _path = Path(__file__).resolve().parents[1] / "kernels.py"
    _spec = importlib.util.spec_from_file_location("_kvcore_mha_kernels_under_test", _path)
    kernels = importlib.util.module_from_spec(_spec)
    sys.modules[_spec.name] = kernels
    _spec.loader.exec_module(kernels)

COMPILED = os.environ.get("KVCORE_TEST_COMPILED") == "1"
if COMPILED and not torch.cuda.is_available():
    pytest.skip("KVCORE_TEST_COMPILED=1 needs a CUDA device", allow_module_level=True)
DEVICE = "cuda" if COMPILED else "cpu"


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(_bytes(a), _bytes(b))


def _poison(shape, dtype, gen) -> torch.Tensor:
    """Random bytes (NaN bit patterns included; compare bytes, never values)."""
    elem = torch.empty((), dtype=dtype).element_size()
    n = 1
    for s in shape:
        n *= s
    raw = torch.randint(0, 256, (n * elem,), dtype=torch.uint8, generator=gen)
    return raw.view(dtype).reshape(shape).to(DEVICE)


def _randn(shape, dtype, gen, scale=1.0) -> torch.Tensor:
    x = torch.randn(shape, generator=gen, dtype=torch.float32) * scale
    x = torch.where(x == 0, torch.ones_like(x), x)
    return x.to(dtype).to(DEVICE)


# ==========================================================================================================
# fp8 / bf16 encoders and decoders
# ==========================================================================================================


@triton.jit
def _encode_kernel(x_ptr, out_ptr, n, KIND: tl.constexpr, SATURATE: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask, other=0.0)
    if KIND == 0:
        tl.store(out_ptr + offs, fp8.f32_to_bf16_bits(x).to(tl.int16), mask=mask)
    else:
        tl.store(out_ptr + offs, fp8.f32_to_fp8_bits(x, KIND, SATURATE).to(tl.uint8), mask=mask)


@triton.jit
def _decode_kernel(b_ptr, out_ptr, n, KIND: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    b = tl.load(b_ptr + offs, mask=mask, other=0)
    tl.store(out_ptr + offs, fp8.fp8_bits_to_f32(b, KIND), mask=mask)


def _encode(x: torch.Tensor, kind: int, saturate: bool) -> torch.Tensor:
    x = x.to(DEVICE)
    out = torch.empty(x.numel(), dtype=torch.int16 if kind == 0 else torch.uint8, device=DEVICE)
    block = 4096
    _encode_kernel[(triton.cdiv(x.numel(), block),)](x, out, x.numel(), kind, saturate, block)
    return out.cpu()


def _sweep_values() -> torch.Tensor:
    """float32 values covering every fp8 value, the midpoints between neighbours (ties) and their float32
    neighbours, the subnormal ranges, overflow, inf, nan, float32 subnormals and random bit patterns."""
    parts = []
    up, down = torch.tensor(float("inf")), torch.tensor(float("-inf"))
    for dt in fp8.FP8_DTYPES:
        v = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(dt).float()
        v = v[~v.isnan()].unique().sort().values
        finite = v[v.isfinite()]
        mids = ((finite[1:].double() + finite[:-1].double()) / 2).float()
        parts += [v, mids, torch.nextafter(mids, up), torch.nextafter(mids, down)]
        parts += [finite * 1.0000001, finite * 0.9999999]
    special = torch.tensor(
        [0.0, 448.0, 449.0, 463.99, 464.0, 464.01, 479.99, 480.0, 481.0, 500.0, 1e4, 57344.0, 57345.0,
         59392.0, 61439.99, 61440.0, 61441.0, 65535.0, 65536.0, 1e30, 3.4028235e38, float("inf"),
         float("nan"), 1e-45, 1e-40, 2.0**-126, 2.0**-20, 2.0**-17, 3 * 2.0**-18, 2.0**-16, 2.0**-10,
         3 * 2.0**-11, 2.0**-9, 2.0**-7, 0.015625, 65504.0, 65520.0]
    )  # fmt: skip
    parts.append(special)
    gen = torch.Generator().manual_seed(0)
    parts.append(torch.randn(20000, generator=gen) * torch.logspace(-12, 6, 20000))
    parts.append(torch.randint(-(2**31), 2**31 - 1, (20000,), dtype=torch.int32, generator=gen).view(torch.float32))
    x = torch.cat([p.float() for p in parts])
    return torch.cat([x, -x])


_SWEEP = _sweep_values()


def _e4m3fn_expected(x: torch.Tensor, saturate: bool) -> torch.Tensor:
    """torch's bytes, adjusted to the requested overflow behaviour: NaN on overflow (torch <= 2.11) or
    saturation (newer torch).  Both are derived from whichever torch runs the test."""
    ref = x.to(torch.float8_e4m3fn).view(torch.uint8).clone()
    over = (x.abs() > 464.0) & ~x.isnan()  # 464 is a tie that rounds to even (448)
    sign = (x.view(torch.int32) < 0).to(torch.uint8) * 0x80
    return torch.where(over, sign | (0x7E if saturate else 0x7F), ref)


@pytest.mark.parametrize("saturate", [False, True])
def test_e4m3fn_encoder_bit_exact(saturate):
    x = _SWEEP
    got = _encode(x, fp8.FP8_E4M3FN, saturate)
    want = _e4m3fn_expected(x, saturate)
    bad = (got != want).nonzero().flatten()
    assert bad.numel() == 0, [(x[i].item(), got[i].item(), want[i].item()) for i in bad[:8]]


def test_e4m3fn_expected_matches_installed_torch():
    # The adjusted expectation for the installed torch's own behaviour is torch itself.
    x = _SWEEP
    assert torch.equal(_e4m3fn_expected(x, fp8.torch_e4m3fn_saturates()), x.to(torch.float8_e4m3fn).view(torch.uint8))


def test_e5m2_encoder_bit_exact():
    x = _SWEEP
    got = _encode(x, fp8.FP8_E5M2, False)
    want = x.to(torch.float8_e5m2).view(torch.uint8)
    bad = (got != want).nonzero().flatten()
    assert bad.numel() == 0, [(x[i].item(), got[i].item(), want[i].item()) for i in bad[:8]]


def test_bf16_encoder_bit_exact():
    x = _SWEEP
    got = _encode(x, 0, False)
    want = x.to(torch.bfloat16).view(torch.int16)
    nan = x.isnan()
    assert torch.equal(got[~nan], want[~nan])
    assert got.view(torch.bfloat16)[nan].isnan().all()
    # NaN keeps its sign.
    assert torch.equal(got[nan] < 0, x[nan].view(torch.int32) < 0)


@pytest.mark.parametrize("dtype", fp8.FP8_DTYPES, ids=["e4m3fn", "e5m2"])
def test_fp8_decoders_bit_exact(dtype):
    b = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    out = torch.empty(256, dtype=torch.float32, device=DEVICE)
    _decode_kernel[(1,)](b.to(DEVICE), out, 256, fp8.fp8_kind(dtype), 256)
    assert torch.equal(out.cpu().view(torch.int32), b.view(dtype).float().view(torch.int32))


def test_fp8_torch_side_helpers():
    assert fp8.storage_dtype(torch.float8_e4m3fn) == torch.uint8
    assert fp8.storage_dtype(torch.float8_e5m2) == torch.uint8
    assert fp8.storage_dtype(torch.bfloat16) == torch.bfloat16
    assert fp8.is_fp8_dtype(torch.float8_e5m2) and not fp8.is_fp8_dtype(torch.float16)
    assert fp8.fp8_kind(torch.float8_e4m3fn) == fp8.FP8_E4M3FN
    assert fp8.fp8_kind(torch.float8_e5m2) == fp8.FP8_E5M2
    assert fp8.fp8_kind(torch.bfloat16) == fp8.FP8_NONE
    inf_byte = torch.tensor([float("inf")]).to(torch.float8_e4m3fn).view(torch.uint8).item()
    assert fp8.torch_e4m3fn_saturates() == (inf_byte == 0x7E)


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
]


def _case_id(case):
    src, dst, ks, vs, n, loc_dtype, layout, _ = case
    name = lambda d: str(d).replace("torch.", "")  # noqa: E731
    return f"{name(src)}->{name(dst)}-k{ks}-v{vs}-N{n}-{name(loc_dtype)}-{layout}"


def _run_store(case, layer_index, seed=0):
    src_dtype, cache_dtype, k_scale_kind, v_scale_kind, n, loc_dtype, layout, magnitude = case
    gen = torch.Generator().manual_seed(seed)
    store = fp8.storage_dtype(cache_dtype)
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
        if fp8.is_fp8_dtype(cache_dtype):
            xf = x.float()
            if scale is not None:
                xf = xf / torch.as_tensor(scale, dtype=torch.float32).to(DEVICE).reshape(1)
            want = xf.to(cache_dtype).view(torch.uint8)
        else:
            want = x.to(cache_dtype)
        assert _bits_equal(out[1, idx], want)


@pytest.mark.parametrize("cache_dtype", fp8.FP8_DTYPES, ids=["e4m3fn", "e5m2"])
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


def test_store_kv_scale_ignored_for_float_caches():
    gen = torch.Generator().manual_seed(4)
    n = 4
    k_cache = _poison((L, ROWS, H, DK), torch.bfloat16, gen)
    v_cache = _poison((L, ROWS, H, DV), torch.bfloat16, gen)
    cache_k, cache_v = _make_inputs(n, torch.float32, "contiguous", gen, 1.0)
    loc = torch.tensor([2, 4, 6, 8], dtype=torch.int32, device=DEVICE)
    kernels.store_kv_triton(
        k_cache, v_cache, 0, loc, cache_k, cache_v, k_scale=0.5, v_scale=torch.tensor(2.0, device=DEVICE),
        cache_dtype=torch.bfloat16,
    )  # fmt: skip
    assert _bits_equal(k_cache[0, loc.long()], cache_k.to(torch.bfloat16))
    assert _bits_equal(v_cache[0, loc.long()], cache_v.to(torch.bfloat16))


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
    k8, v8 = k_cache.view(torch.uint8), v_cache.view(torch.uint8)[..., :8]
    x8 = torch.ones(2, 1, 16, device=DEVICE).to(torch.float8_e4m3fn)
    with pytest.raises(ValueError):  # fp8 input takes no scale
        kernels.store_kv_triton(k8, k8, 0, loc, x8, x8, k_scale=2.0, cache_dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError):  # K and V caches with different head counts / shapes
        kernels.store_kv_triton(k8, v8.reshape(2, 8, 2, 4), 0, loc, x8, x8, cache_dtype=torch.float8_e4m3fn)


# ==========================================================================================================
# move_kv_cache
# ==========================================================================================================


def _check_move(k_cache, v_cache, tgt, src):
    orig_k, orig_v = k_cache.clone(), v_cache.clone()
    tgt_t = torch.as_tensor(tgt).to(DEVICE) if not isinstance(tgt, torch.Tensor) else tgt
    src_t = torch.as_tensor(src).to(DEVICE) if not isinstance(src, torch.Tensor) else src
    # Expected: buf[:, tgt] = buf[:, src] with every source read first.
    want_k, want_v = orig_k.clone(), orig_v.clone()
    want_k[:, tgt_t.long()] = orig_k[:, src_t.long()].clone()
    want_v[:, tgt_t.long()] = orig_v[:, src_t.long()].clone()

    ref_k, ref_v = orig_k.clone(), orig_v.clone()
    kernels.move_kv_cache_native(ref_k, ref_v, tgt_t, src_t)
    assert _bits_equal(ref_k, want_k) and _bits_equal(ref_v, want_v)

    kernels.move_kv_cache_triton(k_cache, v_cache, tgt_t, src_t)
    assert _bits_equal(k_cache, want_k)
    assert _bits_equal(v_cache, want_v)


# (K row shape, V row shape, storage dtype)
MOVE_LAYOUTS = [
    ((3, 72), (3, 40), torch.bfloat16),  # Dv != Dk, int32 words
    ((1, 8), (1, 8), torch.uint8),  # fp8 cache, 8-byte rows
    ((2, 3), (1, 5), torch.float16),  # 12- and 10-byte rows: int32 / int16 words
    ((1, 3), (1, 5), torch.uint8),  # 3- and 5-byte rows: byte words
    ((4, 16), (4, 16), torch.float32),
]

MOVE_PATTERNS = {
    "shift_down": ([4, 5, 6], [5, 6, 7]),  # compaction
    "shift_up": ([5, 6, 7], [4, 5, 6]),
    "swap_pairs": ([3, 4, 10, 11], [4, 3, 11, 10]),
    "three_cycle": ([2, 9, 5], [9, 5, 2]),
    "identity": ([7, 8, 1], [7, 8, 1]),
    "disjoint": ([20, 21, 22, 23, 24], [1, 3, 5, 7, 9]),
    "single": ([12], [30]),
    "long_chain_odd": (list(range(1, 34)), list(range(2, 35))),
}


@pytest.mark.parametrize("layout", MOVE_LAYOUTS, ids=lambda l: f"{l[2]}-{l[0]}-{l[1]}".replace("torch.", ""))
@pytest.mark.parametrize("num_layers", [1, 2, 3])
def test_move_kv_cache_patterns(layout, num_layers):
    (hk, dk), (hv, dv), dtype = layout
    gen = torch.Generator().manual_seed(num_layers)
    for name, (tgt, src) in MOVE_PATTERNS.items():
        k_cache = _poison((num_layers, 40, hk, dk), dtype, gen)
        v_cache = _poison((num_layers, 40, hv, dv), dtype, gen)
        for idx_dtype in (torch.int64, torch.int32):
            _check_move(
                k_cache, v_cache, torch.tensor(tgt, dtype=idx_dtype, device=DEVICE),
                torch.tensor(src, dtype=idx_dtype, device=DEVICE),
            )  # fmt: skip


@pytest.mark.parametrize("n", [1, 7, 33, 255, 1000])
def test_move_kv_cache_random_permutations(n):
    # Targets are a random subset; sources a random permutation of them (cycles of every length) plus
    # outside rows, so targets and sources overlap heavily.
    gen = torch.Generator().manual_seed(n)
    rows = 2 * n + 10
    k_cache = _poison((2, rows, 2, 8), torch.bfloat16, gen)
    v_cache = _poison((2, rows, 1, 24), torch.bfloat16, gen)
    tgt = torch.randperm(rows, generator=gen)[:n]
    pool = torch.cat([tgt, torch.randperm(rows, generator=gen)[: n // 3]]).unique()
    src = pool[torch.randperm(pool.numel(), generator=gen)[:n]]
    _check_move(k_cache, v_cache, tgt.to(DEVICE), src.to(DEVICE))


def test_move_kv_cache_strided_locs():
    gen = torch.Generator().manual_seed(11)
    k_cache = _poison((2, 30, 1, 16), torch.float16, gen)
    v_cache = _poison((2, 30, 1, 16), torch.float16, gen)
    pairs = torch.tensor([[5, 6], [6, 7], [7, 8], [20, 1]], device=DEVICE)  # columns are strided views
    _check_move(k_cache, v_cache, pairs[:, 0], pairs[:, 1])


def test_move_kv_cache_largest_single_launch_and_fallback():
    gen = torch.Generator().manual_seed(12)
    for n in (kernels.MOVE_MAX_TOKENS, kernels.MOVE_MAX_TOKENS + 1):
        rows = n + 8
        k_cache = _poison((2, rows, 1, 8), torch.uint8, gen)
        v_cache = _poison((2, rows, 1, 12), torch.bfloat16, gen)
        tgt = torch.arange(n) + 1
        src = torch.arange(n) + 2  # compaction by one row over the whole pool
        _check_move(k_cache, v_cache, tgt.to(DEVICE), src.to(DEVICE, torch.int32))


def test_move_kv_cache_fallback_layer_groups(monkeypatch):
    # Force the gather/scatter fallback with a scratch of one layer, so it runs layer group by group.
    monkeypatch.setattr(kernels, "MOVE_MAX_TOKENS", 4)
    gen = torch.Generator().manual_seed(14)
    n, rows = 37, 60
    k_cache = _poison((3, rows, 3, 24), torch.float16, gen)
    v_cache = _poison((3, rows, 1, 5), torch.uint8, gen)
    monkeypatch.setattr(kernels, "MOVE_SCRATCH_BYTES", n * 3 * 24 * 2)
    tgt = torch.randperm(rows, generator=gen)[:n]
    src = tgt[torch.randperm(n, generator=gen)]  # a permutation of the targets: cycles everywhere
    _check_move(k_cache, v_cache, tgt.to(DEVICE), src.to(DEVICE))
    _check_move(k_cache, v_cache, torch.arange(1, n + 1, device=DEVICE), torch.arange(2, n + 2, device=DEVICE))


@pytest.mark.parametrize(
    "tgt, src, hazard",
    [
        ([1, 2, 3], [7, 8, 9], 0),  # disjoint
        ([1, 2, 3], [1, 2, 3], 0),  # every target is its own source
        ([4, 5, 6], [5, 6, 7], 1),  # compaction: 5 and 6 are read and written
        ([1, 2], [2, 1], 1),  # swap
        ([3, 9], [3, 3], 0),  # one source copied twice, one of them onto itself
    ],
)
def test_overlap_flag(tgt, src, hazard):
    flag = kernels._flag_overlaps(12, torch.tensor(tgt, device=DEVICE), torch.tensor(src, device=DEVICE, dtype=torch.int32))
    assert int(flag.item()) == hazard


@pytest.mark.parametrize("pattern", ["disjoint", "self", "shift", "permutation"])
def test_move_kv_cache_large_path_picks_copy_or_scratch_on_device(monkeypatch, pattern):
    # Above MOVE_MAX_TOKENS the device flags overlap: disjoint / self moves take the one-pass row copy,
    # overlapping ones the gather/scatter; both must equal torch's gather-then-scatter.
    monkeypatch.setattr(kernels, "MOVE_MAX_TOKENS", 4)
    gen = torch.Generator().manual_seed(15)
    n, rows = 29, 80
    k_cache = _poison((3, rows, 2, 12), torch.bfloat16, gen)
    v_cache = _poison((3, rows, 1, 6), torch.float32, gen)
    perm = torch.randperm(rows - 1, generator=gen) + 1
    tgt = perm[:n]
    src = {
        "disjoint": perm[n : 2 * n],
        "self": tgt.clone(),
        "shift": torch.cat([perm[1:n], perm[n : n + 1]]),
        "permutation": tgt[torch.randperm(n, generator=gen)],
    }[pattern]
    _check_move(k_cache, v_cache, tgt.to(DEVICE), src.to(DEVICE))


def test_move_kv_cache_empty_is_noop():
    gen = torch.Generator().manual_seed(13)
    k_cache = _poison((2, 10, 1, 8), torch.bfloat16, gen)
    v_cache = _poison((2, 10, 1, 8), torch.bfloat16, gen)
    before = (k_cache.clone(), v_cache.clone())
    empty = torch.empty(0, dtype=torch.int64, device=DEVICE)
    kernels.move_kv_cache_triton(k_cache, v_cache, empty, empty)
    assert _bits_equal(k_cache, before[0]) and _bits_equal(v_cache, before[1])


@pytest.mark.parametrize("n", [1, 2, 3, 16, 100, 1024, 2047, 2048])
@pytest.mark.parametrize("row_bytes", [8, 16, 144, 2048, 8192])
def test_move_plan_bounds(n, row_bytes):
    n_pad, tile = kernels._move_plan(n, row_bytes, row_bytes // 2)
    assert n_pad >= n and n_pad & (n_pad - 1) == 0
    assert tile & (tile - 1) == 0
    assert n_pad * tile <= kernels.MOVE_MAX_TILE_BYTES
    assert tile >= min(kernels.MOVE_MIN_TILE_BYTES, row_bytes)


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
        kernels.move_kv_cache_triton(kc, vc, tgt, src)

    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    kernels.store_kv_native(ref_k, ref_v, 1, loc, cache_k, cache_v, k_scale=scale, v_scale=scale,
                            cache_dtype=torch.float8_e4m3fn)  # fmt: skip
    kernels.move_kv_cache_native(ref_k, ref_v, tgt, src)

    warm_k, warm_v = k_cache.clone(), v_cache.clone()
    step(warm_k, warm_v)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step(k_cache, v_cache)
    graph.replay()
    torch.cuda.synchronize()
    assert _bits_equal(k_cache, ref_k) and _bits_equal(v_cache, ref_v)
