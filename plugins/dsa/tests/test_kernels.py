"""Bit-exact tests of the DSA kernels against their torch references, and of the references against the format.

On a CPU-only machine the Triton kernels run in Triton's interpreter (the root conftest sets
TRITON_INTERPRET=1).  With KVCORE_TEST_COMPILED=1 on a GPU machine the same tests run the compiled kernels
on CUDA tensors.  Inputs are random and never zero (except in the zero-tile guard test, which is about zeros).
"""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from kvcore.kernels.kernel_mode import triton_interpreting
from kvcore.testing.tensors import bits_equal, compiled, poison, randn_nonzero, skip_module_without_device, test_device
from kvcore_dsa.layout import scaled_row_bytes
from kvcore_dsa import kernels, scaled_rows
from kvcore_dsa.layout import INDEX_PAGE_SIZE, SCALE_MIN


skip_module_without_device()
COMPILED, DEVICE = compiled(), test_device()

RANK, ROPE = 512, 64
ROW = scaled_row_bytes(RANK, ROPE)
L, ROWS = 3, 200  # rows: size 136 + page 64; row 0..63 padding


def _store_fns():
    return {"triton": kernels.store_dsa_fp8_triton, "native": kernels.store_dsa_fp8_native}


def _inputs(n, dtype, layout, gen, magnitude=3.0):
    """(nope [n, 512], rope [n, 64]) in the asked memory layout; tiles get magnitudes 1e-3 .. 1e3."""
    tile_scale = torch.tensor([1e-3, 1.0, 30.0, 1e3]).repeat_interleave(128).to(DEVICE)
    if layout == "contiguous":
        nope = randn_nonzero((n, RANK), torch.float32, gen, magnitude)
        rope = randn_nonzero((n, ROPE), dtype, gen, magnitude)
        return (nope * tile_scale).to(dtype), rope
    if layout == "fused":  # views of one projection output: strided token dim, [N, 1, w] shapes
        width = RANK + ROPE + 40
        fused = randn_nonzero((n, width), torch.float32, gen, magnitude)
        fused[:, 17 : 17 + RANK] *= tile_scale
        fused = fused.to(dtype)
        return fused[:, 17 : 17 + RANK].unsqueeze(1), fused[:, 17 + RANK : 17 + RANK + ROPE].unsqueeze(1)
    # "transposed": element stride != 1
    nope = (randn_nonzero((RANK, n), torch.float32, gen, magnitude) * tile_scale[:, None]).to(dtype).t()
    rope = randn_nonzero((ROPE, n), dtype, gen, magnitude).t()
    return nope, rope


def _flat(x, width):
    return x.reshape(x.shape[0], width)


# ==========================================================================================================
# quantization arithmetic
# ==========================================================================================================


def test_quantize_round_trip_error_within_e4m3_bound():
    """Every dequantized nope value is within the error e4m3 allows, and rope survives exactly.

    Derivation, for one value x of a tile with amax A and scale s = fl(A / 448) (so s = A/448 (1 + d0)):

    * y = fl(x / s) = (x / s)(1 + d1), |d1| <= 2**-24, and |y| <= 448 (1 + 2**-23) < 464, so nothing overflows
      and q = e4m3(y) is y rounded to nearest even.
    * Normal range |y| >= 2**-6: e4m3 keeps 3 mantissa bits, so in the binade [2**e, 2**(e+1)) the spacing is
      2**(e-3) and |q - y| <= 2**(e-4) <= 2**-4 |y|.  Subnormal range |y| < 2**-6: spacing 2**-9, so
      |q - y| <= 2**-10.
    * x' = fl(q s) = q s (1 + d2), |d2| <= 2**-24.
    * |x' - x| <= s |q - y| + s |y - x / s| + |q s| |d2|
              <= max(2**-4 |x| (1 + 2**-24), 2**-10 s) + 2**-24 |x| + 2**-24 * 448 s
              <= max(2**-4 |x|, 2**-10 s) + 2**-20 A          (448 s <= A (1 + 2**-23), |x| <= A)
    """
    gen = torch.Generator().manual_seed(11)
    n = 257
    nope, rope = _inputs(n, torch.float32, "contiguous", gen)
    rope = rope.to(torch.bfloat16)
    rows = kernels.quantize_concatenated(torch.cat([nope, rope.float()], dim=1))
    deq_nope, deq_rope = kernels.dequantize_rows(rows, RANK, ROPE, torch.float32)

    x = nope.double().reshape(n, 4, 128)
    amax = x.abs().amax(dim=-1, keepdim=True)
    s = rows[:, RANK : RANK + 16].contiguous().view(torch.float32).double().unsqueeze(-1)
    bound = torch.maximum(2.0**-4 * x.abs(), 2.0**-10 * s) + 2.0**-20 * amax
    err = (deq_nope.double().reshape(n, 4, 128) - x).abs()
    worst = (err / bound).max().item()
    assert worst <= 1.0, f"an element exceeds the derived e4m3 bound by {worst:.3f}x"
    assert worst > 0.5, f"the bound is loose ({worst:.3f}); the derivation should be tight for random data"
    # Both ranges were exercised: some quotients landed in e4m3's subnormals.
    assert ((x / s).abs() < 2.0**-6).any() and ((x / s).abs() > 256).any()
    assert bits_equal(deq_rope, rope.float())

    # The kernels store and read back the same values.
    cache = poison((1, n + 64, 1, ROW), torch.uint8, gen)
    loc = torch.arange(64, 64 + n, device=DEVICE)
    kernels.store_dsa_fp8_triton(cache, 0, loc, nope, rope, kv_lora_rank=RANK, qk_rope_head_dim=ROPE)
    out_nope = torch.empty(n, 1, RANK, device=DEVICE)
    out_rope = torch.empty(n, 1, ROPE, device=DEVICE)
    kernels.gather_dsa_fp8_triton(cache, 0, loc, out_nope, out_rope, kv_lora_rank=RANK, qk_rope_head_dim=ROPE)
    assert bits_equal(out_nope[:, 0], deq_nope) and bits_equal(out_rope[:, 0], deq_rope)


@pytest.mark.parametrize("impl", ["triton", "native"])
@pytest.mark.parametrize("n", [1, 7, 33])
@pytest.mark.parametrize(
    "dtype, layout",
    [(torch.bfloat16, "contiguous"), (torch.bfloat16, "fused"), (torch.float32, "transposed"),
     (torch.float16, "fused"), (torch.float32, "contiguous")],
    ids=lambda v: str(v).removeprefix("torch."),
)  # fmt: skip
def test_split_store_is_byte_identical_to_concatenated_quantization(impl, n, dtype, layout):
    gen = torch.Generator().manual_seed(n)
    nope, rope = _inputs(n, dtype, layout, gen)
    before = (nope.clone(), rope.clone())
    cache = poison((L, ROWS, 1, ROW), torch.uint8, gen)
    loc = (torch.randperm(ROWS - 64, generator=gen)[:n] + 64).to(torch.int32 if n == 7 else torch.int64).to(DEVICE)
    out = cache.clone()
    _store_fns()[impl](out, 2, loc, nope, rope, kv_lora_rank=RANK, qk_rope_head_dim=ROPE)

    concatenated = torch.cat([_flat(nope, RANK), _flat(rope, ROPE)], dim=1)
    want = kernels.quantize_concatenated(concatenated, RANK)
    assert want.shape == (n, ROW)
    written = out[2, loc.long(), 0]
    assert bits_equal(written, want)
    # Only those rows of that layer changed; the inputs are untouched.
    mask = torch.zeros(L, ROWS, dtype=torch.bool, device=DEVICE)
    mask[2, loc.long()] = True
    assert bits_equal(out[~mask], cache[~mask])
    assert bits_equal(nope, before[0]) and bits_equal(rope, before[1])

    # The format, checked independently of the reference: rope bytes are the bf16 input bytes ...
    rope_bf16 = _flat(rope, ROPE).to(torch.bfloat16)
    assert bits_equal(written[:, RANK + 16 :], rope_bf16.contiguous().view(torch.uint8))
    # ... and every scale is exactly amax / 448 in float32 (no tile is zero, so the guard never applies).
    amax = _flat(nope, RANK).float().abs().reshape(n, 4, 128).amax(dim=-1)
    scales = written[:, RANK : RANK + 16].contiguous().view(torch.float32)
    assert bits_equal(scales, amax / torch.tensor(448.0, device=DEVICE))
    # ... and the fp8 bytes are x / scale in e4m3fn.
    q = (_flat(nope, RANK).float().reshape(n, 4, 128) / scales.unsqueeze(-1)).to(torch.float8_e4m3fn)
    assert bits_equal(written[:, :RANK], q.view(torch.uint8).reshape(n, RANK))


def test_store_triton_matches_native_on_the_last_layer():
    gen = torch.Generator().manual_seed(5)
    n = 45
    nope, rope = _inputs(n, torch.bfloat16, "fused", gen, magnitude=50.0)
    cache = poison((L, ROWS, 1, ROW), torch.uint8, gen)
    loc = (torch.randperm(ROWS - 64, generator=gen)[:n] + 64).to(DEVICE)
    a, b = cache.clone(), cache.clone()
    kernels.store_dsa_fp8_triton(a, L - 1, loc, nope, rope, kv_lora_rank=RANK, qk_rope_head_dim=ROPE)
    kernels.store_dsa_fp8_native(b, L - 1, loc, nope, rope, kv_lora_rank=RANK, qk_rope_head_dim=ROPE)
    assert bits_equal(a, b)


@pytest.mark.parametrize("rank, rope_dim", [(384, 64), (256, 32), (640, 48)])
def test_other_widths_store_and_gather_like_the_reference(rank, rope_dim):
    """Tile counts that are not a power of two (3, 5: the kernels pad and mask them) and other rope widths."""
    gen = torch.Generator().manual_seed(7)
    n, rows = 19, 40
    nope = randn_nonzero((n, rank), torch.float32, gen, 20.0).to(torch.bfloat16).to(DEVICE)
    rope = randn_nonzero((n, rope_dim), torch.float32, gen).to(DEVICE)
    width = scaled_row_bytes(rank, rope_dim)
    a = poison((2, rows, 1, width), torch.uint8, gen)
    b = a.clone()
    loc = (torch.randperm(rows - 1, generator=gen)[:n] + 1).to(DEVICE)
    kw = dict(kv_lora_rank=rank, qk_rope_head_dim=rope_dim)
    kernels.store_dsa_fp8_triton(a, 1, loc, nope, rope, **kw)
    kernels.store_dsa_fp8_native(b, 1, loc, nope, rope, **kw)
    assert bits_equal(a, b)
    outs = [(torch.empty(n, rank, device=DEVICE), torch.empty(n, rope_dim, device=DEVICE)) for _ in range(2)]
    kernels.gather_dsa_fp8_triton(a, 1, loc, *outs[0], **kw)
    kernels.gather_dsa_fp8_native(b, 1, loc, *outs[1], **kw)
    assert bits_equal(outs[0][0], outs[1][0]) and bits_equal(outs[0][1], outs[1][1])


def test_zero_tile_guard():
    """An all-zero tile (signed zeros included) gets scale 2**-126, stores +-0 bytes and reads back zeros."""
    gen = torch.Generator().manual_seed(6)
    n = 3
    nope, rope = _inputs(n, torch.bfloat16, "contiguous", gen)
    nope[0, 128:256] = 0.0
    nope[1, :128] = -0.0
    nope[2, 384:] = torch.tensor([0.0, -0.0]).repeat(64).to(torch.bfloat16)
    cache = poison((1, 80, 1, ROW), torch.uint8, gen)
    loc = torch.tensor([70, 64, 79], device=DEVICE)
    ref = cache.clone()
    kernels.store_dsa_fp8_triton(cache, 0, loc, nope, rope, kv_lora_rank=RANK, qk_rope_head_dim=ROPE)
    kernels.store_dsa_fp8_native(ref, 0, loc, nope, rope, kv_lora_rank=RANK, qk_rope_head_dim=ROPE)
    assert bits_equal(cache, ref)
    rows = cache[0, loc, 0]
    assert bits_equal(rows, kernels.quantize_concatenated(torch.cat([nope, rope], 1)))
    scales = rows[:, RANK : RANK + 16].contiguous().view(torch.float32)
    assert scales[0, 1].item() == SCALE_MIN == 2.0**-126
    assert scales[1, 0].item() == SCALE_MIN and scales[2, 3].item() == SCALE_MIN
    assert torch.isfinite(scales).all() and (scales > 0).all()
    assert rows[1, :128].eq(0x80).all() and rows[0, 128:256].eq(0).all()
    deq, _ = kernels.dequantize_rows(rows, RANK, ROPE, torch.float32)
    assert deq[0, 128:256].eq(0).all() and deq[1, :128].eq(0).all() and deq[2, 384:].eq(0).all()


# ==========================================================================================================
# dequantizing gather
# ==========================================================================================================


@pytest.mark.parametrize("dst_dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["f32", "f16", "bf16"])
@pytest.mark.parametrize("n", [1, 7, 33])
def test_gather_matches_reference_and_reads_only_asked_rows(dst_dtype, n):
    gen = torch.Generator().manual_seed(100 + n)
    cache = poison((L, ROWS, 1, ROW), torch.uint8, gen)
    # Valid rows (finite scales) where we read; everything else stays random bytes (NaN patterns included).
    loc = (torch.randperm(ROWS - 64, generator=gen)[:n] + 64).to(DEVICE)
    nope, rope = _inputs(n, torch.bfloat16, "contiguous", gen)
    kernels.store_dsa_fp8_native(cache, 1, loc, nope, rope, kv_lora_rank=RANK, qk_rope_head_dim=ROPE)
    before = cache.clone()

    def gather(fn, buf):
        nope_out = poison((n, 1, RANK), dst_dtype, gen)
        rope_out = poison((n, 1, ROPE), dst_dtype, gen)
        fn(buf, 1, loc, nope_out, rope_out, kv_lora_rank=RANK, qk_rope_head_dim=ROPE)
        return nope_out, rope_out

    got = gather(kernels.gather_dsa_fp8_triton, cache)
    ref = gather(kernels.gather_dsa_fp8_native, cache)
    assert bits_equal(got[0], ref[0]) and bits_equal(got[1], ref[1])
    assert bits_equal(cache, before)  # a read writes nothing
    # Independent check: dequantize the rows by the format.
    want_nope, want_rope = kernels.dequantize_rows(cache[1, loc, 0], RANK, ROPE, dst_dtype)
    assert bits_equal(got[0][:, 0], want_nope) and bits_equal(got[1][:, 0], want_rope)
    # Reads only the asked rows: other rows (other layers too) re-randomized, same result.
    other = poison(cache.shape, torch.uint8, gen)
    other[1, loc] = cache[1, loc]
    again = gather(kernels.gather_dsa_fp8_triton, other)
    assert bits_equal(again[0], got[0]) and bits_equal(again[1], got[1])


def test_gather_empty_is_a_no_op():
    gen = torch.Generator().manual_seed(7)
    cache = poison((1, 70, 1, ROW), torch.uint8, gen)
    nope_out = poison((0, 1, RANK), torch.bfloat16, gen)
    rope_out = poison((0, 1, ROPE), torch.bfloat16, gen)
    empty = torch.empty(0, dtype=torch.int64, device=DEVICE)
    kernels.gather_dsa_fp8_triton(cache, 0, empty, nope_out, rope_out, kv_lora_rank=RANK, qk_rope_head_dim=ROPE)
    kernels.store_dsa_fp8_triton(cache, 0, empty, nope_out, rope_out, kv_lora_rank=RANK, qk_rope_head_dim=ROPE)


def test_kernels_reject_bad_arguments():
    gen = torch.Generator().manual_seed(8)
    cache = poison((1, 70, 1, ROW), torch.uint8, gen)
    loc = torch.tensor([64, 65], device=DEVICE)
    nope, rope = _inputs(2, torch.bfloat16, "contiguous", gen)
    kw = dict(kv_lora_rank=RANK, qk_rope_head_dim=ROPE)
    with pytest.raises(ValueError, match="uint8"):
        kernels.store_dsa_fp8_triton(cache[..., :576], 0, loc, nope, rope, **kw)
    with pytest.raises(ValueError, match="layer_index"):
        kernels.store_dsa_fp8_triton(cache, 1, loc, nope, rope, **kw)
    with pytest.raises(ValueError, match=r"cache_k_nope must be \[1, 512\] or \[1, 1, 512\], got \(2, 512\)"):
        kernels.store_dsa_fp8_triton(cache, 0, loc[:1], nope, rope, **kw)
    with pytest.raises(ValueError, match="float32/float16/bfloat16"):
        kernels.store_dsa_fp8_triton(cache, 0, loc, nope.to(torch.float8_e4m3fn), rope, **kw)
    with pytest.raises(ValueError, match="share a dtype"):
        kernels.gather_dsa_fp8_triton(cache, 0, loc, nope.float(), rope, **kw)


# ==========================================================================================================
# indexer pages
# ==========================================================================================================

PAGES = 12  # pages per layer of the test buffer (page 0 is padding)


def _index_case(index_dtype, gen):
    key_bytes = 128 if index_dtype == torch.float8_e4m3fn else 256
    page_bytes = INDEX_PAGE_SIZE * (key_bytes + (4 if index_dtype == torch.float8_e4m3fn else 0))
    return key_bytes, poison((L, PAGES, page_bytes), torch.uint8, gen)


def _keys(n, index_dtype, gen):
    if index_dtype == torch.float8_e4m3fn:
        keys = randn_nonzero((n, 128), torch.float32, gen, 3.0).to(torch.float8_e4m3fn)
        scales = torch.rand(n, generator=gen).add_(0.01).to(DEVICE)
        return keys, scales
    return randn_nonzero((n, 128), torch.bfloat16, gen, 3.0), None


@pytest.mark.parametrize("index_dtype", [torch.float8_e4m3fn, torch.bfloat16], ids=["fp8", "bf16"])
@pytest.mark.parametrize("seq_len", [1, 63, 64, 65, 127, 128, 129, 300])
def test_index_set_then_get_across_page_boundaries(index_dtype, seq_len):
    gen = torch.Generator().manual_seed(seq_len)
    key_bytes, buf = _index_case(index_dtype, gen)
    pages_needed = -(-seq_len // INDEX_PAGE_SIZE)
    page_table = (torch.randperm(PAGES - 1, generator=gen)[:pages_needed] + 1).to(torch.int32).to(DEVICE)
    i = torch.arange(seq_len, device=DEVICE)
    loc = page_table.long()[i // INDEX_PAGE_SIZE] * INDEX_PAGE_SIZE + i % INDEX_PAGE_SIZE
    keys, scales = _keys(seq_len, index_dtype, gen)
    # Write in a scrambled order: the set kernel addresses each token by its own location.
    order = torch.randperm(seq_len, generator=gen).to(DEVICE)
    native, triton_buf = buf.clone(), buf.clone()
    sc = None if scales is None else scales[order]
    kernels.set_index_k_native(native, 1, loc[order], keys[order], sc)
    kernels.set_index_k_triton(triton_buf, 1, loc[order], keys[order], sc)
    assert bits_equal(triton_buf, native)

    # Byte addresses by hand: page p of layer 1, key at slot*key_bytes, scale at 64*128 + 4*slot.
    flat = triton_buf[1]
    for t in sorted({0, 63, 64, 65, 127, 128, seq_len - 1} & set(range(seq_len))):
        page, slot = int(loc[t]) // 64, int(loc[t]) % 64
        assert bits_equal(flat[page, slot * key_bytes : (slot + 1) * key_bytes], keys[t].contiguous().view(torch.uint8))
        if scales is not None:
            s = flat[page, 8192 + 4 * slot : 8192 + 4 * slot + 4]
            assert bits_equal(s, scales[t : t + 1].view(torch.uint8))
    # Nothing else changed: other layers, and the bytes of slots nobody wrote.
    touched = torch.zeros(L, PAGES, buf.shape[2], dtype=torch.bool, device=DEVICE)
    for t in range(seq_len):
        page, slot = int(loc[t]) // 64, int(loc[t]) % 64
        touched[1, page, slot * key_bytes : (slot + 1) * key_bytes] = True
        if scales is not None:
            touched[1, page, 8192 + 4 * slot : 8192 + 4 * slot + 4] = True
    assert bits_equal(triton_buf[~touched], buf[~touched])

    # Continuous reads, separate and fused, Triton and reference.
    def read(fn, want_k, want_s):
        k_out = poison((seq_len, key_bytes), torch.uint8, gen) if want_k else None
        s_out = poison((seq_len, 4), torch.uint8, gen) if want_s else None
        fn(triton_buf, 1, seq_len, page_table, k_out, s_out, key_bytes=key_bytes)
        return k_out, s_out

    want_keys = keys.contiguous().view(torch.uint8)
    k_only, _ = read(kernels.get_index_k_triton, True, False)
    assert bits_equal(k_only, want_keys)
    assert bits_equal(read(kernels.get_index_k_native, True, False)[0], want_keys)
    if scales is not None:
        _, s_only = read(kernels.get_index_k_triton, False, True)
        assert bits_equal(s_only, scales.view(torch.uint8).reshape(seq_len, 4))
        fused_k, fused_s = read(kernels.get_index_k_triton, True, True)
        assert bits_equal(fused_k, k_only) and bits_equal(fused_s, s_only)
        ref_k, ref_s = read(kernels.get_index_k_native, True, True)
        assert bits_equal(ref_k, fused_k) and bits_equal(ref_s, fused_s)


def test_index_set_accepts_scale_bytes_and_strided_keys():
    gen = torch.Generator().manual_seed(9)
    key_bytes, buf = _index_case(torch.float8_e4m3fn, gen)
    n = 19
    loc = (torch.randperm((PAGES - 1) * 64, generator=gen)[:n] + 64).to(DEVICE)
    wide = poison((n, 200), torch.uint8, gen)
    keys = wide[:, 40:168]  # strided token dim
    scales = torch.rand(n, 2, generator=gen).add_(0.5).to(DEVICE)[:, 1]  # strided float32 scales
    a, b, c = buf.clone(), buf.clone(), buf.clone()
    kernels.set_index_k_triton(a, 0, loc, keys, scales)
    kernels.set_index_k_native(b, 0, loc, keys.contiguous(), scales.contiguous())
    kernels.set_index_k_triton(c, 0, loc.int(), keys.contiguous(), scales.contiguous().view(torch.uint8).reshape(n, 4))
    assert bits_equal(a, b) and bits_equal(c, b)
    with pytest.raises(ValueError, match="page indices"):
        kernels.get_index_k_triton(a, 0, 129, torch.tensor([1, 2], device=DEVICE), None, None, key_bytes=key_bytes)
    with pytest.raises(ValueError, match="float32"):
        kernels.set_index_k_triton(a, 0, loc, keys, scales.double())


# ==========================================================================================================
# the quotient x / scale (compiled: a reciprocal per tile and two fma corrections; must equal IEEE division)
# ==========================================================================================================


@triton.jit
def _divide_kernel(x_ptr, s_ptr, q_ptr, n, HW_CVT: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = i < n
    x = tl.load(x_ptr + i, mask=m, other=1.0)
    s = tl.load(s_ptr + i, mask=m, other=1.0)
    tl.store(q_ptr + i, scaled_rows._divide_rn(x, s, HW_CVT), mask=m)


def _quotient_cases(gen: torch.Generator, per_case: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(x, scale) pairs as the store meets them (|x| <= amax, scale = max(amax / 448, SCALE_MIN), amax finite),
    chosen to be hard: every finite bf16 bit pattern as x (signed zeros too), quotients a few ulps from e4m3 rounding midpoints, float32 x
    with 24-bit significands, and amaxes from 2**-140 to 2**120 (tiny scales take the lifted path)."""
    def scale_of(amax):
        return torch.maximum(amax / torch.full_like(amax, 448.0), torch.full_like(amax, SCALE_MIN))

    xs, ss = [], []
    bf16 = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).float()
    bf16 = bf16[torch.isfinite(bf16)][torch.randperm(65280, generator=gen)[:per_case]]
    amax = torch.clamp(bf16.abs() * (1 + torch.rand(bf16.shape, generator=gen) * 4), max=torch.finfo(torch.float32).max)
    xs.append(bf16), ss.append(scale_of(amax))
    xs.append(torch.tensor([0.0, -0.0, 0.0, -0.0])), ss.append(torch.tensor([1.0, 1.0, SCALE_MIN, SCALE_MIN]))
    # quotients next to the midpoints between neighbouring e4m3 values (3 mantissa bits -> 4-bit midpoints)
    mid = (torch.randint(16, 32, (per_case,), generator=gen).float() + 0.5) / 16
    mid = mid * torch.exp2(torch.randint(-9, 9, (per_case,), generator=gen).float())
    amax = torch.exp2(torch.rand(per_case, generator=gen) * 260 - 140)
    scale = scale_of(amax)
    x = (mid * scale).view(torch.int32) + torch.randint(-3, 4, (per_case,), generator=gen, dtype=torch.int32)
    xs.append(x.view(torch.float32)), ss.append(scale)
    # random float32 values under random amaxes
    amax = torch.exp2(torch.rand(per_case, generator=gen) * 260 - 140)
    xs.append((torch.rand(per_case, generator=gen) * 2 - 1) * amax), ss.append(scale_of(amax))
    return torch.cat(xs), torch.cat(ss)


def test_divide_rn_equals_ieee_division():
    gen = torch.Generator().manual_seed(31)
    x, scale = _quotient_cases(gen, 1 << 20 if COMPILED else 2048)
    x, scale = x.to(DEVICE), scale.to(DEVICE)
    q = torch.empty_like(x)
    block = 1024
    _divide_kernel[(triton.cdiv(x.numel(), block),)](x, scale, q, x.numel(), HW_CVT=not triton_interpreting(), BLOCK=block)
    want = x / scale
    assert bits_equal(q, want), f"{(q != want).sum().item()} of {x.numel()} quotients differ"


# ==========================================================================================================
# CUDA graphs (GPU only)
# ==========================================================================================================


@pytest.mark.gpu
@pytest.mark.skipif(not COMPILED, reason="needs compiled kernels on a CUDA device")
def test_kernels_capture_in_cuda_graph():
    gen = torch.Generator().manual_seed(21)
    n = 5
    cache = poison((L, ROWS, 1, ROW), torch.uint8, gen)
    index = poison((L, PAGES, 8448), torch.uint8, gen)
    loc = torch.tensor([64, 65, 127, 128, 199], device=DEVICE)
    nope, rope = _inputs(n, torch.bfloat16, "fused", gen)
    keys, scales = _keys(n, torch.float8_e4m3fn, gen)
    page_table = torch.tensor([2, 1], dtype=torch.int32, device=DEVICE)
    kw = dict(kv_lora_rank=RANK, qk_rope_head_dim=ROPE)

    def step(c, idx, outs):
        kernels.store_dsa_fp8_triton(c, 1, loc, nope, rope, **kw)
        kernels.gather_dsa_fp8_triton(c, 1, loc, outs[0], outs[1], **kw)
        kernels.set_index_k_triton(idx, 2, loc, keys, scales)
        kernels.get_index_k_triton(idx, 2, 100, page_table, outs[2], outs[3], key_bytes=128)

    def buffers():
        return [torch.empty(n, 1, RANK, device=DEVICE), torch.empty(n, 1, ROPE, device=DEVICE),
                torch.empty(100, 128, dtype=torch.uint8, device=DEVICE),
                torch.empty(100, 4, dtype=torch.uint8, device=DEVICE)]  # fmt: skip

    ref_cache, ref_index, ref_outs = cache.clone(), index.clone(), buffers()
    kernels.store_dsa_fp8_native(ref_cache, 1, loc, nope, rope, **kw)
    kernels.gather_dsa_fp8_native(ref_cache, 1, loc, ref_outs[0], ref_outs[1], **kw)
    kernels.set_index_k_native(ref_index, 2, loc, keys, scales)
    kernels.get_index_k_native(ref_index, 2, 100, page_table, ref_outs[2], ref_outs[3], key_bytes=128)

    outs = buffers()
    step(cache.clone(), index.clone(), buffers())  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step(cache, index, outs)
    graph.replay()
    torch.cuda.synchronize()
    assert bits_equal(cache, ref_cache) and bits_equal(index, ref_index)
    for got, want in zip(outs, ref_outs):
        assert bits_equal(got, want)
