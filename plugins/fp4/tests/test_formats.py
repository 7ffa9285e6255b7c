"""The block-scaled codes against decoders written here from the format descriptions alone (not from the
kernels or the references), the scale rules, and the round-trip error of each recipe beside fp8's."""

from __future__ import annotations

import math

import pytest
import torch

from kvcore_fp4.formats import RECIPES, dequantize, quantize

FP4 = [RECIPES["fp4_e2m1"], RECIPES["nvfp4"]]


# -- decoders from the descriptions ----------------------------------------------------------------------


def e2m1_value(nibble: int) -> float:
    """sign | 2 exponent bits (bias 1) | 1 mantissa bit; exponent 0 is subnormal."""
    sign = -1.0 if nibble & 8 else 1.0
    exponent, mantissa = (nibble >> 1) & 3, nibble & 1
    if exponent == 0:
        return sign * mantissa * 0.5
    return sign * (1 + mantissa / 2) * 2.0 ** (exponent - 1)


def e4m3_value(byte: int) -> float:
    """sign | 4 exponent bits (bias 7) | 3 mantissa bits; exponent 0 is subnormal; S.1111.111 is NaN."""
    sign = -1.0 if byte & 0x80 else 1.0
    exponent, mantissa = (byte >> 3) & 15, byte & 7
    if exponent == 15 and mantissa == 7:
        return math.nan
    if exponent == 0:
        return sign * mantissa / 8 * 2.0**-6
    return sign * (1 + mantissa / 8) * 2.0 ** (exponent - 7)


def ue8m0_value(byte: int) -> float:
    return 2.0 ** (byte - 127)


def decode_row(data: list[int], scales: list[int], name: str, global_scale: float = 1.0) -> list[float]:
    recipe = RECIPES[name]
    if recipe.value_bits == 4:
        codes = [c for byte in data for c in (byte & 15, byte >> 4)]  # element 2i in the low nibble
        values = [e2m1_value(c) for c in codes]
    else:
        values = [e4m3_value(b) for b in data]
    out = []
    for i, v in enumerate(values):
        s = scales[i // recipe.block]
        step = ue8m0_value(s) if recipe.scale_kind == "ue8m0" else e4m3_value(s) * global_scale
        out.append(v * step)
    return out


def _rows(seed: int, shape=(6, 64), outliers: bool = False) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * 4
    if outliers:  # a few values 50x larger than the rest, as K rows have in some channels
        x[torch.rand(shape, generator=g) < 0.02] *= 50
    x[0, :32] = 0  # an all-zero block (two of fp4's, one of mxfp8's)
    return x


def _with_global_scales(*scales: float) -> list[tuple[str, float]]:
    """(format, global scale) pairs: every format at 1.0, and the formats that have a global scale (nvfp4's) at
    each of ``scales`` as well."""
    return [(name, 1.0) for name in sorted(RECIPES)] + [
        (name, scale) for name in sorted(RECIPES) if RECIPES[name].global_scale for scale in scales]  # fmt: skip


@pytest.mark.parametrize(("name", "global_scale"), _with_global_scales(0.0625))
def test_codes_decode_as_the_format_describes(name, global_scale):
    recipe = RECIPES[name]
    x = _rows(1)
    data, scales = quantize(x, recipe, global_scale)
    assert data.dtype == scales.dtype == torch.uint8
    assert data.shape == (6, 64 * recipe.value_bits // 8) and scales.shape == (6, 64 // recipe.block)
    ours = dequantize(data, scales, recipe, global_scale=global_scale)
    for r in range(x.shape[0]):
        theirs = decode_row(data[r].tolist(), scales[r].tolist(), name, global_scale)
        assert ours[r].tolist() == pytest.approx(theirs, rel=0, abs=0), f"row {r}"


def test_fp4_scale_is_the_power_of_two_that_brings_amax_under_6():
    recipe = RECIPES["fp4_e2m1"]
    amaxes = [6.0, 12.0, 6.0001, 5.9999, 0.75, 1e-3, 3000.0, 0.0]
    x = torch.zeros(len(amaxes), 16)
    x[:, 3] = torch.tensor(amaxes)
    x[:, 5] = -torch.tensor(amaxes) / 3
    _, scales = quantize(x, recipe)
    for amax, byte in zip(amaxes, scales[:, 0].tolist()):
        expected = 0 if amax == 0 else math.ceil(math.log2(amax / 6)) + 127
        assert byte == expected, amax
        if amax:
            assert amax / ue8m0_value(byte) <= 6 < 2 * amax / ue8m0_value(byte)


def test_mxfp8_scale_puts_amax_into_e4m3s_top_binade():
    recipe = RECIPES["mxfp8"]
    amaxes = [448.0, 512.0, 1.0, 0.3, 1e6]
    x = torch.zeros(len(amaxes), 32)
    x[:, 7] = torch.tensor(amaxes)
    data, scales = quantize(x, recipe)
    for row, (amax, byte) in enumerate(zip(amaxes, scales[:, 0].tolist())):
        assert byte == math.floor(math.log2(amax)) - 8 + 127
        assert 256 <= amax / ue8m0_value(byte) < 512
        assert e4m3_value(data[row, 7].item()) == min(448.0, e4m3_value(data[row, 7].item()))


def test_e2m1_rounds_to_nearest_ties_away_and_saturates():
    recipe = RECIPES["fp4_e2m1"]
    x = torch.tensor([[6.0, 0.25, 0.2499, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 4.99, -0.25, -5.0, 0.0, 1.0, 3.0, 2.0]])
    data, scales = quantize(x, recipe)
    assert scales.tolist() == [[127]]  # amax 6: scale 1
    got = dequantize(data, scales, recipe)[0].tolist()
    assert got == [6.0, 0.5, 0.0, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 4.0, -0.5, -6.0, 0.0, 1.0, 3.0, 2.0]
    # the even element of each pair is the low nibble
    assert data[0, 0].item() == (0b0111 | 0b0001 << 4)  # 6.0 -> code 7 low, 0.25 -> 0.5 = code 1 high


def test_nvfp4_block_scale_is_amax_over_6_in_e4m3_under_the_global_scale():
    recipe = RECIPES["nvfp4"]
    x = torch.zeros(3, 16)
    x[:, 0] = torch.tensor([6.0, 100.0, 1e5])
    for g in (1.0, 0.25):
        _, scales = quantize(x, recipe, g)
        for amax, byte in zip((6.0, 100.0, 1e5), scales[:, 0].tolist()):
            wanted = torch.tensor(min(amax / 6 / g, 448.0)).to(torch.float8_e4m3fn).view(torch.uint8).item()
            assert byte == wanted


def _error(x: torch.Tensor, y: torch.Tensor) -> float:
    return ((y - x).norm() / x.norm()).item()


#: relative RMS error of a round trip, (normal rows, rows with 2% outliers 50x larger): the measured values
#: (README) rounded up.  A plain fp8 cache (one cast, no scale) saturates the outliers at 448.
BOUNDS = {"fp4_e2m1": (0.113, 0.121), "nvfp4": (0.096, 0.065), "mxfp8": (0.030, 0.036), "float8_e4m3fn": (0.027, 0.081)}


def saturating_e4m3fn(x: torch.Tensor) -> torch.Tensor:
    """A plain fp8 cache's store and read: one cast, no scale, overflow saturated at +-448.  What torch's own
    cast does with overflow changed between releases (torch <= 2.11 makes NaN of anything that rounds past
    448, newer torch saturates; :mod:`kvcore.kernels.fp8`), so clamp first: the saturating store on every torch, and
    on the saturating ones the same bytes as the bare cast (and as kvcore's fp8 store there)."""
    return x.clamp(-448.0, 448.0).to(torch.float8_e4m3fn).float()


def test_the_saturating_fp8_store_matches_a_saturating_torch():
    x = torch.tensor([447.0, 448.0, 455.0, 463.9, 464.0, 465.0, 1e4, -1e4, -465.0, 3.3, -0.0, 1e-3])
    y = saturating_e4m3fn(x)
    assert not y.isnan().any()
    assert y.abs().max().item() == 448.0 and y[2:9].abs().eq(448.0).all()
    from kvcore.kernels.fp8 import torch_e4m3fn_saturates

    if torch_e4m3fn_saturates():  # this torch saturates by itself: the clamp changes no byte
        assert torch.equal(y.view(torch.int32), x.to(torch.float8_e4m3fn).float().view(torch.int32))


@pytest.mark.parametrize("outliers", [False, True], ids=["normal", "outliers"])
@pytest.mark.parametrize("name", [*sorted(RECIPES), "float8_e4m3fn"])
def test_round_trip_error_is_bounded(name, outliers):
    x = _rows(2, (512, 128), outliers)[1:]  # without the zero block
    if name == "float8_e4m3fn":  # the plain fp8 cache: one cast, no scale
        y = saturating_e4m3fn(x)
    else:
        recipe = RECIPES[name]
        y = dequantize(*quantize(x, recipe), recipe)
    assert _error(x, y) <= BOUNDS[name][outliers]


@pytest.mark.parametrize("recipe", FP4, ids=lambda r: r.name)
def test_fp4_errors_stay_within_a_block_step(recipe):
    """No value moves by more than half the widest gap of its block's grid (between 4 and 6 scale steps: one
    step, at most amax / 3), plus the e4m3 rounding of an nvfp4 block scale (at most 1/16 of it)."""
    x = _rows(3, (64, 64), outliers=True)
    data, scales = quantize(x, recipe)
    y = dequantize(data, scales, recipe)
    blocks_x, blocks_y = x.reshape(64, -1, 16), y.reshape(64, -1, 16)
    amax = blocks_x.abs().amax(-1, keepdim=True)
    assert bool(((blocks_y - blocks_x).abs() <= amax / 3 * (1 + 1 / 16) + 1e-6).all())


# -- what the kernels are checked against must be exact and the same on every device ---------------------


def test_e2m1_decode_keeps_the_sign_of_zero_and_every_value():
    from kvcore_fp4.formats import e2m1_decode, e2m1_encode

    codes = torch.arange(16, dtype=torch.uint8)
    got = e2m1_decode(codes)
    want = torch.tensor([e2m1_value(c) for c in range(16)])
    want[8] = -0.0  # sign | 000 | 0 is negative zero
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))
    # and a negative value that rounds to zero keeps its sign bit, as -0.0 does: code 8, decoded -0.0
    assert e2m1_encode(torch.tensor([-0.2, 0.2, 0.0, -0.0])).tolist() == [8, 0, 0, 8]


def test_powers_of_two_are_exact_down_to_the_subnormals():
    from kvcore_fp4.formats import pow2

    k = torch.arange(-149, 129, dtype=torch.int32)
    want = torch.tensor([math.ldexp(1.0, int(e)) if e < 128 else math.inf for e in k], dtype=torch.float32)
    assert torch.equal(pow2(k).view(torch.int32), want.view(torch.int32))


def test_ue8m0_scale_byte_0_decodes_as_2_to_the_minus_127():
    """Blocks below 6 x 2**-126 get scale byte 0, which is the float32 subnormal 2**-127, not zero."""
    for recipe in (RECIPES["fp4_e2m1"], RECIPES["mxfp8"]):
        x = torch.zeros(1, recipe.block)
        x[0, :4] = torch.tensor([3e-38, -1e-38, 5e-39, -2e-39])
        data, scales = quantize(x, recipe)
        assert scales.tolist() == [[0]]
        y = dequantize(data, scales, recipe)
        theirs = decode_row(data[0].tolist(), scales[0].tolist(), recipe.name)
        assert y[0].tolist() == theirs and y[0, 0].item() != 0


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_the_references_copy_nothing_from_the_host(name, monkeypatch):
    """``kvcore bench`` captures the torch paths in CUDA graphs, where a host -> device copy is an error: the
    references build no tensors from Python data (a global scale given as a float is filled on the device)."""
    recipe = RECIPES[name]
    x = _rows(4)
    g = torch.tensor(0.25) if recipe.global_scale else 1.0

    def refuse(*args, **kwargs):
        raise AssertionError("a tensor made from host data in a reference path")

    monkeypatch.setattr(torch, "tensor", refuse)
    monkeypatch.setattr(torch, "as_tensor", refuse)
    monkeypatch.setattr(torch, "from_numpy", refuse)
    for scale in (g, 0.25) if recipe.global_scale else (g,):
        data, scales = quantize(x, recipe, scale)
        dequantize(data, scales, recipe, torch.bfloat16, scale)


@pytest.mark.parametrize(("name", "global_scale"), _with_global_scales(3.0, 0.0173))
def test_the_references_give_the_same_bytes_on_every_device(name, global_scale):
    """The references are the kernels' specification, so the test device must compute what the CPU does: CUDA
    torch divides by a Python float through its rounded reciprocal, one bit off at times (compiled runs)."""
    from kvcore.testing.tensors import test_device

    recipe = RECIPES[name]
    g = torch.Generator().manual_seed(11)
    x = torch.randn(256, 64, generator=g) * torch.logspace(-6, 6, 256)[:, None]  # float32: every mantissa bit
    x[0, 5] = 6.0 * 1.0625  # a block scale amax / 6 on an e4m3 tie
    cpu = quantize(x, recipe, global_scale)
    dev = quantize(x.to(test_device()), recipe, global_scale)
    assert all(torch.equal(a, b.cpu()) for a, b in zip(cpu, dev))
    back = dequantize(*cpu, recipe, torch.float32, global_scale)
    back_dev = dequantize(*(t.to(test_device()) for t in cpu), recipe, torch.float32, global_scale)
    assert torch.equal(back.view(torch.int32), back_dev.cpu().view(torch.int32))
