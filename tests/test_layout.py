"""Declared buffer layouts: rows, shapes and bytes for token rows, page rows and request rows; pool totals,
fixed (padding) bytes, size groups, and validation.
"""

from __future__ import annotations

import math

import pytest
import torch

from kvcore.layout import BufferLayout, PoolLayout


def token_buffer(name="k", layers=4, row_shape=(2, 8), dtype=torch.bfloat16, page_size=16, **kw):
    return BufferLayout(name=name, layers=layers, row_shape=row_shape, dtype=dtype, pad_tokens=page_size, **kw)


# -- token rows ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("size", [0, 1, 15, 16, 1000, 4096])
@pytest.mark.parametrize("page_size", [1, 16, 64])
def test_token_rows(size, page_size):
    buf = token_buffer(layers=3, row_shape=(2, 8), dtype=torch.bfloat16, page_size=page_size)
    rows = size + page_size
    assert buf.rows(size) == rows
    assert buf.shape(size) == (3, rows, 2, 8)
    assert buf.row_bytes == 2 * 8 * 2
    assert buf.total_bytes(size) == 3 * rows * 2 * 8 * 2
    assert buf.bytes_per_unit == 3 * 2 * 8 * 2


def test_fp32_and_uint8_row_bytes():
    assert token_buffer(row_shape=(4, 128), dtype=torch.float32).row_bytes == 4 * 128 * 4
    assert token_buffer(row_shape=(4, 128), dtype=torch.uint8).row_bytes == 4 * 128


# -- page rows ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("size", [0, 1, 63, 64, 65, 127, 128, 640, 4096, 4097])
def test_page_rows(size):
    # e.g. an indexer buffer: one row per 64-token page (keys + scales), padded like (size + page + 1) // page
    buf = BufferLayout(name="index", layers=5, row_shape=(64 * 132,), dtype=torch.uint8,
                       tokens_per_row=64, pad_tokens=65)
    rows = (size + 65) // 64
    assert buf.rows(size) == rows
    assert buf.shape(size) == (5, rows, 64 * 132)
    assert buf.total_bytes(size) == 5 * rows * 64 * 132
    assert buf.bytes_per_unit == pytest.approx(5 * 64 * 132 / 64)


def test_fractional_bytes_per_unit():
    buf = BufferLayout(name="scale", layers=3, row_shape=(5,), dtype=torch.float32, tokens_per_row=64)
    assert buf.bytes_per_unit == pytest.approx(3 * 5 * 4 / 64)  # 0.9375, not rounded
    layout = PoolLayout(backend="x", buffers=[buf])
    assert layout.bytes_per_token == math.ceil(3 * 5 * 4 / 64) == 1


# -- pools ----------------------------------------------------------------------------------------------------


def mha_like(page_size=16, layers=4, heads=2, head_dim=8, v_head_dim=8, dtype=torch.bfloat16):
    common = dict(layers=layers, dtype=dtype, pad_tokens=page_size)
    return PoolLayout(
        backend="test",
        buffers=(
            BufferLayout(name="k", row_shape=(heads, head_dim), **common),
            BufferLayout(name="v", row_shape=(heads, v_head_dim), **common),
        ),
    )


@pytest.mark.parametrize("size", [0, 16, 1024])
def test_pool_totals(size):
    layout = mha_like(page_size=16, layers=4, heads=2, head_dim=8, v_head_dim=4)
    per_token = 4 * 2 * (8 + 4) * 2  # layers x heads x (k + v dims) x bf16
    assert layout.bytes_per_unit("tokens") == per_token
    assert layout.bytes_per_token == per_token
    assert layout.total_bytes({"tokens": size}) == (size + 16) * per_token
    assert layout.fixed_bytes() == 16 * per_token
    assert layout.fixed_bytes("tokens") == 16 * per_token
    assert layout.groups == ("tokens",)
    assert set(layout.by_name()) == {"k", "v"}


def test_pool_with_several_groups():
    tokens = token_buffer(name="k", layers=2, row_shape=(4,), dtype=torch.float16, page_size=8)
    swa = BufferLayout(name="swa_k", layers=3, row_shape=(4,), dtype=torch.float16, sized_by="swa_tokens",
                       pad_tokens=8)
    state = BufferLayout(name="state", layers=1, row_shape=(10,), dtype=torch.float32, sized_by="requests",
                         pad_tokens=1)
    layout = PoolLayout(backend="hybrid", buffers=[state, swa, tokens])
    assert layout.groups == ("tokens", "swa_tokens", "requests")  # canonical order, not declaration order
    assert layout.group("swa_tokens") == (swa,)
    assert layout.bytes_per_unit("tokens") == 2 * 4 * 2
    assert layout.bytes_per_unit("swa_tokens") == 3 * 4 * 2
    assert layout.bytes_per_unit("requests") == 10 * 4
    sizes = {"tokens": 100, "swa_tokens": 80, "requests": 7}
    expected = 2 * (100 + 8) * 8 + 3 * (80 + 8) * 8 + 1 * (7 + 1) * 40
    assert layout.total_bytes(sizes) == expected
    assert layout.fixed_bytes("swa_tokens") == 3 * 8 * 8
    assert layout.fixed_bytes("requests") == 40
    with pytest.raises(KeyError, match="requests"):
        layout.total_bytes({"tokens": 100, "swa_tokens": 80})


def test_duplicate_buffer_names_rejected():
    with pytest.raises(ValueError, match="'k'"):
        PoolLayout(backend="dup", buffers=(token_buffer(name="k"), token_buffer(name="v"), token_buffer(name="k")))


def test_buffers_are_frozen():
    buf = token_buffer()
    with pytest.raises(AttributeError):
        buf.layers = 7  # type: ignore[misc]


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(row_shape=(2, 0)),
        dict(row_shape=(-1,)),
        dict(layers=-1),
        dict(sized_by="pages"),
        dict(tokens_per_row=0),
        dict(pad_tokens=-1),
        dict(dtype="bfloat16"),
    ],
)
def test_invalid_buffers_rejected(kwargs):
    base = dict(name="k", layers=1, row_shape=(2,), dtype=torch.bfloat16)
    base.update(kwargs)
    with pytest.raises((ValueError, TypeError)):
        BufferLayout(**base)


def test_row_shape_is_normalised_to_int_tuple():
    buf = BufferLayout(name="k", layers=1, row_shape=[2, 3], dtype=torch.float16)
    assert buf.row_shape == (2, 3)
    assert buf.row_bytes == 12


def test_zero_layers_allocate_nothing():
    buf = token_buffer(layers=0)
    assert buf.total_bytes(1000) == 0
    assert buf.bytes_per_unit == 0
