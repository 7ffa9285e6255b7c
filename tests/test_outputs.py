"""FreshTensors: the hot paths' new output tensors."""

import os

import pytest
import torch

from kvcore.outputs import FreshTensors

DEVICE = "cuda" if os.environ.get("KVCORE_TEST_COMPILED") == "1" else "cpu"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.uint8, torch.int64])
@pytest.mark.parametrize("shape", [(0, 1, 512), (7, 1, 64), (5, 8, 128), (256,)])
def test_fresh_tensors_are_new_contiguous_tensors_of_the_shape_and_dtype_asked(dtype, shape):
    new = FreshTensors(DEVICE)
    a, b = new(shape, dtype), new(shape, dtype)
    for t in (a, b):
        assert t.shape == shape and t.dtype == dtype and t.device.type == DEVICE and t.is_contiguous()
    if a.numel():  # two calls never share storage: writing one leaves the other as it was
        a.fill_(1)
        b.fill_(0)
        assert bool((a == 1).all()) and a.data_ptr() != b.data_ptr()


def test_fresh_tensors_keep_one_template_per_dtype():
    new = FreshTensors(DEVICE)
    new((3,), torch.float16)
    new((4, 2), torch.float16)
    new((1,), torch.int32)
    assert sorted(map(str, new._templates)) == ["torch.float16", "torch.int32"]
    assert all(t.numel() == 0 for t in new._templates.values())
