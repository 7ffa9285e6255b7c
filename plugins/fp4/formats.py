"""The block-scaled formats' codes, as torch references: the specification the kernels are checked against.

Every recipe splits a row's last dimension into blocks of ``block`` values that share one scale byte:

``fp4_e2m1`` (SGLang's block FP4)
    values e2m1 (sign, 2 exponent bits of bias 1, 1 mantissa bit: magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6),
    packed two per byte with the even element in the low nibble; 16 values per scale; the scale is a power of
    two ``2**e`` stored as the byte ``e + 127`` (UE8M0), ``e = ceil(log2(amax / 6))`` so the largest magnitude
    lands at or under 6.  A block of zeros gets the smallest exponent (byte 0), never NaN.
``nvfp4``
    e2m1 values as above; 16 values per scale; the scale is an e4m3 byte holding ``amax / 6 / global_scale``
    (round to nearest even, at most 448), and ``global_scale`` is one float32 per layer and per K/V: a value
    decodes as ``e2m1 x e4m3 x global_scale`` (the block's *step*) and is encoded from its product with the
    step's reciprocal (:func:`reciprocal_step`: one division a block, a product a value, as NVIDIA's NVFP4
    quantizers do).  The default 1.0 keeps block scales in e4m3's range for magnitudes up to 6 x 448 = 2688
    with full precision from about 6 x 2**-6 = 0.09; calibration sets it to ``amax / 2688`` of the layer's K
    (or V) so its largest block uses the top of e4m3.
``mxfp8`` (OCP Microscaling MXFP8)
    e4m3 values, 32 per scale; the scale is ``2**X`` as UE8M0 with ``X = floor(log2(amax)) - 8`` (8 is e4m3's
    largest exponent), so the largest magnitude scales into [256, 512) and saturates at 448.

Rounding: e2m1 codes round to the nearest value, ties away from zero (SGLang's boundaries 0.25, 0.75, ...,
5); the sign bit is the scaled value's own, so a negative value that rounds to zero (and -0.0) is code 8, -0,
which decodes to -0.0.
e4m3 codes are torch's ``.to(torch.float8_e4m3fn)`` (nearest even) of the value clamped to [-448, 448] first,
so they do not depend on whether the installed torch saturates or makes NaN on overflow.  Scaling by a power
of two is exact, so fp4_e2m1 and mxfp8 bytes depend on nothing but these rules.

The references are the specification of the kernels' bytes on every device, so every float32 operation in
them is one IEEE operation, rounded once, on the CPU and on CUDA alike: divisions are tensor by tensor (CUDA
torch turns ``tensor / python_float`` into a multiplication by the rounded reciprocal, one bit off at times),
powers of two are built from their bits (subnormal 2**-127 included; no ``exp2``), and e2m1 codes come from
comparisons and integer operations.  Nothing is copied from the host (no ``torch.tensor`` of constants), so
the torch paths can be captured in CUDA graphs.
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
#: a magnitude at or above the i-th bound takes code i + 1: nearest value, ties away from zero (SGLang's)
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
    """Float32 values (already scaled) -> e2m1 codes 0..15 (uint8), saturating at +-6: the magnitude code is the
    count of :data:`E2M1_BOUNDS` at or below ``|x|`` (NaN gives 0), bit 3 the sign bit (``-0.0`` is code 8)."""
    a = x.abs()
    magnitude = torch.zeros(x.shape, dtype=torch.uint8, device=x.device)
    for bound in E2M1_BOUNDS:
        magnitude += (a >= bound).to(torch.uint8)
    return magnitude | torch.signbit(x).to(torch.uint8) << 3


def e2m1_decode(codes: torch.Tensor) -> torch.Tensor:
    """e2m1 codes (any integer dtype, 0..15) -> float32; code 8 is -0.0 (the sign of zero is kept)."""
    c = codes.to(torch.int32)
    exponent, mantissa = (c >> 1) & 3, c & 1
    # twice the magnitude: m for exponent 0 (subnormal), (2 + m) * 2**(exponent - 1) otherwise
    twice = torch.where(exponent == 0, mantissa, (2 + mantissa) << (exponent - 1).clamp(min=0))
    magnitude = twice.to(torch.float32) * 0.5
    return torch.where((c & 8) != 0, -magnitude, magnitude)  # negation flips the sign bit: -0.0 for code 8


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


def pow2(k: torch.Tensor) -> torch.Tensor:
    """``2**k`` as float32 for integer ``k`` in [-149, 128], built from its bits: exact, subnormals
    (``k < -126``) included, ``k = 128`` is inf; the same on every device (the kernels build it the same way)."""
    k = k.to(torch.int32)
    normal = (k + 127).clamp(min=1) << 23
    subnormal = torch.ones_like(k) << (k + 149).clamp(0, 22)
    return torch.where(k >= -126, normal, subnormal).view(torch.float32)


def _like(value: float, x: torch.Tensor) -> torch.Tensor:
    """``value`` as a float32 0-d tensor on ``x``'s device, filled there (no host copy): dividing by it is an
    IEEE division on CUDA too, where dividing by a Python float multiplies by its rounded reciprocal."""
    return torch.full((), value, dtype=torch.float32, device=x.device)


def _global_scale(global_scale: float | torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    if isinstance(global_scale, torch.Tensor):
        return global_scale.to(device=x.device, dtype=torch.float32)  # no copy when it is already there
    return _like(float(global_scale), x)


def reciprocal_step(step: torch.Tensor) -> torch.Tensor:
    """What nvfp4 values are multiplied by: ``1 / step`` (IEEE division) within float32's finite range, so a
    product with it is never NaN (a subnormal step's reciprocal would be inf, and 0 x inf NaN); 0 for a zero
    step, whose block decodes to zeros whatever its codes."""
    finite = torch.finfo(torch.float32).max
    inv = (_like(1.0, step) / step).clamp(-finite, finite)
    return torch.where(step == 0, 0.0, inv)


def _e4m3(x: torch.Tensor) -> torch.Tensor:
    """Float32 -> e4m3fn bytes, nearest even, saturated at +-448 (clamped first: torch <= 2.11 makes NaN of
    what rounds past 448, newer torch saturates; the clamp gives both the saturating bytes)."""
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
            q = torch.where(zero, 1.0, amax) / _like(E2M1_MAX, amax)
            e = ceil_log2(q)
            zero = zero | (q == 0)  # a subnormal amax whose quotient rounds to 0: the smallest exponent too
        else:
            e = floor_log2(torch.where(zero, 1.0, amax)) - E4M3_EMAX
        e = torch.where(zero, -UE8M0_BIAS, e.clamp(-UE8M0_BIAS, UE8M0_BIAS))
        scales = (e + UE8M0_BIAS).to(torch.uint8)
        scaled = blocks * pow2(-e)  # exact unless the product is subnormal (then rounded once, as the kernel)
    else:  # e4m3 block scales under a global scale
        g = _global_scale(global_scale, x)
        scales = _e4m3(amax / _like(E2M1_MAX, amax) / g)
        step = _e4m3_value(scales) * g
        scaled = blocks * reciprocal_step(step)
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
        step = pow2(scales.to(torch.int32) - UE8M0_BIAS)  # byte 0 is 2**-127, a float32 subnormal
    else:
        step = _e4m3_value(scales) * _global_scale(global_scale, data)
    return (blocks * step.unsqueeze(-1)).reshape(values.shape).to(dtype)
