"""Bit-exact tests of the fp8 / bf16 encoders and decoders in ``kvcore.kernels.fp8`` against torch's conversions.

Interpreted on the CPU by default (the integer encoders); compiled on CUDA with KVCORE_TEST_COMPILED=1.
"""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from kvcore.kernels import dtypes, fp8

from kvcore.testing.tensors import compiled, skip_module_without_device, test_device

skip_module_without_device()
COMPILED, DEVICE = compiled(), test_device()
_BF16 = tl.constexpr(dtypes.BF16)


# ==========================================================================================================
# fp8 / bf16 encoders and decoders
# ==========================================================================================================


@triton.jit
def _encode_kernel(
    x_ptr, out_ptr, n, KIND: tl.constexpr, SATURATE: tl.constexpr, BLOCK: tl.constexpr, HW: tl.constexpr
):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask, other=0.0)
    if KIND == _BF16:
        tl.store(out_ptr + offs, fp8.f32_to_bf16_bits(x).to(tl.int16), mask=mask)
    elif HW:
        tl.store(out_ptr + offs, fp8.f32_to_fp8_bits_hw(x, KIND, SATURATE).to(tl.uint8), mask=mask)
    else:
        tl.store(out_ptr + offs, fp8.f32_to_fp8_bits(x, KIND, SATURATE).to(tl.uint8), mask=mask)


@triton.jit
def _decode_kernel(b_ptr, out_ptr, n, KIND: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    b = tl.load(b_ptr + offs, mask=mask, other=0)
    tl.store(out_ptr + offs, fp8.fp8_bits_to_f32(b, KIND), mask=mask)


def _encode(x: torch.Tensor, kind: int, saturate: bool, hw: bool = False, block: int = 4096) -> torch.Tensor:
    x = x.to(DEVICE)
    out = torch.empty(x.numel(), dtype=torch.int16 if kind == dtypes.BF16 else torch.uint8, device=DEVICE)
    _encode_kernel[(triton.cdiv(x.numel(), block),)](x, out, x.numel(), kind, saturate, block, hw)
    return out.cpu()


def _sweep_values() -> torch.Tensor:
    """float32 values covering every fp8 value, the midpoints between neighbours (ties) and their float32
    neighbours, the subnormal ranges, overflow, inf, nan, float32 subnormals and random bit patterns."""
    parts = []
    up, down = torch.tensor(float("inf")), torch.tensor(float("-inf"))
    for dt in dtypes.FP8_DTYPES:
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
    got = _encode(x, dtypes.E4M3FN, saturate)
    want = _e4m3fn_expected(x, saturate)
    bad = (got != want).nonzero().flatten()
    assert bad.numel() == 0, [(x[i].item(), got[i].item(), want[i].item()) for i in bad[:8]]


def test_e4m3fn_expected_matches_installed_torch():
    # The adjusted expectation for the installed torch's own behaviour is torch itself.
    x = _SWEEP
    assert torch.equal(_e4m3fn_expected(x, fp8.torch_e4m3fn_saturates()), x.to(torch.float8_e4m3fn).view(torch.uint8))


def test_e5m2_encoder_bit_exact():
    x = _SWEEP
    got = _encode(x, dtypes.E5M2, False)
    want = x.to(torch.float8_e5m2).view(torch.uint8)
    bad = (got != want).nonzero().flatten()
    assert bad.numel() == 0, [(x[i].item(), got[i].item(), want[i].item()) for i in bad[:8]]


def test_bf16_encoder_bit_exact():
    x = _SWEEP
    got = _encode(x, dtypes.BF16, False)
    want = x.to(torch.bfloat16).view(torch.int16)
    nan = x.isnan()
    assert torch.equal(got[~nan], want[~nan])
    assert got.view(torch.bfloat16)[nan].isnan().all()
    # NaN keeps its sign.
    assert torch.equal(got[nan] < 0, x[nan].view(torch.int32) < 0)


@pytest.mark.parametrize("dtype", dtypes.FP8_DTYPES, ids=["e4m3fn", "e5m2"])
def test_fp8_decoders_bit_exact(dtype):
    b = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    out = torch.empty(256, dtype=torch.float32, device=DEVICE)
    _decode_kernel[(1,)](b.to(DEVICE), out, 256, dtypes.dtype_code(dtype), 256)
    assert torch.equal(out.cpu().view(torch.int32), b.view(dtype).float().view(torch.int32))


def test_dtype_helpers_and_codes():
    assert dtypes.storage_dtype(torch.float8_e4m3fn) == torch.uint8
    assert dtypes.storage_dtype(torch.float8_e5m2) == torch.uint8
    assert dtypes.storage_dtype(torch.bfloat16) == torch.bfloat16
    assert dtypes.is_fp8_dtype(torch.float8_e5m2) and not dtypes.is_fp8_dtype(torch.float16)
    codes = [dtypes.SAME] + [dtypes.dtype_code(d) for d in dtypes.DTYPE_CODES]
    assert len(set(codes)) == len(codes), "every dtype has its own code, distinct from SAME"
    assert dtypes.conversion_code(torch.bfloat16, torch.bfloat16) == dtypes.SAME
    assert dtypes.conversion_code(torch.float32, torch.float8_e5m2) == dtypes.E5M2
    with pytest.raises(ValueError, match="raw uint8"):
        dtypes.conversion_code(torch.uint8, torch.bfloat16)
    with pytest.raises(ValueError, match="nope: unsupported dtype torch.int32"):
        dtypes.dtype_code(torch.int32, "nope")
    inf_byte = torch.tensor([float("inf")]).to(torch.float8_e4m3fn).view(torch.uint8).item()
    assert fp8.torch_e4m3fn_saturates() == (inf_byte == 0x7E)


@pytest.mark.gpu
@pytest.mark.skipif(not COMPILED, reason="the GPU conversion path runs compiled only (the interpreter's cast rounds wrongly)")
@pytest.mark.parametrize("kind", [dtypes.E4M3FN, dtypes.E5M2], ids=["e4m3fn", "e5m2"])
@pytest.mark.parametrize("saturate", [False, True])
def test_hardware_fp8_conversion_matches_the_integer_encoder(kind, saturate):
    x = _sweep_values()
    assert torch.equal(_encode(x, kind, saturate, hw=True), _encode(x, kind, saturate, hw=False))


@pytest.mark.gpu
@pytest.mark.skipif(not COMPILED, reason="the GPU conversion path runs compiled only (the interpreter's cast rounds wrongly)")
@pytest.mark.parametrize("saturate", [False, True])
def test_hardware_e4m3fn_special_values_alone_in_their_tiles(saturate):
    # Overflow, inf and NaN of either sign, each alone in its own 64-value tile at a different position, among
    # tiles holding none (an encoder that patched only the tiles needing it must still get every byte right).
    gen = torch.Generator().manual_seed(1)
    x = (torch.rand(64 * 64, generator=gen) * 900 - 450).float()  # finite, |x| < 464
    special = [float("nan"), -float("nan"), float("inf"), -float("inf"), 464.0, -464.0, 464.01, -465.0, 1e6, -1e30]
    for i, value in enumerate(special):
        x[64 * (3 * i + 1) + 7 * i] = value
    got = _encode(x, dtypes.E4M3FN, saturate, hw=True, block=64)
    assert torch.equal(got, _e4m3fn_expected(x, saturate))
    assert torch.equal(got, _encode(x, dtypes.E4M3FN, saturate, hw=False, block=64))
