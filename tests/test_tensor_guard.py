"""kvcore.kernels.tensor_guard: a launch's layout guard says True only for tensors laid out as the ones it was made
from, whichever of its two implementations answers."""

from __future__ import annotations

import pytest
import torch

from kvcore.kernels import tensor_guard
from kvcore.kernels.tensor_guard import layout_guard, python_layout_guard

GUARDS = {"layout_guard": layout_guard, "python": python_layout_guard}


class Marked(torch.Tensor):
    """A tensor subclass: another Python type with the same layout."""


def made():
    """Two new rows as a transformers layer hands them over: keys contiguous, values a transposed view."""
    k = torch.randn(3, 2, 1, 16, dtype=torch.bfloat16)
    v = torch.randn(3, 1, 2, 8, dtype=torch.bfloat16).transpose(1, 2)
    return k, v


@pytest.mark.parametrize("name", sorted(GUARDS))
def test_a_guard_says_true_for_tensors_laid_out_alike_and_false_for_each_difference(name):
    k, v = made()
    check = GUARDS[name](k, v)
    k2, v2 = made()
    assert check(k, v) and check(k2, v2), "other tensors of the same layout"
    different = {
        "swapped": (v, k),
        "one passed twice": (k, k),
        "another dtype": (k.half(), v),
        "another shape": (torch.randn(3, 2, 2, 16, dtype=torch.bfloat16), v),
        "another batch": (k[:2], v),
        "other strides": (k, torch.randn(3, 2, 1, 8, dtype=torch.bfloat16)),  # (v's differ in the size-1 dim's)
        "other strides, same shape and dtype": (k.transpose(0, 1).contiguous().transpose(0, 1), v),
        "another rank": (k.squeeze(2), v),
        "requires grad": (k.clone().requires_grad_(), v),
        "another type": (k.as_subclass(Marked), v),
    }
    for what, tensors in different.items():
        assert not check(*tensors), what
    for count in ((k,), (k, v, k2)):
        with pytest.raises(TypeError):
            check(*count)


def test_torch_s_guard_is_the_one_used_where_it_answers_as_the_python_comparison():
    """On this torch the C guard passes the module's own trial, so layout_guard returns it (not the Python one)."""
    assert tensor_guard._torch_guard_answers_right()
    k, v = made()
    assert layout_guard(k, v).__class__ is not python_layout_guard(k, v).__class__


def test_without_torch_s_guard_the_python_comparison_answers(monkeypatch):
    monkeypatch.setattr(tensor_guard, "_TensorGuards", None)
    monkeypatch.setattr(tensor_guard, "_torch_guard_works", None)
    k, v = made()
    check = layout_guard(k, v)
    assert check.__qualname__.startswith("python_layout_guard")
    assert check(*made()) and not check(v, k)
