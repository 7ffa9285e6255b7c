"""Whether tensors are laid out as the ones a launch was planned for, in one C call.

A hot path that launches a planned kernel again (:class:`~kvcore.kernels.head_gather.HeadGather`'s repeated
store-and-gather) must first know that the tensors it is handed have the shapes, strides, dtype and device the plan
was made for: the kernel reads and writes by them.  Compared in Python (``x.shape == shape``, ``x.stride() ==
stride``, ``x.dtype``, ``x.get_device()``) that is eight calls that each build an object for two tensors; torch's own
tensor guard (``torch._C._dynamo.guards.TensorGuards``, what a ``torch.compile``'d function checks its tensor
arguments with) makes the same comparisons, and more, in one call, about a third of the time.

:func:`layout_guard` returns one or the other: torch's guard when this torch has it and it answers as this module
expects (tried once, on small CPU tensors), else the Python comparison.  Either says True only for tensors of the
same Python type, dtype, device, sizes, strides and ``requires_grad`` as the ones it was made from, none passed twice;
torch's also compares the dispatch keys (a tensor made under ``torch.inference_mode()``, or a wrapper subclass, is
not one made outside it), so it may say False where the Python one says True: never the other way round.  A False
only sends a caller back to its checked path.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

__all__ = ["layout_guard", "python_layout_guard"]

try:
    from torch._C._dynamo.guards import TensorGuards as _TensorGuards
except ImportError:  # pragma: no cover - torch builds without dynamo
    _TensorGuards = None

_torch_guard_works: bool | None = None  # tried on first use


def python_layout_guard(*tensors: torch.Tensor) -> Callable[..., bool]:
    """The Python comparison :func:`layout_guard` falls back to (and what torch's guard is tested against)."""
    layouts = tuple((t.__class__, t.shape, t.stride(), t.dtype, t.device, t.requires_grad) for t in tensors)
    count = len(layouts)

    def check(*others: torch.Tensor) -> bool:
        if len(others) != count:
            raise TypeError(f"this guard checks {count} tensors, got {len(others)}")
        if len({id(t) for t in others}) != count:
            return False
        return all((t.__class__, t.shape, t.stride(), t.dtype, t.device, t.requires_grad) == layout
                   for t, layout in zip(others, layouts))  # fmt: skip

    return check


def _torch_guard(tensors: tuple[torch.Tensor, ...]) -> Callable[..., bool]:
    return _TensorGuards(*tensors, dynamic_dims_sizes=[list(t.shape) for t in tensors],
                         dynamic_dims_strides=[list(t.stride()) for t in tensors]).check  # fmt: skip


def _torch_guard_answers_right() -> bool:
    """Whether torch's guard is here and tells apart what the Python comparison does, on small CPU tensors."""
    if _TensorGuards is None:
        return False
    try:
        a = torch.zeros((2, 3, 4), dtype=torch.bfloat16)
        b = torch.zeros((2, 4, 3), dtype=torch.bfloat16).transpose(1, 2)  # a's shape, other strides
        check = _torch_guard((a, b))
        same = check(a.clone(), b.clone().transpose(1, 2).contiguous().transpose(1, 2))
        wrong = (
            check(b, a), check(a, a), check(a.float(), b), check(a[:1], b), check(a, b[:, :2]),
            check(a.view(2, 12), b), check(a.unsqueeze(0), b),
        )  # fmt: skip
        return same is True and not any(wrong)
    except Exception:  # noqa: BLE001 - any failure of a private API means: do not use it
        return False


def layout_guard(*tensors: torch.Tensor) -> Callable[..., bool]:
    """A check ``guard(*others) -> bool`` of as many tensors as ``tensors`` (another count raises TypeError): True
    only when each has the same Python type, dtype, device, sizes, strides and ``requires_grad`` as the one at its
    position and none is passed twice (torch's tensor guard when it works here, else :func:`python_layout_guard`;
    see the module)."""
    global _torch_guard_works
    if _torch_guard_works is None:
        _torch_guard_works = _torch_guard_answers_right()
    if _torch_guard_works:
        try:
            return _torch_guard(tensors)
        except Exception:  # noqa: BLE001 - a tensor the private guard does not take: compare in Python
            pass
    return python_layout_guard(*tensors)
