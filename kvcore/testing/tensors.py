"""Tensor helpers for kernel tests: random bytes, bit-exact comparison, and the device tests run on.

Kernel tests run Triton's interpreter on the CPU by default; with ``KVCORE_TEST_COMPILED=1`` on a machine
with a GPU the same tests run the compiled kernels on CUDA tensors (:func:`test_device`).
"""

from __future__ import annotations

import math
import os

import torch

from kvcore.sample import random_nonzero


def compiled() -> bool:
    """True when tests should run compiled kernels on CUDA (``KVCORE_TEST_COMPILED=1``)."""
    return os.environ.get("KVCORE_TEST_COMPILED") == "1"


def test_device() -> str:
    """``"cuda"`` under ``KVCORE_TEST_COMPILED=1``, else ``"cpu"`` (kernels interpreted)."""
    return "cuda" if compiled() else "cpu"


test_device.__test__ = False  # not a test, whatever pytest's name rules say


def skip_module_without_device() -> None:
    """In a test module: skip it when ``KVCORE_TEST_COMPILED=1`` asks for CUDA and there is none."""
    import pytest

    if compiled() and not torch.cuda.is_available():
        pytest.skip("KVCORE_TEST_COMPILED=1 needs a CUDA device", allow_module_level=True)


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same shape, dtype and bytes (NaN payloads included)."""
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(as_bytes(a), as_bytes(b))


def poison(shape, dtype: torch.dtype, generator: torch.Generator, device: str | None = None) -> torch.Tensor:
    """Random bytes viewed as ``dtype`` (NaN bit patterns included: compare bytes, never values)."""
    elem = torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (math.prod(shape) * elem,), dtype=torch.uint8, generator=generator)
    return raw.view(dtype).reshape(shape).to(device or test_device())


def randn_nonzero(shape, dtype: torch.dtype, generator: torch.Generator, scale: float = 1.0,
                  device: str | None = None) -> torch.Tensor:
    """:func:`kvcore.pools.random_nonzero` on the test device by default."""
    return random_nonzero(shape, dtype, generator, scale, device or test_device())
