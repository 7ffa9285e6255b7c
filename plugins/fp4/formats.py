"""The block-scaled formats' codes, as torch references: the specification the kernels are checked against.

Every recipe splits a row's last dimension into blocks of ``block`` values that share one scale byte:

``fp4_e2m1`` (the seed's block FP4)
    values e2m1 (sign, 2 exponent bits of bias 1, 1 mantissa bit: magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6),
    packed two per byte with the even element in the low nibble; 16 values per scale; the scale is a power of
    two ``2**e`` stored as the byte ``e + 127`` (UE8M0), ``e = ceil(log2(amax / 6))`` so the largest magnitude
    lands at or under 6.  A block of zeros gets the smallest exponent (byte 0), never NaN.
``nvfp4``
    e2m1 values as above; 16 values per scale; the scale is an e4m3 byte holding ``amax / 6 / global_scale``
    (round to nearest even, at most 448), and ``global_scale`` is one float32 per layer and per K/V: a value
    decodes as ``e2m1 x e4m3 x global_scale``.  The default 1.0 keeps block scales in e4m3's range for
    magnitudes up to 6 x 448 = 2688 with full precision from about 6 x 2**-6 = 0.09; calibration sets it to
    ``amax / 2688`` of the layer's K (or V) so its largest block uses the top of e4m3.
``mxfp8`` (OCP Microscaling MXFP8)
    e4m3 values, 32 per scale; the scale is ``2**X`` as UE8M0 with ``X = floor(log2(amax)) - 8`` (8 is e4m3's
    largest exponent), so the largest magnitude scales into [256, 512) and saturates at 448.

Rounding: e2m1 codes round to the nearest value, ties away from zero (the seed's boundaries 0.25, 0.75, ...,
5); e4m3 codes are torch's ``.to(torch.float8_e4m3fn)`` (nearest even), saturated at 448.  Scaling by a power
of two is exact, so fp4_e2m1 and mxfp8 bytes depend on nothing but these rules.
"""

from __future__ import annotations

import attrs
import torch

__all__ = ["E2M1_MAX", "RECIPES", "Recipe", "dequantize", "quantize"]

E2M1_MAX = 6.0
E4M3_MAX = 448.0
E4M3_EMAX = 8
#: magnitudes of the e2m1 codes 0..7 (bit 3 is the sign)
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
#: a magnitude at or above the i-th bound takes code i + 1: nearest value, ties away from zero (the seed's)
E2M1_BOUNDS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
UE8M0_BIAS = 127


@attrs.frozen
class Recipe:
    """One block-scaled format: ``block`` values per scale byte, values of ``value_bits``, scales of
    ``scale_kind`` (``ue8m0`` or ``e4m3``), and whether a float32 global scale per layer and K/V goes with it."""

    name: str
    block: int
    value_bits: int
    scale_kind: str
    global_scale: bool = False

    def data_bytes(self, values: int) -> int:
        """Bytes of ``values`` codes (two per byte for 4-bit values)."""
        return values * self.value_bits // 8

    def scale_bytes(self, values: int) -> int:
        return values // self.block

    def check_width(self, width: int, what: str) -> None:
        if width % self.block:
            raise ValueError(f"{what}={width} is not a multiple of {self.name}'s block of {self.block} values")


RECIPES = {
    "fp4_e2m1": Recipe("fp4_e2m1", block=16, value_bits=4, scale_kind="ue8m0"),
    "nvfp4": Recipe("nvfp4", block=16, value_bits=4, scale_kind="e4m3", global_scale=True),
    "mxfp8": Recipe("mxfp8", block=32, value_bits=8, scale_kind="ue8m0"),
}


# -- e2m1 codes and nibbles ------------------------------------------------------------------------------


def e2m1_encode(x: torch.Tensor) -> torch.Tensor:
    """Float32 values (already scaled) -> e2m1 codes 0..15 (uint8), saturating at +-6."""
    bounds = torch.tensor(E2M1_BOUNDS, dtype=torch.float32, device=x.device)
    magnitude = torch.bucketize(x.abs(), bounds, right=True).to(torch.uint8)  # count of bounds <= |x|
    return magnitude | (x < 0).to(torch.uint8) << 3


def e2m1_decode(codes: torch.Tensor) -> torch.Tensor:
    values = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=codes.device)
    magnitude = values[(codes & 7).long()]
    return torch.where((codes & 8) != 0, -magnitude, magnitude)


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """``[..., 2k]`` codes -> ``[..., k]`` bytes, element ``2i`` in the low nibble of byte ``i``."""
    return codes[..., 0::2] | codes[..., 1::2] << 4


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    low, high = packed & 15, packed >> 4
    return torch.stack((low, high), dim=-1).flatten(-2)


# -- scales ----------------------------------------------------------------------------------------------


def _exponent(v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(k, exact)`` with ``v = m x 2**k``, ``m`` in [0.5, 1), and whether ``v`` is a power of two (exact
    integer log2, unlike ``torch.log2``)."""
    m, k = torch.frexp(v)
    return k, m == 0.5


def ceil_log2(v: torch.Tensor) -> torch.Tensor:
    """``ceil(log2(v))`` of positive float32 ``v``, exactly."""
    k, power = _exponent(v)
    return torch.where(power, k - 1, k)


def floor_log2(v: torch.Tensor) -> torch.Tensor:
    k, _ = _exponent(v)
    return k - 1


def _e4m3(x: torch.Tensor) -> torch.Tensor:
    """Float32 -> e4m3fn bytes, nearest even, saturated at 448."""
    return x.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).view(torch.uint8)


def _e4m3_value(b: torch.Tensor) -> torch.Tensor:
    return b.view(torch.float8_e4m3fn).to(torch.float32)


# -- the recipes -----------------------------------------------------------------------------------------


def quantize(x: torch.Tensor, recipe: Recipe, global_scale: float | torch.Tensor = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows ``[..., D]`` (any float dtype) -> ``(data, scales)``: uint8 ``[..., D x value_bits / 8]`` and uint8
    ``[..., D / block]``.  ``global_scale`` (nvfp4 only) is the decode scale of the layer's K or V."""
    recipe.check_width(x.shape[-1], "row width")
    blocks = x.float().reshape(*x.shape[:-1], -1, recipe.block)
    amax = blocks.abs().amax(dim=-1, keepdim=True)
    zero = amax == 0
    if recipe.scale_kind == "ue8m0":
        if recipe.value_bits == 4:
            e = ceil_log2(torch.where(zero, 1.0, amax) / E2M1_MAX)
        else:
            e = floor_log2(torch.where(zero, 1.0, amax)) - E4M3_EMAX
        e = torch.where(zero, -UE8M0_BIAS, e.clamp(-UE8M0_BIAS, UE8M0_BIAS))
        scales = (e + UE8M0_BIAS).to(torch.uint8)
        scaled = blocks * torch.exp2(-e.float())  # exact: a power of two
    else:  # e4m3 block scales under a global scale
        g = torch.as_tensor(global_scale, dtype=torch.float32, device=x.device)
        scales = _e4m3(amax / E2M1_MAX / g)
        step = _e4m3_value(scales) * g
        scaled = torch.where(step == 0, 0.0, blocks / torch.where(step == 0, 1.0, step))
    if recipe.value_bits == 4:
        data = pack_nibbles(e2m1_encode(scaled).reshape(*x.shape[:-1], -1))
    else:
        data = _e4m3(scaled).reshape(*x.shape[:-1], -1)
    return data, scales.reshape(*x.shape[:-1], -1)


def dequantize(data: torch.Tensor, scales: torch.Tensor, recipe: Recipe, dtype: torch.dtype = torch.float32,
               global_scale: float | torch.Tensor = 1.0) -> torch.Tensor:  # fmt: skip
    """``quantize``'s inverse: ``(data, scales)`` -> ``[..., D]`` of ``dtype`` (computed in float32)."""
    if recipe.value_bits == 4:
        values = e2m1_decode(unpack_nibbles(data))
    else:
        values = _e4m3_value(data)
    blocks = values.reshape(*values.shape[:-1], -1, recipe.block)
    if recipe.scale_kind == "ue8m0":
        step = torch.exp2(scales.float() - UE8M0_BIAS)
    else:
        step = _e4m3_value(scales) * torch.as_tensor(global_scale, dtype=torch.float32, device=data.device)
    return (blocks * step.unsqueeze(-1)).reshape(values.shape).to(dtype)
