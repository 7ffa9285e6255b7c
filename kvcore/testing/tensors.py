"""Tensor helpers for kernel tests: random bytes, bit-exact comparison, and the device tests run on.

Kernel tests run Triton's interpreter on the CPU by default; with ``KVCORE_TEST_COMPILED=1`` on a machine
with a GPU the same tests run the compiled kernels on CUDA tensors (:func:`test_device`).
"""

from __future__ import annotations

import math
import os
import types
from typing import Any

import torch

from kvcore.kernels.addresses import shared_by_copies
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


_LEAVES = (str, bytes, float, complex, bool, type(None), torch.dtype, torch.device, type, types.ModuleType,
           types.BuiltinFunctionType)  # fmt: skip


def _shared_by_copies(x: Any) -> bool:
    """Whether ``copy.deepcopy`` returns ``x`` itself (its class declares it shared by copies)."""
    return getattr(type(x), "__deepcopy__", None) is shared_by_copies


def _object_graph(root: Any):
    """``(path, value)`` of every object reachable from ``root`` through attributes (``__dict__`` and slots), items of
    dicts, lists, tuples and sets, and the cells of closures and bound methods, each object once.  Objects that
    copies share by design (their ``__deepcopy__`` is :func:`~kvcore.kernels.addresses.shared_by_copies`: launchers,
    kernels' argument lists, plans and the frozen planning records) are yielded but not entered: they hold no
    buffer, and what they hold is the original's and the copy's alike."""
    seen: set[int] = set()
    stack = [("copy", root)]
    while stack:
        path, x = stack.pop()
        yield path, x
        if isinstance(x, _LEAVES + (int, torch.Tensor)) or _shared_by_copies(x) or id(x) in seen:
            continue
        seen.add(id(x))
        if isinstance(x, dict):
            stack.extend((f"{path}[{k!r}]", v) for k, v in x.items())
        elif isinstance(x, (list, tuple, set, frozenset)):
            stack.extend((f"{path}[{i}]", v) for i, v in enumerate(x))
        elif isinstance(x, types.MethodType):
            stack.append((f"{path}.__self__", x.__self__))
        elif isinstance(x, types.FunctionType):
            for i, cell in enumerate(x.__closure__ or ()):
                try:
                    stack.append((f"{path}<cell {i}>", cell.cell_contents))
                except ValueError:  # an empty cell (a name the closure binds later)
                    pass
        else:
            names = list(getattr(x, "__dict__", {}))
            for cls in type(x).__mro__:
                slots = getattr(cls, "__slots__", ())
                names += [n for n in ((slots,) if isinstance(slots, str) else slots) if hasattr(x, n)]
            stack.extend((f"{path}.{n}", getattr(x, n)) for n in names if n not in ("__dict__", "__weakref__"))


def addresses_kept(copy: Any, original: Any) -> list[str]:
    """Where ``copy`` (a ``copy.deepcopy`` of ``original``) keeps an int that points into the memory of a tensor of
    ``original`` (a raw address its kernels would launch with: they would write the original's buffers), as paths
    (``copy._store._cache_ptrs[0]``).  Both objects are walked whole, less what copies share by design (see
    :func:`_object_graph`): a byte count in a shared plan may equal some address of the original's, by chance."""
    spans = set()
    for _, x in _object_graph(original):
        if isinstance(x, torch.Tensor):
            storage = x.untyped_storage()
            if storage.nbytes():
                spans.add((storage.data_ptr(), storage.data_ptr() + storage.nbytes()))
    return [path for path, x in _object_graph(copy)
            if type(x) is int and any(start <= x < end for start, end in spans)]  # fmt: skip
