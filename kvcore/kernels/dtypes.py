"""Cache dtypes: which are fp8, how each is stored, and the one table of dtype codes every kernel uses.

Importing this needs no kernels: layouts and the planner use it on machines without a GPU.
"""

from __future__ import annotations

import torch

__all__ = [
    "BF16",
    "BYTES",
    "DTYPE_CODES",
    "E4M3FN",
    "E4M3FN_MAX",
    "E5M2",
    "E5M2_MAX",
    "F16",
    "F32",
    "FP8_DTYPES",
    "SAME",
    "conversion_code",
    "dtype_code",
    "is_fp8_dtype",
    "storage_dtype",
]

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
#: largest finite float8_e4m3fn / float8_e5m2 values.
E4M3FN_MAX = 448.0
E5M2_MAX = 57344.0


def is_fp8_dtype(dtype: torch.dtype) -> bool:
    """True for the fp8 cache dtypes kvcore supports (float8_e4m3fn, float8_e5m2)."""
    return dtype in FP8_DTYPES


def storage_dtype(dtype: torch.dtype) -> torch.dtype:
    """How a cache of ``dtype`` is stored: fp8 as uint8 (index_put has no fp8 kernels), others as is."""
    return torch.uint8 if is_fp8_dtype(dtype) else dtype


# -- kernel dtype codes ------------------------------------------------------------------------------------
# Kernels receive dtypes as these constexpr codes: what a loaded tensor holds, and what a conversion writes.
# fp8 tensors reach kernels as their uint8 bytes, so the code, not the pointer type, says how to decode them.

#: conversion target "the source's own dtype": the bits are moved unchanged.
SAME = 0
F32 = 1
F16 = 2
BF16 = 3
E4M3FN = 4
E5M2 = 5
#: raw bytes (``torch.uint8``), only ever copied (a family's own packed row format).
BYTES = 6

DTYPE_CODES: dict[torch.dtype, int] = {
    torch.float32: F32,
    torch.float16: F16,
    torch.bfloat16: BF16,
    torch.float8_e4m3fn: E4M3FN,
    torch.float8_e5m2: E5M2,
    torch.uint8: BYTES,
}


def dtype_code(dtype: torch.dtype, what: str = "tensor") -> int:
    """The kernel code of ``dtype``.

    :raises ValueError: naming ``what`` for a dtype no kernel handles.
    """
    try:
        return DTYPE_CODES[dtype]
    except KeyError:
        names = ", ".join(str(d).removeprefix("torch.") for d in DTYPE_CODES)
        raise ValueError(f"{what}: unsupported dtype {dtype}; use one of {names}") from None


def conversion_code(src: torch.dtype, dst: torch.dtype, what: str = "tensor") -> int:
    """What a kernel converting ``src`` values into ``dst`` writes: :data:`SAME` when the dtypes agree, else
    the code of ``dst``.

    :raises ValueError: for a dtype no kernel handles, or raw bytes converted to or from anything else.
    """
    dtype_code(src, what)
    if src == dst:
        return SAME
    if src == torch.uint8 or dst == torch.uint8:
        raise ValueError(f"{what}: raw uint8 rows are only copied to/from uint8, got {src} -> {dst}")
    return dtype_code(dst, what)
